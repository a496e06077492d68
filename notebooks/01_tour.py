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
