"""Random weights with the real layout, built straight in (device) memory: no file.

For speed and memory work on shapes too big to write out, such as all 43 layers of
`flash-dims` on a GPU. Values are scaled like `ds4lab.synth`'s, closely enough for
timing; use synth for anything that compares numbers.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from ..config import ModelConfig
from ..layout import VARIANT_TYPES, main_tensors, with_types
from ..quants import FORMATS
from ..synth import EXPERT_D_AT_256
from .weights import ExpertBlocks, LayerWeights, ModelWeights, Q8Matrix

# Byte offsets of the f16 super-scales inside one block (d, and dmin for the K-quants).
_SCALE_FIELDS = {"IQ2_XXS": (0,), "Q2_K": (80, 82), "Q4_K": (0, 2)}


def _expert_blocks(type_name: str, n_expert: int, rows: int, cols: int) -> ExpertBlocks:
    fmt = FORMATS[type_name]
    n_blocks = n_expert * rows * cols // fmt.block_elems
    raw = mx.random.randint(0, 256, (n_blocks, fmt.block_bytes), dtype=mx.uint8)
    d = np.float16(EXPERT_D_AT_256[type_name] * math.sqrt(256 / cols))
    scale = mx.array(np.frombuffer(d.tobytes(), np.uint8))
    parts, at = [], 0
    for offset in _SCALE_FIELDS[type_name]:
        parts += [raw[:, at:offset], mx.broadcast_to(scale, (n_blocks, 2))]
        at = offset + 2
    parts.append(raw[:, at:])
    raw = mx.concatenate(parts, axis=1).reshape(n_expert, -1)
    mx.eval(raw)
    return ExpertBlocks(raw, type_name, rows, cols)


def _q8(rows: int, cols: int) -> Q8Matrix:
    codes = mx.random.randint(0, 1 << 31, (rows, cols // 4), dtype=mx.uint32)
    scales = mx.full((rows, cols // 32), 1.0 / (74.0 * math.sqrt(cols)), mx.float32)
    matrix = Q8Matrix(codes, scales, -128.0 * scales, rows, cols)
    mx.eval(matrix.codes, matrix.scales, matrix.biases)
    return matrix


def random_weights(cfg: ModelConfig, variant: str = "q2", seed: int = 0) -> ModelWeights:
    """A ModelWeights for `cfg` with random values, allocated on MLX's default device."""
    mx.random.seed(seed)
    layers = [LayerWeights(index=i, ratio=cfg.compress_ratios[i]) for i in range(cfg.n_layer)]
    token_embd = output = None
    head: dict[str, mx.array] = {}
    for spec, type_name in with_types(main_tensors(cfg), cfg, VARIANT_TYPES[variant]):
        shape = tuple(reversed(spec.dims))
        if spec.role.endswith("_exps.weight"):
            value = _expert_blocks(type_name, *shape)
        elif type_name == "Q8_0":
            value = _q8(*shape)
        elif type_name == "I32":
            value = mx.random.randint(0, cfg.n_expert, shape, dtype=mx.int32)
        elif spec.role.endswith("norm.weight"):
            value = 1.0 + 0.1 * mx.random.normal(shape)
        else:
            value = mx.random.normal(shape) * (1.0 / math.sqrt(spec.dims[0]) if len(shape) > 1 else 0.5)
        if type_name == "F16":                       # values a file could hold (`LayerWeights.kernel_dense`)
            value = value.astype(mx.float16).astype(mx.float32)
        if spec.layer is None:
            if spec.name == "token_embd.weight":
                token_embd = value.astype(mx.float16)
            elif spec.name == "output.weight":
                output = value
            else:
                head[spec.name.removesuffix(".weight")] = value
            continue
        layer = layers[spec.layer]
        if isinstance(value, ExpertBlocks):
            layer.experts[spec.role] = value
        elif isinstance(value, Q8Matrix):
            layer.q8[spec.role] = value
        elif type_name == "I32":
            layer.tid2eid = value
        else:
            layer.dense[spec.role] = value
            if type_name == "F16":
                layer.f16_roles.add(spec.role)
        mx.eval(list(layer.dense.values()))
    return ModelWeights(cfg, token_embd, output, head, layers)
