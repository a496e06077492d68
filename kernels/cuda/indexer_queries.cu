// The lightning indexer's queries of a decode token (model/indexer.py `indexer_queries`),
// one thread block a (head, token), from the q low-rank path before its norm:
//   qn = RMS(qr; eps[0]) * qnorm                   (attn_q_a_norm: what the q_b product reads)
//   q  = the head's DH rows of wq times qn, RoPE'd at the token's position on the last NROT
//        dims, then Hadamard + FP4 (row_finish's steps and float operations; template QAT,
//        off only where bench/check_device.py compares the heads before that rounding);
//   w  = wp[h] . xa * wscale[0]                    (the head's weight in the scores)
// One launch instead of the norm, two products, the weights' scaling and the rows' finish.
// Inputs: qr [T, QR], qnorm [QR], eps, xa [T, E], wq [H * DH, QR] (float32, or F16 widened as
// loaded: the same bits), wp [H, E], rope_cos /
// rope_sin [T, NROT/2], hscale (1/sqrt(DH)), carry (FP4's log2 table), wscale.
// Outputs: q [T, H, DH], w [T, H]. Grid: x = the heads, y = the tokens.
const int h = blockIdx.x, t = blockIdx.y, n_head = gridDim.x;
const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
__shared__ __align__(16) float qn[QR];
__shared__ float row[DH];
__shared__ float scratch[32];
// Reads are float4 and made into arrays first (QR, E: multiples of 32): written as unrolled
// scalar sums the compiler kept the kernel to 32 registers, a few 4-byte loads in flight a
// lane, and its DRAM round trips stood in turn (44 us a launch on the flash shape).
// The thread's share of the head's weight wp[h] . xa first: its loads are in flight while
// the norm's sum waits on its own (the block sums them after the rows).
const float4* xt4 = reinterpret_cast<const float4*>(xa + (size_t)t * E);
const float4* wph4 = reinterpret_cast<const float4*>(wp + (size_t)h * E);
float ws = 0.0f;
for (int i = threadIdx.x; i < E / 4; i += blockDim.x) ws = ds4lab_dot4_add(ws, wph4[i], xt4[i]);
const float* qrt = qr + (size_t)t * QR;
const float inv = ds4lab_rms_inverse(qrt, QR, eps[0], scratch);
for (int i = threadIdx.x; i < QR; i += blockDim.x) qn[i] = __fmul_rn(__fmul_rn(qrt[i], inv), qnorm[i]);
__syncthreads();
// A warp two rows at a time (r and r + n_warps), every load of both rows in flight; a lane
// takes float4 j = lane + 32k of each row, its sum in element order.
constexpr int PER_LANE = (QR / 4 + 31) / 32;
const float4* qn4 = reinterpret_cast<const float4*>(qn);
for (int r = warp; r < DH; r += 2 * n_warps) {
    const int r2 = r + n_warps < DH ? r + n_warps : r;
    const auto* wr = wq + ((size_t)h * DH + r) * QR;
    const auto* wr2 = wq + ((size_t)h * DH + r2) * QR;
    float4 a[PER_LANE], b[PER_LANE];
#pragma unroll
    for (int k = 0; k < PER_LANE; ++k) {
        const int j = lane + 32 * k < QR / 4 ? lane + 32 * k : 0;
        a[k] = ds4lab_load4(wr, j);
        b[k] = ds4lab_load4(wr2, j);
    }
    float s = 0.0f, s2 = 0.0f;
#pragma unroll
    for (int k = 0; k < PER_LANE; ++k) {
        if (lane + 32 * k < QR / 4) {
            const float4 x = qn4[lane + 32 * k];
            s = ds4lab_dot4_add(s, a[k], x);
            s2 = ds4lab_dot4_add(s2, b[k], x);
        }
    }
    s = ds4lab_warp_sum_all(s);
    s2 = ds4lab_warp_sum_all(s2);
    if (lane == 0) {
        row[r] = s;
        row[r2] = s2;
    }
}
const float weight = ds4lab_block_sum(ws, scratch);   // synchronises: row[] is complete after it
if (threadIdx.x == 0) w[(size_t)t * n_head + h] = __fmul_rn(weight, wscale[0]);
ds4lab_rope_tail(row, DH, NROT, t, rope_cos, rope_sin, false);
__syncthreads();
if (QAT) ds4lab_hadamard_fp4(row, DH, hscale[0], carry);
float* qh = q + ((size_t)t * n_head + h) * DH;
for (int i = threadIdx.x; i < DH; i += blockDim.x) qh[i] = row[i];
