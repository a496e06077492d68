"""Where ds4's activation roundings sit, checked at model level on synthetic models (any CPU).

In "ds4-cpu" numerics every Q8_0 matmul must consume its input rounded to int8 per 32, and
the routed experts their input and their down projections' input rounded to int8 per 256
(Q8_K); in "float" numerics none of them may. Each product the model computes is compared
with the same product from an independent numpy rounding (float64): in one mode it must
match the rounded input, in the other the unrounded one.
"""

from __future__ import annotations

import numpy as np
import pytest

from ds4lab import gguf, load
from ds4lab.model.numerics import Schedule
from ds4lab.quants import dequantize

pytestmark = pytest.mark.usefixtures("on_cpu")


def q8_0_grid(x: np.ndarray) -> np.ndarray:
    """ds4's Q8_0 activation: per 32, d = amax * float32(1/127) (as its -ffast-math builds do),
    codes = rint(x * (1/d)) clamped to [-128, 127]; the values d * codes."""
    b = x.astype(np.float32).reshape(len(x), -1, 32)
    d = np.abs(b).max(axis=-1, keepdims=True) * np.float32(1.0 / 127.0)
    inv = np.where(d == 0, np.float32(0), np.float32(1) / np.where(d == 0, np.float32(1), d))
    return (d * np.clip(np.rint(b * inv), -128, 127)).reshape(x.shape).astype(np.float64)


def q8_k_grid(x: np.ndarray) -> np.ndarray:
    """ds4's Q8_K: per 256, the first value of largest magnitude m, codes rint(-127/m * x), d = -m/127."""
    b = x.astype(np.float32).reshape(len(x), -1, 256)
    m = np.take_along_axis(b, np.abs(b).argmax(axis=-1)[..., None], axis=-1)
    iscale = np.float32(-127.0) / np.where(m == 0, np.float32(1), m)
    codes = np.clip(np.rint(iscale * b), -128, 127)
    return (np.where(m == 0, 0, codes * (m / np.float32(-127.0)))).reshape(x.shape).astype(np.float64)


def _q8_products(model, tokens, monkeypatch) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(x, W, y) of every Q8_0 matmul of one forward."""
    seen = []
    original = Schedule.q8

    def spy(self, matrix, x, shape=None, groups=1):
        y = original(self, matrix, x, shape, groups)
        xs, ys = np.array(x).reshape(-1, groups, matrix.cols), np.array(y).reshape(-1, groups, matrix.rows // groups)
        w = np.array(matrix.dense(), np.float64).reshape(groups, -1, matrix.cols)
        seen.extend((xs[:, g], w[g], ys[:, g]) for g in range(groups))      # each group its own product
        return y

    monkeypatch.setattr(Schedule, "q8", spy)
    model(tokens)
    monkeypatch.undo()
    return seen


@pytest.mark.parametrize("numerics", ["ds4-cpu", "float"])
def test_every_q8_0_matmul_takes_the_rounded_input_only_in_ds4_cpu(tiny_q2, numerics, monkeypatch):
    model = load(tiny_q2, numerics=numerics)
    products = _q8_products(model, [3, 1000, 25000, 77, 9], monkeypatch)
    cfg = model.config
    # per layer q_a, q_b, kv, the output groups and output_b, the shared gate/up/down; then the head
    assert len(products) == cfg.n_layer * (3 + cfg.n_out_group + 1 + 3) + 1
    for i, (x, w, y) in enumerate(products):
        scale = np.abs(y).max()
        on_grid = np.abs(y - q8_0_grid(x) @ w.T).max() / scale
        plain = np.abs(y - x.astype(np.float64) @ w.T).max() / scale
        if numerics == "ds4-cpu":
            assert on_grid <= 2e-6 < plain, (i, on_grid, plain)
        else:
            assert plain <= 2e-6 < on_grid, (i, on_grid, plain)


@pytest.mark.parametrize("numerics", ["ds4-cpu", "float"])
@pytest.mark.parametrize("which", ["tiny_q2", "small_q4_mtp"])
def test_routed_experts_round_their_inputs_only_in_ds4_cpu(request, which, numerics):
    """Both expert kinds: ds4's CPU types (IQ2_XXS/Q2_K, integer dots) and Q4_K (float dots)."""
    path = request.getfixturevalue(which)
    path = path[0] if isinstance(path, tuple) else path
    model = load(path, numerics=numerics)
    cfg = model.config
    layer = cfg.n_hash_layer
    b = f"blocks.{layer}.ffn."
    embd = gguf.open(path).dequantize("token_embd.weight")
    tokens = [int(t) for t in np.flatnonzero(np.abs(embd).sum(axis=1))[[0, 5, 9, 17, 40, 41]]]
    _, cache = model.run_with_cache(tokens, [b + n for n in (
        "hook_in", "hook_experts", "hook_expert_weights", "hook_routed_mid", "hook_routed_out")])
    x, experts, weights = cache[b + "hook_in"], cache[b + "hook_experts"], cache[b + "hook_expert_weights"]
    mids, out = cache[b + "hook_routed_mid"], cache[b + "hook_routed_out"]

    # The down projections' input, as the hook shows it, lies on the Q8_K grid only in ds4-cpu.
    flat = mids.reshape(-1, mids.shape[-1])
    off_grid = np.abs(flat - q8_k_grid(flat)).max() / np.abs(flat).max()
    assert (off_grid <= 1e-6) if numerics == "ds4-cpu" else (off_grid > 1e-4), off_grid

    # The routed sum recomputed in float64 from dequantized weights, with and without rounding.
    raw = {r: model.weights.layers[layer].experts[f"ffn_{r}_exps.weight"] for r in ("gate", "up", "down")}

    def weight(role, e):
        t = raw[role]
        return dequantize(np.array(t.raw[int(e)]), t.type_name, (t.rows, t.cols)).astype(np.float64)

    clamp = cfg.swiglu_clamp[layer]
    for rounded in (True, False):
        xin = q8_k_grid(x) if rounded else x.astype(np.float64)
        ref = np.zeros(out.shape)
        for t in range(len(x)):
            for e, w in zip(experts[t], weights[t], strict=True):
                gate, up = weight("gate", e) @ xin[t], weight("up", e) @ xin[t]
                gate, up = np.minimum(gate, clamp), np.clip(up, -clamp, clamp)
                mid = gate / (1 + np.exp(-gate)) * up * w
                mid = q8_k_grid(mid[None])[0] if rounded else mid
                ref[t] += weight("down", e) @ mid
        err = np.abs(out - ref).max() / np.abs(ref).max()
        if rounded == (numerics == "ds4-cpu"):
            assert err <= 2e-5, (rounded, err)
        else:
            assert err > 1e-4, (rounded, err)

