// Routed-expert matvec on block bytes: y[o][row] = sum over u < PAIRS_PER_OUT of
// W[ids[p]][row, :] . x[p / X_DIV, :], with p = o * PAIRS_PER_OUT + u. A warp takes P
// adjacent output rows of one output o (grid y), which share the lane's activation loads
// (the last warp of a ROWS not a multiple of P reads its last row again and writes it once):
// a row of 2048 Q2_K values is 672 bytes against 8 KB of input, and the input's reads from
// the L1, not the weights', bound these kernels. Decode's gate and up projections: one pair
// per output, the token's input shared by its X_DIV = n_expert_used pairs (no repeated copy
// of it); the down projection: PAIRS_PER_OUT = n_expert_used, the token's route-weighted
// expert outputs summed here.
// PARTS warps of a block share P rows, warp part k taking the pairs u = k, k + PARTS, ...
// (lane partials over its pairs, then its warp sum); the parts' sums are added in part order.
// One warp walking all six of a token's experts left the down projection 2048 warps, each
// waiting on six experts' loads in turn (a fifth of the bandwidth on the H200); split, there
// are four times as many warps, each with at most two experts' loads.
// Inputs: raw [n_expert, EXPERT_BYTES] uint8 (ROW_BYTES per row), ids (pairs, int32),
// x [pairs / X_DIV, COLS]; the format header says how a row's bytes decode.
DS4LAB_DOT_STAGE
const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, part = warp % PARTS;
const int row0 = (blockIdx.x * (blockDim.x >> 5) + warp) / PARTS * P;
const int o = blockIdx.y;
__shared__ float sums[32][P];
float acc[P] = {};
const bool inside = row0 < ROWS;
if (inside) {
    for (int u = part; u < PAIRS_PER_OUT; u += PARTS) {
        const int p = o * PAIRS_PER_OUT + u;
        const uint8_t* w = raw + (size_t)ids[p] * EXPERT_BYTES;
        const uint8_t* rows[P];
#pragma unroll
        for (int i = 0; i < P; ++i) rows[i] = w + (size_t)(row0 + i < ROWS ? row0 + i : ROWS - 1) * ROW_BYTES;
        ds4lab_expert_dot<COLS, P>(rows, x + (size_t)(p / X_DIV) * COLS, lane, acc DS4LAB_DOT_TABLES);
    }
}
#pragma unroll
for (int i = 0; i < P; ++i) acc[i] = ds4lab_warp_sum(acc[i]);
if (PARTS > 1) {
    if (lane == 0) {
#pragma unroll
        for (int i = 0; i < P; ++i) sums[warp][i] = acc[i];
    }
    __syncthreads();
    if (part != 0) return;
    for (int k = 1; k < PARTS; ++k) {
#pragma unroll
        for (int i = 0; i < P; ++i) acc[i] += sums[warp + k][i];
    }
}
if (lane == 0 && inside) {
#pragma unroll
    for (int i = 0; i < P; ++i) {
        if (row0 + i < ROWS) y[(size_t)o * ROWS + row0 + i] = acc[i];
    }
}
