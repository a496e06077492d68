/* The lightning indexer on the CPU (`indexer.indexer_scores`, `indexer.select_rows`).
 *
 * Scores: for token t and key row n, sum over heads h in order of w[t][h] * relu(q[t][h] . k[n]),
 * each dot over lanes (lanes.h). Selection: the top_k best-scoring rows among those the token
 * may see, ties to the lower row (ds4 takes the best one at a time; here a sort of the visible
 * rows by score, then row), or every visible row when no more than top_k are visible.
 *
 * Each token on its own, in an order the source fixes: a token's scores and rows do not depend
 * on the chunk, the number of key rows past the ones it sees or the thread count, so prefill
 * and decode choose the same rows.
 *
 * Shapes: q [T, H, D]; w [T, H]; keys [N, D]; scores [T, N]; visible and chosen [T, N] bytes.
 */
#include <math.h>
#include <stdlib.h>

#include "lanes.h"
#include "parallel.h"

typedef struct {
    const float *q, *w, *keys;
    float *scores;
    int64_t n_head, dim, n_rows;
} scores_job_t;

static void scores_range(void *ctx, int64_t begin, int64_t end) {
    const scores_job_t *job = (const scores_job_t *)ctx;
    for (int64_t t = begin; t < end; t++)
        for (int64_t n = 0; n < job->n_rows; n++) {
            float sum = 0.0f;
            for (int64_t h = 0; h < job->n_head; h++) {
                const float *q = job->q + (t * job->n_head + h) * job->dim;
                const float dot = dot_lanes(q, job->keys + n * job->dim, job->dim);
                sum += job->w[t * job->n_head + h] * (dot > 0.0f ? dot : 0.0f);
            }
            job->scores[t * job->n_rows + n] = sum;
        }
}

/* Returns 0, or -1 when the shapes are out of range. */
int ds4lab_indexer_scores(const float *q, const float *w, const float *keys, int64_t n_tokens, int64_t n_head,
                          int64_t dim, int64_t n_rows, float *scores, int n_threads) {
    if (n_tokens <= 0 || n_head <= 0 || dim <= 0 || dim % (4 * LANES) || n_rows < 0) return -1;
    scores_job_t job = {q, w, keys, scores, n_head, dim, n_rows};
    parallel_ranges(scores_range, &job, n_tokens, n_threads);
    return 0;
}

typedef struct {
    float score;
    int64_t row;
} ranked_t;

/* Best first: the higher score, then the lower row (a NaN ranks as -inf). */
static int by_rank(const void *pa, const void *pb) {
    const ranked_t *a = (const ranked_t *)pa, *b = (const ranked_t *)pb;
    const float sa = a->score == a->score ? a->score : -INFINITY, sb = b->score == b->score ? b->score : -INFINITY;
    if (sa != sb) return sa > sb ? -1 : 1;
    return a->row < b->row ? -1 : a->row > b->row;
}

typedef struct {
    const float *scores;
    const uint8_t *visible;
    uint8_t *chosen;
    int64_t n_rows, top_k;
    int failed;
} select_job_t;

static void select_range(void *ctx, int64_t begin, int64_t end) {
    select_job_t *job = (select_job_t *)ctx;
    ranked_t *ranked = (ranked_t *)malloc((size_t)(job->n_rows > 0 ? job->n_rows : 1) * sizeof(ranked_t));
    if (!ranked) {
        __atomic_store_n(&job->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    for (int64_t t = begin; t < end; t++) {
        const float *s = job->scores + t * job->n_rows;
        const uint8_t *v = job->visible + t * job->n_rows;
        uint8_t *c = job->chosen + t * job->n_rows;
        int64_t n_visible = 0;
        for (int64_t n = 0; n < job->n_rows; n++) {
            c[n] = 0;
            if (v[n]) ranked[n_visible++] = (ranked_t){s[n], n};
        }
        if (n_visible > job->top_k) qsort(ranked, (size_t)n_visible, sizeof(ranked_t), by_rank);
        for (int64_t i = 0; i < n_visible && i < job->top_k; i++) c[ranked[i].row] = 1;
    }
    free(ranked);
}

/* Returns 0, -1 when the shapes are out of range, -2 when scratch memory ran out. */
int ds4lab_indexer_select(const float *scores, const uint8_t *visible, int64_t n_tokens, int64_t n_rows,
                          int64_t top_k, uint8_t *chosen, int n_threads) {
    if (n_tokens <= 0 || n_rows < 0 || top_k <= 0) return -1;
    select_job_t job = {scores, visible, chosen, n_rows, top_k, 0};
    parallel_ranges(select_range, &job, n_tokens, n_threads);
    return job.failed ? -2 : 0;
}
