"""Decode throughput of ds4lab.quants per type, numpy and MLX (MB/s of encoded input).

Usage: python bench/bench_quants.py [--mb 16] [--repeat 5]
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx
import numpy as np

from ds4lab.quants import FORMATS, dequantize, dequantize_mx, random_blocks


def best_seconds(repeat: int, fn, *args) -> float:
    fn(*args)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return min(times)


def decode_mx(raw: mx.array, type_name: str, shape: tuple[int, ...]) -> None:
    mx.eval(dequantize_mx(raw, type_name, shape))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=16.0, help="encoded bytes per tensor, in MB")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    print(f"MLX device: {mx.default_device()}")
    print(f"{'type':8} {'numpy MB/s':>11} {'mlx MB/s':>9}")
    for name, fmt in FORMATS.items():
        n_blocks = int(args.mb * 1e6) // fmt.block_bytes // 256 * 256
        raw = random_blocks(name, n_blocks, rng, d=0.01)
        shape = (n_blocks * fmt.block_elems // 256, 256)
        t_np = best_seconds(args.repeat, dequantize, raw, name, shape)
        t_mx = best_seconds(args.repeat, decode_mx, mx.array(raw), name, shape)
        print(f"{name:8} {raw.nbytes / t_np / 1e6:11.0f} {raw.nbytes / t_mx / 1e6:9.0f}")


if __name__ == "__main__":
    main()
