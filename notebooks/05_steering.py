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
# # Steering vectors
#
# ds4 steers with one direction `v` per layer: on a sublayer's output `y` (the attention
# output, the FFN output, or both, before the hyper-connections spread it into the four
# streams) it applies `y ← y − s·v·(v·y)`. `s = 1` removes the component along `v`, a negative
# `s` amplifies it to `(1 − s)·(v·y)`. ds4lab applies the same edit through its hook points,
# builds directions from two prompt sets the way ds4's `dir-steering/` does, reads and writes
# ds4's `.f32` files and llama.cpp control-vector GGUFs, and sweeps scales.
#
# This runs on the tiny synthetic model (random weights: the generations mean nothing, the
# mechanics are the point). Point `DS4LAB_MODEL` at a real `ds4flash.gguf` to run it for real;
# ds4's own verbosity direction is then applied as is.

# %%
import ds4lab  # first: on Linux it loads OpenBLAS before MLX starts

# isort: split
import os
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from ds4lab.notebooks import NOTEBOOK_DIR
from ds4lab.paths import synthetic_model
from ds4lab.steering import SteeringVector, build, collect_activations, plot_sweep, render_prompt, sweep

path = os.environ.get("DS4LAB_MODEL") or synthetic_model("tiny", "q2", seed=0)
model = ds4lab.load(path)
cfg = model.config
print(f"{cfg.shape_name}: {cfg.n_layer} layers x {cfg.n_embd}")

# %% [markdown]
# ## ds4's verbosity direction
# `dir-steering/out/verbosity.f32` is 43 × 4096 little-endian float32, one unit row per layer,
# with a JSON of how it was built. The directions of different layers are nearly orthogonal.

# %%
verbosity = SteeringVector.load(NOTEBOOK_DIR.parent / "data" / "steering" / "verbosity.f32")
print({k: verbosity.metadata[k] for k in ("component", "orthogonalize_control_mean", "pair_normalize")})
cos = verbosity.directions @ verbosity.directions.T
fig, ax = plt.subplots(figsize=(4.6, 3.8))
image = ax.imshow(cos, cmap="RdBu_r", vmin=-1, vmax=1)
ax.set_xlabel("layer")
ax.set_ylabel("layer")
ax.set_title("cosine between the verbosity directions of two layers")
fig.colorbar(image, ax=ax, label="cosine")
pd.Series({"row norm min": np.linalg.norm(verbosity.directions, axis=1).min(),
           "row norm max": np.linalg.norm(verbosity.directions, axis=1).max(),
           "largest |cos| between layers": np.abs(cos - np.eye(len(cos))).max()})

# %% [markdown]
# ## Building a direction
# Two prompt sets, one prompt per line in ds4's files (`ds4lab steer build MODEL --target A.txt
# --control B.txt --out V.f32` does the same from the shell). Each prompt is rendered as a
# one-turn chat; the FFN output at the last prompt token is read at every layer; the direction
# is the normalised difference of the means, made orthogonal to the control mean (which is why
# the control prompts' mean projection below is zero).

# %%
terse = ["Answer in one word: capital of France?", "Briefly: what is DNS?", "One line: why do leaves fall?",
         "Short answer: boiling point of water?", "In a few words, what is a CPU?", "Tersely: what is rust?"]
verbose = ["Explain in depth, with history and examples, the capital of France.",
           "Write a detailed, multi-section essay on how DNS works.",
           "Describe at great length every reason leaves fall in autumn.",
           "Give a thorough, step-by-step account of why water boils when it does.",
           "Explain in exhaustive detail what a CPU is and how it evolved.",
           "Write a long, careful explanation of how and why iron rusts."]
vector = build(model, terse, verbose)
target, control = collect_activations(model, terse), collect_activations(model, verbose)
separation = pd.DataFrame({
    "terse": np.einsum("pld,ld->pl", target, vector.directions).mean(axis=0),
    "verbose": np.einsum("pld,ld->pl", control, vector.directions).mean(axis=0),
}).rename_axis("layer")
ax = separation.plot(marker="o", figsize=(6, 3.2), title="where each prompt set lies along the direction")
ax.set_xlabel("layer")
ax.set_ylabel("mean projection v·y at the last token")
separation

# %% [markdown]
# ## Applying it
# `with model.steering(vector, attn=0.0, ffn=1.0, mode="project", layers=None):` edits
# everything run inside: `model(...)`, sessions, generation, `run_with_cache`. Hooks
# registered before it see the output before the edit, hooks registered after it (like the
# cache below) the output after it: at scale `s` the component becomes `(1 − s)` times what it was.

# %%
steered = vector if verbosity.directions.shape != (cfg.n_layer, cfg.n_embd) else verbosity
prompt_ids = model.tokenizer.encode(render_prompt("What does DNS do?", system="")).ids
layer = cfg.n_layer // 2
name = f"blocks.{layer}.ffn.hook_out"
_, plain = model.run_with_cache(prompt_ids, name)
before = plain[name] @ steered.directions[layer]
rows = []
for scale in (-1.0, 0.0, 0.5, 1.0, 2.0):
    with model.steering(steered, ffn=scale, layers=[layer]):
        _, cache = model.run_with_cache(prompt_ids, name)
    after = cache[name] @ steered.directions[layer]
    rows.append({"scale": scale, "ratio after/before": float(np.median(after / before)), "expected (1 - s)": 1 - scale})
pd.DataFrame(rows)

# %% [markdown]
# ## Sweeping scales
# Prompts × scales × layer sets, greedy: the text, its length, the log-probs of the chosen
# tokens and, per layer, the mean projection on the direction before the edit.

# %%
frame = sweep(model, steered, ["What does DNS do?", "Explain why databases use indexes."],
              scales=[-1.0, 0.0, 1.0, 2.0], max_tokens=8, progress=True)
fig = plot_sweep(frame, measure="mean_logprob")
fig.axes[0].set_ylabel("mean log-prob of the chosen tokens (nats)")
frame[["prompt", "scale", "n_tokens", "mean_logprob", "text"]]

# %% [markdown]
# ## Files
# `save(path, format="ds4")` writes the `.f32` and its JSON; `format="gguf"` a llama.cpp
# control vector (`direction.<layer>` tensors). `SteeringVector.load` tells them apart.

# %%
with tempfile.TemporaryDirectory() as folder:
    for fmt, file_name in (("ds4", "v.f32"), ("gguf", "v.gguf")):
        written = vector.save(Path(folder) / file_name, format=fmt)
        again = SteeringVector.load(written)
        print(f"{fmt}: {written.stat().st_size} bytes, round trip exact: "
              f"{np.array_equal(again.directions, vector.directions)}")
