"""Two variants of the fast path's decode step, timed in one process: the greedy stream's tok/s
for each, in alternating rounds from the same prompt.

A 43-layer decode step on the H200 is bound by the host's encoding and the device in about
equal parts, and the host's speed moves ~10-20% between machines and even between calls an
hour apart (the same code read 70.4 and 56.8 tok/s at 4096 tokens): a change measured in two
runs is lost in that spread. Here both variants run on the same host, in rounds A B A B ...
(`--rounds` of `--steps` steps each, from one snapshot of the prompt's state, so every round
decodes the same tokens), and the medians are compared.

Variants (`--variant`):
- `hc_input`: the sublayer's HC input made by the last launch of the sublayer before (A, the
  default: `q8_hc`'s last block) or apart (B: `hc_mix` + `hc_pre`, two launches a sublayer).
- `commits`: each step handed to MLX in pieces, up to the attention of each `--commits` layer
  and then the rest (A), or in one piece (B) (`Model.stream_commits`). Run it with MLX's graph
  limits past a step (MLX_MAX_OPS_PER_BUFFER=1000000 MLX_MAX_MB_PER_BUFFER=100000000), so that
  each piece is one CUDA graph and B is one graph a step.
- `planes`: the IQ2_XXS routed experts' gate and up on integers, the router writing the FFN
  input as byte planes (A, `Model.expert_planes`), or on floats (B, the default).
- `router`, `q_b`, `output_a`, `compressor_slot`, `head`: that step in the launch of another
  (A) or in its own launches (B), the other steps as `Model.merged_launches` has them (by
  default only the head merged, `model.DEFAULT_MERGED`): the router before the
  routed experts (`routed_swiglu`, or `router` + `expert_swiglu`), q_b's product after q_a's
  (`q8_pair`, then `q8_matvec`), the grouped output product before output_b's (`q8_hc`,
  `q8_matvec` first), a compressed layer's frontier update beside q_a's product (`q8_pair`,
  or `compressor_slot` after it), the output head's HC weights, collapse and norm by the last
  block's `q8_hc` (or `row_finish` and MLX's operations after it).
- `steps_ahead`: the stream reads a token with the two steps after it queued (A) or with one
  (B, `generation.STEPS_AHEAD`'s default: the build of step n + 2 waits for step n's token).
- `absent`: launches without the operands their template does not use (A, the default:
  `kernels._launch`) or with every operand (B: placeholder inputs and outputs, as before).
- `constants`: the kernels' small constants padded past MLX's scalar pool (A, the default:
  `kernels._CONSTANT_MIN_BYTES`) or as small as their values (B: in host memory).
- `logprob`: each greedy token's log-prob made on the device beside its argmax (A, the
  default: two scalars read a step) or from the logits row copied to the host and its
  log-softmax taken there (B, as before the twenty-eighth session).

    python bench/stream_ab.py [--layers 43] [--context 4096] [--steps 16] [--rounds 5] [--variant NAME]

On a CUDA device (elsewhere both variants are the same computation, the reference path's).
"""

from __future__ import annotations

import ds4lab  # noqa: F401  (first: OpenBLAS before MLX on Linux)

# isort: split
import argparse
import statistics
import time
from collections.abc import Callable

import mlx.core as mx
from bench_model import WARM_STEPS

from ds4lab import generation
from ds4lab.config import preset
from ds4lab.generation import stream
from ds4lab.model import Model, kernels
from ds4lab.model.model import MERGED_LAUNCHES
from ds4lab.model.random_weights import random_weights


def _hc_input(model: Model, a: bool) -> None:
    model.hc_input_in_product = a


def _commits(layers: tuple[int, ...]) -> Callable[[Model, bool], None]:
    def choose(model: Model, a: bool) -> None:
        model.stream_commits = layers if a else ()
    return choose


def _planes(model: Model, a: bool) -> None:
    model.expert_planes = a


