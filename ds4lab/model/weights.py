"""The model's weights in MLX, loaded from a ds4 GGUF without expanding it.

What each GGUF type becomes, and why:
- Q8_0 matrices (projections, shared expert, output head) become MLX 8-bit affine
  matrices with group 32: code q+128, scale d, bias -128·d, all exact in float32. They
  multiply through `mx.quantized_matmul` and take 40 bytes per 32 weights (Q8_0: 34).
- Routed experts stay as their GGUF block bytes, one uint8 row per expert; a forward pass
  decodes only the experts its tokens selected (`gather_experts`). On the CPU they are also
  kept decoded while a budget allows (`keep_decoded`).
- F16 matrices (HC mixers, compressors, indexer, router) are small (about 1 GiB in Flash)
  and are widened to float32 once, since ds4 multiplies them with float32 activations. The
  fast path's compressor, indexer-query and router kernels read an F16 copy instead
  (`kernel_dense`: the same values, half the bytes, widened as loaded).
- F32 vectors stay as they are; the token embedding stays F16 and is gathered by row.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from ..config import ModelConfig
from ..errors import ModelFileError
from ..gguf import ModelFile
from ..quants.mlx_decode import dequantize_mx
from . import cpu_kernels
from .numerics import batch_invariant_device


@dataclass
class Q8Matrix:
    """A Q8_0 matrix [rows, cols] held as MLX 8-bit affine (exact), used as y = x @ W.T."""

    codes: mx.array
    scales: mx.array
    biases: mx.array
    rows: int
    cols: int
    float32: mx.array | None = None   # the decoded matrix, kept on the CPU while a budget allows

    @classmethod
    def from_blocks(cls, raw: np.ndarray, rows: int, cols: int) -> Q8Matrix:
        blocks = np.asarray(raw, dtype=np.uint8).reshape(rows, cols // 32, 34)
        d = blocks[:, :, :2].copy().view(np.float16)[..., 0].astype(np.float32)
        codes = (blocks[:, :, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        scales = mx.array(d)
        return cls(mx.array(codes.reshape(rows, cols).view(np.uint32)), scales, -128.0 * scales, rows, cols)

    def quantized(self, x: mx.array) -> mx.array:
        """x @ W.T through MLX's quantized matmul (the batched path; `Schedule.q8` chooses)."""
        return mx.quantized_matmul(x, self.codes, self.scales, self.biases, transpose=True, group_size=32, bits=8)

    def ds4_cpu(self, x: mx.array, x_codes: mx.array, x_scales: mx.array) -> mx.array:
        """y = x @ W.T the way ds4's CPU Q8_0 matvec computes it, for an activation already
        quantised to int8 codes [.., n/32, 32] with float32 scales [.., n/32].

        Per block of 32 the integer dot is exact (every partial sum is an integer below 2^24,
        so any order gives it); the blocks are then accumulated in order as
        acc += (d_w * d_x) * isum, ds4's expression. What remains is float32 rounding
        identical to ds4's loop. A block's dots come from MLX's 8-bit quantized matmul on
        that block's code words with scale 1 and bias -128 (the codes themselves), so the
        matrix is never decoded whole: the output head's 129280 rows took 1.3 s a call
        decoded, 0.26 s so (tiny-a, 2-core VM)."""
        lead = x.shape[:-1]
        xc = x_codes.reshape(-1, x_codes.shape[-2], 32)
        xs = x_scales.reshape(-1, x_scales.shape[-1])
        blocks = self.cols // 32
        words = self.codes.reshape(self.rows, blocks, 8)
        unit = mx.ones((self.rows, 1), mx.float32)
        offset = mx.full((self.rows, 1), -128.0, mx.float32)
        acc = mx.zeros((xc.shape[0], self.rows), mx.float32)
        for b in range(blocks):
            isum = mx.quantized_matmul(xc[:, b], words[:, b], unit, offset, transpose=True, group_size=32, bits=8)
            acc = acc + (self.scales[:, b][None, :] * xs[:, b][:, None]) * isum
        return acc.reshape(*lead, self.rows)

    def dense(self) -> mx.array:
        """The matrix in float32: the kept copy if there is one, else a temporary."""
        if self.float32 is not None:
            return self.float32
        return mx.dequantize(self.codes, self.scales, self.biases, group_size=32, bits=8)

    def rows_slice(self, start: int, stop: int) -> Q8Matrix:
        """Rows [start, stop) as their own matrix (the grouped output projection's groups)."""
        kept = None if self.float32 is None else self.float32[start:stop]
        return Q8Matrix(self.codes[start:stop], self.scales[start:stop], self.biases[start:stop],
                        stop - start, self.cols, kept)

    @property
    def nbytes(self) -> int:
        kept = self.float32.nbytes if self.float32 is not None else 0
        return self.codes.nbytes + self.scales.nbytes + self.biases.nbytes + kept


