"""x @ W.T whose rows do not depend on how many rows were computed together.

A BLAS picks its kernel by the matrix shape (a matrix-vector product for one row, blocked
GEMM for many), so the same token gets slightly different sums in a prefill chunk and in
a decode step. On a tiny random model, ds4's FP8 rounding of KV rows turns such 1e-7
differences into visible ones. On the CPU, `linear` therefore always multiplies in tiles
of exactly ROW_TILE rows (the last tile zero-padded): every row goes through the same GEMM
shape, and prefill equals token-by-token decode bit for bit. GPUs take the plain product.
"""

from __future__ import annotations

import mlx.core as mx

ROW_TILE = 16


def on_cpu() -> bool:
    return mx.default_device() == mx.cpu


def linear(x: mx.array, w: mx.array) -> mx.array:
    """x [..., in] @ w[out, in].T -> [..., out]."""
    if not on_cpu():
        return x @ w.T
    lead, n_in = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, n_in)
    n = rows.shape[0]
    pad = -n % ROW_TILE
    if pad:
        rows = mx.concatenate([rows, mx.zeros((pad, n_in), rows.dtype)])
    wt = w.T
    tiles = [rows[i:i + ROW_TILE] @ wt for i in range(0, rows.shape[0], ROW_TILE)]
    out = tiles[0] if len(tiles) == 1 else mx.concatenate(tiles)
    return out[:n].reshape(*lead, w.shape[0])
