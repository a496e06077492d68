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
# # Quantization: imatrix, recipes, and where the error goes
#
# ds4's 2-bit files work because of an asymmetric recipe (only the routed experts are low-bit:
# IQ2_XXS gate/up, Q2_K down) and an importance matrix collected per expert. This notebook
# collects an imatrix the way ds4 does, requantizes a model with and without it, and follows
# the error from the weights to the experts' outputs to the whole model's predictions.
#
# It runs on ds4lab's synthetic `tiny` model (random weights, the real layout), with the q4
# file (Q4_K experts) as the reference, as a q4 GGUF is for the real model. Numbers on random
# weights show the mechanics, not DeepSeek V4's real sensitivities.

# %%
import ds4lab  # first: on Linux it loads OpenBLAS before MLX starts

# isort: split
import tempfile
import time
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
from IPython.display import display
from tqdm.auto import tqdm

from ds4lab import gguf
from ds4lab.paths import synthetic_model
from ds4lab.quants import imatrix, requantize, studies

work = Path(tempfile.mkdtemp(prefix="ds4lab-quant-"))
reference_path = synthetic_model("tiny", "q4", seed=0)
reference_file = gguf.open(reference_path)
reference = ds4lab.load(reference_path)
cfg = reference.config
print(f"reference {reference_path.name}: variant {reference_file.variant}, {cfg.n_layer} layers, "
      f"{cfg.n_expert} experts of {cfg.n_ff_exp}x{cfg.n_embd}")

# %% [markdown]
# ## Collecting the imatrix
# For every routed expert, ds4 averages the squared FFN-normed input over the tokens routed to
# it (the importance of each gate/up column) and the squared route-weighted SwiGLU output (the
# importance of each down column). The hook points `ffn.hook_in`, `ffn.hook_experts` and
# `ffn.hook_routed_mid` carry exactly these. Experts no token chose get ds4's 1.0.

# %%
tokenizer = reference.tokenizer
texts = [
    "The old lighthouse keeper climbed the stairs every evening to light the lamp for the ships.",
    "def mean(values):\n    return sum(values) / len(values)\n\nprint(mean([1, 2, 3]))\n",
    "Translate to Italian: the weather is lovely today and we will walk to the harbour.",
    "Question: what is 17 times 23? Think step by step, then give the answer.",
]
calibration = [tokenizer.encode(t) for t in texts]
start = time.perf_counter()
collected = imatrix.collect(reference, calibration, dataset="notebook prompts")
print(f"collected over {sum(map(len, calibration))} tokens in {time.perf_counter() - start:.1f} s")
stats = collected.to_frame()
stats[stats["role"] == "down"].groupby("layer").agg(
    routes=("count", "sum"), never_routed=("count", lambda c: int((c == 0).sum())),
    mean_importance=("mean", "mean"), top1pct_share=("top1pct_share", "mean"))

# %%
routes = stats[stats["role"] == "gate"].pivot(index="layer", columns="expert", values="count")
fig, ax = plt.subplots(figsize=(8, 3))
image = ax.imshow(routes, aspect="auto", cmap="viridis")
fig.colorbar(image, ax=ax, label="routes (tokens)")
ax.set_xlabel("expert")
ax.set_ylabel("layer")
ax.set_title("Routes counted per expert (layers 0-2 hash-routed); 0 = never routed, importance 1.0")
fig.tight_layout()

# %% [markdown]
# Both file layouts hold the same statistics: ds4's legacy `.dat` keeps the means (and loses
# the counts), llama.cpp's GGUF keeps raw sums and counts.

# %%
dat = imatrix.load(collected.save(work / "tiny.dat"), n_expert=cfg.n_expert)
gguf_layout = imatrix.load(collected.save(work / "tiny.imatrix.gguf"))
name = "blk.4.ffn_down_exps.weight"
print(f".dat {(work / 'tiny.dat').stat().st_size} bytes, GGUF {(work / 'tiny.imatrix.gguf').stat().st_size} bytes")
print("means equal:", (dat.entries[name].means() == collected.entries[name].means()).all(),
      "| counts kept by GGUF:", (gguf_layout.entries[name].counts == collected.entries[name].counts).all())

