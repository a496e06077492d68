"""A whole .kv file: header, cache text, payload (raw or LZ4 envelope) and trailer.

`read` maps the file and parses the header words only; arrays are views of the map, so
opening a large raw checkpoint costs its metadata, and a block is read when it is touched (an
LZ4-envelope payload is decompressed and checked whole when the file is opened).
`write` lays the file out as ds4 does, atomically, 0600 in a 0700 directory (cache files hold
prompts verbatim). Unchanged parts are copied as bytes, so rewriting a ds4 file reproduces it.
"""

from __future__ import annotations

import hashlib
import mmap
import os
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pandas as pd

from ..atomic import atomic_open
from ..errors import KVCFormatError
from . import lz4, payload, trailers
from .header import CODEC_LZ4, CODEC_NONE, PREFIX_BYTES, KVCHeader, parse_header


@dataclass
class KVCFile:
    """One checkpoint. `header.payload_bytes` is the payload as stored on disk; `payload` (and
    `payload_bytes_of`) the payload as ds4's engine reads it, decompressed. A file ds4-agent's
    `/strip` rewrote has no payload (payload_bytes 0: header, text and title only; the agent
    rebuilds the state by prefill): `payload` is None and `stripped` is true."""

    path: Path
    header: KVCHeader
    text: bytes
    payload: payload.Payload | None
    trailer: trailers.Trailer

    # ---- what a researcher reads ------------------------------------------------------
    @property
    def stripped(self) -> bool:
        return self.payload is None

    @property
    def tokens(self) -> np.ndarray:
        return self.payload.tokens if self.payload else np.zeros(0, "<u4")

    @property
    def logits(self) -> np.ndarray:
        return self.payload.logits if self.payload else np.zeros(0, "<f4")

    @property
    def ratios(self) -> tuple[int, ...]:
        return self.payload.ratios if self.payload else ()

    @property
    def n_comp(self) -> list[int]:
        return self.payload.n_comp if self.payload else []

    @property
    def n_index_comp(self) -> list[int]:
        return self.payload.n_index_comp if self.payload else []

    @property
    def payload_header(self) -> dict[str, int]:
        return dict(self.payload.fields) if self.payload else {}

    @property
    def tool_map(self) -> list[tuple[bytes, bytes]]:
        return self.trailer.tool_map

    @property
    def title(self) -> bytes | None:
        return self.trailer.title

    @property
    def text_sha1(self) -> str:
        return hashlib.sha1(self.text).hexdigest()

    @property
    def name_is_text_sha1(self) -> bool:
        return self.path.name.lower() == f"{self.text_sha1}.kv"

    @property
    def mismatches(self) -> list[str]:
        """Where the header and the payload disagree. ds4 loads such a payload, then deletes the
        file as corrupt (a token count that differs) or refuses it (a ctx the runtime lacks)."""
        if self.payload is None:
            return []
        words = self.payload.fields
        pairs = (("tokens", self.header.tokens, words["n_tokens"]), ("ctx_size", self.header.ctx_size, words["ctx"]))
        return [f"header {name} {h} != payload {p}" for name, h, p in pairs if h != p]

    def arrays(self, layer: int) -> dict[str, np.ndarray]:
        """The float blocks of one layer by name (raw_kv, comp_kv, attn_state_kv, ...); read-only views."""
        if self.payload is None:
            raise ValueError(f"{self.path}: a stripped file (payload_bytes 0) holds no KV state")
        if not 0 <= layer < len(self.ratios):
            raise IndexError(f"layer {layer} outside 0..{len(self.ratios) - 1}")
        return self.payload.layer_arrays(layer)

    @property
    def layers(self) -> pd.DataFrame:
        """One row per layer: ratio, row counts, bytes, and row-norm statistics per block kind."""
        rows = []
        for il, ratio in enumerate(self.ratios):
            arrays = self.arrays(il)
            row = {"layer": il, "ratio": ratio, "raw_rows": arrays["raw_kv"].shape[0],
                   "compressed_rows": self.n_comp[il], "indexer_rows": self.n_index_comp[il],
                   "bytes": sum(a.nbytes for a in arrays.values())}
            for key, name in (("raw", "raw_kv"), ("compressed", "comp_kv"), ("indexer", "index_comp_kv")):
                norms = np.linalg.norm(arrays[name], axis=1) if name in arrays and len(arrays[name]) else None
                row[f"{key}_norm_mean"] = float(norms.mean()) if norms is not None else np.nan
                row[f"{key}_norm_max"] = float(norms.max()) if norms is not None else np.nan
            rows.append(row)
        ints = ["layer", "ratio", "raw_rows", "compressed_rows", "indexer_rows", "bytes"]
        frame = pd.DataFrame(rows, columns=[*ints, *(f"{k}_norm_{s}" for k in ("raw", "compressed", "indexer")
                                                     for s in ("mean", "max"))])
        return frame.astype(dict.fromkeys(ints, "int64"))

    def summary(self) -> dict:
        """The JSON `ds4lab kv show` prints: header, payload words, per-layer counts."""
        h = self.header
        return {
            "file": str(self.path),
            "header": {"version": h.version, "quant_bits": h.quant_bits, "reason": h.reason,
                       "reason_name": h.reason_name, "ext_flags": h.ext_flags, "ext": h.ext_names,
                       "model_id": h.model_id, "payload_abi": h.payload_abi, "codec": h.codec,
                       "ds4_version": h.ds4_version, "tokens": h.tokens, "hits": h.hits,
                       "ctx_size": h.ctx_size, "created_at": _iso(h.created_at), "last_used": _iso(h.last_used),
                       "payload_bytes": h.payload_bytes, "text_bytes": h.text_bytes},
            "payload": self.payload_header,
            "layers": [{"layer": il, "ratio": r, "raw_rows": self.payload_header["raw_live"],
                        "compressed_rows": self.n_comp[il], "indexer_rows": self.n_index_comp[il]}
                       for il, r in enumerate(self.ratios)],
            "stripped": self.stripped,
            "mismatches": self.mismatches,
            "text_sha1": self.text_sha1,
            "name_is_text_sha1": self.name_is_text_sha1,
            "title": None if self.title is None else self.title.decode("utf-8", "replace"),
            "tool_ids": [tool_id.decode("utf-8", "replace") for tool_id, _ in self.tool_map],
        }

    def with_header(self, **changes) -> KVCFile:
        """A copy with header fields changed (hits, last_used, reason, ...), e.g. to write back."""
        return replace(self, header=self.header.with_(**changes))


