"""Speculative decoding with an MTP head (or any drafter), lossless, with a record of every cycle.

A cycle starts from a session that has consumed tokens up to position P and a chosen next
token f (not consumed yet). The head drafts up to `draft_len` tokens after f; the target
model runs [f, d1, ..., dk] in one pass; drafts are accepted while the target agrees
(greedy) or by rejection sampling (`accept_or_resample`); the first disagreement gives the
next f (the target's own choice, or a draw from the residual), a full accept gives it from
the last row (the bonus token). The session then holds exactly the state plain decoding of
the committed tokens gives: the verify pass's state on a full accept, else the state before
it with the accepted prefix run again (on the CPU, a batch of rows equals the same rows
decoded one by one bit for bit, so the .kv files are byte-identical).

Pairing (what the head's row at position i reads):
- "v3" (DeepSeek V3/V4, vLLM, SGLang): the target's HC state after t_i with the embedding of
  t_{i+1}; it guesses t_{i+2}. The first draft of a cycle uses the real state h_P and f.
- "ds4" (ds4.c's first draft): h_i with the embedding of t_i itself, a guess of t_{i+1} the
  target already makes; drafts past f are chained from the head's own output streams.
The head's rows for committed tokens are always computed from the target's real states
(rows computed for drafts are discarded): its window is warm from the prompt with
`warm_prefill` (vLLM/SGLang), else empty after prefill as in ds4.

Schedule: "standard" verifies [f, drafts] in one target pass (up to draft_len + 1 tokens per
pass); "ds4" first commits f with a one-row pass, checks the head's guess of the next token
against that pass's choice (a "miss" ends the cycle), then verifies [that token, drafts]
(ds4's `ds4_session_eval_speculative_argmax`: at most 3 tokens per 2 passes at draft_len 1).

Ring: "exact" keeps the head's window as above (rows for committed tokens from real states).
"ds4" emulates ds4.c's counter-only ring (8d57664): a draft row goes to slot `pos % raw_cap`
and the window seen is the last min(n + 1, n_swa) slots (`metal_graph_eval_mtp_draft_from_hc`
~12867, ~12960); the window is emptied after prefill (~17547); after verification
`DS4_MTP_KEEP_ACCEPTED` (~17875) makes the committed positions visible without rewriting
them, so the rows drafting wrote there from the head's own chained streams stay, and a
position drafting never reached (the last one after a full accept) shows whatever its slot
held: here a zero row, as a fresh Metal buffer (in a long run or a reused ds4 session, an old
row). Only the one-row target pass of a cycle (`ds4_session_eval`, ~17756) writes a row from
the real state. Drafts change, the emitted tokens and the target's state do not; each cycle
records the stale rows the head's next row will see (`ring_stale`, of them `ring_unwritten`).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
import pandas as pd

from . import gguf
from .config import ModelConfig
from .generation import Emitter, Sampling, Step, distribution, sample
from .model.mtp import PREFIX, MTPHead
from .model.state import LayerCache, MTPState, SessionState
from .model.weights import Q8Matrix, keep_decoded
from .quants import quantize_q8_0

PATHS = ("miss", "margin-skip", "full", "partial", "fallback")
PAIRINGS = ("v3", "ds4")
SCHEDULES = ("standard", "ds4")
RINGS = ("exact", "ds4")
DS4_MARGIN = 3.0        # ds4's --mtp-margin default (top-1 minus top-2 logit of the last draft)

Drafter = Callable[[list[int], int], Sequence[int]]


@dataclass(frozen=True)
class SpecConfig:
    """How to decode speculatively (see the module doc).

    draft_len: speculative tokens per cycle (ds4's `--mtp-draft 2` is draft_len 1).
    verify: "greedy" (temperature 0 only) or "sample" (rejection sampling, any Sampling).
    draft_sampling: "argmax" (one-hot q) or "sample" (drafts drawn from the head's q under the
    same Sampling). margin: drafts stop at the first whose head top-1 minus top-2 logit is
    below it (ds4: 3.0); a cycle left with none decodes f alone ("margin-skip").
    drafter: `(context_tokens, k) -> k ids` replacing the head's proposals (one-hot q).
    ring: "exact" or "ds4" (ds4's window with its stale rows; see the module doc): it starts
    empty after prefill (warm_prefill=False) and needs a cycle that starts with a head row
    from the real state (schedule "ds4", or pairing "v3")."""

    draft_len: int = 1
    pairing: str = "v3"
    schedule: str = "standard"
    warm_prefill: bool = True
    verify: str = "greedy"
    draft_sampling: str = "argmax"
    margin: float | None = None
    drafter: Drafter | None = None
    ring: str = "exact"

    def __post_init__(self) -> None:
        checks = [(self.draft_len >= 1, f"draft_len must be at least 1, not {self.draft_len}"),
                  (self.pairing in PAIRINGS, f"pairing must be one of {PAIRINGS}, not {self.pairing!r}"),
                  (self.schedule in SCHEDULES, f"schedule must be one of {SCHEDULES}, not {self.schedule!r}"),
                  (self.verify in ("greedy", "sample"), f"verify must be 'greedy' or 'sample', not {self.verify!r}"),
                  (self.draft_sampling in ("argmax", "sample"),
                   f"draft_sampling must be 'argmax' or 'sample', not {self.draft_sampling!r}"),
                  (self.ring in RINGS, f"ring must be one of {RINGS}, not {self.ring!r}")]
        if self.ring == "ds4":
            checks += [(not self.warm_prefill, "ring='ds4' is emptied after prefill as ds4 does (ds4.c ~17547): "
                                               "pass warm_prefill=False"),
                       (self.pairing == "v3" or self.schedule == "ds4",
                        "ring='ds4' with pairing='ds4' needs schedule='ds4': only ds4's one-row pass writes a "
                        "head row from the target's real state")]
        bad = [why for ok, why in checks if not ok]
        if bad:
            raise ValueError("; ".join(bad))

    @property
    def offset(self) -> int:
        """s in the pairing (h_i, t_{i+s}): 1 for v3, 0 for ds4."""
        return 1 if self.pairing == "v3" else 0


def accept_or_resample(p: np.ndarray, q: np.ndarray, draft: int, rng: np.random.Generator) -> tuple[bool, int]:
    """One rejection-sampling step: accept `draft` with probability min(1, p/q); on rejection
    draw from norm(max(0, p - q)). The result is distributed as p whatever q is (q[draft] > 0;
    a one-hot q is an argmax draft, accepted with probability p[draft])."""
    p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
    if q[draft] <= 0:
        raise ValueError(f"draft {draft} has q = {q[draft]}: a draft must be possible under q")
    if rng.random() * q[draft] < p[draft]:
        return True, int(draft)
    residual = np.maximum(p - q, 0.0)
    total = residual.sum()
    # Rejection implies p[draft] < q[draft], hence some p[x] > q[x]: the residual has mass.
    return False, int(rng.choice(len(p), p=residual / total))


def _one_hot(n: int, token: int) -> np.ndarray:
    q = np.zeros(n)
    q[token] = 1.0
    return q


def _margins(logits: np.ndarray) -> np.ndarray:
    """Top-1 minus top-2 logit of each row of [T, n_vocab] (two linear passes: np.partition is
    pathologically slow on rows where most of the vocabulary shares one value)."""
    rows = np.arange(len(logits))
    top = logits.argmax(axis=1)
    rest = logits.copy()
    rest[rows, top] = -np.inf
    return logits[rows, top] - rest.max(axis=1)


class _Cycles:
    """The speculative loop over one session (see `speculative_stream`)."""

    def __init__(self, model, session, emitter: Emitter, sampling: Sampling, spec: SpecConfig) -> None:
        if spec.drafter is None and model.mtp is None:
            raise ValueError("speculative decoding needs an MTP head (ds4lab.load(..., mtp=FILE)) or a drafter")
        if spec.verify == "greedy" and sampling.temperature > 0:
            raise ValueError("verify='greedy' is lossless only at temperature 0; use verify='sample'")
        self.model, self.session, self.emitter, self.sampling, self.spec = model, session, emitter, sampling, spec
        self.head = model.mtp if spec.drafter is None else None
        self.rng = np.random.default_rng(sampling.seed)
        self.records: list[dict] = []

    # ---- the head's rows for committed tokens ----------------------------------------
    def _expected_next(self, state: SessionState) -> int:
        return state.n_tokens - self.spec.offset

    def _advance(self, state: SessionState, prev: mx.array | None, hidden: mx.array, tokens: list[int]) -> None:
        """`state` consumed `tokens` (final streams `hidden`; `prev` the streams before them):
        write the head's rows that became computable (pairs of real states and tokens)."""
        if self.head is None or state.mtp is None:
            return
        p0 = state.n_tokens - len(tokens)
        first, last = state.mtp.next_pos, state.n_tokens - 1 - self.spec.offset
        if last < first:
            return
        rows = [prev[None] if i == p0 - 1 else hidden[i - p0][None] for i in range(first, last + 1)]
        toks = [tokens[i + self.spec.offset - p0] for i in range(first, last + 1)]
        _, state.mtp = self.head.run(self.model, state.mtp, mx.concatenate(rows), toks)

    def prefill(self, prompt: list[int], progress: bool) -> None:
        session = self.session
        if self.head is not None and self.spec.warm_prefill and session.state.mtp is None:
            first = session.state.n_tokens if session.state.hidden is None else self._expected_next(session.state)
            session.state.mtp = self.head.empty_state(self.model.config, first)
        if prompt:
            prev = [session.state.hidden]

            def warm(ids: list[int], result) -> None:
                self._advance(session.state, prev[0], result.hidden, ids)
                prev[0] = result.hidden[-1]

            warming = self.head is not None and self.spec.warm_prefill
            session.prefill(prompt, progress=progress, on_chunk=warm if warming else None)
        if self.head is not None and (session.state.mtp is None
                                      or session.state.mtp.next_pos != self._expected_next(session.state)):
            session.state.mtp = self.head.empty_state(self.model.config, self._expected_next(session.state))

    # ---- choosing and drafting ----------------------------------------------------------
    def choose(self, logits) -> int:
        return sample(np.array(logits, dtype=np.float32), self.sampling, self.rng)

    def _q(self, logits: np.ndarray) -> np.ndarray:
        if self.spec.draft_sampling == "sample":
            return distribution(logits, self.sampling)
        return _one_hot(len(logits), int(np.argmax(logits)))

    def draft(self, f: int, k: int) -> tuple[list[int], list[np.ndarray], list[float], tuple, bool]:
        """(drafts, their q, head margins, (the head's state to keep, the ring rows drafting
        wrote after it), cut by the margin)."""
        state = self.session.state
        if self.head is None:
            drafts = [int(t) for t in self.spec.drafter([*state.tokens, f], k)][:k]
            n = self.model.config.n_vocab
            return drafts, [_one_hot(n, d) for d in drafts], [float("nan")] * len(drafts), (None, []), False
        mtp, written = state.mtp, []
        if self.spec.offset:                       # v3: the row (h_P, f) is a committed one
            logits, mtp = self.head.run(self.model, mtp, state.hidden[None], [f])
            keep, logits = mtp, logits[0]
        else:                                      # ds4: chained from the latest row's output
            if mtp.out is None:
                return [], [], [], (mtp, written), False
            keep = mtp
            logits, mtp = self.head.run(self.model, mtp, mtp.out[None], [f])
            logits = logits[0]
            written.append(mtp.ring.raw[-1:])
        drafts, qs, margins = [], [], []
        while True:
            row = np.array(logits, dtype=np.float64)
            margin = float(_margins(row[None])[0])
            if self.spec.margin is not None and margin < self.spec.margin:
                return drafts, qs, margins, (keep, written), True
            q = self._q(row)
            d = int(np.argmax(row)) if self.spec.draft_sampling == "argmax" else int(self.rng.choice(len(q), p=q))
            drafts.append(d)
            qs.append(q)
            margins.append(margin)
            if len(drafts) == k:
                return drafts, qs, margins, (keep, written), False
            logits, mtp = self.head.run(self.model, mtp, mtp.out[None], [d])
            logits = logits[0]
            written.append(mtp.ring.raw[-1:])

    def _ds4_ring(self, keep: MTPState, written: list[mx.array], upto: int) -> MTPState:
        """ds4's DS4_MTP_KEEP_ACCEPTED: positions keep.next_pos..upto-1 become visible as
        drafting left them (its rows, then zero rows where it wrote none); nothing is rewritten."""
        cfg = self.model.config
        n = upto - keep.next_pos
        rows = written[:n] + [mx.zeros((1, cfg.head_dim), mx.float32)] * max(n - len(written), 0)
        horizon = upto - cfg.n_swa
        return MTPState(LayerCache(mx.concatenate([keep.ring.raw, *rows])[-cfg.n_swa:]), upto,
                        stale=tuple(p for p in keep.stale if p >= horizon) + tuple(range(keep.next_pos, upto)),
                        unwritten=tuple(p for p in keep.unwritten if p >= horizon)
                        + tuple(range(keep.next_pos + len(written), upto)))

    def ring_counts(self) -> dict:
        """The rows of the head's window its next row sees besides itself, and how many are stale."""
        mtp = self.session.state.mtp
        if mtp is None:
            return {"ring_rows": 0, "ring_stale": 0, "ring_unwritten": 0}
        n = min(mtp.ring.raw.shape[0], self.model.config.n_swa - 1)
        first = mtp.next_pos - n
        return {"ring_rows": n, "ring_stale": sum(p >= first for p in mtp.stale),
                "ring_unwritten": sum(p >= first for p in mtp.unwritten)}

    # ---- cycles -----------------------------------------------------------------------
    def plain(self, f: int, path: str, record: dict, drafted: tuple | None = None) -> tuple[int | None, object]:
        """Commit f with a one-row pass; the next token from its logits. `drafted` (under
        ds4's ring, after a margin skip): the head's state and rows drafting left, kept."""
        state0 = self.session.state
        t0 = time.perf_counter()
        result = self.model.forward(state0, [f], last_only=True)
        self.session.state = result.state
        if drafted is None:
            self._advance(self.session.state, state0.hidden, result.hidden, [f])
        else:
            self.session.state.mtp = self._ds4_ring(*drafted, self._expected_next(self.session.state))
        record["ms_verify"] += 1e3 * (time.perf_counter() - t0)
        record["target_passes"] += 1
        record["path"] = path
        logits = self.session.state.logits
        return self.choose(logits), logits

    def standard(self, f: int, record: dict) -> tuple[int | None, object, list[Step]]:
        """One standard cycle after f was emitted: returns (next f, its logits row, the steps
        of the accepted drafts)."""
        spec, model = self.spec, self.model
        k = min(spec.draft_len, self.emitter.max_tokens - self.emitter.index - 1)
        if k <= 0 or (self.session.state.hidden is None and self.head is not None):
            return (*self.plain(f, "fallback", record), [])
        t0 = time.perf_counter()
        drafts, qs, margins, drafted, cut = self.draft(f, k)
        record["ms_draft"] += 1e3 * (time.perf_counter() - t0)
        record.update(drafted=len(drafts), draft_ids=drafts, margins=margins)
        ds4_ring = self.head is not None and spec.ring == "ds4"
        if not drafts:
            return (*self.plain(f, "margin-skip" if cut else "fallback", record,
                                drafted if cut and ds4_ring else None), [])
        state0 = self.session.state
        t0 = time.perf_counter()
        result = model.forward(state0, [f, *drafts], last_only=False)
        rows = np.array(result.logits, dtype=np.float32)
        record["ms_verify"] += 1e3 * (time.perf_counter() - t0)
        record["target_passes"] += 1
        accepted, nxt, p_target = 0, None, []
        eos = self.emitter.eos
        for j, d in enumerate(drafts):
            p = distribution(rows[j], self.sampling)
            p_target.append(float(p[d]))
            if spec.verify == "greedy":
                target = int(np.argmax(rows[j]))
                ok = target == d
            else:
                ok, target = accept_or_resample(p, qs[j], d, self.rng)
            if not ok or d == eos:
                nxt = target
                break
            accepted += 1
        if nxt is None:
            nxt = self.choose(rows[accepted])
        record.update(accepted=accepted, target_ids=[int(t) for t in np.argmax(rows, axis=1)], p_target=p_target,
                      q_draft=[float(q[d]) for q, d in zip(qs, drafts, strict=True)],
                      path="full" if accepted == len(drafts) else "partial")
        consumed = [f, *drafts[:accepted]]
        t0 = time.perf_counter()
        if accepted == len(drafts):
            self.session.state = result.state
        else:
            self.session.state = model.forward(state0, consumed, last_only=True).state
        if ds4_ring:
            self.session.state.mtp = self._ds4_ring(*drafted, self._expected_next(self.session.state))
        elif self.head is not None:
            self.session.state.mtp = drafted[0]
            self._advance(self.session.state, state0.hidden, result.hidden[: accepted + 1], consumed)
        record["ms_rollback"] += 1e3 * (time.perf_counter() - t0)
        steps = []
        for j in range(accepted):
            step = self.emitter.step(drafts[j], rows[j])
            steps.append(step)
            if step.finish:          # a stop string inside the accepted drafts: consume only what precedes it
                self.session.state = model.forward(state0, consumed[: j + 1], last_only=True).state
                return None, None, steps
        return nxt, rows[accepted], steps

    def ds4_gate(self, f: int, record: dict) -> tuple[int | None, object, list[Step]]:
        """ds4's cycle: commit f alone, check the head's guess of the next token, then verify."""
        nxt, logits = self.plain(f, "miss", record)
        state = self.session.state
        if self.head is not None:
            guess = None if state.mtp.logits is None else int(np.argmax(np.array(state.mtp.logits)))
        else:
            guess = int(self.spec.drafter(state.tokens, 1)[0])
        if self.emitter.index + 1 >= self.emitter.max_tokens:
            record["path"] = "fallback"
            return nxt, logits, []
        if guess != nxt:
            return nxt, logits, []
        step = self.emitter.step(nxt, logits)
        if step.finish:
            return None, None, [step]
        after, row, steps = self.standard(nxt, record)
        return after, row, [step, *steps]

    def run(self, prompt: list[int], progress: bool) -> Iterator[Step]:
        self.prefill(prompt, progress)
        f, row = self.choose(self.session.logits), self.session.logits
        cycle = 0
        while f is not None:
            record = {"cycle": cycle, "pos": self.session.state.n_tokens, "path": "fallback", "drafted": 0,
                      "accepted": 0, "committed": 1, "draft_ids": [], "target_ids": [], "margins": [], "p_target": [],
                      "q_draft": [], "target_passes": 0, "ms_draft": 0.0, "ms_verify": 0.0, "ms_rollback": 0.0,
                      **self.ring_counts()}
            step = self.emitter.step(f, row)
            yield step
            if step.finish:
                record["committed"] = int(step.finish != "eos")
                self.records.append(record)
                return
            cycle_fn = self.ds4_gate if self.spec.schedule == "ds4" else self.standard
            f, row, steps = cycle_fn(f, record)
            record["committed"] += sum(s.finish != "eos" for s in steps)
            record.update(self.ring_counts())
            self.records.append(record)
            yield from steps
            if steps and steps[-1].finish:
                return
            cycle += 1

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.records, columns=TRACE_COLUMNS)


TRACE_COLUMNS = ["cycle", "pos", "path", "drafted", "accepted", "committed", "draft_ids", "target_ids", "margins",
                 "p_target", "q_draft", "target_passes", "ms_draft", "ms_verify", "ms_rollback", "ring_rows",
                 "ring_stale", "ring_unwritten"]


def speculative_stream(model, session, prompt: list[int], emitter: Emitter, sampling: Sampling, spec: SpecConfig,
                       progress: bool = False) -> Iterator[Step]:
    """`ds4lab.generation.stream(..., spec=...)`: the steps plain decoding would yield (greedy:
    the same tokens; sampled: the same distribution); `session.spec_trace` afterwards."""
    loop = _Cycles(model, session, emitter, sampling, spec)
    try:
        yield from loop.run(prompt, progress)
    finally:
        session.spec_trace = loop.frame()


def summarize(trace: pd.DataFrame, plain_tok_s: float | None = None) -> dict:
    """A spec trace in both conventions (cycles that drafted count as proposals):

    - vLLM: mean acceptance length 1 + accepted / proposals, acceptance per position j
      (proposals whose first j drafts were accepted / proposals), draft acceptance rate;
    - DeepSpec: accept_len (mean of accepted + 1 per proposal), verify_rate accepted /
      (drafted + proposals), conditional acceptance at j (accepted past j-1 / reached j) and
      prefix survival at j (first j accepted / drafted at least j);
    plus tokens per target forward, tok/s over the cycles' measured time and, given the plain
    decoding rate measured in the same process, the speedup."""
    proposals = trace[trace["drafted"] > 0]
    n_prop = len(proposals)
    depth = int(trace["drafted"].max()) if len(trace) else 0
    accepted, drafted = proposals["accepted"].to_numpy(), proposals["drafted"].to_numpy()
    reached = [int(((accepted >= j - 1) & (drafted >= j)).sum()) for j in range(1, depth + 1)]
    passed = [int((accepted >= j).sum()) for j in range(1, depth + 1)]
    seconds = (trace["ms_draft"] + trace["ms_verify"] + trace["ms_rollback"]).sum() / 1e3
    committed = int(trace["committed"].sum())
    out = {
        "cycles": len(trace),
        "proposals": n_prop,
        "drafted": int(drafted.sum()),
        "accepted": int(accepted.sum()),
        "committed": committed,
        "target_forwards": int(trace["target_passes"].sum()),
        "paths": trace["path"].value_counts().to_dict(),
        "mean_acceptance_length": 1 + accepted.sum() / n_prop if n_prop else float("nan"),
        "acceptance_per_position": [p / n_prop for p in passed] if n_prop else [],
        "draft_acceptance_rate": accepted.sum() / drafted.sum() if n_prop else float("nan"),
        "accept_len": float((accepted + 1).mean()) if n_prop else float("nan"),
        "verify_rate": accepted.sum() / (drafted.sum() + n_prop) if n_prop else float("nan"),
        "conditional_acceptance": [p / r if r else float("nan") for p, r in zip(passed, reached, strict=True)],
        "prefix_survival": [p / max(int((drafted >= j).sum()), 1) for j, p in enumerate(passed, 1)],
        "tokens_per_target_forward": committed / max(int(trace["target_passes"].sum()), 1),
        "tok_s": committed / seconds if seconds else float("nan"),
    }
    if plain_tok_s:
        out["plain_tok_s"] = plain_tok_s
        out["speedup"] = out["tok_s"] / plain_tok_s
    return out


def teacher_forced(model, tokens: Sequence[int], pairing: str = "v3", depth: int = 1,
                   chunk: int = 512) -> pd.DataFrame:
    """Greedy acceptance of the head over a token stream, offline: the target runs the tokens
    once, the head runs its rows (warm window, real states) in one pass per chunk.

    One row per (pos, depth): the head's row position, the token it read, its draft, the
    target's greedy choice there (`target`), `accepted` (draft == target), `prefix_accepted`
    (every draft up to this depth accepted), the head's top-1 minus top-2 logit `margin`,
    `p_target` (target softmax probability of the draft) and `q_draft` (the head's). Depth 1
    is vectorised; deeper drafts chain from the head's own output as online (a row at a time).
    With the same pairing, a warm window and the standard schedule, this is the acceptance
    the online loop measures (on the CPU, exactly)."""
    if model.mtp is None:
        raise ValueError("teacher_forced needs an MTP head: ds4lab.load(..., mtp=FILE)")
    ids = [int(t) for t in tokens]
    return _head_rows(model, ids, model.session().prefill_all(ids, chunk=chunk), pairing, depth, chunk)


def _head_rows(model, ids: list[int], full, pairing: str, depth: int, chunk: int = 512) -> pd.DataFrame:
    """`teacher_forced` from the target's pass over `ids` (logits and final streams)."""
    s = SpecConfig(pairing=pairing).offset
    target_logits = np.array(full.logits, dtype=np.float32)
    head, states = _run_head(model, ids, full.hidden, s, 1 if depth > 1 else chunk)
    fed = np.array(ids[s:], dtype=np.int64)
    frames = []
    for j in range(1, depth + 1):
        frames.append(_tf_frame(head, fed, target_logits, s, j))
        if j < depth:                        # the next depth: each row's chain fed its own draft
            n = len(frames[-1])
            fed = head[:n].argmax(axis=1)
            chained = [model.mtp.run(model, states[i], states[i].out[None], [int(fed[i])]) for i in range(n)]
            states = [st for _, st in chained]
            head = np.stack([np.array(lg[0], dtype=np.float32) for lg, _ in chained])
    out = pd.concat(frames, ignore_index=True)
    survived = out["accepted"].to_numpy().copy()
    for j in range(2, depth + 1):
        this, before = np.flatnonzero(out["depth"] == j), np.flatnonzero(out["depth"] == j - 1)
        survived[this] &= survived[before[: len(this)]]
    out["prefix_accepted"] = survived
    return out


def _run_head(model, ids: list[int], hidden: mx.array, s: int, step: int) -> tuple[np.ndarray, list[MTPState]]:
    """The head's rows over `ids` (warm window, real states; `step` rows per pass): the row at
    position i reads hidden[i] and ids[i + s]. Returns the logits [len(ids) - s, n_vocab] and
    the state after each pass."""
    state = model.mtp.empty_state(model.config, 0)
    rows, states = [], []
    for start in range(0, len(ids) - s, step):
        stop = min(start + step, len(ids) - s)
        logits, state = model.mtp.run(model, state, hidden[start:stop], ids[start + s:stop + s])
        rows.append(np.array(logits, dtype=np.float32))
        states.append(state)
    return np.concatenate(rows), states


def _tf_frame(head: np.ndarray, fed: np.ndarray, target_logits: np.ndarray, s: int, depth: int) -> pd.DataFrame:
    """Rows i = 0.. at one depth: the head read `fed[i]` and guesses t_{i+s+depth}; the target's
    choice for that token is the argmax of its logits after t_{i+s+depth-1}."""
    n = min(len(head), len(target_logits) - s - depth + 1)
    head, target = head[:n], target_logits[s + depth - 1: s + depth - 1 + n]
    draft, choice = head.argmax(axis=1), target.argmax(axis=1)
    return pd.DataFrame({"pos": np.arange(n) + depth - 1, "depth": depth, "token": fed[:n], "draft": draft,
                         "target": choice, "accepted": draft == choice, "margin": _margins(head),
                         "p_target": _softmax_at(target, draft), "q_draft": _softmax_at(head, draft)})


def _softmax_at(logits: np.ndarray, at: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    return np.exp(z[np.arange(len(at)), at]) / np.exp(z).sum(axis=1)


# ---- a fitted head ------------------------------------------------------------------------
@dataclass
class FittedHead:
    """A head whose e_proj / h_proj were fitted (`fit`): `head` (Q8_0-rounded, as saved),
    `curve` (step, loss, and teacher-forced acceptance on held-out tokens where measured)."""

    head: MTPHead
    source: Path
    curve: pd.DataFrame
    pairing: str
    config: ModelConfig         # the main model's shape the head belongs to

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write an MTP GGUF: the source file's metadata and tensors byte for byte, e_proj and
        h_proj replaced by the fitted Q8_0 ones (ds4's layout rules; checked by loading it back
        against the main model's shape). Atomic."""
        source = gguf.open(self.source, config=self.config)
        fitted = {f"{PREFIX}.e_proj.weight": self.head.e_proj, f"{PREFIX}.h_proj.weight": self.head.h_proj}
        meta = [(k, source.header.value_types[k], v) for k, v in source.metadata.items()]

        def produce(name: str):
            if name in fitted:
                return lambda: _q8_blocks(fitted[name])
            return lambda: np.asarray(source.raw(name))

        tensors = [gguf.TensorOut(t.name, t.type_name, t.dims, produce(t.name)) for t in source.tensors.values()]
        out = gguf.write_gguf(path, meta, tensors, alignment=source.header.alignment)
        from .model.mtp import load_mtp

        load_mtp(out, self.config)
        return out


def _q8_blocks(matrix: Q8Matrix) -> np.ndarray:
    """A Q8Matrix back to its Q8_0 bytes [rows, cols/32 * 34] (exact: the codes and scales are Q8_0's)."""
    codes = (np.array(matrix.codes).view(np.uint8).reshape(matrix.rows, -1, 32).astype(np.int16) - 128).astype(np.int8)
    d = np.array(matrix.scales).astype(np.float16).reshape(matrix.rows, -1, 1)
    return np.concatenate([d.view(np.uint8), codes.view(np.uint8)], axis=-1).reshape(matrix.rows, -1)


def _q8(values: np.ndarray) -> Q8Matrix:
    rows, cols = values.shape
    matrix = Q8Matrix.from_blocks(quantize_q8_0(values), rows, cols)
    keep_decoded([matrix])
    return matrix


@dataclass(frozen=True)
class TargetPass:
    """The target's pass over one token sequence, what `fit` learns from: the ids, the final
    HC streams [T, n_hc, n_embd] and the final normed vectors [T, n_embd]."""

    ids: list[int]
    hidden: np.ndarray
    final_norm: np.ndarray


def target_passes(model, sequences: Sequence[Sequence[int]]) -> list[TargetPass]:
    """The target's passes over `sequences`. `fit` runs them itself from token ids; given these
    instead, fits under several pairings or step counts run the target once."""
    last = f"blocks.{model.config.n_layer - 1}.hook_resid_post"
    passes = []
    for seq in sequences:
        ids = [int(t) for t in seq]
        _, cache = model.run_with_cache(ids, [last, "hook_final_norm"])
        passes.append(TargetPass(ids, cache[last], cache["hook_final_norm"]))
    return passes


def fit(model, sequences: Sequence[Sequence[int] | TargetPass], steps: int = 300, seed: int = 0,
        pairing: str = "v3", lr: float = 3e-3, gain: float = 30.0, held_out: Sequence[int] | None = None,
        eval_every: int = 100, l2: float = 0.0) -> FittedHead:
    """Fit the head's e_proj and h_proj to the target's own behaviour on `sequences` (token
    ids, e.g. the model's greedy continuations, or their `target_passes`), the rest of the
    head as loaded.

    The objective is the head's residual path: the block's sublayers read RMS-normalised
    inputs, so their outputs have a fixed size, and streams `gain` times larger pass the
    block almost unchanged; the HC collapse and RMSNorm(norm) then give the direction of
    e_proj·a + h_proj·b (a, b the normed embedding and the stream-mean of the normed HC
    state). Adam fits that direction to the target's own final normed vector where the draft
    is checked (divided by the head's norm weights), by mean squared error on unit-RMS
    targets; the head is then evaluated by its real forward (`curve`: teacher-forced
    acceptance on `held_out` every `eval_every` steps).

    `l2` adds a ridge penalty l2 * (|E|^2 + |H|^2) / n_embd on the two maps (0: plain least
    squares). With fewer rows than the maps' 2 * n_embd inputs, or not many more, plain least
    squares interpolates the rows it has and guesses poorly on tokens it has not seen; about
    0.3 is what a few hundred rows of the model's own greedy text need (`notebooks/07_mtp`)."""
    import mlx.optimizers as optim

    if model.mtp is None:
        raise ValueError("fit starts from a loaded MTP head: ds4lab.load(..., mtp=FILE)")
    cfg, head0, s = model.config, model.mtp, SpecConfig(pairing=pairing).offset
    a_rows, b_rows, targets = [], [], []
    for run in sequences:
        run = run if isinstance(run, TargetPass) else target_passes(model, [run])[0]
        n = len(run.ids) - s
        emb = model.weights.token_embd[mx.array(run.ids[s:])].astype(mx.float32)
        a_rows.append(_rms(emb, head0.enorm, cfg.rms_eps))
        b_rows.append(_rms(mx.array(run.hidden[:n]), head0.hnorm, cfg.rms_eps).mean(axis=1))
        y = mx.array(run.final_norm[s: s + n]) / head0.head["output_norm"]
        targets.append(y / mx.sqrt(mx.mean(y * y, axis=1, keepdims=True)))
    a, b, y = (mx.concatenate(x) for x in (a_rows, b_rows, targets))
    key = mx.random.key(seed)
    k1, k2 = mx.random.split(key)
    d = cfg.n_embd
    params = {"e": mx.random.normal((d, d), key=k1) * (0.01 / d ** 0.5),
              "h": mx.random.normal((d, d), key=k2) * (0.01 / d ** 0.5)}

    def loss_fn(p):
        loss = mx.mean(mx.square(a @ p["e"].T + b @ p["h"].T - y))
        if l2:
            loss = loss + l2 * (mx.sum(mx.square(p["e"])) + mx.sum(mx.square(p["h"]))) / d
        return loss

    grad = mx.value_and_grad(loss_fn)
    opt = optim.Adam(learning_rate=lr)
    held = None if held_out is None else [int(t) for t in held_out]
    full = None if held is None else model.session().prefill_all(held)
    choices = None if full is None else np.array(full.logits, dtype=np.float32).argmax(axis=1)
    curve = []
    for step in range(steps + 1):
        if step:
            loss, g = grad(params)
            opt.update(params, g)
            mx.eval(params, opt.state)
        else:
            loss = loss_fn(params)
        row = {"step": step, "loss": float(loss)}
        if full is not None and (step % eval_every == 0 or step == steps):
            head = _with_projections(head0, params, gain)
            row["acceptance"] = _evaluate(model, head, held, full, pairing, choices)
        curve.append(row)
    return FittedHead(_with_projections(head0, params, gain), Path(head0.source), pd.DataFrame(curve), pairing, cfg)


def _rms(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    from .model.numerics import rms_norm

    return rms_norm(x, weight, eps)


def _with_projections(head: MTPHead, params: dict, gain: float) -> MTPHead:
    return dataclasses.replace(head, e_proj=_q8(np.array(params["e"] * gain)), h_proj=_q8(np.array(params["h"] * gain)))


def _evaluate(model, head: MTPHead, ids: list[int], full, pairing: str, choices: np.ndarray) -> float:
    """Teacher-forced greedy acceptance of `head` in place of the model's (restored after):
    `teacher_forced`'s `accepted` at depth 1, without the rest of its frame. `choices`: the
    target's greedy choice at each position (the argmax of `full.logits`)."""
    s = SpecConfig(pairing=pairing).offset
    before, model.mtp = model.mtp, head
    try:
        drafts = _run_head(model, ids, full.hidden, s, 512)[0].argmax(axis=1)
    finally:
        model.mtp = before
    n = min(len(drafts), len(choices) - s)
    return float((drafts[:n] == choices[s: s + n]).mean())
