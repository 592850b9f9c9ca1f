"""The ``fairq`` command line.

Exit codes: 0 success, 1 the operation failed (database error, refused install, a
message not found, output that could not be written), 2 usage error, 130 interrupted.
When whatever reads the output goes away (``fairq stats | head -1``), a command that
changes the database exits with its own outcome, since the change was made (a script
that took 1 for "not sent" sent the message again), and one that only reads exits 141,
as a shell reports a command ended by SIGPIPE.

``bench``, ``demo`` and ``report`` are programs of their own (fairq.bench,
fairq.demo, fairq.report): the CLI hands them the rest of the command line.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import io
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, TypeGuard

import psycopg

from fairq import __version__, _arguments, _pools, _sql, _timestamps
from fairq._source import dsn_argument
from fairq.aio import AsyncQueue
from fairq.aio_worker import AsyncWorker
from fairq.codecs import BytesCodec, Codec, JsonCodec, TextCodec
from fairq.doctor import Verdict, diagnose
from fairq.install import InstallError, Scripts, install, upgrade
from fairq.queue import Queue
from fairq.types import (
    MAX_DURATION,
    ChannelStats,
    CreateStatus,
    DeleteStatus,
    QueueStats,
    RetryStatus,
)
from fairq.worker import Worker

__all__ = ["main"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
EXIT_INTERRUPTED = 130  # as a shell reports a command ended by Ctrl-C (128 + SIGINT)
EXIT_PIPE_CLOSED = 141  # as a shell reports a command ended by a closed pipe (128 + SIGPIPE)
DELEGATED = {
    "bench": ("fairq.bench", "measure fairq against plain SQL on this machine"),
    "demo": ("fairq.demo", "watch fairness happen: a 20-second multi-tenant scenario"),
    "report": ("fairq.report", "Spark report of fairq.message_history (needs the spark extra)"),
    "dashboard": ("fairq.dashboard", "a live web view of the queues (needs the dashboard extra)"),
    "metrics": ("fairq.dashboard.exporter", "Prometheus metrics of the queues (dashboard extra)"),
}
CODECS: dict[str, Callable[[], Codec[Any]]] = {
    "bytes": BytesCodec, "text": TextCodec, "json": JsonCodec}
DEFAULT_QUEUE = "default"
# Each handler of a Worker is a thread, and has a connection of the pool: 100000 ended
# in "can't start new thread", and no server takes that many connections.
MAX_CONCURRENCY = 1024


class _Failed(Exception):
    """The command ran but did not achieve what was asked (exit code 1)."""


class _Output:
    """The commands' standard output. An error writing it does not stop a command
    halfway, since what it changes in the database is changed whether or not the report
    of it is read: the first error is kept for main() to report, and, as the Python docs
    advise for a closed pipe, the rest of the output goes to devnull (else flushing it
    at exit fails again, with a traceback)."""

    def __init__(self) -> None:
        self.error: OSError | None = None

    def line(self, text: str = "") -> None:
        try:
            print(text)
        except OSError as exc:
            self._lose(exc)

    def flush(self) -> None:
        try:
            if sys.stdout is not None:  # (None: started with stdout closed)
                sys.stdout.flush()
        except OSError as exc:
            self._lose(exc)

    def _lose(self, exc: OSError) -> None:
        self.error = self.error or exc
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


@contextmanager
def _arguments_checked() -> Iterator[None]:
    """Where the library checks the arguments given to it: its ValueError is a usage
    error. Only here: one raised by anything else (importing a handler's module, a
    worker's run) is not the command line's fault."""
    try:
        yield
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _integer(text: str) -> int:
    """A value of an SQL integer argument (a limit, a priority, a weight)."""
    return _arguments.whole_number(text, _sql.INTEGER)


def _bigint(text: str) -> int:
    """A value of an SQL bigint argument (a message id)."""
    return _arguments.whole_number(text, _sql.BIGINT)


def _count(text: str) -> int:
    """A number of rows to list: none or more."""
    return _arguments.whole_number(text, range(0, _sql.INTEGER.stop))


def _interval_ms(text: str) -> int:
    """A channel's release interval in milliseconds, at most the SQL's longest duration
    (beyond it, building the timedelta ended in an OverflowError traceback)."""
    return _arguments.whole_number(text, range(0, MAX_DURATION // timedelta(milliseconds=1) + 1))


def _concurrency(text: str) -> int:
    """A worker's number of handlers: 1 to :data:`MAX_CONCURRENCY`."""
    return _arguments.whole_number(text, range(1, MAX_CONCURRENCY + 1))


def _attempts(text: str) -> int | None:
    """A worker's max_attempts: a number, or "none" (Worker's max_attempts=None)."""
    return None if text.lower() == "none" else _integer(text)


def _moment(text: str) -> datetime:
    """An ISO 8601 time; without an offset, this machine's local time."""
    # Before Python 3.11, fromisoformat does not read the "Z" of UTC.
    moment = datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith("Z") else text)
    return moment if moment.tzinfo is not None else moment.astimezone()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fairq", description="Fair, multi-tenant, durable message queue in PostgreSQL.",
        # An abbreviation (`fairq --ds URL metrics`) took the delegated command for one
        # of this parser's, which does nothing: every parser here refuses them.
        allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"fairq {__version__}")
    parser.add_argument("--dsn", type=dsn_argument,
                        help="PostgreSQL conninfo or URL (default: $DATABASE_URL)")
    # --dsn is accepted after the subcommand too (`fairq install --dsn URL`); SUPPRESS
    # keeps a subcommand from overwriting the global value when it is not given there.
    dsn_option = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    dsn_option.add_argument("--dsn", type=dsn_argument, default=argparse.SUPPRESS,
                            help=argparse.SUPPRESS)
    queue_option = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    queue_option.add_argument("--queue", default=DEFAULT_QUEUE, type=_arguments.queue_name,
                              help=f"the queue (default: {DEFAULT_QUEUE})")
    until_option = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    until_option.add_argument("--until", type=_moment,
                              help="ISO 8601 time the pause ends, local time without an offset"
                                   " (default: until resumed)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def leaf(group: argparse._SubParsersAction[argparse.ArgumentParser], name: str,
             summary: str, *options: argparse.ArgumentParser) -> argparse.ArgumentParser:
        return group.add_parser(name, parents=[dsn_option, *options], help=summary,
                                allow_abbrev=False)

    scripts_help = "directory holding fairq.control and the scripts (default: bundled)"
    sub = leaf(commands, "install", "install fairq as a plain schema (no extension)")
    sub.add_argument("--scripts", type=Path, help=scripts_help)
    sub = leaf(commands, "upgrade", "upgrade a `fairq install` to the current version")
    sub.add_argument("--scripts", type=Path, help=scripts_help)
    sub.add_argument("--to", dest="target", help="target version (default: current)")

    queue = commands.add_parser("queue", help="pause and resume queues",
                                allow_abbrev=False).add_subparsers(
        dest="action", required=True, metavar="ACTION")
    sub = leaf(queue, "pause", "hand out none of a queue's messages", until_option)
    sub.add_argument("queue")
    sub = leaf(queue, "resume", "end a queue's pause")
    sub.add_argument("queue")
    sub = leaf(queue, "drain", "pause a queue until resumed and wait until nothing is in flight")
    sub.add_argument("queue")
    sub.add_argument("--timeout", type=_arguments.seconds, metavar="SECONDS",
                     help="give up (exit 1) after this long; the queue stays paused"
                          " (default: wait)")

    channel = commands.add_parser("channel", help="channel policies and pauses",
                                  allow_abbrev=False).add_subparsers(
        dest="action", required=True, metavar="ACTION")
    sub = leaf(channel, "set", "set a channel's policy (omitted limits: unlimited)",
               queue_option)
    sub.add_argument("channel")
    sub.add_argument("--max-concurrency", type=_integer)
    sub.add_argument("--release-interval-ms", type=_interval_ms, default=0)
    sub.add_argument("--max-size", type=_integer)
    sub.add_argument("--max-attempts", type=_integer)
    sub.add_argument("--weight", type=_integer, default=1,
                     help="share of turns, 1-1000 (default: 1)")
    sub = leaf(channel, "clear", "forget a channel's policy and pause", queue_option)
    sub.add_argument("channel")
    sub = leaf(channel, "pause", "hand out none of a channel's messages", queue_option,
               until_option)
    sub.add_argument("channel")
    sub = leaf(channel, "resume", "end a channel's pause", queue_option)
    sub.add_argument("channel")
    leaf(channel, "list", "channels and their policies", queue_option)

    sub = leaf(commands, "send", "create a message", queue_option)
    sub.add_argument("channel")
    sub.add_argument("content", help="the content as text; - reads bytes from stdin")
    sub.add_argument("--delay", type=_arguments.seconds, help="seconds until it is due")
    sub.add_argument("--priority", type=_integer, default=0)
    sub.add_argument("--dedup-key")

    sub = leaf(commands, "doctor", "what in this database keeps fairq from running well")
    sub.add_argument("--invariants", action="store_true",
                     help="also run fairq.check() (reads every message; a role needs"
                          " fairq.grant_observer)")
    sub.add_argument("--max-transaction-age", type=_arguments.seconds, default=timedelta(minutes=5),
                     metavar="SECONDS",
                     help="report snapshots held longer than this (default: 300)")

    sub = leaf(commands, "stats", "queues: size, ready, scheduled, in flight, dead, pause")
    sub.add_argument("--queue", type=_arguments.queue_name,
                     help="that queue only, and its channels")

    dead = commands.add_parser("dead", help="dead letters", allow_abbrev=False).add_subparsers(
        dest="action", required=True, metavar="ACTION")
    sub = leaf(dead, "list", "list a queue's dead letters, oldest first", queue_option)
    sub.add_argument("--channel")
    sub.add_argument("--limit", type=_count, default=100)
    sub = leaf(dead, "retry", "put dead letters back on their channels")
    sub.add_argument("ids", type=_bigint, nargs="+", metavar="ID")
    sub = leaf(dead, "delete", "delete dead letters for good")
    sub.add_argument("ids", type=_bigint, nargs="+", metavar="ID")
    sub = leaf(dead, "purge", "delete a queue's dead letters that died before a time",
               queue_option)
    sub.add_argument("--before", type=_moment, required=True,
                     help="ISO 8601 time, local time without an offset")
    sub.add_argument("--all-queues", action="store_true",
                     help="every queue's dead letters (not only --queue's)")

    history = commands.add_parser("history", help="the settled messages' history",
                                  allow_abbrev=False).add_subparsers(
        dest="action", required=True, metavar="ACTION")
    sub = leaf(history, "prune", "delete history settled before a time, of every queue")
    sub.add_argument("--before", type=_moment, required=True,
                     help="ISO 8601 time, local time without an offset")

    sub = leaf(commands, "worker", "run a handler over a queue's messages", queue_option)
    sub.add_argument("handler", metavar="MODULE:FUNCTION",
                     help="a function taking a fairq.Message, or an async one taking a "
                          "fairq.AsyncMessage (run by an AsyncWorker); the module is "
                          "imported from the current directory or PYTHONPATH")
    sub.add_argument("--concurrency", type=_concurrency, default=1,
                     help=f"handlers run at once, 1-{MAX_CONCURRENCY} (default: 1)")
    sub.add_argument("--codec", choices=sorted(CODECS), default="bytes")
    sub.add_argument("--lock", type=_arguments.seconds, default=timedelta(seconds=30),
                     help="seconds a message stays locked between heartbeats' extensions")
    sub.add_argument("--max-attempts", type=_attempts, default=5,
                     help="deliveries before the worker buries a failing message (default"
                          " 5; none: leave it to the channel's max_attempts)")
    sub.add_argument("--grace", type=_arguments.seconds, default=timedelta(seconds=30),
                     help="seconds in-flight handlers get to finish on SIGTERM"
                          " (a second signal ends it at once)")
    sub.add_argument("--poll", type=_arguments.seconds, default=timedelta(seconds=5),
                     help="seconds between polls when no notification arrives")

    for name, (_, summary) in DELEGATED.items():
        commands.add_parser(name, help=summary, allow_abbrev=False)  # dispatched in main()
    return parser


