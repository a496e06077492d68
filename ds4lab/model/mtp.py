"""The MTP head: ds4's MTP GGUF (`mtp.0.*`) and its draft forward.

ds4's draft (`metal_graph_eval_mtp_draft_from_hc`) takes a token t at position p and an HC
state H [n_hc, n_embd] (the main model's final streams before the output collapse, or the
head's own previous output when drafts are chained):

    e = e_proj · RMSNorm(embed[t]; enorm)               one row, repeated into the n_hc streams
    h_s = h_proj · RMSNorm(H_s; hnorm)                   per stream
    x = e + h  ->  one DS4 block  ->  HC collapse (hc_head_*), RMSNorm(norm), output.weight

The block is an uncompressed one (no compressor, indexer or hash table; biased top-k
routing) with layer 1's constants, attending over the head's own raw window of n_swa rows
(`MTPState.ring`). Its output streams are what a chained draft starts from. Embedding and
output matrix are the main model's.

`MTPHead.run` computes rows for consecutive positions in one pass; on the CPU a row is
bit-identical whether it is computed alone or with others (the same tile slots as the main
model), which is what makes teacher-forced acceptance equal the online one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .. import gguf
from ..config import ModelConfig
from ..errors import ModelFileError
from .rope import Rotation
from .state import LayerCache, MTPState
from .weights import LayerWeights, Q8Matrix, keep_decoded, load_block

PREFIX = "mtp.0"
# The MTP head's tensors that are not part of its block: name in the file -> role here.
_HEAD_ROLES = {"hc_head_fn.weight": "output_hc_fn", "hc_head_scale.weight": "output_hc_scale",
               "hc_head_base.weight": "output_hc_base", "norm.weight": "output_norm"}
_INPUT_ROLES = ("e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight")


@dataclass
class MTPHead:
    """An MTP head's weights: the input projections and norms, one block, its output collapse."""

    block: LayerWeights                  # index None: hooks under `mtp.`, layer 1's constants
    e_proj: Q8Matrix
    h_proj: Q8Matrix
    enorm: mx.array
    hnorm: mx.array
    head: dict[str, mx.array]            # the main head's keys: output_hc_fn/scale/base, output_norm
    source: str = ""

    def empty_state(self, config: ModelConfig, next_pos: int) -> MTPState:
        """A cold head whose first row will sit at `next_pos` (ds4 starts every decode this way)."""
        return MTPState(LayerCache.empty(0, config.head_dim, config.indexer_head_dim), next_pos)

    def run(self, model, state: MTPState, hidden: mx.array, tokens: list[int]) -> tuple[mx.array, MTPState]:
        """Rows at positions state.next_pos.. for (HC state, token) pairs: hidden [T, n_hc, n_embd],
        tokens [T]. Returns the logits [T, n_vocab] and the state after them (ring extended,
        `out` and `logits` of the last row). `state` is left as it was."""
        cfg, hooks = model.config, model._hooks
        p0, n = state.next_pos, len(tokens)
        hooks.positions = np.arange(p0, p0 + n)
        mm = model.numerics.schedule(hooks.positions)
        h = hooks.scope("mtp")
        emb = model.weights.token_embd[mx.array(tokens, dtype=mx.int32)].astype(mx.float32)
        e = h("hook_e", mm.q8(self.e_proj, mm.rms_norm(emb, self.enorm, cfg.rms_eps)))
        hh = h("hook_h", mm.q8(self.h_proj, mm.rms_norm(hidden, self.hnorm, cfg.rms_eps)))
        streams = h("hook_in", e[:, None, :] + hh)
        new = state.copy()
        rotation = Rotation.at(p0, n, cfg.n_rot, cfg.rope_freq_base, None)
        streams, _, _ = model.block(self.block, new.ring, streams, p0, rotation, mx.array(tokens, dtype=mx.int32),
                                    mm)
        logits = model._head(streams, mm, prefix="mtp.")
        new.next_pos, new.out, new.logits = p0 + n, streams[-1], logits[-1]
        return logits, new

    @property
    def nbytes(self) -> int:
        layer = self.block
        return (sum(m.nbytes for m in layer.q8.values()) + sum(v.nbytes for v in layer.dense.values())
                + sum(e.nbytes for e in layer.experts.values()) + sum(v.nbytes for v in self.head.values()))


def load_mtp(path: str | os.PathLike[str], config: ModelConfig) -> MTPHead:
    """Open ds4's MTP GGUF for a main model of shape `config`: every tensor is checked against
    that shape (a head made for another model is refused, naming the file and the tensors)."""
    model_file = gguf.open(path, config=config)
    if model_file.kind == "main":
        raise ModelFileError(path, f"no {PREFIX}.* tensors: this is a main model, not an MTP file")
    problems = gguf.inventory_problems(config, model_file.tensors, model_file.kind)
    if problems:
        raise ModelFileError(path, [f"{p} (the main model's shape)" for p in problems])
    block = load_block(model_file, PREFIX, None, 0)
    head = {role: block.dense.pop(name) for name, role in _HEAD_ROLES.items()}
    e_proj, h_proj = (block.q8.pop(name) for name in _INPUT_ROLES[:2])
    enorm, hnorm = (block.dense.pop(name) for name in _INPUT_ROLES[2:])
    keep_decoded([e_proj, h_proj, *block.q8.values()])
    return MTPHead(block, e_proj, h_proj, enorm, hnorm, head, str(path))
