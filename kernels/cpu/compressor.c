/* A compressor's chunk on the CPU (`compressor.compress_chunk`): feed T tokens' kv and score
 * rows (the score with its slot's APE term) at positions p0.. into the frontier, and pool
 * every window the chunk completes.
 *
 * The frontier holds coff * ratio rows of coff * width values (coff = 2 where windows
 * overlap, ratio 4; else 1). Rows base .. base + ratio - 1 (base = ratio when overlapping,
 * else 0) are the window being filled, slot pos % ratio; when overlapping, rows 0 .. ratio - 1
 * hold the last completed window. A completed window's candidates are its own ratio rows
 * (overlapping: the previous window's rows, first half of the columns, then its own rows,
 * second half), and the pooled row is, per column d,
 *
 *     top = max_i s_id;  pooled_d = (sum_i exp(s_id - top) * kv_id) / (sum_i exp(s_id - top))
 *
 * summed over the candidates in order; 0 where top <= -0.5e30 (no candidate written yet).
 * The new frontier is what ds4's token-by-token path leaves, stale slots included: the last
 * completed window moved to rows 0 .. ratio - 1 (overlapping), and each slot the latest of
 * the chunk's tokens written to it.
 *
 * Each window's pooling reads only its own rows, so a window pooled in a prefill chunk and
 * the same window completed by a decode step give the same bits.
 *
 * Shapes: frontier_kv, frontier_score [coff * ratio, coff * width] (read), kv, score
 * [T, coff * width]; pooled [(p0 % ratio + T) / ratio, width]; new_kv, new_score like the
 * frontier (written; they may not alias the inputs).
 */
#include <math.h>
#include <string.h>

#include <stdint.h>

#define EMPTY_SCORE (-1e30f)

typedef struct {
    const float *front_kv, *front_score, *kv, *score;
    int64_t ratio, width, cols, base, m0;
} chunk_t;

/* Row r of the chunk's sequence: the window's earlier tokens from the frontier, then the chunk. */
static const float *seq_row(const chunk_t *c, const float *front, const float *chunk, int64_t r) {
    return r < c->m0 ? front + (c->base + r) * c->cols : chunk + (r - c->m0) * c->cols;
}

/* Candidate i of window w (kv when `kv`, else score), column d of the pooled width. */
static float candidate(const chunk_t *c, int kv, int64_t w, int64_t i, int64_t d) {
    const float *front = kv ? c->front_kv : c->front_score, *chunk = kv ? c->kv : c->score;
    if (c->base == 0) return seq_row(c, front, chunk, w * c->ratio + i)[d];
    if (i >= c->ratio) return seq_row(c, front, chunk, w * c->ratio + i - c->ratio)[c->width + d];
    /* the previous window's rows, first half: the frontier's for the chunk's first window */
    return w == 0 ? front[i * c->cols + d] : seq_row(c, front, chunk, (w - 1) * c->ratio + i)[d];
}

/* Returns 0, or -1 when the arguments are out of range. */
int ds4lab_compress_chunk(const float *front_kv, const float *front_score, const float *kv, const float *score,
                          int64_t n_tokens, int64_t p0, int64_t ratio, int64_t width, int overlap, float *pooled,
                          float *new_kv, float *new_score) {
    if (n_tokens <= 0 || p0 < 0 || ratio <= 0 || width <= 0) return -1;
    const int64_t coff = overlap ? 2 : 1, cols = coff * width, rows = coff * ratio;
    const chunk_t c = {front_kv, front_score, kv, score, ratio, width, cols, overlap ? ratio : 0, p0 % ratio};
    const int64_t n_done = (c.m0 + n_tokens) / ratio, n_cand = coff * ratio;
    for (int64_t w = 0; w < n_done; w++) {
        for (int64_t d = 0; d < width; d++) {
            float top = EMPTY_SCORE;
            int seen = 0;
            for (int64_t i = 0; i < n_cand; i++) {
                const float s = candidate(&c, 0, w, i, d);
                if (!seen || s > top) top = s, seen = 1;
            }
            float num = 0.0f, den = 0.0f;
            for (int64_t i = 0; i < n_cand; i++) {
                const float e = expf(candidate(&c, 0, w, i, d) - top);
                num += e * candidate(&c, 1, w, i, d);
                den += e;
            }
            pooled[w * width + d] = top <= EMPTY_SCORE * 0.5f ? 0.0f : num / den;
        }
    }
    memcpy(new_kv, front_kv, (size_t)(rows * cols) * sizeof(float));
    memcpy(new_score, front_score, (size_t)(rows * cols) * sizeof(float));
    if (overlap && n_done) {                      /* the last completed window becomes rows 0 .. ratio - 1 */
        for (int64_t i = 0; i < ratio; i++) {
            memcpy(new_kv + i * cols, seq_row(&c, front_kv, kv, (n_done - 1) * ratio + i), (size_t)cols * sizeof(float));
            memcpy(new_score + i * cols, seq_row(&c, front_score, score, (n_done - 1) * ratio + i),
                   (size_t)cols * sizeof(float));
        }
    }
    for (int64_t t = n_tokens > ratio ? n_tokens - ratio : 0; t < n_tokens; t++) {
        const int64_t slot = c.base + (p0 + t) % ratio;
        memcpy(new_kv + slot * cols, kv + t * cols, (size_t)cols * sizeof(float));
        memcpy(new_score + slot * cols, score + t * cols, (size_t)cols * sizeof(float));
    }
    return 0;
}
