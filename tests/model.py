"""A pure-Python reference model of fairq's rules (SPEC §2, README, sql/*.sql).

Given the same operations and the same clock, the model predicts every result of
the SQL functions and the queue's observable state: message statuses, attempts and
recovered flags, each channel's counters, due time and turn, the order of the
round-robin, channel_size rows, dead letters and history rows.

Time. The tests put the queue's clock at ``V0 + v * UNIT + eps`` where ``v`` is a
virtual whole number of units that the test advances, and ``eps`` is the real time
elapsed since the example started (microseconds to seconds, always far below a
unit, and strictly increasing from call to call). The model therefore represents a
timestamp as a pair ``(k, c)``: ``k`` whole units after ``V0`` plus the ``eps`` of
call number ``c`` (``c = 0``: exactly ``V0 + k * UNIT``, a time the test chose).
Pairs compare lexicographically, which is exactly how the real timestamps compare,
whatever the real drift; every duration the model uses is a whole number of units.

Non-determinism. The SQL leaves one thing unordered: expired locks that expire at
the same instant (one dequeue call locks several messages with one ``locked_until``)
are recovered in physical order. ``Model.dequeue`` therefore returns every possible
outcome; the test keeps the one the database chose (all others disagree with its
results or its state).
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

UNIT_MS = 3_600_000  # one model time unit: an hour, far above any real drift in an example
V0 = datetime(2030, 1, 1, tzinfo=timezone.utc)

T = tuple[int, int]  # (whole units after V0, call number whose real elapsed time is added)

# turn_at of a channel in its queue's rotation ('-infinity'), and 'infinity' (a pause
# until resumed): below and above every time the model meets.
IN_ROTATION: T = (-10**18, 0)
FOREVER: T = (10**18, 0)


def at(k: int) -> datetime:
    """The exact timestamp of pair (k, 0)."""
    return V0 + timedelta(milliseconds=k * UNIT_MS)


def coarse(t: T | None) -> tuple[int, bool] | None:
    """What can be compared with a real timestamp: the unit and whether eps > 0."""
    return None if t is None else (t[0], t[1] > 0)


def label(t: T | None) -> str | None:
    """How the test reads '-infinity' and 'infinity' (which psycopg cannot load)."""
    return {IN_ROTATION: "rotation", FOREVER: "never"}.get(t) if t is not None else None


def finite(t: T | None) -> tuple[int, bool] | None:
    return None if t in (IN_ROTATION, FOREVER) else coarse(t)


def stride(weight: int) -> int:
    """fairq.turn_stride: how far one turn moves a channel of this weight on."""
    return 1_000_000 // weight


def coarse_db(ts: datetime | None) -> tuple[int, bool] | None:
    if ts is None:
        return None
    delta = ts - V0
    units, rest = divmod(delta, timedelta(milliseconds=UNIT_MS))
    return (units, rest > timedelta(0))


def plus(t: T | None, units: int) -> T | None:
    return None if t is None else (t[0] + units, t[1])


def least(*ts: T | None) -> T | None:
    """SQL LEAST: NULLs are ignored, NULL only when all are."""
    vals = [t for t in ts if t is not None]
    return min(vals) if vals else None


def greatest(*ts: T | None) -> T | None:
    vals = [t for t in ts if t is not None]
    return max(vals) if vals else None


@dataclass
class Channel:
    id: int
    name: str
    queue: str = "default"
    has_policy: bool = False
    max_concurrency: int | None = None
    release_interval: int = 0  # units
    max_size: int | None = None
    max_attempts: int | None = None
    in_flight: int = 0
    last_release_at: T | None = None
    due_at: T | None = None
    turn_at: T | None = None
    turn_seq: int | None = None
    weight: int = 1
    paused_until: T | None = None
    turn_pass: int | None = None
    turn_given_at: T | None = None  # in the rotation: when its place was given
    # Its turn comes from a wake the database has queued and not yet written into the
    # row (the model applies wakes at once): a dequeue's pick does not see that turn
    # until the channel joins the rotation.
    woken: bool = False


@dataclass
class Message:
    id: int
    channel_id: int
    status: str  # scheduled | ready | locked
    priority: int
    dequeue_at: T
    content: bytes
    locked_until: T | None = None
    num_attempts: int = 0
    recovered: bool = False
    dedup_key: str | None = None
    state: bytes | None = None
    attempts_at_retry: int = 0  # num_attempts when last retried from the dead letters

    def exhausted(self, max_attempts: int | None, lock_expired: bool) -> str | None:
        """fairq.attempts_exhausted: None while another delivery is allowed, else why
        the message dies. max_attempts counts deliveries since the last retry."""
        since = self.num_attempts - self.attempts_at_retry
        if max_attempts is None or since < max_attempts:
            return None
        why = (f"lock expired on delivery {since} of max_attempts {max_attempts}" if lock_expired
               else f"max_attempts {max_attempts} reached after {since} deliveries")
        if self.attempts_at_retry > 0:
            why += f" since the last retry ({self.num_attempts} in all)"
        return why


@dataclass
class Dead:
    id: int
    channel: str
    priority: int
    content: bytes
    state: bytes | None
    num_attempts: int
    error: str | None
    queue: str
    died_at: T


# A delivery as message_dequeue returns it (dequeue_at coarsened, see coarse()).
Delivery = tuple[int, str, bytes, "bytes | None", int, int, "tuple[int, bool] | None", bool]


@dataclass
class Model:
    channels: dict[int, Channel] = field(default_factory=dict)
    sizes: dict[int, int] = field(default_factory=dict)  # channel_size rows
    messages: dict[int, Message] = field(default_factory=dict)
    dead: dict[int, Dead] = field(default_factory=dict)
    history: list[tuple[int, str, str, str, int]] = field(default_factory=list)
    queue_paused_until: dict[str, T | None] = field(default_factory=dict)  # queues named so far
    last_channel_id: int = 0
    last_message_id: int = 0
    last_turn_seq: int = 0

    def copy(self) -> Model:
        return copy.deepcopy(self)

    # -- channels.sql -------------------------------------------------------------------

    def by_name(self, name: str, queue: str = "default") -> Channel | None:
        for ch in self.channels.values():
            if ch.name == name and ch.queue == queue:
                return ch
        return None

    def name_queue(self, queue: str) -> None:
        """A queue exists from the first call that names it (queues.sql)."""
        self.queue_paused_until.setdefault(queue, None)

    def next_seq(self) -> int:
        self.last_turn_seq += 1
        return self.last_turn_seq

    # -- turns.sql ----------------------------------------------------------------------

    @staticmethod
    def next_turn(turn_at: T | None, ch: Channel, now: T) -> T | None:
        if ch.due_at is None:
            return None
        if ch.max_concurrency is not None and ch.in_flight >= ch.max_concurrency:
            return None
        return least(turn_at, greatest(ch.due_at, now, ch.paused_until,
                                       plus(ch.last_release_at, ch.release_interval)))

    @staticmethod
    def kept_pass(old: T | None, new: T | None, turn_pass: int | None, now: T | None) -> int | None:
        """fairq.kept_pass: a pass is kept while the turn does not move, and a kept
        place (a full channel's pass, turn None) also when a freed slot makes the
        channel servable by now."""
        if new == old or (old is None and new is not None and now is not None and new <= now):
            return turn_pass
        return None

    def channel_store(self, ch: Channel, now: T, keep_turn: bool) -> None:
        turn = self.next_turn(ch.turn_at if keep_turn else None, ch, now)
        if turn is None:
            ch.turn_seq = None
        elif not keep_turn or turn != ch.turn_at:
            ch.turn_seq = self.next_seq()
        if turn is None or turn != ch.turn_at or not keep_turn:
            # A new turn is a time: the channel waits to join; at the back unless it
            # keeps its place (full, or freed and servable now).
            ch.turn_pass = self.kept_pass(ch.turn_at, turn, ch.turn_pass, now) if keep_turn else None
            ch.turn_given_at = None
        ch.turn_at = turn
        ch.woken = False  # written: any wake is folded in

    @staticmethod
    def turn_key(ch: Channel) -> tuple[T, int, int]:
        assert ch.turn_at is not None and ch.turn_seq is not None
        # (A NULL pass sorts last, as in channel_turn_ix: a waiting channel has one
        # only when it keeps its place.)
        return (ch.turn_at, ch.turn_pass if ch.turn_pass is not None else 10**18, ch.turn_seq)

    def join_rotation(self, queue: str, now: T, limit: int) -> None:
        """The ``limit`` channels whose wait ended earliest join the rotation, each just
        ahead of the first channel given its place after its wait ended, or else at
        the back (one past the highest pass); one that kept its place (full, then
        freed) at that pass, but no more than a round of its weight behind the front
        and never behind the back (fairq.kept_join_pass)."""
        joining = sorted((c for c in self.channels.values()
                          if c.queue == queue and c.turn_at is not None
                          and IN_ROTATION < c.turn_at <= now), key=self.turn_key)[:limit]
        if not joining:
            return
        rotation = [c for c in self.channels.values()
                    if c.queue == queue and c.turn_at == IN_ROTATION]
        back = max((r.turn_pass or 0) for r in rotation) if rotation else 0
        front0 = min((r.turn_pass or 0) for r in rotation) if rotation else None
        back0 = back if rotation else None
        for ch in joining:
            assert ch.turn_at is not None
            later = [r for r in rotation if r.turn_given_at is not None
                     and r.turn_given_at > ch.turn_at]
            after = min(later, key=lambda r: (r.turn_given_at, r.turn_pass), default=None)
            if ch.turn_pass is not None:  # a kept place
                kept = ch.turn_pass
                if front0 is not None:
                    kept = max(kept, front0 - 1_000_000 + stride(ch.weight))
                if back0 is not None:
                    kept = min(kept, back0 + 1)
                ch.turn_pass = kept
            elif after is not None and after.turn_pass is not None:
                ch.turn_pass = after.turn_pass - 1
            else:
                back += 1
                ch.turn_pass = back
            ch.turn_given_at = ch.turn_at
            ch.turn_at = IN_ROTATION
            ch.turn_seq = self.next_seq()
            ch.woken = False

    def pending_due_at(self, ch: Channel) -> T | None:
        ready = [m for m in self.messages.values() if m.channel_id == ch.id and m.status == "ready"]
        if ready:
            return min(ready, key=lambda m: (-m.priority, m.dequeue_at, m.id)).dequeue_at
        sched = [m for m in self.messages.values()
                 if m.channel_id == ch.id and m.status == "scheduled"]
        if sched:
            return min(sched, key=lambda m: (m.dequeue_at, m.id)).dequeue_at
        return None

    def locked(self, ch: Channel) -> int:
        return sum(1 for m in self.messages.values() if m.channel_id == ch.id and m.status == "locked")

    @staticmethod
    def slots(ch: Channel, count: int) -> int:
        """Only a capped channel counts in_flight."""
        return 0 if ch.max_concurrency is None else count

    def channel_for_producer(self, name: str, queue: str = "default") -> Channel:
        self.name_queue(queue)
        ch = self.by_name(name, queue)
        if ch is None:
            self.last_channel_id += 1
            ch = Channel(self.last_channel_id, name, queue)
            self.channels[ch.id] = ch
        return ch

    def channel_wake(self, ch: Channel, due_at: T, now: T, made: bool = False) -> None:
        """A message due at due_at on ch (made: its row made by this call, which the
        database writes due at once). Only a wake that brings the turn forward is
        queued (fairq.needs_wake)."""
        queued = not made and (ch.due_at is None or (due_at < ch.due_at and ch.due_at > now))
        woken = ch.woken
        ch.due_at = least(ch.due_at, due_at)
        self.channel_store(ch, now, True)
        ch.woken = woken or queued

    def channel_unlock(self, ch: Channel, count: int, due_at: T | None, now: T) -> None:
        ch.in_flight -= self.slots(ch, count)
        ch.due_at = least(ch.due_at, due_at)
        self.channel_store(ch, now, True)

    def channel_resize(self, ch: Channel, delta: int, enforce: bool) -> int:
        if ch.max_size is None:
            return delta
        admitted = delta
        if enforce:
            admitted = min(delta, max(0, ch.max_size - self.sizes[ch.id]))
        self.sizes[ch.id] += admitted
        return admitted

    def channel_set(self, name: str, max_concurrency: int | None, release_interval: int,
                    max_size: int | None, max_attempts: int | None, now: T,
                    weight: int = 1, queue: str = "default") -> None:
        ch = self.channel_for_producer(name, queue)
        ch.has_policy = True
        ch.weight = weight
        ch.max_concurrency = max_concurrency
        ch.release_interval = release_interval
        ch.max_size = max_size
        ch.max_attempts = max_attempts
        ch.in_flight = self.slots(ch, self.locked(ch))
        if max_size is None:
            self.sizes.pop(ch.id, None)
        elif ch.id not in self.sizes:
            self.sizes[ch.id] = sum(1 for m in self.messages.values() if m.channel_id == ch.id)
        self.channel_store(ch, now, False)  # new limits apply from now

    def channel_clear(self, name: str, now: T, queue: str = "default") -> bool:
        ch = self.by_name(name, queue)
        if ch is None or not (ch.has_policy or (ch.paused_until is not None and ch.paused_until > now)):
            return False
        self.sizes.pop(ch.id, None)
        ch.has_policy = False
        ch.weight = 1
        ch.paused_until = None
        ch.max_concurrency = None
        ch.release_interval = 0
        ch.max_size = None
        ch.max_attempts = None
        ch.in_flight = 0
        self.channel_store(ch, now, False)
        return True

    def channel_pause(self, name: str, until: T, now: T, queue: str = "default") -> None:
        ch = self.channel_for_producer(name, queue)
        ch.paused_until = until
        self.channel_store(ch, now, False)

    def channel_resume(self, name: str, now: T, queue: str = "default") -> bool:
        ch = self.by_name(name, queue)
        if ch is None or ch.paused_until is None or not ch.paused_until > now:
            return False
        ch.paused_until = None
        self.channel_store(ch, now, False)
        return True

    # -- queues.sql ---------------------------------------------------------------------

    def queue_pause(self, queue: str, until: T) -> None:
        self.name_queue(queue)
        self.queue_paused_until[queue] = until

    def queue_resume(self, queue: str, now: T) -> bool:
        until = self.queue_paused_until.get(queue)
        if until is None:
            return False
        self.queue_paused_until[queue] = None
        return until > now

    # -- events.sql ---------------------------------------------------------------------

    def bury(self, m: Message, ch: Channel, error: str | None, now: T) -> None:
        self.dead[m.id] = Dead(m.id, ch.name, m.priority, m.content, m.state, m.num_attempts, error,
                               ch.queue, now)
        self.history.append((m.id, ch.queue, ch.name, "dead", m.num_attempts))
        self.channel_resize(ch, -1, False)

    # -- create.sql ---------------------------------------------------------------------

    def create_batch(self, items: list[tuple[str, bytes, T | None, int | None, str | None]],
                     now: T, queue: str = "default") -> list[tuple[int, int | None, str]]:
        """items: (channel, content, dequeue_at or None, priority or None, dedup_key).

        Channels are created in name order; each element, in input order, behaves like
        message_create: duplicate, dropped or created (ids in input order). Then each
        channel that got a message is woken by its earliest created message, where
        that brings its turn forward: first the channels made here (in id order: the
        SQL makes them due as it inserts them), then the others (in id order). (The SQL
        queues the others' wakes and the next dequeue applies them as of now: the model
        applies them at once.)"""
        names = sorted({item[0] for item in items})
        made = {name for name in names if self.by_name(name, queue) is None}
        taken = {channel: self.channel_for_producer(channel, queue) for channel in names}
        out: list[tuple[int, int | None, str]] = []
        for i, (channel, content, due, priority, dedup) in enumerate(items, 1):
            ch = taken[channel]
            dequeue_at = due if due is not None else now
            if dedup is not None:
                same = [m for m in self.messages.values()
                        if m.channel_id == ch.id and m.dedup_key == dedup]
                if same:
                    out.append((i, same[0].id, "duplicate"))
                    continue
            if self.channel_resize(ch, 1, True) == 0:
                out.append((i, None, "dropped"))
                continue
            self.last_message_id += 1
            mid = self.last_message_id
            self.messages[mid] = Message(
                mid, ch.id, "ready" if dequeue_at <= now else "scheduled",
                priority if priority is not None else 0, dequeue_at, content, dedup_key=dedup)
            out.append((i, mid, "created"))
        earliest: dict[int, T] = {}
        for (_, mid, status) in out:
            if status == "created":
                assert mid is not None
                m = self.messages[mid]
                earliest[m.channel_id] = min(earliest.get(m.channel_id, m.dequeue_at), m.dequeue_at)
        made_ids = {taken[name].id for name in made}
        # Wakes take their turn_seq in this order.
        for cid in sorted(earliest, key=lambda cid: (cid not in made_ids, cid)):
            ch = self.channels[cid]
            if ch.due_at is None or (earliest[cid] < ch.due_at and ch.due_at > now):
                self.channel_wake(ch, earliest[cid], now, made=cid in made_ids)
        return out

    # -- dequeue.sql --------------------------------------------------------------------

    def recover_orders(self, now: T, limit: int, queue: str = "default") -> list[list[int]]:
        """Every order in which recover_expired may settle the queue's expired locks:
        oldest expiry first, ties in any order, at most ``limit`` of them."""
        expired = sorted((m for m in self.messages.values()
                          if self.channels[m.channel_id].queue == queue
                          and m.status == "locked" and m.locked_until is not None
                          and m.locked_until <= now), key=lambda m: m.locked_until)  # type: ignore[arg-type, return-value]
        groups = [list(g) for _, g in itertools.groupby(expired, key=lambda m: m.locked_until)]
        parts: list[list[tuple[int, ...]]] = []
        left = limit
        for g in groups:
            if left <= 0:
                break
            take = min(left, len(g))
            parts.append(list(itertools.permutations([m.id for m in g], take)))
            left -= take
        orders = {tuple(x for part in combo for x in part) for combo in itertools.product(*parts)}
        return [list(o) for o in sorted(orders)]

    def recover(self, order: list[int], now: T) -> None:
        for mid in order:
            m = self.messages[mid]
            ch = self.channels[m.channel_id]
            why = m.exhausted(ch.max_attempts, lock_expired=True)
            if why is not None:
                del self.messages[mid]
                self.bury(m, ch, why, now)
                self.channel_unlock(ch, 1, None, now)
            else:
                m.status = "ready"
                m.locked_until = None
                m.recovered = True
                self.channel_unlock(ch, 1, m.dequeue_at, now)

    def channel_take(self, ch: Channel, now: T, lock: int) -> Message | None:
        for m in self.messages.values():
            if m.channel_id == ch.id and m.status == "scheduled" and m.dequeue_at <= now:
                m.status = "ready"
        taken: Message | None = None
        while True:
            ready = [m for m in self.messages.values()
                     if m.channel_id == ch.id and m.status == "ready"]
            if not ready:
                break
            m = min(ready, key=lambda m: (-m.priority, m.dequeue_at, m.id))
            why = m.exhausted(ch.max_attempts, lock_expired=False)
            if why is None:
                m.status = "locked"
                m.locked_until = plus(now, lock)
                m.num_attempts += 1
                ch.in_flight += self.slots(ch, 1)
                ch.last_release_at = now
                taken = m
                break
            del self.messages[m.id]
            self.bury(m, ch, why, now)
        ch.due_at = self.pending_due_at(ch)
        if taken is None or ch.due_at is None or ch.due_at > now:
            self.channel_store(ch, now, False)  # retired, or drained: it waits to join again
            return taken
        # Served and still servable: in the rotation it moves on by its stride, as long
        # as it may be served again at once; else it waits.
        turn = self.next_turn(None, ch, now)
        ch.turn_seq = None if turn is None else self.next_seq()
        if ch.turn_at == IN_ROTATION and turn is not None and turn <= now:
            assert ch.turn_pass is not None
            ch.turn_pass += stride(ch.weight)
            ch.turn_given_at = now
        elif ch.turn_at == IN_ROTATION and turn is None:
            # Full, with work due now: out of the rotation, its place kept (moved on).
            assert ch.turn_pass is not None
            ch.turn_at = None
            ch.turn_pass += stride(ch.weight)
            ch.turn_given_at = None
        else:
            ch.turn_at = turn
            ch.turn_pass = None
            ch.turn_given_at = None
        return taken

    def dequeue_with(self, order: list[int], lock: int, n: int, now: T,
                     queue: str = "default") -> list[Delivery]:
        self.recover(order, now)
        out: list[Delivery] = []
        paused = self.queue_paused_until.get(queue)
        if paused is not None and paused > now:
            return out
        self.join_rotation(queue, now, n)
        visited: set[int] = set()
        joined_again = False
        while len(out) < n:
            eligible = [c for c in self.channels.values()
                        if c.queue == queue and c.turn_at is not None and c.turn_at <= now
                        and c.id not in visited and not c.woken]
            if not eligible:
                # The database lets the next channels join once more before it answers
                # (a woken channel is seen only once it joined).
                if joined_again:
                    break
                joined_again = True
                self.join_rotation(queue, now, n - len(out))
                continue
            joined_again = False
            ch = min(eligible, key=self.turn_key)
            m = self.channel_take(ch, now, lock)
            if m is None:
                visited.add(ch.id)
                continue
            out.append((m.id, ch.name, m.content, m.state, m.num_attempts, m.priority,
                        coarse(m.dequeue_at), m.recovered))
        return out

    def dequeue(self, lock: int, n: int, now: T,
                queue: str = "default") -> list[tuple[list[Delivery], Model]]:
        """Every possible (result, model after the call)."""
        outcomes = []
        for order in self.recover_orders(now, n, queue):
            branch = self.copy()
            outcomes.append((branch.dequeue_with(order, lock, n, now, queue), branch))
        return outcomes

    # -- settle.sql ---------------------------------------------------------------------

    def _fenced(self, mid: int, attempts: int) -> Message | None:
        m = self.messages.get(mid)
        if m is not None and m.status == "locked" and m.num_attempts == attempts:
            return m
        return None

    def _miss(self, mid: int, if_exists: str) -> str:
        return if_exists if mid in self.messages else "not_found"

    def complete_batch(self, pairs: list[tuple[int, int]], now: T,
                       channel_order: list[int] | None = None) -> list[tuple[int, str]]:
        """The elements are answered as message_complete would answer them one after
        the other (an id listed twice is settled by its first element holding its
        token). The freed channels take their new turns in channel_order (any order
        is allowed; see complete_batch_outcomes)."""
        out: list[tuple[int, str]] = []
        done: list[Message] = []
        for mid, attempts in pairs:
            m = self._fenced(mid, attempts)
            if m is not None:
                del self.messages[mid]
                done.append(m)
                out.append((mid, "completed"))
            else:
                out.append((mid, self._miss(mid, "stale")))
        channel_ids = sorted({m.channel_id for m in done})
        if channel_order is not None:
            assert sorted(channel_order) == channel_ids
            channel_ids = channel_order
        for cid in channel_ids:
            ch = self.channels[cid]
            group = [m for m in done if m.channel_id == cid]
            for m in group:
                self.history.append((m.id, ch.queue, ch.name, "completed", m.num_attempts))
            self.channel_resize(ch, -len(group), False)
            self.channel_unlock(ch, len(group), None, now)
        return out

    def complete_batch_outcomes(self, pairs: list[tuple[int, int]],
                                now: T) -> list[tuple[list[tuple[int, str]], Model]]:
        """Every possible (result, model after the call): channels freed by one call
        regain their turns in an order the SPEC leaves open."""
        probe = self.copy()
        probe.complete_batch(pairs, now)
        freed = sorted({m.channel_id for mid, m in self.messages.items()
                        if mid not in probe.messages})
        outcomes = []
        for order in itertools.permutations(freed):
            branch = self.copy()
            outcomes.append((branch.complete_batch(pairs, now, list(order)), branch))
        return outcomes

    def defer(self, mid: int, attempts: int, dequeue_at: T | None, state: bytes | None,
              now: T) -> str:
        m = self._fenced(mid, attempts)
        if m is None:
            return self._miss(mid, "stale")
        due = dequeue_at if dequeue_at is not None else now
        m.status = "ready" if due <= now else "scheduled"
        m.dequeue_at = due
        m.locked_until = None
        m.recovered = False
        if state is not None:
            m.state = state
        self.channel_unlock(self.channels[m.channel_id], 1, due, now)
        return "deferred"

    def heartbeat(self, mid: int, attempts: int, lock: int, now: T) -> str:
        m = self._fenced(mid, attempts)
        if m is None:
            return self._miss(mid, "stale")
        m.locked_until = greatest(m.locked_until, plus(now, lock))
        return "heartbeated"

    def fail(self, mid: int, attempts: int, error: str | None, now: T) -> str:
        m = self._fenced(mid, attempts)
        if m is None:
            return self._miss(mid, "stale")
        del self.messages[mid]
        ch = self.channels[m.channel_id]
        self.bury(m, ch, error, now)
        self.channel_unlock(ch, 1, None, now)
        return "dead"

    def cancel(self, mid: int, now: T) -> str:
        """Never touches the channel's turn but through a wake: a channel left with
        nothing pending keeps its due_at until a dequeue picks it and retires it; a
        message due later may be what gave the channel its wait, so its cancel makes
        the channel due now, as a producer's message due now would."""
        m = self.messages.get(mid)
        if m is None or m.status == "locked":
            return self._miss(mid, "locked")
        del self.messages[mid]
        ch = self.channels[m.channel_id]
        self.history.append((m.id, ch.queue, ch.name, "cancelled", m.num_attempts))
        self.channel_resize(ch, -1, False)
        if m.dequeue_at > now and (ch.due_at is None or ch.due_at > now):
            self.channel_wake(ch, now, now)
        return "cancelled"

    def dead_letter_retry(self, mid: int, now: T) -> str:
        d = self.dead.pop(mid, None)
        if d is None:
            return "not_found"
        made = self.by_name(d.channel, d.queue) is None
        ch = self.channel_for_producer(d.channel, d.queue)
        self.channel_wake(ch, now, now, made=made)
        self.channel_resize(ch, 1, False)
        # A fresh max_attempts budget; num_attempts, the fencing token, goes on counting.
        self.messages[mid] = Message(mid, ch.id, "ready", d.priority, now, d.content,
                                     state=d.state, num_attempts=d.num_attempts,
                                     attempts_at_retry=d.num_attempts)
        return "requeued"

    # -- what the database shows ---------------------------------------------------------

    def dead_letter_delete(self, mid: int) -> str:
        return "deleted" if self.dead.pop(mid, None) is not None else "not_found"

    def dead_letter_purge(self, before: T, queue: str | None) -> int:
        gone = [d.id for d in self.dead.values()
                if d.died_at < before and (queue is None or d.queue == queue)]
        for mid in gone:
            del self.dead[mid]
        return len(gone)

    # -- what the database shows ---------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The observable state, in the same shape as the test's db_snapshot()."""
        name = {c.id: (c.queue, c.name) for c in self.channels.values()}
        in_rotation = [c for c in self.channels.values() if c.turn_at == IN_ROTATION]
        return {
            "messages": sorted(
                (m.id, *name[m.channel_id], m.status, m.priority, m.num_attempts, m.recovered,
                 m.state, m.dedup_key, coarse(m.dequeue_at), coarse(m.locked_until),
                 m.attempts_at_retry)
                for m in self.messages.values()),
            "channels": sorted(
                (c.queue, c.name, c.has_policy, c.max_concurrency, c.release_interval * UNIT_MS,
                 c.max_size, c.max_attempts, c.weight, c.in_flight, coarse(c.last_release_at),
                 coarse(c.due_at), label(c.turn_at), finite(c.turn_at),
                 label(c.paused_until), finite(c.paused_until))
                for c in self.channels.values()),
            # Passes are relative: compared as offsets from each queue's head.
            "passes": sorted(
                (c.queue, c.name, (c.turn_pass or 0) - min((r.turn_pass or 0) for r in in_rotation
                                                          if r.queue == c.queue),
                 coarse(c.turn_given_at))
                for c in in_rotation),
            # Kept places outside the rotation, as offsets from the front.
            "kept": sorted(
                (c.queue, c.name,
                 None if not any(r.queue == c.queue for r in in_rotation)
                 else c.turn_pass - min((r.turn_pass or 0) for r in in_rotation if r.queue == c.queue))
                for c in self.channels.values()
                if c.turn_pass is not None and c.turn_at != IN_ROTATION),
            "turn_order": [(c.queue, c.name) for c in sorted(
                (c for c in self.channels.values() if c.turn_at is not None),
                key=lambda c: (c.queue, *self.turn_key(c)))],
            "sizes": sorted((*name[cid], size) for cid, size in self.sizes.items()),
            "dead": sorted((d.id, d.queue, d.channel, d.num_attempts, d.state, d.error)
                           for d in self.dead.values()),
            "history": sorted(self.history),
            "queues": sorted((q, label(until), finite(until))
                             for q, until in self.queue_paused_until.items()),
        }
