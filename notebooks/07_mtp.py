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
# # MTP: the draft head, speculative decoding, acceptance
#
# ds4's MTP GGUF holds one extra block (`mtp.0.*`) that drafts the token after next from the
# target's final HC streams. ds4lab runs it with hooks, decodes speculatively without loss
# (greedy tokens and the session state are plain decoding's), and measures acceptance online
# (`spec_trace`) and offline (`teacher_forced`). This runs on a 4-layer tiny synthetic model
# with 128 vocabulary rows; its random MTP head never agrees with the target, so we first fit
# one (`mtp.fit`). A random target has no token-level structure for DeepSeek's (v3) pairing to
# use, so a second synthetic model with language-like structure (`successor=`) shows what a v3
# head learns. Point `DS4LAB_MODEL` / `DS4LAB_MTP` at ds4flash.gguf and its MTP file to run the
# other studies for real.

# %%
import ds4lab  # first: on Linux it loads OpenBLAS before MLX starts

# isort: split
import itertools
import os

import matplotlib.pyplot as plt
import mlx.core as mx
import numpy as np
import pandas as pd

from ds4lab import gguf, mtp
from ds4lab.mtp import DS4_MARGIN, SpecConfig
from ds4lab.paths import synthetic_model
from ds4lab.quants import dequantize, quantize
from ds4lab.synth import mtp_path, successor_drafter, successor_map

mx.set_default_device(mx.cpu)
path = os.environ.get("DS4LAB_MODEL") or synthetic_model("tiny", "q2", seed=5, mtp=True, n_layer=4, vocab_rows=128)
head_path = os.environ.get("DS4LAB_MTP") or mtp_path(path)
model = ds4lab.load(path, mtp=head_path)
rows = np.flatnonzero(np.abs(gguf.open(path).dequantize("token_embd.weight")).sum(axis=1))
rng = np.random.default_rng(2)
train = [[int(t) for t in rng.choice(rows, 256)] for _ in range(4)]
held = [int(t) for t in rng.choice(rows, 64)]
print(f"{model.config.n_layer} layers, MTP head from {head_path}")

# %% [markdown]
# ## Fitting a head, and what a pairing mismatch costs
# `fit` adjusts e_proj / h_proj (the head's block as loaded); the curve is the head's real teacher-forced acceptance on
# held-out tokens. A random target's token two steps ahead (v3 pairing) is nearly
# unpredictable; ds4's pairing guesses the token the target is about to emit, which its own
# HC state already decides. The target runs over the training text once (`target_passes`);
# both fits learn from that. `bench/mtp_v3_ceiling.py` measures how far any head gets under
# v3 on this model (the README's MTP section has its figures: the best linear map, which `fit`
# reaches, and a float one-block transformer trained on tens of thousands of rows stay far
# below 50%).

# %%
passes = mtp.target_passes(model, train)
fits = {p: mtp.fit(model, passes, steps=240, pairing=p, held_out=held, eval_every=80) for p in ("ds4", "v3")}
fig, ax = plt.subplots(figsize=(5, 3.2))
for p, f in fits.items():
    c = f.curve.dropna()
    ax.plot(c["step"], 100 * c["acceptance"], marker="o", label=f"fitted under {p}")
ax.set_xlabel("Adam step")
ax.set_ylabel("teacher-forced acceptance (%)")
ax.legend()
plt.show()
cross = pd.DataFrame(index=["ds4", "v3"], columns=list(fits), dtype=float)
for fitted, f in fits.items():
    model.mtp = f.head
    for p in ("ds4", "v3"):
        cross.loc[p, fitted] = mtp.teacher_forced(model, held, pairing=p)["accepted"].mean()
cross.index.name, cross.columns.name = "evaluated under", "fitted under"
cross

# %% [markdown]
# ## A target with language-like structure: what a v3 head learns
# A language model's next token depends strongly on the current one (bigram-like statistics);
# that is what a v3 head, reading h_i and the embedding of t_{i+1}, can use to guess the token
# after t_{i+1}. `make_model(..., successor=S)` writes a model with such structure (synthetic
# whatever `DS4LAB_MODEL` says): the random model's weights, except that for a fixed random
# successor map the output row of succ(v) leans towards v's embedding, which every HC stream
# carries to the final normed vector. Here 2 layers and strength 0.5. Its greedy continuations
# are decoded speculatively with the map itself as the drafter (lossless: the tokens are plain
# greedy decoding's, with fewer target passes); heads are fitted under each pairing on six of
# them and evaluated on a seventh. With ~600 rows for 2 × 256 inputs per output, plain least
# squares interpolates its rows, so the fits are ridge-penalised (`l2=0.3`).

