"""Synthetic ds4 GGUFs: the real tensor layout and tokenizer, random weights, no download.

Every test and notebook runs on these. A file written here has every tensor ds4.c binds,
with its real name, dims and type (IQ2_XXS/Q2_K or Q4_K routed experts, Q8_0 projections,
F16 mixers and routers, F32 norms, I32 hash tables), the real 129,280-token vocabulary,
and weights scaled so that activations keep a sane size through the layers:

- projections are N(0, 1/fan_in), norms 1 + 0.1·N(0, 1), HC and sink parameters as in
  the ds4 oracle's tiny model;
- routed experts are random block bytes (every bit pattern is a valid block) whose f16
  super-scales give weights of std about 1.6/sqrt(fan_in), zero-mean for the K-quants;
- the router's selection bias `exp_probs_b` is N(0, 1), wide enough that top-k choices
  rarely sit on a knife edge;
- the output head is scaled so logits have a std of about 2.4.

Tensors are drawn in file order from one `numpy.random.default_rng(seed)` and written one at
a time, so the same arguments give the same bytes and a multi-GB `flash-dims` file never
sits in memory. `vocab_rows` keeps only a chosen set of embedding and output rows non-zero,
which makes the files compress to almost nothing.

Random weights give a target whose next token has no token-level structure: nothing like a
language model's bigram statistics, which is what an MTP head under DeepSeek's pairing leans
on. `successor=S` (opt-in; off, the bytes are exactly the random model's) writes that
structure into the output head through a fixed random successor map: a single cycle over the
vocabulary rows in use, drawn from `[seed, 3]`, and the output row of succ(v) gets S times a
random row's norm along the direction of v's embedding. The embedding enters every HC stream
unchanged (the doubly-stochastic mixing keeps it; the sublayers add their outputs beside it),
so the final normed vector after token v keeps a share of embed[v]'s direction and succ(v)
gains a logit in proportion: the greedy choice follows the map most of the time, and the
rest of the context (attention, experts) decides the other times. Everything else, the
embedding included, is drawn as in the random model; only output.weight differs. (The
embedding is held in memory, as F16, until the output head is written: 1 GB for flash-dims
without `vocab_rows`.) The embedding's share of the final vector shrinks with depth, so the
same S gives a deeper model less structure (README, MTP section).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .config import ARCH, ModelConfig, preset
from .gguf import TensorOut, write_gguf
from .layout import VARIANT_TYPES, TensorSpec, main_tensors, mtp_tensors, with_types
from .quants import quantize_q8_0, random_blocks
from .tokenizer import vocab

# f16 super-scale d that gives routed-expert weights of std ~0.1 at fan-in 256 (the oracle
# model's values for IQ2_XXS and Q2_K); scaled by sqrt(256 / fan_in) for other widths.
EXPERT_D_AT_256 = {"IQ2_XXS": 0.0012, "Q2_K": 0.0074, "Q4_K": 0.0004}
# dmin / d that makes a K-quant block zero-mean for uniformly random scales and codes.
_EXPERT_DMIN_RATIO = {"Q2_K": 1.5, "Q4_K": 7.5}
_LOGIT_STD = 2.4
MTP_EXPERT_TYPE = "Q4_K"


def metadata(cfg: ModelConfig, with_tokenizer: bool = True) -> list[tuple[str, str, object]]:
    """GGUF key/values for `cfg`, with the key names and value types of ds4's published files."""
    a = f"{ARCH}."
    kv: list[tuple[str, str, object]] = [
        ("general.architecture", "STRING", ARCH),
        ("general.name", "STRING", cfg.name or "ds4lab synthetic"),
        (a + "block_count", "UINT32", cfg.n_layer),
        (a + "context_length", "UINT32", cfg.context_length),
        (a + "embedding_length", "UINT32", cfg.n_embd),
        (a + "vocab_size", "UINT32", cfg.n_vocab),
        (a + "attention.head_count", "UINT32", cfg.n_head),
        (a + "attention.head_count_kv", "UINT32", cfg.n_head_kv),
        (a + "attention.key_length", "UINT32", cfg.head_dim),
        (a + "attention.value_length", "UINT32", cfg.value_dim),
        (a + "rope.dimension_count", "UINT32", cfg.n_rot),
        (a + "attention.q_lora_rank", "UINT32", cfg.q_lora_rank),
        (a + "attention.output_lora_rank", "UINT32", cfg.o_lora_rank),
        (a + "attention.output_group_count", "UINT32", cfg.n_out_group),
        (a + "expert_count", "UINT32", cfg.n_expert),
        (a + "expert_used_count", "UINT32", cfg.n_expert_used),
        (a + "expert_feed_forward_length", "UINT32", cfg.n_ff_exp),
        (a + "expert_shared_count", "UINT32", cfg.n_expert_shared),
        (a + "hash_layer_count", "UINT32", cfg.n_hash_layer),
        (a + "attention.sliding_window", "UINT32", cfg.n_swa),
        (a + "attention.indexer.head_count", "UINT32", cfg.indexer_heads),
        (a + "attention.indexer.key_length", "UINT32", cfg.indexer_head_dim),
        (a + "attention.indexer.top_k", "UINT32", cfg.indexer_top_k),
        (a + "hyper_connection.count", "UINT32", cfg.n_hc),
        (a + "hyper_connection.sinkhorn_iterations", "UINT32", cfg.hc_sinkhorn_iter),
        (a + "attention.compress_ratios", "ARRAY[INT32]", list(cfg.compress_ratios)),
        (a + "swiglu_clamp_exp", "ARRAY[FLOAT32]", list(cfg.swiglu_clamp)),
        (a + "rope.scaling.original_context_length", "UINT64", cfg.rope_orig_ctx),
        (a + "rope.freq_base", "FLOAT32", cfg.rope_freq_base),
        (a + "rope.scaling.factor", "FLOAT32", cfg.rope_scale_factor),
        (a + "rope.scaling.yarn_beta_fast", "FLOAT32", cfg.rope_yarn_beta_fast),
        (a + "rope.scaling.yarn_beta_slow", "FLOAT32", cfg.rope_yarn_beta_slow),
        (a + "attention.compress_rope_freq_base", "FLOAT32", cfg.compress_rope_freq_base),
        (a + "expert_weights_scale", "FLOAT32", cfg.expert_weight_scale),
        (a + "attention.layer_norm_rms_epsilon", "FLOAT32", cfg.rms_eps),
        (a + "hyper_connection.epsilon", "FLOAT32", cfg.hc_eps),
        (a + "expert_weights_norm", "BOOL", cfg.expert_weights_norm),
    ]
    if with_tokenizer:
        v = vocab()
        if len(v.tokens) != cfg.n_vocab:
            raise ValueError(f"the real tokenizer has {len(v.tokens)} tokens but the config asks for {cfg.n_vocab}")
        kv += [
            ("tokenizer.ggml.model", "STRING", "gpt2"),
            ("tokenizer.ggml.pre", "STRING", "joyai-llm"),
            ("tokenizer.ggml.tokens", "ARRAY[STRING]", v.tokens),
            ("tokenizer.ggml.token_type", "ARRAY[INT32]", v.token_types),
            ("tokenizer.ggml.merges", "ARRAY[STRING]", v.merges),
            ("tokenizer.ggml.bos_token_id", "UINT32", v.bos_id),
            ("tokenizer.ggml.eos_token_id", "UINT32", v.eos_id),
        ]
    return kv


