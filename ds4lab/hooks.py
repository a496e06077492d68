"""Hook points: named places in the forward pass where activations are read or replaced.

Names are dotted, TransformerLens style: `hook_embed`, `blocks.3.attn.hook_q`,
`blocks.3.ffn.hook_experts`, `hook_logits`. A hook is `fn(act, hook)`; `hook.name` is the
point's name, `hook.layer` its block, `hook.positions` the absolute token positions of the
chunk being run (so caches taken during chunked prefill or decode line up). A hook that
returns an array replaces the activation; one that returns None only reads it.

Every point is one row of `POINTS`: its name (per block, `blocks.L.` is prepended), the
layers it exists on, its shape, whether a replacement is taken, and what it holds. The
name list, the memory estimate of a cache, the read-only check and the README's table all
come from that table. A read-only point whose hook returns an array raises `HookError`:
nothing a hook returns is dropped silently. A point with no hook costs one dict lookup.

Adding a point is one row here and one call in the model, through a scope:
`h = hooks.scope(f"blocks.{il}.attn")`, then `q = h("hook_q", q)`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
import pandas as pd

from .config import ModelConfig, has_indexer
from .errors import Ds4labError


class HookError(Ds4labError, ValueError):
    """A hook was misused: a replacement at a read-only point or of another shape, forced rows
    that do not cover the run."""


class UnknownHookPoint(Ds4labError, KeyError):
    """A hook name or filter that matches no point of the model."""

    def __str__(self) -> str:
        return str(self.args[0])


# When a block-level point exists, by the layer's compression ratio.
EVERY_LAYER, COMPRESSED, INDEXED = "every layer", "compressed layers", "ratio-4 layers"
_EXISTS: dict[str, Callable[[int], bool]] = {
    EVERY_LAYER: lambda ratio: True,
    COMPRESSED: lambda ratio: ratio > 0,
    INDEXED: has_indexer,
}


@dataclass(frozen=True)
class PointSpec:
    """One row of the hook-point table."""

    suffix: str                                   # the name after `blocks.L.` (or the whole name)
    shape: str                                    # in config names; T the chunk's tokens
    floats: Callable[[ModelConfig, int, int], int]   # floats per token: (cfg, ratio, keys visible)
    doc: str
    replaceable: bool = True
    block: bool = True                            # per block (`blocks.L.`) or once per model
    exists: str = EVERY_LAYER                     # which blocks have it
    mtp: bool = False                             # only on an MTP head (`mtp.` points, model.mtp)


def _p(suffix, shape, floats, doc, replaceable=True, exists=EVERY_LAYER):
    return PointSpec(suffix, shape, floats, doc, replaceable, True, exists)


def _model(suffix, shape, floats, doc):
    return PointSpec(suffix, shape, floats, doc, True, False)


def _mtp(suffix, shape, floats, doc):
    return PointSpec(suffix, shape, floats, doc, True, False, mtp=True)


_STREAMS = "[T, n_hc, n_embd]"


def _hc_points(sub: str) -> list[PointSpec]:
    return [
        _p(f"{sub}.hook_hc_pre", "[T, n_hc]", lambda c, r, k: c.n_hc,
           "HC weights collapsing the streams into the input"),
        _p(f"{sub}.hook_hc_post", "[T, n_hc]", lambda c, r, k: c.n_hc,
           "HC weights spreading the output over the streams"),
        _p(f"{sub}.hook_hc_comb", "[T, n_hc, n_hc]", lambda c, r, k: c.n_hc * c.n_hc,
           "Sinkhorn mix of the old streams (from, to)"),
        _p(f"{sub}.hook_in", "[T, n_embd]", lambda c, r, k: c.n_embd, "the collapsed, normed sublayer input"),
    ]


# Forward order. `keys` in `floats` is the widest key count a token of the run may see.
POINTS: tuple[PointSpec, ...] = (
    _model("hook_embed", "[T, n_embd]", lambda c, r, k: c.n_embd, "token embedding"),
    _p("hook_resid_pre", _STREAMS, lambda c, r, k: c.hc_dim, "the HC streams before attention"),
    *_hc_points("attn"),
    _p("attn.hook_q", "[T, n_head, head_dim]", lambda c, r, k: c.q_dim, "rotated queries"),
    _p("attn.hook_kv", "[T, head_dim]", lambda c, r, k: c.head_dim, "the new KV row as stored (RoPE, FP8, f16)"),
    _p("attn.compressor.hook_rows", "[rows emitted, head_dim]", lambda c, r, k: c.head_dim // r + 1,
       "compressed rows this chunk emitted", exists=COMPRESSED),
    _p("attn.compressor.hook_frontier", "[2, coff·ratio, coff·head_dim]", lambda c, r, k: 0,
       "the compressor state (kv, score) after the chunk; a replacement becomes the state", exists=COMPRESSED),
    _p("attn.indexer.hook_rows", "[rows emitted, indexer_head_dim]", lambda c, r, k: c.indexer_head_dim // r + 1,
       "indexer keys this chunk emitted (Hadamard + FP4)", exists=INDEXED),
    _p("attn.indexer.hook_frontier", "[2, 8, 2·indexer_head_dim]", lambda c, r, k: 0,
       "the indexer compressor's state after the chunk", exists=INDEXED),
    _p("attn.indexer.hook_scores", "[T, rows]", lambda c, r, k: k,
       "indexer scores (only when more rows than top-k are visible)", exists=INDEXED),
    _p("attn.indexer.hook_selected", "[T, rows] bool", lambda c, r, k: k,
       "the rows the indexer lets each token attend", exists=INDEXED),
    _p("attn.hook_comp_mask", "[T, rows] bool", lambda c, r, k: k,
       "the compressed rows each token attends (rows not visible yet stay masked)", exists=COMPRESSED),
    _p("attn.hook_pattern", "[T, n_head, 1 + L]", lambda c, r, k: c.n_head * (1 + k),
       "weights over the keys each token used, column 0 the sink's share (rows sum to 1)", replaceable=False),
    _p("attn.hook_key_span", "[T, L, 4]", lambda c, r, k: 4 * k,
       "per key used: first and last token position it covers, kind (0 window, 1 compressed), row; -1 padding",
       replaceable=False),
    _p("attn.hook_z", "[T, n_head, head_dim]", lambda c, r, k: c.q_dim, "head outputs (inverse-rotated)"),
    _p("attn.hook_out", "[T, n_embd]", lambda c, r, k: c.n_embd, "the attention output before the streams"),
    _p("hook_resid_mid", _STREAMS, lambda c, r, k: c.hc_dim, "the HC streams between attention and FFN"),
    *_hc_points("ffn"),
    _p("ffn.hook_router_probs", "[T, n_expert]", lambda c, r, k: c.n_expert,
       "router scores sqrt(softplus(logit)); a replacement drives selection and weights"),
    _p("ffn.hook_experts", "[T, n_expert_used] int32", lambda c, r, k: c.n_expert_used,
       "the chosen experts (replace to force; weights follow from the scores)"),
    _p("ffn.hook_expert_weights", "[T, n_expert_used]", lambda c, r, k: c.n_expert_used, "route weights"),
    _p("ffn.hook_routed_mid", "[T, n_expert_used, n_ff_exp]", lambda c, r, k: c.n_expert_used * c.n_ff_exp,
       "route-weighted SwiGLU, the down projections' input (ds4's imatrix); built only when hooked",
       replaceable=False),
    _p("ffn.hook_routed_out", "[T, n_embd]", lambda c, r, k: c.n_embd, "the routed experts' sum"),
    _p("ffn.hook_shared_out", "[T, n_embd]", lambda c, r, k: c.n_embd, "the shared expert's output"),
    _p("ffn.hook_out", "[T, n_embd]", lambda c, r, k: c.n_embd, "the FFN output before the streams"),
    _p("hook_resid_post", _STREAMS, lambda c, r, k: c.hc_dim, "the HC streams after the FFN"),
    _model("hook_final_weights", "[T, n_hc]", lambda c, r, k: c.n_hc, "output-head collapse weights"),
    _model("hook_final_norm", "[T, n_embd]", lambda c, r, k: c.n_embd, "the final norm, the head's input"),
    _model("hook_logits", "[T, n_vocab]", lambda c, r, k: c.n_vocab, "logits"),
    _mtp("mtp.hook_e", "[T, n_embd]", lambda c, r, k: c.n_embd,
         "MTP: e_proj·RMSNorm(embedding; enorm) of the draft token"),
    _mtp("mtp.hook_h", _STREAMS, lambda c, r, k: c.hc_dim,
         "MTP: h_proj·RMSNorm(stream; hnorm) of the HC state it drafts from, per stream"),
    _mtp("mtp.hook_in", _STREAMS, lambda c, r, k: c.hc_dim,
         "MTP: e + h, the streams its block starts from (then `mtp.`-prefixed block and head points)"),
)
_BY_SUFFIX = {p.suffix: p for p in POINTS}
# `hook_key_span`'s kind codes, and the sink's in `attention_frame`.
KEY_KINDS = ("window", "compressed", "sink")


def spec_of(name: str) -> PointSpec:
    """The table row of a full point name (`mtp.` block and head points take their model rows)."""
    parts = name.split(".")
    if parts[0] == "blocks":
        return _BY_SUFFIX[".".join(parts[2:])]
    return _BY_SUFFIX.get(name) or _BY_SUFFIX[name.removeprefix("mtp.")]


def hook_names(cfg: ModelConfig, mtp: bool = False) -> list[str]:
    """Every hook point of a model with this config, in the order the forward pass reaches them;
    with `mtp`, the MTP head's points after them (its block is an uncompressed one)."""
    # The table is in forward order: model-level rows before the first block row run before
    # the blocks, the others after them.
    first = next(i for i, p in enumerate(POINTS) if p.block)
    blocks = [f"blocks.{il}.{p.suffix}" for il, ratio in enumerate(cfg.compress_ratios[: cfg.n_layer])
              for p in POINTS if p.block and _EXISTS[p.exists](ratio)]
    head = [p.suffix for p in POINTS[first:] if not p.block and not p.mtp]
    names = [p.suffix for p in POINTS[:first]] + blocks + head
    if mtp:
        names += [p.suffix for p in POINTS if p.mtp]
        names += [f"mtp.{p.suffix}" for p in POINTS if p.block and _EXISTS[p.exists](0)] + [f"mtp.{n}" for n in head]
    return names


