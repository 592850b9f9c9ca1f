"""Model-based property test: the extension against the reference model (tests/model.py).

A hypothesis state machine applies the same random operations - create,
create_batch, dequeue of n, complete, complete_batch, defer (with and without state
and a future time), heartbeat, fail, cancel, channel_set (with weights),
channel_clear, channel_pause/resume, queue_pause/resume, dead_letter_retry, delete
and purge, and clock steps, over two queues - to the real extension and to the
model, and after every step compares:

* every result (ids, channels, delivery order, statuses, num_attempts, recovered
  flags, contents, states, priorities, dequeue times);
* the whole observable state (messages, channels and their counters, due times,
  turns, pauses, weights and passes, each queue's round-robin order, channel_size
  rows, dead letters, history rows, queue pauses);
* that fairq.check() reports nothing;
* SPEC §2 rules 2-5 directly on the database's answers (concurrency cap, rate limit,
  no early delivery, never above max_attempts), independently of the model.

The clock: each example pins the queue's clock to V0 + v units + the real time
elapsed since the example started (see model.py); every schedule, lock, interval and
clock step is a whole number of units (an hour), so real drift never decides an
outcome.

Profiles: by default 50 examples of up to 30 steps (<= 1,500 steps); with --slow 300
examples of up to 60 steps. One database for the whole test, reset per example.

That an ordinary role cannot bend the clock is proven in
tests/test_sql_privileges.py::test_only_the_owner_can_move_the_clock (a role granted
producer, worker and/or observer gets 42501 on clock_travel and on every write to
fairq.clock_offset), so it is not repeated here.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    multiple,
    rule,
    run_state_machine_as_test,
)

from model import FOREVER, UNIT_MS, V0, Model, T, at, coarse_db

CHANNELS = st.sampled_from(["a", "b", "c"])
QUEUES = st.sampled_from(["default", "default", "default", "q2"])
WEIGHTS = st.sampled_from([1, 1, 2, 3])
PAUSES = st.sampled_from([None, 1, 2])  # until now + units, None: until resumed
PRIORITIES = st.integers(-1, 2)
DELAYS = st.sampled_from([None, None, -1, 0, 1, 2])  # dequeue_at = now + delay units
DEDUP_KEYS = st.sampled_from([None, None, None, "k1", "k2"])
FENCE = st.sampled_from([0, 0, 0, 1, -1])  # num_attempts offset: nonzero gives 'stale'
OPTIONAL_LIMIT = st.sampled_from([None, None, 1, 2, 3])

RESET = """
TRUNCATE fairq.message, fairq.channel, fairq.channel_size, fairq.channel_size_change, fairq.channel_wake,
         fairq.dead_letter, fairq.message_history, fairq.queue;
SELECT setval('fairq.message_id_seq', 1, false), setval('fairq.channel_id_seq', 1, false),
       setval('fairq.turn_seq', 1, false), setval('fairq.queue_id_seq', 1, false);
