"""Mixture of experts: router scores, hash or biased top-k selection, routed and shared experts.

Router scores are sqrt(softplus(logit)). The first n_hash_layer layers pick experts by a
table indexed by the token id; later layers pick the top n_expert_used of score + bias (the
bias only selects). Route weights are the selected experts' unbiased scores, normalised to
sum 1 (denominator at least 2^-14) and scaled. Each expert is a clamped SwiGLU whose output
is scaled by its route weight before the down projection; the shared expert runs always.

Routed experts stay in block form: for a chunk of tokens, only the experts some token chose
are decoded, a few at a time, and each is applied to the tokens that chose it; on the fast
path the CUDA kernels read the block bytes themselves (no decoded copy).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import mlx.core as mx
import numpy as np

from ..quants import gather_experts
from . import cpu_kernels, kernels, kquant_dots, linalg
from .numerics import Schedule
from .weights import ExpertBlocks, LayerWeights, Q8Matrix

_ROUTE_DENOM_FLOOR = 2.0 ** -14
# Experts decoded at once: bounds the float32 temporaries (3 matrices each) on big models.
_EXPERTS_PER_BATCH = 8
# Up to this many (token, expert) pairs a GPU decodes per pair instead of per expert.
_GATHERED_MAX_PAIRS = 48


def router_probs(layer: LayerWeights, xf: mx.array, mm: Schedule) -> mx.array:
    """sqrt(softplus(router logits)), [T, n_expert]."""
    logits = mm.linear(xf, layer.dense["ffn_gate_inp.weight"])
    softplus = mx.where(logits > 20, logits, mx.where(logits < -20, mx.exp(logits), mx.log1p(mx.exp(logits))))
    return mx.sqrt(softplus)


def select_experts(layer: LayerWeights, probs: mx.array, tokens: mx.array, n_used: int) -> mx.array:
    """The experts each token uses, [T, n_used] int32 in ds4's order: the hash table's row on
    hash layers, else the best n_used of probs + bias (the bias only selects)."""
    if layer.tid2eid is not None:
        return layer.tid2eid[tokens]
    selection = probs
    if "exp_probs_b.bias" in layer.dense:
        selection = probs + layer.dense["exp_probs_b.bias"]
    return mx.argsort(-selection, axis=-1)[:, :n_used].astype(mx.int32)


def route_weights(probs: mx.array, experts: mx.array, scale: float) -> mx.array:
    """The chosen experts' scores normalised to sum 1 (denominator at least 2^-14), times scale."""
    chosen = mx.take_along_axis(probs, experts.astype(mx.int32), axis=-1)
    denom = mx.maximum(chosen.sum(axis=-1, keepdims=True), _ROUTE_DENOM_FLOOR)
    return chosen / denom * scale


def route_fused(layer: LayerWeights, xf: mx.array, tokens: mx.array, n_used: int, scale: float,
                planes: bool = False) -> tuple[mx.array, mx.array, mx.array, mx.array | None]:
    """The fast path's router: one kernel for `router_probs`, `select_experts` (the hash table's
    rows of `tokens` [T] on hash layers) and `route_weights`, after the logits' GEMM, or in a
    decode step with the logits made inside: (probs, experts, weights, planes). With `planes`
    (where `planes_serve`) a decode step also writes xf as `expert_swiglu(planes=)` takes it
    (`kernels.router_planes`); planes is None where it is not made."""
    if xf.shape[0] <= kernels.MATVEC_MAX_TOKENS:
        route = _route(layer, tokens, n_used, scale)
        if planes:
            return kernels.router_planes(xf, route.bias, n_used, scale, route.weight, route.hashed, route.slot)
        return (*kernels.router(xf, route.bias, n_used, scale, weight=route.weight, hashed=route.hashed,
                                slot=route.slot), None)
    hashed = (layer.tid2eid, tokens) if layer.tid2eid is not None else None
    return (*kernels.router(xf @ layer.transposed("ffn_gate_inp.weight"), layer.dense.get("exp_probs_b.bias"), n_used,
                            scale, hashed=hashed, slot=layer.index), None)


def planes_serve(layer: LayerWeights, xf: mx.array, n_used: int, mm: Schedule) -> bool:
    """Whether the FFN input's byte planes would be read if the router wrote them: a decode
    step whose routed gate and up (IQ2_XXS) come from one launch (`routed_and_shared_mid`)
    reading xf as it is."""
    return (_in_one_launch(layer, xf, xf.shape[0] * n_used, mm) and _expert_tensors(layer)[0].type_name == "IQ2_XXS"
            and xf.shape[0] <= kernels.MATVEC_MAX_TOKENS and mm.experts_in(xf) is xf)


