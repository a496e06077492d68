"""x @ W.T whose rows do not depend on how many rows were computed together, nor on which
GEMM kernel a BLAS picks.

A BLAS picks its kernel by the matrix shape (a matrix-vector product for one row, blocked
GEMM for many), and inside one GEMM a row's sums can depend on where the row sits: an
optimised kernel handles the rows of a full register tile and those of a partial tile at
the end with different code (OpenBLAS's Haswell/Zen SGEMM does, its Cooper Lake one does
not). On a tiny random model, ds4's FP8 rounding of KV rows turns such 1e-7 differences
into visible ones.

So on the batch-invariant path every product is a GEMM of exactly ROW_TILE rows, and a
row always sits at the same place in its tile: the token at absolute position p at row
p mod ROW_TILE (`slots`). Prefill tiles a chunk by position; decode puts its one token at
its slot among zero rows; the routed experts place their tokens by slot too. Whatever
kernel the BLAS runs for that one shape, a token meets the same instructions in prefill
and in decode, so the two agree bit for bit on any CPU.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

ROW_TILE = 16


def slots_of(positions: np.ndarray) -> np.ndarray:
    """The tile row of each token: its absolute position mod ROW_TILE."""
    return np.asarray(positions, dtype=np.int64) % ROW_TILE


def tile_product(tile: mx.array, wt: mx.array) -> mx.array:
    """The one BLAS call of the invariant path: [ROW_TILE, in] @ [in, out], or a stack of
    them, [n, ROW_TILE, in] @ [n or 1, in, out] (a batched matmul runs each as its own GEMM)."""
    return tile @ wt


def _tile_places(slots: np.ndarray) -> np.ndarray:
    """Where each row goes in a stack of tiles: the k-th row with slot s goes to tile k, row s."""
    order = np.argsort(slots, kind="stable")
    ranked = slots[order]
    occurrence = np.empty(len(slots), np.int64)
    occurrence[order] = np.arange(len(slots)) - np.searchsorted(ranked, ranked, side="left")
    return occurrence * ROW_TILE + slots


def slotted_linear(x: mx.array, w: mx.array, slots: np.ndarray) -> mx.array:
    """x [n, in] @ w[out, in].T with row i computed at tile row slots[i] (see the module doc)."""
    n, n_in = x.shape
    if len(slots) != n:
        raise ValueError(f"{n} rows but {len(slots)} tile slots")
    if n == 1:
        # A decode step's row: the same tile as below (the row at its slot among zero rows),
        # made by one pad instead of a gather, and the same product.
        slot = int(slots[0])
        return tile_product(mx.pad(x, [(slot, ROW_TILE - 1 - slot), (0, 0)]), w.T)[slot:slot + 1]
    places = _tile_places(slots)
    n_tiles = int(places.max()) // ROW_TILE + 1
    source = np.full(n_tiles * ROW_TILE, n, np.int64)      # row n: the zero padding row
    source[places] = np.arange(n)
    padded = mx.concatenate([x, mx.zeros((1, n_in), x.dtype)])[mx.array(source)]
    wt = w.T
    tiles = [tile_product(padded[i:i + ROW_TILE], wt) for i in range(0, n_tiles * ROW_TILE, ROW_TILE)]
    out = tiles[0] if n_tiles == 1 else mx.concatenate(tiles)
    return out[mx.array(places)]
