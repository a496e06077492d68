// ds4lab_expert_dot: one lane's share of R weight rows . x for Q2_K blocks (84 bytes per 256
// values): 16 scale bytes (low nibble scale, high nibble min, per 16 values), 64 bytes of
// 2-bit codes, f16 d and dmin; w = d * scale * q - dmin * min. Blocks are 4-byte aligned:
// the lane reads its 8 code bytes as two 32-bit words.
#define DS4LAB_DOT_STAGE
#define DS4LAB_DOT_TABLES
template <int COLS, int R>
__device__ __forceinline__ void ds4lab_expert_dot(const uint8_t* const (&w)[R], const float* xv, int lane,
                                                  float (&acc)[R]) {
    const int first = lane * 8, half = first >> 7, within = first & 127;
    const int shift = 2 * (within >> 5), k0 = within & 31;
    constexpr int NB = COLS / 256, U = ds4lab_step<NB, R>::U;
    float part[R];
    #pragma unroll
    for (int r = 0; r < R; ++r) part[r] = 0.0f;
    for (int b0 = 0; b0 < NB; b0 += U) {
        uint32_t dd[U][R], sc[U][R], lo[U][R], hi[U][R];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            #pragma unroll
            for (int r = 0; r < R; ++r) {
                const uint8_t* blk = w[r] + (b0 + u) * 84;
                const uint32_t* q = reinterpret_cast<const uint32_t*>(blk + 16 + 32 * half + k0);
                dd[u][r] = *reinterpret_cast<const uint32_t*>(blk + 80);
                sc[u][r] = blk[lane >> 1];
                lo[u][r] = q[0];
                hi[u][r] = q[1];
            }
        }
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            float xs[8];
            ds4lab_lane_inputs(xv, b0 + u, lane, xs);
            const float xsum = ds4lab_sum8(xs);
            #pragma unroll
            for (int r = 0; r < R; ++r) {
                const float dl = ds4lab_f16_bits(dd[u][r]) * (float)(sc[u][r] & 15);
                const float ml = ds4lab_f16_bits(dd[u][r] >> 16) * (float)(sc[u][r] >> 4);
                part[r] = ds4lab_kquant_dot8<3>(part[r], dl, ml, lo[u][r], hi[u][r], shift, xs, xsum);
            }
        }
    }
    #pragma unroll
    for (int r = 0; r < R; ++r) acc[r] += part[r];
}
