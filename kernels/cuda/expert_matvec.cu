// Routed-expert matvec on block bytes: y[o][row] = sum over u < PAIRS_PER_OUT of
// W[ids[p]][row, :] . x[p / X_DIV, :], with p = o * PAIRS_PER_OUT + u. A warp takes NR = 4
// adjacent output rows of one output o (grid y), which share the lane's activation loads:
// a lane reads 8 activations for each 2-4 bytes of a row's weights, so the activation is
// most of the kernel's L1 traffic (rows past ROWS read the last row again, unwritten).
// Decode's gate and up projections: one pair per output, the token's input shared by its X_DIV =
// n_expert_used pairs (no repeated copy of it); the down projection: PAIRS_PER_OUT =
// n_expert_used, the token's route-weighted expert outputs summed here.
// PARTS warps of a block share the rows, warp part k taking the pairs u = k, k + PARTS, ...
// (lane partials over its pairs, then its warp sum); the parts' sums are added in part order.
// One warp walking all six of a token's experts left the down projection 2048 warps, each
// waiting on six experts' loads in turn (a fifth of the bandwidth on the H200); split 4 ways
// (and 4 rows a warp) there are twice as many warps, each with at most two experts' loads.
// Inputs: raw [n_expert, EXPERT_BYTES] uint8 (ROW_BYTES per row), ids (pairs, int32),
// x [pairs / X_DIV, COLS]; the format header says how a row's bytes decode.
DS4LAB_DOT_STAGE
constexpr int NR = 4;
const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, part = warp % PARTS;
const int row = (blockIdx.x * (blockDim.x >> 5) + warp) / PARTS * NR;
const int o = blockIdx.y;
__shared__ float sums[32][NR];
float acc[NR] = {};
const bool inside = row < ROWS;
if (inside) {
    for (int u = part; u < PAIRS_PER_OUT; u += PARTS) {
        const int p = o * PAIRS_PER_OUT + u;
        const uint8_t* w = raw + (size_t)ids[p] * EXPERT_BYTES;
        const uint8_t* rows[NR];
#pragma unroll
        for (int i = 0; i < NR; ++i) rows[i] = w + (size_t)min(row + i, ROWS - 1) * ROW_BYTES;
        ds4lab_expert_dot<COLS, NR>(rows, x + (size_t)(p / X_DIV) * COLS, lane, acc DS4LAB_DOT_TABLES);
    }
}
#pragma unroll
for (int i = 0; i < NR; ++i) acc[i] = ds4lab_warp_sum(acc[i]);
if (PARTS > 1) {
    if (lane == 0) {
#pragma unroll
        for (int i = 0; i < NR; ++i) sums[warp][i] = acc[i];
    }
    __syncthreads();
    if (part != 0) return;
    for (int k = 1; k < PARTS; ++k) {
#pragma unroll
        for (int i = 0; i < NR; ++i) acc[i] += sums[warp + k][i];
    }
}
if (lane == 0 && inside) {
#pragma unroll
    for (int i = 0; i < NR; ++i)
        if (row + i < ROWS) y[(size_t)o * ROWS + row + i] = acc[i];
}
