// HC pre-sublayer (ds4's hc_split_weighted_sum_norm) for one token per thread block: the
// control (pre, post, comb) and the sublayer input x = RMSNorm(sum_a pre[a] * streams[a]) * weight.
// Replaces model/hc.py `hc_control` + `hc_collapse` + the sublayer norm (some 20 MLX ops).
//   mix: the mixer matvec of the raw flattened streams in PARTS partial sums, [T, M, PARTS
//        (M = (2 + N) * N)], added here by a warp an output (a chunk's GEMM: PARTS = 1; in a
//        decode step hc_mix.cu's, one per 256 columns); RMSNorm of the flat streams is a
//        per-token scale, applied here (inv_rms * mix) rather than before the matvec as the
//        reference does (same value up to float rounding).
//   eps[0]: the RMS epsilon, eps[1]: the HC epsilon. Templates: N (streams), E (width), ITERS, PARTS,
//   COLS_PER (columns a thread of warps 1.. holds: E over blockDim.x - 32, rounded up).
// The block's work is a chain of latencies (one token, one thread block), so independent
// steps overlap and each step's loads are all in flight together: warp 0 runs the Sinkhorn
// (comb) while the other warps collapse the streams and norm the result, which need only pre
// (computed from the mixer outputs by each thread, the same expression as the split's:
// ds4lab_hc_pre_weight). Warps 1.. load their columns of the streams once, into registers
// (thread j: columns j, j + W, ... for W = blockDim.x - 32, COLS_PER of them), and both the
// streams' RMS and the collapse read them from there, the collapsed row kept for its norm.
// That alone left the launch as it was (ncu, base clock: 15.5 µs against 15.1): warp 0's
// chain (the mixer sums, the block sum, the ~40 normalisations of the split) is the
// launch's length, and the split's shuffles (hc_split.cuh) took it to 13.5.
const int t = blockIdx.x;
if (t >= n_tok[0]) return;
const float* s = streams + (size_t)t * N * E;
constexpr int M = (2 + N) * N;
__shared__ float scratch[32];
__shared__ float m[M];
const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
const int threads = (int)blockDim.x - 32, id = (int)threadIdx.x - 32;
float v[COLS_PER][N];
if (warp > 0) {
#pragma unroll
    for (int k = 0; k < COLS_PER; ++k) {
        const int d = id + k * threads;
#pragma unroll
        for (int a = 0; a < N; ++a) v[k][a] = d < E ? s[a * E + d] : 0.0f;
    }
}
// A warp per mixer output (ds4lab_hc_parts_sum); the sums are scaled by the streams' RMS
// once it is known.
for (int i = warp; i < M; i += (int)(blockDim.x >> 5)) {
    const float sum = ds4lab_hc_parts_sum<PARTS>(mix + ((size_t)t * M + i) * PARTS, lane);
    if (lane == 0) m[i] = sum;
}
float ss = 0.0f;
if (warp > 0) {
#pragma unroll
    for (int k = 0; k < COLS_PER; ++k) {
#pragma unroll
        for (int a = 0; a < N; ++a) ss += v[k][a] * v[k][a];
    }
}
ss = ds4lab_block_sum(ss, scratch);            // synchronises: m[] is complete after it
const float inv = 1.0f / sqrtf(ss / (float)(N * E) + eps[0]);
if ((int)threadIdx.x < M) m[threadIdx.x] *= inv;
__syncthreads();
if (warp == 0) {
    ds4lab_hc_split<N, ITERS>(m, scale, base, eps[1], pre + t * N, post + t * N, comb + (size_t)t * N * N, lane);
    return;
}
float weights[N];
#pragma unroll
for (int a = 0; a < N; ++a) weights[a] = ds4lab_hc_pre_weight(m, scale, base, eps[1], a);
// The collapse and its RMSNorm over warps 1.. (barrier 1: warp 0 is in the Sinkhorn).
float xs[COLS_PER];
float ss2 = 0.0f;
#pragma unroll
for (int k = 0; k < COLS_PER; ++k) {
    float x_d = 0.0f;
#pragma unroll
    for (int a = 0; a < N; ++a) x_d += v[k][a] * weights[a];
    xs[k] = x_d;
    ss2 += x_d * x_d;
}
const float total = ds4lab_collapse_sum(ss2, scratch, threads);
const float inv2 = 1.0f / sqrtf(total / (float)E + eps[0]);
float* xt = x + (size_t)t * E;
#pragma unroll
for (int k = 0; k < COLS_PER; ++k) {
    const int d = id + k * threads;
    if (d < E) xt[d] = xs[k] * inv2 * norm[d];
}
