// The activation side of the block-format GEMM (quant_gemm.cu), made once per product: each
// row of x scaled by a power of two that puts its largest value just under 2^14 (inside
// f16's range, the low half clear of subnormals), then split into f16 halves hi + lo (22
// significant bits), with the float32 sum of every 16 scaled values (the K-quant min term).
// Inputs: x [n_rows, COLS]. Outputs: xh, xl [n_rows, COLS] f16, xsum [n_rows, COLS / 16],
// xexp [n_rows] (the row was scaled by 2^xexp). One thread block per row.
__shared__ float scratch[32];
const int row = blockIdx.x, tid = threadIdx.x;
const float* xr = x + (size_t)row * COLS;
float amax = 0.0f;
for (int i = tid; i < COLS; i += blockDim.x) amax = fmaxf(amax, fabsf(xr[i]));
amax = ds4lab_warp_max_all(amax);
if ((tid & 31) == 0) scratch[tid >> 5] = amax;
__syncthreads();
amax = 0.0f;
for (int w = 0; w < (int)(blockDim.x >> 5); ++w) amax = fmaxf(amax, scratch[w]);
int ex = 0;
frexpf(amax, &ex);                                    // amax < 2^ex
const int k = min(14 - ex, 100);
const float scale = ds4lab_pow2(k);
if (tid == 0) xexp[row] = k;
for (int g = tid; g < COLS / 16; g += blockDim.x) {
    __align__(16) __half hi[16], lo[16];
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; i += 4) {
        const float4 v4 = *reinterpret_cast<const float4*>(xr + 16 * g + i);
        const float v[4] = {v4.x * scale, v4.y * scale, v4.z * scale, v4.w * scale};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            hi[i + j] = __float2half_rn(v[j]);
            lo[i + j] = __float2half_rn(v[j] - __half2float(hi[i + j]));
            s += v[j];
        }
    }
    uint4* h4 = reinterpret_cast<uint4*>(xh + (size_t)row * COLS + 16 * g);
    uint4* l4 = reinterpret_cast<uint4*>(xl + (size_t)row * COLS + 16 * g);
    h4[0] = reinterpret_cast<const uint4*>(hi)[0];
    h4[1] = reinterpret_cast<const uint4*>(hi)[1];
    l4[0] = reinterpret_cast<const uint4*>(lo)[0];
    l4[1] = reinterpret_cast<const uint4*>(lo)[1];
    xsum[(size_t)row * (COLS / 16) + g] = s;
}
