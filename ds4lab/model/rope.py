"""ds4's RoPE: interleaved rotation of the last n_rot dims, with YaRN on compressed layers.

Follows ds4.c's CPU path (`rope_tail_ext_inplace`, `rope_tail_layer_inplace`, commit
8d57664). Pair j of the tail, (x[2j], x[2j+1]) counted from the first RoPE dim, turns by

    theta_j = mix_j(pos * s^j),  s = powf(base, -2/n_rot),

where ds4 forms pos * s^j by multiplying a float32 running value by s once per pair (so
the rounding depends on pos, and a per-pair frequency table would not reproduce it) and
mix_j is YaRN's blend of the position (extrapolation) and position / factor (interpolation)
angles, identity on layers without compression. YaRN's magnitude correction is cancelled by
ds4 (it passes the inverse as attn_factor): the cos/sin multiplier is float32(1/m) * m,
exactly 1 for factor 16.

The angles, in float32 as ds4 forms them, are bit-exact with ds4.c. ds4 then calls
glibc's cosf/sinf, which are not correctly rounded (about 1% of results differ from the
correctly rounded value by one ulp); MLX's own cos/sin differ from correct rounding far
more often (about 17%). So cos and sin are computed here in float64 on the CPU stream
(every MLX build has one) with a three-part pi/2 reduction and Taylor series, and rounded
to float32: correctly rounded in practice, the same on every backend, and one ulp away
from glibc's in the rare cases where glibc is not. The rotation itself is ds4's float32
x0*c - x1*s, x0*s + x1*c.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache, cached_property
from typing import Any

import mlx.core as mx
import numpy as np

from ..floats import f32
from .numerics import batch_invariant_device


@dataclass(frozen=True)
class YarnParams:
    """The YaRN settings of ds4's compressed layers (DeepSeek V4 Flash: 16, 65536, 32, 1)."""

    factor: float
    orig_ctx: int
    beta_fast: float
    beta_slow: float


def yarn_for(cfg: Any, ratio: int) -> YarnParams | None:
    """YaRN for a layer of compression ratio `ratio`: None for uncompressed layers.

    ds4 only blends frequencies when the scale factor is above 1, and only on compressed
    layers (`rope_tail_layer_inplace`). A factor in (0, 1), which ds4 would turn into plain
    position interpolation, is not a DeepSeek V4 setting and is treated as no YaRN.
    """
    if ratio == 0 or cfg.rope_scale_factor <= 1.0:
        return None
    return YarnParams(float(cfg.rope_scale_factor), int(cfg.rope_orig_ctx),
                      float(cfg.rope_yarn_beta_fast), float(cfg.rope_yarn_beta_slow))



@dataclass(frozen=True)
class _Table:
    """Per-(n_rot, base, yarn) float32 constants of ds4's angle computation."""

    theta_scale: float              # powf(base, -2/n_rot)
    freq_scale: float               # 1/factor (1 without YaRN)
    ramp: tuple[float, ...]         # YaRN extrapolation weight per pair (0 without YaRN)
    mscale: float                   # cos/sin multiplier left after ds4's cancellation


def _corr_dim(n_rot: int, orig_ctx: int, beta: float, base: float) -> float:
    """ds4's `rope_yarn_corr_dim` in float32 steps: the pair index where beta rotations fit
    in the original context."""
    turn = f32(f32(f32(beta) * 2.0) * f32(math.pi))
    log_ratio = f32(math.log(f32(f32(orig_ctx) / turn)))
    return f32(f32(n_rot * log_ratio) / f32(2.0 * f32(math.log(base))))


