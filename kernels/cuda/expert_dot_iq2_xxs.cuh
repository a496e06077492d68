// ds4lab_expert_dot: one lane's share of R weight rows . x for IQ2_XXS blocks (66 bytes per
// 256 values): f16 d, then per 32 values 4 grid indices and a u32 of four 7-bit sign indices
// plus a 4-bit scale s; w = d * (0.5 + s) * 0.25 * grid * sign. Blocks are 2-byte aligned:
// the lane reads 16-bit words.
// A value is one byte permute: its grid byte, two zero bytes and its sign byte make the float
// whose bits are sign | g, the subnormal +-g * 2^-149 (expert_matvec_common.cuh: the inputs
// scaled by 2^64, the block's scale by 2^85; the same roundings, the same bits as unscaled),
// then one FMA.
// Where the grid bytes and the signs come from is what bounds the kernels: ncu found
// expert_swiglu bound by its L1 and shared-memory traffic (79% of the L1's throughput, a third
// of the stalls waiting on shared memory), not by instruction issue, when a lane looked up 8
// grid bytes and 16 bytes of sign bytes in shared tables for every 8 values. Now:
//   - the grid goes to shared memory as 4 bytes an entry (DS4LAB_DOT_STAGE): each grid byte is
//     one of three levels, kept as a 2-bit code a nibble (ds4lab_iq2_grid_codes), and two
//     permutes of a constant word of the levels turn an entry into its 8 bytes;
//   - the signs are made in registers from the 7-bit index (ds4lab_iq2_sign_words, ~10
//     instructions for 8 values), no lookup;
//   - the value's permute takes its two zero bytes by replicating the sign bit of its grid
//     byte (every level is below 0x80): prmt's sign mode (ds4lab_prmt).
// A 43-layer step at 4096 tokens on the H200 (device_time_ab.py, 2026-12-04): 10.61 ms with
// both tables, 10.02 with the signs computed, 9.58 with the grid as codes too; the three the
// same bits on the device and in the host tests.
#define DS4LAB_DOT_STAGE                                                                         \
    __shared__ uint32_t ds4lab_iq2_grid4[256];                                                   \
    for (int i = threadIdx.x; i < 256; i += blockDim.x)                                          \
        ds4lab_iq2_grid4[i] = ds4lab_iq2_grid_codes(reinterpret_cast<const uint2*>(grid)[i]);    \
    __syncthreads();
