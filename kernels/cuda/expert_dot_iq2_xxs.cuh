// ds4lab_expert_dot: one lane's share of R weight rows . x for IQ2_XXS blocks (66 bytes per
// 256 values): f16 d, then per 32 values 4 grid indices and a u32 of four 7-bit sign indices
// plus a 4-bit scale s; w = d * (0.5 + s) * 0.25 * grid * sign. Blocks are 2-byte aligned:
// the lane reads 16-bit words.
// A warp walks a row two blocks at a time: lanes 0-15 the first, 16-31 the second, each lane
// 16 values (half of a 32-value group), so that the block's d, the group's scale and sign
// word are loaded and decoded once per 16 values. The kernels are bound by the L1 and
// shared-memory pipe and by instruction issue (ncu, expert_swiglu: 72% of L1 throughput):
// with 8 values a lane, every lane loaded d, the sign word and an index for 8 weights.
// The grid (256 entries of 8 bytes) is read from shared memory in GRID_COPIES copies,
// interleaved (entry e of copy c at e * GRID_COPIES + c), a lane reading copy lane %
// GRID_COPIES: with 16 copies each lane of a half-warp has its own pair of banks, and a warp's
// 32 random 8-byte lookups take the two passes any 64-bit read takes. From one copy they
// took ~7 (16 lanes on 16 bank pairs at random collide three or four deep).
// The sign bits are computed (ds4lab_iq2_signs), not looked up.
#define DS4LAB_DOT_STAGE                                                                         \
    __shared__ uint2 ds4lab_grid_s[256 * GRID_COPIES];                                           \
    for (int i = threadIdx.x; i < 256 * GRID_COPIES; i += blockDim.x)                            \
        ds4lab_grid_s[i] = reinterpret_cast<const uint2*>(grid)[i / GRID_COPIES];                \
    __syncthreads();
#define DS4LAB_DOT_TABLES , ds4lab_grid_s + (lane & (GRID_COPIES - 1)), GRID_COPIES
template <int COLS, int R>
__device__ __forceinline__ void ds4lab_expert_dot(const uint8_t* const (&w)[R], const float* xv, int lane,
                                                  float (&acc)[R], const uint2* grid, int copies) {
    const int second = lane >> 4, sub = (lane >> 1) & 7, half = lane & 1;
    constexpr int NB = COLS / 256, NP = (NB + 1) / 2, U = ds4lab_step<NP, R>::U;
    float sums[R];
    #pragma unroll
    for (int r = 0; r < R; ++r) sums[r] = 0.0f;
    for (int p0 = 0; p0 < NP; p0 += U) {
        uint32_t d[U][R], aux[U][R], index[U][R];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int b = 2 * (p0 + u) + second;
            #pragma unroll
            for (int r = 0; r < R; ++r) {
                d[u][r] = aux[u][r] = index[u][r] = 0u;
                if (NB % 2 == 0 || b < NB) {
                    const uint16_t* blk = reinterpret_cast<const uint16_t*>(w[r] + b * 66);
                    const uint16_t* s16 = blk + 1 + 4 * sub;           // the group's 8 bytes
                    d[u][r] = blk[0];
                    aux[u][r] = (uint32_t)s16[2] | ((uint32_t)s16[3] << 16);
                    index[u][r] = s16[half];                            // the two grid indices of these 16 values
                }
            }
        }
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int b = 2 * (p0 + u) + second;
            if (NB % 2 != 0 && b >= NB) continue;                       // an odd count's last pair: no second block
            float xs[16];
            const float* xb = xv + b * 256 + 32 * sub + 16 * half;
            ds4lab_load8(xb, xs);
            ds4lab_load8(xb + 8, xs + 8);
            #pragma unroll
            for (int r = 0; r < R; ++r) {
                const float db = ds4lab_f16_bits(d[u][r]) * (0.5f + ds4lab_small_uint(aux[u][r] >> 28)) * 0.25f;
                float gx = 0.0f;
                #pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const uint2 g8 = grid[((index[u][r] >> (8 * j)) & 0xffu) * copies];
                    const uint32_t g[2] = {g8.x, g8.y};
                    const uint32_t signs = ds4lab_iq2_signs((aux[u][r] >> (7 * (2 * half + j))) & 127);
                    // A grid byte becomes its float as q8_rows.cuh's codes do (a byte permute
                    // into the mantissa of 2^23, one exact subtraction; an int-to-float
                    // conversion issues at an eighth of the FMA rate); its sign is the sign bit set.
                    #pragma unroll
                    for (int k = 0; k < 8; ++k) {
                        const float mag = __uint_as_float(__byte_perm(g[k >> 2], 0x4B000000u, 0x7540u | (k & 3))) - 8388608.0f;
                        const float q = __uint_as_float(__float_as_uint(mag) ^ ((signs << (31 - k)) & 0x80000000u));
                        gx = fmaf(q, xs[8 * j + k], gx);
                    }
                }
                sums[r] = fmaf(db, gx, sums[r]);
            }
        }
    }
    #pragma unroll
    for (int r = 0; r < R; ++r) acc[r] += sums[r];
}
