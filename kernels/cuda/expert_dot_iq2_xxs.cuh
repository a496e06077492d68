// ds4lab_expert_dot: one lane's share of R weight rows . x for IQ2_XXS blocks (66 bytes per
// 256 values): f16 d, then per 32 values 4 grid indices and a u32 of four 7-bit sign indices
// plus a 4-bit scale s; w = d * (0.5 + s) * 0.25 * grid * sign. Blocks are 2-byte aligned:
// the lane reads 16-bit words.
// Two lookup tables go to shared memory first (DS4LAB_DOT_STAGE, 384 entries of 8 bytes): the
// grid (256 entries, copied: a warp's 32 lookups hit up to 16 cache lines, which the L1
// serves one at a time) and, after it, for each 7-bit sign index a byte mask with 0x7F in
// byte k where value k is negative (ds4lab_iq2_sign_mask, computed). With the mask K the 8
// grid bytes g become b = (g ^ K) + 64 - K, i.e. 64 + g or 64 - g (in 21..107: the 4 bytes
// of a word add without carries), and a value is the float 2^23 + b (b moved into the
// mantissa of 2^23 by a byte permute) minus 2^23 + 64: exactly +-g, in three instructions a
// value (permute, subtract, FMA). The kernels are bound by instruction issue (ncu,
// expert_swiglu: the decode took ~9 instructions a weight when the sign was set per value).
#define DS4LAB_DOT_STAGE                                                                         \
    __shared__ uint2 ds4lab_iq2_tables[384];                                                     \
    for (int i = threadIdx.x; i < 384; i += blockDim.x)                                          \
        ds4lab_iq2_tables[i] = i < 256 ? reinterpret_cast<const uint2*>(grid)[i] : ds4lab_iq2_sign_mask(i - 256); \
    __syncthreads();
#define DS4LAB_DOT_TABLES , ds4lab_iq2_tables
// A lane takes 16 values of a block (half a 32-value group: two grid indices, one u16), so
// a warp covers two blocks a step, the lanes 16 apart on different blocks: the block's scale
// and its group's signs word are read and made once for 16 values (they were for 8), and a
// step has twice the bytes in flight. An odd block count leaves the upper half-warp's last
// step out. tables: the grid's 256 entries, then the 128 sign masks.
template <int COLS, int R>
__device__ __forceinline__ void ds4lab_expert_dot(const uint8_t* const (&w)[R], const float* xv, int lane,
                                                  float (&acc)[R], const uint2* tables) {
    const int upper = lane >> 4, group = (lane >> 1) & 7, pair = lane & 1;
    constexpr int NB = COLS / 256, STEPS = (NB + 1) / 2, U = ds4lab_step<STEPS, R>::U;
    float sums[R];
    #pragma unroll
    for (int r = 0; r < R; ++r) sums[r] = 0.0f;
    for (int s0 = 0; s0 < STEPS; s0 += U) {
        uint32_t d[U][R], aux[U][R], index[U][R];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int b = NB % 2 == 0 || 2 * (s0 + u) + upper < NB ? 2 * (s0 + u) + upper : NB - 1;
            #pragma unroll
            for (int r = 0; r < R; ++r) {
                const uint16_t* blk = reinterpret_cast<const uint16_t*>(w[r] + b * 66);
                const uint16_t* s16 = blk + 1 + 4 * group;            // the group's 8 bytes
                d[u][r] = blk[0];
                aux[u][r] = (uint32_t)s16[2] | ((uint32_t)s16[3] << 16);
                index[u][r] = s16[pair];                              // grid indices of values 0-7, 8-15
            }
        }
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int b = 2 * (s0 + u) + upper;
            if (NB % 2 != 0 && b >= NB) continue;
            float xs[16];
            const float* xb = xv + b * 256 + group * 32 + pair * 16;
            ds4lab_load8(xb, xs);
            ds4lab_load8(xb + 8, xs + 8);
            #pragma unroll
            for (int r = 0; r < R; ++r) {
                const float db = ds4lab_f16_bits(d[u][r]) * (0.5f + ds4lab_small_uint(aux[u][r] >> 28)) * 0.25f;
                float gx = 0.0f;
                #pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const uint2 g8 = tables[(index[u][r] >> (8 * j)) & 0xffu];
                    const uint2 k8 = tables[256 + ((aux[u][r] >> (7 * (2 * pair + j))) & 127)];
                    const uint32_t v[2] = {((g8.x ^ k8.x) + 0x40404040u) - k8.x, ((g8.y ^ k8.y) + 0x40404040u) - k8.y};
                    #pragma unroll
                    for (int k = 0; k < 8; ++k) {
                        const float q = __uint_as_float(__byte_perm(v[k >> 2], 0x4B000000u, 0x7540u | (k & 3))) - 8388672.0f;
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
