// Q8_0 matvec on the model's 8-bit codes (model/weights.py `Q8Matrix`: byte = code + 128,
// one float32 scale per 32 values): y[t][r] = sum over the row's blocks of
// scale[r][b] * sum_i (byte - 128) * x[t][g(r)][i]. Rows come in groups of GROUP_ROWS and
// group g reads its own input vector (the grouped attention output projection; one group of
// all ROWS for a plain matvec).
// Reading the weights is the whole cost, so: one thread block (WARPS warps) per WARPS rows of
// one token, the block's input vector staged once in shared memory, each lane loading 16
// bytes of a row at a time (a warp reads 512 contiguous bytes), float sums per lane, then a
// warp sum. Inputs: codes [ROWS, COLS / 4] uint32, scales [ROWS, COLS / 32], x [T, G, COLS].
// Needs GROUP_ROWS a multiple of WARPS (a block's rows in one group) and COLS floats in shared memory.
constexpr int WARPS = 8;
const int lane = threadIdx.x & 31;
const int r = blockIdx.x * WARPS + (threadIdx.x >> 5);
const int t = blockIdx.y;
__shared__ float4 xs[COLS / 4];
const float4* xv = reinterpret_cast<const float4*>(x + ((size_t)t * (ROWS / GROUP_ROWS)
                                                        + (size_t)(blockIdx.x * WARPS) / GROUP_ROWS) * COLS);
for (int i = threadIdx.x; i < COLS / 4; i += blockDim.x) xs[i] = xv[i];
__syncthreads();
if (r >= ROWS) return;
const uint4* w = reinterpret_cast<const uint4*>(codes + (size_t)r * (COLS / 4));
const float* s = scales + (size_t)r * (COLS / 32);
float acc = 0.0f;
#pragma unroll 4
for (int j = lane; j < COLS / 16; j += 32) {
    const uint4 word = w[j];
    const uint32_t parts[4] = {word.x, word.y, word.z, word.w};
    float dot = 0.0f;
    for (int k = 0; k < 4; ++k) {
        const float4 xq = xs[4 * j + k];
        const uint32_t b = parts[k];
        dot += (float)((int)(b & 0xffu) - 128) * xq.x + (float)((int)((b >> 8) & 0xffu) - 128) * xq.y
             + (float)((int)((b >> 16) & 0xffu) - 128) * xq.z + (float)((int)(b >> 24) - 128) * xq.w;
    }
    acc += s[j / 2] * dot;
}
acc = ds4lab_warp_sum_all(acc);
if (lane == 0) y[(size_t)t * ROWS + r] = acc;
