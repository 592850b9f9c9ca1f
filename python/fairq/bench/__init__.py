"""``fairq bench``: fairq against the physical floor, measured side by side.

Every scenario is measured in the same run as its reference, on the same server:

* throughput (``pgbench -M prepared`` custom scripts, 8 producer + 8 consumer clients
  in two concurrent pgbench processes, bounded by ``-T``): the plain-SQL *floor*
  (INSERT; ``UPDATE … WHERE id = (SELECT … FOR UPDATE SKIP LOCKED LIMIT 1)``; DELETE —
  three transactions per message), the seed article's FIFO queue, and fairq's
  create → dequeue → complete cycle over 100 channels; then all of it again with 100
  messages per call, and fairq's cycle while another session holds a REPEATABLE READ
  snapshot open. Two references carry no target: the floor under the same held
  snapshot, and fairq's batched cycle over ``wide_channels`` (1,000) channels. The
  same method is applied to floor, FIFO and fairq: producers pause while the backlog
  is at ``throughput_backlog`` (a steady state, see ``fairq.bench.throughput``), and
  the rate is messages consumed (sequence advance minus backlog growth), but no more
  than were produced, over the measured seconds;
* dequeue latency (one client, Python, sequential calls): median against queue depth
  and against the number of non-empty channels;
* fairness (Python threads): p99 create → dequeue wait of light tenants with and
  without a heavy tenant's backlog, and Jain's index of service among backlogged
  tenants;
* soak (Python threads, batches of 100): throughput over a long run, table and index
  sizes before and after;
* tenants (fairq.bench.tenants): the throughput cycle, single and batched, over 100 to
  100,000 channels and over a Zipf spread, each against the floor, interleaved;
* churn (fairq.bench.churn): the soak's driver over tenants that come and go;
  throughput and fairq.channel's size and rows per tenth.

Without ``--dsn`` a throwaway cluster with durable settings is started on 127.0.0.1
and removed afterwards. With ``--dsn`` the database must be dedicated to the bench:
the bench refuses to start if fairq already holds data, and it truncates fairq's
tables between scenarios.

One module per job: ``sizes`` (how big), ``database`` (the reference tables, loading,
resets), ``workloads`` and ``pgbench`` (the throughput scripts and their runner),
``throughput`` (the harness), ``latency``, ``fairness``, ``soak``, ``tenants`` and
``churn`` (the scenarios), ``machine`` (what a result was measured on), ``suite`` (the
whole run), ``targets``, ``output`` (table and JSON), ``plots`` and ``cli``.
"""

from fairq.bench.cli import main
from fairq.bench.sizes import FULL, QUICK, TINY, Sizes
from fairq.bench.suite import run
from fairq.bench.targets import TARGETS

__all__ = ["FULL", "QUICK", "TARGETS", "TINY", "Sizes", "main", "run"]
