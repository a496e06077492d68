/* The routed experts of T tokens on the CPU:
 *     y[t] = sum over t's chosen experts e, in ascending id, of W_down[e] . mid
 *     mid  = w * swiglu(W_gate[e] . x[t], W_up[e] . x[t])   (clamped as `moe.swiglu`)
 * read from the stacked matrices where they lie (no copy of six experts per token, no
 * twenty MLX operations per layer). Each matrix comes in its GGUF block format (IQ2_XXS,
 * Q2_K, Q4_K: ds4's files, read at 2-4.5 bits a weight, block_dots.h) or decoded in float32
 * (any other type, when the loader kept it decoded within its budget); a row read in its blocks gives the bits of
 * the same row decoded, so the two forms agree bit for bit.
 *
 * Every (token, expert) pair is computed on its own (each dot over lanes as in lanes.h;
 * threads split the pairs), then each token's y is summed from zero one expert at a time in
 * ascending id: a token's bits do not depend on the chunk or the thread count, so prefill
 * and decode agree bit for bit. The sigmoid is
 * 1 / (1 + expf(-g)) with this machine's libm expf.
 *
 * Shapes: gate, up [E, n_ff, d_model]; down [E, d_model, n_ff] (in float32 or as each
 * type's blocks, rows of 256-value blocks); x [T, d_model]; experts [T, U] int32, weights
 * [T, U]; mid [T, U, n_ff] (NULL: not written; in the token's slot order) and y [T, d_model].
 * The IQ2_XXS tables: grid [256][8] bytes, ksigns [128].
 */
#include <math.h>

#include "block_dots.h"
#include "parallel.h"

#define MAX_USED 64
#define MAX_FF 16384      /* a token's activations live on the stack (64 KiB at most) */

typedef struct {
    const uint8_t *data;
    block_dot_fn dot;                     /* NULL: float32 rows */
    int64_t row_bytes, expert_bytes;
} expert_matrix_t;

typedef struct {
    expert_matrix_t gate, up, down;
    const float *x, *weights;
    const int32_t *experts;
    const uint8_t *grid, *ksigns;
    float *mid, *z, *y;
    int64_t d_model, n_ff, n_used;
    float clamp;
} experts_job_t;

/* Row `row` of expert e's matrix . x (n values). */
static float row_dot(const experts_job_t *job, const expert_matrix_t *m, int64_t e, int64_t row, const float *x,
                     int64_t n) {
    const uint8_t *r = m->data + e * m->expert_bytes + row * m->row_bytes;
    return m->dot ? m->dot(r, x, n, job->grid, job->ksigns) : dot_lanes((const float *)r, x, n);
}

static expert_matrix_t expert_matrix(const void *data, int type, int64_t rows, int64_t cols) {
    const int64_t row_bytes = block_row_bytes(type, cols);
    const block_dot_fn dot = type == TYPE_F32 ? 0 : block_dot(type);
    return (expert_matrix_t){(const uint8_t *)data, dot, row_bytes, rows * row_bytes};
}

/* SwiGLU with ds4's clamp (`moe.swiglu`): gate at most clamp, up within +-clamp. */
static float swiglu(float g, float v, float clamp) {
    if (clamp > 1e-6f) {
        g = g < clamp ? g : clamp;
        v = v < -clamp ? -clamp : (v > clamp ? clamp : v);
    }
    return (g * (1.0f / (1.0f + expf(-g)))) * v;
}

/* Pairs [begin, end) of (token, slot), p = t * U + slot: z[p] = W_down[e] . (w * swiglu(...)). */
static void pairs_range(void *ctx, int64_t begin, int64_t end) {
    const experts_job_t *job = (const experts_job_t *)ctx;
    const int64_t d = job->d_model, f = job->n_ff, u_n = job->n_used;
    float act[MAX_FF];
    for (int64_t p = begin; p < end; p++) {
        const float *x = job->x + (p / u_n) * d;
        const int64_t e = job->experts[p];
        const float w = job->weights[p];
        for (int64_t j = 0; j < f; j++) {
            float g = row_dot(job, &job->gate, e, j, x, d), v = row_dot(job, &job->up, e, j, x, d);
            act[j] = swiglu(g, v, job->clamp) * w;
        }
        if (job->mid) memcpy(job->mid + p * f, act, (size_t)f * sizeof(float));
        for (int64_t k = 0; k < d; k++) job->z[p * d + k] = row_dot(job, &job->down, e, k, act, f);
    }
}

