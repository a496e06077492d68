// ds4lab_gemm_decode16 for IQ2_XXS expert rows (66 bytes per 256 values: f16 d, then per 32
// values 4 grid indices and a u32 of four 7-bit sign indices and a 4-bit scale s):
// q = grid * sign (8 values per grid index), dl = d * (0.5 + s) * 0.25, no min.
struct ds4lab_gemm_row {
    const uint8_t* w;
    const uint8_t* grid;
    const uint8_t* ksigns;
};
#define DS4LAB_GEMM_ROW(e, row) \
    ds4lab_gemm_row{raw + (size_t)(e) * EXPERT_BYTES + (size_t)(row) * ROW_BYTES, grid, ksigns}
#define DS4LAB_GEMM_HAS_MIN false

__device__ __forceinline__ void ds4lab_gemm_decode16(const ds4lab_gemm_row& r, int k0, __half q[16], float& dl,
                                                     float& ml) {
    const int within = k0 & 255, sub = within >> 5, h = (within >> 4) & 1;
    const uint16_t* blk = reinterpret_cast<const uint16_t*>(r.w + (k0 >> 8) * 66);
    const uint16_t* s16 = blk + 1 + 4 * sub;
    const uint32_t aux = (uint32_t)s16[2] | ((uint32_t)s16[3] << 16);
    dl = ds4lab_gemm_f16(blk[0]) * (0.5f + (float)(aux >> 28)) * 0.25f;
    ml = 0.0f;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const int part = 2 * h + j;
        const uint32_t index = (s16[h] >> (8 * j)) & 0xffu;
        const uint8_t signs = r.ksigns[(aux >> (7 * part)) & 127];
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const int mag = r.grid[8 * index + k];
            q[8 * j + k] = __int2half_rn((signs >> k) & 1 ? -mag : mag);
        }
    }
}
