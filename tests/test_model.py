"""The MLX model on synthetic models of two shapes: prefill = decode, snapshots, routing, shapes."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from ds4lab import gguf, load


@pytest.fixture(scope="module")
def small_model(small_q4_mtp):
    return load(small_q4_mtp[0])


@pytest.fixture(scope="module")
def small_tokens(small_q4_mtp):
    embd = gguf.open(small_q4_mtp[0]).dequantize("token_embd.weight")
    rows = np.flatnonzero(np.abs(embd).sum(axis=1))
    return [int(t) for t in np.random.default_rng(7).choice(rows, size=150)]


def _std(logits: np.ndarray) -> float:
    return float(logits[logits != 0].std())


def test_shapes(small_model, small_tokens):
    cfg = small_model.config
    logits = small_model(small_tokens[:9])
    assert logits.shape == (9, cfg.n_vocab) and logits.dtype == mx.float32
    session = small_model.session()
    assert session.prefill(small_tokens[:5]).shape == (cfg.n_vocab,)
    assert session.decode(small_tokens[5]).shape == (cfg.n_vocab,)
    assert session.tokens == small_tokens[:6]


def test_prefill_equals_token_by_token_decode(small_model, small_tokens, on_cpu):
    # 150 tokens on the small shape: the 16-row window slides, ratio-4 rows pass the
    # indexer's top-4, and a ratio-128 row is emitted at token 128.
    full = np.array(small_model(small_tokens))
    session = small_model.session()
    rows = [np.array(session.decode(t)) for t in small_tokens]
    decoded = np.stack(rows)
    scale = _std(full)
    assert np.abs(full - decoded).max() <= 1e-4 * scale

    chunked = small_model.session()
    last = np.array(chunked.prefill(small_tokens, chunk=37))
    assert np.abs(last - full[-1]).max() <= 1e-4 * scale
    for mine, ref in zip(chunked.state.layers, session.state.layers, strict=False):
        for name in ("raw", "comp", "index_comp"):
            a, b = getattr(mine, name), getattr(ref, name)
            if a is not None:
                assert a.shape == b.shape and np.abs(np.array(a) - np.array(b)).max() <= 2e-3, name
    ratio128 = small_model.config.compress_ratios.index(128)
    assert session.state.layers[ratio128].comp.shape[0] == 1


def test_snapshot_restore(small_model, small_tokens):
    session = small_model.session()
    session.prefill(small_tokens[:60])
    snap = session.snapshot()
    first = [np.array(session.decode(t)) for t in small_tokens[60:66]]
    assert session.state.n_tokens == 66 and snap.n_tokens == 60
    session.restore(snap)
    again = [np.array(session.decode(t)) for t in small_tokens[60:66]]
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=False))
    other = small_model.session(snap)
    assert np.array_equal(np.array(other.decode(small_tokens[60])), first[0])


def test_hash_layers_route_by_token_id(small_model, small_tokens, small_q4_mtp):
    table = gguf.open(small_q4_mtp[0]).dequantize("blk.0.ffn_gate_tid2eid.weight")
    result = small_model.forward(small_model.empty_state(), small_tokens[:20])
    assert np.array_equal(np.array(result.experts[0]), table[small_tokens[:20]])
    biased = np.array(result.experts[1])
    assert biased.shape == (20, small_model.config.n_expert_used)
    assert all(len(set(row)) == len(row) for row in biased)


def test_forced_experts(small_model, small_tokens):
    cfg = small_model.config
    rng = np.random.default_rng(1)
    forced = np.stack([rng.permutation(cfg.n_expert)[: cfg.n_expert_used] for _ in range(12 * cfg.n_layer)])
    forced = forced.reshape(12, cfg.n_layer, cfg.n_expert_used)
    result = small_model.forward(small_model.empty_state(), small_tokens[:12], forced=mx.array(forced))
    for il in range(cfg.n_layer):
        assert np.array_equal(np.array(result.experts[il]), forced[:, il])
    free = np.array(small_model(small_tokens[:12]))
    assert not np.allclose(np.array(small_model(small_tokens[:12], experts=forced)), free)


def test_tiny_shape_runs_both_numerics(tiny_q2):
    tokens = list(range(1000, 1040))
    a = np.array(load(tiny_q2, numerics="float")(tokens))
    b = np.array(load(tiny_q2, numerics="ds4-cpu")(tokens))
    assert a.shape == b.shape == (40, 129280)
    rms = np.sqrt(((a - b) ** 2).mean(axis=1)) / _std(a)
    assert 0 < np.median(rms) < 0.1


def test_restored_snapshot_is_untouched_by_what_followed(small_model, small_tokens):
    def frontiers(session):
        return [np.array(f.kv) for c in session.state.layers for f in (c.frontier, c.index_frontier) if f is not None]

    a = small_model.session()
    a.prefill(small_tokens[:60])
    snap = a.snapshot()
    for t in small_tokens[100:106]:
        a.decode(t)
    a.restore(snap)
    for t in small_tokens[60:63]:
        a.decode(t)
    b = small_model.session()
    b.prefill(small_tokens[:60])
    for t in small_tokens[60:63]:
        b.decode(t)
    assert all(np.array_equal(x, y) for x, y in zip(frontiers(a), frontiers(b), strict=True))


def test_a_layer_caches_copy_holds_every_field():
    # `LayerCache.copy` names its fields (cheaper than dataclasses.replace): a field added to
    # the cache and left out of the copy would come back as its default here.
    import dataclasses

    from ds4lab.model.state import LayerCache

    values = [object() for _ in dataclasses.fields(LayerCache)]
    cache = LayerCache(*values)
    copied = cache.copy()
    assert copied is not cache
    assert [getattr(copied, f.name) for f in dataclasses.fields(LayerCache)] == values


# ---- issue 13: prefill = decode must not depend on the BLAS's kernel choice ------------------
def test_prefill_equals_decode_under_a_slot_dependent_gemm(small_model, small_tokens, monkeypatch, on_cpu):
    # A GEMM whose arithmetic depends on the row's place in its tile (as OpenBLAS's Haswell/Zen
    # SGEMM does for a partial register tile): exaggerated so any misplacement shows.
    from ds4lab.model import linalg

    def uneven(tile, wt):                                     # a tile [16, in], or a stack of them
        return (tile @ wt) * mx.array(1.0 + np.arange(tile.shape[-2], dtype=np.float32)[:, None] * 2.0 ** -12)

    monkeypatch.setattr(linalg, "tile_product", uneven)
    tokens = small_tokens[:40]
    full = np.array(small_model(tokens))
    session = small_model.session()
    decoded = np.stack([np.array(session.decode(t)) for t in tokens])
    assert np.array_equal(full, decoded)
    chunked = small_model.session()
    chunked.prefill(tokens[:7])
    assert np.array_equal(np.array(chunked.prefill(tokens[7:], chunk=13)), full[-1])


def test_prefill_equals_decode_with_openblas_zen_kernels(small_q4_mtp):
    # The case found on AMD EPYC: OpenBLAS 0.3.21 (DYNAMIC_ARCH) picking its Haswell/Zen SGEMM.
    # OPENBLAS_CORETYPE forces that choice on any x86-64 CPU; elsewhere it changes nothing.
    import os
    import subprocess
    import sys

    script = f"""
