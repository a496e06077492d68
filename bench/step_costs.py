"""Where a decode step's host time goes on the fast path: the step's encoding per primitive,
against each of its kernels relaunched alone with the step's own inputs.

`host_costs.py` prices primitives in chains on tiny arrays (a custom kernel: ~5 µs of
encoding on an H200); a 43-layer decode step encodes at ~19 µs a primitive. This builds an
N-layer flash-dims q2 model in memory, prefills `--context` tokens, decodes a few steps, then

1. times one step as decoding runs it (sublayers compiled): its graph's build, its encoding
   (`mx.async_eval` until it returns) and the wait for the device, per primitive;
2. records the kernel launches of one step of a fresh model whose sublayers are not compiled
   (so that the launches see the step's real arrays), and relaunches each kernel `--chain`
   times with the inputs of its launch in the middle layer: independent launches that share
   their inputs, as a step's share weights (MLX commits a CUDA graph each time the inputs it
   has seen pass MLX_MAX_MB_PER_BUFFER, counting an input at every launch). Printed per kernel:
   µs per launch to build, to encode and on the device, its input MB and its outputs.

   Also printed: the input elements the step's launches hand MLX's CUDA encoder, which commits
   a CUDA graph each time their count, in 2^20s, passes MLX_MAX_MB_PER_BUFFER (1000 on an
   H100/H200; it counts elements, not bytes: the weights are uint8) or its kernels
   pass MLX_MAX_OPS_PER_BUFFER (100), and lets the host run only 10 commits ahead of the device.

    python bench/step_costs.py [--layers 8] [--context 128] [--chain 200]   # --chain 0: part 1 only

On the CPU the fast path is off: only part 1 runs.
"""

from __future__ import annotations

import ds4lab  # noqa: F401  (first: OpenBLAS before MLX on Linux)

# isort: split
import argparse
import contextlib
import os
import time
from collections.abc import Callable, Iterator

import mlx.core as mx
from bench_model import VIEWS, WARM_STEPS, step_ops
from host_costs import ADD_ONE, build_encode_wait

from ds4lab.config import preset
from ds4lab.model import Model, kernels
from ds4lab.model.random_weights import random_weights


@contextlib.contextmanager
def recorded_launches() -> Iterator[list[tuple[str, Callable, dict]]]:
    """Every fused-kernel launch made inside: (name, kernel, keyword arguments). Sublayers are
    not compiled inside (`mx.compile` is the identity), so a launch's inputs are real arrays."""
    launches: list[tuple[str, Callable, dict]] = []

    def recording(name: str, kernel: Callable) -> Callable:
        def launch(**kwargs):
            launches.append((name, kernel, kwargs))
            return kernel(**kwargs)
        return launch

    saved = kernels._fused, kernels._kernel, kernels._gemm_kernel, kernels._q8_hc_kernel, mx.compile
    kernels._fused = lambda name, absent=(): recording(name, saved[0](name, absent))
    kernels._kernel = lambda type_name, swiglu=False: recording(
        f"expert_{'swiglu' if swiglu else 'matvec'}_{type_name}", saved[1](type_name, swiglu))
    kernels._gemm_kernel = lambda type_name: recording(f"quant_gemm_{type_name}", saved[2](type_name))
    kernels._q8_hc_kernel = lambda type_name: recording(f"q8_hc_{type_name}", saved[3](type_name))
    mx.compile = lambda fn, *args, **kwargs: fn
    try:
        yield launches
    finally:
        kernels._fused, kernels._kernel, kernels._gemm_kernel, kernels._q8_hc_kernel, mx.compile = saved


def decoding_session(weights, context: int):
    """(model, session) of these weights after a `context`-token prefill and WARM_STEPS decode
    steps (the kernels compiled, the sublayers traced: nothing left to pay once)."""
    model = Model(weights)
    session = model.session()
    mx.eval(session.prefill([1000 + i for i in range(context)]))
    for _ in range(WARM_STEPS):
        mx.eval(session.decode(999))
    return model, session


def time_step(model: Model, state, token: int, repeat: int = 5) -> tuple[float, float, float]:
    """Seconds (build, encode, wait) of one decode step from `state`, the fastest of `repeat`."""
    mx.eval(state.arrays())
    runs = [build_encode_wait(lambda: model.forward(state, [token], last_only=True).state.arrays())
            for _ in range(repeat)]
    return min(runs, key=lambda r: r[0] + r[1])


