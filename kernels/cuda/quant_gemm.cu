// Block-format GEMM on tensor cores for prefill (ds4lab/model/kernels.py `quant_gemm`):
// y[out(p)][n] = W_e[n, :] . x[in(p), :] for the pairs p of each expert e's tiles. A dense
// Q8_0 matrix is the case of one expert whose pairs are the tokens.
//
// Why it is exact to float32 (not f16): every block format stores a weight as
// dl * q - ml with q a small integer (IQ2_XXS grid values up to 43 with a sign, Q2_K 0..3,
// Q4_K 0..15, Q8_0 -128..127) and (dl, ml) constant over 16 consecutive values. Small
// integers are exact in f16, so the tensor cores multiply q exactly; x is split into two
// f16 halves hi + lo (22 significant bits) after scaling its row by a power of two that puts
// its largest value just under 2^14 (inside f16's range, lo clear of subnormals). Each mma
// over 16 values gives sum(q * x) in float32; the scales are applied per 16 values outside
// the tensor cores: acc += dl * sum(q * x) - ml * sum(x). That is llama.cpp's MMQ shape,
// with f16 halves instead of int8 activations.
//
// Tiles: a thread block of 4 warps computes 64 pairs x 64 output rows; each warp 32 x 32 as
// 2 x 4 mma.m16n8k16 tiles. Per step of 32 columns the block stages x (scaled, split, with
// per-16 sums) and the decoded q (with dl, ml per 16) in shared memory. Grid x walks the
// pair tiles fastest, so blocks that run together share a weight tile (read from HBM once).
// The format header (gemm_rows_*.cuh) defines DS4LAB_GEMM_ROW(e, row) and
// ds4lab_gemm_decode16: 16 values of a row as (q, dl, ml).
//
// Inputs: the format's weights, x [n_in, COLS] f32, amax [n_in] (max |x| of each row),
// order [P] (pair p's index in the caller's pair order: output row order[p], input row
// order[p] / X_DIV), pair_offsets [N_EXPERT + 1] (expert e's pairs are p in
// [pair_offsets[e], pair_offsets[e + 1])), tile_offsets [N_EXPERT + 1] (its 64-pair tiles).
constexpr int BM = 64, BN = 64, BK = 32, LD = BK + 8;   // LD: padded row, conflict-free fragment loads
__shared__ __align__(16) __half xh[BM][LD];
__shared__ __align__(16) __half xl[BM][LD];
__shared__ __align__(16) __half wq[BN][LD];
__shared__ float wd[BN][2], wmin[BN][2], xsum[BM][2];
__shared__ int xrow[BM], yrow[BM], xexp[BM];

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
if (tid < BM) {
    const int orig = tid < count ? order[p0 + tid] : 0;
    yrow[tid] = orig;
    xrow[tid] = orig / X_DIV;
    int ex = 0;
    frexpf(amax[orig / X_DIV], &ex);                  // amax < 2^ex
    xexp[tid] = min(14 - ex, 100);                    // x * 2^xexp stays under 2^14
}
__syncthreads();

float acc[2][4][4];
#pragma unroll
for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.0f;
const int wm0 = (warp >> 1) * 32, wn0 = (warp & 1) * 32;
const int my = tid >> 1, half = tid & 1;              // the row and 16 values this thread stages
const float my_scale = ds4lab_pow2(xexp[my]);
const float* my_x = x + (size_t)xrow[my] * COLS + 16 * half;
const int my_n = n0 + my;

for (int k0 = 0; k0 < COLS; k0 += BK) {
    {
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float4 v4 = *reinterpret_cast<const float4*>(my_x + k0 + 4 * i);
            const float v[4] = {v4.x * my_scale, v4.y * my_scale, v4.z * my_scale, v4.w * my_scale};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const __half h = __float2half_rn(v[j]);
                xh[my][16 * half + 4 * i + j] = h;
                xl[my][16 * half + 4 * i + j] = __float2half_rn(v[j] - __half2float(h));
                s += v[j];
            }
        }
        xsum[my][half] = s;
    }
    {
        __half q[16];
        float dl = 0.0f, ml = 0.0f;
        if (my_n < ROWS) {
            ds4lab_gemm_decode16(DS4LAB_GEMM_ROW(e, my_n), k0 + 16 * half, q, dl, ml);
        } else {
#pragma unroll
            for (int i = 0; i < 16; ++i) q[i] = __float2half_rn(0.0f);
        }
#pragma unroll
        for (int i = 0; i < 16; i += 2)
            *reinterpret_cast<__half2*>(&wq[my][16 * half + i]) = __halves2half2(q[i], q[i + 1]);
        wd[my][half] = dl;
        wmin[my][half] = ml;
    }
    __syncthreads();
#pragma unroll
    for (int ks = 0; ks < 2; ++ks) {
        const int c = 16 * ks + 2 * t4;
        uint32_t ah[2][4], al[2][4], b[4][2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int r = wm0 + 16 * i + g;
            ah[i][0] = *reinterpret_cast<const uint32_t*>(&xh[r][c]);
            ah[i][1] = *reinterpret_cast<const uint32_t*>(&xh[r + 8][c]);
            ah[i][2] = *reinterpret_cast<const uint32_t*>(&xh[r][c + 8]);
            ah[i][3] = *reinterpret_cast<const uint32_t*>(&xh[r + 8][c + 8]);
            al[i][0] = *reinterpret_cast<const uint32_t*>(&xl[r][c]);
            al[i][1] = *reinterpret_cast<const uint32_t*>(&xl[r + 8][c]);
            al[i][2] = *reinterpret_cast<const uint32_t*>(&xl[r][c + 8]);
            al[i][3] = *reinterpret_cast<const uint32_t*>(&xl[r + 8][c + 8]);
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int n = wn0 + 8 * j + g;
            b[j][0] = *reinterpret_cast<const uint32_t*>(&wq[n][c]);
            b[j][1] = *reinterpret_cast<const uint32_t*>(&wq[n][c + 8]);
        }
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int m = wm0 + 16 * i + g;
            const float sx0 = xsum[m][ks], sx1 = xsum[m + 8][ks];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                ds4lab_mma_f16(d, ah[i], b[j]);
                ds4lab_mma_f16(d, al[i], b[j]);
                const int n = wn0 + 8 * j + 2 * t4;
                const float dl0 = wd[n][ks], dl1 = wd[n + 1][ks];
                acc[i][j][0] += dl0 * d[0];
                acc[i][j][1] += dl1 * d[1];
                acc[i][j][2] += dl0 * d[2];
                acc[i][j][3] += dl1 * d[3];
                if (DS4LAB_GEMM_HAS_MIN) {
                    const float ml0 = wmin[n][ks], ml1 = wmin[n + 1][ks];
                    acc[i][j][0] -= ml0 * sx0;
                    acc[i][j][1] -= ml1 * sx0;
                    acc[i][j][2] -= ml0 * sx1;
                    acc[i][j][3] -= ml1 * sx1;
                }
            }
        }
    }
    __syncthreads();
}
#pragma unroll
for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        const int m = wm0 + 16 * i + g + 8 * rr;
        if (m >= count) continue;
        const float unscale = ds4lab_pow2(-xexp[m]);
        float* out = y + (size_t)yrow[m] * ROWS;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int n = n0 + wn0 + 8 * j + 2 * t4;
            if (n < ROWS) out[n] = acc[i][j][2 * rr] * unscale;
            if (n + 1 < ROWS) out[n + 1] = acc[i][j][2 * rr + 1] * unscale;
        }
    }
}