def successor_map(n_vocab: int, rows: np.ndarray | None, seed: int) -> np.ndarray:
    """The successor map `make_model(..., successor=S)` writes: succ[v] for every token id, a
    single random cycle over `rows` (the ids in use: with `vocab_rows`, the non-zero embedding
    rows; every id when None) drawn from `[seed, 3]`, end of sequence left out (nothing leads
    to it: continuations do not stop by the map); -1 elsewhere."""
    ids = np.arange(n_vocab) if rows is None else np.asarray(rows, dtype=np.int64)
    ids = ids[ids != vocab().eos_id]
    order = np.random.default_rng([seed, 3]).permutation(ids)
    succ = np.full(n_vocab, -1, dtype=np.int64)
    succ[order] = np.roll(order, -1)
    return succ


def successor_drafter(succ: np.ndarray):
    """A drafter for `mtp.SpecConfig(drafter=...)`: the next k tokens along the successor map
    `succ` (`successor_map`) from the context's last token. On a model made with that map it
    guesses the target's greedy choice as often as the target follows the map, so greedy
    continuations decode (losslessly) in fewer target passes."""
    def along_the_map(context: list[int], k: int) -> list[int]:
        out = [int(context[-1])]
        for _ in range(k):
            out.append(int(succ[out[-1]]))
        return out[1:]
    return along_the_map


