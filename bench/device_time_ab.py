"""A decode step's device time under variants of the fast path's launch geometry, in one run.

The greedy stream is bound by the device once a step's kernels take longer than its host
work (2026-12-03, 43 layers at 4096 tokens: built in 5.8 ms, encoded in 6.2 ms, then 13.3 ms
of device time). A geometry constant of `ds4lab.model.kernels` (how many thread blocks share
a head's keys, how many rows a warp of a Q8_0 product takes) changes that device time, and
runs on different machines differ by more than such a change, so the variants are compared
in one process on one model: the step is evaluated as one CUDA graph
(MLX_MAX_OPS_PER_BUFFER and MLX_MAX_MB_PER_BUFFER past its size, set here), so that nothing
runs before its encoding ends and the wait that follows is the device's time (the graph's
update included, the same in every variant). Printed per variant: the fastest of `--repeat`
steps' wait, and its ratio to the first variant's.

A variant is a comma-separated list of NAME=VALUE for module constants of
`ds4lab.model.kernels` (ints); "base" is the code as it is. Between variants the sublayers
are traced again (their kernels' templates change) and each variant's step is warmed first.
A variant "without:NAME" answers every launch of the kernels whose name contains NAME with
zeros of its output shapes (made on the device, after its inputs): the step's device time
less that kernel's, in place, with the step's own caches and clocks (ncu times a launch
alone, caches flushed, at base clock). Its logits are garbage; a stubbed `router` also sends
every token to expert 0, so read it as an upper bound of nothing. (On the H200 the stubs of
`q8_matvec` and `attention` ended in an illegal memory access a few variants into the run,
not yet found; `expert_swiglu` and `expert_matvec` ran.)

The IQ2_XXS gate and up run on the FFN input's byte planes (`Model.expert_planes`, the
default); an item "floats" in a variant runs them on floats: "floats", or
"floats,_SWIGLU_ROWS=1" with a constant changed too.

    python bench/device_time_ab.py [--layers 43] [--context 4096] \
        [--variants base _ATTENTION_SHARE_KEYS=64 _Q8_WARPS_WANTED=8192 without:expert_swiglu]

Measured (2026-12-03, H200, 43 layers at 4096 tokens, the fastest of 6 steps each): the code
as it is 12.50 ms, and 11.82 ms when run again last; two shares of every head's keys 12.37;
four shares 13.90, and with 8 warps a block 11.69; Q8_0 products wanting 8192 warps 12.61,
2048 warps 12.24; 8 warps a block of the expert kernels 12.31; 512 threads for `hc_pre`
12.68. Every variant is inside the 6% the same code moved between its two runs (medians
13.3-14.5 ms): the step's device time does not come from these geometries.
Measured (2026-12-04, same shape, fastest of 6): 10.61 ms as it was (10.48 again later); the
IQ2_XXS dot with its signs computed 10.02, with the grid as level codes too 9.58 (now the
code); without `expert_swiglu` 7.99 and without `expert_matvec` 8.82, so the routed experts'
two kernels took ~4.5 ms of the step's ~10.5 (~1.05 and ~0.42 TB/s of their weights).

Needs a CUDA device: on the CPU the fast path is off and nothing is compared.
"""

from __future__ import annotations

import os

os.environ.setdefault("MLX_MAX_OPS_PER_BUFFER", "1000000")
os.environ.setdefault("MLX_MAX_MB_PER_BUFFER", "100000000")

import ds4lab  # noqa: F401  (first: OpenBLAS before MLX on Linux)

# isort: split
import argparse
import contextlib

import mlx.core as mx
from kernel_variants import parse_variant
from step_costs import decoding_session, time_step

from ds4lab.config import preset
from ds4lab.model import kernels
from ds4lab.model.random_weights import random_weights


@contextlib.contextmanager
def without(kind: str):
    """Launches of kernels whose MLX name contains `kind` replaced by zeros of their outputs."""
    real = mx.fast.cuda_kernel

    def cuda_kernel(**spec):
        if kind not in spec["name"]:
            return real(**spec)

        def launch(*, inputs, output_shapes, output_dtypes, **_):
            zeros = [mx.zeros(shape, dtype) for shape, dtype in zip(output_shapes, output_dtypes, strict=True)]
            return mx.depends(zeros, list(inputs))
        return launch

    kernels.forget_kernel_objects()
    mx.fast.cuda_kernel = cuda_kernel
    try:
        yield
    finally:
        mx.fast.cuda_kernel = real
        kernels.forget_kernel_objects()


def _without_floats(text: str) -> str:
    """A variant's constants: its text without the item "floats" ("base" if nothing is left)."""
    return ",".join(item for item in text.split(",") if item != "floats") or "base"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=43)
    parser.add_argument("--context", type=int, default=4096, help="tokens prefilled before the steps")
    parser.add_argument("--repeat", type=int, default=8, help="steps timed per variant (the fastest wait kept)")
    parser.add_argument("--variants", nargs="+", default=["base"])
    args = parser.parse_args()
    variants = [(text, {} if text.startswith("without:") else parse_variant(_without_floats(text)))
                for text in args.variants]
    if not kernels.cuda_ready():
        raise SystemExit("device_time_ab: the fast path is off on this device (no CUDA): nothing to compare")
    model, session = decoding_session(random_weights(preset("flash-dims", args.layers), "q2"), args.context)
    print(f"device {mx.default_device()}, flash-dims {args.layers}L q2, {args.context} tokens of context; "
          f"one CUDA graph a step")
    defaults = {name: getattr(kernels, name) for _, changes in variants for name in changes}
    first = None
    for text, changes in variants:
        for name, value in {**defaults, **changes}.items():
            setattr(kernels, name, value)
        model._compiled.clear()
        model.expert_planes = "floats" not in text.split(",")
        stubbed = without(text.removeprefix("without:")) if text.startswith("without:") else contextlib.nullcontext()
        with stubbed:
            time_step(model, session.state, 999, repeat=2)        # this variant's kernels and traces
            waits = [time_step(model, session.state, 999, repeat=1)[2] for _ in range(args.repeat)]
        model._compiled.clear()
        best = min(waits)
        first = first or best
        print(f"{text:48s} device {best * 1e3:7.3f} ms a step (median {sorted(waits)[len(waits) // 2] * 1e3:.3f}); "
              f"{best / first:.3f} of the first")
    for name, value in defaults.items():
        setattr(kernels, name, value)


if __name__ == "__main__":
    main()
