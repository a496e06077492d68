"""Compare logits with a reference's top-k (ds4.c's oracle, another build, another numerics).

One row per position: whether the top-1 ids agree, the reference's top-1/top-2 gap, and
the error on the reference's top-k ids, all in units of the reference logit std so that
positions and models compare. `summarize` gives the figures ds4lab's bars are stated in.
"""

from __future__ import annotations

import numpy as np
import pandas as pd


def topk(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k largest logits per row, descending, ties to the lower id: (ids int32, values float32)."""
    logits = np.asarray(logits, dtype=np.float32)
    ids = np.argsort(-logits, axis=-1, kind="stable")[..., :k].astype(np.int32)
    return ids, np.take_along_axis(logits, ids, axis=-1)


def logsumexp(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64)
    top = x.max(axis=-1, keepdims=True)
    return (top[..., 0] + np.log(np.exp(x - top).sum(axis=-1))).astype(np.float32)


def compare_topk(mine: np.ndarray, ref_ids: np.ndarray, ref_logits: np.ndarray,
                 ref_std: np.ndarray) -> pd.DataFrame:
    """Per position: top-1 agreement and the error on the reference's top-k ids over its logit std."""
    mine = np.asarray(mine, dtype=np.float32)
    at_ref = np.take_along_axis(mine, ref_ids, axis=-1)
    err = (at_ref - ref_logits) / ref_std[:, None]
    return pd.DataFrame({
        "position": np.arange(len(mine)),
        "top1_ref": ref_ids[:, 0],
        "top1_mine": mine.argmax(axis=-1).astype(np.int32),
        "ref_gap_over_std": (ref_logits[:, 0] - ref_logits[:, 1]) / ref_std,
        "rms_over_std": np.sqrt((err ** 2).mean(axis=-1)),
        "max_abs_over_std": np.abs(err).max(axis=-1),
    }).assign(top1_match=lambda df: df["top1_ref"] == df["top1_mine"])


def summarize(df: pd.DataFrame) -> dict[str, float]:
    """Top-1 agreement overall and away from near-ties; rms error median, p90 and max."""
    return {
        "top1": float(df["top1_match"].mean()),
        "top1_gap_0.05": float(df.loc[df["ref_gap_over_std"] > 0.05, "top1_match"].mean()),
        "top1_gap_0.1": float(df.loc[df["ref_gap_over_std"] > 0.1, "top1_match"].mean()),
        "rms_median": float(df["rms_over_std"].median()),
        "rms_p90": float(df["rms_over_std"].quantile(0.9)),
        "rms_max": float(df["rms_over_std"].max()),
    }
