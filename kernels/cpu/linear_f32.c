/* y[t][o] = sum_j W[o][j] * x[t][j] for a float32 matrix W on the CPU: the products with the
 * model's float weights on the native path (`Schedule.linear`: the compressors' projections,
 * the indexer's queries and head weights, the HC control's mixer among others).
 *
 * Why not the BLAS: a decode step's few small products each cost an MLX dispatch and a BLAS
 * call, and the BLAS's worker threads then spin on the cores the next kernels need. Why not
 * slower in prefill than it must be: each weight row is read once per chunk of 64 tokens,
 * which stay in the caches while the rows stream by.
 *
 * Every (t, o) is `dot_lanes` (lanes.h), an order this source fixes: the same bits whether a
 * token comes alone (decode) or in a chunk (prefill), on any number of threads (they split
 * the output rows), with any vector width.
 */
#include "lanes.h"
#include "parallel.h"

#define TOKEN_CHUNK 64

typedef struct {
    const float *w, *x;
    float *y;
    int64_t rows, cols, n_tokens;
} linear_job_t;

static void linear_rows(void *ctx, int64_t row_begin, int64_t row_end) {
    const linear_job_t *job = (const linear_job_t *)ctx;
    for (int64_t t0 = 0; t0 < job->n_tokens; t0 += TOKEN_CHUNK) {
        const int64_t t_end = t0 + TOKEN_CHUNK < job->n_tokens ? t0 + TOKEN_CHUNK : job->n_tokens;
        for (int64_t o = row_begin; o < row_end; o++) {
            const float *w = job->w + o * job->cols;
            for (int64_t t = t0; t < t_end; t++)
                job->y[t * job->rows + o] = dot_lanes(w, job->x + t * job->cols, job->cols);
        }
    }
}

/* y [n_tokens, rows] = x [n_tokens, cols] times W^T, W [rows, cols]; cols a multiple of
 * 4 * LANES. Returns 0, or -1 when the arguments are out of range. */
int ds4lab_linear_f32(const float *w, const float *x, float *y, int64_t rows, int64_t cols, int64_t n_tokens,
                      int n_threads) {
    if (rows <= 0 || cols <= 0 || cols % (4 * LANES) || n_tokens <= 0) return -1;
    linear_job_t job = {w, x, y, rows, cols, n_tokens};
    parallel_ranges(linear_rows, &job, rows, n_threads);
    return 0;
}