def _ramp(n_rot: int, base: float, yarn: YarnParams) -> tuple[float, ...]:
    """ds4's `rope_yarn_ramp` per pair: 1 up to the fast corr dim, 0 from the slow one."""
    low = max(0.0, math.floor(_corr_dim(n_rot, yarn.orig_ctx, yarn.beta_fast, base)))
    high = min(float(n_rot - 1), math.ceil(_corr_dim(n_rot, yarn.orig_ctx, yarn.beta_slow, base)))
    width = max(f32(0.001), f32(high - low))
    return tuple(f32(1.0 - min(1.0, max(0.0, f32(f32(j - low) / width)))) for j in range(n_rot // 2))


@cache
def _table(n_rot: int, base: float, yarn: YarnParams | None) -> _Table:
    base = f32(base)
    theta_scale = f32(base ** f32(-2.0 / n_rot))
    if yarn is None:
        return _Table(theta_scale, 1.0, (0.0,) * (n_rot // 2), 1.0)
    freq_scale = f32(1.0 / f32(yarn.factor))
    mag = f32(1.0 + f32(f32(0.1) * f32(math.log(f32(1.0 / freq_scale)))))
    return _Table(theta_scale, freq_scale, _ramp(n_rot, base, yarn), f32(f32(1.0 / mag) * mag))


def _angles(positions: mx.array, n_rot: int, table: _Table) -> mx.array:
    """theta [..., n_rot/2] in float32 as ds4 forms it, computed on the CPU stream.

    The running product pos, pos*s, (pos*s)*s, ... is a cumulative product; MLX's CPU scan is
    a sequential left fold, which is ds4's order (a GPU scan would reassociate it).
    """
    with mx.stream(mx.cpu):
        pos = positions.astype(mx.float32)[..., None]
        steps = mx.full((*pos.shape[:-1], n_rot // 2 - 1), table.theta_scale, mx.float32)
        extrap = mx.cumprod(mx.concatenate([pos, steps], axis=-1), axis=-1)
        if table.freq_scale == 1.0:
            return extrap
        ramp = mx.array(table.ramp, mx.float32)
        return (extrap * table.freq_scale) * (1.0 - ramp) + extrap * ramp


# pi/2 in three parts; the first two have 30 significant bits, so n * part is exact in
# float64 for |n| < 2^23 (angles up to about 1.3e7 rad).
_PIO2 = (float.fromhex("0x1.921fb54p+0"), float.fromhex("0x1.10b46118p-30"),
         float.fromhex("0x1.313198a2e037p-61"))
# Taylor coefficients (-1)^k / (2k+1)! and (-1)^k / (2k)!, k = 0..9: below 1e-20 of error on |r| <= pi/4.
_SIN_COEF = tuple((-1) ** k / math.factorial(2 * k + 1) for k in range(10))
_COS_COEF = tuple((-1) ** k / math.factorial(2 * k) for k in range(10))


def _horner(r2: mx.array, coef: tuple[float, ...]) -> mx.array:
    acc = mx.full(r2.shape, coef[-1], mx.float64)
    for c in reversed(coef[:-1]):
        acc = acc * r2 + c
    return acc


def _cos_sin(theta: mx.array) -> tuple[mx.array, mx.array]:
    """Float32 cos and sin of float32 angles, correctly rounded in practice.

    float64 on the CPU stream (GPU backends have no float64): r = theta - n*pi/2 with n the
    nearest quadrant, Taylor series of sin r and cos r, then the quadrant's swap and signs.
    """
    with mx.stream(mx.cpu):
        t = theta.astype(mx.float64)
        n = mx.round(t * (2.0 / math.pi))
        r = t
        for part in _PIO2:
            r = r - n * part
        r2 = r * r
        s, c = r * _horner(r2, _SIN_COEF), _horner(r2, _COS_COEF)
        quadrant = mx.remainder(n, 4.0)
        odd = (quadrant == 1.0) | (quadrant == 3.0)
        cos = mx.where(odd, s, c)
        sin = mx.where(odd, c, s)
        cos = mx.where((quadrant == 1.0) | (quadrant == 2.0), -cos, cos)
        sin = mx.where(quadrant >= 2.0, -sin, sin)
        return cos.astype(mx.float32), sin.astype(mx.float32)


def rope_angles(positions: mx.array | int, n_rot: int, base: float,
                yarn: YarnParams | None = None) -> mx.array:
    """ds4's rotation angle per position and pair, positions.shape + (n_rot/2,), float32.

    Bit-exact with the angle ds4.c hands to cosf/sinf.
    """
    return _angles(mx.array(positions), n_rot, _table(n_rot, float(base), yarn))


def rope_cos_sin(positions: mx.array | int, n_rot: int, base: float,
                 yarn: YarnParams | None = None) -> tuple[mx.array, mx.array]:
    """(cos, sin), each positions.shape + (n_rot/2,), float32, ds4's multipliers per pair.

    Depends only on the positions and the layer kind, so a forward pass can compute it once
    per kind and hand it to `apply_rope_tail` for every layer.
    """
    table = _table(n_rot, float(base), yarn)
    cos, sin = _cos_sin(rope_angles(positions, n_rot, base, yarn))
    if table.mscale != 1.0:
        cos, sin = cos * table.mscale, sin * table.mscale
    return cos, sin


def apply_rope_tail(x: mx.array, cos: mx.array, sin: mx.array, inverse: bool = False) -> mx.array:
    """Rotate the last 2 * cos.shape[-1] dims of x's last axis by (cos, sin) pair by pair.

    cos/sin have the positions' shape + (n_rot/2,); the positions' shape must be a prefix of
    x.shape[:-1] (e.g. x [T, H, D], positions [T]). inverse=True turns back by the same
    angle: ds4 negates sin, which is exact.
    """
    return _turn(x, *_pair_factors(cos, sin, inverse))


def _pair_factors(cos: mx.array, sin: mx.array, inverse: bool) -> tuple[mx.array, mx.array]:
    """(c, c) and (-s, s) per pair, [..., n_pairs, 2], s negated for the inverse rotation."""
    if inverse:
        sin = -sin
    return mx.stack([cos, cos], axis=-1), mx.stack([-sin, sin], axis=-1)


def _turn(x: mx.array, cc: mx.array, ss: mx.array) -> mx.array:
    """ds4's x0*c - x1*s, x0*s + x1*c on each pair of x's tail, as pair * (c, c) + swapped pair
    * (-s, s): the same IEEE results (a - b is a + (-b), x1*(-s) is -(x1*s), and a sum does
    not depend on its operands' order) in fewer operations."""
    n_pairs = cc.shape[-2]
    lead = x.shape[:-1]
    fill = (1,) * (len(lead) - (cc.ndim - 2))
    cc, ss = cc.reshape(*cc.shape[:-2], *fill, n_pairs, 2), ss.reshape(*ss.shape[:-2], *fill, n_pairs, 2)
    tail = x[..., x.shape[-1] - 2 * n_pairs:].reshape(*lead, n_pairs, 2)
    turned = (tail * cc + tail[..., ::-1] * ss).reshape(*lead, 2 * n_pairs)
    return mx.concatenate([x[..., : x.shape[-1] - 2 * n_pairs], turned], axis=-1)


def rope_tail(x: mx.array, positions: mx.array | int, n_rot: int, base: float,
              yarn: YarnParams | None = None, inverse: bool = False) -> mx.array:
    """ds4's RoPE on the last `n_rot` dims of x's last axis (GPT-J pairs), at `positions`.

    Uncompressed layers: base 10000, yarn None. Compressed layers: base 160000 with
    `yarn_for(cfg, ratio)`. inverse=True is ds4's inverse rotation of attention outputs.
    """
    cos, sin = rope_cos_sin(positions, n_rot, base, yarn)
    return apply_rope_tail(x, cos, sin, inverse)


# ---- tables on the device ---------------------------------------------------------------
# cos/sin depend only on the position and the layer kind, so a forward pass gathers them from
# a table made once (with the exact code above, on the CPU stream) and kept on the default
# device, grown by doubling when a position passes its end. Nothing is computed per token,
# and no host round trip sits inside a decode step.
_TABLE_START = 4096
_tables: dict[tuple, tuple[mx.array, mx.array]] = {}


def cos_sin_table(n_rot: int, base: float, yarn: YarnParams | None, upto: int) -> tuple[mx.array, mx.array]:
    """(cos, sin) [capacity, n_rot/2] for positions 0..capacity-1, capacity > upto."""
    key = (n_rot, float(base), yarn)
    table = _tables.get(key)
    if table is None or table[0].shape[0] <= upto:
        capacity = _TABLE_START
        while capacity <= upto:
            capacity *= 2
        cos, sin = rope_cos_sin(mx.arange(capacity), n_rot, base, yarn)
        table = (mx.array(cos), mx.array(sin))      # off the CPU stream: on the default device
        mx.eval(*table)
        _tables[key] = table
    return table


def reserve_tables(upto: int) -> None:
    """Grow every table made so far to cover positions 0..upto, so that building a graph for
    them evaluates nothing (a worker thread may be evaluating meanwhile: see
    `generation._WorkerEncoder`)."""
    for n_rot, base, yarn in list(_tables):
        cos_sin_table(n_rot, base, yarn, upto)


@dataclass(frozen=True)
class Rotation:
    """The (cos, sin) of a set of positions for one layer kind, gathered once and applied to
    every tensor rotated at those positions (q, the KV row, indexer queries, head outputs)."""

    cos: mx.array
    sin: mx.array

    @classmethod
    def at(cls, first: int, count: int, n_rot: int, base: float, yarn: YarnParams | None,
           step: int = 1) -> Rotation:
        """Positions first, first + step, ... (count of them)."""
        last = first + step * (count - 1)
        cos, sin = cos_sin_table(n_rot, base, yarn, max(last, 0))
        end = last + 1
        if batch_invariant_device():
            # The rows copied out of the (evaluated) table on the host: an MLX slice would be
            # evaluated by the first native CPU kernel that reads it, a round trip per layer kind.
            return cls(*(mx.array(np.asarray(t)[first:end:step]) for t in (cos, sin)))
        return cls(cos[first:end:step], sin[first:end:step])

    def apply(self, x: mx.array, inverse: bool = False) -> mx.array:
        return _turn(x, *(self._inverse if inverse else self._forward))

    # The pair factors, made once per Rotation and shared by every tensor it turns.
    @cached_property
    def _forward(self) -> tuple[mx.array, mx.array]:
        return _pair_factors(self.cos, self.sin, inverse=False)

    @cached_property
    def _inverse(self) -> tuple[mx.array, mx.array]:
        return _pair_factors(self.cos, self.sin, inverse=True)
