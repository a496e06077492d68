"""The tensor inventory of a ds4 GGUF: every tensor's name, GGUF dims, allowed types and component.

One list, derived from a ModelConfig, serves three jobs: the validator checks a file
against it (as ds4.c's `weights_validate_layout` and `mtp_weights_validate_layout` do),
the synthetic-model writer emits exactly these tensors in this order (the order of the
published files), and `ds4lab info` groups bytes by the component named here.

Dims are in GGUF order (innermost first): a matrix stored row-major as [out][in] has
dims (in, out). A routed-expert tensor has dims (in, out, n_expert).
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import ModelConfig, coff, has_indexer

ROUTED_TYPES = ("IQ2_XXS", "Q2_K", "Q4_K")
PLAIN_TYPES = ("F16", "F32")

# The published variants: (gate/up type, down type) of the routed experts.
VARIANT_TYPES = {"q2": ("IQ2_XXS", "Q2_K"), "q4": ("Q4_K", "Q4_K")}

COMPONENTS = (
    "embedding", "hc", "attention", "compressor", "indexer", "router",
    "shared expert", "routed experts", "output", "mtp",
)


@dataclass(frozen=True)
class TensorSpec:
    """What one tensor must look like."""

    name: str
    dims: tuple[int, ...]
    types: tuple[str, ...]
    component: str
    required: bool = True
    layer: int | None = None

    @property
    def role(self) -> str:
        """The name without its layer prefix, e.g. 'ffn_gate_exps.weight'."""
        return self.name.split(".", 2)[2] if self.name.startswith(("blk.", "mtp.")) else self.name


def _block(cfg: ModelConfig, prefix: str, layer: int | None, ratio: int, mtp: bool) -> list[TensorSpec]:
    """One transformer block's tensors (main layer or the MTP block), in file order."""
    d, hc = cfg.n_embd, cfg.hc_dim
    # The MTP file accepts F16 or F32 for its mixing and router matrices; the main model only F16.
    mixer_types = PLAIN_TYPES if mtp else ("F16",)

    def t(role: str, dims: tuple[int, ...], types: tuple[str, ...] | str, component: str,
          required: bool = True) -> TensorSpec:
        types = (types,) if isinstance(types, str) else types
        comp = "mtp" if mtp else component
        return TensorSpec(f"{prefix}.{role}", dims, types, comp, required, layer)

    specs = [
        t("hc_attn_fn.weight", (hc, cfg.hc_mix_dim), mixer_types, "hc"),
        t("hc_attn_scale.weight", (3,), "F32", "hc"),
        t("hc_attn_base.weight", (cfg.hc_mix_dim,), "F32", "hc"),
        t("hc_ffn_fn.weight", (hc, cfg.hc_mix_dim), mixer_types, "hc"),
        t("hc_ffn_scale.weight", (3,), "F32", "hc"),
        t("hc_ffn_base.weight", (cfg.hc_mix_dim,), "F32", "hc"),
        t("attn_norm.weight", (d,), "F32", "attention"),
        t("attn_q_a.weight", (d, cfg.q_lora_rank), "Q8_0", "attention"),
        t("attn_q_a_norm.weight", (cfg.q_lora_rank,), "F32", "attention"),
        t("attn_q_b.weight", (cfg.q_lora_rank, cfg.q_dim), "Q8_0", "attention"),
        t("attn_kv.weight", (d, cfg.head_dim), "Q8_0", "attention"),
        t("attn_kv_a_norm.weight", (cfg.head_dim,), "F32", "attention"),
        t("attn_sinks.weight", (cfg.n_head,), "F32", "attention"),
        t("attn_output_a.weight", (cfg.out_group_in_dim, cfg.out_low_dim), "Q8_0", "attention"),
        t("attn_output_b.weight", (cfg.out_low_dim, d), "Q8_0", "attention"),
    ]
    if ratio:
        width = coff(ratio) * cfg.head_dim
        specs += [
            t("attn_compressor_ape.weight", (width, ratio), "F16", "compressor"),
            t("attn_compressor_kv.weight", (d, width), "F16", "compressor"),
            t("attn_compressor_gate.weight", (d, width), "F16", "compressor"),
            t("attn_compressor_norm.weight", (cfg.head_dim,), "F32", "compressor"),
        ]
    if has_indexer(ratio):
        width = coff(ratio) * cfg.indexer_head_dim
        specs += [
            t("indexer.attn_q_b.weight", (cfg.q_lora_rank, cfg.indexer_q_dim), "F16", "indexer"),
            t("indexer.proj.weight", (d, cfg.indexer_heads), "F16", "indexer"),
            t("indexer_compressor_ape.weight", (width, 4), "F16", "indexer"),
            t("indexer_compressor_kv.weight", (d, width), "F16", "indexer"),
            t("indexer_compressor_gate.weight", (d, width), "F16", "indexer"),
            t("indexer_compressor_norm.weight", (cfg.indexer_head_dim,), "F32", "indexer"),
        ]
    hashed = layer is not None and layer < cfg.n_hash_layer
    specs += [
        t("ffn_norm.weight", (d,), "F32", "router"),
        t("ffn_gate_inp.weight", (d, cfg.n_expert), mixer_types, "router"),
        # The selection bias is optional in the main model (ds4 treats absence as zero)
        # and required in the MTP block.
        t("exp_probs_b.bias", (cfg.n_expert,), "F32", "router", required=mtp),
        t("ffn_gate_exps.weight", (d, cfg.n_ff_exp, cfg.n_expert), ROUTED_TYPES, "routed experts"),
        t("ffn_up_exps.weight", (d, cfg.n_ff_exp, cfg.n_expert), ROUTED_TYPES, "routed experts"),
        t("ffn_down_exps.weight", (cfg.n_ff_exp, d, cfg.n_expert), ROUTED_TYPES, "routed experts"),
        t("ffn_gate_shexp.weight", (d, cfg.n_ff_exp), "Q8_0", "shared expert"),
        t("ffn_up_shexp.weight", (d, cfg.n_ff_exp), "Q8_0", "shared expert"),
        t("ffn_down_shexp.weight", (cfg.n_ff_exp, d), "Q8_0", "shared expert"),
    ]
    if hashed:
        specs.append(t("ffn_gate_tid2eid.weight", (cfg.n_expert_used, cfg.n_vocab), "I32", "router"))
    return specs


