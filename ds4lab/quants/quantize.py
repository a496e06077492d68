"""Numpy quantizers for the block formats of ds4's recipes: Q8_0, Q2_K, Q4_K and IQ2_XXS.

These follow ds4's gguf-tools quantizer (itself a narrow port of ggml's), step for step:

* Q8_0: amax / 127 scale, round half away from zero; an importance vector is ignored (as in ds4).
* Q2_K / Q4_K without importance: ggml's "ref" path (``make_qkx2_quants`` per sub-block, scales
  and mins snapped to 4/6 bits by their maximum). With importance: ggml's weighted path
  (``make_qkx3_quants`` with per-element weight ``imp[col] * sqrt(sigma2 + x^2)``, then the
  sub-block scales and mins themselves quantized by the weighted ``make_qp_quants``).
* IQ2_XXS: always weighted; without importance the weight is each column's energy
  ``sum_rows x^2``, as ds4's converter does. Per 8 values: signs with even parity (the cheapest
  value, by weighted energy, is flipped), magnitudes snapped to the 256-point grid (an
  off-grid rounding is replaced by the best of its two nearest distance shells of grid points),
  and 13 scale candidates around a ``make_qp_quants`` start.

Everything is vectorised over sub-blocks: loops in Python run over the (at most 36) candidates
or the values of one sub-block, never over blocks. Sums whose order decides a comparison are
accumulated value by value in float32, in the C order, so results match ds4's bytes except
for the rare exact near-tie (the IQ2_XXS neighbour search ranks grid points by an expanded
form of the distance, see `_Iq2Search`).

Arrays here are "position-major": a group of n values over G sub-blocks is an [n, G] array,
so that one value position across all sub-blocks is a contiguous row.
"""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .formats import QuantError, block_format, row_bytes
from .numpy_decode import q4_k_scale_min
from .tables import IQ2XXS_GRID

QUANTIZABLE = ("Q8_0", "Q2_K", "Q4_K", "IQ2_XXS")
"""The types `quantize` can produce (those of ds4's recipes)."""

QK_K = 256
_F32 = np.float32
_GROUP_MAX_EPS = _F32(1e-15)
# Rows are quantized in chunks of about this many 256-value blocks: big enough to amortise
# numpy's per-call overhead, small enough for a chunk's IQ2_XXS distance table (16 MB at 256
# blocks) to stay in L3 cache during its 14 random-access passes (twice as fast as 1024
# blocks), and numerous enough to spread over threads.
_CHUNK_BLOCKS = 256


# --- small exact helpers ------------------------------------------------------------------


def set_f16_field(blocks: np.ndarray, offset: int, values: np.ndarray) -> None:
    """Store `values` as little-endian f16 at byte `offset` of each block row of uint8 `blocks`.

    Rounds once, from the values' own dtype (float32 for the quantizers), to nearest-even f16.
    """
    blocks[:, offset : offset + 2] = np.asarray(values).astype(np.float16).view(np.uint8).reshape(-1, 2)


def _f16_round(values: np.ndarray) -> np.ndarray:
    """`values` rounded through f16 and back to float32 (what the decoder will see)."""
    return np.asarray(values, dtype=np.float32).astype(np.float16).astype(np.float32)


def _nearest(x: np.ndarray) -> np.ndarray:
    """ggml's nearest_int: round half to even (its 1.5 * 2^23 trick), as int32."""
    return np.rint(x).astype(np.int32)


def _round_half_away(x: np.ndarray) -> np.ndarray:
    """Round to nearest, ties away from zero (C's roundf), exactly: x - trunc(x) is exact."""
    t = np.trunc(x)
    return np.where(np.abs(x - t) >= 0.5, t + np.sign(x), t)


def _seq_sum(terms: np.ndarray) -> np.ndarray:
    """Sum over axis 0 in float32, one term at a time, like C's ``for (...) s += t[i]``.

    numpy's own reductions sum pairwise or with several accumulators; the order changes the
    last bits, and these sums feed comparisons that pick scales.
    """
    total = terms[0].astype(_F32, copy=True)
    for term in terms[1:]:
        total += term
    return total


def _as_u8(levels: np.ndarray) -> np.ndarray:
    """Integer levels stored into C's uint8_t (negative values wrap), as int32."""
    return levels & 0xFF


# --- ggml's scale searches, vectorised over sub-blocks ------------------------------------


