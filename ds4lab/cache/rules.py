"""ds4's disk-cache rules as plain functions (ds4_kvstore.c at 8d57664 and ba00a8a).

Each function is one rule of ds4-server's cache, written so that it can be checked against
ds4's own tables and used on a real `--kv-disk-dir`: how long a checkpoint is stored, where
continued checkpoints land, the chat anchor of cold saves, the budget test, the eviction
score and order, and the longest-prefix lookup. Integer arithmetic follows the C types
(int, u32, u64 with their overflow checks); scores are computed in doubles in ds4's order.

Keyword options are named like ds4-server's flags (`--kv-cache-min-tokens` -> `min_tokens`).
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from ..config import ModelConfig, known_shape
from ..errors import KVCFormatError
from ..kvc.header import PREFIX_BYTES, REASONS, KVCHeader, read_prefix
from ..kvc.payload import checkpoint_bytes
from ..kvc.scan import scan_headers
from .policies import DEFAULT_POLICY, Entry, Incoming, Policy, get_policy

U64_MAX = (1 << 64) - 1
_SHA_NAME = re.compile(r"[0-9a-fA-F]{40}\.kv")


@dataclass(frozen=True)
class CacheOptions:
    """ds4_kvstore_options with ds4's defaults (ds4_kvstore_default_options)."""

    min_tokens: int = 512
    cold_max_tokens: int = 30000
    continued_interval_tokens: int = 10000
    boundary_trim_tokens: int = 32
    boundary_align_tokens: int = 2048

    @classmethod
    def of(cls, opts: Mapping[str, Any]) -> CacheOptions:
        known = {f.name for f in fields(cls)}
        unknown = set(opts) - known
        if unknown:
            raise TypeError(f"unknown cache option(s) {sorted(unknown)} (known: {sorted(known)})")
        return cls(**{k: int(v) for k, v in opts.items()})


def _c_rem(a: int, b: int) -> int:
    """C's `%` on ints: the remainder takes the dividend's sign."""
    r = abs(a) % abs(b)
    return -r if a < 0 else r


def _c_div(a: int, b: int) -> int:
    """C's `/` on ints: truncation toward zero."""
    q = abs(a) // abs(b)
    return q if (a < 0) == (b < 0) else -q


def store_len(tokens: int, **opts: int) -> int:
    """How many of `tokens` a cold save keeps when no chat anchor applies (ds4_kvstore_store_len).

    Trim `boundary_trim_tokens` off the end, then align down to `boundary_align_tokens`; when
    that would fall below `min_tokens` (545..2079 by default) the length is kept as it is.
    """
    o = CacheOptions.of(opts)
    trim, align = o.boundary_trim_tokens, o.boundary_align_tokens
    if tokens > o.min_tokens + trim:
        stable = tokens - trim
        if align > 0:
            stable -= _c_rem(stable, align)
        if stable >= o.min_tokens:
            return stable
    return tokens


def continued_step(**opts: int) -> int:
    """Distance between continued checkpoints: the interval rounded up to the alignment
    (10000 -> 10240 by default); 0 when continued saves are off."""
    o = CacheOptions.of(opts)
    if o.continued_interval_tokens <= 0:
        return 0
    step, align = o.continued_interval_tokens, o.boundary_align_tokens
    if align > 0:
        step = _c_div(step + align - 1, align) * align
        if step <= 0:
            step = align
    return step


def continued_target(live_tokens: int, last_store_tokens: int, **opts: int) -> int:
    """The continued checkpoint ds4 writes when the live session holds `live_tokens`: the
    length itself on an absolute multiple of the step beyond the last store, else 0."""
    step = continued_step(**opts)
    if step <= 0 or live_tokens < CacheOptions.of(opts).min_tokens:
        return 0
    if _c_rem(live_tokens, step) != 0 or live_tokens <= last_store_tokens:
        return 0
    return live_tokens


