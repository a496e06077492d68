"""float32 facts ds4's arithmetic depends on: rounding of Python floats, as a C `float`
assignment rounds (ds4 computes its constants in float32 step by step; reproducing them
needs each step rounded), and where glibc's log2f carries into the next integer."""

from __future__ import annotations

import math
from bisect import bisect_left
from functools import cache

import numpy as np

_MANT_BITS = 23
_MIN_NORMAL_EXP = -126
_MAX_EXP = 127


def f32(value: float) -> float:
    """The nearest float32 to `value`, as a Python float (overflow gives inf, as in C)."""
    with np.errstate(over="ignore"):
        return float(np.float32(value))


@cache
def log2f_carry_table() -> np.ndarray:
    """For each exponent e of a normal float32 q = 2^e * (1 + j*2^-23): the smallest j > 0
    for which float32(log2(q)) is above e, so that ceil(log2f(q)) = e + 1.

    Near a power of two log2(q) = e + tiny, and for |e| >= 4 the float32 result rounds back
    to exactly e for the first few j; ds4's `ceilf(log2f(.))` then keeps the scale 2^e (the
    clamp to the format's maximum absorbs the excess). A correctly rounded log2 decides
    this; glibc's log2f agrees for every normal float32 (checked exhaustively).
    """
    def carries(e: int, j: int) -> bool:
        return f32(e + math.log2(1.0 + j * 2.0**-_MANT_BITS)) > e

    first = [1 + bisect_left(range(1, 1 << _MANT_BITS), True, key=lambda j, e=e: carries(e, j))
             for e in range(_MIN_NORMAL_EXP, _MAX_EXP + 1)]
    return np.array(first, dtype=np.int32)