def _iso(seconds: int) -> str:
    """ISO time of a header timestamp; one no calendar holds (a corrupt field) stays a number."""
    try:
        return datetime.fromtimestamp(seconds, UTC).isoformat() if seconds else ""
    except (OverflowError, OSError, ValueError):
        return str(seconds)


def _map(path: Path):
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size < PREFIX_BYTES:
            return fh.read()
        return mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)


def read(path, model=None) -> KVCFile:
    """Open a .kv file of any known version. `model` gives the compression schedule (a Model, a
    ModelConfig or the ratios); without it Flash and Pro are recognised by their layer count.
    Anything malformed raises KVCFormatError naming the file, the field and the byte offset."""
    path = Path(path)
    try:
        buf = _map(path)
    except OSError as exc:
        raise KVCFormatError(path, f"cannot read file: {exc.strerror or exc}") from None
    header = parse_header(bytes(buf[:PREFIX_BYTES]), path, len(buf))
    text = bytes(buf[PREFIX_BYTES:header.payload_offset])
    if header.payload_bytes == 0:
        body = None
    elif header.compressed:
        raw = lz4.decode_region(buf, header.payload_offset, header.payload_bytes, path, header.chunk_log2)
        body = payload.parse(raw, 0, len(raw), model, path, header.payload_offset, decompressed=True)
    else:
        body = payload.parse(buf, header.payload_offset, header.payload_bytes, model, path, header.payload_offset)
    trailer = trailers.parse(bytes(buf[header.trailer_offset:]), header.ext_flags, path, header.trailer_offset)
    return KVCFile(path, header, text, body, trailer)


def payload_bytes_of(kvc: KVCFile) -> memoryview:
    """The uncompressed payload bytes exactly as stored (no re-encoding of any float)."""
    p = kvc.payload
    return memoryview(p.buf)[p.base:p.base + p.nbytes] if p else memoryview(b"")


def write(kvc: KVCFile, path, compress: bool | None = None, chunk_log2: int | None = None) -> Path:
    """Write `kvc` to `path` the way ds4 lays it out. `compress`: None keeps the payload stored
    as the file stored it (LZ4 or raw), True writes the LZ4 envelope (version 2, codec 2; stored
    raw when it would shrink by less than 1/64, as the PR does), False writes raw. A raw payload
    is written as envelope version 1, as the PR's refresh rewrites raw version-2 files.
    `chunk_log2`: the LZ4 chunk size, by default the file's own (16 MiB for a raw file)."""
    path = Path(path)
    raw = payload_bytes_of(kvc)
    header = kvc.header.with_(text_bytes=len(kvc.text))
    if compress is None:
        compress = header.compressed
    if chunk_log2 is None:
        chunk_log2 = header.chunk_log2 if header.compressed else lz4.DEFAULT_CHUNK_LOG2
    stored = raw
    if compress and len(raw):  # an empty (stripped) payload has no LZ4 form
        packed = lz4.encode_region(raw, chunk_log2)
        if lz4.compression_worthwhile(len(raw), len(packed)):
            header, stored = header.with_(version=2, codec=CODEC_LZ4, chunk_log2=chunk_log2), packed
    if stored is raw and header.version == 2:
        header = header.with_(version=1, codec=CODEC_NONE, chunk_log2=0)
    header = header.with_(payload_bytes=len(stored))
    with atomic_open(path, private=True) as fh:
        fh.write(header.pack())
        fh.write(kvc.text)
        fh.write(stored)
        fh.write(kvc.trailer.encode())
    return path