@dataclass
class ExpertBlocks:
    """A routed-expert tensor kept in its GGUF block format: bytes [n_expert, expert_bytes]."""

    raw: mx.array
    type_name: str
    rows: int
    cols: int
    float32: mx.array | None = None   # every expert decoded, [n_expert, rows, cols], kept while a CPU budget allows

    def dense(self) -> mx.array:
        """Every expert decoded to float32, [n_expert, rows, cols]: the kept copy if there is one."""
        if self.float32 is not None:
            return self.float32
        return dequantize_mx(self.raw, self.type_name, (self.raw.shape[0], self.rows, self.cols))

    @property
    def nbytes(self) -> int:
        return self.raw.nbytes + (self.float32.nbytes if self.float32 is not None else 0)


# The F16 matrices the fast path's kernels read as F16 (`LayerWeights.kernel_dense`): the
# compressors' (compressor_slot), the indexer's q_b (indexer_queries), the router's.
KERNEL_F16_ROLES = ("attn_compressor_kv.weight", "attn_compressor_gate.weight", "indexer_compressor_kv.weight",
                    "indexer_compressor_gate.weight", "indexer.attn_q_b.weight", "ffn_gate_inp.weight")


@dataclass
class LayerWeights:
    """One block's tensors, keyed by their GGUF role ('attn_q_a.weight', ...)."""

    index: int | None
    ratio: int
    q8: dict[str, Q8Matrix] = field(default_factory=dict)
    dense: dict[str, mx.array] = field(default_factory=dict)
    experts: dict[str, ExpertBlocks] = field(default_factory=dict)
    tid2eid: mx.array | None = None
    f16_roles: set[str] = field(default_factory=set)        # dense roles whose values are F16 (the file's type)
    _transposed: dict[str, mx.array] = field(default_factory=dict, repr=False)
    half_copies: dict[str, mx.array] = field(default_factory=dict, repr=False)   # kernel_dense's, by role

    def kernel_dense(self, role: str) -> mx.array:
        """dense[role] as the fast path's kernels read it: an F16 copy, made once, when the file
        stored it in F16 (the same values: widening F16 is exact; half the bytes a step),
        else the float32 array itself."""
        if role not in self.f16_roles:
            return self.dense[role]
        if role not in self.half_copies:
            self.half_copies[role] = self.dense[role].astype(mx.float16)
        return self.half_copies[role]

    def transposed(self, role: str) -> mx.array:
        """dense[role].T, made once: a view (no copy) that the fast path multiplies by, so that a
        decode step does not add a transpose operation per product."""
        if role not in self._transposed:
            self._transposed[role] = self.dense[role].T
        return self._transposed[role]

    def fast_inputs(self) -> list[mx.array]:
        """Every array the fast path reads from this block (the block-format weights' bytes and
        scales, the float tensors, the transposed router, the F16 copies its kernels read),
        those made. The model evaluates them before it traces a block's compiled parts, so
        that no copy is first made inside a trace (it would be the trace's placeholder)."""
        if "ffn_gate_inp.weight" in self.dense:
            self.transposed("ffn_gate_inp.weight")
        for role in KERNEL_F16_ROLES:
            if role in self.dense:
                self.kernel_dense(role)
        return [*self.dense.values(), *self._transposed.values(), *self.half_copies.values(),
                *(a for m in self.q8.values() for a in (m.codes, m.scales)), *(e.raw for e in self.experts.values()),
                *([] if self.tid2eid is None else [self.tid2eid])]


@dataclass
class ModelWeights:
    config: ModelConfig
    token_embd: mx.array
    output: Q8Matrix
    head: dict[str, mx.array]
    layers: list[LayerWeights]

    @property
    def nbytes(self) -> int:
        total = self.token_embd.nbytes + self.output.nbytes + sum(v.nbytes for v in self.head.values())
        for layer in self.layers:
            total += sum(m.nbytes for m in layer.q8.values()) + sum(v.nbytes for v in layer.dense.values())
            total += sum(e.nbytes for e in layer.experts.values())
            total += layer.tid2eid.nbytes if layer.tid2eid is not None else 0
        return total


def _dense(model_file: ModelFile, name: str) -> mx.array:
    return mx.array(model_file.dequantize(name).astype(np.float32))


