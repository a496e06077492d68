"""The DeepSeek V4 stack: embedding, n_layer blocks over hyper-connection streams, output head.

`Model.forward` runs a chunk of tokens through every layer, reading and extending a
session's state (raw windows, compressed rows, compressor frontiers). ds4 processes a
prompt layer by layer with token-sequential cache updates, so a chunk computed at once
equals token-by-token decode up to float reassociation; decode is the chunk of one token.
On the CPU the two are bit-identical (see `numerics.Numerics` and `linalg`).

Numerics: "float" computes in float32 with exact weights. "ds4-cpu" also rounds
activations the way ds4's CPU path quantises them (int8 per 32 before every Q8_0 matmul,
per 256 before routed experts and before their down projection), which is what makes
comparisons with ds4.c's logits tight. `numerics.Numerics` decides both that and how the
products are scheduled.

Every hook point fires through a scope of the registry (`ds4lab.hooks`); the points and
their shapes are the table `hooks.POINTS`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np
import pandas as pd

from ..config import ModelConfig, has_indexer
from ..hooks import ActivationCache, HookFn, HookRegistry, NameFilter, Scope, floats_per_token, hook_names
from . import attention, cpu_kernels, indexer, kernels, moe
from .compressor import (
    Compressor,
    Frontier,
    completes_window,
    frontier_pairs,
    frontier_state,
    launch_slots,
    made_in_part,
    pooled_rows,
    row_span,
    window_rotation,
)
from .hc import HCControl, hc_collapse, hc_control, hc_expand, hc_expand_q8, hc_fused_input, hc_head_weights
from .kernels import HCInput
from .numerics import MODES, Numerics, Schedule, batch_invariant_device, joined
from .rope import Rotation, yarn_for
from .state import LayerCache, SessionState
from .weights import LayerWeights, ModelWeights

if TYPE_CHECKING:
    from ..steering import SteeringVector
    from .mtp import MTPHead

NUMERICS = MODES

# Decode steps that run in another step's launch (`Model.merged_launches`): "q_b",
# q_b's product in the q_a / kv launch; "output_a", the grouped output product in the launch
# of output_b and the HC step (with the FFN's input made there); "router", the router in the
# routed experts' launch where no hook reads the experts; "compressor_slot", a compressed
# layer's frontier update (both compressors' on a ratio-4 layer) in the q_a / kv launch, which
# reads the same input (the step before it here, not after: the two need each other's nothing);
# "head", the output head's HC weights, collapse and norm made by the last block's last launch,
# as every sublayer's input is (unless a hook reads the head's weights).
MERGED_LAUNCHES = ("q_b", "output_a", "router", "compressor_slot", "head")

# ... and the ones merged unless asked (`Model.merged_launches`). On the H200 (2026-12-05,
# 43 layers at 4096 tokens, greedy stream, `bench/stream_ab.py`, each A/B in one process) the
# router's merge cost 18% (71.6 against 87.9 tok/s: its experts' blocks wait on the one block
# that routes, each holding an SM), and q_b's, output_a's and compressor_slot's 1-2% each
# (their waiting blocks again; `bench_model.py`: 90.5 tok/s with none of the four against
# 86.1 with only the router's left out): the host time they save does not make up for the
# device time they cost. The head's gained 2%: its launch waits for nothing.
DEFAULT_MERGED = ("head",)

# Hook points the fast path fires, replacements included, at full speed: the block boundaries
# (and, through them, steering and forced experts), the sublayers' inputs and the routed
# experts' SwiGLU activations (read-only; with hook_in and hook_experts, what imatrix
# collection reads). A hook at any other point of a block makes that block run the reference
# composition for the call (`Model.fast_path_plan` says which).
FAST_PATH_POINTS = frozenset({"hook_resid_pre", "attn.hook_in", "attn.hook_out", "hook_resid_mid", "ffn.hook_in",
                              "ffn.hook_experts", "ffn.hook_expert_weights", "ffn.hook_routed_mid", "ffn.hook_out",
                              "hook_resid_post"})


# ds4 runs the MTP block as layer 1 (`metal_graph_eval_mtp_draft_from_hc`): its SwiGLU clamp.
MTP_LAYER = 1


@dataclass
class ChunkResult:
    logits: mx.array                 # [T, n_vocab] (or [1, n_vocab] when only the last is asked for)
    experts: list[mx.array]          # per layer [T, n_expert_used]
    state: SessionState
    hidden: mx.array | None = None   # [T, n_hc, n_embd]: the final HC streams of every token


class Model:
    """DeepSeek V4 from a ModelConfig and its weights; see `ds4lab.load`."""

    def __init__(self, weights: ModelWeights, numerics: str = "float", source: str = "",
                 mtp: MTPHead | None = None) -> None:
        self.weights = weights
        self.config: ModelConfig = weights.config
        self.numerics = Numerics(numerics)
        self.source = source
        self.mtp = mtp                   # the MTP head (`ds4lab.load(..., mtp=FILE)`), or None
        self._tokenizer = None
        self._hooks = HookRegistry(hook_names(self.config, mtp=mtp is not None))
        self._compressors = [
            {kind: Compressor.of(layer, self.config, kind) for kind in ("attn", "indexer")
             if layer.ratio and (kind == "attn" or has_indexer(layer.ratio))}
            for layer in weights.layers]
        self._compiled: dict[tuple, Callable] = {}   # see `_sublayer`
        # Per block, its RoPE kind (base, YaRN) and its sublayers' HC inputs (`_hc_input`):
        # made once, not in every step's build.
        self._rope_kinds = [(self.config.rope_base(il), yarn_for(self.config, layer.ratio))
                            for il, layer in enumerate(weights.layers)]
        self._hc_inputs: dict[tuple[int, str], tuple[LayerWeights, HCInput]] = {}
        # On the fast path a decode step's sublayer input (HC control, collapse, norm) is made
        # by the last launch of the sublayer before (`hc_expand_q8(..., next_input=)`); False
        # makes it apart (hc_mix + hc_pre), the same values: for measuring the two in one
        # process (`bench/stream_ab.py`).
        self.hc_input_in_product = True
        self._head_hc: HCInput | None = None      # see `_head_input`
        # ... and which of the MERGED_LAUNCHES run in another step's launch (the same values;
        # any set of them: for measuring them, `bench/stream_ab.py`).
        self.merged_launches = set(DEFAULT_MERGED)
        # The greedy stream hands a decode step to MLX in pieces: first up to each of these
        # layers' attention (their raw windows), then the rest, each piece one `mx.async_eval`
        # and so one commit of MLX's CUDA graph (`generation._WorkerEncoder`). Empty: the step
        # in one piece, MLX committing where its own limits say.
        self.stream_commits: tuple[int, ...] = ()
        # A decode step's router also writes the FFN input as byte planes, and the IQ2_XXS
        # routed experts' gate and up, and the shared expert's, take it from them on integers
        # (`kernels.router_planes`, `expert_swiglu(planes=)`; within 2^-21 of each 32 values'
        # largest, not the same bits; on by default since the H100's greedy stream gained 7% with
        # them, 2026-12-05). False keeps the float form, the same bits as the reference's
        # products, and measures the two in one process. (Where the router has its own launch:
        # with "router" in `merged_launches` it runs inside the experts' launch, on floats.)
        self.expert_planes = True

    # ---- public entry points --------------------------------------------------------
    def __call__(self, tokens, experts=None) -> mx.array:
        """Logits of every position, [T, n_vocab], from a fresh session.

        `experts` (int [T, n_layer, n_expert_used]) forces the routed experts through
        `interventions.force_experts` hooks; route weights still come from the router's
        scores of the forced experts.
        """
        return self.forward(self.empty_state(), _as_tokens(tokens), forced=experts).logits

    # ---- hooks --------------------------------------------------------------------
    def hook_names(self) -> list[str]:
        """Every hook point, in forward order (see ds4lab.hooks)."""
        return list(self._hooks.names)

    @contextmanager
    def hooks(self, fwd_hooks: list[tuple[NameFilter, HookFn]], first: bool = False):
        """Hooks active inside the `with` block, in sessions' prefill and decode too, after the
        hooks already registered (before them with `first`). A name that matches no point
        raises, and leaves no hook of the list registered."""
        added = []
        try:
            for which, fn in (reversed(fwd_hooks) if first else fwd_hooks):
                added += self._hooks.add(which, fn, first=first)
            yield self
        finally:
            self._hooks.remove(added)

    @property
    def hooked(self) -> bool:
        """Whether any hook is registered (a `with model.hooks(...)` block, steering)."""
        return bool(self._hooks.by_name)

    def fast_path_plan(self) -> pd.DataFrame:
        """Which blocks run the fast path with the hooks registered now (ask inside
        `with model.hooks(...)`): one row per block with its path ("fast" or "reference"), the
        hook points that put it on the reference path, and which of its sublayers ("attn",
        "ffn") a decode step runs compiled (none has a hook). Hooks at `FAST_PATH_POINTS` keep
        a block fast; off a CUDA GPU, and in "ds4-cpu" numerics, every block is "reference"."""
        fast = self.numerics.fast
        slow = self._reference_blocks()
        path = ["reference" if not fast or f"blocks.{il}" in slow else "fast" for il in range(self.config.n_layer)]
        return pd.DataFrame({
            "block": np.arange(self.config.n_layer, dtype=np.int64),
            "path": pd.Categorical(path, categories=["fast", "reference"]),
            "hooks": [", ".join(slow.get(f"blocks.{il}", [])) for il in range(self.config.n_layer)],
            "compiled": [", ".join(sub for sub in ("attn", "ffn") if not self._sublayer_hooked(f"blocks.{il}", sub))
                         if kind == "fast" else "" for il, kind in enumerate(path)],
        })

    def _sublayer_hooked(self, prefix: str, sub: str) -> bool:
        """Whether a hook is registered in a block's sublayer (`prefix` "blocks.L" or "mtp", sub
        "attn" or "ffn"): its decode step then runs as written, not compiled (`_sublayer`)."""
        return any(name.startswith(f"{prefix}.{sub}.") for name in self._hooks.by_name)

    def _reference_blocks(self) -> dict[str, list[str]]:
        """Blocks whose hooks need the reference composition: `blocks.L` (or `mtp`, the MTP
        head's block) -> those points."""
        slow: dict[str, list[str]] = {}
        for name in self._hooks.by_name:
            if name.startswith("blocks."):
                _, layer, suffix = name.split(".", 2)
                prefix = f"blocks.{layer}"
            elif name.startswith(("mtp.attn.", "mtp.ffn.")):
                prefix, suffix = name.split(".", 1)
            else:
                continue                     # model-level points: embedding, heads, MTP inputs
            if suffix not in FAST_PATH_POINTS:
                slow.setdefault(prefix, []).append(name)
        return slow

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
        logits = self.run_with_hooks(tokens, [(which, cache.record) for which in wanted])
        return logits, cache

    def run_with_cache_over(self, prompts: Iterable, names: NameFilter | list[str] | None = None, positions=None,
                            progress: bool = False) -> Iterator[tuple[mx.array, ActivationCache]]:
        """`run_with_cache` for each prompt (token ids) in turn, yielding (logits, cache), so
        that only one prompt's activations are held at a time; `progress` shows a bar over all
        the prompts' tokens (tokens/s and the time left)."""
        from tqdm.auto import tqdm

        prompts = [_as_tokens(tokens) for tokens in prompts]
        with tqdm(total=sum(map(len, prompts)), unit="tok", desc="run_with_cache", disable=not progress) as bar:
            for tokens in prompts:
                result = self.run_with_cache(tokens, names, positions)
                bar.update(len(tokens))
                yield result

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
        layers = [LayerCache.empty(ratio, cfg.head_dim, cfg.indexer_head_dim)
                  for ratio in cfg.compress_ratios[: cfg.n_layer]]
        return SessionState(layers=layers, tokens=[], logits=None)

    # ---- the stack ------------------------------------------------------------------
    def forward(self, state: SessionState, tokens: list[int], forced=None, last_only: bool = False) -> ChunkResult:
        """Run `tokens` (positions len(state.tokens)..) through the model; the result holds the
        extended state (`state` itself is left as it was). `forced` (int [T, n_layer,
        n_expert_used]) forces the chunk's routed experts, as `__call__`'s `experts`.
        `tokens` may be device scalars (tokens chosen on the device and not read yet: the graph
        is built without waiting for them); the new state's token list then holds them as they
        are, for the caller to replace by their values (`generation.stream` does)."""
        if forced is not None:
            from ..interventions import force_experts

            chosen = np.asarray(forced, dtype=np.int32)
            pins = [pin for il in range(self.config.n_layer)
                    for pin in force_experts(il, chosen[:, il], first_position=state.n_tokens)]
            with self.hooks(pins, first=True):     # the forced experts are what every other hook sees
                return self.forward(state, tokens, last_only=last_only)
        cfg = self.config
        p0 = state.n_tokens
        self._hooks.positions = np.arange(p0, p0 + len(tokens))
        mm = self.numerics.schedule(self._hooks.positions)
        on_device = isinstance(tokens[0], mx.array)
        token_ids = mx.stack(tokens).reshape(-1).astype(mx.int32) if on_device else mx.array(tokens, dtype=mx.int32)
        x = self._hooks.fire("hook_embed", self.weights.token_embd[token_ids].astype(mx.float32))
        streams = mx.broadcast_to(x[:, None, :], (x.shape[0], cfg.n_hc, cfg.n_embd))
        if self.numerics.fast:
            # MLX copies each input of a custom kernel that is not row-contiguous, once for
            # every kernel that reads it (three read the first block's streams): copied once here.
            streams = mx.contiguous(streams)
        new = state.copy()
        experts = []
        rotations: dict[tuple, Rotation] = {}
        layers, ready, slow = self.weights.layers, None, self._reference_blocks()
        for il, layer in enumerate(layers):
            kind = self._rope_kinds[il]
            if kind not in rotations:
                rotations[kind] = Rotation.at(p0, len(tokens), cfg.n_rot, *kind)
            # the next block's attention input is made by this block's last launch, unless
            # that block runs on the reference composition (which makes its own)
            if il + 1 < len(layers):
                next_input = (self._hc_input(layers[il + 1], "attn") if _prefix(layers[il + 1]) not in slow
                              and self.hc_input_in_product else None)
            else:
                next_input = self._head_input() if self._head_in_product(slow) else None
            streams, chosen, ready = self.block(layer, new.layers[il], streams, p0, rotations[kind], token_ids, mm,
                                                ready, next_input)
            if len(tokens) > 1:
                # Bounds a prefill chunk's graph (a decode step stays one graph). The fast path
                # only starts the layer and goes on building the next while the device runs it.
                (mx.async_eval if mm.fast else mx.eval)(streams)
            experts.append(chosen)
        hidden = streams
        made = None if ready is None else ready[0]           # the head's input, made by the last launch
        if last_only:
            streams, mm = streams[-1:], mm.rows(np.array([len(tokens) - 1]))
            made = None if made is None else made[-1:]
        logits = self._head(streams, mm, made=made)
        new.tokens = state.tokens + list(tokens)
        # A decode step's rows as views (an integer index is a gather kernel in MLX); a chunk's
        # last row as its own copy (a view would keep the chunk's whole buffer alive).
        last = (lambda a: a.squeeze(0)) if len(tokens) == 1 else (lambda a: a[-1])
        new.logits, new.hidden = last(logits), last(hidden)
        return ChunkResult(logits, experts, new, hidden)

    def block(self, layer: LayerWeights, cache: LayerCache, streams: mx.array, p0: int, rotation: Rotation,
              token_ids: mx.array, mm: Schedule, ready: tuple[mx.array, ...] | None = None,
              next_input: HCInput | None = None) -> tuple[mx.array, mx.array, tuple[mx.array, ...] | None]:
        """One block (a layer, or the MTP head's) over a chunk: attention, then FFN, with the
        residual points around them; on the reference composition when its hooks need it.
        Returns the new streams, the experts used and, on the fast path's decode steps with
        `next_input` (the next block's attention HC input weights), that sublayer's input made
        of the new streams, (x, pre, post, comb) (None elsewhere); extends `cache`. `ready`:
        this block's attention input, made by the block before. An input made before a hook
        that replaces the streams is dropped (the sublayer makes its own of the new ones)."""
        prefix, hooked = _prefix(layer), self.hooked     # (no hook: the decode stream asks no more)
        if mm.fast and hooked and prefix in self._reference_blocks():
            mm = mm.reference()
        h = self._hooks.scope(prefix)
        ready, streams = _kept(ready, streams, h("hook_resid_pre", streams))
        output = self._attention_block(layer, cache, streams, p0, rotation, mm, ready)   # (heads, streams, HC control)
        if hooked and (h.wants("hook_resid_mid") or self._sublayer_hooked(prefix, "attn")
                       or self._sublayer_hooked(prefix, "ffn")):
            streams, ready = self._sublayer("attn_out", layer, mm, self._attention_output, *output)
            ready, streams = _kept(ready, streams, h("hook_resid_mid", streams))
            streams, experts, ready = self._sublayer("ffn", layer, mm, self._ffn_block, streams, token_ids,
                                                     *(ready or ()), next_input=next_input)
        else:
            # No point between them is hooked: the attention's output and the FFN are one part,
            # one compiled replay on the fast path's decode steps instead of two.
            streams, experts, ready = self._sublayer("attn_out+ffn", layer, mm, self._output_and_ffn, *output,
                                                     token_ids, next_input=next_input)
        ready, streams = _kept(ready, streams, h("hook_resid_post", streams))
        return streams, experts, ready

    def _output_and_ffn(self, layer: LayerWeights, mm: Schedule, heads: mx.array, streams: mx.array,
                        pre: mx.array, post: mx.array, comb: mx.array, token_ids: mx.array,
                        next_input: HCInput | None = None) -> tuple[mx.array, mx.array, tuple[mx.array, ...] | None]:
        """`_attention_output`, then `_ffn_block` of its streams (with the FFN input it made)."""
        streams, ready = self._attention_output(layer, mm, heads, streams, pre, post, comb)
        return self._ffn_block(layer, mm, streams, token_ids, *(ready or ()), next_input=next_input)

    def _hc_input(self, layer: LayerWeights, sub: str) -> HCInput:
        """The weights and constants of a sublayer's HC input ("attn" or "ffn"), made once a
        block (the MTP head's too: kept with its layer, so that another head gets its own)."""
        key = (id(layer), sub)               # its entry keeps the layer: no other takes that id
        if key not in self._hc_inputs:
            cfg, d = self.config, layer.dense
            self._hc_inputs[key] = layer, HCInput(
                d[f"hc_{sub}_fn.weight"], d[f"hc_{sub}_scale.weight"], d[f"hc_{sub}_base.weight"],
                d[f"{sub}_norm.weight"], cfg.hc_sinkhorn_iter, cfg.rms_eps, cfg.hc_eps)
        return self._hc_inputs[key][1]

    def _attention_block(self, layer: LayerWeights, cache: LayerCache, streams: mx.array, p0: int,
                         rotation: Rotation, mm: Schedule,
                         ready: tuple[mx.array, ...] | None = None) -> tuple[mx.array, ...]:
        """Attention of the chunk's tokens (positions p0..) over the raw window and the
        compressed rows; extends `cache`. Masks are built on the host: positions are known.
        `ready`: the sublayer's input made by the launch before (see `block`). Returns what
        the output projection reads (`_attention_output`): the heads, the streams and the HC
        control (pre, post, comb)."""
        cfg, d = self.config, layer.dense
        h = self._hooks.scope(f"{_prefix(layer)}.attn")
        # The indexer scores once more rows are visible than it keeps: its queries are then
        # computed with the attention's (position p0 + t - 1 completes (p0 + t) // ratio windows).
        indexed = has_indexer(layer.ratio) and (p0 + streams.shape[0]) // layer.ratio > cfg.indexer_top_k
        # On the fast path the KV rows leave the sublayer unfinished: one kernel finishes them
        # after the kept window's rows, the keys to attend (a decode token's: the attention
        # kernel); in a decode step so do the q heads, finished by the attention kernel
        # (`hook_kv`, `hook_q` send a block to the reference).
        q_in_attention = mm.fast and streams.shape[0] <= kernels.MATVEC_MAX_TOKENS
        # A decode token's compressor frontiers made in this part (its own launch, or with
        # "compressor_slot" merged the q_a / kv launch): the frontiers before it and its slot go
        # in as data (`compressor.frontier_state`), the shift (a ratio-4 window completed) as
        # the kind of trace. Traced, the launch costs the build a replayed primitive instead
        # of its wrapper's Python (~25 µs a compressed layer).
        # A completed window's rows are pooled there too (the window's first position's RoPE
        # row as data; a trace of its own).
        comps = self._layer_compressors(layer)
        slots = bool(comps) and mm.fast and streams.shape[0] == 1
        shift = slots and comps[0].decode_slot(p0)[2]
        emit = slots and completes_window(comps, p0)
        part = (("attn_in+indexer" if indexed else "attn_in") + (f"+slot{shift:d}" if slots else "")
                + ("+emit" if emit else ""))
        first = window_rotation(comps, p0) if emit else None
        xa, pre, post, comb, q, kv, made, *queries = self._sublayer(
            part, layer, mm,
            partial(self._attention_inputs, indexed=indexed, finish_kv=not mm.fast, finish_q=not q_in_attention,
                    shift=shift),
            streams, rotation.cos, rotation.sin,
            frontier_state(comps, cache.frontiers(), p0) if slots else (),
            (first.cos, first.sin) if emit else (),
            *(ready or ()))
        t, n_kept = kv.shape[0], cache.raw.shape[0]
        row_in_attention = q_in_attention and t == 1
        if row_in_attention:
            keys = None
        elif mm.fast:
            keys = cache.keep_window(attention.kv_row(layer, kv, rotation, cfg.rms_eps, mm, window=cache.raw),
                                     cfg.n_swa)
        else:
            keys = cache.update_window(kv, cfg.n_swa)
        if layer.ratio:                       # the compressed rows follow the window's in key order
            comp, mask = self._compressed_keys(layer, cache, h, xa, queries, p0, n_kept, mm, made)
        else:
            comp, mask = None, _window_mask(p0, t, n_kept, cfg.n_swa)
        if h.wants("hook_pattern") or h.wants("hook_key_span"):
            self._read_pattern(h, q, keys if comp is None else mx.concatenate([keys, comp]), mask,
                               d["attn_sinks.weight"], mx.arange(p0 - n_kept, p0 + t), layer.ratio)
        if row_in_attention:
            heads, keys = kernels.attention_heads(q, cache.raw, mask, d["attn_sinks.weight"],
                                                  (rotation.cos, rotation.sin), comp, cfg.rms_eps,
                                                  kv_row=(kv, d["attn_kv_a_norm.weight"], cfg.rms_eps),
                                                  keep=cfg.n_swa, slot=layer.index)
            cache.keep_window(keys, cfg.n_swa)
            heads = h("hook_z", heads)
        else:
            heads = h("hook_z", attention.attend_heads(q, keys, mask, d["attn_sinks.weight"], rotation, mm, comp,
                                                       cfg.rms_eps if q_in_attention else None, layer.index))
        return heads, streams, pre, post, comb

    def _attention_inputs(self, layer: LayerWeights, mm: Schedule, streams: mx.array, cos: mx.array,
                          sin: mx.array, frontiers: tuple[mx.array, ...], window: tuple[mx.array, ...],
                          *ready: mx.array, indexed: bool, finish_kv: bool, finish_q: bool, shift: bool) -> tuple:
        """The attention sublayer before the cache: (xa, pre, post, comb, q, kv), hooked, then
        the compressor frontiers after a decode token when `frontiers` = (at, kv, score, ...)
        (`compressor.frontier_state`; made in the q_a / kv launch with "compressor_slot"
        merged, else in a launch of their own; `shift` their kind), followed, with `window` =
        the completed window's RoPE row (cos, sin), by its rows (`compressor.pooled_rows`), as
        a tuple (else empty), then with `indexed` the indexer's queries and head weights
        (`indexer.indexer_queries`); without `finish_kv`, kv is the product attn_kv · xa, not
        yet the stored row; without `finish_q`, q is the q_b product, its heads not yet normed
        nor rotated."""
        cfg = self.config
        h = self._hooks.scope(f"{_prefix(layer)}.attn")
        rotation = Rotation(cos, sin)
        xa, control = self._sublayer_input(h, streams, "attn", layer, mm, ready)
        comps = self._layer_compressors(layer)
        slots = launch_slots(comps, frontiers, shift) if frontiers else None
        merged_slots = slots if "compressor_slot" in self.merged_launches else None
        merged_q = not finish_q and "q_b" in self.merged_launches    # q_b's product in q_a's launch, unfinished
        products = attention.input_products(layer, xa, cfg.rms_eps, mm, (cfg.n_head, cfg.head_dim) if merged_q
                                            else None, slots=merged_slots)
        qr, kv, qr_n = products[:3]
        made = products[3 + merged_q:]
        if finish_q:
            q = h("hook_q", attention.project_q(layer, qr_n, rotation, cfg.n_head, cfg.head_dim, cfg.rms_eps, mm))
        elif merged_q:
            q = products[3]
        else:
            q = attention.project_q(layer, qr_n, rotation, cfg.n_head, cfg.head_dim, cfg.rms_eps, mm, finish=False)
        if finish_kv:
            kv = h("hook_kv", attention.kv_row(layer, kv, rotation, cfg.rms_eps, mm))
        queries = indexer.indexer_queries(layer, xa, qr, qr_n, rotation, cfg.indexer_heads, cfg.indexer_head_dim,
                                          cfg.rms_eps, mm) if indexed else ()
        if slots is not None and merged_slots is None:
            made = kernels.slot_update(xa, slots)
        if window:
            made = (*made, *pooled_rows(comps, frontier_pairs(frontiers[1:]), frontier_pairs(made), Rotation(*window)))
        return xa, control.pre, control.post, control.comb, q, kv, tuple(made), *queries

    def _layer_compressors(self, layer: LayerWeights) -> list[Compressor]:
        """A block's compressors: none, the attention's, or (ratio 4) it and the indexer's."""
        if not layer.ratio:
            return []
        comps = self._compressors[layer.index]
        return [comps[kind] for kind in ("attn", "indexer") if kind in comps]

    def _attention_output(self, layer: LayerWeights, mm: Schedule, heads: mx.array, streams: mx.array,
                          pre: mx.array, post: mx.array,
                          comb: mx.array) -> tuple[mx.array, tuple[mx.array, ...] | None]:
        """The heads through the grouped output projection (`hook_out`) into new streams (both
        products and the HC step one kernel on the fast path's matvec, which also makes the
        FFN's input of them: see `block`; with `hook_out` the products and the HC step apart,
        so that a replacement feeds the HC step)."""
        h = self._hooks.scope(f"{_prefix(layer)}.attn")
        out_a, out_b = layer.q8["attn_output_a.weight"], layer.q8["attn_output_b.weight"]
        control = HCControl(pre, post, comb)
        next_input = self._hc_input(layer, "ffn") if self.hc_input_in_product else None
        if (mm.fast and next_input is not None and "output_a" in self.merged_launches and not h.wants("hook_out")
                and heads.shape[0] <= kernels.MATVEC_MAX_TOKENS and streams.shape[1] <= kernels.HC_MAX_STREAMS):
            # the grouped product by the first thread blocks of the launch of the product after it
            return kernels.q8_hc(out_b, heads, streams, control.post, control.comb, next_input=next_input,
                                 slot=layer.index, pre=(out_a, self.config.n_out_group))
        low = attention.grouped_low(layer, heads, self.config.n_out_group, mm)
        if h.wants("hook_out"):
            return hc_expand(h("hook_out", mm.q8(out_b, low)), streams, control, mm), None
        return hc_expand_q8(out_b, low, streams, control, mm, next_input=next_input, slot=layer.index)

    def _sublayer(self, part: str, layer: LayerWeights, mm: Schedule, fn: Callable, *arrays: mx.array,
                  **weights: mx.array | None):
        """fn(layer, mm, *arrays, **weights): one of the parts of a block with no cache inside
        (the attention's inputs and its output, the FFN); `weights` are other blocks' weights
        it reads (the next block's HC mixer). On the fast path a decode step's part runs
        compiled (`mx.compile`, traced once per block, part, token count and set of inputs):
        building its graph then costs one call instead of some twenty kernel wrappers', and MLX
        fuses its elementwise steps. A hook in the sublayer keeps the part as written, as does
        the reference path; both compute the same steps."""
        hooked = self.hooked and any(self._sublayer_hooked(_prefix(layer), sub) for sub in ("attn", "ffn")
                                     if sub in part)
        if hooked or not mm.fast or arrays[0].shape[0] > kernels.MATVEC_MAX_TOKENS:
            return fn(layer, mm, *arrays, **weights)
        key = (layer.index, part, len(arrays), tuple(name for name, w in weights.items() if w is not None),
               self.hc_input_in_product, frozenset(self.merged_launches), self.expert_planes)
        if key not in self._compiled:
            # Weights enter the traced graph as constants: evaluated first, so that none of
            # them brings its own graph (a lazy view) into every call.
            mx.eval(layer.fast_inputs(), [w for w in weights.values() if w is not None])
            self._compiled[key] = mx.compile(partial(fn, layer, Schedule(self.numerics, None, True), **weights))
        return self._compiled[key](*arrays)

    def _compressed_keys(self, layer: LayerWeights, cache: LayerCache, h: Scope, xa: mx.array, queries: list,
                         p0: int, n_kept: int, mm: Schedule,
                         made: tuple[mx.array, ...] = ()) -> tuple[mx.array, mx.array]:
        """The compressed rows after this chunk, and the attention mask [T, n_kept + T + rows]:
        the raw window's columns, then the rows each token attends (rows of windows it has
        completed; on ratio-4 layers the indexer's top-k of them). `made`: a fast-path decode
        token's frontiers after it (kv, score, then the indexer's) and the rows of a window it
        completes, made by the attention-input part (`_attention_inputs`)."""
        cfg, comps, t = self.config, self._compressors[layer.index], xa.shape[0]
        window = _window_mask(p0, t, n_kept, cfg.n_swa)
        index_rows = None
        if made:
            afters, emitted = made_in_part(self._layer_compressors(layer), made)
            rows, cache.frontier = emitted[0], afters[0]
            if len(afters) > 1:
                index_rows, cache.index_frontier = emitted[1], afters[1]
        else:
            rows, cache.frontier = comps["attn"].step(cache.frontier, xa, p0, mm)
        comp = cache.append_compressed(h("compressor.hook_rows", rows))
        cache.frontier = self._hook_frontier(h, "compressor.hook_frontier", cache.frontier)
        visible, n_visible = _visible_rows(p0, t, comp.shape[0], layer.ratio)
        comp_mask = None                         # every visible row
        if has_indexer(layer.ratio):
            if index_rows is None:
                index_rows, cache.index_frontier = comps["indexer"].step(cache.index_frontier, xa, p0, mm)
            index_keys = cache.append_index_keys(h("indexer.hook_rows", index_rows))
            cache.index_frontier = self._hook_frontier(h, "indexer.hook_frontier", cache.index_frontier)
            if queries:                          # more rows than the indexer keeps (see `_attention_block`)
                if mm.fast and t <= kernels.MATVEC_MAX_TOKENS and not any(
                        h.wants(point) for point in ("indexer.hook_scores", "indexer.hook_selected", "hook_comp_mask")):
                    # the scores and the rows chosen, written into the mask, in one launch
                    _, mask = kernels.indexer_scores(*queries, index_keys, choose=(visible, window, cfg.indexer_top_k),
                                                     slot=layer.index)
                    return comp, mask
                scores = h("indexer.hook_scores", indexer.indexer_scores(*queries, index_keys, mm))
                comp_mask = indexer.select_rows(scores, visible, n_visible, cfg.indexer_top_k, mm)
            # A hook may choose other rows, never ones the token cannot see yet.
            comp_mask = _within(h, "indexer.hook_selected", comp_mask, visible)
        comp_mask = _within(h, "hook_comp_mask", comp_mask, visible)
        if comp_mask is None:                    # the whole mask is made on the host
            return comp, _window_and_rows_mask(p0, t, n_kept, cfg.n_swa, comp.shape[0], layer.ratio)
        return comp, joined([window, comp_mask], axis=1)

    def _hook_frontier(self, h: Scope, suffix: str, frontier: Frontier) -> Frontier:
        """The frontier after the chunk as [2 (kv, score), rows, width]; a replacement becomes the state."""
        if not h.wants(suffix):
            return frontier
        return Frontier.unstack(h(suffix, frontier.stacked()))

    def _read_pattern(self, h: Scope, q: mx.array, keys: mx.array, mask: mx.array, sinks: mx.array,
                      raw_pos: mx.array, ratio: int) -> None:
        """Fire the pattern points: weights over the used keys (sink first), and per key the
        token positions it covers [first, last], its kind (0 raw window, 1 compressed) and its
        row among those (-1 for padding)."""
        weights, index = attention.pattern(q, keys, mask, sinks)
        n_raw = raw_pos.shape[0]
        is_raw = index < n_raw
        row = mx.where(is_raw, index, index - n_raw)
        comp_first, comp_last = row_span(row, max(ratio, 1))
        raw_at = raw_pos[mx.clip(index, 0, n_raw - 1)]
        span = mx.stack([mx.where(is_raw, raw_at, comp_first), mx.where(is_raw, raw_at, comp_last),
                         mx.where(is_raw, 0, 1), row], axis=-1)
        h("hook_pattern", weights)
        h("hook_key_span", mx.where((index >= 0)[..., None], span, -1))

    def _sublayer_input(self, h: Scope, streams: mx.array, sub: str, layer: LayerWeights,
                        mm: Schedule, ready: tuple[mx.array, ...] = ()) -> tuple[mx.array, HCControl]:
        """A sublayer's HC control (pre, post, comb; hooked) and its input: the streams collapsed
        by `pre` and RMS-normed (`hook_in`). One kernel on the fast path, or none: `ready`,
        (x, pre, post, comb) when the launch before made them (`hc_expand_q8`; pre None: a
        decode step reads only post and comb once the input is made)."""
        cfg, d = self.config, layer.dense
        scale, base, norm = d[f"hc_{sub}_scale.weight"], d[f"hc_{sub}_base.weight"], d[f"{sub}_norm.weight"]
        if mm.fast and ready:
            x, control = ready[0], HCControl(*ready[1:])
        elif mm.fast:
            x, control = hc_fused_input(streams, self._hc_input(layer, sub))
        elif mm.native:
            c = HCControl(*cpu_kernels.hc_control(streams, d[f"hc_{sub}_fn.weight"], scale, base,
                                                  cfg.hc_sinkhorn_iter, cfg.rms_eps, cfg.hc_eps))
            control = HCControl(h("hook_hc_pre", c.pre), h("hook_hc_post", c.post), h("hook_hc_comb", c.comb))
            x = cpu_kernels.hc_collapse_norm(streams, control.pre, norm, cfg.rms_eps)
        else:
            c = hc_control(streams, d[f"hc_{sub}_fn.weight"], scale, base, cfg.hc_sinkhorn_iter, cfg.rms_eps,
                           cfg.hc_eps, mm)
            control = HCControl(h("hook_hc_pre", c.pre), h("hook_hc_post", c.post), h("hook_hc_comb", c.comb))
            x = mm.rms_norm(hc_collapse(streams, control.pre), norm, cfg.rms_eps)
        return h("hook_in", x), control

    def _ffn_block(self, layer: LayerWeights, mm: Schedule, streams: mx.array, token_ids: mx.array,
                   *ready: mx.array,
                   next_input: HCInput | None = None) -> tuple[mx.array, mx.array, tuple[mx.array, ...] | None]:
        """Router (probs -> experts -> weights, each hooked, each replacement used by the next
        step), routed and shared experts; returns the new streams, the experts used and, with
        `next_input` on the fast path's decode steps, the next sublayer's input made of the
        new streams (see `block`). `ready`: this sublayer's, made by the launch before."""
        cfg = self.config
        h = self._hooks.scope(f"{_prefix(layer)}.ffn")
        xf, control = self._sublayer_input(h, streams, "ffn", layer, mm, ready)
        clamp = cfg.swiglu_clamp[MTP_LAYER if layer.index is None else layer.index]
        on_mid = (lambda mid: h("hook_routed_mid", mid)) if h.wants("hook_routed_mid") else None
        one_kernel = not (h.wants("hook_shared_out") or h.wants("hook_out"))    # the down products and HC
        down_later = not h.wants("hook_routed_out")
        made = None
        if (mm.fast and one_kernel and "router" in self.merged_launches
                and not (h.wants("hook_experts") or h.wants("hook_expert_weights"))):
            # the router inside the routed experts' launch, where that launch serves
            made = moe.routed_and_shared_mid_routing(layer, xf, token_ids, cfg.n_expert_used,
                                                     cfg.expert_weight_scale, clamp, mm, on_mid, down_later)
        if made is not None:
            experts, routed, mid = made
        else:
            planes = one_kernel and self.expert_planes and moe.planes_serve(layer, xf, cfg.n_expert_used, mm)
            experts, weights, planes = self._route(h, layer, xf, token_ids, mm, planes)
            if one_kernel:
                routed, mid = moe.routed_and_shared_mid(layer, xf, experts, weights, clamp, mm, on_mid, down_later,
                                                        planes)
        if one_kernel:                           # the down products and the HC step: one kernel
            streams, ready = hc_expand_q8(layer.q8["ffn_down_shexp.weight"], mid, streams, control, mm,
                                          add=routed if down_later else h("hook_routed_out", routed),
                                          next_input=next_input, slot=layer.index)
            return streams, experts, ready
        routed = h("hook_routed_out", moe.routed_experts(layer, xf, experts, weights, clamp, mm, on_mid))
        shared = h("hook_shared_out", moe.shared_expert(layer, xf, clamp, mm))
        if h.wants("hook_out"):
            routed, shared = h("hook_out", routed + shared), None
        return hc_expand(routed, streams, control, mm, add=shared), experts, None

    def _route(self, h: Scope, layer: LayerWeights, xf: mx.array, token_ids: mx.array, mm: Schedule,
               planes: bool = False) -> tuple[mx.array, mx.array, mx.array | None]:
        """The router of the FFN input xf: (experts, weights, planes), each hooked
        (`hook_router_probs` off the fast path), each replacement used by the next step;
        planes: with `planes`, xf's byte planes where the fast path's router writes them
        (`moe.route_fused`), else None."""
        cfg = self.config
        made = None
        if mm.fast:
            probs, chosen, weights, made = moe.route_fused(layer, xf, token_ids, cfg.n_expert_used,
                                                           cfg.expert_weight_scale, planes)
            experts = h("hook_experts", chosen)
            if experts is not chosen:
                weights = moe.route_weights(probs, experts, cfg.expert_weight_scale)
        elif mm.native:
            # One call; a replacement at a point is followed by the composition of the next steps.
            probs, chosen, weights = cpu_kernels.router(xf, layer.dense["ffn_gate_inp.weight"],
                                                        layer.dense.get("exp_probs_b.bias"), cfg.n_expert_used,
                                                        cfg.expert_weight_scale, token_ids, layer.tid2eid)
            replaced = h("hook_router_probs", probs)
            if replaced is not probs:
                probs, chosen, weights = replaced, moe.select_experts(layer, replaced, token_ids,
                                                                      cfg.n_expert_used), None
            experts = h("hook_experts", chosen)
            if experts is not chosen or weights is None:
                weights = moe.route_weights(probs, experts, cfg.expert_weight_scale)
        else:
            probs = h("hook_router_probs", moe.router_probs(layer, xf, mm))
            experts = h("hook_experts", moe.select_experts(layer, probs, token_ids, cfg.n_expert_used))
            weights = moe.route_weights(probs, experts, cfg.expert_weight_scale)
        return experts, h("hook_expert_weights", weights), made

    def _head(self, streams: mx.array, mm: Schedule, prefix: str = "", made: mx.array | None = None) -> mx.array:
        """Collapse, norm and output matrix; with prefix "mtp." the MTP head's own collapse and
        norm (and its `mtp.` points) before the shared output matrix. `made`: the collapsed and
        normed input, made by the last block's last launch (`_head_input`)."""
        cfg, fire = self.config, self._hooks.fire
        w = self.mtp.head if prefix else self.weights.head
        if made is None:
            mix = fire(prefix + "hook_final_weights", hc_head_weights(
                streams, w["output_hc_fn"], w["output_hc_scale"], w["output_hc_base"], cfg.rms_eps, cfg.hc_eps, mm))
            made = mm.rms_norm(hc_collapse(streams, mix), w["output_norm"], cfg.rms_eps)
        z = fire(prefix + "hook_final_norm", made)
        return fire(prefix + "hook_logits", mm.q8(self.weights.output, z))

    def ready_for_decode(self) -> None:
        """Make and evaluate what a fast-path decode step's build would otherwise make on its
        first use: the blocks' fast-path inputs (the F16 copies and transposes its kernels
        read: `LayerWeights.fast_inputs`, evaluated before a compiled part is traced) and the
        output head's HC input (`_head_input`). The greedy stream calls it before its worker
        starts, so that building a step evaluates nothing while the worker encodes."""
        if not self.numerics.fast:
            return
        mx.eval([layer.fast_inputs() for layer in self.weights.layers])
        if self._head_in_product(self._reference_blocks()):
            self._head_input()

    def _head_in_product(self, slow: dict[str, list[str]]) -> bool:
        """Whether the last block's last launch makes the output head's input (`_head_input`):
        on the fast path, unless the last block runs on the reference composition (it is in
        `slow`, `_reference_blocks`) or a hook reads the head's weights (which that launch
        keeps to itself)."""
        return (self.numerics.fast and self.hc_input_in_product and "head" in self.merged_launches
                and _prefix(self.weights.layers[-1]) not in slow
                and not self._hooks.wants("hook_final_weights"))

    def _head_input(self) -> HCInput:
        """The output head's collapse and norm as a sublayer's HC input, for the last block's
        last product to make (`hc_expand_q8(next_input=)`): a mixer whose first n_hc rows are
        the head's (the split's pre is the head's weights: the same sigmoid of the product times
        scale[0] plus base, plus eps, `hc_head_weights`) and whose post and comb rows are zero
        (their outputs unread), then the output norm. Made once."""
        if self._head_hc is None:
            cfg, w = self.config, self.weights.head
            n, fn = cfg.n_hc, w["output_hc_fn"]
            rest = (2 + n) * n - n
            self._head_hc = HCInput(mx.concatenate([fn, mx.zeros((rest, fn.shape[1]), fn.dtype)]),
                                    mx.concatenate([w["output_hc_scale"].reshape(-1)[:1], mx.zeros((2,))]),
                                    mx.concatenate([w["output_hc_base"], mx.zeros((rest,))]), w["output_norm"],
                                    cfg.hc_sinkhorn_iter, cfg.rms_eps, cfg.hc_eps)
            mx.eval(self._head_hc)
        return self._head_hc


# Masks depend only on positions and sizes: made once per chunk, shared by the layers.
@lru_cache(maxsize=16)
def _window_mask(p0: int, t: int, n_kept: int, n_swa: int) -> mx.array:
    """[T, n_kept + T]: the raw rows (kept window, then the chunk's) each token sees."""
    if t == 1:                                   # the columns n_kept - c < n_swa
        return _span_mask(n_kept + 1, max(0, n_kept + 1 - n_swa), n_kept + 1)
    offset = np.arange(p0, p0 + t)[:, None] - np.arange(p0 - n_kept, p0 + t)[None, :]
    return mx.array((offset >= 0) & (offset < n_swa))


@lru_cache(maxsize=16)
def _visible_rows(p0: int, t: int, n_rows: int, ratio: int) -> tuple[mx.array, np.ndarray]:
    """([T, n_rows] compressed rows each token may see (windows it has completed), their counts)."""
    if t == 1:
        seen = min(n_rows, (p0 + 1) // ratio)
        return _span_mask(n_rows, 0, seen), np.array([seen])
    seen = np.arange(n_rows)[None, :] < ((np.arange(p0, p0 + t) + 1) // ratio)[:, None]
    return mx.array(seen), seen.sum(axis=1)


@lru_cache(maxsize=16)
def _window_and_rows_mask(p0: int, t: int, n_kept: int, n_swa: int, n_rows: int, ratio: int) -> mx.array:
    """[T, n_kept + T + n_rows]: `_window_mask` then `_visible_rows`, side by side."""
    if t == 1:                                   # the window's visible columns, then the rows seen: one span
        return _span_mask(n_kept + 1 + n_rows, max(0, n_kept + 1 - n_swa),
                          n_kept + 1 + min(n_rows, (p0 + 1) // ratio))
    window = np.array(_window_mask(p0, t, n_kept, n_swa))
    return mx.array(np.concatenate([window, np.array(_visible_rows(p0, t, n_rows, ratio)[0])], axis=1))


@lru_cache(maxsize=64)
def _span_mask(n: int, lo: int, hi: int) -> mx.array:
    """[1, n], True on columns lo..hi-1: a decode token's masks, each one span of its columns.
    Kept by its span, not by position, so that the steps of a run share one array until a
    compressed row is added. On a GPU it is made on the device: MLX's CUDA backend keeps an
    array made from host bytes in managed memory, whose pages move to the GPU when a kernel
    first reads them (a fresh mask each step did that in every step). On the CPU the host's
    bytes are read as they are (a lazy array there costs the first native kernel an evaluation)."""
    if batch_invariant_device():
        return mx.array((np.arange(n) >= lo) & (np.arange(n) < hi))[None]
    columns = mx.arange(n, dtype=mx.int32)
    return ((columns >= lo) & (columns < hi))[None]


def _within(h: Scope, suffix: str, mask: mx.array | None, visible: mx.array) -> mx.array | None:
    """Fire a row-mask point if a hook wants it (None: every visible row); a replacement is
    limited to the visible rows. Unwanted, the mask stays as it was, None included."""
    if not h.wants(suffix):
        return mask
    return h(suffix, visible if mask is None else mask) & visible


def _kept(ready: tuple[mx.array, ...] | None, before: mx.array,
          after: mx.array) -> tuple[tuple[mx.array, ...] | None, mx.array]:
    """(next sublayer's input, streams) past a residual point: the input made of `before`
    stays only if no hook replaced the streams there (`after is before`)."""
    return (ready if after is before else None), after


def _prefix(layer: LayerWeights) -> str:
    """Where a block's points live: `blocks.L`, or `mtp` for the MTP head's block (index None)."""
    return "mtp" if layer.index is None else f"blocks.{layer.index}"


def _as_tokens(tokens) -> list[int]:
    return [int(t) for t in np.asarray(tokens).reshape(-1)]
