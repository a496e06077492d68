// Q8_0 matvec on the model's 8-bit codes: y[t][r] = sum over the row's blocks of
// scale[r][b] * sum_i (byte - 128) * x[t][g(r)][i]. Rows come in groups of GROUP_ROWS and
// group g reads its own input vector (the grouped attention output projection; one group of
// all ROWS for a plain matvec). Each warp owns R consecutive rows (R divides GROUP_ROWS, so
// they share one input vector); q8_rows.cuh has the loop.
// NORM (one group, no split): x is RMS-normed and weighted first, as row_finish(x; eps[0],
// norm_w) would leave it (the same block-wide sum: q8_matvec's blocks and row_finish's are
// both 128 threads), so q_a's norm runs inside the q_b product instead of a launch of its own
// (q8_rows.cuh `ds4lab_q8_dots_normed`).
// Inputs: codes [ROWS, COLS / 4] uint32, scales [ROWS, COLS / 32], x [T, ROWS / GROUP_ROWS, COLS],
// norm_w [COLS] and eps [1] (NORM).
// Grid: x = 32 threads per warp, R rows per warp (per block with SPLIT: its warps split the
// columns, q8_rows.cuh); y = the token.
const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
const int r0 = (SPLIT > 1 ? blockIdx.x : blockIdx.x * (blockDim.x >> 5) + warp) * R;
const int cols_part = SPLIT > 1 ? warp : 0;
const int t = blockIdx.y;
const float* xt = x + ((size_t)t * (ROWS / GROUP_ROWS) + min(r0, ROWS - 1) / GROUP_ROWS) * COLS;
const uint4* w[R];
const float* s[R];
float acc[R];
if (NORM) {
    // Every warp joins the norm's block sum; one past the matrix reads its last rows.
    __shared__ float scratch[32];
    __shared__ __align__(16) float xn[NORM ? COLS : 4];
#pragma unroll
    for (int i = 0; i < R; ++i) ds4lab_q8_row<COLS>(codes, scales, min(r0 + i, ROWS - 1), w[i], s[i]);
    ds4lab_q8_dots_normed<R, COLS>(w, s, xt, lane, acc, norm_w, eps[0], scratch, xn);
    if (r0 >= ROWS) return;
} else {
    if (r0 >= ROWS) return;
#pragma unroll
    for (int i = 0; i < R; ++i) ds4lab_q8_row<COLS>(codes, scales, r0 + i, w[i], s[i]);
    ds4lab_q8_dots<R, COLS, SPLIT>(w, s, reinterpret_cast<const float4*>(xt), lane, acc, cols_part);
}
ds4lab_q8_totals<R, SPLIT>(acc, cols_part, lane);
#pragma unroll
for (int i = 0; i < R; ++i) {
    if (lane == 0 && cols_part == 0) y[(size_t)t * ROWS + r0 + i] = acc[i];
}
