// Lightning-indexer scores, one warp per KEYS key rows of a token: score = sum_h w[h] *
// relu(q_h . k) (model/indexer.py `indexer_scores` after the queries are rotated and rounded).
//   q [T, H, DH]; w [T, H] (already scaled); keys [n_keys, DH]. Output [T, n_keys].
// Every key reads all of the token's q (32 KB on the flash shape, from the L1 or L2), so a
// warp takes KEYS keys and each q load serves them all. HB heads at a time: their q loads
// (made into an array first, all in flight) are independent, and the HB * KEYS dots of a step
// are added over the warp together (ds4lab_transpose_sum32: 31 shuffles for the 32, where a
// butterfly each took 160 in all; each dot summed in the butterfly's order, the same bits). Lane
// b * KEYS + j then holds head h0 + b's dot with key j and adds its relu times the head's
// weight over the steps; a key's score is its HB lanes' sums added at the end.
// CHOOSE (a decode token's indexer, no hook between): the last thread block of a token to
// finish (ds4lab_last_block on counter[t]) then makes its mask row from the scores the
// launch wrote (indexer_topk.cuh), so the choice takes no launch of its own.
//   visible [T, N], window [T, W], n_keys [2] = (N, W), counter (zeroed ints); mask
//   [T, W + N] (with CHOOSE, else unwritten).
constexpr int PER = DH / 32, KEYS = 4;
constexpr int HB = H % 8 == 0 ? 8 : (H % 4 == 0 ? 4 : (H % 2 == 0 ? 2 : 1));
static_assert(HB * KEYS <= 32, "indexer_scores: a step's dots are at most a warp's lanes");
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
    const int my_head = lane / KEYS;                   // this lane's dot of a step: head h0 + my_head,
    float part = 0.0f;                                 // key lane % KEYS
    for (int h0 = 0; h0 < H; h0 += HB) {
        float qv[HB][PER], dot[32];
#pragma unroll
        for (int b = 0; b < HB; ++b) {
#pragma unroll
            for (int k = 0; k < PER; ++k) qv[b][k] = qt[(h0 + b) * DH + lane + 32 * k];
        }
#pragma unroll
        for (int b = 0; b < HB; ++b) {
#pragma unroll
            for (int j = 0; j < KEYS; ++j) {
                float d = 0.0f;
#pragma unroll
                for (int k = 0; k < PER; ++k) d += qv[b][k] * kv[j][k];
                dot[b * KEYS + j] = d;
            }
        }
#pragma unroll
        for (int i = HB * KEYS; i < 32; ++i) dot[i] = 0.0f;
        const float total = ds4lab_transpose_sum32(dot, lane);
        if (my_head < HB) part += fmaxf(total, 0.0f) * w[t * H + h0 + my_head];
    }
    for (int offset = KEYS; offset < 32; offset <<= 1) part += __shfl_xor_sync(0xffffffffu, part, offset);
    if (lane < KEYS && n0 + lane < nk) scores[(size_t)t * nk + n0 + lane] = part;
}
if (!CHOOSE || !ds4lab_last_block(const_cast<int*>(counter) + t, gridDim.x)) return;
const int W = n_keys[1];
ds4lab_indexer_choose<K>(scores + (size_t)t * nk, visible + (size_t)t * nk, window + (size_t)t * W,
                         mask + (size_t)t * (W + nk), nk, W);
