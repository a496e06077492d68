"""The LZ4 payload region of ds4's compressed disk KV cache (PR #186, "KVC version 2", final layout).

A .kv file whose header says codec 2 (byte 21) stores its DSV4 payload as this region instead of
raw bytes; header byte 22 is log2 of the chunk size (24 = 16 MiB by default, at most 64 MiB).
Everything is little-endian:

    u64 uncompressed_total ; u32 chunk_count                       region preamble, 12 bytes
    chunk_count times:
        u32 raw_size ; u32 compressed_size ; u32 xxh32(raw chunk, seed 0)     record, 12 bytes
        u8[compressed_size]   LZ4 block (ds4 uses LZ4-HC level 1) of the byte-4-transposed chunk

Every chunk but the last is exactly one chunk size, the raw sizes add up to the total, and the
checksum covers the original (un-transposed) bytes. The transpose groups byte k of every 4-byte
word into stream k (float32 KV rows have near-constant exponent and, in V4.1, zero low bytes), and
leaves the `len % 4` tail bytes where they are.

This module has pure-Python implementations of XXH32 and the LZ4 block format, so it needs no
extension modules; when the `xxhash` / `lz4` packages are importable the public functions use them
for speed. The `*_pure` functions are always the Python versions.
"""

from __future__ import annotations

import re
import struct

import numpy as np

from ..errors import Ds4labError, KVCFormatError

try:  # optional accelerators; the pure-Python paths below give the same results
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - depends on the environment
    _xxhash = None
try:
    import lz4.block as _lz4block
except ImportError:  # pragma: no cover - depends on the environment
    _lz4block = None

__all__ = ["DEFAULT_CHUNK_LOG2", "MAX_CHUNK_LOG2", "MIN_CHUNK_LOG2", "LZ4BlockError", "compress_bound",
           "compression_worthwhile", "decode_region", "encode_region", "lz4_block_compress",
           "lz4_block_compress_pure", "lz4_block_decompress", "lz4_block_decompress_pure", "transpose4",
           "untranspose4", "xxh32", "xxh32_pure"]

DEFAULT_CHUNK_LOG2 = 24  # 16 MiB, ds4's DS4_KVSTORE_DEFAULT_CHUNK_BYTES
MIN_CHUNK_LOG2 = 1  # ds4_kvstore_read_header maps byte 22 = 0 to "no chunk size"
MAX_CHUNK_LOG2 = 26  # 64 MiB, DS4_KVSTORE_MAX_CHUNK_BYTES
_PREAMBLE = struct.Struct("<QI")
_RECORD = struct.Struct("<III")
# The reader refuses a total above 256 bytes per region byte (rounded up), as ds4's reader does:
# an LZ4 block expands at most ~255x, so no real region is refused, and a hostile header cannot
# make us allocate more than 256x the bytes the file really has.
_MAX_EXPANSION = 256

# LZ4 block-format constants (lz4.c): the last 5 bytes are always literals, and the last match
# must start at least 12 bytes before the end of the block.
_MINMATCH = 4
_LASTLITERALS = 5
_MFLIMIT = 12
_MAX_OFFSET = 0xFFFF
_TABLE_LIMIT = 1 << 17  # positions the pure compressor remembers at most

_M32 = 0xFFFFFFFF
_P1, _P2, _P3, _P4, _P5 = 2654435761, 2246822519, 3266489917, 668265263, 374761393


class LZ4BlockError(Ds4labError, ValueError):
    """An LZ4 block that is malformed or does not decode to exactly the expected size."""


# ---------------------------------------------------------------------------------------------
# XXH32


