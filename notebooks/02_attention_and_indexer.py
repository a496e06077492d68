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
# # Attention, compressed rows and the indexer
#
# DeepSeek V4 attends to a raw window of recent rows plus compressed rows: every 4 tokens
# (ratio-4 layers, chosen by the lightning indexer once more are visible than its top-k) or
# every 128 tokens (ratio-128 layers, all visible rows). The hook points show which rows
# each token actually used and how much weight attention then gave them.

# %%
import ds4lab  # first: on Linux it loads OpenBLAS before MLX starts

# isort: split
import os

import ipywidgets as widgets
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from ds4lab.paths import synthetic_model

path = os.environ.get("DS4LAB_MODEL") or synthetic_model("tiny", "q2", seed=0)
model = ds4lab.load(path)
cfg = model.config
rng = np.random.default_rng(0)
tokens = [int(t) for t in rng.integers(1000, 60000, size=320)]
ratio4 = [i for i, r in enumerate(cfg.compress_ratios) if r == 4]
ratio128 = [i for i, r in enumerate(cfg.compress_ratios) if r == 128]
wanted = lambda name: name.endswith(("attn.hook_pattern", "attn.hook_key_span", "indexer.hook_selected",  # noqa: E731
                                     "indexer.hook_scores", "ffn.hook_experts"))
print(f"{len(tokens)} tokens; cache estimate {model.cache_estimate(wanted, len(tokens)) / 2**20:.1f} MiB")
logits, cache = model.run_with_cache(tokens, wanted)

# %% [markdown]
# ## Weight on compressed rows, per token
# For a ratio-4 layer: the attention mass (summed over heads, averaged) each token puts on
# each compressed row, with the rows the indexer did not select left blank.

# %%
layer = ratio4[0]
pattern = cache[f"blocks.{layer}.attn.hook_pattern"]          # [T, H, 1 + L]
span = cache[f"blocks.{layer}.attn.hook_key_span"]            # [T, L, 4]: first, last, kind, row
n_rows = cache[f"blocks.{layer}.attn.indexer.hook_selected"].shape[1]
mass = np.full((len(tokens), n_rows), np.nan)
for t in range(len(tokens)):
    compressed = (span[t, :, 0] >= 0) & (span[t, :, 0] != span[t, :, 1])
    rows = (span[t, compressed, 1] + 1) // 4 - 1
    mass[t, rows] = pattern[t, :, 1:][:, compressed].mean(axis=0)
fig, ax = plt.subplots(figsize=(8, 4))
image = ax.imshow(mass.T, aspect="auto", origin="lower", cmap="magma", interpolation="nearest")
ax.set_xlabel("query token position")
ax.set_ylabel("compressed row (tokens 4r..4r+3)")
ax.set_title(f"layer {layer}: attention weight on selected compressed rows (top-{cfg.indexer_top_k})")
fig.colorbar(image, ax=ax, label="mean weight over heads (fraction)")
plt.show()

# %% [markdown]
# ## Does attention weigh what the indexer ranks first?
# Per token: the indexer score of each selected row against the weight attention gave it.

# %%
scores = cache[f"blocks.{layer}.attn.indexer.hook_scores"]
rows_frame = []
for t in range(len(tokens)):
    for row in np.flatnonzero(~np.isnan(mass[t])):
        rows_frame.append({"position": t, "row": int(row), "indexer_score": float(scores[t, row]),
                           "attention_weight": float(mass[t, row])})
rows_frame = pd.DataFrame(rows_frame)
fig, ax = plt.subplots(figsize=(6, 4))
ax.scatter(rows_frame["indexer_score"], rows_frame["attention_weight"], s=4, alpha=0.4)
ax.set_xlabel("indexer score (a.u.)")
ax.set_ylabel("attention weight (fraction, mean over heads)")
ax.set_title(f"layer {layer}: indexer score vs attention weight")
rows_frame[["indexer_score", "attention_weight"]].corr(method="spearman")

# %% [markdown]
# ## Sink, window and compressed rows: where the weight goes, by layer

# %%
shares = []
for layer_index in range(cfg.n_layer):
    w = cache[f"blocks.{layer_index}.attn.hook_pattern"]
    s = cache[f"blocks.{layer_index}.attn.hook_key_span"]
    raw = (s[..., 0] >= 0) & (s[..., 0] == s[..., 1])
    comp = (s[..., 0] >= 0) & (s[..., 0] != s[..., 1])
    shares.append({"layer": layer_index, "ratio": cfg.compress_ratios[layer_index],
                   "sink": w[:, :, 0].mean(),
                   "raw window": (w[:, :, 1:] * raw[:, None, :]).sum(-1).mean(),
                   "compressed": (w[:, :, 1:] * comp[:, None, :]).sum(-1).mean()})
shares = pd.DataFrame(shares)
ax = shares.set_index("layer")[["sink", "raw window", "compressed"]].plot.bar(stacked=True, figsize=(7, 3.5))
ax.set_ylabel("share of attention weight (fraction)")
ax.set_xlabel("layer")
shares

# %% [markdown]
# ## Router usage per layer

# %%
usage = np.zeros((cfg.n_layer, cfg.n_expert))
for layer_index in range(cfg.n_layer):
    np.add.at(usage[layer_index], cache[f"blocks.{layer_index}.ffn.hook_experts"].ravel(), 1)
fig, ax = plt.subplots(figsize=(8, 3))
image = ax.imshow(usage / len(tokens), aspect="auto", cmap="viridis")
ax.set_xlabel("expert id")
ax.set_ylabel("layer")
ax.set_title("router usage")
fig.colorbar(image, ax=ax, label="fraction of tokens routed")
plt.show()

# %% [markdown]
# ## Explorer: one layer, head and token
# The weight on every key the token used, placed at the positions the key covers.


# %%
def show(layer: int, head: int, position: int) -> None:
    w = cache[f"blocks.{layer}.attn.hook_pattern"][position, head]
    s = cache[f"blocks.{layer}.attn.hook_key_span"][position]
    used = s[:, 0] >= 0
    _, ax = plt.subplots(figsize=(8, 2.8))
    for (first, last, kind, _), weight in zip(s[used], w[1:][used], strict=True):   # kind 0 window, 1 compressed
        ax.barh(kind, last - first + 1, left=first, height=0.8, alpha=min(1.0, 0.15 + weight * 5),
                color="tab:orange" if kind else "tab:blue")
    ax.set_yticks([0, 1], ["raw rows", "compressed rows"])
    ax.set_xlabel("token position covered")
    ax.set_title(f"layer {layer}, head {head}, token {position}: sink share {w[0]:.3f} "
                 "(bar opacity: weight)")
    plt.show()


widgets.interactive(show, layer=widgets.IntSlider(ratio4[0], 0, cfg.n_layer - 1),
                    head=widgets.IntSlider(0, 0, cfg.n_head - 1),
                    position=widgets.IntSlider(len(tokens) - 1, 0, len(tokens) - 1))
