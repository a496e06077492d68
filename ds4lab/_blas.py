"""Load Debian's OpenBLAS before MLX on Linux.

MLX's Linux CPU wheel links a reference BLAS (fp32 GEMM about 5 GFLOP/s on this class of
machine). Opening OpenBLAS with RTLD_GLOBAL before `import mlx.core` makes MLX bind its
BLAS symbols to it instead (about 320 GFLOP/s). Set DS4LAB_NO_OPENBLAS=1 to skip.
"""

from __future__ import annotations

import ctypes
import os
import sys
import warnings

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
)

loaded_blas: str | None = None


def preload_openblas() -> str | None:
    """Open the first OpenBLAS found, globally; return its path (None if absent or not Linux)."""
    global loaded_blas
    if loaded_blas or not sys.platform.startswith("linux") or os.environ.get("DS4LAB_NO_OPENBLAS"):
        return loaded_blas
    if "mlx.core" in sys.modules:
        on_cpu = sys.modules["mlx.core"].default_device() == sys.modules["mlx.core"].cpu
        if on_cpu and any(os.path.exists(p) for p in OPENBLAS_CANDIDATES):
            warnings.warn("ds4lab was imported after mlx: MLX keeps its reference BLAS (fp32 GEMM ~60x slower "
                          "on CPU). Import ds4lab first.", RuntimeWarning, stacklevel=3)
        return None
    for path in OPENBLAS_CANDIDATES:
        if os.path.exists(path):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            loaded_blas = path
            return path
    return None