def xxh32_pure(data: bytes, seed: int = 0) -> int:
    """XXH32 of `data` (the reference algorithm, in Python)."""
    data = bytes(data)
    n = len(data)
    seed &= _M32
    pos = 0
    if n >= 16:
        v1 = (seed + _P1 + _P2) & _M32
        v2 = (seed + _P2) & _M32
        v3 = seed
        v4 = (seed - _P1) & _M32
        stripes = n // 16
        words = struct.unpack_from(f"<{stripes * 4}I", data)
        for i in range(0, stripes * 4, 4):
            v1 = (v1 + words[i] * _P2) & _M32
            v1 = (((v1 << 13) | (v1 >> 19)) * _P1) & _M32
            v2 = (v2 + words[i + 1] * _P2) & _M32
            v2 = (((v2 << 13) | (v2 >> 19)) * _P1) & _M32
            v3 = (v3 + words[i + 2] * _P2) & _M32
            v3 = (((v3 << 13) | (v3 >> 19)) * _P1) & _M32
            v4 = (v4 + words[i + 3] * _P2) & _M32
            v4 = (((v4 << 13) | (v4 >> 19)) * _P1) & _M32
        h = (((v1 << 1) | (v1 >> 31)) + ((v2 << 7) | (v2 >> 25))
             + ((v3 << 12) | (v3 >> 20)) + ((v4 << 18) | (v4 >> 14))) & _M32
        pos = stripes * 16
    else:
        h = (seed + _P5) & _M32
    h = (h + n) & _M32
    while pos + 4 <= n:
        (w,) = struct.unpack_from("<I", data, pos)
        h = (h + w * _P3) & _M32
        h = (((h << 17) | (h >> 15)) * _P4) & _M32
        pos += 4
    while pos < n:
        h = (h + data[pos] * _P5) & _M32
        h = (((h << 11) | (h >> 21)) * _P1) & _M32
        pos += 1
    h ^= h >> 15
    h = (h * _P2) & _M32
    h ^= h >> 13
    h = (h * _P3) & _M32
    h ^= h >> 16
    return h


def xxh32(data: bytes, seed: int = 0) -> int:
    """XXH32 of `data` with `seed` (ds4 uses seed 0), through `xxhash` when it is installed."""
    if _xxhash is not None:
        return _xxhash.xxh32_intdigest(data, seed & _M32)
    return xxh32_pure(data, seed)


# ---------------------------------------------------------------------------------------------
# LZ4 block format

_NOT_FF = re.compile(rb"[^\xff]")


def _read_length(src: bytes, ip: int, base: int) -> tuple[int, int]:
    """A 4-bit length field of 15 continues in bytes (each 255 means "more"); returns (length, ip)."""
    # A regex finds the end of a 0xFF run in C, so a hostile run of millions of 0xFF bytes costs
    # one scan rather than a Python loop per byte.
    m = _NOT_FF.search(src, ip)
    if m is None:
        raise LZ4BlockError(f"length extension runs past the end of the block (from byte {ip})")
    end = m.start()
    return base + 255 * (end - ip) + src[end], end + 1


