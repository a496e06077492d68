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
# # ds4lab tour
#
# ds4lab reads ds4's GGUF files the way ds4.c does: the header is parsed, the tensor data is
# memory-mapped and only touched when asked for. This tour runs on a synthetic model that
# ds4lab writes itself: the real DeepSeek V4 tensor layout and tokenizer, random weights.
# Point `DS4LAB_MODEL` at a real `ds4flash.gguf` to run it on the real thing.

# %%
import ds4lab  # first: on Linux it loads OpenBLAS before MLX starts

# isort: split
import os

import matplotlib.pyplot as plt
import mlx.core as mx
import numpy as np
import pandas as pd

from ds4lab import ModelConfig, gguf
from ds4lab.layout import planned_bytes
from ds4lab.paths import synthetic_model
from ds4lab.quants import gather_experts

path = os.environ.get("DS4LAB_MODEL") or synthetic_model("tiny", "q2", seed=0)
model_file = gguf.open(path)
cfg = model_file.config
print(f"{path}: kind {model_file.kind}, variant {model_file.variant}, shape {cfg.shape_name}")
pd.Series(cfg.to_json())

# %% [markdown]
# ## The tensor inventory
# One row per tensor: its component, GGUF type and dims (innermost first), bytes and offset.

# %%
tensors = model_file.tensor_table()
tensors[tensors["layer"].isna() | (tensors["layer"] == 2)]

# %% [markdown]
# ## Where the bytes go
# The same layout rules give the size of the published files without opening them:
# routed experts are almost all of the real q2 (IQ2_XXS/Q2_K) and q4 (Q4_K) files.

# %%
flash = ModelConfig.flash()
sizes = pd.DataFrame({
    "this file": model_file.component_bytes().set_index("component")["bytes"],
    "Flash q2": pd.Series(planned_bytes(flash, "q2")),
    "Flash q4": pd.Series(planned_bytes(flash, "q4")),
}).fillna(0) / 2**30
fig, axes = plt.subplots(1, 2, figsize=(11, 3.5))
sizes[["this file"]].plot.barh(ax=axes[0], legend=False, title="synthetic file")
sizes[["Flash q2", "Flash q4"]].plot.barh(ax=axes[1], title="published Flash files", logx=True)
for ax in axes:
    ax.set_xlabel("size (GiB)")
    ax.set_ylabel("component")
fig.tight_layout()
sizes.sum().rename("total GiB")

# %% [markdown]
# ## Routed experts stay in block form
# A token uses `n_expert_used` of the `n_expert` experts. `gather_experts` decodes only those
# straight from the raw block bytes (here in MLX); numpy's decoder of the whole tensor agrees.

# %%
layer = cfg.n_hash_layer
name = f"blk.{layer}.ffn_gate_exps.weight"
info = model_file.tensor(name)
raw = model_file.raw(name).reshape(cfg.n_expert, -1)
chosen = mx.array([[1, 5, 2]])
gathered = np.array(gather_experts(mx.array(raw), chosen, info.type_name, cfg.n_ff_exp, cfg.n_embd))
full = model_file.dequantize(name)
print(info.type_name, "gathered", gathered.shape, "equal to numpy:", np.array_equal(gathered[0], full[[1, 5, 2]]))

# %%
fig, ax = plt.subplots(figsize=(7, 3.5))
for role in ("ffn_gate_exps", "ffn_down_exps", "attn_q_a", "ffn_gate_inp"):
    tensor_name = f"blk.{layer}.{role}.weight"
    values = model_file.dequantize(tensor_name).ravel()
    ax.hist(values, bins=120, histtype="step", density=True,
            label=f"{role} ({model_file.tensor(tensor_name).type_name})")
ax.set_xlabel("weight value")
ax.set_ylabel("density (1/unit)")
ax.set_yscale("log")
ax.set_title(f"layer {layer} weights by block format")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# ## The model
# `ds4lab.load` builds DeepSeek V4 in MLX from the file: routed experts stay in their block
# format and only the experts a token selects are decoded. `numerics="ds4-cpu"` also rounds
# activations the way ds4's CPU path does, for tight comparisons with ds4.c.

# %%
model = ds4lab.load(path, numerics="float")
tokenizer = model.tokenizer
prompt = "<｜begin▁of▁sentence｜><｜User｜>Tell me about the sea.<｜Assistant｜></think>"
tokens = tokenizer.encode(prompt, add_special_tokens=False).ids
session = model.session()
logits = session.prefill(tokens)
generated = []
for _ in range(8):
    generated.append(int(mx.argmax(logits).item()))
    logits = session.decode(generated[-1])
print(len(tokens), "prompt tokens; greedy continuation (random weights, so no sense):")
print(repr(tokenizer.decode(generated)))

# %% [markdown]
# ## Logits of every position
# `model(tokens)` returns `[T, n_vocab]`; the top candidates of the last position:

# %%
all_logits = np.array(model(tokens))
last = all_logits[-1]
top = np.argsort(-last)[:10]
pd.DataFrame({"token_id": top, "text": [tokenizer.decode([int(t)]) for t in top], "logit": last[top],
              "log_prob": last[top] - np.log(np.exp(last - last.max()).sum()) - last.max()})

# %% [markdown]
# ## Routing
# The first `n_hash_layer` layers pick experts by token id; later ones by the router's
# biased top-k. Which experts each position used, layer by layer:

# %%
result = model.session().prefill_all(tokens)                            # every position's logits and experts
experts = np.stack([np.array(e) for e in result.experts], axis=1)       # [T, n_layer, n_expert_used]
counts = np.zeros((cfg.n_layer, cfg.n_expert), int)
for layer in range(cfg.n_layer):
    np.add.at(counts[layer], experts[:, layer].ravel(), 1)
fig, ax = plt.subplots(figsize=(8, 3))
image = ax.imshow(counts, aspect="auto", cmap="viridis")
ax.set_xlabel("expert id")
ax.set_ylabel("layer")
ax.set_title(f"routed expert use over {len(tokens)} prompt positions")
fig.colorbar(image, ax=ax, label="positions routed (count)")
plt.show()

# %% [markdown]
# ## The session state
# Exactly what ds4 keeps per layer: the raw sliding window, the compressed rows, the
# compressor frontier, and on ratio-4 layers the indexer's keys and frontier.

# %%
state = session.snapshot()
pd.DataFrame([{
    "layer": i,
    "compress_ratio": cfg.compress_ratios[i],
    "raw_rows": cache.raw.shape[0],
    "compressed_rows": 0 if cache.comp is None else cache.comp.shape[0],
    "indexer_rows": 0 if cache.index_comp is None else cache.index_comp.shape[0],
    "frontier_shape": None if cache.frontier is None else tuple(cache.frontier.kv.shape),
} for i, cache in enumerate(state.layers)])
