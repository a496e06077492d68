"""Quantize speed of ds4lab.quants.quantize: a 2048x4096 matrix per type (IQ2_XXS budget: 10 s).

ds4's C quantizer takes 3-4 s for the IQ2_XXS case; the numpy port must stay under 10 s on
CI's 2-core CPU. Wall time is the figure that counts; CPU time (all threads) is printed too,
because on a shared machine the wall time also measures the neighbours.

Usage: python bench/bench_quantize.py [--rows 2048] [--cols 4096] [--repeat 1]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from ds4lab.quants import QUANTIZABLE, quantize
from ds4lab.quants.quantize import usable_cpus

IQ2_XXS_BUDGET_S = 10.0


def timed(repeat: int, fn, *args) -> tuple[float, float]:
    """Best wall seconds over `repeat` runs, and the CPU seconds of that run."""
    best = (float("inf"), 0.0)
    for _ in range(repeat):
        wall, cpu = time.perf_counter(), time.process_time()
        fn(*args)
        best = min(best, (time.perf_counter() - wall, time.process_time() - cpu))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((args.rows, args.cols)) * 0.02).astype(np.float32)
    importance = rng.lognormal(0.0, 1.5, args.cols).astype(np.float32)
    quantize(x[:1], "IQ2_XXS")  # build the IQ2_XXS grid tables outside the timing
    cpus = usable_cpus()
    print(f"{args.rows}x{args.cols} float32, {cpus} usable CPUs")
    print(f"{'type':8} {'importance':>10} {'wall s':>7} {'cpu s':>7} {'wall / 10 s':>11}")
    for type_name in ("IQ2_XXS", *(t for t in QUANTIZABLE if t != "IQ2_XXS")):
        for imp in (None, importance):
            wall, cpu = timed(args.repeat, quantize, x, type_name, imp)
            ratio = f"{wall / IQ2_XXS_BUDGET_S:11.2f}" if type_name == "IQ2_XXS" else ""
            print(f"{type_name:8} {'yes' if imp is not None else 'no':>10} {wall:7.2f} {cpu:7.2f} {ratio}")


if __name__ == "__main__":
    main()
