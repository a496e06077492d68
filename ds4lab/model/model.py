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

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..config import ModelConfig
from . import attention, compressor, indexer, moe
from .hc import hc_collapse, hc_control, hc_expand, hc_head_weights
from .numerics import fp8_kv_round, indexer_qat, q8_0_act_codes, q8_k_act_round, rms_norm, round_f16
from .rope import Rotation, rope_tail, yarn_for
from .state import LayerCache, SessionState
from .weights import LayerWeights, ModelWeights, Q8Matrix

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

    # ---- public entry points --------------------------------------------------------
    def __call__(self, tokens, experts=None) -> mx.array:
        """Logits of every position, [T, n_vocab], from a fresh session.

        `experts` (int [T, n_layer, n_expert_used]) forces the routed experts; route weights
        still come from the router's scores of the forced experts.
        """
        tokens = _as_tokens(tokens)
        forced = None if experts is None else mx.array(np.asarray(experts, dtype=np.int32))
        return self.forward(self.empty_state(), tokens, forced=forced).logits

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
        cfg = self.config
        p0 = len(state.tokens)
        positions = mx.arange(p0, p0 + len(tokens))
        token_ids = mx.array(tokens, dtype=mx.int32)
        x = self.weights.token_embd[token_ids].astype(mx.float32)
        streams = mx.broadcast_to(x[:, None, :], (x.shape[0], cfg.n_hc, cfg.n_embd))
        new_layers, experts = [], []
        rotations: dict[tuple, Rotation] = {}
        for il, layer in enumerate(self.weights.layers):
            kind = (cfg.rope_base(il), yarn_for(cfg, layer.ratio))
            if kind not in rotations:
                rotations[kind] = Rotation.at(positions, cfg.n_rot, *kind)
            streams, cache = self._attention_block(layer, state.layers[il], streams, positions, p0, rotations[kind])
            layer_forced = None if forced is None else forced[:, il]
            streams, routing = self._ffn_block(layer, streams, token_ids, layer_forced)
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
        cfg, nm = self.config, self.numerics
        ratio = layer.ratio
        base, yarn = cfg.rope_base(layer.index), yarn_for(cfg, ratio)
        d = layer.dense
        control = hc_control(streams, d["hc_attn_fn.weight"], d["hc_attn_scale.weight"], d["hc_attn_base.weight"],
                             cfg.hc_sinkhorn_iter, cfg.rms_eps, cfg.hc_eps)
        xa = rms_norm(hc_collapse(streams, control.pre), d["attn_norm.weight"], cfg.rms_eps)
        q, qr_n = attention.project_q(layer, xa, cfg.n_head, cfg.head_dim, cfg.rms_eps, nm.q8)
        q = rotation.apply(q)
        kv = attention.finish_kv_row(attention.project_kv(layer, xa, cfg.rms_eps, nm.q8), rotation, cfg.n_rot)

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
            comp = mx.concatenate([cache.comp, comp_rows])
            n_visible = (positions + 1) // ratio
            comp_mask = mx.arange(comp.shape[0])[None, :] < n_visible[:, None]
            new_cache.comp, new_cache.frontier = comp, frontier
            if ratio == 4:
                index_rows, index_frontier = self._compress(layer, "indexer_compressor", cache.index_frontier, xa,
                                                            positions, p0, ratio, cfg.indexer_head_dim, base, yarn)
                index_keys = mx.concatenate([cache.index_comp, index_rows])
                new_cache.index_comp, new_cache.index_frontier = index_keys, index_frontier
                if index_keys.shape[0] > cfg.indexer_top_k:
                    scores = indexer.indexer_scores(layer, xa, qr_n, index_keys, rotation, cfg.indexer_heads,
                                                    cfg.indexer_head_dim)
                    comp_mask = indexer.select_rows(scores, comp_mask, n_visible, cfg.indexer_top_k)
            keys = mx.concatenate([raw_keys, comp])
            mask = mx.concatenate([mask, comp_mask], axis=1)

        heads = attention.attend(q, keys, mask, d["attn_sinks.weight"])
        heads = attention.output_heads(heads, rotation)
        out = attention.grouped_output(layer, heads, cfg.n_out_group, nm.q8)
        return hc_expand(out, streams, control), new_cache

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
        cfg, nm = self.config, self.numerics
        d = layer.dense
        control = hc_control(streams, d["hc_ffn_fn.weight"], d["hc_ffn_scale.weight"], d["hc_ffn_base.weight"],
                             cfg.hc_sinkhorn_iter, cfg.rms_eps, cfg.hc_eps)
        xf = rms_norm(hc_collapse(streams, control.pre), d["ffn_norm.weight"], cfg.rms_eps)
        routing = moe.route(layer, xf, token_ids, cfg.n_expert_used, cfg.expert_weight_scale, forced)
        clamp = cfg.swiglu_clamp[layer.index]
        routed = moe.routed_experts(layer, xf, routing, clamp, nm.experts_in)
        shared = moe.shared_expert(layer, xf, clamp, nm.q8)
        return hc_expand(routed + shared, streams, control), routing

    def _head(self, streams: mx.array) -> mx.array:
        cfg, h = self.config, self.weights.head
        w = hc_head_weights(streams, h["output_hc_fn"], h["output_hc_scale"], h["output_hc_base"],
                            cfg.rms_eps, cfg.hc_eps)
        z = rms_norm(hc_collapse(streams, w), h["output_norm"], cfg.rms_eps)
        return self.numerics.q8(self.weights.output, z)


def _as_tokens(tokens) -> list[int]:
    return [int(t) for t in np.asarray(tokens).reshape(-1)]
