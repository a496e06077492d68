// ds4lab_gemm_decode16 for Q4_K expert rows (144 bytes per 256 values: f16 d, dmin; 12 bytes
// of 6-bit (scale, min) pairs for 8 groups of 32, packed as in expert_dot_q4_k.cuh; 128
// bytes of nibbles, low nibbles first per 64 values): q = nibble, dl = d * scale,
// ml = dmin * min.
struct ds4lab_gemm_row {
    const uint8_t* w;
};
#define DS4LAB_GEMM_ROW(e, row) ds4lab_gemm_row{raw + (size_t)(e) * EXPERT_BYTES + (size_t)(row) * ROW_BYTES}
#define DS4LAB_GEMM_HAS_MIN true

__device__ __forceinline__ void ds4lab_gemm_decode16(const ds4lab_gemm_row& r, int k0, __half q[16], float& dl,
                                                     float& ml) {
    const int i0 = k0 & 255, group = i0 >> 5;
    const uint8_t* blk = r.w + (k0 >> 8) * 144;
    ds4lab_gemm_codes16(blk + 16 + 32 * (i0 >> 6) + (i0 & 31), 4 * (group & 1), 15u, q);
    const uint32_t dd = *reinterpret_cast<const uint32_t*>(blk);
    const uint32_t sp = blk[4 + (group < 4 ? group : group + 4)];
    const uint32_t sq = blk[4 + (group < 4 ? group + 4 : group - 4)];
    const uint32_t sr = blk[4 + group];
    const uint32_t sc = group < 4 ? sp & 63 : (sp & 15) | ((sq >> 6) << 4);
    const uint32_t mn = group < 4 ? sq & 63 : (sp >> 4) | ((sr >> 6) << 4);
    dl = ds4lab_gemm_f16(dd) * (float)sc;
    ml = ds4lab_gemm_f16(dd >> 16) * (float)mn;
}
