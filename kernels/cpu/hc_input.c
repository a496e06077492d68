/* A sublayer's hyper-connections on the CPU: the control (pre, post, comb) from the streams,
 * the streams collapsed by pre and RMS-normed (the sublayer's input), and after the sublayer
 * the new streams from its output, post and comb. The same steps as the MLX
 * composition in `ds4lab/model/hc.py` (ds4's order: RMSNorm of the flattened streams, the
 * mixer's dots, sigmoids, the softmax of comb + eps, Sinkhorn), in one call per chunk instead
 * of some twenty MLX operations and a host round trip for the Sinkhorn iterations.
 *
 * Every token is computed on its own, in an order fixed by this source (sums over lanes as
 * in lanes.h, then in index order), so a token's bits do not depend on the chunk or the
 * thread count: prefill and decode agree bit for bit. The exponentials are the C library's
 * expf, so the bits are those of this machine's libm.
 *
 * Shapes: streams [T, n_hc, width]; fn [n_mix, n_hc * width] (n_mix = 2 n_hc + n_hc^2: pre,
 * post, comb rows in that order); scale [3]; base [n_mix]; pre, post [T, n_hc]; comb [T,
 * n_hc (from), n_hc (to)]; norm [width] or NULL; the sublayer input [T, width]; its output
 * (and add) [T, width]; the new streams [T, n_hc, width].
 */
#include <math.h>

#include "lanes.h"
#include "parallel.h"

#define MAX_HC 16

typedef struct {
    const float *streams, *fn, *scale, *base, *norm;           /* the control's and the collapse's */
    const float *pre_in, *post_in, *comb_in, *sub_out, *add;   /* the collapse's and the expansion's */
    float *pre, *post, *comb, *out;
    int64_t n_hc, width;
    float rms_eps, hc_eps;
    int iters;
} hc_job_t;

static float sigmoid(float z) {
    return 1.0f / (1.0f + expf(-z));
}

/* 1 / sqrt(mean of squares + eps), the mean's sum over lanes. */
static float rms_scale(const float *x, int64_t n, float eps) {
    return 1.0f / sqrtf(dot_lanes(x, x, n) / (float)n + eps);
}

/* comb[i][j] /= (sum_i comb[i][j] + eps) for every j (axis 1: over the source streams). */
static void normalise_columns(float *c, int64_t n, float eps) {
    for (int64_t j = 0; j < n; j++) {
        float s = 0.0f;
        for (int64_t i = 0; i < n; i++) s += c[i * n + j];
        for (int64_t i = 0; i < n; i++) c[i * n + j] = c[i * n + j] / (s + eps);
    }
}

static void normalise_rows(float *c, int64_t n, float eps) {
    for (int64_t i = 0; i < n; i++) {
        float s = 0.0f;
        for (int64_t j = 0; j < n; j++) s += c[i * n + j];
        for (int64_t j = 0; j < n; j++) c[i * n + j] = c[i * n + j] / (s + eps);
    }
}

static void control_range(void *ctx, int64_t begin, int64_t end) {
    const hc_job_t *job = (const hc_job_t *)ctx;
    const int64_t n = job->n_hc, flat_n = n * job->width, n_mix = 2 * n + n * n;
    float mix[2 * MAX_HC + MAX_HC * MAX_HC];
    for (int64_t t = begin; t < end; t++) {
        const float *flat = job->streams + t * flat_n;
        const float inv = rms_scale(flat, flat_n, job->rms_eps);
        for (int64_t m = 0; m < n_mix; m++) {          /* the mixer's dots with the normed streams */
            lanes_t acc = {0};
            const float *w = job->fn + m * flat_n;
            for (int64_t k = 0; k < flat_n; k += LANES) acc = acc + load_floats(w + k) * (load_floats(flat + k) * inv);
            mix[m] = lanes_sum(acc);
        }
        float *pre = job->pre + t * n, *post = job->post + t * n, *c = job->comb + t * n * n;
        for (int64_t i = 0; i < n; i++) {
            pre[i] = sigmoid(mix[i] * job->scale[0] + job->base[i]) + job->hc_eps;
            post[i] = 2.0f * sigmoid(mix[n + i] * job->scale[1] + job->base[n + i]);
        }
        for (int64_t i = 0; i < n; i++) {                 /* softmax of each row, + eps */
            float *row = c + i * n, top = -INFINITY, s = 0.0f;
            for (int64_t j = 0; j < n; j++) {
                row[j] = mix[2 * n + i * n + j] * job->scale[2] + job->base[2 * n + i * n + j];
                top = row[j] > top ? row[j] : top;
            }
            for (int64_t j = 0; j < n; j++) s += row[j] = expf(row[j] - top);
            for (int64_t j = 0; j < n; j++) row[j] = row[j] / s + job->hc_eps;
        }
        normalise_columns(c, n, job->hc_eps);
        for (int it = 1; it < job->iters; it++) {
            normalise_rows(c, n, job->hc_eps);
            normalise_columns(c, n, job->hc_eps);
        }
    }
}

