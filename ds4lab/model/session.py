"""A generation session over ds4's state: chunked prefill, decode, snapshot and restore."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..kvc import KVCFile, read
from .compressor import clear_unused_slots
from .kv_state import from_state, to_state
from .model import ChunkResult
from .state import SessionState

# Tokens per prefill chunk. The reference path holds [T, keys, head_dim] attention rows, so
# its chunks stay small; the fast path (tensor-core GEMMs, an attention kernel that reads keys
# in place) wants big ones.
DEFAULT_PREFILL_CHUNK = 512
FAST_PREFILL_CHUNK = 2048


class Session:
    """Holds one sequence's state; `prefill` and `decode` return the next-token logits [n_vocab]."""

    def __init__(self, model, state: SessionState | None = None) -> None:
        self.model = model
        self.state = state or model.empty_state()
        self.spec_trace = None       # after speculative decoding: one row per cycle (ds4lab.mtp)

    @property
    def tokens(self) -> list[int]:
        return self.state.tokens

    @property
    def logits(self) -> mx.array | None:
        return self.state.logits

    def prefill(self, tokens, chunk: int | None = None, progress: bool = False,
                on_chunk: Callable[[list[int], ChunkResult], None] | None = None) -> mx.array:
        """Consume `tokens` in chunks of `chunk` tokens (default: FAST_PREFILL_CHUNK on the fast
        path, else DEFAULT_PREFILL_CHUNK; a progress bar over them with `progress`); return the
        logits that predict the next token, [n_vocab]. Afterwards, like ds4, the frontier
        slots past the partial window are reset (they are never read before being overwritten).
        `on_chunk(ids, result)` sees each chunk (its tokens' final HC streams: result.hidden)."""
        self._run(tokens, chunk, progress, last_only=True, on_chunk=on_chunk)
        return self.state.logits

    def prefill_all(self, tokens, chunk: int | None = None, progress: bool = False) -> ChunkResult:
        """`prefill` keeping every position's logits [T, n_vocab], the experts each layer
        routed to (per layer [T, n_expert_used]) and the final HC streams [T, n_hc, n_embd]:
        teacher-forced scoring of a prompt."""
        return self._run(tokens, chunk, progress, last_only=False)

    def _run(self, tokens, chunk: int | None, progress: bool, last_only: bool,
             on_chunk: Callable[[list[int], ChunkResult], None] | None = None) -> ChunkResult:
        ids = [int(t) for t in np.asarray(tokens).reshape(-1)]
        if chunk is None:
            chunk = FAST_PREFILL_CHUNK if self.model.numerics.fast else DEFAULT_PREFILL_CHUNK
        if not ids:
            raise ValueError("prefill needs at least one token")
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), unit="tok", desc="prefill")
        logits, experts, hidden = [], [], []    # only what the caller gets back: not each chunk's state
        for start in range(0, len(ids), chunk):
            part = ids[start:start + chunk]
            result = self.model.forward(self.state, part, last_only=last_only)
            self.state = result.state
            if on_chunk is not None:
                on_chunk(part, result)
            if not last_only:
                logits.append(result.logits)
                experts.append(result.experts)
                hidden.append(result.hidden)
            if bar is not None:
                bar.update(len(part))
        if bar is not None:
            bar.close()
        n = self.state.n_tokens
        for cache, ratio in zip(self.state.layers, self.model.config.compress_ratios, strict=False):
            if cache.frontier is not None:
                cache.frontier = clear_unused_slots(cache.frontier, n, ratio)
            if cache.index_frontier is not None:
                cache.index_frontier = clear_unused_slots(cache.index_frontier, n, ratio)
        if last_only:
            return ChunkResult(self.state.logits[None], result.experts, self.state)
        if len(logits) == 1:
            return ChunkResult(logits[0], experts[0], self.state, hidden[0])
        return ChunkResult(mx.concatenate(logits), [mx.concatenate(layer) for layer in zip(*experts, strict=True)],
                           self.state, mx.concatenate(hidden))

    def decode(self, token: int | mx.array) -> mx.array:
        """Consume one token; return the logits that predict the next one. The token may be a
        device scalar not evaluated yet (see `Model.forward`)."""
        token = token if isinstance(token, mx.array) else int(token)
        self.state = self.model.forward(self.state, [token], last_only=True).state
        return self.state.logits

    def snapshot(self) -> SessionState:
        return self.state.copy()

    def restore(self, snapshot: SessionState) -> None:
        self.state = snapshot.copy()

    def save_kv(self, path, reason: str | int = "cold", **options) -> Path:
        """Write this state as the .kv file ds4 would write (see `ds4lab.model.kv_state.from_state` for the
        options: ctx_size, version, now, title, tool_map, compress). `path` may be a cache
        directory: the file is then named by the SHA-1 of its rendered text, as ds4 names it."""
        return from_state(self.state, self.model, path, reason=reason, **options)

    def load_kv(self, path) -> KVCFile:
        """Continue from a .kv file (ds4-written ones included); returns the file read."""
        kvc = read(path, self.model)
        self.state = to_state(kvc, self.model)
        return kvc
