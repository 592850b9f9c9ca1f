-- tables.sql — where fairq keeps its state.
--
-- Invariants kept by every function in this schema:
--   * one queue row per name, created on first use and kept (queues are few: job
--     kinds); every channel, message, wake, dead letter and history row belongs to
--     one queue, and a message or wake carries its channel's queue_id, so that every
--     index a dequeue reads starts with the queue;
--   * one channel row per (queue, name), created on first use; a channel with no
--     explicit policy and nothing in it is kept idle for a while (a tenant that
--     comes back finds it), then collected in bulk (fairq.collect_idle_channels);
--   * channel.in_flight = number of its messages with status 'locked' when it has a
--     max_concurrency, else 0: only a capped channel's settlements touch its row;
--   * channel.due_at is NULL only when the channel has no pending ('ready' or
--     'scheduled') message, and is never later than the earliest time one of its
--     pending messages becomes due (it may be earlier: a dequeue then finds nothing
--     and recomputes it);
--   * channel.turn_at is NULL when the channel cannot be served (nothing pending or
--     at max_concurrency); '-infinity' when it is in its queue's rotation (ordered
--     by turn_pass, then turn_seq); else the time from which it may be served (see
--     turns.sql for the whole rule). Outside the rotation turn_pass is NULL but for
--     a kept place: a channel full with work due, or freed from that and servable
--     now, keeps its pass (turns.sql, since 0.7.37);
--   * channel.idle_since is NULL exactly when due_at is not: since when the channel
--     has had nothing pending;
--   * channel_size exists exactly for channels with a max_size; its size plus its
--     channel's rows in channel_size_change counts all their messages, in flight
--     included; channel_size_change has rows only for such channels.
-- Messages move scheduled -> ready -> locked -> (deleted | ready | scheduled).
-- Only 'ready' messages are ordered by priority; a 'scheduled' message becomes
-- 'ready' in the dequeue that finds it due, so no daemon is needed.

CREATE TYPE fairq.message_status AS ENUM ('scheduled', 'ready', 'locked');

CREATE SEQUENCE fairq.queue_id_seq AS integer;
CREATE SEQUENCE fairq.channel_id_seq;
-- Round-robin tie-breaker: a served or newly eligible channel takes the next value,
-- so channels whose turns fall in the same microsecond still take strict turns.
CREATE SEQUENCE fairq.turn_seq;
CREATE SEQUENCE fairq.message_id_seq;

-- A queue: its own channels and round-robin, served by its own workers. Rows are
-- created by the first call that names the queue.
CREATE TABLE fairq.queue (
    id           integer     NOT NULL DEFAULT nextval('fairq.queue_id_seq') PRIMARY KEY,
    name         text        NOT NULL UNIQUE,
    paused_until timestamptz
);
ALTER SEQUENCE fairq.queue_id_seq OWNED BY fairq.queue.id;

-- Every dequeue rewrites its channel's turn (an indexed column), so channel updates
-- cannot be HOT: leave room on each page and vacuum the small, hot table often.
-- Vacuum never truncates the tables that queue traffic rewrites all the time (this
-- one, channel_wake, channel_size, channel_size_change, message): a truncation needs
-- the table's exclusive lock, which traffic never lets it have, and autovacuum's
-- worker waited up to 5 s for it at many visits, then gave up, while dead rows piled up
-- in the tables it had not reached yet. The pages stay, and are filled again.
CREATE TABLE fairq.channel (
    id                  bigint      NOT NULL DEFAULT nextval('fairq.channel_id_seq') PRIMARY KEY,
    name                text        NOT NULL,
    has_policy          boolean     NOT NULL DEFAULT false,
    max_concurrency     integer,
    release_interval_ms bigint      NOT NULL DEFAULT 0,
    max_size            integer,
    max_attempts        integer,
    in_flight           integer     NOT NULL DEFAULT 0,
    last_release_at     timestamptz,
    due_at              timestamptz,
    turn_at             timestamptz,
    turn_seq            bigint,
    idle_since          timestamptz,
    queue_id            integer     NOT NULL,
    weight              integer     NOT NULL DEFAULT 1,
    paused_until        timestamptz,
    -- Its place in the rotation while turn_at is '-infinity', and when it was given
    -- (turns.sql).
    turn_pass           bigint,
    turn_given_at       timestamptz,
    CONSTRAINT channel_queue_id_name_key UNIQUE (queue_id, name)
) WITH (fillfactor = 50,
        autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000,
        autovacuum_analyze_scale_factor = 0.05, autovacuum_vacuum_cost_delay = 0,
        vacuum_truncate = false);