def _merged(step: str) -> Callable[[Model, bool], None]:
    def choose(model: Model, a: bool) -> None:
        (model.merged_launches.add if a else model.merged_launches.discard)(step)
    return choose


_EMITTER_STEP = generation.Emitter.step


def _device_logprob(model: Model, a: bool) -> None:
    generation.Emitter.step = _EMITTER_STEP if a else (
        lambda self, token, logits, logprob=None: _EMITTER_STEP(self, token, logits))


def _kernels_constant(name: str, a_value: int, b_value: int) -> Callable[[Model, bool], None]:
    """A setter of `kernels.<name>` that the compiled decode parts read when traced."""
    def choose(model: Model, a: bool) -> None:
        setattr(kernels, name, a_value if a else b_value)
        model._compiled.clear()
    return choose


def _steps_ahead(model: Model, a: bool) -> None:
    generation.STEPS_AHEAD = 2 if a else 1


# name -> (what A and B are, the setter: variant A when given True)
VARIANTS: dict[str, tuple[str, str, Callable[[Model, bool], None]]] = {
    "hc_input": ("HC input in the product's last block", "HC input apart (hc_mix + hc_pre)", _hc_input),
    "logprob": ("log-prob made on the device", "log-prob from the row on the host", _device_logprob),
    "steps_ahead": ("two steps queued ahead of a token read", "one step queued ahead", _steps_ahead),
    "absent": ("launches without unused operands", "launches with every operand",
               _kernels_constant("_DROP_ABSENT", 1, 0)),
    "constants": ("constants padded to 16 bytes", "constants as small as their values",
                  _kernels_constant("_CONSTANT_MIN_BYTES", 16, 0)),
    "planes": ("IQ2_XXS gate and up on the input's byte planes", "on floats", _planes),
    **{step: (f"{step} in another step's launch", f"{step} in its own launch", _merged(step))
       for step in MERGED_LAUNCHES},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=43)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=16, help="greedy steps a round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of each variant, alternating")
    parser.add_argument("--variant", choices=[*VARIANTS, "commits"], default="hc_input")
    parser.add_argument("--commits", nargs="+", type=int, default=[1, 6, 16, 28], metavar="LAYER",
                        help="with --variant commits: A's layers")
    args = parser.parse_args()
    name_a, name_b, choose = VARIANTS[args.variant] if args.variant != "commits" else (
        f"commits at layers {', '.join(map(str, args.commits))}", "one piece a step", _commits(tuple(args.commits)))
    model = Model(random_weights(preset("flash-dims", args.layers), "q2"))
    session = model.session()
    mx.eval(session.prefill([1000 + i % 50000 for i in range(args.context)]))
    start = session.snapshot()
    rates: dict[bool, list[float]] = {True: [], False: []}
    for warm in (True, False):                    # each variant's kernels and traces first
        choose(model, warm)
        session.restore(start)
        for _ in stream(model, [], max_tokens=WARM_STEPS, session=session):
            pass
    for _ in range(args.rounds):
        for a in (True, False):
            choose(model, a)
            session.restore(start)
            for _ in stream(model, [], max_tokens=2, session=session):   # untimed: a variant may retrace
                pass
            session.restore(start)
            t = time.perf_counter()
            n = sum(1 for _ in stream(model, [], max_tokens=args.steps, session=session))
            rates[a].append(n / (time.perf_counter() - t))
    for a, label in ((True, f"A: {name_a}"), (False, f"B: {name_b}")):
        print(f"{label:45s} {statistics.median(rates[a]):7.2f} tok/s (median of {args.rounds} rounds of "
              f"{args.steps} steps; rounds: {', '.join(f'{r:.1f}' for r in rates[a])})")
    print(f"A / B: {statistics.median(rates[True]) / statistics.median(rates[False]):.3f} "
          f"({args.layers} layers, {args.context} tokens of context, greedy stream)")


if __name__ == "__main__":
    main()
