"""Device time a kernel pays to read a small input, by where MLX put the input.

The fast path hands its kernels small constants made from host values (`kernels._constant`:
eps values, the SwiGLU clamp, a compressor's frontier row, key counts), and MLX's CUDA
allocator places an array by its size and origin (mlx/backend/cuda/allocator.cpp):
- 8 bytes or less, made anywhere (host values or a kernel's output): its scalar pool,
  managed memory advised as accessed by the GPU: it stays in host memory and the GPU reads
  it over the bus;
- larger and made from host values: managed memory, moved to the GPU at the first kernel
  that touches it (a page fault), then read there;
- larger and made by a kernel: device memory.
Every warp of `expert_swiglu` reads its clamp, every thread of `compressor_slot` its row.
This times a chain of launches of one kernel whose every warp reads one float of a small
input and writes one float, evaluated as one CUDA graph (MLX's graph limits raised here, as
`device_time_ab.py` does), so that the wait after the encoding is the device's time: per
launch, the fastest of `--repeat` chains, for each placement; and with a new array of host
values at every launch, as a length that grows with the context is (the attention's key
counts: a new `_constant` every few tokens on a ratio-4 layer).

    python bench/small_inputs.py [--launches 400] [--blocks 1056] [--repeat 5]

Needs a CUDA device.
"""

from __future__ import annotations

import os

os.environ.setdefault("MLX_MAX_OPS_PER_BUFFER", "1000000")
os.environ.setdefault("MLX_MAX_MB_PER_BUFFER", "100000000")

import ds4lab  # noqa: F401  (first: OpenBLAS before MLX on Linux)

# isort: split
import argparse
import sys
import time
from collections.abc import Callable

import mlx.core as mx

from ds4lab.model import kernels

_SOURCE = """
const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
y[i] = x[i] * c[0] + 1.0f;
"""


def chain_seconds(kernel, x: mx.array, c: Callable[[int], mx.array], launches: int, blocks: int) -> float:
    """Seconds from the end of the encoding to the end of `launches` chained launches, launch i
    reading `c(i)`."""
    y = x
    for i in range(launches):
        y = kernel(inputs=[y, c(i)], grid=(blocks * 256, 1, 1), threadgroup=(256, 1, 1), output_shapes=[x.shape],
                   output_dtypes=[mx.float32])[0]
    mx.async_eval(y)
    t = time.perf_counter()
    mx.eval(y)
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=400)
    parser.add_argument("--blocks", type=int, default=1056, help="thread blocks of 256 a launch")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    if not kernels.cuda_ready():
        sys.exit("small_inputs.py needs a CUDA device")
    kernel = mx.fast.cuda_kernel(name="ds4lab_small_input_read", input_names=["x", "c"], output_names=["y"],
                                 source=_SOURCE)
    x = mx.zeros((args.blocks * 256,), mx.float32)
    device_made = mx.ones((4,), mx.float32) * 0.5          # a kernel's output: device memory
    device_scalar = mx.ones((1,), mx.float32) * 0.5        # a kernel's output of 4 bytes: the scalar pool
    mx.eval(x, device_made, device_scalar)
    host_scalar, host_quad = mx.array([0.5], mx.float32), mx.array([0.5, 0.0, 0.0, 0.0], mx.float32)
    placements: dict[str, Callable[[int], mx.array]] = {
        "kernel output, 16 bytes (device memory)": lambda i: device_made,
        "kernel output, 4 bytes (scalar pool: host memory)": lambda i: device_scalar,
        "host values, 4 bytes (scalar pool: host memory)": lambda i: host_scalar,
        "host values, 16 bytes (managed, moved on first use)": lambda i: host_quad,
        # A new array each launch, as a length that grows with the context is (`_constant`):
        "new host values each launch, 4 bytes (scalar pool)": lambda i: mx.array([0.5 + i], mx.float32),
        "new host values each launch, 16 bytes (managed: a first use each)":
            lambda i: mx.array([0.5 + i, 0.0, 0.0, 0.0], mx.float32),
    }
    base = None
    for name, c in placements.items():
        chain_seconds(kernel, x, c, 8, args.blocks)          # compiled, first touched, graphs made
        best = min(chain_seconds(kernel, x, c, args.launches, args.blocks) for _ in range(args.repeat))
        per = best / args.launches * 1e6
        base = per if base is None else base
        print(f"{name:55s} {per:7.2f} µs a launch ({per - base:+6.2f} against the first)")
    print(f"({args.launches} chained launches of {args.blocks} blocks of 256 threads, each warp reading the input; "
          f"the fastest of {args.repeat} chains, one CUDA graph each)")


if __name__ == "__main__":
    main()
