// Rows of Q2_K experts for quant_gemm.cu (84 bytes per 256 values: 16 scale bytes, low
// nibble scale and high nibble min per 16 values; 64 bytes of 2-bit codes; f16 d, dmin):
// w = d * scale * code - dmin * min, taken as q = scale * code (at most 45, exact in f16),
// dl = d (the whole block's), ml = dmin * min. Value i of a block: code byte
// 32 * (i / 128) + i % 32, shifted by 2 * ((i % 128) / 32).
struct ds4lab_gemm_row {
    const uint8_t* w;
};
struct ds4lab_gemm_raw {
    uint32_t w[4], dd, sc;
};
#define DS4LAB_GEMM_ROW(e, row) ds4lab_gemm_row{raw + (size_t)(e) * EXPERT_BYTES + (size_t)(row) * ROW_BYTES}
#define DS4LAB_GEMM_HAS_MIN true

__device__ __forceinline__ void ds4lab_gemm_load16(const ds4lab_gemm_row& r, int k0, ds4lab_gemm_raw& v) {
    const int i0 = k0 & 255, within = i0 & 127;
    const uint8_t* blk = r.w + (k0 >> 8) * 84;
    ds4lab_gemm_words4(blk + 16 + 32 * (i0 >> 7) + (within & 31), v.w);
    v.dd = *reinterpret_cast<const uint32_t*>(blk + 80);
    v.sc = blk[i0 >> 4];
}

__device__ __forceinline__ void ds4lab_gemm_unpack16(const ds4lab_gemm_row&, const ds4lab_gemm_raw& v, int k0,
                                                     __half q[16], float& dl, float& ml) {
    const int shift = 2 * ((k0 & 127) >> 5);
    const uint32_t scale = v.sc & 15;
#pragma unroll
    for (int k = 0; k < 16; ++k) q[k] = __uint2half_rn(((v.w[k >> 2] >> (8 * (k & 3) + shift)) & 3u) * scale);
    dl = ds4lab_f16_bits(v.dd);
    ml = ds4lab_f16_bits(v.dd >> 16) * (float)(v.sc >> 4);
}
