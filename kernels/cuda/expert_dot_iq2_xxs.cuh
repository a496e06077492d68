// ds4lab_expert_dot: one lane's share of R weight rows . x for IQ2_XXS blocks (66 bytes per
// 256 values): f16 d, then per 32 values 4 grid indices and a u32 of four 7-bit sign indices
// plus a 4-bit scale s; w = d * (0.5 + s) * 0.25 * grid * sign. Blocks are 2-byte aligned:
// the lane reads 16-bit words.
// The grid (256 entries of 8 bytes) is copied to shared memory first: a warp's 32 grid
// lookups hit up to 16 cache lines, which the L1 serves one at a time, and shared memory
// serves them in a few passes. The sign bits are computed (ds4lab_iq2_signs), not looked up:
// the kernels are bound by the L1 and shared memory pipe (ncu, expert_swiglu: 72%).
#define DS4LAB_DOT_STAGE                                                                         \
    __shared__ uint2 ds4lab_grid_s[256];                                                         \
    for (int i = threadIdx.x; i < 256; i += blockDim.x)                                          \
        ds4lab_grid_s[i] = reinterpret_cast<const uint2*>(grid)[i];                              \
    __syncthreads();
#define DS4LAB_DOT_TABLES , ds4lab_grid_s
template <int COLS, int R>
__device__ __forceinline__ void ds4lab_expert_dot(const uint8_t* const (&w)[R], const float* xv, int lane,
                                                  float (&acc)[R], const uint2* grid) {
    const int sub = lane >> 2, part = lane & 3;
    constexpr int NB = COLS / 256, U = ds4lab_step<NB, R>::U;
    float sums[R];
    #pragma unroll
    for (int r = 0; r < R; ++r) sums[r] = 0.0f;
    for (int b0 = 0; b0 < NB; b0 += U) {
        uint32_t d[U][R], aux[U][R], index[U][R];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            #pragma unroll
            for (int r = 0; r < R; ++r) {
                const uint16_t* blk = reinterpret_cast<const uint16_t*>(w[r] + (b0 + u) * 66);
                const uint16_t* s16 = blk + 1 + 4 * sub;               // this lane's 8 bytes of 32 values
                d[u][r] = blk[0];
                aux[u][r] = (uint32_t)s16[2] | ((uint32_t)s16[3] << 16);
                index[u][r] = (s16[part >> 1] >> (8 * (part & 1))) & 0xffu;
            }
        }
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            float xs[8];
            ds4lab_lane_inputs(xv, b0 + u, lane, xs);
            #pragma unroll
            for (int r = 0; r < R; ++r) {
                const float db = ds4lab_f16_bits(d[u][r]) * (0.5f + ds4lab_small_uint(aux[u][r] >> 28)) * 0.25f;
                const uint2 g8 = grid[index[u][r]];
                const uint32_t g[2] = {g8.x, g8.y};
                const uint32_t signs = ds4lab_iq2_signs((aux[u][r] >> (7 * part)) & 127);
                // The scale once per 8 values: the weights' loop is bound by instruction issue.
                // So a grid byte becomes its float as q8_rows.cuh's codes do (a byte permute
                // into the mantissa of 2^23, one exact subtraction; an int-to-float conversion
                // issues at an eighth of the FMA rate), and its sign is the sign bit set.
                float gx = 0.0f;
                #pragma unroll
                for (int k = 0; k < 8; ++k) {
                    const float mag = __uint_as_float(__byte_perm(g[k >> 2], 0x4B000000u, 0x7540u | (k & 3))) - 8388608.0f;
                    const float q = __uint_as_float(__float_as_uint(mag) ^ ((signs << (31 - k)) & 0x80000000u));
                    gx = fmaf(q, xs[k], gx);
                }
                sums[r] = fmaf(db, gx, sums[r]);
            }
        }
    }
    #pragma unroll
    for (int r = 0; r < R; ++r) acc[r] += sums[r];
}
