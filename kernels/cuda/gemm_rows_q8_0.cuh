// Rows of a Q8_0 matrix for quant_gemm.cu, as model/weights.py `Q8Matrix` holds them: codes
// [N_EXPERT * ROWS, COLS / 4] uint32 (byte = code + 128), one float32 scale per 32 values.
// q = code, dl = the block's scale, no min. "Expert" e is rows [e * ROWS, (e + 1) * ROWS):
// one matrix, or the groups of the grouped output projection.
struct ds4lab_gemm_row {
    const uint32_t* codes;
    const float* scales;
};
struct ds4lab_gemm_raw {
    uint4 w;
    float scale;
};
#define DS4LAB_GEMM_ROW(e, row) \
    ds4lab_gemm_row{codes + ((size_t)(e) * ROWS + (row)) * (COLS / 4), scales + ((size_t)(e) * ROWS + (row)) * (COLS / 32)}
#define DS4LAB_GEMM_HAS_MIN false

__device__ __forceinline__ void ds4lab_gemm_load16(const ds4lab_gemm_row& r, int k0, ds4lab_gemm_raw& v) {
    v.w = *reinterpret_cast<const uint4*>(r.codes + k0 / 4);
    v.scale = r.scales[k0 / 32];
}

__device__ __forceinline__ void ds4lab_gemm_unpack16(const ds4lab_gemm_row&, const ds4lab_gemm_raw& v, int, __half q[16],
                                                     float& dl, float& ml) {
    const uint32_t words[4] = {v.w.x, v.w.y, v.w.z, v.w.w};
#pragma unroll
    for (int k = 0; k < 16; ++k) q[k] = __int2half_rn((int)((words[k >> 2] >> (8 * (k & 3))) & 0xffu) - 128);
    dl = v.scale;
    ml = 0.0f;
}
