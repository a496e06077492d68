// A sublayer's last Q8_0 product and the hyper-connection step after it in one launch
// (model/hc.py `hc_expand`): out[t] = W x[t] (plus add[t] with ADD: the FFN's routed output
// beside the shared expert's), then stream c of the new residual gets
// post[c] * out + sum_a comb[a][c] * streams[a] (ds4lab_hc_value, as hc_post.cu).
// Each warp owns R rows (R output dims); lanes c < N write stream c of them.
// MIX: the next sublayer's HC mixer product of these new streams, as this block's partial
// sums: part[t, j, block] = sum over the block's rows d and streams c of
// mix[j, c * E + d] * y[t, c, d] (mix [M, N * E], M = (2 + N) * N), each lane c < N summing
// its rows, then the warps in order; hc_pre.cu adds the blocks' partials in order. So the
// next hc_pre needs no hc_mix launch of its own: its 1.6 MB mixer is read here, spread over
// this product's blocks, while the streams are still in registers.
// Inputs: codes [E, COLS / 4], scales [E, COLS / 32], x [T, COLS], add [T, E] (or one unused
// value), streams [T, N, E], post [T, N], comb [T, N, N], mix (or one unused value).
// Outputs: y [T, N, E], part [T, M, gridDim.x] (one unused value without MIX).
// Grid: x = 32 threads per warp, R rows per warp (per block with SPLIT: its warps split the
// columns, q8_rows.cuh; the first writes); y = the token.
constexpr int M = (2 + N) * N;
const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
const int r0 = (SPLIT > 1 ? blockIdx.x : blockIdx.x * (blockDim.x >> 5) + warp) * R;
const int cols_part = SPLIT > 1 ? warp : 0;
const int t = blockIdx.y;
float mixed[MIX ? M : 1] = {};
if (r0 < E) {
    const float4* xv = reinterpret_cast<const float4*>(x + (size_t)t * COLS);
    const uint4* w[R];
    const float* s[R];
#pragma unroll
    for (int i = 0; i < R; ++i) ds4lab_q8_row<COLS>(codes, scales, r0 + i, w[i], s[i]);
    float acc[R];
    ds4lab_q8_dots<R, COLS, SPLIT>(w, s, xv, lane, acc, cols_part);
    ds4lab_q8_totals<R, SPLIT>(acc, cols_part, lane);
#pragma unroll
    for (int i = 0; i < R; ++i) {
        const float total = acc[i];
        const int d = r0 + i;
        if (lane < N && cols_part == 0) {
            const float o = ADD ? total + add[(size_t)t * E + d] : total;
            const float v = ds4lab_hc_value<N, E>(o, streams, post, comb, t, lane, d);
            y[((size_t)t * N + lane) * E + d] = v;
            if (MIX) {
#pragma unroll
                for (int j = 0; j < M; ++j) mixed[j] += mix[((size_t)j * N + lane) * E + d] * v;
            }
        }
    }
}
if (MIX) {
    __shared__ float warp_mixed[32 * M];
    ds4lab_block_sums<M>(mixed, warp_mixed, part + (size_t)t * M * gridDim.x + blockIdx.x, gridDim.x);
}
