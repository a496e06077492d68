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

    python bench/launch_inputs.py [--launches 500] [--repeat 15] [--inputs 1 4 8 16 32]

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


def chain(kernel, x: mx.array, extra: list[mx.array], launches: int) -> tuple[float, float, float]:
    """Seconds to build, encode and then wait for a chain of `launches` launches."""
    t0 = time.perf_counter()
    y = x
    for _ in range(launches):
        y = kernel(inputs=[y, *extra], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[x.shape],
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


if __name__ == "__main__":
    main()
