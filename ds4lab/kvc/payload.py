"""The DSV4 session payload (ds4.c "Session Snapshot Payloads"): layout, lazy parse, encode.

13 u32 header words (magic "DSV4", version, ctx, prefill_cap, raw_cap, raw_window, comp_cap,
n_tokens, n_layer, head_dim, indexer_head_dim, n_vocab, raw_live), the token ids, the f32
logits after the last token, n_comp[n_layer] and n_index_comp[n_layer], then per layer, all
float32: the raw window rows (oldest first), and on compressed layers the compressed rows and
the compressor frontier (kv, score: [c·ratio, c·head_dim] with c = 2 at ratio 4); ratio-4
layers add the indexer rows and indexer frontier ([8, 2·indexer_head_dim] each).

Payload version 1 is ds4 8d57664, version 2 is ba00a8a: the bytes are laid out identically
(the bump guards runtime changes). The payload does not say which layers compress; that is
the model's `compress_ratios`, so shapes come from the header words plus the schedule.
Every block's extent is computed and checked against the bytes present before any array
is made, and arrays are views of the file's memory map: opening a 450 MB checkpoint reads
its header words only.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config import coff, has_indexer, known_shape
from ..errors import KVCFormatError

DSV4_MAGIC = 0x34565344
PAYLOAD_VERSIONS = (1, 2)
FIELDS = ("magic", "version", "ctx", "prefill_cap", "raw_cap", "raw_window", "comp_cap", "n_tokens", "n_layer",
          "head_dim", "indexer_head_dim", "n_vocab", "raw_live")
HEADER_WORDS = len(FIELDS)
# ds4 itself runs at most 61 layers (Pro) with 512-wide rows and a 129280 vocabulary; bounds far
# above that still keep a hostile header from describing blocks whose products overflow.
_MAX_WORD = {"n_layer": 4096, "head_dim": 1 << 16, "indexer_head_dim": 1 << 16, "n_vocab": 1 << 24}

# Per-layer block names, in file order (the names ds4's oracle manifest uses).
BLOCKS = ("raw_kv", "comp_kv", "attn_state_kv", "attn_state_score", "index_comp_kv", "index_state_kv",
          "index_state_score")


@dataclass(frozen=True)
class Block:
    """One float32 array of the payload: where it starts (from the payload's first byte) and its shape."""

    layer: int
    name: str
    offset: int
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return 4 * self.shape[0] * self.shape[1]


def schedule_of(model_or_ratios, n_layer: int) -> tuple[int, ...]:
    """The compression ratio of each layer: from a sequence, a ModelConfig, a Model, or (None)
    the known shapes, Flash (43 layers) and Pro (61)."""
    source = getattr(model_or_ratios, "config", model_or_ratios)
    if hasattr(source, "compress_ratios"):
        # A GGUF's schedule may list more entries than main layers (config.py checks "at least").
        source = source.compress_ratios[:source.n_layer]
    if source is None:
        try:
            source = known_shape(n_layer).compress_ratios
        except KeyError:
            raise ValueError(f"a payload of {n_layer} layers is neither Flash nor Pro: pass the model or its "
                             "compress_ratios") from None
    ratios = tuple(int(r) for r in source)
    if len(ratios) != n_layer:
        raise ValueError(f"the model has {len(ratios)} layers, the payload {n_layer}")
    return ratios


def frontier_shape(ratio: int, width: int) -> tuple[int, int]:
    return coff(ratio) * ratio, coff(ratio) * width


def layer_shapes(ratio: int, fields: dict[str, int], n_comp: int, n_index: int) -> list[tuple[str, tuple[int, int]]]:
    """The float blocks of one layer in file order, by name and shape."""
    hd, ihd = fields["head_dim"], fields["indexer_head_dim"]
    out = [("raw_kv", (fields["raw_live"], hd))]
    if ratio:
        out += [("comp_kv", (int(n_comp), hd)), ("attn_state_kv", frontier_shape(ratio, hd)),
                ("attn_state_score", frontier_shape(ratio, hd))]
    if has_indexer(ratio):
        out += [("index_comp_kv", (int(n_index), ihd)), ("index_state_kv", frontier_shape(ratio, ihd)),
                ("index_state_score", frontier_shape(ratio, ihd))]
    return out


def blocks(fields: dict[str, int], ratios: tuple[int, ...], n_comp, n_index, start: int) -> list[Block]:
    """The per-layer float blocks in file order, starting `start` bytes into the payload."""
    out, pos = [], start
    for il, ratio in enumerate(ratios):
        for name, shape in layer_shapes(ratio, fields, n_comp[il], n_index[il]):
            out.append(Block(il, name, pos, shape))
            pos += out[-1].nbytes
    return out


def _fixed_bytes(fields: dict[str, int], n_layer: int) -> int:
    """Header words, token ids, logits and the two per-layer count arrays."""
    return 4 * (HEADER_WORDS + fields["n_tokens"] + fields["n_vocab"] + 2 * n_layer)


def payload_size(fields: dict[str, int], ratios: tuple[int, ...], n_comp, n_index) -> int:
    """Bytes of a payload with these header words, schedule and per-layer counts."""
    return _fixed_bytes(fields, len(ratios)) + sum(b.nbytes for b in blocks(fields, ratios, n_comp, n_index, 0))


def checkpoint_bytes(config, n_tokens: int, ctx_size: int | None = None) -> int:
    """Payload bytes of an `n_tokens` checkpoint of a model with this config, as ds4 saves it
    (ds4_session_payload_bytes): floor(T/ratio) compressed rows per compressed layer, floor(T/4)
    indexer rows on ratio-4 layers, min(T, window) raw rows (the window capped by `ctx_size`).
    Layers of one ratio are alike, so each ratio is sized once (the cache simulator calls this
    for every store)."""
    window = config.n_swa if ctx_size is None else min(config.n_swa, ctx_size)
    fields = {"n_tokens": n_tokens, "n_vocab": config.n_vocab, "head_dim": config.head_dim,
              "indexer_head_dim": config.indexer_head_dim, "raw_live": min(n_tokens, window)}
    ratios = list(config.compress_ratios[:config.n_layer])
    total = _fixed_bytes(fields, len(ratios))
    for ratio in set(ratios):
        shapes = layer_shapes(ratio, fields, n_tokens // ratio if ratio else 0, n_tokens // 4)
        total += ratios.count(ratio) * sum(4 * rows * cols for _, (rows, cols) in shapes)
    return total


@dataclass
class Payload:
    """A parsed payload: header words, token ids, logits, per-layer counts and float blocks.
    Arrays are views into `buf` (a memory map or decompressed bytes), made on first use."""

    fields: dict[str, int]
    ratios: tuple[int, ...]
    tokens: np.ndarray
    logits: np.ndarray
    n_comp: list[int]
    n_index_comp: list[int]
    blocks: list[Block]
    buf: object
    base: int

    @property
    def nbytes(self) -> int:
        """The payload's size (uncompressed): its fixed part and every block."""
        return _fixed_bytes(self.fields, len(self.ratios)) + sum(b.nbytes for b in self.blocks)

    def array(self, block: Block) -> np.ndarray:
        return np.frombuffer(self.buf, "<f4", block.shape[0] * block.shape[1],
                             self.base + block.offset).reshape(block.shape)

    def layer_arrays(self, layer: int) -> dict[str, np.ndarray]:
        return {b.name: self.array(b) for b in self.blocks if b.layer == layer}


def parse(buf, base: int, length: int, model_or_ratios, path: Path, file_offset: int,
          decompressed: bool = False) -> Payload:
    """Parse the `length` payload bytes at `buf[base:]`. Errors name the byte offset in the file
    (`file_offset` is where the payload starts there). A `decompressed` payload (the LZ4
    envelope) has no file offset of its own: errors name the region's offset, and the message
    says which byte of the decompressed payload is wrong."""

    def fail(what: str, at: int) -> KVCFormatError:
        if decompressed:
            return KVCFormatError(path, f"{what} (byte {at} of the decompressed payload)", offset=file_offset)
        return KVCFormatError(path, what, offset=file_offset + at)

    if length < 4 * HEADER_WORDS:
        raise fail(f"DSV4 payload header: needs {4 * HEADER_WORDS} bytes, payload_bytes is {length}", 0)
    fields = dict(zip(FIELDS, struct.unpack_from(f"<{HEADER_WORDS}I", buf, base), strict=True))
    if fields["magic"] != DSV4_MAGIC:
        raise fail(f"payload magic: expected 'DSV4' ({DSV4_MAGIC:#x}), found {fields['magic']:#x}", 0)
    if fields["version"] not in PAYLOAD_VERSIONS:
        raise fail(f"payload version: {fields['version']} is unknown (known: 1 at 8d57664, 2 at ba00a8a)", 4)
    for i, key in enumerate(FIELDS):
        if key in _MAX_WORD and fields[key] > _MAX_WORD[key]:
            raise fail(f"payload {key}: {fields[key]} exceeds {_MAX_WORD[key]}", 4 * i)
    if fields["raw_live"] > min(fields["raw_cap"], fields["n_tokens"]):
        raise fail(f"payload raw_live: {fields['raw_live']} rows but raw_cap is {fields['raw_cap']} and n_tokens "
                   f"{fields['n_tokens']}", 48)
    if fields["n_tokens"] > fields["ctx"]:
        raise fail(f"payload n_tokens: {fields['n_tokens']} exceeds the saved ctx {fields['ctx']}", 28)
    # Everything before the per-layer blocks, checked against the bytes there are before reading.
    n_layer = fields["n_layer"]
    head = _fixed_bytes(fields, n_layer)
    if head > length:
        raise fail(f"payload tokens/logits/counts: need {head} bytes, payload_bytes is {length}", 4 * HEADER_WORDS)
    try:
        ratios = schedule_of(model_or_ratios, n_layer)
    except ValueError as exc:
        raise fail(f"payload n_layer: {exc}", 32) from None
    pos = base + 4 * HEADER_WORDS
    tokens = np.frombuffer(buf, "<u4", fields["n_tokens"], pos)
    pos += tokens.nbytes
    logits = np.frombuffer(buf, "<f4", fields["n_vocab"], pos)
    pos += logits.nbytes
    counts = np.frombuffer(buf, "<u4", 2 * n_layer, pos)
    n_comp, n_index = counts[:n_layer].tolist(), counts[n_layer:].tolist()
    for il, ratio in enumerate(ratios):
        at = pos - base + 4 * il
        if ratio == 0 and n_comp[il]:
            raise fail(f"layer {il} n_comp: {n_comp[il]} rows on an uncompressed layer", at)
        if ratio and n_comp[il] > fields["comp_cap"]:
            raise fail(f"layer {il} n_comp: {n_comp[il]} exceeds comp_cap {fields['comp_cap']}", at)
        if ratio != 4 and n_index[il]:
            raise fail(f"layer {il} n_index_comp: {n_index[il]} rows on a layer without an indexer",
                       at + 4 * n_layer)
        if has_indexer(ratio) and n_index[il] > fields["comp_cap"]:
            raise fail(f"layer {il} n_index_comp: {n_index[il]} exceeds comp_cap {fields['comp_cap']}",
                       at + 4 * n_layer)
    layout = blocks(fields, ratios, n_comp, n_index, head)
    need = head + sum(b.nbytes for b in layout)
    if need != length:
        field, at = ("uncompressed_total", file_offset) if decompressed else ("payload_bytes", 40)
        raise KVCFormatError(path, f"{field}: {length} bytes, but the layout of {n_layer} layers with "
                                   f"these row counts needs {need}", offset=at)
    return Payload(fields, ratios, tokens, logits, n_comp, n_index, layout, buf, base)


def encode(fields: dict[str, int], tokens, logits, n_comp, n_index, layer_arrays: list[dict[str, np.ndarray]]
           ) -> list[bytes]:
    """The payload as byte pieces in file order (joined by the caller, or streamed to a file)."""
    pieces = [struct.pack(f"<{HEADER_WORDS}I", *(fields[k] for k in FIELDS)),
              np.asarray(tokens, "<u4").tobytes(), np.asarray(logits, "<f4").tobytes(),
              np.asarray(n_comp, "<u4").tobytes(), np.asarray(n_index, "<u4").tobytes()]
    for arrays in layer_arrays:
        pieces += [np.ascontiguousarray(arrays[name], "<f4").tobytes() for name in BLOCKS if name in arrays]
    return pieces
