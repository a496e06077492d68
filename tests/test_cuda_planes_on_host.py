"""The integer path of the IQ2_XXS gate and up (kernels/cuda/expert_planes.cuh and
expert_dot_iq2_xxs_planes.cuh), run on the host.

The planes are made by a warp (`ds4lab_make_planes`: a lane a value, a shuffle for the
group's largest magnitude), here a block of host threads as in the router's host test; the
bytes and scales must equal `kernels.input_planes`' (MLX operations) exactly (a power of two, then one
rounding: nothing depends on the machine), and the values they hold must lie within 2^-21 of
each group's largest magnitude of the input. The dot on the planes runs its 32 lanes in turn
as the float dot's host test does (dp4a written out here) and must give the dot product of
the decoded rows with the planes' values up to float32 sums.
"""

from __future__ import annotations

import ctypes

import mlx.core as mx
import numpy as np
import pytest
from test_cuda_dots_on_host import _HOST_CUDA, _host_library
from test_cuda_router_on_host import _HOST_THREADS

from ds4lab.model import kernels
from ds4lab.quants import dequantize, random_blocks, row_bytes
from ds4lab.quants.tables import IQ2XXS_GRID_BYTES

# What the planes' maker uses beyond the router test's threads and shuffles.
_MAKER_PRELUDE = _HOST_THREADS + r"""
#include <cstring>
static int warp_votes[32][32];
static inline int __all_sync(unsigned, int v) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    warp_votes[warp][lane] = v;
    warp_barriers[warp]->arrive_and_wait();
    int all = 1;
    for (int k = 0; k < 32; ++k) all &= warp_votes[warp][k] != 0;
    warp_barriers[warp]->arrive_and_wait();
    return all;
}
static inline float __uint_as_float(uint32_t v) { float f; std::memcpy(&f, &v, 4); return f; }
static inline float __int_as_float(int v) { float f; std::memcpy(&f, &v, 4); return f; }
static inline uint32_t __float_as_uint(float f) { uint32_t v; std::memcpy(&v, &f, 4); return v; }
static inline int __float2int_rn(float v) {                  // cvt.rni.s32.f32: saturating, NaN 0
    return std::isnan(v) ? 0 : v >= 2147483647.0f ? 2147483647 : v <= -2147483648.0f ? (-2147483647 - 1)
                                                              : (int)std::nearbyint(v);
}
"""

_MAKER_DRIVER = r"""
template <int COLS>
static void make_planes(int threads, const float* x, uint8_t* buffer, int n_tokens) {
    for (int t = 0; t < n_tokens; ++t) {
        run_block(threads, [=] {
            ds4lab_make_token_planes<COLS>(x + (size_t)t * COLS, buffer, n_tokens, t, threadIdx.x >> 5,
                                           blockDim.x >> 5, threadIdx.x & 31);
        });
    }
}
extern "C" void planes_512(int threads, const float* x, uint8_t* buffer, int n_tokens) {
    make_planes<512>(threads, x, buffer, n_tokens);
}
"""

# dp4a for the host: c + the dot of a's signed bytes with b's signed (ss) or unsigned (su) bytes.
_DOT_PRELUDE = _HOST_CUDA + r"""
static inline int ds4lab_dp4a_ss(uint32_t a, uint32_t b, int c) {
    for (int k = 0; k < 4; ++k) c += (int)(int8_t)(a >> (8 * k)) * (int)(int8_t)(b >> (8 * k));
    return c;
}
static inline int ds4lab_dp4a_su(uint32_t a, uint32_t b, int c) {
    for (int k = 0; k < 4; ++k) c += (int)(int8_t)(a >> (8 * k)) * (int)(uint8_t)(b >> (8 * k));
    return c;
}
"""

_DOT_DRIVER = r"""
template <int COLS, int R>
static void warp_dot(const uint8_t* const* w, const uint8_t* planes, float* out, const uint2* grid) {
    DS4LAB_DOT_STAGE
    DS4LAB_PLANES_STAGE
    const uint8_t* rows[R];
    for (int r = 0; r < R; ++r) { rows[r] = w[r]; out[r] = 0.0f; }
    const ds4lab_planes xin = ds4lab_token_planes<COLS>(planes, 1, 0);
    for (int lane = 0; lane < 32; ++lane) {
        float acc[R] = {};
        ds4lab_expert_dot<COLS, R>(rows, xin, lane, acc DS4LAB_PLANES_TABLES);
        for (int r = 0; r < R; ++r) out[r] += acc[r];
    }
}
#define ONE(COLS, R) extern "C" void dot_##COLS##_##R(const uint8_t* const* w, const uint8_t* planes, float* out, \
    const uint2* grid) { warp_dot<COLS, R>(w, planes, out, grid); }
ONE(256, 1) ONE(768, 2) ONE(1280, 4) ONE(4096, 4)

template <int COLS, int R>
static void warp_q8_dot(const uint32_t* codes, const float* scales, const uint8_t* planes, float* out) {
    const uint4* w[R];
    const float* s[R];
    for (int r = 0; r < R; ++r) { ds4lab_q8_row<COLS>(codes, scales, r, w[r], s[r]); out[r] = 0.0f; }
    const ds4lab_planes xin = ds4lab_token_planes<COLS>(planes, 1, 0);
    for (int lane = 0; lane < 32; ++lane) {
        float acc[R];
        ds4lab_q8_dots<R, COLS>(w, s, xin, lane, acc);
        for (int r = 0; r < R; ++r) out[r] += acc[r];
    }
}
#define Q8(COLS, R) extern "C" void q8_dot_##COLS##_##R(const uint32_t* codes, const float* scales, \
    const uint8_t* planes, float* out) { warp_q8_dot<COLS, R>(codes, scales, planes, out); }
Q8(256, 1) Q8(1024, 2) Q8(4096, 4)
"""