def load_block(model_file: ModelFile, prefix: str, index: int | None, ratio: int) -> LayerWeights:
    cfg = model_file.config
    layer = LayerWeights(index=index, ratio=ratio)
    start = len(prefix) + 1
    for name, info in model_file.tensors.items():
        if not name.startswith(prefix + "."):
            continue
        role = name[start:]
        if role.endswith("_exps.weight"):
            n_expert, rows, cols = info.shape
            raw = model_file.raw(name).reshape(n_expert, -1)
            layer.experts[role] = ExpertBlocks(mx.array(raw), info.type_name, rows, cols)
        elif role == "ffn_gate_tid2eid.weight":
            table = model_file.dequantize(name)
            if table.size and (table.min() < 0 or table.max() >= cfg.n_expert):
                raise ModelFileError(model_file.path, f"tensor {name}: expert ids outside 0..{cfg.n_expert - 1}")
            layer.tid2eid = mx.array(table)
        elif info.type_name == "Q8_0":
            rows, cols = info.shape
            layer.q8[role] = Q8Matrix.from_blocks(model_file.raw(name), rows, cols)
        else:
            layer.dense[role] = _dense(model_file, name)
            if info.type_name == "F16":
                layer.f16_roles.add(role)
    return layer


# Q8_0 matrices and routed experts kept decoded in float32 on the CPU, so that decode steps
# do not decode them again: up to this many bytes (the output head first, the routed experts
# last), DS4LAB_CPU_DENSE_MB to change. With the native kernels (`cpu_kernels`) the Q8_0
# matrices are multiplied in their codes and the routed experts read in their blocks (IQ2_XXS,
# Q2_K, Q4_K): neither is decoded.
CPU_DENSE_BUDGET_MB = 1024


def keep_decoded(matrices: list[Q8Matrix | ExpertBlocks]) -> None:
    """On the CPU, keep these matrices (or expert tensors) decoded in float32 while the budget
    allows (first come first)."""
    if not batch_invariant_device():
        return
    budget = int(os.environ.get("DS4LAB_CPU_DENSE_MB", CPU_DENSE_BUDGET_MB)) << 20
    for matrix in matrices:
        # The native kernels read these in their codes / blocks ("ds4-cpu" numerics then decode
        # Q4_K experts per step: only its IQ2_XXS / Q2_K dots are ds4's).
        if cpu_kernels.available() and (isinstance(matrix, Q8Matrix) or
                                        cpu_kernels.reads_blocks(matrix.type_name, matrix.cols)):
            continue
        size = matrix.rows * matrix.cols * 4 * (matrix.raw.shape[0] if isinstance(matrix, ExpertBlocks) else 1)
        if size <= budget:
            matrix.float32 = matrix.dense()
            mx.eval(matrix.float32)
            budget -= size


def load_weights(model_file: ModelFile) -> ModelWeights:
    """Every main-model tensor of `model_file` in its MLX form (see the module docstring)."""
    cfg = model_file.config
    layers = [load_block(model_file, f"blk.{i}", i, cfg.compress_ratios[i]) for i in range(cfg.n_layer)]
    head = {role: _dense(model_file, f"{role}.weight") for role in
            ("output_hc_base", "output_hc_fn", "output_hc_scale", "output_norm")}
    embd = model_file.tensor("token_embd.weight")
    output = model_file.tensor("output.weight")
    weights = ModelWeights(
        config=cfg,
        token_embd=mx.array(model_file.raw("token_embd.weight").view(np.float16).reshape(embd.shape)),
        output=Q8Matrix.from_blocks(model_file.raw("output.weight"), *output.shape),
        head=head,
        layers=layers,
    )
    keep_decoded([weights.output] + [m for layer in weights.layers for m in layer.q8.values()]
                 + [e for layer in weights.layers for e in layer.experts.values()])
    return weights


def resident_bytes(model_file: ModelFile) -> dict[str, int]:
    """Bytes `load_weights` keeps in memory, by component, computed from the header alone.

    Q8_0 matrices take 40 bytes per 32 weights (codes, float32 scale and bias); F16 matrices
    other than the embedding are widened to float32; everything else keeps its file size.
    """
    totals: dict[str, int] = {}
    table = model_file.tensor_table()
    for row in table.itertuples():
        if row.type == "Q8_0":
            size = row.n_elements // 32 * 40
        elif row.type == "F16" and row.name != "token_embd.weight":
            size = row.n_elements * 4
        else:
            size = row.bytes
        totals[str(row.component)] = totals.get(str(row.component), 0) + int(size)
    return totals
