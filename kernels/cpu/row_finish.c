/* The per-row steps the model chains on q heads, KV rows, compressed rows and indexer rows,
 * each optional, in this order (`Schedule.finish_rows` in ds4lab/model/numerics.py; the CUDA
 * kernels/cuda/row_finish.cu is the same list):
 *   RMSNorm   x * (1 / sqrt(mean(x^2) + eps)), times weight[d] when given
 *   RoPE      the last n_rot dims, GPT-J pairs, at the row's position (row / rows_per_pos:
 *             the heads of a token share it); inverse turns back (sin negated)
 *   QAT       Hadamard over the row (butterflies a + b, a - b with stride 1, 2, ...; times
 *             1/sqrt(D) as float32), then FP4 E2M1 in blocks of 32
 *   FP8       FP8 E4M3FN in blocks of 64 over the first D - n_rot dims
 *   F16       the float16 round trip (nearest even, subnormals, overflow to inf)
 * RoPE, Hadamard and the roundings repeat the MLX composition's float operations one by one
 * (the build has no FMA contraction), so from the same input they give the same bits, and
 * the roundings are ds4.c's; the norm's sum is over lanes (lanes.h), another order than
 * MLX's. Rows are independent: a row's bits do not depend on the batch or the threads.
 */
#include <math.h>

#include "lanes.h"
#include "parallel.h"

typedef struct {
    const float *x, *weight, *cos, *sin;
    const int32_t *carry;        /* log2f carry table, indexed by exponent + 126 */
    float *y;
    int64_t d, n_rot, rows_per_pos;
    float eps, hadamard_scale;
    int norm, rope, qat, fp8, f16;
} rows_job_t;

static float from_bits(int32_t b) {
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

static int32_t to_bits(float f) {
    int32_t b;
    memcpy(&b, &f, sizeof b);
    return b;
}

static float pow2(int k) { return from_bits((k + 127) << 23); }          /* k in [-126, 127] */

static int exponent(float a) { return (to_bits(a) >> 23) - 127; }       /* a >= 0; -127 at 0 */

/* ceilf(log2f(q)) for a positive normal q as ds4 computes it with glibc. */
static int ceil_log2f(float q, const int32_t *carry) {
    const int32_t bits = to_bits(q);
    const int e = (bits >> 23) - 127;
    return e + ((bits & 0x7fffff) >= carry[e + 126] ? 1 : 0);
}

/* ds4's scaled small-float round trip of n values in place (`_block_minifloat_round`). */
static void block_minifloat(float *p, int n, float fmax, float amax_floor, int mant, int min_exp,
                            const int32_t *carry) {
    float amax = 0.0f;
    for (int k = 0; k < n; k++) amax = fmaxf(amax, fabsf(p[k]));
    amax = fmaxf(amax, amax_floor);
    const float scale = pow2(ceil_log2f(amax / fmax, carry));
    for (int k = 0; k < n; k++) {
        const float c = fminf(fmaxf(p[k] / scale, -fmax), fmax);
        const float a = fabsf(c);
        const int e = exponent(a) > min_exp ? exponent(a) : min_exp;
        const float step = pow2(e - mant);
        const float r = rintf(a / step) * step;
        p[k] = (c < 0.0f ? -r : r) * scale;
    }
}

/* float32 -> float16 -> float32, round to nearest even: the f16 grid step at v's exponent. */
static float round_f16(float v) {
    const float a = fabsf(v);
    if (!(a < 65520.0f)) return a == a ? copysignf(INFINITY, v) : v;       /* overflow; NaN kept */
    const int e = exponent(a) > -14 ? exponent(a) : -14;
    const float step = pow2(e - 10);
    return copysignf(rintf(a / step) * step, v);
}

static void rows_range(void *ctx, int64_t begin, int64_t end) {
    const rows_job_t *job = (const rows_job_t *)ctx;
    const int64_t d = job->d, half = job->n_rot / 2, lead = d - job->n_rot;
    for (int64_t r = begin; r < end; r++) {
        const float *x = job->x + r * d;
        float *y = job->y + r * d;
        const float inv = job->norm ? 1.0f / sqrtf(dot_lanes(x, x, d) / (float)d + job->eps) : 1.0f;
        for (int64_t i = 0; i < d; i++) {
            float v = x[i];
            if (job->norm) v = v * inv;
            if (job->weight) v = v * job->weight[i];
            y[i] = v;
        }
        if (job->rope) {
            const int64_t pos = r / job->rows_per_pos;
            for (int64_t j = 0; j < half; j++) {
                const float c = job->cos[pos * half + j];
                const float s = job->rope == 2 ? -job->sin[pos * half + j] : job->sin[pos * half + j];
                float *p = y + lead + 2 * j;
                const float x0 = p[0], x1 = p[1];
                p[0] = x0 * c - x1 * s;
                p[1] = x0 * s + x1 * c;
            }
        }
        if (job->qat) {
            for (int64_t stride = 1; stride < d; stride *= 2)
                for (int64_t j = 0; j < d / 2; j++) {
                    const int64_t i = (j / stride) * 2 * stride + j % stride;
                    const float a = y[i], b = y[i + stride];
                    y[i] = a + b;
                    y[i + stride] = a - b;
                }
            for (int64_t i = 0; i < d; i++) y[i] = y[i] * job->hadamard_scale;
            for (int64_t b = 0; b < d / 32; b++) block_minifloat(y + 32 * b, 32, 6.0f, 7.052966104933725e-38f, 1, 0, job->carry);
        }
        if (job->fp8)
            for (int64_t b = 0; b < lead / 64; b++) block_minifloat(y + 64 * b, 64, 448.0f, 1.0e-4f, 3, -6, job->carry);
        if (job->f16)
            for (int64_t i = 0; i < d; i++) y[i] = round_f16(y[i]);
    }
}

/* rope: 0 none, 1 RoPE, 2 inverse. Returns 0, or -1 when the shapes are out of range (d a
 * multiple of 32; the QAT row a power of two; the FP8 part whole blocks of 64). */
int ds4lab_row_finish(const float *x, float *y, int64_t n_rows, int64_t d, int norm, float eps, const float *weight,
                      int rope, const float *cos, const float *sin, int64_t n_rot, int64_t rows_per_pos, int qat,
                      float hadamard_scale, int fp8, int f16, const int32_t *carry, int n_threads) {
    if (n_rows <= 0 || d <= 0 || d % (4 * LANES) || n_rot < 0 || n_rot % 2 || n_rot > d ||
        (rope && (!cos || !sin || rows_per_pos <= 0)) || (qat && (d & (d - 1))) ||
        (fp8 && (d - n_rot) % 64) || ((qat || fp8) && !carry))
        return -1;
    rows_job_t job = {x, weight, cos, sin, carry, y, d, rope ? n_rot : 0, rows_per_pos, eps, hadamard_scale,
                      norm, rope, qat, fp8, f16};
    parallel_ranges(rows_range, &job, n_rows, n_threads);
    return 0;
}
