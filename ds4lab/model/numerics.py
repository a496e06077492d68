"""The rounding steps of ds4.c's CPU reference path, as MLX ops.

ds4 does not run DeepSeek V4 in plain float32: it rounds cache rows to f16, simulates the
model's FP8 KV and FP4 indexer quantisation, and quantises activations to int8 blocks
before its Q8_0 and K-quant matmuls. Matching ds4 token for token means reproducing those
roundings, so every function here follows the IEEE semantics of ds4.c's C source (commit
8d57664) and is bit-exact with it where the docstring says so; `data/numerics_ref.npz`
holds the reference outputs the tests compare against.

All functions take float32 arrays of any leading shape and work on the last axis. They use
only MLX ops, so they run on any MLX backend. The block-scaled formats find the power-of-two
scale and the grid point from the float's bits rather than through `log2`, whose accuracy
varies between backends.
"""

from __future__ import annotations

import math
from functools import cache
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from ..floats import log2f_carry_table
from . import cpu_kernels, kernels
from .linalg import ROW_TILE, slots_of, slotted_linear, tile_rows

if TYPE_CHECKING:
    from .rope import Rotation
    from .weights import Q8Matrix

_MANT_BITS = 23
_EXP_BIAS = 127
_MIN_NORMAL_EXP = -126


def round_f16(x: mx.array) -> mx.array:
    """float32 -> f16 -> float32, ds4's storage rounding of KV and indexer cache rows.

    ds4's software `f32_to_f16` is IEEE round-to-nearest-even with subnormals, overflow to
    inf and NaN kept, which is what MLX's cast does.
    """
    return x.astype(mx.float16).astype(mx.float32)


@cache
def _carry_table() -> mx.array:
    return mx.array(log2f_carry_table(), dtype=mx.int32)


def _exponent(x: mx.array) -> mx.array:
    """Unbiased exponent field of non-negative float32 values (-127 for zero and subnormals)."""
    return (mx.view(x, mx.int32) >> _MANT_BITS) - _EXP_BIAS


def _pow2(k: mx.array) -> mx.array:
    """2^k as float32 for integer k in [-126, 127], built from the bits so it is exact."""
    return mx.view((k + _EXP_BIAS) << _MANT_BITS, mx.float32)


def _ceil_log2f(q: mx.array) -> mx.array:
    """`ceilf(log2f(q))` for positive normal float32 q, exactly as ds4 computes it on glibc."""
    e = _exponent(q)
    mant = mx.view(q, mx.int32) & ((1 << _MANT_BITS) - 1)
    carry = mant >= _carry_table()[e - _MIN_NORMAL_EXP]
    return e + carry.astype(mx.int32)


def _round_minifloat(a: mx.array, mant_bits: int, min_exp: int) -> mx.array:
    """Nearest value of a small float format to a >= 0 (not above its max), ties to even code.

    ds4 searches the format's value table and breaks ties towards the even code; the codes'
    parity is their last mantissa bit, so this is round-half-even of a in units of the
    grid step 2^(max(exponent, min_exp) - mant_bits) (subnormals share the step at min_exp).
    """
    step = _pow2(mx.maximum(_exponent(a), min_exp) - mant_bits)
    return mx.round(a / step) * step


