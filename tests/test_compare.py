"""ds4lab.compare, which computes every oracle bar, on a case worked out by hand."""

from __future__ import annotations

import numpy as np
import pytest

from ds4lab.compare import compare_topk, logsumexp, summarize, topk


def test_topk_and_logsumexp_by_hand():
    logits = np.array([[1.0, 3.0, 3.0, -2.0], [0.0, 0.0, 0.0, 0.0]], np.float32)
    ids, vals = topk(logits, 3)
    assert ids.tolist() == [[1, 2, 0], [0, 1, 2]]                     # ties to the lower id
    assert vals.tolist() == [[3.0, 3.0, 1.0], [0.0, 0.0, 0.0]]
    assert logsumexp(logits)[1] == pytest.approx(np.log(4.0), rel=1e-7)
    assert logsumexp(logits)[0] == pytest.approx(np.log(np.e + 2 * np.e ** 3 + np.e ** -2), rel=1e-7)


def test_compare_topk_by_hand():
    # Reference top-2 per position, logit std 2. Position 0: mine agrees, errors (+0.2, -0.2);
    # position 1: mine prefers the reference's second id, errors (-1, +1).
    ref_ids = np.array([[0, 1], [2, 3]], np.int32)
    ref_logits = np.array([[5.0, 4.0], [7.0, 6.5]], np.float32)
    ref_std = np.array([2.0, 2.0], np.float32)
    mine = np.array([[5.2, 3.8, 0.0, 0.0], [0.0, 0.0, 6.0, 7.5]], np.float32)
    table = compare_topk(mine, ref_ids, ref_logits, ref_std)
    assert table["top1_match"].tolist() == [True, False]
    assert table["ref_gap_over_std"].tolist() == pytest.approx([0.5, 0.25])
    assert table["rms_over_std"].tolist() == pytest.approx([0.1, 0.5], rel=1e-6)
    assert table["max_abs_over_std"].tolist() == pytest.approx([0.1, 0.5], rel=1e-6)
    s = summarize(table)
    assert s["top1"] == 0.5 and s["top1_gap_0.05"] == 0.5 and s["top1_gap_0.1"] == 0.5
    assert s["rms_median"] == pytest.approx(0.3, rel=1e-6) and s["rms_max"] == pytest.approx(0.5, rel=1e-6)
    assert s["rms_p90"] == pytest.approx(0.1 + 0.9 * 0.4, rel=1e-6)
