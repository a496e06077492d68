"""Constant lookup tables for IQ2_XXS, derived from gguf-py at import.

Taking them from the reference implementation (instead of pasting hex tables) keeps them
identical to what the bit-exactness tests compare against.
"""

from __future__ import annotations

import numpy as np
from gguf.quants import IQ2_XXS

IQ2_XXS.init_grid()

IQ2XXS_GRID: np.ndarray = IQ2_XXS.grid.reshape(256, 8).astype(np.float32)
"""The 256 grid points of 8 magnitudes (8, 25 or 43) each, float32 [256, 8]."""

IQ2XXS_GRID_BYTES: np.ndarray = np.ascontiguousarray(IQ2_XXS.grid.reshape(256, 8), dtype=np.uint8)
"""The grid as the block kernels read it, uint8 [256, 8]."""

IQ2XXS_KSIGNS: np.ndarray = np.frombuffer(IQ2_XXS.ksigns, dtype=np.uint8).copy()
"""The 128 sign bytes (7 stored bits, the 8th their parity), uint8 [128]."""

IQ2XXS_SIGNS: np.ndarray = np.where((IQ2XXS_KSIGNS[:, None] >> np.arange(8, dtype=np.uint8)) & 1, -1,
                                    1).astype(np.float32)
"""The 128 sign patterns (7 stored bits plus even parity) as ±1, float32 [128, 8]."""

IQ2XXS_SIGNED_GRID: np.ndarray = IQ2XXS_GRID[:, None, :] * IQ2XXS_SIGNS[None, :, :]
"""Every grid point under every sign pattern, float32 [256, 128, 8].

Decoders multiply the block scale by this instead of by grid and sign in turn: negation
commutes with round-to-nearest, so ``db * (±g) == (db * g) * (±1)`` bit for bit.
"""
