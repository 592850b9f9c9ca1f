"""How big a bench run is: :class:`Sizes` and the ``full``, ``quick`` and ``tiny`` presets."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FULL", "QUICK", "TINY", "Sizes"]


@dataclass(frozen=True)
class Sizes:
    """How big every scenario is."""

    name: str
    throughput_s: int = 30          # each pgbench throughput run (-T)
    producers: int = 8
    consumers: int = 8
    channels: int = 100
    channel_spread: str = "uniform"  # how producers pick channels: "uniform" or "zipf"
    prefill: int = 4_000            # backlog before a throughput run, so consumers start busy
    throughput_backlog: int = 8_000  # producers of a throughput run pause above this backlog
    batch: int = 100
    wide_channels: int = 1_000      # the batched reference where channels outnumber batches
    depth_levels: tuple[int, ...] = (1_000, 10_000, 100_000, 1_000_000)
    depth_channels: int = 100
    latency_samples: int = 1_000
    channel_levels: tuple[int, ...] = (10, 100, 1_000, 10_000, 100_000)
    fair_heavy: int = 100_000
    fair_light_tenants: int = 20
    fair_light_rate: float = 200.0  # light messages per second, all light tenants together
    fair_consumers: int = 4
    fair_phase_s: float = 20.0
    jain_tenants: int = 10
    jain_window_s: float = 10.0
    soak_messages: int = 1_000_000
    soak_producers: int = 8
    soak_consumers: int = 8
    soak_backlog: int = 20_000      # producers pause above this backlog
    soak_max_s: float = 900.0       # the soak also stops here (then reports what it did)
    load_chunk: int = 300           # rows per message_create_batch call when loading
    load_workers: int = 2
    tenant_levels: tuple[int, ...] = (100, 1_000, 10_000, 100_000)  # the tenant axis
    churn_messages: int = 1_000_000
    churn_tenants: int = 100_000    # tenants the churn soak ever sees
    churn_window: int = 1_000       # tenants receiving messages at any one time
    churn_max_s: float = 1_200.0    # the churn soak also stops here
    weight_rounds: int = 10         # rounds of 55 deliveries over channels of weights 1..10
    queue_deep: int = 1_000_000     # the deep queue beside a small one


FULL = Sizes("full")
QUICK = Sizes(
    "quick", throughput_s=6, prefill=2_000, throughput_backlog=4_000,
    depth_levels=(1_000, 10_000, 100_000),
    latency_samples=300, channel_levels=(10, 1_000, 10_000), fair_heavy=10_000,
    fair_phase_s=6.0, jain_window_s=4.0, soak_messages=100_000, soak_backlog=10_000,
    soak_max_s=40.0, tenant_levels=(100, 1_000, 10_000), churn_messages=100_000,
    churn_tenants=10_000, churn_max_s=60.0, queue_deep=100_000)
TINY = Sizes(
    "tiny", throughput_s=1, producers=2, consumers=2, channels=10, prefill=200, batch=20,
    wide_channels=40,
    throughput_backlog=400,
    depth_levels=(100, 1_000), depth_channels=10, latency_samples=30,
    channel_levels=(10, 200), fair_heavy=300, fair_light_tenants=4, fair_light_rate=50.0,
    fair_consumers=2, fair_phase_s=1.0, jain_tenants=4, jain_window_s=0.5,
    soak_messages=2_000, soak_producers=2, soak_consumers=2, soak_backlog=1_000,
    soak_max_s=60.0, load_chunk=500, tenant_levels=(10, 100), churn_messages=2_000,
    churn_tenants=200, churn_window=20, churn_max_s=60.0, weight_rounds=3, queue_deep=2_000)