def chat_anchor(tokens: Sequence[int] | None, user_token_id: int, assistant_token_id: int,
                min_tokens: int = 512) -> int:
    """Where a cold save of a chat prompt ends: the last `<｜User｜>` before the first
    `<｜Assistant｜>` (the stable system + tools prefix), or -1 when it is below `min_tokens`."""
    if tokens is None or user_token_id < 0 or assistant_token_id < 0:
        return -1
    last_user = -1
    for i, token in enumerate(tokens):
        if token == assistant_token_id:
            break
        if token == user_token_id:
            last_user = i
    return last_user if last_user >= min_tokens else -1


def file_size_fits(text_bytes: int, payload_bytes: int, trailer_bytes: int,
                   budget_bytes: int) -> tuple[bool, int | None, int | None]:
    """ds4_kvstore_file_size_fits: (fits, file bytes, bytes required with 1% headroom).

    An output ds4 leaves unwritten is None: both on u64 overflow of the file size, the
    required bytes when the budget is 0 (unlimited) or when the headroom overflows.
    """
    fixed = PREFIX_BYTES
    if U64_MAX - fixed < text_bytes or U64_MAX - fixed - text_bytes < payload_bytes or \
            U64_MAX - fixed - text_bytes - payload_bytes < trailer_bytes:
        return False, None, None
    file_bytes = fixed + text_bytes + payload_bytes + trailer_bytes
    if budget_bytes == 0:
        return True, file_bytes, None
    slack = file_bytes // 100 + (1 if file_bytes % 100 else 0)
    if U64_MAX - file_bytes < slack:
        return False, file_bytes, None
    required = file_bytes + slack
    return required <= budget_bytes, file_bytes, required


def payload_bytes(config: ModelConfig | str, n_tokens: int, ctx_size: int | None = None) -> int:
    """Bytes of the DSV4 session payload of an `n_tokens` checkpoint (ds4_session_payload_bytes).

    `config` is a ModelConfig or "flash"/"pro". The layout is the same at 8d57664 and ba00a8a:
    header, tokens, logits, per-layer row counts, then per layer the raw window rows, and on
    compressed layers the compressed rows and compressor frontier (kv and score), and on
    ratio-4 layers the indexer rows and frontier, all f32. `ctx_size` only matters below the
    sliding window (raw rows are min(T, window, ctx)).
    """
    return checkpoint_bytes(model_config(config), int(n_tokens), ctx_size)


def model_config(config: ModelConfig | str) -> ModelConfig:
    """A ModelConfig as given, or ds4's shape by name ("flash" or "pro")."""
    return known_shape(config) if isinstance(config, str) else config


# ---- directories ---------------------------------------------------------------------
def index_entry(name: str, header: KVCHeader, file_size: int, policy: str | Policy = DEFAULT_POLICY) -> Entry | None:
    """The entry ds4 indexes for a file of this name, parsed header and size, or None where
    that version's ds4 does not see the file (kv_cache_refresh's rules).

    A file counts only with a 40-hex `.kv` name, envelope version 1, tokens != 0, quant bits 2
    or 4, and at ba00a8a payload ABI byte 20 == 2; `parse_header` (given the file size) has
    already refused short files and a text or payload running past the end. Anything else is
    invisible: never counted, evicted or loaded.
    """
    h, pol = header, get_policy(policy)
    if not _SHA_NAME.fullmatch(name) or h.version != 1 or h.tokens == 0 or h.quant_bits not in (2, 4):
        return None
    if pol.payload_abi is not None and h.payload_abi != pol.payload_abi:
        return None
    return Entry(name[:40].lower(), h.tokens, h.hits, file_size, h.created_at, h.last_used,
                 h.reason if h.reason <= 6 else 0, h.model_id, h.quant_bits, h.ctx_size, h.text_bytes, name)


def index_directory(directory: str | Path, policy: str | Policy = DEFAULT_POLICY) -> list[Entry]:
    """The files ds4 would index in `directory`, in readdir order (see `index_entry`)."""
    out = []
    with os.scandir(directory) as it:
        for de in it:
            if not _SHA_NAME.fullmatch(de.name):
                continue
            try:
                with open(de.path, "rb") as fh:  # one open: ds4's stat() size and its header read
                    h, size = read_prefix(fh, de.path)
            except (OSError, KVCFormatError):
                continue
            entry = index_entry(de.name, h, size, policy)
            if entry is not None:
                out.append(entry)
    return out


