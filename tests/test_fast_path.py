"""The fast path's wiring and plan, on the CPU.

The CUDA kernels themselves only run on a GPU (bench/check_device.py checks each against the
composition it replaces). Here each kernel is replaced by a stand-in that follows the
kernel's documented contract with plain MLX ops (flattened rows, rows sharing a position,
masked keys never read); the model then takes its fast-path branches on the CPU. That checks
what the GPU check cannot isolate: which kernel each step calls, with which arguments and
shapes, and which blocks hooks send to the reference path.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from ds4lab.config import preset
from ds4lab.model import Model, hc, kernels, moe
from ds4lab.model import numerics as nm
from ds4lab.model.random_weights import random_weights
from ds4lab.model.rope import apply_rope_tail


def _row_finish(x, *, eps=None, weight=None, rope=None, inverse=False, qat=False, fp8=False, f16=False):
    d = x.shape[-1]
    rows = x.reshape(-1, d)
    if eps is not None:
        rows = nm.rms_norm(rows, weight, eps)
    n_rot = 0
    if rope is not None:
        cos, sin = rope
        per = rows.shape[0] // cos.shape[0]           # consecutive rows share a position
        rows = apply_rope_tail(rows, mx.repeat(cos, per, axis=0), mx.repeat(sin, per, axis=0), inverse)
        n_rot = 2 * cos.shape[-1]
    if qat:
        rows = nm.indexer_qat(rows)
    if fp8:
        rows = nm.fp8_kv_round(rows, d - n_rot)
    if f16:
        rows = nm.round_f16(rows)
    return rows.reshape(x.shape)


def _hc_pre(streams, mix, scale, base, norm, iters, rms_eps, hc_eps):
    t, n, e = streams.shape
    inv = 1.0 / mx.sqrt(mx.mean(mx.square(streams.reshape(t, -1)), axis=-1, keepdims=True) + rms_eps)
    pre, post, comb = hc._split(mix * inv, scale, base, n, iters, hc_eps)
    return nm.rms_norm((streams * pre[:, :, None]).sum(axis=1), norm, rms_eps), pre, post, comb


def _hc_post(out, streams, post, comb):
    return post[:, :, None] * out[:, None, :] + (comb[:, :, :, None] * streams[:, :, None, :]).sum(axis=1)


def _attention_heads(q, keys, mask, sinks, rope):
    scores = (q @ keys.T) / math.sqrt(q.shape[-1])                               # [T, H, N]
    scores = mx.where(mask[:, None, :], scores, -mx.inf)
    sink = mx.broadcast_to(sinks[None, :, None], (*scores.shape[:2], 1))
    weights = mx.softmax(mx.concatenate([sink, scores], axis=-1), axis=-1)[..., 1:]
    heads = mx.where(mask[:, None, :], weights, 0.0) @ mx.where(mx.any(mask, axis=0)[:, None], keys, 0.0)
    return apply_rope_tail(heads, *rope, inverse=True)


def _indexer_scores(q, w, keys):
    return (mx.maximum(q @ keys.T, 0.0) * w[:, :, None]).sum(axis=1)


def _expert_matvec(tensor, ids, x):
    return (moe._decode(tensor, ids) @ x[:, :, None])[..., 0]


STAND_INS = {"row_finish": _row_finish, "hc_pre": _hc_pre, "hc_post": _hc_post,
             "attention_heads": _attention_heads, "indexer_scores": _indexer_scores, "expert_matvec": _expert_matvec}


@pytest.fixture
def batched(monkeypatch):
    """The GPU's batched schedule on the CPU (no CUDA: the fast path stays off)."""
    monkeypatch.setattr(nm, "batch_invariant_device", lambda: False)


@pytest.fixture
def stand_in_kernels(monkeypatch, batched):
    """CUDA 'ready', every kernel replaced by its stand-in; returns the calls made, by kernel."""
    calls: dict[str, int] = {}

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(kernels, "cuda_ready", lambda: True)
    for name, fn in STAND_INS.items():
        monkeypatch.setattr(kernels, name, counted(name, fn))
    return calls


