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
// both read the same FFN input, so one launch serves the two. (A thread block's share:
// expert_swiglu.cuh.)
// Inputs: raw_gate, raw_up [n_expert, EXPERT_BYTES] uint8 (ROW_BYTES per row), ids (pairs,
// int32), x [pairs / X_DIV, COLS], w (pairs), clamp [1] (0: none), the shared expert's matrices.
DS4LAB_DOT_STAGE
const int p = blockIdx.y, n_pairs = SHARED_ROWS > 0 ? gridDim.y / (X_DIV + 1) * X_DIV : gridDim.y;
const int token = p < n_pairs ? p / X_DIV : p - n_pairs;
ds4lab_swiglu_rows<ROWS, COLS, ROW_BYTES, EXPERT_BYTES, X_DIV, SHARED_ROWS, P>(
    blockIdx.x, p, n_pairs, p < n_pairs ? ids[p] : 0, p < n_pairs ? w[p] : 0.0f, raw_gate, raw_up,
    x + (size_t)token * COLS, clamp[0],
    codes_g, scales_g, codes_u, scales_u, mid, shared DS4LAB_DOT_TABLES);
