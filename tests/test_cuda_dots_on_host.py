"""The routed-expert kernels' dot products (kernels/cuda/expert_dot_*.cuh), run on the host.

`test_cuda_sources` only compiles the CUDA kernels; what a lane decodes from the block bytes
is checked on a GPU. The part that decodes — one lane's share of R rows' dot products in a
block format, `ds4lab_expert_dot` — is plain arithmetic on bytes and floats, so it also
compiles as C++ for the host, with the few CUDA intrinsics it uses written out here
(`__byte_perm`, `__popc`, the float/int bit casts, f16). A warp is its 32 lanes run in turn and
their sums added, as the kernels' warp sum does. Compared with numpy's decode of the same
bytes (`ds4lab.quants.dequantize`) times the input, in float64: a wrong byte, shift, sign
or scale moves a row by far more than float32 rounding does.
"""

from __future__ import annotations

import ctypes
import os
import subprocess

import numpy as np
import pytest

from ds4lab.model import kernels
from ds4lab.quants import dequantize, random_blocks, row_bytes
from ds4lab.quants.tables import IQ2XXS_GRID_BYTES

# The CUDA device functions and types the dot headers use, for a host compiler.
_HOST_CUDA = r"""
#include <cstdint>
#include <cstring>
#include <cmath>
#define __device__
#define __forceinline__ inline
struct uint2 { uint32_t x, y; };
static inline uint2 make_uint2(uint32_t x, uint32_t y) { return uint2{x, y}; }
#define __shared__ static
static const struct { unsigned x; } threadIdx = {0}, blockDim = {1};
static inline void __syncthreads() {}
struct float4 { float x, y, z, w; };
struct uint4 { uint32_t x, y, z, w; };
static inline uint4 make_uint4(uint32_t x, uint32_t y, uint32_t z, uint32_t w) { return uint4{x, y, z, w}; }
struct __half { unsigned short bits; };
static inline __half __ushort_as_half(unsigned short b) { return __half{b}; }
static inline float __half2float(__half h) {
    const int e = (h.bits >> 10) & 31, m = h.bits & 1023;
    const float v = e == 0 ? std::ldexp((float)m, -24) : std::ldexp((float)(m | 1024), e - 25);
    return h.bits & 0x8000 ? -v : v;
}
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __int_as_float(int v) { float f; std::memcpy(&f, &v, 4); return f; }
static inline float __uint_as_float(uint32_t v) { float f; std::memcpy(&f, &v, 4); return f; }
static inline int __float_as_int(float f) { int v; std::memcpy(&v, &f, 4); return v; }
static inline uint32_t __float_as_uint(float f) { uint32_t v; std::memcpy(&v, &f, 4); return v; }
static inline int __popc(uint32_t v) { return __builtin_popcount(v); }
static inline uint32_t __byte_perm(uint32_t x, uint32_t y, uint32_t s) {
    const uint64_t bytes = ((uint64_t)y << 32) | x;
    uint32_t r = 0;
    for (int n = 0; n < 4; ++n) r |= (uint32_t)((bytes >> (8 * ((s >> (4 * n)) & 7))) & 0xff) << (8 * n);
    return r;
}
static inline uint32_t ds4lab_prmt(uint32_t x, uint32_t y, uint32_t s) {     // PTX prmt.b32, sign mode too
    const uint64_t bytes = ((uint64_t)y << 32) | x;
    uint32_t r = 0;
    for (int n = 0; n < 4; ++n) {
        const uint32_t nibble = (s >> (4 * n)) & 15, byte = (uint32_t)(bytes >> (8 * (nibble & 7))) & 0xff;
        r |= (nibble & 8 ? (byte & 0x80 ? 0xffu : 0u) : byte) << (8 * n);
    }
    return r;
}
"""

_DRIVER = r"""
template <int COLS, int R>
static void warp_dot(const uint8_t* const* w, const float* x, float* out, const uint2* grid) {
    DS4LAB_DOT_STAGE
    const uint8_t* rows[R];
    for (int r = 0; r < R; ++r) { rows[r] = w[r]; out[r] = 0.0f; }
    for (int lane = 0; lane < 32; ++lane) {
        float acc[R] = {};
        ds4lab_expert_dot<COLS, R>(rows, x, lane, acc DS4LAB_DOT_TABLES);
        for (int r = 0; r < R; ++r) out[r] += acc[r];
    }
}
#define ONE(COLS, R) extern "C" void dot_##COLS##_##R(const uint8_t* const* w, const float* x, float* out, \
    const uint2* grid) { warp_dot<COLS, R>(w, x, out, grid); }
ONE(256, 1) ONE(256, 2) ONE(768, 2) ONE(768, 4) ONE(1280, 2) ONE(2048, 1) ONE(2048, 2) ONE(2048, 4) ONE(4096, 2)
ONE(4096, 4)
"""
_SHAPES = [(256, 1), (256, 2), (768, 2), (768, 4), (1280, 2), (2048, 1), (2048, 2), (2048, 4), (4096, 2), (4096, 4)]


@pytest.fixture(scope="module", params=list(kernels._TYPES))
def host_dots(request, tmp_path_factory):
    """(type name, the compiled library) of one block format's dot header."""
    type_name = request.param
    name = kernels._TYPES[type_name]
    return type_name, _host_library(tmp_path_factory.mktemp(f"dots_{name}"), _DRIVER,
                                    "ds4lab_block.cuh", "expert_matvec_common.cuh", f"expert_dot_{name}.cuh")


