// ds4lab_gemm_decode16 for Q2_K expert rows (84 bytes per 256 values: 16 scale bytes, low
// nibble scale and high nibble min per 16 values; 64 bytes of 2-bit codes; f16 d, dmin):
// q = 2-bit code, dl = d * scale, ml = dmin * min. Values i of a block: code byte
// 32 * (i / 128) + i % 32, shifted by 2 * ((i % 128) / 32).
struct ds4lab_gemm_row {
    const uint8_t* w;
};
#define DS4LAB_GEMM_ROW(e, row) ds4lab_gemm_row{raw + (size_t)(e) * EXPERT_BYTES + (size_t)(row) * ROW_BYTES}
#define DS4LAB_GEMM_HAS_MIN true

__device__ __forceinline__ void ds4lab_gemm_decode16(const ds4lab_gemm_row& r, int k0, __half q[16], float& dl,
                                                     float& ml) {
    const int i0 = k0 & 255, within = i0 & 127;
    const uint8_t* blk = r.w + (k0 >> 8) * 84;
    ds4lab_gemm_codes16(blk + 16 + 32 * (i0 >> 7) + (within & 31), 2 * (within >> 5), 3u, q);
    const uint32_t dd = *reinterpret_cast<const uint32_t*>(blk + 80);
    const uint32_t sc = blk[i0 >> 4];
    dl = ds4lab_gemm_f16(dd) * (float)(sc & 15);
    ml = ds4lab_gemm_f16(dd >> 16) * (float)(sc >> 4);
}
