// Two Q8_0 matrices times one input vector in one launch (the attention's q_a and kv
// projections, both of the sublayer input): ya[t] = A x[t], yb[t] = B x[t]. Warps take R
// rows of A, then of B (R divides both row counts); q8_rows.cuh has the loop.
// NORM_A: the launch also writes ya_n[t] = RMSNorm(ya[t]) * norm_w, as row_finish(ya; eps[0],
// norm_w) would (the same block-wide sum: this launch's blocks and row_finish's are both 128
// threads), made by the last block to finish (ds4lab_last_block: it reads the others' ya
// through L2). q_b multiplies ya_n: the norm made once a token, where the q_b product made it
// in each of its 2048 blocks (ncu: 31 µs for its 35.6 MB, 1.2 TB/s, the warps waiting on the
// norm's loads and barriers before their first weights).
// Inputs: codes_a [ROWS_A, COLS / 4], scales_a [ROWS_A, COLS / 32], the same of B, x [T, COLS],
// norm_w [ROWS_A] and eps [1] (NORM_A), counter (an arrival counter, NORM_A).
// Grid: x = 32 threads per warp, R rows per warp over ROWS_A + ROWS_B; y = the token.
const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
const int r0 = (SPLIT > 1 ? blockIdx.x : blockIdx.x * (blockDim.x >> 5) + warp) * R;
const int cols_part = SPLIT > 1 ? warp : 0;
const int t = blockIdx.y;
if (r0 < ROWS_A + ROWS_B) {
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
}
if (NORM_A) {
    // Every thread of every block gets here (a block's warps past the rows included): the
    // arrival count is the grid's.
    __shared__ float scratch[32];
    __shared__ float row[NORM_A ? ROWS_A : 1];
    __shared__ float row_w[NORM_A ? ROWS_A : 1];
    if (!ds4lab_last_block(const_cast<int*>(counter), gridDim.x * gridDim.y)) return;
    for (int tt = 0; tt < (int)gridDim.y; ++tt) {
        // The row and the norm's weights into shared memory, eight of each in flight a thread:
        // as plain loops (the block size known only at run time) each load waited for the one
        // before, eight L2 round trips for the row and then eight DRAM ones for the weights.
        constexpr int LOADS = 8;
        for (int i0 = threadIdx.x; i0 < ROWS_A; i0 += LOADS * blockDim.x) {
            float v[LOADS], w[LOADS];
#pragma unroll
            for (int k = 0; k < LOADS; ++k) {
                const int i = i0 + k * (int)blockDim.x;
                v[k] = i < ROWS_A ? __ldcg(ya + (size_t)tt * ROWS_A + i) : 0.0f;
                w[k] = i < ROWS_A ? norm_w[i] : 0.0f;
            }
#pragma unroll
            for (int k = 0; k < LOADS; ++k) {
                const int i = i0 + k * (int)blockDim.x;
                if (i < ROWS_A) {
                    row[i] = v[k];
                    row_w[i] = w[k];
                }
            }
        }
        __syncthreads();
        const float inv = ds4lab_rms_inverse(row, ROWS_A, eps[0], scratch);
        for (int i = threadIdx.x; i < ROWS_A; i += blockDim.x)
            ya_n[(size_t)tt * ROWS_A + i] = __fmul_rn(__fmul_rn(row[i], inv), row_w[i]);
        __syncthreads();
    }
}
