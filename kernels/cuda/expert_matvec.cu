// Routed-expert matvec on block bytes: y[o][row] = sum over u < PAIRS_PER_OUT of
// W[ids[p]][row, :] . x[p / X_DIV, :], with p = o * PAIRS_PER_OUT + u. A warp takes two
// adjacent output rows of one output o (grid y), which share the lane's activation loads
// (the last warp of an odd ROWS reads its one row twice and writes it once). Decode's gate
// and up projections: one pair per output, the token's input shared by its X_DIV =
// n_expert_used pairs (no repeated copy of it); the down projection: PAIRS_PER_OUT =
// n_expert_used, the token's route-weighted expert outputs summed here.
// PARTS warps of a block share a row pair, warp part k taking the pairs u = k, k + PARTS, ...
// (lane partials over its pairs, then its warp sum); the parts' sums are added in part order.
// One warp walking all six of a token's experts left the down projection 2048 warps, each
// waiting on six experts' loads in turn (a fifth of the bandwidth on the H200); split, there
// are four times as many warps, each with at most two experts' loads.
// Inputs: raw [n_expert, EXPERT_BYTES] uint8 (ROW_BYTES per row), ids (pairs, int32),
// x [pairs / X_DIV, COLS]; the format header says how a row's bytes decode.
DS4LAB_DOT_STAGE
const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, part = warp % PARTS;
const int row = (blockIdx.x * (blockDim.x >> 5) + warp) / PARTS * 2;
const int o = blockIdx.y;
__shared__ float sums[32][2];
float acc[2] = {0.0f, 0.0f};
const bool inside = row < ROWS;
const int next = row + 1 < ROWS ? row + 1 : row;
if (inside) {
    for (int u = part; u < PAIRS_PER_OUT; u += PARTS) {
        const int p = o * PAIRS_PER_OUT + u;
        const uint8_t* w = raw + (size_t)ids[p] * EXPERT_BYTES;
        const uint8_t* const rows[2] = {w + (size_t)row * ROW_BYTES, w + (size_t)next * ROW_BYTES};
        ds4lab_expert_dot<COLS, 2>(rows, x + (size_t)(p / X_DIV) * COLS, lane, acc DS4LAB_DOT_TABLES);
    }
}
acc[0] = ds4lab_warp_sum(acc[0]);
acc[1] = ds4lab_warp_sum(acc[1]);
if (PARTS > 1) {
    if (lane == 0) {
        sums[warp][0] = acc[0];
        sums[warp][1] = acc[1];
    }
    __syncthreads();
    if (part != 0) return;
    for (int k = 1; k < PARTS; ++k) {
        acc[0] += sums[warp + k][0];
        acc[1] += sums[warp + k][1];
    }
}
if (lane == 0 && inside) {
    y[(size_t)o * ROWS + row] = acc[0];
    if (next != row) y[(size_t)o * ROWS + next] = acc[1];
}
