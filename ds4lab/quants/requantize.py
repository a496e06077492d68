"""Requantize a ds4 GGUF with a per-layer, per-tensor recipe, optionally weighted by an imatrix.

A recipe says which type each tensor becomes:

- a preset: `"q2"` (routed gate/up IQ2_XXS, down Q2_K), `"q4"` (routed experts Q4_K), or
  `"mixed:37-42"` (q2 with the routed experts of the listed layers Q4_K, the file ds4's
  splice tool makes from a q2 and a q4 file);
- a dict of tensor name patterns to types (`{"blk.3.ffn_down_exps.weight": "Q4_K",
  "blk.*.ffn_gate_exps.weight": "Q2_K"}`): exact names, prefixes or shell globs, first
  match wins, as ds4's `--tensor-type NAME_OR_PREFIX=TYPE` does;
- a function `(name, layer, current_type) -> type or None` (None keeps the type).

Tensors not named keep their type and bytes. A tensor that changes type is decoded to
float32 and re-encoded; a routed-expert tensor one expert at a time with that expert's
imatrix slice. As in ds4's converter, Q2_K and Q4_K without an imatrix use ggml's unweighted
algorithms and IQ2_XXS falls back to column energy, and the output drops the source's
`quantize.imatrix.*` keys and records the imatrix used. ds4.c hard-checks every tensor's
type (only the routed experts may vary, gate and up of a layer alike), so the plan is
checked against the layout validator before a byte is written.
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pandas as pd

from .. import gguf
from ..config import ModelConfig
from ..errors import ModelFileError
from ..layout import VARIANT_TYPES
from .formats import FORMATS, row_bytes, tensor_bytes
from .imatrix import Imatrix
from .imatrix import load as load_imatrix
from .numpy_decode import dequantize
from .quantize import QUANTIZABLE, quantize, usable_cpus

RecipeFn = Callable[[str, "int | None", str], "str | None"]
Recipe = str | Mapping[str, str] | RecipeFn

_EXPERT_TENSOR = re.compile(r"^(?:blk\.(\d+)|mtp\.0)\.ffn_(gate|up|down)_exps\.weight$")
_PLAIN_TARGETS = ("F32", "F16")


def parse_layers(text: str) -> set[int]:
    """`"37-42"` or `"0-2,40-42"` -> the set of layer indices; ValueError naming the bad part."""
    layers: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, _, last = part.partition("-")
        last = last or first
        if not (first.strip().isdigit() and last.strip().isdigit()) or int(last) < int(first):
            raise ValueError(f"layer list {text!r}: {part!r} is not N or N-M with N <= M")
        layers.update(range(int(first), int(last) + 1))
    return layers


def routed(gate_up: str, down: str, layers: set[int] | None = None) -> RecipeFn:
    """A recipe setting the routed experts (of `layers`, or of every block) to these types."""
    def recipe(name: str, layer: int | None, current: str) -> str | None:
        match = _EXPERT_TENSOR.match(name)
        if match is None or (layers is not None and layer not in layers):
            return None
        return down if match.group(2) == "down" else gate_up
    return recipe


def mixed(q4_layers: set[int]) -> RecipeFn:
    """q2 everywhere except the routed experts of `q4_layers`, which are Q4_K."""
    q2, q4 = routed(*VARIANT_TYPES["q2"]), routed(*VARIANT_TYPES["q4"], layers=q4_layers)
    return lambda name, layer, current: q4(name, layer, current) or q2(name, layer, current)


def resolve(recipe: Recipe) -> RecipeFn:
    """Any recipe form as a function `(name, layer, current_type) -> type or None`."""
    if callable(recipe):
        return recipe
    if isinstance(recipe, str):
        if recipe in VARIANT_TYPES:
            return routed(*VARIANT_TYPES[recipe])
        if recipe.startswith("mixed:"):
            return mixed(parse_layers(recipe[len("mixed:"):]))
        raise ValueError(f"unknown recipe {recipe!r}: expected {', '.join(VARIANT_TYPES)} or mixed:LAYERS "
                         f"(e.g. mixed:37-42)")
    rules = list(recipe.items())

    def by_name(name: str, layer: int | None, current: str) -> str | None:
        return next((t for pattern, t in rules
                     if name == pattern or name.startswith(pattern) or fnmatch.fnmatchcase(name, pattern)), None)
    return by_name


def combine(*recipes: Recipe) -> RecipeFn:
    """One recipe from several: each tensor takes the first type any of them names."""
    chosen = [resolve(r) for r in recipes]
    return lambda name, layer, current: next(
        (t for t in (fn(name, layer, current) for fn in chosen) if t is not None), None)


def _layer(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "blk" and parts[1].isdigit() else None


def plan(model_file: gguf.ModelFile, recipe: Recipe) -> pd.DataFrame:
    """One row per tensor: its `type` and bytes now, its `target` type and bytes after the recipe
    (a dry run)."""
    choose = resolve(recipe)
    rows = []
    for info in model_file.tensors.values():
        layer = _layer(info.name)
        target = choose(info.name, layer, info.type_name) or info.type_name
        if target not in FORMATS:
            raise ValueError(f"recipe: tensor {info.name} -> unknown type {target!r}")
        rows.append({"name": info.name, "layer": layer, "type": info.type_name, "target": target,
                     "dims": info.dims, "bytes": info.n_bytes, "target_bytes": tensor_bytes(target, info.dims[::-1])})
    df = pd.DataFrame(rows)
    df["layer"] = df["layer"].astype("Int64")
    return df


def _check(model_file: gguf.ModelFile, table: pd.DataFrame, out: Path) -> None:
    """Refuse a plan ds4.c would reject, or one with a conversion ds4lab cannot do."""
    planned = {r.name: gguf.TensorInfo(r.name, r.target, r.dims, 0, r.target_bytes) for r in table.itertuples()}
    problems = gguf.inventory_problems(model_file.config, planned, model_file.kind)
    for r in table[table["type"] != table["target"]].itertuples():
        if r.target not in (*QUANTIZABLE, *_PLAIN_TARGETS) or r.type == "I32" \
                or r.dims[0] % FORMATS[r.target].block_elems:
            problems.append(f"tensor {r.name}: cannot convert {r.type} to {r.target}")
    if problems:
        raise ModelFileError(out, ["the recipe makes a file ds4 would not load:", *problems])


def _encode(values: np.ndarray, type_name: str, importance: np.ndarray | None) -> np.ndarray:
    """A float32 [rows, cols] matrix as `type_name` bytes."""
    if type_name in _PLAIN_TARGETS:
        return values.astype(np.float16 if type_name == "F16" else np.float32).view(np.uint8).reshape(-1)
    return np.frombuffer(quantize(values, type_name, importance), np.uint8)


def expert_bytes(model_file: gguf.ModelFile, name: str, expert: int) -> np.ndarray:
    """The raw bytes of one expert's matrix in a routed-expert tensor (a view of the file)."""
    info = model_file.tensor(name)
    _, rows, cols = info.shape
    size = rows * row_bytes(info.type_name, cols)
    return model_file.raw(name)[expert * size:(expert + 1) * size]


