"""The fast path's wiring and plan, on the CPU.

The CUDA kernels themselves only run on a GPU (bench/check_device.py checks each against the
composition it replaces). Here each compiled kernel is replaced by a stand-in that does what
its `.cu` source documents, from the same inputs, templates and launch geometry, with plain
MLX ops; the Python wrappers in `kernels.py` and the model's fast-path branches run as on a
GPU. That checks what the device check cannot isolate: which kernel each step calls, with
which arguments, shapes, templates and grid, and which blocks hooks send to the reference path.
"""

from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from ds4lab import generation
from ds4lab.config import preset
from ds4lab.model import Model, attention, compressor, hc, kernel_cache, kernels, moe
from ds4lab.model import numerics as nm
from ds4lab.model.model import MERGED_LAUNCHES
from ds4lab.model.random_weights import _expert_blocks, random_weights
from ds4lab.model.rope import Rotation, apply_rope_tail, yarn_for
from ds4lab.model.weights import Q8Matrix
from ds4lab.quants import gather_experts


def _blocks(grid, threadgroup) -> tuple[int, int]:
    assert grid[0] % threadgroup[0] == 0, "grid x is not whole thread blocks"
    return grid[0] // threadgroup[0], grid[1] // threadgroup[1]


def _rms_weighted(y, eps, weight):
    """row_finish's first steps: RMSNorm (eps, a scalar, given), then times weight (given)."""
    if eps is not None:
        y = nm.rms_norm(y, None, float(eps.item()))
    return y if weight is None else y * weight


def _row_finish(inputs, t, grid, threadgroup):
    x, weight, cos, sin, eps, hscale, carry, n_rows, prefix = inputs
    d, (rows, n_prefix) = t["D"], (int(n) for n in np.array(n_rows)[:2])
    assert carry.shape == (254,)                                   # one entry per normal exponent
    assert x.shape[-1] == d and x.size == rows * d and _blocks(grid, threadgroup)[0] == n_prefix + rows
    assert t["PREFIX"] or n_prefix == 0
    y = _rms_weighted(x.reshape(rows, d), eps[0] if t["NORM"] else None, weight if t["WEIGHT"] else None)
    if t["ROPE"]:
        assert cos.shape[-1] * 2 == t["NROT"]
        at = mx.arange(rows) // t["POS_DIV"]
        assert int(at.max().item()) < cos.shape[0], "a row reads a position past the (cos, sin) rows"
        y = apply_rope_tail(y, cos[at], sin[at], inverse=t["ROPE"] == 2)
    if t["QAT"]:
        assert abs(float(hscale[0].item()) - 1 / math.sqrt(d)) < 1e-7
        y = nm.indexer_qat(y)
    if t["FP8"]:
        y = nm.fp8_kv_round(y, d - t["NROT"])
    if t["F16"]:
        y = nm.round_f16(y)
    if t["PREFIX"]:                      # the prefix's rows copied first (the KV window, then its new rows)
        assert prefix.shape == (n_prefix, d)
        return [mx.concatenate([prefix, y])]
    return [y.reshape(x.shape)]


def _hc_pre(inputs, t, grid, threadgroup):
    streams, mix, scale, base, norm, eps, n_tok = inputs
    n, e, tokens = t["N"], t["E"], int(n_tok[0].item())
    assert streams.shape == (tokens, n, e) and _blocks(grid, threadgroup)[0] == tokens
    assert threadgroup[0] % 32 == 0 and 64 <= threadgroup[0] <= 1024     # warp 0 splits while the rest collapse
    assert t["COLS_PER"] * (threadgroup[0] - 32) >= e                    # warps 1.. hold every column
    rms_eps, hc_eps = (float(v) for v in eps[:2].tolist())
    flat = streams.reshape(tokens, -1)
    assert mix.shape[0] == tokens and mix.size == tokens * t["PARTS"] * (2 + n) * n   # [T, M, PARTS] ([T, M]: 1)
    mix = mix.reshape(tokens, -1, t["PARTS"]).sum(axis=2)         # partial sums, added in order
    inv = 1.0 / mx.sqrt(mx.mean(mx.square(flat), axis=-1, keepdims=True) + rms_eps)
    pre, post, comb = hc._split(mix * inv, scale, base, n, t["ITERS"], hc_eps)
    return [nm.rms_norm((streams * pre[:, :, None]).sum(axis=1), norm, rms_eps), pre, post, comb]


def _hc_mix(inputs, t, grid, threadgroup):
    streams, mix = inputs
    n, e, parts = t["N"], t["E"], t["PARTS"]
    blocks, tokens = _blocks(grid, threadgroup)
    assert blocks == parts and parts * threadgroup[0] >= n * e > (parts - 1) * threadgroup[0]
    assert streams.shape == (tokens, n, e) and mix.shape == ((2 + n) * n, n * e)
    columns = threadgroup[0]                       # block b: columns [b·256, (b + 1)·256)
    flat = streams.reshape(tokens, -1)
    return [mx.stack([flat[:, b * columns:(b + 1) * columns] @ mix[:, b * columns:(b + 1) * columns].T
                      for b in range(parts)], axis=2)]


def _hc_post(inputs, t, grid, threadgroup):
    out, add, streams, post, comb, n_tok = inputs
    assert grid[0] >= streams.size and streams.shape == (int(n_tok[0].item()), t["N"], t["E"])
    if t["ADD"]:
        assert add.shape == out.shape
        out = out + add
    return [post[:, :, None] * out[:, None, :] + (comb[:, :, :, None] * streams[:, :, None, :]).sum(axis=1)]


