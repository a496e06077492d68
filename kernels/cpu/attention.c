/* The attention of "float" numerics on the CPU (`attention.attend`, then each head's output
 * as `attend_heads` hands it to the inverse RoPE): for a token t and head h, over the keys
 * its mask shows, in cache order (the raw window's rows, then the compressed rows; K = V),
 *
 *     s_j   = (q_th . k_j) * scale
 *     top   = max(sink_h, max_j s_j)
 *     out_th = (sum_j exp(s_j - top) * k_j) / (exp(sink_h - top) + sum_j exp(s_j - top))
 *
 * The sink joins the denominator only. Each (token, head) is computed on its own: the dots
 * over lanes (lanes.h), every sum over keys in key order, so a token's output does not depend
 * on the chunk it came in, the number of threads or which rows other tokens see. A decode
 * step and the prefill of the same tokens give the same bits. expf is this machine's libm.
 *
 * Shapes: q [T, H, D]; keys [n_raw, D] and comp [n_comp, D] (or NULL with n_comp 0);
 * mask [T, n_raw + n_comp] (nonzero = visible); sinks [H]; out [T, H, D]. D a multiple of
 * 4 * LANES.
 */
#include <math.h>
#include <stdlib.h>

#include "lanes.h"
#include "parallel.h"

typedef struct {
    const float *q, *keys, *comp, *sinks;
    const uint8_t *mask;
    float *out;
    int64_t n_head, dim, n_raw, n_comp;
    float scale;
    int failed;
} attention_job_t;

static const float *key_row(const attention_job_t *job, int64_t j) {
    return j < job->n_raw ? job->keys + j * job->dim : job->comp + (j - job->n_raw) * job->dim;
}

static void attend_range(void *ctx, int64_t begin, int64_t end) {
    attention_job_t *job = (attention_job_t *)ctx;
    const int64_t n_keys = job->n_raw + job->n_comp, dim = job->dim;
    float *scores = (float *)malloc((size_t)(n_keys > 0 ? n_keys : 1) * sizeof(float));
    if (!scores) {
        __atomic_store_n(&job->failed, 1, __ATOMIC_RELAXED);    /* ranges may fail together */
        return;
    }
    for (int64_t item = begin; item < end; item++) {
        const int64_t t = item / job->n_head, h = item % job->n_head;
        const uint8_t *visible = job->mask + t * n_keys;
        const float *q = job->q + item * dim;
        float top = job->sinks[h];
        for (int64_t j = 0; j < n_keys; j++) {
            if (!visible[j]) continue;
            scores[j] = dot_lanes(q, key_row(job, j), dim) * job->scale;
            if (scores[j] > top) top = scores[j];
        }
        float *out = job->out + item * dim;
        for (int64_t c = 0; c < dim; c++) out[c] = 0.0f;
        float denom_keys = 0.0f;
        for (int64_t j = 0; j < n_keys; j++) {
            if (!visible[j]) continue;
            const float w = expf(scores[j] - top);
            denom_keys += w;
            const lanes_t wv = (lanes_t){0} + w;
            const float *k = key_row(job, j);
            for (int64_t c = 0; c < dim; c += LANES) {
                const lanes_t acc = load_floats(out + c) + wv * load_floats(k + c);
                memcpy(out + c, &acc, sizeof acc);
            }
        }
        const float denom = expf(job->sinks[h] - top) + denom_keys;
        for (int64_t c = 0; c < dim; c++) out[c] = out[c] / denom;
    }
    free(scores);
}

/* Returns 0, -1 when the shapes are out of range, -2 when scratch memory ran out. */
int ds4lab_attention(const float *q, const float *keys, const float *comp, const uint8_t *mask, const float *sinks,
                     int64_t n_tokens, int64_t n_head, int64_t dim, int64_t n_raw, int64_t n_comp, float scale,
                     float *out, int n_threads) {
    if (n_tokens <= 0 || n_head <= 0 || dim <= 0 || dim % (4 * LANES) || n_raw < 0 || n_comp < 0 ||
        (n_comp && !comp) || (n_raw && !keys))
        return -1;
    attention_job_t job = {q, keys, comp, sinks, mask, out, n_head, dim, n_raw, n_comp, scale, 0};
    parallel_ranges(attend_range, &job, n_tokens * n_head, n_threads);
    return job.failed ? -2 : 0;
}