_HEADERS = ("ds4lab_block.cuh", "expert_matvec_common.cuh", "expert_dot_iq2_xxs.cuh", "expert_planes.cuh",
            "expert_dot_iq2_xxs_planes.cuh", "q8_rows.cuh", "q8_rows_planes.cuh")


@pytest.fixture(scope="module")
def host_maker(tmp_path_factory) -> ctypes.CDLL:
    return _host_library(tmp_path_factory.mktemp("planes"), _MAKER_DRIVER, "expert_planes.cuh",
                         prelude=_MAKER_PRELUDE, std="c++20")


@pytest.fixture(scope="module")
def host_planes_dot(tmp_path_factory) -> ctypes.CDLL:
    return _host_library(tmp_path_factory.mktemp("planes_dot"), _DOT_DRIVER, *_HEADERS, prelude=_DOT_PRELUDE)


def _planes(x: np.ndarray) -> np.ndarray:
    return np.array(kernels.input_planes(mx.array(x)))


def _values(planes: np.ndarray, n_tokens: int, cols: int) -> np.ndarray:
    return np.array(kernels.planes_values(mx.array(planes), n_tokens, cols)).astype(np.float64)


def _pointer(a: np.ndarray) -> ctypes.c_void_p:
    return a.ctypes.data_as(ctypes.c_void_p)


