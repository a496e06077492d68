"""The model against ds4.c's own CPU path on the tiny-a oracle (../shared/oracle/tiny-a).

Tiny random models amplify rounding: two correct ds4 builds agree on top-1 at only 93%
(3.5% median rms/std) with routing forced. The bars below are the issue's: just outside
that spread and inside what a missing rounding step costs.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from ds4lab import load
from ds4lab.compare import compare_topk, summarize

ORACLE = Path(__file__).resolve().parents[2] / "shared" / "oracle" / "tiny-a"


@pytest.fixture(scope="module")
def oracle():
    return dict(np.load(ORACLE / "oracle.npz"))


def _run(path, oracle, numerics, forced):
    model = load(path, numerics=numerics)
    tokens = [int(t) for t in oracle["tokens"]]
    result = model.forward(model.empty_state(), tokens,
                           forced=mx.array(oracle["experts"]) if forced else None)
    experts = np.stack([np.array(e) for e in result.experts], axis=1)
    table = compare_topk(np.array(result.logits), oracle["topk_ids"], oracle["topk_logits"], oracle["logit_std"])
    return summarize(table), experts, model, result


def test_ds4_cpu_numerics_with_ds4s_experts(tiny_a_gguf, oracle):
    s, experts, _, _ = _run(tiny_a_gguf, oracle, "ds4-cpu", forced=True)
    print(s)
    assert np.array_equal(experts, oracle["experts"])
    assert s["top1"] >= 0.90 and s["top1_gap_0.05"] >= 0.97 and s["top1_gap_0.1"] >= 0.995
    assert s["rms_median"] <= 0.045 and s["rms_p90"] <= 0.06 and s["rms_max"] <= 0.10


def test_ds4_cpu_numerics_free_routing(tiny_a_gguf, oracle):
    s, experts, model, result = _run(tiny_a_gguf, oracle, "ds4-cpu", forced=False)
    print(s)
    assert s["top1"] >= 0.85 and s["rms_median"] <= 0.05
    cfg = model.config
    ref, margin = oracle["experts"], oracle["expert_margin"]
    for il in range(cfg.n_layer):
        same = np.array([set(a) == set(b) for a, b in zip(experts[:, il], ref[:, il], strict=True)])
        if il < cfg.n_hash_layer:
            assert same.all(), f"hash layer {il} must choose exactly ds4's experts"
        else:
            confident = margin[:, il] >= 0.1
            print(f"layer {il}: same set {same.mean():.3f}, where margin >= 0.1: {same[confident].mean():.3f}")
            assert same[confident].all(), f"layer {il} differs from ds4 where its margin is >= 0.1"

    # Greedy continuation from the prompt: equal up to the first step whose ds4 top-2 margin is under 0.2.
    session = model.session(result.state)
    gaps = oracle["gen_topk_logits"][:, 0] - oracle["gen_topk_logits"][:, 1]
    logits = np.array(result.logits[-1])
    for k, want in enumerate(oracle["gen_ids"]):
        if gaps[k] < 0.2:
            break
        assert int(np.argmax(logits)) == int(want), f"greedy step {k}"
        logits = np.array(session.decode(int(want)))


def test_float_numerics(tiny_a_gguf, oracle):
    s, _, _, _ = _run(tiny_a_gguf, oracle, "float", forced=True)
    print(s)
    assert s["top1"] >= 0.75 and s["rms_median"] <= 0.10


def test_full_rows_and_logsumexp(tiny_a_gguf, oracle):
    model = load(tiny_a_gguf, numerics="ds4-cpu")
    logits = np.array(model(oracle["tokens"], experts=oracle["experts"]))
    rows = oracle["full_positions"]
    for row, ref in zip(logits[rows], oracle["full_logits"], strict=True):
        scale = ref[oracle["output_rows"]].std()
        assert np.sqrt(((row - ref) ** 2).mean()) / scale < 0.1
        assert np.array_equal(row == 0, ref == 0)
    lse = np.log(np.exp(logits.astype(np.float64) - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
    assert np.median(np.abs(lse - oracle["logsumexp"]) / oracle["logit_std"]) < 0.05