# %%
s_path = synthetic_model("tiny", "q2", seed=5, mtp=True, n_layer=2, vocab_rows=128, successor=0.5)
s_model = ds4lab.load(s_path, mtp=mtp_path(s_path))
s_rows = np.flatnonzero(np.abs(gguf.open(s_path).dequantize("token_embd.weight")).sum(axis=1))
succ = successor_map(s_model.config.n_vocab, s_rows, seed=5)


s_rng = np.random.default_rng(3)
texts, per_pass = [], []
for _ in range(7):
    prompt = [int(t) for t in s_rng.choice(s_rows, 8)]
    g = ds4lab.generate(s_model, prompt, 96, spec=SpecConfig(draft_len=8, drafter=successor_drafter(succ)))
    texts.append(prompt + g.tokens)
    per_pass.append(g.spec_summary["tokens_per_target_forward"])
s_train, s_held = texts[:-1], texts[-1]
follows = np.mean([succ[a] == b for t in texts for a, b in itertools.pairwise(t[7:])])
print(f"{len(texts)} greedy continuations of 96 tokens: the target's choice is the map's at {follows:.0%} of "
      f"steps; {np.mean([len(set(t[8:])) for t in texts]):.0f} distinct tokens in each on average; "
      f"{np.mean(per_pass):.1f} tokens per target forward with the map as drafter")

# %%
s_passes = mtp.target_passes(s_model, s_train)
s_fits = {p: mtp.fit(s_model, s_passes, steps=150, pairing=p, l2=0.3, held_out=s_held, eval_every=50)
          for p in ("v3", "ds4")}
by_rows = {sum(len(r.ids) for r in s_passes[:n]): mtp.fit(s_model, s_passes[:n], steps=150, pairing="v3", l2=0.3,
                                                          held_out=s_held, eval_every=150).curve["acceptance"].iloc[-1]
           for n in (1, 2, 4)}
by_rows[sum(len(r.ids) for r in s_passes)] = s_fits["v3"].curve["acceptance"].iloc[-1]
s_loaded = s_model.mtp
s_model.mtp = s_fits["v3"].head
tf_v3 = mtp.teacher_forced(s_model, s_held, pairing="v3")
drafts, targets = tf_v3["draft"].to_numpy(), tf_v3["target"].to_numpy()
chance = np.mean([(drafts == np.random.default_rng(i).permutation(targets)).mean() for i in range(50)])
ceiling = (succ[tf_v3["token"].to_numpy()] == targets).mean()     # a head that drafts the map's choice

fig, (ax, bx) = plt.subplots(1, 2, figsize=(9.5, 3.4))
for p, f in s_fits.items():
    c = f.curve.dropna()
    ax.plot(c["step"], 100 * c["acceptance"], marker="o", ms=3, label=f"structured, fitted under {p}")
c = fits["v3"].curve.dropna()
ax.plot(c["step"], 100 * c["acceptance"], ls="--", color="grey", label="random 4-layer model (above), v3")
ax.axhline(100 * chance, color="black", lw=0.8, ls=":", label="chance (targets shuffled)")
ax.set_xlabel("Adam step (count)")
ax.set_ylabel("held-out acceptance, each pairing (%)")
ax.legend(fontsize=7)
bx.plot(list(by_rows), [100 * v for v in by_rows.values()], marker="o", label="fitted under v3")
bx.axhline(100 * ceiling, color="grey", ls="--", label="the map's own choice (token lookup)")
bx.set_xlabel("training rows (tokens of greedy text)")
bx.set_ylabel("held-out v3 acceptance (%)")
bx.set_ylim(0, 100)
bx.legend(fontsize=7)
plt.tight_layout()
plt.show()

# %% [markdown]
# The cost of a pairing mismatch on this model: each head evaluated under both pairings (the
# unfitted, random head for scale). The v3 head drafts the map's successor of the token it
# reads; under ds4's pairing that token is t_i and its successor is again the target's likely
# choice, so it keeps most of its acceptance. The ds4 head reads the target's choice off the
# state h_i; under v3 that choice is the token it is also given, t_{i+1}, which it then often
# repeats (the printout counts how often): nearly nothing is accepted. The controls: the v3
# head's drafts against the target one position later (a misaligned pairing) and against
# shuffled targets stay at chance.

