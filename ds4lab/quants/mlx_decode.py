"""MLX decoding of GGUF tensor bytes, bit-exact with the numpy decoder and gguf-py.

Only MLX ops are used, so decoding stays lazy and runs on any MLX backend (CPU, CUDA, Metal);
`gather_experts` decodes just the routed experts a batch selected. The float operations are
separate ops in gguf-py's order (no ``mx.compile``, so nothing is fused into an FMA).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import mlx.core as mx

from .formats import QuantError, check_byte_count, row_bytes
from .tables import IQ2XXS_SIGNED_GRID

_SHIFT_2BIT = mx.array([0, 2, 4, 6], dtype=mx.uint8).reshape(1, 1, 4, 1)
_SHIFT_4BIT = mx.array([0, 4], dtype=mx.uint8).reshape(1, 1, 2, 1)
_SHIFT_SIGNS = mx.array([0, 7, 14, 21], dtype=mx.uint32)
_SIGNED_GRID_FLAT = mx.array(IQ2XXS_SIGNED_GRID.reshape(-1, 8))


def _f16(blocks: mx.array, offset: int) -> mx.array:
    """The f16 field at byte `offset` of each block, widened to float32 [n, 1]."""
    return mx.view(blocks[:, offset : offset + 2], mx.float16).astype(mx.float32)


def _f32(blocks: mx.array) -> mx.array:
    return mx.view(blocks, mx.float32)


def _f16_values(blocks: mx.array) -> mx.array:
    return mx.view(blocks, mx.float16).astype(mx.float32)


def _bf16(blocks: mx.array) -> mx.array:
    return mx.view(mx.view(blocks, mx.uint16).astype(mx.uint32) << 16, mx.float32)


def _i32(blocks: mx.array) -> mx.array:
    return mx.view(blocks, mx.int32)


def _q8_0(blocks: mx.array) -> mx.array:
    # d, then 32 int8
    return mx.view(blocks[:, 2:], mx.int8).astype(mx.float32) * _f16(blocks, 0)


def _q2_k(blocks: mx.array) -> mx.array:
    # scales[16] (low nibble scale, high nibble min), qs[64] 2-bit, d, dmin
    n = blocks.shape[0]
    scales = blocks[:, :16]
    dl = (_f16(blocks, 80) * (scales & 0xF).astype(mx.float32))[:, :, None]
    ml = (_f16(blocks, 82) * (scales >> 4).astype(mx.float32))[:, :, None]
    q = (blocks[:, 16:80].reshape(n, 2, 1, 32) >> _SHIFT_2BIT) & 3
    return (dl * q.reshape(n, 16, 16).astype(mx.float32) - ml).reshape(n, 256)


def _q4_k_scale_min(packed: mx.array) -> tuple[mx.array, mx.array]:
    """Unpack the 12 bytes of 6-bit (scale, min) pairs of Q4_K into two uint8 [n, 8]."""
    lo, hi, mixed = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scale = mx.concatenate([lo & 0x3F, (mixed & 0xF) | ((lo >> 2) & 0x30)], axis=1)
    min_ = mx.concatenate([hi & 0x3F, (mixed >> 4) | ((hi >> 2) & 0x30)], axis=1)
    return scale, min_


def _q4_k(blocks: mx.array) -> mx.array:
    # d, dmin, scales[12] packed 6-bit, qs[128] nibbles (low nibbles first, per 32 values)
    n = blocks.shape[0]
    scale, min_ = _q4_k_scale_min(blocks[:, 4:16])
    dl = (_f16(blocks, 0) * scale.astype(mx.float32))[:, :, None]
    ml = (_f16(blocks, 2) * min_.astype(mx.float32))[:, :, None]
    q = (blocks[:, 16:].reshape(n, 4, 1, 32) >> _SHIFT_4BIT) & 0xF
    return (dl * q.reshape(n, 8, 32).astype(mx.float32) - ml).reshape(n, 256)


def _iq2_xxs(blocks: mx.array) -> mx.array:
    # d, then per 32 values one u32 of 4 grid indices (u8) and one u32 of 4 x 7-bit sign indices
    # with the 4-bit sub-block scale on top
    n = blocks.shape[0]
    words = mx.view(blocks[:, 2:], mx.uint32).reshape(n, 8, 2)
    grid_idx, aux = mx.view(words[:, :, :1], mx.uint8), words[:, :, 1:]  # [n, 8, 4], [n, 8, 1]
    db = _f16(blocks, 0)[:, :, None] * (0.5 + (aux >> 28).astype(mx.float32)) * 0.25
    idx = (grid_idx.astype(mx.uint32) << 7) | ((aux >> _SHIFT_SIGNS) & 0x7F)
    values = mx.take(_SIGNED_GRID_FLAT, idx, axis=0)  # [n, 8, 4, 8]
    return (db[:, :, :, None] * values).reshape(n, 256)


_DECODERS: dict[str, Callable[[mx.array], mx.array]] = {
    "F32": _f32,
    "F16": _f16_values,
    "BF16": _bf16,
    "I32": _i32,
    "Q8_0": _q8_0,
    "Q2_K": _q2_k,
    "Q4_K": _q4_k,
    "IQ2_XXS": _iq2_xxs,
}


def _as_bytes(raw: mx.array) -> mx.array:
    return raw if raw.dtype == mx.uint8 else mx.view(raw, mx.uint8)


def dequantize_mx(raw: mx.array, type_name: str, shape: Sequence[int]) -> mx.array:
    """Decode the raw bytes of a `type_name` tensor into a float32 mx.array of numpy-order `shape`.

    Same contract as `ds4lab.quants.dequantize` (I32 decodes to int32), but lazy, in MLX ops.
    """
    raw = _as_bytes(raw)
    shape = tuple(int(n) for n in shape)
    fmt = check_byte_count(type_name, shape, raw.size)
    return _DECODERS[type_name](raw.reshape(raw.size // fmt.block_bytes, fmt.block_bytes)).reshape(shape)


def gather_experts(raw: mx.array, ids: mx.array, type_name: str, rows: int, cols: int) -> mx.array:
    """Decode only the routed experts `ids` selects: float32 of shape ``ids.shape + (rows, cols)``.

    `raw` holds the bytes of a routed-expert tensor, GGUF dims (cols, rows, n_expert), as
    [n_expert, expert_bytes] (or [n_expert, rows, row_bytes]). Each id must be in
    ``range(n_expert)``; only the selected experts' bytes are read.
    """
    raw = _as_bytes(raw)
    expert_bytes = rows * row_bytes(type_name, cols)
    if raw.ndim < 2 or math.prod(raw.shape[1:]) != expert_bytes:
        raise QuantError(
            f"{type_name}: expert bytes of shape {tuple(raw.shape)} do not hold [n_expert, {expert_bytes}] "
            f"({rows} rows of {cols} values)"
        )
    picked = mx.take(raw.reshape(raw.shape[0], expert_bytes), ids.reshape(-1), axis=0)
    return dequantize_mx(picked, type_name, (*ids.shape, rows, cols))