ALTER SEQUENCE fairq.channel_id_seq OWNED BY fairq.channel.id;

-- The dequeue's lookups, within one queue: the rotation ('-infinity', by pass), then
-- the channels whose time to join it has come (by that time).
CREATE INDEX channel_turn_ix ON fairq.channel (queue_id, turn_at, turn_pass, turn_seq)
    WHERE turn_at IS NOT NULL;
-- The rotation by when each place was given: where a channel joining late belongs.
CREATE INDEX channel_turn_given_ix ON fairq.channel (queue_id, turn_given_at, turn_pass)
    WHERE turn_at = '-infinity';
-- Channels the collector may remove, longest idle (and unpaused) first.
CREATE INDEX channel_idle_ix ON fairq.channel ((GREATEST(idle_since, paused_until)))
    WHERE idle_since IS NOT NULL AND NOT has_policy;

-- When idle channels were last collected: dequeues take turns at it, at most one at
-- a time and once a second (fairq.collect_idle_channels).
CREATE TABLE fairq.channel_collection (
    singleton    boolean     NOT NULL DEFAULT true PRIMARY KEY CHECK (singleton),
    collected_at timestamptz NOT NULL DEFAULT '-infinity'
);
INSERT INTO fairq.channel_collection DEFAULT VALUES;

-- Wakes of idle channels, queued by producers (fairq.channels_wake), who never lock
-- a channel row: the channel's turn is due no later than due_at, from woken_at, with
-- turn_seq. Committed with the producer's messages and applied, then deleted, by the
-- next dequeues (fairq.join_rotation, earliest turn first).
CREATE TABLE fairq.channel_wake (
    channel_id bigint      NOT NULL,
    due_at     timestamptz NOT NULL,
    woken_at   timestamptz NOT NULL,
    turn_seq   bigint      NOT NULL,
    queue_id   integer     NOT NULL
) WITH (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000,
        autovacuum_vacuum_cost_delay = 0, vacuum_truncate = false);
-- A channel's wakes, earliest due first: a producer asks for the earliest, and for
-- the latest due by its message's time, in one probe however many are queued (a
-- producer gone bulk queues one per channel per transaction, and until dequeues
-- apply them they add up: with the channel alone, each call read them all).
CREATE INDEX channel_wake_channel_ix ON fairq.channel_wake (channel_id, due_at);
-- Wakes by the turn they give (rate limits aside): dequeues apply the earliest first.
CREATE INDEX channel_wake_turn_ix ON fairq.channel_wake (queue_id, (GREATEST(due_at, woken_at)), turn_seq);

-- Producers of a bounded channel serialise on this row, not on the channel row that
-- dequeues lock, so an open producer transaction never hides a channel from workers.
CREATE TABLE fairq.channel_size (
    channel_id bigint  NOT NULL PRIMARY KEY,
    size       integer NOT NULL
) WITH (fillfactor = 50, autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000,
        vacuum_truncate = false);

