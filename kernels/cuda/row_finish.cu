// One row per thread block, in place in the output: the per-row steps the model chains on
// q heads, KV rows, compressed rows and indexer queries/keys, each optional (templates):
//   NORM    RMSNorm: x * (1 / sqrt(mean(x^2) + eps[0]))         (model/numerics.py `rms_norm`)
//   WEIGHT  times weight[d]
//   ROPE    0 none, 1 RoPE, 2 inverse RoPE on the last NROT dims, GPT-J pairs, with the
//           (rope_cos, rope_sin) row of the row's position: row / POS_DIV (heads share a position)
//   QAT     Hadamard over the row (butterflies with stride 1, 2, ...; times hscale[0] = 1/sqrt(D)),
//           then FP4 E2M1 in blocks of 32                       (`indexer_qat`)
//   FP8     FP8 E4M3FN in blocks of 64 over the first D - NROT dims  (`fp8_kv_round`)
//   F16     f16 round trip                                       (`round_f16`)
// RoPE, Hadamard and the roundings repeat the reference's float operations (explicitly
// rounded multiplies, no fused multiply-add), so from the same input they give the same bits;
// the norm's sum runs in another order.
// n_rows = [rows of x, rows of prefix]. With PREFIX the output is prefix's rows (copied) then
// x's finished rows: a KV row appended to the raw window in the launch that finishes it.
const int n_prefix = PREFIX ? n_rows[1] : 0;
if ((int)blockIdx.x < n_prefix) {
    for (int i = threadIdx.x; i < D; i += blockDim.x) y[(size_t)blockIdx.x * D + i] = prefix[(size_t)blockIdx.x * D + i];
    return;
}
const int r = blockIdx.x - n_prefix;
if (r >= n_rows[0]) return;
const float* xr = x + (size_t)r * D;
float* yr = y + (size_t)(n_prefix + r) * D;
__shared__ float scratch[32];
float inv = 1.0f;
if (NORM) inv = ds4lab_rms_inverse(xr, D, eps[0], scratch);
for (int i = threadIdx.x; i < D; i += blockDim.x) {
    float v = xr[i];
    if (NORM) v = __fmul_rn(v, inv);
    if (WEIGHT) v = __fmul_rn(v, weight[i]);
    yr[i] = v;
}
__syncthreads();
if (ROPE) {
    ds4lab_rope_tail(yr, D, NROT, r / POS_DIV, rope_cos, rope_sin, ROPE == 2);
    __syncthreads();
}
if (QAT) ds4lab_hadamard_fp4(yr, D, hscale[0], carry);
if (FP8) ds4lab_fp8_round(yr, D, NROT, carry);
if (F16) {
    for (int i = threadIdx.x; i < D; i += blockDim.x) yr[i] = __half2float(__float2half_rn(yr[i]));
}
