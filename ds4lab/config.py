"""ModelConfig: every dimension and constant of a DeepSeek V4 model, read from GGUF metadata.

ds4.c compiles the DeepSeek V4 Flash shape in as constants and refuses any file that
differs. ds4lab instead takes every number from the file's `deepseek4.*` metadata, so the
same code runs the real 43-layer Flash file, the 61-layer Pro file and the small synthetic
models the tests generate. The layer schedule (which layers compress, by 4 or by 128)
always comes from `compress_ratios`, never from the layer index: Flash and Pro differ there.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from .errors import ModelFileError
from .floats import f32

ARCH = "deepseek4"

# Layer counts, widths and vocabularies beyond these are not DeepSeek V4 files; the bounds
# keep a hostile header from sizing any allocation or loop.
_MAX_DIM = 1 << 20
_MAX_LAYERS = 1024


# ---- the compression ratios' facts --------------------------------------------------------
# A layer's ratio says what it keeps: 0 only the raw window; 128 a compressor whose rows each
# pool their own 128 tokens; 4 a compressor whose windows overlap (each row pools 8
# candidates: the previous window's first half and its own second half, so its projections
# and frontier are twice as wide) and a lightning indexer choosing among its rows.
def overlaps(ratio: int) -> bool:
    """Whether this ratio's compressor windows overlap the previous window (ratio 4)."""
    return ratio == 4


def coff(ratio: int) -> int:
    """The compressor's width multiple: 2 where windows overlap, else 1."""
    return 2 if overlaps(ratio) else 1


def has_indexer(ratio: int) -> bool:
    """Whether layers of this ratio choose their compressed rows with the indexer (ratio 4)."""
    return ratio == 4


# The integer shape fields, in ds4's enum order: the keys of the oracle's config.json.
_ORACLE_KEYS = ("n_layer", "n_embd", "n_vocab", "n_head", "n_head_kv", "head_dim", "value_dim", "n_rot",
                "n_out_group", "q_lora_rank", "o_lora_rank", "n_expert", "n_expert_used", "n_expert_shared",
                "n_ff_exp", "n_hash_layer", "n_swa", "indexer_heads", "indexer_head_dim", "indexer_top_k",
                "n_hc", "hc_sinkhorn_iter")


