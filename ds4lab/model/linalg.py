"""x @ W.T whose rows do not depend on how many rows were computed together, nor on which
GEMM kernel a BLAS picks.

A BLAS picks its kernel by the matrix shape (a matrix-vector product for one row, blocked
GEMM for many), and inside one GEMM a row's sums can depend on where the row sits: an
optimised kernel handles the rows of a full register tile and those of a partial tile at
the end with different code (OpenBLAS's Haswell/Zen SGEMM does, its Cooper Lake one does
not). On a tiny random model, ds4's FP8 rounding of KV rows turns such 1e-7 differences
into visible ones.

So on the batch-invariant path every product is a GEMM of a fixed number of rows (its
tile height, a function of the weights alone: `tile_rows`), and a row always sits at the
same place in its tile: the token at absolute position p at row p mod the height (`slots`
are p mod ROW_TILE, which every height divides). Prefill tiles a chunk by position; decode
puts its one token at its slot among zero rows; the routed experts place their tokens by
slot too. Whatever kernel the BLAS runs for that one shape, a token meets the same
instructions in prefill and in decode, so the two agree bit for bit on any CPU.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

ROW_TILE = 16
# The tile height of products whose weights fit in the caches (at most CACHED_WEIGHTS values):
# those are compute-bound, and a decode step's tile computes its zero rows too, so a low tile
# costs decode a quarter of a ROW_TILE one (prefill pays the same per row). Larger weights are
# read from memory once per tile: ROW_TILE rows cost about what one row costs, and prefill
# (the output head's logits of every token, say) reads them fewer times.
SMALL_TILE = 4
CACHED_WEIGHTS = 1 << 20


def slots_of(positions: np.ndarray) -> np.ndarray:
    """The tile row of each token in a ROW_TILE tile: its absolute position mod ROW_TILE."""
    return np.asarray(positions, dtype=np.int64) % ROW_TILE


def tile_rows(n_weights: int) -> int:
    """The tile height of products with a matrix of n_weights values (see SMALL_TILE)."""
    return ROW_TILE if n_weights > CACHED_WEIGHTS else SMALL_TILE


def tile_product(tile: mx.array, wt: mx.array) -> mx.array:
    """The one BLAS call of the invariant path: [height, in] @ [in, out], or a stack of
    them, [n, height, in] @ [n or 1, in, out] (a batched matmul runs each as its own GEMM)."""
    return tile @ wt


def _tile_places(slots: np.ndarray, height: int) -> np.ndarray:
    """Where each row goes in a stack of tiles: the k-th row with slot s goes to tile k, row s."""
    order = np.argsort(slots, kind="stable")
    ranked = slots[order]
    occurrence = np.empty(len(slots), np.int64)
    occurrence[order] = np.arange(len(slots)) - np.searchsorted(ranked, ranked, side="left")
    return occurrence * height + slots


def slotted_linear(x: mx.array, w: mx.array, slots: np.ndarray, height: int) -> mx.array:
    """x [n, in] @ w[out, in].T in tiles of `height` rows, row i at tile row slots[i] mod
    height (`slots` in a ROW_TILE tile; see the module doc)."""
    n, n_in = x.shape
    if len(slots) != n:
        raise ValueError(f"{n} rows but {len(slots)} tile slots")
    slots = slots % height
    if n == 1:
        # A decode step's row: the same tile as below (the row at its slot among zero rows),
        # made by one pad instead of a gather, and the same product.
        slot = int(slots[0])
        return tile_product(mx.pad(x, [(slot, height - 1 - slot), (0, 0)]), w.T)[slot:slot + 1]
    places = _tile_places(slots, height)
    n_tiles = int(places.max()) // height + 1
    source = np.full(n_tiles * height, n, np.int64)        # row n: the zero padding row
    source[places] = np.arange(n)
    padded = mx.concatenate([x, mx.zeros((1, n_in), x.dtype)])[mx.array(source)]
    wt = w.T
    tiles = [tile_product(padded[i:i + height], wt) for i in range(0, n_tiles * height, height)]
    out = tiles[0] if n_tiles == 1 else mx.concatenate(tiles)
    return out[mx.array(places)]