def scan(directory: str | Path, with_text: bool = False, now: float | None = None,
         policies: Iterable[str] | None = None):
    """`ds4lab.kvc.scan`'s table of a cache directory plus a `score_<policy>` column per policy:
    the eviction score each file has now (lowest goes first), NaN for files that policy's ds4
    would not index (default: both of ds4's versions). Scores come from the headers read once."""
    frame, headers = scan_headers(directory, with_text)
    now = int(time.time() if now is None else now)
    for name in policies or ("ds4@8d57664", "ds4@ba00a8a"):
        scores = []
        for file, size, h in zip(frame["file"], frame["file_bytes"], headers, strict=True):
            entry = index_entry(file, h, int(size), name) if h is not None else None
            scores.append(np.nan if entry is None else eviction_score(entry, now, policy=name))
        frame[f"score_{name}"] = np.asarray(scores, np.float64)
    return frame


def _entries(directory: str | Path | Iterable[Mapping[str, Any] | Entry], policy: Policy) -> list[Entry]:
    if isinstance(directory, (str, os.PathLike)):
        return index_directory(directory, policy)
    return [Entry.of(e) for e in directory]


def eviction_score(entry: Mapping[str, Any] | Entry, now: int, protected_sha: str | None = None,
                   incoming: Mapping[str, Any] | Incoming | None = None,
                   policy: str | Policy = DEFAULT_POLICY) -> float:
    """The eviction score of one file under `policy` (lowest is evicted first).

    `entry` is any mapping with sha, tokens, hits, file_size, created_at, last_used, reason
    (and for ba00a8a model_id, quant_bits, ctx_size, text_bytes); `incoming` the checkpoint
    about to be stored (text, model_id, quant_bits, ctx_size, reject_different_quant).
    """
    return get_policy(policy).score(Entry.of(entry), int(now), protected_sha, Incoming.of(incoming))


def evict_order(entries: Sequence[Entry], budget_bytes: int, now: int, protected_sha: Any = None,
                extra_bytes: int = 0, incoming: Incoming | None = None,
                policy: Policy | str = DEFAULT_POLICY) -> list[tuple[Entry, float]]:
    """ds4_kvstore_evict without the unlinks: the victims in order, each with its score.

    `entries` are in readdir order, which breaks exact ties after the older-last_used rule.
    """
    pol = get_policy(policy)
    if budget_bytes == 0:
        return []
    if isinstance(protected_sha, str):
        protected_sha = protected_sha.lower()  # names are compared case-blind, as ds4 does
    if pol.pre_store_eviction:
        if extra_bytes > budget_bytes:
            return []  # an oversized newcomer evicts nothing
        target = budget_bytes - extra_bytes
    else:
        target = budget_bytes
        if protected_sha is not None:
            size = next((e.file_size for e in entries if e.sha == protected_sha), 0)
            if size > budget_bytes:
                protected_sha = None
    left = list(entries)
    total = sum(e.file_size for e in left) & U64_MAX
    now = int(now)
    # ds4 rescores every entry for each victim; within one pass nothing a score reads changes
    # (same now, incoming and protection), so scoring once gives the same victims.
    scores = [pol.score(e, now, protected_sha, incoming) for e in left]
    victims = []
    while total > target and left:
        victim, best = 0, scores[0]
        for i in range(1, len(left)):
            s = scores[i]
            if s < best or (s == best and left[i].last_used < left[victim].last_used):
                victim, best = i, s
        e = left.pop(victim)
        del scores[victim]
        victims.append((e, best))
        total = total - e.file_size if total >= e.file_size else 0
    return victims


