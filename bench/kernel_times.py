"""Device time of each kernel of a decode step, from Nsight Compute (`ncu`), against the
step's wall time.

`step_costs.py` can only time kernels from the host, where a launch's fixed costs (~20 µs
evaluated alone) and its overlap with the next launch's encoding hide the device's share.
This runs an N-layer flash-dims q2 model (random weights, in memory), prefills `--context`
tokens, decodes untimed steps (compiling everything), times `--steps` decode steps, then
decodes `--steps` more with the CUDA profiler on, under `ncu` (which it starts itself, on
this same script, with `--profile-from-start off`: only those steps are measured). Printed
per kernel name: launches per step, mean µs per launch, µs per step and per layer, and its
share of the kernels' device time; then the kernels' sum per step beside the step's wall
time (under ncu each kernel runs alone, serialised, so the sum is the device's floor).
Caches are left as they run (`--cache-control none`): a kernel finds in L2 what the one
before it wrote, as in a step. Clocks are locked at the base clock (ncu's default). They
were left unlocked (`--clock-control none`) until 2026-12-03, and the ranking then gave
decode attention ~60 µs a layer at 128 tokens, several times what its ~160 keys need: with
launches serialised and host gaps between them, the SM clock may fall toward idle (the H200
idles at 345 MHz). Base clock is below boost, so durations read ~15-30% long, alike for
every kernel.

    python bench/kernel_times.py [--layers 4] [--context 128] [--steps 4] [--ncu /usr/local/cuda/bin/ncu]
    python bench/kernel_times.py --details attention_heads [--launches 2]
    python bench/kernel_times.py --sequence      # also the first step's launches in order
    python bench/kernel_times.py --set _EXPERT_WARPS=8,_ATTENTION_WARPS=8   # a launch variant (kernel_variants.py)
    python bench/kernel_times.py --details expert_swiglu --sections MemoryWorkloadAnalysis_Tables

`--details NAME` prints instead ncu's own report of the first `--launches` launches of the
kernels whose name contains NAME in those steps: speed of light (the share of the device's
memory and compute peaks reached), memory workload, launch statistics, occupancy and warp
stall reasons, what a kernel's rewrite needs to know first.

Needs a CUDA device and `ncu` (the CUDA toolkit's); on the H200 machine it is
/usr/local/cuda/bin/ncu. Nothing runs on the CPU.
"""

from __future__ import annotations

import ds4lab  # noqa: F401  (first: OpenBLAS before MLX on Linux)

# isort: split
import argparse
import csv
import ctypes
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

import mlx.core as mx
from kernel_variants import parse_variant
from step_costs import decoding_session

from ds4lab.config import preset
from ds4lab.model import kernels
from ds4lab.model.random_weights import random_weights

# Set in the child that ncu runs: the script profiles instead of reporting.
_CHILD = "DS4LAB_KERNEL_TIMES_CHILD"
_METRIC = "gpu__time_duration.sum"
# ncu's report sections for `--details`: where a kernel stands against the peaks, and why its
# warps wait.
_SECTIONS = ("SpeedOfLight", "MemoryWorkloadAnalysis", "LaunchStats", "Occupancy", "WarpStateStats")


def decode_steps(layers: int, context: int, steps: int, profile: bool) -> float:
    """Seconds per decode step (wall, `steps` steps after a warm-up); with `profile`, the
    CUDA profiler is on for `steps` more steps."""
    _, session = decoding_session(random_weights(preset("flash-dims", layers), "q2"), context)
    t = time.perf_counter()
    for _ in range(steps):
        mx.eval(session.decode(999))
    wall = (time.perf_counter() - t) / steps
    if profile:
        driver = ctypes.CDLL("libcuda.so.1")
        driver.cuProfilerStart()
        for _ in range(steps):
            mx.eval(session.decode(999))
        driver.cuProfilerStop()
    return wall


def kernel_name(name: str) -> str:
    """A kernel's name without its namespace, template arguments and parameter list."""
    name = re.sub(r"\(.*\)$", "", name.removeprefix("void "))
    name = re.sub(r"<.*>", "", name)
    return name.rsplit("::", 1)[-1]


def launches(report: str) -> list[tuple[str, float]]:
    """(kernel name, nanoseconds) of each launch in launch order, from ncu's CSV
    (`--csv --print-units base`)."""
    start = report.find('"ID"')
    if start < 0:
        raise ValueError("ncu's output holds no CSV table (did it profile anything?):\n" + report[-2000:])
    return [(kernel_name(row["Kernel Name"]), float(row["Metric Value"].replace(",", "")))
            for row in csv.DictReader(io.StringIO(report[start:])) if row.get("Metric Name") == _METRIC]


