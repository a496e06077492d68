"""ds4lab.model.numerics and .rope against ds4.c's own functions, through data/numerics_ref.npz.

The fixture holds inputs (random and edge cases: zeros, -0, values below the FP8/FP4 amax
floors, subnormals, exact rounding ties and their neighbours, amax just above a power of two,
huge values) and the outputs of ds4.c's functions compiled from commit 8d57664 (see
data/README.md). Everything but RMSNorm and cos/sin is compared bit for bit. The property
tests need no fixture.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4lab.config import FLASH
from ds4lab.model.numerics import (
    fp4_round,
    fp8_kv_round,
    hadamard,
    indexer_qat,
    q8_0_act_codes,
    q8_0_act_round,
    q8_k_act_round,
    rms_norm,
    round_f16,
)
from ds4lab.model.rope import YarnParams, apply_rope_tail, rope_angles, rope_cos_sin, rope_tail, yarn_for

REF_PATH = Path(__file__).resolve().parent.parent / "data" / "numerics_ref.npz"
YARN = YarnParams(16.0, 65536, 32.0, 1.0)
ROPE_KINDS = {"plain": (10000.0, None), "yarn": (160000.0, YARN)}


# Bit-exact with ds4.c: pinned to the CPU device, whatever the default is.
pytestmark = pytest.mark.usefixtures("on_cpu")


@pytest.fixture(scope="module")
def ref() -> dict[str, np.ndarray]:
    with np.load(REF_PATH) as data:
        return dict(data)


def run(fn, x: np.ndarray, *args, **kwargs) -> np.ndarray:
    return np.array(fn(mx.array(x), *args, **kwargs))


def assert_bits_equal(got: np.ndarray, want: np.ndarray) -> None:
    """Same float32 bit patterns (so -0.0 and +0.0 count as different)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape
    bad = got.view(np.uint32) != want.view(np.uint32)
    assert not bad.any(), f"{int(bad.sum())} of {bad.size} differ, e.g. got {got[bad][:4]} want {want[bad][:4]}"


def ulp_diff(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """|got - want| in float32 ulps of want."""
    spacing = np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)
    return np.abs(got.astype(np.float64) - want.astype(np.float64)) / spacing


# ---- bit-exact against ds4.c --------------------------------------------------------


def test_round_f16_matches_ds4(ref):
    assert_bits_equal(run(round_f16, ref["f16_x"]), ref["f16_y"])


def test_fp8_kv_round_matches_ds4(ref):
    x = ref["fp8_x"]
    got = run(fp8_kv_round, x, 448)
    assert_bits_equal(got[:, :448], ref["fp8_y"])
    assert_bits_equal(got[:, 448:], x[:, 448:])


def test_fp4_round_matches_ds4(ref):
    assert_bits_equal(run(fp4_round, ref["fp4_x"]), ref["fp4_y"])


def test_hadamard_and_indexer_qat_match_ds4(ref):
    assert_bits_equal(run(hadamard, ref["had_x"]), ref["had_y"])
    assert_bits_equal(run(indexer_qat, ref["had_x"]), ref["qat_y"])


@pytest.mark.parametrize("name,fn,block", [("q8_0", q8_0_act_round, 32), ("q8_k", q8_k_act_round, 256)])
def test_activation_quant_matches_ds4(ref, name, fn, block):
    x = ref[f"{name}_x"]
    got = run(fn, x)
    assert_bits_equal(got, ref[f"{name}_y"])
    d = ref[f"{name}_d"][..., None]                     # ds4's float32 block scale
    codes = np.round(got.reshape(*d.shape[:-1], block) / np.where(d == 0, 1, d)).astype(np.int32)
    assert np.abs(codes).max() <= 128
    assert_bits_equal((d * codes.astype(np.float32)).reshape(got.shape), got)


@pytest.mark.parametrize("kind", ROPE_KINDS)
def test_rope_angles_match_ds4(ref, kind):
    base, yarn = ROPE_KINDS[kind]
    assert_bits_equal(run(rope_angles, ref["rope_pos"], 64, base, yarn), ref[f"rope_{kind}_theta"])


@pytest.mark.parametrize("kind", ROPE_KINDS)
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_rotation_with_ds4_cos_sin_matches_ds4(ref, kind, inverse):
    """Given ds4's own cos/sin, the rotation arithmetic is bit-exact."""
    x = mx.array(ref["rope_x"])
    cos, sin = mx.array(ref[f"rope_{kind}_cos"]), mx.array(ref[f"rope_{kind}_sin"])
    got = np.array(apply_rope_tail(x, cos, sin, inverse=inverse))
    assert_bits_equal(got[..., 64:], ref[f"rope_{kind}_{'inv' if inverse else 'y'}"])
    assert_bits_equal(got[..., :64], ref["rope_x"][..., :64])


# ---- close to ds4.c: cos/sin (glibc's are not correctly rounded) and RMSNorm (double sum) ---


