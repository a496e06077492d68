"""The compressors: every `ratio` tokens become one pooled row the later tokens can attend.

Each token projects a kv row and a gate score row (plus a learned position term, APE, by the
token's slot `pos % ratio`) into a frontier buffer. When a token completes a window, the
window is pooled with a per-dimension softmax over the scores, normalised, rotated to the
window's first position and rounded (FP8 for attention rows, Hadamard + FP4 for indexer
keys), then stored in f16.

Ratio 128 pools its own 128 tokens. Ratio 4 overlaps: the projection is twice as wide and
row w pools 8 candidates, the previous window's first half and its own second half, so
the frontier keeps two windows: rows 0..3 the last completed window, rows 4..7 the window
being filled (slot 4 + pos % 4). The very first window's "previous" rows hold score -1e30
and weigh nothing.

`compress_chunk` processes a whole chunk of tokens at once and leaves the frontier exactly
as ds4's token-by-token path leaves it (stale slots included), so sessions, snapshots and
KV files agree with ds4.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx
import numpy as np

from ..config import coff, overlaps
from . import cpu_kernels, kernels
from .numerics import Schedule
from .rope import Rotation, YarnParams, yarn_for
from .weights import LayerWeights

NEG_INF = -1e30


def row_span(row: mx.array, ratio: int) -> tuple[mx.array, mx.array]:
    """The first and last token position compressed row `row` pools: its own window
    [row·ratio, row·ratio + ratio - 1], from the previous window's start where windows overlap."""
    first = row * ratio - (ratio if overlaps(ratio) else 0)
    return mx.maximum(first, 0), row * ratio + ratio - 1


@dataclass
class Frontier:
    """A compressor's state: kv and score rows, [coff·ratio, coff·width]."""

    kv: mx.array
    score: mx.array

    @classmethod
    def empty(cls, ratio: int, width: int) -> Frontier:
        rows, cols = coff(ratio) * ratio, coff(ratio) * width
        return cls(mx.zeros((rows, cols), mx.float32), mx.full((rows, cols), NEG_INF, mx.float32))

    def stacked(self) -> mx.array:
        """[2 (kv, score), rows, width], as the frontier hook points show it."""
        return mx.stack([self.kv, self.score])

    @classmethod
    def unstack(cls, both: mx.array) -> Frontier:
        return cls(both[0], both[1])


@dataclass
class Compressor:
    """One layer's compressor: the attention's (rows of head_dim, FP8-rounded: `fp8`) or the
    indexer's (rows of indexer_head_dim, Hadamard + FP4: `qat`), with its weights and RoPE kind."""

    kv_weight: mx.array
    gate_weight: mx.array
    ape: mx.array
    norm: mx.array
    ratio: int
    width: int
    fp8: bool
    qat: bool
    rope_base: float
    yarn: YarnParams | None
    n_rot: int
    eps: float
    layer: LayerWeights                      # the block it came from, and its kind: the weights `compressor_slot`
    kind: str                                # reads (`LayerWeights.kernel_dense`, F16 as in the file)

    @classmethod
    def of(cls, layer: LayerWeights, cfg, kind: str) -> Compressor:
        """kind "attn" or "indexer"."""
        d, ratio = layer.dense, layer.ratio
        width = cfg.head_dim if kind == "attn" else cfg.indexer_head_dim
        return cls(d[f"{kind}_compressor_kv.weight"], d[f"{kind}_compressor_gate.weight"],
                   d[f"{kind}_compressor_ape.weight"], d[f"{kind}_compressor_norm.weight"], ratio, width,
                   kind == "attn", kind == "indexer", cfg.rope_base(layer.index), yarn_for(cfg, ratio), cfg.n_rot,
                   cfg.rms_eps, layer, kind)

    def project(self, x: mx.array, p0: int, mm: Schedule) -> tuple[mx.array, mx.array]:
        """Per-token kv and score rows [T, coff·width] of tokens at p0.. (the score with the slot's APE term)."""
        slots = _slots(p0 % self.ratio, x.shape[0], self.ratio)
        kv, gate = mm.linear(x, self.kv_weight), mm.linear(x, self.gate_weight)
        if mm.native:                     # on the host: the same float32 sums, no MLX round trip
            return kv, mx.array(np.asarray(gate) + np.asarray(self.ape)[np.asarray(slots)])
        return kv, gate + self.ape[slots]

    def step(self, frontier: Frontier, x: mx.array, p0: int, mm: Schedule) -> tuple[mx.array, Frontier]:
        """Feed a chunk of tokens at positions p0..: the rows it completes, [E, width], normed, rotated to each window's
        first position, rounded and stored as f16; and the new frontier.

        A fast-path decode token takes the kernels of a compiled decode step (`decode_token`).
        The CPU's native path runs `compress_chunk` as one native call (`cpu_kernels`)."""
        if mm.fast and x.shape[0] == 1:
            (after,), (rows,) = decode_token([self], [frontier], x, p0)
            return rows, after
        kv, score = self.project(x, p0, mm)
        if mm.native:
            pooled, *rows = cpu_kernels.compress_chunk(frontier.kv, frontier.score, kv, score, p0, self.ratio,
                                                       self.width, overlaps(self.ratio))
            after = Frontier(*rows)
        else:
            pooled, after = compress_chunk(frontier, kv, score, p0, self.ratio, self.width)
        return (pooled if pooled.shape[0] == 0 else self._finished(pooled, p0, mm)), after

    def _finished(self, pooled: mx.array, p0: int, mm: Schedule) -> mx.array:
        """Pooled rows of the windows completed from p0 on, normed, rotated to each window's
        first position (p0 // ratio · ratio, then every ratio tokens), rounded, f16."""
        first = Rotation.at(p0 // self.ratio * self.ratio, pooled.shape[0], self.n_rot, self.rope_base, self.yarn,
                            step=self.ratio)
        return mm.finish_rows(pooled, eps=self.eps, weight=self.norm, rotation=first, qat=self.qat, fp8=self.fp8,
                              f16=True)

    def decode_slot(self, p0: int) -> tuple[int, int, bool]:
        """A decode token's (APE row, frontier row, shift): its window slot, the frontier row it
        writes and, on a ratio-4 compressor, whether it completes the window (that window then
        moves to the first half: `compress_chunk`)."""
        slot = p0 % self.ratio
        overlap = overlaps(self.ratio)
        return slot, (self.ratio if overlap else 0) + slot, overlap and slot == self.ratio - 1

    def slot_inputs(self, frontier: Frontier) -> tuple[mx.array, ...]:
        """`compressor_slot`'s inputs (a fast-path decode token): the F16 copies of F16 weights."""
        kv, gate = (self.layer.kernel_dense(f"{self.kind}_compressor_{part}.weight") for part in ("kv", "gate"))
        return kv, gate, self.ape, frontier.kv, frontier.score


