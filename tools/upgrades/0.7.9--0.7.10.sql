-- 0.7.9 -> 0.7.10: message_locked_ix is partial on locked_until, not status, so that
-- a channel's locked messages are looked up in message_locked_channel_ix only.
DROP INDEX fairq.message_locked_ix;
CREATE INDEX message_locked_ix ON fairq.message (queue_id, locked_until)
    WHERE locked_until IS NOT NULL;