def _route(layer: LayerWeights, tokens: mx.array, n_used: int, scale: float) -> kernels.Route:
    """The layer's router as a decode step's kernels take it (the logits made inside): the
    matrix as `kernel_dense` gives it (F16 when the file's is), the selection bias, the hash
    table's rows of `tokens` on hash layers."""
    hashed = (layer.tid2eid, tokens) if layer.tid2eid is not None else None
    return kernels.Route(layer.kernel_dense("ffn_gate_inp.weight"), layer.dense.get("exp_probs_b.bias"), scale,
                         n_used, hashed, layer.index)


def swiglu(gate: mx.array, up: mx.array, clamp: float) -> mx.array:
    if clamp > 1e-6:
        gate = mx.minimum(gate, clamp)
        up = mx.clip(up, -clamp, clamp)
    return gate * mx.sigmoid(gate) * up


@cache
def _swiglu_compiled(clamp: float, weighted: bool):
    """`swiglu` with this clamp, compiled into one kernel (the clamp a constant of the compiled
    graph); `weighted` also multiplies by the route weights, w [T, U] against [T, U, n_ff]."""
    if weighted:
        return mx.compile(lambda gate, up, w: swiglu(gate, up, clamp) * w[..., None])
    return mx.compile(lambda gate, up: swiglu(gate, up, clamp))


def _swiglu(gate: mx.array, up: mx.array, clamp: float, mm: Schedule) -> mx.array:
    """`swiglu`, compiled into one kernel on the fast path, native on the CPU's native path."""
    if mm.fast:
        return _swiglu_compiled(clamp, False)(gate, up)
    return cpu_kernels.swiglu(gate, up, clamp) if mm.native else swiglu(gate, up, clamp)


def routed_experts(layer: LayerWeights, xf: mx.array, experts: mx.array, weights: mx.array, clamp: float,
                   mm: Schedule, on_mid: Callable[[mx.array], object] | None = None) -> mx.array:
    """Σ over each token's chosen experts of W_down·(w·swiglu(W_gate·x, W_up·x)), [T, d].

    `on_mid`, when given, is shown the route-weighted SwiGLU activations of every (token,
    slot), [T, U, n_ff]: the down projections' input (what ds4's imatrix collects); it only
    reads them, so both schedules stay as they are.

    In "ds4-cpu" numerics with ds4's CPU expert types (IQ2_XXS gate/up, Q2_K down) the experts
    are ds4's integer dots (`kquant_dots`). Otherwise several schedules, the same sums. Few
    (token, expert) pairs on a GPU: decode each pair's expert and multiply, all lazily (no
    host round trip, so a decode step stays one graph). On the CPU in "float" numerics: one
    native call for the chunk (`cpu_kernels.routed_experts`, the experts read in their
    blocks, or kept decoded when the kernel does not read their type). One
    token on the batch-invariant path otherwise (CPU decode): the per-expert schedule's
    products batched, also without a round trip.
    Many pairs on the fast path: tensor-core GEMMs over the pairs grouped by expert. Otherwise
    (prefill on the portable path, and the batch-invariant path, where each token's rows keep
    their tile slot): decode each expert some token chose once, a few at a time, and apply it
    to its tokens.
    """
    gate_t, up_t, down_t = _expert_tensors(layer)
    if mm.numerics.emulate and all(t.type_name in kquant_dots.TYPES for t in (gate_t, up_t, down_t)):
        show = None if on_mid is None else (lambda mid: on_mid(mx.array(mid)))
        return mx.array(kquant_dots.routed_experts(np.array(xf), np.array(experts), np.array(weights),
                                                   layer.experts, clamp, show))
    act_round = mm.experts_in
    fused = mm.fast and all(kernels.available(w.type_name) for w in (gate_t, up_t, down_t))
    if fused and experts.size > _GATHERED_MAX_PAIRS:
        return _routed_grouped(gate_t, up_t, down_t, xf, experts, weights, clamp, on_mid)
    if not mm.batch_invariant and experts.size <= _GATHERED_MAX_PAIRS:
        return _routed_gathered(gate_t, up_t, down_t, act_round(xf), experts, weights, clamp, act_round, on_mid,
                                fused)[0]
    native = [_native_form(t) for t in (gate_t, up_t, down_t)] if mm.native else [None]
    if None not in native:
        y, mid = cpu_kernels.routed_experts(*native, xf, experts, weights, clamp, want_mid=on_mid is not None)
        if on_mid is not None:
            on_mid(mid)
        return y
    if mm.batch_invariant and not mm.numerics.emulate and xf.shape[0] == 1:
        return _routed_one_token(gate_t, up_t, down_t, xf, experts, weights, clamp, int(mm.slots[0]), on_mid)
    route = weights
    experts = np.array(experts)
    x_in = act_round(xf)
    out = mx.zeros(xf.shape, mx.float32)
    used = np.unique(experts)
    pairs, mids = [], []
    for start in range(0, len(used), _EXPERTS_PER_BATCH):
        batch = used[start:start + _EXPERTS_PER_BATCH]
        ids = mx.array(batch)
        gate_w, up_w, down_w = (_decode(t, ids) for t in (gate_t, up_t, down_t))
        for i, e in enumerate(batch):
            tok, slot = np.nonzero(experts == e)
            tok_ids = mx.array(tok)
            x = x_in[tok_ids]
            w = route[tok_ids, mx.array(slot)][:, None]
            rows = mm.rows(tok)
            mid = act_round(swiglu(rows.linear(x, gate_w[i]), rows.linear(x, up_w[i]), clamp) * w)
            out = out.at[tok_ids].add(rows.linear(mid, down_w[i]))
            if on_mid is not None:
                pairs.append(np.stack([tok, slot]))
                mids.append(mid)
        mx.eval(out)
    if on_mid is not None:
        # Every (token, slot) pair belongs to exactly one expert, so the scatter fills every row.
        tok, slot = np.concatenate(pairs, axis=1)
        full = mx.zeros((*experts.shape, down_t.cols), mx.float32)
        full[mx.array(tok), mx.array(slot)] = mx.concatenate(mids)
        on_mid(full)
    return out