class _WeightDrawer:
    """Draws each tensor's values in file order from one generator."""

    def __init__(self, cfg: ModelConfig, rng: np.random.Generator, vocab_rows: np.ndarray | None,
                 successor: tuple[float, np.ndarray] | None = None) -> None:
        self.cfg, self.rng, self.vocab_rows = cfg, rng, vocab_rows
        self.successor = successor           # (strength, succ map) or None: see the module doc
        self.embedding: np.ndarray | None = None

    def _normal(self, shape: tuple[int, ...], std: float) -> np.ndarray:
        return (self.rng.standard_normal(shape, dtype=np.float32) * np.float32(std))

    def _mask_rows(self, values: np.ndarray) -> np.ndarray:
        if self.vocab_rows is not None:
            keep = np.zeros(values.shape[0], dtype=bool)
            keep[self.vocab_rows] = True
            values[~keep] = 0
        return values

    def _as(self, values: np.ndarray, type_name: str) -> np.ndarray:
        if type_name == "F16":
            return values.astype(np.float16)
        if type_name == "F32":
            return values.astype(np.float32)
        if type_name == "Q8_0":
            return quantize_q8_0(values)
        raise ValueError(f"no float writer for {type_name}")

    def _add_successors(self, values: np.ndarray, chunk: int = 8192) -> None:
        """output[succ[v]] += strength * _LOGIT_STD * embed[v] / |embed[v]| (a random output
        row's norm is about _LOGIT_STD), in chunks of token ids."""
        if self.embedding is None:
            raise ValueError("the successor structure needs token_embd.weight drawn before output.weight")
        strength, succ = self.successor
        ids = np.flatnonzero(succ >= 0)
        for start in range(0, len(ids), chunk):
            v = ids[start:start + chunk]
            e = self.embedding[v].astype(np.float32)
            norm = np.maximum(np.linalg.norm(e, axis=1, keepdims=True), np.float32(1e-6))
            values[succ[v]] += np.float32(strength * _LOGIT_STD) * e / norm

    def draw(self, spec: TensorSpec, type_name: str) -> np.ndarray:
        role, shape = spec.role, tuple(reversed(spec.dims))
        if type_name in EXPERT_D_AT_256:
            fan_in = spec.dims[0]
            d = EXPERT_D_AT_256[type_name] * float(np.sqrt(256.0 / fan_in))
            ratio = _EXPERT_DMIN_RATIO.get(type_name)
            n_blocks = int(np.prod(spec.dims)) // 256
            return random_blocks(type_name, n_blocks, self.rng, d, None if ratio is None else ratio * d)
        if type_name == "I32":
            # Hash routing: each token id gets n_expert_used distinct experts.
            n_vocab, n_expert = self.cfg.n_vocab, self.cfg.n_expert
            keys = self.rng.random((n_vocab, n_expert), dtype=np.float32)
            return np.argsort(keys, axis=1)[:, : self.cfg.n_expert_used].astype(np.int32)
        if role == "token_embd.weight":
            values = self._mask_rows(self._normal(shape, 1.0))
            if self.successor is not None:
                self.embedding = values.astype(np.float16)      # as written (F16)
        elif role == "output.weight":
            values = self._mask_rows(self._normal(shape, _LOGIT_STD / np.sqrt(self.cfg.n_embd)))
            if self.successor is not None:
                self._add_successors(values)
        elif role.endswith("norm.weight"):
            values = 1.0 + self._normal(shape, 0.1)
        elif role.endswith("_scale.weight"):
            values = (self.rng.uniform(0.3, 0.6, shape).astype(np.float32) if shape != (1,)
                      else np.full(shape, 0.5, np.float32))
        elif role.endswith("_base.weight"):
            values = self._normal(shape, 0.5)
        elif role in ("attn_sinks.weight", "exp_probs_b.bias"):
            values = self._normal(shape, 1.0)
        elif role.endswith("_ape.weight"):
            values = self._normal(shape, 0.1)
        else:
            values = self._normal(shape, 1.0 / np.sqrt(spec.dims[0]))
        return self._as(values, type_name)


