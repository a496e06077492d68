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

from .numerics import fp8_kv_round, rms_norm, round_f16
from .rope import rope_tail
from .weights import LayerWeights, Q8Matrix


def project_q(layer: LayerWeights, xa: mx.array, n_head: int, head_dim: int, eps: float,
              q8) -> tuple[mx.array, mx.array]:
    """(q [T, H, D] with per-head weightless RMS, qr_n [T, q_lora_rank], which also feeds the indexer)."""
    qr = q8(layer.q8["attn_q_a.weight"], xa)
    qr_n = rms_norm(qr, layer.dense["attn_q_a_norm.weight"], eps)
    q = q8(layer.q8["attn_q_b.weight"], qr_n).reshape(xa.shape[0], n_head, head_dim)
    return rms_norm(q, None, eps), qr_n


def project_kv(layer: LayerWeights, xa: mx.array, eps: float, q8) -> mx.array:
    """The layer's KV row before RoPE: RMS(attn_kv · xa; kv_norm), [T, D]."""
    return rms_norm(q8(layer.q8["attn_kv.weight"], xa), layer.dense["attn_kv_a_norm.weight"], eps)


def finish_kv_row(kv: mx.array, positions: mx.array, n_rot: int, base: float, yarn) -> mx.array:
    """RoPE at the token's position, ds4's FP8 round trip on the non-RoPE dims, f16 storage."""
    kv = rope_tail(kv, positions, n_rot, base, yarn)
    return round_f16(fp8_kv_round(kv, kv.shape[-1] - n_rot))


def attend(q: mx.array, keys: mx.array, mask: mx.array, sinks: mx.array) -> mx.array:
    """Softmax attention with a sink logit per head, K = V.

    q [T, H, D]; keys [N, D]; mask [T, N] (True = visible); sinks [H]. Returns [T, H, D].
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = (q @ keys.T) * scale                                      # [T, H, N]
    scores = mx.where(mask[:, None, :], scores, -mx.inf)
    sink = mx.broadcast_to(sinks[None, :, None], (q.shape[0], q.shape[1], 1))
    probs = mx.softmax(mx.concatenate([scores, sink], axis=-1), axis=-1, precise=True)
    return probs[..., :-1] @ keys


def grouped_output(layer: LayerWeights, heads: mx.array, n_out_group: int, q8) -> mx.array:
    """Inverse-rotated heads [T, H, D] -> [T, n_embd] through the grouped low-rank projection."""
    t = heads.shape[0]
    groups = heads.reshape(t, n_out_group, -1)                         # heads of a group side by side
    out_a: Q8Matrix = layer.q8["attn_output_a.weight"]
    rank = out_a.rows // n_out_group
    low = [q8(out_a.rows_slice(g * rank, (g + 1) * rank), groups[:, g]) for g in range(n_out_group)]
    return q8(layer.q8["attn_output_b.weight"], mx.concatenate(low, axis=-1))


def output_heads(heads: mx.array, positions: mx.array, n_rot: int, base: float, yarn) -> mx.array:
    return rope_tail(heads, positions, n_rot, base, yarn, inverse=True)
