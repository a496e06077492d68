"""Replay a request trace through ds4-server's disk-cache decisions (ds4_server.c generate_job).

Per request, in ds4's order: reuse the live session when it is a prefix of the prompt;
otherwise save the live session ("evict"), look the prompt up on disk, and on a miss save a
cold checkpoint (chat anchor, else `store_len`); continued checkpoints land on absolute
multiples of the continued step at prefill chunk ends and before decode steps; a clean exit
saves the live session ("shutdown"). Stores follow the policy's version of
ds4_kvstore_store_live_prefix_text (same-file reuse, budget fit with 1% headroom, eviction
before or after writing), hits touch or consume the file.

The directory is a model in memory: entries keyed by canonical text (see `texts`), indexed
per branch so the longest-prefix lookup is a bisect per ancestor branch instead of a SHA-1
per file, and a running byte total. Eviction scans the entries for the minimum score, as
ds4 does: scores decay with time, so no order can be kept between stores, and a budget holds
tens to hundreds of checkpoints.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import pandas as pd

from ..config import ModelConfig
from ..kvc.header import REASONS
from .policies import (
    DEFAULT_POLICY,
    REASON_COLD,
    REASON_CONTINUED,
    REASON_EVICT,
    REASON_SHUTDOWN,
    Entry,
    Incoming,
    Policy,
    get_policy,
)
from .rules import (
    CacheOptions,
    continued_step,
    evict_order,
    file_size_fits,
    model_config,
    payload_bytes,
    store_len,
)
from .texts import Text, TextTree
from .workloads import Request, iter_records, prepare

MIB = 1 << 20
DEFAULT_BUDGET = 4096 * MIB  # --kv-disk-space-mb default


@dataclass(frozen=True)
class SimOptions:
    """ds4-server's cache flags (`cache`) and the runtime the trace is replayed on."""

    cache: CacheOptions = field(default_factory=CacheOptions)
    ctx_size: int = 131072            # --ctx (ds4's default is 32768; agent sessions need more)
    quant_bits: int = 2
    model: str = "flash"              # payload sizes and header model id: "flash" or "pro"
    reject_different_quant: bool = False
    prefill_chunk: int | None = None  # None: the policy's version default (2048, 4096 at ba00a8a)
    prefill_tokens_per_s: float = 400.0
    decode_tokens_per_s: float = 25.0
    bytes_per_token: int = 4          # rendered bytes per token of traces without text
    shutdown: bool = True             # save the live session after the last request

    @classmethod
    def of(cls, options: SimOptions | dict[str, Any] | None) -> SimOptions:
        """From a dict that may mix cache flags (min_tokens, ...) and runtime fields."""
        if options is None or isinstance(options, SimOptions):
            return options or cls()
        names = {f.name for f in fields(CacheOptions)}
        cache = CacheOptions.of({k: v for k, v in options.items() if k in names})
        return cls(cache=cache, **{k: v for k, v in options.items() if k not in names})

    @property
    def config(self) -> ModelConfig:
        return model_config(self.model)


EVENT_COLUMNS = ["time", "request", "session", "event", "source", "reason", "tokens", "text_bytes", "file_bytes",
                 "matched_tokens", "prefill_tokens", "score", "effective_hits", "density", "anchor_factor",
                 "supersede_factor", "hits", "dir_bytes", "n_files", "file"]
EVENTS = ("request", "reject", "load-failed", "store", "store-existing", "store-skipped", "replace", "evict",
          "consume")
SOURCES = ("memory", "disk", "none")


class _TreeIncoming(Incoming):
    """The incoming checkpoint for the supersede test, answered by the text tree."""

    def __init__(self, tree: TextTree, text: Text, model_id: int, quant_bits: int, ctx_size: int,
                 reject_different_quant: bool) -> None:
        super().__init__(None, model_id, quant_bits, ctx_size, reject_different_quant)
        self.tree, self.body = tree, text

    @property
    def text_len(self) -> int:
        return self.body.nbytes

    def starts_with(self, entry: Entry) -> bool:
        return self.tree.owner(self.body.branch, entry.text_bytes) == entry.sha[0]