def _tensors(specs: list[TensorSpec], drawer: _WeightDrawer, routed: tuple[str, str],
             cfg: ModelConfig) -> list[TensorOut]:
    return [TensorOut(spec.name, type_name, spec.dims, lambda s=spec, t=type_name: drawer.draw(s, t))
            for spec, type_name in with_types(specs, cfg, routed)]


def mtp_path(out: str | os.PathLike[str]) -> Path:
    """Where `make_model(..., mtp=True)` writes the MTP GGUF beside the main file."""
    out = Path(out)
    return out.with_name(out.stem + "-mtp.gguf")


def make_model(out: str | os.PathLike[str], preset_name: str = "tiny", variant: str = "q2", *,
               mtp: bool = False, seed: int = 0, n_layer: int | None = None,
               vocab_rows: int | None = None, successor: float | None = None,
               config: ModelConfig | None = None) -> list[Path]:
    """Write a synthetic ds4 GGUF (and, with `mtp`, its MTP GGUF); return the paths written.

    `variant` picks the routed-expert types: 'q2' (IQ2_XXS gate/up, Q2_K down) or 'q4' (Q4_K).
    `vocab_rows=N` keeps N random embedding/output rows (ids drawn from the seed, the
    special tokens included) and zeroes the rest. `successor=S` gives the target a
    language-like token structure: a fixed random successor map (`successor_map`, over the rows
    in use) whose successor's output row leans S times a random row's norm towards the current
    token's embedding, so that its greedy next token follows the map most of the time and the
    context the rest (see the module doc; S = 0 or None is the random model, byte for byte).
    `config` overrides the preset's shape.
    """
    if variant not in VARIANT_TYPES:
        raise ValueError(f"unknown variant {variant!r}: expected one of {', '.join(VARIANT_TYPES)}")
    cfg = config or preset(preset_name, n_layer)
    rows = None
    if vocab_rows is not None:
        id_rng = np.random.default_rng([seed, 1])
        control = np.flatnonzero(np.asarray(vocab().token_types) != 1)
        others = id_rng.choice(cfg.n_vocab, size=min(vocab_rows, cfg.n_vocab), replace=False)
        rows = np.union1d(control, others)
    structure = None
    if successor is not None and not successor >= 0:
        raise ValueError(f"successor strength must be a number >= 0, not {successor!r}")
    if successor:
        structure = (float(successor), successor_map(cfg.n_vocab, rows, seed))
    drawer = _WeightDrawer(cfg, np.random.default_rng(seed), rows, structure)
    out = Path(out)
    paths = [write_gguf(out, metadata(cfg), _tensors(main_tensors(cfg), drawer, VARIANT_TYPES[variant], cfg))]
    if mtp:
        mtp_drawer = _WeightDrawer(cfg, np.random.default_rng([seed, 2]), rows)
        routed = (MTP_EXPERT_TYPE, MTP_EXPERT_TYPE)
        paths.append(write_gguf(mtp_path(out), metadata(cfg.replace(name=f"{cfg.name} MTP"), False),
                                _tensors(mtp_tensors(cfg), mtp_drawer, routed, cfg)))
    return paths
