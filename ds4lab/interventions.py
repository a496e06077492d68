"""Interventions researchers reach for, as hooks for `model.hooks(...)` / `run_with_hooks`.

Each function returns a list of (hook name, fn) pairs:

- `force_experts(layer, ids)`: the routed experts of a block, for every token (or per token);
  route weights still come from the router's scores of the forced experts.
- `ablate_experts(layer, experts)`: take experts out of a block; each token gets the best
  remaining experts by the router's selection score (hash layers: the table's other choices
  are kept and each ablated one is replaced by the best remaining expert).
- `patch(name, source, positions=None)`: activation patching: rows of `name` replaced by
  those a cache from another run holds (`run_with_cache` on the source prompt), at the given
  absolute positions (all the source's positions when None).
- `select_compressed_rows(layer, fn)`: override which compressed rows a layer attends, on
  ratio-4 (after the indexer) and ratio-128 layers alike (`fn(mask [T, rows] bool, hook) ->
  bool mask`); rows a token cannot see yet stay masked. `drop_compressed_rows(layer, rows)`
  hides the given rows from every token.
- `edit_frontier(session, layer, fn, indexer=False)`: replace a compressor's frontier (kv and
  score rows, ds4's state) in a live session, e.g. to erase a partial window.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.core as mx
import numpy as np

from .hooks import ActivationCache, HookError, HookPoint


def force_experts(layer: int, ids: Sequence[int] | np.ndarray,
                  first_position: int = 0) -> list[tuple[str, Callable]]:
    """ids [n_expert_used]: every token's experts; ids [N, n_expert_used]: row i is the token
    at absolute position first_position + i (a run outside those rows is an error)."""
    chosen = np.asarray(ids, dtype=np.int32)

    def fn(experts: mx.array, hook: HookPoint) -> mx.array:
        if chosen.ndim == 1:
            return mx.array(np.broadcast_to(chosen, experts.shape).copy())
        rows = hook.positions - first_position
        if rows.min() < 0 or rows.max() >= len(chosen):
            raise HookError(f"{hook.name}: forced experts cover positions {first_position}.."
                            f"{first_position + len(chosen) - 1}, not {hook.positions[0]}..{hook.positions[-1]}")
        return mx.array(chosen[rows])

    return [(f"blocks.{layer}.ffn.hook_experts", fn)]


def ablate_experts(layer: int, experts: Sequence[int], bias: np.ndarray | None = None) -> list[tuple[str, Callable]]:
    """`bias` is the block's `exp_probs_b` (selection-only); without it, plain router scores rank."""
    banned = np.asarray(sorted(set(experts)), dtype=np.int64)
    seen: dict[str, np.ndarray] = {}

    def keep_probs(probs: mx.array, hook: HookPoint) -> None:
        seen["probs"] = np.array(probs)

    def replace(chosen: mx.array, hook: HookPoint) -> mx.array:
        score = seen["probs"] + (0 if bias is None else bias)
        score[:, banned] = -np.inf
        current = np.array(chosen)
        out = np.empty_like(current)
        for t, row in enumerate(current):
            keep = [e for e in row if e not in banned]
            ranked = [int(e) for e in np.argsort(-score[t], kind="stable") if e not in keep and e not in banned]
            out[t] = keep + ranked[: len(row) - len(keep)]
        return mx.array(out)

    prefix = f"blocks.{layer}.ffn."
    return [(prefix + "hook_router_probs", keep_probs), (prefix + "hook_experts", replace)]


def patch(name: str, source: ActivationCache, positions: Sequence[int] | None = None) -> list[tuple[str, Callable]]:
    donor, donor_pos = source[name], source.positions[name]
    wanted = donor_pos if positions is None else np.asarray(positions)

    def fn(act: mx.array, hook: HookPoint) -> mx.array:
        rows = np.flatnonzero(np.isin(hook.positions, wanted))
        if not len(rows):
            return act
        values = np.array(act)
        values[rows] = donor[np.searchsorted(donor_pos, hook.positions[rows])]
        return mx.array(values)

    return [(name, fn)]


def select_compressed_rows(layer: int, fn: Callable[[mx.array, HookPoint], mx.array]) -> list[tuple[str, Callable]]:
    return [(f"blocks.{layer}.attn.hook_comp_mask", fn)]


def drop_compressed_rows(layer: int, rows: Sequence[int]) -> list[tuple[str, Callable]]:
    dropped = np.asarray(rows, dtype=np.int64)

    def fn(mask: mx.array, hook: HookPoint) -> mx.array:
        keep = ~np.isin(np.arange(mask.shape[1]), dropped)
        return mask & mx.array(keep)[None, :]

    return select_compressed_rows(layer, fn)


def edit_frontier(session, layer: int, fn: Callable[[mx.array, mx.array], tuple[mx.array, mx.array]],
                  indexer: bool = False) -> None:
    """Set a compressor frontier to `fn(kv, score)` (arrays [rows, width], as `Frontier` holds them)."""
    from .model.compressor import Frontier

    cache = session.state.layers[layer]
    frontier = cache.index_frontier if indexer else cache.frontier
    if frontier is None:
        raise ValueError(f"layer {layer} has no {'indexer ' if indexer else ''}compressor")
    kv, score = fn(frontier.kv, frontier.score)
    if kv.shape != frontier.kv.shape or score.shape != frontier.score.shape:
        raise ValueError(f"layer {layer}: the frontier must keep its shape {tuple(frontier.kv.shape)}")
    if indexer:
        cache.index_frontier = Frontier(kv, score)
    else:
        cache.frontier = Frontier(kv, score)
