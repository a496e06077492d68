"""ds4's disk KV cache files (.kv) as data: KVC header, cache text, DSV4 session payload.

Layout (ds4_kvstore.c and ds4.c's session payload, little-endian):
- KVC header, 48 bytes: "KVC", version, routed quant bits, reason, ext flags, model id
  (ba00a8a; 0 Flash, 1 Pro), u32 tokens / hits / ctx, payload ABI byte at 20 (ba00a8a: 2),
  u64 created / last_used / payload_bytes;
- u32 text_bytes and the rendered text (the file is named by its SHA-1);
- the DSV4 payload: 13 u32 (magic "DSV4", version, ctx, prefill_cap, raw_cap, raw_window,
  comp_cap, n_tokens, n_layer, head_dim, indexer_head_dim, n_vocab, raw_live), the token ids,
  the logits after the last token, n_comp and n_index_comp per layer, then per layer the raw
  window rows, and on compressed layers the compressed rows and the compressor frontier (kv,
  score), and on ratio-4 layers the indexer rows and frontier, all float32;
- an optional trailer up to the end of the file.

The payload does not say which layers compress: that is the model's schedule, taken from
`compress_ratios` (Flash and Pro are known by their layer count). Every size is checked
against the bytes the file has before anything is read.
"""

from __future__ import annotations

import hashlib
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..atomic import atomic_open
from ..config import FLASH, PRO
from ..errors import KVCFormatError
from .header import PREFIX_BYTES, KVCHeader, parse_header, read_header

DSV4_MAGIC = 0x34565344
_PAYLOAD_FIELDS = ("magic", "version", "ctx", "prefill_cap", "raw_cap", "raw_window", "comp_cap", "n_tokens",
                   "n_layer", "head_dim", "indexer_head_dim", "n_vocab", "raw_live")
_MAX_DIM = 1 << 20
__all__ = ["KVCFile", "KVCHeader", "LayerState", "encode", "parse_header", "read", "read_header", "to_state",
           "write"]


@dataclass
class LayerState:
    ratio: int
    raw: np.ndarray
    comp: np.ndarray | None = None
    attn_state_kv: np.ndarray | None = None
    attn_state_score: np.ndarray | None = None
    index_comp: np.ndarray | None = None
    index_state_kv: np.ndarray | None = None
    index_state_score: np.ndarray | None = None

    def blocks(self) -> dict[str, np.ndarray]:
        """The arrays present, by the names ds4's manifest uses."""
        names = {"raw": "raw_kv", "comp": "comp_kv", "index_comp": "index_comp_kv"}
        out = {}
        for key in ("raw", "comp", "attn_state_kv", "attn_state_score", "index_comp", "index_state_kv",
                    "index_state_score"):
            value = getattr(self, key)
            if value is not None:
                out[names.get(key, key)] = value
        return out


@dataclass
class KVCFile:
    path: Path
    header: KVCHeader
    text: bytes
    payload: dict[str, int]
    tokens: np.ndarray
    logits: np.ndarray
    n_comp: list[int]
    n_index_comp: list[int]
    layers: list[LayerState] = field(default_factory=list)
    trailer: bytes = b""

    @property
    def text_sha1(self) -> str:
        return hashlib.sha1(self.text).hexdigest()


class _Reader:
    def __init__(self, buf, path: Path) -> None:
        self.buf, self.path, self.pos = buf, path, 0

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise KVCFormatError(self.path, f"{what}: needs {n} bytes but only {len(self.buf) - self.pos} remain "
                                          f"(file truncated or corrupt)", offset=self.pos)

    def unpack(self, fmt: str, what: str) -> tuple:
        n = struct.calcsize(fmt)
        self.need(n, what)
        out = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return out

    def floats(self, shape: tuple[int, ...], what: str, dtype=np.float32) -> np.ndarray:
        count = int(np.prod(shape))
        self.need(count * 4, what)
        out = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).reshape(shape).copy()
        self.pos += count * 4
        return out


def _ratios_for(n_layer: int, model_id: int, compress_ratios) -> tuple[int, ...]:
    if compress_ratios is not None:
        ratios = tuple(int(r) for r in compress_ratios)
    else:
        known = {FLASH.n_layer: FLASH, PRO.n_layer: PRO}
        if n_layer not in known:
            raise ValueError(f"a payload of {n_layer} layers is neither Flash nor Pro: pass compress_ratios")
        ratios = known[n_layer].compress_ratios
    if len(ratios) < n_layer:
        raise ValueError(f"compress_ratios has {len(ratios)} entries for {n_layer} layers")
    return ratios[:n_layer]


def read(path, compress_ratios=None) -> KVCFile:
    """Parse a .kv file completely; `compress_ratios` is the model's schedule (Flash/Pro known)."""
    path = Path(path)
    try:
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(_Reader(buf, path), compress_ratios)
    except ValueError as exc:
        if isinstance(exc, KVCFormatError):
            raise
        raise KVCFormatError(path, str(exc)) from None
    except OSError as exc:
        raise KVCFormatError(path, f"cannot read file: {exc.strerror or exc}") from None