def _make_qkx_quants(
    x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int, use_mad: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml's make_qkx2_quants / make_qkx3_quants (identical when weights are given).

    Asymmetric quantization ``x ~ scale * L - min`` with L in [0, nmax]: start from the
    min..max range, then try ``nstep + 1`` stretched ranges and keep the weighted
    least-squares (scale, min) fit with the smallest weighted error (squared, or absolute
    with `use_mad`). x, w: float32 [n, G]. Returns (scale [G], min [G] (>= 0), L int32 [n, G]).
    """
    lo = start_lo = np.minimum(x.min(axis=0), _F32(0))
    hi = x.max(axis=0)
    flat = hi == lo  # flat sub-blocks end with L = 0, scale 0 and their own min, as in C
    sum_w = _seq_sum(w)
    sum_x = _seq_sum(w * x)

    def error(scale: np.ndarray, offset: np.ndarray, levels: np.ndarray) -> np.ndarray:
        diff = (scale * levels.astype(_F32) + offset) - x
        return _seq_sum(w * (np.abs(diff) if use_mad else diff * diff))

    iscale = _F32(nmax) / np.where(flat, _F32(1), hi - lo)
    scale = _F32(1) / iscale
    best_l = np.clip(_nearest(iscale * (x - lo)), 0, nmax)
    best_err = error(scale, lo, best_l)
    with np.errstate(divide="ignore", invalid="ignore"):
        for step in range(nstep + 1):
            # Like the C, later candidates stretch the range from the best offset found so far.
            iscale = (_F32(rmin) + _F32(rdelta) * _F32(step) + _F32(nmax)) / np.where(flat, _F32(1), hi - lo)
            levels = np.clip(_nearest(iscale * (x - lo)), 0, nmax)
            lf = levels.astype(_F32)
            wl = w * lf
            sum_l = _seq_sum(wl)
            sum_l2 = _seq_sum(wl * lf)
            sum_xl = _seq_sum(wl * x)
            det = sum_w * sum_l2 - sum_l * sum_l
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
            # A positive offset is not representable (the format subtracts min >= 0): refit
            # the scale alone with the offset pinned at zero.
            clamp = this_min > 0
            this_min = np.where(clamp, _F32(0), this_min)
            this_scale = np.where(clamp, sum_xl / sum_l2, this_scale)
            err = error(this_scale, this_min, levels)
            better = (det > 0) & (err < best_err)
            best_l = np.where(better, levels, best_l)
            best_err = np.where(better, err, best_err)
            scale = np.where(better, this_scale, scale)
            lo = np.where(better, this_min, lo)
    scale = np.where(flat, _F32(0), scale)
    best_l = np.where(flat, 0, best_l)
    return scale, -np.where(flat, start_lo, lo), best_l


def _make_qp_quants(x: np.ndarray, w: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml's make_qp_quants: symmetric ``x ~ scale * L``, L <= nmax, weighted.

    Tries 9 scales around nmax / max, then refines levels one at a time (up to 5 passes) while
    that raises the weighted fit ``sumlx^2 / suml2``. Like the C code, the stored levels are
    uint8 (a negative level wraps), which matters only for negative inputs. x, w: float32
    [n, G]. Returns (scale [G], L int32 [n, G] as stored).
    """
    big = np.maximum(x.max(axis=0), _F32(0))
    dead = big < _GROUP_MAX_EPS
    big = np.where(dead, _F32(1), big)

    def mse(scale: np.ndarray, levels: np.ndarray) -> np.ndarray:
        diff = x - scale * levels.astype(_F32)
        return _seq_sum(w * diff * diff)

    iscale = _F32(nmax) / big
    best_mse = mse(_F32(1) / iscale, _as_u8(_nearest(iscale * x)))
    for step in (-4, -3, -2, -1, 1, 2, 3, 4):
        iscale_s = (_F32(0.1) * _F32(step) + _F32(nmax)) / big
        err = mse(_F32(1) / iscale_s, np.minimum(nmax, _nearest(iscale_s * x)))
        better = err < best_mse
        best_mse = np.where(better, err, best_mse)
        iscale = np.where(better, iscale_s, iscale)

    levels = np.minimum(nmax, _nearest(iscale * x))
    lf = levels.astype(_F32)
    sumlx = _seq_sum(w * x * lf)
    suml2 = _seq_sum(w * lf * lf)
    stored = _as_u8(levels)
    with np.errstate(divide="ignore", invalid="ignore"):
        for _ in range(5):
            for i in range(len(x)):
                wi, xi, li = w[i], x[i], stored[i].astype(_F32)
                slx = sumlx - wi * xi * li
                sl2 = suml2 - wi * li * li
                movable = (slx > 0) & (sl2 > 0)
                new_l = np.minimum(nmax, _nearest(xi * sl2 / np.where(movable, slx, _F32(1))))
                nf = new_l.astype(_F32)
                slx = slx + wi * xi * nf
                sl2 = sl2 + wi * nf * nf
                take = movable & (new_l != stored[i]) & (slx * slx * suml2 > sumlx * sumlx * sl2)
                stored[i] = np.where(take, _as_u8(new_l), stored[i])
                sumlx = np.where(take, slx, sumlx)
                suml2 = np.where(take, sl2, suml2)
            # A pass that changes nothing leaves the state as it was, so further passes are
            # no-ops: running all 5 everywhere equals C's early exit.
        scale = np.where(suml2 > 0, sumlx / suml2, _F32(0))
    scale = np.where(dead, _F32(0), scale)
    stored = np.where(dead, 0, stored)
    return scale, stored


# --- Q8_0 ----------------------------------------------------------------------------------


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """Quantize float32 rows (length a multiple of 32) to Q8_0 bytes, shape ``x.shape[:-1] + (row_bytes,)``.

    Bit-exact with gguf-py's and ds4's Q8_0 quantizers (ggml's reference rounding).
    """
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 0:
        raise QuantError("Q8_0: cannot quantize a 0-d array; rows need a last dimension")
    n_row_bytes = row_bytes("Q8_0", x.shape[-1])
    blocks = x.reshape(-1, 32)
    d = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv_d = np.where(d == 0, np.float32(0), np.float32(1) / d)
    out = np.empty((len(blocks), 34), dtype=np.uint8)
    set_f16_field(out, 0, d)
    out[:, 2:] = _round_half_away(blocks * inv_d).astype(np.int8).view(np.uint8)
    return out.reshape(*x.shape[:-1], n_row_bytes)


# --- K-quants: shared tail ------------------------------------------------------------------


def _final_levels(x: np.ndarray, levels: np.ndarray, d: np.ndarray, dmin: np.ndarray, nmax: int) -> np.ndarray:
    """Re-round every value against its decoded sub-block scale ``d`` and offset ``dmin``.

    Sub-blocks whose decoded scale is 0 keep their search levels, as in ggml. x, levels:
    [n, G]; d, dmin: [G] float32 (already f16-rounded products). Returns int32 [n, G].
    """
    with np.errstate(divide="ignore", invalid="ignore"):
        fresh = np.clip(_nearest((x + dmin) / np.where(d == 0, _F32(1), d)), 0, nmax)
    return np.where(d == 0, levels, fresh)


def _pack_q4_k_scales(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """Pack 8 (scale, min) uint8 pairs per block into Q4_K's 12 bytes, with the C's uint8 ops.

    Pairs 0-3 take the low 6 bits of bytes 0-7 whole; pairs 4-7 put their low nibbles in
    bytes 8-11 and their top 2 bits in the high bits of bytes 0-7. ls, lm: [nb, 8] int.
    """
    ls = ls.astype(np.uint8)
    lm = lm.astype(np.uint8)
    out = np.zeros((len(ls), 12), dtype=np.uint8)
    out[:, 0:4] = ls[:, :4]
    out[:, 4:8] = lm[:, :4]
    out[:, 8:12] = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    out[:, 0:4] |= (ls[:, 4:] >> 4) << 6
    out[:, 4:8] |= (lm[:, 4:] >> 4) << 6
    return out


def _sub_blocks(x: np.ndarray, n: int) -> np.ndarray:
    """[nb, 256] blocks as position-major sub-blocks: [n, G], G = nb * 256 // n in memory order."""
    return np.ascontiguousarray(x.reshape(-1, n).T)


def _from_sub_blocks(levels: np.ndarray, nb: int) -> np.ndarray:
    """Inverse of `_sub_blocks` for levels: [n, G] -> [nb, 256]."""
    return levels.T.reshape(nb, QK_K)


def _quantize_q4_k(x: np.ndarray, imp: np.ndarray | None) -> np.ndarray:
    """Q4_K blocks of x [nb, 256] with per-value importance imp [nb, 256] or None."""
    nb = len(x)
    xs = _sub_blocks(x, 32)  # [32, nb*8]
    if imp is None:
        av_x = np.sqrt(_seq_sum(xs * xs) / _F32(32))
        w = av_x + np.abs(xs)
        scales, mins, levels = _make_qkx_quants(xs, w, 15, -1.0, 0.1, 20, use_mad=False)
        scales, mins = scales.reshape(nb, 8), mins.reshape(nb, 8)
        max_scale = np.maximum(scales.max(axis=1), _F32(0))
        max_min = np.maximum(mins.max(axis=1), _F32(0))
        with np.errstate(divide="ignore"):
            inv_scale = np.where(max_scale > 0, _F32(63) / max_scale, _F32(0))[:, None]
            inv_min = np.where(max_min > 0, _F32(63) / max_min, _F32(0))[:, None]
        ls = np.minimum(63, _as_u8(_nearest(inv_scale * scales)))
        lm = np.minimum(63, _as_u8(_nearest(inv_min * mins)))
        d, dmin = max_scale / _F32(63), max_min / _F32(63)
    else:
        sigma2 = _F32(2) * _seq_sum(_sub_blocks(x, QK_K) ** 2) / _F32(QK_K)  # [nb]
        sigma2_s = np.repeat(sigma2, 8)
        w = _sub_blocks(imp, 32) * np.sqrt(sigma2_s + xs * xs)
        sw = _seq_sum(w).reshape(nb, 8).T  # [8, nb]
        scales, mins, levels = _make_qkx_quants(xs, w, 15, -0.9, 0.05, 36, use_mad=False)
        d, ls = _make_qp_quants(np.ascontiguousarray(scales.reshape(nb, 8).T), sw, 63)
        dmin, lm = _make_qp_quants(np.ascontiguousarray(mins.reshape(nb, 8).T), sw, 63)
        ls, lm = ls.T, lm.T
    out = np.zeros((nb, 144), dtype=np.uint8)
    set_f16_field(out, 0, d)
    set_f16_field(out, 2, dmin)
    out[:, 4:16] = _pack_q4_k_scales(ls, lm)
    sc, m = q4_k_scale_min(out[:, 4:16])  # the 6-bit values as the decoder will read them
    dd = (_f16_round(d)[:, None] * sc.astype(_F32)).reshape(-1)
    dm = (_f16_round(dmin)[:, None] * m.astype(_F32)).reshape(-1)
    levels = _from_sub_blocks(_final_levels(xs, levels, dd, dm, 15), nb).astype(np.uint8)
    # Per 64 values: 32 bytes, low nibble from the first 32 values, high from the next 32.
    quads = levels.reshape(nb, 4, 2, 32)
    out[:, 16:] = (quads[:, :, 0] | (quads[:, :, 1] << 4)).reshape(nb, 128)
    return out


def _quantize_q2_k(x: np.ndarray, imp: np.ndarray | None) -> np.ndarray:
    """Q2_K blocks of x [nb, 256] with per-value importance imp [nb, 256] or None."""
    nb = len(x)
    xs = _sub_blocks(x, 16)  # [16, nb*16]
    out = np.zeros((nb, 84), dtype=np.uint8)
    if imp is None:
        scales, mins, levels = _make_qkx_quants(xs, np.abs(xs), 3, -0.5, 0.1, 15, use_mad=True)
        scales, mins = scales.reshape(nb, 16), mins.reshape(nb, 16)
        max_scale = np.maximum(scales.max(axis=1), _F32(0))
        max_min = np.maximum(mins.max(axis=1), _F32(0))
        with np.errstate(divide="ignore"):
            iscale = (_F32(15) / np.where(max_scale > 0, max_scale, _F32(1)))[:, None]
            imin = (_F32(15) / np.where(max_min > 0, max_min, _F32(1)))[:, None]
        ls = np.where(max_scale[:, None] > 0, _as_u8(_nearest(iscale * scales)), 0)
        lm = np.where(max_min[:, None] > 0, _as_u8(_nearest(imin * mins)), 0)
        d, dmin = max_scale / _F32(15), max_min / _F32(15)
    else:
        sigma2 = _seq_sum(_sub_blocks(x, QK_K) ** 2) / _F32(QK_K)
        w = _sub_blocks(imp, 16) * np.sqrt(np.repeat(sigma2, 16) + xs * xs)
        sw = _seq_sum(w).reshape(nb, 16).T  # [16, nb]
        scales, mins, levels = _make_qkx_quants(xs, w, 3, -0.9, 0.05, 36, use_mad=False)
        d, ls = _make_qp_quants(np.ascontiguousarray(scales.reshape(nb, 16).T), sw, 15)
        dmin, lm = _make_qp_quants(np.ascontiguousarray(mins.reshape(nb, 16).T), sw, 15)
        ls, lm = ls.T, lm.T
    packed = ls.astype(np.uint8) | (lm.astype(np.uint8) << 4)
    out[:, :16] = packed
    set_f16_field(out, 80, d)
    set_f16_field(out, 82, dmin)
    dd = (_f16_round(d)[:, None] * (packed & 0xF).astype(_F32)).reshape(-1)
    dm = (_f16_round(dmin)[:, None] * (packed >> 4).astype(_F32)).reshape(-1)
    levels = _from_sub_blocks(_final_levels(xs, levels, dd, dm, 3), nb).astype(np.uint8)
    # Per 128 values: 32 bytes, 2-bit fields from values l, l+32, l+64, l+96 (lowest first).
    quads = levels.reshape(nb, 2, 4, 32)
    out[:, 16:80] = (quads[:, :, 0] | (quads[:, :, 1] << 2) | (quads[:, :, 2] << 4) | (quads[:, :, 3] << 6)).reshape(
        nb, 64
    )
    return out


# --- IQ2_XXS ---------------------------------------------------------------------------------

_IQ2_SHELLS = 2  # neighbour lists hold the grid points of the two nearest distances
_DOT_ROWS = 32  # rows per BLAS call in `_Iq2Search.dot_tables`: 32 x 512 x 16 = 2^18


class _Iq2Search:
    """IQ2_XXS's grid: code -> grid index, and nearest-grid lists for off-grid codes.

    A code packs 8 levels l in {0, 1, 2} (magnitudes 2l + 1) two bits each, like ggml's
    ``u``. ggml's off-grid list for a code holds the grid points in the two nearest squared
    distance shells, sorted by (distance, index); the best of them for the current scale wins
    (the first on ties). Lists are 1 to 150 long (18 on average), so they are kept ragged:
    ``lists[start[code] : start[code] + length[code]]``.
    """

    def __init__(self) -> None:
        levels = np.rint((IQ2XXS_GRID - 8) / 17).astype(np.int64)  # magnitudes 8/25/43 -> 0/1/2
        shifts = 2 * np.arange(8)
        self.q = (2 * levels + 1).astype(_F32)  # [256, 8]
        self.dot_rhs = np.zeros((16, 256, 2), dtype=_F32)
        self.dot_rhs[:8, :, 0] = (self.q * self.q).T
        self.dot_rhs[8:, :, 1] = self.q.T
        self.dot_rhs = self.dot_rhs.reshape(16, 512)
        self.index = np.full(1 << 16, -1, dtype=np.int32)
        self.index[(levels << shifts).sum(axis=1)] = np.arange(256, dtype=np.int32)

        all_levels = np.array(list(itertools.product(range(3), repeat=8)), dtype=np.int64)
        codes = (all_levels << shifts).sum(axis=1)
        off = self.index[codes] < 0
        codes, all_levels = codes[off], all_levels[off]
        dist = ((2 * all_levels[:, None, :] + 1 - self.q[None].astype(np.int64)) ** 2).sum(axis=2)
        order = np.lexsort((np.broadcast_to(np.arange(256), dist.shape), dist), axis=1)
        dist_sorted = np.take_along_axis(dist, order, axis=1)
        # Distance rank of each sorted entry (0 = nearest shell); keep the first _IQ2_SHELLS.
        rank = np.concatenate(
            [np.zeros((len(dist), 1), dtype=np.int64), np.cumsum(np.diff(dist_sorted, axis=1) > 0, axis=1)], axis=1
        )
        keep = rank < _IQ2_SHELLS  # a prefix of each sorted row
        self.length = np.zeros(1 << 16, dtype=np.int32)
        self.length[codes] = keep.sum(axis=1)
        self.start = np.zeros(1 << 16, dtype=np.int32)
        self.start[codes] = np.cumsum(self.length[codes]) - self.length[codes]
        self.lists = order[keep].astype(np.int32)  # row-major: each code's prefix in turn

    def dot_tables(self, x8: np.ndarray, w8: np.ndarray) -> np.ndarray:
        """Per 8-value group and grid point, ``sum w q^2`` (real) and ``sum w x q`` (imag).

        x8, w8: float32 [M, 8] values and search weights. Returns complex64 [M, 256]: packing
        the pair into one complex number lets `snap` fetch both with a single gather.
        """
        # One BLAS product [w | w x] @ [[q^2, 0], [0, q]] with the output columns interleaved
        # (the zero blocks add exact zeros): contiguous, so no strided writes. It runs as a
        # stack of 32-row products because OpenBLAS keeps those (m n k <= 2^18) on the calling
        # thread; big ones start its own threads, which then spin against our chunk threads.
        lhs = np.concatenate([w8, w8 * x8], axis=1)
        rows = len(lhs)
        pad = -rows % _DOT_ROWS
        if pad:
            lhs = np.concatenate([lhs, np.zeros((pad, 16), dtype=_F32)])
        table = np.matmul(lhs.reshape(-1, _DOT_ROWS, 16), self.dot_rhs).reshape(-1, 512)[:rows]
        return table.view(np.complex64)

    def snap(self, codes: np.ndarray, scale: np.ndarray, dots: np.ndarray) -> np.ndarray:
        """Grid index for each 8-value group: its own code if on the grid, else the best neighbour.

        codes: int [M] level codes; scale: float32 [M] the group's candidate scale s; dots:
        `dot_tables` of the groups, with w the square root of the weight, as in ggml's
        neighbour search. The weighted distance ``sum w (s q - x)^2`` equals
        ``s^2 sum w q^2 - 2 s sum w x q`` plus a term that is the same for every grid point.
        All (group, neighbour) pairs are evaluated in one flat pass, in group order, so the
        table is read front to back once.
        """
        gi = self.index[codes]
        rows = np.flatnonzero(gi < 0).astype(np.int32)
        if not len(rows):
            return gi
        off = codes[rows]
        lengths = self.length[off]
        seg_start = np.cumsum(lengths, dtype=np.int32) - lengths
        pair = np.arange(int(seg_start[-1] + lengths[-1]), dtype=np.int32)
        # np.take with mode="clip" skips fancy indexing's negative-index and bounds handling
        # (the indices are valid by construction) and is several times faster here.
        cand = np.take(self.lists, np.repeat(self.start[off] - seg_start, lengths) + pair, mode="clip")
        pair_dots = np.take(dots.reshape(-1), np.repeat(rows * np.int32(256), lengths) + cand, mode="clip")
        s = scale[rows]
        dist = np.repeat(s * s, lengths) * pair_dots.real
        dist -= np.repeat(_F32(2) * s, lengths) * pair_dots.imag
        # Segment argmin, first index on ties: the lowest pair position holding its segment's min.
        at_min = dist == np.repeat(np.minimum.reduceat(dist, seg_start), lengths)
        first = np.minimum.reduceat(np.where(at_min, pair, np.int32(len(pair))), seg_start)
        gi[rows] = cand[first]
        return gi


@functools.cache
def _iq2_search() -> _Iq2Search:
    return _Iq2Search()


def _iq2_codes(xval: np.ndarray, inv_scale: np.ndarray) -> np.ndarray:
    """Level codes [4, G] of xval [32, G] at inverse scale [G]: l = round((x/s - 1) / 2) in [0, 2]."""
    levels = np.clip(_nearest(_F32(0.5) * (inv_scale * xval - _F32(1))), 0, 2)
    return (levels.reshape(4, 8, -1) << (2 * np.arange(8, dtype=np.int32))[None, :, None]).sum(axis=1)


def _quantize_iq2_xxs(x: np.ndarray, imp: np.ndarray) -> np.ndarray:
    """IQ2_XXS blocks of x [nb, 256] with per-value importance imp [nb, 256] (required)."""
    search = _iq2_search()
    nb = len(x)
    xs = _sub_blocks(x, 32)  # [32, G], G = nb * 8 groups of 32
    n_groups = xs.shape[1]
    sigma2 = np.repeat(_seq_sum(_sub_blocks(x, QK_K) ** 2) / _F32(QK_K), 8)
    w = _sub_blocks(imp, 32) * np.sqrt(sigma2 + xs * xs)
    waux = np.sqrt(w)

    # Signs: 7 stored bits per 8 values, the 8th implied by even parity. With an odd count of
    # negatives, the value whose sign flip costs least (smallest w x^2) is flipped instead.
    neg = (xs < 0).reshape(4, 8, n_groups)
    bits = (1 << np.arange(8, dtype=np.int32))[None, :, None]
    signs = (neg * bits).sum(axis=1)  # [4, G]
    odd = (neg.sum(axis=1) % 2).astype(bool)
    cheapest = ((w * xs) * xs).reshape(4, 8, n_groups).argmin(axis=1)
    xval = np.abs(xs).reshape(4, 8, n_groups)
    flip = np.zeros_like(neg)
    np.put_along_axis(flip, cheapest[:, None, :], odd[:, None, :], axis=1)
    xval = np.where(flip, -xval, xval).reshape(32, n_groups)
    signs = (signs ^ np.where(odd, 1 << cheapest, 0)) & 127

    # Per 8-value group and grid point, the two dot products of the neighbour distance.
    x8 = xval.reshape(4, 8, n_groups).transpose(2, 0, 1).reshape(-1, 8)  # group-major [G*4, 8]
    w8 = waux.reshape(4, 8, n_groups).transpose(2, 0, 1).reshape(-1, 8)
    dots = search.dot_tables(x8, w8)

    def snap(inv_scale: np.ndarray, scale: np.ndarray) -> np.ndarray:
        codes = _iq2_codes(xval, inv_scale)  # [4, G]
        gi = search.snap(codes.T.reshape(-1), np.repeat(scale, 4), dots)
        return gi.reshape(n_groups, 4).T  # [4, G]

    def fit(gi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        q = search.q[gi].transpose(0, 2, 1).reshape(32, n_groups)  # [4, G, 8] -> [32, G]
        return _seq_sum(w * xval * q), _seq_sum(w * q * q)

    dead = xval.max(axis=0) < _GROUP_MAX_EPS
    scale, _ = _make_qp_quants(xval, w, 4)
    eff_max = scale * _F32(3)
    dead |= eff_max <= 0
    eff_max = np.where(dead, _F32(1), eff_max)
    best = np.zeros(n_groups, dtype=_F32)
    best_gi = np.zeros((4, n_groups), dtype=np.int32)
    with np.errstate(divide="ignore", invalid="ignore"):
        for step in range(-6, 7):
            inv = (_F32(5) + _F32(step) * _F32(0.1)) / eff_max
            gi = snap(inv, _F32(1) / inv)
            sumqx, sumq2 = fit(gi)
            better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
            scale = np.where(better, sumqx / sumq2, scale)
            best = np.where(better, scale * sumqx, best)
            best_gi = np.where(better, gi, best_gi)
        # Snap once more at the winning scale, then refit the scale to those grid points.
        positive = scale > 0
        gi = np.where(positive, snap(_F32(1) / np.where(positive, scale, _F32(1)), scale), best_gi)
        sumqx, sumq2 = fit(gi)
        scale = np.where(positive & (sumq2 > 0), sumqx / sumq2, scale)
    negative = scale < 0
    scale = np.abs(scale)
    signs = np.where(negative, ~signs & 127, signs)
    scale = np.where(dead, _F32(0), scale)

    scales = scale.reshape(nb, 8)
    max_scale = np.maximum(scales.max(axis=1), _F32(0))
    d = max_scale / _F32(31)
    with np.errstate(divide="ignore"):
        inv_d = (_F32(1) / np.where(max_scale > 0, d, _F32(1)))[:, None]
    nibble = np.clip(_nearest(_F32(0.5) * (inv_d * scales - _F32(1))), 0, 15).astype(np.uint32)
    grid_word = (gi.astype(np.uint32) << (8 * np.arange(4, dtype=np.uint32))[:, None]).sum(axis=0, dtype=np.uint32)
    sign_word = (signs.astype(np.uint32) << (7 * np.arange(4, dtype=np.uint32))[:, None]).sum(axis=0, dtype=np.uint32)
    live = ~dead
    words = np.empty((nb, 8, 2), dtype=np.uint32)
    words[:, :, 0] = np.where(live, grid_word, 0).reshape(nb, 8)
    words[:, :, 1] = np.where(live, sign_word, 0).reshape(nb, 8) | (nibble << 28)
    words[max_scale == 0] = 0
    out = np.empty((nb, 66), dtype=np.uint8)
    set_f16_field(out, 0, d)
    out[:, 2:] = words.view(np.uint8).reshape(nb, 64)
    return out


# --- public API ------------------------------------------------------------------------------

_BLOCK_QUANTIZERS: dict[str, Callable[[np.ndarray, np.ndarray | None], np.ndarray]] = {
    "Q2_K": _quantize_q2_k,
    "Q4_K": _quantize_q4_k,
    "IQ2_XXS": _quantize_iq2_xxs,
}


def column_energy(x: np.ndarray) -> np.ndarray:
    """ds4's stand-in importance when none is given: ``sum_rows x[r, c]^2``, float32 [n_cols].

    Accumulated row by row in float32, as ds4's converter does.
    """
    energy = np.zeros(x.shape[1], dtype=_F32)
    for row in x:
        energy += row * row
    return energy


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, e.g. under taskset or a CI cpuset)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _check_importance(importance, n_cols: int, type_name: str) -> np.ndarray | None:
    if importance is None:
        return None
    imp = np.asarray(importance, dtype=np.float32)
    if imp.shape != (n_cols,):
        raise QuantError(
            f"{type_name}: importance must be a vector of one weight per column ({n_cols}), got shape {imp.shape}"
        )
    if not np.isfinite(imp).all() or (imp < 0).any():
        raise QuantError(f"{type_name}: importance weights must be finite and >= 0")
    return imp


def quantize(array2d: np.ndarray, type_name: str, importance: np.ndarray | None = None) -> bytes:
    """Quantize a [rows, cols] float matrix to the raw GGUF bytes of `type_name`, row by row.

    `type_name` is one of "Q8_0", "Q2_K", "Q4_K", "IQ2_XXS" (gguf's GGMLQuantizationType
    names); cols must be a multiple of the type's block size (32 for Q8_0, 256 otherwise).
    `importance` is an optional per-column float32 vector (an imatrix entry: the mean squared
    activation feeding each column); Q8_0 ignores it, like ds4, and IQ2_XXS without it uses
    each column's energy (`column_energy`). Decode with ``dequantize(data, type_name, shape)``.
    Raises QuantError (a ValueError) on any bad input.
    """
    if type_name not in QUANTIZABLE:
        block_format(type_name)  # raises for names ds4lab does not know at all
        raise QuantError(f"cannot quantize to {type_name}; quantizable types: {', '.join(QUANTIZABLE)}")
    x = np.asarray(array2d)
    if x.ndim != 2:
        raise QuantError(f"{type_name}: expected a 2-D [rows, cols] array, got shape {x.shape}")
    if not np.issubdtype(x.dtype, np.floating):
        raise QuantError(f"{type_name}: expected a float array, got dtype {x.dtype}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    n_rows, n_cols = x.shape
    fmt = block_format(type_name)
    if n_cols % fmt.block_elems:
        raise QuantError(f"{type_name}: {n_cols} columns is not a multiple of the block size {fmt.block_elems}")
    if not np.isfinite(x).all():
        raise QuantError(f"{type_name}: the matrix holds NaN or infinite values")
    imp = _check_importance(importance, n_cols, type_name)
    if x.size == 0:
        return b""
    if type_name == "Q8_0":
        return quantize_q8_0(x).tobytes()
    if type_name == "IQ2_XXS" and imp is None:
        imp = column_energy(x)

    blocks_per_row = n_cols // QK_K
    out = np.empty((n_rows * blocks_per_row, fmt.block_bytes), dtype=np.uint8)
    rows_per_chunk = max(1, _CHUNK_BLOCKS // blocks_per_row)
    quantizer = _BLOCK_QUANTIZERS[type_name]
    imp_blocks = None if imp is None else imp.reshape(1, blocks_per_row, QK_K)

    def run(start: int) -> None:
        stop = min(start + rows_per_chunk, n_rows)
        xb = x[start:stop].reshape(-1, QK_K)
        ib = None
        if imp_blocks is not None:
            ib = np.broadcast_to(imp_blocks, (stop - start, blocks_per_row, QK_K)).reshape(-1, QK_K)
        out[start * blocks_per_row : stop * blocks_per_row] = quantizer(xb, ib)

    starts = range(0, n_rows, rows_per_chunk)
    if type_name == "IQ2_XXS":
        _iq2_search()  # build the shared tables once, before the threads race to
    # numpy releases the GIL inside its kernels, so chunks in threads use several cores.
    with ThreadPoolExecutor(max_workers=min(len(starts), usable_cpus())) as pool:
        list(pool.map(run, starts))
    return out.tobytes()
