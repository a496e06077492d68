"""The router's routing (kernels/cuda/router.cuh, `ds4lab_route`), run on the host.

A token's routing runs in one thread block: router.cu's, a thread an expert, and
routed_swiglu.cu's, 128 threads for the real model's 256 experts (two a thread). Its
selection must not depend on the block: the best values first, the lower id among equal
ones. Here the device function compiles as C++ for the host with each CUDA thread of a block
a host thread (`__syncthreads` a barrier of the block, a warp's shuffles an exchange behind a
barrier of its 32 lanes), and its choice is checked against that rule on scores with many
ties, its probs against sqrt(softplus) in numpy, its weights against the chosen probs
normalised in float32, and the two block sizes against each other.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from test_cuda_dots_on_host import _host_library

# CUDA's thread and warp primitives for a block of host threads.
_HOST_THREADS = r"""
#include <barrier>
#include <cmath>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>
#define __device__
#define __forceinline__ inline
#define __shared__ static
struct Dim3 { unsigned x; };
static thread_local Dim3 threadIdx;
static Dim3 blockDim;
static std::barrier<>* block_barrier;
static std::barrier<>* warp_barriers[32];
static float warp_floats[32][32];
static int warp_ints[32][32];
static inline void __syncthreads() { block_barrier->arrive_and_wait(); }
static inline float __ldcg(const float* p) { return *p; }
template <typename T>
static T exchange(T v, int offset, T (&slots)[32][32]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    slots[warp][lane] = v;
    warp_barriers[warp]->arrive_and_wait();
    const T other = slots[warp][lane ^ offset];
    warp_barriers[warp]->arrive_and_wait();
    return other;
}
static inline float __shfl_xor_sync(unsigned, float v, int offset) { return exchange(v, offset, warp_floats); }
static inline int __shfl_xor_sync(unsigned, int v, int offset) { return exchange(v, offset, warp_ints); }
// One thread block of `threads` host threads, each running body() with its threadIdx.
template <typename Body>
static void run_block(int threads, Body body) {
    blockDim.x = threads;
    std::barrier<> block(threads);
    block_barrier = &block;
    std::vector<std::unique_ptr<std::barrier<>>> warps;
    for (int w = 0; w < threads / 32; ++w) {
        warps.emplace_back(new std::barrier<>(32));
        warp_barriers[w] = warps.back().get();
    }
    std::vector<std::thread> pool;
    for (int i = 0; i < threads; ++i) pool.emplace_back([=] { threadIdx.x = i; body(); });
    for (auto& thread : pool) thread.join();
}
"""

_DRIVER = r"""
template <int E, int K, int EPT, bool HAS_BIAS, bool HASH>
static void route_block(int threads, const float* logits, const float* bias, const int* table, const int* tokens,
                        float scale, float* probs, int* experts, float* weights) {
    run_block(threads, [=] {
        float b[EPT];
        const int hashed = ds4lab_route_reads<E, K, EPT, HAS_BIAS, HASH>(bias, table, tokens, 0, b);
        ds4lab_route<E, K, EPT, HAS_BIAS, HASH>(logits, probs, b, hashed, scale, experts, weights);
    });
}
#define ONE(NAME, E, K, EPT, HAS_BIAS, HASH) extern "C" void NAME(int threads, const float* logits, \
    const float* bias, const int* table, const int* tokens, float scale, float* probs, int* experts, \
    float* weights) { route_block<E, K, EPT, HAS_BIAS, HASH>(threads, logits, bias, table, tokens, scale, probs, \
                                                            experts, weights); }
