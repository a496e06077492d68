// A compressor's decode step that completes no window (model/compressor.py `_decode_step`):
// the token's kv and score rows written into its frontier slot. The new frontier is the old
// one with row `at[0]` replaced: kv_out[at] = W_kv · x, score_out[at] = W_gate · x + ape[at[1]]
// (the APE row of the token's window slot). Every other row is copied unchanged, except with
// SHIFT (a ratio-4 compressor's step that completes its window, whose frontier holds two
// windows): rows 0..RATIO-1 then take the window just completed, rows RATIO..2·RATIO-1 with
// the token's row in its place (row 2·RATIO-1), so the last output row of that half is the token.
//
// The work is cut into `blocks` thread blocks of equal size (`block`: this one's place):
// compressor_slot.cu launches them alone, q8_pair.cu after its pair's blocks (SLOT).
// One warp per output column c of one of the two matrices (warp w: matrix w / R, column
// w % R, R = the frontier's width): the lanes read the matrix row c (contiguous, COLS values)
// four values a load, sixteen loads in flight, a lane every 32nd quad, summed in its column
// order, then a warp sum. The frontier's other rows are copied by every thread of the grid,
// consecutive threads consecutive float4s, each thread's first one loaded before the product
// and stored after it (ratio 128: one float4 a thread); each warp writes its value into the
// row(s) the token's row lands in. One load at a time a lane, and a warp copying its own
// column (one value per 32-byte sector), this read 0.3-0.8 TB/s (ncu, 25-31 µs a launch).
// Replaces two float32 GEMVs, a gather and two selects.
// The slot comes in as data (`at`), so one compiled kernel serves every position.
// A ratio-4 layer's two compressors (the attention's and the indexer's: the same ratio,
// slot and shift, other widths) take one launch: the second's warps follow the first's.
// Arguments: x [COLS] float32 (COLS a multiple of 4), w_kv / w_gate [R, COLS] (float32, or F16
// widened as loaded: all four matrices alike), ape [RATIO, R], kv / score [ROWS, R] (R and R2
// multiples of 4), then the second compressor's (R2, ROWS2; R2 = 0: none, and its outputs are
// not written), at [4] int32 (frontier row, APE row, then zeros); then the outputs kv_out, score_out, the
// second's. 32 threads per warp, 2·R + 2·R2 warps over the blocks.
template <int R, int COLS, int ROWS, int R2, int ROWS2, int RATIO, bool SHIFT, typename W>
__device__ void ds4lab_compressor_slot(int block, int blocks, const float* x, const W* w_kv, const W* w_gate,
                                       const float* ape, const float* kv, const float* score, const W* w_kv2,
                                       const W* w_gate2, const float* ape2, const float* kv2,
                                       const float* score2, const int* at, float* kv_out, float* score_out,
                                       float* kv_out2, float* score_out2) {
    const int lane = threadIdx.x & 31;
    // The copy's float4s: the first compressor's kv, score, then the second's, as one flat range.
    constexpr size_t Q1 = (size_t)ROWS * R / 4, Q2 = (size_t)ROWS2 * R2 / 4, QT = 2 * (Q1 + Q2);
    const size_t id = (size_t)block * blockDim.x + threadIdx.x, threads = (size_t)blocks * blockDim.x;
    // Output row i of a frontier holds input row source_row(i); compressor `in2`'s kv or score.
    auto source_row = [](int i) { return SHIFT && i < RATIO ? i + RATIO : i; };
    auto frontier_in = [&](bool in2, bool is_score) { return in2 ? (is_score ? score2 : kv2) : (is_score ? score : kv); };
    auto frontier_out = [&](bool in2, bool is_score) {
        return in2 ? (is_score ? score_out2 : kv_out2) : (is_score ? score_out : kv_out);
    };
    auto copy_at = [&](size_t g, const float4*& src, float4*& dst) {   // the input row g is copied from
        const bool in2 = g >= 2 * Q1;
        const size_t local = in2 ? g - 2 * Q1 : g, n = in2 ? Q2 : Q1;
        const bool is_score = local >= n;
        const size_t k = is_score ? local - n : local;
        const int quads = (in2 ? R2 : R) / 4;
        const int i = (int)(k / quads), c = (int)(k % quads);
        const int from = source_row(i);
        src = reinterpret_cast<const float4*>(frontier_in(in2, is_score)) + (size_t)from * quads + c;
        dst = reinterpret_cast<float4*>(frontier_out(in2, is_score)) + k;
        return from;
    };
    // The frontier and APE rows are first used after the product, so nothing before it waits
    // for `at` (the held float4 is loaded whatever its row). `at` is 16 bytes (`slot_at`): at
    // 8 MLX kept it in host memory (its scalar pool), and every warp's read was a trip over
    // the bus (~18 µs a launch of 1056 blocks, `bench/small_inputs.py` on an H100).
    const float4* held_src = nullptr;
    float4* held_dst = nullptr;
    const int held_from = id < QT ? copy_at(id, held_src, held_dst) : -1;
    const float4 held = held_from >= 0 ? *held_src : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    const int row = at[0], ape_row = at[1];                     // first used after the product
    int warp = block * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const bool second = warp >= 2 * R;
    if (second) warp -= 2 * R;
    const int r = second ? R2 : R, rows = second ? ROWS2 : ROWS;
    if (warp < 2 * r) {
        const bool is_score = warp >= r;
        const int c = is_score ? warp - r : warp;
        const auto* w = (second ? (is_score ? w_gate2 : w_kv2) : (is_score ? w_gate : w_kv)) + (size_t)c * COLS;
        const float4* xq = reinterpret_cast<const float4*>(x);
        constexpr int QUADS = COLS / 4, PER_LANE = (QUADS + 31) / 32, BATCH = 16;
        float acc = 0.0f;
    #pragma unroll 1
        for (int k0 = 0; k0 < PER_LANE; k0 += BATCH) {
            float4 wv[BATCH];
    #pragma unroll
            for (int k = 0; k < BATCH; ++k) {
                const int q = lane + 32 * (k0 + k);
                wv[k] = k0 + k < PER_LANE && q < QUADS ? ds4lab_load4(w, q) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            }
    #pragma unroll
            for (int k = 0; k < BATCH; ++k) {
                const int q = lane + 32 * (k0 + k);
                if (k0 + k < PER_LANE && q < QUADS) {
                    const float4 xv = xq[q];
                    acc = fmaf(wv[k].x, xv.x, acc);
                    acc = fmaf(wv[k].y, xv.y, acc);
                    acc = fmaf(wv[k].z, xv.z, acc);
                    acc = fmaf(wv[k].w, xv.w, acc);
                }
            }
        }
    #pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, offset);
        const float value = is_score ? acc + (second ? ape2 : ape)[(size_t)ape_row * r + c] : acc;
        float* dst = frontier_out(second, is_score);
        for (int i = lane; i < rows; i += 32) {
            if (source_row(i) == row) dst[(size_t)i * r + c] = value;
        }
    }
    if (held_from >= 0 && held_from != row) *held_dst = held;
    for (size_t g = id + threads; g < QT; g += threads) {          // frontiers of more rows than threads
        const float4* src;
        float4* dst;
        if (copy_at(g, src, dst) != row) *dst = *src;
    }
}
