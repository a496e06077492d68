"""Cost of the hook points, and memory of a one-point cache on a long prompt.

1. Forward time with hook points present but unused, against the same forward with every
   point bypassed (the registry's `fire` swapped for the identity): the ratio should stay
   within 1.03.
2. Peak RSS added by `run_with_cache` of one point over a long prompt against the bytes
   that point holds (`cache_estimate`): the cache must not keep what was not asked for.

    python bench/bench_hooks.py [--tokens 2048]
"""

from __future__ import annotations

import ds4lab  # first: OpenBLAS before MLX on Linux

# isort: split
import argparse
import resource
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from ds4lab.synth import make_model


def best_of(fn, n: int = 5) -> float:
    fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        path = make_model(Path(tmp) / "tiny.gguf", "tiny", "q2", seed=0)[0]
        model = ds4lab.load(path)
        tokens = list(range(1000, 1128))
        with_points = best_of(lambda: model(tokens))
        registry_fire = model._hooks.fire
        model._hooks.fire = lambda name, value: value
        bypassed = best_of(lambda: model(tokens))
        model._hooks.fire = registry_fire
        print(f"forward of {len(tokens)} tokens: hook points present {with_points * 1e3:.1f} ms, "
              f"bypassed {bypassed * 1e3:.1f} ms, ratio {with_points / bypassed:.3f} (target <= 1.03)")

        long = [1000 + (i * 7919) % 50000 for i in range(args.tokens)]
        name = "blocks.3.hook_resid_post"
        asked = model.cache_estimate([name], len(long))
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        logits, cache = model.run_with_cache(long, [name])
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print(f"run_with_cache of {name} over {len(long)} tokens: asked {asked / 2**20:.1f} MiB, "
              f"held {cache[name].nbytes / 2**20:.1f} MiB, peak RSS grew {(peak - before) / 2**20:.1f} MiB "
              f"(the returned logits alone: {logits.nbytes / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
