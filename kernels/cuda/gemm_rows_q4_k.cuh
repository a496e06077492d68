// Rows of Q4_K experts for quant_gemm.cu (144 bytes per 256 values: f16 d, dmin; 12 bytes
// of 6-bit (scale, min) pairs for 8 groups of 32, packed as in expert_dot_q4_k.cuh; 128
// bytes of nibbles, low nibbles first per 64 values): q = nibble, dl = d * scale,
// ml = dmin * min.
struct ds4lab_gemm_row {
    const uint8_t* w;
};
struct ds4lab_gemm_raw {
    uint32_t w[4], dd, sp, sq, sr;
};
#define DS4LAB_GEMM_ROW(e, row) ds4lab_gemm_row{raw + (size_t)(e) * EXPERT_BYTES + (size_t)(row) * ROW_BYTES}
#define DS4LAB_GEMM_HAS_MIN true

__device__ __forceinline__ void ds4lab_gemm_load16(const ds4lab_gemm_row& r, int k0, ds4lab_gemm_raw& v) {
    const int i0 = k0 & 255, group = i0 >> 5;
    const uint8_t* blk = r.w + (k0 >> 8) * 144;
    ds4lab_gemm_words4(blk + 16 + 32 * (i0 >> 6) + (i0 & 31), v.w);
    v.dd = *reinterpret_cast<const uint32_t*>(blk);
    v.sp = blk[4 + (group < 4 ? group : group + 4)];
    v.sq = blk[4 + (group < 4 ? group + 4 : group - 4)];
    v.sr = blk[4 + group];
}

__device__ __forceinline__ void ds4lab_gemm_unpack16(const ds4lab_gemm_row&, const ds4lab_gemm_raw& v, int k0,
                                                     __half q[16], float& dl, float& ml) {
    const int group = (k0 & 255) >> 5;
    ds4lab_gemm_codes16(v.w, 4 * (group & 1), 15u, q);
    const uint32_t sc = group < 4 ? v.sp & 63 : (v.sp & 15) | ((v.sq >> 6) << 4);
    const uint32_t mn = group < 4 ? v.sq & 63 : (v.sp >> 4) | ((v.sr >> 6) << 4);
    dl = ds4lab_f16_bits(v.dd) * (float)sc;
    ml = ds4lab_f16_bits(v.dd >> 16) * (float)mn;
}
