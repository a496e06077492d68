// The shared expert's Q8_0 dots on a float row (q8_rows.cuh's loop; on the byte planes,
// q8_rows_planes.cuh's).
template <int NR, int COLS>
__device__ __forceinline__ void ds4lab_q8_dots(const uint4* const* w, const float* const* s, const float* x, int lane,
                                               float* acc) {
    ds4lab_q8_dots<NR, COLS>(w, s, reinterpret_cast<const float4*>(x), lane, acc);
}

// One thread block's share of the routed experts' gate, up and SwiGLU (expert_swiglu.cu says
// what the launch makes; routed_swiglu.cu makes it too, after routing): the block of output
// rows bx of grid row p, which is a pair p < n_pairs (its expert `id`, its route weight `wp`)
// or, with SHARED_ROWS, token p - n_pairs's shared expert. xp: that token's input as the
// launch's dots read it, a row of floats [COLS] or its byte planes (expert_planes.cuh).
// `tables`: DS4LAB_DOT_TABLES (or DS4LAB_PLANES_TABLES).
template <int ROWS, int COLS, int ROW_BYTES, int EXPERT_BYTES, int X_DIV, int SHARED_ROWS, int P, typename Input,
          typename... Tables>
__device__ __forceinline__ void ds4lab_swiglu_rows(int bx, int p, int n_pairs, int id, float wp,
                                                   const uint8_t* raw_gate, const uint8_t* raw_up, Input xp, float clamp,
                                                   const uint32_t* codes_g, const float* scales_g,
                                                   const uint32_t* codes_u, const float* scales_u, float* mid,
                                                   float* shared, Tables... tables) {
    const int lane = threadIdx.x & 31;
    const int row0 = ((bx * blockDim.x + threadIdx.x) >> 5) * P;
    if (SHARED_ROWS > 0 && p >= n_pairs) {
        const int t = p - n_pairs;
        if (row0 >= SHARED_ROWS) return;
        const uint4* w2[2 * P];
        const float* s2[2 * P];
#pragma unroll
        for (int i = 0; i < P; ++i) {
            const int row = row0 + i < SHARED_ROWS ? row0 + i : SHARED_ROWS - 1;
            ds4lab_q8_row<COLS>(codes_g, scales_g, row, w2[2 * i], s2[2 * i]);
            ds4lab_q8_row<COLS>(codes_u, scales_u, row, w2[2 * i + 1], s2[2 * i + 1]);
        }
        float acc[2 * P];
        ds4lab_q8_dots<2 * P, COLS>(w2, s2, xp, lane, acc);
        ds4lab_q8_totals<2 * P, 1>(acc, 0, lane);
#pragma unroll
        for (int i = 0; i < P; ++i) {
            if (lane == 0 && row0 + i < SHARED_ROWS)
                shared[(size_t)t * SHARED_ROWS + row0 + i] = ds4lab_swiglu(acc[2 * i], acc[2 * i + 1], clamp);
        }
        return;
    }
    if (row0 >= ROWS) return;
    const uint8_t* rows[2 * P];
#pragma unroll
    for (int i = 0; i < P; ++i) {
        const int row = row0 + i < ROWS ? row0 + i : ROWS - 1;
        const size_t at = (size_t)id * EXPERT_BYTES + (size_t)row * ROW_BYTES;
        rows[2 * i] = raw_gate + at;
        rows[2 * i + 1] = raw_up + at;
    }
    float gu[2 * P] = {};
    ds4lab_expert_dot<COLS, 2 * P>(rows, xp, lane, gu, tables...);
#pragma unroll
    for (int i = 0; i < P; ++i) {
        const float g = ds4lab_warp_sum(gu[2 * i]);
        const float u = ds4lab_warp_sum(gu[2 * i + 1]);
        if (lane == 0 && row0 + i < ROWS) mid[(size_t)p * ROWS + row0 + i] = ds4lab_swiglu(g, u, clamp) * wp;
    }
}