/* Tokens [begin, end): y[t] = the token's z rows summed from zero in ascending expert id. */
static void sums_range(void *ctx, int64_t begin, int64_t end) {
    const experts_job_t *job = (const experts_job_t *)ctx;
    const int64_t d = job->d_model, u_n = job->n_used;
    for (int64_t t = begin; t < end; t++) {
        const int32_t *ids = job->experts + t * u_n;
        int order[MAX_USED];                    /* slots by ascending expert id (insertion sort) */
        for (int64_t s = 0; s < u_n; s++) {
            int64_t k = s;
            while (k > 0 && ids[order[k - 1]] > ids[s]) order[k] = order[k - 1], k--;
            order[k] = (int)s;
        }
        float *y = job->y + t * d;
        for (int64_t k = 0; k < d; k++) y[k] = 0.0f;
        for (int64_t r = 0; r < u_n; r++) {
            const float *z = job->z + (t * u_n + order[r]) * d;
            for (int64_t k = 0; k < d; k++) y[k] = y[k] + z[k];
        }
    }
}

/* z [T, U, d_model] is the caller's scratch; *_type 0 float32, 1 IQ2_XXS, 2 Q2_K, 3 Q4_K.
 * Returns 0, or -1 when the shapes or types are out of range or an expert id is not in
 * [0, n_expert) (checked before anything is computed). */
int ds4lab_routed_experts(const void *gate, int gate_type, const void *up, int up_type, const void *down,
                          int down_type, int64_t n_expert, int64_t d_model, int64_t n_ff, const float *x,
                          const int32_t *experts, const float *weights, int64_t n_tokens, int64_t n_used, float clamp,
                          const uint8_t *grid, const uint8_t *ksigns, float *mid, float *z, float *y, int n_threads) {
    const int types[3] = {gate_type, up_type, down_type};
    const int64_t widths[3] = {d_model, d_model, n_ff};
    if (n_expert <= 0 || d_model <= 0 || n_ff <= 0 || n_ff > MAX_FF || d_model % (4 * LANES) || n_ff % (4 * LANES) ||
        n_tokens <= 0 || n_used <= 0 || n_used > MAX_USED)
        return -1;
    for (int i = 0; i < 3; i++) {
        if (types[i] < TYPE_F32 || types[i] > TYPE_Q4_K || (types[i] != TYPE_F32 && widths[i] % QK)) return -1;
        if (types[i] == TYPE_IQ2_XXS && (!grid || !ksigns)) return -1;
    }
    for (int64_t i = 0; i < n_tokens * n_used; i++)
        if (experts[i] < 0 || experts[i] >= n_expert) return -1;
    experts_job_t job = {expert_matrix(gate, gate_type, n_ff, d_model), expert_matrix(up, up_type, n_ff, d_model),
                         expert_matrix(down, down_type, d_model, n_ff), x, weights, experts, grid, ksigns, mid, z, y,
                         d_model, n_ff, n_used, clamp};
    parallel_ranges(pairs_range, &job, n_tokens * n_used, n_threads);
    parallel_ranges(sums_range, &job, n_tokens, n_tokens > 1 ? n_threads : 1);
    return 0;
}

/* out[i] = swiglu(gate[i], up[i]) for n values: the shared expert's activation, the same
 * float steps as the routed experts' (without the route weight). */
void ds4lab_swiglu(const float *gate, const float *up, int64_t n, float clamp, float *out) {
    for (int64_t i = 0; i < n; i++) out[i] = swiglu(gate[i], up[i], clamp);
}