def floats_per_token(name: str, cfg: ModelConfig, n_tokens: int) -> int:
    """How many float32 values a point holds per token of a run of `n_tokens` (an estimate for
    the attention pattern and the indexer, whose width grows with the context)."""
    ratio = cfg.compress_ratios[int(name.split(".")[1])] if name.startswith("blocks.") else 0
    keys = cfg.n_swa + (n_tokens // ratio if ratio else 0)
    return spec_of(name).floats(cfg, ratio, keys)


def markdown_table() -> str:
    """The README's table of hook points, made from `POINTS`."""
    lines = ["| point | shape | exists on | replaceable | what |", "|---|---|---|---|---|"]
    for p in POINTS:
        name = f"blocks.L.{p.suffix}" if p.block else p.suffix
        where = p.exists if p.block else "the MTP head" if p.mtp else "the model"
        lines.append(f"| `{name}` | {p.shape} | {where} | {'yes' if p.replaceable else 'read-only'} | {p.doc} |")
    return "\n".join(lines)


@dataclass(frozen=True)
class HookPoint:
    name: str
    layer: int | None
    positions: np.ndarray


HookFn = Callable[[mx.array, HookPoint], "mx.array | None"]
NameFilter = str | Callable[[str], bool]


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "blocks" else None


@dataclass
class HookRegistry:
    """The hooks registered on a model, by point name."""

    names: list[str]
    by_name: dict[str, list[HookFn]] = field(default_factory=dict)
    positions: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    _scopes: dict[str, Scope] = field(default_factory=dict, repr=False, compare=False)   # `scope`'s, once a prefix

    def resolve(self, which: NameFilter) -> list[str]:
        chosen = [n for n in self.names if (which(n) if callable(which) else n == which)]
        if not chosen:
            raise UnknownHookPoint(f"no hook point matches {which!r} (model.hook_names() lists them)")
        return chosen

    def add(self, which: NameFilter, fn: HookFn, first: bool = False) -> list[tuple[str, HookFn]]:
        """Register `fn` at the matching points, after their hooks (before them with `first`)."""
        added = []
        for name in self.resolve(which):
            fns = self.by_name.setdefault(name, [])
            fns.insert(0, fn) if first else fns.append(fn)
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
                value = _replacement(name, value, out)
        return value

    def scope(self, prefix: str) -> Scope:
        """Fire points under `prefix`: `h = registry.scope("blocks.3.attn")`, `q = h("hook_q", q)`."""
        if prefix not in self._scopes:
            self._scopes[prefix] = Scope(self, prefix + ".")
        return self._scopes[prefix]


def _replacement(name: str, value: mx.array, out) -> mx.array:
    if not spec_of(name).replaceable:
        raise HookError(f"{name} is read-only: its hook returned a {type(out).__name__}; return None to read it")
    out = out if isinstance(out, mx.array) else mx.array(out)
    if out.shape == value.shape:
        return out
    try:
        return mx.broadcast_to(out, value.shape)
    except ValueError:
        raise HookError(f"{name}: a replacement must have (or broadcast to) the shape {tuple(value.shape)}, "
                        f"not {tuple(out.shape)}") from None


@dataclass(frozen=True)
class Scope:
    """The points under one prefix (a block, a sublayer), fired by their short names."""

    registry: HookRegistry
    prefix: str

    def __call__(self, suffix: str, value: mx.array) -> mx.array:
        return self.registry.fire(self.prefix + suffix, value)

    def wants(self, suffix: str) -> bool:
        return self.registry.wants(self.prefix + suffix)


class _Chunks(Mapping):
    """name -> the arrays of successive chunks, joined (once) when read."""

    def __init__(self) -> None:
        self._parts: dict[str, list[np.ndarray]] = {}

    def append(self, name: str, value: np.ndarray) -> None:
        self._parts.setdefault(name, []).append(value)

    def __getitem__(self, name: str) -> np.ndarray:
        parts = self._parts[name]
        if len(parts) > 1:
            parts[:] = [np.concatenate(parts)]
        return parts[0]

    def __iter__(self):
        return iter(self._parts)

    def __len__(self) -> int:
        return len(self._parts)


class ActivationCache(Mapping):
    """name -> numpy array, rows of chunks run one after another concatenated (see `positions`).

    Chunks are kept as they come and joined when a point is read, so a long decode costs
    linear time. `keep` (absolute token positions) keeps only those rows of the points whose
    first axis is the chunk's tokens; other points are kept whole."""

    def __init__(self, keep: np.ndarray | None = None) -> None:
        self._values = _Chunks()
        self.positions = _Chunks()
        self.keep = keep

    def __getitem__(self, name: str) -> np.ndarray:
        return self._values[name]

    def __iter__(self):
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def record(self, act: mx.array, hook: HookPoint) -> None:
        value = np.array(act)
        positions = hook.positions
        if self.keep is not None and value.ndim and value.shape[0] == len(positions):
            rows = np.isin(positions, self.keep)
            value, positions = value[rows], positions[rows]
        self._values.append(hook.name, value)
        self.positions.append(hook.name, positions)

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
        """One row per (position, head, key used): the weight, which key it is (`kind`: sink,
        window or compressed; `row`: its row in the raw window or among the compressed rows)
        and the token positions it covers; the sink's share as key -1. Needs `hook_pattern`
        and `hook_key_span` cached."""
        weights = self[f"blocks.{layer}.attn.hook_pattern"]
        span = self[f"blocks.{layer}.attn.hook_key_span"]
        t, h, width = weights.shape
        sink = np.full((t, 1), -1)
        first, last, kind, row = (np.concatenate([sink, span[..., i]], axis=1) for i in range(4))
        kind[:, 0] = 2

        def per_head(column: np.ndarray) -> np.ndarray:
            return np.repeat(column, h, axis=0).reshape(-1)

        frame = pd.DataFrame({
            "position": np.repeat(self.positions[f"blocks.{layer}.attn.hook_pattern"], h * width),
            "head": np.tile(np.repeat(np.arange(h), width), t),
            "key": np.tile(np.arange(width) - 1, t * h),
            "kind": pd.Categorical.from_codes(np.maximum(per_head(kind), 0), KEY_KINDS),
            "row": per_head(row),
            "first": per_head(first),
            "last": per_head(last),
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