# %%
s_cross = pd.DataFrame(index=["v3", "ds4"], columns=["unfitted", "v3", "ds4"], dtype=float)
for p, f in s_fits.items():                 # a fit's own pairing: the curve's last point
    s_cross.loc[p, p] = f.curve["acceptance"].iloc[-1]
for name, head in [("unfitted", s_loaded), ("v3", s_fits["v3"].head), ("ds4", s_fits["ds4"].head)]:
    s_model.mtp = head
    for p in ("v3", "ds4"):
        if np.isnan(s_cross.loc[p, name]):
            rows = mtp.teacher_forced(s_model, s_held, pairing=p)
            s_cross.loc[p, name] = rows["accepted"].mean()
    if name == "ds4":
        repeats = (rows["draft"] == rows["token"]).mean()     # its rows under v3
s_model.mtp = s_loaded
s_cross.index.name, s_cross.columns.name = "evaluated under", "fitted under"
print(f"v3 head: shifted targets {(drafts[:-1] == targets[1:]).mean():.1%}, shuffled {chance:.1%}; the map's own "
      f"choice {ceiling:.0%}. ds4 head under v3: drafts the token it read {repeats:.0%} of the time")
s_cross

# %% [markdown]
# ## Pairing × schedule × draft length, online
# The ds4-fitted head drafts for speculative decoding of a greedy continuation. Acceptance
# per position, mean accepted length, tokens per target forward, and time per token against
# plain decoding measured here (CPU, tiny model: a target pass is cheap, so the head's own
# cost weighs more than on Flash).

# %%
model.mtp = fits["ds4"].head
prompt = held[:12]
session = model.session()
session.prefill(prompt)
t0 = pd.Timestamp.now()
plain = ds4lab.generate(model, [], 8, session=session)
plain_tok_s = len(plain.tokens) / (pd.Timestamp.now() - t0).total_seconds()
runs = []
for pairing in ("ds4", "v3"):
    for schedule in ("standard", "ds4"):
        for k in (1, 2) if schedule == "standard" else (1,):
            g = ds4lab.generate(model, prompt, 8, spec=SpecConfig(draft_len=k, pairing=pairing, schedule=schedule))
            s = mtp.summarize(g.spec_trace, plain_tok_s)
            runs.append({"pairing": pairing, "schedule": schedule, "draft_len": k,
                         "acc@1": s["acceptance_per_position"][0] if s["acceptance_per_position"] else np.nan,
                         "mean_acc_len": s["mean_acceptance_length"],
                         "tokens/target fwd": s["tokens_per_target_forward"], "speedup": s["speedup"]})
study = pd.DataFrame(runs)
fig, ax = plt.subplots(figsize=(6, 3.2))
labels = [f"{r.pairing}/{r.schedule}/k={r.draft_len}" for r in study.itertuples()]
ax.bar(labels, study["tokens/target fwd"])
ax.axhline(1.0, color="grey", lw=0.8)
ax.set_ylabel("tokens per target forward")
ax.set_xlabel("pairing / schedule / draft length")
ax.tick_params(axis="x", rotation=60)
plt.show()
study

# %% [markdown]
# ## Margin-gate calibration
# ds4 verifies a draft only when the head's top-1 minus top-2 logit is at least 3.0. The
# reliability table bins that margin against teacher-forced acceptance; ECE and AUROC say how
# well it predicts acceptance.

# %%
tf = mtp.teacher_forced(model, held + train[0][:64], pairing="ds4")
bins = pd.cut(tf["margin"], [0, 1, 2, 3, 5, 8, np.inf], right=False)
table = tf.groupby(bins, observed=True).agg(n=("accepted", "size"), acceptance=("accepted", "mean"),
                                            confidence=("q_draft", "mean"))
ece = float((table["n"] / table["n"].sum() * (table["acceptance"] - table["confidence"]).abs()).sum())
pos, neg = tf.loc[tf["accepted"], "margin"].to_numpy(), tf.loc[~tf["accepted"], "margin"].to_numpy()
auroc = float((pos[:, None] > neg[None, :]).mean() + 0.5 * (pos[:, None] == neg[None, :]).mean()) if len(neg) else 1.0
gate = tf["margin"] >= DS4_MARGIN
print(f"ECE (head softmax as confidence) {ece:.3f}, AUROC of the margin {auroc:.3f}; ds4's gate at {DS4_MARGIN}: "
      f"passes {gate.mean():.0%}, acceptance {tf.loc[gate, 'accepted'].mean():.0%} vs {tf['accepted'].mean():.0%}")