-- What left a bounded channel (or came back to it) outside its producers' lock:
-- completions, failures, cancels, burials and retries insert their change here
-- instead of updating channel_size, whose row a producer holds until it commits, so
-- an open producer transaction never makes them wait. The next producer of the
-- channel folds the changes into channel_size under that lock.
CREATE TABLE fairq.channel_size_change (
    channel_id bigint  NOT NULL,
    delta      integer NOT NULL
) WITH (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000, vacuum_truncate = false);
CREATE INDEX channel_size_change_channel_ix ON fairq.channel_size_change (channel_id);

CREATE TABLE fairq.message (
    id                bigint               NOT NULL DEFAULT nextval('fairq.message_id_seq') PRIMARY KEY,
    channel_id        bigint               NOT NULL,
    status            fairq.message_status NOT NULL,
    priority          integer              NOT NULL DEFAULT 0,
    dequeue_at        timestamptz          NOT NULL,
    locked_until      timestamptz,
    num_attempts      bigint               NOT NULL DEFAULT 0,
    recovered         boolean              NOT NULL DEFAULT false,
    created_at        timestamptz          NOT NULL,
    first_dequeued_at timestamptz,
    dedup_key         text,
    content           bytea                NOT NULL,
    state             bytea,
    -- num_attempts when the message was last retried from the dead letters (0 if
    -- never): max_attempts counts the deliveries since (fairq.attempts_exhausted).
    attempts_at_retry bigint               NOT NULL DEFAULT 0,
    queue_id          integer              NOT NULL
) WITH (autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 1000,
        autovacuum_analyze_scale_factor = 0.02, autovacuum_vacuum_cost_delay = 0,
        vacuum_truncate = false);
ALTER SEQUENCE fairq.message_id_seq OWNED BY fairq.message.id;

-- A channel's best ready message: priority first, then schedule, then arrival.
CREATE INDEX message_ready_ix ON fairq.message (channel_id, priority DESC, dequeue_at, id)
    WHERE status = 'ready';
-- A channel's scheduled messages, by the time they become due.
CREATE INDEX message_scheduled_ix ON fairq.message (channel_id, dequeue_at, id)
    WHERE status = 'scheduled';
-- The same, in the order they will be handed out once due: a dequeue that finds more
-- come due than it promotes at once promotes the first in this order (dequeue.sql,
-- step 3), reading past the channel's messages of higher priority not yet due.
CREATE INDEX message_scheduled_priority_ix ON fairq.message (channel_id, priority DESC, dequeue_at, id)
    WHERE status = 'scheduled';
-- A queue's locks that may have expired, oldest expiry first. Only locked messages
-- have a locked_until; the index says so by that column, not by status, so that a
-- statement looking for a channel's locked messages cannot be planned through it
-- (a plan cached while nothing was locked read every lock of the queue for each
-- channel) and has message_locked_channel_ix alone to go by.
CREATE INDEX message_locked_ix ON fairq.message (queue_id, locked_until)
    WHERE locked_until IS NOT NULL;
-- A channel's locked messages: is an uncapped channel empty, how many are in flight.
CREATE INDEX message_locked_channel_ix ON fairq.message (channel_id)
    WHERE status = 'locked';
CREATE UNIQUE INDEX message_dedup_ix ON fairq.message (channel_id, dedup_key)
    WHERE dedup_key IS NOT NULL;
-- Messages whose lock expired unsettled (the dashboard's "Recovered" list, newest
-- first): few, and no other index finds them. Only a recovery adds an entry; every
-- other write of a message either writes its indexes anyway (no update of a message
-- is HOT) or deletes it.
CREATE INDEX message_recovered_ix ON fairq.message (id) WHERE recovered;

CREATE TABLE fairq.dead_letter (
    id           bigint      NOT NULL PRIMARY KEY,
    channel      text        NOT NULL,
    priority     integer     NOT NULL,
    content      bytea       NOT NULL,
    state        bytea,
    num_attempts bigint      NOT NULL,
    error        text,
    created_at   timestamptz NOT NULL,
    died_at      timestamptz NOT NULL,
    queue        text        NOT NULL
);
CREATE INDEX dead_letter_died_at_ix ON fairq.dead_letter (died_at);
CREATE INDEX dead_letter_queue_died_at_ix ON fairq.dead_letter (queue, died_at);

