"""Importance matrices of the routed experts, collected as ds4 collects them, in both file layouts.

What ds4 measures (`ds4 --imatrix-dataset`, ds4.c's imatrix collector): for every layer and
every routed expert, over the tokens that chose that expert,

- gate and up: the mean of the squared FFN-normed input x² (one value per input column);
- down: the mean of the squared route-weighted SwiGLU activation (w·swiglu)², the down
  projection's input,

with how many (token, expert) routes were summed. Shared experts, attention and the router
are not measured. Here the statistics come from the hook points `blocks.N.ffn.hook_in`,
`ffn.hook_experts` and `ffn.hook_routed_mid`, so whatever numerics the model runs with is
what gets measured, and other hooks (forced experts, ablations) shape what is collected.

Two file layouts:

- llama.cpp's legacy `.dat`, the one ds4 writes and its quantizer reads: one entry per routed
  tensor (GGUF tensor name, gate, up, down per layer), `ncall = 1`, the per-expert means
  packed expert-major (`n_expert * n_cols` floats), an expert never routed written as all
  1.0, then a chunk count and the dataset path. Call counts per expert are not kept.
- llama.cpp's GGUF imatrix (`general.type = imatrix`): per tensor `<name>.in_sum2`, the raw
  sums [n_expert, n_cols], and `<name>.counts` [n_expert, 1], so nothing is lost.

Each forward chunk's sums are taken in float32 (one matrix product per layer) and added into
float64 totals; ds4 accumulates in float32 throughout, a difference far below what the
quantizers can resolve.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pandas as pd

from ..atomic import atomic_open
from ..errors import FileFormatError
from ..gguf import GGUF_MAGIC, TensorOut, read_header, write_gguf

# The value ds4 writes for an expert no token chose (so it quantizes as if unweighted).
UNROUTED_VALUE = 1.0
PROMPT_MARKER = "===== DS4_IMATRIX_PROMPT"
ROLES = ("gate", "up", "down")
_MAX_NAME = 4096


class ImatrixFileError(FileFormatError):
    """An imatrix file (.dat or GGUF) that cannot be read, or that does not fit a tensor."""


@dataclass
class ImatrixEntry:
    """One tensor's statistics: per matrix (expert), the column sums of squared inputs and
    how many input rows were summed."""

    sum2: np.ndarray     # float64 [n_mat, n_cols]
    counts: np.ndarray   # int64 [n_mat]

    def means(self) -> np.ndarray:
        """Mean squared input per column, float32 [n_mat, n_cols]; ds4's 1.0 for a matrix never used."""
        counts = self.counts[:, None]
        mean = self.sum2 / np.maximum(counts, 1)
        return np.where(counts > 0, mean, UNROUTED_VALUE).astype(np.float32)

    def flat_means(self, start: int, stop: int) -> np.ndarray:
        """``means().reshape(-1)[start:stop]``, computing only the matrices that range touches."""
        width = self.sum2.shape[1]
        first, last = start // width, -(-stop // width)
        part = ImatrixEntry(self.sum2[first:last], self.counts[first:last]).means().reshape(-1)
        return part[start - first * width:stop - first * width]


@dataclass
class Imatrix:
    """Routed-expert importance statistics by GGUF tensor name (`blk.N.ffn_gate_exps.weight`, ...)."""

    entries: dict[str, ImatrixEntry]
    chunks: int = 0                  # ds4 counts one per layer per prefill batch
    chunk_size: int = 0              # the longest batch run (the GGUF layout's imatrix.chunk_size)
    datasets: list[str] = field(default_factory=list)

    def importance(self, name: str, n_cols: int, expert: int | None = None,
                   n_expert: int | None = None) -> np.ndarray | None:
        """The per-column importance for `name` (one expert's slice for an expert tensor), as
        ds4's quantizer finds it: `<name>.expert.<id>`, `<name>.expert_<id>`, then `<name>`
        itself, shared when it has `n_cols` values or sliced when it has `n_cols * n_expert`.
        None when no entry matches; ImatrixFileError when one matches with another size."""
        names = [f"{name}.expert.{expert}", f"{name}.expert_{expert}"] if expert is not None else []
        for candidate in [*names, name]:
            entry = self.entries.get(candidate)
            if entry is None:
                continue
            size = entry.sum2.size
            if size == n_cols:
                return entry.means().reshape(-1)
            if expert is not None and n_expert is not None and size == n_cols * n_expert:
                return entry.flat_means(expert * n_cols, (expert + 1) * n_cols)
            raise ImatrixFileError(candidate, f"imatrix entry has {size} values; expected {n_cols}"
                                              + (f" or {n_cols * n_expert}" if n_expert else ""))
        return None

    def to_frame(self) -> pd.DataFrame:
        """One row per (tensor, expert): layer, role, routes counted and the column statistics."""
        rows = []
        for name, entry in self.entries.items():
            layer, role = _layer_role(name)
            means = entry.means()
            for expert in range(len(means)):
                rows.append({"tensor": name, "layer": layer, "role": role, "expert": expert,
                             "count": int(entry.counts[expert]), "mean": float(means[expert].mean()),
                             "max": float(means[expert].max()),
                             # share of the importance held by the top 1% of columns: how peaked it is
                             "top1pct_share": _top_share(means[expert], 0.01)})
        return pd.DataFrame(rows)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the GGUF layout for a `.gguf` path, ds4's legacy `.dat` layout otherwise."""
        path = Path(path)
        return write_gguf_imatrix(self, path) if path.suffix == ".gguf" else write_dat(self, path)


