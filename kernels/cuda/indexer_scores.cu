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
float score = 0.0f;
for (int h = 0; h < H; ++h) {
    float dot = 0.0f;
    for (int k = 0; k < PER; ++k) dot += qt[h * DH + lane + 32 * k] * kv[k];
    dot = ds4lab_warp_sum_all(dot);
    score += fmaxf(dot, 0.0f) * w[t * H + h];
}
if (lane == 0) scores[(size_t)t * nk + n] = score;