def _decode_attention_inputs(q, keys, comp, mask, cos, sin, n_keys, eps, kv, kv_weight, t, grid, threadgroup):
    """decode_attention.cuh's inputs checked against the launch, as (q finished, all keys, the
    keys the launch writes with KVROW: the window's rows then the token's finished row, less
    the first n_keys[2])."""
    heads, tokens = _blocks(grid, threadgroup)
    n_raw, n_all, skip = n_keys[:3].tolist()
    assert q.shape == (tokens, heads, t["D"]) and keys.shape[0] == n_raw and n_all == mask.shape[1]
    assert threadgroup[0] == 32 * t["WARPS"] and cos.shape == (tokens, t["NROT"] // 2) and eps.shape[0] >= 2
    if t["QFINISH"]:                     # q is the q_b product: each head normed and rotated first
        at = mx.arange(tokens * heads) // heads
        q = apply_rope_tail(_rms_weighted(q.reshape(-1, t["D"]), eps[0], None), cos[at], sin[at]).reshape(q.shape)
    written = None
    if t["KVROW"]:                       # the token's KV row finished as row_finish finishes it, after the window
        assert tokens == 1 and kv.shape == (1, t["D"]) and kv_weight.shape == (t["D"],)
        row = apply_rope_tail(_rms_weighted(kv, eps[1], kv_weight), cos, sin)
        keys = mx.concatenate([keys, nm.round_f16(nm.fp8_kv_round(row, t["D"] - t["NROT"]))])
        written = keys[skip:]                     # less the rows the window drops
        n_raw += 1
    assert skip == 0 or (t["KVROW"] and skip <= n_raw)
    if n_all > n_raw:                             # the compressed rows follow the window's
        assert comp.shape == (n_all - n_raw, t["D"])
        keys = mx.concatenate([keys, comp])
    return q, keys, written


def _attention_heads(inputs, t, grid, threadgroup):
    q, keys, comp, mask, sinks, cos, sin, n_keys, eps, kv, kv_weight, carry = inputs
    assert not t["KVROW"] or carry.shape == (254,)
    q, keys, written = _decode_attention_inputs(q, keys, comp, mask, cos, sin, n_keys, eps, kv, kv_weight, t, grid,
                                                threadgroup)
    return [*_attention(q, keys, mask, sinks, cos, sin, t), mx.zeros((1, 1)) if written is None else written]


def _attention_shares(inputs, t, grid, threadgroup):
    """Each of grid z's SHARES equal shares of the keys: its largest visible score m (-inf when
    none), l = sum of exp(score - m) and the keys weighted by those; then (the last block of
    a head) the shares added with the sink and the inverse RoPE: decode attention's output."""
    q, keys, comp, mask, cos, sin, n_keys, eps, sinks, counter, kv, kv_weight, carry, part_ml, part_acc = inputs
    heads, tokens = _blocks(grid, threadgroup)
    assert grid[2] == t["SHARES"] and tokens * heads <= counter.size and (not t["KVROW"] or carry.shape == (254,))
    assert part_ml.size >= tokens * heads * t["SHARES"] * 2 and part_acc.size >= tokens * heads * t["SHARES"] * t["D"]
    assert counter.dtype == mx.int32 and not np.array(counter).any()
    q, keys, written = _decode_attention_inputs(q, keys, comp, mask, cos, sin, n_keys, eps, kv, kv_weight, t, grid,
                                                threadgroup)
    shares, n = grid[2], keys.shape[0]
    chunk = -(-n // shares)
    visible = np.array(mask)[:, None, :]
    scores = np.where(visible, np.array(q @ keys.T) / math.sqrt(t["D"]), -np.inf)
    rows = np.where(visible.any(axis=(0, 1))[:, None], np.array(keys), 0.0)   # masked rows are never read
    ml = np.zeros((*scores.shape[:2], shares, 2), np.float32)
    acc = np.zeros((*scores.shape[:2], shares, t["D"]), np.float32)
    for z in range(shares):
        share = scores[..., min(n, z * chunk):min(n, (z + 1) * chunk)]
        m = share.max(axis=-1, initial=-np.inf)
        weights = np.exp(share - np.where(np.isfinite(m), m, 0.0)[..., None])
        ml[..., z, 0], ml[..., z, 1] = m, weights.sum(axis=-1)
        acc[..., z, :] = weights @ rows[min(n, z * chunk):min(n, (z + 1) * chunk)]
    m, total = mx.array(ml[..., 0]), mx.array(ml[..., 1])
    top = mx.maximum(sinks[None, :], m.max(axis=-1))
    kept = mx.where(m == -mx.inf, 0.0, mx.exp(m - top[..., None]))
    denom = mx.exp(sinks[None, :] - top) + (total * kept).sum(axis=-1)
    out = (mx.array(acc) * kept[..., None]).sum(axis=2) / denom[..., None]
    return [apply_rope_tail(out, cos, sin, inverse=True), mx.zeros((1, 1)) if written is None else written]


def _prefill_attention(inputs, t, grid, threadgroup):
    q, keys, mask, sinks, cos, sin, n_keys = inputs
    head_groups, tokens = _blocks(grid, threadgroup)
    assert threadgroup[0] == 128 and t["D"] % 64 == 0 and head_groups == -(-t["H"] // 16)
    assert q.shape == (tokens, t["H"], t["D"]) and keys.shape[0] == int(n_keys[0].item()) == mask.shape[1]
    assert cos.shape == (tokens, t["NROT"] // 2)
    return _attention(q, keys, mask, sinks, cos, sin, t)


def _attention(q, keys, mask, sinks, cos, sin, t):
    scores = (q @ keys.T) / math.sqrt(t["D"])
    scores = mx.where(mask[:, None, :], scores, -mx.inf)
    sink = mx.broadcast_to(sinks[None, :, None], (*scores.shape[:2], 1))
    weights = mx.softmax(mx.concatenate([sink, scores], axis=-1), axis=-1)[..., 1:]
    # masked keys are never read: their rows may hold anything
    out = mx.where(mask[:, None, :], weights, 0.0) @ mx.where(mx.any(mask, axis=0)[:, None], keys, 0.0)
    return [apply_rope_tail(out, cos, sin, inverse=True)]


def _indexer_queries(inputs, t, grid, threadgroup):
    """q_a's norm, the head's rows of wq times it, RoPE, Hadamard + FP4 (QAT); the head weights."""
    qr, qnorm, eps, xa, wq, wp, cos, sin, hscale, carry, wscale = inputs
    heads, tokens = _blocks(grid, threadgroup)
    dh, n_rot = t["DH"], t["NROT"]
    assert qr.shape == (tokens, t["QR"]) and xa.shape == (tokens, t["E"]) and wq.shape == (heads * dh, t["QR"])
    assert wp.shape == (heads, t["E"]) and cos.shape == (tokens, n_rot // 2) and carry.shape == (254,)
    assert abs(float(hscale[0].item()) - 1 / math.sqrt(dh)) < 1e-7
    assert float(wscale[0].item()) == np.float32(1 / math.sqrt(dh * heads))
    assert wq.dtype in (mx.float32, mx.float16)                  # F16 when the file's is (kernel_dense)
    q = (_rms_weighted(qr, eps[0], qnorm) @ wq.astype(mx.float32).T).reshape(tokens, heads, dh)
    q = apply_rope_tail(q, cos, sin)
    return [nm.indexer_qat(q) if t["QAT"] else q, (xa @ wp.T) * wscale[0]]


def _indexer_scores(inputs, t, grid, threadgroup):
    """The scores; with CHOOSE also the mask of the rows chosen from them (a token's last
    block choosing: a thread block of whole warps, a counter per token)."""
    q, w, keys, n_keys, visible, window, counter = inputs
    n, cols = np.array(n_keys[:2]).tolist()
    assert q.shape[1:] == (t["H"], t["DH"]) and keys.shape == (n, t["DH"])
    assert _blocks(grid, threadgroup)[0] * threadgroup[0] // 32 * 4 >= n and grid[1] == q.shape[0]   # 4 keys a warp
    scores = (mx.maximum(q @ keys.T, 0.0) * w[:, :, None]).sum(axis=1)
    if not t["CHOOSE"]:
        return [scores, mx.zeros((1, 1), mx.bool_)]
    assert threadgroup[0] % 32 == 0 and counter.size >= q.shape[0] and window.shape == (q.shape[0], cols)
    return [scores, _chosen(np.array(scores), np.array(visible), np.array(window), t["K"])]


def _chosen(scores: np.ndarray, visible: np.ndarray, window: np.ndarray, k: int) -> mx.array:
    """Per token: the window's columns, then every visible row when at most k are visible,
    else the k visible rows of highest score, ties to the lower row (numpy's stable sort)."""
    rows = visible.copy()
    for i in np.nonzero(visible.sum(axis=1) > k)[0]:
        best = np.argsort(-np.where(visible[i], scores[i], -np.inf), kind="stable")[:k]
        rows[i] = False
        rows[i, best] = True
    return mx.array(np.concatenate([window, rows], axis=1))


def _compressor_slot(inputs, t, grid, threadgroup):
    """The frontier with row at[0] replaced: kv by w_kv·x, score by w_gate·x + ape[at[1]]; with
    SHIFT the second half of the rows (token included) copied over the first. One warp per
    column of each matrix, each warp's values written once; with R2 a second compressor's
    frontier the same way, its warps after the first's."""
    x, *both, at = inputs
    ratio = t["RATIO"]
    assert threadgroup[0] % 32 == 0 and at.dtype == mx.int32 and at.shape == (4,)
    try:                       # `at` is data: a compiled step's placeholder while it is traced
        row, slot = np.array(at).tolist()[:2]
    except ValueError:
        row = slot = None
    assert slot is None or 0 <= slot < ratio
    warps = 2 * (t["R"] + t["R2"])
    assert warps <= _blocks(grid, threadgroup)[0] * threadgroup[0] // 32 < warps + threadgroup[0] // 32
    outs = []
    for (w_kv, w_gate, ape, kv, score), r, rows in zip((both[:5], both[5:]), (t["R"], t["R2"]),
                                                       (t["ROWS"], t["ROWS2"]), strict=True):
        if r == 0:                                       # no second compressor: outputs left unwritten
            outs += [mx.zeros((1, 1)), mx.zeros((1, 1))]
            continue
        assert kv.shape == score.shape == (rows, r) and w_kv.shape == w_gate.shape == (r, t["COLS"]) == (r, x.size)
        assert ape.shape == (ratio, r) and (row is None or 0 <= row < rows)
        assert not t["SHIFT"] or (rows == 2 * ratio and row in (None, rows - 1))
        assert all(a.dtype == mx.float32 for a in (x, ape, kv, score))
        assert w_kv.dtype == w_gate.dtype == both[0].dtype in (mx.float32, mx.float16)   # all four alike
        w_kv, w_gate = w_kv.astype(mx.float32), w_gate.astype(mx.float32)
        at_row = mx.arange(rows)[:, None] == at[0]
        xr = x.reshape(1, -1)
        pair = [mx.where(at_row, xr @ w_kv.T, kv), mx.where(at_row, xr @ w_gate.T + ape[at[1]], score)]
        outs += [mx.concatenate([o[ratio:], o[ratio:]]) for o in pair] if t["SHIFT"] else pair
    return outs


def _compressor_pool(inputs, t, grid, threadgroup):
    """compress_chunk's candidates of the completed window, pooled, a block a compressor (the
    second's with WIDTH2); with FINISH each row finished as row_finish finishes it, at row
    pos of the full (cos, sin) tables, the same block size (the same norm sums)."""
    (*firsts, norm, old_kv2, old_score2, new_kv2, new_score2, norm2, eps, cos, sin, pos, hscale, carry) = inputs
    ratio, n = t["RATIO"], 1 + (t["WIDTH2"] > 0)
    assert _blocks(grid, threadgroup)[0] == n and threadgroup[0] == kernels._THREADS
    assert all(a.dtype == mx.float32 for a in inputs[:10]) and eps.shape[0] >= 2 and hscale.shape[0] >= 2
    outs = []
    for (old_kv, old_score, new_kv, new_score, weight), suffix in zip(
            ((*firsts, norm), (old_kv2, old_score2, new_kv2, new_score2, norm2))[:n], ("", "2"), strict=False):
        width = t[f"WIDTH{suffix}"]
        assert new_kv.shape[1] == t[f"R{suffix}"] == (1 + t["OVERLAP"]) * width
        if t["OVERLAP"]:
            kv = mx.concatenate([old_kv[:ratio, :width], new_kv[:ratio, width:]])
            score = mx.concatenate([old_score[:ratio, :width], new_score[:ratio, width:]])
        else:
            kv, score = new_kv[:ratio], new_score[:ratio]
        row = compressor._pool(kv[None], score[None])
        if t["FINISH"]:
            at = int(pos[0].item())
            i = len(outs)
            steps = {"D": width, "NORM": True, "WEIGHT": True, "ROPE": 1, "NROT": t["NROT"], "POS_DIV": 1,
                     "QAT": t[f"QAT{suffix}"], "FP8": t["FP8" if suffix == "" else "FP8_2"], "F16": True,
                     "PREFIX": False}
            row = _row_finish([row, weight, cos[at:at + 1], sin[at:at + 1], eps[i:i + 1], hscale[i:i + 1], carry,
                               mx.array([1, 0]), mx.zeros((1, 1))], steps, threadgroup, threadgroup)[0]
        outs.append(row)
    return outs + [mx.zeros((1, 1))] * (2 - n)


def _router(inputs, t, grid, threadgroup):
    """With PRODUCT the logits first: x · w.T, a warp a row of w over grid x's blocks, counted
    in counter[token] (given zeroed, left zeroed). With HASH the experts are the tokens' rows
    of the table."""
    x, w, bias, scale, counter, table, token_ids = inputs
    assert threadgroup[0] >= t["E"] and threadgroup[0] % 32 == 0
    assert counter.dtype == mx.int32 and not np.array(counter).any()
    if t["PRODUCT"]:
        blocks, tokens = _blocks(grid, threadgroup)
        assert x.shape == (tokens, t["N"]) and w.shape == (t["E"], t["N"]) and tokens <= counter.size
        assert blocks * threadgroup[0] // 32 >= t["E"] > (blocks - 1) * threadgroup[0] // 32
        assert w.dtype in (mx.float32, mx.float16)                   # F16 when the file's is (kernel_dense)
        logits = x @ w.astype(mx.float32).T
    else:
        logits = x
        assert logits.shape[1] == t["E"] and grid[0] // threadgroup[0] == logits.shape[0] >= 1
    sp = mx.where(logits > 20, logits, mx.where(logits < -20, mx.exp(logits), mx.log1p(mx.exp(logits))))
    probs = mx.sqrt(sp)
    if t["HASH"]:
        assert table.dtype == token_ids.dtype == mx.int32 and table.shape[1] == t["K"]
        assert token_ids.shape == (probs.shape[0],)
        experts = table[token_ids]
    else:
        experts = mx.argsort(-(probs + bias if t["HAS_BIAS"] else probs), axis=-1)[:, :t["K"]].astype(mx.int32)
    return [probs, experts, moe.route_weights(probs, experts, float(scale[0].item()))]


def _q8_rows(codes, scales, cols):
    """A Q8_0 matrix's rows as float32 (code = byte - 128, a float32 scale per 32)."""
    assert codes.shape[1] == cols // 4 and scales.shape == (codes.shape[0], cols // 32)
    return mx.dequantize(codes, scales, -128.0 * scales, group_size=32, bits=8).reshape(-1, cols)


def _q8_products(w, x, dtype=mx.float32):
    """x [T, cols] times each row of w, summed in `dtype` without a BLAS, as float32."""
    return (x.astype(dtype)[:, None, :] * w.astype(dtype)[None]).sum(axis=-1).astype(mx.float32)


def _q8_warps(t, grid, rows, n_tok):
    """A Q8_0 matvec kernel's geometry: R rows per warp (per block of SPLIT warps) cover
    `rows`; grid y the tokens."""
    assert t["SPLIT"] in (1, kernels._Q8_WARPS)
    assert rows % t["R"] == 0 and grid[0] // 32 // t["SPLIT"] * t["R"] >= rows and grid[1] == n_tok


def _q8_matvec(inputs, t, grid, threadgroup):
    codes, scales, x = inputs
    rows, cols, group_rows, r = t["ROWS"], t["COLS"], t["GROUP_ROWS"], t["R"]
    n_tok, groups = grid[1], rows // group_rows
    assert codes.shape == (rows, cols // 4) and x.size == n_tok * groups * cols
    _q8_warps(t, grid, rows, n_tok)
    assert group_rows % r == 0
    w = _q8_rows(codes, scales, cols).reshape(-1, group_rows, cols)
    y = (x.reshape(n_tok, groups, 1, cols) * w[None]).sum(axis=-1).reshape(n_tok, rows)
    return [y.reshape(*x.shape[:-1], rows) if groups == 1 else y]


def _q8_pair(inputs, t, grid, threadgroup):
    """With THEN, the q_b product of the norm too, its blocks after the pair's in grid x (a
    token's PAIR_BLOCKS, then its C_BLOCKS), each geometry a Q8_0 matvec's. With SLOT (one
    token) a compressor update by SLOT_BLOCKS more blocks (between the pair's and C's), as
    compressor_slot's warps make it; its frontiers follow the other outputs."""
    codes_a, scales_a, codes_b, scales_b, x, norm_w, eps, counter, codes_c, scales_c = inputs[:10]
    n_tok, block = x.shape[0], threadgroup[0]
    pair_grid = (t["PAIR_BLOCKS"] * block, n_tok) if t["THEN"] or t["SLOT"] else grid
    _q8_warps(t, pair_grid, t["ROWS_A"], n_tok)
    _q8_warps(t, pair_grid, t["ROWS_A"] + t["ROWS_B"], n_tok)
    a, b = _q8_rows(codes_a, scales_a, t["COLS"]), _q8_rows(codes_b, scales_b, t["COLS"])
    assert a.shape[0] == t["ROWS_A"] and b.shape[0] == t["ROWS_B"]
    assert grid[0] == (n_tok * (t["PAIR_BLOCKS"] + t["C_BLOCKS"]) + t["SLOT_BLOCKS"]) * block or not (
        t["THEN"] or t["SLOT"])
    frontiers = [mx.zeros((1, 1))] * 4
    if t["SLOT"]:
        assert n_tok == 1 and grid[1] == 1
        slot_t = {name.removeprefix("S_"): v for name, v in t.items() if name.startswith("S_")} | {"COLS": t["COLS"]}
        frontiers = _compressor_slot([x, *inputs[10:]], slot_t, (t["SLOT_BLOCKS"] * block, 1, 1), threadgroup)
    else:
        assert t["SLOT_BLOCKS"] == 0
    ya = _q8_products(a, x)
    if not t["NORM_A"]:
        assert not t["THEN"]
        return [ya, _q8_products(b, x), mx.zeros((1, 1)), mx.zeros((1, 1)), *frontiers]
    # q_a's norm sums over the launch's block as row_finish's does (the same bits)
    assert norm_w.shape == (t["ROWS_A"],) and block == kernels._THREADS and counter.dtype == mx.int32
    ya_n = _rms_weighted(ya, eps[0], norm_w)
    if not t["THEN"]:
        return [ya, _q8_products(b, x), ya_n, mx.zeros((1, 1)), *frontiers]
    assert counter.size >= 4 and not np.array(counter).any()
    c_t = {"SPLIT": t["SPLIT_C"], "R": t["R_C"]}
    _q8_warps(c_t, (t["C_BLOCKS"] * block, n_tok), t["ROWS_C"], n_tok)
    assert _q8_launch_blocks(t["ROWS_C"], t["R_C"], t["SPLIT_C"]) == t["C_BLOCKS"]
    c = _q8_rows(codes_c, scales_c, t["ROWS_A"])
    assert c.shape[0] == t["ROWS_C"]
    return [ya, _q8_products(b, x), ya_n, _q8_products(c, ya_n), *frontiers]


def _q8_launch_blocks(rows: int, r: int, split: int) -> int:
    """The thread blocks a Q8_0 matvec of `rows` takes for a token (R rows a warp, SPLIT warps a row)."""
    return -(-rows // (r * kernels._Q8_WARPS // split))


def _q8_swiglu(inputs, t, grid, threadgroup):
    codes_g, scales_g, codes_u, scales_u, x, clamp = inputs
    _q8_warps(t, grid, t["ROWS"], x.shape[0])
    gate, up = _q8_rows(codes_g, scales_g, t["COLS"]), _q8_rows(codes_u, scales_u, t["COLS"])
    assert gate.shape[0] == up.shape[0] == t["ROWS"]
    return [moe.swiglu(_q8_products(gate, x), _q8_products(up, x), float(clamp[0].item()))]


def _q8_hc(inputs, t, grid, threadgroup):
    """With PRE, x is first made: the grouped product of pre_x, by the first PRE_BLOCKS blocks
    of each token in grid x (each of PRE_SETS row sets of PRE_R rows, PRE_SPLIT warps a set),
    the product's PARTS blocks after them."""
    (codes, scales, x, add, streams, post, comb, mix, next_scale, next_base, next_norm, eps, counter, part,
     pre_next, pre_codes, pre_scales, pre_x) = inputs
    if t["PRE"]:
        n_tok, warps = streams.shape[0], threadgroup[0] // 32
        assert t["NEXT"] and not np.array(counter).any() and counter.size >= 4
        assert grid[1] == 1 and grid[0] == n_tok * (t["PRE_BLOCKS"] + t["PARTS"]) * threadgroup[0]
        assert t["PRE_SETS"] * (t["PRE_SPLIT"] if t["PRE_SPLIT"] > 1 else 1) == warps
        assert t["PRE_BLOCKS"] * t["PRE_SETS"] * t["PRE_R"] == t["PRE_ROWS"] and x.size >= n_tok * t["PRE_ROWS"]
        x = _q8_matvec([pre_codes, pre_scales, pre_x], {"ROWS": t["PRE_ROWS"], "COLS": t["PRE_COLS"],
                                                        "GROUP_ROWS": t["PRE_GROUP_ROWS"], "R": t["PRE_R"],
                                                        "SPLIT": t["PRE_SPLIT"]},
                       (t["PRE_BLOCKS"] * threadgroup[0], n_tok), threadgroup)[0]
        grid = (t["PARTS"] * threadgroup[0], n_tok)
    _q8_warps(t, grid, t["E"], x.shape[0])
    # GROUPS sets of rows a block (the next input's tail), each of SPLIT warps with rows
    assert threadgroup[0] == 32 * kernels._Q8_WARPS * t["GROUPS"] and t["E"] % (t["R"] * t["GROUPS"]) == 0
    assert t["GROUPS"] == 1 or (t["NEXT"] and t["SPLIT"] > 1)
    w = _q8_rows(codes, scales, t["COLS"])
    n, e = t["N"], t["E"]
    assert w.shape[0] == e and streams.shape == (x.shape[0], n, e)
    (y,) = _hc_post([_q8_products(w, x), add, streams, post, comb, mx.array([x.shape[0]])], t, (streams.size,), None)
    unused = [mx.zeros((1,))] * 3
    if not t["NEXT"]:
        return [y, *unused]
    # The next sublayer's input, as hc_pre makes it (its last block: warp 0 splits while the
    # others collapse), from the mixer's product of the new streams summed over the blocks.
    assert counter.dtype == mx.int32 and threadgroup[0] >= 64 and _blocks(grid, threadgroup)[0] == t["PARTS"]
    m = (2 + n) * n
    assert mix.shape == (m, n * e) and next_norm.shape == (e,) and part.size >= y.shape[0] * (m + 1) * t["PARTS"]
    assert pre_next.dtype == mx.float32 and pre_next.size >= y.shape[0] * n       # the split's pre: scratch
    summed = (y.reshape(y.shape[0], -1) @ mix.T)[:, :, None]
    tokens = mx.array([y.shape[0]])
    x_next, _, post_next, comb_next = _hc_pre([y, summed, next_scale, next_base, next_norm, eps, tokens],
                                                {"N": n, "E": e, "ITERS": t["ITERS"], "PARTS": 1, "COLS_PER": e},
                                                (y.shape[0] * 64, 1, 1), (64, 1, 1))
    return [y, x_next, post_next, comb_next]


def _q8_hc_routed(type_name):
    """q8_hc with a token's routed experts' down products beside its rows (`add=` a RoutedDown): the
    warp parts of a row set take the pairs in turn, so every pair is summed once."""
    def run(inputs, t, grid, threadgroup):
        raw, ids, mid = inputs[18:21]
        k, rows, cols = t["K"], t["E"], t["COLS"]
        assert not t["ADD"] and ids.dtype == mx.int32 and ids.shape == (grid[1], k) and mid.shape == (*ids.shape, cols)
        # the pairs' rows cut into PIECES runs of whole blocks, evenly over a row set's warps
        assert t["PIECES"] == 1 or (cols % (256 * t["PIECES"]) == 0 and k * t["PIECES"] % t["SPLIT"] == 0)
        assert t["ROW_BYTES"] * rows == t["EXPERT_BYTES"] == raw.shape[1]
        assert len(inputs) == 21 + (type_name == "IQ2_XXS") and not t["PRE"]          # its grid
        flat = ids.reshape(-1)
        down = (gather_experts(raw, flat, type_name, rows, cols) @ mid.reshape(-1, cols)[:, :, None])[..., 0]
        add = down.reshape(*ids.shape, rows).sum(axis=1)
        return _q8_hc([*inputs[:3], add, *inputs[4:18]], {**t, "ADD": True}, grid, threadgroup)
    return run


def _gemm_split_x(inputs, t, grid, threadgroup):
    """Rows scaled by 2^xexp to a largest value under 2^14, split into f16 hi + lo, 16-sums."""
    (x,) = inputs
    assert x.shape[1] == t["COLS"] and _blocks(grid, threadgroup)[0] == x.shape[0]
    xs = np.array(x)
    _, ex = np.frexp(np.abs(xs).max(axis=1))
    k = np.minimum(14 - ex, 100).astype(np.int32)
    scaled = (xs * np.exp2(k.astype(np.float32))[:, None]).astype(np.float32)
    hi = scaled.astype(np.float16)
    lo = (scaled - hi.astype(np.float32)).astype(np.float16)
    sums = scaled.reshape(x.shape[0], -1, 16).sum(axis=-1)
    return [mx.array(hi), mx.array(lo), mx.array(sums), mx.array(k)]


def _router_planes(inputs, t, grid, threadgroup):
    """router_planes.cu: the router's decode form, then its input x as byte planes, as
    `kernels.input_planes` writes them (the host test checks the CUDA maker against it)."""
    assert t["PRODUCT"] and t["N"] % 32 == 0
    return [*_router(inputs, t, grid, threadgroup), kernels.input_planes(inputs[0])]


STAND_INS = {"q8_matvec": _q8_matvec, "q8_pair": _q8_pair, "q8_swiglu": _q8_swiglu, "q8_hc": _q8_hc,
             "router": _router, "router_planes": _router_planes, "row_finish": _row_finish, "hc_pre": _hc_pre,
             "hc_mix": _hc_mix,
             "hc_post": _hc_post, "gemm_split_x": _gemm_split_x,
             "attention_heads": _attention_heads, "attention_shares": _attention_shares,
             "prefill_attention": _prefill_attention,
             "indexer_queries": _indexer_queries, "indexer_scores": _indexer_scores,
             "compressor_slot": _compressor_slot, "compressor_pool": _compressor_pool}


def _expert_matvec(type_name):
    def run(inputs, t, grid, threadgroup):
        raw, ids, x = inputs[:3]
        rows, cols, per_out, x_div = t["ROWS"], t["COLS"], t["PAIRS_PER_OUT"], t["X_DIV"]
        assert t["ROW_BYTES"] * rows == t["EXPERT_BYTES"] == raw.shape[1]
        assert grid[1] * per_out == ids.size and x.size == ids.size // x_div * cols
        assert grid[0] // 32 * t["P"] >= rows * t["PARTS"]     # PARTS warps per P rows
        flat = ids.reshape(-1)
        xs = x.reshape(-1, cols)[mx.arange(flat.size) // x_div]
        y = (gather_experts(raw, flat, type_name, rows, cols) @ xs[:, :, None])[..., 0]
        return [y.reshape(*ids.shape, rows).sum(axis=-2) if per_out > 1 else y.reshape(*ids.shape, rows)]
    return run


def _expert_swiglu(type_name, shared_dtype=mx.float32):
    """With SHARED_ROWS also the shared expert's SwiGLU, a warp a row, grid y's rows after
    the pairs one a token (its products summed in `shared_dtype`)."""
    def run(inputs, t, grid, threadgroup):
        raw_gate, raw_up, ids, x, w, clamp, codes_g, scales_g, codes_u, scales_u = inputs[:10]
        rows, cols, x_div, shared_rows = t["ROWS"], t["COLS"], t["X_DIV"], t["SHARED_ROWS"]
        tokens = ids.size // x_div
        assert t["ROW_BYTES"] * rows == t["EXPERT_BYTES"] == raw_gate.shape[1] == raw_up.shape[1]
        assert grid[1] == ids.size + (tokens if shared_rows else 0) and ids.size == w.size
        assert x.shape == (tokens, cols) and ids.shape[1] == x_div
        assert grid[0] // 32 * t["P"] >= max(rows, shared_rows)     # P rows a warp
        flat = ids.reshape(-1)
        xs = x[mx.arange(flat.size) // x_div][:, :, None]
        gate, up = ((gather_experts(raw, flat, type_name, rows, cols) @ xs)[..., 0] for raw in (raw_gate, raw_up))
        mid = moe.swiglu(gate, up, float(clamp[0].item())) * w.reshape(-1, 1)
        if not shared_rows:
            return [mid.reshape(*ids.shape, rows), mx.zeros((1, 1))]
        shared = moe.swiglu(*(_q8_products(_q8_rows(c, s, cols), x, shared_dtype)
                              for c, s in ((codes_g, scales_g), (codes_u, scales_u))), float(clamp[0].item()))
        assert shared.shape == (tokens, shared_rows)
        return [mid.reshape(*ids.shape, rows), shared]
    return run


def _expert_swiglu_planes(inputs, t, grid, threadgroup):
    """expert_swiglu_planes.cu: expert_swiglu.cu's without x, the routed pairs' and the shared
    expert's dots on the values its planes hold (`kernels.planes_values`); the shared expert's
    summed in float64, as the device sums exact integer partials (a float32 sum of 4096 terms
    is ~1e-5 off on the device check's rows)."""
    ids, planes = inputs[2], inputs[9]
    n_tokens, cols = ids.shape[0], t["COLS"]
    assert planes.dtype == mx.uint8 and planes.shape == (n_tokens * cols // 32 * kernels.PLANE_GROUP_BYTES,)
    x = kernels.planes_values(planes, n_tokens, cols)
    return _expert_swiglu("IQ2_XXS", mx.float64)([*inputs[:3], x, *inputs[3:9], *inputs[10:]], t, grid, threadgroup)


def _routed_swiglu(type_name):
    """routed_swiglu.cu: the router's stand-in (its logits made inside), then expert_swiglu's
    with the experts and weights chosen; checks the job layout (a token's router blocks, a warp
    a row, then its shared and pairs' blocks of output rows, all in grid x) and that the
    counters come zeroed and the scratch holds the tokens' logits and weights."""
    swiglu = _expert_swiglu(type_name)

    def run(inputs, t, grid, threadgroup):
        (raw_gate, raw_up, x, clamp, codes_g, scales_g, codes_u, scales_u, rw, bias, scale, table, token_ids,
         counter, logits, route_w) = inputs[:16]
        threads, k, e, rows, shared_rows = threadgroup[0], t["X_DIV"], t["E"], t["ROWS"], t["SHARED_ROWS"]
        warps, tokens = threads // 32, x.shape[0]
        assert grid[1] == grid[2] == 1 and threadgroup[1] == threadgroup[2] == 1 and threads % 32 == 0
        assert rw.shape == (e, t["COLS"]) and t["EPT"] * threads >= e > (t["EPT"] - 1) * threads
        assert t["ROUTER_BLOCKS"] * warps >= e > (t["ROUTER_BLOCKS"] - 1) * warps
        assert t["X_BLOCKS"] * warps * t["P"] >= max(rows, shared_rows) > (t["X_BLOCKS"] - 1) * warps * t["P"]
        per_token = t["ROUTER_BLOCKS"] + t["X_BLOCKS"] * (k + (1 if shared_rows else 0))
        assert grid[0] == tokens * per_token * threads
        assert counter.dtype == mx.int32 and counter.size >= 2 + 2 * tokens and not np.array(counter).any()
        assert logits.size >= tokens * e and route_w.size >= tokens * k
        block = -(-e // 32) * 32                    # the router's own launch: a thread an expert
        _, experts, weights = _router([x, rw, bias, scale, mx.zeros((tokens,), mx.int32), table, token_ids],
                                      {"E": e, "K": k, "N": t["COLS"], "HAS_BIAS": t["HAS_BIAS"],
                                       "PRODUCT": True, "HASH": t["HASH"]},
                                      (-(-e // (block // 32)) * block, tokens, 1), (block, 1, 1))
        mid, shared = swiglu([raw_gate, raw_up, experts, x, weights, clamp, codes_g, scales_g, codes_u, scales_u,
                              *inputs[16:]], t,
                             (t["X_BLOCKS"] * threads, tokens * k + (tokens if shared_rows else 0), 1), threadgroup)
        return [mid, shared, experts]
    return run


def _quant_gemm(type_name):
    """quant_gemm.cu's walk: each thread block a tile of 64 pairs of one expert (the last
    expert whose first tile is at or before it) times 64 output rows; every output row must
    be written exactly once."""
    def run(inputs, t, grid, threadgroup):
        *weights, xh, xl, xsum, xexp, order, pair_offsets, tile_offsets = inputs
        rows, cols, n_expert, x_div = t["ROWS"], t["COLS"], t["N_EXPERT"], t["X_DIV"]
        n_tiles, row_tiles = _blocks(grid, threadgroup)
        assert threadgroup[0] == 256 and row_tiles * 128 >= rows > (row_tiles - 1) * 128
        assert xh.dtype == xl.dtype == mx.float16 and xh.shape[1] == cols and xsum.shape == (xh.shape[0], cols // 16)
        # the kernel's x: the halves' sum, unscaled (min terms from xsum, checked against it)
        halves = xh.astype(mx.float32) + xl.astype(mx.float32)
        assert np.allclose(np.array(halves.reshape(xh.shape[0], -1, 16).sum(-1)), np.array(xsum), rtol=1e-5, atol=1e-2)
        x = halves * mx.power(2.0, -xexp.astype(mx.float32))[:, None]
        if type_name == "Q8_0":
            codes, scales = weights
            # "experts": the matrix's row groups (one, or the grouped output projection's)
            assert codes.shape == (n_expert * rows, cols // 4) and scales.shape == (n_expert * rows, cols // 32)
            mats = mx.dequantize(codes, scales, -128.0 * scales, group_size=32, bits=8).reshape(n_expert, rows, cols)
        else:
            raw = weights[0]
            assert raw.shape == (n_expert, t["EXPERT_BYTES"]) and t["EXPERT_BYTES"] == rows * t["ROW_BYTES"]
            mats = gather_experts(raw, mx.arange(n_expert), type_name, rows, cols)
        offsets, starts, order = (np.array(a) for a in (pair_offsets, tile_offsets, order))
        assert offsets.shape == starts.shape and offsets.shape[0] >= n_expert + 1   # (padded: kernels._constant)
        offsets, starts = offsets[:n_expert + 1], starts[:n_expert + 1]
        assert starts[-1] <= n_tiles
        y, written = np.zeros((order.size, rows), np.float32), np.zeros(order.size, np.int64)
        for tile in range(int(starts[-1])):
            e = int(np.nonzero(starts[:n_expert] <= tile)[0][-1])
            p0 = offsets[e] + (tile - starts[e]) * kernels.GEMM_TILE
            pairs = order[p0:min(p0 + kernels.GEMM_TILE, offsets[e + 1])]
            y[pairs] = np.array(x[mx.array(pairs // x_div)] @ mats[e].T)
            written[pairs] += 1
        assert (written == 1).all(), "a pair's output row written other than once"
        return [mx.array(y)]
    return run


def _launcher(name, emulate, calls, absent=()):
    """The stand-in's launch; with `absent` (`kernels._fused`'s: a variant without some
    operands) it sees each absent input as zeros of its type and makes no absent output."""
    gone = {operand: dtype for operand, dtype, _ in absent}

    def launch(*, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        calls[name] = calls.get(name, 0) + 1
        if gone:
            _, _, input_names, output_names = kernels._KERNELS[name]
            assert len(inputs) == len([n for n in input_names if n not in gone]), name
            given = iter(inputs)
            inputs = [mx.zeros((1,), gone[n]) if n in gone else next(given) for n in input_names]
        outs = emulate(inputs, dict(template), grid, threadgroup)
        if gone:
            outs = [o for n, o in zip(output_names, outs, strict=True) if n not in gone]
        if name in ("q8_matvec", "q8_pair"):     # they write their values in the shape asked for (q heads)
            outs = [o.reshape(shape) for o, shape in zip(outs, output_shapes, strict=True)]
        assert [tuple(o.shape) for o in outs] == [tuple(s) for s in output_shapes], name
        return [o.astype(dt) for o, dt in zip(outs, output_dtypes, strict=True)]
    return launch


@pytest.fixture
def stand_in_kernels(monkeypatch, batched):
    """CUDA 'ready', every compiled kernel replaced by its stand-in; returns the launches, by kernel."""
    calls: dict[str, int] = {}
    monkeypatch.setattr(kernels, "cuda_ready", lambda: True)
    monkeypatch.setattr(kernels, "_fused", lambda name, absent=(): _launcher(name, STAND_INS[name], calls, absent))
    monkeypatch.setattr(kernels, "_kernel", lambda type_name, swiglu=False: (
        _launcher("expert_swiglu", _expert_swiglu(type_name), calls) if swiglu
        else _launcher("expert_matvec", _expert_matvec(type_name), calls)))
    monkeypatch.setattr(kernels, "_planes_kernel", lambda: _launcher("expert_swiglu_planes", _expert_swiglu_planes,
                                                                     calls))
    monkeypatch.setattr(kernels, "_routed_kernel", lambda type_name: _launcher("routed_swiglu",
                                                                               _routed_swiglu(type_name), calls))
    monkeypatch.setattr(kernels, "_gemm_kernel", lambda type_name: _launcher("quant_gemm", _quant_gemm(type_name),
                                                                             calls))
    monkeypatch.setattr(kernels, "_q8_hc_kernel", lambda type_name: _launcher("q8_hc", _q8_hc_routed(type_name), calls))
    return calls


@pytest.fixture(scope="module")
def small_weights():
    return random_weights(preset("small"), "q2", seed=4)


def _prefill_and_decode(model: Model, tokens: list[int], decoded: int) -> tuple[np.ndarray, np.ndarray]:
    """Logits of a prefill of every token, and of the last `decoded` tokens decoded one by one."""
    full = np.array(model(tokens))
    session = model.session()
    session.prefill(tokens[:-decoded])
    return full, np.stack([np.array(session.decode(t)) for t in tokens[-decoded:]])


@pytest.mark.parametrize("weights_fixture, merged", [("small_weights", "default"), ("tiny_weights", "default"),
                                                     ("small_weights", "floats"), ("small_weights", "all")])
def test_fast_path_wiring_matches_the_reference(request, weights_fixture, merged, stand_in_kernels):
    """Every kernel called, with arguments that reproduce the reference composition, in a
    prefill and in decode steps; 76 tokens: the tiny shape's indexer (top-k 16 of ratio-4
    rows) selects from position 68 on. With the model's defaults (a decode step's IQ2_XXS
    gate and up on the input's planes), with the float form (`Model.expert_planes` off), and
    with every merged launch (`MERGED_LAUNCHES`)."""
    model = Model(request.getfixturevalue(weights_fixture))
    if merged == "all":
        model.merged_launches = set(MERGED_LAUNCHES)
    model.expert_planes = merged == "default"
    tokens = [(37 * i + 11) % 1000 + 100 for i in range(76)]
    assert model.numerics.fast
    fast_full, fast_decoded = _prefill_and_decode(model, tokens, 6)
    # (decode attention over shares of its keys takes 1024 keys or more: its own test; the
    # shared expert's SwiGLU is made in the routed experts' launch unless ffn.hook_out is
    # hooked: q8_swiglu then, in the boundary-hook test; the routed down products are made
    # by the FFN's q8_hc unless ffn.hook_routed_out is hooked: expert_matvec then; a chunk's
    # router reads its logits from a GEMM, a prefill's routed experts are expert_swiglu's.
    # Merged, a decode step routes inside the routed experts' launch (router and expert_swiglu
    # apart: with a hook that reads the experts, or unmerged) and its compressor frontiers are
    # made in the q_a / kv launch)
    every = (set(STAND_INS) - {"attention_shares", "q8_swiglu", "router_planes"}) | {"expert_swiglu", "quant_gemm"}
    if merged == "default":                      # a decode step's router and gate and up on planes
        every = every - {"expert_swiglu"} | {"router_planes", "expert_swiglu_planes"}
    if merged == "all":
        every = every - {"compressor_slot", "expert_swiglu"} | {"routed_swiglu"}
    assert set(stand_in_kernels) == every, f"kernels never called: {every - set(stand_in_kernels)}"
    model.numerics.allow_fast = False
    ref_full, ref_decoded = _prefill_and_decode(model, tokens, 6)
    scale = ref_full.std()
    assert np.abs(fast_full - ref_full).max() / scale < 1e-4
    assert np.abs(fast_decoded - ref_decoded).max() / scale < 1e-4
    assert np.abs(fast_decoded - fast_full[-6:]).max() / scale < 1e-4


@pytest.mark.parametrize("weights_fixture", ["small_weights", "tiny_weights"])
def test_expert_planes_route_decode_steps_through_the_integer_launches(request, weights_fixture,
                                                                       stand_in_kernels):
    """With `Model.expert_planes` each decode step's router writes the FFN input's planes and
    the IQ2_XXS gate and up read them (a prefill keeps its router and GEMMs); the logits stay within the
    fast path's bar of the reference's, and the planes hold each input to 2^-21 of its
    group's largest (the stand-in checks it)."""
    model = Model(request.getfixturevalue(weights_fixture))
    model.expert_planes = True
    tokens = [(37 * i + 11) % 1000 + 100 for i in range(40)]
    _, fast_decoded = _prefill_and_decode(model, tokens, 4)
    n_layer = model.config.n_layer
    # (a compiled decode sublayer calls a stand-in once, when traced: once a layer)
    assert stand_in_kernels["router_planes"] == stand_in_kernels["expert_swiglu_planes"] == n_layer
    assert "expert_swiglu" not in stand_in_kernels and "router" in stand_in_kernels   # the prefill: GEMMs
    model.numerics.allow_fast = False
    ref_full, ref_decoded = _prefill_and_decode(model, tokens, 4)
    assert np.abs(fast_decoded - ref_decoded).max() / ref_full.std() < 1e-4


def test_expert_planes_are_made_only_where_they_are_read(small_weights, stand_in_kernels):
    """No planes where the gate and up do not read them: with the router inside the routed
    experts' launch (`routed_swiglu`, on floats), or with `ffn.hook_shared_out` hooked (the
    routed experts then apart, `expert_matvec`)."""
    model = Model(small_weights)
    model.expert_planes = True
    model.merged_launches = {"router"}
    session = model.session()
    session.prefill([(37 * i + 11) % 1000 + 100 for i in range(12)])
    session.decode(7)
    assert stand_in_kernels["routed_swiglu"] and "router_planes" not in stand_in_kernels
    model.merged_launches = set()
    with model.hooks([("blocks.1.ffn.hook_shared_out", lambda value, hook: None)]):
        session.decode(8)
    assert stand_in_kernels["router_planes"] == model.config.n_layer - 1 and stand_in_kernels["expert_matvec"]


def test_fast_decode_compressor_state_matches_the_reference(small_weights, stand_in_kernels):
    """A decode token's compressor kernels leave the state the reference leaves, from the same
    frontier and the same inputs (so that no float order upstream enters, whatever the BLAS):
    frontiers and compressed rows across a ratio-4 and a ratio-128 window's completion
    (positions 124..131: ratio 128 emits at 127)."""
    model = Model(small_weights)
    cfg = model.config
    x = mx.array(np.random.default_rng(6).standard_normal((132, cfg.n_embd)).astype(np.float32))
    ratios = [ratio for ratio, comps in zip(cfg.compress_ratios, model._compressors, strict=False) if comps]
    assert 128 in ratios and 4 in ratios

    def schedule(p: int, fast: bool):
        model.numerics.allow_fast = fast
        return model.numerics.schedule(np.array([p]))

    for ratio, comps in zip(cfg.compress_ratios, model._compressors, strict=False):
        for comp in comps.values():
            model.numerics.allow_fast = False
            _, start = comp.step(compressor.Frontier.empty(ratio, comp.width), x[:124], 0,
                                 model.numerics.schedule(np.arange(124)))
            states = {}
            for fast in (True, False):
                frontier, rows = start, []
                for p in range(124, 132):
                    emitted, frontier = comp.step(frontier, x[p:p + 1], p, schedule(p, fast))
                    rows.append(np.array(emitted))
                states[fast] = frontier, np.concatenate(rows)
            (a, rows_fast), (b, rows_ref) = states[True], states[False]
            for u, v in ((a.kv, b.kv), (a.score, b.score)):     # float sums in another order
                v = np.array(v)
                assert np.abs(np.array(u) - v).max() <= 1e-5 * max(np.abs(v[np.abs(v) < 1e29]).max(), 1.0)
            assert rows_fast.shape == rows_ref.shape == (132 // ratio - 124 // ratio, comp.width)
            # FP8 / FP4 codes: a float-order difference flips a rare rounding
            assert np.mean(rows_fast == rows_ref) > 0.99
    assert stand_in_kernels.get("compressor_slot", 0) and stand_in_kernels.get("compressor_pool", 0)


def test_a_decode_step_keeps_the_window_the_reference_keeps(small_weights, stand_in_kernels):
    """The raw window after a fast decode step (the attention kernel writes the kept rows and
    the token's finished row) is the reference's: the older rows copied exactly, the token's
    row up to a rare FP8 rounding a float-order difference upstream may flip."""
    model = Model(small_weights)
    session = model.session()
    session.prefill([(37 * i + 11) % 1000 + 100 for i in range(20)])      # n_swa 16: the window slides
    start = session.snapshot()
    windows = {}
    for fast in (True, False):
        model.numerics.allow_fast = fast
        session.restore(start)
        stand_in_kernels.clear()
        session.decode(321)
        windows[fast] = [np.array(c.raw) for c in session.state.layers]
        assert ("attention_heads" in stand_in_kernels) == fast
    for before, fast, ref in zip(start.layers, windows[True], windows[False], strict=True):
        assert fast.shape == ref.shape == (small_weights.config.n_swa, small_weights.config.head_dim)
        assert np.array_equal(fast[:-1], np.array(before.raw)[1:]) and np.array_equal(ref[:-1], fast[:-1])
        assert np.mean(fast[-1] == ref[-1]) > 0.95 and np.allclose(fast[-1], ref[-1], rtol=0.1, atol=1e-3)


def test_expert_tiles_group_every_pair_once_by_expert():
    """The device-side grouping the expert GEMM walks: pairs in expert order, offsets that
    count them, tiles per expert; experts nobody chose get no tile."""
    experts = mx.array(np.random.default_rng(1).integers(0, 10, (150, 6)), dtype=mx.int32)   # 10..15 unused
    tiles = kernels.expert_tiles(experts, 16)
    flat, order = np.array(experts).reshape(-1), np.array(tiles.order)
    offsets, starts = np.array(tiles.pair_offsets), np.array(tiles.tile_offsets)
    assert sorted(order) == list(range(flat.size))
    counts = np.bincount(flat, minlength=16)
    assert list(offsets) == [0, *np.cumsum(counts)]
    for e in range(16):
        assert (flat[order[offsets[e]:offsets[e + 1]]] == e).all()
    assert list(np.diff(starts)) == list(-(-counts // kernels.GEMM_TILE))
    assert starts[-1] <= tiles.n_tiles
    gate = _expert_blocks("IQ2_XXS", 16, 64, 256)
    with pytest.raises(ValueError, match="150 pairs"):                 # one input row short: refused, not read
        kernels.expert_gemm(gate, kernels.expert_tiles(experts[:, :1], 16), mx.zeros((149, 256)), x_div=1)


def test_kernel_sources_lose_comments_and_indentation_not_code_or_line_numbers():
    """What `header_for` cuts (and the host tests compile): each line of every source, comment
    cut and stripped, at its own line number; a string literal (the MMA's asm) kept whole."""
    sent_total = raw_total = 0
    for path in sorted(kernels.KERNEL_DIR.iterdir()):
        raw = path.read_text()
        sent = kernels.kernel_source(path.name)
        raw_lines, sent_lines = raw.split("\n"), sent.split("\n")
        assert len(sent_lines) == len(raw_lines), path.name
        for i, (line, kept) in enumerate(zip(raw_lines, sent_lines, strict=True)):
            code = line.split("//")[0] if "//" in line else line
            assert kept == code.strip(), f"{path.name}:{i + 1}"
        sent_total, raw_total = sent_total + len(sent), raw_total + len(raw)
    assert '"{%0,%1,%2,%3};\\n"' in kernels.kernel_source("gemm_common.cuh")
    assert sent_total < 0.7 * raw_total


def test_a_header_cut_to_a_body_keeps_what_it_uses_and_blanks_the_rest(tmp_path, monkeypatch):
    """`header_for` (the host tests' headers): only the definitions the body reaches (through
    each other too), each line where it was; preprocessor lines and unrecognised pieces stay."""
    (tmp_path / "helpers.cuh").write_text(
        "#include <cuda_fp16.h>\n"
        "// a comment\n"
        "__device__ float leaf(float v) { return v + 1.0f; }\n"
        "template <int N>\n"
        "__device__ float used_by_source(float v) {\n"
        "    const char* s = \"{ not a brace\";\n"
        "    return leaf(v) * N;\n"
        "}\n"
        "__device__ float never_called(float v) {\n"
        "    return leaf(v);\n"
        "}\n"
        "__constant__ float table[2] = {1.0f, 2.0f};\n"
        "__constant__ float other_table[2] = {3.0f, 4.0f};\n"
        "struct Pair { float a, b; };\n"
        "typedef float real;\n")
    (tmp_path / "k.cu").write_text("out[0] = used_by_source<2>(table[0]);\n")
    monkeypatch.setattr(kernels, "KERNEL_DIR", tmp_path)
    lines = kernels.header_for(kernels.kernel_source("k.cu"), "helpers.cuh").split("\n")
    assert len(lines) == len(kernels.kernel_source("helpers.cuh").split("\n"))
    kept = "\n".join(lines)
    for name in ("#include <cuda_fp16.h>", "leaf(float v)", "used_by_source(float v)", "table[2]", "typedef float"):
        assert name in kept, name
    for name in ("never_called", "other_table", "struct Pair"):
        assert name not in kept, name
    assert lines[4] == "__device__ float used_by_source(float v) {"      # still on its own line
    monkeypatch.undo()
    q8 = kernels.header_for(kernels.kernel_source("q8_pair.cu"), "ds4lab_block.cuh", "q8_rows.cuh")
    assert "ds4lab_rms_inverse" in q8 and "ds4lab_block_sum" in q8 and "ds4lab_hc_value" not in q8


def test_a_kernel_is_sent_as_includes_of_its_text_written_under_its_hash(tmp_path, monkeypatch):
    """MLX hashes a kernel's whole text at every launch: the fast path sends an `#include` line
    of its body and one of its header, each the text it used to send (comments cut, the header
    cut to what the body uses), written once to a file named by the text's SHA-256: the
    lines (MLX's key of the compiled module) change with the text and with nothing else."""
    monkeypatch.setenv("DS4LAB_CACHE", str(tmp_path / "cache"))
    (tmp_path / "helpers.cuh").write_text("__device__ float used(float v) { return v; }\n"
                                          "__device__ float unused(float v) { return v; }\n")
    (tmp_path / "k.cu").write_text("out[0] = used(1.0f);  // a comment\n")
    monkeypatch.setattr(kernels, "KERNEL_DIR", tmp_path)

    def sent(texts: dict[str, str]) -> dict[str, Path]:
        paths = {}
        for key, text in texts.items():
            line = text.split("\n")[-2]
            assert line.startswith('#include "') and line.endswith('"'), line
            paths[key] = Path(line[len('#include "'):-1])
        return paths

    texts = kernels.kernel_texts("k.cu", "helpers.cuh")
    files = sent(texts)
    body = kernels.kernel_source("k.cu")
    assert files["source"].read_text() == body == "out[0] = used(1.0f);\n"
    assert files["header"].read_text() == kernels.header_for(body, "helpers.cuh")
    assert "unused" not in files["header"].read_text()
    assert all(p.parent == tmp_path / "cache" / "kernels" for p in files.values())
    assert kernels.kernel_texts("k.cu", "helpers.cuh") == texts
    (tmp_path / "k.cu").write_text("out[0] = used(2.0f);\n")
    edited = sent(kernels.kernel_texts("k.cu", "helpers.cuh"))
    assert edited["source"] != files["source"] and edited["header"] == files["header"]
    assert files["source"].read_text() == body                     # the older text stays as it was
    monkeypatch.undo()
    for name, (source, headers, _, _) in kernels._KERNELS.items():
        made = kernels.kernel_texts(source, *headers)
        assert len(made["source"]) + len(made["header"]) < 512, name


def test_kernel_constants_stay_bounded_over_a_long_session():
    """The key counts a decode step passes grow with the context: the constants cache keeps
    the latest, not one array per length ever seen."""
    for n in range(kernels.CONSTANTS_KEPT + 1000):
        kernels._constant((n, n + 7), mx.int32)
    assert kernels._kept_constant.cache_info().currsize <= kernels.CONSTANTS_KEPT
    assert np.array(kernels._constant((5, 12), mx.int32)).tolist()[:2] == [5, 12]


def test_kernel_constants_stay_out_of_the_scalar_pool():
    """MLX CUDA keeps arrays of 8 bytes or less in host memory (a trip over the bus for every
    kernel that reads one): a constant of 8 bytes or less is padded to 16, its values first,
    zeros after; a larger one is as given."""
    for values, dtype in [((1e-6,), mx.float32), ((1e-6, 1e-5), mx.float32), ((3, 9, 1), mx.int32),
                          ((7,), mx.uint32), ((0.5,) * 5, mx.float32)]:
        made = kernels._constant(values, dtype)
        assert made.nbytes == (16 if len(values) * 4 <= 8 else len(values) * 4) and made.dtype == dtype
        held = np.array(made).tolist()
        assert held[:len(values)] == np.array(values, dtype=np.float32 if dtype == mx.float32 else np.int64).tolist()
        assert not any(held[len(values):])


def test_arrival_counters_and_launch_scratch_are_made_once_and_zeroed():
    """The counters and the last blocks' scratch are one buffer each (per block, use and size)
    for every launch, zeroed, and made from host memory: making them evaluates nothing while
    a step's graph is built (the stream builds on its own thread)."""
    counters = kernels._arrival_counters()
    assert counters is kernels._arrival_counters() and counters.dtype == mx.int32
    assert counters.size >= max(kernels.MATVEC_MAX_TOKENS, kernels._ATTENTION_MANY_BLOCKS)
    scratch = kernels._launch_scratch("q8_hc", 25 * 1024)
    assert scratch is kernels._launch_scratch("q8_hc", 25 * 1024) and scratch.size == 25 * 1024
    assert scratch is not kernels._launch_scratch("attention_shares_ml", 25 * 1024)
    assert not np.array(counters).any() and not np.array(scratch).any()
    # each block its own (launches of two blocks may be unordered in one CUDA graph)
    assert kernels._arrival_counters(3) is not kernels._arrival_counters(4)
    assert kernels._arrival_counters(None) is not counters
    assert kernels._launch_scratch("q8_hc", 25 * 1024, 3) is not scratch


def test_q8_products_of_a_few_thousand_rows_split_their_columns_over_a_block(stand_in_kernels):
    """On a few thousand rows a warp takes 4 rows and a block's warps split their columns
    (SPLIT): as many warps as one row a warp, a quarter of the input reads per row. The
    launches keep every row covered (the stand-ins check the geometry) and the values are the
    products'."""
    rng = np.random.default_rng(5)
    raw = rng.integers(0, 256, (4096, 2048 // 32, 34), dtype=np.uint8)
    raw[:, :, :2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    q8 = Q8Matrix.from_blocks(raw, 4096, 2048)
    x = mx.array(rng.standard_normal((1, 2048)).astype(np.float32))
    want = np.array(q8.quantized(x))
    assert np.allclose(np.array(kernels.q8_matvec(q8, x)), want, rtol=1e-5, atol=1e-5)
    streams, post = mx.ones((1, 4, 4096)), mx.full((1, 4), 0.5)
    comb = mx.array(np.eye(4, dtype=np.float32)[None])
    new, _ = kernels.q8_hc(q8, x, streams, post, comb)
    assert np.allclose(np.array(new), 1.0 + 0.5 * want[:, None, :], rtol=1e-5, atol=1e-5)
    # with the next input: _Q8_HC_GROUPS sets of rows a block (the stand-in checks that geometry)
    mix = mx.array(rng.standard_normal((24, 4 * 4096)).astype(np.float32) * 0.01)
    nxt = kernels.HCInput(mix, mx.ones((3,)), mx.zeros((24,)), mx.ones((4096,)), 20, 1e-6, 1e-6)
    again, made = kernels.q8_hc(q8, x, streams, post, comb, next_input=nxt)
    assert np.array_equal(np.array(again), np.array(new)) and made[0].shape == (1, 4096)
    assert kernels._Q8_HC_GROUPS > 1 and 4096 % (4 * kernels._Q8_HC_GROUPS) == 0
    assert kernels._rows_per_warp(4096, 2048) == (4, kernels._Q8_WARPS)
    assert kernels._rows_per_warp(129280, 4096) == (4, 1)            # the output head: enough warps unsplit
    # with a token's 6 routed down products beside the rows: 6 rows over a row set's 4 warps
    # as 12 half rows (PIECES; the stand-in checks they divide evenly), the sum as made apart
    down = _expert_blocks("Q2_K", 3, 4096, 2048)
    routed = kernels.RoutedDown(down, mx.array([[0, 2, 1, 2, 0, 1]], mx.int32),
                                mx.array(rng.standard_normal((1, 6, 2048)).astype(np.float32)))
    beside, _ = kernels.q8_hc(q8, x, streams, post, comb, add=routed)
    apart, _ = kernels.q8_hc(q8, x, streams, post, comb, add=routed.product())
    assert np.allclose(np.array(beside), np.array(apart), rtol=1e-5, atol=1e-5)
    assert kernels._row_pieces(6, 4, 2048) == 2 and kernels._row_pieces(8, 4, 2048) == 1
    assert kernels._row_pieces(6, 4, 256) == 1                       # one block a row: whole rows


def test_decode_attention_over_many_keys_takes_shares_of_them_and_adds_them(stand_in_kernels):
    """A (token, head)'s 1024 keys or more go over two blocks (attention_shares), the last of
    them adding the shares with the sink, when the heads fill fewer blocks than the GPU has SMs:
    the same output as one block's, a share with no visible key included; the q heads
    finished inside too."""
    rng = np.random.default_rng(8)
    q = mx.array(rng.standard_normal((2, 8, 64)).astype(np.float32))
    keys = mx.array(rng.standard_normal((1100, 64)).astype(np.float32))
    sinks = mx.array(rng.standard_normal(8).astype(np.float32))
    rotation = Rotation.at(900, 2, 32, 10000.0, None)
    rope = (rotation.cos, rotation.sin)
    for mask in (rng.uniform(size=(2, 1100)) < 0.3, np.arange(1100)[None].repeat(2, 0) < 300):
        mask = mx.array(mask)
        stand_in_kernels.clear()
        shared = kernels.attention_heads(q, keys[:128], mask, sinks, rope, keys[128:])
        assert stand_in_kernels == {"attention_shares": 1}
        none = mx.array(0.0)
        whole = _attention_heads([q, keys, none, mask, sinks, *rope, mx.array([1100, 1100, 0]), mx.zeros((2,)), none,
                                  none, none],
                                 {"D": 64, "NROT": 32, "WARPS": kernels._ATTENTION_WARPS, "QFINISH": False,
                                  "KVROW": False},
                                 (8 * 32 * kernels._ATTENTION_WARPS, 2, 1), (32 * kernels._ATTENTION_WARPS, 1, 1))[0]
        assert np.allclose(np.array(shared), np.array(whole), rtol=1e-5, atol=1e-5)
    finished = kernels.attention_heads(q * 5.0, keys[:128], mask, sinks, rope, keys[128:], q_eps=1e-6)
    stand_in_kernels.clear()
    apart = kernels.attention_heads(kernels.row_finish(q * 5.0, eps=1e-6, rope=rope), keys, mask, sinks, rope)
    assert np.allclose(np.array(finished), np.array(apart), rtol=1e-5, atol=1e-5)
    few = kernels.attention_heads(q, keys[:600], mask[:, :600], sinks, rope)          # under 1024 keys: one block
    assert few.shape == q.shape and stand_in_kernels.get("attention_heads") == 1


def test_q8_matvec_refuses_an_output_shape_of_other_size(small_weights):
    """The matvec writes tokens x rows values into the shape it is given: one of another size
    is refused before any launch (the kernel would write past it or leave values unset)."""
    q_b = small_weights.layers[0].q8["attn_q_b.weight"]
    with pytest.raises(ValueError, match="does not hold"):
        kernels.q8_matvec(q_b, mx.zeros((1, q_b.cols)), shape=(1, 2, q_b.rows))


def test_expert_planes_are_refused_for_other_formats_and_other_sizes():
    """Planes serve IQ2_XXS gate and up only, and must hold the tokens' whole input (the
    kernel reads T * cols / 32 groups of them): anything else is refused before any launch;
    router_planes takes rows of whole 32-value groups."""
    ids, x, w = mx.array([[0, 1]], mx.int32), mx.zeros((1, 512)), mx.ones((1, 2))
    planes = mx.zeros((512 // 32 * kernels.PLANE_GROUP_BYTES,), mx.uint8)
    q4 = _expert_blocks("Q4_K", 3, 8, 512)
    with pytest.raises(ValueError, match="planes"):
        kernels.expert_swiglu(q4, q4, ids, x, w, 0.0, None, planes)
    iq2 = _expert_blocks("IQ2_XXS", 3, 8, 512)
    with pytest.raises(ValueError, match="planes"):
        kernels.expert_swiglu(iq2, iq2, ids, x, w, 0.0, None, planes[:-4])
    with pytest.raises(ValueError, match="32-value groups"):
        kernels.router_planes(mx.zeros((1, 100)), None, 2, 1.0, mx.zeros((8, 100)))


def test_a_hook_off_the_boundaries_sends_only_its_block_to_the_reference(small_weights, stand_in_kernels):
    model = Model(small_weights)
    tokens = [5, 6, 7]
    model(tokens)
    fast_calls = dict(stand_in_kernels)
    stand_in_kernels.clear()
    model = Model(small_weights)             # a decode-sized chunk's parts run compiled: traced anew
    seen = []
    with model.hooks([("blocks.1.attn.hook_q", lambda act, hook: seen.append(hook.name)),
                      ("blocks.2.ffn.hook_out", lambda act, hook: None)]):
        plan = model.fast_path_plan()
        model(tokens)
    assert seen == ["blocks.1.attn.hook_q"]
    assert list(plan.path) == ["fast", "reference", "fast", "fast", "fast"]
    assert plan.hooks[1] == "blocks.1.attn.hook_q"
    # block 2's boundary hook keeps it fast, its FFN as written (a decode step's FFN not compiled)
    assert list(plan.compiled) == ["attn, ffn", "", "attn", "attn, ffn", "attn, ffn"]
    # unhooked, only the first sublayer makes its HC input (each other's comes from the launch
    # before); with block 1 on the reference, so do block 2's attention (after a reference
    # block) and block 3's (after block 2's FFN, whose HC step is apart)
    assert fast_calls["hc_pre"] == 1 and stand_in_kernels["hc_pre"] == 3
    # unhooked, each sublayer's last product and HC step are one kernel; block 2's FFN (its
    # hook_out replaceable) keeps the HC step apart
    assert "hc_post" not in fast_calls and stand_in_kernels["hc_post"] == 1
    # and the shared expert's SwiGLU is made in the routed experts' launch, except in block 2
    assert "q8_swiglu" not in fast_calls and stand_in_kernels["q8_swiglu"] == 1
    assert stand_in_kernels["q8_hc"] == fast_calls["q8_hc"] - 3
    # the compiled parts are traced once: the same chunk again launches only the uncompiled
    # blocks' kernels (block 1 on the reference: none; block 2's FFN as written)
    stand_in_kernels.clear()
    with model.hooks([(name, lambda act, hook: None) for name in ("blocks.1.attn.hook_q", "blocks.2.ffn.hook_out")]):
        model(tokens)
    assert "hc_pre" not in stand_in_kernels and stand_in_kernels["hc_post"] == 1


def test_a_decode_step_traces_the_attention_output_and_the_ffn_as_one_part_unless_a_point_between_is_hooked(
        small_weights, stand_in_kernels):
    """Unhooked, a fast decode step's attention output and FFN are one compiled part a block;
    a hook at hook_resid_mid (read-only here) splits them into two, with the same logits, and
    a replacement there is seen by the FFN."""
    model = Model(small_weights)
    session = model.session()
    session.prefill([(37 * i + 11) % 1000 + 100 for i in range(10)])
    state = session.state
    merged = np.array(session.decode(321))
    parts = {key[1] for key in model._compiled}
    assert "attn_out+ffn" in parts and not {"attn_out", "ffn"} & parts
    seen = []
    session.state = state
    with model.hooks([(lambda name: name.endswith("hook_resid_mid"), lambda act, hook: seen.append(hook.name))]):
        split = np.array(session.decode(321))
    assert len(seen) == small_weights.config.n_layer
    assert {"attn_out", "ffn"} <= {key[1] for key in model._compiled}
    assert np.abs(split - merged).max() <= 1e-6 * merged.std()
    session.state = state
    with model.hooks([("blocks.1.hook_resid_mid", lambda act, hook: act * 1.5)]):
        changed = np.array(session.decode(321))
    assert np.abs(changed - merged).max() > 1e-2 * merged.std()


def test_q_a_is_normed_and_multiplied_by_q_b_in_the_launch_of_its_product(small_weights, stand_in_kernels):
    """A decode token's q_a norm and q_b product: made by the q_a and kv launch (its last
    block, then more blocks), no launch of their own; the same values as the reference's
    composition (q_a and kv products, rms_norm, q_b). Without q_b, `project_q` makes it of
    the norm (a chunk's way): the same values as the reference's too."""
    cfg, layer = small_weights.config, small_weights.layers[2]
    mm = Model(small_weights).numerics.schedule(np.arange(40, 41))
    reference = Model(small_weights).numerics.schedule(np.arange(40, 41)).reference()
    assert mm.fast and not reference.fast
    xa = mx.random.normal((1, cfg.n_embd), key=mx.random.key(3))
    heads = (cfg.n_head, cfg.head_dim)
    made = attention.input_products(layer, xa, cfg.rms_eps, mm, heads)
    assert stand_in_kernels == {"q8_pair": 1}
    expected = attention.input_products(layer, xa, cfg.rms_eps, reference, heads)
    assert made[3].shape == (1, *heads)
    for got, want in zip(made, expected, strict=True):
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-5)
    qr_n = attention.input_products(layer, xa, cfg.rms_eps, mm)[2]
    rotation = Rotation.at(40, 1, cfg.n_rot, cfg.rope_base(2), yarn_for(cfg, layer.ratio))
    args = (layer, qr_n, rotation, cfg.n_head, cfg.head_dim, cfg.rms_eps)
    np.testing.assert_allclose(np.array(attention.project_q(*args, mm)),
                               np.array(attention.project_q(*args, reference)), rtol=1e-4, atol=1e-5)
    assert stand_in_kernels["q8_pair"] == 2 and stand_in_kernels["q8_matvec"] == 1


def test_kv_rows_are_finished_after_the_window_in_one_launch(small_weights, stand_in_kernels):
    """The fast path's keys: the kept window's rows, then the chunk's KV rows finished, from
    one row_finish launch and no concatenation; the same values as the reference's append."""
    cfg, layer = small_weights.config, small_weights.layers[1]
    rotation = Rotation.at(40, 2, cfg.n_rot, cfg.rope_base(1), yarn_for(cfg, layer.ratio))
    window = mx.random.normal((5, cfg.head_dim), key=mx.random.key(4))
    kv = mx.random.normal((2, cfg.head_dim), key=mx.random.key(5)) * 3.0
    numerics = Model(small_weights).numerics
    keys = attention.kv_row(layer, kv, rotation, cfg.rms_eps, numerics.schedule(np.arange(40, 42)), window=window)
    assert stand_in_kernels == {"row_finish": 1}
    numerics.allow_fast = False
    rows = attention.kv_row(layer, kv, rotation, cfg.rms_eps, numerics.schedule(np.arange(40, 42)))
    assert np.array_equal(np.array(keys), np.array(mx.concatenate([window, rows])))


def test_a_decode_step_finishes_q_and_kv_rows_without_launches_of_their_own(small_weights, stand_in_kernels):
    """A decode step (no window completed, no indexer) launches no row_finish: the head's HC
    weights, collapse and norm are made by the last block's last launch (as a sublayer's
    input), q_a's norm, q_b's product and the compressors' frontiers by the q_a and kv
    launch, and the q heads and the KV row (written after the window: the keys) are finished
    by the attention kernel. And hc_pre (with its hc_mix) once: every other sublayer's HC
    input is made by the q8_hc before it, and q8_hc runs twice a layer, the attention's
    making the grouped output product first: q8_matvec for the output head only. Each
    merged step in its own launch again (`Model.merged_launches` emptied, as stream_ab.py's
    B): the same logits and frontiers. (The gate and up on floats in both: the merged router's
    launch reads no planes.)"""
    model = Model(small_weights)
    model.merged_launches = set(MERGED_LAUNCHES)
    model.expert_planes = False
    session = model.session()
    session.prefill([(37 * i + 11) % 1000 + 100 for i in range(10)])
    stand_in_kernels.clear()
    mx.eval(session.decode(321))           # position 10: no ratio-4 or ratio-128 window completes
    n_layer = small_weights.config.n_layer
    assert "row_finish" not in stand_in_kernels
    assert stand_in_kernels["attention_heads"] == stand_in_kernels["q8_pair"] == n_layer
    assert stand_in_kernels["hc_pre"] == stand_in_kernels["hc_mix"] == 1
    assert stand_in_kernels["q8_hc"] == 2 * n_layer and stand_in_kernels["q8_matvec"] == 1
    assert "compressor_slot" not in stand_in_kernels
    state, logits = session.state, np.array(session.decode(321))
    merged_state = session.state
    model.merged_launches.clear()
    stand_in_kernels.clear()
    session.state = state
    unmerged = np.array(session.decode(321))
    assert stand_in_kernels["q8_matvec"] == 2 * n_layer + 1
    assert stand_in_kernels["router"] == stand_in_kernels["expert_swiglu"] == n_layer
    assert stand_in_kernels["compressor_slot"] == sum(r > 0 for r in small_weights.config.compress_ratios)
    assert stand_in_kernels["row_finish"] == 2                  # the head's: its HC weights' norm, its own
    assert np.abs(unmerged - logits).max() < 1e-5 * logits.std()
    fronts = [pair for c, d in zip(merged_state.layers, session.state.layers, strict=True)
              for pair in zip(c.frontiers(), d.frontiers(), strict=True)]
    assert fronts and all(np.array_equal(np.array(a.kv), np.array(b.kv)) and
                          np.array_equal(np.array(a.score), np.array(b.score)) for a, b in fronts)
    # made apart (for measuring the two): each sublayer's own hc_mix and hc_pre, the same logits
    model.hc_input_in_product = False
    stand_in_kernels.clear()
    session.state = state
    apart = np.array(session.decode(321))
    assert stand_in_kernels["hc_pre"] == stand_in_kernels["hc_mix"] == 2 * n_layer
    assert np.abs(apart - logits).max() < 1e-5 * logits.std()


def test_a_decode_step_shares_launches_where_parts_read_the_same_input(small_weights, stand_in_kernels):
    """A decode step whose indexer chooses (small: top-4 of 5 ratio-4 rows at position 21; no
    window completes): each ratio-4 layer's indexer queries in one launch, its scores and
    choice of rows in another, its two compressors' slots in the q_a / kv launch (q8_pair), the
    router (its logits too, a hash layer's as well) and the shared expert's SwiGLU in the routed
    experts' launch, the routed down products in the FFN's last product (q8_hc); no norm launch
    for the indexer's q_a. (Every merge on: by default the router and the slots have their
    own launches.)"""
    cfg = small_weights.config
    model = Model(small_weights)
    model.merged_launches = set(MERGED_LAUNCHES)
    session = model.session()
    session.prefill([(37 * i + 11) % 1000 + 100 for i in range(21)])
    stand_in_kernels.clear()
    mx.eval(session.decode(321))
    ratios = cfg.compress_ratios
    assert stand_in_kernels["indexer_queries"] == stand_in_kernels["indexer_scores"] == ratios.count(4) == 2
    assert "compressor_slot" not in stand_in_kernels and stand_in_kernels["q8_pair"] == cfg.n_layer
    assert "compressor_pool" not in stand_in_kernels
    assert cfg.n_hash_layer > 0 and stand_in_kernels["routed_swiglu"] == cfg.n_layer     # hash layers' too
    assert not {"router", "expert_swiglu", "q8_swiglu"} & set(stand_in_kernels)
    assert "expert_matvec" not in stand_in_kernels and stand_in_kernels["q8_hc"] == 2 * cfg.n_layer
    assert "row_finish" not in stand_in_kernels


def test_a_decode_step_that_completes_windows_finishes_their_rows_in_one_launch_a_layer(small_weights,
                                                                                       stand_in_kernels):
    """A decode token that completes a ratio-4 window (position 23): each ratio-4 layer pools
    and finishes both compressors' rows in one compressor_pool launch, and no row_finish
    launch; the rows are the reference's (the logits after it are)."""
    cfg = small_weights.config
    model = Model(small_weights)
    session = model.session()
    session.prefill([(37 * i + 11) % 1000 + 100 for i in range(23)])
    state = session.state
    stand_in_kernels.clear()
    fast = np.array(session.decode(321))
    assert stand_in_kernels["compressor_pool"] == cfg.compress_ratios.count(4) > 0
    assert "row_finish" not in stand_in_kernels
    assert stand_in_kernels["compressor_slot"] == sum(r > 0 for r in cfg.compress_ratios)      # not merged
    fast_next = np.array(session.decode(77))
    model.numerics.allow_fast = False
    session.state = state
    ref = np.array(session.decode(321))
    ref_next = np.array(session.decode(77))
    for a, b in ((fast, ref), (fast_next, ref_next)):
        assert np.abs(a - b).max() < 1e-4 * b.std()


def test_the_heads_input_made_by_the_last_launch_keeps_its_hooks(small_weights, stand_in_kernels):
    """A decode step's head input (HC weights, collapse, norm) is made by the last block's
    last launch; hook_final_norm still reads it there and a replacement there feeds the
    logits; a hook on hook_final_weights (which that launch keeps to itself) gives the head
    its own launches again (two row_finish), with the same logits."""
    model = Model(small_weights)
    session = model.session()
    session.prefill([(37 * i + 11) % 1000 + 100 for i in range(10)])
    state = session.state
    merged = np.array(session.decode(321))
    seen = {}
    for name, fn in (("hook_final_norm", lambda act, hook: seen.setdefault(hook.name, np.array(act))),
                     ("hook_final_weights", lambda act, hook: seen.setdefault(hook.name, np.array(act)))):
        session.state = state
        stand_in_kernels.clear()
        with model.hooks([(name, fn)]):
            logits = np.array(session.decode(321))
        assert (stand_in_kernels.get("row_finish", 0) == 2) == (name == "hook_final_weights") and name in seen
        assert np.abs(logits - merged).max() < 1e-5 * merged.std()
    session.state = state
    with model.hooks([("hook_final_norm", lambda act, hook: act * 0.0)]):
        zeroed = np.array(session.decode(321))
    assert seen["hook_final_norm"].shape == (1, small_weights.config.n_embd) and not zeroed.any()


def test_an_hc_input_made_before_a_replaced_residual_is_not_used(small_weights, stand_in_kernels):
    """A hook that replaces the streams at a residual point drops the HC input the launch
    before made of the old streams: the next sublayer runs its own hc_pre (and hc_mix), and
    the fast path's logits stay the reference path's."""
    for name in ("blocks.2.hook_resid_mid", "blocks.1.hook_resid_post"):
        model = Model(small_weights)            # its sublayers traced afresh: every launch counted
        session = model.session()
        session.prefill([5, 6, 7])
        with model.hooks([(name, lambda act, hook: act * 1.5)]):
            stand_in_kernels.clear()
            state = session.state
            fast = np.array(session.decode(9))
            assert stand_in_kernels["hc_mix"] == stand_in_kernels["hc_pre"] == 2, name
            session.state = state
            model.numerics.allow_fast = False
            reference = np.array(session.decode(9))
        assert np.abs(fast - reference).max() < 1e-4 * reference.std(), name


def test_boundary_hooks_keep_the_fast_path_and_their_replacements_count(small_weights, stand_in_kernels):
    model = Model(small_weights)
    tokens = [5, 6, 7, 8]
    base = np.array(model(tokens))
    boundary = ["blocks.0.hook_resid_pre", "blocks.1.attn.hook_out", "blocks.2.hook_resid_mid",
                "blocks.3.ffn.hook_expert_weights", "blocks.3.ffn.hook_experts", "blocks.4.ffn.hook_out",
                "blocks.4.hook_resid_post"]
    with model.hooks([(name, lambda act, hook: act * 1.5 if hook.name.endswith("attn.hook_out") else None)
                      for name in boundary]):
        plan = model.fast_path_plan()
        steered = np.array(model(tokens))
    assert (plan.path == "fast").all()
    assert np.abs(steered - base).max() > 1e-3 * base.std()
    with model.hooks([("blocks.1.attn.hook_out", lambda act, hook: act * 1.5)]):
        model.numerics.allow_fast = False
        reference = np.array(model(tokens))
    assert np.abs(steered - reference).max() < 1e-4 * base.std()


def test_imatrix_collection_keeps_the_fast_path_and_its_values(small_weights, stand_in_kernels):
    """The points imatrix collection reads (hook_in, hook_experts, hook_routed_mid) keep every
    block on the fast path, and what it collects there is the reference path's."""
    from ds4lab.quants import imatrix

    model = Model(small_weights)
    prompts = [[(13 * i + 5) % 900 + 50 for i in range(40)], [7, 8, 9]]
    with model.hooks(imatrix._Collector(1, 1, 1, 1).hooks()):
        assert (model.fast_path_plan().path == "fast").all()
    fast = imatrix.collect(model, prompts, chunk=16)
    assert stand_in_kernels["quant_gemm"] > 0                  # the chunks ran the tensor-core GEMMs
    model.numerics.allow_fast = False
    reference = imatrix.collect(model, prompts, chunk=16)
    for name, entry in reference.entries.items():
        np.testing.assert_array_equal(fast.entries[name].counts, entry.counts)
        np.testing.assert_allclose(fast.entries[name].sum2, entry.sum2, rtol=1e-4, atol=1e-6 * entry.sum2.max())


def test_plan_is_reference_everywhere_off_cuda_and_in_ds4_cpu(small_weights, batched):
    model = Model(small_weights)
    assert (model.fast_path_plan().path == "reference").all()
    assert list(model.fast_path_plan().block) == list(range(model.config.n_layer))


def test_plan_in_ds4_cpu_numerics_is_reference(small_weights, stand_in_kernels):
    assert (Model(small_weights, numerics="ds4-cpu").fast_path_plan().path == "reference").all()
    assert (Model(small_weights).fast_path_plan().path == "fast").all()


def test_forced_experts_on_the_fast_path_reweight_as_the_reference(small_weights, stand_in_kernels):
    """A replacement at `ffn.hook_experts` (here: forced experts) keeps the fast path; the route
    weights then follow the router's scores of the forced experts, as on the reference path.
    The router then has its own launch (writing the input's planes, which the gate and up
    read): the routed experts' launch does not route."""
    model = Model(small_weights)
    cfg = model.config
    tokens = [5, 6, 7, 8, 9]
    forced = np.random.default_rng(0).integers(0, cfg.n_expert, (len(tokens), cfg.n_layer, cfg.n_expert_used))
    fast = np.array(model(tokens, experts=forced))
    assert stand_in_kernels["router_planes"] == stand_in_kernels["expert_swiglu_planes"] == cfg.n_layer
    assert "routed_swiglu" not in stand_in_kernels
    model.numerics.allow_fast = False
    reference = np.array(model(tokens, experts=forced))
    free = np.array(model(tokens))
    assert np.abs(fast - reference).max() < 1e-4 * reference.std()
    assert np.abs(free - reference).max() > 1e-2 * reference.std()


def test_a_hook_inside_the_mtp_block_sends_it_to_the_reference(synth_dir, stand_in_kernels):
    """The MTP head's block follows the same plan as the model's: a hook at one of its inner
    points fires (the fast path has no HC control to show it)."""
    import ds4lab
    from ds4lab.synth import make_model

    main, head = make_model(synth_dir / "tiny2-mtp.gguf", "tiny", "q2", mtp=True, seed=3, n_layer=2, vocab_rows=64)
    model = ds4lab.load(main, mtp=head)
    session = model.session()
    session.prefill([5, 6, 7])
    state = model.mtp.empty_state(model.config, 3)
    seen = []
    with model.hooks([("mtp.attn.hook_hc_pre", lambda act, hook: seen.append(hook.name))]):
        model.mtp.run(model, state, session.state.hidden[None], [8])
    assert seen == ["mtp.attn.hook_hc_pre"]


def test_a_stream_continuing_a_session_makes_the_heads_input_before_its_worker(tiny_weights, stand_in_kernels,
                                                                               monkeypatch):
    """A greedy stream that continues a session (no prefill in this call) on a model that has
    not made the head's input nor its kernels' F16 copies yet (`Model._head_input`,
    `LayerWeights.kernel_dense`, evaluated when made) makes them before the worker starts,
    not in a step's build while the worker encodes."""
    model = Model(tiny_weights)
    session = model.session()
    session.prefill([(29 * i + 7) % 900 + 100 for i in range(20)])
    model._head_hc = None
    for layer in tiny_weights.layers:
        layer.half_copies.clear()
    assert any(layer.f16_roles for layer in tiny_weights.layers)
    made_with_workers = []

    def workers() -> list[str]:
        return [t.name for t in generation.threading.enumerate() if t.name == "ds4lab-encode"]

    real_head, real_dense = Model._head_input, type(tiny_weights.layers[0]).kernel_dense

    def head_input(self):
        if self._head_hc is None:
            made_with_workers.append(("head", workers()))
        return real_head(self)

    def kernel_dense(self, role):
        if role in self.f16_roles and role not in self.half_copies:
            made_with_workers.append((role, workers()))
        return real_dense(self, role)

    monkeypatch.setattr(Model, "_head_input", head_input)
    monkeypatch.setattr(type(tiny_weights.layers[0]), "kernel_dense", kernel_dense)
    assert len(list(generation.stream(model, [], max_tokens=3, session=session))) == 3
    assert made_with_workers and all(not alive for _, alive in made_with_workers), made_with_workers


def test_greedy_stream_on_the_fast_path_encodes_on_a_worker_thread(tiny_weights, stand_in_kernels, monkeypatch):
    """Hook-free greedy streaming on the fast path builds each step while a worker thread
    evaluates the one before: every evaluation it queues runs on the worker, the tokens and
    the session it leaves are plain decoding's, the caller's default stream is its own
    between steps, stopping early leaves the worker joined, and an error in the worker is
    raised to the caller. With a hook registered it stays on one thread."""
    model = Model(tiny_weights)
    prompt = [(29 * i + 7) % 900 + 100 for i in range(20)]
    plain = model.session()
    seen, expected = [plain.prefill(prompt)], []
    for _ in range(6):
        expected.append(int(mx.argmax(seen[-1]).item()))
        seen.append(plain.decode(expected[-1]))
    workers, queued_on = [], []
    real_thread, real_async_eval = generation.threading.Thread, mx.async_eval
    monkeypatch.setattr(generation.threading, "Thread", lambda **kw: workers.append(real_thread(**kw)) or workers[-1])
    fail_at = [None]

    def async_eval(*arrays):
        queued_on.append(generation.threading.current_thread().name)
        if queued_on.count("ds4lab-encode") == fail_at[0]:
            raise RuntimeError("encoding failed")
        return real_async_eval(*arrays)

    monkeypatch.setattr(mx, "async_eval", async_eval)
    own_stream = mx.default_stream(mx.default_device())
    session = model.session()
    got = []
    for s in generation.stream(model, prompt, max_tokens=6, session=session):
        got.append(s.token)
        assert mx.default_stream(mx.default_device()) == own_stream
    assert got == expected and len(workers) == 1 and not workers[0].is_alive()
    # the prompt's chunks queued here; then the first token and five steps, on the worker only
    first = queued_on.index("ds4lab-encode")
    assert queued_on[first:] == ["ds4lab-encode"] * 6
    assert session.tokens == prompt + expected[:-1]
    np.testing.assert_array_equal(np.array(session.logits), np.array(seen[5]))     # the logits of token 5
    early = model.session()
    steps = generation.stream(model, prompt, max_tokens=6, session=early)
    assert [next(steps).token for _ in range(3)] == expected[:3]
    steps.close()
    assert early.tokens == prompt + expected[:2] and not workers[-1].is_alive() and len(workers) == 2
    queued_on.clear()
    fail_at[0] = 3
    with pytest.raises(RuntimeError, match="encoding failed"):
        list(generation.stream(model, prompt, max_tokens=6))
    assert len(workers) == 3 and not workers[-1].is_alive() and queued_on.count("ds4lab-encode") == 3
    fail_at[0] = None
    queued_on.clear()
    with model.hooks([("blocks.0.hook_resid_pre", lambda act, hook: None)]):
        assert [s.token for s in generation.stream(model, prompt, max_tokens=3)] == expected[:3]
    assert len(workers) == 3 and queued_on and set(queued_on) == {generation.threading.current_thread().name}


def test_f16_matrices_reach_the_kernels_as_f16_with_the_files_values(small_weights):
    """The compressors', the indexer queries' and the router's matrices are F16 in the file:
    the fast path's kernels read an F16 copy (half the bytes), whose values are the float32
    matrix's; a matrix stored otherwise is handed over as it is."""
    layer = next(block for block in small_weights.layers if block.ratio == 4)
    roles = ["attn_compressor_kv.weight", "attn_compressor_gate.weight", "indexer_compressor_kv.weight",
             "indexer.attn_q_b.weight", "ffn_gate_inp.weight"]
    for role in roles:
        assert role in layer.f16_roles
        half = layer.kernel_dense(role)
        assert half.dtype == mx.float16 and mx.array_equal(half.astype(mx.float32), layer.dense[role]).item()
        assert layer.kernel_dense(role) is half                          # made once
    assert "attn_q_a_norm.weight" not in layer.f16_roles                 # F32 in the file
    assert layer.kernel_dense("attn_q_a_norm.weight") is layer.dense["attn_q_a_norm.weight"]
    comp = Model(small_weights)._compressors[layer.index]["attn"]
    kv, gate, *_ = comp.slot_inputs(compressor.Frontier.empty(4, comp.width))
    assert kv.dtype == gate.dtype == mx.float16


def test_no_kernel_of_a_decode_step_reads_a_broadcast_or_transposed_view(tmp_path):
    """MLX copies each input of a custom kernel that is not row-contiguous, at every launch
    (`CustomKernel::eval_gpu`): a hidden copy kernel and buffer per reader. With every launch
    stubbed (one `Depends` node on its inputs), no kernel of a decode step may read an array
    made by a broadcast or a transpose (the embedding's four streams once did: three readers,
    three copies a step). A prefill chunk's graph is evaluated layer by layer, so its graph
    here shows only the last layers and the head."""
    weights = random_weights(preset("tiny"), "q2", seed=4)
    with kernel_cache.recorded_variants(record=False):
        session = Model(weights).session()
        for tokens in ([5, 6, 7, 8, 9, 10], [11]):
            mx.eval(session.state.arrays())
            result = session.model.forward(session.state, tokens, last_only=True)
            mx.export_to_dot(str(tmp_path / "step.dot"), result.logits, *result.state.arrays())
            text = (tmp_path / "step.dot").read_text()
            labels = dict(re.findall(r'\{ (\d+) \[label ="?([A-Za-z]+)', text))
            producer = {b: a for a, b in re.findall(r'(\d+) -> "(\w+)"', text)}
            kernel_inputs = [a for a, b in re.findall(r'"(\w+)" -> (\d+)', text) if labels.get(b) == "Depends"]
            assert kernel_inputs, "no kernel launch in the step"
            views = [labels[producer[a]] for a in kernel_inputs if labels.get(producer.get(a)) in
                     ("Broadcast", "BroadcastAxes", "Transpose", "AsStrided")]
            assert views == [], f"{len(tokens)} tokens: kernels read views {views}"
            session.state = result.state


def test_the_device_check_of_the_merged_launches_runs_on_the_stand_ins(stand_in_kernels, monkeypatch, capsys):
    """bench/check_device.py's kernel parts run through on the CPU with the stand-ins (a broken
    call there would cost device time), and the fused part's lines for the merged launches
    (the router in the routed experts' launch, q_b and the compressor update in q_a's,
    output_a in output_b's, the emitted rows' finish in their pool's) meet their bars: the
    wrappers hand each merged kernel what the separate kernels get."""
    spec = importlib.util.spec_from_file_location(
        "check_device", Path(__file__).resolve().parents[1] / "bench" / "check_device.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    monkeypatch.setattr(check, "_seconds", lambda fn, x, calls=20: (mx.eval(fn(x)), 0.0)[1])
    check.check_fused_kernels()
    check.check_fused_experts()
    check.check_fused_products()
    assert stand_in_kernels["routed_swiglu"] and stand_in_kernels["router"] and stand_in_kernels["q8_pair"]
    merged = ("routed_swiglu", "q8_pair with q_b", "q8_pair with a compressor update",
              "q8_hc with the grouped output product", "compressor_pool with the rows finished")
    assert not [m for m in check._MISSED if m.startswith(merged)], check._MISSED
    out = capsys.readouterr().out
    assert "q8_pair with a compressor update (ratio 4" in out and "compressor_pool with the rows finished" in out



def test_the_device_check_of_the_expert_planes_runs_on_the_stand_ins(stand_in_kernels, monkeypatch, capsys):
    """bench/check_device.py's planes part runs through on the CPU with the stand-ins, and its
    kernel lines meet their bars there: the wrappers hand router_planes what router gets and
    expert_swiglu on planes what its float form gets (the fast path against the reference with
    planes: `test_expert_planes_route_decode_steps_through_the_integer_launches`)."""
    spec = importlib.util.spec_from_file_location(
        "check_device", Path(__file__).resolve().parents[1] / "bench" / "check_device.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    monkeypatch.setattr(check, "_seconds", lambda fn, x, calls=20: (mx.eval(fn(x)), 1e-6)[1])
    monkeypatch.setattr(check, "fast_vs_reference", lambda shape, tokens, planes=False: None)
    check.check_planes()
    assert stand_in_kernels["router_planes"] and stand_in_kernels["expert_swiglu_planes"]
    assert not check._MISSED, check._MISSED
    out = capsys.readouterr().out
    assert out.count("same bytes as input_planes on the CPU True") == 3 and "on planes (2 tokens x 6 of 16" in out


def test_a_compressor_slot_position_is_never_a_shared_constant():
    """A decode part's `at` input (frontier row, APE row) is its own array: mx.compile refuses
    a traced part whose input is also a constant inside it, as q8_pair's stand-in `at` (0, 0)
    was for a ratio-128 layer at every 128th position (H100, 2026-12-05)."""
    assert kernels.slot_at(0, 0) is kernels.slot_at(0, 0)
    assert kernels.slot_at(0, 0) is not kernels._constant((0, 0), mx.int32)
    assert np.array(kernels.slot_at(4, 1)).tolist() == [4, 1, 0, 0]   # past the scalar pool: 16 bytes
