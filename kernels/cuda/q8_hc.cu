// A sublayer's last Q8_0 product and the hyper-connection step after it in one launch
// (model/hc.py `hc_expand`): out[t] = W x[t] (plus add[t] with ADD: the FFN's routed output
// beside the shared expert's), then stream c of the new residual gets
// post[c] * out + sum_a comb[a][c] * streams[a] (ds4lab_hc_value, as hc_post.cu).
// Each warp owns R rows (R output dims); lanes c < N write stream c of them.
// Inputs: codes [E, COLS / 4], scales [E, COLS / 32], x [T, COLS], add [T, E] (or one unused
// value), streams [T, N, E], post [T, N], comb [T, N, N]. Output y [T, N, E].
// Grid: x = 32 threads per warp, R rows per warp; y = the token.
const int lane = threadIdx.x & 31;
const int r0 = (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * R;
const int t = blockIdx.y;
if (r0 >= E) return;
const float4* xv = reinterpret_cast<const float4*>(x + (size_t)t * COLS);
const uint4* w[R];
const float* s[R];
#pragma unroll
for (int i = 0; i < R; ++i) ds4lab_q8_row<COLS>(codes, scales, r0 + i, w[i], s[i]);
float acc[R];
ds4lab_q8_dots<R, COLS>(w, s, xv, lane, acc);
#pragma unroll
for (int i = 0; i < R; ++i) {
    const float total = ds4lab_warp_sum_all(acc[i]);
    const int d = r0 + i;
    if (lane < N) {
        const float o = ADD ? total + add[(size_t)t * E + d] : total;
        y[((size_t)t * N + lane) * E + d] = ds4lab_hc_value<N, E>(o, streams, post, comb, t, lane, d);
    }
}