def _format_moment(moment: datetime | None) -> str | None:
    if moment == _timestamps.MAX:
        return "infinity"  # a pause until resumed, as PostgreSQL shows it
    return None if moment is None else moment.isoformat()


def _paused(until: datetime | None) -> str:
    return f"paused until {'resumed' if until is None else until.isoformat()}"


def _print_queues(out: _Output, queues: Sequence[QueueStats]) -> None:
    _print_table(out, ["queue", "channels", "size", "ready", "scheduled", "in_flight", "dead",
                  "paused_until"],
                 [(q.queue, q.channels, q.size, q.ready, q.scheduled, q.in_flight, q.dead,
                   _format_moment(q.paused_until)) for q in queues])


def _limits(max_concurrency: int | None, interval_ms: int | None, max_size: int | None,
            max_attempts: int | None) -> list[str]:
    return [f"{name}={value}" for name, value in (
        ("concurrency", max_concurrency), ("interval_ms", interval_ms or None),
        ("size", max_size), ("attempts", max_attempts)) if value is not None]


def _format_limits(stats: ChannelStats) -> str:
    return " ".join(_limits(stats.max_concurrency,
                            stats.release_interval // timedelta(milliseconds=1),
                            stats.max_size, stats.max_attempts)) or "-"


def _printable(text: str) -> str:
    """``text`` with what a terminal would act on escaped (tenants choose channel names
    and error texts: an escape sequence in one cleared the screen, a newline forged a
    row)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _print_table(out: _Output, header: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    cells = [[str(c) for c in header],
             *[["-" if c is None else _printable(str(c)) for c in r] for r in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    for row in cells:
        padded = (cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        out.line("  ".join(padded).rstrip())


def _is_async(handler: object) -> TypeGuard[Callable[[Any], Awaitable[None]]]:
    """Whether `fairq worker` runs ``handler`` with an AsyncWorker: a coroutine function,
    or an object whose ``__call__`` is one (``inspect.iscoroutinefunction`` is false for
    such an object: a Worker ran it, and every message failed)."""
    return (inspect.iscoroutinefunction(handler)
            or inspect.iscoroutinefunction(inspect.getattr_static(type(handler), "__call__", None)))


def _load_handler(spec: str) -> Callable[[Any], None]:
    module_name, _, function_name = spec.partition(":")
    if not module_name or not function_name:
        raise argparse.ArgumentTypeError(f"expected MODULE:FUNCTION, got {spec!r}")
    # Like `python -m`, let the current directory's modules be found.
    sys.path.insert(0, os.getcwd())
    try:
        handler = getattr(importlib.import_module(module_name), function_name)
    except Exception as exc:  # whatever the module raised as it ran (a SyntaxError too)
        raise argparse.ArgumentTypeError(
            f"cannot load {spec}: {type(exc).__name__}: {exc}") from exc
    if not callable(handler):
        raise argparse.ArgumentTypeError(f"{spec} is not callable")
    return handler  # type: ignore[no-any-return]


def _read_stdin() -> bytes:
    if sys.stdin is None:  # started with stdin closed (`<&-`): an AttributeError ended it
        raise argparse.ArgumentTypeError("content -: there is no standard input to read")
    return sys.stdin.buffer.read()


def _changes(args: argparse.Namespace) -> bool:
    """Whether the command changes the database (rather than only showing it)."""
    return not (args.command in ("stats", "doctor") or getattr(args, "action", None) == "list")


#: How often `queue drain` counts what is still in flight, at the most often.
DRAIN_POLL = timedelta(milliseconds=500)
#: The count reads every message of the database (the `fairq.queues` view: 0.3 s at
#: 10^6 messages), so the drain waits this many times as long as its last count took
#: before the next: counting every 0.5 s took over half a core.
DRAIN_WAIT_PER_COUNT = 4


def _drain(queue: Queue[Any], timeout: timedelta | None, out: _Output) -> None:
    """Pauses the queue until resumed, then waits until none of its messages is in
    flight: the handlers running finish (or their locks expire and a worker's next
    dequeue recovers them), and no worker is handed another. A lock counts until it is
    settled or recovered, so a crashed worker's lock holds the drain up to its expiry."""
    queue.pause()
    out.line(f"queue {queue.name}: paused until resumed")
    limit_s = None if timeout is None else timeout.total_seconds()
    started = time.monotonic()
    shown = None
    while True:
        counted_at = time.monotonic()
        in_flight = queue.stats().in_flight
        count_s = time.monotonic() - counted_at
        if in_flight == 0:
            break
        if in_flight != shown:
            out.line(f"queue {queue.name}: {in_flight} in flight")
            out.flush()  # progress, for whoever watches a pipe
            shown = in_flight
        left_s = None if limit_s is None else limit_s - (time.monotonic() - started)
        if left_s is not None and left_s <= 0:
            raise _Failed(f"{in_flight} still in flight after {limit_s:g} s"
                          f" (queue {queue.name} stays paused; `fairq queue resume"
                          f" {queue.name}` ends the pause)")
        poll_s = max(DRAIN_POLL.total_seconds(), DRAIN_WAIT_PER_COUNT * count_s)
        time.sleep(poll_s if left_s is None else min(poll_s, left_s))
    out.line(f"queue {queue.name}: drained, nothing in flight (paused until resumed;"
             f" `fairq queue resume {queue.name}` ends the pause)")


