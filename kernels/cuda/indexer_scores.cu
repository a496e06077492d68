// Lightning-indexer scores, one warp per KEYS key rows of a token: score = sum_h w[h] *
// relu(q_h . k) (model/indexer.py `indexer_scores` after the queries are rotated and rounded).
//   q [T, H, DH]; w [T, H] (already scaled); keys [n_keys, DH]. Output [T, n_keys].
// Every key reads all of the token's q (32 KB on the flash shape, from the L1 or L2), so a
// warp takes KEYS keys and each q load serves them all. HB heads at a time: their q loads
// (made into an array first, all in flight) and their butterflies are independent, so they
// overlap. Each head's dot and the score's sum over heads keep their order (the bits of one
// key a warp, one head at a time).
// CHOOSE (a decode token's indexer, no hook between): the last thread block of a token to
// finish (ds4lab_last_block on counter[t]) then makes its mask row from the scores the
// launch wrote (indexer_topk.cuh), so the choice takes no launch of its own.
//   visible [T, N], window [T, W], n_keys [2] = (N, W), counter (zeroed ints); mask
//   [T, W + N] (with CHOOSE, else unwritten).
constexpr int PER = DH / 32, KEYS = 4;
constexpr int HB = H % 8 == 0 ? 8 : (H % 4 == 0 ? 4 : (H % 2 == 0 ? 2 : 1));
const int lane = threadIdx.x & 31;
const int n0 = (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * KEYS;
const int t = blockIdx.y;
const int nk = n_keys[0];
if (n0 < nk) {                                     // (no return: the last block's barriers want every thread)
    float kv[KEYS][PER];
#pragma unroll
    for (int j = 0; j < KEYS; ++j) {
        const int n = min(n0 + j, nk - 1);             // past the last key: the last again, unwritten
#pragma unroll
        for (int k = 0; k < PER; ++k) kv[j][k] = keys[(size_t)n * DH + lane + 32 * k];
    }
    const float* qt = q + (size_t)t * H * DH;
    float score[KEYS] = {};
    for (int h0 = 0; h0 < H; h0 += HB) {
        float qv[HB][PER], dot[HB][KEYS];
#pragma unroll
        for (int b = 0; b < HB; ++b) {
#pragma unroll
            for (int k = 0; k < PER; ++k) qv[b][k] = qt[(h0 + b) * DH + lane + 32 * k];
        }
#pragma unroll
        for (int b = 0; b < HB; ++b) {
#pragma unroll
            for (int j = 0; j < KEYS; ++j) {
                dot[b][j] = 0.0f;
#pragma unroll
                for (int k = 0; k < PER; ++k) dot[b][j] += qv[b][k] * kv[j][k];
            }
        }
#pragma unroll
        for (int b = 0; b < HB; ++b) {
#pragma unroll
            for (int j = 0; j < KEYS; ++j) dot[b][j] = ds4lab_warp_sum_all(dot[b][j]);
        }
#pragma unroll
        for (int b = 0; b < HB; ++b) {
#pragma unroll
            for (int j = 0; j < KEYS; ++j) score[j] += fmaxf(dot[b][j], 0.0f) * w[t * H + h0 + b];
        }
    }
    if (lane == 0) {
#pragma unroll
        for (int j = 0; j < KEYS; ++j)
            if (n0 + j < nk) scores[(size_t)t * nk + n0 + j] = score[j];
    }
}
if (!CHOOSE || !ds4lab_last_block(const_cast<int*>(counter) + t, gridDim.x)) return;
const int W = n_keys[1];
ds4lab_indexer_choose<K>(scores + (size_t)t * nk, visible + (size_t)t * nk, window + (size_t)t * W,
                         mask + (size_t)t * (W + nk), nk, W);
