// ds4lab_expert_dot for IQ2_XXS rows (expert_dot_iq2_xxs.cuh's loads, lanes and tables) on the
// input as byte planes (expert_planes.cuh): the integer form of expert_swiglu_planes.cu.
// A value's byte is its signed level: a selector nibble code | sign << 2 picks byte `code` of
// the levels word or of their negatives, so one permute makes four signed bytes once the
// signs sit at bit 2 of each nibble of the entry's codes word (ds4lab_iq2_sign4, a word per
// 7-bit sign index, staged by DS4LAB_PLANES_STAGE). Each 16 values of a row then take four
// dp4a a plane, in one int32 chain: p0's sum, times 256 plus p1's, times 256 plus p2's
// (|p0| <= 32: at most 16 * 43 * 32 * 65536 + 16 * 43 * 255 * 257 < 1.5 * 10^9), one
// conversion and the block's and the group's scales. Exact but for
// the input's rounding to its planes and the float sums after.
#define DS4LAB_IQ2_NEGATIVES 0x00d5e7f8u
__device__ __forceinline__ uint32_t ds4lab_iq2_sign_nibbles(uint32_t index7) {
    uint32_t words[2], nibbles = 0;
    ds4lab_iq2_sign_words(index7, words);
    for (int k = 0; k < 8; ++k) nibbles |= ((words[k >> 2] >> (8 * (k & 3) + 7)) & 1u) << (4 * k + 2);
    return nibbles;
}
#define DS4LAB_PLANES_STAGE                                                                      \
    __shared__ uint32_t ds4lab_iq2_sign4[128];                                                   \
    for (int i = threadIdx.x; i < 128; i += blockDim.x) ds4lab_iq2_sign4[i] = ds4lab_iq2_sign_nibbles(i); \
    __syncthreads();
#define DS4LAB_PLANES_TABLES , ds4lab_iq2_grid4, ds4lab_iq2_sign4

// The word at byte offset `offset` of a table of words.
__device__ __forceinline__ uint32_t ds4lab_word_at(const uint32_t* table, uint32_t offset) {
    return *reinterpret_cast<const uint32_t*>(reinterpret_cast<const uint8_t*>(table) + offset);
}

template <int COLS, int R>
__device__ __forceinline__ void ds4lab_expert_dot(const uint8_t* const (&w)[R], ds4lab_planes xin, int lane,
                                                  float (&acc)[R], const uint32_t* grid4, const uint32_t* sign4) {
    const int group = (lane >> 1) & 7, pair = lane & 1;
    ds4lab_iq2_walk<COLS, R>(w, lane, acc, [&](int b, const uint32_t (&d)[R], const uint32_t (&aux)[R],
                                               const uint32_t (&index)[R], float (&sums)[R]) {
        const int g = b * 8 + group;                              // the input's 32-value group
        const uint4* planes = reinterpret_cast<const uint4*>(xin.bytes + g * 96 + pair * 16);
        const uint4 p0 = planes[0], p1 = planes[2], p2 = planes[4];
        const float xscale = xin.scales[g];
        #pragma unroll
        for (int r = 0; r < R; ++r) {
            uint32_t v[4];
            const uint32_t aux4 = aux[r] << 2, index4 = index[r] << 2;   // table byte offsets: no shift a lookup
            #pragma unroll
            for (int j = 0; j < 2; ++j) {
                const uint32_t sel = ds4lab_word_at(grid4, (index4 >> (8 * j)) & 0x3fcu)
                                     | ds4lab_word_at(sign4, (aux4 >> (7 * (2 * pair + j))) & 0x1fcu);
                v[2 * j] = ds4lab_prmt(DS4LAB_IQ2_LEVELS, DS4LAB_IQ2_NEGATIVES, sel);
                v[2 * j + 1] = ds4lab_prmt(DS4LAB_IQ2_LEVELS, DS4LAB_IQ2_NEGATIVES, sel >> 16);
            }
            const int q0 = ds4lab_plane_dot_ss(v, p0, 0);
            const int q = ds4lab_plane_dot_su(v, p2, ds4lab_plane_dot_su(v, p1, q0 * 256) * 256);
            const float db = ds4lab_f16_bits(d[r]) * (0.5f + ds4lab_small_uint(aux[r] >> 28)) * 0.25f;
            sums[r] = fmaf(db * xscale, (float)q, sums[r]);
        }
    });
}
