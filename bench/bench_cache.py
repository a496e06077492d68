"""Simulated requests per second of the cache simulator on a 100k-request coding-agent trace.

Target: >= 2,000 requests/s per policy on a 2-core CPU. Usage: python bench/bench_cache.py [N]
"""

from __future__ import annotations

import sys
import time

import ds4lab  # noqa: F401  (first: BLAS before anything else)
from ds4lab.cache.simulate import simulate, summary
from ds4lab.cache.workloads import coding_agent_trace


def main(n: int = 100_000) -> None:
    t0 = time.perf_counter()
    records = coding_agent_trace(n, n_users=16, seed=1)
    print(f"trace: {n} requests, 16 users, generated in {time.perf_counter() - t0:.1f} s")
    for policy in ("ds4@ba00a8a", "ds4@8d57664", "lru"):
        t0 = time.perf_counter()
        events = simulate(records, policy, 4096 << 20)
        dt = time.perf_counter() - t0
        s = summary(events)
        print(f"{policy:12s} {n / dt:8.0f} requests/s  ({len(events)} events, disk hit rate {s['disk_hit_rate']:.3f}, "
              f"{s['evictions']} evictions)")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 100_000)