def per_kernel(report: str) -> dict[str, list[float]]:
    """Nanoseconds of each launch, by kernel name."""
    times: dict[str, list[float]] = defaultdict(list)
    for name, ns in launches(report):
        times[name].append(ns)
    return times


def sequence(report: str, steps: int) -> None:
    """The first profiled step's launches in order: where in the step (which layer's
    attention, which sublayer) the device's time goes."""
    step = launches(report)
    step = step[:len(step) // steps]
    print(f"{'#':>4s} {'µs':>8s}  kernel (the first profiled step, in launch order)")
    for index, (name, ns) in enumerate(step):
        print(f"{index:4d} {ns / 1e3:8.2f}  {name}")


def report(times: dict[str, list[float]], steps: int, layers: int, wall: float) -> None:
    total = sum(sum(v) for v in times.values()) / steps
    print(f"{'kernel':40s} {'per step':>8s} {'µs each':>8s} {'µs/step':>9s} {'µs/layer':>9s} {'share':>6s}")
    for name, ns in sorted(times.items(), key=lambda kv: -sum(kv[1])):
        per_step = sum(ns) / steps
        print(f"{name[:40]:40s} {len(ns) / steps:8.1f} {sum(ns) / len(ns) / 1e3:8.2f} {per_step / 1e3:9.1f} "
              f"{per_step / layers / 1e3:9.1f} {per_step / total:6.1%}")
    print(f"kernels' device time per step {total / 1e6:.3f} ms ({sum(len(v) for v in times.values()) / steps:.0f} "
          f"launches); the step's wall time without ncu {wall * 1e3:.3f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--context", type=int, default=128, help="tokens prefilled before the steps")
    parser.add_argument("--steps", type=int, default=4, help="decode steps timed, and then profiled")
    parser.add_argument("--ncu", default=shutil.which("ncu") or "/usr/local/cuda/bin/ncu")
    parser.add_argument("--details", metavar="NAME", help="ncu's sections for the kernels whose name contains NAME")
    parser.add_argument("--launches", type=int, default=2, help="launches reported with --details")
    parser.add_argument("--sequence", action="store_true", help="also print the first step's launches in order")
    parser.add_argument("--set", default="base", metavar="NAME=VALUE,...",
                        help="integer constants of ds4lab.model.kernels to change first (kernel_variants.py)")
    parser.add_argument("--sections", nargs="+", default=list(_SECTIONS), help="ncu's sections for --details")
    args = parser.parse_args()
    for name, value in parse_variant(args.set).items():
        setattr(kernels, name, value)
    if os.environ.get(_CHILD):
        decode_steps(args.layers, args.context, args.steps, profile=True)
        return
    if not kernels.cuda_ready():
        sys.exit("kernel_times.py needs a CUDA device (the fast path's kernels)")
    if not os.path.exists(args.ncu):
        sys.exit(f"no ncu at {args.ncu} (--ncu PATH)")
    if args.details:
        what = ["--kernel-name", f"regex:{re.escape(args.details)}", "--launch-count", str(args.launches),
                *(arg for section in args.sections for arg in ("--section", section))]
    else:
        what = ["--metrics", _METRIC, "--csv", "--print-units", "base"]
        wall = decode_steps(args.layers, args.context, args.steps, profile=False)
        mx.clear_cache()                             # the child builds its own model
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "ncu.txt")
        run = subprocess.run([args.ncu, "--profile-from-start", "off", *what, "--cache-control", "none",
                              "--clock-control", "base", "--log-file", log, sys.executable, *sys.argv],
                             env={**os.environ, _CHILD: "1"}, capture_output=True, text=True)
        text = open(log).read() if os.path.exists(log) else ""
    if run.returncode != 0:
        sys.exit(f"ncu failed ({run.returncode}):\n{run.stderr[-3000:]}\n{text[-2000:]}")
    if args.details:
        print(text)
        return
    print(f"device {mx.default_device()}, flash-dims {args.layers}L q2, {args.context} tokens of context, "
          f"{args.steps} decode steps under ncu")
    report(per_kernel(text), args.steps, args.layers, wall)
    if args.sequence:
        sequence(text, args.steps)


if __name__ == "__main__":
    main()