fig, ax = plt.subplots(figsize=(4.6, 3.2))
ax.plot(table["confidence"], table["acceptance"], marker="o")
ax.plot([0, 1], [0, 1], color="grey", lw=0.8)
ax.set_xlabel("head softmax probability of its draft")
ax.set_ylabel("empirical acceptance")
plt.show()
table

# %% [markdown]
# ## Argmax vs sampled drafts at T = 0.8
# With sampled verification, an argmax draft (one-hot q) is accepted with probability p(d);
# a sampled draft with 1 − TV(p, q).

# %%
sampling = ds4lab.generation.Sampling(temperature=0.8, seed=4)
rates = {}
for how in ("argmax", "sample"):
    g = ds4lab.generate(model, prompt, 10, sampling=sampling,
                        spec=SpecConfig(draft_len=2, verify="sample", draft_sampling=how))
    rates[how] = g.spec_summary["draft_acceptance_rate"]
pd.Series(rates, name="draft acceptance rate at T=0.8")

# %% [markdown]
# ## Acceptance vs the quantization of the fitted projections
# ds4's layout stores e_proj / h_proj as Q8_0; F32 (exact) and Q4_K show what the type costs.

# %%
fitted = fits["ds4"].head
quant_rows = {}
for type_name in ("F32", "Q8_0", "Q4_K"):
    head = fitted
    if type_name != "Q8_0":
        mats = {}
        for name in ("e_proj", "h_proj"):
            dense = np.array(getattr(fitted, name).dense())
            if type_name == "Q4_K":
                dense = dequantize(np.frombuffer(quantize(dense, "Q4_K"), np.uint8), "Q4_K", dense.shape)
            matrix = getattr(fitted, name)
            mats[name] = type(matrix)(matrix.codes, matrix.scales, matrix.biases, matrix.rows, matrix.cols,
                                      mx.array(dense.astype(np.float32)))
        head = type(fitted)(**{**fitted.__dict__, **mats})
    model.mtp = head
    quant_rows[type_name] = mtp.teacher_forced(model, held, pairing="ds4")["accepted"].mean()
model.mtp = fitted
fig, ax = plt.subplots(figsize=(4, 3))
ax.bar(list(quant_rows), [100 * v for v in quant_rows.values()])
ax.set_xlabel("e_proj / h_proj type")
ax.set_ylabel("teacher-forced acceptance (%)")
plt.show()

# %% [markdown]
# ## ds4's ring emulated: stale rows
# ds4 keeps the head's window with a counter only: after verification the committed positions
# become visible as drafting left them (rows the head wrote from its own chained streams), and
# after a full accept the last one was never written (`SpecConfig(ring="ds4")`, which starts
# empty after prefill as ds4 does). The exact ring rewrites those rows from the target's real
# states. Same prompt, ds4's pairing and schedule, both windows cold; the tokens are plain
# decoding's either way, only the head's guesses can change.

# %%
ring_rows, ring_traces = [], {}
plain_16 = ds4lab.generate(model, prompt, 16).tokens
for ring in ("exact", "ds4"):
    g = ds4lab.generate(model, prompt, 16, spec=SpecConfig(draft_len=1, pairing="ds4", schedule="ds4",
                                                           warm_prefill=False, ring=ring))
    t = ring_traces[ring] = g.spec_trace
    gated = t[t["path"] != "fallback"]
    ring_rows.append({"ring": ring, "same tokens as plain": g.tokens == plain_16,
                      "gate passed (%)": 100 * (gated["path"] != "miss").mean(),
                      "draft acceptance (%)": 100 * g.spec_summary["draft_acceptance_rate"],
                      "tokens/target fwd": g.spec_summary["tokens_per_target_forward"],
                      "mean stale rows seen": t["ring_stale"].mean(), "of them unwritten": t["ring_unwritten"].mean()})
fig, ax = plt.subplots(figsize=(5.2, 3.2))
for ring, t in ring_traces.items():
    ax.step(t["pos"], t["ring_stale"], where="post", label=f"{ring} ring: stale")
    ax.step(t["pos"], t["ring_rows"], where="post", ls=":", label=f"{ring} ring: rows seen")
ax.set_xlabel("token position at the cycle's start")
ax.set_ylabel("rows of the head's window (count)")
ax.legend(fontsize=8)
plt.show()
pd.DataFrame(ring_rows).set_index("ring")
