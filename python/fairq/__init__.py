"""fairq: a fair, multi-tenant, durable message queue inside PostgreSQL."""

from fairq.aio import AsyncQueue
from fairq.aio_worker import AsyncWorker
from fairq.codecs import BytesCodec, Codec, JsonCodec, TextCodec
from fairq.queue import Queue
from fairq.types import (
    AsyncMessage,
    CancelStatus,
    ChannelStats,
    CreateResult,
    CreateStatus,
    DeadLetter,
    DeleteStatus,
    HistoryOutcome,
    HistoryRecord,
    Message,
    NewMessage,
    QueueStats,
    ReceivedMessage,
    RetryStatus,
    SettleResult,
    SettleStatus,
)
from fairq.worker import Backoff, Worker

__version__ = "0.7.40"

__all__ = [
    "AsyncMessage",
    "AsyncQueue",
    "AsyncWorker",
    "Backoff",
    "BytesCodec",
    "CancelStatus",
    "ChannelStats",
    "Codec",
    "CreateResult",
    "CreateStatus",
    "DeadLetter",
    "DeleteStatus",
    "HistoryOutcome",
    "HistoryRecord",
    "JsonCodec",
    "Message",
    "NewMessage",
    "Queue",
    "QueueStats",
    "ReceivedMessage",
    "RetryStatus",
    "SettleResult",
    "SettleStatus",
    "TextCodec",
    "Worker",
    "__version__",
]
