"""Synthetic block data: random but valid tensor bytes.

Lets tests and benchmarks build routed experts of realistic magnitude without a real model.
"""

from __future__ import annotations

import numpy as np

from .formats import QuantError, block_format
from .quantize import set_f16_field

# Byte offsets of the f16 super-block scale d and, where there is one, the min scale dmin.
_D_OFFSET = {"Q8_0": 0, "Q2_K": 80, "Q4_K": 0, "IQ2_XXS": 0}
_DMIN_OFFSET = {"Q2_K": 82, "Q4_K": 2}
_FLOAT_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.float32}  # BF16: f32's upper half


def random_blocks(
    type_name: str,
    n_blocks: int,
    rng: np.random.Generator,
    d: float,
    dmin: float | None = None,
    jitter: tuple[float, float] = (0.75, 1.25),
) -> np.ndarray:
    """Random bytes of `n_blocks` blocks of `type_name`, uint8 [n_blocks, block_bytes].

    Every field is uniformly random (all bit patterns are valid) except the f16 scales: d is
    set to ``d * uniform(*jitter)`` per block, and for Q2_K/Q4_K dmin to ``dmin * uniform(*jitter)``
    (dmin defaults to 1.5 * d). F32/F16/BF16 values are ``±d * uniform(*jitter)``; I32 is random.
    """
    fmt = block_format(type_name)
    if dmin is not None and type_name not in _DMIN_OFFSET:
        raise QuantError(f"{type_name}: has no dmin scale; dmin applies to {', '.join(_DMIN_OFFSET)} only")
    if type_name in _FLOAT_DTYPES:
        signs = rng.choice(np.array([-1.0, 1.0]), n_blocks)
        values = (signs * d * rng.uniform(*jitter, n_blocks)).astype(_FLOAT_DTYPES[type_name])
        if type_name == "BF16":
            values = (values.view(np.uint32) >> 16).astype(np.uint16)
        return values.view(np.uint8).reshape(n_blocks, fmt.block_bytes)
    blocks = rng.integers(0, 256, size=(n_blocks, fmt.block_bytes), dtype=np.uint8)
    if type_name in _D_OFFSET:
        set_f16_field(blocks, _D_OFFSET[type_name], d * rng.uniform(*jitter, n_blocks))
    if type_name in _DMIN_OFFSET:
        dmin = 1.5 * d if dmin is None else dmin
        set_f16_field(blocks, _DMIN_OFFSET[type_name], dmin * rng.uniform(*jitter, n_blocks))
    return blocks
