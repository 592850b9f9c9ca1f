-- Written by hand: what tools/upgrade_script.py cannot derive from the functions.
-- A dequeue that finds more of a channel's scheduled messages come due than it
-- promotes at once (fairq.promotions_per_serve()) promotes the first of them by
-- priority from this index. Building it reads fairq.message once, and producers and
-- workers wait for that (CREATE INDEX in the upgrade's transaction).
CREATE INDEX message_scheduled_priority_ix ON fairq.message (channel_id, priority DESC, dequeue_at, id)
    WHERE status = 'scheduled';
