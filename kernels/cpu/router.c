/* The FFN's router on the CPU (`moe.router_probs`, `select_experts`, `route_weights`): for
 * each token, probs = sqrt(softplus(W_gate_inp . x)) over the experts; the chosen experts are
 * the hash table's row of the token id (hash layers), else the n_used best of probs + bias
 * (the bias only selects; ties to the lower id); their weights are the chosen probs over
 * max(their sum in slot order, 2^-14), times scale.
 *
 * Every token on its own, each logit a dot over lanes (lanes.h): a token's bits do not depend
 * on the chunk or the thread count. softplus uses this machine's libm expf and log1pf.
 *
 * Shapes: x [T, d]; w [E, d]; bias [E] or NULL; tokens [T] and table [vocab, n_used] (hash
 * layers) or NULL; probs [T, E]; experts [T, n_used] int32; weights [T, n_used].
 */
#include <math.h>

#include "lanes.h"
#include "parallel.h"

#define MAX_USED 64

typedef struct {
    const float *x, *w, *bias;
    const int32_t *tokens, *table;
    float *probs, *weights;
    int32_t *experts;
    int64_t d, n_expert, n_used;
    float scale;
} router_job_t;

static void route_range(void *ctx, int64_t begin, int64_t end) {
    const router_job_t *job = (const router_job_t *)ctx;
    const int64_t e_n = job->n_expert, u_n = job->n_used;
    for (int64_t t = begin; t < end; t++) {
        float *p = job->probs + t * e_n;
        for (int64_t e = 0; e < e_n; e++) {
            const float l = dot_lanes(job->w + e * job->d, job->x + t * job->d, job->d);
            p[e] = sqrtf(l > 20.0f ? l : (l < -20.0f ? expf(l) : log1pf(expf(l))));
        }
        int32_t *ids = job->experts + t * u_n;
        if (job->table) {
            for (int64_t s = 0; s < u_n; s++) ids[s] = job->table[(int64_t)job->tokens[t] * u_n + s];
        } else {
            for (int64_t s = 0; s < u_n; s++) {             /* the s-th best not yet chosen */
                int32_t best = -1;
                float best_v = 0.0f;
                for (int64_t e = 0; e < e_n; e++) {
                    int taken = 0;
                    for (int64_t r = 0; r < s; r++) taken |= ids[r] == e;
                    const float v = job->bias ? p[e] + job->bias[e] : p[e];
                    if (!taken && (best < 0 || v > best_v)) best = (int32_t)e, best_v = v;
                }
                ids[s] = best;
            }
        }
        float sum = 0.0f;
        for (int64_t s = 0; s < u_n; s++) sum += p[ids[s]];
        const float denom = sum > 0x1p-14f ? sum : 0x1p-14f;
        for (int64_t s = 0; s < u_n; s++) job->weights[t * u_n + s] = p[ids[s]] / denom * job->scale;
    }
}

/* Returns 0, or -1 when the shapes are out of range, a token id is not in [0, vocab) or the
 * table names an expert not in [0, n_expert) (checked before anything is computed). */
int ds4lab_router(const float *x, const float *w, const float *bias, const int32_t *tokens, const int32_t *table,
                  int64_t vocab, int64_t n_tokens, int64_t d, int64_t n_expert, int64_t n_used, float scale,
                  float *probs, int32_t *experts, float *weights, int n_threads) {
    if (n_tokens <= 0 || d <= 0 || d % (4 * LANES) || n_expert <= 0 || n_used <= 0 || n_used > MAX_USED ||
        n_used > n_expert || (table && (!tokens || vocab <= 0)))
        return -1;
    if (table) {                                          /* the rows the tokens use */
        for (int64_t t = 0; t < n_tokens; t++) {
            if (tokens[t] < 0 || tokens[t] >= vocab) return -1;
            for (int64_t s = 0; s < n_used; s++) {
                const int32_t e = table[(int64_t)tokens[t] * n_used + s];
                if (e < 0 || e >= n_expert) return -1;
            }
        }
    }
    router_job_t job = {x, w, bias, tokens, table, probs, weights, experts, d, n_expert, n_used, scale};
    parallel_ranges(route_range, &job, n_tokens, n_threads);
    return 0;
}
