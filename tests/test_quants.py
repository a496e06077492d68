"""ds4lab.quants: numpy and MLX decoders are bit-exact with gguf-py on random and real tensors."""

from __future__ import annotations

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4lab.quants import (
    FORMATS,
    QuantError,
    dequantize,
    dequantize_mx,
    gather_experts,
    quantize_q8_0,
    random_blocks,
    row_bytes,
    tensor_bytes,
)

BLOCK_TYPES = ["Q8_0", "Q2_K", "Q4_K", "IQ2_XXS"]
ALL_TYPES = ["F32", "F16", "BF16", *BLOCK_TYPES, "I32"]
# Byte offsets of the f16 scales (d, and dmin for the K-quants) in each block.
F16_SCALE_OFFSETS = {"Q8_0": [0], "Q2_K": [80, 82], "Q4_K": [0, 2], "IQ2_XXS": [0]}
# (word dtype, exponent mask, lowest exponent bit) of the float words of the plain float types.
FLOAT_EXPONENT = {
    "F32": (np.uint32, 0x7F800000, 0x00800000),
    "F16": (np.uint16, 0x7C00, 0x0400),
    "BF16": (np.uint16, 0x7F80, 0x0080),
}


def reference(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> np.ndarray:
    """gguf-py's decoding of `raw` (I32, which gguf-py does not decode, is just reinterpreted)."""
    raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if type_name == "I32":
        return raw.view(np.int32).reshape(shape)
    rows = raw.reshape(int(np.prod(shape[:-1])), -1)
    return gguf.quants.dequantize(rows, GGMLQuantizationType[type_name]).reshape(shape)


def finite_words(words: np.ndarray, exp_mask: int, exp_lsb: int) -> np.ndarray:
    """Make random float bit patterns finite: an all-ones exponent loses its lowest bit."""
    nonfinite = (words & exp_mask) == exp_mask
    return np.where(nonfinite, words ^ words.dtype.type(exp_lsb), words)


def random_bytes(type_name: str, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Fully random block bytes, except that every f16 scale / float value is finite."""
    fmt = FORMATS[type_name]
    raw = rng.integers(0, 256, size=(n_blocks, fmt.block_bytes), dtype=np.uint8)
    if type_name in FLOAT_EXPONENT:
        dtype, exp_mask, exp_lsb = FLOAT_EXPONENT[type_name]
        return finite_words(raw.view(dtype), exp_mask, exp_lsb).view(np.uint8)
    for offset in F16_SCALE_OFFSETS.get(type_name, []):
        field = np.ascontiguousarray(raw[:, offset : offset + 2]).view(np.uint16)
        raw[:, offset : offset + 2] = finite_words(field, 0x7C00, 0x0400).view(np.uint8)
    return raw


def shape_for(type_name: str, n_blocks: int) -> tuple[int, int]:
    n_elems = n_blocks * FORMATS[type_name].block_elems
    return (n_elems // 512, 512)


def assert_decoders_match_reference(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> None:
    expected = reference(raw, type_name, shape)
    if type_name != "I32":
        assert not np.isnan(expected).any()
    got_np = dequantize(raw, type_name, shape)
    got_mx = np.array(dequantize_mx(mx.array(raw), type_name, shape))
    for got in (got_np, got_mx):
        assert got.dtype == (np.int32 if type_name == "I32" else np.float32)
        assert got.shape == shape
        assert np.array_equal(got, expected)


def test_formats_match_gguf_py():
    assert set(FORMATS) == set(ALL_TYPES)
    for name, fmt in FORMATS.items():
        qtype = GGMLQuantizationType[name]
        assert (fmt.name, fmt.ggml_type) == (name, int(qtype))
        assert (fmt.block_elems, fmt.block_bytes) == GGML_QUANT_SIZES[qtype]
    assert row_bytes("Q2_K", 512) == 168
    assert row_bytes("IQ2_XXS", 4096) == 16 * 66
    assert tensor_bytes("Q8_0", (3, 2, 64)) == 3 * 2 * 68
    assert tensor_bytes("F32", (7,)) == 28


@pytest.mark.parametrize("type_name", ALL_TYPES)
def test_random_blocks_decode_like_gguf_py(type_name):
    n_blocks = 1024 if FORMATS[type_name].block_elems > 1 else 8192
    raw = random_blocks(type_name, n_blocks, np.random.default_rng(1), d=0.01)
    assert raw.shape == (n_blocks, FORMATS[type_name].block_bytes) and raw.dtype == np.uint8
    assert_decoders_match_reference(raw, type_name, shape_for(type_name, n_blocks))


@pytest.mark.parametrize("type_name", ALL_TYPES)
def test_fully_random_bytes_decode_like_gguf_py(type_name):
    n_blocks = 1024 if FORMATS[type_name].block_elems > 1 else 8192
    raw = random_bytes(type_name, n_blocks, np.random.default_rng(2))
    assert_decoders_match_reference(raw, type_name, shape_for(type_name, n_blocks))


@settings(max_examples=25, deadline=None)
@given(
    type_name=st.sampled_from(ALL_TYPES),
    seed=st.integers(0, 2**32 - 1),
    rows=st.integers(1, 3),
    blocks_per_row=st.integers(1, 3),
)
def test_any_shape_decodes_like_gguf_py(type_name, seed, rows, blocks_per_row):
    raw = random_bytes(type_name, rows * blocks_per_row, np.random.default_rng(seed))
    shape = (rows, blocks_per_row * FORMATS[type_name].block_elems)
    assert_decoders_match_reference(raw, type_name, shape)


def test_every_f16_scale_widens_exactly():
    # All 63488 finite f16 bit patterns as the Q8_0 scale d, with every int8 value once.
    d = np.arange(1 << 16, dtype=np.uint16)
    d = d[(d & 0x7C00) != 0x7C00]
    raw = np.zeros((len(d), 34), dtype=np.uint8)
    raw[:, :2] = d.view(np.uint8).reshape(-1, 2)
    raw[:, 2:] = np.arange(len(d) * 32).reshape(-1, 32) % 256
    assert_decoders_match_reference(raw, "Q8_0", (len(d), 32))


def test_accepts_any_byte_buffer(tmp_path):
    raw = random_blocks("Q4_K", 8, np.random.default_rng(3), d=0.01)
    expected = dequantize(raw, "Q4_K", (4, 512))
    memmap_path = tmp_path / "blocks.bin"
    raw.tofile(memmap_path)
    for data in (raw.tobytes(), memoryview(raw.tobytes()), np.memmap(memmap_path, mode="r"), raw.view(np.uint32)):
        assert np.array_equal(dequantize(data, "Q4_K", (4, 512)), expected)


def test_gguf_dims_reverse_to_numpy_shape():
    values = np.arange(2 * 3 * 32, dtype=np.float32)  # GGUF dims (32, 3, 2)
    got = dequantize(values, "F32", (2, 3, 32))
    assert np.array_equal(got, values.reshape(2, 3, 32))
    assert np.array_equal(np.array(dequantize_mx(mx.array(values), "F32", (2, 3, 32))), got)


@pytest.mark.parametrize("type_name", BLOCK_TYPES)
def test_gather_experts_matches_numpy(type_name):
    n_expert, rows, cols = 8, 16, 512
    rng = np.random.default_rng(4)
    expert_bytes = rows * row_bytes(type_name, cols)
    n_blocks = n_expert * rows * cols // FORMATS[type_name].block_elems
    raw = random_blocks(type_name, n_blocks, rng, d=0.01).reshape(n_expert, expert_bytes)
    ids = rng.integers(0, n_expert, size=(5, 6)).astype(np.int32)
    full = dequantize(raw, type_name, (n_expert, rows, cols))

    got = gather_experts(mx.array(raw), mx.array(ids), type_name, rows, cols)
    assert got.shape == (5, 6, rows, cols) and got.dtype == mx.float32
    assert np.array_equal(np.array(got), full[ids])

    # The [n_expert, rows, row_bytes] layout GGUFReader gives works too, as do flat ids.
    by_row = mx.array(raw.reshape(n_expert, rows, -1))
    assert np.array_equal(np.array(gather_experts(by_row, mx.array(ids[0]), type_name, rows, cols)), full[ids[0]])


def test_quantize_q8_0_matches_gguf_py():
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((6, 4, 256)) * rng.uniform(1e-4, 1e3, (6, 4, 1))).astype(np.float32)
    x[0, 0, :32] = 0  # d == 0
    x[0, 1, :32] = np.arange(-16, 16) + 0.5  # exact ties once scaled ...
    x[0, 1, 0] = 127  # ... by d == 1
    got = quantize_q8_0(x)
    assert got.shape == (6, 4, row_bytes("Q8_0", 256)) and got.dtype == np.uint8
    assert np.array_equal(got, gguf.quants.quantize(x, GGMLQuantizationType.Q8_0))


@settings(max_examples=25, deadline=None)
@given(values=st.lists(st.floats(-1e4, 1e4, allow_nan=False, width=32), min_size=32, max_size=32))
def test_quantize_q8_0_any_block(values):
    x = np.array(values, dtype=np.float32)
    assert np.array_equal(quantize_q8_0(x), gguf.quants.quantize(x, GGMLQuantizationType.Q8_0))


def test_random_blocks_scales_and_determinism():
    def draw(type_name, **kw):
        return random_blocks(type_name, 512, np.random.default_rng(6), d=0.02, **kw)

    assert np.array_equal(draw("IQ2_XXS"), draw("IQ2_XXS"))
    q2k = draw("Q2_K")
    d = np.ascontiguousarray(q2k[:, 80:82]).view(np.float16).astype(np.float32)
    dmin = np.ascontiguousarray(q2k[:, 82:84]).view(np.float16).astype(np.float32)
    assert 0.02 * 0.749 <= d.min() and d.max() <= 0.02 * 1.251
    assert 0.03 * 0.749 <= dmin.min() and dmin.max() <= 0.03 * 1.251
    q4k = draw("Q4_K", dmin=0.1, jitter=(1.0, 1.0))
    assert set(np.ascontiguousarray(q4k[:, 0:4]).view(np.float16).ravel()) == {np.float16(0.02), np.float16(0.1)}


def test_bad_inputs_raise_quant_error():
    raw = np.zeros(2 * 84, dtype=np.uint8)
    with pytest.raises(QuantError, match=r"Q2_K: got 168 bytes, but shape \(3, 256\) needs 252 bytes"):
        dequantize(raw, "Q2_K", (3, 256))
    with pytest.raises(QuantError, match="Q2_K: got 168 bytes"):
        dequantize_mx(mx.array(raw), "Q2_K", (3, 256))
    with pytest.raises(QuantError, match="IQ2_XXS: 100 values is not a multiple of the block size 256"):
        dequantize(raw, "IQ2_XXS", (100,))
    with pytest.raises(QuantError, match="Q4_0"):
        dequantize(raw, "Q4_0", (256,))
    with pytest.raises(QuantError, match="Q8_0: 33 values"):
        quantize_q8_0(np.zeros(33, dtype=np.float32))
    with pytest.raises(QuantError, match="Q8_0: has no dmin"):
        random_blocks("Q8_0", 1, np.random.default_rng(), d=1.0, dmin=1.0)
    with pytest.raises(QuantError, match=r"Q2_K: expert bytes of shape \(2, 84\)"):
        gather_experts(mx.array(raw.reshape(2, 84)), mx.array([0]), "Q2_K", 2, 256)
    assert issubclass(QuantError, ValueError)


def test_oracle_tensors_decode_like_gguf_py(tiny_a_reader):
    seen = set()
    for tensor in tiny_a_reader.tensors:
        type_name = tensor.tensor_type.name
        shape = tuple(int(n) for n in reversed(tensor.shape))
        expected = tensor.data if type_name == "I32" else gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        expected = expected.reshape(shape)
        assert np.array_equal(dequantize(tensor.data, type_name, shape), expected), tensor.name
        got_mx = dequantize_mx(mx.array(tensor.data.view(np.uint8)), type_name, shape)
        assert np.array_equal(np.array(got_mx), expected), tensor.name
        seen.add(type_name)
    assert seen == {"F32", "F16", "Q8_0", "IQ2_XXS", "Q2_K", "I32"}


@pytest.mark.parametrize("name", ["blk.0.ffn_gate_exps.weight", "blk.0.ffn_down_exps.weight"])
def test_oracle_experts_gather_like_numpy(tiny_a_reader, name):
    tensor = next(t for t in tiny_a_reader.tensors if t.name == name)
    cols, rows, n_expert = (int(n) for n in tensor.shape)
    full = dequantize(tensor.data, tensor.tensor_type.name, (n_expert, rows, cols))
    ids = np.random.default_rng(7).integers(0, n_expert, size=(4, 6)).astype(np.int32)
    got = gather_experts(mx.array(tensor.data), mx.array(ids), tensor.tensor_type.name, rows, cols)
    assert np.array_equal(np.array(got), full[ids])
