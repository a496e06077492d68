"""Hook points: named places in the forward pass where activations are read or replaced.

Names are dotted, TransformerLens style: `hook_embed`, `blocks.3.attn.hook_q`,
`blocks.3.ffn.hook_experts`, `hook_logits`. A hook is `fn(act, hook)`; `hook.name` is the
point's name, `hook.layer` its block, `hook.positions` the absolute token positions of the
chunk being run (so caches taken during chunked prefill or decode line up). A hook that
returns an array replaces the activation; one that returns None only reads it. A point
with no hook costs one dictionary lookup. A few points only report (their hooks' return
values are ignored): the attention pattern and key spans, and `ffn.hook_routed_mid`, the
route-weighted SwiGLU activations [T, n_expert_used, n_ff] that the down projections take.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
import pandas as pd

from .config import ModelConfig


@dataclass(frozen=True)
class HookPoint:
    name: str
    layer: int | None
    positions: np.ndarray


HookFn = Callable[[mx.array, HookPoint], "mx.array | None"]
NameFilter = str | Callable[[str], bool]


def hook_names(cfg: ModelConfig) -> list[str]:
    """Every hook point of a model with this config, in the order the forward pass reaches them."""
    names = ["hook_embed"]
    for layer, ratio in enumerate(cfg.compress_ratios[: cfg.n_layer]):
        b = f"blocks.{layer}."
        names += [b + "hook_resid_pre"] + [b + f"attn.hook_hc_{k}" for k in ("pre", "post", "comb")]
        names += [b + "attn.hook_in", b + "attn.hook_q", b + "attn.hook_kv"]
        if ratio:
            names += [b + "attn.compressor.hook_rows", b + "attn.compressor.hook_frontier"]
        if ratio == 4:
            names += [b + "attn.indexer.hook_rows", b + "attn.indexer.hook_frontier", b + "attn.indexer.hook_scores",
                      b + "attn.indexer.hook_selected"]
        if ratio:
            names.append(b + "attn.hook_comp_mask")
        names += [b + "attn.hook_pattern", b + "attn.hook_key_span"]
        names += [b + "attn.hook_z", b + "attn.hook_out", b + "hook_resid_mid"]
        names += [b + f"ffn.hook_hc_{k}" for k in ("pre", "post", "comb")] + [b + "ffn.hook_in"]
        names += [b + f"ffn.hook_{k}" for k in ("router_probs", "experts", "expert_weights", "routed_mid",
                                                 "routed_out", "shared_out", "out")]
        names.append(b + "hook_resid_post")
    return [*names, "hook_final_weights", "hook_final_norm", "hook_logits"]


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "blocks" else None


@dataclass
class HookRegistry:
    """The hooks registered on a model, by point name."""

    names: list[str]
    by_name: dict[str, list[HookFn]] = field(default_factory=dict)
    positions: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    def resolve(self, which: NameFilter) -> list[str]:
        chosen = [n for n in self.names if (which(n) if callable(which) else n == which)]
        if not chosen:
            raise KeyError(f"no hook point matches {which!r} (model.hook_names() lists them)")
        return chosen

    def add(self, which: NameFilter, fn: HookFn) -> list[tuple[str, HookFn]]:
        added = []
        for name in self.resolve(which):
            self.by_name.setdefault(name, []).append(fn)
            added.append((name, fn))
        return added

    def remove(self, added: Iterable[tuple[str, HookFn]]) -> None:
        for name, fn in added:
            fns = self.by_name.get(name, [])
            if fn in fns:
                fns.remove(fn)
            if not fns:
                self.by_name.pop(name, None)

    def wants(self, name: str) -> bool:
        return name in self.by_name

    def fire(self, name: str, value: mx.array) -> mx.array:
        fns = self.by_name.get(name)
        if not fns:
            return value
        point = HookPoint(name, _layer_of(name), self.positions)
        for fn in fns:
            out = fn(value, point)
            if out is not None:
                value = out
        return value


def floats_per_token(name: str, cfg: ModelConfig, n_tokens: int) -> int:
    """How many float32 values a point holds per token of a run of `n_tokens` (an estimate for
    the attention pattern and the indexer, whose width grows with the context)."""
    leaf = name.rsplit(".", 1)[-1]
    ratio = cfg.compress_ratios[int(name.split(".")[1])] if name.startswith("blocks.") else 0
    keys = cfg.n_swa + (n_tokens // ratio if ratio else 0)
    sizes = {
        "hook_resid_pre": cfg.hc_dim, "hook_resid_mid": cfg.hc_dim, "hook_resid_post": cfg.hc_dim,
        "hook_hc_pre": cfg.n_hc, "hook_hc_post": cfg.n_hc, "hook_hc_comb": cfg.n_hc * cfg.n_hc,
        "hook_q": cfg.q_dim, "hook_z": cfg.q_dim, "hook_kv": cfg.head_dim,
        "hook_router_probs": cfg.n_expert, "hook_experts": cfg.n_expert_used, "hook_expert_weights": cfg.n_expert_used,
        "hook_routed_mid": cfg.n_expert_used * cfg.n_ff_exp,
        "hook_final_weights": cfg.n_hc, "hook_logits": cfg.n_vocab,
        "hook_pattern": cfg.n_head * (1 + keys), "hook_key_span": 2 * keys,
        "hook_scores": keys, "hook_selected": keys,
    }
    if name.endswith("hook_frontier"):
        return 0
    if name.endswith("compressor.hook_rows"):
        return cfg.head_dim // max(ratio, 1) + 1
    if name.endswith("indexer.hook_rows"):
        return cfg.indexer_head_dim // max(ratio, 1) + 1
    return sizes.get(leaf, cfg.n_embd)


class ActivationCache(dict):
    """name -> numpy array, rows of chunks run one after another concatenated (see `positions`).

    `keep` (absolute token positions) keeps only those rows of the points whose first axis
    is the chunk's tokens; other points are kept whole."""

    def __init__(self, keep: np.ndarray | None = None) -> None:
        super().__init__()
        self.positions: dict[str, np.ndarray] = {}
        self.keep = keep

    def record(self, act: mx.array, hook: HookPoint) -> None:
        value = np.array(act)
        if self.keep is not None and value.ndim and value.shape[0] == len(hook.positions):
            rows = np.isin(hook.positions, self.keep)
            value, hook = value[rows], HookPoint(hook.name, hook.layer, hook.positions[rows])
        if hook.name in self:
            self[hook.name] = np.concatenate([self[hook.name], value])
            self.positions[hook.name] = np.concatenate([self.positions[hook.name], hook.positions])
        else:
            self[hook.name] = value
            self.positions[hook.name] = hook.positions

    def routing_frame(self) -> pd.DataFrame:
        """One row per (position, layer, slot): the expert chosen and, if cached, its route weight."""
        frames = []
        for name in (n for n in self if n.endswith("ffn.hook_experts")):
            layer = int(name.split(".")[1])
            experts = self[name]
            frame = pd.DataFrame({
                "position": np.repeat(self.positions[name], experts.shape[1]),
                "layer": layer,
                "slot": np.tile(np.arange(experts.shape[1]), experts.shape[0]),
                "expert": experts.reshape(-1),
            })
            weights = self.get(name.replace("hook_experts", "hook_expert_weights"))
            if weights is not None:
                frame["weight"] = weights.reshape(-1)
            frames.append(frame)
        return pd.concat(frames, ignore_index=True)

    def attention_frame(self, layer: int) -> pd.DataFrame:
        """One row per (position, head, key used): the weight and the token positions the key
        covers; the sink's share as key -1. Needs `hook_pattern` and `hook_key_span` cached."""
        weights = self[f"blocks.{layer}.attn.hook_pattern"]
        span = self[f"blocks.{layer}.attn.hook_key_span"]
        t, h, width = weights.shape
        key = np.arange(width) - 1
        first = np.concatenate([np.full((t, 1), -1), span[..., 0]], axis=1)
        last = np.concatenate([np.full((t, 1), -1), span[..., 1]], axis=1)
        frame = pd.DataFrame({
            "position": np.repeat(self.positions[f"blocks.{layer}.attn.hook_pattern"], h * width),
            "head": np.tile(np.repeat(np.arange(h), width), t),
            "key": np.tile(key, t * h),
            "first": np.repeat(first, h, axis=0).reshape(-1),
            "last": np.repeat(last, h, axis=0).reshape(-1),
            "weight": weights.reshape(-1),
        })
        return frame[(frame["key"] < 0) | (frame["first"] >= 0)].reset_index(drop=True)

    def to_frame(self, name: str) -> pd.DataFrame:
        """A tidy table of one cached point: one row per (position, index...) with its value."""
        value = self[name]
        index = np.indices(value.shape).reshape(value.ndim, -1)
        columns = {"position": self.positions[name][index[0]] if len(self.positions[name]) == value.shape[0]
                   else index[0]}
        for axis in range(1, value.ndim):
            columns[f"index{axis}"] = index[axis]
        columns["value"] = value.reshape(-1)
        return pd.DataFrame(columns)
