"""The GGUF block formats ds4 uses, and their byte sizes.

Sizes come from gguf-py's ``GGML_QUANT_SIZES`` so they cannot drift from the reference.
Shapes here are in numpy order: the last dimension is the contiguous one (GGUF's ``ne0``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from ..errors import Ds4labError


class QuantError(Ds4labError, ValueError):
    """A tensor's type, shape or byte count is not what a block format allows."""


@dataclass(frozen=True)
class BlockFormat:
    name: str
    ggml_type: int
    block_elems: int
    block_bytes: int


def _format(name: str) -> BlockFormat:
    qtype = GGMLQuantizationType[name]
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    return BlockFormat(name, int(qtype), block_elems, block_bytes)


FORMATS: dict[str, BlockFormat] = {
    name: _format(name) for name in ("F32", "F16", "BF16", "Q8_0", "Q2_K", "Q4_K", "IQ2_XXS", "I32")
}


def block_format(type_name: str) -> BlockFormat:
    """The format called `type_name`, or QuantError if ds4lab does not support it."""
    try:
        return FORMATS[type_name]
    except KeyError:
        raise QuantError(f"unsupported tensor type {type_name!r}; supported: {', '.join(FORMATS)}") from None


def row_bytes(type_name: str, n_elems: int) -> int:
    """Bytes taken by `n_elems` consecutive values (a multiple of the block size) of `type_name`."""
    fmt = block_format(type_name)
    if n_elems < 0 or n_elems % fmt.block_elems:
        raise QuantError(f"{type_name}: {n_elems} values is not a multiple of the block size {fmt.block_elems}")
    return n_elems // fmt.block_elems * fmt.block_bytes


def tensor_bytes(type_name: str, shape: Sequence[int]) -> int:
    """Bytes taken by a `type_name` tensor of numpy-order `shape` (last dimension contiguous)."""
    shape = tuple(shape)
    if not shape:
        raise QuantError(f"{type_name}: a tensor needs at least one dimension")
    if any(n < 0 for n in shape):
        raise QuantError(f"{type_name}: negative dimension in shape {shape}")
    return math.prod(shape[:-1]) * row_bytes(type_name, shape[-1])


def check_byte_count(type_name: str, shape: Sequence[int], n_bytes: int) -> BlockFormat:
    """The format of `type_name`, after checking that `n_bytes` is exactly a tensor of `shape`."""
    expected = tensor_bytes(type_name, shape)
    if n_bytes != expected:
        raise QuantError(f"{type_name}: got {n_bytes} bytes, but shape {tuple(shape)} needs {expected} bytes")
    return block_format(type_name)
