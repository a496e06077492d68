"""The DeepSeek V4 stack: embedding, n_layer blocks over hyper-connection streams, output head.

`Model.forward` runs a chunk of tokens through every layer, reading and extending a
session's state (raw windows, compressed rows, compressor frontiers). ds4 processes a
prompt layer by layer with token-sequential cache updates, so a chunk computed at once
equals token-by-token decode up to float reassociation; decode is the chunk of one token.

Numerics: "float" computes in float32 with exact weights. "ds4-cpu" also rounds
activations the way ds4's CPU path quantises them (int8 per 32 before every Q8_0 matmul,
per 256 before routed experts and before their down projection), which is what makes
comparisons with ds4.c's logits tight.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from ..config import ModelConfig
from ..hooks import ActivationCache, HookFn, HookRegistry, NameFilter, floats_per_token, hook_names
from . import attention, compressor, indexer, moe
from .hc import HCControl, hc_collapse, hc_control, hc_expand, hc_head_weights
from .numerics import fp8_kv_round, indexer_qat, q8_0_act_codes, q8_k_act_round, rms_norm, round_f16
from .rope import Rotation, rope_tail, yarn_for
from .state import LayerCache, SessionState
from .weights import LayerWeights, ModelWeights, Q8Matrix

if TYPE_CHECKING:
    from ..steering import SteeringVector

NUMERICS = ("float", "ds4-cpu")


class Numerics:
    """Where activations get rounded before quantized matmuls."""

    def __init__(self, mode: str) -> None:
        if mode not in NUMERICS:
            raise ValueError(f"numerics must be one of {NUMERICS}, not {mode!r}")
        self.mode = mode
        self.emulate = mode == "ds4-cpu"

    def q8(self, matrix: Q8Matrix, x: mx.array) -> mx.array:
        if not self.emulate:
            return matrix(x)
        codes, scales = q8_0_act_codes(x, as_built=True)
        return matrix.ds4_cpu(x, codes, scales)

    def experts_in(self, x: mx.array) -> mx.array:
        return q8_k_act_round(x) if self.emulate else x


@dataclass
class ChunkResult:
    logits: mx.array                 # [T, n_vocab] (or [1, n_vocab] when only the last is asked for)
    experts: list[mx.array]          # per layer [T, n_expert_used]
    state: SessionState


class Model:
    """DeepSeek V4 from a ModelConfig and its weights; see `ds4lab.load`."""

    def __init__(self, weights: ModelWeights, numerics: str = "float", source: str = "") -> None:
        self.weights = weights
        self.config: ModelConfig = weights.config
        self.numerics = Numerics(numerics)
        self.source = source
        self._tokenizer = None
        self._hooks = HookRegistry(hook_names(self.config))

    # ---- public entry points --------------------------------------------------------
    def __call__(self, tokens, experts=None) -> mx.array:
        """Logits of every position, [T, n_vocab], from a fresh session.

        `experts` (int [T, n_layer, n_expert_used]) forces the routed experts; route weights
        still come from the router's scores of the forced experts.
        """
        tokens = _as_tokens(tokens)
        forced = None if experts is None else mx.array(np.asarray(experts, dtype=np.int32))
        return self.forward(self.empty_state(), tokens, forced=forced).logits

    # ---- hooks --------------------------------------------------------------------
    def hook_names(self) -> list[str]:
        """Every hook point, in forward order (see ds4lab.hooks)."""
        return list(self._hooks.names)

    @contextmanager
    def hooks(self, fwd_hooks: list[tuple[NameFilter, HookFn]]):
        """Hooks active inside the `with` block, in sessions' prefill and decode too."""
        added = [pair for which, fn in fwd_hooks for pair in self._hooks.add(which, fn)]
        try:
            yield self
        finally:
            self._hooks.remove(added)

    def run_with_hooks(self, tokens, fwd_hooks: list[tuple[NameFilter, HookFn]]) -> mx.array:
        """Logits of every position with `fwd_hooks` applied; `fn(act, hook)` may return a replacement."""
        with self.hooks(fwd_hooks):
            return self(tokens)

    def steering(self, vector: SteeringVector, attn: float = 0.0, ffn: float = 1.0, mode: str = "project",
                 layers: Iterable[int] | None = None):
        """`with model.steering(vector, attn=0.0, ffn=1.0, mode="project", layers=None):` ds4's
        directional steering on the attention / FFN outputs of everything run inside (see ds4lab.steering)."""
        from ..steering import steer

        return steer(self, vector, attn=attn, ffn=ffn, mode=mode, layers=layers)

    def cache_estimate(self, names: NameFilter | list[str] | None, n_tokens: int) -> int:
        """Bytes `run_with_cache` would hold for `n_tokens` tokens (before running anything)."""
        wanted = names if isinstance(names, list) else [names or (lambda _: True)]
        chosen = {n for which in wanted for n in self._hooks.resolve(which)}
        return sum(4 * n_tokens * floats_per_token(n, self.config, n_tokens) for n in chosen)

    def run_with_cache(self, tokens, names: NameFilter | list[str] | None = None,
                       positions=None) -> tuple[mx.array, ActivationCache]:
        """(logits, cache): the activations at the points `names` selects (all when None), as
        numpy; `positions` (absolute token positions) keeps only those tokens' rows.
        `cache_estimate` says beforehand how much memory that takes."""
        cache = ActivationCache(None if positions is None else np.asarray(positions).reshape(-1))
        wanted = names if isinstance(names, list) else [names or (lambda _: True)]

        def record(act: mx.array, hook) -> None:
            cache.record(act, hook)

        logits = self.run_with_hooks(tokens, [(which, record) for which in wanted])
        return logits, cache

    def session(self, state: SessionState | None = None):
        """A new generation session, empty or starting from a snapshot."""
        from .session import Session

        return Session(self, None if state is None else state.copy())

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from ..tokenizer import load

            self._tokenizer = load()
        return self._tokenizer

    def empty_state(self) -> SessionState:
        cfg = self.config
        layers = []
        for ratio in cfg.compress_ratios[: cfg.n_layer]:
            layers.append(LayerCache.empty(ratio, cfg.head_dim, cfg.indexer_head_dim))
        return SessionState(layers=layers, tokens=[], logits=None)

    # ---- the stack ------------------------------------------------------------------
    def forward(self, state: SessionState, tokens: list[int], forced: mx.array | None = None,
                last_only: bool = False) -> ChunkResult:
        """Run `tokens` (positions len(state.tokens)..) through the model, extending `state`."""
        cfg, hook = self.config, self._hooks.fire
        p0 = len(state.tokens)
        self._hooks.positions = np.arange(p0, p0 + len(tokens))
        positions = mx.arange(p0, p0 + len(tokens))
        token_ids = mx.array(tokens, dtype=mx.int32)
        x = hook("hook_embed", self.weights.token_embd[token_ids].astype(mx.float32))
        streams = mx.broadcast_to(x[:, None, :], (x.shape[0], cfg.n_hc, cfg.n_embd))
        new_layers, experts = [], []
        rotations: dict[tuple, Rotation] = {}
        for il, layer in enumerate(self.weights.layers):
            kind = (cfg.rope_base(il), yarn_for(cfg, layer.ratio))
            if kind not in rotations:
                rotations[kind] = Rotation.at(positions, cfg.n_rot, *kind)
            b = f"blocks.{il}."
            streams = hook(b + "hook_resid_pre", streams)
            streams, cache = self._attention_block(layer, state.layers[il], streams, positions, p0, rotations[kind])
            streams = hook(b + "hook_resid_mid", streams)
            layer_forced = None if forced is None else forced[:, il]
            streams, routing = self._ffn_block(layer, streams, token_ids, layer_forced)
            streams = hook(b + "hook_resid_post", streams)
            if len(tokens) > 1:
                mx.eval(streams)     # bounds a prefill chunk's graph; a decode step stays one graph
            new_layers.append(cache)
            experts.append(routing.experts)
        if last_only:
            streams = streams[-1:]
        logits = self._head(streams)
        new_state = SessionState(layers=new_layers, tokens=state.tokens + list(tokens), logits=logits[-1])
        return ChunkResult(logits, experts, new_state)

    def _attention_block(self, layer: LayerWeights, cache: LayerCache, streams: mx.array,
                         positions: mx.array, p0: int, rotation: Rotation) -> tuple[mx.array, LayerCache]:
        cfg, nm, hook = self.config, self.numerics, self._hooks.fire
        b = f"blocks.{layer.index}.attn."
        ratio = layer.ratio
        base, yarn = cfg.rope_base(layer.index), yarn_for(cfg, ratio)
        d = layer.dense
        control = self._control(b, streams, d["hc_attn_fn.weight"], d["hc_attn_scale.weight"],
                                d["hc_attn_base.weight"])
        xa = hook(b + "hook_in", rms_norm(hc_collapse(streams, control.pre), d["attn_norm.weight"], cfg.rms_eps))
        q, qr_n = attention.project_q(layer, xa, cfg.n_head, cfg.head_dim, cfg.rms_eps, nm.q8)
        q = hook(b + "hook_q", rotation.apply(q))
        kv = attention.finish_kv_row(attention.project_kv(layer, xa, cfg.rms_eps, nm.q8), rotation, cfg.n_rot)
        kv = hook(b + "hook_kv", kv)

        # Raw window: the rows kept from earlier chunks, then this chunk's rows.
        raw_keys = mx.concatenate([cache.raw, kv])
        raw_pos = mx.arange(p0 - cache.raw.shape[0], p0 + kv.shape[0])
        offset = positions[:, None] - raw_pos[None, :]
        mask = (offset >= 0) & (offset < cfg.n_swa)
        keys = raw_keys
        new_cache = LayerCache(raw=raw_keys[-cfg.n_swa:])

        if ratio:
            comp_rows, frontier = self._compress(layer, "attn_compressor", cache.frontier, xa, positions, p0, ratio,
                                                 cfg.head_dim, base, yarn)
            comp = mx.concatenate([cache.comp, hook(b + "compressor.hook_rows", comp_rows)])
            frontier = self._hook_frontier(b + "compressor.hook_frontier", frontier)
            n_visible = (positions + 1) // ratio
            comp_row = mx.arange(comp.shape[0])[None, :]
            comp_mask = comp_row < n_visible[:, None]
            new_cache.comp, new_cache.frontier = comp, frontier
            if ratio == 4:
                index_rows, index_frontier = self._compress(layer, "indexer_compressor", cache.index_frontier, xa,
                                                            positions, p0, ratio, cfg.indexer_head_dim, base, yarn)
                index_keys = mx.concatenate([cache.index_comp, hook(b + "indexer.hook_rows", index_rows)])
                index_frontier = self._hook_frontier(b + "indexer.hook_frontier", index_frontier)
                new_cache.index_comp, new_cache.index_frontier = index_keys, index_frontier
                if index_keys.shape[0] > cfg.indexer_top_k:
                    scores = indexer.indexer_scores(layer, xa, qr_n, index_keys, rotation, cfg.indexer_heads,
                                                    cfg.indexer_head_dim)
                    scores = hook(b + "indexer.hook_scores", scores)
                    comp_mask = indexer.select_rows(scores, comp_mask, n_visible, cfg.indexer_top_k)
                # A hook may choose other rows, never ones the token cannot see yet.
                comp_mask = hook(b + "indexer.hook_selected", comp_mask) & (comp_row < n_visible[:, None])
            comp_mask = hook(b + "hook_comp_mask", comp_mask) & (comp_row < n_visible[:, None])
            keys = mx.concatenate([raw_keys, comp])
            mask = mx.concatenate([mask, comp_mask], axis=1)

        if self._hooks.wants(b + "hook_pattern") or self._hooks.wants(b + "hook_key_span"):
            self._read_pattern(b, q, keys, mask, d["attn_sinks.weight"], raw_pos, ratio)
        heads = attention.attend(q, keys, mask, d["attn_sinks.weight"])
        heads = hook(b + "hook_z", attention.output_heads(heads, rotation))
        out = hook(b + "hook_out", attention.grouped_output(layer, heads, cfg.n_out_group, nm.q8))
        return hc_expand(out, streams, control), new_cache

    def _hook_frontier(self, name: str, frontier: compressor.Frontier) -> compressor.Frontier:
        """The frontier after the chunk as [2 (kv, score), rows, width]; a replacement becomes the state."""
        if not self._hooks.wants(name):
            return frontier
        both = self._hooks.fire(name, mx.stack([frontier.kv, frontier.score]))
        return compressor.Frontier(both[0], both[1])

    def _read_pattern(self, prefix: str, q: mx.array, keys: mx.array, mask: mx.array, sinks: mx.array,
                      raw_pos: mx.array, ratio: int) -> None:
        """Fire the pattern points: weights over the used keys (sink first) and the token
        positions each key covers, [first, last] (a raw row one position; compressed row c the
        window [c·ratio, c·ratio + ratio - 1], from ratio·(c - 1) on ratio-4 layers, which
        overlap the previous window; -1 for padding)."""
        weights, index = attention.pattern(q, keys, mask, sinks)
        n_raw = raw_pos.shape[0]
        row = mx.maximum(index - n_raw, 0)
        overlap = ratio if ratio == 4 else 0
        first = mx.where(index < n_raw, raw_pos[mx.minimum(mx.maximum(index, 0), n_raw - 1)],
                         mx.maximum(row * max(ratio, 1) - overlap, 0))
        last = mx.where(index < n_raw, first, row * max(ratio, 1) + max(ratio, 1) - 1)
        span = mx.where((index >= 0)[..., None], mx.stack([first, last], axis=-1), -1)
        self._hooks.fire(prefix + "hook_pattern", weights)
        self._hooks.fire(prefix + "hook_key_span", span)

    def _control(self, prefix: str, streams: mx.array, fn: mx.array, scale: mx.array, base: mx.array) -> HCControl:
        cfg, hook = self.config, self._hooks.fire
        c = hc_control(streams, fn, scale, base, cfg.hc_sinkhorn_iter, cfg.rms_eps, cfg.hc_eps)
        return HCControl(hook(prefix + "hook_hc_pre", c.pre), hook(prefix + "hook_hc_post", c.post),
                         hook(prefix + "hook_hc_comb", c.comb))

    def _compress(self, layer: LayerWeights, name: str, frontier: compressor.Frontier, xa: mx.array,
                  positions: mx.array, p0: int, ratio: int, width: int, base: float, yarn) -> tuple:
        d = layer.dense
        kv, score = compressor.project(xa, d[f"{name}_kv.weight"], d[f"{name}_gate.weight"],
                                       d[f"{name}_ape.weight"], positions, ratio)
        pooled, frontier = compressor.compress_chunk(frontier, kv, score, p0, ratio, width)
        if pooled.shape[0] == 0:
            return pooled, frontier
        rows = rms_norm(pooled, d[f"{name}_norm.weight"], self.config.rms_eps)
        first = (p0 // ratio + mx.arange(pooled.shape[0])) * ratio
        rows = rope_tail(rows, first, self.config.n_rot, base, yarn)
        if name == "attn_compressor":
            rows = fp8_kv_round(rows, width - self.config.n_rot)
        else:
            rows = indexer_qat(rows)
        return round_f16(rows), frontier

    def _ffn_block(self, layer: LayerWeights, streams: mx.array, token_ids: mx.array,
                   forced: mx.array | None) -> tuple[mx.array, moe.Routing]:
        cfg, nm, hook = self.config, self.numerics, self._hooks.fire
        b = f"blocks.{layer.index}.ffn."
        d = layer.dense
        control = self._control(b, streams, d["hc_ffn_fn.weight"], d["hc_ffn_scale.weight"], d["hc_ffn_base.weight"])
        xf = hook(b + "hook_in", rms_norm(hc_collapse(streams, control.pre), d["ffn_norm.weight"], cfg.rms_eps))
        routing = moe.route(layer, xf, token_ids, cfg.n_expert_used, cfg.expert_weight_scale, forced)
        hook(b + "hook_router_probs", routing.probs)
        experts = hook(b + "hook_experts", routing.experts)
        if experts is not routing.experts:      # a hook chose the experts: weigh them by the router's scores
            routing = moe.route(layer, xf, token_ids, cfg.n_expert_used, cfg.expert_weight_scale, experts)
        routing.weights = hook(b + "hook_expert_weights", routing.weights)
        clamp = cfg.swiglu_clamp[layer.index]
        mid_point = b + "hook_routed_mid"     # read only; built only when a hook asks for it
        on_mid = (lambda mid: hook(mid_point, mid)) if self._hooks.wants(mid_point) else None
        routed = hook(b + "hook_routed_out", moe.routed_experts(layer, xf, routing, clamp, nm.experts_in, on_mid))
        shared = hook(b + "hook_shared_out", moe.shared_expert(layer, xf, clamp, nm.q8))
        return hc_expand(hook(b + "hook_out", routed + shared), streams, control), routing

    def _head(self, streams: mx.array) -> mx.array:
        cfg, h, hook = self.config, self.weights.head, self._hooks.fire
        w = hook("hook_final_weights", hc_head_weights(streams, h["output_hc_fn"], h["output_hc_scale"],
                                                       h["output_hc_base"], cfg.rms_eps, cfg.hc_eps))
        z = hook("hook_final_norm", rms_norm(hc_collapse(streams, w), h["output_norm"], cfg.rms_eps))
        return hook("hook_logits", self.numerics.q8(self.weights.output, z))


def _as_tokens(tokens) -> list[int]:
    return [int(t) for t in np.asarray(tokens).reshape(-1)]