def _layer_role(name: str) -> tuple[int | None, str]:
    parts = name.split(".")
    layer = int(parts[1]) if parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit() else None
    role = next((r for r in ROLES if f"ffn_{r}_exps" in name), name)
    return layer, role


def _top_share(values: np.ndarray, fraction: float) -> float:
    k = max(1, round(fraction * values.size))
    total = float(values.sum())
    return float(np.sort(values)[-k:].sum()) / total if total > 0 else float("nan")


# ---- collection ----------------------------------------------------------------------------
class _Collector:
    """Hook functions that sum one layer's statistics as each forward chunk passes.

    Within a layer the points fire in the order hook_in, hook_experts, hook_routed_mid; the
    first two are held until the third arrives and the layer's sums are taken. The sums stay
    on the device (float32, scatter-adds: no host round trip, so a prefill on the fast path
    keeps running ahead of the host) until `result`."""

    def __init__(self, n_layer: int, n_expert: int, n_embd: int, n_ff: int) -> None:
        self.n_expert = n_expert
        self.gate_up = [mx.zeros((n_expert, n_embd), mx.float32) for _ in range(n_layer)]
        self.down = [mx.zeros((n_expert, n_ff), mx.float32) for _ in range(n_layer)]
        self.counts = [mx.zeros((n_expert,), mx.int32) for _ in range(n_layer)]
        self.chunks = 0
        self.chunk_size = 0
        self._x: dict[int, mx.array] = {}
        self._experts: dict[int, mx.array] = {}

    def on_in(self, act: mx.array, hook: Any) -> None:
        self._x[hook.layer] = act

    def on_experts(self, act: mx.array, hook: Any) -> None:
        self._experts[hook.layer] = act

    def on_mid(self, act: mx.array, hook: Any) -> None:
        layer = hook.layer
        x, experts = self._x.pop(layer), self._experts.pop(layer)
        t, u = experts.shape
        ids = experts.reshape(-1).astype(mx.int32)
        # every (token, slot) route adds its token's x² to its expert, and its mid² (slot's row)
        self.gate_up[layer] = self.gate_up[layer].at[ids].add(mx.repeat(mx.square(x.astype(mx.float32)), u, axis=0))
        self.down[layer] = self.down[layer].at[ids].add(mx.square(act.astype(mx.float32)).reshape(t * u, -1))
        self.counts[layer] = self.counts[layer].at[ids].add(1)
        mx.async_eval(self.gate_up[layer], self.down[layer], self.counts[layer])
        self.chunks += 1
        self.chunk_size = max(self.chunk_size, t)

    def hooks(self) -> list[tuple[Any, Any]]:
        return [(lambda n: n.endswith("ffn.hook_in"), self.on_in),
                (lambda n: n.endswith("ffn.hook_experts"), self.on_experts),
                (lambda n: n.endswith("ffn.hook_routed_mid"), self.on_mid)]

    def result(self, dataset: str) -> Imatrix:
        entries = {}
        for layer in range(len(self.counts)):
            counts = np.array(self.counts[layer]).astype(np.int64)
            for role in ROLES:
                sums = self.down[layer] if role == "down" else self.gate_up[layer]
                entries[f"blk.{layer}.ffn_{role}_exps.weight"] = ImatrixEntry(np.array(sums, np.float64), counts.copy())
        return Imatrix(entries, self.chunks, self.chunk_size, [dataset] if dataset else [])