@pytest.mark.parametrize("kind", ROPE_KINDS)
def test_rope_cos_sin_within_one_ulp_of_glibc(ref, kind):
    base, yarn = ROPE_KINDS[kind]
    cos, sin = rope_cos_sin(mx.array(ref["rope_pos"]), 64, base, yarn)
    for got, want in ((np.array(cos), ref[f"rope_{kind}_cos"]), (np.array(sin), ref[f"rope_{kind}_sin"])):
        assert ulp_diff(got, want).max() <= 1
        assert (got != want).mean() < 0.05


@pytest.mark.parametrize("kind", ROPE_KINDS)
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_tail_close_to_ds4(ref, kind, inverse):
    base, yarn = ROPE_KINDS[kind]
    got = run(rope_tail, ref["rope_x"], mx.array(ref["rope_pos"]), 64, base, yarn, inverse=inverse)
    want = ref[f"rope_{kind}_{'inv' if inverse else 'y'}"]
    assert np.abs(got[..., 64:] - want).max() <= 1e-6
    assert (got[..., 64:] != want).mean() < 0.05
    assert_bits_equal(got[..., :64], ref["rope_x"][..., :64])


def test_rms_norm_within_a_few_ulp_of_ds4(ref):
    x, w = ref["rms_x"], ref["rms_w"]
    assert ulp_diff(run(rms_norm, x), ref["rms_y"]).max() <= 8
    got = np.array(rms_norm(mx.array(x), mx.array(w), 1e-6))
    assert ulp_diff(got, ref["rms_yw"]).max() <= 8


# ---- properties (no fixture) ----------------------------------------------------------


def finite_f32(min_value: float = -(2.0**100), max_value: float = 2.0**100):
    return st.floats(min_value, max_value, allow_nan=False, allow_infinity=False, width=32)


def explicit_mantissa_bits(y: np.ndarray) -> np.ndarray:
    """Number of significant explicit mantissa bits of normal float32 values (0 for zero)."""
    mant = np.asarray(y, np.float32).view(np.uint32) & 0x7FFFFF
    trailing = np.array([(int(m) & -int(m)).bit_length() - 1 if m else 23 for m in mant.ravel()]).reshape(mant.shape)
    return 23 - trailing


def block_scales(x: np.ndarray, block: int, fmax: float, floor: float) -> np.ndarray:
    """Upper bound of ds4's per-block power-of-two scale (it may be half this at a carry edge)."""
    amax = np.maximum(np.abs(x.reshape(-1, block)).max(-1), floor)
    return np.exp2(np.ceil(np.log2(amax.astype(np.float64) / fmax)))[:, None]


@settings(max_examples=40, deadline=None)
@given(st.lists(finite_f32(), min_size=128, max_size=128), st.floats(-20, 20))
def test_fp8_values_on_e4m3_grid_and_idempotent(values, log_scale):
    x = (np.array(values, np.float64).reshape(1, 128) * 2.0**log_scale).astype(np.float32)
    y = run(fp8_kv_round, x, 64)
    assert_bits_equal(y[:, 64:], x[:, 64:])
    nope, ynope = x[:, :64], y[:, :64]
    scale = block_scales(nope, 64, 448.0, 1e-4)
    assert (explicit_mantissa_bits(ynope[ynope != 0]) <= 3).all()
    assert (np.abs(ynope) <= 448.0 * scale).all()
    step = np.maximum(2.0 ** (np.floor(np.log2(np.maximum(np.abs(ynope), 1e-45))) - 3), 2.0**-9 * scale / 2)
    assert (ynope / step == np.round(ynope / step)).all()
    assert (np.abs(ynope.astype(np.float64) - nope) <= np.abs(nope) / 16 + scale * 2.0**-10).all()
    assert np.array_equal(run(fp8_kv_round, y, 64), y)     # values: ds4 maps -0.0 to +0.0


@settings(max_examples=40, deadline=None)
@given(st.lists(finite_f32(), min_size=64, max_size=64), st.floats(-30, 15))
def test_fp4_values_on_e2m1_grid_and_idempotent(values, log_scale):
    x = (np.array(values, np.float64).reshape(2, 32) * 2.0**log_scale).astype(np.float32)
    y = run(fp4_round, x)
    scale = block_scales(x, 32, 6.0, 7.052966104933725e-38).reshape(2, 1)
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    ratio = np.abs(y.astype(np.float64)) / scale
    on_grid = np.isin(ratio, grid) | np.isin(ratio * 2, grid)       # scale may be half the bound
    assert on_grid.all()
    assert (np.abs(y.astype(np.float64) - x) <= np.abs(x) / 4 + scale / 4).all()
    assert np.array_equal(run(fp4_round, y), y)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 0xFFFFFFFF), min_size=256, max_size=256))
