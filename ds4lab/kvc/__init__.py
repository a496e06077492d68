"""ds4's disk KV cache files (.kv) as data: read, write, scan, compare.

A .kv file (ds4_kvstore.c) is a 48-byte KVC header, the u32 length and bytes of the cache text
(the rendered prompt; server checkpoints are named by its SHA-1), the DSV4 session payload
(ds4.c) and optional trailers (agent title, KTM tool map).
Versions: envelope 1 at ds4 8d57664 (payload version 1) and ba00a8a (model id at byte 7,
payload ABI 2 at byte 20, payload version 2, same payload layout); envelope 2 is the unmerged
LZ4 work (PR #186, final layout: chunked LZ4 with XXH32 per chunk). `header`, `payload`,
`trailers`, `lz4` hold the formats; `kvfile` the whole file (`read`, `write`); `scan` the directory
view; `diff` two checkpoints compared. A pure file-format layer (numpy): the bridge to model
sessions is `ds4lab.model.kv_state`, eviction scores are `ds4lab.cache.scan`'s.
"""

from .header import REASON_CODES, REASONS, KVCHeader, parse_header, read_header
from .kvfile import KVCFile, read, write
from .scan import scan

__all__ = ["REASONS", "REASON_CODES", "KVCFile", "KVCHeader", "parse_header", "read", "read_header",
           "scan", "write"]