-- Filled only while the setting fairq.history is on.
CREATE TABLE fairq.message_history (
    id                bigint      NOT NULL,
    queue             text        NOT NULL,
    channel           text        NOT NULL,
    priority          integer     NOT NULL,
    created_at        timestamptz NOT NULL,
    first_dequeued_at timestamptz,
    settled_at        timestamptz NOT NULL,
    num_attempts      bigint      NOT NULL,
    outcome           text        NOT NULL CHECK (outcome IN ('completed', 'dead', 'cancelled'))
);
CREATE INDEX message_history_settled_at_ix ON fairq.message_history (settled_at);
CREATE INDEX message_history_id_ix ON fairq.message_history (id);

-- Queue data is user data: pg_dump must back it up although the tables belong to
-- the extension. (Outside CREATE EXTENSION, e.g. `fairq install`, nothing to mark.)
DO $config_dump$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_extension WHERE extname = 'fairq') THEN
        PERFORM pg_catalog.pg_extension_config_dump('fairq.queue', '');
        PERFORM pg_catalog.pg_extension_config_dump('fairq.channel', '');
        PERFORM pg_catalog.pg_extension_config_dump('fairq.channel_size', '');
        PERFORM pg_catalog.pg_extension_config_dump('fairq.channel_size_change', '');
        PERFORM pg_catalog.pg_extension_config_dump('fairq.channel_wake', '');
        PERFORM pg_catalog.pg_extension_config_dump('fairq.message', '');
        PERFORM pg_catalog.pg_extension_config_dump('fairq.dead_letter', '');
        PERFORM pg_catalog.pg_extension_config_dump('fairq.message_history', '');
        PERFORM pg_catalog.pg_extension_config_dump('fairq.queue_id_seq', '');
        PERFORM pg_catalog.pg_extension_config_dump('fairq.channel_id_seq', '');
        PERFORM pg_catalog.pg_extension_config_dump('fairq.message_id_seq', '');
        PERFORM pg_catalog.pg_extension_config_dump('fairq.turn_seq', '');
    END IF;
END
$config_dump$;

COMMENT ON TYPE fairq.message_status IS
    'Where a message is: scheduled (not yet due), ready (due, ordered by priority), locked (handed out, in flight).';
COMMENT ON TABLE fairq.queue IS
    'One row per named queue (created on first use): its id and, while it is paused, until when.';
COMMENT ON TABLE fairq.channel IS
    'One row per channel (tenant): its policy, in-flight count and round-robin turn. Rows without a policy disappear when the channel is empty.';
COMMENT ON TABLE fairq.channel_wake IS
    'Wakes of idle channels that producers queued (producers never lock a channel row); the next dequeues apply them, oldest first.';
COMMENT ON TABLE fairq.channel_collection IS
    'When idle channels (no policy, nothing in them) were last collected; dequeues collect them once a second.';
COMMENT ON TABLE fairq.channel_size IS
    'Message count of each channel that has a max_size, in flight included, as its producers last left it (plus the rows of fairq.channel_size_change).';
COMMENT ON TABLE fairq.channel_size_change IS
    'Changes to the message count of bounded channels made outside their producers'' lock (settlements, cancels, retries), not yet folded into fairq.channel_size.';
COMMENT ON TABLE fairq.message IS
    'Every message not yet completed, cancelled or dead: scheduled, ready or locked (in flight).';
COMMENT ON TABLE fairq.dead_letter IS
    'Messages that failed or ran out of attempts; fairq.dead_letter_retry puts one back.';
COMMENT ON TABLE fairq.message_history IS
    'One row per settled message (completed, dead, cancelled) while the setting fairq.history is on; read by the Spark report, trimmed by fairq.history_prune.';