@dataclass(frozen=True)
class ModelConfig:
    """The shape and constants of one DeepSeek V4 model (names follow ds4's enum, lower case)."""

    n_layer: int
    n_embd: int
    n_vocab: int
    n_head: int
    n_head_kv: int
    head_dim: int
    value_dim: int
    n_rot: int
    n_out_group: int
    q_lora_rank: int
    o_lora_rank: int
    n_expert: int
    n_expert_used: int
    n_expert_shared: int
    n_ff_exp: int
    n_hash_layer: int
    n_swa: int
    indexer_heads: int
    indexer_head_dim: int
    indexer_top_k: int
    n_hc: int
    hc_sinkhorn_iter: int
    compress_ratios: tuple[int, ...]
    swiglu_clamp: tuple[float, ...] = ()
    rope_freq_base: float = 10000.0
    compress_rope_freq_base: float = 160000.0
    rope_scale_factor: float = 16.0
    rope_yarn_beta_fast: float = 32.0
    rope_yarn_beta_slow: float = 1.0
    rope_orig_ctx: int = 65536
    rms_eps: float = 1e-6
    hc_eps: float = 1e-6
    expert_weight_scale: float = 1.5
    expert_weights_norm: bool = True
    context_length: int = 1048576
    name: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        # GGUF stores these as float32: keep them at float32 precision so that a config
        # written to a file and read back compares equal.
        for f in dataclasses.fields(self):
            if f.type == "float":
                object.__setattr__(self, f.name, f32(getattr(self, f.name)))
        object.__setattr__(self, "compress_ratios", tuple(int(r) for r in self.compress_ratios))
        clamp = tuple(f32(c) for c in self.swiglu_clamp) or (10.0,) * self.n_layer
        object.__setattr__(self, "swiglu_clamp", clamp)

    # ---- derived widths -------------------------------------------------------------
    @property
    def hc_dim(self) -> int:
        """Width of the concatenated hyper-connection streams."""
        return self.n_hc * self.n_embd

    @property
    def hc_mix_dim(self) -> int:
        """Width of the HC control vector: pre and post weights plus the n_hc x n_hc combination."""
        return 2 * self.n_hc + self.n_hc * self.n_hc

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def n_nope(self) -> int:
        """Dims of each head that carry no RoPE (and get ds4's fp8 rounding)."""
        return self.head_dim - self.n_rot

    @property
    def heads_per_group(self) -> int:
        return self.n_head // self.n_out_group

    @property
    def out_group_in_dim(self) -> int:
        """Input width of one output group's low-rank projection."""
        return self.head_dim * self.heads_per_group

    @property
    def out_low_dim(self) -> int:
        return self.n_out_group * self.o_lora_rank

    @property
    def indexer_q_dim(self) -> int:
        return self.indexer_heads * self.indexer_head_dim

    @property
    def model_id(self) -> int:
        """ds4's variant id as written in KVC headers: 0 Flash, 1 Pro."""
        return 1 if self.shape_name == "pro" else 0

    @property
    def shape_name(self) -> str:
        """'flash' or 'pro' when the dims are the published model's, else 'custom'."""
        for shape_name, ref in (("flash", FLASH), ("pro", PRO)):
            if self.n_layer == ref.n_layer and self.n_embd == ref.n_embd:
                return shape_name
        return "custom"

    def rope_base(self, layer: int) -> float:
        return self.compress_rope_freq_base if self.compress_ratios[layer] else self.rope_freq_base

    # ---- conversions --------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """The config as the JSON keys of the oracle's config.json (ds4's enum names)."""
        out: dict[str, Any] = {k: getattr(self, k) for k in _ORACLE_KEYS}
        out["compress_ratios"] = list(self.compress_ratios)
        return out

    def to_dict(self) -> dict[str, Any]:
        """Every field, for metadata writers and reports."""
        out = dataclasses.asdict(self)
        out["compress_ratios"] = list(self.compress_ratios)
        out["swiglu_clamp"] = list(self.swiglu_clamp)
        return out

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def flash(cls) -> ModelConfig:
        """The published DeepSeek V4 Flash shape (ds4.c's constants)."""
        return FLASH

    @classmethod
    def pro(cls) -> ModelConfig:
        """The published DeepSeek V4 Pro shape (61 layers; layers 0-1 compress by 128)."""
        return PRO

    @classmethod
    def from_metadata(cls, fields: dict[str, Any], source: str = "<metadata>") -> ModelConfig:
        """Build from decoded GGUF key/values; every missing or malformed key is reported at once."""
        reader = _MetadataReader(fields, source)
        values = {
            "n_layer": reader.u32("block_count", 1, _MAX_LAYERS),
            "n_embd": reader.u32("embedding_length"),
            "n_vocab": reader.u32("vocab_size"),
            "n_head": reader.u32("attention.head_count"),
            "n_head_kv": reader.u32("attention.head_count_kv"),
            "head_dim": reader.u32("attention.key_length"),
            "value_dim": reader.u32("attention.value_length"),
            "n_rot": reader.u32("rope.dimension_count"),
            "n_out_group": reader.u32("attention.output_group_count"),
            "q_lora_rank": reader.u32("attention.q_lora_rank"),
            "o_lora_rank": reader.u32("attention.output_lora_rank"),
            "n_expert": reader.u32("expert_count"),
            "n_expert_used": reader.u32("expert_used_count"),
            "n_expert_shared": reader.u32("expert_shared_count", 0),
            "n_ff_exp": reader.u32("expert_feed_forward_length"),
            "n_hash_layer": reader.u32("hash_layer_count", 0),
            "n_swa": reader.u32("attention.sliding_window"),
            "indexer_heads": reader.u32("attention.indexer.head_count"),
            "indexer_head_dim": reader.u32("attention.indexer.key_length"),
            "indexer_top_k": reader.u32("attention.indexer.top_k"),
            "n_hc": reader.u32("hyper_connection.count"),
            "hc_sinkhorn_iter": reader.u32("hyper_connection.sinkhorn_iterations", 0, 1000),
            "compress_ratios": reader.int_array("attention.compress_ratios"),
            "swiglu_clamp": reader.float_array("swiglu_clamp_exp"),
            "rope_freq_base": reader.f32("rope.freq_base"),
            "compress_rope_freq_base": reader.f32("attention.compress_rope_freq_base"),
            "rope_scale_factor": reader.f32("rope.scaling.factor"),
            "rope_yarn_beta_fast": reader.f32("rope.scaling.yarn_beta_fast"),
            "rope_yarn_beta_slow": reader.f32("rope.scaling.yarn_beta_slow"),
            "rope_orig_ctx": reader.u32("rope.scaling.original_context_length", 1, 1 << 40),
            "rms_eps": reader.f32("attention.layer_norm_rms_epsilon"),
            "hc_eps": reader.f32("hyper_connection.epsilon"),
            "expert_weight_scale": reader.f32("expert_weights_scale"),
            "expert_weights_norm": reader.boolean("expert_weights_norm"),
            "context_length": reader.u32("context_length", 1, 1 << 40, required=False) or 1048576,
            "name": str(fields.get("general.name", "")),
        }
        for group_key in ("expert_group_count", "expert_group_used_count"):
            got = reader.u32(group_key, 0, required=False)
            if got:
                reader.problems.append(f"{ARCH}.{group_key}: expected 0 (no group-limited routing), found {got}")
        if reader.problems:
            raise ModelFileError(source, reader.problems)
        cfg = cls(**values)
        problems = config_problems(cfg)
        if problems:
            raise ModelFileError(source, problems)
        return cfg


