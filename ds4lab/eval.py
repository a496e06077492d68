"""Score a logprob dump (ds4's `--dump-logprobs` or ds4lab's) against an official API vector.

The official vectors (`../shared/vectors/official/*.official.json`) hold, per generated
step, the chosen token and its top-20 alternatives with log-probs, tokens given as bytes.
Both sides name tokens by their bytes, so the comparison needs no shared vocabulary ids.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pandas as pd


def _load(source: str | os.PathLike[str] | dict) -> dict:
    if isinstance(source, dict):
        return source
    with open(source, encoding="utf-8") as fh:
        return json.load(fh)


def _key(token: dict) -> bytes:
    return bytes(token["bytes"])


def compare_vectors(dump: str | os.PathLike[str] | dict, official: str | os.PathLike[str] | dict) -> pd.DataFrame:
    """One row per step both sides have: whether the chosen tokens agree, how many of the
    official top-k the dump also ranks in its top-k, and the mean |Δ logprob| over those."""
    mine, ref = _load(dump), _load(official)
    rows = []
    for ours, theirs in zip(mine["steps"], ref["steps"], strict=False):
        our_lp = {_key(t["token"]): t["logprob"] for t in ours["top_logprobs"]}
        ref_lp = {_key(t["token"]): t["logprob"] for t in theirs["top_logprobs"] if t["logprob"] > -9000}
        shared = [k for k in ref_lp if k in our_lp]
        rows.append({
            "step": int(theirs["step"]),
            "official_token": _key(theirs["token"]).decode("utf-8", errors="replace"),
            "dump_token": _key(ours["selected"]).decode("utf-8", errors="replace"),
            "top1_match": _key(ours["selected"]) == _key(theirs["token"]),
            "topk_overlap": len(shared) / max(len(ref_lp), 1),
            "mean_abs_logprob_diff": float(np.mean([abs(our_lp[k] - ref_lp[k]) for k in shared]))
            if shared else float("nan"),
        })
    return pd.DataFrame(rows)