static void collapse_range(void *ctx, int64_t begin, int64_t end) {
    const hc_job_t *job = (const hc_job_t *)ctx;
    const int64_t n = job->n_hc, d = job->width;
    for (int64_t t = begin; t < end; t++) {
        const float *s = job->streams + t * n * d, *pre = job->pre_in + t * n;
        float *out = job->out + t * d;
        for (int64_t k = 0; k < d; k++) {
            float acc = pre[0] * s[k];
            for (int64_t i = 1; i < n; i++) acc = acc + pre[i] * s[i * d + k];
            out[k] = acc;
        }
        const float inv = rms_scale(out, d, job->rms_eps);
        for (int64_t k = 0; k < d; k++) out[k] = job->norm ? (out[k] * inv) * job->norm[k] : out[k] * inv;
    }
}

/* pre, post, comb of T tokens. Returns 0, or -1 when the shapes are out of range. */
int ds4lab_hc_control(const float *streams, const float *fn, const float *scale, const float *base,
                      int64_t n_tokens, int64_t n_hc, int64_t width, float rms_eps, float hc_eps, int iters,
                      float *pre, float *post, float *comb, int n_threads) {
    if (n_tokens <= 0 || n_hc <= 0 || n_hc > MAX_HC || width <= 0 || (n_hc * width) % (4 * LANES) || iters < 1) return -1;
    hc_job_t job = {.streams = streams, .fn = fn, .scale = scale, .base = base, .pre = pre, .post = post,
                    .comb = comb, .n_hc = n_hc, .width = width, .rms_eps = rms_eps, .hc_eps = hc_eps, .iters = iters};
    parallel_ranges(control_range, &job, n_tokens, n_threads);
    return 0;
}

/* out[t] = RMSNorm(sum_i pre[t][i] * streams[t][i]) * norm (norm may be NULL). */
int ds4lab_hc_collapse_norm(const float *streams, const float *pre, const float *norm, int64_t n_tokens,
                            int64_t n_hc, int64_t width, float rms_eps, float *out, int n_threads) {
    if (n_tokens <= 0 || n_hc <= 0 || width <= 0 || width % (4 * LANES)) return -1;
    hc_job_t job = {.streams = streams, .norm = norm, .pre_in = pre, .out = out, .n_hc = n_hc, .width = width,
                    .rms_eps = rms_eps};
    parallel_ranges(collapse_range, &job, n_tokens, n_threads);
    return 0;
}

/* New streams after a sublayer: stream c = post[c] * (out + add) + sum over a, in order, of
 * comb[a][c] * streams[a] (`hc.hc_expand`). add may be NULL. */
static void expand_range(void *ctx, int64_t begin, int64_t end) {
    const hc_job_t *job = (const hc_job_t *)ctx;
    const int64_t n = job->n_hc, d = job->width;
    for (int64_t t = begin; t < end; t++) {
        const float *s = job->streams + t * n * d, *out = job->sub_out + t * d;
        const float *add = job->add ? job->add + t * d : 0;
        const float *post = job->post_in + t * n, *comb = job->comb_in + t * n * n;
        float *y = job->out + t * n * d;
        for (int64_t c = 0; c < n; c++)
            for (int64_t k = 0; k < d; k++) {
                float mixed = comb[c] * s[k];
                for (int64_t a = 1; a < n; a++) mixed = mixed + comb[a * n + c] * s[a * d + k];
                const float o = add ? out[k] + add[k] : out[k];
                y[c * d + k] = post[c] * o + mixed;
            }
    }
}

int ds4lab_hc_expand(const float *sub_out, const float *add, const float *streams, const float *post,
                     const float *comb, int64_t n_tokens, int64_t n_hc, int64_t width, float *out, int n_threads) {
    if (n_tokens <= 0 || n_hc <= 0 || n_hc > MAX_HC || width <= 0) return -1;
    hc_job_t job = {.streams = streams, .post_in = post, .comb_in = comb, .sub_out = sub_out, .add = add,
                    .out = out, .n_hc = n_hc, .width = width};
    parallel_ranges(expand_range, &job, n_tokens, n_threads);
    return 0;
}