def _run(args: argparse.Namespace, out: _Output) -> None:
    if args.command in DELEGATED:
        # main() hands them their command line; this one got here through options
        # before its name that main() does not hand on (`fairq --dsn A --dsn B metrics`).
        raise argparse.ArgumentTypeError(
            f"give {args.command}'s options after its name: fairq {args.command} --dsn ...")

    if args.command in ("install", "upgrade"):
        scripts = Scripts(args.scripts) if args.scripts else None
        with psycopg.connect(args.dsn) as conn:
            if args.command == "install":
                out.line(f"fairq {install(conn, scripts)} installed in schema fairq")
            else:
                applied = upgrade(conn, scripts, args.target)
                out.line("\n".join(f"applied {p.name}" for p in applied) or "already up to date")
        return

    if args.command == "worker":
        handler = _load_handler(args.handler)
        codec = CODECS[args.codec]()
        logging.basicConfig(level=logging.INFO,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        # Every handler, the dequeue loop and the heartbeats may hold a connection.
        pool_size = args.concurrency + 2
        options: dict[str, Any] = {"concurrency": args.concurrency, "lock": args.lock,
                                   "max_attempts": args.max_attempts,
                                   "grace_period": args.grace, "poll_interval": args.poll}
        if _is_async(handler):
            async def work() -> None:
                async with AsyncQueue(args.dsn, name=args.queue, codec=codec,
                                      pool_size=pool_size) as aqueue:
                    with _arguments_checked():
                        aworker = AsyncWorker(aqueue, handler, **options)
                    await aworker.run()
            asyncio.run(work())
            return
        with Queue(args.dsn, name=args.queue, codec=codec, pool_size=pool_size) as wqueue:
            with _arguments_checked():
                worker = Worker(wqueue, handler, **options)
            worker.run()
        return

    # One-shot commands: one connection, so that an unreachable database fails at once.
    # Their ValueErrors are the calls refusing an argument, before any SQL (their output
    # raises none: main() has it escape what its encoding cannot show).
    with psycopg.connect(args.dsn, autocommit=True) as conn, _arguments_checked():
        conn.execute(_pools.SESSION_SETUP)  # as a queue's own pool: fairq needs it
        # `stats` without --queue, `dead retry`/`delete` (by id) and `history` concern no
        # one queue.
        name = getattr(args, "queue", None)
        queue = Queue(conn, name=DEFAULT_QUEUE if name is None else name)
        if args.command == "queue" and args.action == "pause":
            queue.pause(args.until)
            out.line(f"queue {queue.name}: {_paused(args.until)}")
        elif args.command == "queue" and args.action == "drain":
            _drain(queue, args.timeout, out)
        elif args.command == "queue":
            out.line(f"queue {queue.name}: " + ("resumed" if queue.resume() else "was not paused"))
        elif args.command == "channel" and args.action == "set":
            queue.channel_set(args.channel, max_concurrency=args.max_concurrency,
                              release_interval=timedelta(milliseconds=args.release_interval_ms),
                              max_size=args.max_size, max_attempts=args.max_attempts,
                              weight=args.weight)
            # channel_set replaces the whole policy: say what is in force now, so that
            # `--weight 3` alone visibly drops a cap the channel had.
            limits = _limits(args.max_concurrency, args.release_interval_ms, args.max_size,
                             args.max_attempts)
            out.line(f"channel {args.channel}: policy set: weight={args.weight}"
                     + (" " + " ".join(limits) if limits else ", no limits")
                     + " (any limit not given is removed)")
        elif args.command == "channel" and args.action == "clear":
            had = queue.channel_clear(args.channel)
            out.line(f"channel {args.channel}: " + ("policy cleared" if had else "had no policy"))
        elif args.command == "channel" and args.action == "pause":
            queue.channel_pause(args.channel, args.until)
            out.line(f"channel {args.channel}: {_paused(args.until)}")
        elif args.command == "channel" and args.action == "resume":
            resumed = queue.channel_resume(args.channel)
            out.line(f"channel {args.channel}: " + ("resumed" if resumed else "was not paused"))
        elif args.command == "channel":
            _print_table(out, ["channel", "weight", "limits", "paused_until"],
                         [(s.channel, s.weight, _format_limits(s), _format_moment(s.paused_until))
                          for s in queue.channels()])
        elif args.command == "send":
            # As given: os.fsencode gives back the bytes of an argument that is not UTF-8
            # (encode() refused it).
            content = _read_stdin() if args.content == "-" else os.fsencode(args.content)
            result = queue.send(args.channel, content, delay=args.delay, priority=args.priority,
                                dedup_key=args.dedup_key)
            out.line(f"{result.status.value} {result.id if result.id is not None else '-'}")
            if result.status is CreateStatus.DROPPED:
                raise _Failed(f"channel {args.channel} is full (max_size): nothing was stored")
        elif args.command == "doctor":
            findings = diagnose(conn, invariants=args.invariants,
                                max_transaction_age=args.max_transaction_age)
            _print_table(out, ["check", "verdict", "detail"],
                         [(f.check, f.verdict.value, f.detail) for f in findings])
            problems = sum(f.verdict is Verdict.PROBLEM for f in findings)
            if problems:
                raise _Failed(f"{problems} problem{'s' if problems > 1 else ''} found")
        elif args.command == "stats" and args.queue is None:
            _print_queues(out, queue.queues())
        elif args.command == "stats":
            _print_queues(out, [queue.stats()])
            out.line()
            _print_table(
                out, ["channel", "size", "ready", "scheduled", "in_flight", "weight", "limits",
                 "paused_until", "next_turn"],
                [(s.channel, s.size, s.ready, s.scheduled, s.in_flight, s.weight,
                  _format_limits(s), _format_moment(s.paused_until),
                  _format_moment(s.next_dequeue_at)) for s in queue.channels()])
        elif args.command == "dead" and args.action == "list":
            _print_table(out, ["id", "channel", "attempts", "died_at", "error"],
                         [(d.id, d.channel, d.num_attempts, d.died_at.isoformat(), d.error)
                          for d in queue.dead_letters(args.channel, limit=args.limit)])
        elif args.command == "dead" and args.action == "purge":
            purged = queue.dead_letter_purge(args.before, all_queues=args.all_queues)
            scope = "every queue" if args.all_queues else f"queue {queue.name}"
            out.line(f"{scope}: {purged} dead letter{'' if purged == 1 else 's'} purged")
        elif args.command == "dead":
            # Each id in its own transaction: one unknown id keeps none of the others
            # from being handled, and is reported at the end.
            missing = []
            for message_id in args.ids:
                status: RetryStatus | DeleteStatus
                if args.action == "retry":
                    status = queue.dead_letter_retry(message_id)
                    handled = status is RetryStatus.REQUEUED
                else:
                    status = queue.dead_letter_delete(message_id)
                    handled = status is DeleteStatus.DELETED
                out.line(f"{message_id} {status.value}")
                if not handled:
                    missing.append(message_id)
            if missing:
                raise _Failed(f"no dead letter with id {', '.join(map(str, missing))}")
        elif args.command == "history":
            pruned = queue.history_prune(args.before)
            out.line(f"{pruned} history row{'' if pruned == 1 else 's'} pruned")


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    # `fairq --dsn URL bench ...` hands the --dsn given before the command on too.
    forwarded = (arguments[:2] if arguments[:1] == ["--dsn"]
                 else arguments[:1] if arguments[:1] and arguments[0].startswith("--dsn=")
                 else [])
    rest = arguments[len(forwarded):]
    if rest and rest[0] in DELEGATED:
        program = importlib.import_module(DELEGATED[rest[0]][0])
        return int(program.main([*forwarded, *rest[1:]]))
    parser = _parser()
    args = parser.parse_args(arguments)
    args.dsn = _arguments.dsn_or_environment(parser, args.dsn)
    if not args.dsn:
        parser.error("no database: pass --dsn or set DATABASE_URL")
    if isinstance(sys.stdout, io.TextIOWrapper):
        # Tenants choose channel names: one this terminal's encoding cannot show is
        # shown escaped (a UnicodeEncodeError ended the command).
        sys.stdout.reconfigure(errors="backslashreplace")
    out = _Output()
    try:
        _run(args, out)
        outcome = EXIT_OK
    except argparse.ArgumentTypeError as exc:  # arguments the calls refused
        parser.error(str(exc))
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except (psycopg.Error, InstallError, _Failed) as exc:
        print(f"fairq {args.command}: {exc}", file=sys.stderr)
        outcome = EXIT_FAILED
    out.flush()
    if isinstance(out.error, BrokenPipeError):
        return outcome if _changes(args) else EXIT_PIPE_CLOSED
    if out.error is not None:
        print(f"fairq {args.command}: cannot write the output: {out.error.strerror}",
              file=sys.stderr)
        return EXIT_FAILED
    return outcome
