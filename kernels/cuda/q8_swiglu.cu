// The shared expert's gate and up Q8_0 products and its SwiGLU in one launch:
// y[t][r] = swiglu(G[r] . x[t], U[r] . x[t]) (ds4lab_swiglu: the clamp, then g * sigmoid(g) * u).
// Each warp owns R rows of both matrices, reading the input once for the 2R rows.
// Inputs: codes_g [ROWS, COLS / 4], scales_g [ROWS, COLS / 32], the same of U, x [T, COLS],
// clamp [1] (0: none). Grid: x = 32 threads per warp, R rows per warp; y = the token.
const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
const int r0 = (SPLIT > 1 ? blockIdx.x : blockIdx.x * (blockDim.x >> 5) + warp) * R;
const int cols_part = SPLIT > 1 ? warp : 0;
const int t = blockIdx.y;
if (r0 >= ROWS) return;
const float4* xv = reinterpret_cast<const float4*>(x + (size_t)t * COLS);
const uint4* w[2 * R];
const float* s[2 * R];
#pragma unroll
for (int i = 0; i < R; ++i) {
    ds4lab_q8_row<COLS>(codes_g, scales_g, r0 + i, w[i], s[i]);
    ds4lab_q8_row<COLS>(codes_u, scales_u, r0 + i, w[R + i], s[R + i]);
}
float acc[2 * R];
ds4lab_q8_dots<2 * R, COLS, SPLIT>(w, s, xv, lane, acc, cols_part);
ds4lab_q8_totals<2 * R, SPLIT>(acc, cols_part, lane);
#pragma unroll
for (int i = 0; i < R; ++i) {
    if (lane == 0 && cols_part == 0) y[(size_t)t * ROWS + r0 + i] = ds4lab_swiglu(acc[i], acc[R + i], clamp[0]);
}
