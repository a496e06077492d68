"""Where the greedy stream's time goes, step by step: the four phases of its loop.

`generation.stream` (greedy, fast path) overlaps two threads: the generator builds step n + 1's
graph (Python and MLX's graph construction) while a worker encodes step n (`mx.async_eval`:
MLX's eval loop and the CUDA graph nodes); the generator then waits for the worker (settle)
and for the device's token of step n. A step costs the longest of these paths, so this times
each phase of each step in the real loop, by wrapping the session's `decode` (build), the
worker's `mx.async_eval` (encode) and the generator's `settle`, and prints their medians
beside the step's period; the rest of the generator's step is mostly its token read (a wait
for the device). With `--empty-kernels` (bench_model's) the
device does almost nothing: what is left is the host's share.

    python bench/stream_phases.py [--layers 43] [--context 4096] [--steps 32] [--empty-kernels]

On a CUDA device; elsewhere the fast path, and with it the worker, is off (no encode or settle).
"""

from __future__ import annotations

import ds4lab  # noqa: F401  (first: OpenBLAS before MLX on Linux)

# isort: split
import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import mlx.core as mx
from bench_model import WARM_STEPS, empty_kernel_bodies

from ds4lab import generation
from ds4lab.config import preset
from ds4lab.model import Model
from ds4lab.model.random_weights import random_weights


def timed(phases: dict[str, list[float]], name: str, fn: Callable) -> Callable:
    """fn, its every call's seconds appended to phases[name]."""
    def call(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            phases[name].append(time.perf_counter() - t)
    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=43)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--empty-kernels", action="store_true", help="every custom kernel returns at once")
    args = parser.parse_args()
    if args.empty_kernels:
        empty_kernel_bodies()
    model = Model(random_weights(preset("flash-dims", args.layers), "q2"))
    session = model.session()
    mx.eval(session.prefill([1000 + i % 50000 for i in range(args.context)]))
    start = session.snapshot()
    for _ in generation.stream(model, [], max_tokens=WARM_STEPS, session=session):
        pass
    session.restore(start)
    phases: dict[str, list[float]] = defaultdict(list)
    saved = generation._WorkerEncoder.settle, mx.async_eval
    session.decode = timed(phases, "build", session.decode)
    generation._WorkerEncoder.settle = timed(phases, "settle (wait for the worker)", saved[0])
    mx.async_eval = timed(phases, "encode (worker)", saved[1])
    t = time.perf_counter()
    try:
        n = sum(1 for _ in generation.stream(model, [], max_tokens=args.steps, session=session))
    finally:
        generation._WorkerEncoder.settle, mx.async_eval = saved
    period = (time.perf_counter() - t) / n
    print(f"flash-dims {args.layers}L q2, {args.context} tokens of context"
          f"{', kernels empty' if args.empty_kernels else ''}: {n} steps, {1 / period:.1f} tok/s, "
          f"{period * 1e3:.2f} ms a step; medians per step (ms):")
    for name, values in phases.items():
        print(f"    {name:30s} {statistics.median(values) * 1e3:7.2f}  (calls {len(values)})")
    rest = period - sum(statistics.median(phases[name]) for name in ("build", "settle (wait for the worker)")
                        if phases[name])
    print(f"    {'rest of the generator (token)':30s} {rest * 1e3:7.2f}")


if __name__ == "__main__":
    main()
