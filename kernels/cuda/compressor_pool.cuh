// The row one compressor emits, pooled and (FINISH_) finished, by the whole thread block into
// out, through `row` (shared memory, WIDTH_ floats): compressor_pool.cu's work for one block.
template <int R_, int WIDTH_, int RATIO_, bool OVERLAP_, bool FINISH_, int NROT_, bool QAT_, bool FP8_>
__device__ void ds4lab_emitted_row(const float* old_kv, const float* old_score, const float* new_kv,
                                   const float* new_score, const float* norm, float eps, const float* rope_cos,
                                   const float* rope_sin, int pos, float hscale, const int* carry, float* row,
                                   float* out) {
    constexpr int N = OVERLAP_ ? 2 * RATIO_ : RATIO_;
    for (int d = threadIdx.x; d < WIDTH_; d += blockDim.x) {
        // Candidate i: row i % RATIO; from the old frontier (dim d) for the first RATIO with
        // OVERLAP, else from the new one (dim d, or WIDTH + d with OVERLAP).
        auto is_old = [&](int i) { return OVERLAP_ && i < RATIO_; };
        auto at = [&](int i) { return (size_t)(i % RATIO_) * R_ + d + (OVERLAP_ && !is_old(i) ? WIDTH_ : 0); };
        auto score = [&](int i) { return is_old(i) ? old_score[at(i)] : new_score[at(i)]; };
        float top = score(0);
        for (int i = 1; i < N; ++i) top = fmaxf(top, score(i));
        float weights = 0.0f, acc = 0.0f;
        for (int i = 0; i < N; ++i) {
            const float w = expf(score(i) - top);
            weights += w;
            acc += w * (is_old(i) ? old_kv[at(i)] : new_kv[at(i)]);
        }
        row[d] = top <= -0.5e30f ? 0.0f : acc / weights;
    }
    __syncthreads();
    if (FINISH_) {
        __shared__ float scratch[32];
        const float inv = ds4lab_rms_inverse(row, WIDTH_, eps, scratch);
        for (int d = threadIdx.x; d < WIDTH_; d += blockDim.x) row[d] = __fmul_rn(__fmul_rn(row[d], inv), norm[d]);
        __syncthreads();
        ds4lab_rope_tail(row, WIDTH_, NROT_, pos, rope_cos, rope_sin, false);
        __syncthreads();
        if (QAT_) ds4lab_hadamard_fp4(row, WIDTH_, hscale, carry);
        if (FP8_) ds4lab_fp8_round(row, WIDTH_, NROT_, carry);
    }
    for (int d = threadIdx.x; d < WIDTH_; d += blockDim.x)
        out[d] = FINISH_ ? __half2float(__float2half_rn(row[d])) : row[d];
}