def frontier_pairs(arrays: Sequence[mx.array]) -> list[Frontier]:
    """(kv, score, kv, score, ...) as Frontiers."""
    return [Frontier(*arrays[i:i + 2]) for i in range(0, len(arrays), 2)]


def decode_token(compressors: list[Compressor], frontiers: list[Frontier], x: mx.array,
                 p0: int) -> tuple[list[Frontier], list[mx.array]]:
    """A fast-path decode token x at p0 through a layer's compressors (one, or a ratio-4
    layer's two: the attention's and the indexer's, the same ratio, so the same slot), by the
    launches the compiled attention-input part makes (`Model._attention_inputs`): both slot
    writes in one `compressor_slot` launch, then, when the token completes a window, its rows
    pooled from the frontiers before and after and finished in one `compressor_pool`. Returns
    (frontiers after it, each compressor's rows: [1, width], or [0, width] for none)."""
    state = frontier_state(compressors, frontiers, p0)
    made = kernels.slot_update(x, launch_slots(compressors, state, compressors[0].decode_slot(p0)[2]))
    if completes_window(compressors, p0):
        made = (*made, *pooled_rows(compressors, frontiers, frontier_pairs(made), window_rotation(compressors, p0)))
    return made_in_part(compressors, made)


def completes_window(compressors: list[Compressor], p0: int) -> bool:
    """Whether a decode token at p0 completes a window of the layer's compressors."""
    return (p0 + 1) % compressors[0].ratio == 0