def expert_matrix(model_file: gguf.ModelFile, name: str, expert: int) -> np.ndarray:
    """One expert's matrix of a routed-expert tensor, float32 [rows, cols], decoding only its bytes."""
    info = model_file.tensor(name)
    return dequantize(expert_bytes(model_file, name, expert), info.type_name, info.shape[1:])


def convert_tensor(model_file: gguf.ModelFile, name: str, target: str, imatrix: Imatrix | None = None,
                   threads: int | None = None) -> np.ndarray:
    """The bytes of tensor `name` re-encoded as `target` (copied when the type is unchanged).
    An expert tensor is converted expert by expert (in `threads` threads), each weighted by
    its own imatrix slice; other tensors by their imatrix entry, if any."""
    info = model_file.tensor(name)
    raw = model_file.raw(name)
    if info.type_name == target:
        return raw
    shape = info.shape
    rows, cols = int(np.prod(shape[:-1], dtype=np.int64)), shape[-1]
    if not _EXPERT_TENSOR.match(name):
        matrix = dequantize(raw, info.type_name, (rows, cols))
        importance = imatrix.importance(name, cols) if imatrix is not None else None
        return _encode(matrix, target, importance)
    n_expert = shape[0]

    def one(expert: int) -> np.ndarray:
        importance = None if imatrix is None else imatrix.importance(name, cols, expert, n_expert)
        return _encode(expert_matrix(model_file, name, expert), target, importance)

    # The quantizers spend their time in numpy kernels, which release the GIL.
    with ThreadPoolExecutor(max_workers=threads or usable_cpus()) as pool:
        return np.concatenate(list(pool.map(one, range(n_expert))))


def _metadata(model_file: gguf.ModelFile, imatrix: Imatrix | None,
              imatrix_file: str | None) -> list[tuple[str, str, object]]:
    header = model_file.header
    kv = [(k, header.value_types[k], v) for k, v in header.metadata.items() if not k.startswith("quantize.imatrix.")]
    if imatrix is not None:
        # ds4's converter writes these provenance keys (counts as u64).
        if imatrix_file:
            kv.append(("quantize.imatrix.file", "STRING", imatrix_file))
        kv.append(("quantize.imatrix.entries_count", "UINT64", len(imatrix.entries)))
        if imatrix.datasets:
            kv.append(("quantize.imatrix.dataset", "STRING", imatrix.datasets[-1]))
        if imatrix.chunks > 0:
            kv.append(("quantize.imatrix.chunks_count", "UINT64", imatrix.chunks))
    return kv


def requantize(src: str | os.PathLike[str], out: str | os.PathLike[str], recipe: Recipe,
               imatrix: Imatrix | str | os.PathLike[str] | None = None, threads: int | None = None,
               progress: Callable[[str, str, str], None] | None = None,
               config: ModelConfig | None = None) -> Path:
    """Write `src` with `recipe`'s tensor types to `out` (atomically) and return its path.

    `imatrix` (an Imatrix or a .dat/.gguf path) weights the quantizers; `progress(name,
    from, to)` is called as each tensor is written; `config` is for an MTP-only file (see
    `gguf.open`). Raises ModelFileError, before writing, if ds4 would reject the result."""
    model_file = gguf.open(src, config=config)
    out = Path(out)
    imatrix_file = None
    if imatrix is not None and not isinstance(imatrix, Imatrix):
        imatrix_file = str(imatrix)
        imatrix = load_imatrix(imatrix, n_expert=model_file.config.n_expert)
    table = plan(model_file, recipe)
    _check(model_file, table, out)

    def produce(name: str, source: str, target: str) -> np.ndarray:
        data = convert_tensor(model_file, name, target, imatrix, threads)
        if progress is not None:
            progress(name, source, target)
        return data

    tensors = [gguf.TensorOut(r.name, r.target, r.dims, lambda r=r: produce(r.name, r.type, r.target))
               for r in table.itertuples()]
    return gguf.write_gguf(out, _metadata(model_file, imatrix, imatrix_file), tensors,
                           alignment=model_file.header.alignment)
