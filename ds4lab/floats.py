"""float32 rounding of Python floats, as a C `float` assignment rounds (ds4 computes its
constants in float32 step by step; reproducing them needs each step rounded)."""

from __future__ import annotations

import numpy as np


def f32(value: float) -> float:
    """The nearest float32 to `value`, as a Python float (overflow gives inf, as in C)."""
    with np.errstate(over="ignore"):
        return float(np.float32(value))
