// The Q8_0 row dots of the decode step's Q8_0 kernels: two small helpers, then
// ds4lab_q8_dots (the common loop) and ds4lab_q8_totals.

// The lane's 16 inputs of chunk j (xv: the input vector as float4).
__device__ __forceinline__ void ds4lab_q8_inputs(const float4* xv, int j, float xs[16]) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const float4 v = xv[4 * j + k];
        xs[4 * k] = v.x; xs[4 * k + 1] = v.y; xs[4 * k + 2] = v.z; xs[4 * k + 3] = v.w;
    }
}

// sum_k (byte k of q - 128) * xs[k] over one 16-byte word of codes, in k order.
__device__ __forceinline__ float ds4lab_q8_dot16(uint4 q, const float xs[16]) {
    const uint32_t words[4] = {q.x, q.y, q.z, q.w};
    float dot = 0.0f;
#pragma unroll
    for (int k = 0; k < 16; ++k) {
        const uint32_t bits = __byte_perm(words[k >> 2], 0x4B000000u, 0x7540u | (k & 3));
        dot += (__uint_as_float(bits) - 8388736.0f) * xs[k];
    }
    return dot;
}

// One warp's dot products of NR Q8_0 rows with one input vector: the inner loop of every
// decode-step Q8_0 product (q8_matvec, q8_pair, q8_swiglu, q8_hc). Row i's codes are the
// 16-byte words w[i] (byte = code + 128, model/weights.py `Q8Matrix`), its float32 block
// scales s[i] (one per 32 values); xv is the input vector as float4.
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
template <int NR, int COLS, int SPLIT = 1>
__device__ __forceinline__ void ds4lab_q8_dots(const uint4* const* w, const float* const* s, const float4* xv,
                                               int lane, float* acc, int part = 0) {
#pragma unroll
    for (int i = 0; i < NR; ++i) acc[i] = 0.0f;
#pragma unroll (NR < 8 ? 8 / NR : 1)
    for (int j = lane + 32 * part; j < COLS / 16; j += 32 * SPLIT) {
        float xs[16];
        ds4lab_q8_inputs(xv, j, xs);
#pragma unroll
        for (int i = 0; i < NR; ++i) acc[i] += s[i][j >> 1] * ds4lab_q8_dot16(w[i][j], xs);
    }
}

// The totals of a warp's NR rows from its lanes' sums (acc, replaced): the warp's butterfly,
// then with SPLIT > 1 the sums of the SPLIT warps sharing the rows, added in part order (every
// warp gets them). SPLIT > 1 synchronises the block: it is the block's warps, all on one set
// of rows, or GROUPS such sets (group g: warps g * SPLIT ..), so a block leaves or stays as a
// whole.
template <int NR, int SPLIT, int GROUPS = 1>
__device__ __forceinline__ void ds4lab_q8_totals(float* acc, int part, int lane, int group = 0) {
#pragma unroll
    for (int i = 0; i < NR; ++i) acc[i] = ds4lab_warp_sum_all(acc[i]);
    if (SPLIT > 1) {
        __shared__ float sums[GROUPS * SPLIT * NR];
        float* mine = sums + group * SPLIT * NR;
        if (lane == 0) {
#pragma unroll
            for (int i = 0; i < NR; ++i) mine[part * NR + i] = acc[i];
        }
        __syncthreads();
#pragma unroll
        for (int i = 0; i < NR; ++i) {
            float total = 0.0f;
            for (int p = 0; p < SPLIT; ++p) total += mine[p * NR + i];
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

// R rows from r0 of a Q8_0 matrix times one vector xv of COLS values (global or shared memory),
// into y[r0..]: the warp's lanes sum, and with SPLIT the SPLIT warps sharing the rows (set
// `set` of GROUPS such sets a block; `part` this warp's); the first writes. The body of
// q8_matvec.cu and of q8_pair.cu's and q8_hc.cu's products that have nothing else in the loop.
template <int R, int COLS, int SPLIT, int GROUPS = 1>
__device__ __forceinline__ void ds4lab_q8_rows_times(const uint32_t* codes, const float* scales, const float* xv,
                                                     float* y, int r0, int part, int lane, int set = 0) {
    const uint4* w[R];
    const float* s[R];
    float acc[R];
#pragma unroll
    for (int i = 0; i < R; ++i) ds4lab_q8_row<COLS>(codes, scales, r0 + i, w[i], s[i]);
    ds4lab_q8_dots<R, COLS, SPLIT>(w, s, reinterpret_cast<const float4*>(xv), lane, acc, part);
    ds4lab_q8_totals<R, SPLIT, GROUPS>(acc, part, lane, set);
#pragma unroll
    for (int i = 0; i < R; ++i) {
        if (lane == 0 && part == 0) y[r0 + i] = acc[i];
    }
}
