"""Prefill and decode speed of the MLX model, and decode against the memory roofline.

Prints tokens/s for prefill (one chunk) and decode (greedy steps, one at a time, then
through `generation.stream`, which builds each step's graph while the device computes the
previous one), the bytes one decode step must read (weights outside the routed experts,
plus n_expert_used experts per layer), the memory bandwidth measured in the same run (a
large array reduction), and the ratio of decode's achieved bytes/s to that bandwidth.

    python bench/bench_model.py                          # CPU: tiny, and flash-dims with 2 layers
    python bench/bench_model.py --in-memory --layers 43 --prompt 128 4096 --steps 32   # GPU, no file
    python bench/bench_model.py --in-memory --layers 43 --prompt 512 2048 8192 --prefill-only
"""

from __future__ import annotations

import ds4lab  # first: OpenBLAS before MLX on Linux

# isort: split
import argparse
import os
import re
import statistics
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import numpy as np
from host_costs import build_encode_wait

from ds4lab import generation
from ds4lab.config import preset
from ds4lab.generation import stream
from ds4lab.model import Model
from ds4lab.model.model import DEFAULT_MERGED, MERGED_LAUNCHES
from ds4lab.model.random_weights import random_weights
from ds4lab.model.weights import ModelWeights
from ds4lab.quants import imatrix

# ds4.c decoding a tiny shape token by token on this VM class (the decode issue's CPU reference),
# and prefilling tiny-a's 392-token prompt (the prefill issue's).
DS4C_TINY_CPU_DECODE = 60.0
DS4C_TINY_CPU_PREFILL = (392, 2.43)


def bandwidth() -> float:
    """Bytes/s of a reduction over a 1 GiB array (reads dominate), best of 5. On the CPU the
    faster of MLX's reduction and numpy's on every core, a slice each (MLX's CPU sum is bound
    by its arithmetic, ~3 GB/s; the native kernels read with every core)."""
    x = mx.ones((1 << 28,), mx.float32)
    mx.eval(x)
    slices = np.array_split(np.asarray(x), os.cpu_count() or 1) if mx.default_device() == mx.cpu else []
    best = float("inf")
    with ThreadPoolExecutor(max(len(slices), 1)) as pool:
        for _ in range(5):
            t = time.perf_counter()
            mx.eval(x.sum())
            best = min(best, time.perf_counter() - t)
            if slices:                                  # numpy's sum releases the GIL
                t = time.perf_counter()
                list(pool.map(np.sum, slices))
                best = min(best, time.perf_counter() - t)
    return x.nbytes / best


def decode_bytes(w: ModelWeights) -> int:
    """Bytes a decode step reads: every weight but the unchosen experts and the embedding's
    other rows; F16 matrices the fast path's kernels read as F16 (`kernel_dense`, made by a
    step already run) at their F16 size."""
    cfg = w.config
    experts = sum(e.nbytes for layer in w.layers for e in layer.experts.values())
    halves = sum(h.nbytes for layer in w.layers for h in layer.half_copies.values())
    rest = w.nbytes - experts - w.token_embd.nbytes - halves
    return int(rest + experts * cfg.n_expert_used / cfg.n_expert + cfg.n_embd * 2)


# Decode steps run untimed at each context before the timed ones (see `bench`).
WARM_STEPS = 8

# Primitives that only describe a view of their input: they launch no kernel.
VIEWS = {"Broadcast", "BroadcastAxes", "Reshape", "Slice", "Squeeze", "ExpandDims", "Transpose", "AsStrided",
          "View", "Unflatten", "Flatten", "Copy"}


def step_ops(model: Model, state) -> Counter:
    """The primitives in the graph of one decode step from `state`, by name: its logits and the
    cache it leaves (a compressor's frontier update feeds no logits of its own step)."""
    mx.eval(state.arrays())
    result = model.forward(state, [1234], last_only=True)
    with tempfile.TemporaryDirectory() as tmp:
        dot = Path(tmp) / "step.dot"
        mx.export_to_dot(str(dot), *result.state.arrays())
        return Counter(re.findall(r'label ?="?([A-Za-z0-9_]+)', dot.read_text()))


