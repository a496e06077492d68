// ds4lab_expert_dot: one lane's share of a weight row . x for IQ2_XXS blocks (66 bytes per 256 values):
// f16 d, then per 32 values 4 grid indices and a u32 of four 7-bit sign indices plus a
// 4-bit scale s; w = d * (0.5 + s) * 0.25 * grid * sign. Blocks are 2-byte aligned: the
// lane reads 16-bit words.
#define DS4LAB_DOT_TABLES , grid, ksigns
template <int COLS>
__device__ __forceinline__ float ds4lab_expert_dot(const uint8_t* w, const float* xv, int lane, const uint8_t* grid,
                                                   const uint8_t* ksigns) {
    const int sub = lane >> 2, part = lane & 3;
    constexpr int NB = COLS / 256, U = ds4lab_step<COLS / 256>::U;
    float acc = 0.0f;
    for (int b0 = 0; b0 < NB; b0 += U) {
        uint32_t d[U], aux[U], index[U];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const uint16_t* blk = reinterpret_cast<const uint16_t*>(w + (b0 + u) * 66);
            const uint16_t* s16 = blk + 1 + 4 * sub;                   // this lane's 8 bytes of 32 values
            d[u] = blk[0];
            aux[u] = (uint32_t)s16[2] | ((uint32_t)s16[3] << 16);
            index[u] = (s16[part >> 1] >> (8 * (part & 1))) & 0xffu;
        }
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const float db = ds4lab_f16_bits(d[u]) * (0.5f + (float)(aux[u] >> 28)) * 0.25f;
            const uint2 g8 = *reinterpret_cast<const uint2*>(grid + 8 * index[u]);   // 8 grid bytes, one load
            const uint32_t g[2] = {g8.x, g8.y};
            const uint8_t signs = ksigns[(aux[u] >> (7 * part)) & 127];
            float xs[8];
            ds4lab_lane_inputs(xv, b0 + u, lane, xs);
            #pragma unroll
            for (int k = 0; k < 8; ++k) {
                const float mag = (float)((g[k >> 2] >> (8 * (k & 3))) & 0xffu);
                const float v = (signs >> k) & 1 ? -mag : mag;
                acc += db * v * xs[k];
            }
        }
    }
    return acc;
}
