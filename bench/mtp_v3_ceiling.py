"""How far can an MTP head fitted to a random tiny model get under the v3 pairing?

The head's row at position L reads the target's final HC streams h_L and the embedding of
t_{L+1}, plus its own window of earlier rows; under v3 it must guess the target's greedy
choice after t_{L+1}, a token the target's state has not seen. This measures, on the
synthetic `tiny` model (seed 5, 128 vocabulary rows) with 2 and with 4 layers (the head takes
layer 1's constants: 2 at least), on random text and on the model's own greedy continuations,
with held-out sequences never trained on:

1. the target itself: its median top-1 minus top-2 logit, and how often its greedy choice
   survives redrawing every token more than k positions back (positions kept);
2. per pairing (ds4, v3): the best a token-only lookup does (the majority next choice of each
   token in training), and the least-squares map from [normed streams, normed embedding] to
   the target's final normed vector (the optimum of the linear family `mtp.fit` trains);
3. under v3 on random text: a float one-block transformer over the head's rows (causal
   attention over the window with RoPE, a 4x FFN; more capacity than the head's block, no
   quantization), trained with AdamW on the target's greedy labels;
4. `mtp.fit` itself (the head's real forward, teacher-forced) on each text and pairing.

    python bench/mtp_v3_ceiling.py [--layers 2 4] [--random 96] [--greedy 12] [--epochs 15]
"""

from __future__ import annotations

import ds4lab  # first: OpenBLAS before MLX on Linux

# isort: split
import argparse
import time
from collections import Counter, defaultdict

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from ds4lab import gguf, mtp
from ds4lab.paths import synthetic_model
from ds4lab.synth import mtp_path

HELD = 0.15         # the fraction of sequences held out
PAIRINGS = {"ds4": 0, "v3": 1}


def greedy_continuation(model, prompt: list[int], n: int) -> list[int]:
    """The prompt and the target's next n greedy tokens (end of sequence included: fixed length)."""
    session = model.session()
    session.prefill(prompt)
    state, ids = session.state, list(prompt)
    for _ in range(n):
        ids.append(int(np.argmax(np.array(state.logits))))
        state = model.forward(state, ids[-1:], last_only=True).state
    return ids


def context_survival(model, rows: np.ndarray, rng: np.random.Generator, keep: int, trials: int = 48) -> float:
    """How often the target's greedy choice after 96 random tokens stays the same when every
    token before the last `keep` is redrawn (positions kept)."""
    same = []
    for _ in range(trials):
        seq = [int(t) for t in rng.choice(rows, 96)]
        alt = [int(t) for t in rng.choice(rows, 96 - keep)] + seq[96 - keep:]
        a, b = (int(np.argmax(np.array(model.session().prefill_all(s).logits[-1]))) for s in (seq, alt))
        same.append(a == b)
    return float(np.mean(same))


class Features:
    """A pairing's rows over target passes: inputs [normed streams h_L (flat), normed embedding
    of t_{L+s}], the target's final normed vector after t_{L+s}, its greedy label, the token."""

    def __init__(self, passes: list[mtp.TargetPass], s: int, embed: np.ndarray, rank: dict, out: np.ndarray):
        self.x, self.y, self.label, self.token = [], [], [], []
        for run in passes:
            n = len(run.ids) - s - 1
            tokens = np.array(run.ids[s:s + n])
            h = _unit_rms(run.hidden[:n]).reshape(n, -1)
            self.x.append(np.concatenate([h, _unit_rms(embed[[rank[t] for t in tokens]])], axis=1))
            self.y.append(run.final_norm[s:s + n])
            self.label.append((run.final_norm[s:s + n] @ out.T).argmax(axis=1))
            self.token.append(tokens)


def _unit_rms(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + 1e-6)


def lookup_accuracy(f: Features, n_train: int) -> float:
    table = defaultdict(Counter)
    for tokens, labels in zip(f.token[:n_train], f.label[:n_train], strict=True):
        for t, y in zip(tokens, labels, strict=True):
            table[t][y] += 1
    hits = [bool(table[t]) and table[t].most_common(1)[0][0] == y
            for tokens, labels in zip(f.token[n_train:], f.label[n_train:], strict=True)
            for t, y in zip(tokens, labels, strict=True)]
    return float(np.mean(hits))


def ridge_accuracy(f: Features, n_train: int, out: np.ndarray, lam: float = 10.0) -> tuple[float, float]:
    a, b = np.concatenate(f.x[:n_train]), np.concatenate(f.y[:n_train])
    m = np.linalg.solve(a.T @ a + lam * np.eye(a.shape[1]), a.T @ b)

    def acc(lo: int, hi: int | None) -> float:
        x, labels = np.concatenate(f.x[lo:hi]), np.concatenate(f.label[lo:hi])
        return float(((x @ m @ out.T).argmax(axis=1) == labels).mean())

    return acc(0, n_train), acc(n_train, None)


