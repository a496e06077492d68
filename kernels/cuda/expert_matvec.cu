// Routed-expert matvec on block bytes: y[o][row] = sum over u < PAIRS_PER_OUT of
// W[ids[p]][row, :] . x[p / X_DIV, :], with p = o * PAIRS_PER_OUT + u. One warp per two
// adjacent output rows of one output o (grid y), which share the lane's activation loads
// (the last warp of an odd ROWS reads its one row twice and writes it once). Decode's gate
// and up projections: one pair per output, the token's input shared by its X_DIV =
// n_expert_used pairs (no repeated copy of it); the down projection: PAIRS_PER_OUT =
// n_expert_used, the token's route-weighted expert outputs summed here (lane partials over
// the pairs, then one warp sum).
// Inputs: raw [n_expert, EXPERT_BYTES] uint8 (ROW_BYTES per row), ids (pairs, int32),
// x [pairs / X_DIV, COLS]; the format header says how a row's bytes decode.
DS4LAB_DOT_STAGE
const int lane = threadIdx.x & 31;
const int row = ((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * 2;
const int o = blockIdx.y;
if (row >= ROWS) return;
const int next = row + 1 < ROWS ? row + 1 : row;
float acc[2] = {0.0f, 0.0f};
for (int u = 0; u < PAIRS_PER_OUT; ++u) {
    const int p = o * PAIRS_PER_OUT + u;
    const uint8_t* w = raw + (size_t)ids[p] * EXPERT_BYTES;
    const uint8_t* const rows[2] = {w + (size_t)row * ROW_BYTES, w + (size_t)next * ROW_BYTES};
    ds4lab_expert_dot<COLS, 2>(rows, x + (size_t)(p / X_DIV) * COLS, lane, acc DS4LAB_DOT_TABLES);
}
const float y0 = ds4lab_warp_sum(acc[0]);
const float y1 = ds4lab_warp_sum(acc[1]);
if (lane == 0) {
    y[(size_t)o * ROWS + row] = y0;
    if (next != row) y[(size_t)o * ROWS + next] = y1;
}
