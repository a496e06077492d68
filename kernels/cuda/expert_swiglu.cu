// A token's routed experts' gate and up projections and their SwiGLU in one launch:
// mid[p][row] = swiglu(G[ids[p]][row, :] . x, U[ids[p]][row, :] . x) * w[p], x the input row
// p / X_DIV (a token's input shared by its X_DIV = n_expert_used pairs), w the route weights
// (ds4lab_swiglu as the shared expert's; model/moe.py multiplies by the weight after it).
// One warp per output row of one pair (grid y): the row of gate and of up in one pass over
// x; the format header says how a row's bytes decode (both matrices of one block format).
// With SHARED_ROWS the launch also makes the shared expert's SwiGLU (q8_swiglu.cu's, a warp a
// row): grid y's rows after the pairs are the tokens, whose warps take the shared expert's
// Q8_0 gate and up rows (codes_g, scales_g, codes_u, scales_u) into shared [T, SHARED_ROWS];
// both read the same FFN input, so one launch serves the two.
// Inputs: raw_gate, raw_up [n_expert, EXPERT_BYTES] uint8 (ROW_BYTES per row), ids (pairs,
// int32), x [pairs / X_DIV, COLS], w (pairs), clamp [1] (0: none), the shared expert's matrices.
DS4LAB_DOT_STAGE
const int lane = threadIdx.x & 31;
const int row = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
const int p = blockIdx.y;
if (SHARED_ROWS > 0) {
    const int n_pairs = gridDim.y / (X_DIV + 1) * X_DIV;
    if (p >= n_pairs) {
        const int t = p - n_pairs;
        if (row >= SHARED_ROWS) return;
        const uint4* w2[2];
        const float* s2[2];
        ds4lab_q8_row<COLS>(codes_g, scales_g, row, w2[0], s2[0]);
        ds4lab_q8_row<COLS>(codes_u, scales_u, row, w2[1], s2[1]);
        float acc[2];
        ds4lab_q8_dots<2, COLS>(w2, s2, reinterpret_cast<const float4*>(x + (size_t)t * COLS), lane, acc);
        ds4lab_q8_totals<2, 1>(acc, 0, lane);
        if (lane == 0) shared[(size_t)t * SHARED_ROWS + row] = ds4lab_swiglu(acc[0], acc[1], clamp[0]);
        return;
    }
}
if (row >= ROWS) return;
const size_t at = (size_t)ids[p] * EXPERT_BYTES + (size_t)row * ROW_BYTES;
const uint8_t* const rows[2] = {raw_gate + at, raw_up + at};
float gu[2] = {0.0f, 0.0f};
ds4lab_expert_dot<COLS, 2>(rows, x + (size_t)(p / X_DIV) * COLS, lane, gu DS4LAB_DOT_TABLES);
const float g = ds4lab_warp_sum(gu[0]);
const float u = ds4lab_warp_sum(gu[1]);
if (lane == 0) mid[(size_t)p * ROWS + row] = ds4lab_swiglu(g, u, clamp[0]) * w[p];
