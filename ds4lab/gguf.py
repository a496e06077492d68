"""Open, validate and describe ds4 GGUF files without reading their tensor data.

The real files are 81 GiB (q2) and 153 GiB (q4), so `open` only parses the header and
memory-maps the rest: a tensor's bytes are touched when somebody asks for them. The header
walk is our own rather than `gguf.GGUFReader`'s, for two reasons. gguf-py builds a numpy
view per array item and needs about 7 s for the 129,280 tokens and 127,741 merges of the
tokenizer (the walk below takes a fraction of a second); and a damaged or hostile header
must end in a clear error naming the field and its byte offset, never in a loop or an
allocation sized by a count the file made up. Every count is checked against the bytes
that remain before anything is read. gguf-py stays the reference: its constants name the
types, `ModelFile.reader` hands out its reader, and the tests check that both agree on
every tensor's offset, type and shape.
"""

from __future__ import annotations

import builtins
import mmap
import os
import struct
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from .atomic import atomic_open
from .config import ARCH, ModelConfig
from .errors import ModelFileError
from .layout import COMPONENTS, VARIANT_TYPES, main_tensors, mtp_tensors
from .quants.formats import FORMATS, tensor_bytes

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types: id -> (name, struct format for scalars).
_VALUE_TYPES: dict[int, tuple[str, str | None]] = {
    0: ("UINT8", "<B"), 1: ("INT8", "<b"), 2: ("UINT16", "<H"), 3: ("INT16", "<h"),
    4: ("UINT32", "<I"), 5: ("INT32", "<i"), 6: ("FLOAT32", "<f"), 7: ("BOOL", "<?"),
    8: ("STRING", None), 9: ("ARRAY", None), 10: ("UINT64", "<Q"), 11: ("INT64", "<q"),
    12: ("FLOAT64", "<d"),
}
_MAX_STRING = 1 << 24
_MAX_DIMS = 4

_TYPE_BY_ID = {fmt.ggml_type: name for name, fmt in FORMATS.items()}


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives in the file and what it holds."""

    name: str
    type_name: str
    dims: tuple[int, ...]
    offset: int
    n_bytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy (row-major) shape: GGUF dims reversed."""
        return tuple(reversed(self.dims))

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.dims, dtype=np.int64))


@dataclass
class GGUFHeader:
    version: int
    alignment: int
    metadata: dict[str, Any]
    value_types: dict[str, str]         # GGUF type names, arrays as 'ARRAY[INT32]' (write_gguf's spelling)
    tensors: dict[str, TensorInfo]
    data_offset: int
    file_size: int


class _Cursor:
    """Bounds-checked little-endian reads from a mapped file; every failure names field and offset."""

    def __init__(self, buf: mmap.mmap | bytes, path: str) -> None:
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)

    def fail(self, what: str, at: int | None = None) -> ModelFileError:
        return ModelFileError(self.path, what, offset=self.pos if at is None else at)

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"{what}: needs {n} bytes but only {self.size - self.pos} remain "
                            f"(file truncated or corrupt)")

    def scalar(self, fmt: str, what: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n, what)
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += n
        return value

    def string(self, what: str) -> str:
        start = self.pos
        n = self.scalar("<Q", f"{what} (string length)")
        if n > _MAX_STRING:
            raise self.fail(f"{what}: string length {n} exceeds {_MAX_STRING}", start)
        self.need(n, what)
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(f"{what}: not valid UTF-8 ({exc.reason})", start) from None

    def value(self, vtype: int, what: str) -> Any:
        name, fmt = _VALUE_TYPES.get(vtype, ("?", None))
        if name == "?":
            raise self.fail(f"{what}: unknown value type {vtype}")
        if fmt is not None:
            return self.scalar(fmt, what)
        if name == "STRING":
            return self.string(what)
        start = self.pos
        etype = self.scalar("<I", f"{what} (array element type)")
        count = self.scalar("<Q", f"{what} (array length)")
        ename, efmt = _VALUE_TYPES.get(etype, ("?", None))
        if ename in ("?", "ARRAY"):
            raise self.fail(f"{what}: unsupported array element type {etype}", start)
        min_size = struct.calcsize(efmt) if efmt else 8
        if count * min_size > self.size - self.pos:
            raise self.fail(f"{what}: array of {count} {ename} cannot fit in the {self.size - self.pos} "
                            f"bytes that remain", start)
        if efmt is None:
            return [self.string(f"{what}[{i}]") for i in range(count)]
        n = count * struct.calcsize(efmt)
        values = np.frombuffer(self.buf, dtype=np.dtype(efmt), count=count, offset=self.pos)
        self.pos += n
        return values.tolist()