ONE(biased_256_1, 256, 6, 1, true, false) ONE(biased_256_2, 256, 6, 2, true, false)
ONE(plain_40_1, 40, 2, 1, false, false) ONE(plain_40_2, 40, 2, 2, false, false)
ONE(hash_256_2, 256, 6, 2, false, true)
"""

# name -> (experts, used, experts a thread, threads, bias, hash)
_CASES = {"biased_256_1": (256, 6, 1, 256, True, False), "biased_256_2": (256, 6, 2, 128, True, False),
          "plain_40_1": (40, 2, 1, 64, False, False), "plain_40_2": (40, 2, 2, 32, False, False),
          "hash_256_2": (256, 6, 2, 128, False, True)}


@pytest.fixture(scope="module")
def host_router(tmp_path_factory) -> ctypes.CDLL:
    return _host_library(tmp_path_factory.mktemp("router"), _DRIVER, "router.cuh", prelude=_HOST_THREADS,
                         std="c++20")


def _route(lib: ctypes.CDLL, case: str, logits: np.ndarray, bias: np.ndarray, table: np.ndarray, token: int,
           scale: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    e, k, _, threads, _, _ = _CASES[case]
    probs, experts, weights = np.zeros(e, np.float32), np.zeros(k, np.int32), np.zeros(k, np.float32)
    tokens = np.array([token], np.int32)
    pointer = lambda a: a.ctypes.data_as(ctypes.c_void_p)    # noqa: E731
    getattr(lib, case)(threads, pointer(logits), pointer(bias), pointer(table), pointer(tokens), ctypes.c_float(scale),
                       pointer(probs), pointer(experts), pointer(weights))
    return probs, experts, weights


def _inputs(e: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Logits on a coarse grid (many equal scores; beyond ±20 too, where softplus switches
    form), a bias of few values, and a hash table; seed 0: every score equal (a thread's
    experts tie with each other)."""
    rng = np.random.default_rng(seed)
    logits = (rng.integers(-50, 50, e) * 0.5).astype(np.float32) if seed else np.ones(e, np.float32)
    bias = (rng.integers(-2, 3, e) * 0.25).astype(np.float32) if seed else np.zeros(e, np.float32)
    table = rng.integers(0, e, (9, 6)).astype(np.int32)
    return logits, bias, table


@pytest.mark.parametrize("case", list(_CASES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_routing_chooses_the_best_lowest_id_first_and_normalises_their_probs(host_router, case, seed):
    e, k, _, _, has_bias, hashed = _CASES[case]
    logits, bias, table = _inputs(e, seed)
    probs, experts, weights = _route(host_router, case, logits, bias, table, 4, 1.5)
    l64 = logits.astype(np.float64)
    softplus = np.where(l64 > 20, l64, np.where(l64 < -20, np.exp(l64), np.log1p(np.exp(l64))))
    np.testing.assert_allclose(probs, np.sqrt(softplus), rtol=2e-7)
    if hashed:
        want = table[4]
    else:
        score = probs + bias if has_bias else probs             # float32, as the kernel adds
        want = np.lexsort((np.arange(e), -score))[:k]           # best first, the lower id on ties
    np.testing.assert_array_equal(experts, want)
    total = np.float32(0.0)
    for p in probs[want]:
        total = np.float32(total + p)
    expected = (probs[want] / np.maximum(total, np.float32(2.0 ** -14)) * np.float32(1.5)).astype(np.float32)
    np.testing.assert_array_equal(weights, expected)


@pytest.mark.parametrize("one, two", [("biased_256_1", "biased_256_2"), ("plain_40_1", "plain_40_2")])
def test_the_choice_does_not_depend_on_the_block_size(host_router, one, two):
    e = _CASES[one][0]
    for seed in (0, 11, 12, 13, 14):
        logits, bias, table = _inputs(e, seed)
        a, b = (_route(host_router, case, logits, bias, table, 0, 2.0) for case in (one, two))
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(x, y)


def test_the_host_check_catches_a_wrong_choice(host_router):
    """The check can fail: on these scores the ties reach the chosen experts, so ties broken
    toward the higher id choose others."""
    differs = []
    for case in ("biased_256_2", "plain_40_2"):
        e, k = _CASES[case][:2]
        for seed in range(1, 4):
            logits, bias, table = _inputs(e, seed)
            probs, experts, _ = _route(host_router, case, logits, bias, table, 0, 1.0)
            score = probs + bias if _CASES[case][4] else probs
            differs.append(not np.array_equal(experts, np.lexsort((-np.arange(e), -score))[:k]))
    assert sum(differs) >= 2, differs
