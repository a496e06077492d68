// Block-format GEMM on tensor cores for prefill (ds4lab/model/kernels.py `quant_gemm`):
// y[order[p]][n] = W_e[n, :] . x[order[p] / X_DIV, :] for the pairs p of each expert e's
// tiles. A dense Q8_0 matrix is the case of one expert whose pairs are the tokens.
//
// Why it is exact to float32 (not f16): every block format stores a weight as dl * q - ml
// with q a small integer (IQ2_XXS grid values up to 43 with a sign, Q2_K 4-bit scale times
// 2-bit code, Q4_K 0..15, Q8_0 -128..127), dl constant over 32 consecutive values and ml
// over 16. Small integers are exact in f16, so the tensor cores multiply q exactly; x comes
// as two f16 halves hi + lo of its row scaled by a power of two (gemm_split_x.cu). The mma
// products over 32 values are float32 sums of exact products; the scales are applied
// outside the tensor cores: acc += dl * sum(q * x) - sum over each 16 of ml * sum(x).
// llama.cpp's MMQ shape, with f16 halves where it has int8 activations.
//
// Tiles: a thread block of 8 warps computes 64 pairs x 128 output rows; each warp 32 x 32
// as 2 x 4 mma.m16n8k16 tiles. Shared memory holds two stages of 32 columns (x halves and
// sums; decoded q with dl, ml per 16 values): while the warps multiply one stage, each
// thread's global loads for the next are in flight, then it decodes them into the other
// stage; one barrier per stage. Grid x walks the pair tiles fastest, so blocks that run
// together share a weight tile (read from HBM once). The format header (gemm_rows_*.cuh)
// says how 16 values of a row load (ds4lab_gemm_load16) and decode (ds4lab_gemm_unpack16).
//
// Inputs: the format's weights; xh, xl [n_in, COLS] f16, xsum [n_in, COLS / 16], xexp
// [n_in] (gemm_split_x.cu); order [P]; pair_offsets [N_EXPERT + 1] (expert e's pairs are
// p in [pair_offsets[e], pair_offsets[e + 1])); tile_offsets [N_EXPERT + 1] (its tiles).
constexpr int BM = 64, BN = 128, BK = 32, LD = BK + 8;   // LD: padded rows, conflict-free fragment loads
__shared__ __align__(16) __half sxh[2][BM][LD];
__shared__ __align__(16) __half sxl[2][BM][LD];
__shared__ __align__(16) __half swq[2][BN][LD];
__shared__ float swd[2][BN], swm[2][BN][2], sxs[2][BM][2];
__shared__ int xrow[BM];

const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
const int g = lane >> 2, t4 = lane & 3;
const int tile = blockIdx.x, n0 = blockIdx.y * BN;
if (tile >= tile_offsets[N_EXPERT]) return;
// The expert owning this tile: the last e with tile_offsets[e] <= tile (experts without
// pairs share the next one's offset, so the last of equals is the owner).
int lo = 0, hi = N_EXPERT - 1;
while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (tile_offsets[mid] <= tile) lo = mid; else hi = mid - 1;
}
const int e = lo;
const int p0 = pair_offsets[e] + (tile - tile_offsets[e]) * BM;
const int count = min(BM, pair_offsets[e + 1] - p0);
if (tid < BM) xrow[tid] = (tid < count ? order[p0 + tid] : order[p0]) / X_DIV;
__syncthreads();

// What each thread stages: a quarter (8 values) of a row of x, hi and lo, and for the first
// 128 threads one 16-value sum; 16 values of a weight row.
const int x_m = tid >> 2, x_q = tid & 3;
const __half* x_hi = xh + (size_t)xrow[x_m] * COLS + 8 * x_q;
const __half* x_lo = xl + (size_t)xrow[x_m] * COLS + 8 * x_q;
const float* x_sum = xsum + (size_t)xrow[(tid >> 1) & (BM - 1)] * (COLS / 16) + (tid & 1);
const int w_n = tid >> 1, w_half = tid & 1;
const bool w_in = n0 + w_n < ROWS;
const auto w_row = DS4LAB_GEMM_ROW(e, w_in ? n0 + w_n : 0);

