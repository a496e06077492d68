"""Sections appended after the payload: ds4-agent's session title and ds4-server's KTM tool map.

The trailer has no length field of its own: it runs from the end of the payload to the end of
the file, and the header's extension flags say what is there.
- ext bit 3 (ba00a8a, agent sessions): the title, u32 length then its bytes;
- ext bit 0 (server): "KTM", version 1, u32 count, then per entry u32 id_len, u32 dsml_len,
  the tool-call id and the exact DSML block the model sampled for it. ds4 sets the bit from a
  size estimate, so an empty trailer with the bit set means "no entries".
The agent never writes a tool map and the server never writes a title; a file with both is
read title first, the order the agent appends sections in.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import KVCFormatError
from .header import EXT_SESSION_TITLE, EXT_TOOL_MAP

KTM_MAGIC = b"KTM"
KTM_VERSION = 1
MAX_TOOL_ID = 256
MAX_DSML = 512 << 20


@dataclass
class Trailer:
    title: bytes | None = None
    tool_map: list[tuple[bytes, bytes]] = field(default_factory=list)
    unknown: bytes = b""

    def ext_flags(self) -> int:
        return (EXT_SESSION_TITLE if self.title is not None else 0) | (EXT_TOOL_MAP if self.tool_map else 0)

    def encode(self) -> bytes:
        out = b""
        if self.title is not None:
            out += struct.pack("<I", len(self.title)) + self.title
        if self.tool_map:
            out += KTM_MAGIC + bytes([KTM_VERSION]) + struct.pack("<I", len(self.tool_map))
            for tool_id, dsml in self.tool_map:
                out += struct.pack("<2I", len(tool_id), len(dsml)) + tool_id + dsml
        return out + self.unknown


def parse(data: bytes, ext_flags: int, path: Path, offset: int) -> Trailer:
    """Decode the trailer bytes (`offset` is where they start in the file, for error messages)."""
    out, pos = Trailer(), 0

    def need(n: int, what: str) -> None:
        if pos + n > len(data):
            raise KVCFormatError(path, f"{what}: needs {n} bytes, the trailer has {len(data) - pos} left",
                                 offset=offset + pos)

    if ext_flags & EXT_SESSION_TITLE:
        need(4, "title length")
        (n,) = struct.unpack_from("<I", data, pos)
        pos += 4
        need(n, "title")
        out.title = bytes(data[pos:pos + n])
        pos += n
    if ext_flags & EXT_TOOL_MAP and pos < len(data):
        need(8, "KTM header")
        if data[pos:pos + 3] != KTM_MAGIC or data[pos + 3] != KTM_VERSION:
            raise KVCFormatError(path, f"KTM magic/version: found {bytes(data[pos:pos + 4])!r}", offset=offset + pos)
        (count,) = struct.unpack_from("<I", data, pos + 4)
        pos += 8
        if 8 * count > len(data) - pos:
            raise KVCFormatError(path, f"KTM count: {count} entries cannot fit in {len(data) - pos} bytes",
                                 offset=offset + pos - 4)
        for i in range(count):
            need(8, f"KTM entry {i} lengths")
            id_len, dsml_len = struct.unpack_from("<2I", data, pos)
            if not (1 <= id_len <= MAX_TOOL_ID and 1 <= dsml_len <= MAX_DSML):
                raise KVCFormatError(path, f"KTM entry {i}: id_len {id_len} (1..{MAX_TOOL_ID}) or dsml_len "
                                           f"{dsml_len} out of range", offset=offset + pos)
            pos += 8
            need(id_len + dsml_len, f"KTM entry {i}")
            out.tool_map.append((bytes(data[pos:pos + id_len]), bytes(data[pos + id_len:pos + id_len + dsml_len])))
            pos += id_len + dsml_len
    # Bytes past the announced sections belong to a section this reader does not know (ds4's
    # own readers ignore them too); they are kept so a rewrite reproduces the file.
    out.unknown = bytes(data[pos:])
    return out
