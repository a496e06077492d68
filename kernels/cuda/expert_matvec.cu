// Routed-expert matvec on block bytes: y[o][row] = sum over u < PAIRS_PER_OUT of
// W[ids[p]][row, :] . x[p / X_DIV, :], with p = o * PAIRS_PER_OUT + u. One warp per output
// row of one output o (grid y). Decode's gate and up projections: one pair per output, the
// token's input shared by its X_DIV = n_expert_used pairs (no repeated copy of it); the down
// projection: PAIRS_PER_OUT = n_expert_used, the token's route-weighted expert outputs summed
// here (lane partials over the pairs, then one warp sum).
// Inputs: raw [n_expert, EXPERT_BYTES] uint8 (ROW_BYTES per row), ids (pairs, int32),
// x [pairs / X_DIV, COLS]; the format header says how a row's bytes decode.
const int lane = threadIdx.x & 31;
const int row = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
const int o = blockIdx.y;
if (row >= ROWS) return;
float acc = 0.0f;
for (int u = 0; u < PAIRS_PER_OUT; ++u) {
    const int p = o * PAIRS_PER_OUT + u;
    const uint8_t* w = raw + (size_t)ids[p] * EXPERT_BYTES + (size_t)row * ROW_BYTES;
    acc += ds4lab_expert_dot<COLS>(w, x + (size_t)(p / X_DIV) * COLS, lane DS4LAB_DOT_TABLES);
}
acc = ds4lab_warp_sum(acc);
if (lane == 0) y[(size_t)o * ROWS + row] = acc;