def bench(name: str, model: Model, contexts: list[int], steps: int, bw: float, histogram: bool = False,
          rounds: int = 3) -> None:
    """Per context length: prefill tok/s of that prompt, then decode tok/s of `steps` greedy steps
    (the greedy stream's: the median and the best of `rounds` rounds)."""
    session = model.session()                              # warm-up (not timed): a chunk's and a decode
    mx.eval(session.prefill(list(range(1000, 1000 + min(contexts)))))   # step's kernels are compiled
    mx.eval(session.decode(999))                                        # (NVRTC) on first use
    per_token = decode_bytes(model.weights)
    for context in contexts:
        tokens = [1000 + i % 50000 for i in range(context)]
        session = model.session()
        t = time.perf_counter()
        logits = session.prefill(tokens)
        mx.eval(logits)
        prefill = context / (time.perf_counter() - t)
        start = session.snapshot()
        # Untimed first: this context's first steps compile what the warm-up did not reach (a
        # compressed row's emission every 4 tokens, the indexer's kernels past 2048 tokens).
        # The greedy stream too: its steps take the token as a device scalar (new kernels once).
        for _ in range(WARM_STEPS):
            mx.eval(session.decode(int(mx.argmax(logits).item())))
        session.restore(start)
        for _ in stream(model, [], max_tokens=WARM_STEPS, session=session):
            pass
        session.restore(start)
        t = time.perf_counter()
        for _ in range(steps):
            logits = session.decode(int(mx.argmax(logits).item()))
            mx.eval(logits)
        decode = steps / (time.perf_counter() - t)
        # The stream in rounds from the same state: on the H200 machines the host bounds it, and
        # the host's speed moved from run to run of one process (a step built in 8.6 ms, then
        # 15.1 minutes later; 67 and 102 tok/s at 4096 within the hour, 2026-12-04).
        rates = []
        for _ in range(rounds):
            session.restore(start)
            t = time.perf_counter()
            streamed = sum(1 for _ in stream(model, [], max_tokens=steps, session=session))
            rates.append(streamed / (time.perf_counter() - t))
        pipelined, best = statistics.median(rates), max(rates)
        mx.eval(session.state.arrays())              # one step alone: its logits and its cache
        built, encoded, waited = build_encode_wait(
            lambda state=session.state: model.forward(state, [999], last_only=True).state.arrays())
        ops, layers = step_ops(model, session.state), model.config.n_layer
        kernel_ops = sum(n for op, n in ops.items() if op not in VIEWS)
        print(f"{name:30s} context {context:6d}: prefill {prefill:8.1f} tok/s   decode {decode:7.2f} tok/s "
              f"(greedy stream, pipelined: {pipelined:7.2f}, best {best:7.2f} of {rounds} rounds)   "
              f"{per_token / 2**20:8.1f} MiB/token   roofline ratio {max(decode, pipelined) * per_token / bw:6.1%}   "
              f"per layer {kernel_ops / layers:.0f} kernel ops ({ops.total() / layers:.0f} primitives); "
              f"one step: graph built in {built * 1e3:.1f} ms, encoded in {encoded * 1e3:.1f} ms, "
              f"then {waited * 1e3:.1f} ms waiting for the device")
        if histogram:
            print("    per layer: " + ", ".join(f"{op} {n / layers:.1f}" for op, n in ops.most_common(24)))


def bench_prefill(name: str, model: Model, prompts: list[int]) -> None:
    """Prefill tok/s of each prompt length (one session each, default chunks), after a
    warm-up prefill of the longest (kernels are compiled for each new shape on first use, and
    a long prompt's later chunks reach shapes a short one does not: the indexer's); then
    imatrix collection over the longest prompt (its hooks keep the fast path)."""
    mx.eval(model.session().prefill(list(range(1000, 1000 + max(prompts)))))
    for n in prompts:
        tokens = [1000 + i % 50000 for i in range(n)]
        session = model.session()
        t = time.perf_counter()
        mx.eval(session.prefill(tokens))
        print(f"{name:30s} prompt {n:6d}: prefill {n / (time.perf_counter() - t):8.1f} tok/s")
    n = max(prompts)
    t = time.perf_counter()
    imatrix.collect(model, [[1000 + i % 50000 for i in range(n)]])
    print(f"{name:30s} imatrix collection over {n} tokens: {n / (time.perf_counter() - t):8.1f} tok/s")