def config_problems(cfg: ModelConfig) -> list[str]:
    """Structural rules every DeepSeek V4 shape obeys (and the exact values for Flash and Pro).

    ds4.c only accepts its own compiled shape; ds4lab accepts any shape whose parts fit
    together, and for a file that claims the Flash or Pro layer count and width it checks
    every value the way ds4.c does.
    """
    p: list[str] = []
    key = f"{ARCH}."

    def need(ok: bool, what: str) -> None:
        if not ok:
            p.append(what)

    need(cfg.n_head_kv == 1, f"{key}attention.head_count_kv: expected 1 (one shared KV row), found {cfg.n_head_kv}")
    need(cfg.value_dim == cfg.head_dim,
         f"{key}attention.value_length: expected key_length {cfg.head_dim}, found {cfg.value_dim}")
    need(0 < cfg.n_rot < cfg.head_dim and cfg.n_rot % 2 == 0,
         f"{key}rope.dimension_count: expected an even value below key_length {cfg.head_dim}, found {cfg.n_rot}")
    need(cfg.n_out_group > 0 and cfg.n_head % max(cfg.n_out_group, 1) == 0,
         f"{key}attention.output_group_count: expected a divisor of head_count {cfg.n_head}, "
         f"found {cfg.n_out_group}")
    need(0 < cfg.n_expert_used <= cfg.n_expert,
         f"{key}expert_used_count: expected 1..expert_count ({cfg.n_expert}), found {cfg.n_expert_used}")
    need(cfg.n_hash_layer <= cfg.n_layer,
         f"{key}hash_layer_count: expected at most block_count {cfg.n_layer}, found {cfg.n_hash_layer}")
    need(cfg.n_hc >= 1, f"{key}hyper_connection.count: expected at least 1, found {cfg.n_hc}")
    need(len(cfg.compress_ratios) >= cfg.n_layer,
         f"{key}attention.compress_ratios: expected at least {cfg.n_layer} entries, "
         f"found {len(cfg.compress_ratios)}")
    bad = [(i, r) for i, r in enumerate(cfg.compress_ratios[: cfg.n_layer]) if r not in (0, 4, 128)]
    need(not bad, f"{key}attention.compress_ratios: expected 0, 4 or 128 per layer, found {bad[:4]}")
    need(len(cfg.swiglu_clamp) >= cfg.n_layer,
         f"{key}swiglu_clamp_exp: expected at least {cfg.n_layer} entries, found {len(cfg.swiglu_clamp)}")
    for name in ("rope_freq_base", "compress_rope_freq_base", "rope_scale_factor", "rms_eps", "hc_eps",
                 "expert_weight_scale"):
        value = getattr(cfg, name)
        need(math.isfinite(value) and value > 0, f"{name}: expected a positive finite value, found {value}")
    for name in ("n_embd", "n_vocab", "n_head", "head_dim", "q_lora_rank", "o_lora_rank", "n_expert",
                 "n_ff_exp", "n_swa", "indexer_heads", "indexer_head_dim", "indexer_top_k"):
        value = getattr(cfg, name)
        need(0 < value <= _MAX_DIM, f"{name}: expected 1..{_MAX_DIM}, found {value}")

    ref = KNOWN_SHAPES.get(cfg.shape_name)
    if ref is not None:
        for f in dataclasses.fields(ModelConfig):
            if f.name in ("name", "context_length", "compress_ratios", "swiglu_clamp"):
                continue
            got, want = getattr(cfg, f.name), getattr(ref, f.name)
            if isinstance(want, float):
                ok = abs(got - want) <= max(abs(want), 1.0) * 1e-6
            else:
                ok = got == want
            need(ok, f"{f.name}: expected {want} for DeepSeek V4 {cfg.shape_name.title()}, found {got}")
        got_sched = list(cfg.compress_ratios[: ref.n_layer])
        for i, (g, w) in enumerate(zip(got_sched, ref.compress_ratios, strict=False)):
            need(g == w, f"{key}attention.compress_ratios[{i}]: expected {w} for "
                         f"DeepSeek V4 {cfg.shape_name.title()}, found {g}")
        need(all(abs(c - 10.0) < 1e-5 for c in cfg.swiglu_clamp[: cfg.n_layer]),
             f"{key}swiglu_clamp_exp: expected 10.0 for every layer")
    return p


