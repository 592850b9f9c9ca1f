-- Written by hand: what tools/upgrade_script.py cannot derive from the functions.
-- The dashboard's list of recovered messages read every message to find the few
-- whose lock had expired; this index holds only those. Building it reads
-- fairq.message once, and producers and workers wait for that (CREATE INDEX in the
-- upgrade's transaction: 0.1 s for a million messages in memory on the 2-core
-- machine of docs/bench.md; reading them from disk takes longer).
CREATE INDEX message_recovered_ix ON fairq.message (id) WHERE recovered;