def plan_eviction(directory: str | Path | Iterable[Mapping[str, Any] | Entry], budget_bytes: int, now: int,
                  protected_sha: str | None = None, extra_bytes: int = 0,
                  incoming: Mapping[str, Any] | Incoming | None = None,
                  policy: str | Policy = DEFAULT_POLICY) -> list[str]:
    """The file names ds4 would delete from `directory` to meet `budget_bytes`, in order.

    Deletes nothing. `directory` is a path (indexed by the policy's version rules) or entry
    mappings in readdir order. At 8d57664 eviction follows a store and `protected_sha` is the
    new file; at ba00a8a it precedes a store of `extra_bytes` and runs to budget - extra_bytes,
    not at all when extra_bytes exceeds the budget.
    """
    pol = get_policy(policy)
    victims = evict_order(_entries(directory, pol), budget_bytes, now, protected_sha, extra_bytes,
                          Incoming.of(incoming), pol)
    return [e.file_name for e, _ in victims]


def find_prefix(directory: str | Path | Iterable[Mapping[str, Any] | Entry], prompt_text: str | bytes,
                runtime_ctx: int, quant_bits: int, reject_different_quant: bool = False, min_tokens: int = 512,
                model_id: int = 0, policy: str | Policy = DEFAULT_POLICY) -> str | None:
    """The file a prompt would load (ds4_kvstore_find_text_prefix): the longest stored text
    that is a byte prefix of the rendered prompt, ties to more tokens, then readdir order.

    Skipped: texts longer than the prompt, fewer than `min_tokens` tokens, written for a
    larger ctx than `runtime_ctx`, a different quant when `reject_different_quant`, and at
    ba00a8a a different model id. A runtime quant other than 2 or 4 loads nothing.
    """
    pol = get_policy(policy)
    if quant_bits not in (2, 4):
        return None
    prompt = prompt_text.encode("utf-8") if isinstance(prompt_text, str) else bytes(prompt_text)
    prompt = prompt.split(b"\0", 1)[0]  # ds4 takes strlen() of the prompt
    best: Entry | None = None
    for e in _entries(directory, pol):
        if e.text_bytes > len(prompt):
            continue
        if _i32(e.tokens) < min_tokens:  # C compares (int)tokens
            continue
        if pol.model_id_filter and e.model_id != model_id & 0xFF:
            continue
        if runtime_ctx & 0xFFFFFFFF < e.ctx_size:
            continue
        if reject_different_quant and e.quant_bits != quant_bits & 0xFF:
            continue
        if best is not None and (e.text_bytes < best.text_bytes or
                                 (e.text_bytes == best.text_bytes and e.tokens <= best.tokens)):
            continue
        if hashlib.sha1(prompt[: e.text_bytes]).hexdigest() == e.sha:
            best = e
    return None if best is None else best.file_name


def _i32(value: int) -> int:
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def explain_eviction(directory: str | Path | Iterable[Mapping[str, Any] | Entry], budget_bytes: int, now: int,
                     protected_sha: str | None = None, extra_bytes: int = 0,
                     incoming: Mapping[str, Any] | Incoming | None = None,
                     policy: str | Policy = DEFAULT_POLICY):
    """`plan_eviction` with its reasons: one row per indexed file, in eviction order first
    (`order` 1, 2, ...; 0 for files kept), with the score and its factors."""
    import pandas as pd

    pol = get_policy(policy)
    entries = _entries(directory, pol)
    inc = Incoming.of(incoming)
    order = {e.sha: i for i, (e, _) in enumerate(
        evict_order(entries, budget_bytes, now, protected_sha, extra_bytes, inc, pol), 1)}
    rows = []
    for e in entries:
        parts = pol.parts(e, int(now), inc)
        rows.append({"order": order.get(e.sha, 0), "file": e.file_name, "reason": REASONS.get(e.reason, ""),
                     "tokens": e.tokens, "hits": e.hits, "effective_hits": parts.effective_hits,
                     "file_bytes": e.file_size, "density": parts.density, "anchor_factor": parts.anchor,
                     "supersede_factor": parts.supersede,
                     "score": pol.score(e, int(now), protected_sha, inc), "last_used": e.last_used or e.created_at})
    df = pd.DataFrame(rows, columns=["order", "file", "reason", "tokens", "hits", "effective_hits", "file_bytes",
                                     "density", "anchor_factor", "supersede_factor", "score", "last_used"])
    df["kept"] = df["order"] == 0
    return df.sort_values(["kept", "order", "score"]).drop(columns="kept").reset_index(drop=True)
