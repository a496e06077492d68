// ds4lab_expert_dot: one lane's share of R weight rows . x for Q4_K blocks (144 bytes per 256
// values): f16 d and dmin, 12 bytes of 6-bit (scale, min) pairs for 8 groups of 32, 128 bytes
// of nibbles (low nibbles first, per 64 values); w = d * scale * q - dmin * min. Group g < 4
// keeps its scale and min in the low 6 bits of bytes g and g + 4; group g >= 4 keeps their
// low 4 bits in byte g + 4 and their high 2 bits in the top bits of bytes g - 4 and g.
// Blocks are 16-byte aligned: the lane reads 32-bit words. A code is a subnormal float
// (expert_matvec_common.cuh): a value costs a byte permute and an FMA.
#define DS4LAB_DOT_STAGE
#define DS4LAB_DOT_TABLES
template <int COLS, int R>
__device__ __forceinline__ void ds4lab_expert_dot(const uint8_t* const (&w)[R], const float* xv, int lane,
                                                  float (&acc)[R]) {
    const int first = lane * 8, group = first >> 5, chunk = first >> 6;
    const int shift = 4 * ((first >> 5) & 1), k0 = first & 31;
    const int at_p = group < 4 ? group : group + 4, at_q = group < 4 ? group + 4 : group - 4;
    constexpr int NB = COLS / 256, U = ds4lab_step<NB, R>::U;
    float part[R];
    #pragma unroll
    for (int r = 0; r < R; ++r) part[r] = 0.0f;
    for (int b0 = 0; b0 < NB; b0 += U) {
        uint32_t dd[U][R], sp[U][R], sq[U][R], sr[U][R], lo[U][R], hi[U][R];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            #pragma unroll
            for (int r = 0; r < R; ++r) {
                const uint8_t* blk = w[r] + (b0 + u) * 144;
                const uint32_t* q = reinterpret_cast<const uint32_t*>(blk + 16 + 32 * chunk + k0);
                dd[u][r] = *reinterpret_cast<const uint32_t*>(blk);
                sp[u][r] = blk[4 + at_p];
                sq[u][r] = blk[4 + at_q];
                sr[u][r] = blk[4 + group];
                lo[u][r] = q[0];
                hi[u][r] = q[1];
            }
        }
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            float xs[8];
            ds4lab_lane_inputs(xv, b0 + u, lane, xs);
            ds4lab_scale_inputs(xs);                                       // codes as subnormals
            const float xsum = ds4lab_sum8(xs);
            #pragma unroll
            for (int r = 0; r < R; ++r) {
                const uint32_t sc = group < 4 ? sp[u][r] & 63 : (sp[u][r] & 15) | ((sq[u][r] >> 6) << 4);
                const uint32_t mn = group < 4 ? sq[u][r] & 63 : (sp[u][r] >> 4) | ((sr[u][r] >> 6) << 4);
                float dl, ml;
                ds4lab_kquant_scales(dd[u][r], sc, mn, dl, ml);
                part[r] = ds4lab_kquant_dot8<15>(part[r], dl, ml, lo[u][r], hi[u][r], shift, xs, xsum);
            }
        }
    }
    #pragma unroll
    for (int r = 0; r < R; ++r) acc[r] += part[r];
}
