"""The CPU's native Q8_0 kernel (kernels/cpu/q8_0_matmul.c): the documented order of its sums,
bit for bit; rows that do not depend on their batch or the thread count; the model's use of it."""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest

from ds4lab.model import cpu_kernels
from ds4lab.model.weights import Q8Matrix


def random_q8(rows: int, cols: int, seed: int = 0) -> tuple[Q8Matrix, np.ndarray, np.ndarray]:
    """A Q8_0 matrix from random GGUF blocks, with its int8 codes and float32 scales."""
    rng = np.random.default_rng(seed)
    q = rng.integers(-128, 128, (rows, cols // 32, 32), dtype=np.int8)
    d = (rng.random((rows, cols // 32)) * 0.02 + 1e-4).astype(np.float16)
    raw = np.concatenate([d[..., None].view(np.uint8), q.view(np.uint8)], axis=-1)
    return Q8Matrix.from_blocks(raw.reshape(-1), rows, cols), q, d.astype(np.float32)


def documented_order(q: np.ndarray, d: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The kernel's header, step by step in float32: per block p[l] = sum_k q·x over the four
    8-lane slices in order, acc[l] += d·p[l], then the fixed tree over the eight lanes."""
    f = np.float32
    qf = q.astype(f)                                             # [rows, blocks, 32], exact
    xb = x.astype(f).reshape(x.shape[0], 1, -1, 32)              # [T, 1, blocks, 32]
    acc = np.zeros((x.shape[0], q.shape[0], 8), f)
    for b in range(q.shape[1]):
        p = qf[None, :, b, 0:8] * xb[:, :, b, 0:8]
        for k in range(1, 4):
            p = p + qf[None, :, b, 8 * k:8 * k + 8] * xb[:, :, b, 8 * k:8 * k + 8]
        acc = acc + d[None, :, b, None] * p
    a = acc
    return ((a[..., 0] + a[..., 4]) + (a[..., 2] + a[..., 6])) + ((a[..., 1] + a[..., 5]) + (a[..., 3] + a[..., 7]))


@pytest.mark.parametrize("rows,cols,tokens", [(37, 64, 1), (300, 96, 7), (5, 256, 9), (1030, 32, 4)])
def test_sums_follow_the_documented_order_bit_for_bit(rows, cols, tokens):
    matrix, q, d = random_q8(rows, cols, seed=rows)
    x = np.random.default_rng(1).standard_normal((tokens, cols)).astype(np.float32) * 3
    y = np.array(cpu_kernels.q8_0_matmul(matrix.codes, matrix.scales, mx.array(x)))
    assert y.shape == (tokens, rows)
    np.testing.assert_array_equal(y, documented_order(q, d, x))
    exact = x.astype(np.float64) @ (q.astype(np.float64) * d[..., None].astype(np.float64)).reshape(rows, cols).T
    assert np.abs(y - exact).max() <= 1e-5 * np.abs(exact).max()


def test_a_row_does_not_depend_on_its_batch_or_the_thread_count():
    rows, cols = 2051, 128
    matrix, _, _ = random_q8(rows, cols)
    x = np.random.default_rng(2).standard_normal((11, cols)).astype(np.float32)
    batch = np.array(cpu_kernels.q8_0_matmul(matrix.codes, matrix.scales, mx.array(x)))
    for t in range(11):
        alone = np.array(cpu_kernels.q8_0_matmul(matrix.codes, matrix.scales, mx.array(x[t:t + 1])))
        np.testing.assert_array_equal(alone[0], batch[t])
    lib = cpu_kernels._library()
    codes = np.ascontiguousarray(np.asarray(matrix.codes).view(np.uint8))
    scales = np.ascontiguousarray(np.asarray(matrix.scales))
    for threads in (1, 3, 16):
        y = np.empty((11, rows), np.float32)
        assert lib.ds4lab_q8_0_matmul(codes.ctypes.data, scales.ctypes.data, x.ctypes.data, y.ctypes.data,
                                      rows, cols, 11, threads) == 0
        np.testing.assert_array_equal(y, batch)
    y = np.empty((1, rows), np.float32)
    assert lib.ds4lab_q8_0_matmul(codes.ctypes.data, scales.ctypes.data, x.ctypes.data, y.ctypes.data,
                                  rows, cols - 1, 1, 1) == -1


def test_shapes_are_checked():
    matrix, _, _ = random_q8(8, 64)
    with pytest.raises(ValueError, match="does not split"):
        cpu_kernels.q8_0_matmul(matrix.codes, matrix.scales, mx.zeros((2, 32)))
    with pytest.raises(ValueError, match="does not split"):     # the right size, the wrong rows
        cpu_kernels.q8_0_matmul(matrix.codes, matrix.scales, mx.zeros((4, 32)), shape=(2, 8))
    with pytest.raises(ValueError, match="Q8_0 matrix"):
        cpu_kernels.q8_0_matmul(matrix.codes[:4], matrix.scales, mx.zeros((2, 64)))


# ---- the HC input and the routed experts ----------------------------------------------------
def _hc_inputs(t: int, n: int, width: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    streams = mx.array(rng.standard_normal((t, n, width)).astype(np.float32))
    fn = mx.array((rng.standard_normal((2 * n + n * n, n * width)) * 0.05).astype(np.float32))
    scale = mx.array(np.array([0.7, 1.3, 0.9], np.float32))
    base = mx.array((rng.standard_normal(2 * n + n * n) * 0.3).astype(np.float32))
    norm = mx.array((1 + rng.standard_normal(width) * 0.1).astype(np.float32))
    return streams, fn, scale, base, norm


@pytest.mark.parametrize("t,n,width", [(5, 4, 256), (3, 2, 64)])
def test_hc_input_matches_the_composition_and_not_its_batch(t, n, width, on_cpu):
    from ds4lab.model import hc
    from ds4lab.model.numerics import Numerics

    streams, fn, scale, base, norm = _hc_inputs(t, n, width)
    pre, post, comb = cpu_kernels.hc_control(streams, fn, scale, base, 20, 1e-6, 1e-6)
    ref = hc.hc_control(streams, fn, scale, base, 20, 1e-6, 1e-6, Numerics("float").schedule(np.arange(t)))
    for mine, theirs in ((pre, ref.pre), (post, ref.post), (comb, ref.comb)):
        assert np.abs(np.array(mine) - np.array(theirs)).max() <= 1e-5
    c = np.array(comb)                          # Sinkhorn: rows and columns near 1
    assert np.abs(c.sum(axis=1) - 1).max() < 1e-3 and np.abs(c.sum(axis=2) - 1).max() < 1e-3
    x = cpu_kernels.hc_collapse_norm(streams, pre, norm, 1e-6)
    want = np.array(ref.pre)[:, :, None] * np.array(streams)
    want = want.sum(axis=1)
    want = want / np.sqrt((want ** 2).mean(axis=1, keepdims=True) + 1e-6) * np.array(norm)
    assert np.abs(np.array(x) - want).max() <= 1e-5 * np.abs(want).max()
    for i in range(t):                          # a token alone: the same bits
        alone = cpu_kernels.hc_control(streams[i:i + 1], fn, scale, base, 20, 1e-6, 1e-6)
        for a, b in zip(alone, (pre, post, comb), strict=True):
            np.testing.assert_array_equal(np.array(a)[0], np.array(b)[i])
        np.testing.assert_array_equal(np.array(cpu_kernels.hc_collapse_norm(streams[i:i + 1], pre[i:i + 1], norm,
                                                                            1e-6))[0], np.array(x)[i])
    with pytest.raises(ValueError, match="do not fit"):
        cpu_kernels.hc_control(streams, fn[1:], scale, base, 20, 1e-6, 1e-6)
    out, add = x, mx.array(np.random.default_rng(1).standard_normal((t, width)).astype(np.float32))
    new = cpu_kernels.hc_expand(out, streams, post, comb, add)
    s64, c64 = np.array(streams, np.float64), np.array(comb, np.float64)
    want = np.array(post, np.float64)[:, :, None] * (np.array(out, np.float64) + np.array(add))[:, None, :]
    want = want + np.einsum("tac,tad->tcd", c64, s64)             # stream c takes comb[a, c] of stream a
    assert np.abs(np.array(new) - want).max() <= 1e-5 * np.abs(want).max()
    for i in range(t):
        alone = cpu_kernels.hc_expand(out[i:i + 1], streams[i:i + 1], post[i:i + 1], comb[i:i + 1], add[i:i + 1])
        np.testing.assert_array_equal(np.array(alone)[0], np.array(new)[i])


def _experts(n_expert: int, d: int, n_ff: int, t: int, u: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    gate, up = (mx.array((rng.standard_normal((n_expert, n_ff, d)) * 0.1).astype(np.float32)) for _ in range(2))
    down = mx.array((rng.standard_normal((n_expert, d, n_ff)) * 0.1).astype(np.float32))
    x = mx.array(rng.standard_normal((t, d)).astype(np.float32))
    ids = np.stack([rng.choice(n_expert, u, replace=False) for _ in range(t)]).astype(np.int32)
    weights = mx.array(rng.random((t, u)).astype(np.float32))
    return gate, up, down, x, mx.array(ids), weights


def test_routed_experts_match_the_per_expert_sum_and_not_their_batch():
    from ds4lab.model.moe import swiglu

    gate, up, down, x, ids, weights = _experts(8, 64, 96, t=7, u=3)
    gate, up, down = ((a, "F32") for a in (gate, up, down))
    y, mid = cpu_kernels.routed_experts(gate, up, down, x, ids, weights, clamp=1.5, want_mid=True)
    g, v, dn, xs, e, w = (np.array(a, dtype=np.float64) for a in (gate[0], up[0], down[0], x, ids, weights))
    for t in range(7):
        total = np.zeros(64)
        for s in range(3):
            k = int(e[t, s])
            want_mid = np.array(swiglu(mx.array(g[k] @ xs[t], mx.float32), mx.array(v[k] @ xs[t], mx.float32), 1.5),
                                np.float64) * w[t, s]
            assert np.abs(np.array(mid)[t, s] - want_mid).max() <= 1e-5 * max(1.0, np.abs(want_mid).max())
            total += dn[k] @ want_mid
        assert np.abs(np.array(y)[t] - total).max() <= 1e-5 * max(1.0, np.abs(total).max())
    alone = [np.array(cpu_kernels.routed_experts(gate, up, down, x[t:t + 1], ids[t:t + 1], weights[t:t + 1],
                                                 1.5)[0])[0] for t in range(7)]
    np.testing.assert_array_equal(np.stack(alone), np.array(y))
    bad = np.array(ids)
    bad[2, 1] = 8                               # an expert that does not exist
    with pytest.raises(ValueError, match="out of range"):
        cpu_kernels.routed_experts(gate, up, down, x, mx.array(bad), weights, 1.5)


def test_swiglu_matches_the_composition_and_clamps():
    from ds4lab.model.moe import swiglu

    rng = np.random.default_rng(3)
    gate, up = (mx.array((rng.standard_normal((4, 300)) * 8).astype(np.float32)) for _ in range(2))
    for clamp in (0.0, 5.0):
        native = np.array(cpu_kernels.swiglu(gate, up, clamp))
        composed = np.array(swiglu(gate, up, clamp))
        assert np.abs(native - composed).max() <= 2e-6 * np.abs(composed).max()
    g = np.minimum(np.array(gate, np.float64), 5.0)
    want = g / (1 + np.exp(-g)) * np.clip(np.array(up, np.float64), -5.0, 5.0)
    assert np.abs(native - want).max() <= 2e-6 * np.abs(want).max()
    with pytest.raises(ValueError, match="differ"):
        cpu_kernels.swiglu(gate, up[:, :10], 1.0)


# Bytes per block and where its f16 scales lie, per type.
_BLOCKS = {"IQ2_XXS": (66, (0,)), "Q2_K": (84, (80, 82)), "Q4_K": (144, (0, 2))}


def _random_blocks(type_name: str, n_expert: int, rows: int, cols: int, rng) -> np.ndarray:
    """Random bytes in a block format (every code, sign and scale pattern), with normal f16
    scales of either sign and one subnormal one."""
    size, scale_at = _BLOCKS[type_name]
    blocks = rng.integers(0, 256, (n_expert * rows * cols // 256, size), dtype=np.uint8)
    for at in scale_at:
        d = (rng.standard_normal(len(blocks)) * 0.01).astype(np.float16)
        d[3] = np.float16(3e-6)                                      # subnormal in f16
        blocks[:, at:at + 2] = d.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n_expert, -1)


@pytest.mark.parametrize("gate_type,down_type", [("IQ2_XXS", "Q2_K"), ("Q4_K", "Q4_K"), ("Q2_K", "IQ2_XXS")])
def test_routed_experts_in_blocks_equal_the_decoded_experts_bit_for_bit(gate_type, down_type):
    """Read in their blocks, the experts give the bits of the same experts decoded to float32
    (ds4lab's decoders) and read as floats, whose sums the test above checks; so prefill and
    decode, which both read blocks, agree with each other as they did."""
    from ds4lab.quants.numpy_decode import dequantize

    rng = np.random.default_rng(7)
    n_expert, d, n_ff, t, u = 5, 512, 256, 6, 3
    raw = {"gate": _random_blocks(gate_type, n_expert, n_ff, d, rng),
           "up": _random_blocks(gate_type, n_expert, n_ff, d, rng),
           "down": _random_blocks(down_type, n_expert, d, n_ff, rng)}
    types = {"gate": gate_type, "up": gate_type, "down": down_type}
    shapes = {"gate": (n_expert, n_ff, d), "up": (n_expert, n_ff, d), "down": (n_expert, d, n_ff)}
    blocks = [(mx.array(raw[k]), types[k]) for k in ("gate", "up", "down")]
    decoded = [(mx.array(dequantize(raw[k], types[k], shapes[k])), "F32") for k in ("gate", "up", "down")]
    x = mx.array(rng.standard_normal((t, d)).astype(np.float32))
    ids = mx.array(np.stack([rng.choice(n_expert, u, replace=False) for _ in range(t)]).astype(np.int32))
    weights = mx.array(rng.random((t, u)).astype(np.float32))
    y_blocks, mid_blocks = cpu_kernels.routed_experts(*blocks, x, ids, weights, 0.0, want_mid=True)
    y_floats, mid_floats = cpu_kernels.routed_experts(*decoded, x, ids, weights, 0.0, want_mid=True)
    assert np.abs(np.array(y_floats)).max() > 0
    np.testing.assert_array_equal(np.array(mid_blocks), np.array(mid_floats))
    np.testing.assert_array_equal(np.array(y_blocks), np.array(y_floats))
    with pytest.raises(ValueError, match="does not hold"):               # a byte count that is not the shape's
        cpu_kernels.routed_experts((mx.array(raw["gate"][:, :-2]), gate_type), *blocks[1:], x, ids, weights, 0.0)


def test_the_model_takes_the_native_kernels_on_the_cpu(tiny_q2, monkeypatch, on_cpu):
    """They are used (a spy counts them), hook replacements still apply, and the logits agree
    with the MLX compositions and the BLAS (the kernels turned off), the same edit moving both alike."""
    import ds4lab

    model = ds4lab.load(tiny_q2)
    assert model.weights.output.float32 is None           # read in its codes, never decoded
    # the routed experts read in their blocks: no float32 copy kept (16x the q2 file's bytes)
    assert all(e.float32 is None for layer in model.weights.layers for e in layer.experts.values())
    tokens = list(range(2000, 2012))
    calls = {"hc_control": 0, "routed_experts": 0, "q8_0_matmul": 0, "row_finish": 0, "attention": 0, "swiglu": 0,
             "linear": 0, "compress_chunk": 0, "indexer_scores": 0, "indexer_select": 0}
    for name in calls:
        real = getattr(cpu_kernels, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(cpu_kernels, name, spy)
    native = np.array(model.session().prefill_all(tokens).logits)
    cfg = model.config
    assert calls["hc_control"] == 2 * cfg.n_layer and calls["routed_experts"] == cfg.n_layer
    assert calls["attention"] == calls["swiglu"] == cfg.n_layer
    # the compressors' two projections per compressed layer (the indexer's too), the indexer's queries and weights
    assert calls["linear"] >= 2 * sum(1 for r in cfg.compress_ratios if r)
    assert calls["compress_chunk"] == sum(1 + (r == 4) for r in cfg.compress_ratios if r)   # the indexer's own
    # q_a, q_b, kv, the grouped output (one call), output_b, the shared expert's three; the head
    assert calls["q8_0_matmul"] == 8 * cfg.n_layer + 1 and calls["row_finish"] > 3 * cfg.n_layer
    assert calls["indexer_scores"] == calls["indexer_select"] == 0        # no more rows than it keeps
    model.session().prefill_all(list(range(2000, 2000 + 4 * cfg.indexer_top_k + 8)))
    assert calls["indexer_scores"] == calls["indexer_select"] == sum(r == 4 for r in cfg.compress_ratios)
    rolled = [("blocks.1.ffn.hook_hc_pre", lambda x, hook: mx.roll(x, 1, axis=-1))]   # another stream mix
    with model.hooks(rolled):
        edited = np.array(model.session().prefill_all(tokens).logits)
    assert np.abs(edited - native).max() > 1e-3 * native.std()
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    composed = np.array(model.session().prefill_all(tokens).logits)
    with model.hooks(rolled):
        composed_edit = np.array(model.session().prefill_all(tokens).logits)
    # Another float order: ds4's FP8 rounding of cached KV rows turns 1e-7 differences into whole
    # FP8 steps on a tiny random model (measured: 1e-5 of the std at the first token, then ~1e-2).
    assert np.abs(native - composed).max() <= 3e-2 * composed.std()
    assert (native.argmax(axis=1) == composed.argmax(axis=1)).mean() >= 0.9
    assert np.abs((edited - native) - (composed_edit - composed)).max() <= 0.1 * np.abs(edited - native).max()


# ---- attention ---------------------------------------------------------------------------
def _attention_inputs(t: int, h: int, d: int, n_raw: int, n_comp: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((t, h, d)).astype(np.float32)
    keys = rng.standard_normal((n_raw, d)).astype(np.float32)
    comp = rng.standard_normal((n_comp, d)).astype(np.float32)
    mask = rng.random((t, n_raw + n_comp)) < 0.6
    mask[0] = False                                  # a token that sees nothing: the sink alone
    sinks = rng.standard_normal(h).astype(np.float32)
    return q, keys, comp, mask, sinks


def _attention_float64(q, keys, comp, mask, sinks):
    rows = np.concatenate([keys, comp]).astype(np.float64)
    scores = np.einsum("thd,nd->thn", q.astype(np.float64), rows) / np.sqrt(q.shape[-1])
    scores = np.where(mask[:, None, :], scores, -np.inf)
    top = np.maximum(scores.max(axis=-1), sinks[None, :])
    w = np.exp(scores - top[..., None])
    return (w @ rows) / (np.exp(sinks[None, :] - top) + w.sum(axis=-1))[..., None]


@pytest.mark.parametrize("t,h,d,n_raw,n_comp", [(5, 8, 256, 40, 9), (3, 6, 192, 16, 0), (9, 2, 64, 130, 33)])
def test_attention_matches_float64_and_not_its_batch(t, h, d, n_raw, n_comp, on_cpu):
    """Softmax with sinks over the visible keys (raw rows, then compressed rows): float64's
    values; a token alone, in its batch or on more threads gives the same bits; keys a token
    cannot see never reach its output."""
    q, keys, comp, mask, sinks = _attention_inputs(t, h, d, n_raw, n_comp, seed=d)
    c = mx.array(comp) if n_comp else None
    out = np.array(cpu_kernels.attention(mx.array(q), mx.array(keys), c, mx.array(mask), mx.array(sinks)))
    want = _attention_float64(q, keys, comp, mask, sinks)
    assert np.abs(out - want).max() <= 1e-5 * np.abs(want).max()
    assert np.abs(out[0]).max() == 0.0                      # the sink's weight falls on no row
    for i in range(t):
        alone = cpu_kernels.attention(mx.array(q[i:i + 1]), mx.array(keys), c, mx.array(mask[i:i + 1]),
                                      mx.array(sinks))
        np.testing.assert_array_equal(np.array(alone)[0], out[i])
    hidden = keys.copy()
    hidden[~mask[1, :n_raw]] = 1e6                          # what token 1 cannot see
    again = cpu_kernels.attention(mx.array(q[1:2]), mx.array(hidden), c, mx.array(mask[1:2]), mx.array(sinks))
    np.testing.assert_array_equal(np.array(again)[0], out[1])
    lib = cpu_kernels._library()
    cs = np.ascontiguousarray(comp) if n_comp else None
    visible = mask.astype(np.uint8)
    threaded = np.empty_like(out)
    assert lib.ds4lab_attention(q.ctypes.data, keys.ctypes.data, None if cs is None else cs.ctypes.data,
                                visible.ctypes.data, sinks.ctypes.data, t, h, d, n_raw, n_comp,
                                float(np.float32(1 / np.sqrt(d))), threaded.ctypes.data, 2) == 0
    np.testing.assert_array_equal(threaded, out)


def test_attention_checks_its_shapes():
    q, keys, comp, mask, sinks = _attention_inputs(2, 4, 64, 10, 3)
    with pytest.raises(ValueError, match="do not fit"):
        cpu_kernels.attention(mx.array(q), mx.array(keys), None, mx.array(mask), mx.array(sinks))
    with pytest.raises(ValueError, match="out of range"):               # a head width the lanes do not tile
        cpu_kernels.attention(mx.array(q[..., :40]), mx.array(keys[:, :40]), mx.array(comp[:, :40]),
                              mx.array(mask), mx.array(sinks))


# ---- the indexer ---------------------------------------------------------------------------
def test_indexer_scores_match_float64_and_not_their_batch():
    rng = np.random.default_rng(11)
    t, h, d, n = 5, 4, 64, 37
    q = rng.standard_normal((t, h, d)).astype(np.float32)
    w = rng.standard_normal((t, h)).astype(np.float32)
    keys = rng.standard_normal((n, d)).astype(np.float32)
    scores = np.array(cpu_kernels.indexer_scores(mx.array(q), mx.array(w), mx.array(keys)))
    want = (np.maximum(np.einsum("thd,nd->thn", q.astype(np.float64), keys.astype(np.float64)), 0)
            * w[:, :, None]).sum(axis=1)
    assert np.abs(scores - want).max() <= 1e-5 * np.abs(want).max()
    fewer = cpu_kernels.indexer_scores(mx.array(q[2:3]), mx.array(w[2:3]), mx.array(keys[:20]))
    np.testing.assert_array_equal(np.array(fewer)[0], scores[2, :20])   # alone, and fewer rows
    with pytest.raises(ValueError, match="do not fit"):
        cpu_kernels.indexer_scores(mx.array(q), mx.array(w[:, :2]), mx.array(keys))


def test_indexer_select_takes_the_best_visible_rows_ties_to_the_lower_row():
    """As `indexer.select_rows` (a stable sort, ties to the lower row): the top_k best of the
    visible rows, or every visible row when no more are visible."""
    from ds4lab.model import indexer
    from ds4lab.model.numerics import Numerics, Schedule

    rng = np.random.default_rng(12)
    t, n, top_k = 6, 40, 5
    scores = rng.integers(0, 6, (t, n)).astype(np.float32)             # many ties
    visible = np.arange(n)[None, :] < np.array([3, 5, 6, 17, 40, 40])[:, None]
    chosen = np.array(cpu_kernels.indexer_select(mx.array(scores), mx.array(visible), top_k))
    composed = indexer.select_rows(mx.array(scores), mx.array(visible), visible.sum(axis=1), top_k,
                                   Schedule(Numerics("float"), None))
    np.testing.assert_array_equal(chosen, np.array(composed))
    assert chosen.sum(axis=1).tolist() == [3, 5, 5, 5, 5, 5] and not (chosen & ~visible).any()
    with pytest.raises(ValueError, match="do not fit"):
        cpu_kernels.indexer_select(mx.array(scores), mx.array(visible[:, :10]), top_k)


# ---- the compressor ----------------------------------------------------------------------
@pytest.mark.parametrize("ratio,width", [(4, 64), (128, 32), (16, 96)])
def test_compress_chunk_matches_the_composition_and_not_its_chunking(ratio, width):
    """The frontier after any chunk equals `compressor.compress_chunk`'s bit for bit (stale
    slots included); the pooled rows agree to float32 order and do not depend on how the tokens
    were chunked (one prefill, token by token, or chunks that start mid-window)."""
    from ds4lab.config import overlaps
    from ds4lab.model.compressor import Frontier, compress_chunk

    rng = np.random.default_rng(ratio)
    c = 2 if overlaps(ratio) else 1
    n = 3 * ratio + ratio // 2 + 1
    kv = rng.standard_normal((n, c * width)).astype(np.float32)
    score = (rng.standard_normal((n, c * width)) * 3).astype(np.float32)

    def run(cuts, native):
        front, pooled = Frontier.empty(ratio, width), []
        for a, b in itertools.pairwise(cuts):
            if native:
                rows, *state = cpu_kernels.compress_chunk(front.kv, front.score, mx.array(kv[a:b]),
                                                          mx.array(score[a:b]), a, ratio, width, overlaps(ratio))
                front = Frontier(*state)
            else:
                rows, front = compress_chunk(front, mx.array(kv[a:b]), mx.array(score[a:b]), a, ratio, width)
            pooled.append(np.array(rows))
        return np.concatenate(pooled), np.array(front.kv), np.array(front.score)

    whole = run([0, n], native=True)
    composed = run([0, n], native=False)
    assert whole[0].shape == (n // ratio, width)
    assert np.abs(whole[0] - composed[0]).max() <= 1e-5 * np.abs(composed[0]).max()
    np.testing.assert_array_equal(whole[1], composed[1])
    np.testing.assert_array_equal(whole[2], composed[2])
    for cuts in ([*range(n), n], [0, ratio // 2 + 1, 2 * ratio + 1, n]):
        again = run(cuts, native=True)
        for got, want in zip(again, whole, strict=True):
            np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="do not fit"):
        bad = mx.zeros((c * ratio + 1, c * width))                      # a row too many
        cpu_kernels.compress_chunk(bad, bad, mx.array(kv), mx.array(score), 0, ratio, width, overlaps(ratio))


# ---- the per-row steps ----------------------------------------------------------------------
def test_row_steps_equal_the_composition_bit_for_bit_and_norms_closely(on_cpu):
    """RoPE (both ways), Hadamard + FP4, FP8 and f16 repeat the MLX composition's float
    operations (ds4's roundings, bit-exact with ds4.c): equal bits from the same input, rows
    of very different scales and the f16 grid's edges included. The norm's sum runs in lanes."""
    from ds4lab.model.numerics import Numerics
    from ds4lab.model.rope import Rotation

    rng = np.random.default_rng(5)
    t, h, d = 6, 3, 128
    scales = np.exp(rng.standard_normal((t, h, 1)) * 4)
    x = (rng.standard_normal((t, h, d)) * scales).astype(np.float32)
    x[0, 0, :8] = [65504.0, 65519.0, 65520.0, -7e4, 6.0e-8, -2.9e-8, 1e-40, 0.0]   # f16 max, edges, subnormals
    x = mx.array(x)
    weight = mx.array((1 + 0.1 * rng.standard_normal(d)).astype(np.float32))
    rotation = Rotation.at(1000, t, 64, 160000.0, None)
    rope = (rotation.cos, rotation.sin)
    composition = Numerics("float").schedule(np.arange(t))
    cases = [{"rotation": rotation}, {"rotation": rotation, "inverse": True}, {"qat": True}, {"fp8": True},
             {"rotation": rotation, "fp8": True, "f16": True}, {"f16": True}, {"qat": True, "f16": True}]
    for case in cases:
        want = np.array(composition.finish_rows(x, **case))
        steps = {k: v for k, v in case.items() if k != "rotation"}
        got = np.array(cpu_kernels.row_finish(x, rope=rope if "rotation" in case else None, **steps))
        np.testing.assert_array_equal(got, want, err_msg=str(sorted(case)))
    want = np.array(composition.finish_rows(x, eps=1e-6, weight=weight, rotation=rotation, fp8=True))
    got = np.array(cpu_kernels.row_finish(x, eps=1e-6, weight=weight, rope=rope, fp8=True))
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    alone = np.array(cpu_kernels.row_finish(x[2:3], eps=1e-6, weight=weight, rope=(rope[0][2:3], rope[1][2:3]),
                                            fp8=True))
    np.testing.assert_array_equal(alone[0], got[2])
    with pytest.raises(ValueError, match="out of range"):
        cpu_kernels.row_finish(x[..., :96], qat=True)          # the Hadamard needs a power of two


def test_router_matches_the_composition_and_checks_its_tables():
    rng = np.random.default_rng(11)
    t, d, n_expert, used = 9, 64, 16, 4
    x = mx.array(rng.standard_normal((t, d)).astype(np.float32))
    gate = mx.array((rng.standard_normal((n_expert, d)) * 2).astype(np.float32))   # logits past ±20 too
    bias = mx.array((rng.standard_normal(n_expert) * 0.1).astype(np.float32))
    logits = np.array(x, np.float64) @ np.array(gate, np.float64).T
    soft = np.where(logits > 20, logits, np.where(logits < -20, np.exp(logits), np.log1p(np.exp(logits))))
    want_probs = np.sqrt(soft)
    for table in (None, mx.array(rng.integers(0, n_expert, (50, used)).astype(np.int32))):
        tokens = mx.array(rng.integers(0, 50, t).astype(np.int32))
        probs, experts, weights = cpu_kernels.router(x, gate, None if table is not None else bias, used, 1.5,
                                                     tokens, table)
        assert np.abs(np.array(probs) - want_probs).max() <= 1e-5 * want_probs.max()
        want = (np.array(table)[np.array(tokens)] if table is not None
                else np.argsort(-(want_probs + np.array(bias)), axis=1, kind="stable")[:, :used])
        np.testing.assert_array_equal(np.array(experts), want)
        chosen = np.take_along_axis(want_probs, want, axis=1)
        want_w = chosen / np.maximum(chosen.sum(axis=1, keepdims=True), 2.0 ** -14) * 1.5
        assert np.abs(np.array(weights) - want_w).max() <= 1e-5 * want_w.max()
        alone = cpu_kernels.router(x[4:5], gate, None if table is not None else bias, used, 1.5, tokens[4:5], table)
        for a, b in zip(alone, (probs, experts, weights), strict=True):
            np.testing.assert_array_equal(np.array(a)[0], np.array(b)[4])
    with pytest.raises(ValueError, match="out of range"):                  # a token past the table
        cpu_kernels.router(x, gate, None, used, 1.5, mx.array(np.full(t, 50, np.int32)), table)
