// ds4lab_expert_dot: one lane's share of a weight row . x for Q2_K blocks (84 bytes per 256 values):
// 16 scale bytes (low nibble scale, high nibble min, per 16 values), 64 bytes of 2-bit
// codes, f16 d and dmin; w = d * scale * q - dmin * min. Blocks are 4-byte aligned: the
// lane reads its 8 code bytes as two 32-bit words.
#define DS4LAB_DOT_TABLES
template <int COLS>
__device__ __forceinline__ float ds4lab_expert_dot(const uint8_t* w, const float* xv, int lane) {
    const int first = lane * 8, half = first >> 7, within = first & 127;
    const int shift = 2 * (within >> 5), k0 = within & 31;
    constexpr int NB = COLS / 256, U = ds4lab_step<COLS / 256>::U;
    float acc = 0.0f;
    for (int b0 = 0; b0 < NB; b0 += U) {
        uint32_t dd[U], sc[U], lo[U], hi[U];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const uint8_t* blk = w + (b0 + u) * 84;
            const uint32_t* q = reinterpret_cast<const uint32_t*>(blk + 16 + 32 * half + k0);
            dd[u] = *reinterpret_cast<const uint32_t*>(blk + 80);
            sc[u] = blk[lane >> 1];
            lo[u] = q[0];
            hi[u] = q[1];
        }
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const float dl = ds4lab_f16_bits(dd[u]) * (float)(sc[u] & 15);
            const float ml = ds4lab_f16_bits(dd[u] >> 16) * (float)(sc[u] >> 4);
            acc = ds4lab_kquant_dot8<3>(acc, dl, ml, lo[u], hi[u], shift, xv, b0 + u, lane);
        }
    }
    return acc;
}
