"""Eviction policies as objects: ds4's own versions, and baselines to compare them with.

A policy answers three questions the directory model asks: which files count (indexing rules),
how much each file is worth keeping (`score`, lowest evicted first), and when eviction runs
(after a store with the new file protected at 8d57664; before a store, down to
budget - incoming size, at ba00a8a). The lookup and store rules that changed between
versions (model-id filtering, payload ABI byte, the single-use "consume" of long hits) are
flags here too, so one simulator drives every version.

Write your own by subclassing `Policy` and overriding `score`; register it with
`register_policy` to use it by name in `ds4lab cache simulate`.
"""

from __future__ import annotations

import hashlib
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ..kvc.header import REASON_CODES

# ds4_kvstore.c: DS4_KVSTORE_HIT_HALF_LIFE_SECONDS, KV_CACHE_MIN_EFFECTIVE_HITS and (ba00a8a)
# the anchor and continued-prefix factors.
HALF_LIFE_S = 21600
MIN_EFFECTIVE_HITS = 0.01
ANCHOR_FACTOR = 2.0
SUPERSEDE_MIN = 0.05
SUPERSEDE_HIT = 0.45
DBL_MAX = sys.float_info.max

REASON_COLD, REASON_CONTINUED, REASON_EVICT, REASON_SHUTDOWN = 1, 2, 3, 4
_ANCHORS = frozenset((REASON_COLD, REASON_EVICT, REASON_SHUTDOWN))


@dataclass(slots=True)
class Entry:
    """One indexed cache file, as ds4_kvstore_entry holds it (the fields the policy reads).

    `sha` is the file name without `.kv`, lowercased as ds4 compares hashes case-blind (the
    simulator uses any hashable key instead); `file` is the file's own name as the directory
    holds it (a 40-hex name may be upper- or mixed-case), "" when the entry is not a file.
    """

    sha: Any
    tokens: int
    hits: int
    file_size: int
    created_at: int
    last_used: int
    reason: int = 0
    model_id: int = 0
    quant_bits: int = 2
    ctx_size: int = 0
    text_bytes: int = 0
    file: str = ""

    @property
    def file_name(self) -> str:
        """The name to open or delete: the directory's own spelling when known."""
        return self.file or f"{self.sha}.kv"

    @classmethod
    def of(cls, entry: Mapping[str, Any] | Entry) -> Entry:
        """An Entry from any mapping with the named keys (reason as a code or a name)."""
        if isinstance(entry, Entry):
            return entry
        reason = entry.get("reason", 0)
        if isinstance(reason, str):
            reason = REASON_CODES.get(reason, 0)
        return cls(entry["sha"], int(entry["tokens"]), int(entry["hits"]), int(entry["file_size"]),
                   int(entry["created_at"]), int(entry["last_used"]), int(reason),
                   int(entry.get("model_id", 0)), int(entry.get("quant_bits", 2)), int(entry.get("ctx_size", 0)),
                   int(entry.get("text_bytes", 0)), str(entry.get("file", "")))


@dataclass
class Incoming:
    """The checkpoint about to be stored (ba00a8a's ds4_kvstore_eviction_context)."""

    text: bytes | None
    model_id: int = 0
    quant_bits: int = 2
    ctx_size: int = 0
    reject_different_quant: bool = False

    @classmethod
    def of(cls, incoming: Mapping[str, Any] | Incoming | None) -> Incoming | None:
        if incoming is None or isinstance(incoming, Incoming):
            return incoming
        text = incoming.get("text")
        if isinstance(text, str):
            text = text.encode("utf-8")
        return cls(text, int(incoming.get("model_id", 0)), int(incoming.get("quant_bits", 2)),
                   int(incoming.get("ctx_size", 0)), bool(incoming.get("reject_different_quant", False)))

    @property
    def text_len(self) -> int:
        return len(self.text) if self.text else 0

    def starts_with(self, entry: Entry) -> bool:
        """Whether the entry's text is the first `entry.text_bytes` bytes of ours (by its SHA-1 name)."""
        assert self.text is not None
        return hashlib.sha1(self.text[: entry.text_bytes]).hexdigest() == entry.sha


@dataclass(frozen=True)
class ScoreParts:
    """A score taken apart: score = (effective_hits + 1) * density * anchor * supersede."""

    density: float
    effective_hits: float
    anchor: float
    supersede: float
    score: float


def _demotion(effective_hits: float) -> float:
    """ba00a8a's factor on a superseded continued checkpoint: 0.05 + 0.45 h, h = hits/(hits+1)."""
    h = effective_hits / (effective_hits + 1.0) if effective_hits > 0.0 else 0.0
    return SUPERSEDE_MIN + SUPERSEDE_HIT * h