class OneBlock(nn.Module):
    """Rows -> width 256, one pre-norm attention block (8 heads, RoPE, causal) and a 4x GELU
    FFN, a final norm and projection to a final vector, the target's output matrix."""

    def __init__(self, n_in: int, out: mx.array, width: int = 256, heads: int = 8) -> None:
        super().__init__()
        self.inp, self.q, self.k, self.v, self.o = (nn.Linear(a, b) for a, b in
                                                    [(n_in, width)] + [(width, width)] * 4)
        self.n1, self.n2, self.n3 = nn.RMSNorm(width), nn.RMSNorm(width), nn.RMSNorm(width)
        self.up, self.down, self.fin = nn.Linear(width, 4 * width), nn.Linear(4 * width, width), nn.Linear(width, width)
        self.rope, self.heads, self.width = nn.RoPE(width // heads), heads, width
        self.out = out
        self.freeze(keys=["out"])

    def __call__(self, x: mx.array) -> mx.array:
        b, t, _ = x.shape
        x = self.inp(x)
        y = self.n1(x)
        q, k, v = (m(y).reshape(b, t, self.heads, -1).transpose(0, 2, 1, 3) for m in (self.q, self.k, self.v))
        mask = nn.MultiHeadAttention.create_additive_causal_mask(t)
        z = mx.fast.scaled_dot_product_attention(self.rope(q), self.rope(k), v, scale=q.shape[-1] ** -0.5, mask=mask)
        x = x + self.o(z.transpose(0, 2, 1, 3).reshape(b, t, self.width))
        x = x + self.down(nn.gelu(self.up(self.n2(x))))
        return self.fin(self.n3(x)) @ self.out.T


def one_block_accuracy(f: Features, n_train: int, out: np.ndarray, epochs: int, seed: int = 0) -> tuple[float, float]:
    mx.random.seed(seed)
    x, y = mx.array(np.stack(f.x)), mx.array(np.stack(f.label))
    net = OneBlock(x.shape[-1], mx.array(out))
    opt = optim.AdamW(learning_rate=1e-3, weight_decay=0.01)
    step = nn.value_and_grad(net, lambda net, xb, yb: nn.losses.cross_entropy(net(xb), yb, reduction="mean"))
    rng = np.random.default_rng(seed)
    for _ in range(epochs):
        for batch in np.array_split(rng.permutation(n_train), max(n_train // 8, 1)):
            _, grads = step(net, x[mx.array(batch)], y[mx.array(batch)])
            opt.update(net, grads)
            mx.eval(net.parameters(), opt.state)

    def acc(part: slice) -> float:
        return float((mx.argmax(net(x[part]), axis=2) == y[part]).mean())

    return acc(slice(0, n_train)), acc(slice(n_train, None))


def fit_acceptance(model, passes: list[mtp.TargetPass], n_train: int, pairing: str) -> tuple[float, float, float]:
    """`mtp.fit` on the training passes: (teacher-forced acceptance on held-out sequences before,
    after, seconds). The head is put back as loaded."""
    held = passes[n_train:]
    loaded = model.mtp

    def accept() -> float:
        return float(np.mean([mtp.teacher_forced(model, p.ids, pairing=pairing)["accepted"].mean() for p in held]))

    before = accept()
    t0 = time.perf_counter()
    fitted = mtp.fit(model, passes[:n_train], steps=240, pairing=pairing)
    seconds = time.perf_counter() - t0
    model.mtp = fitted.head
    after = accept()
    model.mtp = loaded
    return before, after, seconds


def study(n_layer: int, n_random: int, n_greedy: int, epochs: int) -> None:
    path = synthetic_model("tiny", "q2", seed=5, mtp=True, n_layer=n_layer, vocab_rows=128)
    model = ds4lab.load(path, mtp=mtp_path(path))
    rows = np.flatnonzero(np.abs(gguf.open(path).dequantize("token_embd.weight")).sum(axis=1))
    out = np.array(model.weights.output.dense())[rows]
    embed = np.array(model.weights.token_embd[mx.array(rows)].astype(mx.float32))
    rank = {int(t): i for i, t in enumerate(rows)}
    rng = np.random.default_rng(11)
    t0 = time.perf_counter()
    texts = {"random": [[int(t) for t in rng.choice(rows, 128)] for _ in range(n_random)],
             "greedy": [greedy_continuation(model, [int(t) for t in rng.choice(rows, 8)], 120)
                        for _ in range(n_greedy)]}
    print(f"\n== {n_layer} layer(s); {n_greedy} greedy continuations of 120 tokens in "
          f"{time.perf_counter() - t0:.0f} s")
    passes = {kind: mtp.target_passes(model, seqs) for kind, seqs in texts.items()}
    margins = np.concatenate([np.diff(np.sort(p.final_norm @ out.T, axis=1)[:, -2:], axis=1)[:, 0]
                              for p in passes["random"]])
    survival = {k: context_survival(model, rows, rng, k) for k in (1, 8, 64)}
    print(f"target: median top-1 minus top-2 logit {np.median(margins):.2f}; greedy choice unchanged when tokens "
          "more than k back are redrawn: " + ", ".join(f"k={k} {v:.2f}" for k, v in survival.items()))
    for kind, kind_passes in passes.items():
        if len(kind_passes) < 2:            # nothing to hold out (--greedy 0: random text only)
            continue
        n_train = len(kind_passes) - max(round(HELD * len(kind_passes)), 1)
        for pairing, s in PAIRINGS.items():
            f = Features(kind_passes, s, embed, rank, out)
            tr, te = ridge_accuracy(f, n_train, out)
            line = (f"{kind:6} {pairing:3}: token lookup {lookup_accuracy(f, n_train):.3f}; "
                    f"least squares train {tr:.3f} held-out {te:.3f}")
            if pairing == "v3" and kind == "random":
                tr, te = one_block_accuracy(f, n_train, out, epochs)
                line += f"; float one-block train {tr:.3f} held-out {te:.3f}"
            before, after, seconds = fit_acceptance(model, kind_passes, n_train, pairing)
            print(line + f"; mtp.fit held-out {before:.3f} -> {after:.3f} ({seconds:.0f} s)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--random", type=int, default=96, help="random sequences of 128 tokens")
    parser.add_argument("--greedy", type=int, default=12, help="greedy continuations of 120 tokens")
    parser.add_argument("--epochs", type=int, default=15, help="epochs of the float one-block model")
    args = parser.parse_args()
    mx.set_default_device(mx.cpu)
    for n_layer in args.layers:
        study(n_layer, args.random, args.greedy, args.epochs)


if __name__ == "__main__":
    main()
