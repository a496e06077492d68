/* y[t][o] = sum_j W[o][j] * x[t][j] for a Q8_0 matrix W on the CPU, read in its 8-bit codes.
 *
 * Why a kernel of our own: a decode step on the CPU is memory-bound on the large Q8_0
 * matrices (the output head of 129,280 rows above all). Decoded to float32 for a BLAS they
 * are read at 4 bytes a weight; here at 1 byte plus a scale per 32. ds4lab builds this file
 * with the system C compiler on first use (`ds4lab/model/cpu_kernels.py`).
 *
 * Layout (what `Q8Matrix` holds): codes[o][j] = q + 128 as uint8 (q the GGUF's int8 code),
 * scales[o][b] = the block's float16 scale d widened to float32, b = j / 32.
 *
 * The order of the float operations is fixed by this source and depends on nothing else:
 * not on how many rows of x are computed together (prefill and decode agree bit for bit,
 * which the model's batch-invariant CPU path relies on), not on the thread count (threads
 * split the output rows), not on the vector width the compiler picks (every operation is
 * lane-wise over LANES independent sums, and the build disables FMA contraction, so SSE2,
 * AVX2 and NEON code round identically). Per (t, o):
 *     p[l]   = sum over k = 0..3, in order, of q[32b + 8k + l] * x[32b + 8k + l]
 *     acc[l] = acc[l] + d[b] * p[l]                    for each block b in order
 *     y      = ((acc0 + acc4) + (acc2 + acc6)) + ((acc1 + acc5) + (acc3 + acc7))
 * q * x is one rounding (q is exact in float32), as in a float32 product with the decoded
 * matrix; only the grouping of the sums differs from a BLAS's.
 */
#include "lanes.h"
#include "parallel.h"

#define BLOCK 32
#define TOKEN_GROUP 4     /* rows of x sharing one pass over a block's converted codes */
#define TOKEN_CHUNK 64    /* rows of x kept hot in the caches while the weight rows stream by */

typedef struct {
    const uint8_t *codes;
    const float *scales;
    const float *x;
    float *y;
    int64_t rows, cols, n_tokens;
} job_t;

/* Row o of W (codes, scales) against G consecutive rows of x, results G rows apart in y
 * (stride `out_stride`). Each row of x sees the same operations whatever G is. */
#define ROW_TIMES_ROWS(NAME, G, TARGET, WIDEN)                                                    \
    TARGET static void NAME(const uint8_t *codes, const float *scales, const float *x,            \
                            int64_t cols, float *out, int64_t out_stride) {                       \
        lanes_t acc[G];                                                                           \
        for (int g = 0; g < (G); g++) acc[g] = (lanes_t){0};                                      \
        for (int64_t b = 0; b < cols / BLOCK; b++) {                                              \
            const uint8_t *c = codes + b * BLOCK;                                                 \
            lanes_t w[BLOCK / LANES];                                                             \
            for (int k = 0; k < BLOCK / LANES; k++)                                               \
                w[k] = __builtin_convertvector(WIDEN(c + k * LANES), lanes_t) - 128.0f;           \
            const float d = scales[b];                                                            \
            for (int g = 0; g < (G); g++) {                                                       \
                const float *xb = x + g * cols + b * BLOCK;                                       \
                lanes_t p = w[0] * load_floats(xb);                                               \
                for (int k = 1; k < BLOCK / LANES; k++) p = p + w[k] * load_floats(xb + k * LANES); \
                acc[g] = acc[g] + d * p;                                                          \
            }                                                                                     \
        }                                                                                         \
        for (int g = 0; g < (G); g++) out[g * out_stride] = lanes_sum(acc[g]);                    \
    }

typedef void (*row_fn)(const uint8_t *, const float *, const float *, int64_t, float *, int64_t);

ROW_TIMES_ROWS(group_portable, TOKEN_GROUP, , widen_bytes)
ROW_TIMES_ROWS(one_portable, 1, , widen_bytes)

#ifdef HAVE_AVX2_WIDEN
ROW_TIMES_ROWS(group_avx2, TOKEN_GROUP, AVX2, widen_bytes_avx2)
ROW_TIMES_ROWS(one_avx2, 1, AVX2, widen_bytes_avx2)
#endif

/* Output rows [row_begin, row_end) of the product, every row of x. */
static void rows_times_tokens(void *ctx, int64_t row_begin, int64_t row_end) {
    const job_t *job = (const job_t *)ctx;
    row_fn group = group_portable, one = one_portable;
#ifdef HAVE_AVX2_WIDEN
    if (__builtin_cpu_supports("avx2")) group = group_avx2, one = one_avx2;
#endif
    const int64_t cols = job->cols, n_blocks = cols / BLOCK;
    for (int64_t t0 = 0; t0 < job->n_tokens; t0 += TOKEN_CHUNK) {
        const int64_t t_end = t0 + TOKEN_CHUNK < job->n_tokens ? t0 + TOKEN_CHUNK : job->n_tokens;
        for (int64_t o = row_begin; o < row_end; o++) {
            const uint8_t *codes = job->codes + o * cols;
            const float *scales = job->scales + o * n_blocks;
            float *y = job->y + o;
            int64_t t = t0;
            for (; t + TOKEN_GROUP <= t_end; t += TOKEN_GROUP)
                group(codes, scales, job->x + t * cols, cols, y + t * job->rows, job->rows);
            for (; t < t_end; t++) one(codes, scales, job->x + t * cols, cols, y + t * job->rows, 0);
        }
    }
}

/* y [n_tokens, rows] = x [n_tokens, cols] times W^T, W [rows, cols] as above; cols a
 * multiple of 32. The output rows are split between up to 16 threads. Returns 0, or -1
 * when the arguments are out of range. */
int ds4lab_q8_0_matmul(const uint8_t *codes, const float *scales, const float *x, float *y,
                       int64_t rows, int64_t cols, int64_t n_tokens, int n_threads) {
    if (rows <= 0 || cols <= 0 || cols % BLOCK || n_tokens <= 0) return -1;
    job_t job = {codes, scales, x, y, rows, cols, n_tokens};
    parallel_ranges(rows_times_tokens, &job, rows, n_threads);
    return 0;
}
