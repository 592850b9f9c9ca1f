-- 0.7.8 -> 0.7.9: a channel's wakes indexed by due time too (fairq.woken_here and
-- fairq.wake_candidates read one entry, not all of the channel's wakes).
DROP INDEX fairq.channel_wake_channel_ix;
CREATE INDEX channel_wake_channel_ix ON fairq.channel_wake (channel_id, due_at);
