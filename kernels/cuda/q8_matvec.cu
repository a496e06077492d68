// Q8_0 matvec on the model's 8-bit codes: y[t][r] = sum over the row's blocks of
// scale[r][b] * sum_i (byte - 128) * x[t][g(r)][i]. Rows come in groups of GROUP_ROWS and
// group g reads its own input vector (the grouped attention output projection; one group of
// all ROWS for a plain matvec). Each warp owns R consecutive rows (R divides GROUP_ROWS, so
// they share one input vector); q8_rows.cuh has the loop.
// Inputs: codes [ROWS, COLS / 4] uint32, scales [ROWS, COLS / 32], x [T, ROWS / GROUP_ROWS, COLS].
// Grid: x = 32 threads per warp, R rows per warp (per block with SPLIT: its warps split the
// columns, q8_rows.cuh); y = the token.
const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
const int r0 = (SPLIT > 1 ? blockIdx.x : blockIdx.x * (blockDim.x >> 5) + warp) * R;
const int cols_part = SPLIT > 1 ? warp : 0;
const int t = blockIdx.y;
if (r0 >= ROWS) return;
ds4lab_q8_rows_times<R, COLS, SPLIT>(codes, scales, x + ((size_t)t * (ROWS / GROUP_ROWS) + r0 / GROUP_ROWS) * COLS,
                                     y + (size_t)t * ROWS, r0, cols_part, lane);