class _MetadataReader:
    """Typed access to `deepseek4.*` keys that collects problems instead of stopping at the first."""

    def __init__(self, fields: dict[str, Any], source: str) -> None:
        self.fields = fields
        self.source = source
        self.problems: list[str] = []

    def _get(self, key: str, required: bool) -> Any:
        full = f"{ARCH}.{key}"
        if full not in self.fields:
            if required:
                self.problems.append(f"{full}: required key is missing")
            return None
        return self.fields[full]

    def _bad(self, key: str, want: str, value: Any) -> None:
        self.problems.append(f"{ARCH}.{key}: expected {want}, found {_short(value)}")

    def u32(self, key: str, lo: int = 1, hi: int = _MAX_DIM, required: bool = True) -> int:
        value = self._get(key, required)
        if value is None:
            return 0
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            self._bad(key, f"an integer in {lo}..{hi}", value)
            return 0
        return value

    def f32(self, key: str) -> float:
        value = self._get(key, True)
        if value is None:
            return 0.0
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self._bad(key, "a number", value)
            return 0.0
        return float(value)

    def boolean(self, key: str) -> bool:
        value = self._get(key, True)
        if value is not None and not isinstance(value, bool):
            self._bad(key, "a bool", value)
        return bool(value)

    def int_array(self, key: str) -> tuple[int, ...]:
        value = self._get(key, True)
        if value is None:
            return ()
        if not isinstance(value, list) or not all(isinstance(v, int) and v >= 0 for v in value):
            self._bad(key, "an array of non-negative integers", value)
            return ()
        if len(value) > _MAX_LAYERS:
            self._bad(key, f"at most {_MAX_LAYERS} entries", f"{len(value)} entries")
            return ()
        return tuple(value)

    def float_array(self, key: str) -> tuple[float, ...]:
        value = self._get(key, True)
        if value is None:
            return ()
        if not isinstance(value, list) or not all(isinstance(v, (int, float)) for v in value):
            self._bad(key, "an array of floats", value)
            return ()
        return tuple(float(v) for v in value[:_MAX_LAYERS])


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _schedule(n_layer: int, first_two: int) -> tuple[int, ...]:
    return tuple(first_two if i < 2 else (4 if i % 2 == 0 else 128) for i in range(n_layer))


