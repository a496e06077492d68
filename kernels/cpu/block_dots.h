/* Dots of a weight row held in a GGUF block format (IQ2_XXS, Q2_K, Q4_K; 256 values a
 * block) with a float32 vector, on the CPU, without decoding the row to memory first.
 *
 * Each weight is decoded with the float operations of ds4lab's decoders
 * (ds4lab/quants/numpy_decode.py, which follow ggml's dequantize_row_*):
 *     IQ2_XXS  w = (d * (0.5 + s) * 0.25) * (+-grid)       (the sign exact, the grid 8 bytes)
 *     Q2_K     w = (d * scale) * q - dmin * min           (per 16 values)
 *     Q4_K     w = (d * scale) * q - dmin * min           (per 32 values)
 * and the products are summed exactly as `dot_lanes` (lanes.h) sums a float32 row: the
 * chunk of 8 values j / 8 = k goes to accumulator k mod 4. So a row read here gives the bits
 * of the same row decoded to float32 and read by `dot_lanes`; a block's 32 chunks of 8 keep
 * that assignment (32 is a multiple of 4).
 *
 * Layouts (bytes per block): IQ2_XXS 66 = f16 d, then per 32 values a u32 of four grid
 * indices and a u32 of four 7-bit sign indices with a 4-bit scale on top; Q2_K 84 = 16
 * scale bytes (low nibble scale, high nibble min, per 16 values), 64 bytes of 2-bit codes
 * (value 128h + 32j + l in byte 32h + l at bits 2j), f16 d and dmin; Q4_K 144 = f16 d and
 * dmin, 12 bytes of 6-bit (scale, min) pairs for 8 groups of 32, 128 bytes of nibbles (value
 * 64c + 32n + l in byte 32c + l, low nibble n = 0).
 */
#ifndef DS4LAB_BLOCK_DOTS_H
#define DS4LAB_BLOCK_DOTS_H

#include "lanes.h"

enum { TYPE_F32 = 0, TYPE_IQ2_XXS = 1, TYPE_Q2_K = 2, TYPE_Q4_K = 3 };

#define QK 256

/* IEEE half to float, exactly (every half is a float). */
INLINE float half_to_float(const uint8_t *p) {
    const uint32_t h = (uint32_t)p[0] | (uint32_t)p[1] << 8;
    const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 31, man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0) {
        const float f = (float)man * 0x1p-24f;               /* zero or subnormal */
        return sign ? -f : f;
    }
    bits = exp == 31 ? sign | 0x7f800000u | man << 13 : sign | (exp + 112) << 23 | man << 13;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

INLINE float sum_accumulators(const lanes_t a[4]) { return lanes_sum((a[0] + a[1]) + (a[2] + a[3])); }

/* Eight K-quant weights (scale dl, min ml, integer levels q) times eight inputs: the decoder's
 * w = dl * q - ml, then the product. */
INLINE lanes_t kquant_terms(float dl, float ml, ilanes_t q, const float *x) {
    return (dl * __builtin_convertvector(q, lanes_t) - ml) * load_floats(x);
}

typedef float (*block_dot_fn)(const uint8_t *row, const float *x, int64_t n, const uint8_t *grid,
                              const uint8_t *ksigns);

/* The dots, compiled once per instruction set (block_dots_body.h), chosen at run time. */
#define DOT_TARGET
#define DOT_NAME(name) name##_portable
#define WIDEN8 widen_bytes
#include "block_dots_body.h"
#undef DOT_TARGET
#undef DOT_NAME
#undef WIDEN8

#ifdef HAVE_AVX2_WIDEN
#define DOT_TARGET AVX2
#define DOT_NAME(name) name##_avx2
#define WIDEN8 widen_bytes_avx2
#include "block_dots_body.h"
#undef DOT_TARGET
#undef DOT_NAME
#undef WIDEN8
#endif

/* The row dot of a block type (TYPE_IQ2_XXS, TYPE_Q2_K, TYPE_Q4_K) for this CPU. */
static block_dot_fn block_dot(int type) {
#ifdef HAVE_AVX2_WIDEN
    if (__builtin_cpu_supports("avx2"))
        return type == TYPE_IQ2_XXS ? dot_iq2_xxs_avx2 : type == TYPE_Q2_K ? dot_q2_k_avx2 : dot_q4_k_avx2;
#endif
    return type == TYPE_IQ2_XXS ? dot_iq2_xxs_portable : type == TYPE_Q2_K ? dot_q2_k_portable : dot_q4_k_portable;
}

/* Bytes of one row of n values in `type`. */
INLINE int64_t block_row_bytes(int type, int64_t n) {
    return type == TYPE_F32 ? 4 * n : n / QK * (type == TYPE_IQ2_XXS ? 66 : type == TYPE_Q2_K ? 84 : 144);
}

#endif
