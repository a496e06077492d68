// A token's routed experts' gate and up projections and their SwiGLU in one launch:
// mid[p][row] = swiglu(G[ids[p]][row, :] . x, U[ids[p]][row, :] . x) * w[p], x the input row
// p / X_DIV (a token's input shared by its X_DIV = n_expert_used pairs), w the route weights
// (ds4lab_swiglu as the shared expert's; model/moe.py multiplies by the weight after it).
// A warp takes P adjacent output rows of one pair (grid y): the rows of gate and of up, 2P
// rows in one pass over x, which they share (the last warp of a ROWS not a multiple of P
// reads its last row again and writes it once). The input is the bound, not the weights: a
// warp of one row read 8 bytes of (cached) input for each byte of IQ2_XXS weights; P rows cut
// that by P. The format header says how a row's bytes decode (both matrices one block format).
// With SHARED_ROWS the launch also makes the shared expert's SwiGLU (q8_swiglu.cu's, P rows a
// warp): grid y's rows after the pairs are the tokens, whose warps take the shared expert's
// Q8_0 gate and up rows (codes_g, scales_g, codes_u, scales_u) into shared [T, SHARED_ROWS];
// both read the same FFN input, so one launch serves the two.
// Inputs: raw_gate, raw_up [n_expert, EXPERT_BYTES] uint8 (ROW_BYTES per row), ids (pairs,
// int32), x [pairs / X_DIV, COLS], w (pairs), clamp [1] (0: none), the shared expert's matrices.
DS4LAB_DOT_STAGE
const int lane = threadIdx.x & 31;
const int row0 = ((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * P;
const int p = blockIdx.y;
if (SHARED_ROWS > 0) {
    const int n_pairs = gridDim.y / (X_DIV + 1) * X_DIV;
    if (p >= n_pairs) {
        const int t = p - n_pairs;
        if (row0 >= SHARED_ROWS) return;
        const uint4* w2[2 * P];
        const float* s2[2 * P];
#pragma unroll
        for (int i = 0; i < P; ++i) {
            const int row = row0 + i < SHARED_ROWS ? row0 + i : SHARED_ROWS - 1;
            ds4lab_q8_row<COLS>(codes_g, scales_g, row, w2[2 * i], s2[2 * i]);
            ds4lab_q8_row<COLS>(codes_u, scales_u, row, w2[2 * i + 1], s2[2 * i + 1]);
        }
        float acc[2 * P];
        ds4lab_q8_dots<2 * P, COLS>(w2, s2, reinterpret_cast<const float4*>(x + (size_t)t * COLS), lane, acc);
        ds4lab_q8_totals<2 * P, 1>(acc, 0, lane);
#pragma unroll
        for (int i = 0; i < P; ++i) {
            if (lane == 0 && row0 + i < SHARED_ROWS)
                shared[(size_t)t * SHARED_ROWS + row0 + i] = ds4lab_swiglu(acc[2 * i], acc[2 * i + 1], clamp[0]);
        }
        return;
    }
}
if (row0 >= ROWS) return;
const uint8_t* rows[2 * P];
#pragma unroll
for (int i = 0; i < P; ++i) {
    const int row = row0 + i < ROWS ? row0 + i : ROWS - 1;
    const size_t at = (size_t)ids[p] * EXPERT_BYTES + (size_t)row * ROW_BYTES;
    rows[2 * i] = raw_gate + at;
    rows[2 * i + 1] = raw_up + at;
}
float gu[2 * P] = {};
ds4lab_expert_dot<COLS, 2 * P>(rows, x + (size_t)(p / X_DIV) * COLS, lane, gu DS4LAB_DOT_TABLES);
#pragma unroll
for (int i = 0; i < P; ++i) {
    const float g = ds4lab_warp_sum(gu[2 * i]);
    const float u = ds4lab_warp_sum(gu[2 * i + 1]);
    if (lane == 0 && row0 + i < ROWS) mid[(size_t)p * ROWS + row0 + i] = ds4lab_swiglu(g, u, clamp[0]) * w[p];
}