def _block_minifloat_round(x: mx.array, block: int, fmax: float, amax_floor: float,
                           mant_bits: int, min_exp: int) -> mx.array:
    """ds4's scaled small-float round trip over blocks of the last axis.

    Per block: amax (floored), scale = 2^ceil(log2f(amax / fmax)), v = clamp(x / scale),
    x <- sign(v) * nearest_grid(|v|) * scale. A negative v that rounds to zero gives -0.0,
    as ds4's `sign * value` does.
    """
    n = x.shape[-1]
    if n % block:
        raise ValueError(f"last axis {n} is not a multiple of the {block}-value block")
    b = x.reshape(*x.shape[:-1], n // block, block)
    amax = mx.maximum(mx.max(mx.abs(b), axis=-1, keepdims=True), mx.array(amax_floor, mx.float32))
    scale = _pow2(_ceil_log2f(amax / fmax))
    v = mx.clip(b / scale, -fmax, fmax)
    r = _round_minifloat(mx.abs(v), mant_bits, min_exp)
    return (mx.where(v < 0, -r, r) * scale).reshape(x.shape)


def fp8_kv_round(x: mx.array, n_nope: int) -> mx.array:
    """ds4's FP8 E4M3FN round trip of the first `n_nope` dims (the rest, RoPE dims, untouched).

    `dsv4_fp8_kv_quantize_row_inplace_cpu`: blocks of 64, amax floored at 1e-4, scale
    2^ceil(log2(amax/448)), values clamped to +-448 and rounded to the nearest e4m3fn value
    (3 mantissa bits, min normal 2^-6, subnormal step 2^-9), ties to the even code.
    ds4 applies it to raw and compressed KV rows after RoPE. Bit-exact with ds4.c.
    """
    if n_nope % 64:
        raise ValueError(f"n_nope {n_nope} is not a multiple of ds4's 64-value FP8 block")
    nope = _block_minifloat_round(x[..., :n_nope], 64, 448.0, 1.0e-4, mant_bits=3, min_exp=-6)
    return mx.concatenate([nope, x[..., n_nope:]], axis=-1)


def hadamard(x: mx.array) -> mx.array:
    """Walsh-Hadamard transform over the last axis (a power of two), scaled by 1/sqrt(n).

    ds4 (`dsv4_hadamard128_inplace_cpu`, n = 128) runs the unnormalised butterflies
    (a + b, a - b) with stride 1, 2, 4, ... in natural Sylvester order, then multiplies every
    value by the float32 constant 1/sqrt(n). Same additions in the same order here, so the
    result is bit-exact with ds4.c.
    """
    n = x.shape[-1]
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard length {n} is not a power of two")
    lead = x.shape[:-1]
    # (a, a) + (b, b) * (1, -1) per pair: a + b and a + (-b), which is a - b, in fewer operations.
    signs = mx.array([[1.0], [-1.0]], mx.float32)
    stride = 1
    while stride < n:
        pairs = x.reshape(*lead, n // (2 * stride), 2, stride)
        x = (pairs[..., :1, :] + pairs[..., 1:, :] * signs).reshape(*lead, n)
        stride *= 2
    return x * mx.array(1.0 / math.sqrt(n), mx.float32)


def fp4_round(x: mx.array) -> mx.array:
    """ds4's FP4 E2M1 round trip in blocks of 32 (`dsv4_fp4_act_quantize_row_inplace_cpu`).

    amax floored at 6 * 2^-126, scale 2^ceil(log2(amax/6)), clamp to +-6, nearest of
    {0, 0.5, 1, 1.5, 2, 3, 4, 6} with ties to the even code. Bit-exact with ds4.c.
    """
    return _block_minifloat_round(x, 32, 6.0, 7.052966104933725e-38, mant_bits=1, min_exp=0)


def indexer_qat(x: mx.array) -> mx.array:
    """ds4's indexer "QAT": Hadamard then FP4 round trip, on indexer queries and keys.

    Without it ds4's top-k selection of compressed rows is not the model's (ds4.c says so at
    `dsv4_indexer_qat_row_inplace_cpu`). Bit-exact with ds4.c.
    """
    return fp4_round(hadamard(x))


def _blocks(x: mx.array, block: int) -> mx.array:
    """The last axis split into blocks, [..., n / block, block]; ds4 needs whole blocks."""
    n = x.shape[-1]
    if n % block:
        raise ValueError(f"last axis {n} is not a multiple of the {block}-value block")
    return x.reshape(*x.shape[:-1], n // block, block)


def _int8_code(v: mx.array) -> mx.array:
    """`(int8_t)clamp(lrintf(v), -128, 127)` as float32: round half to even, and through an
    integer so that a code of zero is +0 as in ds4 (d * code then has ds4's sign of zero)."""
    return mx.clip(mx.round(v), -128, 127).astype(mx.int8).astype(mx.float32)


_INV_127 = float(np.float32(1.0 / 127.0))


def q8_0_act_codes(x: mx.array, as_built: bool = False) -> tuple[mx.array, mx.array]:
    """ds4's Q8_0 activation quantisation as (int8 codes as float32 [..., n/32, 32], scales
    d [..., n/32]); `q8_0_act_round` is d * codes. See `q8_0_act_round` for the rules.

    `as_built=True` takes d as ds4's -ffast-math binaries compute it (gcc and clang alike):
    amax * float32(1/127) instead of amax / 127. That is the arithmetic behind ds4's own
    outputs (the oracle files), so the model's "ds4-cpu" numerics use it."""
    b = _blocks(x, 32)
    amax = mx.max(mx.abs(b), axis=-1, keepdims=True)
    d = amax * _INV_127 if as_built else amax / 127.0
    inv = mx.where(d == 0, 0.0, 1.0 / mx.where(d == 0, 1.0, d))
    return _int8_code(b * inv), d[..., 0]


def q8_0_act_round(x: mx.array) -> mx.array:
    """The activation as ds4's CPU Q8_0 matvec sees it: dequantised d * q per block of 32.

    `quantize_q8_0_activation`: d = amax / 127 (float32 division, d kept as float32, not
    f16), q = lrintf(x * (1/d)) (round half to even) clamped to [-128, 127]; an all-zero block
    gives q = 0. The values d * q are bit-exact with ds4.c.

    ds4 then computes per block f16(w_d) * d * (integer dot of the int8 codes) and sums the
    blocks in float32. A float matmul of this activation with the dequantised Q8_0 weight
    has the same terms, rounded and added in a different order: it differs from ds4's
    output by float32 reassociation only.

    ds4's Makefile builds with -ffast-math; gcc and clang then compute d = amax * float32(1/127),
    one ulp off amax / 127 in about 4.5% of blocks (the codes differ in about 1 of 10^6
    values). This follows the source's IEEE semantics. Blocks with amax below about 4e-37 are
    out of scope: 1/d overflows and ds4's lrintf(inf) is undefined.
    """
    codes, d = q8_0_act_codes(x)
    return (d[..., None] * codes).reshape(x.shape)


def q8_k_act_round(x: mx.array) -> mx.array:
    """The activation as ds4's routed-expert (Q2_K/IQ2_XXS/Q4_K x Q8_K) dots see it: d * q
    per block of 256.

    `ds4_quantize_row_q8_K`: max = the signed value of largest magnitude (first one on ties),
    iscale = -127 / max, q = lrintf(iscale * x) (round half to even) clamped to [-128, 127],
    d = 1 / iscale stored as float32; an all-zero block gives d = 0, q = 0. ds4 uses it on the
    expert input and again on the weighted SwiGLU mid before the down projection. The values
    d * q are bit-exact with ds4.c (which of two opposite maxima is taken only changes the
    sign of zeros). The K-quant dot products then differ from a float matmul with this
    activation by reassociation only.

    Under ds4's -ffast-math gcc (not clang) computes d = max * float32(-1/127) instead of
    1 / iscale: one ulp off in about 28% of blocks, same codes. This follows the source's IEEE
    semantics. As for Q8_0, blocks with a max below about 4e-37 are out of scope.
    """
    b = _blocks(x, 256)
    mag = mx.abs(b)
    signed_max = mx.take_along_axis(b, mx.argmax(mag, axis=-1, keepdims=True), axis=-1)
    zero = mx.max(mag, axis=-1, keepdims=True) == 0
    iscale = -127.0 / mx.where(zero, 1.0, signed_max)
    d = mx.where(zero, 0.0, 1.0 / iscale)
    return (d * _int8_code(iscale * b)).reshape(x.shape)


def rms_norm(x: mx.array, weight: mx.array | None = None, eps: float = 1.0e-6) -> mx.array:
    """ds4's RMSNorm over the last axis: x * (1 / sqrt(mean(x^2) + eps)) [* weight].

    ds4's CPU path accumulates the squares in double and rounds the mean to float32 before
    adding eps; MLX backends have no portable float64, so the sum here is float32. It is
    summed in two levels (about sqrt(n) chunks, then their sums): a single float32 reduction
    over n = 16384 (the HC width) drifts by tens of ulp from ds4's mean, the two levels by a
    few. The rest (the float32 eps addition, 1 / sqrtf, x * scale, then * weight) is ds4's
    order, so the output differs from ds4's by a few ulp at most.
    """
    n = x.shape[-1]
    chunks = math.gcd(n, 1 << (n.bit_length() // 2))
    squares = mx.square(x).reshape(*x.shape[:-1], chunks, n // chunks)
    mean_sq = mx.sum(mx.sum(squares, axis=-1), axis=-1, keepdims=True) / n
    y = x * (1.0 / mx.sqrt(mean_sq + mx.array(eps, mx.float32)))
    return y if weight is None else y * weight


# ---- the numerics object -----------------------------------------------------------------
# Which roundings run (the mode) and how products are scheduled (by device) are decided
# here and nowhere else: the model asks `Numerics.schedule(positions)` for a chunk's
# `Schedule` and every matmul, the attention sums, the HC split and the routed experts go
# through it. It is also the one place the fast path is selected (`Numerics.fast`).
MODES = ("float", "ds4-cpu")


def batch_invariant_device() -> bool:
    """Whether the default device runs the batch-invariant path (the CPU does; GPUs batch)."""
    return mx.default_device() == mx.cpu


def joined(arrays: list[mx.array], axis: int = 0) -> mx.array:
    """`mx.concatenate`; on the CPU joined on the host, so that the result is evaluated: the
    native kernels that read it next would otherwise wait for MLX (a round trip each)."""
    if batch_invariant_device():
        return mx.array(np.concatenate([np.asarray(a) for a in arrays], axis=axis))
    return mx.concatenate(arrays, axis=axis)


class Numerics:
    """The model's numerics: "float" (float32, exact weights) or "ds4-cpu" (also ds4's CPU
    activation roundings: int8 per 32 before every Q8_0 matmul with ds4's integer block dots,
    per 256 before routed experts and their down projections)."""

    def __init__(self, mode: str = "float") -> None:
        if mode not in MODES:
            raise ValueError(f"numerics must be one of {MODES}, not {mode!r}")
        self.mode = mode
        self.emulate = mode == "ds4-cpu"
        self.allow_fast = True          # False keeps the reference composition on a GPU too

    @property
    def batch_invariant(self) -> bool:
        """Fixed-shape products and fixed-order sums, so prefill equals decode bit for bit."""
        return batch_invariant_device()

    @property
    def fast(self) -> bool:
        """The fast path: fused CUDA kernels where they exist ("float" numerics on a CUDA GPU).
        It computes the same function in another float order (checked against the reference
        compositions by bench/check_device.py); the CPU and "ds4-cpu" keep the reference."""
        return not (self.emulate or self.batch_invariant or not self.allow_fast) and kernels.cuda_ready()

    def schedule(self, positions: np.ndarray) -> Schedule:
        """How the products of a chunk of tokens at these absolute positions are computed."""
        return Schedule(self, slots_of(positions) if self.batch_invariant else None, self.fast)


class Schedule:
    """The products of one chunk: `linear` (float weights), `q8` (Q8_0 weights), `experts_in`
    (the routed experts' input rounding). `rows(index)` is the schedule of a subset of the
    chunk's tokens (the tokens that chose one expert)."""

    def __init__(self, numerics: Numerics, slots: np.ndarray | None, fast: bool = False) -> None:
        self.numerics = numerics
        self.slots = slots
        self.fast = fast

    @property
    def batch_invariant(self) -> bool:
        return self.slots is not None

    def rows(self, index: np.ndarray) -> Schedule:
        return Schedule(self.numerics, None if self.slots is None else self.slots[index], self.fast)

    @property
    def native(self) -> bool:
        """The CPU's native kernels (`cpu_kernels`) for the HC input and output, Q8_0 and float
        products, the per-row steps and norms, attention, the compressors, the router, the
        routed experts (in their blocks) and the shared expert's SwiGLU: the batch-invariant
        path in "float" numerics ("ds4-cpu" keeps the compositions its oracle comparisons were
        measured with)."""
        return self.batch_invariant and not self.numerics.emulate and cpu_kernels.available()

    def reference(self) -> Schedule:
        """The same chunk on the reference composition (a block whose hooks need it)."""
        return Schedule(self.numerics, self.slots, False)

    def rms_norm(self, x: mx.array, weight: mx.array | None, eps: float) -> mx.array:
        """ds4's RMSNorm (`rms_norm`); one kernel per call on the fast path and the native CPU path."""
        if self.fast:
            return kernels.row_finish(x, eps=eps, weight=weight)
        if self.native_rows(x):
            return cpu_kernels.row_finish(x, eps=eps, weight=weight)
        return rms_norm(x, weight, eps)

    def native_rows(self, x: mx.array) -> bool:
        """Whether the native kernels take x's rows (`native`, rows a multiple of 32 wide)."""
        return self.native and x.shape[-1] % 32 == 0

    def finish_rows(self, x: mx.array, *, eps: float | None = None, weight: mx.array | None = None,
                    rotation: Rotation | None = None, inverse: bool = False, qat: bool = False,
                    fp8: bool = False, f16: bool = False, prefix: mx.array | None = None) -> mx.array:
        """The per-row steps ds4 chains on q heads, KV rows, compressed rows and indexer rows,
        each optional, in this order: RMSNorm (`eps`, times `weight`), RoPE at `rotation`'s
        positions (`inverse` turns back), Hadamard + FP4 (`qat`), FP8 of the non-RoPE dims
        (`fp8`), f16 storage rounding (`f16`). One kernel on the fast path, which repeats the
        reference's float steps (only the norm's sum runs in another order); so does the native
        CPU kernel. With `prefix` [P, D] (x [rows, D]) the result is prefix's rows, then x's
        finished (the raw window, then a chunk's KV rows: in the same kernel on the fast path)."""
        rope = None if rotation is None else (rotation.cos, rotation.sin)
        if self.fast:
            return kernels.row_finish(x, eps=eps, weight=weight, rope=rope, inverse=inverse, qat=qat, fp8=fp8,
                                      f16=f16, prefix=prefix)
        if self.native_rows(x):
            x = cpu_kernels.row_finish(x, eps=eps, weight=weight, rope=rope, inverse=inverse, qat=qat, fp8=fp8, f16=f16)
        else:
            if eps is not None:
                x = rms_norm(x, weight, eps)
            if rotation is not None:
                x = rotation.apply(x, inverse)
            if qat:
                x = indexer_qat(x)
            if fp8:
                x = fp8_kv_round(x, x.shape[-1] - (0 if rotation is None else 2 * rotation.cos.shape[-1]))
            if f16:
                x = round_f16(x)
        return x if prefix is None else joined([prefix, x])

    def linear(self, x: mx.array, w: mx.array) -> mx.array:
        """x [T, ..., in] @ w[out, in].T; on the invariant path every token through its tile slot,
        or on the native path through `cpu_kernels.linear` (each row on its own, no tiles).

        In "ds4-cpu" numerics on the CPU the products are summed in float64 and rounded once:
        ds4's vectorised float loops are accurate to about an ulp, a BLAS's float32 GEMM may
        not be (MLX's reference BLAS sums naively, about 5x the error), and the int8 roundings
        downstream turn that difference into different codes."""
        if self.slots is None:
            return x @ w.T
        if self.native_rows(x):                  # batch-invariant by construction, no tiles
            return cpu_kernels.linear(x, w)
        if self.numerics.emulate:
            # ROW_TILE tiles whatever the weights: "ds4-cpu" keeps the products its comparisons were measured with.
            return self._slotted(x.astype(mx.float64), w.astype(mx.float64), ROW_TILE).astype(mx.float32)
        return self._slotted(x, w, tile_rows(w.size))

    def _slotted(self, x: mx.array, w: mx.array, height: int) -> mx.array:
        if x.ndim == 2 and x.shape[0] == len(self.slots):          # a row per token: the token's slot
            return slotted_linear(x, w, self.slots, height)
        per_token = x.size // (len(self.slots) * x.shape[-1])
        # Row j of a token at position p takes slot (p·per_token + j) mod ROW_TILE: a
        # function of (p, j) alone, the same in prefill and decode.
        slots = (self.slots[:, None] * per_token + np.arange(per_token)).reshape(-1)
        return slotted_linear(x.reshape(-1, x.shape[-1]), w, slots_of(slots), height).reshape(*x.shape[:-1],
                                                                                             w.shape[0])

    def q8(self, matrix: Q8Matrix, x: mx.array, shape: tuple[int, ...] | None = None, groups: int = 1) -> mx.array:
        """x [..., cols] @ W.T for a Q8_0 matrix; `shape` gives the product another shape (the
        same values: q heads [T, H, D]), which the fast path's matvec and the native kernel
        write directly. With
        `groups`, W's rows are that many equal blocks and block g multiplies x's g-th slice
        (the grouped output projection: x [..., groups * cols])."""
        if groups > 1:
            if self.native:                                      # every group in one call
                return cpu_kernels.q8_0_matmul(matrix.codes, matrix.scales, x, groups=groups, shape=shape)
            per, xs = matrix.rows // groups, x.reshape(*x.shape[:-1], groups, -1)
            return mx.concatenate([self._q8(matrix.rows_slice(g * per, (g + 1) * per), xs[..., g, :])
                                   for g in range(groups)], axis=-1)
        if self.matvec(x):
            return kernels.q8_matvec(matrix, x, shape=shape)
        # On the CPU the native kernel reads the matrices in their codes, its sums batch-invariant
        # by construction; a chain of native steps then needs no MLX evaluation between them
        # (each costs a hand-off to MLX's worker thread).
        if self.native:
            return cpu_kernels.q8_0_matmul(matrix.codes, matrix.scales, x, shape=shape)
        y = self._q8(matrix, x)
        return y if shape is None else y.reshape(shape)

    def matvec(self, x: mx.array) -> bool:
        """Whether products of x [..., cols] are the fast path's matvec kernels: few tokens
        (decode, MTP verification) on the fast path."""
        return self.fast and x.size // x.shape[-1] <= kernels.MATVEC_MAX_TOKENS

    def q8_pair(self, a: Q8Matrix, b: Q8Matrix, x: mx.array, norm_a: tuple[mx.array, float] | None = None,
                slot: int | None = 0, then: tuple[Q8Matrix, tuple[int, ...]] | None = None,
                slots: kernels.CompressorSlots | None = None) -> tuple[mx.array, ...]:
        """(`q8`(a, x), `q8`(b, x)), and with `norm_a` = (weight, eps) also `rms_norm` of the
        first, and with `then` = (C, shape) also `q8`(C, that norm, shape=shape): one kernel for
        all on the fast path's matvec (the same values; `slot`: the block's,
        `kernels._arrival_counters`). `slots` (a decode token's compressor update, its
        frontiers after the rest) only there."""
        if self.matvec(x):
            return kernels.q8_pair(a, b, x, norm_a, slot, then, slots)
        if slots is not None:
            raise ValueError("q8_pair: a compressor update in the launch is the fast path's matvec's only")
        ya, yb = self.q8(a, x), self.q8(b, x)
        if norm_a is None:
            return ya, yb
        normed = self.rms_norm(ya, *norm_a)
        return (ya, yb, normed) if then is None else (ya, yb, normed, self.q8(then[0], normed, shape=then[1]))

    def _q8(self, matrix: Q8Matrix, x: mx.array) -> mx.array:
        if self.numerics.emulate:
            codes, scales = q8_0_act_codes(x, as_built=True)
            return matrix.ds4_cpu(x, codes, scales)
        if self.slots is None:
            return kernels.q8_gemm(matrix, x) if self.fast else matrix.quantized(x)
        # Without the native kernels the BLAS multiplies the decoded matrix (MLX's quantized
        # matmul runs near 1 GFLOP/s here, OpenBLAS near 100).
        return self.linear(x, matrix.dense())

    def experts_in(self, x: mx.array) -> mx.array:
        return q8_k_act_round(x) if self.numerics.emulate else x
