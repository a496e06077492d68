/* Eight float lanes as one value, shared by ds4lab's CPU kernels (GCC/Clang vector
 * extensions). Every operation on a lanes_t is lane-wise, whatever instructions the target
 * has (two SSE2 registers, one AVX2, two NEON), and the kernels are built without FMA
 * contraction: a sum written over lanes rounds the same on every CPU. */
#ifndef DS4LAB_LANES_H
#define DS4LAB_LANES_H

#include <stdint.h>
#include <string.h>

#define LANES 8
#define INLINE static inline __attribute__((always_inline))

typedef float lanes_t __attribute__((vector_size(LANES * sizeof(float))));

INLINE lanes_t load_floats(const float *p) {
    lanes_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* The eight lanes in a fixed tree. */
INLINE float lanes_sum(lanes_t a) {
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

/* sum_j w[j] * x[j], n a multiple of 4 * LANES: four lane accumulators, a[k] taking the
 * chunks j / 8 = k mod 4 in order (four independent chains keep the adder busy), combined
 * as (a0 + a1) + (a2 + a3), then the tree. */
INLINE float dot_lanes(const float *w, const float *x, int64_t n) {
    lanes_t a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (int64_t j = 0; j < n; j += 4 * LANES) {
        a0 = a0 + load_floats(w + j) * load_floats(x + j);
        a1 = a1 + load_floats(w + j + LANES) * load_floats(x + j + LANES);
        a2 = a2 + load_floats(w + j + 2 * LANES) * load_floats(x + j + 2 * LANES);
        a3 = a3 + load_floats(w + j + 3 * LANES) * load_floats(x + j + 3 * LANES);
    }
    return lanes_sum((a0 + a1) + (a2 + a3));
}

typedef int32_t ilanes_t __attribute__((vector_size(LANES * sizeof(int32_t))));
typedef uint8_t bytes_t __attribute__((vector_size(LANES)));

/* Eight bytes widened to int32 lanes: portable, and with AVX2's one-instruction widening
 * (compilers scalarise the portable form on x86; callers pick it at run time in functions
 * built for AVX2). Both give the same integers. */
INLINE ilanes_t widen_bytes(const uint8_t *p) {
    bytes_t b;
    memcpy(&b, p, sizeof b);
    return __builtin_convertvector(b, ilanes_t);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_AVX2_WIDEN 1
#define AVX2 __attribute__((target("avx2")))
AVX2 INLINE ilanes_t widen_bytes_avx2(const uint8_t *p) {
    return (ilanes_t)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
#endif

#endif
