// Lightning-indexer scores, one warp per (token, key row): score = sum_h w[h] * relu(q_h . k)
// (model/indexer.py `indexer_scores` after the queries are rotated and rounded).
//   q [T, H, DH]; w [T, H] (already scaled); keys [n_keys, DH]. Output [T, n_keys].
constexpr int PER = DH / 32;
const int lane = threadIdx.x & 31;
const int n = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
const int t = blockIdx.y;
const int nk = n_keys[0];
if (n >= nk) return;
float kv[PER];
for (int k = 0; k < PER; ++k) kv[k] = keys[(size_t)n * DH + lane + 32 * k];
const float* qt = q + (size_t)t * H * DH;
// HB heads at a time: their q loads and their butterflies are independent, so they overlap
// (one head at a time, every head waits on its loads and five dependent shuffles: 64 such
// chains a key on the flash shape). Each head's dot and the score's sum over heads keep
// their order, so the bits are the same.
constexpr int HB = H % 8 == 0 ? 8 : (H % 4 == 0 ? 4 : (H % 2 == 0 ? 2 : 1));
float score = 0.0f;
for (int h0 = 0; h0 < H; h0 += HB) {
    float dot[HB];
#pragma unroll
    for (int b = 0; b < HB; ++b) {
        dot[b] = 0.0f;
#pragma unroll
        for (int k = 0; k < PER; ++k) dot[b] += qt[(h0 + b) * DH + lane + 32 * k] * kv[k];
    }
#pragma unroll
    for (int b = 0; b < HB; ++b) dot[b] = ds4lab_warp_sum_all(dot[b]);
#pragma unroll
    for (int b = 0; b < HB; ++b) score += fmaxf(dot[b], 0.0f) * w[t * H + h0 + b];
}
if (lane == 0) scores[(size_t)t * nk + n] = score;