def lz4_block_decompress_pure(src: bytes, raw_size: int) -> bytes:
    """Decode one LZ4 block that must decode to exactly `raw_size` bytes (Python).

    As strict as lz4's `LZ4_decompress_safe` plus ds4's exact-size check: the block must end with
    a literal-only sequence that consumes the input exactly, no match may reach into the last 5
    output bytes or start after the last 12, offsets must point inside the output, and the output
    must be exactly `raw_size` bytes. Anything else raises LZ4BlockError; the output never grows
    past `raw_size`.
    """
    src = bytes(src)
    n = len(src)
    if raw_size < 0:
        raise LZ4BlockError(f"raw size {raw_size} is negative")
    if raw_size == 0:
        # lz4's rule for an empty output: the only valid block is the single token 0x00.
        if src != b"\x00":
            raise LZ4BlockError(f"a block for 0 bytes must be the single byte 00, found {n} bytes")
        return b""
    out = bytearray()
    ip = 0
    while True:
        if ip >= n:
            raise LZ4BlockError("block ends after a match: the last sequence must be literals only")
        token = src[ip]
        ip += 1
        lit = token >> 4
        if lit == 15:
            lit, ip = _read_length(src, ip, 15)
        lit_end = len(out) + lit
        # Near either end of the block only the final, literal-only sequence may follow (the
        # same test lz4.c makes): it must consume the input exactly and fill at most the output.
        if lit_end > raw_size - _MFLIMIT or ip + lit > n - (2 + 1 + _LASTLITERALS):
            if ip + lit != n:
                raise LZ4BlockError(f"last literals at byte {ip} ({lit} bytes) do not end exactly at the "
                                    f"block's end ({n} bytes)")
            if lit_end > raw_size:
                raise LZ4BlockError(f"literals would make {lit_end} bytes, more than the {raw_size} expected")
            out += src[ip:n]
            break
        out += src[ip:ip + lit]
        ip += lit
        offset = src[ip] | (src[ip + 1] << 8)
        ip += 2
        mlen = token & 15
        if mlen == 15:
            mlen, ip = _read_length(src, ip, 15)
        mlen += _MINMATCH
        if offset == 0 or offset > len(out):
            raise LZ4BlockError(f"match offset {offset} at byte {ip - 2} points outside the {len(out)} bytes "
                                f"decoded so far")
        if len(out) + mlen > raw_size - _LASTLITERALS:
            raise LZ4BlockError(f"match of {mlen} bytes at output {len(out)} reaches into the last "
                                f"{_LASTLITERALS} bytes of a {raw_size}-byte block")
        start = len(out) - offset
        if mlen <= offset:
            out += out[start:start + mlen]
        else:
            # Overlapping match: the copy repeats the last `offset` bytes as a pattern.
            pattern = bytes(out[start:])
            out += (pattern * (mlen // offset + 1))[:mlen]
    if len(out) != raw_size:
        raise LZ4BlockError(f"block decodes to {len(out)} bytes, {raw_size} expected")
    return bytes(out)


def lz4_block_decompress(src: bytes, raw_size: int) -> bytes:
    """Decode one LZ4 block to exactly `raw_size` bytes (through `lz4` when installed).

    Any malformed block, or one that decodes to a different size, raises LZ4BlockError. One
    difference from the pure decoder: liblz4 tolerates a match offset of 0 (invalid by the block
    format) and decodes garbage; inside a region the chunk's XXH32 still catches that.
    """
    if _lz4block is None or raw_size <= 0:
        return lz4_block_decompress_pure(src, raw_size)
    try:
        out = _lz4block.decompress(src, uncompressed_size=raw_size)
    except _lz4block.LZ4BlockError as exc:  # lz4 raises its own type, not a ValueError
        raise LZ4BlockError(f"malformed LZ4 block: {exc}") from None
    if len(out) != raw_size:
        raise LZ4BlockError(f"block decodes to {len(out)} bytes, {raw_size} expected")
    return out


def compress_bound(size: int) -> int:
    """LZ4_compressBound: the largest block LZ4 can emit for `size` input bytes."""
    return size + size // 255 + 16


def _put_length(out: bytearray, length: int) -> None:
    """The continuation bytes of a length whose 4-bit field was set to 15."""
    rest = length - 15
    out += b"\xff" * (rest // 255)
    out.append(rest % 255)


def _common_length(src: bytes, a: int, b: int, limit: int) -> int:
    """How many bytes from `b` (up to `limit`) equal those from the earlier position `a`."""
    n = 0
    step = 64
    # Compare whole slices first (in C), halving the step at the first difference.
    while step:
        while b + n + step <= limit and src[a + n:a + n + step] == src[b + n:b + n + step]:
            n += step
        step >>= 1
    return n


def lz4_block_compress_pure(src: bytes) -> bytes:
    """A valid LZ4 block for `src` (Python): greedy, one hash-table candidate per 4-byte key.

    Obeys the block format's end rules (no match starts after `len - 12`, no match reaches into
    the last 5 bytes), so lz4's own decoder accepts it. Like LZ4's fast mode it steps faster
    through input that keeps missing, so incompressible data costs less per byte.
    """
    src = bytes(src)
    n = len(src)
    out = bytearray()
    anchor = 0
    if n > _MFLIMIT:
        last_match_start = n - _MFLIMIT  # a match may start at most here
        match_limit = n - _LASTLITERALS  # and end at most here
        table: dict[bytes, int] = {}
        pos = 0
        misses = 0
        while pos <= last_match_start:
            if len(table) >= _TABLE_LIMIT:
                # Bound memory on big chunks; entries this old are mostly past LZ4's 64 KiB window.
                table.clear()
            key = src[pos:pos + 4]
            ref = table.get(key)
            table[key] = pos
            if ref is None or pos - ref > _MAX_OFFSET:
                misses += 1
                pos += 1 + (misses >> 6)
                continue
            misses = 0
            mlen = _MINMATCH + _common_length(src, ref + _MINMATCH, pos + _MINMATCH, match_limit)
            # Grow the match backwards over literals not yet emitted.
            while pos > anchor and ref > 0 and src[pos - 1] == src[ref - 1]:
                pos -= 1
                ref -= 1
                mlen += 1
            lit = pos - anchor
            ml = mlen - _MINMATCH
            out.append((min(lit, 15) << 4) | min(ml, 15))
            if lit >= 15:
                _put_length(out, lit)
            out += src[anchor:pos]
            out += (pos - ref).to_bytes(2, "little")
            if ml >= 15:
                _put_length(out, ml)
            anchor = pos + mlen
            # Index one position inside the match so runs that follow can find it.
            if anchor - 2 > pos:
                table[src[anchor - 2:anchor + 2]] = anchor - 2
            pos = anchor
    lit = n - anchor
    out.append(min(lit, 15) << 4)
    if lit >= 15:
        _put_length(out, lit)
    out += src[anchor:]
    return bytes(out)


def lz4_block_compress(src: bytes) -> bytes:
    """A valid LZ4 block for `src`: LZ4-HC level 1 as ds4 writes it when `lz4` is installed,
    otherwise the pure-Python greedy compressor."""
    if _lz4block is not None:
        return _lz4block.compress(src, mode="high_compression", compression=1, store_size=False)
    return lz4_block_compress_pure(src)


# ---------------------------------------------------------------------------------------------
# Byte-4 transpose


def transpose4(chunk: bytes) -> bytes:
    """ds4's kv_shuffle_byte4: with m = len // 4, output[k*m + i] = chunk[4*i + k] for the four
    byte positions k, then the `len % 4` tail bytes unchanged."""
    m = len(chunk) >> 2
    words = np.frombuffer(chunk, np.uint8, count=4 * m).reshape(m, 4)
    return words.T.tobytes() + bytes(chunk[4 * m:])


def untranspose4(shuffled: bytes) -> bytes:
    """The inverse of `transpose4` (ds4's kv_unshuffle_byte4)."""
    m = len(shuffled) >> 2
    streams = np.frombuffer(shuffled, np.uint8, count=4 * m).reshape(4, m)
    return streams.T.tobytes() + bytes(shuffled[4 * m:])


# ---------------------------------------------------------------------------------------------
# Region


def _check_chunk_log2(chunk_log2: int) -> int:
    if not MIN_CHUNK_LOG2 <= chunk_log2 <= MAX_CHUNK_LOG2:
        raise ValueError(f"chunk_log2 {chunk_log2} outside {MIN_CHUNK_LOG2}..{MAX_CHUNK_LOG2} (chunks up to 64 MiB)")
    return 1 << chunk_log2


def encode_region(payload: bytes, chunk_log2: int = DEFAULT_CHUNK_LOG2) -> bytes:
    """The LZ4 region ds4 writes for `payload`: preamble, then per chunk the record (raw size,
    compressed size, XXH32 of the raw bytes) and the LZ4 block of the transposed chunk.

    An empty payload has no LZ4 form (ds4 stores it raw and its reader refuses an empty region),
    so it raises ValueError. Whether the result is worth storing: `compression_worthwhile`.
    """
    chunk = _check_chunk_log2(chunk_log2)
    view = memoryview(payload).cast("B")
    total = len(view)
    if total == 0:
        raise ValueError("an empty payload is stored raw: the LZ4 region cannot be empty")
    count = -(-total // chunk)
    parts = [_PREAMBLE.pack(total, count)]
    for start in range(0, total, chunk):
        raw = bytes(view[start:start + chunk])
        block = lz4_block_compress(transpose4(raw))
        parts += [_RECORD.pack(len(raw), len(block), xxh32(raw)), block]
    return b"".join(parts)


def compression_worthwhile(raw_size: int, encoded_size: int) -> bool:
    """Whether to store the LZ4 region rather than the raw payload: ds4 (PR #186) keeps the raw
    bytes when compression shrinks the payload by less than 1/64 of its size."""
    return raw_size > 0 and 64 * (raw_size - encoded_size) >= raw_size


def decode_region(buf, offset: int, length: int, path, chunk_log2: int) -> bytes:
    """The payload stored in the LZ4 region `buf[offset:offset+length]` (chunks of 2**chunk_log2
    bytes, header byte 22), checked as ds4's reader checks it.

    The preamble's counts and sizes are checked against `length` and the chunk size before
    anything is allocated: chunk_count == ceil(total / chunk), room for every record, and a total
    of at most 256 bytes per region byte. Then each record: every chunk but the last exactly one
    chunk size, the raw sizes summing to the total, compressed sizes within LZ4's bound and the
    region, each block decoding to exactly its raw size, and the XXH32 of the un-transposed bytes
    matching; nothing may follow the last chunk. Every problem raises KVCFormatError(path,
    "field: problem", offset=absolute byte offset in `buf`).
    """
    def fail(what: str, at: int) -> KVCFormatError:
        return KVCFormatError(path, what, offset=at)

    if not MIN_CHUNK_LOG2 <= chunk_log2 <= MAX_CHUNK_LOG2:
        raise fail(f"chunk_log2: {chunk_log2} outside {MIN_CHUNK_LOG2}..{MAX_CHUNK_LOG2} (chunks up to 64 MiB)", 22)
    chunk = 1 << chunk_log2
    if offset < 0 or length < 0 or offset + length > len(buf):
        raise fail(f"payload_bytes: the LZ4 region of {length} bytes at {offset} extends past the end of the "
                   f"file ({len(buf)} bytes)", offset)
    view = memoryview(buf)[offset:offset + length]
    if length < _PREAMBLE.size:
        raise fail(f"region preamble: needs {_PREAMBLE.size} bytes, the region has {length}", offset)
    total, count = _PREAMBLE.unpack_from(view, 0)
    body = length - _PREAMBLE.size
    if total == 0:
        raise fail("uncompressed_total: 0 (an empty payload is stored raw, never as an LZ4 region)", offset)
    expected = -(-total // chunk)
    if count != expected:
        raise fail(f"chunk_count: {count}, but {total} bytes in chunks of {chunk} make {expected}", offset + 8)
    if count * _RECORD.size > body:
        raise fail(f"chunk_count: {count} records need {count * _RECORD.size} bytes, the region has {body} after "
                   f"its preamble", offset + 8)
    if -(-total // _MAX_EXPANSION) > body:
        raise fail(f"uncompressed_total: {total} bytes from a {body}-byte region is more than LZ4's "
                   f"{_MAX_EXPANSION}x maximum expansion", offset)
    # Scratch is never larger than the smaller of the chunk and the whole payload.
    largest = min(chunk, total)
    block_bound = compress_bound(largest)
    pos = _PREAMBLE.size
    seen = 0
    parts = []
    for i in range(count):
        at = offset + pos
        if length - pos < _RECORD.size:
            raise fail(f"chunk {i} record: needs {_RECORD.size} bytes, the region has {length - pos} left", at)
        raw_size, comp_size, stored_sum = _RECORD.unpack_from(view, pos)
        final = i == count - 1
        if raw_size == 0 or raw_size > largest:
            raise fail(f"chunk {i} raw_size: {raw_size} outside 1..{largest}", at)
        if not final and raw_size != chunk:
            raise fail(f"chunk {i} raw_size: {raw_size}, but every chunk except the last holds {chunk} bytes", at)
        if final and seen + raw_size != total:
            raise fail(f"chunk {i} raw_size: the raw sizes add up to {seen + raw_size}, uncompressed_total "
                       f"says {total}", at)
        if comp_size == 0 or comp_size > block_bound:
            raise fail(f"chunk {i} compressed_size: {comp_size} outside 1..{block_bound} (LZ4's bound for "
                       f"{largest} bytes)", at + 4)
        if comp_size > length - pos - _RECORD.size:
            raise fail(f"chunk {i} compressed_size: {comp_size} bytes, the region has "
                       f"{length - pos - _RECORD.size} left", at + 4)
        pos += _RECORD.size
        try:
            shuffled = lz4_block_decompress(view[pos:pos + comp_size], raw_size)
        except LZ4BlockError as exc:
            raise fail(f"chunk {i} LZ4 block: {exc}", offset + pos) from None
        raw = untranspose4(shuffled)
        actual = xxh32(raw)
        if actual != stored_sum:
            raise fail(f"chunk {i} xxh32: stored {stored_sum:#010x}, the decoded bytes hash to {actual:#010x}",
                       at + 8)
        parts.append(raw)
        seen += raw_size
        pos += comp_size
    if pos != length:
        raise fail(f"payload_bytes: {length - pos} bytes follow the last chunk inside the region", offset + pos)
    return b"".join(parts)
