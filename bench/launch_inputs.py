"""The host's encoding of a custom kernel launch, by how many inputs the launch takes.

A 43-layer decode step hands MLX ~520 launches and ~6200 inputs (a layer: 144 inputs over
its ~10 launches, most of them small weights: norms, HC parameters, scales). MLX pays for
every input of every launch on the encoding thread: its evaluation's graph walk (a hash map
entry), the input kept alive until the device is done (`add_temporary`), the CUDA graph's
dependency bookkeeping and the kernel's argument. On this VM's CPU backend the generic part
alone is ~0.14 µs an input (a chain of `mx.depends`). If it is a few tenths of a µs on the
GPU's host too, the step's inputs cost ~2 ms of the ~10.5 ms encoding that bounds the greedy
stream, and packing a layer's small weights into one array would pay.

This times a chain of `--launches` launches of one trivial kernel (one block: y = x + 1)
taking `k` inputs beside its chained one (small arrays already evaluated, unread), under
MLX's default graph limits: the Python build, then `mx.async_eval` (the encoding, on this
thread), then the wait for the device; per launch, the median of `--repeat` chains, for each
k, and the slope per input.

Then the price of a commit. MLX commits a CUDA graph once the inputs it has counted pass
MLX_MAX_MB_PER_BUFFER (1000 MB on an H200), counting a large input whole at every launch
that takes it: a decode step's routed-expert tensors (0.55-0.7 GB each) commit ~86 graphs a
step of ~6 launches each, where these chains commit one graph every 100 launches (the
operations limit). With `--big-every N` every N-th launch of the 4-input chain also takes a
`--big-mb` array (unread), so MLX commits every 2N launches (N = 6: as a decode step does);
the difference per launch, times 2N, is a commit's cost on the encoding thread.

    python bench/launch_inputs.py [--launches 500] [--repeat 15] [--inputs 1 4 8 16 32] [--big-every 6] [--big-mb 600]

Needs a CUDA device.
"""

from __future__ import annotations

import ds4lab  # noqa: F401  (first: OpenBLAS before MLX on Linux)

# isort: split
import argparse
import statistics
import sys
import time

import mlx.core as mx
import numpy as np

_SOURCE = "y[threadIdx.x] = x[threadIdx.x] + 1.0f;\n"


def chain(kernel, x: mx.array, extra: list[mx.array], launches: int, big: mx.array | None = None,
          every: int = 0) -> tuple[float, float, float]:
    """Seconds to build, encode and then wait for a chain of `launches` launches (every
    `every`-th launch with `big` as its last input instead of the last of `extra`)."""
    t0 = time.perf_counter()
    y = x
    for i in range(launches):
        inputs = [y, *extra[:-1], big] if every and i % every == every - 1 else [y, *extra]
        y = kernel(inputs=inputs, grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[x.shape],
                   output_dtypes=[mx.float32])[0]
    t1 = time.perf_counter()
    mx.async_eval(y)
    t2 = time.perf_counter()
    mx.eval(y)
    return t1 - t0, t2 - t1, time.perf_counter() - t2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=500)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--inputs", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    parser.add_argument("--big-every", type=int, default=6, help="0: no commit-pricing chains")
    parser.add_argument("--big-mb", type=int, default=600)
    args = parser.parse_args()
    if mx.default_device() != mx.gpu or not mx.cuda.is_available():
        sys.exit("launch_inputs.py needs a CUDA device")
    x = mx.zeros((32,), mx.float32)
    pool = [mx.array(np.full(64, i, np.float32)) for i in range(max(args.inputs))]
    mx.eval(x, pool)
    encode_per_launch = {}
    for k in args.inputs:
        names = ["x", *(f"w{i}" for i in range(k))]
        kernel = mx.fast.cuda_kernel(name=f"ds4lab_bench_inputs_{k}", input_names=names, output_names=["y"],
                                     source=_SOURCE)
        chain(kernel, x, pool[:k], 8)                                  # compiled, cached
        runs = [chain(kernel, x, pool[:k], args.launches) for _ in range(args.repeat)]
        build, encode, wait = (statistics.median(r[i] for r in runs) * 1e6 / args.launches for i in range(3))
        encode_per_launch[k] = encode
        print(f"{k + 1:3d} inputs a launch: build {build:6.2f} µs, encode {encode:6.2f} µs, "
              f"then {wait:6.2f} µs waiting, a launch (median of {args.repeat} chains of {args.launches})")
    ks = sorted(encode_per_launch)
    if len(ks) > 1:
        slope = np.polyfit(ks, [encode_per_launch[k] for k in ks], 1)[0]
        print(f"encoding: {slope:.3f} µs an input (least squares over {len(ks)} input counts)")
    if args.big_every:
        big = mx.zeros((args.big_mb << 20,), mx.uint8)          # MLX counts elements, so bytes here
        names = ["x", *(f"w{i}" for i in range(4))]
        kernel = mx.fast.cuda_kernel(name="ds4lab_bench_inputs_big", input_names=names, output_names=["y"],
                                     source=_SOURCE)
        per_launch = {}
        for every in (0, args.big_every):
            chain(kernel, x, pool[:4], 8, big, every)
            runs = [chain(kernel, x, pool[:4], args.launches, big, every) for _ in range(args.repeat)]
            per_launch[every] = statistics.median(r[1] for r in runs) * 1e6 / args.launches
        commit = (per_launch[args.big_every] - per_launch[0]) * 2 * args.big_every
        print(f"5 inputs a launch: encode {per_launch[0]:6.2f} µs a launch committed every 100 launches, "
              f"{per_launch[args.big_every]:6.2f} with a {args.big_mb} MB input every {args.big_every} "
              f"(a commit every {2 * args.big_every}): a commit {commit:.1f} µs of encoding")


if __name__ == "__main__":
    main()