def _parse(r: _Reader, compress_ratios) -> KVCFile:
    path = r.path
    header = parse_header(bytes(r.buf[:PREFIX_BYTES]), path, len(r.buf))
    model_id, payload_bytes, text_bytes = header.model_id, header.payload_bytes, header.text_bytes
    r.pos = PREFIX_BYTES
    text = bytes(r.buf[r.pos:r.pos + text_bytes])
    r.pos += text_bytes
    payload_start = r.pos
    r.need(payload_bytes, "DSV4 payload")
    fields = dict(zip(_PAYLOAD_FIELDS, r.unpack("<13I", "DSV4 payload header"), strict=True))
    if fields["magic"] != DSV4_MAGIC:
        raise KVCFormatError(path, f"payload magic: expected 'DSV4', found {fields['magic']:#x}", offset=payload_start)
    for key in ("n_layer", "head_dim", "indexer_head_dim", "n_vocab", "raw_live", "n_tokens", "comp_cap", "raw_cap"):
        if fields[key] > _MAX_DIM:
            raise KVCFormatError(path, f"payload {key}: {fields[key]} exceeds {_MAX_DIM}", offset=payload_start)
    if fields["raw_live"] > fields["raw_cap"] or fields["n_tokens"] > fields["ctx"]:
        raise KVCFormatError(path, f"payload: raw_live {fields['raw_live']} > raw_cap {fields['raw_cap']} or "
                                 f"n_tokens {fields['n_tokens']} > ctx {fields['ctx']}", offset=payload_start)
    n_layer, hd, ihd = fields["n_layer"], fields["head_dim"], fields["indexer_head_dim"]
    ratios = _ratios_for(n_layer, model_id, compress_ratios)
    toks = r.floats((fields["n_tokens"],), "token ids", np.uint32)
    logits = r.floats((fields["n_vocab"],), "logits")
    n_comp = list(r.floats((n_layer,), "n_comp", np.uint32).tolist())
    n_index = list(r.floats((n_layer,), "n_index_comp", np.uint32).tolist())
    expected = r.pos - payload_start
    for il, ratio in enumerate(ratios):
        coff = 2 if ratio == 4 else 1
        expected += 4 * fields["raw_live"] * hd
        if ratio:
            if n_comp[il] > fields["comp_cap"]:
                raise KVCFormatError(path, f"layer {il}: n_comp {n_comp[il]} > comp_cap {fields['comp_cap']}")
            expected += 4 * (n_comp[il] * hd + 2 * coff * ratio * coff * hd)
        if ratio == 4:
            expected += 4 * (n_index[il] * ihd + 2 * 8 * 2 * ihd)
    if expected != payload_bytes:
        raise KVCFormatError(path, f"payload_bytes: header says {payload_bytes}, the layout of {n_layer} layers "
                                 f"needs {expected}", offset=40)
    layers = []
    for il, ratio in enumerate(ratios):
        coff = 2 if ratio == 4 else 1
        layer = LayerState(ratio, r.floats((fields["raw_live"], hd), f"layer {il} raw rows"))
        if ratio:
            layer.comp = r.floats((n_comp[il], hd), f"layer {il} compressed rows")
            layer.attn_state_kv = r.floats((coff * ratio, coff * hd), f"layer {il} compressor kv")
            layer.attn_state_score = r.floats((coff * ratio, coff * hd), f"layer {il} compressor score")
        if ratio == 4:
            layer.index_comp = r.floats((n_index[il], ihd), f"layer {il} indexer rows")
            layer.index_state_kv = r.floats((8, 2 * ihd), f"layer {il} indexer kv")
            layer.index_state_score = r.floats((8, 2 * ihd), f"layer {il} indexer score")
        layers.append(layer)
    trailer = bytes(r.buf[r.pos:])
    return KVCFile(path, header, text, fields, toks, logits, n_comp, n_index, layers, trailer)


def to_state(kvc: KVCFile):
    """The session state a .kv file holds, for `model.session(state)`: ds4's raw windows,
    compressed rows, frontiers, tokens and last logits."""
    import mlx.core as mx

    from ..model.compressor import Frontier
    from ..model.state import LayerCache, SessionState

    def arr(a: np.ndarray | None) -> mx.array | None:
        return None if a is None else mx.array(a)

    layers = []
    for layer in kvc.layers:
        cache = LayerCache(raw=mx.array(layer.raw), comp=arr(layer.comp), index_comp=arr(layer.index_comp))
        if layer.attn_state_kv is not None:
            cache.frontier = Frontier(mx.array(layer.attn_state_kv), mx.array(layer.attn_state_score))
        if layer.index_state_kv is not None:
            cache.index_frontier = Frontier(mx.array(layer.index_state_kv), mx.array(layer.index_state_score))
        layers.append(cache)
    return SessionState(layers=layers, tokens=[int(t) for t in kvc.tokens], logits=mx.array(kvc.logits))


def encode(kvc: KVCFile) -> bytes:
    """The bytes of a .kv file, laid out exactly as ds4 writes them (header, text, payload, trailer)."""
    h = kvc.header
    body = [struct.pack("<13I", *(kvc.payload[k] for k in _PAYLOAD_FIELDS)),
            np.asarray(kvc.tokens, "<u4").tobytes(), np.asarray(kvc.logits, "<f4").tobytes(),
            np.asarray(kvc.n_comp, "<u4").tobytes(), np.asarray(kvc.n_index_comp, "<u4").tobytes()]
    for layer in kvc.layers:
        body += [np.ascontiguousarray(a, "<f4").tobytes() for a in layer.blocks().values()]
    payload = b"".join(body)
    head = h.with_(payload_bytes=len(payload), text_bytes=len(kvc.text)).pack()
    return head + kvc.text + payload + kvc.trailer


def write(path, kvc: KVCFile) -> Path:
    """Write a .kv file atomically, 0600 in a 0700 directory: cache files hold prompts verbatim."""
    path = Path(path)
    with atomic_open(path, private=True) as fh:
        fh.write(encode(kvc))
    return path