def routed_and_shared_mid(layer: LayerWeights, xf: mx.array, experts: mx.array, weights: mx.array, clamp: float,
                          mm: Schedule, on_mid: Callable[[mx.array], object] | None = None,
                          down_later: bool = False,
                          planes: mx.array | None = None) -> tuple[mx.array | kernels.RoutedDown, mx.array]:
    """(`routed_experts`, `shared_mid`). In a fast-path decode step whose routed gate and up
    share a block format, the routed pairs' SwiGLU and the shared expert's come from one launch
    (`kernels.expert_swiglu(shared=)`: both read the FFN input); there, with `down_later`, the
    routed output is left as its down products still to make (`kernels.RoutedDown`: the
    shared expert's down launch makes them beside its own rows, `hc.hc_expand_q8`, when the
    two down matrices have one shape). `planes`: xf as `route_fused` wrote it, for that launch's
    routed dots (`kernels.expert_swiglu(planes=)`), used where the experts read xf unrounded."""
    if not _in_one_launch(layer, xf, experts.size, mm):
        return routed_experts(layer, xf, experts, weights, clamp, mm, on_mid), shared_mid(layer, xf, clamp, mm)
    gate_t, up_t, down_t = _expert_tensors(layer)
    x_in = mm.experts_in(xf)
    return _routed_gathered(gate_t, up_t, down_t, x_in, experts, weights, clamp, mm.experts_in, on_mid,
                            True, _shared_gate_up(layer), _down_later(layer, down_later),
                            planes if x_in is xf else None)


def routed_and_shared_mid_routing(layer: LayerWeights, xf: mx.array, tokens: mx.array, n_used: int, scale: float,
                                  clamp: float, mm: Schedule, on_mid: Callable[[mx.array], object] | None = None,
                                  down_later: bool = False
                                  ) -> tuple[mx.array, mx.array | kernels.RoutedDown, mx.array] | None:
    """`route_fused` and then `routed_and_shared_mid` where one launch makes the three
    (`kernels.routed_swiglu`: the router inside the routed experts' launch, a fast-path
    decode step whose experts and weights no hook reads): (experts, routed, shared_mid), as
    the two calls give them; None where that launch does not serve (route first then)."""
    if not _in_one_launch(layer, xf, xf.shape[0] * n_used, mm) or mm.experts_in(xf) is not xf:
        return None
    gate_t, up_t, down_t = _expert_tensors(layer)
    experts, mid, shared = kernels.routed_swiglu(gate_t, up_t, xf, _route(layer, tokens, n_used, scale), clamp,
                                                 _shared_gate_up(layer))
    return experts, _routed_down(down_t, experts, mid, on_mid, _down_later(layer, down_later)), shared