def _host_library(folder, driver: str, *headers: str, prelude: str = _HOST_CUDA, std: str = "c++17") -> ctypes.CDLL:
    """`driver` after the CUDA headers (cut to what it uses) compiled for the host, loaded;
    `prelude` stands in for what CUDA provides."""
    (folder / "cuda_fp16.h").write_text("")          # the headers' include: the prelude replaces it
    source, library = folder / "host.cpp", folder / "host.so"
    source.write_text(f"{prelude}\n{kernels.header_for(driver, *headers)}\n{driver}\n")
    subprocess.run([os.environ.get("CXX", "c++"), f"-std={std}", "-O1", "-shared", "-fPIC", "-pthread",
                    f"-I{folder}", str(source), "-o", str(library)], check=True, capture_output=True)
    return ctypes.CDLL(str(library))


def _run(lib, type_name: str, raw: np.ndarray, x: np.ndarray, cols: int, r: int) -> np.ndarray:
    rows = [np.ascontiguousarray(raw[i]) for i in range(r)]
    pointers = (ctypes.c_void_p * r)(*[row.ctypes.data for row in rows])
    out = np.zeros(r, np.float32)
    grid = np.ascontiguousarray(IQ2XXS_GRID_BYTES, dtype=np.uint8)
    getattr(lib, f"dot_{cols}_{r}")(pointers, x.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p),
                                    grid.ctypes.data_as(ctypes.c_void_p))
    return out


@pytest.mark.parametrize("cols, r", _SHAPES)
def test_a_warps_lanes_add_up_to_the_rows_decoded_dot_products(host_dots, cols, r):
    type_name, lib = host_dots
    rng = np.random.default_rng(cols * 7 + r)
    n_bytes = row_bytes(type_name, cols)
    raw = random_blocks(type_name, r * cols // 256, rng, d=0.01).reshape(r, n_bytes)
    x = rng.standard_normal(cols).astype(np.float32)
    x[::7] *= 40.0                                       # a spread of magnitudes, as activations have
    want = dequantize(raw.reshape(-1), type_name, (r, cols)).astype(np.float64) @ x.astype(np.float64)
    scale = np.abs(dequantize(raw.reshape(-1), type_name, (r, cols))).astype(np.float64) @ np.abs(x)
    got = _run(lib, type_name, raw, x, cols, r)
    assert np.all(np.abs(got - want) <= 1e-5 * scale), (type_name, cols, r, got, want)


def test_the_host_check_catches_a_wrong_lane(host_dots):
    """The check can fail: one lane's values left out moves the dot far past its bound."""
    type_name, lib = host_dots
    rng = np.random.default_rng(3)
    raw = random_blocks(type_name, 8, rng, d=0.01).reshape(1, row_bytes(type_name, 2048))
    x = rng.standard_normal(2048).astype(np.float32)
    x_missing = x.copy()
    x_missing[8 * 5: 8 * 6] = 0.0                       # 8 inputs of the first block: a lane's share or half of one
    decoded = dequantize(raw.reshape(-1), type_name, (1, 2048)).astype(np.float64)
    scale = np.abs(decoded) @ np.abs(x)
    got = _run(lib, type_name, raw, x_missing, 2048, 1)
    assert np.abs(got - decoded @ x).max() > 1e-5 * scale.max()


_Q8_DRIVER = r"""
// One Q8_0 row's dot as a block of SPLIT warps computes it: each (part, lane) in turn, the
// lanes' sums added, then the parts'.
template <int COLS, int SPLIT>
static float block_dot(const uint32_t* codes, const float* scales, const float* x) {
    const uint4* w[1] = {reinterpret_cast<const uint4*>(codes)};
    const float* s[1] = {scales};
    float total = 0.0f;
    for (int part = 0; part < SPLIT; ++part) {
        float warp = 0.0f;
        for (int lane = 0; lane < 32; ++lane) {
            float acc[1];
            ds4lab_q8_dots<1, COLS, SPLIT>(w, s, reinterpret_cast<const float4*>(x), lane, acc, part);
            warp += acc[0];
        }
        total += warp;
    }
    return total;
}
#define Q8(COLS, SPLIT) extern "C" float q8_dot_##COLS##_##SPLIT(const uint32_t* c, const float* s, const float* x) \
    { return block_dot<COLS, SPLIT>(c, s, x); }
Q8(2048, 1) Q8(2048, 4) Q8(8192, 4)
"""


@pytest.mark.parametrize("cols, split", [(2048, 1), (2048, 4), (8192, 4)])
def test_a_q8_rows_split_columns_add_up_to_its_dot_product(tmp_path, cols, split):
    """kernels/cuda/q8_rows.cuh: with SPLIT warps sharing a row, each over every SPLIT-th
    chunk of its columns, every column is counted once (codes are byte + 128, a scale per 32)."""
    lib = _host_library(tmp_path, _Q8_DRIVER, "ds4lab_block.cuh", "q8_rows.cuh")
    rng = np.random.default_rng(cols + split)
    codes = rng.integers(0, 256, cols, dtype=np.uint8)
    scales = rng.uniform(0.5, 2.0, cols // 32).astype(np.float32)
    x = rng.standard_normal(cols).astype(np.float32)
    dot = getattr(lib, f"q8_dot_{cols}_{split}")
    dot.restype = ctypes.c_float
    got = dot(codes.ctypes.data_as(ctypes.c_void_p), scales.ctypes.data_as(ctypes.c_void_p),
              x.ctypes.data_as(ctypes.c_void_p))
    weights = (codes.astype(np.float64) - 128.0) * np.repeat(scales, 32)
    assert abs(got - weights @ x) <= 1e-5 * (np.abs(weights) @ np.abs(x))
