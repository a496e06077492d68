"""ds4lab's native CPU kernels (`kernels/cpu/`, one small C file each), built on first use.

On the CPU an MLX operation costs about 8 µs of dispatch on top of its work (the hand-off to
MLX's CPU worker thread), and a tiny-model decode step is some 1,400 of them; and the large
Q8_0 matrices (the output head above all) go through a BLAS decoded to float32, in a tile of
rows (the batch-invariant path's, `linalg`). These kernels do whole steps in one call:

- `q8_0_matmul`: a Q8_0 matrix times float rows, read in its codes (1 byte a weight and a
  scale per 32; "ds4-cpu" numerics keep their integer block dots);
- `linear`: a float32 matrix times float rows (`Schedule.linear`: the compressors', the
  indexer's and the HC control's weights, among others);
- `compress_chunk`: a compressor's frontier update and the pooling of the windows a chunk
  completes;
- `indexer_scores`, `indexer_select`: the lightning indexer's scores of the key rows and each
  token's top-k of the rows it may see;
- `hc_control`, `hc_collapse_norm`, `hc_expand`: a sublayer's hyper-connections (the control
  with its Sinkhorn iterations, the collapse and RMSNorm of its input, the new streams from
  its output);
- `router`: the FFN's router (probs, the chosen experts, their weights);
- `routed_experts`: the routed experts of a chunk, read in their block formats (IQ2_XXS,
  Q2_K, Q4_K) or kept decoded; `swiglu`, the shared expert's activation;
- `attention`: the softmax attention with sinks over each token's visible keys (the raw
  window's rows and the compressed rows, read where they are: no gathered copy);
- `row_finish`: the per-row steps of q heads, KV, compressed and indexer rows (RMSNorm,
  RoPE, Hadamard + FP4, FP8, f16), ds4's roundings bit for bit.

Each computes every token (and output) on its own in an order its source fixes, whatever the
number of tokens, threads or the vector width: prefill and decode still agree bit for bit.
The sources are compiled together with the system C compiler (`$CC`, else `cc`) on first use,
into `$DS4LAB_CACHE/kernels/` under a name that hashes the sources and the flags, and loaded
with ctypes. Without a compiler (or with `DS4LAB_NATIVE=0`) `available()` is False and the
model keeps its MLX compositions: the same functions in another float order.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..paths import cache_dir
from ..quants.formats import row_bytes
from ..quants.tables import IQ2XXS_GRID_BYTES, IQ2XXS_KSIGNS

KERNEL_DIR = Path(__file__).resolve().parents[2] / "kernels" / "cpu"
# No FMA contraction and no fast-math: the source's order of roundings is the result's.
FLAGS = ["-O3", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared", "-pthread"]
# Calls below this many multiply-adds run on the calling thread (starting and joining a
# thread costs ~30-100 µs; measured ~100 on the 2-core VM).
THREADED_MACS = 1 << 22


def _build() -> ctypes.CDLL | None:
    sources = sorted(KERNEL_DIR.glob("*.c")) if KERNEL_DIR.is_dir() else []
    if os.environ.get("DS4LAB_NATIVE", "1") == "0" or not sources:
        return None
    compiler = os.environ.get("CC", "cc")
    digest = hashlib.sha256(" ".join([compiler, *FLAGS, platform.machine()]).encode())
    for path in sorted(KERNEL_DIR.glob("*.[ch]")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    out_dir = cache_dir() / "kernels"
    out_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    library = out_dir / f"ds4lab_cpu-{digest.hexdigest()[:16]}.so"
    if not library.is_file():
        fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so")
        os.close(fd)
        try:
            subprocess.run([compiler, *FLAGS, "-o", tmp, *map(str, sources), "-lm"], check=True, capture_output=True,
                           timeout=300)
            os.replace(tmp, library)
            for stale in out_dir.glob("*.so"):    # earlier builds (a loaded one stays mapped)
                if stale != library:
                    stale.unlink(missing_ok=True)
        except (OSError, subprocess.SubprocessError):
            Path(tmp).unlink(missing_ok=True)
            return None
    lib = ctypes.CDLL(str(library))
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    signatures = {
        "ds4lab_q8_0_matmul": [p] * 4 + [i64] * 3 + [i32],
        "ds4lab_hc_control": [p] * 4 + [i64] * 3 + [f32, f32, i32] + [p] * 3 + [i32],
        "ds4lab_hc_collapse_norm": [p] * 3 + [i64] * 3 + [f32, p, i32],
        "ds4lab_routed_experts": [p, i32, p, i32, p, i32] + [i64] * 3 + [p] * 3 + [i64, i64, f32] + [p] * 5 + [i32],
        "ds4lab_hc_expand": [p] * 5 + [i64] * 3 + [p, i32],
        "ds4lab_router": [p] * 5 + [i64] * 5 + [f32, p, p, p, i32],
        "ds4lab_row_finish": [p, p, i64, i64, i32, f32, p, i32, p, p, i64, i64, i32, f32, i32, i32, p, i32],
        "ds4lab_attention": [p] * 5 + [i64] * 5 + [f32, p, i32],
        "ds4lab_linear_f32": [p] * 3 + [i64] * 3 + [i32],
        "ds4lab_compress_chunk": [p] * 4 + [i64] * 4 + [i32] + [p] * 3,
        "ds4lab_indexer_scores": [p] * 3 + [i64] * 4 + [p, i32],
        "ds4lab_indexer_select": [p, p, i64, i64, i64, p, i32],
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = ctypes.c_int, argtypes
    lib.ds4lab_swiglu.restype, lib.ds4lab_swiglu.argtypes = None, [p, p, i64, f32, p]
    return lib


@cache
def _library() -> ctypes.CDLL | None:
    return _build()


def available() -> bool:
    """Whether the native kernels are built (or can be) on this machine."""
    return _library() is not None


def _threads(macs: int) -> int:
    return min(os.cpu_count() or 1, 16) if macs >= THREADED_MACS else 1


def _floats(a: mx.array, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """A C-contiguous float32 view (or copy) of a (evaluated) array, optionally reshaped."""
    out = np.ascontiguousarray(np.asarray(a.astype(mx.float32) if a.dtype != mx.float32 else a))
    return out if shape is None else out.reshape(shape)


def _ints(a: mx.array) -> np.ndarray:
    """A C-contiguous int32 view (or copy) of an (evaluated) array."""
    return np.ascontiguousarray(np.asarray(a.astype(mx.int32) if a.dtype != mx.int32 else a))


def _check(status: int, what: str) -> None:
    if status:
        raise ValueError(f"native CPU kernel {what}: arguments out of range (status {status})")


def _lib() -> ctypes.CDLL:
    lib = _library()
    if lib is None:
        raise RuntimeError(f"the native CPU kernels are not built ({KERNEL_DIR}): no C compiler, or DS4LAB_NATIVE=0")
    return lib


def q8_0_matmul(codes: mx.array, scales: mx.array, x: mx.array, groups: int = 1,
                shape: tuple[int, ...] | None = None) -> mx.array:
    """x [..., groups * cols] @ W.T for W [rows, cols] held as `Q8Matrix` holds it: `codes` the
    int8 codes + 128 as uint8 (packed four to a uint32, as MLX's 8-bit quantisation stores
    them), `scales` [rows, cols / 32] float32. With `groups`, W's rows are `groups` equal
    blocks and block g multiplies x's g-th slice of cols (the grouped output projection).
    x may come in any shape whose size is a whole number of such rows (the heads [T, H, D]
    of the grouped projection). Evaluates x; the result is a new array [..., rows], or
    `shape` (made on the host: an MLX reshape would cost the next kernel a round trip)."""
    lib = _lib()
    rows, n_blocks = scales.shape
    cols = n_blocks * 32
    if rows % groups or (x.shape[-1] != cols if groups == 1 else x.size % (groups * cols)) or (
            shape is None and x.shape[-1] != groups * cols):
        raise ValueError(f"x {x.shape} does not split into rows of {groups} x {cols} (the matrix: {rows} rows)")
    code_bytes = np.ascontiguousarray(np.asarray(codes).view(np.uint8))
    if code_bytes.shape != (rows, cols) or scales.dtype != mx.float32:
        raise ValueError(f"codes {code_bytes.shape} and scales {scales.shape} {scales.dtype} "
                         f"do not describe a [{rows}, {cols}] Q8_0 matrix")
    scale_values = _floats(scales)
    xs = _floats(x, (-1, groups, cols))
    n, per = xs.shape[0], rows // groups
    y = np.empty((groups, n, per), np.float32)
    for g in range(groups if n else 0):
        xg = np.ascontiguousarray(xs[:, g])
        _check(lib.ds4lab_q8_0_matmul(code_bytes[g * per:].ctypes.data, scale_values[g * per:].ctypes.data,
                                      xg.ctypes.data, y[g].ctypes.data, per, cols, n, _threads(n * per * cols)),
               "q8_0_matmul")
    out = y[0] if groups == 1 else y.transpose(1, 0, 2).reshape(n, rows)
    return mx.array(out.reshape((*x.shape[:-1], rows) if shape is None else shape))


def linear(x: mx.array, w: mx.array) -> mx.array:
    """x [..., cols] @ w.T for a float32 matrix w [rows, cols] (`kernels/cpu/linear_f32.c`):
    each output a dot over lanes in the source's order, whatever the batch or thread count."""
    rows, cols = w.shape
    if x.shape[-1] != cols:
        raise ValueError(f"x has {x.shape[-1]} columns, the matrix [{rows}, {cols}]")
    ws, xs = _floats(w), _floats(x, (-1, cols))
    y = np.empty((xs.shape[0], rows), np.float32)
    if xs.shape[0]:
        _check(_lib().ds4lab_linear_f32(ws.ctypes.data, xs.ctypes.data, y.ctypes.data, rows, cols, xs.shape[0],
                                        _threads(y.size * cols)), "linear")
    return mx.array(y.reshape(*x.shape[:-1], rows))


