// IQ2_XXS for the tensor-core expert kernel (expert_swiglu_tc.cu). Blocks of 256 values are
// 66 bytes: f16 d, then per group of 32 values 4 grid indices and a u32 `aux` of four 7-bit
// sign indices and a 4-bit scale s; value = d * (0.5 + s) * 0.25 * grid * sign.
// Lane t4 of a row decodes the group's grid entry t4, its 8 consecutive values, into four
// words of two f16 (values 2j and 2j + 1 in word j) holding q = grid * sign (8, 25 or 43,
// signed: exact in f16), and returns the group's dl = d * (0.5 + s) * 0.25 (value = dl * q).
// No conversion instruction: a grid byte b placed under 0x64 (__byte_perm) is the f16
// 1024 + b, and 1024 is subtracted (exact). A sign flips bit 15 of its half: one
// multiplication per word moves sign bits 2j and 2j + 1 to bits 15 and 31
// (s * (2^(15 - 2j) + 2^(30 - 2j)); the two shifted copies of the 8-bit s do not overlap).
// Blocks are 2-byte aligned: 16-bit loads. The tables are expert_dot_iq2_xxs.cuh's, staged
// in shared memory by its DS4LAB_DOT_STAGE.
struct ds4lab_tc_group {
    uint32_t index;   // the 16-bit word holding this lane's grid index byte
    uint32_t aux;     // the group's sign indices and scale
};

// The f16 bits of block b's d.
__device__ __forceinline__ uint32_t ds4lab_tc_block_d(const uint8_t* row, int b) {
    return *reinterpret_cast<const uint16_t*>(row + 66 * b);
}

__device__ __forceinline__ ds4lab_tc_group ds4lab_tc_load(const uint8_t* row, int b, int group, int t4) {
    const uint16_t* s16 = reinterpret_cast<const uint16_t*>(row + 66 * b) + 1 + 4 * group;
    return {s16[t4 >> 1], (uint32_t)s16[2] | ((uint32_t)s16[3] << 16)};
}

// Two f16 of the form 1024 + v (v < 1024) in one word, as the two f16 v.
__device__ __forceinline__ uint32_t ds4lab_unbias_halves(uint32_t biased) {
    const __half2 v = __hsub2(*reinterpret_cast<const __half2*>(&biased), __float2half2_rn(1024.0f));
    return *reinterpret_cast<const uint32_t*>(&v);
}

__device__ __forceinline__ float ds4lab_tc_unpack(ds4lab_tc_group v, uint32_t d_bits, int t4, const uint2* grid,
                                                  const uint8_t* ksigns, uint32_t q[4]) {
    const uint2 entry = grid[(v.index >> (8 * (t4 & 1))) & 0xffu];
    const uint32_t signs = ksigns[(v.aux >> (7 * t4)) & 127u];
    const uint32_t words[2] = {entry.x, entry.y};
    const uint32_t spread[4] = {0x40008000u, 0x10002000u, 0x04000800u, 0x01000200u};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const uint32_t biased = __byte_perm(words[j >> 1], 0x64u, (j & 1) ? 0x4342u : 0x4140u);
        q[j] = ds4lab_unbias_halves(biased) ^ ((signs * spread[j]) & 0x80008000u);
    }
    return ds4lab_f16_bits(d_bits) * (0.5f + ds4lab_small_uint(v.aux >> 28)) * 0.25f;
}
