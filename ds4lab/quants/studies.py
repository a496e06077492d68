"""Quantization studies: where the error of a recipe goes, as tidy DataFrames and plots.

- `weight_error`: per layer, role and expert, how far a requantized file's experts are from a
  reference's, plain and as the imatrix weighs it (the expected output error when columns
  are independent: Σ_c imp_c Σ_r ΔW_rc² over Σ_c imp_c Σ_r W_rc²).
- `output_error`: each expert's route-weighted output on the activations that reached it
  (`expert_inputs`), quantized against reference.
- `model_quality`: teacher-forced NLL, KL(reference ‖ candidate) and top-1 agreement of
  whole models over a prompt set; `quality_summary` condenses it per model.
- `q4_k_to_mlx`, `repack_check`: Q4_K repacked losslessly into MLX's 4-bit group-32 affine
  format; `mlx_requant_error`: the error of moving IQ2_XXS/Q2_K/Q4_K experts into MLX's
  own formats.

Errors are relative (a fraction of the reference's norm); plots show them in percent.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pandas as pd

from ..compare import logsumexp
from ..gguf import ModelFile
from .formats import FORMATS
from .imatrix import ROLES, Imatrix
from .numpy_decode import f16_field, q4_k_scale_min, split_fields
from .requantize import expert_bytes, expert_matrix

# Storage per weight of the GGUF block formats (bytes per block * 8 / values per block).
GGUF_BITS = {name: FORMATS[name].block_bytes * 8 / FORMATS[name].block_elems
             for name in ("IQ2_XXS", "Q2_K", "Q4_K", "Q8_0")}
# MLX formats compared by `mlx_requant_error`: (mode, bits, group size).
MLX_FORMATS = (("affine", 2, 32), ("affine", 2, 64), ("affine", 3, 32), ("affine", 3, 64),
               ("affine", 4, 32), ("affine", 4, 64), ("mxfp4", 4, 32))


def _expert_tensors(model_file: ModelFile, layers: Iterable[int] | None) -> list[tuple[int, str, str]]:
    chosen = range(model_file.config.n_layer) if layers is None else layers
    return [(layer, role, f"blk.{layer}.ffn_{role}_exps.weight") for layer in chosen for role in ROLES]


def _rel(diff: np.ndarray, ref: np.ndarray, weight: np.ndarray | None = None) -> float:
    """‖diff‖ / ‖ref‖, squared terms weighted per column by `weight` when given."""
    d2, r2 = np.square(diff, dtype=np.float64), np.square(ref, dtype=np.float64)
    if weight is not None:
        d2, r2 = d2 * weight, r2 * weight
    return float(np.sqrt(d2.sum() / r2.sum()))


# ---- weights ---------------------------------------------------------------------------------
def weight_error(reference: ModelFile, candidates: Mapping[str, ModelFile], imatrix: Imatrix | None = None,
                 layers: Iterable[int] | None = None) -> pd.DataFrame:
    """One row per (candidate, layer, role, expert): the candidate's type, `rel_rmse` against
    the reference expert, and with an imatrix `weighted_err` (see the module docstring) and
    the routes it counted."""
    cfg = reference.config
    rows = []
    for layer, role, name in _expert_tensors(reference, layers):
        for expert in range(cfg.n_expert):
            ref = expert_matrix(reference, name, expert)
            importance = None
            if imatrix is not None:
                importance = imatrix.importance(name, ref.shape[1], expert, cfg.n_expert)
            for label, candidate in candidates.items():
                diff = expert_matrix(candidate, name, expert) - ref
                row = {"variant": label, "layer": layer, "role": role, "expert": expert,
                       "type": candidate.tensor(name).type_name, "rel_rmse": _rel(diff, ref)}
                if importance is not None:
                    row["weighted_err"] = _rel(diff, ref, importance)
                    row["routes"] = int(imatrix.entries[name].counts[expert]) if name in imatrix.entries else 0
                rows.append(row)
    return pd.DataFrame(rows)


# ---- expert outputs --------------------------------------------------------------------------
@dataclass
class ExpertInputs:
    """What reached one layer's routed experts: FFN-normed inputs, chosen experts, route weights."""

    x: np.ndarray          # [T, n_embd]
    experts: np.ndarray    # [T, n_expert_used]
    weights: np.ndarray    # [T, n_expert_used]


def expert_inputs(model, prompts: Sequence[Sequence[int]]) -> dict[int, ExpertInputs]:
    """Each layer's routed-expert inputs over `prompts` (each run from an empty session)."""
    leaves = ("ffn.hook_in", "ffn.hook_experts", "ffn.hook_expert_weights")
    parts: dict[str, list[np.ndarray]] = {}
    for tokens in prompts:
        _, cache = model.run_with_cache(list(tokens), lambda n: n.endswith(leaves))
        for name, value in cache.items():
            parts.setdefault(name, []).append(value)
    out = {}
    for layer in range(model.config.n_layer):
        x, experts, weights = (np.concatenate(parts[f"blocks.{layer}.{leaf}"]) for leaf in leaves)
        out[layer] = ExpertInputs(x, experts, weights)
    return out