def _expert_tensors(layer: LayerWeights) -> tuple[ExpertBlocks, ExpertBlocks, ExpertBlocks]:
    """The layer's routed experts: gate, up and down."""
    return tuple(layer.experts[f"ffn_{r}_exps.weight"] for r in ("gate", "up", "down"))


def _routed_down(down_t: ExpertBlocks, experts: mx.array, mid: mx.array,
                 on_mid: Callable[[mx.array], object] | None, down_later: bool) -> mx.array | kernels.RoutedDown:
    """The routed output from the pairs' mid (shown to `on_mid` first): its down products
    still to make with `down_later` (`kernels.RoutedDown`), else made now."""
    if on_mid is not None:
        on_mid(mid)
    routed = kernels.RoutedDown(down_t, experts, mid)
    return routed if down_later else routed.product()


def _in_one_launch(layer: LayerWeights, xf: mx.array, n_pairs: int, mm: Schedule) -> bool:
    """Whether the routed pairs' gate and up and the shared expert's come from one launch: a
    fast-path decode step of few pairs, gate and up in one block format the kernels read."""
    gate_t, up_t, down_t = _expert_tensors(layer)
    return (mm.matvec(xf) and n_pairs <= _GATHERED_MAX_PAIRS and gate_t.type_name == up_t.type_name
            and all(kernels.available(w.type_name) for w in (gate_t, up_t, down_t)))


def _shared_gate_up(layer: LayerWeights) -> tuple[Q8Matrix, Q8Matrix]:
    return layer.q8["ffn_gate_shexp.weight"], layer.q8["ffn_up_shexp.weight"]


def _down_later(layer: LayerWeights, wanted: bool) -> bool:
    """Whether the routed down products are left to the shared expert's down launch: asked
    for, and the two down matrices of one shape (it makes them beside its own rows)."""
    down_t, shared_down = layer.experts["ffn_down_exps.weight"], layer.q8["ffn_down_shexp.weight"]
    return wanted and (down_t.rows, down_t.cols) == (shared_down.rows, shared_down.cols)


def _native_form(tensor: ExpertBlocks) -> tuple[mx.array, str] | None:
    """What the native kernel reads of an expert tensor: its blocks, else its kept float32 copy."""
    if cpu_kernels.reads_blocks(tensor.type_name, tensor.cols):
        return tensor.raw, tensor.type_name
    return None if tensor.float32 is None else (tensor.float32, "F32")


def _routed_gathered(gate_t: ExpertBlocks, up_t: ExpertBlocks, down_t: ExpertBlocks, x_in: mx.array,
                     experts: mx.array, weights: mx.array, clamp: float, act_round,
                     on_mid: Callable[[mx.array], object] | None, fused: bool,
                     shared: tuple[Q8Matrix, Q8Matrix] | None = None, down_later: bool = False,
                     planes: mx.array | None = None) -> tuple[mx.array | kernels.RoutedDown, mx.array | None]:
    """(the routed output (fused, with `down_later`: its down products still to make), and
    with `shared` (fused, gate and up in one format) the shared expert's SwiGLU made in the
    routed one's launch; else None). `planes`: x_in's byte planes for that launch."""
    t, u = experts.shape
    shared_mid = None
    if fused:
        # Two expert kernels: gate, up and the weighted SwiGLU, each token's input read by its
        # U pairs in place; then the down projections, summed in the kernel. (Gate and up in
        # two block formats: one kernel each and a compiled SwiGLU.)
        if gate_t.type_name == up_t.type_name:
            mid = kernels.expert_swiglu(gate_t, up_t, experts, x_in, weights, clamp, shared, planes)  # [T, U, n_ff]
            if shared is not None:
                mid, shared_mid = mid
        else:
            gate = kernels.expert_matvec(gate_t, experts, x_in, pairs_per_input=u)
            up = kernels.expert_matvec(up_t, experts, x_in, pairs_per_input=u)
            mid = _swiglu_compiled(clamp, True)(gate, up, weights)
        return _routed_down(down_t, experts, mid, on_mid, down_later), shared_mid
    ids = experts.reshape(-1)
    x = mx.repeat(x_in, u, axis=0)                                      # [T*U, d]
    gate = _matvec(gate_t, ids, x)
    up = _matvec(up_t, ids, x)
    mid = act_round(swiglu(gate, up, clamp) * weights.reshape(-1, 1))
    if on_mid is not None:
        on_mid(mid.reshape(t, u, -1))
    return _matvec(down_t, ids, mid).reshape(t, u, -1).sum(axis=1), None