uint4 rh, rl;
float rs = 0.0f;
ds4lab_gemm_raw rw;
auto load = [&](int k0) {
    rh = *reinterpret_cast<const uint4*>(x_hi + k0);
    rl = *reinterpret_cast<const uint4*>(x_lo + k0);
    if (tid < 2 * BM) rs = x_sum[k0 / 16];
    ds4lab_gemm_load16(w_row, k0 + 16 * w_half, rw);
};
auto store = [&](int s, int k0) {
    *reinterpret_cast<uint4*>(&sxh[s][x_m][8 * x_q]) = rh;
    *reinterpret_cast<uint4*>(&sxl[s][x_m][8 * x_q]) = rl;
    if (tid < 2 * BM) sxs[s][tid >> 1][tid & 1] = rs;
    __half q[16];
    float dl = 0.0f, ml = 0.0f;
    ds4lab_gemm_unpack16(w_row, rw, k0 + 16 * w_half, q, dl, ml);
#pragma unroll
    for (int i = 0; i < 16; i += 2)
        *reinterpret_cast<__half2*>(&swq[s][w_n][16 * w_half + i]) =
            w_in ? __halves2half2(q[i], q[i + 1]) : __float2half2_rn(0.0f);
    if (w_half == 0) swd[s][w_n] = w_in ? dl : 0.0f;
    swm[s][w_n][w_half] = w_in ? ml : 0.0f;
};

float acc[2][4][4];
#pragma unroll
for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.0f;
const int wm0 = (warp >> 2) * 32, wn0 = (warp & 3) * 32;

load(0);
store(0, 0);
__syncthreads();
constexpr int NK = COLS / BK;
for (int ks = 0; ks < NK; ++ks) {
    const int s = ks & 1;
    if (ks + 1 < NK) load((ks + 1) * BK);
    // The B fragments of both 16-value halves, then per 16-row m tile: the products over
    // the 32 values (A fragments loaded as used), and the scales: acc += dl * part - (ml of
    // each 16) * (sum of its x). One m tile's partial sums live at a time (registers).
    uint32_t b[2][4][2];
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int n = wn0 + 8 * j + g, c = 16 * h + 2 * t4;
            b[h][j][0] = *reinterpret_cast<const uint32_t*>(&swq[s][n][c]);
            b[h][j][1] = *reinterpret_cast<const uint32_t*>(&swq[s][n][c + 8]);
        }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int m = wm0 + 16 * i + g;
        float part[4][4];
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int c4 = 0; c4 < 4; ++c4) part[j][c4] = 0.0f;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int c = 16 * h + 2 * t4;
            const uint32_t ah[4] = {*reinterpret_cast<const uint32_t*>(&sxh[s][m][c]),
                                    *reinterpret_cast<const uint32_t*>(&sxh[s][m + 8][c]),
                                    *reinterpret_cast<const uint32_t*>(&sxh[s][m][c + 8]),
                                    *reinterpret_cast<const uint32_t*>(&sxh[s][m + 8][c + 8])};
            const uint32_t al[4] = {*reinterpret_cast<const uint32_t*>(&sxl[s][m][c]),
                                    *reinterpret_cast<const uint32_t*>(&sxl[s][m + 8][c]),
                                    *reinterpret_cast<const uint32_t*>(&sxl[s][m][c + 8]),
                                    *reinterpret_cast<const uint32_t*>(&sxl[s][m + 8][c + 8])};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                ds4lab_mma_f16(part[j], ah, b[h][j]);
                ds4lab_mma_f16(part[j], al, b[h][j]);
            }
        }
        const float sa0 = sxs[s][m][0], sa1 = sxs[s][m][1], sb0 = sxs[s][m + 8][0], sb1 = sxs[s][m + 8][1];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int n = wn0 + 8 * j + 2 * t4;
            const float dl0 = swd[s][n], dl1 = swd[s][n + 1];
            acc[i][j][0] += dl0 * part[j][0];
            acc[i][j][1] += dl1 * part[j][1];
            acc[i][j][2] += dl0 * part[j][2];
            acc[i][j][3] += dl1 * part[j][3];
            if (DS4LAB_GEMM_HAS_MIN) {
                const float m00 = swm[s][n][0], m01 = swm[s][n][1], m10 = swm[s][n + 1][0], m11 = swm[s][n + 1][1];
                acc[i][j][0] -= m00 * sa0 + m01 * sa1;
                acc[i][j][1] -= m10 * sa0 + m11 * sa1;
                acc[i][j][2] -= m00 * sb0 + m01 * sb1;
                acc[i][j][3] -= m10 * sb0 + m11 * sb1;
            }
        }
    }
    if (ks + 1 < NK) store(s ^ 1, (ks + 1) * BK);
    __syncthreads();
}
#pragma unroll
for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        const int m = wm0 + 16 * i + g + 8 * rr;
        if (m >= count) continue;
        const float unscale = ds4lab_pow2(-xexp[xrow[m]]);
        float* out = y + (size_t)order[p0 + m] * ROWS;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int n = n0 + wn0 + 8 * j + 2 * t4;
            if (n < ROWS) out[n] = acc[i][j][2 * rr] * unscale;
            if (n + 1 < ROWS) out[n + 1] = acc[i][j][2 * rr + 1] * unscale;
        }
    }
}