def empty_kernel_bodies() -> None:
    """From now on every `mx.fast.cuda_kernel` (the fast path's, made on first use) returns at
    its first statement: the same source hashed, the same inputs, outputs and grid launched,
    so a step costs the host and the launches what it does with real kernels, and the device
    nothing more. The logits are then garbage (NaN, whose argmax on CUDA may be any integer):
    the stream's tokens are wrapped into the vocabulary and its text left empty."""
    make = mx.fast.cuda_kernel

    def empty(*, name: str, source: str, **kwargs):
        return make(name=f"{name}_empty", source="return;\n" + source, **kwargs)

    mx.fast.cuda_kernel = empty
    emit = generation.Emitter.step
    generation.Emitter.step = lambda self, token, logits: emit(self, token % logits.shape[-1], logits)
    generation.token_bytes = lambda token: b""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--in-memory", action="store_true", help="flash-dims with random weights, no file")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--variant", default="q2", choices=["q2", "q4"])
    parser.add_argument("--prompt", type=int, nargs="+", default=[128],
                        help="context lengths: each is prefilled, then decoded from (e.g. 128 4096)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="greedy streams of --steps timed from one state")
    parser.add_argument("--prefill-only", action="store_true", help="only prefill tok/s of each --prompt length")
    parser.add_argument("--op-histogram", action="store_true", help="print a decode step's primitives by name")
    parser.add_argument("--merged", nargs="*", default=None, choices=MERGED_LAUNCHES,
                        help="the steps run in another step's launch (`Model.merged_launches`; default: "
                             f"{', '.join(DEFAULT_MERGED)}; none when given alone; in-memory)")
    parser.add_argument("--commits", nargs="+", type=int, default=(), metavar="LAYER",
                        help="the greedy stream hands each step to MLX in pieces, up to each of these layers' "
                             "attention, then the rest (`Model.stream_commits`; run with MLX_MAX_OPS_PER_BUFFER "
                             "and MLX_MAX_MB_PER_BUFFER past a step, so that MLX commits nowhere else; in-memory)")
    parser.add_argument("--float-experts", action="store_true",
                        help="the IQ2_XXS gate and up on floats, not on the FFN input's byte planes "
                             "(`Model.expert_planes = False`; in-memory)")
    parser.add_argument("--empty-kernels", action="store_true",
                        help="every custom kernel returns at once (launched with its inputs, outputs and grid, "
                             "its values garbage): the step's host and launch floor, without the kernels' work")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds: at least 1")
    if args.empty_kernels:
        empty_kernel_bodies()
    device = mx.default_device()
    bw = bandwidth()
    print(f"device {device}, measured memory bandwidth {bw / 1e9:.1f} GB/s, "
          f"MLX_MAX_MB_PER_BUFFER {os.environ.get('MLX_MAX_MB_PER_BUFFER', 'unset')}")
    if args.in_memory:
        cfg = preset("flash-dims", args.layers)
        t = time.perf_counter()
        weights = random_weights(cfg, args.variant)
        print(f"built {cfg.n_layer}-layer flash-dims {args.variant} in memory: {weights.nbytes / 2**30:.1f} GiB "
              f"in {time.perf_counter() - t:.0f} s")
        model = Model(weights)
        if args.merged is not None:
            model.merged_launches = set(args.merged)
        model.stream_commits = tuple(args.commits)
        model.expert_planes = not args.float_experts
        name = (f"flash-dims {cfg.n_layer}L {args.variant} (memory), merged: "
                f"{', '.join(sorted(model.merged_launches)) or 'none'}"
                + (f", commits at layers {', '.join(map(str, args.commits))}" if args.commits else "")
                + (", experts on floats" if args.float_experts else ", expert planes"))
        if args.prefill_only:
            bench_prefill(name, model, args.prompt)
        else:
            bench(name, model, args.prompt, args.steps, bw, args.op_histogram, args.rounds)
        return
    from ds4lab.synth import make_model

    with tempfile.TemporaryDirectory(dir=".") as tmp:
        tiny = make_model(Path(tmp) / "tiny.gguf", "tiny", args.variant, seed=0)[0]
        bench(f"tiny {args.variant}", ds4lab.load(tiny), args.prompt, args.steps, bw, rounds=args.rounds)
        print(f"{'':30s} (ds4.c's CPU path on a tiny shape, token by token: {DS4C_TINY_CPU_DECODE:.0f} tok/s)")
        n, ds4c_s = DS4C_TINY_CPU_PREFILL
        bench_prefill(f"tiny {args.variant}", ds4lab.load(tiny), [n])
        print(f"{'':30s} (ds4.c's CPU path prefilling {n} tokens of a tiny shape: {n / ds4c_s:.0f} tok/s)")
        flash = make_model(Path(tmp) / "flash.gguf", "flash-dims", args.variant, n_layer=args.layers,
                           seed=0, vocab_rows=4096)[0]
        bench(f"flash-dims {args.layers}L {args.variant}", ds4lab.load(flash), args.prompt, args.steps, bw,
              rounds=args.rounds)


if __name__ == "__main__":
    main()
