"""Fused CUDA kernels of the fast path (sources in `kernels/cuda/`, one small file each).

MLX on CUDA pays a few microseconds of host work per operation, and MLX's compile fuses
elementwise chains, not reductions: the reference composition of a decode step is some
300 operations per layer. These kernels each replace a chain of them; each repeats the
reference's steps in the same order, so a Metal port can translate them line by line:

- `hc_pre`: the hyper-connection split (pre, post, Sinkhorn comb; one warp per token, each
  lane a cell, bit for bit ds4's one-thread `hc_split_sinkhorn`), the collapse of the
  streams and the sublayer's RMSNorm; for a few tokens (decode) the mixer product before it
  is partial sums over the whole GPU (`hc_mix`) that hc_pre adds in order. A decode step
  runs it once: every later sublayer's input is made by `q8_hc` (below).
- `hc_post`: the new streams from the sublayer output (`hc.hc_expand`), optionally the sum
  of two outputs (the FFN's routed and shared experts).
- `row_finish`: per-row RMSNorm, weight, RoPE (or its inverse), Hadamard + FP4, FP8 and f16
  roundings, each optional: q heads, KV rows (written after the raw window's rows: the keys
  a chunk attends), compressed rows, indexer queries and keys.
- `attention_heads`: softmax attention with sinks over the visible keys (masked ones are not
  read; the raw window and the compressed rows from their own arrays), online softmax
  across warps (each taking its keys four at a time), and the inverse RoPE of the output;
  in a decode step it first finishes the q heads (norm, RoPE) from the q_b product. A long
  key list (1024 keys or more, a ratio-4 layer past ~2k tokens) goes over two blocks a head
  instead, `attention_shares`, whose last block of a head adds the shares with the sink (64
  heads fill under half an H200's SMs). A chunk of tokens (prefill) runs
  `prefill_attention` instead: a token's heads 16 at a time on the tensor cores, each
  visible key read once for them.
- `indexer_queries`: a decode token's indexer queries and head weights: q_a's norm, both
  products, the heads' RoPE, Hadamard and FP4 in one launch (a head a block).
- `indexer_scores`: the lightning indexer's Σ_h w_h·relu(q_h·k) per key row; for a decode
  step also its top-k of those rows, written with the window's columns as the attention
  mask by each token's last thread block (a radix select of the k-th score, ties ranked by
  row: indexer_topk.cuh).
- `slot_update` (compressor_slot.cuh): a decode token's compressor frontier update (its kv and score row in
  the slot, a ratio-4 window's shift), both of a ratio-4 layer's compressors in one launch;
  in a decode step made by the q_a / kv launch (`q8_pair(slots=)`). `compressor_pool`: the
  rows a completed window makes, pooled, and in a decode step finished (row_finish's steps)
  in the same launch, a block a compressor.
- `q8_matvec`: a Q8_0 matrix (the model's 8-bit codes) times a few vectors, each warp a few
  rows with 16-byte loads (on a few thousand rows 4 rows a warp, the block's warps splitting
  the columns: `_rows_per_warp`); rows may come in groups that each read their own vector (the
  grouped output projection). Every Q8_0 product of a decode step goes through its loop
  (`q8_rows.cuh`), some with the step after them in the same launch: `q8_pair` (two matrices,
  one input: q_a and kv, and q_a's norm for q_b made by its last block, then in a decode
  step q_b's product of it and the compressors' update by more blocks), `q8_swiglu` (the
  shared expert's gate, up and SwiGLU), `q8_hc` (a sublayer's last product and the HC output
  step, then the next sublayer's HC input as hc_pre makes it, or the output head's: the
  blocks' partial sums of the next mixer's product, added, split and collapsed by the
  launch's last block; in a decode step the attention's grouped output product first, by
  more blocks).
- Launches that hold a step and the step after it (`q8_pair` with q_b, `q8_hc` with the
  grouped product, `routed_swiglu`) hand out their thread blocks' jobs by arrival ticket:
  the blocks that wait for another step's results take later tickets than all the blocks
  making them, which never wait, so none can wait for a block that is not running; a flag
  (`ds4lab_raise_flag`, `ds4lab_wait_flag`) says when the results are there.
- `quant_gemm`: prefill's products on the tensor cores, exact to float32, from the block
  bytes: Q8_0 matrices (`q8_gemm`) and the routed experts grouped by expert on the device
  (`expert_tiles`, `expert_gemm`: each expert's tile of pairs reads its weights once); its
  input first split into scaled f16 halves by `gemm_split_x`.
- `router`: router scores, biased top-k selection (a hash layer: its table's row of the
  token) and route weights of a token in one block; in a decode step the logits too, over
  many blocks, the last to finish routing (`ds4lab_last_block`, as decode attention's
  shares are added).
- `expert_matvec`: routed-expert matvec on the IQ2_XXS, Q2_K or Q4_K block bytes of the
  selected experts, one warp per two output rows (their activation loads shared); a token's
  input read once for all its experts, and the down projection's weighted outputs summed in
  the kernel (the portable path decodes each selected expert to a float32 matrix first: a
  few dozen kernels and three float32 copies per step). `expert_swiglu`: the gate and up
  projections and the route-weighted SwiGLU of each pair in one launch (the down
  projection's input), a warp per row of gate and up in one pass; in a decode step the
  shared expert's gate, up and SwiGLU in the same launch (`q8_swiglu`'s work, more blocks).
  `routed_swiglu`: a decode step's router and then `expert_swiglu` in one launch (unless a
  hook reads the experts or their weights).

Float sums run in another order than the reference's (same values up to float32
reassociation); `bench/check_device.py` checks each kernel against its composition. The
fast path uses them only on a CUDA GPU (`numerics.Numerics.fast`).
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from functools import cache, lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import mlx.core as mx
import numpy as np

from ..atomic import atomic_open
from ..floats import log2f_carry_table
from ..paths import cache_dir
from ..quants.formats import row_bytes
from ..quants.tables import IQ2XXS_GRID_BYTES

if TYPE_CHECKING:
    from .weights import ExpertBlocks, Q8Matrix

KERNEL_DIR = Path(__file__).resolve().parents[2] / "kernels" / "cuda"
_TYPES = {"IQ2_XXS": "iq2_xxs", "Q2_K": "q2_k", "Q4_K": "q4_k"}
_TABLE_NAMES = {"IQ2_XXS": ["grid"], "Q2_K": [], "Q4_K": []}     # the expert dots' lookup tables (`_tables`)
_EXPERT_WARPS = 4                        # warps per thread block of the expert kernels
_SWIGLU_ROWS = 2                         # output rows a warp of expert_swiglu (gate and up of each)
_MATVEC_ROWS = 4                         # output rows a warp of expert_matvec
_THREADS = 128                           # threads per block of the row and HC kernels
_ATTENTION_WARPS = 16                    # warps per (token, head) block of decode attention
# Decode attention splits a (token, head)'s keys over blocks ("shares", attention_shares)
# when its heads fill fewer blocks than an H200 has SMs (132; a block of 16 warps at 128
# registers fills one): a share per _ATTENTION_SHARE_KEYS keys, at most
# _ATTENTION_MAX_SHARES. At 4096 tokens a ratio-4 layer's 1152 keys take 2 shares.
_ATTENTION_MANY_BLOCKS = 132
_ATTENTION_SHARE_KEYS = 512
_ATTENTION_MAX_SHARES = 2
_INDEXER_Q_WARPS = 32                    # warps per (token, head) block of indexer_queries (two rows of wq a warp
                                         # at a time: one block a head, so the more warps the more loads in flight)
_HC_THREADS = 1024                       # hc_pre's block (one block a token; warps 1.. hold the streams)
_HC_MIX_COLUMNS = 256                    # hc_mix's block: a column of the mixer product a thread


def on_cuda() -> bool:
    """True when the default device is a CUDA GPU."""
    return mx.default_device() == mx.gpu and hasattr(mx, "cuda") and mx.cuda.is_available()


def cuda_ready() -> bool:
    """True when CUDA kernels can run: the default device is a CUDA GPU and the sources exist."""
    return on_cuda() and KERNEL_DIR.is_dir()


def available(type_name: str) -> bool:
    """True when the fused expert kernel can run: CUDA ready and a supported type."""
    return type_name in _TYPES and cuda_ready()


# compressor_slot.cuh's arguments after x, and its outputs (`compressor_slot`, `q8_pair(slots=)`)
_SLOT_INPUTS = ["w_kv", "w_gate", "ape", "kv", "score", "w_kv2", "w_gate2", "ape2", "kv2", "score2", "at"]
_SLOT_OUTPUTS = ["kv_out", "score_out", "kv_out2", "score_out2"]
_SECOND_SLOT = [n for n in _SLOT_INPUTS + _SLOT_OUTPUTS if n.endswith("2")]   # a second compressor's operands

# name -> (source file, header files, input names, output names)
_KERNELS = {
    "hc_pre": ("hc_pre.cu", ("ds4lab_block.cuh", "hc_split.cuh"),
               ["streams", "mix", "scale", "base", "norm", "eps", "n_tok"], ["x", "pre", "post", "comb"]),
    "hc_mix": ("hc_mix.cu", ("ds4lab_block.cuh",), ["streams", "mix"], ["part"]),
    "hc_post": ("hc_post.cu", ("ds4lab_block.cuh",), ["out", "add", "streams", "post", "comb", "n_tok"], ["y"]),
    "row_finish": ("row_finish.cu", ("ds4lab_block.cuh",),
                   ["x", "weight", "rope_cos", "rope_sin", "eps", "hscale", "carry", "n_rows", "prefix"], ["y"]),
    "attention_heads": ("decode_attention.cu", ("ds4lab_block.cuh", "decode_attention.cuh"),
                        ["q", "keys", "comp", "mask", "sinks", "rope_cos", "rope_sin", "n_keys", "eps", "kv",
                         "kv_weight", "carry"], ["out", "keys_out"]),
    "attention_shares": ("attention_shares.cu", ("ds4lab_block.cuh", "decode_attention.cuh"),
                         ["q", "keys", "comp", "mask", "rope_cos", "rope_sin", "n_keys", "eps", "sinks", "counter",
                          "kv", "kv_weight", "carry", "part_ml", "part_acc"], ["out", "keys_out"]),
    "prefill_attention": ("prefill_attention.cu", ("ds4lab_block.cuh", "gemm_common.cuh"),
                          ["q", "keys", "mask", "sinks", "rope_cos", "rope_sin", "n_keys"], ["out"]),
    "indexer_queries": ("indexer_queries.cu", ("ds4lab_block.cuh",),
                        ["qr", "qnorm", "eps", "xa", "wq", "wp", "rope_cos", "rope_sin", "hscale", "carry", "wscale"],
                        ["q", "w"]),
    "indexer_scores": ("indexer_scores.cu", ("ds4lab_block.cuh", "indexer_topk.cuh"),
                       ["q", "w", "keys", "n_keys", "visible", "window", "counter"], ["scores", "mask"]),
    "compressor_slot": ("compressor_slot.cu", ("ds4lab_block.cuh", "compressor_slot.cuh"),
                        ["x", *_SLOT_INPUTS], _SLOT_OUTPUTS),
    "compressor_pool": ("compressor_pool.cu", ("ds4lab_block.cuh", "compressor_pool.cuh"),
                        ["old_kv", "old_score", "new_kv", "new_score", "norm", "old_kv2", "old_score2", "new_kv2",
                         "new_score2", "norm2", "eps", "rope_cos", "rope_sin", "pos", "hscale", "carry"],
                        ["out", "out2"]),
    "router": ("router.cu", ("ds4lab_block.cuh", "router.cuh"),
               ["x", "w", "bias", "scale", "counter", "table", "tokens"], ["probs", "experts", "weights"]),
    "router_planes": ("router_planes.cu", ("ds4lab_block.cuh", "router.cuh", "expert_planes.cuh"),
                      ["x", "w", "bias", "scale", "counter", "table", "tokens"],
                      ["probs", "experts", "weights", "planes"]),
    "q8_matvec": ("q8_matvec.cu", ("ds4lab_block.cuh", "q8_rows.cuh"), ["codes", "scales", "x"], ["y"]),
    "q8_pair": ("q8_pair.cu", ("ds4lab_block.cuh", "q8_rows.cuh", "compressor_slot.cuh"),
                ["codes_a", "scales_a", "codes_b", "scales_b", "x", "norm_w", "eps", "counter", "codes_c", "scales_c",
                 *(f"slot_{name}" for name in _SLOT_INPUTS)],
                ["ya", "yb", "ya_n", "yc", *(f"slot_{name}" for name in _SLOT_OUTPUTS)]),
    "q8_swiglu": ("q8_swiglu.cu", ("ds4lab_block.cuh", "q8_rows.cuh"),
                  ["codes_g", "scales_g", "codes_u", "scales_u", "x", "clamp"], ["y"]),
    "q8_hc": ("q8_hc.cu", ("ds4lab_block.cuh", "q8_rows.cuh", "hc_split.cuh"),
              ["codes", "scales", "x", "add", "streams", "post", "comb", "mix", "next_scale", "next_base", "next_norm",
               "eps", "counter", "part", "pre_next", "pre_codes", "pre_scales", "pre_x"],
              ["y", "x_next", "post_next", "comb_next"]),
    "gemm_split_x": ("gemm_split_x.cu", ("ds4lab_block.cuh", "gemm_common.cuh"), ["x"], ["xh", "xl", "xsum", "xexp"]),
}


# A string literal (kept whole), a line comment or a block comment of a CUDA source.
_TOKEN = re.compile(r'"(?:\\.|[^"\\\n])*"|//[^\n]*|/\*.*?\*/', re.S)


def kernel_source(*files: str) -> str:
    """The text of these files (in `kernels/cuda/`) with comments and each line's indentation
    removed, every line break kept, so a compiler message's line numbers still match the
    files': what `header_for` cuts to a body's definitions (the host tests compile the dot
    and router headers as C++ so)."""
    def blank(match: re.Match) -> str:
        text = match.group()
        return text if text.startswith('"') else "\n" * text.count("\n")
    text = "\n".join((KERNEL_DIR / f).read_text() for f in files)
    return "\n".join(line.strip() for line in _TOKEN.sub(blank, text).split("\n"))


# The name a top-level header definition gives is the last identifier before its first "(",
# "[", "=" or "{" (a function, a table, a constant, a struct), its `template <...>` set aside.
_TEMPLATE_PREFIX = re.compile(r"^\s*template\s*<[^>]*>")
_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")
_STRING = re.compile(r'"(?:\\.|[^"\\\n])*"')


def _header_pieces(lines: list[str]) -> list[tuple[int, int, str | None]]:
    """(first line, end line, defined name) of each top-level piece of header text whose
    comments are blanked: a preprocessor line, or a definition from a line at brace depth 0
    to the `}` or `;` that brings it back there. The name is None where none is recognised
    (a preprocessor line, a typedef): such pieces are always kept."""
    pieces, start, depth = [], None, 0
    for i, line in enumerate(lines):
        code = _STRING.sub('""', line).strip()
        if start is None:
            if not code:
                continue
            if code.startswith("#"):
                pieces.append((i, i + 1, None))
                continue
            start = i
        depth += code.count("{") - code.count("}")
        if depth == 0 and code.endswith(("}", ";")):
            text = _TEMPLATE_PREFIX.sub("", _STRING.sub('""', " ".join(lines[start:i + 1])))
            first = min((text.find(c) for c in "([={" if c in text), default=-1)
            names = _IDENTIFIER.findall(text[:first]) if first >= 0 else []
            pieces.append((start, i + 1, names[-1] if names else None))
            start = None
    return pieces


def kernel_texts(source: str, *headers: str) -> dict[str, str]:
    """A kernel's `source=` and `header=` for `mx.fast.cuda_kernel`: an `#include` line each.

    MLX hashes a kernel's whole text at every launch (its compiled module's key; ~0.5 µs a KB
    on the H200 machines' hosts, on the thread that encodes) and rebuilds it at every call
    that is not a compiled replay. Sent as text, the body without comments (`kernel_source`)
    and the headers cut to the definitions it uses (`header_for`), a decode layer's launches
    carried ~90 KB: ~4 MB hashed a 43-layer step. That same text is now written once to a
    file named by its SHA-256 (`sent_text`), which NVRTC reads; MLX hashes the ~0.1 KB line.
    A changed file gives another name, so MLX's disk cache of compiled modules
    (`kernel_cache`) never serves a module built from older text. (Including `kernels/cuda/`
    itself would send less still, but NVRTC then parses every definition of every header:
    the fast path's variants took 1.7x as long to compile.)"""
    body = kernel_source(source)
    # A declaration before the header's include: NVRTC's automatic precompiled header (`-pch`,
    # kernel_cache.Nvrtc) stops at the first one, so it holds the CUDA headers every kernel
    # shares and not one kernel's own (one made per kernel took the variants 3.7x as long here: 96 s against 26).
    header = "namespace ds4lab_kernel {}\n" + sent_text(header_for(body, *headers), ".cuh")
    return {"source": sent_text(body, ".cu"), "header": header}


def sent_text(text: str, suffix: str) -> str:
    """An `#include` line of `text`, written (once, atomically) to `<cache>/kernels/<SHA-256
    of text><suffix>`. A compiler message names that file, whose lines are the kernel files'
    (`kernel_source` keeps every line break; a header file's lines follow the one before)."""
    path = cache_dir() / "kernels" / f"{hashlib.sha256(text.encode()).hexdigest()[:32]}{suffix}"
    if '"' in str(path):
        raise ValueError(f"kernels: the cache path {path} holds a '\"', which an #include line cannot")
    if not path.exists():
        with atomic_open(path, private=True) as fh:
            fh.write(text.encode())
    return f'#include "{path}"\n'


def header_for(body: str, *headers: str) -> str:
    """The header files (in `kernels/cuda/`) as `kernel_source` sends them, cut to the
    definitions `body` uses, directly or through other kept definitions; the rest blanked,
    line numbers kept. Preprocessor lines and unrecognised pieces are always kept."""
    lines = kernel_source(*headers).split("\n")
    pieces = _header_pieces(lines)
    used = set(_IDENTIFIER.findall(body))
    for first, end, name in pieces:
        if name is None:
            used.update(_IDENTIFIER.findall(" ".join(lines[first:end])))
    kept = {p for p in pieces if p[2] is None}
    while grown := [p for p in pieces if p not in kept and p[2] in used]:
        for first, end, name in grown:
            kept.add((first, end, name))
            used.update(_IDENTIFIER.findall(" ".join(lines[first:end])))
    for first, end, _ in set(pieces) - kept:
        lines[first:end] = [""] * (end - first)
    return "\n".join(lines)


# The cached makers of `mx.fast.cuda_kernel` objects (`_kernel_maker`), which
# `forget_kernel_objects` clears: every maker is listed by being declared one.
_KERNEL_MAKERS: list = []


def _kernel_maker(make):
    """`make` cached (one kernel object per set of arguments) and listed in `_KERNEL_MAKERS`."""
    made = cache(make)
    _KERNEL_MAKERS.append(made)
    return made


# MLX's C type of each dtype in a kernel's parameters (mlx/backend/cuda/custom_kernel.cpp).
CUDA_TYPES = {mx.float32: "float", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.int32: "int32_t",
              mx.uint32: "uint32_t", mx.uint8: "uint8_t", mx.int8: "int8_t", mx.bool_: "bool",
              mx.int64: "int64_t", mx.uint64: "uint64_t", mx.int16: "int16_t", mx.uint16: "uint16_t"}


@_kernel_maker
def _fused(name: str, absent: tuple[tuple[str, mx.Dtype, bool], ...] = ()):
    """The kernel object of `_KERNELS[name]`; with `absent` = (operand, dtype, is an output)
    the variant without those operands: each is declared a null pointer of its type in front
    of the body, which reads or writes it only in branches its template turns off
    (`_launch`)."""
    source, headers, inputs, outputs = _KERNELS[name]
    gone = {operand for operand, _, _ in absent}
    texts = kernel_texts(source, *headers)
    texts["source"] = "".join(f"{'' if out else 'const '}{CUDA_TYPES[dtype]}* {operand} = nullptr;\n"
                              for operand, dtype, out in absent) + texts["source"]
    return mx.fast.cuda_kernel(name=f"ds4lab_{name}", input_names=[n for n in inputs if n not in gone],
                               output_names=[n for n in outputs if n not in gone], **texts)


# Whether `_launch` drops a launch's absent operands (0: every launch takes them all, as
# before; `bench/stream_ab.py --variant absent`).
_DROP_ABSENT = 1


def _launch(name: str, *, inputs: list[mx.array], output_shapes: list, output_dtypes: list,
            absent: frozenset[str] = frozenset(), **launch) -> list[mx.array | None]:
    """A launch of `_fused(name)` with every operand in `_KERNELS[name]`'s order, less those
    named in `absent`: inputs and outputs the launch's template does not use. The inputs are
    given whole (an absent one's array stands for its type) and the outputs come back whole,
    None for an absent one. MLX's encoding spends ~2 µs of the host on each output of a
    launch and ~0.15 on each input (`bench/host_costs.py`, `launch_inputs.py`): a decode
    layer's q_a / kv launch carried five unused outputs and thirteen unused inputs."""
    _, _, input_names, output_names = _KERNELS[name]
    absent = absent if _DROP_ABSENT else frozenset()
    kept_outputs = [i for i, n in enumerate(output_names) if n not in absent]
    gone = tuple((n, x.dtype, False) for n, x in zip(input_names, inputs, strict=True) if n in absent) + tuple(
        (n, dtype, True) for n, dtype in zip(output_names, output_dtypes, strict=True) if n in absent)
    made = iter(_fused(name, gone)(
        inputs=[x for n, x in zip(input_names, inputs, strict=True) if n not in absent],
        output_shapes=[output_shapes[i] for i in kept_outputs], output_dtypes=[output_dtypes[i] for i in kept_outputs],
        **launch))
    return [None if n in absent else next(made) for n in output_names]


def forget_kernel_objects() -> None:
    """Drop the `mx.fast.cuda_kernel` objects made so far, so that the next launches make
    theirs again (after `mx.fast.cuda_kernel` is patched or restored: benches and tests)."""
    for made in _KERNEL_MAKERS:
        made.cache_clear()


@cache
def _carry_table() -> mx.array:
    return mx.array(log2f_carry_table())


# Small input arrays kept (`_constant`): a step's few dozen, with room for the lengths that
# grow with the context (the attention's key counts, the indexer's rows: new every few tokens,
# so an unbounded cache would grow for as long as a session decodes).
CONSTANTS_KEPT = 4096


# The least bytes a kept constant takes. MLX's CUDA allocator puts every array of 8 bytes or
# less in its scalar pool (mlx/backend/cuda/allocator.cpp): managed memory that stays in host
# memory, so that each kernel reading it waits for a trip over the bus, and a launch's tail
# (a norm's eps read by its last block once the product is done) cannot start that read
# early. Larger host-made arrays go to managed memory that moves to the GPU at its first
# use and stays there. So a constant of 8 bytes or less is padded with zeros to this many
# (kernels read its first elements only).
# (0: no padding; `bench/device_time_ab.py`'s variant `_CONSTANT_MIN_BYTES=0`.)
_CONSTANT_MIN_BYTES = 16


def _constant(values: tuple, dtype=mx.float32) -> mx.array:
    """A small input array; kept, so that a decode step does not upload hundreds of copies,
    and padded with zeros to `_CONSTANT_MIN_BYTES`."""
    return _kept_constant(values, dtype, _CONSTANT_MIN_BYTES)


@lru_cache(maxsize=CONSTANTS_KEPT)
def _kept_constant(values: tuple, dtype, min_bytes: int) -> mx.array:
    if len(values) * dtype.size <= 8:                    # the scalar pool's
        values += (0,) * max(-(-min_bytes // dtype.size) - len(values), 0)
    return mx.array(values, dtype)


def _scalar(value, dtype=mx.float32) -> mx.array:
    return _constant((value,), dtype)


def hc_pre(streams: mx.array, fn: mx.array, scale: mx.array, base: mx.array, norm: mx.array, sinkhorn_iters: int,
           rms_eps: float, hc_eps: float) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """(x [T, E], pre [T, N], post [T, N], comb [T, N, N]) from the streams [T, N, E] and the
    mixer matrix fn [(2 + N)·N, N·E]. Up to MATVEC_MAX_TOKENS tokens the mixer product is
    `hc_mix`'s partial sums (a block per 256 columns) that hc_pre adds in a fixed order, a
    warp an output; a chunk's is one GEMM first. (A decode step's sublayers mostly get their
    input from the launch before: `q8_hc(..., next_input=)`.)"""
    t, n, e = streams.shape
    if n * n > 32:
        raise ValueError(f"hc_pre: {n} streams: the split's warp holds one cell a lane (n_hc * n_hc <= 32)")
    if t <= MATVEC_MAX_TOKENS:
        n_parts = -(-n * e // _HC_MIX_COLUMNS)
        (mix,) = _fused("hc_mix")(
            inputs=[streams, fn], template=[("N", n), ("E", e), ("PARTS", n_parts)],
            grid=(n_parts * _HC_MIX_COLUMNS, t, 1), threadgroup=(_HC_MIX_COLUMNS, 1, 1),
            output_shapes=[(t, (2 + n) * n, n_parts)], output_dtypes=[mx.float32])
    else:
        n_parts, mix = 1, streams.reshape(t, -1) @ fn.T
    return tuple(_fused("hc_pre")(
        inputs=[streams, mix, scale, base, norm, _constant((rms_eps, hc_eps)), _scalar(t, mx.int32)],
        template=[("N", n), ("E", e), ("ITERS", sinkhorn_iters), ("PARTS", n_parts),
                  ("COLS_PER", -(-e // (_HC_THREADS - 32)))],
        grid=(t * _HC_THREADS, 1, 1), threadgroup=(_HC_THREADS, 1, 1),
        output_shapes=[(t, e), (t, n), (t, n), (t, n, n)], output_dtypes=[mx.float32] * 4))


def hc_post(out: mx.array, streams: mx.array, post: mx.array, comb: mx.array, add: mx.array | None = None) -> mx.array:
    """New streams [T, N, E]: stream c gets post[c]·out + Σ_a comb[a, c]·streams[a]; with
    `add` [T, E], out + add in its place (the FFN's routed and shared outputs)."""
    t, n, e = streams.shape
    threads = 256
    (y,) = _fused("hc_post")(
        inputs=[out, _scalar(0.0) if add is None else add, streams, post, comb, _scalar(t, mx.int32)],
        template=[("N", n), ("E", e), ("ADD", add is not None)],
        grid=(-(-t * n * e // threads) * threads, 1, 1), threadgroup=(threads, 1, 1),
        output_shapes=[streams.shape], output_dtypes=[mx.float32])
    return y


def row_finish(x: mx.array, *, eps: float | None = None, weight: mx.array | None = None,
               rope: tuple[mx.array, mx.array] | None = None, inverse: bool = False, qat: bool = False,
               fp8: bool = False, f16: bool = False, prefix: mx.array | None = None) -> mx.array:
    """The chosen per-row steps over x's last axis, in this order: RMSNorm (when `eps` is
    given), times `weight`, RoPE of the last 2·cos.shape[-1] dims with `rope` = (cos, sin)
    [positions, n_rot/2] (x's rows split evenly over the positions, in order: the heads of a
    token share its position; `inverse` turns back), Hadamard + FP4 (`qat`), FP8 of the
    non-RoPE dims (`fp8`), f16 round trip (`f16`). With `prefix` [P, D] (x [rows, D]) the
    result is [P + rows, D]: prefix's rows, then x's finished (the KV rows after the window)."""
    d = x.shape[-1]
    rows = x.size // d
    if prefix is not None and (x.ndim != 2 or prefix.ndim != 2 or prefix.shape[1] != d):
        raise ValueError(f"row_finish: prefix {tuple(prefix.shape)} before rows {tuple(x.shape)} (both [rows, {d}])")
    n_prefix = 0 if prefix is None else prefix.shape[0]
    one = _scalar(0.0)
    cos, sin = rope if rope is not None else (one, one)
    n_rot = 2 * cos.shape[-1] if rope is not None else 0
    (y,) = _fused("row_finish")(
        inputs=[x.astype(mx.float32), one if weight is None else weight, cos, sin, _scalar(eps or 0.0),
                _scalar(float(np.float32(1.0 / np.sqrt(d)))), _carry_table(), _constant((rows, n_prefix), mx.int32),
                one if prefix is None else prefix.astype(mx.float32)],
        template=[("D", d), ("NORM", eps is not None), ("WEIGHT", weight is not None),
                  ("ROPE", 0 if rope is None else 2 if inverse else 1), ("NROT", n_rot),
                  ("POS_DIV", rows // cos.shape[0] if rope is not None else 1), ("QAT", qat), ("FP8", fp8),
                  ("F16", f16), ("PREFIX", prefix is not None)],
        grid=((n_prefix + rows) * _THREADS, 1, 1), threadgroup=(_THREADS, 1, 1),
        output_shapes=[x.shape if prefix is None else (n_prefix + rows, d)], output_dtypes=[mx.float32])
    return y


def attention_heads(q: mx.array, keys: mx.array, mask: mx.array, sinks: mx.array,
                    rope: tuple[mx.array, mx.array], comp: mx.array | None = None,
                    q_eps: float | None = None,
                    kv_row: tuple[mx.array, mx.array, float] | None = None,
                    keep: int | None = None, slot: int | None = 0) -> mx.array | tuple[mx.array, mx.array]:
    """Sink softmax attention, K = V, then the inverse RoPE of the query positions: q [T, H, D],
    keys [N, D] (then `comp` [C, D], the compressed rows, when given), mask [T, N (+ C)],
    sinks [H], rope (cos, sin) [T, n_rot/2] -> [T, H, D]. With `q_eps` (up to
    MATVEC_MAX_TOKENS tokens) q is the q_b product: each head is first RMS-normed with that
    eps and rotated at its token's position (`row_finish(q, eps=q_eps, rope=rope)`).
    With kv_row = (kv [1, D], the KV norm's weight, its eps) (a decode token) keys is the kept
    window and kv the token's KV product: the kernel finishes its row as `attention.kv_row`
    does and attends it after the window (mask [1, N + 1 (+ C)]); returns (heads, the window's
    rows then the token's: the keys, as `row_finish(prefix=keys)` makes them), of which only
    the last `keep` rows with `keep` (the window the cache keeps: no slice of them a layer).
    `slot`: the block's (its counters and scratch, `_arrival_counters`)."""
    t, h, d = q.shape
    cos, sin = rope
    if q_eps is not None and t > MATVEC_MAX_TOKENS:
        raise ValueError(f"attention_heads: q finished inside for at most {MATVEC_MAX_TOKENS} tokens, not {t}")
    if kv_row is not None and (t != 1 or kv_row[0].shape != (1, d)):
        raise ValueError(f"attention_heads: the KV row finished inside for one token, not {t} (kv "
                         f"{tuple(kv_row[0].shape)})")
    if t > MATVEC_MAX_TOKENS and d % 64 == 0:
        # A chunk: one thread block per token and 16 heads, on the tensor cores.
        keys = keys if comp is None else mx.concatenate([keys, comp])
        (out,) = _fused("prefill_attention")(
            inputs=[q, keys, mask, sinks, cos, sin, _scalar(keys.shape[0], mx.int32)],
            template=[("D", d), ("NROT", 2 * cos.shape[-1]), ("H", h)],
            grid=(-(-h // 16) * 128, t, 1), threadgroup=(128, 1, 1),
            output_shapes=[q.shape], output_dtypes=[mx.float32])
        return out
    threads = 32 * _ATTENTION_WARPS
    n_comp = 0 if comp is None else comp.shape[0]
    n_keys = keys.shape[0] + (kv_row is not None) + n_comp
    template = [("D", d), ("NROT", 2 * cos.shape[-1]), ("WARPS", _ATTENTION_WARPS), ("QFINISH", q_eps is not None),
                ("KVROW", kv_row is not None)]
    sources = [q, keys, _scalar(0.0) if comp is None else comp, mask]
    kv, kv_weight, kv_eps = kv_row if kv_row is not None else (_scalar(0.0), _scalar(0.0), 0.0)
    skip = max(0, keys.shape[0] + 1 - keep) if kv_row is not None and keep is not None else 0
    lengths = [_constant((keys.shape[0], n_keys, skip), mx.int32), _constant((q_eps or 0.0, kv_eps))]
    row_inputs = [kv.astype(mx.float32), kv_weight, _carry_table()]
    keys_out = [(keys.shape[0] + 1 - skip, d) if kv_row is not None else (1, 1)]
    shares = min(_ATTENTION_MAX_SHARES, n_keys // _ATTENTION_SHARE_KEYS) if h * t < _ATTENTION_MANY_BLOCKS else 1
    if shares <= 1:
        out, new_keys = _fused("attention_heads")(
            inputs=[*sources, sinks, cos, sin, *lengths, *row_inputs], template=template,
            grid=(h * threads, t, 1), threadgroup=(threads, 1, 1), output_shapes=[q.shape, *keys_out],
            output_dtypes=[mx.float32] * 2)
    else:
        # A long key list over more blocks than heads: shares of the keys, the last block of a
        # head adding them with the sink.
        out, new_keys = _fused("attention_shares")(
            inputs=[*sources, cos, sin, *lengths, sinks, _arrival_counters(slot), *row_inputs,
                    _launch_scratch("attention_shares_ml", t * h * shares * 2, slot),
                    _launch_scratch("attention_shares_acc", t * h * shares * d, slot)],
            template=[*template, ("SHARES", shares)], grid=(h * threads, t, shares), threadgroup=(threads, 1, 1),
            output_shapes=[q.shape, *keys_out], output_dtypes=[mx.float32] * 2)
    return out if kv_row is None else (out, new_keys)


def indexer_queries(qr: mx.array, qnorm: mx.array, eps: float, xa: mx.array, wq: mx.array, wp: mx.array,
                    rope: tuple[mx.array, mx.array], n_heads: int, qat: bool = True) -> tuple[mx.array, mx.array]:
    """A few tokens' indexer queries from the q_a product qr [T, QR] before its norm (qnorm,
    eps: attn_q_a_norm) and the sublayer input xa [T, E]: (q [T, H, DH] = the heads of
    wq [H * DH, QR] times the normed qr, RoPE'd at rope = (cos, sin) [T, n_rot/2], Hadamard +
    FP4 unless `qat` is False; w [T, H] = xa times wp [H, E], over sqrt(DH * H)). wq may be F16
    (`LayerWeights.kernel_dense`: read as such, widened as loaded, the same bits)."""
    t, qdim = qr.shape
    head_dim = wq.shape[0] // n_heads
    cos, sin = rope
    if t > MATVEC_MAX_TOKENS:
        raise ValueError(f"indexer_queries: at most {MATVEC_MAX_TOKENS} tokens, not {t}")
    if qdim % 4 or xa.shape[-1] % 4:
        raise ValueError(f"indexer_queries: q_a width {qdim}, input {xa.shape[-1]} (the kernel reads float4: "
                         "multiples of 4)")
    threads = 32 * _INDEXER_Q_WARPS
    return tuple(_fused("indexer_queries")(
        inputs=[qr, qnorm, _scalar(eps), xa, wq, wp, cos, sin, _scalar(float(np.float32(1.0 / np.sqrt(head_dim)))),
                _carry_table(), _scalar(float(np.float32(1.0 / math.sqrt(head_dim * n_heads))))],
        template=[("QR", qdim), ("E", xa.shape[-1]), ("DH", head_dim), ("NROT", 2 * cos.shape[-1]), ("QAT", qat)],
        grid=(n_heads * threads, t, 1), threadgroup=(threads, 1, 1),
        output_shapes=[(t, n_heads, head_dim), (t, n_heads)], output_dtypes=[mx.float32] * 2))


def indexer_scores(q: mx.array, w: mx.array, keys: mx.array, choose: tuple[mx.array, mx.array, int] | None = None,
                   slot: int | None = 0) -> mx.array | tuple[mx.array, mx.array]:
    """Σ_h w[t, h]·relu(q[t, h]·keys[n]): q [T, H, DH], w [T, H], keys [N, DH] -> [T, N].
    With choose = (visible [T, N], window [T, W], top_k) (a decode step: at most
    MATVEC_MAX_TOKENS tokens) the launch also makes each token's attention mask row in its
    last thread block: the window's columns, then every visible row when at most top_k are,
    else the top_k best visible ones, ties to the lower row (`indexer.select_rows`):
    (scores, mask [T, W + N])."""
    t, h, dh = q.shape
    n = keys.shape[0]
    warps, keys_per_warp = 8, 4                  # indexer_scores.cu's KEYS
    if choose is None:
        visible, window, top_k, cols = _constant((False,), mx.bool_), _constant((False,), mx.bool_), 0, 0
    else:
        visible, window, top_k = choose
        cols = window.shape[1]
        if t > MATVEC_MAX_TOKENS or visible.shape != (t, n) or window.shape[0] != t:
            raise ValueError(f"indexer_scores: choosing for {t} tokens (at most {MATVEC_MAX_TOKENS}), visible "
                             f"{tuple(visible.shape)}, window {tuple(window.shape)}, {n} keys")
    scores, mask = _fused("indexer_scores")(
        inputs=[q, w, keys, _constant((n, cols), mx.int32), visible, window,
                _arrival_counters(slot) if choose is not None else _scalar(0, mx.int32)],
        template=[("H", h), ("DH", dh), ("CHOOSE", choose is not None), ("K", top_k)],
        grid=(-(-n // (warps * keys_per_warp)) * 32 * warps, t, 1), threadgroup=(32 * warps, 1, 1),
        output_shapes=[(t, n), (t, cols + n) if choose is not None else (1, 1)],
        output_dtypes=[mx.float32, mx.bool_])
    return scores if choose is None else (scores, mask)


class CompressorSlots(NamedTuple):
    """A decode token's compressor update, `slot_update`'s arguments, also for a launch that
    makes it beside its own work (`q8_pair(slots=)`): first = (w_kv, w_gate, ape, kv, score),
    the layer's second compressor's the same (or None), and the frontier row and APE row as
    `at` [4] int32 (`slot_at`), an array (a compiled step reads it as data: one trace serves
    every position)."""
    first: tuple[mx.array, ...]
    second: tuple[mx.array, ...] | None
    at: mx.array
    shift: bool


@lru_cache(maxsize=1024)
def slot_at(row: int, slot: int) -> mx.array:
    """`CompressorSlots.at`: a frontier row and an APE row, then two zeros, [4] int32: past
    MLX's scalar pool (`_CONSTANT_MIN_BYTES`), since every thread of `compressor_slot` reads
    it. Kept (as `_constant`s are) but never one of `_constant`'s arrays: a compiled decode
    part takes it as an input, and `mx.compile` refuses a part that also reads its input as a
    constant."""
    return mx.array((row, slot, 0, 0), mx.int32)


def slot_update(x: mx.array, slots: CompressorSlots) -> tuple[mx.array, ...]:
    """A compressor's frontier (kv, score [rows, R]) after one decode token x [1, cols], from
    `slots.first` = (w_kv, w_gate, ape, kv, score): row `row` replaced by w_kv·x and w_gate·x +
    ape[slot] (model/compressor.py), where (row, slot) = `slots.at` (`slot_at`), data, so
    that a compiled decode step traces the launch once for every position. With
    `slots.shift` (a ratio-4 window completed) the first half of the rows then takes the
    second half's. `slots.second`: another compressor of the same ratio (a ratio-4 layer's
    indexer), in the same launch; then its (kv, score) follow. The weights may be F16
    (`LayerWeights.kernel_dense`: read as such, widened as loaded), all four alike."""
    inputs, template, warps, shapes = _slot_launch(x, slots)
    threads = 256
    outs = _launch(
        "compressor_slot", absent=frozenset() if slots.second is not None else frozenset(_SECOND_SLOT),
        inputs=[x.astype(mx.float32), *inputs], template=template,
        grid=(-(-warps * 32 // threads) * threads, 1, 1), threadgroup=(threads, 1, 1),
        output_shapes=shapes, output_dtypes=[mx.float32] * 4)
    return tuple(outs if slots.second is not None else outs[:2])


def _slot_launch(x: mx.array, slots: CompressorSlots) -> tuple[list[mx.array], list[tuple], int, list[tuple]]:
    """compressor_slot.cuh's inputs after x, template, warps and output shapes."""
    first, second = slots.first, slots.second
    rows, r = first[3].shape
    rows2, r2 = (0, 0) if second is None else second[3].shape
    if x.shape != (1, x.shape[-1]) or x.shape[-1] % 4 or r % 4 or r2 % 4 or slots.at.shape != (4,):
        raise ValueError(f"compressor_slot: input {tuple(x.shape)} (one token; the kernel reads and copies 4 values "
                         f"at a time: multiples of 4), frontiers {r} and {r2} wide, at {tuple(slots.at.shape)} "
                         f"(the frontier row and the APE row)")
    weights = [*first[:2], *(second[:2] if second is not None else ())]
    wtype = weights[0].dtype if len({w.dtype for w in weights}) == 1 and weights[0].dtype == mx.float16 else mx.float32
    unused = (_constant((0.0,), wtype),) * 2 + (_scalar(0.0),) * 3
    inputs = []
    for group in (first, second or unused):                           # weights, then ape, kv, score
        inputs += [w.astype(wtype) for w in group[:2]] + [a.astype(mx.float32) for a in group[2:]]
    template = [("R", r), ("COLS", x.shape[-1]), ("ROWS", rows), ("R2", r2), ("ROWS2", rows2),
                ("RATIO", first[2].shape[0]), ("SHIFT", slots.shift)]
    return ([*inputs, slots.at.astype(mx.int32)], template, 2 * (r + r2),
            [(rows, r)] * 2 + [(max(rows2, 1), max(r2, 1))] * 2)


class EmittedRow(NamedTuple):
    """One compressor's part of a `compressor_pool` launch: its frontier (kv, score) before
    the token and after it (`compressor_slot`), its row width, and its row steps after the
    pool (`Compressor._finished`: the norm's weight and eps, Hadamard + FP4 or FP8) or None."""
    old: tuple[mx.array, mx.array]
    new: tuple[mx.array, mx.array]
    width: int
    steps: tuple[mx.array, float, bool, bool] | None = None        # (norm weight, eps, qat, fp8)


def compressor_pool(rows: list[EmittedRow], ratio: int, overlap: bool,
                    rope: tuple[mx.array, mx.array, int] | None = None) -> list[mx.array]:
    """The row [1, width] each compressor makes of the window a decode token completes (a
    layer's one, or a ratio-4 layer's two in one launch: a block each), pooled from its
    frontier before and after the token. `overlap`: a ratio-4 layer's (frontier rows of
    2·width, candidates from two windows). With every row's `steps` and `rope` = the full
    (cos, sin) tables of the layer's kind and the window's first position, the rows are also
    finished: `row_finish`(pooled, eps, weight, RoPE at that position, qat or fp8, f16), the
    same bits, in the same launch."""
    if not 1 <= len(rows) <= 2 or (rope is None) != (rows[0].steps is None) or len({r.steps is None for r in rows}) > 1:
        raise ValueError(f"compressor_pool: {len(rows)} compressors (one or two), rope {rope is not None} and row "
                         f"steps {[r.steps is not None for r in rows]} (all or none)")
    finish = rope is not None
    cos, sin, pos = rope if finish else (_scalar(0.0), _scalar(0.0), 0)
    parts, template = [], []
    for i, row in enumerate([*rows, None][:2]):
        suffix = "" if i == 0 else "2"
        if row is None:                                               # no second compressor: typed stand-ins
            parts += [_scalar(0.0)] * 5
            template += [("R2", 0), ("WIDTH2", 0), ("QAT2", False), ("FP8_2", False)]
            continue
        norm, _, qat, fp8 = row.steps if finish else (_scalar(0.0), 0.0, False, False)
        parts += [a.astype(mx.float32) for a in (*row.old, *row.new)] + [norm.astype(mx.float32)]
        template += [(f"R{suffix}", row.new[0].shape[1]), (f"WIDTH{suffix}", row.width), (f"QAT{suffix}", qat),
                     ("FP8" if i == 0 else "FP8_2", fp8)]
    eps = tuple(r.steps[1] if finish else 0.0 for r in rows) + (0.0,) * (2 - len(rows))
    hscale = tuple(float(np.float32(1.0 / np.sqrt(r.width))) for r in rows) + (1.0,) * (2 - len(rows))
    threads = 128                                                     # row_finish's: the same norm sums
    outs = _fused("compressor_pool")(
        inputs=[*parts, _constant(eps), cos, sin, _constant((pos,), mx.int32), _constant(hscale),
                _carry_table()],
        template=[*template, ("RATIO", ratio), ("OVERLAP", overlap), ("FINISH", finish),
                  ("NROT", 2 * cos.shape[-1] if finish else 0)],
        grid=(len(rows) * threads, 1, 1), threadgroup=(threads, 1, 1),
        output_shapes=[(1, rows[0].width), (1, rows[1].width if len(rows) > 1 else 1)],
        output_dtypes=[mx.float32] * 2)
    return list(outs[:len(rows)])


# Up to this many tokens (decode, MTP verification) Q8_0 products are matvec kernels on the
# fast path; a prefill chunk is a tensor-core GEMM (`q8_gemm`).
MATVEC_MAX_TOKENS = 8
_Q8_WARPS = 4                            # warps per thread block of the Q8_0 matvec (as row_finish's:
                                         # q8_pair's norm of q_a sums as row_finish does)
_Q8_WARPS_WANTED = 4096                  # fewest warps a Q8_0 matvec takes 4 or 2 rows a warp with
_HC_NEXT_MAX_WIDTH = 8192                # widest row that tail stages in shared memory
_Q8_HC_GROUPS = 2                        # row sets a block of q8_hc with the next input (its tail's threads)


def _grouped_tokens(name: str, matrix: Q8Matrix, x: mx.array, groups: int) -> int:
    """The tokens in x for a Q8_0 product whose rows come in `groups` groups, each reading
    its own vector (x holding tokens·groups·cols values; one group: x's last axis is cols)."""
    cols = matrix.cols
    if matrix.rows % groups or x.size % (groups * cols) or (groups == 1 and x.shape[-1] != cols):
        raise ValueError(f"{name}: {matrix.rows}x{cols} matrix in {groups} groups, input {tuple(x.shape)}")
    return x.size // (groups * cols)


def q8_matvec(matrix: Q8Matrix, x: mx.array, groups: int = 1, shape: tuple[int, ...] | None = None) -> mx.array:
    """W·x for a few tokens, from x's memory as it is (no reshape: each would be one more
    operation of the step). groups = 1: x [..., cols] -> [..., rows]. groups = G: the rows in
    G equal groups, group g multiplied by its own vector, x [T, ...] holding T·G·cols values
    (token-major, then group) -> [T, rows] (the grouped output projection). `shape`, when
    given, is the output's shape instead (the same values in order: q heads [T, H, D])."""
    cols = matrix.cols
    t = _grouped_tokens("q8_matvec", matrix, x, groups)
    natural = (*x.shape[:-1], matrix.rows) if groups == 1 else (x.shape[0], matrix.rows)
    if shape is not None and int(np.prod(shape)) != t * matrix.rows:    # the kernel writes t·rows values
        raise ValueError(f"q8_matvec: output shape {tuple(shape)} does not hold {t}x{matrix.rows} values")
    group_rows = matrix.rows // groups
    r, split = _rows_per_warp(matrix.rows, cols, group_rows)
    (y,) = _fused("q8_matvec")(
        inputs=[matrix.codes, matrix.scales, x.astype(mx.float32)],
        template=[("ROWS", matrix.rows), ("COLS", cols), ("GROUP_ROWS", group_rows), ("R", r), ("SPLIT", split)],
        **_q8_launch(matrix.rows, r, split, t), output_shapes=[shape or natural], output_dtypes=[mx.float32])
    return y


def _rows_per_warp(rows: int, cols: int, unit: int | None = None) -> tuple[int, int]:
    """(R, SPLIT) of a Q8_0 matvec over `rows` of `cols`: each warp owns R rows (4, 2 or 1,
    dividing `unit`, default rows: a warp's rows stay in one group or one matrix) and, with
    SPLIT = _Q8_WARPS, the block's warps share those R rows, each over every SPLIT-th 512-byte
    chunk of columns. The most rows a warp (one read of the input serves them all: a warp of
    one row reads 4 bytes of input per byte of weights, and on a few thousand rows the L1
    bounds the product) that still leaves at least _Q8_WARPS_WANTED warps: without the split
    if it can, else split (each warp a chunk at least: cols >= 512 * SPLIT). A decode
    step's matvec waits on memory latency: the more warps, the more loads in flight (an H200
    holds 132 SMs x 64 warps)."""
    can_split = cols >= 512 * _Q8_WARPS
    for r in (4, 2, 1):
        if (unit or rows) % r:
            continue
        if rows // r >= _Q8_WARPS_WANTED:
            return r, 1
        if can_split and rows // r * _Q8_WARPS >= _Q8_WARPS_WANTED:
            return r, _Q8_WARPS
    return 1, _Q8_WARPS if can_split else 1


def _q8_launch(rows: int, r: int, split: int, t: int, groups: int = 1) -> dict:
    """A Q8_0 matvec's geometry: a warp per r of `rows` (`split` = _Q8_WARPS warps per r),
    _Q8_WARPS * groups warps a block; y = token."""
    per_block = r * _Q8_WARPS * groups // split
    return {"grid": (-(-rows // per_block) * 32 * _Q8_WARPS * groups, t, 1),
            "threadgroup": (32 * _Q8_WARPS * groups, 1, 1)}


def _one_vector_tokens(name: str, matrices: tuple[Q8Matrix, ...], x: mx.array) -> int:
    """The tokens of x [T, cols] for Q8_0 products that all read x (equal column counts)."""
    cols = matrices[0].cols
    if any(m.cols != cols for m in matrices) or x.ndim != 2 or x.shape[1] != cols:
        shapes = ", ".join(f"{m.rows}x{m.cols}" for m in matrices)
        raise ValueError(f"{name}: matrices {shapes} and input {tuple(x.shape)} (one [tokens, cols] vector each)")
    return x.shape[0]


def q8_pair(a: Q8Matrix, b: Q8Matrix, x: mx.array, norm_a: tuple[mx.array, float] | None = None,
            slot: int | None = 0, then: tuple[Q8Matrix, tuple[int, ...]] | None = None,
            slots: CompressorSlots | None = None) -> tuple[mx.array, ...]:
    """(A·x, B·x) for x [T, cols] in one launch: two products of one input (the attention's
    q_a and kv projections), each [T, rows of its matrix]. With `norm_a` = (weight [rows of
    A], eps) also `row_finish`(A·x, eps=eps, weight=weight) (the same bits: q_a normed for
    q_b), made by the launch's last block; with `then` = (C, shape) as well (q_b, and the
    shape of its output: the q heads [T, H, D]) also C times that norm, as `q8_matvec`(C,
    norm, shape=shape) makes it, by more thread blocks of the launch (q8_pair.cu's THEN).
    With `slots` (one token) the layer's compressor frontiers after it follow, as
    `slot_update`(x, slots) makes them: (kv, score), then the second compressor's."""
    t = _one_vector_tokens("q8_pair", (a, b), x)
    if norm_a is not None and norm_a[0].shape != (a.rows,):
        raise ValueError(f"q8_pair: a norm of weight {tuple(norm_a[0].shape)} for {a.rows} rows")
    if then is not None and (norm_a is None or then[0].cols != a.rows or int(np.prod(then[1])) != t * then[0].rows):
        raise ValueError(f"q8_pair: then {then[0].rows}x{then[0].cols} into {tuple(then[1])} after {a.rows} rows "
                         f"of {t} tokens (needs norm_a; its columns are A's rows)")
    r, split = _rows_per_warp(a.rows + b.rows, a.cols, math.gcd(a.rows, b.rows))
    norm_w, eps = (norm_a[0].astype(mx.float32), norm_a[1]) if norm_a is not None else (_scalar(0.0), 0.0)
    launch = _q8_launch(a.rows + b.rows, r, split, t)
    c = then[0] if then is not None else None
    r_c, split_c = _rows_per_warp(c.rows, c.cols) if c is not None else (1, 1)
    pair_blocks = launch["grid"][0] // launch["threadgroup"][0]
    c_blocks = _q8_launch(c.rows, r_c, split_c, t)["grid"][0] // launch["threadgroup"][0] if c is not None else 0
    if slots is not None:
        slot_inputs, slot_template, slot_warps, slot_shapes = _slot_launch(x, slots)
        slot_blocks = -(-slot_warps // _Q8_WARPS)
    else:                                                                     # typed stand-ins
        slot_inputs = [_scalar(0.0)] * 10 + [_constant((0, 0), mx.int32)]
        slot_template, slot_blocks, slot_shapes = [("R", 4), ("ROWS", 1), ("R2", 0), ("ROWS2", 1), ("RATIO", 1),
                                                   ("SHIFT", False)], 0, [(1, 1)] * 4
    if c is not None or slots is not None:
        launch["grid"] = ((t * (pair_blocks + c_blocks) + slot_blocks) * launch["threadgroup"][0], 1, 1)
    none = [_constant((0,), mx.uint32), _scalar(0.0)]                           # no C: typed stand-ins
    absent = frozenset(([] if norm_a is not None else ["norm_w", "eps", "counter", "ya_n"])
                       + ([] if c is not None else ["codes_c", "scales_c", "yc"])
                       + ([] if slots is not None else [f"slot_{n}" for n in _SLOT_INPUTS + _SLOT_OUTPUTS]))
    ya, yb, ya_n, yc, *frontiers = _launch(
        "q8_pair", absent=absent,
        inputs=[a.codes, a.scales, b.codes, b.scales, x.astype(mx.float32), norm_w, _scalar(eps),
                _arrival_counters(slot) if norm_a is not None else _scalar(0, mx.int32),
                *([c.codes, c.scales] if c is not None else none), *slot_inputs],
        template=[("ROWS_A", a.rows), ("ROWS_B", b.rows), ("COLS", a.cols), ("R", r), ("SPLIT", split),
                  ("NORM_A", norm_a is not None), ("THEN", c is not None), ("ROWS_C", c.rows if c else 1),
                  ("R_C", r_c), ("SPLIT_C", split_c), ("PAIR_BLOCKS", pair_blocks), ("C_BLOCKS", c_blocks),
                  ("SLOT", slots is not None), ("SLOT_BLOCKS", slot_blocks),
                  *((f"S_{name}", value) for name, value in slot_template if name != "COLS")],
        **launch,
        output_shapes=[(t, a.rows), (t, b.rows), (t, a.rows) if norm_a is not None else (1, 1),
                       tuple(then[1]) if then is not None else (1, 1), *slot_shapes],
        output_dtypes=[mx.float32] * 8)
    made = (ya, yb) if norm_a is None else (ya, yb, ya_n) if then is None else (ya, yb, ya_n, yc)
    if slots is None:
        return made
    return made + tuple(frontiers if slots.second is not None else frontiers[:2])


def q8_swiglu(gate: Q8Matrix, up: Q8Matrix, x: mx.array, clamp: float) -> mx.array:
    """swiglu(G·x, U·x) [T, rows] for x [T, cols] in one launch (the shared expert's first
    half; `moe.swiglu`'s clamp, 0 for none)."""
    t = _one_vector_tokens("q8_swiglu", (gate, up), x)
    if gate.rows != up.rows:
        raise ValueError(f"q8_swiglu: gate has {gate.rows} rows, up {up.rows}")
    r, split = _rows_per_warp(gate.rows, gate.cols)
    (y,) = _fused("q8_swiglu")(
        inputs=[gate.codes, gate.scales, up.codes, up.scales, x.astype(mx.float32), _scalar(clamp)],
        template=[("ROWS", gate.rows), ("COLS", gate.cols), ("R", r), ("SPLIT", split)],
        **_q8_launch(gate.rows, r, split, t), output_shapes=[(t, gate.rows)], output_dtypes=[mx.float32])
    return y


# q8_hc writes stream c from lane c of a warp.
HC_MAX_STREAMS = 32


class HCInput(NamedTuple):
    """What a sublayer's HC input is made of (hc_pre's weights and constants, in the order of
    its arguments after the streams): its mixer [(2 + N)·N, N·E], scale [3], base [(2 + N)·N],
    the norm after the collapse [E]."""

    fn: mx.array
    scale: mx.array
    base: mx.array
    norm: mx.array
    sinkhorn_iters: int
    rms_eps: float
    hc_eps: float


class RoutedDown(NamedTuple):
    """A token's routed experts' down products still to make: sum over u of
    tensor[ids[t, u]] · mid[t, u] ([T, rows]); `q8_hc(add=)` makes them in its launch."""
    tensor: ExpertBlocks
    ids: mx.array          # [T, K] int32
    mid: mx.array          # [T, K, cols]: the route-weighted SwiGLU

    def product(self) -> mx.array:
        """The sum made on its own (`expert_matvec`), [T, rows]."""
        return expert_matvec(self.tensor, self.ids, self.mid, sum_pairs=True)


def _row_pieces(pairs: int, split: int, cols: int) -> int:
    """Runs of whole blocks each routed down row is cut into in q8_hc, so that its `split`
    warps of a row set get equal shares of the `pairs` rows: split / gcd(pairs, split), when
    the row has that many 256-value blocks a run (else 1: whole rows)."""
    pieces = split // math.gcd(pairs, split)
    return pieces if cols % (256 * pieces) == 0 else 1


@_kernel_maker
def _q8_hc_kernel(type_name: str):
    """q8_hc with the routed experts' down products in a block format (q8_hc.cu's routed form:
    the format's dot header included)."""
    source, headers, inputs, outputs = _KERNELS["q8_hc"]
    name = _TYPES[type_name]
    return mx.fast.cuda_kernel(name=f"ds4lab_q8_hc_{name}", output_names=outputs,
                               input_names=[*inputs, "raw", "ids", "mid", *_TABLE_NAMES[type_name]],
                               **kernel_texts(source, *headers, "expert_matvec_common.cuh", f"expert_dot_{name}.cuh"))


def q8_hc(matrix: Q8Matrix, x: mx.array, streams: mx.array, post: mx.array, comb: mx.array,
          add: mx.array | RoutedDown | None = None, next_input: HCInput | None = None,
          slot: int | None = 0,
          pre: tuple[Q8Matrix, int] | None = None) -> tuple[mx.array, tuple[mx.array, ...] | None]:
    """`hc_post`(W·x, ...) in one launch: a sublayer's last product (x [T, cols], W with
    n_embd rows) and the new streams [T, N, E] from it; `add` [T, E] is added to W·x first
    (the FFN's routed output beside the shared expert's), or, `add` a `RoutedDown`, the
    routed experts' down products made in the same launch (their rows beside W's). With
    `next_input`, the same launch also makes the next sublayer's input from the new streams,
    as `hc_pre` would (its last block, from partial sums the others made): (x [T, E], None,
    post [T, N], comb [T, N, N]) (a decode step reads no `pre` once the input is made). With
    `pre` = (P, G) as well (the attention's grouped output: P's rows in G groups), x is P's
    input and W's input is `q8_matvec`(P, x, groups=G), made by more thread blocks of the
    launch (q8_hc.cu's PRE). Returns (new streams, the next input or None)."""
    if pre is not None:
        low, groups_pre = pre
        t = _grouped_tokens("q8_hc", low, x, groups_pre)
        if next_input is None or low.rows != matrix.cols or isinstance(add, RoutedDown):
            raise ValueError(f"q8_hc: a grouped product of {low.rows} rows before {matrix.cols} columns (with the "
                             f"next input, no routed rows)")
        # W's input: scratch the launch's first blocks write and its others read
        pre_x, x = x.astype(mx.float32), _launch_scratch("q8_hc_low", t * low.rows, slot)
    else:
        t = _one_vector_tokens("q8_hc", (matrix,), x)
    n, e = streams.shape[1:]
    routed, add = (add, None) if isinstance(add, RoutedDown) else (None, add)
    if routed is not None and (routed.tensor.rows != matrix.rows
                               or routed.tensor.cols != matrix.cols or routed.ids.ndim != 2
                               or routed.ids.shape[0] != t
                               or routed.mid.shape != (*routed.ids.shape, matrix.cols)):
        raise ValueError(f"q8_hc: routed down {routed.tensor.rows}x{routed.tensor.cols}, ids "
                         f"{tuple(routed.ids.shape)}, mid {tuple(routed.mid.shape)} beside a {matrix.rows}x"
                         f"{matrix.cols} product of {t} tokens")
    m = (2 + n) * n
    if streams.shape != (t, n, matrix.rows) or post.shape != (t, n) or comb.shape != (t, n, n) or n > HC_MAX_STREAMS:
        raise ValueError(f"q8_hc: streams {tuple(streams.shape)}, post {tuple(post.shape)}, comb {tuple(comb.shape)} "
                         f"for {t} tokens of a {matrix.rows}-row product")
    if next_input is not None and (
            [tuple(a.shape) for a in next_input[:4]] != [(m, n * e), (3,), (m,), (e,)]
            or any(a.dtype != mx.float32 for a in next_input[:4])):
        raise ValueError(f"q8_hc: next input weights {[(tuple(a.shape), a.dtype) for a in next_input[:4]]} for {n} "
                         f"streams of {e}, not float32 ({m}, {n * e}), (3,), ({m},), ({e},)")
    if next_input is not None and (n * n > 32 or e % 4 or e > _HC_NEXT_MAX_WIDTH):
        raise ValueError(f"q8_hc: {n} streams of {e}: the next input's split holds one cell a lane (n_hc * n_hc "
                         f"<= 32) and its collapse reads 4 columns at once (a multiple of 4) into shared memory "
                         f"(at most {_HC_NEXT_MAX_WIDTH})")
    r, split = _rows_per_warp(e, matrix.cols)
    nxt = next_input is not None
    # A launch that makes the next input takes _Q8_HC_GROUPS sets of rows a block (q8_hc.cu):
    # its last block, which does the tail alone, then has that many times the threads.
    groups = _Q8_HC_GROUPS if nxt and split > 1 and e % (r * _Q8_HC_GROUPS) == 0 else 1
    launch = _q8_launch(e, r, split, t, groups)
    parts = launch["grid"][0] // launch["threadgroup"][0]
    unused = _scalar(0.0)
    pre_inputs, pre_template = [_constant((0,), mx.uint32), unused, unused], [
        ("PRE", False), ("PRE_ROWS", 1), ("PRE_COLS", 32), ("PRE_GROUP_ROWS", 1), ("PRE_R", 1), ("PRE_SPLIT", 1),
        ("PRE_SETS", 1), ("PRE_BLOCKS", 0)]
    if pre is not None:
        warps = launch["threadgroup"][0] // 32
        pre_r, pre_split = _rows_per_warp(low.rows, low.cols, low.rows // groups_pre)
        sets = warps // pre_split
        if pre_split > warps or low.rows % (pre_r * sets):
            raise ValueError(f"q8_hc: a grouped product of {low.rows} rows in blocks of {warps} warps")
        pre_blocks = low.rows // (pre_r * sets)
        pre_inputs = [low.codes, low.scales, pre_x]
        pre_template = [("PRE", True), ("PRE_ROWS", low.rows), ("PRE_COLS", low.cols),
                        ("PRE_GROUP_ROWS", low.rows // groups_pre), ("PRE_R", pre_r), ("PRE_SPLIT", pre_split),
                        ("PRE_SETS", sets), ("PRE_BLOCKS", pre_blocks)]
        launch["grid"] = (t * (pre_blocks + parts) * launch["threadgroup"][0], 1, 1)
    weights = ([next_input.fn, next_input.scale, next_input.base, next_input.norm,
                _constant((next_input.rms_eps, next_input.hc_eps)), _arrival_counters(slot),
                _launch_scratch("q8_hc", t * (m + 1) * parts, slot), _launch_scratch("q8_hc_pre", t * n, slot)]
               if nxt else [unused] * 5 + [_scalar(0, mx.int32), unused, unused])
    down, down_template = [], []
    if routed is not None:
        n_row_bytes = row_bytes(routed.tensor.type_name, routed.tensor.cols)
        down = [routed.tensor.raw, routed.ids.astype(mx.int32), routed.mid.astype(mx.float32),
                *_tables(routed.tensor.type_name)]
        down_template = [("K", routed.ids.shape[1]), ("ROW_BYTES", n_row_bytes),
                         ("EXPERT_BYTES", routed.tensor.rows * n_row_bytes),
                         ("PIECES", _row_pieces(routed.ids.shape[1], split, matrix.cols))]
    kernel = _fused("q8_hc") if routed is None else _q8_hc_kernel(routed.tensor.type_name)
    y, *made = kernel(
        inputs=[matrix.codes, matrix.scales, x.astype(mx.float32), unused if add is None else add,
                streams, post, comb, *weights, *pre_inputs, *down],
        template=[("E", e), ("COLS", matrix.cols), ("R", r), ("SPLIT", split), ("N", n), ("ADD", add is not None),
                  ("NEXT", nxt), ("PARTS", parts), ("ITERS", next_input.sinkhorn_iters if nxt else 1),
                  ("GROUPS", groups), *pre_template, *down_template],
        **launch,
        output_shapes=[streams.shape] + ([(t, e), (t, n), (t, n, n)] if nxt else [(1,)] * 3),
        output_dtypes=[mx.float32] * 4)
    return y, (made[0], None, *made[1:]) if nxt else None


def router(x: mx.array, bias: mx.array | None, n_used: int, scale: float, weight: mx.array | None = None,
           hashed: tuple[mx.array, mx.array] | None = None,
           slot: int | None = 0) -> tuple[mx.array, mx.array, mx.array]:
    """(probs [T, E], experts [T, n_used] int32 best first, weights [T, n_used]) from the router
    logits x [T, E]: sqrt(softplus), the best n_used of probs + bias, normalised chosen probs x
    scale. With `weight` [E, N] (up to MATVEC_MAX_TOKENS tokens) x is the FFN input [T, N] and
    the logits x . weight.T are made in the same launch, over a thread block per few experts
    (weight float32, or F16 as `LayerWeights.kernel_dense` gives it: widened as loaded).
    With `hashed` = (table [vocab, n_used] int32, tokens [T] int32) the experts are the
    tokens' rows of the table (a hash layer's), not the best."""
    return _router_launch("router", x, bias, n_used, scale, weight, hashed, slot)


def router_planes(x: mx.array, bias: mx.array | None, n_used: int, scale: float, weight: mx.array,
                  hashed: tuple[mx.array, mx.array] | None = None,
                  slot: int | None = 0) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """`router` of a decode step (the logits made inside from the FFN input x [T, N], `weight`
    given) that also writes x as byte planes, the input of `expert_swiglu(planes=)`:
    (probs, experts, weights, planes). `input_planes` says what the planes hold."""
    if x.shape[1] % 32 or weight is None:
        raise ValueError(f"router_planes: rows of {x.shape[1]} values (planes of 32-value groups) and the router "
                         f"matrix {None if weight is None else tuple(weight.shape)} (the logits made inside)")
    return _router_launch("router_planes", x, bias, n_used, scale, weight, hashed, slot)


def _router_launch(name: str, x: mx.array, bias: mx.array | None, n_used: int, scale: float,
                   weight: mx.array | None, hashed: tuple[mx.array, mx.array] | None,
                   slot: int | None) -> tuple[mx.array, ...]:
    """The launch of `router` ("router") or `router_planes` ("router_planes", one more output)."""
    t = x.shape[0]
    e = x.shape[1] if weight is None else weight.shape[0]
    threads = -(-e // 32) * 32
    if threads > 1024:
        raise ValueError(f"the router kernel takes at most 1024 experts, not {e}")
    if weight is not None and t > MATVEC_MAX_TOKENS:
        raise ValueError(f"router: the logits made inside for at most {MATVEC_MAX_TOKENS} tokens, not {t}")
    if weight is not None and weight.shape[1] % 4:
        raise ValueError(f"router: rows of {weight.shape[1]} values (the kernel reads float4: a multiple of 4)")
    table, tokens = _hash_inputs(name, hashed, n_used, t)
    blocks = 1 if weight is None else -(-e // (threads // 32))
    planes = [(t * x.shape[1] // 32 * PLANE_GROUP_BYTES,)] if name == "router_planes" else []
    return tuple(_fused(name)(
        inputs=[x, _scalar(0.0) if weight is None else weight, _scalar(0.0) if bias is None else bias, _scalar(scale),
                _arrival_counters(slot), table, tokens],
        template=[("E", e), ("K", n_used), ("N", x.shape[1]), ("HAS_BIAS", bias is not None),
                  ("PRODUCT", weight is not None), ("HASH", hashed is not None)],
        grid=(blocks * threads, t, 1) if weight is not None else (t * threads, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(t, e), (t, n_used), (t, n_used), *planes],
        output_dtypes=[mx.float32, mx.int32, mx.float32, *[mx.uint8] * len(planes)]))


# Bytes of a 32-value group in `router_planes`' buffer: its three byte planes and its scale.
PLANE_GROUP_BYTES = 3 * 32 + 4


def input_planes(x: mx.array) -> mx.array:
    """The byte planes `router_planes` writes for the rows x [T, N] (kernels/cuda/
    expert_planes.cuh has the format), in MLX operations: uint8 [T * N / 32 *
    PLANE_GROUP_BYTES]. For each 32-value group, scale = 2^(E - 20) with 2^E <= its largest
    magnitude < 2^(E+1), and q = rint(x / scale) (ties to even) split as p0 = q >> 16 (int8),
    p1 = (q >> 8) & 255, p2 = q & 255; a group below 2^-100 is zeros with scale 0, one
    holding inf or NaN has scale NaN (and planes of its other values)."""
    t, n = x.shape
    groups = x.astype(mx.float32).reshape(t, n // 32, 32)
    finite = mx.isfinite(groups)
    largest = mx.where(finite, mx.abs(groups), 0.0).max(axis=-1)
    e = mx.view(largest, mx.uint32).astype(mx.int32) >> 23          # the biased exponent (largest >= 0)
    zero = e < 27
    inverse = mx.view(mx.where(zero, 127, 274 - e) << 23, mx.float32)  # 2^(20 - E); 1 where unused
    q = mx.where(zero[..., None] | ~finite, 0, mx.round(groups * inverse[..., None])).astype(mx.int32)
    planes = mx.stack([q >> 16, q >> 8, q], axis=2).astype(mx.uint8)  # [T, G, 3, 32]: low bytes of each
    scales = mx.where(zero, 0.0, mx.view(mx.where(zero, 0, e - 20) << 23, mx.float32))
    scales = mx.where(finite.all(axis=-1), scales, float("nan"))
    return mx.concatenate([planes.reshape(-1), mx.view(scales.reshape(-1), mx.uint8)])


def planes_values(buffer: mx.array, n_tokens: int, cols: int) -> mx.array:
    """The values [T, N] that a `router_planes` buffer holds: scale * (p0 * 65536 + p1 * 256
    + p2), exact in float32."""
    g = cols // 32
    planes = buffer[:n_tokens * g * 96].reshape(n_tokens, g, 3, 32).astype(mx.int32)
    scales = mx.view(buffer[n_tokens * g * 96:], mx.float32).reshape(n_tokens, g, 1)
    p0 = planes[:, :, 0] - (planes[:, :, 0] >= 128) * 256
    q = p0 * 65536 + planes[:, :, 1] * 256 + planes[:, :, 2]
    return (q.astype(mx.float32) * scales).reshape(n_tokens, cols)


def _hash_inputs(name: str, hashed: tuple[mx.array, mx.array] | None, n_used: int,
                 t: int) -> tuple[mx.array, mx.array]:
    """A router kernel's `table` and `tokens` inputs: a hash layer's table [vocab, n_used] and
    its t token ids as int32 (astype is no operation on the int32 arrays the model passes; a
    reshape would be one a step), else typed stand-ins."""
    if hashed is None:
        return _scalar(0, mx.int32), _scalar(0, mx.int32)
    if hashed[0].ndim != 2 or hashed[0].shape[1] != n_used or hashed[1].size != t:
        raise ValueError(f"{name}: a hash table {tuple(hashed[0].shape)} and {hashed[1].size} tokens for {t} tokens "
                         f"of {n_used} experts")
    return hashed[0].astype(mx.int32), hashed[1].astype(mx.int32)


@lru_cache(maxsize=1024)
def _launch_scratch(use: str, n: int, slot: int | None = 0) -> mx.array:
    """n floats that a launch's thread blocks write and only its own last block reads (q8_hc's
    partial sums of the next sublayer's input, decode attention's shares): given as an input
    (the kernel writes it anyway) rather than made as an output, since MLX spends ~2 µs of the
    host's encoding on each output of a launch (`bench/host_costs.py`) and nothing reads these
    after it. One buffer per use, size and block (`slot`) serves every launch, for the reason
    one set of `_arrival_counters` does. Made from host memory (as `_constant`s are): nothing
    is evaluated while a step's graph is built."""
    return mx.array(np.zeros(max(n, 1), np.float32))


@cache
def _arrival_counters(slot: int | None = 0) -> mx.array:
    """The zeroed ints in which kernels whose last thread block finishes a launch's work count
    their blocks (`ds4lab_last_block`): the router and the indexer's scores a counter per
    token, q8_pair's norm of q_a (and with q_b its tickets, departures and flag: the first
    four) and q8_hc's next input the first (with the grouped product before it the first
    four: its blocks, flag and tickets), decode attention's shares
    one per (token, head), of which there are fewer than _ATTENTION_MANY_BLOCKS;
    `routed_swiglu` its tickets, departures, and a router count and a flag per token. Each launch
    leaves them zero, so one set serves launches that run one after the other. In a CUDA
    graph MLX orders two launches only through a buffer one writes and the other reads (the
    counters are an input of both), so launches that count must be ordered by their data, as
    a block's are (each reads what one before it made): independent ones could run at once
    and share a count. So each block has its own set (`slot`: its layer, None the MTP
    head's): a block's launches are ordered, while two blocks' may not be (a hook that
    replaces a block's input by an array not made from the block before, whose output is
    also wanted; MTP's rollback beside the head's rows)."""
    return mx.array(np.zeros(max(_ATTENTION_MANY_BLOCKS, MATVEC_MAX_TOKENS), np.int32))


# The block-format GEMM's tiles (`quant_gemm.cu`'s BM and BN): pairs (or tokens) by output
# rows, 8 warps per thread block.
GEMM_TILE = 64
_GEMM_ROWS = 128
_GEMM_THREADS = 256


@_kernel_maker
def _gemm_kernel(type_name: str):
    name = "q8_0" if type_name == "Q8_0" else _TYPES[type_name]
    weights = (["codes", "scales"] if type_name == "Q8_0" else
               ["raw"] + (["grid"] if type_name == "IQ2_XXS" else []))
    return mx.fast.cuda_kernel(name=f"ds4lab_quant_gemm_{name}",
                               input_names=[*weights, "xh", "xl", "xsum", "xexp", "order", "pair_offsets",
                                            "tile_offsets"],
                               output_names=["y"], **kernel_texts("quant_gemm.cu", "ds4lab_block.cuh",
                                                                  "gemm_common.cuh", f"gemm_rows_{name}.cuh"))


@dataclass(frozen=True)
class PairTiles:
    """(token, expert) pairs grouped by expert for the block-format GEMM, made on the device:
    `order` [P] lists the pairs (flat indices into the caller's [T, U] experts) expert by
    expert; expert e's are order[pair_offsets[e]:pair_offsets[e + 1]], in tiles of GEMM_TILE
    numbered tile_offsets[e].. ; `n_tiles` bounds the tile count (P / GEMM_TILE + n_expert:
    each expert adds at most one partial tile) without reading it back."""

    order: mx.array
    pair_offsets: mx.array
    tile_offsets: mx.array
    n_tiles: int


def expert_tiles(experts: mx.array, n_expert: int) -> PairTiles:
    """The pairs of `experts` (int, any shape) grouped by expert; no host round trip."""
    ids = experts.reshape(-1).astype(mx.int32)
    order = mx.argsort(ids).astype(mx.int32)
    pair_offsets = (ids[None, :] < mx.arange(n_expert + 1, dtype=mx.int32)[:, None]).sum(axis=1).astype(mx.int32)
    tiles = (pair_offsets[1:] - pair_offsets[:-1] + GEMM_TILE - 1) // GEMM_TILE
    tile_offsets = mx.concatenate([mx.zeros((1,), mx.int32), mx.cumsum(tiles).astype(mx.int32)])
    return PairTiles(order, pair_offsets, tile_offsets, ids.size // GEMM_TILE + n_expert)


@cache
def _dense_tiles(n_tokens: int, groups: int = 1) -> PairTiles:
    """The tiles of a dense product, rows in `groups` equal groups ("experts"), each token's
    group g reading input row token * groups + g: pairs group by group, tokens in order."""
    n_tiles = -(-n_tokens // GEMM_TILE)
    order = (mx.arange(n_tokens, dtype=mx.int32)[None, :] * groups + mx.arange(groups, dtype=mx.int32)[:, None])
    return PairTiles(order.reshape(-1), _constant(tuple(range(0, (groups + 1) * n_tokens, n_tokens)), mx.int32),
                     _constant(tuple(range(0, (groups + 1) * n_tiles, n_tiles)), mx.int32), groups * n_tiles)


def _quant_gemm(type_name: str, weights: list[mx.array], template: list, rows: int, cols: int, n_expert: int,
                x: mx.array, x_div: int, tiles: PairTiles) -> mx.array:
    if x.shape[-1] != cols or x.size // cols * x_div != tiles.order.size:
        raise ValueError(f"quant_gemm: a {type_name} matrix of {cols} columns, {tiles.order.size} pairs reading "
                         f"input rows pair // {x_div}, input {tuple(x.shape)}")
    x = x.reshape(-1, cols).astype(mx.float32)
    split = _fused("gemm_split_x")(
        inputs=[x], template=[("COLS", cols)], grid=(x.shape[0] * _THREADS, 1, 1), threadgroup=(_THREADS, 1, 1),
        output_shapes=[x.shape, x.shape, (x.shape[0], cols // 16), (x.shape[0],)],
        output_dtypes=[mx.float16, mx.float16, mx.float32, mx.int32])
    (y,) = _gemm_kernel(type_name)(
        inputs=weights + split + [tiles.order, tiles.pair_offsets, tiles.tile_offsets],
        template=[("ROWS", rows), ("COLS", cols), ("N_EXPERT", n_expert), ("X_DIV", x_div), *template],
        grid=(tiles.n_tiles * _GEMM_THREADS, -(-rows // _GEMM_ROWS), 1), threadgroup=(_GEMM_THREADS, 1, 1),
        output_shapes=[(tiles.order.size, rows)], output_dtypes=[mx.float32])
    return y


def q8_gemm(matrix: Q8Matrix, x: mx.array, groups: int = 1) -> mx.array:
    """x [..., cols] @ W.T on the tensor cores, exact to float32 (see quant_gemm.cu): the
    fast path's Q8_0 product for more than MATVEC_MAX_TOKENS tokens. groups = G: as
    `q8_matvec`'s, the rows in G groups, group g times its own vector, x [T, ...] holding
    T·G·cols values -> [T, rows] (the grouped output projection in one kernel)."""
    n_tokens = _grouped_tokens("q8_gemm", matrix, x, groups)
    y = _quant_gemm("Q8_0", [matrix.codes, matrix.scales], [], matrix.rows // groups, matrix.cols, groups,
                    x.reshape(-1, matrix.cols), 1, _dense_tiles(n_tokens, groups))
    return y.reshape(*x.shape[:-1], matrix.rows) if groups == 1 else y.reshape(n_tokens, matrix.rows)


def expert_gemm(tensor: ExpertBlocks, tiles: PairTiles, x: mx.array, x_div: int) -> mx.array:
    """Each pair's expert times its input on the tensor cores, exact to float32: row p of the
    result [P, rows] is pair p (flat, the caller's order) and reads row p // x_div of x
    [P / x_div, cols] (a token's input shared by its x_div experts)."""
    n_expert = tensor.raw.shape[0]
    n_row_bytes = row_bytes(tensor.type_name, tensor.cols)
    weights = [tensor.raw, *_tables(tensor.type_name)]
    return _quant_gemm(tensor.type_name, weights,
                       [("ROW_BYTES", n_row_bytes), ("EXPERT_BYTES", tensor.rows * n_row_bytes)],
                       tensor.rows, tensor.cols, n_expert, x, x_div, tiles)


@_kernel_maker
def _kernel(type_name: str, swiglu: bool = False):
    """The routed-expert matvec in this block format; with `swiglu` its gate-and-up form."""
    name = _TYPES[type_name]
    headers = ("ds4lab_block.cuh", "expert_matvec_common.cuh", f"expert_dot_{name}.cuh")
    tables = _TABLE_NAMES[type_name]
    if swiglu:
        return mx.fast.cuda_kernel(name=f"ds4lab_expert_swiglu_{name}",
                                   input_names=["raw_gate", "raw_up", "ids", "x", "w", "clamp", "codes_g", "scales_g",
                                                "codes_u", "scales_u", *tables],
                                   output_names=["mid", "shared"],
                                   **kernel_texts("expert_swiglu.cu", *headers, "q8_rows.cuh", "expert_swiglu.cuh"))
    return mx.fast.cuda_kernel(name=f"ds4lab_expert_matvec_{name}", input_names=["raw", "ids", "x", *tables],
                               output_names=["y"], **kernel_texts("expert_matvec.cu", *headers))


@_kernel_maker
def _planes_kernel():
    """`expert_swiglu` of IQ2_XXS gate and up on the input's byte planes."""
    headers = ("ds4lab_block.cuh", "expert_matvec_common.cuh", "expert_dot_iq2_xxs.cuh", "expert_planes.cuh",
               "expert_dot_iq2_xxs_planes.cuh", "q8_rows.cuh", "q8_rows_planes.cuh", "expert_swiglu.cuh")
    return mx.fast.cuda_kernel(name="ds4lab_expert_swiglu_planes_iq2_xxs",
                               input_names=["raw_gate", "raw_up", "ids", "w", "clamp", "codes_g", "scales_g",
                                            "codes_u", "scales_u", "planes", *_TABLE_NAMES["IQ2_XXS"]],
                               output_names=["mid", "shared"],
                               **kernel_texts("expert_swiglu_planes.cu", *headers))


@_kernel_maker
def _routed_kernel(type_name: str):
    """The routed experts' gate-and-up form with the router inside (`routed_swiglu`)."""
    name = _TYPES[type_name]
    headers = ("ds4lab_block.cuh", "expert_matvec_common.cuh", f"expert_dot_{name}.cuh", "q8_rows.cuh",
               "expert_swiglu.cuh", "router.cuh")
    return mx.fast.cuda_kernel(name=f"ds4lab_routed_swiglu_{name}",
                               input_names=["raw_gate", "raw_up", "x", "clamp", "codes_g", "scales_g", "codes_u",
                                            "scales_u", "rw", "bias", "scale", "table", "tokens", "counter", "logits",
                                            "route_w", *_TABLE_NAMES[type_name]],
                               output_names=["mid", "shared", "experts"],
                               **kernel_texts("routed_swiglu.cu", *headers))


@cache
def _iq2_grid() -> mx.array:
    return mx.array(IQ2XXS_GRID_BYTES.reshape(-1))


_TABLE_ARRAYS = {"grid": _iq2_grid}


def _tables(type_name: str) -> list[mx.array]:
    """The lookup tables a block format's expert kernels read, in `_TABLE_NAMES` order
    (IQ2_XXS: its grid, which the kernels stage as level codes; the signs are computed)."""
    return [_TABLE_ARRAYS[name]() for name in _TABLE_NAMES[type_name]]


def expert_matvec(tensor: ExpertBlocks, ids: mx.array, x: mx.array, *, pairs_per_input: int = 1,
                  sum_pairs: bool = False) -> mx.array:
    """Expert ids[p]'s matrix times an input row, from the block bytes, for each pair p of
    `ids` (any shape, int): pair p reads row p // pairs_per_input of x [pairs / pairs_per_input,
    cols], any leading shape (a token's input shared by its experts). Returns [*ids.shape, rows];
    with `sum_pairs`, summed over ids' last axis, [*ids.shape[:-1], rows] (a token's weighted
    expert outputs)."""
    rows, cols = tensor.rows, tensor.cols
    if ids.size % pairs_per_input or x.shape[-1] != cols or x.size != ids.size // pairs_per_input * cols:
        raise ValueError(f"expert_matvec: {ids.size} pairs, {pairs_per_input} per input row, input {tuple(x.shape)}")
    per_out = ids.shape[-1] if sum_pairs else 1
    n_row_bytes = row_bytes(tensor.type_name, cols)
    inputs = [tensor.raw, ids.astype(mx.int32), x.astype(mx.float32), *_tables(tensor.type_name)]
    threads = 32 * _EXPERT_WARPS
    # Warps sharing a row pair, each over every parts-th of the pairs summed (expert_matvec.cu).
    parts = next(k for k in (4, 2, 1) if k <= per_out and _EXPERT_WARPS % k == 0)
    (y,) = _kernel(tensor.type_name)(
        inputs=inputs,
        template=[("ROWS", rows), ("COLS", cols), ("ROW_BYTES", n_row_bytes),
                  ("EXPERT_BYTES", rows * n_row_bytes), ("PAIRS_PER_OUT", per_out),
                  ("X_DIV", pairs_per_input), ("PARTS", parts), ("P", _MATVEC_ROWS)],
        grid=(-(-(-(-rows // _MATVEC_ROWS) * parts) // _EXPERT_WARPS) * threads, ids.size // per_out, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(*ids.shape[:-1], rows) if sum_pairs else (*ids.shape, rows)],
        output_dtypes=[mx.float32],
    )
    return y


def expert_swiglu(gate: ExpertBlocks, up: ExpertBlocks, ids: mx.array, x: mx.array, weights: mx.array,
                  clamp: float, shared: tuple[Q8Matrix, Q8Matrix] | None = None,
                  planes: mx.array | None = None) -> mx.array | tuple[mx.array, mx.array]:
    """The routed experts' mid [T, U, rows] in one launch: for pair (t, u), expert ids[t, u]'s
    swiglu(G·x[t], U·x[t]) times its route weight weights[t, u] (`moe.swiglu`'s clamp, 0 for
    none), read from the block bytes; x [T, cols], the token's input, is read by its U pairs.
    With `shared` (the shared expert's Q8_0 gate and up, as `q8_swiglu` takes them) also its
    swiglu(G·x[t], U·x[t]) [T, rows], by more thread blocks of the same launch: (mid, that).
    With `planes` (IQ2_XXS gate and up; x as `router_planes` wrote it) the routed and shared
    dots take x from its planes, on integers (expert_swiglu_planes.cu)."""
    rows, cols = gate.rows, gate.cols
    shared_rows, q8 = _gate_up_and_shared("expert_swiglu", gate, up, shared)
    if ids.ndim != 2 or weights.shape != ids.shape or x.shape != (ids.shape[0], cols):
        raise ValueError(f"expert_swiglu: ids {tuple(ids.shape)}, weights {tuple(weights.shape)}, "
                         f"input {tuple(x.shape)} (expected [T, U], [T, U], [T, {cols}])")
    n_row_bytes = row_bytes(gate.type_name, cols)
    threads = 32 * _EXPERT_WARPS
    t = ids.shape[0]
    if planes is not None and (gate.type_name != "IQ2_XXS" or planes.shape != (t * cols // 32 * PLANE_GROUP_BYTES,)):
        raise ValueError(f"expert_swiglu: planes {tuple(planes.shape)} with {gate.type_name} experts and input "
                         f"{tuple(x.shape)} (IQ2_XXS, {t * cols // 32 * PLANE_GROUP_BYTES} bytes)")
    mid, shared_mid = (_kernel(gate.type_name, True) if planes is None else _planes_kernel())(
        inputs=[gate.raw, up.raw, ids.astype(mx.int32), *([x.astype(mx.float32)] if planes is None else []),
                weights.astype(mx.float32), _scalar(clamp), *q8, *([] if planes is None else [planes]),
                *_tables(gate.type_name)],
        template=[("ROWS", rows), ("COLS", cols), ("ROW_BYTES", n_row_bytes),
                  ("EXPERT_BYTES", rows * n_row_bytes), ("X_DIV", ids.shape[1]), ("SHARED_ROWS", shared_rows),
                  ("P", _SWIGLU_ROWS)],
        grid=(-(-max(rows, shared_rows) // (_SWIGLU_ROWS * _EXPERT_WARPS)) * threads, ids.size + (t if shared else 0),
              1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(*ids.shape, rows), (t, shared_rows) if shared else (1, 1)], output_dtypes=[mx.float32] * 2)
    return (mid, shared_mid) if shared is not None else mid


def _gate_up_and_shared(name: str, gate: ExpertBlocks, up: ExpertBlocks,
                        shared: tuple[Q8Matrix, Q8Matrix] | None) -> tuple[int, list[mx.array]]:
    """The checks and inputs the routed experts' gate-and-up kernels share: gate and up in one
    format and shape; (the shared expert's rows, 0 without one; its Q8_0 gate and up codes and
    scales, or typed stand-ins)."""
    if (gate.type_name, gate.rows, gate.cols) != (up.type_name, up.rows, up.cols):
        raise ValueError(f"{name}: gate {gate.type_name} {gate.rows}x{gate.cols}, "
                         f"up {up.type_name} {up.rows}x{up.cols} (one format and shape)")
    if shared is None:
        return 0, [_constant((0,), mx.uint32), _scalar(0.0)] * 2
    if any((m.rows, m.cols) != (shared[0].rows, gate.cols) for m in shared):
        raise ValueError(f"{name}: shared gate and up {[(m.rows, m.cols) for m in shared]} "
                         f"(expected equal, {gate.cols} columns)")
    return shared[0].rows, [a for m in shared for a in (m.codes, m.scales)]


class Route(NamedTuple):
    """A layer's router as `router(weight=...)` takes it, for `routed_swiglu` to run inside the
    routed experts' launch: the matrix [E, cols] (float32, or F16 as `kernel_dense` gives it),
    the selection bias [E] or None, the weights' scale, n_used experts a token, the hash
    table and token ids of a hash layer or None, and the block's `slot`."""
    weight: mx.array
    bias: mx.array | None
    scale: float
    n_used: int
    hashed: tuple[mx.array, mx.array] | None = None
    slot: int | None = 0


def routed_swiglu(gate: ExpertBlocks, up: ExpertBlocks, x: mx.array, route: Route, clamp: float,
                  shared: tuple[Q8Matrix, Q8Matrix] | None = None) -> tuple[mx.array, mx.array, mx.array]:
    """`router` then `expert_swiglu` in one launch (routed_swiglu.cu), for up to
    MATVEC_MAX_TOKENS tokens x [T, cols]: (experts [T, n_used] int32, as `router` chooses them;
    mid [T, n_used, rows], as `expert_swiglu` makes it with the router's weights; the shared
    expert's SwiGLU [T, rows] with `shared`, else a [1, 1] placeholder). The route weights and
    probs stay inside: used where no hook reads them."""
    rows, cols, t, e = gate.rows, gate.cols, x.shape[0], route.weight.shape[0]
    shared_rows, q8 = _gate_up_and_shared("routed_swiglu", gate, up, shared)
    if x.ndim != 2 or x.shape[1] != cols or not 1 <= t <= MATVEC_MAX_TOKENS or route.weight.shape[1] != cols:
        raise ValueError(f"routed_swiglu: input {tuple(x.shape)} and router {tuple(route.weight.shape)} "
                         f"(expected [T <= {MATVEC_MAX_TOKENS}, {cols}] and [E, {cols}])")
    if cols % 4 or route.n_used > 32:
        raise ValueError(f"routed_swiglu: rows of {cols} values (a multiple of 4) and {route.n_used} experts "
                         f"a token (at most 32)")
    table, tokens = _hash_inputs("routed_swiglu", route.hashed, route.n_used, t)
    threads = 32 * _EXPERT_WARPS
    router_blocks, x_blocks = -(-e // _EXPERT_WARPS), -(-max(rows, shared_rows) // (_SWIGLU_ROWS * _EXPERT_WARPS))
    per_token = router_blocks + x_blocks * (route.n_used + (1 if shared is not None else 0))
    n_row_bytes = row_bytes(gate.type_name, cols)
    mid, shared_mid, experts = _routed_kernel(gate.type_name)(
        inputs=[gate.raw, up.raw, x.astype(mx.float32), _scalar(clamp), *q8, route.weight,
                _scalar(0.0) if route.bias is None else route.bias, _scalar(route.scale), table, tokens,
                _arrival_counters(route.slot), _launch_scratch("router_logits", t * e, route.slot),
                _launch_scratch("route_weights", t * route.n_used, route.slot), *_tables(gate.type_name)],
        template=[("ROWS", rows), ("COLS", cols), ("ROW_BYTES", n_row_bytes), ("EXPERT_BYTES", rows * n_row_bytes),
                  ("X_DIV", route.n_used), ("SHARED_ROWS", shared_rows), ("P", _SWIGLU_ROWS), ("E", e),
                  ("EPT", -(-e // threads)), ("HAS_BIAS", route.bias is not None), ("HASH", route.hashed is not None),
                  ("ROUTER_BLOCKS", router_blocks), ("X_BLOCKS", x_blocks)],
        grid=(t * per_token * threads, 1, 1), threadgroup=(threads, 1, 1),
        output_shapes=[(t, route.n_used, rows), (t, shared_rows) if shared is not None else (1, 1),
                       (t, route.n_used)],
        output_dtypes=[mx.float32, mx.float32, mx.int32])
    return experts, mid, shared_mid
