"""Attention: the low-rank q path, the single shared KV row, sinks, and the grouped output.

Every head reads the same KV row (the row is both key and value). Keys are the layer's raw
window (the last n_swa rows, the current token included) followed by the compressed rows
the token may see; a learned per-head sink logit joins the softmax denominator only. Heads
come out inverse-rotated at the query position and are projected in n_out_group groups
through a low-rank pair of matrices.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from . import cpu_kernels, kernels
from .numerics import Schedule
from .rope import Rotation
from .weights import LayerWeights, Q8Matrix


def input_products(layer: LayerWeights, xa: mx.array, eps: float, mm: Schedule,
                   q_heads: tuple[int, int] | None = None,
                   slots: kernels.CompressorSlots | None = None) -> tuple[mx.array, ...]:
    """(qr = attn_q_a · xa, attn_kv · xa, qr RMS-normed with attn_q_a_norm): the two products
    of the sublayer input and the norm q_b and the indexer read; with `q_heads` = (H, D) also
    q_b's product of that norm, [T, H, D] (`project_q`'s unfinished q); with `slots` (a decode
    token's compressor update, `compressor.launch_slots`) then the frontiers after it. One
    kernel for all on the fast path's matvec."""
    then = None if q_heads is None else (layer.q8["attn_q_b.weight"], (xa.shape[0], *q_heads))
    return mm.q8_pair(layer.q8["attn_q_a.weight"], layer.q8["attn_kv.weight"], xa,
                      norm_a=(layer.dense["attn_q_a_norm.weight"], eps), slot=layer.index, then=then, slots=slots)


def project_q(layer: LayerWeights, qr_n: mx.array, rotation: Rotation, n_head: int, head_dim: int, eps: float,
              mm: Schedule, finish: bool = True) -> mx.array:
    """From qr_n (q_a's product RMS-normed, `input_products`): q [T, H, D] with per-head
    weightless RMS, rotated. Without `finish` q is the q_b product, its heads not yet normed
    nor rotated (decode attention on the fast path does both: `attend_heads(q_eps=)`; a
    fast-path decode step takes it from `input_products(q_heads=)`, in q_a's launch)."""
    q = mm.q8(layer.q8["attn_q_b.weight"], qr_n, shape=(qr_n.shape[0], n_head, head_dim))
    return mm.finish_rows(q, eps=eps, rotation=rotation) if finish else q


def kv_row(layer: LayerWeights, kv: mx.array, rotation: Rotation, eps: float, mm: Schedule,
           window: mx.array | None = None) -> mx.array:
    """The layer's KV row as stored, [T, D], from kv = attn_kv · xa: RMS(kv; kv_norm), RoPE at
    the token's position, ds4's FP8 round trip on the non-RoPE dims, f16 storage. With `window`
    (the kept raw rows) the rows come after it: the keys a chunk attends (one kernel on the
    fast path, no concatenation)."""
    return mm.finish_rows(kv, eps=eps, weight=layer.dense["attn_kv_a_norm.weight"], rotation=rotation, fp8=True,
                          f16=True, prefix=window)


def visible_keys(mask: mx.array) -> tuple[mx.array, mx.array]:
    """Each token's visible keys in ds4's order, packed to the front: (indices [T, L], valid [T, L]).

    `mask` [T, N] marks what each token may see, with keys in cache order (raw window
    oldest first, then compressed rows). Packing them to the front, padding at the end,
    gives every token the same sequence of terms in prefill and in decode: trailing
    padding cannot change a sum, wherever the other rows of a chunk end.
    """
    n = mask.shape[1]
    order = mx.argsort(mx.where(mask, 0, n) + mx.arange(n)[None, :], axis=1)
    # A single token (decode) keeps every column: no host round trip to size the pack.
    width = n if mask.shape[0] == 1 else max(int(mask.sum(axis=1).max().item()), 1)
    order = order[:, :width]
    return order, mx.take_along_axis(mask, order, axis=1)


def attend_heads(q: mx.array, keys: mx.array, mask: mx.array, sinks: mx.array, rotation: Rotation,
                 mm: Schedule, comp: mx.array | None = None, q_eps: float | None = None,
                 slot: int | None = 0) -> mx.array:
    """Head outputs [T, H, D]: `attend` over keys (then `comp`, the compressed rows, when
    given), then turned back by the query position's angle (ds4's inverse RoPE). One kernel on
    the fast path (`kernels.attention_heads`) and on the native CPU path
    (`cpu_kernels.attention`), which read only the visible keys. With `q_eps`, q is the q_b
    product (`input_products(q_heads=)`): its heads are finished first, inside the fast path's
    decode kernel. `slot`: the block's (`kernels._arrival_counters`)."""
    if mm.fast:
        return kernels.attention_heads(q, keys, mask, sinks, (rotation.cos, rotation.sin), comp, q_eps, slot=slot)
    if q_eps is not None:
        q = mm.finish_rows(q, eps=q_eps, rotation=rotation)
    if mm.native_rows(q):                             # `cpu_kernels.attention`: one call, no gathers
        return mm.finish_rows(cpu_kernels.attention(q, keys, comp, mask, sinks), rotation=rotation, inverse=True)
    if comp is not None:
        keys = mx.concatenate([keys, comp])
    heads = attend(q, keys, mask, sinks, ordered=mm.batch_invariant, products=mm.numerics.emulate)
    return rotation.apply(heads, inverse=True)


def attend(q: mx.array, keys: mx.array, mask: mx.array, sinks: mx.array, ordered: bool,
           products: bool = False) -> mx.array:
    """Softmax attention with a sink logit per head, K = V.

    q [T, H, D]; keys [N, D]; mask [T, N] (True = visible); sinks [H]. Returns [T, H, D].
    The sink joins the denominator only. On the CPU (`ordered`, the batch-invariant path) a
    token's output does not depend on the other tokens of its chunk: each token's two GEMMs
    (`_attend_per_token`), or with `products` (the "ds4-cpu" numerics, whose comparisons
    with ds4.c's logits were measured with it) elementwise products summed in order
    (`_attend_products`, some 4x slower). GPUs use batched matmuls.
    """
    index, valid = visible_keys(mask)
    if not ordered:
        rows = keys[index]                                             # [T, L, D]
        return _sink_softmax(q, rows, valid, sinks)[..., 1:] @ rows
    if not products:
        return _attend_per_token(q, keys, index, valid, sinks)
    per_token = q.shape[1] * index.shape[1] * q.shape[2]
    step = max(1, _CPU_ATTENTION_BUDGET // per_token)
    return mx.concatenate([_attend_products(q[i:i + step], keys[index[i:i + step]], valid[i:i + step], sinks)
                           for i in range(0, q.shape[0], step)])


def pattern(q: mx.array, keys: mx.array, mask: mx.array, sinks: mx.array) -> tuple[mx.array, mx.array]:
    """The attention weights over the keys each token used: (weights [T, H, 1 + L], key index [T, L]).

    Column 0 is the sink's share; column 1 + j weighs key `index[t, j]` (into the keys
    passed to `attend`: raw window rows, then compressed rows), -1 where a token has fewer
    keys than the widest. Each row sums to 1. A reading of `attend`, computed on request.
    """
    index, valid = visible_keys(mask)
    weights = _sink_softmax(q, keys[index], valid, sinks)
    return weights, mx.where(valid, index.astype(mx.int32), -1)


def _sink_softmax(q: mx.array, rows: mx.array, valid: mx.array, sinks: mx.array) -> mx.array:
    """Softmax over [sink, q·rows / sqrt(D)] (invalid rows at -inf), [T, H, 1 + L]."""
    scores = (q @ rows.transpose(0, 2, 1)) * (1.0 / math.sqrt(q.shape[-1]))
    scores = mx.where(valid[:, None, :], scores, -mx.inf)
    sink = mx.broadcast_to(sinks[None, :, None], (q.shape[0], q.shape[1], 1))
    return mx.softmax(mx.concatenate([sink, scores], axis=-1), axis=-1, precise=True)


# Floats held at once by the CPU attention's products or gathered key rows: bounds its memory.
_CPU_ATTENTION_BUDGET = 1 << 25
# The CPU attention pads each token's packed keys to a multiple of this (few distinct widths).
_KEY_WIDTH_STEP = 32


def _attend_products(q: mx.array, rows: mx.array, valid: mx.array, sinks: mx.array) -> mx.array:
    """The CPU form in "ds4-cpu" numerics: products then sums along a non-contiguous axis,
    which MLX adds in order."""
    scores = (q[:, :, None, :] * rows[:, None, :, :]).sum(axis=-1) * (1.0 / math.sqrt(q.shape[-1]))   # [T, H, L]
    scores = mx.where(valid[:, None, :], scores, -mx.inf)
    top = mx.maximum(scores.max(axis=-1), sinks[None, :])                         # [T, H]
    weights = mx.exp(scores - top[..., None])                                     # 0 where masked
    denom = mx.exp(sinks[None, :] - top) + weights.transpose(0, 2, 1).sum(axis=1)
    out = (weights[..., None] * rows[:, None, :, :]).sum(axis=2)                  # [T, H, D]
    return out / denom[..., None]


def _attend_per_token(q: mx.array, keys: mx.array, index: mx.array, valid: mx.array, sinks: mx.array) -> mx.array:
    """The CPU form in "float" numerics. Each token is its own pair of GEMMs, q [H, D] @ rows.T [D, W] and weights
    [H, W] @ rows [W, D], over its packed visible key rows (padding zeroed) with W its visible
    count rounded up to _KEY_WIDTH_STEP: the same matrices, of the same shape, whether the
    token is decoded alone or prefilled among others, so the same bits whatever kernel the
    BLAS picks for that shape. Tokens of one width go through one batched matmul (each item
    its own GEMM); the softmax reduces each row along its contiguous last axis."""
    t, _, d = q.shape
    counts = np.array(valid.sum(axis=1)).astype(np.int64)
    widths = -(-np.maximum(counts, 1) // _KEY_WIDTH_STEP) * _KEY_WIDTH_STEP
    if widths.max() > index.shape[1]:                     # room for the widest token's padding
        pad = int(widths.max()) - index.shape[1]
        index = mx.concatenate([index, mx.zeros((t, pad), index.dtype)], axis=1)
        valid = mx.concatenate([valid, mx.zeros((t, pad), mx.bool_)], axis=1)
    scale = 1.0 / math.sqrt(d)
    out = mx.zeros(q.shape, mx.float32)
    for width in np.unique(widths):
        tokens = np.nonzero(widths == width)[0]
        step = max(1, _CPU_ATTENTION_BUDGET // (int(width) * d))
        for i in range(0, len(tokens), step):
            # Every token of the chunk in one batch (a decode step's token): no gathers, no scatter.
            whole = step >= t == len(tokens)
            at = None if whole else mx.array(tokens[i:i + step])
            q_at, index_at, valid_at = (q, index, valid) if whole else (q[at], index[at], valid[at])
            ok = valid_at[:, :width]                                              # [B, W]
            rows = mx.where(ok[..., None], keys[index_at[:, :width]], 0.0)        # [B, W, D]
            scores = (q_at @ rows.transpose(0, 2, 1)) * scale                     # [B, H, W]
            scores = mx.where(ok[:, None, :], scores, -mx.inf)
            top = mx.maximum(scores.max(axis=-1), sinks[None, :])                 # [B, H]
            weights = mx.exp(scores - top[..., None])                             # 0 where masked
            denom = mx.exp(sinks[None, :] - top) + weights.sum(axis=-1)
            heads = (weights @ rows) / denom[..., None]
            if whole:
                return heads
            out[at] = heads
    return out


def grouped_low(layer: LayerWeights, heads: mx.array, n_out_group: int, mm: Schedule) -> mx.array:
    """Inverse-rotated heads [T, H, D] -> [T, n_out_group · o_lora_rank], the grouped
    projection's first half (attn_output_b takes it to [T, n_embd])."""
    t = heads.shape[0]
    out_a: Q8Matrix = layer.q8["attn_output_a.weight"]
    if mm.fast:                                                        # every group in one kernel
        gemv = t <= kernels.MATVEC_MAX_TOKENS
        return (kernels.q8_matvec if gemv else kernels.q8_gemm)(out_a, heads, groups=n_out_group)
    # Heads of a group side by side; the native kernel reads them as they lie.
    flat = heads if mm.native else heads.reshape(t, -1)
    return mm.q8(out_a, flat, groups=n_out_group, shape=(t, out_a.rows))

