// Q8_0 matvec on the model's 8-bit codes (model/weights.py `Q8Matrix`: byte = code + 128,
// one float32 scale per 32 values): y[t][r] = sum over the row's blocks of
// scale[r][b] * sum_i (byte - 128) * x[t][g(r)][i]. Rows come in groups of GROUP_ROWS and
// group g reads its own input vector (the grouped attention output projection; one group of
// all ROWS for a plain matvec).
//
// Reading the weights is the whole cost of a decode step's matvec, so the loop is shaped for
// memory bandwidth: each warp owns R consecutive rows (R divides GROUP_ROWS, so they share one
// input vector); per step a lane loads 16 inputs once and, for each of its rows, 16 codes in
// one 16-byte load (a warp reads 512 contiguous bytes of a row) and their block's scale;
// the loop is unrolled so that each lane has 8 such loads in flight.
// A byte becomes the float (byte - 128) without an int-to-float conversion: placed in the
// mantissa of 2^23 (bits 0x4B0000bb = 8388608 + byte, exact) and 8388608 + 128 subtracted.
// Float sums per lane in column order, then a warp sum per row.
// Inputs: codes [ROWS, COLS / 4] uint32, scales [ROWS, COLS / 32], x [T, ROWS / GROUP_ROWS, COLS].
// Grid: x = 32 threads per warp, R rows per warp; y = the token.
const int lane = threadIdx.x & 31;
const int r0 = (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * R;
const int t = blockIdx.y;
if (r0 >= ROWS) return;
const float4* xv = reinterpret_cast<const float4*>(x + ((size_t)t * (ROWS / GROUP_ROWS) + r0 / GROUP_ROWS) * COLS);
const uint4* w = reinterpret_cast<const uint4*>(codes) + (size_t)r0 * (COLS / 16);
const float* s = scales + (size_t)r0 * (COLS / 32);
float acc[R];
#pragma unroll
for (int i = 0; i < R; ++i) acc[i] = 0.0f;
#pragma unroll (8 / R)
for (int j = lane; j < COLS / 16; j += 32) {
    float xs[16];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const float4 v = xv[4 * j + k];
        xs[4 * k] = v.x; xs[4 * k + 1] = v.y; xs[4 * k + 2] = v.z; xs[4 * k + 3] = v.w;
    }
#pragma unroll
    for (int i = 0; i < R; ++i) {
        const uint4 q = w[(size_t)i * (COLS / 16) + j];
        const uint32_t words[4] = {q.x, q.y, q.z, q.w};
        float dot = 0.0f;
#pragma unroll
        for (int k = 0; k < 16; ++k) {
            const uint32_t bits = __byte_perm(words[k >> 2], 0x4B000000u, 0x7540u | (k & 3));
            dot += (__uint_as_float(bits) - 8388736.0f) * xs[k];
        }
        acc[i] += s[(size_t)i * (COLS / 32) + (j >> 1)] * dot;
    }
}
#pragma unroll
for (int i = 0; i < R; ++i) {
    const float total = ds4lab_warp_sum_all(acc[i]);
    if (lane == 0) y[(size_t)t * ROWS + r0 + i] = total;
}
