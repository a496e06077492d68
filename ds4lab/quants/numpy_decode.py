"""Vectorised numpy decoding of GGUF tensor bytes, bit-exact with ``gguf.quants.dequantize``.

Every float operation happens in the same order as gguf-py (f16 scales widened to f32 first),
so results match the reference exactly. Blocks are decoded in fixed-size chunks to keep the
temporaries in cache and memory use bounded. Assumes a little-endian host, like GGUF itself.

The block-field readers `f16_field`, `split_fields` and `q4_k_scale_min` are shared with the
quantizers (which check their packing against them) and the MLX repacking in `studies`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from .formats import check_byte_count
from .tables import IQ2XXS_SIGNED_GRID

_CHUNK_BLOCKS = 4096

_SHIFT_SIGNS = np.array([0, 7, 14, 21], dtype=np.uint32)
_SIGNED_GRID_FLAT = IQ2XXS_SIGNED_GRID.reshape(-1, 8)


def f16_field(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The f16 field at byte `offset` of each block, widened to float32 [n, 1]."""
    return blocks[:, offset : offset + 2].view(np.float16).astype(np.float32)


def split_fields(packed: np.ndarray, bits: int) -> np.ndarray:
    """Unpack [n, g*32] bytes into uint8 [n, g, 8 // bits, 32] bit fields, lowest field first.

    Works on u64 words (8 bytes at once): after the shift, the mask drops the bits that
    crossed in from the neighbouring byte.
    """
    n = len(packed)
    words = np.ascontiguousarray(packed).view(np.uint64).reshape(n, -1, 1, 4)
    shifts = np.arange(0, 8, bits, dtype=np.uint64).reshape(1, 1, -1, 1)
    mask = np.uint64(int.from_bytes(bytes([(1 << bits) - 1]) * 8, "little"))
    return ((words >> shifts) & mask).view(np.uint8)


def _f32(blocks: np.ndarray) -> np.ndarray:
    return blocks.view(np.float32)


def _f16_values(blocks: np.ndarray) -> np.ndarray:
    return blocks.view(np.float16).astype(np.float32)


def _bf16(blocks: np.ndarray) -> np.ndarray:
    return (blocks.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def _i32(blocks: np.ndarray) -> np.ndarray:
    return blocks.view(np.int32)


def _q8_0(blocks: np.ndarray, out: np.ndarray) -> None:
    # d, then 32 int8
    np.multiply(blocks[:, 2:].view(np.int8), f16_field(blocks, 0), out=out)


def _q2_k(blocks: np.ndarray, out: np.ndarray) -> None:
    # scales[16] (low nibble scale, high nibble min), qs[64] 2-bit, d, dmin
    n = len(blocks)
    scales = blocks[:, :16]
    dl = (f16_field(blocks, 80) * (scales & 0xF).astype(np.float32))[:, :, None]
    ml = (f16_field(blocks, 82) * (scales >> 4).astype(np.float32))[:, :, None]
    q = split_fields(blocks[:, 16:80], 2)
    out = out.reshape(n, 16, 16)
    np.multiply(dl, q.reshape(n, 16, 16), out=out)
    np.subtract(out, ml, out=out)


def q4_k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack the 12 bytes of 6-bit (scale, min) pairs of Q4_K into two uint8 [n, 8]."""
    lo, hi, mixed = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scale = np.concatenate([lo & 0x3F, (mixed & 0xF) | ((lo >> 2) & 0x30)], axis=1)
    min_ = np.concatenate([hi & 0x3F, (mixed >> 4) | ((hi >> 2) & 0x30)], axis=1)
    return scale, min_


def _q4_k(blocks: np.ndarray, out: np.ndarray) -> None:
    # d, dmin, scales[12] packed 6-bit, qs[128] nibbles (low nibbles first, per 32 values)
    n = len(blocks)
    scale, min_ = q4_k_scale_min(blocks[:, 4:16])
    dl = (f16_field(blocks, 0) * scale.astype(np.float32))[:, :, None]
    ml = (f16_field(blocks, 2) * min_.astype(np.float32))[:, :, None]
    q = split_fields(blocks[:, 16:], 4)
    out = out.reshape(n, 8, 32)
    np.multiply(dl, q.reshape(n, 8, 32), out=out)
    np.subtract(out, ml, out=out)


def _iq2_xxs(blocks: np.ndarray, out: np.ndarray) -> None:
    # d, then per 32 values one u32 of 4 grid indices (u8) and one u32 of 4 x 7-bit sign indices
    # with the 4-bit sub-block scale on top
    n = len(blocks)
    words = np.ascontiguousarray(blocks[:, 2:]).view(np.uint32).reshape(n, 8, 2)
    grid_idx, aux = words[:, :, :1].view(np.uint8), words[:, :, 1:]  # [n, 8, 4], [n, 8, 1]
    db = f16_field(blocks, 0)[:, :, None] * (np.float32(0.5) + (aux >> 28).astype(np.float32)) * np.float32(0.25)
    idx = (grid_idx.astype(np.intp) << 7) | ((aux >> _SHIFT_SIGNS) & 0x7F)
    out = out.reshape(n, 8, 4, 8)
    np.take(_SIGNED_GRID_FLAT, idx, axis=0, out=out)
    np.multiply(db[:, :, :, None], out, out=out)


_PLAIN_DECODERS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "F32": _f32,
    "F16": _f16_values,
    "BF16": _bf16,
    "I32": _i32,
}

_BLOCK_DECODERS: dict[str, Callable[[np.ndarray, np.ndarray], None]] = {
    "Q8_0": _q8_0,
    "Q2_K": _q2_k,
    "Q4_K": _q4_k,
    "IQ2_XXS": _iq2_xxs,
}


def _as_bytes(data) -> np.ndarray:
    """`data` (bytes-like, or an ndarray of any dtype, e.g. a memmap) as a flat uint8 array, no copy."""
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return np.frombuffer(data, dtype=np.uint8)


def dequantize(data, type_name: str, shape: Sequence[int]) -> np.ndarray:
    """Decode the raw bytes of a `type_name` tensor into a float32 array of numpy-order `shape`.

    `shape` is GGUF's dims reversed (last dimension contiguous). I32 tensors decode to int32;
    F32 and I32 come back as zero-copy views of `data`. Raises QuantError if the byte count does
    not match `shape`.
    """
    raw = _as_bytes(data)
    shape = tuple(int(n) for n in shape)
    fmt = check_byte_count(type_name, shape, raw.size)
    blocks = raw.reshape(raw.size // fmt.block_bytes, fmt.block_bytes)
    if type_name in _PLAIN_DECODERS:
        return _PLAIN_DECODERS[type_name](blocks).reshape(shape)
    decode = _BLOCK_DECODERS[type_name]
    out = np.empty((len(blocks), fmt.block_elems), dtype=np.float32)
    for start in range(0, len(blocks), _CHUNK_BLOCKS):
        stop = start + _CHUNK_BLOCKS
        decode(blocks[start:stop], out[start:stop])
    return out.reshape(shape)
