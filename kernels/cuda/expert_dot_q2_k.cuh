// ds4lab_expert_dot: one lane's share of R weight rows . x for Q2_K blocks (84 bytes per 256
// values): 16 scale bytes (low nibble scale, high nibble min, per 16 values), 64 bytes of
// 2-bit codes, f16 d and dmin; w = d * scale * q - dmin * min. Blocks are 4-byte aligned.
// A warp walks a row two blocks at a time: lanes 0-15 the first, 16-31 the second, each lane
// the 16 values of one scale byte (16 code bytes at one shift: four 32-bit words), so that
// d, dmin and the scale are loaded and decoded once per 16 values, not per 8. A code is a
// subnormal float (expert_matvec_common.cuh): one byte permute and an FMA a value.
#define DS4LAB_DOT_STAGE
#define DS4LAB_DOT_TABLES
template <int COLS, int R>
__device__ __forceinline__ void ds4lab_expert_dot(const uint8_t* const (&w)[R], const float* xv, int lane,
                                                  float (&acc)[R]) {
    const int second = lane >> 4, group = lane & 15;                  // group: the 16 values of scale byte `group`
    const int first = 16 * group, half = first >> 7, within = first & 127;
    const int shift = 2 * (within >> 5), k0 = within & 31;
    constexpr int NB = COLS / 256, NP = (NB + 1) / 2, U = ds4lab_step<NP, R>::U;
    float part[R];
    #pragma unroll
    for (int r = 0; r < R; ++r) part[r] = 0.0f;
    for (int p0 = 0; p0 < NP; p0 += U) {
        uint32_t dd[U][R], sc[U][R], q[U][R][4];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int b = 2 * (p0 + u) + second;
            #pragma unroll
            for (int r = 0; r < R; ++r) {
                dd[u][r] = sc[u][r] = 0u;
                #pragma unroll
                for (int i = 0; i < 4; ++i) q[u][r][i] = 0u;
                if (NB % 2 == 0 || b < NB) {
                    const uint8_t* blk = w[r] + b * 84;
                    const uint32_t* codes = reinterpret_cast<const uint32_t*>(blk + 16 + 32 * half + k0);
                    dd[u][r] = *reinterpret_cast<const uint32_t*>(blk + 80);
                    sc[u][r] = blk[group];
                    #pragma unroll
                    for (int i = 0; i < 4; ++i) q[u][r][i] = codes[i];
                }
            }
        }
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int b = 2 * (p0 + u) + second;
            if (NB % 2 != 0 && b >= NB) continue;                       // an odd count's last pair: no second block
            float xs[16];
            const float* xb = xv + b * 256 + first;
            ds4lab_load8(xb, xs);
            ds4lab_load8(xb + 8, xs + 8);
            ds4lab_scale_inputs(xs);                                       // codes as subnormals
            const float xsum = ds4lab_sum8(xs) + ds4lab_sum8(xs + 8);
            #pragma unroll
            for (int r = 0; r < R; ++r) {
                float dl, ml;
                ds4lab_kquant_scales(dd[u][r], sc[u][r] & 15, sc[u][r] >> 4, dl, ml);
                float qx = 0.0f;
                #pragma unroll
                for (int i = 0; i < 4; ++i) qx = ds4lab_codes4_dot(qx, (q[u][r][i] >> shift) & 0x03030303u, xs + 4 * i);
                part[r] = fmaf(dl, qx, fmaf(-ml, xsum, part[r]));
            }
        }
    }
    #pragma unroll
    for (int r = 0; r < R; ++r) acc[r] += part[r];
}