def _expert_out(model_file: ModelFile, layer: int, expert: int, x: np.ndarray, w: np.ndarray,
                clamp: float) -> np.ndarray:
    """W_down · (w · swiglu(W_gate x, W_up x)) for rows x with route weights w, [n, n_embd]."""
    gate, up, down = (expert_matrix(model_file, f"blk.{layer}.ffn_{r}_exps.weight", expert) for r in ROLES)
    g, u = x @ gate.T, x @ up.T
    if clamp > 1e-6:
        g, u = np.minimum(g, clamp), np.clip(u, -clamp, clamp)
    return (g / (1 + np.exp(-g)) * u * w[:, None]) @ down.T


def output_error(reference: ModelFile, candidates: Mapping[str, ModelFile],
                 inputs: Mapping[int, ExpertInputs]) -> pd.DataFrame:
    """One row per (candidate, layer, routed expert): routes seen and the relative error of the
    expert's output on exactly the inputs that were routed to it."""
    cfg = reference.config
    rows = []
    for layer, seen in inputs.items():
        clamp = cfg.swiglu_clamp[layer]
        for expert in np.unique(seen.experts):
            tok, slot = np.nonzero(seen.experts == expert)
            x, w = seen.x[tok], seen.weights[tok, slot]
            ref = _expert_out(reference, layer, int(expert), x, w, clamp)
            for label, candidate in candidates.items():
                diff = _expert_out(candidate, layer, int(expert), x, w, clamp) - ref
                rows.append({"variant": label, "layer": layer, "expert": int(expert), "routes": len(tok),
                             "rel_err": _rel(diff, ref)})
    return pd.DataFrame(rows)


# ---- whole models ----------------------------------------------------------------------------
def _log_probs(model, tokens: Sequence[int]) -> np.ndarray:
    logits = np.array(model(list(tokens)), dtype=np.float64)
    return logits - logsumexp(logits)[:, None]


def model_quality(reference, candidates: Mapping[str, object], prompts: Sequence[Sequence[int]]) -> pd.DataFrame:
    """One row per (model, prompt, position) predicting the prompt's next token: `nll` (nats),
    the reference's `ref_nll`, `kl` = KL(reference ‖ model) in nats and `top1_agree`. The
    reference appears too, as variant 'reference' (KL 0)."""
    frames = []
    for index, tokens in enumerate(prompts):
        target = np.asarray(tokens[1:])
        ref = _log_probs(reference, tokens)[:-1]
        p_ref = np.exp(ref)
        for label, model in {"reference": reference, **candidates}.items():
            lp = ref if model is reference else _log_probs(model, tokens)[:-1]
            frames.append(pd.DataFrame({
                "variant": label, "prompt": index, "position": np.arange(len(target)),
                "nll": -lp[np.arange(len(target)), target], "ref_nll": -ref[np.arange(len(target)), target],
                "kl": (p_ref * (ref - lp)).sum(axis=1), "top1_agree": lp.argmax(axis=1) == ref.argmax(axis=1),
            }))
    return pd.concat(frames, ignore_index=True)


def quality_summary(frame: pd.DataFrame) -> pd.DataFrame:
    """Per model: token-averaged NLL, its change against the reference, mean KL, top-1 agreement."""
    out = frame.groupby("variant", sort=False).agg(nll=("nll", "mean"), ref_nll=("ref_nll", "mean"),
                                                   kl=("kl", "mean"), top1_agree=("top1_agree", "mean"))
    out["delta_nll"] = out["nll"] - out["ref_nll"]
    return out.drop(columns="ref_nll").reset_index()


