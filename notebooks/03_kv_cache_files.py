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
# # ds4's disk KV cache files
#
# ds4-server keeps prefilled prompts on disk as `<sha1>.kv` files: a 48-byte header, the
# rendered prompt text (the SHA-1 of which names the file), and the DSV4 session payload —
# tokens, next-token logits, and per layer the raw window, the compressed rows and the
# compressor frontiers. This notebook builds a cache directory with ds4lab's own sessions on
# the tiny synthetic model (the files have ds4's exact layout, so ds4.c would load them for
# a model of this shape), then reads it back as tables and arrays.
#
# Cache files contain prompts verbatim: ds4lab creates them 0600 in a 0700 directory.

# %%
import ds4lab  # first: on Linux it loads OpenBLAS before MLX starts

# isort: split
import os
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
from tqdm.auto import tqdm

from ds4lab import cache, chat, kvc
from ds4lab.kvc.diff import diff
from ds4lab.paths import synthetic_model

path = os.environ.get("DS4LAB_MODEL") or synthetic_model("tiny", "q2", seed=0)
model = ds4lab.load(path)
cache_dir = Path(tempfile.mkdtemp(prefix="ds4lab-kv-")) / "kvcache"

# %% [markdown]
# ## A conversation, checkpointed the way ds4-server does
# Three requests of one chat: after the first prompt (a *cold* save), after the second turn
# (*continued*), and at the end of the session (*shutdown*). A second conversation adds an
# *evict* checkpoint, as when another user's request takes the live session.

# %%
turns = ["Summarise the plot of Hamlet in two sentences.",
         "Now do the same for Macbeth, and compare the two endings.",
         "Which of the two is shorter on stage?"]
system = ("You are a careful literary assistant. Answer in plain prose, cite acts and scenes when you can, "
          "and keep every answer short. ") * 12
messages = [{"role": "system", "content": system}]
session = model.session()
written = []
for i, turn in enumerate(tqdm(turns, desc="turns", unit="turn")):
    messages.append({"role": "user", "content": turn})
    text = chat.render({"messages": messages})
    ids = model.tokenizer.encode(text).ids
    pairs = zip(session.tokens, ids, strict=False)
    shared = next((k for k, (a, b) in enumerate(pairs) if a != b), min(len(ids), len(session.tokens)))
    if shared < len(session.tokens):  # the new prompt rewrote history: start over, as ds4 would
        session, shared = model.session(), 0
    session.prefill(ids[shared:])
    written.append(session.save_kv(cache_dir, reason=["cold", "continued", "shutdown"][i], ctx_size=4096))
    replying = model.session(session.snapshot())  # greedy reply on a copy: the checkpoint stays the prompt
    reply = [int(np.argmax(np.array(replying.logits)))]
    for _ in range(5):
        reply.append(int(np.argmax(np.array(replying.decode(reply[-1])))))
    messages.append({"role": "assistant", "content": model.tokenizer.decode(reply)})

other = model.session()
other.prefill(model.tokenizer.encode(chat.render({"messages": [{"role": "user", "content": "Hi! " * 60}]})).ids)
written.append(other.save_kv(cache_dir, reason="evict", ctx_size=4096))
print(f"{cache_dir}: mode {oct(cache_dir.stat().st_mode & 0o777)}")
for p in written:
    print(p.name, oct(p.stat().st_mode & 0o777), p.stat().st_size, "bytes")

# %% [markdown]
# ## The directory as a table
# One row per file from headers and texts only (payloads are not read): versions, reason,
# tokens, hits, times, sizes, whether the name is the SHA-1 of the text, and the eviction
# score each file has now under ds4 8d57664 and ba00a8a (lowest is evicted first; ba00a8a
# doubles the score of anchor reasons: cold, evict, shutdown).

# %%
table = cache.scan(cache_dir)             # kvc.scan plus the eviction scores
table[["file", "ds4_version", "reason_name", "tokens", "ctx_size", "file_bytes", "created_at", "name_is_text_sha1",
       "score_ds4@8d57664", "score_ds4@ba00a8a"]]