#define DS4LAB_DOT_TABLES , ds4lab_iq2_grid4
// The level bytes of the IQ2_XXS grid (every grid byte is one of them), as prmt's source word.
#define DS4LAB_IQ2_LEVELS 0x002b1908u
// A grid entry's 8 bytes as 2-bit level codes, one a nibble (value k in nibble k): a prmt
// selector for each half (`ds4lab_prmt(DS4LAB_IQ2_LEVELS, 0, codes)`, `... codes >> 16`).
__device__ __forceinline__ uint32_t ds4lab_iq2_grid_codes(uint2 entry) {
    uint32_t codes = 0;
    for (int k = 0; k < 8; ++k) {
        const uint32_t b = ((k < 4 ? entry.x : entry.y) >> (8 * (k & 3))) & 0xffu;
        codes |= (b == 0x08u ? 0u : b == 0x19u ? 1u : 2u) << (4 * k);
    }
    return codes;
}
// The signs of a 7-bit IQ2_XXS sign index as two words of 0x80/0x00 bytes (byte k of word h:
// value 4h + k negative). One multiply puts bit k of the index on bit 8k + 7: word 0's copies
// the index shifted by 7, 14, 21 and 28 (bit k of copy k + 1 lands there), word 1's by 3, 10
// and 17 (bit 4 + k of copy k + 1). Two copies of one word meet on a bit only where their
// index bits are 7 or 14 apart, and the index has 7 bits, so nothing carries and the other
// bits fall outside the mask: no mask or shift of the index first. The eighth sign is the
// index's parity (ds4lab_iq2_signs).
__device__ __forceinline__ void ds4lab_iq2_sign_words(uint32_t index7, uint32_t (&words)[2]) {
    words[0] = (index7 * 0x10204080u) & 0x80808080u;
    words[1] = ((index7 * 0x00020408u) & 0x00808080u) | ((uint32_t)__popc(index7) << 31);
}
// The lane's words of U steps of R rows from step s0 on (every load in flight before any is
// used): each block's f16 scale d, its group's signs-and-scale word aux and the lane's two
// grid indices.
template <int NB, int U, int R>
__device__ __forceinline__ void ds4lab_iq2_loads(const uint8_t* const (&w)[R], int s0, int lane, uint32_t (&d)[U][R],
                                                 uint32_t (&aux)[U][R], uint32_t (&index)[U][R]) {
    const int upper = lane >> 4, group = (lane >> 1) & 7, pair = lane & 1;
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
}
// A lane takes 16 values of a block (half a 32-value group: two grid indices, one u16), so
// a warp covers two blocks a step, the lanes 16 apart on different blocks: the block's scale
// and its group's signs word are read and made once for 16 values, and a step has twice the
// bytes in flight. An odd block count leaves the upper half-warp's last step out.
// ds4lab_iq2_walk is that walk, shared by the float dot below and the integer one
// (expert_dot_iq2_xxs_planes.cuh): body(b, d, aux, index, sums) for each block b the lane
// takes, with its rows' words (ds4lab_iq2_loads) and their sums, added to acc at the end.
template <int COLS, int R, typename Body>
__device__ __forceinline__ void ds4lab_iq2_walk(const uint8_t* const (&w)[R], int lane, float (&acc)[R], Body body) {
    const int upper = lane >> 4;
    constexpr int NB = COLS / 256, STEPS = (NB + 1) / 2, U = ds4lab_step<STEPS, R>::U;
    float sums[R];
    #pragma unroll
    for (int r = 0; r < R; ++r) sums[r] = 0.0f;
    for (int s0 = 0; s0 < STEPS; s0 += U) {
        uint32_t d[U][R], aux[U][R], index[U][R];
        ds4lab_iq2_loads<NB, U, R>(w, s0, lane, d, aux, index);
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int b = 2 * (s0 + u) + upper;
            if (NB % 2 != 0 && b >= NB) continue;
            body(b, d[u], aux[u], index[u], sums);
        }
    }
    #pragma unroll
    for (int r = 0; r < R; ++r) acc[r] += sums[r];
}

template <int COLS, int R>
__device__ __forceinline__ void ds4lab_expert_dot(const uint8_t* const (&w)[R], const float* xv, int lane,
                                                  float (&acc)[R], const uint32_t* grid4) {
    const int group = (lane >> 1) & 7, pair = lane & 1;
    ds4lab_iq2_walk<COLS, R>(w, lane, acc, [&](int b, const uint32_t (&d)[R], const uint32_t (&aux)[R],
                                               const uint32_t (&index)[R], float (&sums)[R]) {
        float xs[16];
        const float* xb = xv + b * 256 + group * 32 + pair * 16;
        ds4lab_load8(xb, xs);
        ds4lab_load8(xb + 8, xs + 8);
        ds4lab_scale_inputs(xs);
        #pragma unroll
        for (int r = 0; r < R; ++r) {
            const float db = ds4lab_f16_bits(d[r]) * (0.5f + ds4lab_small_uint(aux[r] >> 28)) * (0.25f * DS4LAB_CODE_SCALE);
            float gx = 0.0f;
            #pragma unroll
            for (int j = 0; j < 2; ++j) {
                const uint32_t grid_index = (index[r] >> (8 * j)) & 0xffu;
                const uint32_t sign_index = (aux[r] >> (7 * (2 * pair + j))) & 127;
                const uint32_t codes = grid4[grid_index];
                const uint32_t g[2] = {ds4lab_prmt(DS4LAB_IQ2_LEVELS, 0u, codes),
                                       ds4lab_prmt(DS4LAB_IQ2_LEVELS, 0u, codes >> 16)};
                uint32_t sw[2];
                ds4lab_iq2_sign_words(sign_index, sw);
                #pragma unroll
                for (int k = 0; k < 8; ++k) {
                    // bytes: grid byte k, its sign bit twice (zero), sign byte k
                    const uint32_t c = k & 3;
                    const uint32_t bits = ds4lab_prmt(g[k >> 2], sw[k >> 2], c | ((8 | c) * 0x110u) | ((4 + c) << 12));
                    gx = fmaf(__uint_as_float(bits), xs[8 * j + k], gx);
                }
            }
            sums[r] = fmaf(db, gx, sums[r]);
        }
    });
}
