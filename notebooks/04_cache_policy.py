# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # ds4's disk KV cache policy
#
# Stateless chat APIs resend the whole conversation every turn. ds4-server keeps prefill
# checkpoints on disk (`--kv-disk-dir`) and reloads the longest one whose rendered text is a
# byte prefix of the new prompt. Which checkpoints exist depends on its policy: cold saves at
# the chat anchor (system prompt + tools), continued saves every 10240 tokens, a save of the
# live session when another conversation takes over, and eviction by
# `(decayed hits + 1) x tokens / file bytes` under a byte budget. This notebook replays a
# coding-agent workload through that policy at two ds4 versions and two baselines. No model
# is needed: file sizes follow from the model's shape.

# %%
import ds4lab  # noqa: F401  (first: on Linux it loads OpenBLAS before MLX starts)

# isort: split
import matplotlib.pyplot as plt
import pandas as pd

from ds4lab.cache import explain_eviction, payload_bytes, store_len
from ds4lab.cache.plots import plot_evictions, plot_summary
from ds4lab.cache.simulate import simulate, summary
from ds4lab.cache.widget import cache_panel
from ds4lab.cache.workloads import coding_agent_trace

# %% [markdown]
# ## What one checkpoint costs
# A Flash checkpoint is ~23 MiB of fixed state (logits, raw window, compressor frontiers) plus
# ~13.4 KiB per token; the default 4096 MiB budget holds a handful of long ones.

# %%
sizes = pd.DataFrame({"tokens": [2048, 8192, 20480, 32768]})
sizes["cold save keeps"] = sizes["tokens"].map(store_len)
sizes["Flash payload (MiB)"] = sizes["tokens"].map(lambda t: payload_bytes("flash", t) / 2**20)
sizes["Pro payload (MiB)"] = sizes["tokens"].map(lambda t: payload_bytes("pro", t) / 2**20)
sizes.round(1)

# %% [markdown]
# ## A coding-agent workload
# Eight users, three sessions each, two agents with 18k- and 24k-token system prompts, tool
# output turns, occasional 20-40k-token generations, and session switching.

# %%
records = coding_agent_trace(3000, n_users=8, seed=0)
pd.DataFrame(records).describe().loc[["mean", "50%", "max"], ["prompt_tokens", "gen_tokens"]]

# %% [markdown]
# ## Four policies on the same trace, 4096 MiB budget

# %%
runs = {name: simulate(records, name, 4096 << 20) for name in ("ds4@ba00a8a", "ds4@8d57664", "lru", "size")}
pd.DataFrame({name: summary(ev) for name, ev in runs.items()}).T

# %% [markdown]
# ## Reuse, directory bytes and evictions over time (ds4 at ba00a8a)

# %%
fig = plot_summary(runs["ds4@ba00a8a"])
plt.show()

# %% [markdown]
# At 8d57664 there is no reason weighting and the new file is written before eviction, so the
# directory briefly exceeds the budget after each store; ba00a8a evicts first, down to
# budget minus the incoming file.

# %%
fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
for ax, name in zip(axes, ("ds4@8d57664", "ds4@ba00a8a"), strict=True):
    plot_evictions(runs[name], ax)
    ax.set_title(name)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Why a file goes: a dry run
# `explain_eviction` (and `ds4lab cache plan DIR`) takes a real cache directory or entries like
# these and lists the victims in ds4's order with the score's factors.

# %%
now = 100_000
entries = [
    {"sha": "a" * 40, "tokens": 24000, "hits": 6, "file_size": 354_000_000, "created_at": 10, "last_used": now - 3600,
     "reason": "cold", "ctx_size": 131072, "text_bytes": 96000},
    {"sha": "b" * 40, "tokens": 20480, "hits": 0, "file_size": 306_000_000, "created_at": now - 600,
     "last_used": now - 600, "reason": "continued", "ctx_size": 131072, "text_bytes": 81920},
    {"sha": "c" * 40, "tokens": 30000, "hits": 1, "file_size": 440_000_000, "created_at": 10, "last_used": 20,
     "reason": "evict", "ctx_size": 131072, "text_bytes": 120000},
]
explain_eviction(entries, 800_000_000, now, policy="ds4@ba00a8a")

# %% [markdown]
# ## Try it
# The panel re-runs the simulation when the budget, the hits' half-life, the boundary trim or
# the alignment change (a shorter trace keeps it responsive).

# %%
cache_panel(records[:800], budget_mb=2048)