def alone(kernel: Callable, kwargs: dict, repeat: int = 10) -> float:
    """Seconds of one launch evaluated by itself (encoded, run, waited for), the fastest of
    `repeat`: its device time plus a fixed cost, which an empty launch's figure prices."""
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        mx.eval(kernel(**kwargs))
        best = min(best, time.perf_counter() - t)
    return best


def relaunch(kernel: Callable, kwargs: dict, chain: int) -> tuple[float, float, float]:
    """Seconds per launch (build, encode, device) of `chain` launches with these arguments."""
    return tuple(v / chain for v in build_encode_wait(lambda: [kernel(**kwargs) for _ in range(chain)]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--context", type=int, default=128, help="tokens prefilled before the timed steps")
    parser.add_argument("--chain", type=int, default=200, help="relaunches per kernel")
    args = parser.parse_args()
    weights = random_weights(preset("flash-dims", args.layers), "q2")
    model, session = decoding_session(weights, args.context)
    ops = step_ops(model, session.state)
    primitives = ops.total()
    kernel_ops = sum(n for op, n in ops.items() if op not in VIEWS)
    built, encoded, waited = time_step(model, session.state, 999)
    print(f"device {mx.default_device()}, flash-dims {args.layers}L q2, {args.context} tokens of context")
    print(f"one step (sublayers compiled): {primitives} primitives ({kernel_ops} not views); built in "
          f"{built * 1e3:.2f} ms, encoded in {encoded * 1e3:.2f} ms ({encoded / primitives * 1e6:.1f} µs per "
          f"primitive), then {waited * 1e3:.2f} ms waiting for the device")
    if not model.numerics.fast or args.chain == 0:
        return
    fresh = Model(weights)                   # its sublayers traced inside: not compiled
    with recorded_launches() as launches:
        built_plain, encoded_plain, _ = time_step(fresh, session.state, 999, repeat=3)
    del launches[len(launches) // 3:]        # one step's
    handed = sum(x.size for _, _, kwargs in launches for x in kwargs["inputs"]) / 2**20
    print(f"one step, sublayers not compiled: built in {built_plain * 1e3:.2f} ms, encoded in "
          f"{encoded_plain * 1e3:.2f} ms; {len(launches)} kernel launches handing the encoder {handed:.0f} Mi "
          f"input elements (MLX_MAX_MB_PER_BUFFER={os.environ.get('MLX_MAX_MB_PER_BUFFER', 'default')}, "
          f"MLX_MAX_OPS_PER_BUFFER={os.environ.get('MLX_MAX_OPS_PER_BUFFER', 'default')})")
    by_name: dict[str, list[tuple[Callable, dict]]] = {}
    for name, kernel, kwargs in launches:
        by_name.setdefault(name, []).append((kernel, kwargs))
    one = mx.fast.cuda_kernel(name="step_costs_one", input_names=["x"], output_names=["out"], source=ADD_ONE)
    empty = alone(one, {"inputs": [mx.zeros((1,))], "grid": (32, 1, 1), "threadgroup": (32, 1, 1),
                        "output_shapes": [(1,)], "output_dtypes": [mx.float32]}, repeat=50)
    print(f"one launch evaluated alone: a one-thread custom kernel takes {empty * 1e6:.1f} µs; the column "
          "'alone' is a kernel's less that, and 'per step' that times its launches in a step")
    print(f"{'kernel':28s} {'launches':>8s} {'build':>8s} {'encode':>8s} {'device':>8s} {'alone':>8s} "
          f"{'per step':>9s} {'in MB':>9s} {'outs':>4s}  (µs per launch, relaunched {args.chain} times; µs)")
    step_device = 0.0
    for name, calls in by_name.items():
        kernel, kwargs = calls[len(calls) // 2]
        mx.eval(kwargs["inputs"])
        relaunch(kernel, kwargs, 4)
        cost = relaunch(kernel, kwargs, args.chain)
        own = alone(kernel, kwargs) - empty
        step_device += own * len(calls)
        mb = sum(x.nbytes for x in kwargs["inputs"]) / 2**20
        print(f"{name:28s} {len(calls):8d} " + " ".join(f"{v * 1e6:8.2f}" for v in cost) +
              f" {own * 1e6:8.2f} {own * len(calls) * 1e6:9.1f} {mb:9.1f} {len(kwargs['output_shapes']):4d}")
    print(f"the step's kernels, each alone: {step_device * 1e3:.2f} ms of device time")


if __name__ == "__main__":
    main()