def collect(model: Any, prompts: Iterable[Sequence[int]], chunk: int = 2048, dataset: str = "",
            progress: bool = False) -> Imatrix:
    """Run each prompt (token ids) from an empty session, `chunk` tokens per forward, and
    return the routed experts' imatrix; `dataset` names the source in the files written.
    `progress` shows a bar over all the prompts' tokens (tokens/s and the time left). The
    points it reads keep the fast path, so on a CUDA GPU it runs at prefill speed."""
    from tqdm.auto import tqdm

    cfg = model.config
    prompts = [list(tokens) for tokens in prompts]
    collector = _Collector(cfg.n_layer, cfg.n_expert, cfg.n_embd, cfg.n_ff_exp)
    with (tqdm(total=sum(map(len, prompts)), unit="tok", desc="imatrix", disable=not progress) as bar,
          model.hooks(collector.hooks())):
        for tokens in prompts:
            if len(tokens):
                model.session().prefill(tokens, chunk=chunk, on_chunk=lambda ids, _: bar.update(len(ids)))
    return collector.result(dataset)


def read_prompts(path: str | os.PathLike[str]) -> list[str]:
    """The prompts of a ds4 imatrix dataset: the blocks after each `===== DS4_IMATRIX_PROMPT`
    line, whitespace-trimmed (text before the first marker is skipped, as ds4 does); a file
    without markers is one prompt."""
    text = Path(path).read_text(encoding="utf-8")
    if PROMPT_MARKER not in text:
        return [text.strip()] if text.strip() else []
    blocks = text.split(PROMPT_MARKER)[1:]
    prompts = [block.split("\n", 1)[1].strip() if "\n" in block else "" for block in blocks]
    return [p for p in prompts if p]


def dataset_tokens(prompts: Iterable[str], tokenizer: Any, ctx: int = 32768, max_tokens: int = 0,
                   max_prompts: int = 0) -> list[list[int]]:
    """Token ids of each prompt as ds4 feeds them: each cut to `ctx`, all together to a
    `max_tokens` budget, at most `max_prompts` prompts (0: no limit)."""
    out: list[list[int]] = []
    used = 0
    for text in prompts:
        ids = list(tokenizer.encode(text))[:ctx]
        if max_tokens > 0:
            ids = ids[:max_tokens - used]
        if ids:
            out.append(ids)
            used += len(ids)
        if (max_prompts and len(out) >= max_prompts) or (max_tokens and used >= max_tokens):
            break
    return out


# ---- files ---------------------------------------------------------------------------------
def write_dat(imatrix: Imatrix, path: str | os.PathLike[str]) -> Path:
    """ds4's legacy `.dat`: entries in order, ncall 1, per-expert means expert-major, then the
    chunk count and the dataset path."""
    path = Path(path)
    with atomic_open(path) as fh:
        fh.write(struct.pack("<i", len(imatrix.entries)))
        for name, entry in imatrix.entries.items():
            raw = name.encode("utf-8")
            values = entry.means().reshape(-1)
            fh.write(struct.pack("<i", len(raw)) + raw + struct.pack("<ii", 1, values.size))
            fh.write(values.astype("<f4").tobytes())
        dataset = (imatrix.datasets[-1] if imatrix.datasets else "").encode("utf-8")
        fh.write(struct.pack("<ii", imatrix.chunks, len(dataset)) + dataset)
    return path


def read_dat(path: str | os.PathLike[str], n_expert: int | None = None) -> Imatrix:
    """Read a legacy `.dat`. Values are divided by their entry's ncall, as ds4's quantizer does.
    With `n_expert`, expert tensors (`*_exps*`) whose size divides by it come back one row per
    expert; everything else is one row. The chunk/dataset trailer is optional."""
    path = str(path)
    buf = Path(path).read_bytes()
    pos = 0

    def take(n: int, what: str) -> bytes:
        nonlocal pos
        if n < 0 or pos + n > len(buf):
            raise ImatrixFileError(path, f"{what}: needs {n} bytes, {len(buf) - pos} remain (truncated?)", pos)
        pos += n
        return buf[pos - n:pos]

    def i32(what: str) -> int:
        return struct.unpack("<i", take(4, what))[0]

    n_entries = i32("entry count")
    if n_entries < 1:
        raise ImatrixFileError(path, f"entry count {n_entries}: an imatrix needs at least one entry", 0)
    entries: dict[str, ImatrixEntry] = {}
    for i in range(n_entries):
        at = pos
        length = i32(f"entry #{i} name length")
        if not 0 < length <= _MAX_NAME:
            raise ImatrixFileError(path, f"entry #{i}: name length {length} outside 1..{_MAX_NAME}", at)
        name = take(length, f"entry #{i} name").decode("utf-8", errors="replace")
        ncall, nval = i32(f"{name} ncall"), i32(f"{name} value count")
        if nval < 1 or nval * 4 > len(buf) - pos:
            raise ImatrixFileError(path, f"{name}: value count {nval} does not fit the file", pos - 4)
        values = np.frombuffer(take(4 * nval, f"{name} values"), "<f4").astype(np.float64)
        if not np.isfinite(values).all():
            raise ImatrixFileError(path, f"{name}: non-finite values", pos - 4 * nval)
        n_mat = n_expert if n_expert and "_exps" in name and nval % n_expert == 0 else 1
        # ncall <= 0 means "not divided" to ds4's loader: treat the values as means.
        entries[name] = ImatrixEntry(values.reshape(n_mat, -1), np.full(n_mat, max(ncall, 1), np.int64))
    chunks, datasets = 0, []
    if pos + 8 <= len(buf):
        chunks, length = i32("chunk count"), i32("dataset length")
        if 0 < length <= len(buf) - pos:
            datasets = [take(length, "dataset").decode("utf-8", errors="replace")]
    return Imatrix(entries, chunks, 0, datasets)