def compress_chunk(front_kv: mx.array, front_score: mx.array, kv: mx.array, score: mx.array, p0: int, ratio: int,
                   width: int, overlap: bool) -> tuple[mx.array, mx.array, mx.array]:
    """`compressor.compress_chunk` (`kernels/cpu/compressor.c`): the frontier [coff·ratio,
    coff·width] fed the chunk's kv and score rows [T, coff·width] (score with its APE term) of
    positions p0..; returns the pooled rows of the windows it completes [E, width] and the new
    frontier's kv and score."""
    c = 2 if overlap else 1
    t = kv.shape[0]
    if front_kv.shape != (c * ratio, c * width) or front_score.shape != front_kv.shape or \
            kv.shape != (t, c * width) or score.shape != kv.shape or p0 < 0:
        raise ValueError(f"compressor frontier {front_kv.shape} / {front_score.shape} and rows {kv.shape} / "
                         f"{score.shape} do not fit ratio {ratio}, width {width} at position {p0}")
    fk, fs, k, sc = _floats(front_kv), _floats(front_score), _floats(kv), _floats(score)
    pooled = np.empty(((p0 % ratio + t) // ratio, width), np.float32)
    new_kv, new_score = np.empty_like(fk), np.empty_like(fs)
    if t == 0:
        return mx.array(pooled), front_kv, front_score
    _check(_lib().ds4lab_compress_chunk(fk.ctypes.data, fs.ctypes.data, k.ctypes.data, sc.ctypes.data, t, p0, ratio,
                                        width, overlap, pooled.ctypes.data, new_kv.ctypes.data, new_score.ctypes.data),
           "compress_chunk")
    return mx.array(pooled), mx.array(new_kv), mx.array(new_score)


def indexer_scores(q: mx.array, weights: mx.array, keys: mx.array) -> mx.array:
    """`indexer.indexer_scores` (`kernels/cpu/indexer.c`): Σ_h w_h·relu(q_h·k) of every key row
    for every token, q [T, H, D], weights [T, H], keys [N, D]; returns [T, N]."""
    if q.ndim != 3 or weights.shape != q.shape[:2] or keys.ndim != 2 or keys.shape[1] != q.shape[2]:
        raise ValueError(f"indexer queries {q.shape}, weights {weights.shape} and keys {keys.shape} "
                         "do not fit together")
    t, n_head, d = q.shape
    qs, ws, ks = _floats(q), _floats(weights), _floats(keys)
    out = np.empty((t, keys.shape[0]), np.float32)
    if t:
        _check(_lib().ds4lab_indexer_scores(qs.ctypes.data, ws.ctypes.data, ks.ctypes.data, t, n_head, d,
                                            keys.shape[0], out.ctypes.data, _threads(out.size * n_head * d)),
               "indexer_scores")
    return mx.array(out)


def indexer_select(scores: mx.array, visible: mx.array, top_k: int) -> mx.array:
    """`indexer.select_rows` (`kernels/cpu/indexer.c`): mask [T, N] of the top_k best-scoring
    rows each token may see (`visible` [T, N]), ties to the lower row; every visible row when
    no more are visible."""
    if scores.ndim != 2 or visible.shape != scores.shape:
        raise ValueError(f"indexer scores {scores.shape} and visible rows {visible.shape} do not fit together")
    s = _floats(scores)
    seen = np.ascontiguousarray(np.asarray(visible), dtype=np.uint8)
    chosen = np.empty(s.shape, np.uint8)
    if s.shape[0]:
        _check(_lib().ds4lab_indexer_select(s.ctypes.data, seen.ctypes.data, s.shape[0], s.shape[1], top_k,
                                            chosen.ctypes.data, _threads(s.size * 64)), "indexer_select")
    return mx.array(chosen.view(np.bool_))


def hc_control(streams: mx.array, fn: mx.array, scale: mx.array, base: mx.array, sinkhorn_iters: int,
               rms_eps: float, hc_eps: float) -> tuple[mx.array, mx.array, mx.array]:
    """pre [T, n_hc], post [T, n_hc], comb [T, n_hc, n_hc] of `hc.hc_control` for streams
    [T, n_hc, width] and the mixer fn [2 n_hc + n_hc^2, n_hc * width] (`kernels/cpu/hc_input.c`)."""
    t, n, width = streams.shape
    if fn.shape != (2 * n + n * n, n * width) or scale.size != 3 or base.size != fn.shape[0]:
        raise ValueError(f"HC mixer {fn.shape}, scale {scale.shape}, base {base.shape} do not fit "
                         f"streams [{t}, {n}, {width}]")
    s, f, sc, b = _floats(streams), _floats(fn), _floats(scale), _floats(base)
    pre, post, comb = np.empty((t, n), np.float32), np.empty((t, n), np.float32), np.empty((t, n, n), np.float32)
    if t:
        _check(_lib().ds4lab_hc_control(s.ctypes.data, f.ctypes.data, sc.ctypes.data, b.ctypes.data, t, n, width,
                                        rms_eps, hc_eps, sinkhorn_iters, pre.ctypes.data, post.ctypes.data,
                                        comb.ctypes.data, _threads(f.size * t)), "hc_control")
    return mx.array(pre), mx.array(post), mx.array(comb)


def hc_collapse_norm(streams: mx.array, pre: mx.array, norm: mx.array | None, eps: float) -> mx.array:
    """RMSNorm(Σ_a pre[:, a] · streams[:, a]) · norm, [T, width] (`hc.hc_collapse`, then the
    sublayer's norm)."""
    t, n, width = streams.shape
    if pre.shape != (t, n) or (norm is not None and norm.shape != (width,)):
        raise ValueError(f"pre {pre.shape} and norm {None if norm is None else norm.shape} do not fit "
                         f"streams [{t}, {n}, {width}]")
    s, p = _floats(streams), _floats(pre)
    w = None if norm is None else _floats(norm)
    out = np.empty((t, width), np.float32)
    if t:
        _check(_lib().ds4lab_hc_collapse_norm(s.ctypes.data, p.ctypes.data, None if w is None else w.ctypes.data, t,
                                              n, width, eps, out.ctypes.data, _threads(s.size)), "hc_collapse_norm")
    return mx.array(out)


def hc_expand(out: mx.array, streams: mx.array, post: mx.array, comb: mx.array,
              add: mx.array | None = None) -> mx.array:
    """`hc.hc_expand` (`kernels/cpu/hc_input.c`): stream c of the new streams [T, n_hc, width]
    is post[:, c] · (out + add) + Σ_a comb[:, a, c] · streams[:, a], the sum in stream order."""
    t, n, width = streams.shape
    if out.shape != (t, width) or post.shape != (t, n) or comb.shape != (t, n, n) or (
            add is not None and add.shape != out.shape):
        raise ValueError(f"out {out.shape}, post {post.shape}, comb {comb.shape} do not fit "
                         f"streams [{t}, {n}, {width}]")
    o, s, p, c = _floats(out), _floats(streams), _floats(post), _floats(comb)
    a = None if add is None else _floats(add)
    y = np.empty((t, n, width), np.float32)
    if t:
        _check(_lib().ds4lab_hc_expand(o.ctypes.data, None if a is None else a.ctypes.data, s.ctypes.data,
                                       p.ctypes.data, c.ctypes.data, t, n, width, y.ctypes.data, _threads(s.size * n)),
               "hc_expand")
    return mx.array(y)


def router(x: mx.array, gate_inp: mx.array, bias: mx.array | None, n_used: int, scale: float,
           tokens: mx.array | None = None, table: mx.array | None = None) -> tuple[mx.array, mx.array, mx.array]:
    """`moe.router_probs`, `select_experts` and `route_weights` in one call
    (`kernels/cpu/router.c`): x [T, d], gate_inp [E, d], bias [E] or None; on hash layers the
    token ids [T] and the table [vocab, n_used]. Returns probs [T, E], experts [T, n_used]
    int32 and weights [T, n_used]."""
    t, d = x.shape
    n_expert = gate_inp.shape[0]
    if gate_inp.shape != (n_expert, d) or (bias is not None and bias.shape != (n_expert,)) or (
            table is not None and (tokens is None or table.shape[1:] != (n_used,) or tokens.shape != (t,))):
        raise ValueError(f"router inputs x {x.shape}, gate {gate_inp.shape}, table "
                         f"{None if table is None else table.shape} do not fit together")
    xs, w = _floats(x), _floats(gate_inp)
    b = None if bias is None else _floats(bias)
    ids, tab = (None, None) if table is None else (_ints(tokens), _ints(table))
    probs, experts, weights = (np.empty((t, n_expert), np.float32), np.empty((t, n_used), np.int32),
                               np.empty((t, n_used), np.float32))
    if t:
        _check(_lib().ds4lab_router(xs.ctypes.data, w.ctypes.data, None if b is None else b.ctypes.data,
                                    None if ids is None else ids.ctypes.data, None if tab is None else tab.ctypes.data,
                                    0 if tab is None else tab.shape[0], t, d, n_expert, n_used, scale,
                                    probs.ctypes.data, experts.ctypes.data, weights.ctypes.data,
                                    _threads(t * n_expert * d)), "router")
    return mx.array(probs), mx.array(experts), mx.array(weights)


def swiglu(gate: mx.array, up: mx.array, clamp: float) -> mx.array:
    """`moe.swiglu` elementwise (`kernels/cpu/routed_experts.c`, the routed experts' steps)."""
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate {gate.shape} and up {up.shape} differ")
    g, v = _floats(gate), _floats(up)
    out = np.empty_like(g)
    _lib().ds4lab_swiglu(g.ctypes.data, v.ctypes.data, g.size, clamp, out.ctypes.data)
    return mx.array(out)


# Expert tensor types the native kernel reads in their blocks (`kernels/cpu/block_dots.h`), and
# its code for each; "F32" is a tensor the loader kept decoded.
EXPERT_TYPES = {"F32": 0, "IQ2_XXS": 1, "Q2_K": 2, "Q4_K": 3}


def reads_blocks(type_name: str, cols: int) -> bool:
    """Whether `routed_experts` reads expert matrices of this type and row width in their
    blocks (rows of whole 256-value blocks), so that nothing needs them decoded."""
    return type_name in EXPERT_TYPES and type_name != "F32" and cols % 256 == 0


def _expert_bytes(data: mx.array, type_name: str, rows: int, cols: int, what: str) -> np.ndarray:
    """One expert tensor as the kernel reads it: float32 [E, rows, cols] or blocks [E, bytes]."""
    if type_name == "F32":
        out = _floats(data)
        ok = out.shape[1:] == (rows, cols)
    else:
        out = np.ascontiguousarray(np.asarray(data).view(np.uint8)).reshape(data.shape[0], -1)
        ok = reads_blocks(type_name, cols) and out.shape[1] == rows * row_bytes(type_name, cols)
    if not ok:
        raise ValueError(f"routed experts: {what} ({type_name}, {tuple(data.shape)}) does not hold "
                         f"[{rows}, {cols}] matrices")
    return out


def routed_experts(gate: tuple[mx.array, str], up: tuple[mx.array, str], down: tuple[mx.array, str], x: mx.array,
                   experts: mx.array, weights: mx.array, clamp: float,
                   want_mid: bool = False) -> tuple[mx.array, mx.array | None]:
    """`moe.routed_experts` in one call (`kernels/cpu/routed_experts.c`). gate, up and down are
    (data, type): an `ExpertBlocks`' bytes [E, expert bytes] with its type (`EXPERT_TYPES`:
    IQ2_XXS, Q2_K, Q4_K) or float32 experts with "F32" (gate, up [E, n_ff, d], down [E, d, n_ff]);
    x [T, d], experts and weights [T, U]. Returns y [T, d] and, with `want_mid`, the
    route-weighted SwiGLU activations [T, U, n_ff]."""
    if x.ndim != 2 or experts.ndim != 2:
        raise ValueError(f"routed experts: x {x.shape} and experts {experts.shape} must be [T, d] and [T, U]")
    t, d = x.shape
    u = experts.shape[1]
    n_expert = gate[0].shape[0]
    if gate[1] == "F32":
        n_ff = gate[0].shape[1]
    else:
        per_row = row_bytes(gate[1], d) if reads_blocks(gate[1], d) else 0
        n_ff = int(np.prod(gate[0].shape[1:])) // max(per_row, 1)
    arrays = [_expert_bytes(data, kind, rows, cols, what) for (data, kind), rows, cols, what in
              ((gate, n_ff, d, "gate"), (up, n_ff, d, "up"), (down, d, n_ff, "down"))]
    if any(a.shape[0] != n_expert for a in arrays) or experts.shape != (t, u) or weights.shape != (t, u):
        raise ValueError(f"routed experts: gate, up and down hold {[a.shape[0] for a in arrays]} experts; "
                         f"x {x.shape}, experts {experts.shape}, weights {weights.shape} do not fit together")
    xs, w, ids = _floats(x), _floats(weights), _ints(experts)
    y, z = np.empty((t, d), np.float32), np.empty((t, u, d), np.float32)
    mid = np.empty((t, u, n_ff), np.float32) if want_mid else None
    if t:
        g, v, dn = arrays
        _check(_lib().ds4lab_routed_experts(g.ctypes.data, EXPERT_TYPES[gate[1]], v.ctypes.data, EXPERT_TYPES[up[1]],
                                            dn.ctypes.data, EXPERT_TYPES[down[1]], n_expert, d, n_ff, xs.ctypes.data,
                                            ids.ctypes.data, w.ctypes.data, t, u, clamp, IQ2XXS_GRID_BYTES.ctypes.data,
                                            IQ2XXS_KSIGNS.ctypes.data, None if mid is None else mid.ctypes.data,
                                            z.ctypes.data, y.ctypes.data, _threads(3 * t * u * n_ff * d)),
               "routed_experts")
    return mx.array(y), None if mid is None else mx.array(mid)


@cache
def _carry() -> np.ndarray:
    from ..floats import log2f_carry_table

    return np.ascontiguousarray(log2f_carry_table(), dtype=np.int32)


def row_finish(x: mx.array, *, eps: float | None = None, weight: mx.array | None = None,
               rope: tuple[mx.array, mx.array] | None = None, inverse: bool = False, qat: bool = False,
               fp8: bool = False, f16: bool = False) -> mx.array:
    """`kernels.row_finish`'s steps on the CPU (`kernels/cpu/row_finish.c`): over x's last
    axis, RMSNorm (when `eps` is given) times `weight`, RoPE of the last 2·cos.shape[-1] dims
    with `rope` = (cos, sin) [positions, n_rot/2] (x's rows split evenly over the positions;
    `inverse` turns back), Hadamard + FP4 (`qat`), FP8 of the non-RoPE dims, f16 round trip."""
    d = x.shape[-1]
    xs = _floats(x, (-1, d))
    rows = xs.shape[0]
    y = np.empty_like(xs)
    w = None if weight is None else _floats(weight)
    cos = sin = None
    n_rot = per_pos = 0
    if rope is not None:
        cos, sin = (_floats(a) for a in rope)
        n_rot = 2 * cos.shape[-1]
        per_pos = rows // max(cos.shape[0], 1)
        if cos.shape != sin.shape or per_pos * cos.shape[0] != rows:
            raise ValueError(f"rope {cos.shape} / {sin.shape} does not fit {rows} rows")
    if w is not None and w.shape != (d,):
        raise ValueError(f"weight {w.shape} does not fit rows of {d}")
    if rows:
        _check(_lib().ds4lab_row_finish(xs.ctypes.data, y.ctypes.data, rows, d, eps is not None, eps or 0.0,
                                        None if w is None else w.ctypes.data,
                                        0 if rope is None else 2 if inverse else 1,
                                        None if cos is None else cos.ctypes.data,
                                        None if sin is None else sin.ctypes.data, n_rot, per_pos, qat,
                                        float(np.float32(1.0 / np.sqrt(d))), fp8, f16, _carry().ctypes.data,
                                        _threads(rows * d * 8)), "row_finish")
    return mx.array(y.reshape(x.shape))


def attention(q: mx.array, keys: mx.array, comp: mx.array | None, mask: mx.array, sinks: mx.array) -> mx.array:
    """`attention.attend` of "float" numerics (`kernels/cpu/attention.c`): q [T, H, D] over the
    rows of keys [n_raw, D] then comp [n_comp, D] that mask [T, n_raw + n_comp] shows, a sink
    logit per head (sinks [H]) in the denominator. Returns the heads [T, H, D] (not yet
    inverse-rotated)."""
    if q.ndim != 3 or keys.ndim != 2:
        raise ValueError(f"attention: q {q.shape} and keys {keys.shape} must be [T, H, D] and [N, D]")
    t, n_head, d = q.shape
    n_raw, n_comp = keys.shape[0], 0 if comp is None else comp.shape[0]
    if keys.shape[1:] != (d,) or (comp is not None and comp.shape[1:] != (d,)) or \
            mask.shape != (t, n_raw + n_comp) or sinks.shape != (n_head,):
        raise ValueError(f"attention inputs q {q.shape}, keys {keys.shape}, compressed "
                         f"{None if comp is None else comp.shape}, mask {mask.shape}, sinks {sinks.shape} "
                         "do not fit together")
    qs, ks, sk = _floats(q), _floats(keys), _floats(sinks)
    cs = None if comp is None else _floats(comp)
    visible = np.ascontiguousarray(np.asarray(mask), dtype=np.uint8)
    out = np.empty((t, n_head, d), np.float32)
    if t:
        _check(_lib().ds4lab_attention(qs.ctypes.data, ks.ctypes.data, None if cs is None else cs.ctypes.data,
                                       visible.ctypes.data, sk.ctypes.data, t, n_head, d, n_raw, n_comp,
                                       float(np.float32(1.0 / np.sqrt(d))), out.ctypes.data,
                                       _threads(2 * t * n_head * (n_raw + n_comp) * d)), "attention")
    return mx.array(out)