# %% [markdown]
# ## Requantizing
# The q2 recipe on the reference's routed experts, plain and with the imatrix. Recipes are
# per tensor: here only the last four layers change (keeping the notebook quick); `"q2"`
# would take every layer, `"mixed:4-5"` is ds4's spliced file, a dict or function anything
# the engine accepts. The plan is checked against the layout before anything is written.

# %%
recipe = requantize.routed("IQ2_XXS", "Q2_K", layers={2, 3, 4, 5})
plan = requantize.plan(reference_file, recipe)
print(plan[plan["type"] != plan["target"]][["name", "type", "target", "bytes", "target_bytes"]].to_string(index=False))
variants = {}
for label, weights in (("q2 plain", None), ("q2 imatrix", collected)):
    start = time.perf_counter()
    with tqdm(total=len(plan), desc=label, unit="tensor") as bar:
        path = requantize.requantize(reference_path, work / f"{label.replace(' ', '-')}.gguf", recipe, weights,
                                     progress=lambda *_: bar.update())
    variants[label] = gguf.open(path)      # validated like ds4.c validates
    print(f"{label}: {path.stat().st_size / 2**20:.1f} MiB in {time.perf_counter() - start:.1f} s, "
          f"layers {variants[label].layer_variants()}")

# %% [markdown]
# ## Weight error per expert and layer
# `rel_rmse` is the plain relative error; `weighted_err` weighs each column by the imatrix,
# which is the output error to expect when columns are independent. The imatrix trades plain
# error for weighted error.

# %%
weights_err = studies.weight_error(reference_file, variants, collected, layers=[2, 3, 4, 5])
display(weights_err.groupby(["variant", "role"])[["rel_rmse", "weighted_err"]].mean().mul(100).round(2))
studies.plot_weight_error(weights_err)
plt.show()

# %% [markdown]
# ## Each expert's output on the activations that reached it
# The route-weighted expert output (down · w·swiglu(gate·x, up·x)) on held-out prompts,
# quantized against reference, for every expert some token chose.

# %%
held_out = [tokenizer.encode(t) for t in (
    "A short story about a robot who learns to paint the sea at night.",
    "for i in range(10):\n    if i % 3 == 0:\n        print(i)\n",
)]
inputs = studies.expert_inputs(reference, held_out)
outputs = studies.output_error(reference_file, variants, {layer: inputs[layer] for layer in (2, 3, 4, 5)})
outputs.groupby(["variant", "layer"])["rel_err"].mean().mul(100).unstack("variant").round(1)

# %% [markdown]
# ## The whole model against the reference
# Teacher-forced over the held-out prompts: NLL of each next token, KL(reference ‖ model) and
# whether the top-1 prediction agrees.

# %%
models = {label: ds4lab.load(f.path) for label, f in variants.items()}
quality = studies.model_quality(reference, models, held_out)
summary = studies.quality_summary(quality)
display(summary)
fig, axes = plt.subplots(1, 2, figsize=(9, 3))
summary.plot.bar(x="variant", y="kl", ax=axes[0], legend=False, rot=0)
axes[0].set_ylabel("mean KL(reference ‖ model) (nats/token)")
summary.plot.bar(x="variant", y="top1_agree", ax=axes[1], legend=False, rot=0)
axes[1].set_ylabel("top-1 agreement (fraction of tokens)")
for ax in axes:
    ax.set_xlabel("model")
fig.tight_layout()

# %% [markdown]
# ## MLX formats
# A Q4_K sub-block (32 weights, x = d·sc·q − dmin·m) is MLX's 4-bit group-32 affine format
# with scale d·sc and bias −dmin·m, so Q4_K experts repack without loss; the check below
# compares MLX's own dequantization with gguf-py's decoding bit for bit. IQ2_XXS and Q2_K
# have no MLX twin: moving them costs a re-quantization, measured per MLX format.

# %%
repack = studies.repack_check(reference_file, layers=[0, 5])
print(f"{len(repack)} Q4_K experts repacked, all bit-exact: {repack['exact'].all()}, "
      f"largest difference {repack['max_abs_diff'].max()}")
q2_file = variants["q2 imatrix"]
mlx_err = studies.mlx_requant_error(q2_file, layers=[4], experts=range(4))
display(pd.pivot_table(mlx_err, index="format", columns="source", values="rel_rmse").mul(100).round(1))
studies.plot_mlx_requant(mlx_err)
plt.show()
