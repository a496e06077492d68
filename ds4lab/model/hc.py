"""Hyper-connections: the n_hc residual streams, their mixing, and the output head's collapse.

The residual is n_hc streams of width n_embd (4 x 4096 in Flash), kept in float32 for the
whole pass. Before each sublayer a control vector is projected from the RMS-normalised
streams: `pre` weights collapse the streams into the sublayer input, `post` weights spread
the sublayer output back, and a Sinkhorn-normalised n_hc x n_hc matrix mixes the old
streams. Shapes: streams [T, n_hc, n_embd]; control values are per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from . import cpu_kernels, kernels
from .numerics import Schedule

if TYPE_CHECKING:
    from .weights import Q8Matrix


@dataclass
class HCControl:
    pre: mx.array    # [T, n_hc]: weights that collapse the streams into the sublayer input
    post: mx.array   # [T, n_hc]: how much of the sublayer output each stream receives
    comb: mx.array   # [T, n_hc (from), n_hc (to)]: doubly-stochastic mixing of the old streams


def _control_vector(streams: mx.array, fn: mx.array, eps: float, mm: Schedule) -> mx.array:
    flat = streams.reshape(streams.shape[0], -1)
    return mm.linear(mm.rms_norm(flat, None, eps), fn)


def hc_control(streams: mx.array, fn: mx.array, scale: mx.array, base: mx.array,
               sinkhorn_iters: int, rms_eps: float, hc_eps: float, mm: Schedule) -> HCControl:
    """pre/post/comb for one sublayer, from the streams right before it (ds4's order of steps).

    The batch-invariant path keeps the float operations of the split exactly ds4's: the
    sigmoids and the softmax as MLX ops, then the Sinkhorn iterations (~120 steps on
    [T, n_hc, n_hc], a few µs of dispatch each as MLX ops) in numpy on the host, the same
    float32 divisions and sums in the same order. A GPU runs the split compiled (the fast
    path fuses it with the collapse and norm: `hc_fused_input`).
    """
    mix = _control_vector(streams, fn, rms_eps, mm)
    if not mm.batch_invariant:
        return HCControl(*_split_compiled(mix, scale, base, streams.shape[1], sinkhorn_iters, hc_eps))
    pre, post, comb = _split_start(mix, scale, base, streams.shape[1], hc_eps)
    return HCControl(pre, post, mx.array(_sinkhorn(np.array(comb), sinkhorn_iters, hc_eps)))


def hc_fused_input(streams: mx.array, weights: kernels.HCInput) -> tuple[mx.array, HCControl]:
    """The fast path's `hc_control` + `hc_collapse` + the sublayer's RMSNorm in one kernel
    (`kernels/cuda/hc_pre.cu`, the split of a token as ds4's `hc_split_sinkhorn`; a decode
    step's mixer product from `hc_mix.cu`), from the sublayer's HC input weights. A decode
    step mostly makes this in the launch before instead (`hc_expand_q8(..., next_input=)`).
    Returns (sublayer input [T, n_embd], control)."""
    x, pre, post, comb = kernels.hc_pre(streams, *weights)
    return x, HCControl(pre, post, comb)


def _split_start(mix: mx.array, scale: mx.array, base: mx.array, n: int,
                 hc_eps: float) -> tuple[mx.array, mx.array, mx.array]:
    """pre, post, and comb before the Sinkhorn iterations: its softmax (+ eps)."""
    pre = mx.sigmoid(mix[:, :n] * scale[0] + base[:n]) + hc_eps
    post = 2.0 * mx.sigmoid(mix[:, n:2 * n] * scale[1] + base[n:2 * n])
    # comb[t, i, j]: row i is the destination-major index ds4 softmaxes over j first.
    logits = (mix[:, 2 * n:] * scale[2] + base[2 * n:]).reshape(-1, n, n)
    return pre, post, mx.softmax(logits, axis=-1, precise=True) + hc_eps


def _sinkhorn(comb, sinkhorn_iters: int, hc_eps: float):
    """ds4's Sinkhorn normalisation of comb [T, n, n], float32 mx.array or numpy array alike
    (the same operations: sums over n values in order, then the divisions)."""
    comb = comb / (comb.sum(axis=1, keepdims=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(axis=2, keepdims=True) + hc_eps)
        comb = comb / (comb.sum(axis=1, keepdims=True) + hc_eps)
    return comb


def _split(mix: mx.array, scale: mx.array, base: mx.array, n: int, sinkhorn_iters: int,
           hc_eps: float) -> tuple[mx.array, mx.array, mx.array]:
    pre, post, comb = _split_start(mix, scale, base, n, hc_eps)
    return pre, post, _sinkhorn(comb, sinkhorn_iters, hc_eps)


_split_compiled = mx.compile(_split)


def hc_collapse(streams: mx.array, weights: mx.array) -> mx.array:
    """Σ_a w[a]·streams[a]: [T, n_hc, d] x [T, n_hc] -> [T, d]."""
    return (streams * weights[:, :, None]).sum(axis=1)


def hc_expand(out: mx.array, streams: mx.array, control: HCControl, mm: Schedule,
              add: mx.array | None = None) -> mx.array:
    """New streams: stream c gets post[c]·out + Σ_a comb[a, c]·streams[a] (one kernel on the
    fast path and the native CPU path); `add`, when given, is added to out first (inside that kernel)."""
    if mm.fast:
        return kernels.hc_post(out, streams, control.post, control.comb, add)
    if mm.native:
        return cpu_kernels.hc_expand(out, streams, control.post, control.comb, add)
    if add is not None:
        out = out + add
    mixed = (control.comb[:, :, :, None] * streams[:, :, None, :]).sum(axis=1)
    return control.post[:, :, None] * out[:, None, :] + mixed


def hc_expand_q8(matrix: Q8Matrix, x: mx.array, streams: mx.array, control: HCControl, mm: Schedule,
                 add: mx.array | kernels.RoutedDown | None = None, next_input: kernels.HCInput | None = None,
                 slot: int | None = 0) -> tuple[mx.array, tuple[mx.array, ...] | None]:
    """`hc_expand`(matrix · x, ...): a sublayer's last product and the new streams, one kernel
    on the fast path's matvec (`kernels.q8_hc`, up to its HC_MAX_STREAMS); `add` is added
    to the product first (routed experts' down products still to make, `kernels.RoutedDown`:
    made in that kernel, beside the product's rows). With `next_input` (the next sublayer's
    HC input weights) that kernel also makes the next sublayer's input, as `hc_fused_input`
    would. Returns (new streams, that input as (x, None, post, comb) (its pre left unread),
    or None: the other paths make none). `slot`: the block's (`kernels._arrival_counters`)."""
    if mm.matvec(x) and streams.shape[1] <= kernels.HC_MAX_STREAMS:
        return kernels.q8_hc(matrix, x, streams, control.post, control.comb, add, next_input, slot)
    if isinstance(add, kernels.RoutedDown):
        add = add.product()
    return hc_expand(mm.q8(matrix, x), streams, control, mm, add=add), None


def hc_head_weights(streams: mx.array, fn: mx.array, scale: mx.array, base: mx.array,
                    rms_eps: float, hc_eps: float, mm: Schedule) -> mx.array:
    """The output head's collapse weights: sigmoid without Sinkhorn, [T, n_hc]."""
    mix = _control_vector(streams, fn, rms_eps, mm)
    return mx.sigmoid(mix * scale + base) + hc_eps    # scale [1] broadcast: `scale[0]` is a gather kernel