import ds4lab, numpy as np
from ds4lab import gguf, load
m = load({str(small_q4_mtp[0])!r})
rows = np.flatnonzero(np.abs(gguf.open({str(small_q4_mtp[0])!r}).dequantize("token_embd.weight")).sum(axis=1))
tokens = [int(t) for t in np.random.default_rng(7).choice(rows, size=40)]
full = np.array(m(tokens))
s = m.session()
decoded = np.stack([np.array(s.decode(t)) for t in tokens])
print(float(np.abs(full - decoded).max()))
"""
    for core in ("Zen", "Haswell"):
        out = subprocess.run([sys.executable, "-c", script], env=os.environ | {"OPENBLAS_CORETYPE": core},
                             capture_output=True, text=True, check=True)
        assert float(out.stdout.strip().splitlines()[-1]) == 0.0, core


def test_cpu_attention_per_token_gemms_equal_the_batched_form():
    """The CPU's per-token GEMM attention (keys packed, padded to a multiple of 32 past the
    mask's width) against the GPU's batched form, and a token's bits alone or in a chunk."""
    from ds4lab.model import attention

    rng = np.random.default_rng(3)
    q = mx.array(rng.normal(size=(5, 3, 64)).astype(np.float32))
    keys = mx.array(rng.normal(size=(40, 64)).astype(np.float32))
    mask = mx.array(rng.random((5, 40)) < np.array([0.1, 0.5, 0.9, 1.0, 0.3])[:, None])
    sinks = mx.array(rng.normal(size=3).astype(np.float32))
    per_token = attention.attend(q, keys, mask, sinks, ordered=True)
    batched = attention.attend(q, keys, mask, sinks, ordered=False)
    assert np.abs(np.array(per_token) - np.array(batched)).max() < 1e-5
    alone = attention.attend(q[3:4], keys, mask[3:4], sinks, ordered=True)
    assert np.array_equal(np.array(alone)[0], np.array(per_token)[3])


def test_cpu_sinkhorn_in_numpy_equals_the_mlx_ops():
    """The CPU runs the HC split's Sinkhorn iterations in numpy: bit for bit the MLX ops."""
    from ds4lab.model import hc

    rng = np.random.default_rng(5)
    comb = mx.softmax(mx.array(rng.normal(scale=4.0, size=(2048, 4, 4)).astype(np.float32)), axis=-1) + 1e-6
    ours = hc._sinkhorn(np.array(comb), 20, 1e-6)
    assert ours.dtype == np.float32 and np.array_equal(ours, np.array(hc._sinkhorn(comb, 20, 1e-6)))