def read_header(path: str | os.PathLike[str]) -> GGUFHeader:
    """Parse a GGUF v3 header: metadata, tensor table and data offset; read no tensor data."""
    path = str(path)
    try:
        with builtins.open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size < 24:
                raise ModelFileError(path, f"not a GGUF file: {size} bytes, shorter than a GGUF header", 0)
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _walk_header(_Cursor(buf, path))
    except OSError as exc:
        raise ModelFileError(path, f"cannot read file: {exc.strerror or exc}") from None


def _walk_header(cur: _Cursor) -> GGUFHeader:
    path = cur.path
    if cur.buf[:4] != GGUF_MAGIC:
        raise ModelFileError(path, f"not a GGUF file: magic {bytes(cur.buf[:4])!r}, expected b'GGUF'", 0)
    cur.pos = 4
    version = cur.scalar("<I", "header.version")
    if version != 3:
        raise ModelFileError(path, f"header.version: expected GGUF version 3, found {version}", 4)
    n_tensors = cur.scalar("<Q", "header.tensor_count")
    n_kv = cur.scalar("<Q", "header.kv_count")
    # A key/value pair needs at least 12 bytes and a tensor entry at least 28.
    if n_kv * 12 + n_tensors * 28 > cur.size - cur.pos:
        raise ModelFileError(path, f"header: {n_kv} keys and {n_tensors} tensors cannot fit in a file of "
                                   f"{cur.size} bytes", 8)

    metadata: dict[str, Any] = {}
    value_types: dict[str, str] = {}
    for i in range(n_kv):
        key_at = cur.pos
        key = cur.string(f"metadata key #{i}")
        vtype = cur.scalar("<I", f"metadata {key} (value type)")
        if key in metadata:
            raise ModelFileError(path, f"metadata {key}: duplicate key", key_at)
        value_at = cur.pos
        metadata[key] = cur.value(vtype, f"metadata {key}")
        type_name = _VALUE_TYPES[vtype][0]
        if type_name == "ARRAY":    # named with its element type, as write_gguf takes it back
            type_name = f"ARRAY[{_VALUE_TYPES[struct.unpack_from('<I', cur.buf, value_at)[0]][0]}]"
        value_types[key] = type_name

    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ModelFileError(path, f"metadata general.alignment: expected a power of two, found {alignment!r}")

    entries = []
    for i in range(n_tensors):
        at = cur.pos
        name = cur.string(f"tensor #{i} name")
        n_dims = cur.scalar("<I", f"tensor {name} (n_dims)")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise ModelFileError(path, f"tensor {name}: {n_dims} dims, expected 1..{_MAX_DIMS}", at)
        dims = tuple(cur.scalar("<Q", f"tensor {name} (dim {d})") for d in range(n_dims))
        type_id = cur.scalar("<I", f"tensor {name} (type)")
        rel = cur.scalar("<Q", f"tensor {name} (data offset)")
        entries.append((at, name, dims, type_id, rel))

    data_offset = -(-cur.pos // alignment) * alignment
    tensors: dict[str, TensorInfo] = {}
    for at, name, dims, type_id, rel in entries:
        type_name = _TYPE_BY_ID.get(type_id)
        if type_name is None:
            raise ModelFileError(path, f"tensor {name}: GGML type {type_id} is not one ds4 files use", at)
        block_elems = FORMATS[type_name].block_elems
        if any(d == 0 or d > 1 << 40 for d in dims) or dims[0] % block_elems:
            raise ModelFileError(path, f"tensor {name}: dims {dims} invalid for {type_name} "
                                       f"(first dim must be a positive multiple of {block_elems})", at)
        n_bytes = tensor_bytes(type_name, dims[::-1])
        start = data_offset + rel
        if rel % alignment:
            raise ModelFileError(path, f"tensor {name}: data offset {rel} is not aligned to {alignment}", at)
        if start + n_bytes > cur.size:
            raise ModelFileError(path, f"tensor {name}: data [{start}, {start + n_bytes}) runs past the end of "
                                       f"the file ({cur.size} bytes): file truncated", start)
        if name in tensors:
            raise ModelFileError(path, f"tensor {name}: duplicate name", at)
        tensors[name] = TensorInfo(name, type_name, dims, start, n_bytes)
    return GGUFHeader(version, alignment, metadata, value_types, tensors, data_offset, cur.size)


class ModelFile:
    """A ds4 GGUF, header parsed and data memory-mapped: `config`, `tensors`, `raw`, `dequantize`."""

    def __init__(self, path: str | os.PathLike[str], header: GGUFHeader, config: ModelConfig) -> None:
        self.path = Path(path)
        self.header = header
        self.config = config
        self.metadata = header.metadata
        self.tensors = header.tensors

    @cached_property
    def _map(self) -> np.memmap:
        return np.memmap(self.path, dtype=np.uint8, mode="r")

    @cached_property
    def reader(self) -> Any:
        """gguf-py's own reader of this file (slow on the tokenizer arrays; for cross-checks)."""
        import gguf

        return gguf.GGUFReader(self.path)

    @property
    def kind(self) -> str:
        """'main', 'mtp' (an MTP-only file) or 'main+mtp'."""
        has_main = "token_embd.weight" in self.tensors
        has_mtp = any(name.startswith("mtp.0.") for name in self.tensors)
        return "main+mtp" if has_main and has_mtp else ("mtp" if has_mtp else "main")

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelFileError(self.path, f"tensor {name}: not in this file") from None

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view of the mapping (nothing is copied)."""
        info = self.tensor(name)
        return self._map[info.offset:info.offset + info.n_bytes]

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor as float32 (I32 tables as int32) in numpy shape: the same values as gguf-py."""
        from .quants import dequantize

        info = self.tensor(name)
        return dequantize(self.raw(name), info.type_name, info.shape)

    # ---- the quantization variant ---------------------------------------------------
    def routed_types(self) -> list[tuple[str, str, str]]:
        """(gate, up, down) types of the routed experts, one entry per block (MTP last)."""
        prefixes = [f"blk.{i}" for i in range(self.config.n_layer)] if self.kind != "mtp" else []
        if self.kind != "main":
            prefixes.append("mtp.0")
        return [tuple(self.tensors[f"{p}.ffn_{r}_exps.weight"].type_name for r in ("gate", "up", "down"))
                for p in prefixes]

    def layer_variants(self) -> list[str]:
        """'q2' (IQ2_XXS gate/up, Q2_K down), 'q4' (Q4_K) or 'gate/down' types, per block."""
        return [_variant_of(t) for t in self.routed_types()]

    @property
    def variant(self) -> str:
        """'q2', 'q4', 'mixed' when blocks differ, or the one non-standard combination."""
        kinds = set(self.layer_variants())
        return kinds.pop() if len(kinds) == 1 else "mixed"

    # ---- tables ----------------------------------------------------------------------
    def tensor_table(self) -> Any:
        """One row per tensor: name, layer, component, type, dims (GGUF order), elements, bytes."""
        import pandas as pd

        component = {s.name: s.component for s in _specs_for(self.config, self.kind)}
        rows = [{
            "name": t.name,
            "layer": _layer_of(t.name),
            "component": component.get(t.name, "other"),
            "type": t.type_name,
            "dims": "x".join(str(d) for d in t.dims),
            "n_elements": t.n_elements,
            "bytes": t.n_bytes,
            "offset": t.offset,
        } for t in self.tensors.values()]
        df = pd.DataFrame(rows)
        df["layer"] = df["layer"].astype("Int64")
        df["component"] = pd.Categorical(df["component"], categories=[*COMPONENTS, "other"])
        return df

    def component_bytes(self) -> Any:
        """Bytes per component (embedding, attention, ..., routed experts, output)."""
        table = self.tensor_table()
        out = table.groupby("component", observed=True)["bytes"].sum().reset_index()
        out["GiB"] = out["bytes"] / 2**30
        out["share"] = out["bytes"] / out["bytes"].sum()
        return out

    def summary(self) -> dict[str, Any]:
        """What `ds4lab info --json` prints."""
        return {
            "file": str(self.path),
            "file_bytes": self.header.file_size,
            "kind": self.kind,
            "variant": self.variant,
            "shape": self.config.shape_name,
            "config": self.config.to_json(),
            "tensors": self.tensor_table().astype({"layer": object, "component": str})
            .replace({np.nan: None}).to_dict(orient="records"),
            "components": {r["component"]: int(r["bytes"]) for r in self.component_bytes().to_dict("records")},
        }


def _variant_of(types: tuple[str, str, str]) -> str:
    gate, _, down = types
    named = {pair: name for name, pair in VARIANT_TYPES.items()}
    return named.get((gate, down), f"{gate}/{down}")


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "blk" and parts[1].isdigit() else None


def _specs_for(cfg: ModelConfig, kind: str) -> list:
    specs = main_tensors(cfg) if kind != "mtp" else []
    return specs + (mtp_tensors(cfg) if kind != "main" else [])


def inventory_problems(cfg: ModelConfig, tensors: dict[str, TensorInfo], kind: str) -> list[str]:
    """Every difference between a file's tensors and the layout `cfg` implies, as ds4.c checks it."""
    problems: list[str] = []
    specs = _specs_for(cfg, kind)
    expected = {s.name for s in specs}
    for spec in specs:
        info = tensors.get(spec.name)
        if info is None:
            if spec.required:
                problems.append(f"tensor {spec.name}: missing (expected {'/'.join(spec.types)} "
                                f"with dims {spec.dims})")
            continue
        if info.type_name not in spec.types:
            problems.append(f"tensor {spec.name}: type {info.type_name}, expected {' or '.join(spec.types)}")
        if info.dims != spec.dims:
            problems.append(f"tensor {spec.name}: dims {info.dims}, expected {spec.dims}")
    for prefix in {s.name.rsplit(".", 2)[0] for s in specs if s.role == "ffn_gate_exps.weight"}:
        gate, up = (tensors.get(f"{prefix}.ffn_{r}_exps.weight") for r in ("gate", "up"))
        if gate and up and gate.type_name != up.type_name:
            problems.append(f"tensors {prefix}.ffn_gate/up_exps.weight: gate is {gate.type_name} but up is "
                            f"{up.type_name}; ds4 needs one type for both")
    for name in tensors:
        if name in expected:
            continue
        layer = _layer_of(name)
        if layer is not None and layer < cfg.n_layer:
            problems.append(f"tensor {name}: not expected in layer {layer} (compress ratio "
                            f"{cfg.compress_ratios[layer]}, hash routing {layer < cfg.n_hash_layer})")
        else:
            problems.append(f"tensor {name}: not part of the DeepSeek V4 layout")
    return problems


def open(path: str | os.PathLike[str], config: ModelConfig | None = None) -> ModelFile:
    """Open a ds4 GGUF (main model, MTP file, or both in one), validate it, and return a ModelFile.

    `config` is only needed for an MTP file that carries no `deepseek4.*` metadata: pass the
    main model's config. Every problem found is reported at once in one ModelFileError.
    """
    header = read_header(path)
    meta = header.metadata
    has_arch_keys = any(k.startswith(f"{ARCH}.") for k in meta)
    if not has_arch_keys and config is None:
        raise ModelFileError(path, f"general.architecture: expected '{ARCH}' with {ARCH}.* keys, found "
                                   f"{meta.get('general.architecture')!r} and no {ARCH}.* metadata")
    problems: list[str] = []
    if has_arch_keys and meta.get("general.architecture") != ARCH:
        problems.append(f"general.architecture: expected '{ARCH}', found {meta.get('general.architecture')!r}")
    if has_arch_keys:
        cfg = ModelConfig.from_metadata(meta, source=str(path))
    else:
        assert config is not None
        cfg = config
    model = ModelFile(path, header, cfg)
    problems += inventory_problems(cfg, header.tensors, model.kind)
    if model.kind != "mtp":
        problems += _tokenizer_problems(meta, cfg)
    if problems:
        raise ModelFileError(path, problems)
    return model


def _tokenizer_problems(meta: dict[str, Any], cfg: ModelConfig) -> list[str]:
    """The BPE vocabulary ds4 needs: one token string per id, and the merge list."""
    problems = []
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or len(tokens) != cfg.n_vocab:
        found = f"{len(tokens)} entries" if isinstance(tokens, list) else repr(tokens)[:40]
        problems.append(f"tokenizer.ggml.tokens: expected {cfg.n_vocab} strings, found {found}")
    if not isinstance(meta.get("tokenizer.ggml.merges"), list):
        problems.append("tokenizer.ggml.merges: required string array is missing")
    return problems


# ---- writing ---------------------------------------------------------------------------
_VALUE_TYPE_IDS = {name: tid for tid, (name, _) in _VALUE_TYPES.items()}


@dataclass(frozen=True)
class TensorOut:
    """A tensor to write: its data comes from `produce()` only when the writer reaches it."""

    name: str
    type_name: str
    dims: tuple[int, ...]
    produce: Any

    @property
    def n_bytes(self) -> int:
        return tensor_bytes(self.type_name, self.dims[::-1])


def _pack_value(vtype: str, value: Any) -> bytes:
    if vtype == "STRING":
        raw = value.encode("utf-8")
        return struct.pack("<Q", len(raw)) + raw
    if vtype.startswith("ARRAY["):
        etype = vtype[6:-1]
        head = struct.pack("<IQ", _VALUE_TYPE_IDS[etype], len(value))
        if etype == "STRING":
            return head + b"".join(_pack_value("STRING", v) for v in value)
        fmt = _VALUE_TYPES[_VALUE_TYPE_IDS[etype]][1]
        return head + np.asarray(value, dtype=np.dtype(fmt)).tobytes()
    return struct.pack(_VALUE_TYPES[_VALUE_TYPE_IDS[vtype]][1], value)


def write_gguf(path: str | os.PathLike[str], metadata: list[tuple[str, str, Any]],
               tensors: list[TensorOut], alignment: int = DEFAULT_ALIGNMENT) -> Path:
    """Write a GGUF v3 file atomically (temp file, then rename), one tensor in memory at a time.

    `metadata` is a list of (key, value type, value) with types named as in GGUF
    ('UINT32', 'FLOAT32', 'STRING', 'ARRAY[INT32]', ...), written in that order.
    """
    path = Path(path)
    head = bytearray(GGUF_MAGIC + struct.pack("<IQQ", 3, len(tensors), len(metadata)))
    for key, vtype, value in metadata:
        head += _pack_value("STRING", key)
        head += struct.pack("<I", _VALUE_TYPE_IDS[vtype.split("[")[0]])
        head += _pack_value(vtype, value)
    offsets, offset = [], 0
    for t in tensors:
        offsets.append(offset)
        offset += -(-t.n_bytes // alignment) * alignment
    for t, rel in zip(tensors, offsets, strict=False):
        head += _pack_value("STRING", t.name) + struct.pack("<I", len(t.dims))
        head += struct.pack(f"<{len(t.dims)}Q", *t.dims)
        head += struct.pack("<IQ", FORMATS[t.type_name].ggml_type, rel)
    head += bytes(-len(head) % alignment)

    with atomic_open(path) as fh:
        fh.write(head)
        for t in tensors:
            data = np.ascontiguousarray(t.produce()).view(np.uint8).reshape(-1)
            if data.size != t.n_bytes:
                raise ValueError(f"{path}: tensor {t.name} produced {data.size} bytes, expected {t.n_bytes}")
            fh.write(data.data)
            fh.write(bytes(-t.n_bytes % alignment))
    return path
