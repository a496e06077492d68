"""The model against ds4.c's own CPU path on the tiny-a oracle (../shared/oracle/tiny-a).

Tiny random models amplify rounding: two correct ds4 builds agree on top-1 at only 93%
(3.5% median rms/std) with routing forced, and one with a few logging calls added (a
-ffast-math code-generation change) at 97.7% / 0.96% median rms/std. The model issue's bars
sit just outside the first spread; the bars written "measured - spread" below are this
model's measured figure moved by the logging build's spread (2.3 points of top-1, 0.0096 of
rms/std), so a change that costs more than ds4's own bit-level noise fails.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ds4lab import load
from ds4lab.compare import compare_topk, logsumexp, summarize
from ds4lab.hooks import ActivationCache
from ds4lab.interventions import force_experts

ORACLE = Path(__file__).resolve().parents[2] / "shared" / "oracle" / "tiny-a"
TOP1_SPREAD, RMS_SPREAD = 0.023, 0.0096      # the logging build vs the reference build


@pytest.fixture(scope="module")
def oracle():
    return dict(np.load(ORACLE / "oracle.npz"))


def _run(path, oracle, numerics, forced, gen=False):
    """Teacher-forced run of the prompt (then, with `gen`, of ds4's greedy ids, routing free),
    caching the router scores and experts of every layer."""
    model = load(path, numerics=numerics)
    cfg = model.config
    pins = [p for il in range(cfg.n_layer) for p in force_experts(il, oracle["experts"][:, il])] if forced else []
    cache = ActivationCache()
    points = [(lambda n: n.endswith(("ffn.hook_router_probs", "ffn.hook_experts")), cache.record)]
    session = model.session()
    with model.hooks(pins + points):
        result = session.prefill_all([int(t) for t in oracle["tokens"]])
    logits = np.array(result.logits)
    gen_logits = [logits[-1]]
    if gen:
        with model.hooks(points):
            gen_logits += [np.array(session.decode(int(t))) for t in oracle["gen_ids"][:-1]]
    experts = np.stack([np.array(e) for e in result.experts], axis=1)
    table = compare_topk(logits, oracle["topk_ids"], oracle["topk_logits"], oracle["logit_std"])
    return {"summary": summarize(table), "logits": logits, "experts": experts, "model": model,
            "gen_logits": np.stack(gen_logits), "cache": cache}


@pytest.fixture(scope="module")
def forced(tiny_a_gguf, oracle):
    return _run(tiny_a_gguf, oracle, "ds4-cpu", forced=True, gen=True)


@pytest.fixture(scope="module")
def forced_float(tiny_a_gguf, oracle):
    return _run(tiny_a_gguf, oracle, "float", forced=True)


def test_ds4_cpu_numerics_with_ds4s_experts(forced, forced_float, oracle):
    s = forced["summary"]
    print(s)
    assert np.array_equal(forced["experts"], oracle["experts"])
    assert s["top1"] >= 0.90 and s["top1_gap_0.05"] >= 0.97 and s["top1_gap_0.1"] >= 0.995
    assert s["rms_median"] <= 0.045 and s["rms_p90"] <= 0.06 and s["rms_max"] <= 0.10
    # ds4's activation roundings must show: the same run without them is clearly further away
    # (measured 0.029 vs 0.036), so ds4-cpu cannot pass as float or float as ds4-cpu.
    assert s["rms_median"] <= 0.9 * forced_float["summary"]["rms_median"]


def test_float_numerics(forced_float):
    s = forced_float["summary"]
    print(s)
    # measured 0.929 / 0.036
    assert s["top1"] >= 0.929 - TOP1_SPREAD and s["rms_median"] <= 0.036 + RMS_SPREAD


def test_full_rows_and_logsumexp(forced, oracle):
    logits, live = forced["logits"], oracle["output_rows"]
    for row, ref in zip(logits[oracle["full_positions"]], oracle["full_logits"], strict=True):
        # on the live rows only: the other 121,088 are zero in both and would dilute the mean
        rms = np.sqrt(((row[live] - ref[live]) ** 2).mean()) / ref[live].std()
        assert rms <= 0.048 + RMS_SPREAD                                 # measured max 0.048
        assert np.array_equal(row == 0, ref == 0)
    err = np.abs(logsumexp(logits) - oracle["logsumexp"]) / oracle["logit_std"]
    assert np.median(err) <= 0.0014 + 0.0016 and err.max() <= 0.0097 + RMS_SPREAD   # measured 0.0013 / 0.0097


def test_router_scores_are_ds4s(forced, oracle):
    cfg = forced["model"].config
    n = len(oracle["tokens"])
    for il in range(cfg.n_hash_layer, cfg.n_layer):
        probs = forced["cache"][f"blocks.{il}.ffn.hook_router_probs"]
        for mine, ref in ((probs[:n], oracle["router_probs"][:, il]),
                          (probs[n:], oracle["gen_router_probs"][:, il])):
            rel = np.abs(mine - ref) / np.abs(ref)
            # measured (prompt, layers 3-5): median 0.4-0.6%, p99 2.0-2.6%
            assert np.median(rel) <= 0.01 and np.quantile(rel, 0.99) <= 0.04, il
    assert np.isnan(oracle["router_probs"][:, : cfg.n_hash_layer]).all()


def test_greedy_steps_teacher_forced(forced, oracle):
    # Fed ds4's own greedy ids: every step whose ds4 top-2 gap is at least 0.2 picks ds4's
    # token (13 of 16; near-ties skipped), and where ds4's routing margin is >= 0.1 the
    # free routing of the fed tokens picks ds4's experts.
    gaps = oracle["gen_topk_logits"][:, 0] - oracle["gen_topk_logits"][:, 1]
    clear = gaps >= 0.2
    assert clear.sum() == 13
    assert (forced["gen_logits"].argmax(axis=1)[clear] == oracle["gen_ids"][clear]).all()
    s = summarize(compare_topk(forced["gen_logits"], oracle["gen_topk_ids"], oracle["gen_topk_logits"],
                               oracle["gen_logit_std"]))
    assert s["rms_median"] <= 0.033 + RMS_SPREAD                         # measured 0.033
    cfg, n = forced["model"].config, len(oracle["tokens"])
    for il in range(cfg.n_layer):
        mine = forced["cache"][f"blocks.{il}.ffn.hook_experts"][n:]
        same = np.array([set(a) == set(b) for a, b in zip(mine, oracle["gen_experts"][:, il], strict=True)])
        sure = np.ones(len(same), bool) if il < cfg.n_hash_layer else oracle["gen_expert_margin"][:, il] >= 0.1
        assert same[sure].all(), il


def test_ds4_cpu_numerics_free_routing(tiny_a_gguf, oracle):
    run = _run(tiny_a_gguf, oracle, "ds4-cpu", forced=False)
    s, experts, cfg = run["summary"], run["experts"], run["model"].config
    print(s)
    assert s["top1"] >= 0.85 and s["rms_median"] <= 0.05
    ref, margin = oracle["experts"], oracle["expert_margin"]
    for il in range(cfg.n_layer):
        same = np.array([set(a) == set(b) for a, b in zip(experts[:, il], ref[:, il], strict=True)])
        if il < cfg.n_hash_layer:
            assert same.all(), f"hash layer {il} must choose exactly ds4's experts"
        else:
            confident = margin[:, il] >= 0.1
            print(f"layer {il}: same set {same.mean():.3f}, where margin >= 0.1: {same[confident].mean():.3f}")
            assert same[confident].all(), f"layer {il} differs from ds4 where its margin is >= 0.1"