SELECT fairq.clock_travel(0);
-- The model keeps idle channels: so must the database (no collection in a test).
SET fairq.idle_channel_ttl = '1000 years';
"""

DB_SNAPSHOT = {
    "messages": "SELECT m.id, q.name, c.name, m.status::text, m.priority, m.num_attempts,"
                " m.recovered, m.state, m.dedup_key, m.dequeue_at, m.locked_until,"
                " m.attempts_at_retry FROM fairq.message m"
                " LEFT JOIN fairq.channel c ON c.id = m.channel_id"
                " LEFT JOIN fairq.queue q ON q.id = m.queue_id",
    "channels": "SELECT q.name, c.name, has_policy, max_concurrency, release_interval_ms, max_size,"
                " max_attempts, weight, in_flight, last_release_at, due_at,"
                " CASE c.turn_at WHEN '-infinity' THEN 'rotation' WHEN 'infinity' THEN 'never' END,"
                " CASE WHEN isfinite(c.turn_at) THEN c.turn_at END,"
                " CASE WHEN c.paused_until = 'infinity' THEN 'never' END,"
                " CASE WHEN isfinite(c.paused_until) THEN c.paused_until END"
                " FROM fairq.channel c JOIN fairq.queue q ON q.id = c.queue_id",
    "passes": "SELECT q.name, c.name, c.turn_pass - min(c.turn_pass) OVER (PARTITION BY q.name),"
              " c.turn_given_at"
              " FROM fairq.channel c JOIN fairq.queue q ON q.id = c.queue_id"
              " WHERE c.turn_at = '-infinity'",
    # Channels that keep their place outside the rotation (turns.sql), with their pass
    # as an offset from the rotation's front (none when the rotation is empty).
    "kept": "SELECT q.name, c.name, c.turn_pass - (SELECT min(r.turn_pass) FROM fairq.channel r"
            " WHERE r.queue_id = c.queue_id AND r.turn_at = '-infinity')"
            " FROM fairq.channel c JOIN fairq.queue q ON q.id = c.queue_id"
            " WHERE c.turn_pass IS NOT NULL AND c.turn_at IS DISTINCT FROM '-infinity'",
    "turn_order": "SELECT q.name, c.name FROM fairq.channel c JOIN fairq.queue q ON q.id = c.queue_id"
                  " WHERE turn_at IS NOT NULL ORDER BY q.name, turn_at, turn_pass, turn_seq",
    # (A bounded channel's count: its row plus the changes no producer has folded yet.)
    "sizes": "SELECT q.name, c.name, s.size + coalesce((SELECT sum(x.delta) FROM fairq.channel_size_change x"
             " WHERE x.channel_id = s.channel_id), 0) FROM fairq.channel_size s"
             " LEFT JOIN fairq.channel c ON c.id = s.channel_id"
             " LEFT JOIN fairq.queue q ON q.id = c.queue_id",
    "dead": "SELECT id, queue, channel, num_attempts, state, error FROM fairq.dead_letter",
    "history": "SELECT id, queue, channel, outcome, num_attempts FROM fairq.message_history",
    "queues": "SELECT name, CASE WHEN paused_until = 'infinity' THEN 'never' END,"
              " CASE WHEN isfinite(paused_until) THEN paused_until END"
              " FROM fairq.queue",
}
TIMESTAMP_COLUMNS = {"messages": (9, 10), "channels": (9, 10, 12, 14), "passes": (3,),
                     "queues": (2,)}


def db_snapshot(conn: psycopg.Connection[Any]) -> dict[str, Any]:
    """The state as the next dequeue sees it: the wakes producers queued are applied
    (fairq.fold_wakes, in a transaction rolled back), as the model applies them at
    once."""
    snap: dict[str, Any] = {}
    with conn.transaction(force_rollback=True):
        conn.execute("SELECT fairq.fold_wakes(ARRAY(SELECT channel_id FROM fairq.channel_wake))")
        tables = {key: [list(r) for r in conn.execute(sql).fetchall()]
                  for key, sql in DB_SNAPSHOT.items()}
    for key, rows in tables.items():
        for r in rows:
            for i in TIMESTAMP_COLUMNS.get(key, ()):
                r[i] = coarse_db(r[i])
            r[:] = [bytes(x) if isinstance(x, memoryview) else x for x in r]
        if key == "turn_order":
            snap[key] = [tuple(r) for r in rows]
        else:
            snap[key] = sorted(tuple(r) for r in rows)
    return snap


def differences(expected: dict[str, Any], actual: dict[str, Any]) -> str:
    lines = []
    for key in expected:
        if expected[key] != actual[key]:
            lines.append(f"  {key}:\n    model: {expected[key]}\n    db:    {actual[key]}")
    return "\n".join(lines)


class QueueMachine(RuleBasedStateMachine):
    conn: psycopg.Connection[Any]  # set by the test function

    deliveries = Bundle("deliveries")  # (id, num_attempts) as handed out
    ids = Bundle("ids")  # every message id a create returned

    def __init__(self) -> None:
        super().__init__()
        conn = self.conn
        conn.execute(RESET)
        # Clock = V0 + elapsed real time + v units; ceil keeps elapsed >= 0.
        row = conn.execute("SELECT ceil(extract(epoch FROM (%s::timestamptz - clock_timestamp()))"
                           " * 1000)::bigint", (V0,)).fetchone()
        assert row is not None
        self.shift0: int = row[0]
        self.v = 0
        self.calls = 0
        self.model = Model()
        self.serial = 0
        self.last_release: dict[tuple[str, str], T] = {}
        self.log: list[str] = []
        self.travel()

    # -- plumbing ------------------------------------------------------------------------

    def travel(self) -> None:
        self.conn.execute("SELECT fairq.clock_travel(%s)", (self.shift0 + self.v * UNIT_MS,))

    def now(self) -> T:
        """The pair of the next call's clock reading (see model.py)."""
        self.calls += 1
        return (self.v, self.calls)

    def content(self) -> bytes:
        self.serial += 1
        return f"m{self.serial}".encode()

    def sql(self, query: str, *args: Any) -> list[tuple[Any, ...]]:
        rows = self.conn.execute(query, args).fetchall()
        return [tuple(bytes(x) if isinstance(x, memoryview) else x for x in r) for r in rows]

    def agree(self, what: str, candidates: list[tuple[Any, Model]], actual: Any) -> None:
        """Keeps the model outcome that matches the database's result and state."""
        self.log.append(what)
        matching = [(r, m) for r, m in candidates if r == actual]
        assert matching, (f"{what}: the database answered\n    {actual}\nthe model expected"
                          f" {' or '.join(str(r) for r, _ in candidates)}")
        snap = db_snapshot(self.conn)
        for _, model in matching:
            if model.snapshot() == snap:
                self.model = model
                break
        else:
            raise AssertionError(f"{what}: state differs from the model's\n"
                                 + differences(matching[0][1].snapshot(), snap))
        problems = self.conn.execute("SELECT channel, problem FROM fairq.check()").fetchall()
        assert problems == [], f"{what}: fairq.check() reports {problems}"

    def agree1(self, what: str, model: Model, expected: Any, actual: Any) -> None:
        self.agree(what, [(expected, model)], actual)

    # -- producers -----------------------------------------------------------------------

    @rule(target=ids, channel=CHANNELS, priority=PRIORITIES, delay=DELAYS, dedup=DEDUP_KEYS,
          queue=QUEUES)
    def create(self, channel: str, priority: int, delay: int | None, dedup: str | None,
               queue: str) -> Any:
        content = self.content()
        due = None if delay is None else (self.v + delay, 0)
        now = self.now()
        m = self.model
        expected = [(i, s) for _, i, s in m.create_batch([(channel, content, due, priority, dedup)],
                                                         now, queue)]
        actual = self.sql("SELECT id, status FROM fairq.message_create(%s, %s, %s, %s, %s, %s)",
                          channel, content, None if due is None else at(due[0]), priority, dedup,
                          queue)
        self.agree1(f"create({channel!r}, p={priority}, delay={delay}, dedup={dedup},"
                    f" queue={queue!r})", m, expected, actual)
        return multiple(*(i for i, _ in actual if i is not None))

    @rule(target=ids, items=st.lists(st.tuples(CHANNELS, PRIORITIES, DELAYS, DEDUP_KEYS),
                                     min_size=1, max_size=4), queue=QUEUES)
    def create_batch(self, items: list[tuple[str, int, int | None, str | None]],
                     queue: str) -> Any:
        rows: list[tuple[str, bytes, T | None, int | None, str | None]] = [
            (ch, self.content(), None if d is None else (self.v + d, 0), p, k)
                for ch, p, d, k in items]
        now = self.now()
        m = self.model
        expected = m.create_batch(rows, now, queue)
        actual = self.sql(
            "SELECT ord, id, status FROM fairq.message_create_batch(%s, %s, %s::timestamptz[],"
            " %s::int[], %s::text[], %s)",
            [r[0] for r in rows], [r[1] for r in rows],
            [None if r[2] is None else at(r[2][0]) for r in rows],
            [r[3] for r in rows], [r[4] for r in rows], queue)
        self.agree1(f"create_batch({items}, queue={queue!r})", m, expected, actual)
        return multiple(*(i for _, i, _ in actual if i is not None))

    @rule(mid=ids)
    def cancel(self, mid: int) -> None:
        now = self.now()
        m = self.model
        expected = m.cancel(mid, now)
        actual = self.sql("SELECT fairq.message_cancel(%s)", mid)[0][0]
        self.agree1(f"cancel({mid})", m, expected, actual)

    # -- workers -------------------------------------------------------------------------

    @rule(target=deliveries, lock=st.integers(1, 3), n=st.integers(1, 3), queue=QUEUES)
    def dequeue(self, lock: int, n: int, queue: str) -> Any:
        now = self.now()
        before = self.model
        candidates = before.dequeue(lock, n, now, queue)
        rows = self.sql("SELECT id, channel, content, state, num_attempts, priority, dequeue_at,"
                        " recovered FROM fairq.message_dequeue(%s, %s, %s)", lock * UNIT_MS, n, queue)
        actual = [(*r[:6], coarse_db(r[6]), r[7]) for r in rows]

        # SPEC §2 rules 2-5, on the database's answers alone.
        locked = dict(self.sql("SELECT c.name, count(*) FROM fairq.message m"
                               " JOIN fairq.channel c ON c.id = m.channel_id"
                               " JOIN fairq.queue q ON q.id = c.queue_id"
                               " WHERE m.status = 'locked' AND q.name = %s GROUP BY c.name", queue))
        # max_attempts counts the deliveries since the last dead-letter retry.
        retried = dict(self.sql("SELECT id, attempts_at_retry FROM fairq.message"
                                " WHERE id = ANY (%s)", [r[0] for r in actual]))
        for (mid, channel, _, _, attempts, _, due, _) in actual:
            policy = before.by_name(channel, queue)
            assert policy is not None, f"delivery from unknown channel {channel}"
            assert due is not None and due[0] <= self.v, f"{channel}: delivered before dequeue_at"
            since_retry = attempts - retried[mid]
            assert policy.max_attempts is None or since_retry <= policy.max_attempts, \
                f"{channel}: delivered {since_retry} times since its last retry > {policy.max_attempts}"
            assert policy.max_concurrency is None or locked[channel] <= policy.max_concurrency, \
                f"{channel}: {locked[channel]} in flight > max_concurrency {policy.max_concurrency}"
            last = self.last_release.get((queue, channel))
            if last is not None and policy.release_interval:
                assert (last[0] + policy.release_interval, last[1]) <= now, (
                    f"{channel}: released at unit {now[0]}, {policy.release_interval} units of"
                    f" release interval after the release at unit {last[0]} have not passed")
            self.last_release[(queue, channel)] = now
            assert policy.paused_until is None or policy.paused_until <= now, \
                f"{channel}: delivered while paused until {policy.paused_until}"

        self.agree(f"dequeue(lock={lock}, n={n}, queue={queue!r})", candidates, actual)
        return multiple(*((r[0], r[4]) for r in actual))

    @rule(d=deliveries, fence=FENCE)
    def complete(self, d: tuple[int, int], fence: int) -> None:
        now = self.now()
        m = self.model
        expected = m.complete_batch([(d[0], d[1] + fence)], now)[0][1]
        actual = self.sql("SELECT fairq.message_complete(%s, %s)", d[0], d[1] + fence)[0][0]
        self.agree1(f"complete({d[0]}, {d[1] + fence})", m, expected, actual)

    @rule(ds=st.lists(st.tuples(deliveries, FENCE), min_size=1, max_size=4))
    def complete_batch(self, ds: list[tuple[tuple[int, int], int]]) -> None:
        pairs = [(d[0], d[1] + f) for d, f in ds]
        now = self.now()
        candidates = self.model.complete_batch_outcomes(pairs, now)
        actual = self.sql("SELECT id, status FROM fairq.message_complete_batch(%s::bigint[],"
                          " %s::bigint[])", [p[0] for p in pairs], [p[1] for p in pairs])
        self.agree(f"complete_batch({pairs})", candidates, actual)

    @rule(d=deliveries, fence=FENCE, delay=st.sampled_from([None, None, -1, 1, 2]),
          state=st.sampled_from([None, b"s1", b"s2"]))
    def defer(self, d: tuple[int, int], fence: int, delay: int | None, state: bytes | None) -> None:
        due = None if delay is None else (self.v + delay, 0)
        now = self.now()
        m = self.model
        expected = m.defer(d[0], d[1] + fence, due, state, now)
        actual = self.sql("SELECT fairq.message_defer(%s, %s, %s, %s)", d[0], d[1] + fence,
                          None if due is None else at(due[0]), state)[0][0]
        self.agree1(f"defer({d[0]}, {d[1] + fence}, delay={delay}, state={state!r})",
                    m, expected, actual)

    @rule(d=deliveries, fence=FENCE, lock=st.integers(1, 3))
    def heartbeat(self, d: tuple[int, int], fence: int, lock: int) -> None:
        now = self.now()
        m = self.model
        expected = m.heartbeat(d[0], d[1] + fence, lock, now)
        actual = self.sql("SELECT fairq.message_heartbeat(%s, %s, %s)", d[0], d[1] + fence,
                          lock * UNIT_MS)[0][0]
        self.agree1(f"heartbeat({d[0]}, {d[1] + fence}, lock={lock})", m, expected, actual)

    @rule(d=deliveries, fence=FENCE, error=st.sampled_from([None, "boom"]))
    def fail(self, d: tuple[int, int], fence: int, error: str | None) -> None:
        now = self.now()
        m = self.model
        expected = m.fail(d[0], d[1] + fence, error, now)
        actual = self.sql("SELECT fairq.message_fail(%s, %s, %s)", d[0], d[1] + fence, error)[0][0]
        self.agree1(f"fail({d[0]}, {d[1] + fence}, {error!r})", m, expected, actual)

    # -- operators -----------------------------------------------------------------------

    @rule(channel=CHANNELS, max_concurrency=OPTIONAL_LIMIT,
          release_interval=st.sampled_from([0, 0, 1, 2]),
          max_size=st.sampled_from([None, None, 1, 2, 4]), max_attempts=OPTIONAL_LIMIT,
          weight=WEIGHTS, queue=QUEUES)
    def channel_set(self, channel: str, max_concurrency: int | None, release_interval: int,
                    max_size: int | None, max_attempts: int | None, weight: int,
                    queue: str) -> None:
        now = self.now()
        m = self.model
        self.last_release.pop((queue, channel), None)  # the rate limit binds releases under one policy
        m.channel_set(channel, max_concurrency, release_interval, max_size, max_attempts, now,
                      weight, queue)
        actual = self.sql("SELECT fairq.channel_set(%s, %s, %s, %s, %s, %s, %s)", channel,
                          max_concurrency, release_interval * UNIT_MS, max_size, max_attempts,
                          weight, queue)[0][0]
        self.agree1(f"channel_set({channel!r}, mc={max_concurrency}, ri={release_interval},"
                    f" size={max_size}, attempts={max_attempts}, weight={weight},"
                    f" queue={queue!r})", m, "", actual)  # void

    @rule(channel=CHANNELS, queue=QUEUES)
    def channel_clear(self, channel: str, queue: str) -> None:
        now = self.now()
        m = self.model
        expected = m.channel_clear(channel, now, queue)
        actual = self.sql("SELECT fairq.channel_clear(%s, %s)", channel, queue)[0][0]
        self.last_release.pop((queue, channel), None)  # the policy is forgotten
        self.agree1(f"channel_clear({channel!r}, queue={queue!r})", m, expected, actual)

    @rule(channel=CHANNELS, units=PAUSES, queue=QUEUES)
    def channel_pause(self, channel: str, units: int | None, queue: str) -> None:
        until = FOREVER if units is None else (self.v + units, 0)
        now = self.now()
        m = self.model
        m.channel_pause(channel, until, now, queue)
        actual = self.sql("SELECT fairq.channel_pause(%s, %s, %s)", channel,
                          "infinity" if units is None else at(until[0]), queue)[0][0]
        self.agree1(f"channel_pause({channel!r}, {units}, queue={queue!r})", m, "", actual)

    @rule(channel=CHANNELS, queue=QUEUES)
    def channel_resume(self, channel: str, queue: str) -> None:
        now = self.now()
        m = self.model
        expected = m.channel_resume(channel, now, queue)
        actual = self.sql("SELECT fairq.channel_resume(%s, %s)", channel, queue)[0][0]
        self.agree1(f"channel_resume({channel!r}, queue={queue!r})", m, expected, actual)

    @rule(units=PAUSES, queue=QUEUES)
    def queue_pause(self, units: int | None, queue: str) -> None:
        until = FOREVER if units is None else (self.v + units, 0)
        self.now()
        m = self.model
        m.queue_pause(queue, until)
        actual = self.sql("SELECT fairq.queue_pause(%s, %s)", queue,
                          "infinity" if units is None else at(until[0]))[0][0]
        self.agree1(f"queue_pause({queue!r}, {units})", m, "", actual)

    @rule(queue=QUEUES)
    def queue_resume(self, queue: str) -> None:
        now = self.now()
        m = self.model
        expected = m.queue_resume(queue, now)
        actual = self.sql("SELECT fairq.queue_resume(%s)", queue)[0][0]
        self.agree1(f"queue_resume({queue!r})", m, expected, actual)

    @rule(mid=ids)
    def dead_letter_retry(self, mid: int) -> None:
        now = self.now()
        m = self.model
        expected = m.dead_letter_retry(mid, now)
        actual = self.sql("SELECT fairq.dead_letter_retry(%s)", mid)[0][0]
        self.agree1(f"dead_letter_retry({mid})", m, expected, actual)

    @rule(mid=ids)
    def dead_letter_delete(self, mid: int) -> None:
        self.now()
        m = self.model
        expected = m.dead_letter_delete(mid)
        actual = self.sql("SELECT fairq.dead_letter_delete(%s)", mid)[0][0]
        self.agree1(f"dead_letter_delete({mid})", m, expected, actual)

    @rule(units=st.integers(-1, 1), queue=st.sampled_from([None, "default", "q2"]))
    def dead_letter_purge(self, units: int, queue: str | None) -> None:
        self.now()
        m = self.model
        expected = m.dead_letter_purge((self.v + units, 0), queue)
        actual = self.sql("SELECT fairq.dead_letter_purge(%s, %s)", at(self.v + units), queue)[0][0]
        self.agree1(f"dead_letter_purge({units}, {queue!r})", m, expected, actual)

    @rule(units=st.integers(1, 3))
    def advance(self, units: int) -> None:
        self.v += units
        self.travel()
        self.log.append(f"advance({units})")


def run_machine(dsn: str, examples: int, steps: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET fairq.history = on")
        conn.execute("SET fairq.events = off")
        QueueMachine.conn = conn
        run_state_machine_as_test(QueueMachine, settings=settings(
            max_examples=examples, stateful_step_count=steps, deadline=None,
            suppress_health_check=list(HealthCheck)))


def test_queue_agrees_with_the_model(dsn: str) -> None:
    run_machine(dsn, examples=50, steps=30)


@pytest.mark.slow
def test_queue_agrees_with_the_model_long(dsn: str) -> None:
    run_machine(dsn, examples=300, steps=60)
