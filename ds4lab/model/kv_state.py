"""Session state <-> .kv files: restore a file's state, save a state as ds4 would. The file
format itself is `ds4lab.kvc` (numpy only); this is the model side of the bridge.

What ds4's CPU path writes for a state (ds4.c session payload, ds4_kvstore.c header):
- payload words: ctx; prefill_cap = min(ctx, 2048) at 8d57664 and min(ctx, 4096) at ba00a8a
  (the default chunk grew; the loader ignores the word since ba00a8a); raw_cap and raw_window
  = min(n_swa, ctx); comp_cap = ctx / (smallest ratio) + 2, the first ratio-4 layer's
  capacity; raw_live = min(T, raw_window);
- header: quant bits 4 when layer 0's routed gate experts are Q4_K, else 2; hits 0;
  created_at = last_used = now; at ba00a8a the model id in byte 7 and payload ABI 2 in byte 20;
- the text: every token's bytes concatenated (ds4_token_text), and the file is named by its SHA-1.
The GPU backends differ only in raw_cap (a ring sized for prefill chunks), which is no part of
the durable state; ds4lab writes the CPU value.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..errors import KVCFormatError
from ..kvc import payload, trailers
from ..kvc.header import PAYLOAD_ABI, REASON_CODES, KVCHeader
from ..kvc.kvfile import KVCFile, read, write
from ..tokenizer import token_bytes
from .compressor import Frontier
from .state import LayerCache, SessionState

VERSIONS = ("8d57664", "ba00a8a")
DEFAULT_CTX = 32768  # ds4-server's default --ctx


def render_text(tokens) -> bytes:
    """The cache text ds4 stores for these tokens (what the file name hashes)."""
    return b"".join(token_bytes(int(t)) for t in tokens)


def quant_bits(model) -> int:
    first = model.weights.layers[0].experts.get("ffn_gate_exps.weight")
    return 4 if first is not None and first.type_name == "Q4_K" else 2


def payload_words(config, n_tokens: int, ctx_size: int, version: str) -> dict[str, int]:
    if version not in VERSIONS:
        raise ValueError(f"version {version!r}: known versions are {', '.join(VERSIONS)}")
    window = min(config.n_swa, ctx_size)
    compressed = [r for r in payload.schedule_of(config, config.n_layer) if r]
    return {"magic": payload.DSV4_MAGIC, "version": 1 if version == "8d57664" else 2, "ctx": ctx_size,
            "prefill_cap": min(ctx_size, 2048 if version == "8d57664" else 4096), "raw_cap": window,
            "raw_window": window, "comp_cap": ctx_size // min(compressed) + 2 if compressed else 0,
            "n_tokens": n_tokens, "n_layer": config.n_layer, "head_dim": config.head_dim,
            "indexer_head_dim": config.indexer_head_dim, "n_vocab": config.n_vocab,
            "raw_live": min(n_tokens, window)}


def _layer_arrays(cache) -> dict[str, np.ndarray]:
    out = {"raw_kv": cache.raw}
    if cache.comp is not None:
        out |= {"comp_kv": cache.comp, "attn_state_kv": cache.frontier.kv, "attn_state_score": cache.frontier.score}
    if cache.index_comp is not None:
        out |= {"index_comp_kv": cache.index_comp, "index_state_kv": cache.index_frontier.kv,
                "index_state_score": cache.index_frontier.score}
    return {k: np.asarray(v, np.float32) for k, v in out.items()}


def from_state(state, model, path, reason: str | int = "cold", ctx_size: int = DEFAULT_CTX,
               version: str = "ba00a8a", now: int | None = None, title: bytes | None = None,
               tool_map: list[tuple[bytes, bytes]] | None = None, compress: bool = False) -> Path:
    """Write a session state as the .kv file ds4 would write for it. `path` is a directory (the
    file is named `<sha1 of the text>.kv` in it, as ds4 names it) or a file path."""
    config = model.config
    n = state.n_tokens
    if n == 0:
        raise ValueError("an empty session has nothing to save (ds4 never writes 0-token files)")
    if n >= ctx_size:
        raise ValueError(f"{n} tokens do not fit ctx_size {ctx_size} (ds4 loads only T < ctx)")
    code = REASON_CODES[reason] if isinstance(reason, str) else int(reason)
    words = payload_words(config, n, ctx_size, version)
    layers = [_layer_arrays(cache) for cache in state.layers]
    for il, arrays in enumerate(layers):
        if arrays["raw_kv"].shape[0] != words["raw_live"]:
            raise ValueError(f"layer {il} holds {arrays['raw_kv'].shape[0]} raw rows, ds4 keeps {words['raw_live']}")
    n_comp = [len(a.get("comp_kv", ())) for a in layers]
    n_index = [len(a.get("index_comp_kv", ())) for a in layers]
    body = b"".join(payload.encode(words, state.tokens, np.asarray(state.logits, np.float32).reshape(-1), n_comp,
                                   n_index, layers))
    text = render_text(state.tokens)
    trailer = trailers.Trailer(title=title, tool_map=list(tool_map or []))
    stamp = int(time.time()) if now is None else int(now)
    header = KVCHeader(version=1, quant_bits=quant_bits(model), reason=code, ext_flags=trailer.ext_flags(),
                       model_id=config.model_id if version == "ba00a8a" else 0, tokens=n, hits=0,
                       ctx_size=ctx_size, payload_abi=PAYLOAD_ABI if version == "ba00a8a" else 0,
                       created_at=stamp, last_used=stamp, payload_bytes=len(body), text_bytes=len(text))
    path = Path(path)
    if path.is_dir() or not path.suffix:
        path = path / f"{hashlib.sha1(text).hexdigest()}.kv"
    parsed = payload.parse(body, 0, len(body), model, path, header.payload_offset)
    return write(KVCFile(path, header, text, parsed, trailer), path, compress=compress)


def to_state(kvc: KVCFile | str | Path, model=None):
    """The session state a .kv file holds (ds4-written files included), for `model.session(state)`.
    With `model`, the file must match its shape: layers, dims, vocabulary and raw window."""
    if not isinstance(kvc, KVCFile):
        kvc = read(kvc, model)
    if kvc.stripped:
        raise KVCFormatError(kvc.path, "payload_bytes: 0 (a stripped agent session): no KV state to restore; "
                                       "prefill its text instead", offset=40)
    if model is not None:
        _check_fits(kvc, model.config)
    layers = []
    for il in range(len(kvc.ratios)):
        a = {k: mx.array(v) for k, v in kvc.arrays(il).items()}
        cache = LayerCache(raw=a["raw_kv"], comp=a.get("comp_kv"), index_comp=a.get("index_comp_kv"))
        if "attn_state_kv" in a:
            cache.frontier = Frontier(a["attn_state_kv"], a["attn_state_score"])
        if "index_state_kv" in a:
            cache.index_frontier = Frontier(a["index_state_kv"], a["index_state_score"])
        layers.append(cache)
    return SessionState(layers=layers, tokens=[int(t) for t in kvc.tokens], logits=mx.array(kvc.logits))


def _check_fits(kvc: KVCFile, config) -> None:
    """ds4's load checks: the same shape, and the raw window this runtime keeps."""
    words = kvc.payload.fields
    want = {"n_layer": config.n_layer, "head_dim": config.head_dim, "indexer_head_dim": config.indexer_head_dim,
            "n_vocab": config.n_vocab, "raw_window": min(config.n_swa, words["ctx"]),
            "raw_live": min(words["n_tokens"], config.n_swa, words["ctx"])}
    bad = [f"payload {k}: the file has {words[k]}, the model needs {v}" for k, v in want.items() if words[k] != v]
    if kvc.header.model_id != config.model_id and kvc.header.payload_abi == PAYLOAD_ABI:
        bad.append(f"model_id: the file was written for model {kvc.header.model_id}, this is {config.model_id}")
    if bad:
        raise KVCFormatError(kvc.path, bad)
