"""ds4's CPU routed experts, dot for dot: IQ2_XXS gate/up and Q2_K down against Q8_K activations.

ds4.c (8d57664, the scalar path every x86-64 build runs; there is no AVX code) multiplies a
routed expert's rows with the activation quantised to Q8_K (int8 codes per 256, one float
scale d): per super-block of 256 an exact integer dot, then float32 arithmetic per block
accumulated in order along the row:

- IQ2_XXS (`ds4_vec_dot_iq2_xxs_q8_K`): per 32 values, the signed grid values g (±8, 25, 43)
  times the codes, weighted by the integer ls = 2·(scale nibble) + 1; per block
  d = f16(x.d) · y.d and sumf = fma(d, Σ, sumf) (gcc -ffast-math contracts it); the row's
  result is 0.125f · sumf.
- Q2_K (`ds4_vec_dot_q2_K_q8_K`): per 16 values, (scale nibble) · q2 · code summed as isum, and
  Σ bsums·(min nibble) as summs; per block dall = y.d · f16(x.d),
  t = (summs · y.d) · f16(x.dmin), sumf += fma(dall, isum, -t) (again as gcc emits it).

So the weights become integer vectors per block (ls·g, or scale·q2 and min per value), whose
dots with the int8 codes are exact in float64 whatever the summation order; only the per-block
float steps are ds4's, done here in ds4's order. An FMA is emulated as one float64 product
(exact: 24-bit times at most 26-bit integer) plus the addend, rounded to float32 (a double
rounding, off by one ulp in about 1 of 2^29 cases).

The expert itself (`layer_routed_moe_one`, ds4's decode path): Q8_K of the input; per row the
gate and up dots; clamp; mid = (gate·sigmoid(gate))·(up·w); Q8_K of each slot's mid; the down
dots; the slots' rows added in slot order from 0.0f. ds4's CPU path has no Q4_K dot (it
refuses Q4_K experts), so Q4_K models keep the float dot of Q8_K-rounded activations.
"""

from __future__ import annotations

import numpy as np

from ..quants.formats import row_bytes
from ..quants.numpy_decode import split_fields
from ..quants.tables import IQ2XXS_SIGNED_GRID

TYPES = ("IQ2_XXS", "Q2_K")
_QK = 256
_Q8K_SCALE = np.float32(-1.0 / 127.0)   # gcc -ffast-math: d = max * float32(-1/127)