# %% [markdown]
# ## One checkpoint, layer by layer
# The per-layer table: row counts and bytes, and the norms of the stored rows. Ratio-4
# layers carry the most: a compressed row per 4 tokens plus the indexer's rows.

# %%
last = kvc.read(written[2], model)
layers = last.layers
print(last.summary()["payload"])
layers

# %%
fig, ax = plt.subplots(figsize=(8, 3.5))
kinds = {"raw_kv": "raw window", "comp_kv": "compressed rows", "index_comp_kv": "indexer rows",
         "attn_state_kv": "frontiers", "attn_state_score": "frontiers", "index_state_kv": "frontiers",
         "index_state_score": "frontiers"}
bottom = np.zeros(len(layers))
for label in dict.fromkeys(kinds.values()):
    sizes = np.array([sum(a.nbytes for k, a in last.arrays(il).items() if kinds[k] == label)
                      for il in range(len(layers))]) / 1024
    ax.bar(layers["layer"], sizes, bottom=bottom, label=label)
    bottom += sizes
ax.set_xlabel("layer")
ax.set_ylabel("bytes in the file (KiB)")
ax.set_title(f"{last.path.name[:12]}…: {len(last.tokens)} tokens, payload {last.header.payload_bytes / 2**20:.2f} MiB")
ax.set_xticks(layers["layer"], [f"{i}\n(r{r})" for i, r in zip(layers["layer"], layers["ratio"], strict=True)])
ax.legend()
plt.show()

# %% [markdown]
# ## Compressed rows and frontiers
# Left: the compressed attention rows of the first ratio-4 layer (one per 4 tokens, oldest
# at the top). Middle and right: its compressor frontier — the kv and score rows of the
# window still being filled. Slots past the current position hold ds4's reset values
# (kv 0, score −1e30), shown blank.

# %%
layer = next(i for i, r in enumerate(model.config.compress_ratios) if r == 4)
arrays = last.arrays(layer)
score = arrays["attn_state_score"].copy()
score[score < -1e29] = np.nan
fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
for ax, data, title in ((axes[0], arrays["comp_kv"], "compressed rows"),
                        (axes[1], arrays["attn_state_kv"], "frontier kv"), (axes[2], score, "frontier score")):
    im = ax.imshow(data, aspect="auto", cmap="coolwarm", interpolation="nearest")
    ax.set_title(f"layer {layer}: {title}")
    ax.set_xlabel("dimension")
    ax.set_ylabel("row")
    fig.colorbar(im, ax=ax, label="value")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Two checkpoints of one conversation
# The continued checkpoint extends the cold one: every compressed row the cold file holds
# is in the later file unchanged, and the raw windows agree where their positions overlap.
# What differs is the new rows, the frontiers and the logits.

# %%
first, second = kvc.read(written[0], model), kvc.read(written[1], model)
changes = diff(first, second)
changes

# %%
rows = changes[changes["part"] == "layer"]
fig, ax = plt.subplots(figsize=(8, 3))
for name, group in rows.groupby("field"):
    ax.plot(group["layer"], group["max_abs_diff"], "o", label=name.removesuffix(" rows"))
ax.set_xlabel("layer")
ax.set_ylabel("max |a − b| over shared rows (float32 value)")
ax.set_yscale("symlog", linthresh=1e-6)
ax.set_title(f"{len(first.tokens)}-token vs {len(second.tokens)}-token checkpoint")
ax.legend(fontsize=7)
plt.show()

# %% [markdown]
# ## Restoring a checkpoint
# A new session loads the continued file and decodes on: the logits match those of a
# session that prefilled the same tokens itself.

# %%
resumed = model.session()
resumed.load_kv(written[1])
check = model.session()
check.prefill(second.tokens)
a, b = np.array(resumed.decode(1000)), np.array(check.decode(1000))
print("max |Δlogit| after restore:", float(np.abs(a - b).max()))
