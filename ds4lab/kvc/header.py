"""The 48-byte KVC header and the u32 text length that follows it (ds4_kvstore.c).

Offsets (little-endian):
    0  "KVC"          3  envelope version     4  routed-expert quant bits (2 or 4)
    5  save reason    6  extension flags       7  model id (ba00a8a; 0 Flash, 1 Pro; 0 before)
    8  u32 tokens    12  u32 hits             16  u32 ctx the snapshot was written for
   20  payload ABI (ba00a8a: 2; 0 before)     21  codec (LZ4 envelope only)
   22  log2 chunk bytes (LZ4 envelope only)   23  reserved (kept as found)
   24  u64 created_at    32  u64 last_used     40  u64 payload bytes as stored on disk
   48  u32 text_bytes, then the rendered text the file is named after (SHA-1).

Envelope versions: 1 is every upstream ds4 (8d57664 and ba00a8a); 2 is the unmerged LZ4 work,
whose byte 21 says how the payload is stored (0 raw, 2 chunked LZ4 with XXH32 per chunk;
codec 1, the retired unchecksummed framing, is refused). Nothing here reads past byte 52, so a
directory of thousands of files is indexed without touching payloads.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import BinaryIO

from ..errors import KVCFormatError
from .lz4 import MAX_CHUNK_LOG2, MIN_CHUNK_LOG2

KVC_MAGIC = b"KVC"
HEADER_BYTES = 48
PREFIX_BYTES = HEADER_BYTES + 4
ENVELOPE_VERSIONS = (1, 2)
PAYLOAD_ABI = 2

REASONS = {0: "unknown", 1: "cold", 2: "continued", 3: "evict", 4: "shutdown", 5: "agent-system",
           6: "agent-session"}
REASON_CODES = {name: code for code, name in REASONS.items()}
EXT_TOOL_MAP = 0x01
EXT_RESPONSES_VISIBLE = 0x02
EXT_THINKING_VISIBLE = 0x04
EXT_SESSION_TITLE = 0x08
EXT_FLAGS = {EXT_TOOL_MAP: "tool-map", EXT_RESPONSES_VISIBLE: "responses-visible",
             EXT_THINKING_VISIBLE: "thinking-visible", EXT_SESSION_TITLE: "session-title"}
MODEL_IDS = {0: "DeepSeek V4 Flash", 1: "DeepSeek V4 Pro"}
CODEC_NONE, CODEC_LZ4_RETIRED, CODEC_LZ4 = 0, 1, 2


@dataclass(frozen=True)
class KVCHeader:
    """Every field of the 48-byte header, plus the text length stored right after it."""

    version: int = 1
    quant_bits: int = 2
    reason: int = 0
    ext_flags: int = 0
    model_id: int = 0
    tokens: int = 0
    hits: int = 0
    ctx_size: int = 0
    payload_abi: int = PAYLOAD_ABI
    codec: int = CODEC_NONE
    chunk_log2: int = 0
    reserved: int = 0
    created_at: int = 0
    last_used: int = 0
    payload_bytes: int = 0
    text_bytes: int = 0

    @property
    def reason_name(self) -> str:
        return REASONS.get(self.reason, "unknown")

    @property
    def ext_names(self) -> list[str]:
        return [name for bit, name in EXT_FLAGS.items() if self.ext_flags & bit]

    @property
    def ds4_version(self) -> str:
        """Which ds4 wrote this layout: the payload ABI byte appeared in ba00a8a."""
        if self.version == 2:
            return "lz4-envelope"
        return "ba00a8a" if self.payload_abi == PAYLOAD_ABI else "8d57664"

    @property
    def compressed(self) -> bool:
        """Only envelope version 2 gives bytes 21-22 a meaning; in version 1 they are reserved."""
        return self.version == 2 and self.codec == CODEC_LZ4

    @property
    def payload_offset(self) -> int:
        return PREFIX_BYTES + self.text_bytes

    @property
    def trailer_offset(self) -> int:
        return PREFIX_BYTES + self.text_bytes + self.payload_bytes

    def pack(self) -> bytes:
        """The 52 bytes: header, then text length. Reserved bytes go back as they were read (ds4
        writes them 0), so an unchanged header packs to the bytes it came from."""
        out = bytearray(PREFIX_BYTES)
        out[0:3] = KVC_MAGIC
        out[3:8] = bytes([self.version, self.quant_bits, self.reason, self.ext_flags, self.model_id])
        struct.pack_into("<3I", out, 8, self.tokens, self.hits, self.ctx_size)
        out[20:24] = bytes([self.payload_abi, self.codec, self.chunk_log2, self.reserved])
        struct.pack_into("<3QI", out, 24, self.created_at, self.last_used, self.payload_bytes, self.text_bytes)
        return bytes(out)

    def with_(self, **changes) -> KVCHeader:
        return replace(self, **changes)


def parse_header(prefix: bytes, path: str | Path = "<bytes>", file_size: int | None = None) -> KVCHeader:
    """Decode the first 52 bytes of a .kv file. Refuses what no ds4 version wrote (magic,
    envelope version, codec) and, given the file size, a text or payload that overruns it."""
    if len(prefix) < PREFIX_BYTES:
        raise KVCFormatError(path, f"KVC header: needs {PREFIX_BYTES} bytes, the file has {len(prefix)}",
                             offset=len(prefix))
    if prefix[0:3] != KVC_MAGIC:
        raise KVCFormatError(path, f"magic: expected b'KVC', found {bytes(prefix[0:3])!r}", offset=0)
    version = prefix[3]
    if version not in ENVELOPE_VERSIONS:
        raise KVCFormatError(path, f"version: envelope version {version} is unknown (known: 1, and 2 for the "
                                   "LZ4 envelope)", offset=3)
    tokens, hits, ctx = struct.unpack_from("<3I", prefix, 8)
    created, last_used, payload_bytes, text_bytes = struct.unpack_from("<3QI", prefix, 24)
    header = KVCHeader(version, prefix[4], prefix[5], prefix[6], prefix[7], tokens, hits, ctx, prefix[20],
                       prefix[21], prefix[22], prefix[23], created, last_used, payload_bytes, text_bytes)
    if version == 2:
        if header.codec == CODEC_LZ4_RETIRED:
            raise KVCFormatError(path, "codec: 1 is the retired unchecksummed LZ4 framing", offset=21)
        if header.codec not in (CODEC_NONE, CODEC_LZ4):
            raise KVCFormatError(path, f"codec: {header.codec} is unknown (known: 0 raw, 2 LZ4+XXH32)", offset=21)
        if header.codec == CODEC_LZ4 and not MIN_CHUNK_LOG2 <= header.chunk_log2 <= MAX_CHUNK_LOG2:
            raise KVCFormatError(path, f"chunk_log2: {header.chunk_log2} outside {MIN_CHUNK_LOG2}..{MAX_CHUNK_LOG2} "
                                       "(chunks up to 64 MiB)", offset=22)
    if file_size is not None:
        if PREFIX_BYTES + text_bytes > file_size:
            raise KVCFormatError(path, f"text_bytes: {text_bytes} bytes of text but the file has "
                                       f"{file_size - PREFIX_BYTES} after the header", offset=48)
        if header.trailer_offset > file_size:
            raise KVCFormatError(path, f"payload_bytes: {payload_bytes} bytes of payload but the file has "
                                       f"{file_size - header.payload_offset} after the text", offset=40)
    return header


def read_prefix(fh: BinaryIO, path: str | Path, size: int | None = None) -> tuple[KVCHeader, int]:
    """(header, file size) of a .kv file open at its start (`size` when already known); the file
    is left just past the header's 52 bytes."""
    size = os.fstat(fh.fileno()).st_size if size is None else size
    return parse_header(fh.read(PREFIX_BYTES), path, size), size


def read_header(path: str | Path) -> KVCHeader:
    """The header of a .kv file, reading only its first 52 bytes."""
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            return read_prefix(fh, path)[0]
    except OSError as exc:
        raise KVCFormatError(path, f"cannot read file: {exc.strerror or exc}") from None