@dataclass(frozen=True)
class Policy:
    """ds4's eviction score and the version-specific rules around it.

    The defaults are ds4 at ba00a8a; `DS4_8D57664` and `DS4_24FA85EA` change the flags.
    """

    name: str = "ds4@ba00a8a"
    half_life_s: float = HALF_LIFE_S
    anchor_factor: float = ANCHOR_FACTOR
    supersede: bool = True
    protect_new: bool = False          # 8d57664: evict after the store, the new file scoring DBL_MAX
    pre_store_eviction: bool = True    # ba00a8a: evict before the store, down to budget - new file
    payload_abi: int | None = 2        # header byte 20 a file must carry to be indexed
    model_id_filter: bool = True       # lookup, reuse and supersede compare header byte 7
    consume_over_cold_max: bool = True  # a hit over cold_max tokens unlinks the file (gone in 24fa85ea)
    check_existing_first: bool = True  # ba00a8a looks for the same file before the budget check
    prefill_chunk: int = 4096          # default GPU prefill chunk (63ceed6a); continued saves land on its ends
    description: str = field(default="", compare=False)

    def with_(self, **changes: Any) -> Policy:
        return replace(self, **changes)

    # ---- the score -------------------------------------------------------------------
    def effective_hits(self, e: Entry, now: int) -> float:
        """Hits halved every `half_life_s` since last use; below 0.01 they count as none."""
        used_at = e.last_used or e.created_at
        if used_at == 0:
            return 0.0
        if now > used_at and e.hits:  # 0 hits stay 0.0 whatever the decay
            eff = e.hits * math.exp2(-float(now - used_at) / self.half_life_s)
            return eff if eff >= MIN_EFFECTIVE_HITS else 0.0
        return float(e.hits)

    def supersedes(self, e: Entry, incoming: Incoming | None) -> bool:
        """A continued checkpoint that is a strict rendered-byte prefix of the incoming store,
        no more widely loadable than it (kv_cache_incoming_supersedes_continued)."""
        if not self.supersede or incoming is None or not incoming.text_len:
            return False
        if e.reason != REASON_CONTINUED or e.text_bytes == 0 or e.text_bytes >= incoming.text_len:
            return False
        if e.model_id != incoming.model_id & 0xFF:
            return False
        if incoming.reject_different_quant and e.quant_bits != incoming.quant_bits & 0xFF:
            return False
        if incoming.ctx_size & 0xFFFFFFFF > e.ctx_size:
            return False
        return incoming.starts_with(e)

    def score(self, e: Entry, now: int, protected_sha: Any = None, incoming: Incoming | None = None) -> float:
        """ds4_kvstore_entry_eviction_score, operation for operation (doubles, C order)."""
        if e.file_size == 0:
            return 0.0
        if protected_sha is not None and self.protect_new and e.sha == protected_sha:
            return DBL_MAX
        eff = self.effective_hits(e, now)
        score = (eff + 1.0) * e.tokens / float(e.file_size)
        if e.reason in _ANCHORS:
            score *= self.anchor_factor
        if incoming is not None and self.supersedes(e, incoming):
            score *= _demotion(eff)
        return score

    def parts(self, e: Entry, now: int, incoming: Incoming | None = None) -> ScoreParts:
        """The factors of `score` for plots and the dry-run explanation."""
        eff = self.effective_hits(e, now)
        anchor = self.anchor_factor if e.reason in _ANCHORS else 1.0
        sup = _demotion(eff) if self.supersedes(e, incoming) else 1.0
        density = e.tokens / e.file_size if e.file_size else 0.0
        return ScoreParts(density, eff, anchor, sup, self.score(e, now, None, incoming))


DS4_BA00A8A = Policy(description="ds4 at ba00a8a (2026-05-30): anchor reasons x2, superseded continued "
                                 "checkpoints demoted, eviction before each store")
DS4_8D57664 = Policy(name="ds4@8d57664", anchor_factor=1.0, supersede=False, protect_new=True,
                     pre_store_eviction=False, payload_abi=None, model_id_filter=False,
                     check_existing_first=False, prefill_chunk=2048,
                     description="ds4 at 8d57664 (2026-05-21): density x decayed hits, new file protected, "
                                 "eviction after each store")
DS4_24FA85EA = DS4_BA00A8A.with_(name="ds4@24fa85ea", consume_over_cold_max=False,
                                 description="ds4 after 24fa85ea: ba00a8a without single-use long hits")


@dataclass(frozen=True)
class LRUPolicy(Policy):
    """Least recently used first: the score is the last use time (ba00a8a's store mechanics)."""

    name: str = "lru"
    description: str = field(default="least recently used file first", compare=False)

    def score(self, e: Entry, now: int, protected_sha: Any = None, incoming: Incoming | None = None) -> float:
        return float(e.last_used or e.created_at)

    def parts(self, e: Entry, now: int, incoming: Incoming | None = None) -> ScoreParts:
        return ScoreParts(0.0, 0.0, 1.0, 1.0, self.score(e, now))


@dataclass(frozen=True)
class SizePolicy(Policy):
    """Largest file first, then least recently used: frees the budget with the fewest deletions."""

    name: str = "size"
    description: str = field(default="largest file first", compare=False)

    def score(self, e: Entry, now: int, protected_sha: Any = None, incoming: Incoming | None = None) -> float:
        return -float(e.file_size)

    def parts(self, e: Entry, now: int, incoming: Incoming | None = None) -> ScoreParts:
        return ScoreParts(0.0, 0.0, 1.0, 1.0, self.score(e, now))


POLICIES: dict[str, Policy] = {p.name: p for p in (DS4_BA00A8A, DS4_8D57664, DS4_24FA85EA, LRUPolicy(),
                                                  SizePolicy())}
DEFAULT_POLICY = DS4_BA00A8A.name


def register_policy(policy: Policy) -> Policy:
    """Make `policy` available by its name (CLI, widget)."""
    POLICIES[policy.name] = policy
    return policy


def get_policy(policy: str | Policy) -> Policy:
    """A policy object from a name in `POLICIES` or the object itself."""
    if isinstance(policy, Policy):
        return policy
    try:
        return POLICIES[policy]
    except KeyError:
        raise ValueError(f"unknown cache policy {policy!r} (known: {', '.join(POLICIES)})") from None
