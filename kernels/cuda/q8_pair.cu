// Two Q8_0 matrices times one input vector in one launch (the attention's q_a and kv
// projections, both of the sublayer input): ya[t] = A x[t], yb[t] = B x[t]. Warps take R
// rows of A, then of B (R divides both row counts); q8_rows.cuh has the loop.
// Inputs: codes_a [ROWS_A, COLS / 4], scales_a [ROWS_A, COLS / 32], the same of B, x [T, COLS].
// Grid: x = 32 threads per warp, R rows per warp over ROWS_A + ROWS_B; y = the token.
const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
const int r0 = (SPLIT > 1 ? blockIdx.x : blockIdx.x * (blockDim.x >> 5) + warp) * R;
const int cols_part = SPLIT > 1 ? warp : 0;
const int t = blockIdx.y;
if (r0 >= ROWS_A + ROWS_B) return;
const bool in_a = r0 < ROWS_A;
const int rb = in_a ? r0 : r0 - ROWS_A;
const float4* xv = reinterpret_cast<const float4*>(x + (size_t)t * COLS);
const uint4* w[R];
const float* s[R];
#pragma unroll
for (int i = 0; i < R; ++i) {
    if (in_a) ds4lab_q8_row<COLS>(codes_a, scales_a, rb + i, w[i], s[i]);
    else ds4lab_q8_row<COLS>(codes_b, scales_b, rb + i, w[i], s[i]);
}
float acc[R];
ds4lab_q8_dots<R, COLS, SPLIT>(w, s, xv, lane, acc, cols_part);
ds4lab_q8_totals<R, SPLIT>(acc, cols_part, lane);
#pragma unroll
for (int i = 0; i < R; ++i) {
    if (lane == 0 && cols_part == 0) (in_a ? ya + (size_t)t * ROWS_A : yb + (size_t)t * ROWS_B)[rb + i] = acc[i];
}
