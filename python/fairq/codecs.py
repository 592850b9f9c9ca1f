"""Content codecs: how a message's ``bytea`` content becomes a Python value and back.

The queue stores bytes; a codec decides what users put in and get out. A queue uses
one codec for everything it sends and receives, so producers and workers of the same
channels must agree on it.
"""

from __future__ import annotations

import json
from typing import Any, Protocol, TypeVar

__all__ = ["BytesCodec", "Codec", "JsonCodec", "TextCodec"]

T = TypeVar("T")


class Codec(Protocol[T]):
    """Turns content values into the bytes stored in ``fairq.message.content``."""

    def encode(self, value: T, /) -> bytes: ...

    def decode(self, data: bytes, /) -> T: ...


class BytesCodec:
    """Content as raw bytes (the default): what the SQL stores, unchanged."""

    def encode(self, value: bytes, /) -> bytes:
        # Only bytes-like values: bytes(5) is five zero bytes, and bytes([104, 105]) "hi".
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise TypeError(f"content must be bytes, bytearray or memoryview, not"
                            f" {type(value).__name__} (pass a codec= to send other values)")
        return bytes(value)

    def decode(self, data: bytes, /) -> bytes:
        return bytes(data)


class TextCodec:
    """Content as text, UTF-8 by default."""

    def __init__(self, encoding: str = "utf-8") -> None:
        # Looked up now (LookupError: unknown, or not a text encoding such as base64):
        # otherwise a misspelt one failed at the first message, and a worker given it
        # failed every message it took.
        "".encode(encoding)
        b"".decode(encoding)
        self.encoding = encoding

    def encode(self, value: str, /) -> bytes:
        return value.encode(self.encoding)

    def decode(self, data: bytes, /) -> str:
        return bytes(data).decode(self.encoding)


class JsonCodec:
    """Content as JSON documents (UTF-8, compact separators to keep rows small).

    Only standard JSON goes out: NaN and the infinities raise ValueError, since
    Python's ``NaN``/``Infinity`` are read by no other parser (PostgreSQL's ``::jsonb``
    refused every row of a query over such content). Decoding stays Python's, which
    reads them.
    """

    def encode(self, value: Any, /) -> bytes:
        try:
            text = json.dumps(value, separators=(",", ":"), ensure_ascii=False,
                              allow_nan=False)
        except ValueError as exc:  # (json's own message does not say which rule)
            raise ValueError(f"content is not JSON: {exc} (NaN and infinities have no"
                             " JSON form)") from None
        # (A str holding a lone surrogate raises UnicodeEncodeError, a ValueError, here:
        # escaped as "\ud800" it would be JSON that PostgreSQL's jsonb refuses.)
        return text.encode()

    def decode(self, data: bytes, /) -> Any:
        return json.loads(bytes(data))
