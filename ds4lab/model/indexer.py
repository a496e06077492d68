"""The lightning indexer: on ratio-4 layers, which compressed rows each token attends.

The indexer has its own ratio-4 compressor (keys of width indexer_head_dim, rounded with
Hadamard + FP4). A token's query heads come from the q low-rank path, are rotated and
rounded the same way, and score every visible key as Σ_h w_h·relu(q_h·k), with per-head
weights projected from the layer input. Only when more rows are visible than top_k does
the indexer choose; otherwise every visible row is attended.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from . import cpu_kernels, kernels
from .numerics import Schedule
from .rope import Rotation
from .weights import LayerWeights


def indexer_queries(layer: LayerWeights, xa: mx.array, qr: mx.array, qr_n: mx.array, rotation: Rotation,
                    n_heads: int, head_dim: int, eps: float, mm: Schedule) -> tuple[mx.array, mx.array]:
    """A chunk's indexer queries: (q [T, H, DH] from the q low-rank path, rotated and rounded
    with Hadamard + FP4; per-head weights [T, H] from the layer input, scaled). qr is the q_a
    product, qr_n its RMSNorm (`attention.input_products`); the fast path's matvec kernel
    (`kernels.indexer_queries`) norms qr itself."""
    if mm.matvec(xa):
        return kernels.indexer_queries(qr, layer.dense["attn_q_a_norm.weight"], eps, xa,
                                       layer.kernel_dense("indexer.attn_q_b.weight"),
                                       layer.dense["indexer.proj.weight"], (rotation.cos, rotation.sin), n_heads)
    q = mm.linear(qr_n, layer.dense["indexer.attn_q_b.weight"])
    weights = mm.linear(xa, layer.dense["indexer.proj.weight"])
    scale = 1.0 / math.sqrt(head_dim * n_heads)
    if mm.native:          # shaped and scaled on the host (float32 products): no MLX round trip
        q = mx.array(np.asarray(q).reshape(xa.shape[0], n_heads, head_dim))
        weights = mx.array(np.asarray(weights) * np.float32(scale))
    else:
        q, weights = q.reshape(xa.shape[0], n_heads, head_dim), weights * scale
    return mm.finish_rows(q, rotation=rotation, qat=True), weights


def indexer_scores(q: mx.array, weights: mx.array, keys: mx.array, mm: Schedule) -> mx.array:
    """Scores [T, N] of every key row for every token (visibility not applied), from
    `indexer_queries`: Σ_h w_h·relu(q_h·k).

    On the batch-invariant path the q·k dots are summed in a fixed order outside the BLAS:
    the key count differs between a prefill chunk and a decode step, and so would a GEMM's
    kernel, and a near-tie in the top-k could then go the other way. The fast path scores
    in one kernel (`kernels.indexer_scores`), the native CPU path in one call
    (`cpu_kernels.indexer_scores`, its own fixed order)."""
    if mm.fast:
        return kernels.indexer_scores(q, weights, keys)
    if mm.native_rows(q):
        return cpu_kernels.indexer_scores(q, weights, keys)
    if not mm.batch_invariant:
        dots = q @ keys.T                                               # [T, H, N]
    else:
        n_heads, head_dim = q.shape[1:]
        step = max(1, _ORDERED_BUDGET // max(1, n_heads * keys.shape[0] * head_dim))
        dots = mx.concatenate([(q[i:i + step, :, None, :] * keys[None, None]).sum(axis=-1)
                               for i in range(0, q.shape[0], step)])
    return (mx.maximum(dots, 0.0) * weights[:, :, None]).sum(axis=1)


# Floats held at once by the ordered q x key products: bounds their memory.
_ORDERED_BUDGET = 1 << 25


def select_rows(scores: mx.array, visible: mx.array, n_visible: np.ndarray, top_k: int, mm: Schedule) -> mx.array:
    """Mask [T, N] of the rows each token attends: all visible rows, or the top_k best when more
    are visible (`n_visible`, per token, known on the host). One call on the native CPU path."""
    if mm.native:
        return cpu_kernels.indexer_select(scores, visible, top_k)
    n = scores.shape[1]
    if n <= top_k:
        return visible
    masked = mx.where(visible, scores, -mx.inf)
    # ds4 takes the best rows one by one, ties to the lowest index; a stable descending sort does the same.
    order = mx.argsort(-masked, axis=1)[:, :top_k]
    chosen = mx.put_along_axis(mx.zeros(scores.shape, dtype=mx.bool_), order, mx.array(True), axis=1) & visible
    choosing = n_visible > top_k
    return chosen if choosing.all() else mx.where(mx.array(choosing)[:, None], chosen, visible)
