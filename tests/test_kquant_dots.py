"""ds4's CPU routed-expert dots (IQ2_XXS, Q2_K x Q8_K) against a float64 computation."""

from __future__ import annotations

import numpy as np
import pytest

from ds4lab.model.kquant_dots import ExpertRows, q8_k_codes
from ds4lab.quants import dequantize, random_blocks


def test_q8_k_codes_follow_ds4s_rule():
    x = np.array([[0.5, -2.0, 1.0, 2.0] + [0.0] * 252, [0.0] * 256], np.float32)
    codes, d = q8_k_codes(x)
    # the first largest magnitude is -2.0: iscale = 63.5, d = -2 * float32(-1/127)
    assert d[0, 0] == np.float32(-2.0) * np.float32(-1.0 / 127.0) and d[1, 0] == 0
    assert codes[0, 0, :4].tolist() == [32.0, -127.0, 64.0, 127.0]     # rint(31.75), rint(-127), 63.5 -> 64
    assert not codes[1].any()


@pytest.mark.parametrize("type_name", ["IQ2_XXS", "Q2_K"])
def test_integer_dots_equal_the_float64_product(type_name):
    rng = np.random.default_rng(5)
    rows, cols = 48, 768
    raw = np.asarray(random_blocks(type_name, rows * cols // 256, rng, 0.01, 0.004 if type_name == "Q2_K" else None),
                     np.uint8).reshape(-1)
    w = dequantize(raw, type_name, (rows, cols)).astype(np.float64)
    x = rng.standard_normal((7, cols)).astype(np.float32)
    codes, d = q8_k_codes(x)
    exact = (codes * d[..., None].astype(np.float64)).reshape(7, cols) @ w.T
    mine = ExpertRows(raw, type_name, rows, cols).dot(codes, d)
    # float32 per-block steps only: a few ulp of the row's magnitude, never a layout slip
    assert np.abs(mine - exact).max() <= 1e-6 * np.abs(exact).max()
    swapped = raw.reshape(rows, -1)[::-1].reshape(-1)                  # rows in the wrong order
    wrong = ExpertRows(swapped, type_name, rows, cols).dot(codes, d)
    assert np.abs(wrong - exact).max() > 1e-3 * np.abs(exact).max()
