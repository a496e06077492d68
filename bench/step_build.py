"""The Python build of a fast-path decode step, on any machine: every CUDA kernel stubbed.

Once the device needs less than ~10 ms a step, the graph's build (Python: the model's code,
the kernel wrappers, MLX's graph construction) bounds the greedy stream, which builds step
n + 1 while step n is encoded. The build is host work, so it can be priced here: the fast
path is switched on as on a CUDA GPU (`kernels.cuda_ready`, the GPU's batched schedule),
and each kernel launch is replaced by zeros of its output shapes, so that what is left is
the build and a trivial evaluation. Printed per context: the build's milliseconds per step
and per layer, then (`--profile`) the functions the build spends its time in (cProfile,
cumulative), so a change to the build can be measured before a device session.

Measured (2026-12-02): on the 2-core CI VM, 6 layers against 3 add ~130 µs a layer at 128
tokens of context and ~220 at 4096; the H200 machine's host built the 43-layer step in
6.3-7.0 ms at 128 tokens (~150 µs a layer, MLX's CUDA primitives included) and 8.7-11.3 ms
at 4096. So the figures here track the device host's, growth with the context included.

With `--count` it also prints the step's primitives a layer, as `bench_model.py` counts
them on the GPU: every kernel launch one (`Depends`: the stub ties its zeros to the
launch's inputs), then MLX's other operations and views; a launch cut shows here before a
device session.

    python bench/step_build.py [--layers 3] [--contexts 128 4096] [--steps 8] [--profile 25] [--count]
"""

from __future__ import annotations

import ds4lab  # noqa: F401  (first: OpenBLAS before MLX on Linux)

# isort: split
import argparse
import cProfile
import io
import pstats
import time

import mlx.core as mx
from bench_model import VIEWS, step_ops

from ds4lab.config import preset
from ds4lab.model import Model, kernel_cache
from ds4lab.model.random_weights import random_weights


def build_seconds(session, steps: int, profiler: cProfile.Profile | None = None) -> list[float]:
    """Seconds to build each of `steps` decode steps (each evaluated before the next is built),
    the builds alone profiled when a profiler is given."""
    out = []
    for _ in range(steps):
        mx.eval(session.state.arrays())
        if profiler:
            profiler.enable()
        t = time.perf_counter()
        logits = session.decode(999)
        out.append(time.perf_counter() - t)
        if profiler:
            profiler.disable()
        mx.eval(logits, session.state.arrays())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 4096],
                        help="tokens prefilled before the timed steps")
    parser.add_argument("--steps", type=int, default=8, help="decode steps timed after 4 warm-up steps")
    parser.add_argument("--profile", type=int, default=0, help="print this many functions of a profile of the steps")
    parser.add_argument("--count", action="store_true", help="print the step's primitives a layer, by kind")
    args = parser.parse_args()
    weights = random_weights(preset("flash-dims", args.layers), "q2")
    with kernel_cache.recorded_variants(record=False):
        for context in args.contexts:
            model = Model(weights)
            assert model.numerics.fast
            session = model.session()
            mx.eval(session.prefill([1000 + i for i in range(context)]))
            build_seconds(session, 4)
            times = sorted(build_seconds(session, args.steps))
            median = times[len(times) // 2]
            print(f"flash-dims {args.layers}L q2, {context} tokens of context: a decode step's build "
                  f"{median * 1e3:.2f} ms (median of {args.steps}; fastest {times[0] * 1e3:.2f}), "
                  f"{median / args.layers * 1e6:.0f} µs a layer")
            if args.count:
                ops = step_ops(model, session.state)
                launches = ops.pop("Depends", 0)
                views = sum(n for op, n in ops.items() if op in VIEWS)
                print(f"    a layer: {launches / args.layers:.1f} kernel launches, "
                      f"{(ops.total() - views) / args.layers:.1f} other operations, {views / args.layers:.1f} views"
                      f" (the output head's and the embedding's included); other operations in the step: "
                      + ", ".join(f"{op} {n}" for op, n in ops.most_common() if op not in VIEWS))
            if args.profile:
                profiler = cProfile.Profile()
                build_seconds(session, args.steps, profiler)
                text = io.StringIO()
                pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(args.profile)
                print(text.getvalue())


if __name__ == "__main__":
    main()
