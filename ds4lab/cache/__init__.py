"""ds4's disk KV cache policy as a simulator (see README "Cache policy").

- `rules`: the policy's rules as plain functions (store length, continued frontiers, chat
  anchor, budget fit, eviction score and order, longest-prefix lookup), exact to ds4's C;
- `policies`: pluggable eviction policies ("ds4@ba00a8a" default, "ds4@8d57664",
  "ds4@24fa85ea", "lru", "size") and the `Policy` base class for your own;
- `simulate`: replay a trace of requests through ds4-server's cache decisions;
- `workloads`: trace generators, JSONL traces and a reader of ds4-server `--trace` logs;
- `plots`, `widget`: figures and an interactive panel.
"""

from .policies import (
    DEFAULT_POLICY,
    POLICIES,
    Entry,
    Incoming,
    LRUPolicy,
    Policy,
    ScoreParts,
    SizePolicy,
    get_policy,
    register_policy,
)
from .rules import (
    CacheOptions,
    chat_anchor,
    continued_step,
    continued_target,
    evict_order,
    eviction_score,
    explain_eviction,
    file_size_fits,
    find_prefix,
    index_directory,
    index_entry,
    payload_bytes,
    plan_eviction,
    scan,
    store_len,
)

__all__ = [
    "DEFAULT_POLICY",
    "POLICIES",
    "CacheOptions",
    "Entry",
    "Incoming",
    "LRUPolicy",
    "Policy",
    "ScoreParts",
    "SizePolicy",
    "chat_anchor",
    "continued_step",
    "continued_target",
    "evict_order",
    "eviction_score",
    "explain_eviction",
    "file_size_fits",
    "find_prefix",
    "get_policy",
    "index_directory",
    "index_entry",
    "payload_bytes",
    "plan_eviction",
    "register_policy",
    "scan",
    "store_len",
]
