"""The LZ4 payload region of ds4's compressed .kv files (PR #186 final layout): XXH32, the LZ4
block format both ways, the byte-4 transpose, and a region reader that refuses hostile input."""

from __future__ import annotations

import struct
from contextlib import contextmanager
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds4lab.errors import KVCFormatError
from ds4lab.kvc import lz4 as L

try:  # the accelerators are dev dependencies; without them only the interop tests are skipped
    import lz4.block as lz4block
    import xxhash
except ImportError:  # pragma: no cover - depends on the environment
    lz4block = xxhash = None
needs_packages = pytest.mark.skipif(lz4block is None or xxhash is None, reason="needs the lz4 and xxhash packages")

PATH = "test.kv"
SMALL_LOG2 = 12  # 4 KiB chunks keep multi-chunk regions small
CHUNK = 1 << SMALL_LOG2


@contextmanager
def pure_only():
    """Run the public functions on their pure-Python paths although lz4/xxhash are installed."""
    with mock.patch.object(L, "_lz4block", None), mock.patch.object(L, "_xxhash", None):
        yield


def hc1(data: bytes) -> bytes:
    return lz4block.compress(data, mode="high_compression", compression=1, store_size=False)


def structured(n: int) -> bytes:
    """KV-like bytes: float32 rows rounded to bf16, so the low two bytes of each word are zero."""
    rng = np.random.default_rng(n)
    words = rng.standard_normal((n + 3) // 4).astype(np.float32).view(np.uint32) & 0xFFFF0000
    return words.astype("<u4").tobytes()[:n]


def random_bytes(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def text_bytes(n: int) -> bytes:
    return (b"the quick brown fox " * (n // 20 + 1))[:n]


# ---------------------------------------------------------------------------------------------
# XXH32

# xxhsum 0.8 -H32 reference values (the ones ds4's own test_kv_lz4.c checks).
PATTERN_VECTORS = [(7, 0x02226FE7), (16, 0x96AC9FA6), (17, 0x3CDFB1A2), (23, 0x12A0921B), (31, 0xDF853FBF),
                   (32, 0xDA8072DC), (33, 0x3C8FD07D)]


@pytest.mark.parametrize("fn", [L.xxh32, L.xxh32_pure])
def test_xxh32_known_vectors(fn):
    assert fn(b"") == 0x02CC5D05
    assert fn(b"abc") == 0x32D153FF
    assert fn(bytes((i * 131 + 7) & 255 for i in range(100003))) == 0xF0EF88E1
    for n, want in PATTERN_VECTORS:
        assert fn(bytes((i * 37 + 11) & 255 for i in range(n))) == want


@needs_packages
@pytest.mark.parametrize("n", [*range(0, 40), 63, 64, 65, 1000, 4099])
def test_xxh32_pure_matches_xxhash(n):
    data = random_bytes(n, n)
    for seed in (0, 1, 0x9E3779B1, 0xFFFFFFFF):
        assert L.xxh32_pure(data, seed) == xxhash.xxh32_intdigest(data, seed)


# ---------------------------------------------------------------------------------------------
# Byte-4 transpose


def reference_transpose(data: bytes) -> bytes:
    """ds4's definition: stream b holds every 4th byte from b; the len % 4 tail passes through."""
    m = len(data) // 4
    out = bytearray(data)
    for b in range(4):
        for i in range(m):
            out[b * m + i] = data[i * 4 + b]
    return bytes(out)


@pytest.mark.parametrize("n", [*range(0, 70), 511, 512, 513, 4093, 4096, 4099])
def test_transpose_matches_ds4_definition_and_inverts(n):
    data = random_bytes(n, n)
    shuffled = L.transpose4(data)
    assert shuffled == reference_transpose(data)
    assert L.untranspose4(shuffled) == data


def test_transpose_groups_byte_positions():
    assert L.transpose4(b"ABCDabcd12") == b"AaBbCcDd12"


# ---------------------------------------------------------------------------------------------
# LZ4 block format

BLOCK_INPUTS = {
    "empty": b"",
    "one": b"x",
    "twelve": b"abcdefghijkl",
    "thirteen": b"abcabcabcabca",
    "zeros": bytes(100_000),
    "random": random_bytes(5000),
    "text": text_bytes(70_000),  # offsets up to the 64 KiB window
    "long-run-then-random": bytes(300) + random_bytes(300),
    "float32": np.linspace(0, 1, 20_000, dtype=np.float32).tobytes(),
    "kv-transposed": L.transpose4(structured(50_001)),
}


@needs_packages
@pytest.mark.parametrize("name", list(BLOCK_INPUTS))
def test_pure_compressor_output_decodes_everywhere(name):
    data = BLOCK_INPUTS[name]
    block = L.lz4_block_compress_pure(data)
    assert len(block) <= L.compress_bound(len(data))
    assert L.lz4_block_decompress_pure(block, len(data)) == data
    if data:  # python-lz4 refuses a zero-size destination
        assert lz4block.decompress(block, uncompressed_size=len(data)) == data


@needs_packages
@pytest.mark.parametrize("name", list(BLOCK_INPUTS))
def test_lz4_hc1_output_decodes_with_pure_decoder(name):
    data = BLOCK_INPUTS[name]
    assert L.lz4_block_decompress_pure(hc1(data), len(data)) == data
    assert L.lz4_block_decompress(L.lz4_block_compress(data), len(data)) == data


def test_pure_compressor_finds_redundancy():
    assert len(L.lz4_block_compress_pure(bytes(100_000))) < 500
    assert len(L.lz4_block_compress_pure(text_bytes(100_000))) < 1000


def seq(literals: bytes, offset: int, match_len: int) -> bytes:
    """One LZ4 sequence with short (< 15) literal and match lengths."""
    return bytes([(len(literals) << 4) | (match_len - 4)]) + literals + offset.to_bytes(2, "little")


def last(literals: bytes) -> bytes:
    return bytes([len(literals) << 4]) + literals


MALFORMED_BLOCKS = {
    "empty input": (b"", 5),
    "zero-size output needs the single 00 token": (b"\x10a", 0),
    "literals past the input": (b"\x50ab", 5),
    "output shorter than expected": (last(b"abcde"), 6),
    "output longer than expected": (last(b"abcdef"), 5),
    "ends after a match": (seq(b"abcdefghi", 4, 4), 13),
    "offset zero": (seq(b"abcdefghi", 0, 4) + last(b"stuvwxyz"), 21),
    "offset before the output": (seq(b"abcdefghi", 10, 4) + last(b"stuvwxyz"), 21),
    # A 19-byte match (nibble 15 + extension 0) ending 4 bytes before the end.
    "match into the last five bytes": (b"\x9fabcdefghi\x04\x00\x00" + last(b"wxyz"), 32),
    "match starting inside the last twelve": (seq(b"abcdefghi", 4, 4) + last(b"vwxyz"), 18),
    "length extension past the end": (b"\xf0\xff\xff", 1000),
    "match length extension past the end": (b"\x9fabcdefghi\x04\x00\xff", 1000),
    "trailing input after the last literals": (last(b"abcde") + b"\x00", 5),
}


@pytest.mark.parametrize("name", list(MALFORMED_BLOCKS))
def test_malformed_blocks_are_refused(name):
    src, raw_size = MALFORMED_BLOCKS[name]
    with pytest.raises(L.LZ4BlockError):
        L.lz4_block_decompress_pure(src, raw_size)
    if name == "offset zero":
        return  # liblz4 tolerates offset 0 (decoding garbage); a region's XXH32 catches that
    with pytest.raises(L.LZ4BlockError):
        L.lz4_block_decompress(src, raw_size)


@needs_packages
def test_well_formed_handmade_blocks_decode():
    block = seq(b"abcdefghi", 4, 4) + last(b"stuvwxyz")
    assert L.lz4_block_decompress_pure(block, 21) == b"abcdefghi" + b"fghi" + b"stuvwxyz"
    assert lz4block.decompress(block, uncompressed_size=21) == b"abcdefghifghistuvwxyz"
    # An overlapping match (offset 1) repeats the last byte.
    assert L.lz4_block_decompress_pure(seq(b"a", 1, 12) + last(b"bcdef"), 18) == b"a" * 13 + b"bcdef"
    # Offset 3 over 19 bytes repeats a 3-byte pattern.
    block = b"\x3fabc\x03\x00\x00" + last(b"vwxyz")
    assert L.lz4_block_decompress_pure(block, 27) == b"abc" * 7 + b"a" + b"vwxyz"
    assert L.lz4_block_decompress_pure(b"\x00", 0) == b""


def test_huge_length_extension_fails_fast():
    # A hostile literal length of 255 * 10**6 bytes must be refused, not decoded or looped over.
    src = b"\xf0" + b"\xff" * 1_000_000 + b"\x00"
    with pytest.raises(L.LZ4BlockError):
        L.lz4_block_decompress_pure(src, 1 << 20)


@settings(max_examples=1000, deadline=None)
@given(st.binary(max_size=64), st.integers(min_value=0, max_value=300))
def test_pure_decoder_never_escapes_on_random_input(src, raw_size):
    try:
        out = L.lz4_block_decompress_pure(src, raw_size)
    except L.LZ4BlockError:
        return
    assert len(out) == raw_size


# ---------------------------------------------------------------------------------------------
# Region round trips


SIZES = [1, 3, 4, 5, 1023, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK, 3 * CHUNK + 7]


@pytest.mark.parametrize("make", [random_bytes, structured, text_bytes, bytes])
@pytest.mark.parametrize("n", SIZES)
def test_region_round_trip(make, n):
    payload = make(n)
    region = L.encode_region(payload, SMALL_LOG2)
    total, count = struct.unpack_from("<QI", region)
    assert (total, count) == (n, -(-n // CHUNK))
    assert L.decode_region(region, 0, len(region), PATH, SMALL_LOG2) == payload


@pytest.mark.parametrize("n", [5, CHUNK + 3, 2 * CHUNK + 9])
def test_region_round_trip_pure_paths(n):
    payload = structured(n)
    with pure_only():
        region = L.encode_region(payload, SMALL_LOG2)
        assert L.decode_region(region, 0, len(region), PATH, SMALL_LOG2) == payload
    # The pure writer's region reads back through the native reader, and the other way round.
    assert L.decode_region(region, 0, len(region), PATH, SMALL_LOG2) == payload
    native = L.encode_region(payload, SMALL_LOG2)
    with pure_only():
        assert L.decode_region(native, 0, len(native), PATH, SMALL_LOG2) == payload


@needs_packages
def test_region_records_are_ds4s():
    payload = structured(CHUNK + 10)
    region = L.encode_region(payload, SMALL_LOG2)
    pos = 12
    for start in (0, CHUNK):
        raw = payload[start:start + CHUNK]
        raw_size, comp_size, checksum = struct.unpack_from("<III", region, pos)
        assert raw_size == len(raw) and checksum == xxhash.xxh32_intdigest(raw)  # of the raw, un-transposed bytes
        block = region[pos + 12:pos + 12 + comp_size]
        assert block == hc1(L.transpose4(raw))  # exactly what ds4's LZ4_compress_HC(level 1) writes
        pos += 12 + comp_size
    assert pos == len(region)


def test_float32_array_compresses_like_ds4_reports():
    payload = structured(1 << 20)
    region = L.encode_region(payload, 18)
    assert len(payload) / len(region) > 1.9
    assert L.compression_worthwhile(len(payload), len(region))
    assert L.decode_region(region, 0, len(region), PATH, 18) == payload


def test_region_inside_a_larger_file():
    payload = text_bytes(3 * CHUNK + 1)
    region = L.encode_region(payload, SMALL_LOG2)
    lead, trailer = b"H" * 97, b"TRAILER"
    buf = memoryview(lead + region + trailer)
    assert L.decode_region(buf, len(lead), len(region), PATH, SMALL_LOG2) == payload


def test_default_chunk_size_is_16_mib():
    region = L.encode_region(b"abc" * 1000)
    assert struct.unpack_from("<QI", region) == (3000, 1)
    assert L.DEFAULT_CHUNK_LOG2 == 24
    assert L.decode_region(region, 0, len(region), PATH, 24) == b"abc" * 1000


def test_empty_payload_and_bad_chunk_sizes_are_not_encoded():
    with pytest.raises(ValueError, match="stored raw"):
        L.encode_region(b"", SMALL_LOG2)
    for log2 in (0, 27):
        with pytest.raises(ValueError, match="chunk_log2"):
            L.encode_region(b"abc", log2)


def test_compression_worthwhile_is_the_1_64_rule():
    assert L.compression_worthwhile(6400, 6300)  # shrinks by exactly 1/64
    assert not L.compression_worthwhile(6400, 6301)
    assert not L.compression_worthwhile(6400, 7000)
    assert not L.compression_worthwhile(0, 0)
    assert L.compression_worthwhile(100, 1)


# ---------------------------------------------------------------------------------------------
# Hostile regions


def record(raw: bytes, *, raw_size: int | None = None, block: bytes | None = None, checksum: int | None = None
           ) -> bytes:
    """One chunk record, each field overridable so a test can break exactly one of them."""
    block = L.lz4_block_compress(L.transpose4(raw)) if block is None else block
    return struct.pack("<III", len(raw) if raw_size is None else raw_size, len(block),
                       L.xxh32(raw) if checksum is None else checksum) + block


def region_of(total: int, count: int, *records: bytes) -> bytes:
    return struct.pack("<QI", total, count) + b"".join(records)


def refused(region: bytes, match: str, chunk_log2: int = SMALL_LOG2, offset: int | None = None) -> KVCFormatError:
    with pytest.raises(KVCFormatError, match=match) as info:
        L.decode_region(region, 0, len(region), PATH, chunk_log2)
    if offset is not None:
        assert info.value.offset == offset
    assert info.value.path == PATH
    return info.value


SRC = text_bytes(5000)


def test_control_two_chunk_region_is_accepted():
    region = region_of(5000, 2, record(SRC[:CHUNK]), record(SRC[CHUNK:]))
    assert L.decode_region(region, 0, len(region), PATH, SMALL_LOG2) == SRC


def test_short_non_final_chunk_is_refused():
    region = region_of(5000, 2, record(SRC[:2048]), record(SRC[2048:]))
    refused(region, r"chunk 0 raw_size: 2048, but every chunk except the last holds 4096", offset=12)


def test_raw_sizes_must_add_up_to_the_total():
    region = region_of(5000, 2, record(SRC[:CHUNK]), record(text_bytes(1000)))
    refused(region, r"chunk 1 raw_size: the raw sizes add up to 5096")


@pytest.mark.parametrize("bad", [0, 1])
def test_checksum_mismatch_on_either_chunk(bad):
    records = [record(SRC[:CHUNK]), record(SRC[CHUNK:])]
    raw = [SRC[:CHUNK], SRC[CHUNK:]][bad]
    records[bad] = record(raw, checksum=L.xxh32(raw) ^ 1)
    at = 12 if bad == 0 else 12 + len(records[0])
    refused(region_of(5000, 2, *records), rf"chunk {bad} xxh32: stored", offset=at + 8)


def test_preamble_checks_come_before_any_allocation():
    refused(b"", r"region preamble: needs 12 bytes", offset=0)
    refused(b"\x01\x00\x00", r"region preamble")
    refused(region_of(0, 0), r"uncompressed_total: 0")
    refused(region_of(5000, 3, record(SRC)), r"chunk_count: 3, but 5000 bytes in chunks of 4096 make 2", offset=8)
    # Valid counts, but not enough bytes for the records they claim (ds4's test uses these).
    refused(region_of(16, 1), r"chunk_count: 1 records need 12 bytes", L.MAX_CHUNK_LOG2)
    huge = (1 << 26) * 8
    refused(region_of(huge, 8, bytes(8 * 12)), r"more than LZ4's 256x", L.MAX_CHUNK_LOG2)
    refused(region_of(2**64 - 1, 2**32 - 1), r"chunk_count")


@pytest.mark.parametrize("log2", [0, 27, 255, -1])
def test_chunk_size_out_of_range(log2):
    region = L.encode_region(SRC, SMALL_LOG2)
    refused(region, r"chunk_log2", log2)


def test_wrong_chunk_size_is_refused():
    region = L.encode_region(text_bytes(3 * CHUNK), SMALL_LOG2)
    refused(region, r"chunk_count", SMALL_LOG2 + 1)


def test_compressed_size_checks():
    raw = SRC[:50]  # one short chunk: small enough that the 256x bound never fires first
    refused(region_of(50, 1, record(raw, block=b"")), r"chunk 0 compressed_size: 0 outside", offset=16)
    refused(region_of(50, 1, record(raw)[:-1]), r"chunk 0 compressed_size: \d+ bytes, the region has", offset=16)
    refused(region_of(50, 1, record(raw, block=bytes(100))), r"outside 1\.\.66 \(LZ4's bound for 50 bytes\)")
    refused(region_of(50, 1, record(raw, raw_size=51)), r"chunk 0 raw_size: 51 outside 1\.\.50", offset=12)


def test_bad_block_is_named_with_its_offset():
    err = refused(region_of(50, 1, record(SRC[:50], block=b"\x50ab")), r"chunk 0 LZ4 block", offset=24)
    assert "chunk 0 LZ4 block" in err.problems[0]


def test_trailing_bytes_and_truncation():
    region = L.encode_region(text_bytes(3 * CHUNK + 7), SMALL_LOG2)
    refused(region + b"\x00", r"payload_bytes: 1 bytes follow the last chunk", offset=len(region))
    for cut in (len(region) - 1, len(region) // 2, 13, 12):
        refused(region[:cut], r"chunk|region")
    with pytest.raises(KVCFormatError, match=r"past the end of the file"):
        L.decode_region(region, 10, len(region), PATH, SMALL_LOG2)


FUZZ_PAYLOAD = structured(9 * CHUNK + 5)
FUZZ_REGION = L.encode_region(FUZZ_PAYLOAD, SMALL_LOG2)


def decode_or_refuse(region: bytes) -> None:
    """A damaged region is refused with KVCFormatError, or (when the damage changed nothing that
    matters, e.g. an equivalent match offset) decodes to exactly the original payload."""
    try:
        out = L.decode_region(region, 0, len(region), PATH, SMALL_LOG2)
    except KVCFormatError:
        return
    assert out == FUZZ_PAYLOAD


mutations = st.lists(st.tuples(st.integers(0, len(FUZZ_REGION) - 1), st.integers(1, 255)), min_size=1, max_size=8)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutations, st.one_of(st.none(), st.integers(0, len(FUZZ_REGION))))
def test_fuzz_mutated_regions(flips, cut):
    region = bytearray(FUZZ_REGION)
    for pos, xor in flips:
        region[pos] ^= xor
    decode_or_refuse(bytes(region[:cut]))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutations)
def test_fuzz_mutated_regions_pure(flips):
    region = bytearray(FUZZ_REGION)
    for pos, xor in flips:
        region[pos] ^= xor
    with pure_only():
        decode_or_refuse(bytes(region))


@settings(max_examples=1000, deadline=None)
@given(st.binary(min_size=0, max_size=200), st.integers(1, 30))
def test_fuzz_random_regions(data, log2):
    # Random bytes: refused with the file, a field and an offset inside the region (or the
    # chunk-size byte 22), or, if they happen to form a region, decoded within its bounds.
    try:
        out = L.decode_region(data, 0, len(data), PATH, log2)
    except KVCFormatError as exc:
        assert exc.path == str(PATH) and exc.offset is not None and ":" in exc.problems[0]
        assert 0 <= exc.offset <= max(len(data), 22), (exc.offset, len(data))
    else:
        assert len(out) <= 256 * len(data)