def main_tensors(cfg: ModelConfig) -> list[TensorSpec]:
    """The main model's tensors, in the order of ds4's published files."""
    d, n_hc = cfg.n_embd, cfg.n_hc
    specs = [
        TensorSpec("token_embd.weight", (d, cfg.n_vocab), ("F16",), "embedding"),
        TensorSpec("output_hc_base.weight", (n_hc,), ("F32",), "output"),
        TensorSpec("output_hc_fn.weight", (cfg.hc_dim, n_hc), ("F16",), "output"),
        TensorSpec("output_hc_scale.weight", (1,), ("F32",), "output"),
        TensorSpec("output_norm.weight", (d,), ("F32",), "output"),
        TensorSpec("output.weight", (d, cfg.n_vocab), ("Q8_0",), "output"),
    ]
    for layer in range(cfg.n_layer):
        specs += _block(cfg, f"blk.{layer}", layer, cfg.compress_ratios[layer], mtp=False)
    return specs


def mtp_tensors(cfg: ModelConfig) -> list[TensorSpec]:
    """The MTP block's tensors (`mtp.0.*`); it reuses the main model's embedding and output head."""
    d = cfg.n_embd
    head = [
        TensorSpec("mtp.0.hc_head_base.weight", (cfg.n_hc,), ("F32",), "mtp"),
        TensorSpec("mtp.0.hc_head_fn.weight", (cfg.hc_dim, cfg.n_hc), PLAIN_TYPES, "mtp"),
        TensorSpec("mtp.0.hc_head_scale.weight", (1,), ("F32",), "mtp"),
        TensorSpec("mtp.0.e_proj.weight", (d, d), ("Q8_0",), "mtp"),
        TensorSpec("mtp.0.h_proj.weight", (d, d), ("Q8_0",), "mtp"),
        TensorSpec("mtp.0.enorm.weight", (d,), ("F32",), "mtp"),
        TensorSpec("mtp.0.hnorm.weight", (d,), ("F32",), "mtp"),
        TensorSpec("mtp.0.norm.weight", (d,), ("F32",), "mtp"),
    ]
    return head + _block(cfg, "mtp.0", None, 0, mtp=True)



def with_types(specs: list[TensorSpec], cfg: ModelConfig, routed: tuple[str, str]) -> list[tuple[TensorSpec, str]]:
    """The tensors a published-style file holds, each with its type: routed experts take
    `routed` (gate/up type, down type), the rest their one allowed type. The optional
    selection bias is kept only on biased (non-hash) layers, as in ds4's files."""
    gate_up, down = routed
    out = []
    for spec in specs:
        if not spec.required and spec.layer is not None and spec.layer < cfg.n_hash_layer:
            continue
        if spec.role.endswith("_exps.weight"):
            type_name = down if spec.role.startswith("ffn_down") else gate_up
        else:
            type_name = spec.types[0]
        out.append((spec, type_name))
    return out


def planned_bytes(cfg: ModelConfig, variant: str) -> dict[str, int]:
    """Bytes per component of a main file with this shape and variant, from the layout alone
    (no file needed: how big the real q2/q4 files are, and where the bytes go)."""
    from .quants.formats import tensor_bytes

    totals: dict[str, int] = {}
    for spec, type_name in with_types(main_tensors(cfg), cfg, VARIANT_TYPES[variant]):
        totals[spec.component] = totals.get(spec.component, 0) + tensor_bytes(type_name, spec.dims[::-1])
    return totals