# ---- MLX formats -----------------------------------------------------------------------------
def q4_k_to_mlx(raw: np.ndarray, rows: int, cols: int) -> tuple[mx.array, mx.array, mx.array]:
    """Q4_K bytes of a [rows, cols] matrix as MLX 4-bit, group-32 affine (codes, scales, biases),
    losslessly. A Q4_K sub-block is 32 consecutive weights x = (d·sc)·q − dmin·m with 4-bit q,
    which is MLX's scale·q + bias with scale = d·sc and bias = −dmin·m (float32). Both
    products are exact in float32 (11-bit f16 mantissa times a 6-bit integer, times a 4-bit
    code), so each decoded weight is one rounding of the same exact sum on either side."""
    blocks = np.asarray(raw, np.uint8).reshape(-1, 144)
    n = len(blocks)
    sc, m = q4_k_scale_min(blocks[:, 4:16])
    d, dmin = f16_field(blocks, 0), f16_field(blocks, 2)
    scales = (d * sc.astype(np.float32)).reshape(rows, cols // 32)
    biases = -(dmin * m.astype(np.float32)).reshape(rows, cols // 32)
    codes = split_fields(blocks[:, 16:], 4).reshape(n, 256).reshape(rows, cols // 8, 8).astype(np.uint32)
    words = (codes << (4 * np.arange(8, dtype=np.uint32))).sum(axis=-1, dtype=np.uint32)   # nibble i at bits 4i
    return mx.array(words), mx.array(scales), mx.array(biases)


def repack_check(model_file: ModelFile, layers: Iterable[int] | None = None) -> pd.DataFrame:
    """For every Q4_K routed expert: the largest difference between MLX's dequantization of the
    repacked matrix and ds4lab's (gguf-py exact) decoding; `exact` is bit equality."""
    rows = []
    for layer, role, name in _expert_tensors(model_file, layers):
        info = model_file.tensor(name)
        if info.type_name != "Q4_K":
            continue
        n_expert, n_rows, n_cols = info.shape
        for expert in range(n_expert):
            packed = q4_k_to_mlx(expert_bytes(model_file, name, expert), n_rows, n_cols)
            mine = np.array(mx.dequantize(*packed, group_size=32, bits=4))
            ref = expert_matrix(model_file, name, expert)
            rows.append({"layer": layer, "role": role, "expert": expert,
                         "max_abs_diff": float(np.abs(mine - ref).max()), "exact": bool(np.array_equal(mine, ref))})
    return pd.DataFrame(rows)


def _mlx_bits(mode: str, bits: int, group: int) -> float:
    # affine keeps an f16 scale and bias per group; mxfp4 one 8-bit shared exponent
    return bits + (32 / group if mode == "affine" else 8 / group)


def _mlx_round_trip(w: np.ndarray, mode: str, bits: int, group: int) -> np.ndarray:
    packed = mx.quantize(mx.array(w, dtype=mx.float16), group_size=group, bits=bits, mode=mode)
    biases = packed[2] if mode == "affine" else None
    return np.array(mx.dequantize(packed[0], packed[1], biases, group_size=group, bits=bits, mode=mode)
                    .astype(mx.float32))


def mlx_requant_error(model_file: ModelFile, formats: Sequence[tuple[str, int, int]] = MLX_FORMATS,
                      layers: Iterable[int] | None = None, experts: Iterable[int] | None = None) -> pd.DataFrame:
    """One row per (layer, role, expert, MLX format): the source GGUF type and its bits per
    weight, the MLX format's bits per weight, and the relative RMS error of re-quantizing the
    decoded expert into it (MLX works from float16 weights, as MLX models are stored)."""
    chosen = range(model_file.config.n_expert) if experts is None else list(experts)
    rows = []
    for layer, role, name in _expert_tensors(model_file, layers):
        source = model_file.tensor(name).type_name
        for expert in chosen:
            w = expert_matrix(model_file, name, expert)
            for mode, bits, group in formats:
                rows.append({"layer": layer, "role": role, "expert": expert, "source": source,
                             "source_bits": GGUF_BITS[source], "format": f"{mode} {bits}-bit g{group}",
                             "bits": _mlx_bits(mode, bits, group),
                             "rel_rmse": _rel(_mlx_round_trip(w, mode, bits, group) - w, w)})
    return pd.DataFrame(rows)


# ---- plots -----------------------------------------------------------------------------------
def plot_weight_error(frame: pd.DataFrame, column: str = "weighted_err"):
    """Mean relative weight error per layer and role, one bar group per variant (percent)."""
    import matplotlib.pyplot as plt

    means = frame.groupby(["layer", "role", "variant"])[column].mean().unstack("variant") * 100
    fig, ax = plt.subplots(figsize=(9, 3.5))
    means.plot.bar(ax=ax, rot=0)
    ax.set_xlabel("(layer, role) of the routed-expert tensor")
    ax.set_ylabel(f"{column.replace('_', ' ')} (% of reference norm)")
    ax.set_title("Routed-expert weight error against the reference, mean over experts")
    fig.tight_layout()
    return fig


def plot_mlx_requant(frame: pd.DataFrame):
    """Relative RMS error against bits per weight of each MLX format, per source type."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for source, part in frame.groupby("source"):
        stats = part.groupby(["format", "bits"])["rel_rmse"].mean().reset_index()
        ax.scatter(stats["bits"], stats["rel_rmse"] * 100, label=f"from {source} ({GGUF_BITS[source]} bits)")
        for row in stats.itertuples():
            ax.annotate(row.format, (row.bits, row.rel_rmse * 100), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
    ax.set_xlabel("MLX format storage (bits per weight, scales included)")
    ax.set_ylabel("re-quantization error (% relative RMS)")
    ax.set_title("Moving GGUF experts into MLX's own formats")
    ax.legend()
    fig.tight_layout()
    return fig
