"""What producers and consumers run in a throughput run: pgbench scripts for the
plain-SQL floor, the seed FIFO queue and fairq, one message per call or batched, and
how they spread messages over channels (uniform or Zipf)."""

from __future__ import annotations

import random

from fairq.bench.database import LOCK_MS, PAYLOAD_SQL, SCHEMA
from fairq.bench.sizes import Sizes

__all__ = ["channel_number", "consumer_script", "producer_script"]


def producer_script(kind: str, sizes: Sizes, batched: bool) -> str:
    """One producer call, made only while the backlog gate is open (see ``throughput``)."""
    return (f"SELECT open::int AS open FROM {SCHEMA}.gate \\gset\n"
            "\\if :open\n" + _produce(kind, sizes, batched) + IDLE)


def _produce(kind: str, sizes: Sizes, batched: bool) -> str:
    n = sizes.batch
    if kind == "floor":
        if batched:
            return (f"INSERT INTO {SCHEMA}.floor (channel, content)"
                    f" SELECT {_channel_sql(sizes)}, {PAYLOAD_SQL}"
                    f" FROM generate_series(1, {n});\n")
        return (_channel_set(sizes) +
                f"INSERT INTO {SCHEMA}.floor (channel, content) VALUES (:ch, {PAYLOAD_SQL});\n")
    if kind == "fifo":
        return f"SELECT {SCHEMA}.message_create({PAYLOAD_SQL});\n"
    if batched:
        return ("SELECT count(*) FROM fairq.message_create_batch("
                f"ARRAY(SELECT 'bench-' || {_channel_sql(sizes)}"
                f" FROM generate_series(1, {n})),"
                f" array_fill({PAYLOAD_SQL}, ARRAY[{n}]));\n")
    return (_channel_set(sizes) +
            f"SELECT 1 FROM fairq.message_create('bench-' || :ch::text, {PAYLOAD_SQL});\n")


# The "zipf" spread: channel = floor((c + 1) ** u) for u uniform in [0, 1), so channel
# k of 1..c gets ln((k + 1) / k) / ln(c + 1) of the messages, about 1 / (k ln c): Zipf
# with exponent 1. A few channels are heavy, half the messages go to the first
# sqrt(c) channels, and the rest is a long tail. The same formula in pgbench (one
# message per call) and in SQL (batches), and for floor and fairq alike.

def _channel_set(sizes: Sizes) -> str:
    """pgbench: ``:ch``, the channel (1..channels) of a one-message call."""
    c = sizes.channels
    if sizes.channel_spread == "zipf":
        return f"\\set ch int(pow({c + 1}, random(0, 999999) / 1000000.0))\n"
    return f"\\set ch random(1, {c})\n"


def _channel_sql(sizes: Sizes) -> str:
    """SQL: the channel (1..channels) of one message of a batch."""
    c = sizes.channels
    if sizes.channel_spread == "zipf":
        return f"floor(power({c + 1}, random()))::int"
    # (floor, not a cast: a cast rounds, and channels 1 and c got half the others' share.)
    return f"(1 + floor(random() * {c})::int)"


def channel_number(sizes: Sizes, rng: random.Random) -> int:
    """Python: a channel (1..channels) drawn as the producers of ``sizes`` draw it."""
    if sizes.channel_spread == "zipf":
        return min(sizes.channels, int((sizes.channels + 1) ** rng.random()))
    return rng.randint(1, sizes.channels)


IDLE = "\\else\n\\sleep 1 ms\n\\endif\n"


def consumer_script(kind: str, sizes: Sizes, batched: bool) -> str:
    n = sizes.batch
    if kind == "floor":
        claim = (f"UPDATE {SCHEMA}.floor SET status = 1, attempts = attempts + 1,"
                 f" locked_until = now() + interval '{LOCK_MS} ms'")
        if batched:
            return (f"WITH c AS ({claim} WHERE id IN (SELECT id FROM {SCHEMA}.floor"
                    f" WHERE status = 0 ORDER BY id LIMIT {n} FOR UPDATE SKIP LOCKED)"
                    " RETURNING id) SELECT coalesce(array_agg(id), '{}') AS ids,"
                    " count(*) AS n FROM c \\gset\n"
                    "\\if :n > 0\n"
                    f"DELETE FROM {SCHEMA}.floor WHERE id = ANY (:ids::bigint[]);\n" + IDLE)
        return (f"WITH c AS ({claim} WHERE id = (SELECT id FROM {SCHEMA}.floor"
                " WHERE status = 0 ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED)"
                " RETURNING id) SELECT coalesce(max(id), 0) AS mid FROM c \\gset\n"
                "\\if :mid > 0\n"
                f"DELETE FROM {SCHEMA}.floor WHERE id = :mid;\n" + IDLE)
    if kind == "fifo":
        return (f"SELECT ({SCHEMA}.message_dequeue() IS NOT NULL)::int AS got \\gset\n"
                "\\if :got = 0\n\\sleep 1 ms\n\\endif\n")
    if batched:
        return ("SELECT coalesce(array_agg(id), '{}') AS ids,"
                " coalesce(array_agg(num_attempts), '{}') AS atts, count(*) AS n"
                f" FROM fairq.message_dequeue({LOCK_MS}, {n}) \\gset\n"
                "\\if :n > 0\n"
                "SELECT count(*) FROM fairq.message_complete_batch(:ids::bigint[],"
                " :atts::bigint[]);\n" + IDLE)
    return ("SELECT coalesce(max(id), 0) AS mid, coalesce(max(num_attempts), 0) AS att"
            f" FROM fairq.message_dequeue({LOCK_MS}, 1) \\gset\n"
            "\\if :mid > 0\n"
            "SELECT fairq.message_complete(:mid, :att);\n" + IDLE)
