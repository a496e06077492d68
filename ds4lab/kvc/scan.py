"""A cache directory as a DataFrame: one row per .kv file, read from headers and texts only."""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

import pandas as pd

from ..errors import KVCFormatError
from .header import KVCHeader, read_prefix

_INT_COLUMNS = ("version", "codec", "payload_version", "model_id", "quant_bits", "reason", "ext_flags", "tokens",
                "hits", "ctx_size", "payload_abi", "text_bytes", "payload_bytes", "file_bytes")


def _row(path: Path, with_text: bool) -> tuple[dict, KVCHeader | None]:
    """A file's row, and its parsed header (None for a file that does not parse)."""
    row: dict = {"file": path.name, "valid": False, "error": ""}
    try:
        with open(path, "rb") as fh:
            row["file_bytes"] = os.fstat(fh.fileno()).st_size
            h, _ = read_prefix(fh, path, row["file_bytes"])
            text = fh.read(h.text_bytes)
            # The payload's own version word (1 at 8d57664, 2 at ba00a8a), when stored raw.
            words = fh.read(8) if not h.compressed and h.payload_bytes >= 8 else b""
    except (OSError, KVCFormatError) as exc:
        row["error"] = str(exc).removeprefix(f"{path}: ").removeprefix(f"{path} ")
        return row, None
    row |= {"valid": True, "version": h.version, "ds4_version": h.ds4_version, "codec": h.codec,
            "payload_version": struct.unpack("<2I", words)[1] if len(words) == 8 else pd.NA,
            "model_id": h.model_id, "quant_bits": h.quant_bits, "reason": h.reason, "reason_name": h.reason_name,
            "ext_flags": h.ext_flags, "ext": ",".join(h.ext_names), "tokens": h.tokens, "hits": h.hits,
            "ctx_size": h.ctx_size, "payload_abi": h.payload_abi, "created_at": h.created_at,
            "last_used": h.last_used, "text_bytes": h.text_bytes, "payload_bytes": h.payload_bytes,
            "name_is_text_sha1": path.name.lower() == hashlib.sha1(text).hexdigest() + ".kv"}
    if with_text:
        row["text"] = text.decode("utf-8", errors="replace")
    return row, h


def scan(directory, with_text: bool = False) -> pd.DataFrame:
    """One row per `*.kv` file in `directory`: whether it parses (and the error if not), its
    versions, header fields, sizes, timestamps as UTC datetimes, and whether its name is the
    SHA-1 of its text. The prompt text only with `with_text` (it is the user's prompt,
    verbatim). `ds4lab.cache.scan` adds each file's eviction scores."""
    return scan_headers(directory, with_text)[0]


def scan_headers(directory, with_text: bool = False) -> tuple[pd.DataFrame, list[KVCHeader | None]]:
    """`scan`'s table and, row by row, the parsed header (None where the file does not parse)."""
    directory = Path(directory)
    names = sorted(n for n in os.listdir(directory) if n.endswith(".kv"))
    rows, headers = zip(*(_row(directory / n, with_text) for n in names), strict=True) if names else ((), ())
    frame = pd.DataFrame(list(rows),
                         columns=["file", "valid", "error", *_INT_COLUMNS, "ds4_version", "reason_name", "ext",
                                  "created_at", "last_used", "name_is_text_sha1", *(["text"] if with_text else [])])
    frame = frame.astype(dict.fromkeys(_INT_COLUMNS, "Int64") | {"valid": bool, "name_is_text_sha1": "boolean"})
    for column in ("created_at", "last_used"):
        # A timestamp beyond pandas' calendar (a corrupt header) becomes NaT, not an error.
        frame[column] = pd.to_datetime(frame[column].astype("Int64"), unit="s", utc=True, errors="coerce")
    return frame, list(headers)