def window_rotation(compressors: list[Compressor], p0: int) -> Rotation:
    """The RoPE row (cos, sin [1, n_rot/2]) of the first position of the window a decode
    token at p0 is in, for its compressors' kind: where their emitted rows are rotated."""
    first = compressors[0]
    return Rotation.at(p0 // first.ratio * first.ratio, 1, first.n_rot, first.rope_base, first.yarn)


def pooled_rows(compressors: list[Compressor], befores: list[Frontier], afters: list[Frontier],
                first: Rotation) -> list[mx.array]:
    """The rows [1, width] of the window a decode token completes in a layer's compressors,
    pooled from their frontiers before and after it and finished (`_finished`'s steps, RoPE
    at `first`, `window_rotation`) in one launch (`kernels.compressor_pool`). Position and
    tables enter as data: a compiled step traces the launch once for every window."""
    ratio = compressors[0].ratio
    rows = [kernels.EmittedRow((b.kv, b.score), (a.kv, a.score), c.width, (c.norm, c.eps, c.qat, c.fp8))
            for c, b, a in zip(compressors, befores, afters, strict=True)]
    return kernels.compressor_pool(rows, ratio, overlaps(ratio), (first.cos, first.sin, 0))


def made_in_part(compressors: list[Compressor], made: Sequence[mx.array]) -> tuple[list[Frontier], list[mx.array]]:
    """A decode token's compressor outputs as its attention-input part makes them (the
    frontiers' kv and score, then the rows of a completed window, if any): (frontiers after
    it, each compressor's emitted rows, [0, width] for none)."""
    n = 2 * len(compressors)
    rows = list(made[n:]) or [_no_rows(c.width) for c in compressors]
    return frontier_pairs(made[:n]), rows


@lru_cache(maxsize=8)
def _no_rows(width: int) -> mx.array:
    """[0, width]: no rows (made from host memory, so that steps on any stream may share it)."""
    return mx.array(np.zeros((0, width), np.float32))


def launch_slots(compressors: list[Compressor], state: tuple[mx.array, ...], shift: bool) -> kernels.CompressorSlots:
    """A decode token's update of a layer's compressors (one, or a ratio-4 layer's two: the
    same slot), for a launch that makes it beside its own work (`kernels.q8_pair(slots=)`),
    from `state` = (at, then each frontier's kv and score): `frontier_state`'s arrays; `shift`
    as `decode_slot` gives it."""
    at, *fronts = state
    groups = [c.slot_inputs(f) for c, f in zip(compressors, frontier_pairs(fronts), strict=True)]
    return kernels.CompressorSlots(groups[0], groups[1] if len(groups) > 1 else None, at, shift)


def frontier_state(compressors: list[Compressor], frontiers: list[Frontier], p0: int) -> tuple[mx.array, ...]:
    """What a decode token's compressor update reads that changes from step to step, as
    arrays: at = (frontier row, APE row), then each frontier's kv and score (the inputs of a
    compiled step's traced part, `launch_slots` inside it)."""
    slot, row, _ = compressors[0].decode_slot(p0)
    return (kernels.slot_at(row, slot), *(a for f in frontiers for a in (f.kv, f.score)))


@lru_cache(maxsize=512)
def _slots(first: int, t: int, ratio: int) -> mx.array:
    """The window slots of t consecutive tokens, the first at slot `first`."""
    return mx.array((first + np.arange(t)) % ratio)


def _pool(kv: mx.array, score: mx.array) -> mx.array:
    """Softmax over axis 1 of score, weights applied to kv: [W, n, D] -> [W, D]."""
    top = score.max(axis=1, keepdims=True)
    weights = mx.exp(score - top)
    pooled = (weights * kv).sum(axis=1) / weights.sum(axis=1)
    return mx.where(top[:, 0] <= NEG_INF * 0.5, 0.0, pooled)


def compress_chunk(frontier: Frontier, kv: mx.array, score: mx.array, p0: int, ratio: int,
                   width: int) -> tuple[mx.array, Frontier]:
    """Feed tokens at positions p0.. (rows kv/score [T, coff·width]); return the pooled rows of
    every window the chunk completes, [E, width], and the new frontier."""
    t = kv.shape[0]
    m0 = p0 % ratio
    n_done = (m0 + t) // ratio
    overlap = overlaps(ratio)
    cur_base = ratio if overlap else 0

    # The current window's earlier tokens live in the frontier; line them up with the chunk.
    seq_kv = mx.concatenate([frontier.kv[cur_base:cur_base + m0], kv])
    seq_score = mx.concatenate([frontier.score[cur_base:cur_base + m0], score])

    pooled = mx.zeros((0, width), mx.float32)
    if n_done:
        win_kv = seq_kv[: n_done * ratio].reshape(n_done, ratio, -1)
        win_score = seq_score[: n_done * ratio].reshape(n_done, ratio, -1)
        if overlap:
            prev_kv = mx.concatenate([frontier.kv[None, :ratio], win_kv[:-1]])
            prev_score = mx.concatenate([frontier.score[None, :ratio], win_score[:-1]])
            cand_kv = mx.concatenate([prev_kv[..., :width], win_kv[..., width:]], axis=1)
            cand_score = mx.concatenate([prev_score[..., :width], win_score[..., width:]], axis=1)
        else:
            cand_kv, cand_score = win_kv, win_score
        pooled = _pool(cand_kv, cand_score)

    # The frontier after the chunk: each slot holds the latest token written to it, and for
    # ratio 4 rows 0..3 hold the last window completed.
    new_kv, new_score = frontier.kv, frontier.score
    if overlap and n_done:
        new_kv = mx.concatenate([win_kv[-1], new_kv[ratio:]])
        new_score = mx.concatenate([win_score[-1], new_score[ratio:]])
    tail = min(t, ratio)
    slots = mx.array([cur_base + (p0 + i) % ratio for i in range(t - tail, t)])
    # Item assignment writes into the array object, which a snapshot may share: copy first.
    new_kv, new_score = mx.array(new_kv), mx.array(new_score)
    new_kv[slots] = kv[t - tail:]
    new_score[slots] = score[t - tail:]
    return pooled, Frontier(new_kv, new_score)


def clear_unused_slots(frontier: Frontier, n_tokens: int, ratio: int) -> Frontier:
    """What ds4 does after a prefill: slots past the partial window are reset to (0, -1e30)."""
    start = (ratio if overlaps(ratio) else 0) + n_tokens % ratio
    end = frontier.kv.shape[0]
    if start >= end:
        return frontier
    kv, score = frontier.kv, frontier.score
    kv = mx.concatenate([kv[:start], mx.zeros((end - start, kv.shape[1]), mx.float32)])
    score = mx.concatenate([score[:start], mx.full((end - start, score.shape[1]), NEG_INF, mx.float32)])
    return Frontier(kv, score)
