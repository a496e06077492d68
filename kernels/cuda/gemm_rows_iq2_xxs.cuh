// Rows of IQ2_XXS experts for quant_gemm.cu (66 bytes per 256 values: f16 d, then per 32
// values 4 grid indices and a u32 of four 7-bit sign indices and a 4-bit scale s):
// q = grid * sign (8 values per grid index), dl = d * (0.5 + s) * 0.25, no min.
struct ds4lab_gemm_row {
    const uint8_t* w;
    const uint8_t* grid;
};
struct ds4lab_gemm_raw {
    uint32_t d, index, aux;   // the block's d bits; the 2 grid indices of these 16 values; aux
};
#define DS4LAB_GEMM_ROW(e, row) \
    ds4lab_gemm_row{raw + (size_t)(e) * EXPERT_BYTES + (size_t)(row) * ROW_BYTES, grid}
#define DS4LAB_GEMM_HAS_MIN false

__device__ __forceinline__ void ds4lab_gemm_load16(const ds4lab_gemm_row& r, int k0, ds4lab_gemm_raw& v) {
    const int within = k0 & 255;
    const uint16_t* blk = reinterpret_cast<const uint16_t*>(r.w + (k0 >> 8) * 66);
    const uint16_t* s16 = blk + 1 + 4 * (within >> 5);
    v.d = blk[0];
    v.index = s16[(within >> 4) & 1];
    v.aux = (uint32_t)s16[2] | ((uint32_t)s16[3] << 16);
}

__device__ __forceinline__ void ds4lab_gemm_unpack16(const ds4lab_gemm_row& r, const ds4lab_gemm_raw& v, int k0,
                                                     __half q[16], float& dl, float& ml) {
    const int half = (k0 >> 4) & 1;
    dl = ds4lab_f16_bits(v.d) * (0.5f + (float)(v.aux >> 28)) * 0.25f;
    ml = 0.0f;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const uint32_t index = (v.index >> (8 * j)) & 0xffu;
        const uint32_t signs = ds4lab_iq2_signs((v.aux >> (7 * (2 * half + j))) & 127);
        const uint2 g8 = *reinterpret_cast<const uint2*>(r.grid + 8 * index);   // 8 grid bytes, one load
        const uint32_t gw[2] = {g8.x, g8.y};
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const int mag = (gw[k >> 2] >> (8 * (k & 3))) & 0xff;
            q[8 * j + k] = __int2half_rn((signs >> k) & 1 ? -mag : mag);
        }
    }
}