def test_round_f16_is_numpy_f16_cast(words):
    x = np.array(words, np.uint32).view(np.float32)
    x = np.where(np.isnan(x), np.float32(1.0), x)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).astype(np.float32)
    assert_bits_equal(run(round_f16, x), want)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 5), st.integers(0, 2**31 - 1))
def test_hadamard_is_orthonormal_sylvester(log_n, seed):
    n = 2 ** (log_n + 2)
    x = np.random.default_rng(seed).standard_normal((3, n)).astype(np.float32)
    h = np.array([[1.0]])
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    y = run(hadamard, x)
    np.testing.assert_allclose(y, x @ h.T / np.sqrt(n), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(run(hadamard, y), x, rtol=1e-5, atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(st.lists(finite_f32(-(2.0**66), 2.0**66), min_size=64, max_size=64), st.sampled_from([("0", 32), ("K", 256)]),
       st.integers(0, 2**31 - 1))
def test_activation_quant_is_on_int8_grid(values, kind, seed):
    name, block = kind
    fn = q8_0_act_round if name == "0" else q8_k_act_round
    rng = np.random.default_rng(seed)
    x = (rng.choice(np.array(values, np.float32), 512) * rng.choice([-1, 1], 512)).astype(np.float32).reshape(-1, block)
    x[np.abs(x).max(-1) < 1e-30] = 0          # below ~4e-37 1/d overflows; ds4's lrintf(inf) is undefined
    y = run(fn, x)
    d = np.abs(x).max(-1, keepdims=True).astype(np.float64) / 127
    assert (np.abs(y) <= 127 * d * (1 + 1e-6)).all()
    assert (np.abs(y.astype(np.float64) - x) <= d / 2 * (1 + 1e-5)).all()


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 2**20), min_size=1, max_size=8), st.sampled_from(list(ROPE_KINDS)),
       st.integers(0, 2**31 - 1))
def test_rope_inverse_undoes_rope(positions, kind, seed):
    base, yarn = ROPE_KINDS[kind]
    x = np.random.default_rng(seed).standard_normal((len(positions), 3, 96)).astype(np.float32)
    pos = mx.array(positions)
    y = rope_tail(mx.array(x), pos, 64, base, yarn)
    back = np.array(rope_tail(y, pos, 64, base, yarn, inverse=True))
    np.testing.assert_allclose(back, x, atol=2e-6)
    y = np.array(y)
    assert_bits_equal(y[..., :32], x[..., :32])
    norms = lambda a: np.hypot(a[..., 32::2], a[..., 33::2])  # noqa: E731
    np.testing.assert_allclose(norms(y), norms(x), rtol=1e-6, atol=1e-6)


@settings(max_examples=20, deadline=None)
@given(st.lists(st.integers(0, 2**20), min_size=1, max_size=64), st.sampled_from(list(ROPE_KINDS)))
def test_rope_cos_sin_correctly_rounded(positions, kind):
    base, yarn = ROPE_KINDS[kind]
    theta = np.array(rope_angles(mx.array(positions), 64, base, yarn)).astype(np.float64)
    cos, sin = rope_cos_sin(mx.array(positions), 64, base, yarn)
    assert_bits_equal(np.array(cos), np.cos(theta).astype(np.float32))
    assert_bits_equal(np.array(sin), np.sin(theta).astype(np.float32))


def test_rope_position_zero_is_identity_and_positions_broadcast():
    x = np.random.default_rng(0).standard_normal((2, 4, 128)).astype(np.float32)
    y = run(rope_tail, x, mx.array([0, 7]), 64, 160000.0, YARN)
    assert np.array_equal(y[0], x[0])
    per_token = np.stack([run(rope_tail, x[t], t * 7, 64, 160000.0, YARN) for t in range(2)])
    assert_bits_equal(y, per_token)


def test_yarn_for_follows_the_layer_kind():
    assert yarn_for(FLASH, 0) is None
    assert yarn_for(FLASH, 4) == yarn_for(FLASH, 128) == YARN


@pytest.mark.parametrize("call", [
    lambda: fp8_kv_round(mx.zeros((2, 100)), 36),
    lambda: fp4_round(mx.zeros((2, 48))),
    lambda: hadamard(mx.zeros((2, 96))),
    lambda: q8_0_act_round(mx.zeros((2, 40))),
    lambda: q8_k_act_round(mx.zeros((2, 128))),
])
def test_partial_blocks_are_refused(call):
    with pytest.raises(ValueError):
        call()


def test_q8_0_scale_as_ds4s_fast_math_binaries_compute_it():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4000, 32)).astype(np.float32)
    amax = np.abs(x).max(-1)
    strict = np.array(q8_0_act_codes(mx.array(x))[1]).reshape(-1)
    built = np.array(q8_0_act_codes(mx.array(x), as_built=True)[1]).reshape(-1)
    assert np.array_equal(strict, amax / np.float32(127))
    assert np.array_equal(built, amax * np.float32(1 / 127))
    assert 0 < (strict != built).mean() < 0.2
