"""Scripted comparison runs: the top-k logits of every prompt position and of N greedy steps.

What `ds4lab logits` writes (an .npz, the conventions of ds4's oracle files):
- `tokens` int32 [T]; `topk_ids` int32 [T, K] and `topk_logits` float32 [T, K] (descending,
  ties to the lower id); `logsumexp` float32 [T]; row p is the state after tokens[0..p];
- `experts` int32 [T, n_layer, n_expert_used]: the routed experts chosen at each position;
- `gen_ids` int32 [N]; `gen_topk_ids` / `gen_topk_logits` [N, K] and `gen_logsumexp` [N]:
  row k are the logits after tokens + gen_ids[:k] (row 0 is prompt row T-1), and
  gen_ids[k] is their argmax.
With `resume` (a .kv file, ds4-written or not), the session starts from the file's state and
only the prompt tokens after the cached ones run: `resumed_from` holds the cached count and
the per-position rows cover tokens[resumed_from:].
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .atomic import atomic_open
from .compare import logsumexp, topk
from .errors import Ds4labError


def run(model, tokens: list[int], k: int = 64, n_gen: int = 0, resume: str | os.PathLike[str] | None = None
        ) -> dict[str, np.ndarray]:
    """Teacher-forced top-k over the prompt, then `n_gen` greedy steps in the same session."""
    session = model.session()
    cached = 0
    if resume is not None:
        kvc = session.load_kv(resume)
        cached = len(kvc.tokens)
        if list(tokens[:cached]) != kvc.tokens.tolist():
            raise Ds4labError(f"{resume}: its {cached} cached tokens are not a prefix of the prompt")
    if len(tokens) > cached:
        result = session.prefill_all(tokens[cached:])
        logits, experts = np.array(result.logits), [np.array(e) for e in result.experts]
    else:
        logits = np.zeros((0, model.config.n_vocab), np.float32)
        experts = [np.zeros((0, model.config.n_expert_used), np.int32)] * model.config.n_layer
    ids, vals = topk(logits, k)
    out = {
        "resumed_from": np.int32(cached),
        "tokens": np.asarray(tokens, dtype=np.int32),
        "topk_ids": ids,
        "topk_logits": vals,
        "logsumexp": logsumexp(logits),
        "experts": np.stack(experts, axis=1).astype(np.int32),
    }
    rows = [logits[-1] if len(logits) else np.array(session.logits).reshape(-1)]
    gen: list[int] = []
    for _ in range(n_gen):
        gen.append(int(np.argmax(rows[-1])))
        if len(gen) < n_gen:
            rows.append(np.array(session.decode(gen[-1])))
    gen_logits = np.stack(rows[:n_gen]) if n_gen else np.zeros((0, logits.shape[1]), np.float32)
    gen_ids, gen_vals = topk(gen_logits, k)
    out.update(gen_ids=np.asarray(gen, dtype=np.int32), gen_topk_ids=gen_ids, gen_topk_logits=gen_vals,
               gen_logsumexp=logsumexp(gen_logits))
    return out


def save(path: str | os.PathLike[str], arrays: dict[str, np.ndarray]) -> Path:
    """Write the arrays atomically (temp file, then rename)."""
    path = Path(path)
    with atomic_open(path) as fh:
        np.savez_compressed(fh, **arrays)
    return path