@pytest.fixture(scope="module")
def small_weights():
    return random_weights(preset("small"), "q2", seed=4)


@pytest.fixture(scope="module")
def tiny_weights():
    return random_weights(preset("tiny"), "q2", seed=5)


def _prefill_and_decode(model: Model, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    full = np.array(model(tokens))
    session = model.session()
    decoded = np.stack([np.array(session.decode(t)) for t in tokens])
    return full, decoded


@pytest.mark.parametrize("weights_fixture", ["small_weights", "tiny_weights"])
def test_fast_path_wiring_matches_the_reference(request, weights_fixture, stand_in_kernels):
    """Every kernel called, with arguments that reproduce the reference composition: prefill and
    decode (the tiny shape's indexer selects once more rows than top-k are visible)."""
    model = Model(request.getfixturevalue(weights_fixture))
    tokens = [(37 * i + 11) % 1000 + 100 for i in range(80)]
    assert model.numerics.fast
    fast_full, fast_decoded = _prefill_and_decode(model, tokens)
    assert set(stand_in_kernels) == set(STAND_INS), f"kernels never called: {set(STAND_INS) - set(stand_in_kernels)}"
    model.numerics.allow_fast = False
    ref_full, ref_decoded = _prefill_and_decode(model, tokens)
    scale = ref_full.std()
    assert np.abs(fast_full - ref_full).max() / scale < 1e-4
    assert np.abs(fast_decoded - ref_decoded).max() / scale < 1e-4


def test_a_hook_off_the_boundaries_sends_only_its_block_to_the_reference(small_weights, stand_in_kernels):
    model = Model(small_weights)
    tokens = [5, 6, 7]
    model(tokens)
    fast_calls = dict(stand_in_kernels)
    stand_in_kernels.clear()
    seen = []
    with model.hooks([("blocks.1.attn.hook_q", lambda act, hook: seen.append(hook.name)),
                      ("blocks.2.ffn.hook_out", lambda act, hook: None)]):
        plan = model.fast_path_plan()
        model(tokens)
    assert seen == ["blocks.1.attn.hook_q"]
    assert list(plan.path) == ["fast", "reference", "fast", "fast", "fast"]
    assert plan.hooks[1] == "blocks.1.attn.hook_q"
    # one block of five on the reference: its two HC inputs and outputs leave the kernels
    assert stand_in_kernels["hc_pre"] == fast_calls["hc_pre"] - 2
    assert stand_in_kernels["hc_post"] == fast_calls["hc_post"] - 2


def test_boundary_hooks_keep_the_fast_path_and_their_replacements_count(small_weights, stand_in_kernels):
    model = Model(small_weights)
    tokens = [5, 6, 7, 8]
    base = np.array(model(tokens))
    boundary = ["blocks.0.hook_resid_pre", "blocks.1.attn.hook_out", "blocks.2.hook_resid_mid",
                "blocks.3.ffn.hook_expert_weights", "blocks.3.ffn.hook_experts", "blocks.4.ffn.hook_out",
                "blocks.4.hook_resid_post"]
    with model.hooks([(name, lambda act, hook: act * 1.5 if hook.name.endswith("attn.hook_out") else None)
                      for name in boundary]):
        plan = model.fast_path_plan()
        steered = np.array(model(tokens))
    assert (plan.path == "fast").all()
    assert np.abs(steered - base).max() > 1e-3 * base.std()
    with model.hooks([("blocks.1.attn.hook_out", lambda act, hook: act * 1.5)]):
        model.numerics.allow_fast = False
        reference = np.array(model(tokens))
    assert np.abs(steered - reference).max() < 1e-4 * base.std()


def test_plan_is_reference_everywhere_off_cuda_and_in_ds4_cpu(small_weights, batched):
    model = Model(small_weights)
    assert (model.fast_path_plan().path == "reference").all()
    assert list(model.fast_path_plan().block) == list(range(model.config.n_layer))


def test_plan_in_ds4_cpu_numerics_is_reference(small_weights, stand_in_kernels):
    assert (Model(small_weights, numerics="ds4-cpu").fast_path_plan().path == "reference").all()
    assert (Model(small_weights).fast_path_plan().path == "fast").all()
