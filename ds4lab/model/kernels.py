"""Fused CUDA kernels of the fast path (sources in `kernels/cuda/`, one small file each).

`hc_split`: the hyper-connection split (pre, post, Sinkhorn comb) of a token in one thread,
instead of some 80 MLX operations (MLX's compile fuses elementwise chains, not reductions).

Fused routed-expert matvec: decode the block bytes and multiply in one CUDA kernel.

The portable path (`moe._routed_gathered`) decodes each selected expert to a float32
matrix with MLX ops and multiplies it: a few dozen kernels and three float32 copies of
every expert per decode step. On CUDA these kernels (sources in `kernels/cuda/`) read
the IQ2_XXS, Q2_K or Q4_K bytes of the selected experts once, one warp per output row.
Their float sums run in a different order from the portable path (same values up to
float32 reassociation). Elsewhere (CPU, Metal) the portable path runs.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..quants.formats import row_bytes
from ..quants.tables import IQ2XXS_GRID
from .weights import ExpertBlocks

KERNEL_DIR = Path(__file__).resolve().parents[2] / "kernels" / "cuda"
_TYPES = {"IQ2_XXS": "iq2_xxs", "Q2_K": "q2_k", "Q4_K": "q4_k"}
_ROWS_PER_BLOCK = 4                      # warps per thread block


def cuda_ready() -> bool:
    """True when CUDA kernels can run: the default device is a CUDA GPU and the sources exist."""
    return mx.default_device() == mx.gpu and hasattr(mx, "cuda") and mx.cuda.is_available() and KERNEL_DIR.is_dir()


def available(type_name: str) -> bool:
    """True when the fused expert kernel can run: CUDA ready and a supported type."""
    return type_name in _TYPES and cuda_ready()


@cache
def _hc_split_kernel():
    return mx.fast.cuda_kernel(name="ds4lab_hc_split", input_names=["mix", "scale", "base", "eps", "n_tok"],
                               output_names=["pre", "post", "comb"], source=(KERNEL_DIR / "hc_split.cu").read_text())


def hc_split(mix: mx.array, scale: mx.array, base: mx.array, n: int, sinkhorn_iters: int,
             hc_eps: float) -> tuple[mx.array, mx.array, mx.array]:
    """(pre [T, n], post [T, n], comb [T, n, n]) from mix [T, (2 + n)·n]: hc._split in one kernel."""
    t = mix.shape[0]
    threads = 64
    return tuple(_hc_split_kernel()(
        inputs=[mix.astype(mx.float32), scale.astype(mx.float32), base.astype(mx.float32),
                mx.array([hc_eps], mx.float32), mx.array([t], mx.int32)],
        template=[("N", n), ("ITERS", sinkhorn_iters)],
        grid=(-(-t // threads) * threads, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(t, n), (t, n), (t, n, n)],
        output_dtypes=[mx.float32] * 3,
    ))


@cache
def _kernel(type_name: str):
    name = _TYPES[type_name]
    header = (KERNEL_DIR / "expert_matvec_common.cuh").read_text()
    source = (KERNEL_DIR / f"expert_matvec_{name}.cu").read_text()
    inputs = ["raw", "ids", "x"] + (["grid", "ksigns"] if type_name == "IQ2_XXS" else [])
    return mx.fast.cuda_kernel(name=f"ds4lab_expert_matvec_{name}", input_names=inputs, output_names=["y"],
                               source=source, header=header)


@cache
def _iq2_tables() -> tuple[mx.array, mx.array]:
    from gguf.quants import IQ2_XXS

    signs = np.frombuffer(IQ2_XXS.ksigns, dtype=np.uint8)
    return mx.array(IQ2XXS_GRID.astype(np.uint8).reshape(-1)), mx.array(signs)


def expert_matvec(tensor: ExpertBlocks, ids: mx.array, x: mx.array) -> mx.array:
    """y [P, rows]: expert ids[p]'s matrix times x[p] (x [P, cols] float32), from block bytes."""
    rows, cols = tensor.rows, tensor.cols
    inputs = [tensor.raw, ids.astype(mx.int32), x.astype(mx.float32)]
    if tensor.type_name == "IQ2_XXS":
        inputs += list(_iq2_tables())
    threads = 32 * _ROWS_PER_BLOCK
    (y,) = _kernel(tensor.type_name)(
        inputs=inputs,
        template=[("ROWS", rows), ("COLS", cols), ("EXPERT_BYTES", rows * row_bytes(tensor.type_name, cols))],
        grid=(-(-rows // _ROWS_PER_BLOCK) * threads, ids.size, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(ids.size, rows)],
        output_dtypes=[mx.float32],
    )
    return y
