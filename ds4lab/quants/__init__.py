"""Decoding the GGUF block formats ds4 uses (F32, F16, BF16, Q8_0, Q2_K, Q4_K, IQ2_XXS, I32).

Two decoders with identical, gguf-py bit-exact results: numpy (`dequantize`) for analysis,
MLX (`dequantize_mx`, `gather_experts`) for lazy decoding on any MLX backend. `quantize`
encodes Q8_0, Q2_K, Q4_K and IQ2_XXS the way ds4's converter does, with optional importance.
"""

from .formats import FORMATS, BlockFormat, QuantError, block_format, row_bytes, tensor_bytes
from .mlx_decode import dequantize_mx, gather_experts
from .numpy_decode import dequantize
from .quantize import QUANTIZABLE, column_energy, quantize, quantize_q8_0
from .synthetic import random_blocks

__all__ = [
    "FORMATS",
    "QUANTIZABLE",
    "BlockFormat",
    "QuantError",
    "block_format",
    "column_energy",
    "dequantize",
    "dequantize_mx",
    "gather_experts",
    "quantize",
    "quantize_q8_0",
    "random_blocks",
    "row_bytes",
    "tensor_bytes",
]
