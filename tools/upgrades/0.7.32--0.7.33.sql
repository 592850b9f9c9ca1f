-- Written by hand: what tools/upgrade_script.py cannot derive from the functions.
-- @after
-- fairq.channels' next_dequeue_at is NULL when nothing is pending (a channel may keep
-- its turn after its last pending message was cancelled): described again.
COMMENT ON VIEW fairq.channels IS
    'Every channel with a policy, a pause or messages (idle channels kept for the collector are not shown), by queue, with its policy, weight and pause and its contents: size (all messages), ready (due), scheduled (future), in_flight, and next_dequeue_at (when it may next be served; NULL when nothing is pending or at max_concurrency).';
