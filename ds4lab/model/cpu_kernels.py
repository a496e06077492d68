"""The CPU's native kernel: a Q8_0 matrix times float rows, read in its 8-bit codes.

On the CPU a decode step is bound by the large Q8_0 matrices (the output head above all:
129,280 x n_embd). Through a BLAS they are multiplied decoded to float32, 4 bytes a weight,
and in a tile of rows (the batch-invariant path's, `linalg`). `kernels/cpu/q8_0_matmul.c`
reads the codes where they lie (1 byte a weight plus a scale per 32) and sums every output
in an order fixed by its source, whatever the number of rows, threads or vector width: so
prefill and decode still agree bit for bit, on any CPU.

The source is compiled with the system C compiler (`$CC`, else `cc`) on first use, into
`$DS4LAB_CACHE/kernels/` under a name that hashes the source and the flags, and loaded with
ctypes. Without a compiler (or with `DS4LAB_NATIVE=0`) `available()` is False and the model
keeps the BLAS product: the same function in another float order.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..paths import cache_dir
from .linalg import CACHED_WEIGHTS

SOURCE = Path(__file__).resolve().parents[2] / "kernels" / "cpu" / "q8_0_matmul.c"
# No FMA contraction and no fast-math: the source's order of roundings is the result's.
FLAGS = ["-O3", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared", "-pthread"]
# Products below this many multiply-adds run on the calling thread (a thread costs ~30 µs).
THREADED_MACS = 1 << 22


def _build() -> ctypes.CDLL | None:
    if os.environ.get("DS4LAB_NATIVE", "1") == "0" or not SOURCE.is_file():
        return None
    source = SOURCE.read_bytes()
    compiler = os.environ.get("CC", "cc")
    key = hashlib.sha256(b"\0".join([source, " ".join([compiler, *FLAGS]).encode(),
                                     platform.machine().encode()])).hexdigest()[:16]
    out_dir = cache_dir() / "kernels"
    out_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    library = out_dir / f"q8_0_matmul-{key}.so"
    if not library.is_file():
        fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so")
        os.close(fd)
        try:
            subprocess.run([compiler, *FLAGS, "-o", tmp, str(SOURCE)], check=True, capture_output=True, timeout=120)
            os.replace(tmp, library)
        except (OSError, subprocess.SubprocessError):
            Path(tmp).unlink(missing_ok=True)
            return None
    lib = ctypes.CDLL(str(library))
    fn = lib.ds4lab_q8_0_matmul
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    return lib


@cache
def _library() -> ctypes.CDLL | None:
    return _build()


def available() -> bool:
    """Whether the native kernel is built (or can be) on this machine."""
    return _library() is not None


def handles(rows: int, cols: int) -> bool:
    """Whether the batch-invariant CPU path multiplies a [rows, cols] Q8_0 matrix here: the
    memory-bound ones (more than `linalg.CACHED_WEIGHTS` weights), when the kernel is built.
    The smaller ones stay in the caches, where the BLAS's tiles are faster."""
    return rows * cols > CACHED_WEIGHTS and available()


def q8_0_matmul(codes: mx.array, scales: mx.array, x: mx.array) -> mx.array:
    """x [..., cols] @ W.T for W [rows, cols] held as `Q8Matrix` holds it: `codes` the int8
    codes + 128 as uint8 (packed four to a uint32, as MLX's 8-bit quantisation stores them),
    `scales` [rows, cols / 32] float32. Evaluates x; the result is a new array [..., rows]."""
    lib = _library()
    if lib is None:
        raise RuntimeError(f"the native CPU kernel is not built ({SOURCE}): no C compiler, or DS4LAB_NATIVE=0")
    rows, n_blocks = scales.shape
    cols = n_blocks * 32
    if x.shape[-1] != cols:
        raise ValueError(f"x has {x.shape[-1]} columns, the matrix {cols}")
    code_bytes = np.asarray(codes).view(np.uint8)
    scale_values = np.asarray(scales)
    if code_bytes.shape != (rows, cols) or scale_values.dtype != np.float32:
        raise ValueError(f"codes {code_bytes.shape} and scales {scale_values.shape} "
                         f"{scale_values.dtype} do not describe a [{rows}, {cols}] Q8_0 matrix")
    lead = x.shape[:-1]
    xs = np.ascontiguousarray(np.asarray(x.astype(mx.float32)).reshape(-1, cols))
    code_bytes = np.ascontiguousarray(code_bytes)
    scale_values = np.ascontiguousarray(scale_values)
    n = xs.shape[0]
    y = np.empty((n, rows), np.float32)
    if n:
        threads = min(os.cpu_count() or 1, 16) if n * rows * cols >= THREADED_MACS else 1
        lib.ds4lab_q8_0_matmul(code_bytes.ctypes.data, scale_values.ctypes.data, xs.ctypes.data, y.ctypes.data,
                               rows, cols, n, threads)
    return mx.array(y).reshape(*lead, rows)
