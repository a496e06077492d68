"""Hostile .kv files: ≥ 10,000 mutations of valid files (raw and LZ4 envelopes, with trailers)
raise KVCFormatError or read cleanly — never another exception, and never an allocation beyond
what the file's bytes can justify."""

from __future__ import annotations

import functools
import struct
import tempfile
import tracemalloc
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds4lab.errors import KVCFormatError
from ds4lab.kvc import read, write
from ds4lab.kvc.header import KVCHeader
from ds4lab.kvc.payload import BLOCKS, DSV4_MAGIC, FIELDS, encode, frontier_shape
from ds4lab.kvc.trailers import Trailer

RATIOS = (0, 4, 128, 4)
HEAD, INDEX, VOCAB, T = 8, 4, 16, 13


def _valid_file() -> bytes:
    """A small, complete file: every block kind, a title and a tool map."""
    gen = np.random.default_rng(0)

    def rows(shape) -> np.ndarray:  # KV-like values (bf16-representable) so the LZ4 envelope is worth writing
        x = gen.standard_normal(shape).astype(np.float32)
        return (x.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)

    words = dict(zip(FIELDS, [DSV4_MAGIC, 2, 64, 64, 8, 8, 18, T, len(RATIOS), HEAD, INDEX, VOCAB, 8], strict=True))
    layers, n_comp, n_index = [], [], []
    for ratio in RATIOS:
        arrays = {"raw_kv": rows((8, HEAD))}
        if ratio:
            arrays |= {"comp_kv": rows((T // ratio, HEAD)),
                       "attn_state_kv": rows(frontier_shape(ratio, HEAD)),
                       "attn_state_score": rows(frontier_shape(ratio, HEAD))}
        if ratio == 4:
            arrays |= {"index_comp_kv": rows((T // 4, INDEX)),
                       "index_state_kv": rows(frontier_shape(4, INDEX)),
                       "index_state_score": rows(frontier_shape(4, INDEX))}
        assert set(arrays) <= set(BLOCKS)
        layers.append(arrays)
        n_comp.append(T // ratio if ratio else 0)
        n_index.append(T // 4 if ratio == 4 else 0)
    body = b"".join(encode(words, np.arange(T), rows(VOCAB), n_comp, n_index, layers))
    text = b"<|begin|>hello world"
    trailer = Trailer(title=b"a title", tool_map=[(b"call_1", b"<tool_calls>x</tool_calls>")])
    header = KVCHeader(quant_bits=2, reason=2, ext_flags=trailer.ext_flags(), tokens=T, ctx_size=64,
                       created_at=1, last_used=2, payload_bytes=len(body), text_bytes=len(text))
    return header.pack() + text + body + trailer.encode()


@functools.cache
def _originals() -> tuple[bytes, bytes]:
    folder = Path(tempfile.mkdtemp())
    raw = _valid_file()
    (folder / "raw.kv").write_bytes(raw)
    packed = write(read(folder / "raw.kv", RATIOS), folder / "lz4.kv", compress=True, chunk_log2=9).read_bytes()
    assert packed[3] == 2 and packed[21] == 2  # the LZ4 envelope really was written
    return raw, packed


def _touch_everything(path) -> None:
    f = read(path, RATIOS)
    f.summary()
    for il in range(len(RATIOS)):
        for array in f.arrays(il).values():
            assert len(array.tobytes()) == array.nbytes
    assert len(f.tokens.tobytes() + f.logits.tobytes()) == 4 * (len(f.tokens) + len(f.logits))
    f.trailer.encode()


mutation = st.one_of(
    st.tuples(st.just("truncate"), st.floats(0, 1)),
    st.tuples(st.just("flip"), st.lists(st.tuples(st.floats(0, 1), st.integers(0, 7)), min_size=1, max_size=8)),
    st.tuples(st.just("u32"), st.integers(0, 200), st.sampled_from([0, 1, 2**31 - 1, 2**31, 2**32 - 1, 1 << 20,
                                                                       4097, 65536])),
    st.tuples(st.just("u64"), st.sampled_from([24, 32, 40]), st.sampled_from([0, 2**63, 2**64 - 1, 1 << 40])),
    st.tuples(st.just("splice"), st.floats(0, 1), st.binary(max_size=64)),
)


def _mutate(data: bytes, m) -> bytes:
    out = bytearray(data)
    kind = m[0]
    if kind == "truncate":
        return bytes(out[:int(m[1] * len(out))])
    if kind == "flip":
        for where, bit in m[1] if out else []:
            out[min(int(where * len(out)), len(out) - 1)] ^= 1 << bit
    elif kind == "u32":  # oversized counts: header, text length, payload words, per-layer counts
        pos = 8 + 4 * m[1] if m[1] < 12 else 52 + 20 + 4 * (m[1] - 12)
        if pos + 4 <= len(out):
            struct.pack_into("<I", out, pos, m[2])
    elif kind == "u64":
        if m[1] + 8 <= len(out):
            struct.pack_into("<Q", out, m[1], m[2])
    else:
        at = int(m[1] * len(out))
        out[at:at + len(m[2])] = m[2]
    return bytes(out)


def _reads_or_refuses_cleanly(path, data: bytes, m) -> None:
    """Reading every part of a damaged file either works or raises KVCFormatError naming the
    file; memory stays bounded by the file (no allocation sized by a hostile field)."""
    path.write_bytes(data)
    tracemalloc.start()
    try:
        _touch_everything(path)
    except KVCFormatError as exc:
        assert str(path) in str(exc)
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    # Raw files are mapped, not copied; an LZ4 payload may decompress to its declared size,
    # which the reader bounds by 256 bytes per stored byte.
    assert peak <= 256 * len(data) + (1 << 20), (m, peak)


@settings(max_examples=5000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(which=st.integers(0, 1), m=mutation)
def test_mutated_files_fail_cleanly(tmp_path, which, m):
    _reads_or_refuses_cleanly(tmp_path / "x.kv", _mutate(_originals()[which], m), m)


@settings(max_examples=5000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(which=st.integers(0, 1), m=mutation, m2=mutation)
def test_compound_damage_fails_cleanly(tmp_path, which, m, m2):
    """The second half of the 10,000: two independent mutations of one file (compound damage)."""
    _reads_or_refuses_cleanly(tmp_path / "y.kv", _mutate(_mutate(_originals()[which], m), m2), (m, m2))