def _activations(n_tokens: int, cols: int, seed: int) -> np.ndarray:
    """Rows with a spread of magnitudes between groups and inside them, values that round at
    exactly half a step, a zero group and one below 2^-100."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n_tokens, cols)).astype(np.float32)
    x *= np.exp2(rng.integers(-30, 30, (n_tokens, cols // 32, 1))).repeat(32, axis=2).reshape(n_tokens, cols)
    x[:, ::7] *= 40.0
    x[0, 32:64] = 0.0
    x[0, 64:96] = np.float32(2.0 ** -110) * np.linspace(-1.0, 1.0, 32, dtype=np.float32)
    x[0, 96:128] = np.linspace(-0.5, 0.5, 32, dtype=np.float32)
    x[0, 96] = 1.0                                   # the group's largest: 2^0, so a step is 2^-20
    x[0, 97:100] = np.float32(2.0 ** -21) * np.array([1, 3, -5], np.float32)   # ties, to even
    return x


def _host_planes(lib: ctypes.CDLL, x: np.ndarray, threads: int) -> np.ndarray:
    buffer = np.zeros(x.shape[0] * x.shape[1] // 32 * kernels.PLANE_GROUP_BYTES, np.uint8)
    lib.planes_512(threads, _pointer(x), _pointer(buffer), x.shape[0])
    return buffer


@pytest.mark.parametrize("threads", [32, 128])
def test_a_warps_planes_are_numpys_bytes_and_hold_the_input_to_21_bits(host_maker, threads):
    x = _activations(3, 512, seed=threads)
    got = _host_planes(host_maker, x, threads)
    want = _planes(x)
    np.testing.assert_array_equal(got, want)
    values = _values(got, 3, 512)
    largest = np.abs(x.reshape(3, -1, 32)).max(axis=-1, keepdims=True).repeat(32, axis=-1).reshape(3, 512)
    assert np.all(np.abs(values - x) <= np.where(largest >= 2.0 ** -100, largest * 2.0 ** -21, largest))
    assert values[0, 97] == 0.0 and values[0, 98] == 2.0 ** -19 and values[0, 99] == -2.0 ** -19  # half-steps to even
    assert not values[0, 64:96].any() and not values[0, 32:64].any()


def test_a_group_with_an_infinity_or_a_nan_has_a_nan_scale(host_maker):
    x = _activations(1, 512, seed=5)
    x[0, 3], x[0, 200] = np.inf, np.nan
    np.testing.assert_array_equal(_host_planes(host_maker, x, 64), _planes(x))
    for planes in (_host_planes(host_maker, x, 64), _planes(x)):
        values = _values(planes, 1, 512)
        assert np.isnan(values[0, :32]).all() and np.isnan(values[0, 192:224]).all()
        assert np.isfinite(values[0, 32:192]).all() and np.isfinite(values[0, 224:]).all()


def _planes_dot(lib: ctypes.CDLL, raw: np.ndarray, planes: np.ndarray, cols: int, r: int) -> np.ndarray:
    rows = [np.ascontiguousarray(raw[i]) for i in range(r)]
    pointers = (ctypes.c_void_p * r)(*[row.ctypes.data for row in rows])
    out = np.zeros(r, np.float32)
    grid = np.ascontiguousarray(IQ2XXS_GRID_BYTES, dtype=np.uint8)
    getattr(lib, f"dot_{cols}_{r}")(pointers, _pointer(planes), _pointer(out), _pointer(grid))
    return out


@pytest.mark.parametrize("cols, r", [(256, 1), (768, 2), (1280, 4), (4096, 4)])
def test_the_planes_dot_is_the_decoded_rows_times_the_planes_values(host_planes_dot, cols, r):
    """Against float64: the same up to float32 sums (a 2^-20 bar), and within 2^-19 of the
    float input's dot (the planes' rounding)."""
    rng = np.random.default_rng(cols + r)
    raw = random_blocks("IQ2_XXS", r * cols // 256, rng, d=0.01).reshape(r, row_bytes("IQ2_XXS", cols))
    x = rng.standard_normal((1, cols)).astype(np.float32)
    x[0, ::7] *= 40.0
    planes = _planes(x)
    decoded = dequantize(raw.reshape(-1), "IQ2_XXS", (r, cols)).astype(np.float64)
    scale = np.abs(decoded) @ np.abs(x[0]).astype(np.float64)
    got = _planes_dot(host_planes_dot, raw, planes, cols, r)
    assert np.all(np.abs(got - decoded @ _values(planes, 1, cols)[0]) <= 2.0 ** -20 * scale)
    assert np.all(np.abs(got - decoded @ x[0].astype(np.float64)) <= 2.0 ** -19 * scale)


def test_the_planes_check_catches_a_wrong_sign_or_plane(host_planes_dot):
    """The checks can fail: one value's sign flipped in the planes, or a low plane's byte
    moved, shifts the dot past the bar."""
    rng = np.random.default_rng(9)
    raw = random_blocks("IQ2_XXS", 5, rng, d=0.01).reshape(1, row_bytes("IQ2_XXS", 1280))
    x = rng.standard_normal((1, 1280)).astype(np.float32)
    planes = _planes(x)
    decoded = dequantize(raw.reshape(-1), "IQ2_XXS", (1, 1280)).astype(np.float64)
    scale = np.abs(decoded) @ np.abs(x[0]).astype(np.float64)
    for at in (5 * 96 + 3, 7 * 96 + 32 + 11):          # a p0 byte negated; a p1 byte moved by 128
        bad = planes.copy()
        bad[at] = (256 - int(bad[at])) % 256 if at % 96 < 32 else int(bad[at]) ^ 0x80
        got = _planes_dot(host_planes_dot, np.repeat(raw, 4, axis=0), bad, 1280, 4)[0]
        assert abs(got - decoded[0] @ _values(planes, 1, 1280)[0]) > 2.0 ** -20 * scale[0]


def _q8_planes_dot(lib: ctypes.CDLL, codes: np.ndarray, scales: np.ndarray, planes: np.ndarray) -> np.ndarray:
    r, cols = codes.shape
    out = np.zeros(r, np.float32)
    getattr(lib, f"q8_dot_{cols}_{r}")(_pointer(codes), _pointer(scales), _pointer(planes), _pointer(out))
    return out


@pytest.mark.parametrize("cols, r", [(256, 1), (1024, 2), (4096, 4)])
def test_the_q8_planes_dot_is_the_decoded_rows_times_the_planes_values(host_planes_dot, cols, r):
    """The shared expert's Q8_0 rows on the planes (q8_rows_planes.cuh), bytes code + 128 with
    codes at both ends of [-128, 127] (the sums' largest): against float64, as the IQ2_XXS dot."""
    rng = np.random.default_rng(cols + 3 * r)
    codes = rng.integers(0, 256, (r, cols), dtype=np.uint8)
    codes[0, :64] = 0                                    # code -128 on two whole groups
    codes[-1, 64:96] = 255
    scales = (rng.standard_normal((r, cols // 32)) * 0.01).astype(np.float32)
    x = rng.standard_normal((1, cols)).astype(np.float32)
    x[0, ::7] *= 40.0
    x[0, :32] = -np.abs(x[0, :32])                       # its p0 bytes negative beside code -128
    planes = _planes(x)
    decoded = (codes.astype(np.float64) - 128.0) * np.repeat(scales, 32, axis=1)
    scale = np.abs(decoded) @ np.abs(x[0]).astype(np.float64)
    got = _q8_planes_dot(host_planes_dot, codes, scales, planes)
    assert np.all(np.abs(got - decoded @ _values(planes, 1, cols)[0]) <= 2.0 ** -20 * scale)
    assert np.all(np.abs(got - decoded @ x[0].astype(np.float64)) <= 2.0 ** -19 * scale)
    bad = codes.copy()
    bad[0, 5] ^= 0x80                                    # one code read as its byte, not byte - 128
    assert abs(_q8_planes_dot(host_planes_dot, bad, scales, planes)[0] - got[0]) > 2.0 ** -20 * scale[0]