def write_gguf_imatrix(imatrix: Imatrix, path: str | os.PathLike[str]) -> Path:
    """llama.cpp's GGUF imatrix: `<name>.in_sum2` F32 [n_mat, n_cols] (raw sums) and
    `<name>.counts` F32 [n_mat, 1], with `general.type = imatrix` and the imatrix.* keys."""
    metadata = [
        ("general.type", "STRING", "imatrix"),
        ("imatrix.datasets", "ARRAY[STRING]", list(imatrix.datasets)),
        ("imatrix.chunk_count", "UINT32", int(imatrix.chunks)),
        ("imatrix.chunk_size", "UINT32", int(imatrix.chunk_size)),
    ]
    tensors = []
    for name, entry in imatrix.entries.items():
        n_mat, n_cols = entry.sum2.shape
        tensors.append(TensorOut(f"{name}.in_sum2", "F32", (n_cols, n_mat),
                                 lambda e=entry: e.sum2.astype(np.float32)))
        tensors.append(TensorOut(f"{name}.counts", "F32", (1, n_mat),
                                 lambda e=entry: e.counts.astype(np.float32)))
    return write_gguf(path, metadata, tensors)


def read_gguf_imatrix(path: str | os.PathLike[str]) -> Imatrix:
    """Read llama.cpp's GGUF imatrix (the `.in_sum` mean tensors of newer files are ignored)."""
    header = read_header(path)
    data = np.memmap(path, dtype=np.uint8, mode="r")

    def values(name: str) -> np.ndarray:
        info = header.tensors[name]
        if info.type_name != "F32":
            raise ImatrixFileError(str(path), f"tensor {name}: type {info.type_name}, expected F32", info.offset)
        return np.frombuffer(data[info.offset:info.offset + info.n_bytes], "<f4").reshape(info.shape)

    entries: dict[str, ImatrixEntry] = {}
    for tensor in header.tensors:
        if not tensor.endswith(".in_sum2"):
            continue
        name = tensor[:-len(".in_sum2")]
        if f"{name}.counts" not in header.tensors:
            raise ImatrixFileError(str(path), f"tensor {tensor}: no matching {name}.counts")
        sums, counts = values(tensor), values(f"{name}.counts").reshape(-1)
        if not len(counts) or sums.size % len(counts):
            raise ImatrixFileError(str(path), f"tensor {tensor}: {sums.size} values do not divide into "
                                              f"{len(counts)} counts", header.tensors[tensor].offset)
        if not (np.isfinite(sums).all() and np.isfinite(counts).all() and (counts >= 0).all()):
            raise ImatrixFileError(str(path), f"tensor {tensor} or {name}.counts: non-finite or negative values",
                                   header.tensors[tensor].offset)
        entries[name] = ImatrixEntry(sums.reshape(len(counts), -1).astype(np.float64),
                                     np.rint(counts).astype(np.int64))
    meta = header.metadata
    fields = {key: meta.get(f"imatrix.{key}", default)
              for key, default in (("chunk_count", 0), ("chunk_size", 0), ("datasets", []))}
    if not all(isinstance(fields[k], int) for k in ("chunk_count", "chunk_size")) \
            or not (isinstance(fields["datasets"], list) and all(isinstance(d, str) for d in fields["datasets"])):
        raise ImatrixFileError(str(path), "metadata imatrix.chunk_count/chunk_size must be integers and "
                                          "imatrix.datasets an array of strings")
    return Imatrix(entries, fields["chunk_count"], fields["chunk_size"], list(fields["datasets"]))


def load(path: str | os.PathLike[str], n_expert: int | None = None) -> Imatrix:
    """Read an imatrix in either layout (told apart by the GGUF magic); `n_expert` shapes a
    legacy file's expert entries (see `read_dat`)."""
    with open(path, "rb") as fh:
        magic = fh.read(4)
    return read_gguf_imatrix(path) if magic == GGUF_MAGIC else read_dat(path, n_expert)
