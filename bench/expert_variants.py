"""The routed-expert kernels of a decode step timed alone, under variants of their launch.

A 43-layer step spends ~100 µs a layer in `expert_swiglu` (the six routed experts' IQ2_XXS
gate, up and SwiGLU, the shared expert's Q8_0 ones beside them) and the down `expert_matvec`
(Q2_K, the six summed), far from the H200's bandwidth; a whole step's device time moves 6%
between runs of the same code (`device_time_ab.py`), more than a change to one kernel does.
This times the two kernels alone on Flash's shapes with 256 experts, so that the expert
matrices (1.9 GB) come from DRAM as in a step: `--calls` launches in one evaluation, each on
its own six random experts (the host's encoding of them runs ahead of the device), the
fastest of 5 evaluations. Printed per variant and kernel: µs a launch and the expert bytes
it read per second.

A variant is device_time_ab.py's: NAME=VALUE,... for integer constants of
`ds4lab.model.kernels` ("base": the code as it is).

    python bench/expert_variants.py [--calls 40] [--variants base _IQ2_GRID_COPIES=1 _EXPERT_SWIGLU_WARPS=4]

Needs a CUDA device.
"""

from __future__ import annotations

import ds4lab  # noqa: F401  (first: OpenBLAS before MLX on Linux)

# isort: split
import argparse
import time

import mlx.core as mx
from device_time_ab import parse_variant

from ds4lab.model import kernels
from ds4lab.model.random_weights import _expert_blocks
from ds4lab.model.weights import Q8Matrix

N_EXPERT, N_USED, HIDDEN, MID = 256, 6, 4096, 2048


def _q8_matrix(rows: int, cols: int) -> Q8Matrix:
    codes = mx.random.randint(0, 256, (rows, cols)).astype(mx.uint8)
    scales = mx.random.uniform(1e-3, 1e-2, (rows, cols // 32))
    return Q8Matrix(mx.view(codes, mx.uint32).reshape(rows, cols // 4), scales, -128.0 * scales, rows, cols)


def seconds_per_launch(launch, calls: int) -> float:
    """Device seconds a launch: `calls` launches, each on its own random experts, in one
    evaluation; the fastest of 5."""
    ids = [mx.argsort(mx.random.uniform(shape=(1, N_EXPERT)), axis=1)[:, :N_USED].astype(mx.int32)
           for _ in range(calls)]
    mx.eval(ids, launch(ids[0]))
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        mx.eval([launch(i) for i in ids])
        best = min(best, time.perf_counter() - t)
    return best / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--variants", nargs="+", default=["base"])
    args = parser.parse_args()
    if not kernels.cuda_ready():
        raise SystemExit("expert_variants: needs a CUDA device (the fast path's kernels)")
    gate, up = (_expert_blocks("IQ2_XXS", N_EXPERT, MID, HIDDEN) for _ in range(2))
    down = _expert_blocks("Q2_K", N_EXPERT, HIDDEN, MID)
    shared = (_q8_matrix(MID, HIDDEN), _q8_matrix(MID, HIDDEN))
    x, mid = mx.random.normal((1, HIDDEN)), mx.random.normal((1, N_USED, MID))
    weights = mx.full((1, N_USED), 0.5)
    per_expert = gate.raw.nbytes // N_EXPERT
    cases = {
        "expert_swiglu IQ2_XXS": (lambda i: kernels.expert_swiglu(gate, up, i, x, weights, 10.0), 2 * per_expert),
        "expert_swiglu + shared Q8_0": (lambda i: kernels.expert_swiglu(gate, up, i, x, weights, 10.0, shared)[0],
                                        2 * per_expert + 2 * MID * HIDDEN * 34 // 32 / N_USED),
        "expert_matvec Q2_K down": (lambda i: kernels.expert_matvec(down, i, mid, sum_pairs=True),
                                    down.raw.nbytes // N_EXPERT),
    }
    for text in args.variants:
        saved = {name: getattr(kernels, name) for name in parse_variant(text)}
        for name, value in parse_variant(text).items():
            setattr(kernels, name, value)
        for what, (launch, nbytes) in cases.items():
            s = seconds_per_launch(launch, args.calls)
            print(f"{text:40s} {what:30s} {s * 1e6:7.1f} µs ({N_USED * nbytes / s / 1e9:6.0f} GB/s)", flush=True)
        for name, value in saved.items():
            setattr(kernels, name, value)


if __name__ == "__main__":
    main()
