// ds4lab_expert_dot: one lane's share of a weight row . x for Q4_K blocks (144 bytes per 256 values):
// f16 d and dmin, 12 bytes of 6-bit (scale, min) pairs for 8 groups of 32, 128 bytes of
// nibbles (low nibbles first, per 64 values); w = d * scale * q - dmin * min. Group g < 4
// keeps its scale and min in the low 6 bits of bytes g and g + 4; group g >= 4 keeps their
// low 4 bits in byte g + 4 and their high 2 bits in the top bits of bytes g - 4 and g.
// Blocks are 16-byte aligned: the lane reads 32-bit words.
#define DS4LAB_DOT_TABLES
template <int COLS>
__device__ __forceinline__ float ds4lab_expert_dot(const uint8_t* w, const float* xv, int lane) {
    const int first = lane * 8, group = first >> 5, chunk = first >> 6;
    const int shift = 4 * ((first >> 5) & 1), k0 = first & 31;
    const int at_p = group < 4 ? group : group + 4, at_q = group < 4 ? group + 4 : group - 4;
    constexpr int NB = COLS / 256, U = ds4lab_step<COLS / 256>::U;
    float acc = 0.0f;
    for (int b0 = 0; b0 < NB; b0 += U) {
        uint32_t dd[U], sp[U], sq[U], sr[U], lo[U], hi[U];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const uint8_t* blk = w + (b0 + u) * 144;
            const uint32_t* q = reinterpret_cast<const uint32_t*>(blk + 16 + 32 * chunk + k0);
            dd[u] = *reinterpret_cast<const uint32_t*>(blk);
            sp[u] = blk[4 + at_p];
            sq[u] = blk[4 + at_q];
            sr[u] = blk[4 + group];
            lo[u] = q[0];
            hi[u] = q[1];
        }
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const uint32_t sc = group < 4 ? sp[u] & 63 : (sp[u] & 15) | ((sq[u] >> 6) << 4);
            const uint32_t mn = group < 4 ? sq[u] & 63 : (sp[u] >> 4) | ((sr[u] >> 6) << 4);
            const float dl = ds4lab_f16_bits(dd[u]) * (float)sc;
            const float ml = ds4lab_f16_bits(dd[u] >> 16) * (float)mn;
            acc = ds4lab_kquant_dot8<15>(acc, dl, ml, lo[u], hi[u], shift, xv, b0 + u, lane);
        }
    }
    return acc;
}