def _routed_grouped(gate_t: ExpertBlocks, up_t: ExpertBlocks, down_t: ExpertBlocks, x: mx.array,
                    experts: mx.array, weights: mx.array, clamp: float,
                    on_mid: Callable[[mx.array], object] | None) -> mx.array:
    """The fast path's prefill: the pairs grouped by expert on the device, then three
    tensor-core GEMMs on the block bytes (`kernels.expert_gemm`) and one compiled SwiGLU;
    no host round trip and no decoded copy of any expert."""
    t, u = experts.shape
    tiles = kernels.expert_tiles(experts, gate_t.raw.shape[0])
    gate = kernels.expert_gemm(gate_t, tiles, x, x_div=u).reshape(t, u, -1)
    up = kernels.expert_gemm(up_t, tiles, x, x_div=u).reshape(t, u, -1)
    mid = _swiglu_compiled(clamp, True)(gate, up, weights)
    if on_mid is not None:
        on_mid(mid)
    return kernels.expert_gemm(down_t, tiles, mid, x_div=1).reshape(t, u, -1).sum(axis=1)


def _routed_one_token(gate_t: ExpertBlocks, up_t: ExpertBlocks, down_t: ExpertBlocks, x: mx.array,
                      experts: mx.array, weights: mx.array, clamp: float, slot: int,
                      on_mid: Callable[[mx.array], object] | None) -> mx.array:
    """The per-expert schedule below for a chunk of one token, batched and lazy: the same
    products (the token at its tile slot among zero rows in a tile of an expert matrix's
    height, times each chosen expert's decoded matrix; `linalg.tile_product` on a stack of
    tiles runs each as its own GEMM, so the bits are the per-expert loop's) and the same sum,
    expert by expert in ascending id from zero."""
    order = mx.argsort(experts[0])                      # the loop's order: ascending expert id
    ids, w = experts[0][order], weights[0][order]
    height = linalg.tile_rows(gate_t.rows * gate_t.cols)     # gate, up and down alike
    slot %= height
    at_slot = mx.array(np.arange(height) == slot)[:, None]

    def through(tensor: ExpertBlocks, tiles: mx.array) -> mx.array:
        """tiles [1 or U, height, in] times expert ids[u]'s matrix -> the slot's row [U, out]."""
        return linalg.tile_product(tiles, _decode(tensor, ids).transpose(0, 2, 1))[:, slot]

    tile = mx.where(at_slot, x, 0.0)[None]
    mid = swiglu(through(gate_t, tile), through(up_t, tile), clamp) * w[:, None]
    if on_mid is not None:
        on_mid(mid[mx.argsort(order)][None])            # back in the token's slot order
    y = through(down_t, mx.where(at_slot[None], mid[:, None, :], 0.0))
    out = mx.zeros(x.shape, mx.float32)
    for u in range(y.shape[0]):
        out = out + y[u]
    return out


def _matvec(tensor: ExpertBlocks, ids: mx.array, x: mx.array) -> mx.array:
    """Expert ids[p] times x[p], [P, rows]: decode the pairs' experts, then multiply."""
    return (_decode(tensor, ids) @ x[:, :, None])[..., 0]


def _decode(tensor: ExpertBlocks, ids: mx.array) -> mx.array:
    if tensor.float32 is not None:                      # kept decoded (the CPU, within its budget)
        return tensor.float32[ids]
    return gather_experts(tensor.raw, ids, tensor.type_name, tensor.rows, tensor.cols)


def shared_expert(layer: LayerWeights, xf: mx.array, clamp: float, mm: Schedule) -> mx.array:
    return mm.q8(layer.q8["ffn_down_shexp.weight"], shared_mid(layer, xf, clamp, mm))


def shared_mid(layer: LayerWeights, xf: mx.array, clamp: float, mm: Schedule) -> mx.array:
    """The shared expert's swiglu(W_gate·x, W_up·x), the down projection's input: one kernel
    on the fast path's matvec."""
    gate, up = layer.q8["ffn_gate_shexp.weight"], layer.q8["ffn_up_shexp.weight"]
    if mm.matvec(xf):
        return kernels.q8_swiglu(gate, up, xf, clamp)
    return _swiglu(mm.q8(gate, xf), mm.q8(up, xf), clamp, mm)