def q8_k_codes(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ds4's Q8_K quantisation of rows x [n, k]: (int8 codes as float64 [n, k/256, 256], d
    float32 [n, k/256]), d as ds4's -ffast-math builds compute it (max · float32(-1/127)).

    max is the signed value of largest magnitude (the first on ties); iscale = -127 / max;
    code = clamp(rint(iscale · x), -128, 127); an all-zero block gives d = 0 and codes 0."""
    b = np.asarray(x, np.float32).reshape(len(x), -1, _QK)
    first = np.abs(b).argmax(axis=-1)[..., None]
    signed_max = np.take_along_axis(b, first, axis=-1)
    zero = signed_max == 0
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = np.where(zero, np.float32(0), np.float32(-127.0) / np.where(zero, np.float32(1), signed_max))
    codes = np.clip(np.rint(iscale * b), -128, 127)
    d = np.where(zero, np.float32(0), signed_max * _Q8K_SCALE)[..., 0].astype(np.float32)
    return codes.astype(np.float64), d


class ExpertRows:
    """One expert matrix [rows, cols] of IQ2_XXS or Q2_K blocks as ds4's integer dot sees it."""

    def __init__(self, raw: np.ndarray, type_name: str, rows: int, cols: int) -> None:
        if type_name not in TYPES:
            raise ValueError(f"ds4's CPU dots cover {TYPES}, not {type_name}")
        self.type_name = type_name
        blocks = np.asarray(raw, np.uint8).reshape(rows, cols // _QK, row_bytes(type_name, _QK))
        nb = cols // _QK
        flat = blocks.reshape(-1, blocks.shape[-1])
        if type_name == "IQ2_XXS":
            self.d = flat[:, :2].copy().view(np.float16).astype(np.float32).reshape(rows, nb)
            words = np.ascontiguousarray(flat[:, 2:]).view(np.uint32).reshape(-1, 8, 2)
            grid = words[:, :, :1].view(np.uint8).astype(np.intp)                        # [n, 8, 4]
            aux = words[:, :, 1:]
            signs = (aux >> (7 * np.arange(4, dtype=np.uint32))) & 0x7F                   # [n, 8, 4]
            values = IQ2XXS_SIGNED_GRID[grid, signs]                                      # [n, 8, 4, 8]
            ls = (2 * (aux >> 28) + 1).astype(np.float64)[..., None]                       # [n, 8, 1, 1]
            self.weights = (values * ls).reshape(rows, nb, _QK).astype(np.float64)
        else:
            scales = flat[:, :16]
            q = split_fields(flat[:, 16:80], 2).reshape(-1, 16, 16).astype(np.float64)
            self.weights = ((scales & 0xF)[:, :, None] * q).reshape(rows, nb, _QK)
            self.mins = np.broadcast_to((scales >> 4)[:, :, None], (len(flat), 16, 16)).reshape(rows, nb, _QK)
            self.mins = self.mins.astype(np.float64)
            self.d = flat[:, 80:82].copy().view(np.float16).astype(np.float32).reshape(rows, nb)
            self.dmin = flat[:, 82:84].copy().view(np.float16).astype(np.float32).reshape(rows, nb)

    def dot(self, codes: np.ndarray, d: np.ndarray) -> np.ndarray:
        """ds4's dot of every row with every Q8_K activation: [n, rows] float32."""
        n, nb = d.shape
        sumf = np.zeros((n, self.weights.shape[0]), np.float32)
        for b in range(nb):
            isum = codes[:, b] @ self.weights[:, b].T                                    # exact integers
            if self.type_name == "IQ2_XXS":
                scale = self.d[None, :, b] * d[:, b, None]                                # f16(x.d) * y.d
                sumf = _fma(scale, isum, sumf)
            else:
                summs = codes[:, b] @ self.mins[:, b].T
                dall = d[:, b, None] * self.d[None, :, b]                                 # y.d * f16(x.d)
                t = (summs.astype(np.float32) * d[:, b, None]) * self.dmin[None, :, b]
                sumf = sumf + _fma(dall, isum, -t)
        return sumf * np.float32(0.125) if self.type_name == "IQ2_XXS" else sumf


def _fma(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32(a·b + c) with one rounding of the product (float64 holds it exactly)."""
    return (a.astype(np.float64) * b + c.astype(np.float64)).astype(np.float32)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    """ds4's sigmoid_stable: 1/(1+e^-x) for x >= 0, e^x/(1+e^x) below."""
    e = np.exp(-np.abs(x)).astype(np.float32)
    return np.where(x >= 0, np.float32(1) / (np.float32(1) + e), e / (np.float32(1) + e))


def routed_experts(x: np.ndarray, experts: np.ndarray, weights: np.ndarray, tensors: dict, clamp: float,
                   on_mid=None) -> np.ndarray:
    """Σ over slots, in slot order, of ds4's expert output for rows x [T, d]; experts and
    weights [T, U]; tensors the layer's gate/up/down ExpertBlocks. `on_mid` sees the
    Q8_K-rounded mids [T, U, n_ff] (the down projections' input)."""
    t, u = experts.shape
    codes, d = q8_k_codes(x)
    gate_t, up_t, down_t = (tensors[f"ffn_{r}_exps.weight"] for r in ("gate", "up", "down"))
    down_out = np.zeros((t, u, down_t.rows), np.float32)
    mids = np.zeros((t, u, down_t.cols), np.float32) if on_mid is not None else None
    for e in np.unique(experts):
        tok, slot = np.nonzero(experts == e)
        gate = _rows(gate_t, e).dot(codes[tok], d[tok])
        up = _rows(up_t, e).dot(codes[tok], d[tok])
        if clamp > 1e-6:
            gate = np.minimum(gate, np.float32(clamp))
            up = np.clip(up, np.float32(-clamp), np.float32(clamp))
        mid = (gate * _sigmoid(gate)) * (up * weights[tok, slot][:, None])
        mid_codes, mid_d = q8_k_codes(mid)
        down_out[tok, slot] = _rows(down_t, e).dot(mid_codes, mid_d)
        if mids is not None:
            mids[tok, slot] = (mid_codes * mid_d[..., None]).astype(np.float32).reshape(len(tok), -1)
    if on_mid is not None:
        on_mid(mids)
    out = np.zeros((t, down_t.rows), np.float32)
    for s in range(u):
        out = out + down_out[:, s]
    return out


def _rows(tensor, expert: int) -> ExpertRows:
    size = tensor.rows * row_bytes(tensor.type_name, tensor.cols)
    raw = np.asarray(tensor.raw[int(expert)]).reshape(-1)[:size]
    return ExpertRows(raw, tensor.type_name, tensor.rows, tensor.cols)