class CacheSimulator:
    """ds4-server's cache state: the directory model, the live session and the clock."""

    def __init__(self, policy: str | Policy = DEFAULT_POLICY, budget_bytes: int = DEFAULT_BUDGET,
                 options: SimOptions | dict[str, Any] | None = None) -> None:
        self.policy = get_policy(policy)
        self.budget = int(budget_bytes)
        self.opt = SimOptions.of(options)
        self.cache_opts = asdict(self.opt.cache)
        self.step = continued_step(**self.cache_opts)
        self.chunk = self.opt.prefill_chunk or self.policy.prefill_chunk
        self.model_id = self.opt.config.model_id
        self.tree = TextTree()
        self.entries: dict[tuple[int, int], Entry] = {}
        self.by_branch: dict[int, list[int]] = {}  # owner branch -> sorted text_bytes of its entries
        self.total = 0
        self.live: Text | None = None
        self.last_store = 0   # continued_last_store_tokens
        self.clock = 0.0
        self.now = 0.0
        self.rows: list[tuple] = []
        self._req = -1
        self._session = ""
        self._payload: dict[int, int] = {}

    # ---- running ---------------------------------------------------------------------
    def run(self, trace: str | Path | Iterable[dict[str, Any]]) -> pd.DataFrame:
        """Replay a trace (JSONL path, ds4 `--trace` log or records) and return the events."""
        for i, req in enumerate(prepare(iter_records(trace), self.tree, self.opt.bytes_per_token)):
            self.request(i, req)
        if self.opt.shutdown and self.live is not None and self.live.tokens >= self.opt.cache.min_tokens:
            self.now = self.clock
            self._store(self.live, REASON_SHUTDOWN)
        return self.events()

    def request(self, index: int, r: Request) -> None:
        """One request, in generate_job's order."""
        o, c = self.opt, self.opt.cache
        self._req, self._session = index, r.session
        self.now = max(r.t, self.clock)
        prompt, p = r.prompt, r.prompt.tokens
        if p >= o.ctx_size:
            self._row("reject", tokens=p)
            return
        cached, source = 0, "none"
        live = self.live
        if live is not None and live.tokens <= p and self.tree.is_prefix(live, prompt):
            cached, source = live.tokens, "memory"
        else:
            self.last_store = 0
            if live is not None and live.tokens >= c.min_tokens:
                self._store(live, REASON_EVICT)
            self.live = None
            hit = self._lookup(prompt)
            if hit is not None:
                cached, source = self._load(hit)
        self._row("request", source=source, tokens=p, text_bytes=prompt.nbytes, matched_tokens=cached,
                  prefill_tokens=p - cached)
        pos = cached
        if cached == 0 and c.cold_max_tokens > 0 and c.min_tokens <= p <= c.cold_max_tokens:
            anchor = r.anchor if r.anchor is not None and r.anchor.tokens >= c.min_tokens else None
            cold = anchor or TextTree.cut(prompt, store_len(p, **self.cache_opts))
            old = self._suppress(cold.tokens) if cold.tokens >= c.min_tokens else -1
            if cold.tokens < p:
                self._prefill(prompt, pos, cold.tokens)
                pos = cold.tokens
                if not self._store(cold, REASON_COLD):
                    self._restore(old, cold.tokens)
                self._prefill(prompt, pos, p)
                self._maybe_continued(prompt, p)
            else:
                self._prefill(prompt, pos, p)
                self._maybe_continued(prompt, p)
                if not self._store(prompt, REASON_COLD):
                    self._restore(old, p)
        else:
            self._prefill(prompt, pos, p)
            self._maybe_continued(prompt, p)
        self._decode(r.live, p, min(r.live.tokens, o.ctx_size))
        self.clock = self.now

    # ---- the request's phases ------------------------------------------------------
    def _prefill(self, text: Text, start: int, end: int) -> None:
        """Prefill [start, end): a continued save may land on each chunk end and at `end`."""
        if end <= start:
            return
        t0 = self.now
        if self.step > 0:
            m = (start // self.step + 1) * self.step
            while m <= end:
                if m % self.chunk == 0 or m == end:
                    self.now = t0 + (m - start) / self.opt.prefill_tokens_per_s
                    self.live = TextTree.cut(text, m)
                    self._maybe_continued(text, m)
                m += self.step
        self.now = t0 + (end - start) / self.opt.prefill_tokens_per_s
        self.live = TextTree.cut(text, end)

    def _decode(self, text: Text, start: int, end: int) -> None:
        """Generate from `start` to `end` tokens; before each step a continued save may land."""
        t0 = self.now
        if self.step > 0 and end > start:
            m = -(-start // self.step) * self.step
            while m < end:
                self.now = t0 + (m - start) / self.opt.decode_tokens_per_s
                self.live = TextTree.cut(text, m)
                self._maybe_continued(text, m)
                m += self.step
        self.now = t0 + max(0, end - start) / self.opt.decode_tokens_per_s
        self.live = TextTree.cut(text, end)

    def _maybe_continued(self, text: Text, live_tokens: int) -> None:
        if self._target(live_tokens) and self._store(TextTree.cut(text, live_tokens), REASON_CONTINUED):
            self.last_store = max(self.last_store, live_tokens)

    def _target(self, live_tokens: int) -> bool:
        """continued_target != 0, inlined on the simulator's precomputed step."""
        return self.step > 0 and live_tokens >= self.opt.cache.min_tokens and live_tokens % self.step == 0 \
            and live_tokens > self.last_store

    def _suppress(self, tokens: int) -> int:
        if not self._target(tokens):
            return -1
        old = self.last_store
        self.last_store = max(self.last_store, tokens)
        return old

    def _restore(self, old: int, tokens: int) -> None:
        if old >= 0 and self.last_store == tokens:
            self.last_store = old

    # ---- the directory ----------------------------------------------------------------
    def _lookup(self, prompt: Text) -> Entry | None:
        """The longest stored prefix of `prompt` that passes ds4's lookup filters."""
        o, pol = self.opt, self.policy
        parent, fork = self.tree.parent, self.tree.fork
        branch, limit = prompt.branch, prompt.nbytes
        while branch >= 0:
            positions = self.by_branch.get(branch)
            if positions:
                for i in range(bisect.bisect_right(positions, limit) - 1, -1, -1):
                    e = self.entries[(branch, positions[i])]
                    if e.tokens < o.cache.min_tokens or o.ctx_size < e.ctx_size:
                        continue
                    if pol.model_id_filter and e.model_id != self.model_id:
                        continue
                    if o.reject_different_quant and e.quant_bits != o.quant_bits:
                        continue
                    return e
            limit = min(limit, fork[branch])
            branch = parent[branch]
        return None

    def _load(self, e: Entry) -> tuple[int, str]:
        """A disk hit: load checks, then continued bookkeeping and touch or consume."""
        if e.tokens >= self.opt.ctx_size:  # "does not fit current context": kept, session invalidated
            self._row("load-failed", tokens=e.tokens, file=e)
            return 0, "none"
        self.last_store = e.tokens
        c = self.opt.cache
        if self.policy.consume_over_cold_max and c.cold_max_tokens > 0 and e.tokens > c.cold_max_tokens:
            self._remove(e)
            self._row("consume", tokens=e.tokens, file_bytes=e.file_size, hits=e.hits, file=e)
        else:
            e.hits = (e.hits + 1) & 0xFFFFFFFF
            e.last_used = int(self.now)
        self.live = Text(*e.sha, e.tokens)
        return e.tokens, "disk"

    def _store(self, text: Text, reason: int) -> bool:
        """ds4_kvstore_store_live_prefix_text on the directory model."""
        o, pol = self.opt, self.policy
        n = text.tokens
        if n < o.cache.min_tokens or o.quant_bits not in (2, 4):
            return False
        key = self.tree.key(text)
        payload = self._payload.get(n)
        if payload is None:
            payload = self._payload[n] = payload_bytes(o.config, n, o.ctx_size)
        fits, file_bytes, _ = file_size_fits(text.nbytes, payload, 0, self.budget)
        if not pol.check_existing_first and not fits:
            self._row("store-skipped", reason=reason, tokens=n, text_bytes=text.nbytes, file_bytes=file_bytes)
            return False
        old = self.entries.get(key)
        if old is not None:
            if (not pol.model_id_filter or old.model_id == self.model_id) and \
                    (not o.reject_different_quant or old.quant_bits == o.quant_bits) and old.ctx_size <= o.ctx_size:
                self._row("store-existing", reason=reason, tokens=n, text_bytes=text.nbytes,
                          file_bytes=old.file_size, hits=old.hits, file=old)
                return True
            self._remove(old)
            self._row("replace", reason=old.reason, tokens=old.tokens, file_bytes=old.file_size, file=old)
        if not fits:
            self._row("store-skipped", reason=reason, tokens=n, text_bytes=text.nbytes, file_bytes=file_bytes)
            return False
        now = int(self.now)
        if pol.pre_store_eviction:
            incoming = _TreeIncoming(self.tree, text, self.model_id, o.quant_bits, o.ctx_size,
                                     o.reject_different_quant)
            self._evict(file_bytes, incoming, None)
        e = Entry(key, n, 0, file_bytes, now, now, reason, self.model_id, o.quant_bits, o.ctx_size, text.nbytes)
        self.entries[key] = e
        bisect.insort(self.by_branch.setdefault(key[0], []), key[1])
        self.total += file_bytes
        self._row("store", reason=reason, tokens=n, text_bytes=text.nbytes, file_bytes=file_bytes, file=e)
        if not pol.pre_store_eviction:
            self._evict(0, None, key)
        return True

    def _evict(self, extra: int, incoming: Incoming | None, protected: Any) -> None:
        if self.budget == 0 or self.total <= self.budget - min(extra, self.budget):
            return
        now = int(self.now)
        for e, score in evict_order(list(self.entries.values()), self.budget, now, protected, extra, incoming,
                                    self.policy):
            parts = self.policy.parts(e, now, incoming)
            self._remove(e)
            self._row("evict", reason=e.reason, tokens=e.tokens, text_bytes=e.text_bytes, file_bytes=e.file_size,
                      score=score, effective_hits=parts.effective_hits, density=parts.density,
                      anchor_factor=parts.anchor, supersede_factor=parts.supersede, hits=e.hits, file=e)

    def _remove(self, e: Entry) -> None:
        del self.entries[e.sha]
        positions = self.by_branch[e.sha[0]]
        del positions[bisect.bisect_left(positions, e.sha[1])]
        self.total -= e.file_size

    # ---- events ------------------------------------------------------------------------
    def _row(self, event: str, *, source: str = "", reason: int = -1, tokens: int = 0, text_bytes: int = 0,
             file_bytes: int | None = 0, matched_tokens: int = 0, prefill_tokens: int = 0,
             score: float = float("nan"), effective_hits: float = float("nan"), density: float = float("nan"),
             anchor_factor: float = float("nan"), supersede_factor: float = float("nan"), hits: int = 0,
             file: Entry | None = None) -> None:
        self.rows.append((self.now, self._req, self._session, event, source, REASONS.get(reason, ""), tokens,
                          text_bytes, file_bytes or 0, matched_tokens, prefill_tokens, score, effective_hits,
                          density, anchor_factor, supersede_factor, hits, self.total, len(self.entries),
                          "" if file is None else f"{file.sha[0]}:{file.sha[1]}"))

    def events(self) -> pd.DataFrame:
        """One row per event; see `simulate` for the columns."""
        df = pd.DataFrame(self.rows, columns=EVENT_COLUMNS)
        ints = ["request", "tokens", "text_bytes", "file_bytes", "matched_tokens", "prefill_tokens", "hits",
                "dir_bytes", "n_files"]
        df[ints] = df[ints].astype("int64")
        df["event"] = pd.Categorical(df["event"], categories=EVENTS)
        df["source"] = pd.Categorical(df["source"].replace("", None), categories=SOURCES)
        df["reason"] = pd.Categorical(df["reason"].replace("", None),
                                      categories=["cold", "continued", "evict", "shutdown"])
        df.attrs.update(policy=self.policy.name, budget_bytes=self.budget)
        return df


def simulate(trace: str | Path | Iterable[dict[str, Any]], policy: str | Policy = DEFAULT_POLICY,
             budget_bytes: int = DEFAULT_BUDGET, options: SimOptions | dict[str, Any] | None = None) -> pd.DataFrame:
    """Replay `trace` under `policy` with a `budget_bytes` directory; one row per event.

    Columns: time (s, simulated clock), request (index), session, event (request, reject,
    load-failed, store, store-existing, store-skipped, replace, evict, consume), source of a
    request's reuse (memory, disk, none), reason of a stored/evicted file (cold, continued,
    evict, shutdown), tokens, text_bytes, file_bytes, matched_tokens (prefill saved),
    prefill_tokens (left to compute), for evictions the score and its factors (effective_hits,
    density = tokens/file byte, anchor_factor, supersede_factor) and hits, then the directory's
    bytes and file count after the event, and the file (canonical text id).
    """
    return CacheSimulator(policy, budget_bytes, options).run(trace)


def summary(events: pd.DataFrame) -> dict[str, float]:
    """Headline numbers of one run: hit rates, prefill saved, files written and evicted."""
    req = events[events["event"] == "request"]
    n = max(len(req), 1)
    total = max(int(req["tokens"].sum()), 1)
    disk = req["source"] == "disk"
    counts = events["event"].value_counts()
    return {"requests": len(req), "memory_hit_rate": float((req["source"] == "memory").mean()) if len(req) else 0.0,
            "disk_hit_rate": float(disk.sum() / n),
            "disk_saved_tokens": int(req.loc[disk, "matched_tokens"].sum()),
            "prefill_saved_share": float(req["matched_tokens"].sum() / total),
            "stores": int(counts.get("store", 0)), "evictions": int(counts.get("evict", 0)),
            "consumed": int(counts.get("consume", 0)),
            "peak_dir_bytes": int(events["dir_bytes"].max()) if len(events) else 0}