FLASH = ModelConfig(
    n_layer=43, n_embd=4096, n_vocab=129280, n_head=64, n_head_kv=1, head_dim=512, value_dim=512,
    n_rot=64, n_out_group=8, q_lora_rank=1024, o_lora_rank=1024, n_expert=256, n_expert_used=6,
    n_expert_shared=1, n_ff_exp=2048, n_hash_layer=3, n_swa=128, indexer_heads=64, indexer_head_dim=128,
    indexer_top_k=512, n_hc=4, hc_sinkhorn_iter=20, compress_ratios=_schedule(43, 0),
    expert_weight_scale=1.5, name="DeepSeek V4 Flash",
)

PRO = ModelConfig(
    n_layer=61, n_embd=7168, n_vocab=129280, n_head=128, n_head_kv=1, head_dim=512, value_dim=512,
    n_rot=64, n_out_group=16, q_lora_rank=1536, o_lora_rank=1024, n_expert=384, n_expert_used=6,
    n_expert_shared=1, n_ff_exp=3072, n_hash_layer=3, n_swa=128, indexer_heads=64, indexer_head_dim=128,
    indexer_top_k=1024, n_hc=4, hc_sinkhorn_iter=20, compress_ratios=_schedule(61, 128),
    expert_weight_scale=2.5, name="DeepSeek V4 Pro",
)


# ds4's two real shapes, by name and by layer count (a .kv payload names only its layer count).
KNOWN_SHAPES = {"flash": FLASH, "pro": PRO}


def known_shape(key: str | int) -> ModelConfig:
    """Flash or Pro by name ("flash", "pro", any case) or by layer count (43, 61); KeyError otherwise."""
    if isinstance(key, str):
        return KNOWN_SHAPES[key.lower()]
    return {c.n_layer: c for c in KNOWN_SHAPES.values()}[key]

TINY = ModelConfig(
    n_layer=6, n_embd=256, n_vocab=129280, n_head=8, n_head_kv=1, head_dim=256, value_dim=256,
    n_rot=64, n_out_group=4, q_lora_rank=256, o_lora_rank=128, n_expert=16, n_expert_used=6,
    n_expert_shared=1, n_ff_exp=256, n_hash_layer=3, n_swa=128, indexer_heads=4, indexer_head_dim=128,
    indexer_top_k=16, n_hc=4, hc_sinkhorn_iter=20, compress_ratios=(0, 0, 4, 128, 4, 128),
    name="ds4lab tiny",
)

# A second small shape that shares no width with `tiny` (head_dim 192, 3 heads per group,
# 2 HC streams, 8 experts, a short window), so tests catch anything tuned to one shape.
SMALL = ModelConfig(
    n_layer=5, n_embd=256, n_vocab=129280, n_head=6, n_head_kv=1, head_dim=192, value_dim=192,
    n_rot=64, n_out_group=2, q_lora_rank=128, o_lora_rank=64, n_expert=8, n_expert_used=3,
    n_expert_shared=1, n_ff_exp=512, n_hash_layer=1, n_swa=16, indexer_heads=2, indexer_head_dim=64,
    indexer_top_k=4, n_hc=2, hc_sinkhorn_iter=10, compress_ratios=(0, 4, 128, 4, 0),
    name="ds4lab small",
)

PRESETS = ("tiny", "small", "flash-dims")


def preset(name: str, n_layer: int | None = None) -> ModelConfig:
    """A named synthetic shape. `flash-dims` is the real Flash with `n_layer` layers (default 2)
    following Flash's schedule; the others take `n_layer` to shorten or extend their own schedule."""
    if name == "flash-dims":
        layers = n_layer or 2
        return FLASH.replace(n_layer=layers, compress_ratios=_schedule(layers, 0),
                             n_hash_layer=min(FLASH.n_hash_layer, layers),
                             swiglu_clamp=(10.0,) * layers, name=f"ds4lab flash-dims {layers}L")
    base = {"tiny": TINY, "small": SMALL}.get(name)
    if base is None:
        raise ValueError(f"unknown preset {name!r}: expected one of {', '.join(PRESETS)}")
    if n_layer is None or n_layer == base.n_layer:
        return base
    ratios = tuple(base.compress_ratios[i % base.n_layer] for i in range(n_layer))
    return base.replace(n_layer=n_layer, compress_ratios=ratios, swiglu_clamp=(10.0,) * n_layer,
                        n_hash_layer=min(base.n_hash_layer, n_layer))
