// One warp's dot products of NR Q8_0 rows with one input vector: the inner loop of every
// decode-step Q8_0 product (q8_matvec, q8_pair, q8_swiglu, q8_hc). Row i's codes are the
// 16-byte words w[i] (byte = code + 128, model/weights.py `Q8Matrix`), its float32 block
// scales s[i] (one per 32 values); x is the input vector (16-byte aligned).
//
// Reading the weights is the whole cost of a decode step's matvec, so the loop is shaped for
// memory bandwidth: per step a lane loads 16 inputs once and, for each row, 16 codes in one
// 16-byte load (a warp reads 512 contiguous bytes of a row) and their block's scale; the
// loop is unrolled so that each lane has 8 such loads in flight.
// A byte becomes the float (byte - 128) without an int-to-float conversion: placed in the
// mantissa of 2^23 (bits 0x4B0000bb = 8388608 + byte, exact) and 8388608 + 128 subtracted.
// Each lane sums in column order into acc[i]; the caller sums the warp (ds4lab_q8_totals).
// SPLIT warps may share rows, warp `part` taking every SPLIT-th 512-byte chunk of them: on
// matrices of a few thousand rows a warp of one row reads 4 bytes of (cached) input for each
// byte of weights, and the L1 becomes the bound (ncu: 88% of its throughput, DRAM 24%, on the
// 4096 x 8192 q8_hc); 4 rows a warp over a quarter of the columns each keep as many warps and
// read a quarter of the input per row.
// A lane reads its 16 inputs as four float4 at a 64-byte stride from the next lane's: in the
// L1 each such load touches 16 lines for 512 bytes, 4 times a coalesced load's, which a warp
// of 4 rows amortises. An input that is not the kernel's own (the q_b product's RMS-normed,
// weighted x) goes through shared memory instead (STAGED, ds4lab_q8_stage_normed), in a
// padded layout where those float4 reads are conflict-free.

// Shared memory for a staged input of COLS values: 4 floats of padding after every 32, so
// that 8 lanes reading float4 at a 64-byte stride (one phase of a 16-byte shared load) hit 8
// distinct groups of 4 banks.
constexpr int ds4lab_q8_staged_size(int cols) { return cols + cols / 8; }
__device__ __forceinline__ int ds4lab_q8_staged_slot(int col) { return col + 4 * (col >> 5); }

// The whole block stages x RMS-normed and weighted as row_finish leaves it: x * inv, then
// times norm_w (two rounded products; inv from ds4lab_rms_inverse), in coalesced float4 reads;
// then the block synchronises (every thread calls it).
template <int COLS>
__device__ __forceinline__ void ds4lab_q8_stage_normed(const float* x, const float* norm_w, float inv,
                                                       float* staged) {
    for (int i = threadIdx.x; i < COLS / 4; i += blockDim.x) {
        const float4 v = reinterpret_cast<const float4*>(x)[i];
        const float4 g = reinterpret_cast<const float4*>(norm_w)[i];
        const float4 n = {__fmul_rn(__fmul_rn(v.x, inv), g.x), __fmul_rn(__fmul_rn(v.y, inv), g.y),
                          __fmul_rn(__fmul_rn(v.z, inv), g.z), __fmul_rn(__fmul_rn(v.w, inv), g.w)};
        *reinterpret_cast<float4*>(staged + ds4lab_q8_staged_slot(4 * i)) = n;
    }
    __syncthreads();
}

template <int NR, int COLS, int SPLIT = 1, bool STAGED = false>
__device__ __forceinline__ void ds4lab_q8_dots(const uint4* const* w, const float* const* s, const float* x,
                                               int lane, float* acc, int part = 0) {
#pragma unroll
    for (int i = 0; i < NR; ++i) acc[i] = 0.0f;
#pragma unroll (NR < 8 ? 8 / NR : 1)
    for (int j = lane + 32 * part; j < COLS / 16; j += 32 * SPLIT) {
        float xs[16];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int col = 16 * j + 4 * k;
            const float4 v = *reinterpret_cast<const float4*>(x + (STAGED ? ds4lab_q8_staged_slot(col) : col));
            xs[4 * k] = v.x; xs[4 * k + 1] = v.y; xs[4 * k + 2] = v.z; xs[4 * k + 3] = v.w;
        }
#pragma unroll
        for (int i = 0; i < NR; ++i) {
            const uint4 q = w[i][j];
            const uint32_t words[4] = {q.x, q.y, q.z, q.w};
            float dot = 0.0f;
#pragma unroll
            for (int k = 0; k < 16; ++k) {
                const uint32_t bits = __byte_perm(words[k >> 2], 0x4B000000u, 0x7540u | (k & 3));
                dot += (__uint_as_float(bits) - 8388736.0f) * xs[k];
            }
            acc[i] += s[i][j >> 1] * dot;
        }
    }
}

// The totals of a warp's NR rows from its lanes' sums (acc, replaced): the warp's butterfly,
// then with SPLIT > 1 the sums of the SPLIT warps sharing the rows, added in part order (every
// warp gets them). SPLIT > 1 synchronises the block: it is the block's warps, all on one set
// of rows (so a block leaves or stays as a whole).
template <int NR, int SPLIT>
__device__ __forceinline__ void ds4lab_q8_totals(float* acc, int part, int lane) {
#pragma unroll
    for (int i = 0; i < NR; ++i) acc[i] = ds4lab_warp_sum_all(acc[i]);
    if (SPLIT > 1) {
        __shared__ float sums[SPLIT * NR];
        if (lane == 0) {
#pragma unroll
            for (int i = 0; i < NR; ++i) sums[part * NR + i] = acc[i];
        }
        __syncthreads();
#pragma unroll
        for (int i = 0; i < NR; ++i) {
            float total = 0.0f;
            for (int p = 0; p < SPLIT; ++p) total += sums[p * NR + i];
            acc[i] = total;
        }
    }
}

// Row r of a Q8_0 matrix: its code words and scales (codes [rows, COLS / 4] uint32,
// scales [rows, COLS / 32]).
template <int COLS>
__device__ __forceinline__ void ds4lab_q8_row(const uint32_t* codes, const float* scales, int r, const uint4*& w,
                                              const float*& s) {
    w = reinterpret_cast<const uint4*>(codes) + (size_t)r * (COLS / 16);
    s = scales + (size_t)r * (COLS / 32);
}
