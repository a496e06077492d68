// A decode (token, head)'s attention over the keys [lo, hi) it may see, by one thread block
// of WARPS warps (decode_attention.cu over all of them; attention_shares.cu over a share,
// its last block adding the shares): sink-free online softmax, K = V.
//   q [T, H, D]; keys [n_keys[0], D]: the raw window rows, then (KVROW) the token's own row,
//   then comp: the compressed rows (separate arrays: no copy of the cache into one); mask
//   [T, n_keys[1]] over them all (n_keys[2]: see ds4lab_token_row); rope_cos/rope_sin
//   [T, NROT/2] of the query positions.
// QFINISH: q is the q_b product, not yet the head: the block first RMS-norms it (weightless,
// eps[0]) and applies the RoPE of the token's position, with row_finish's float steps (its
// NORM and ROPE = 1; the norm's sum over this block's threads), so the heads' finish costs
// no launch of its own.
// Each warp runs an online softmax over every WARPS-th key (a lane holds D/32 dims); the
// warps' partial sums are then combined. Masked keys are skipped, so only the selected
// compressed rows are read. A warp takes its keys BATCH at a time: the batch's key rows are
// all in flight together (its mask bytes were loaded with the batch before), and one
// softmax rescale covers the batch (one key at a time, every key waits for two dependent
// loads and a shuffle reduction before the next key's loads start).
// Result: m (the largest scaled score, -INFINITY when no key is visible), l (the sum of
// exp(score - m)) and acc[D] (the sum of exp(score - m) * key, shared memory) for every
// thread; the call synchronises the block.
// `row` (or nullptr): the decode token's own KV row, finished by the kernel
// (ds4lab_token_row), the key after keys' n_keys[0] rows and before comp's.
template <int D, int NROT, int WARPS, bool QFINISH>
__device__ void ds4lab_attend_keys(const float* q, const float* keys, const float* row, const float* comp,
                                   const bool* mask, const int* n_keys, const float* eps, const float* rope_cos,
                                   const float* rope_sin, int lo, int hi, float& m_out, float& l_out,
                                   float* acc_out) {
    constexpr int PER = D / 32, BATCH = 4;
    const int h = blockIdx.x, t = blockIdx.y, n_head = gridDim.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n_raw = n_keys[0], nk = n_keys[1], comp_from = n_raw + (row != nullptr ? 1 : 0);
    const float scale = 1.0f / sqrtf((float)D);
    const float* qh = q + ((size_t)t * n_head + h) * D;
    const bool* visible = mask + (size_t)t * nk;
    // Each batch's mask bytes are loaded a batch ahead (the first before the query's finish),
    // so that a batch waits on one round trip, its key rows, not on two in turn.
    bool vis_next[BATCH];
    #pragma unroll
    for (int b = 0; b < BATCH; ++b) {
        const int n = lo + warp + b * WARPS;
        vis_next[b] = n < hi && visible[n];
    }
    __shared__ float q_finished[QFINISH ? D : 1];
    if (QFINISH) {
        __shared__ float scratch[32];
        const float inv = ds4lab_rms_inverse(qh, D, eps[0], scratch);
        for (int i = threadIdx.x; i < D; i += blockDim.x) q_finished[i] = __fmul_rn(qh[i], inv);
        __syncthreads();
        ds4lab_rope_tail(q_finished, D, NROT, t, rope_cos, rope_sin, false);
        __syncthreads();
    }
    const float* qr = QFINISH ? q_finished : qh;
    float qv[PER], acc[PER];
    for (int k = 0; k < PER; ++k) { qv[k] = qr[lane + 32 * k]; acc[k] = 0.0f; }
    float m = -INFINITY, l = 0.0f;
    for (int n0 = lo + warp; n0 < hi; n0 += WARPS * BATCH) {
        bool vis[BATCH];
        float kv[BATCH][PER], dot[BATCH];
        #pragma unroll
        for (int b = 0; b < BATCH; ++b) {
            const int n = n0 + WARPS * BATCH + b * WARPS;
            vis[b] = vis_next[b];
            vis_next[b] = n < hi && visible[n];
        }
        #pragma unroll
        for (int b = 0; b < BATCH; ++b) {
            const int n = n0 + b * WARPS;
            const float* kr = n < n_raw ? keys + (size_t)n * D
                                        : (n < comp_from ? row : comp + (size_t)(n - comp_from) * D);
            #pragma unroll
            for (int k = 0; k < PER; ++k) kv[b][k] = vis[b] ? kr[lane + 32 * k] : 0.0f;
        }
        #pragma unroll
        for (int b = 0; b < BATCH; ++b) {
            dot[b] = 0.0f;
            #pragma unroll
            for (int k = 0; k < PER; ++k) dot[b] += qv[k] * kv[b][k];
        }
        #pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) {
            #pragma unroll
            for (int b = 0; b < BATCH; ++b) dot[b] += __shfl_xor_sync(0xffffffffu, dot[b], offset);
        }
        float m_new = m;
        #pragma unroll
        for (int b = 0; b < BATCH; ++b) {
            dot[b] *= scale;
            if (vis[b]) m_new = fmaxf(m_new, dot[b]);
        }
        if (m_new == -INFINITY) continue;   // nothing visible yet (the same in every lane)
        const float corr = expf(m - m_new);
        l *= corr;
        #pragma unroll
        for (int k = 0; k < PER; ++k) acc[k] *= corr;
        #pragma unroll
        for (int b = 0; b < BATCH; ++b) {
            if (!vis[b]) continue;
            const float p = expf(dot[b] - m_new);
            l += p;
            #pragma unroll
            for (int k = 0; k < PER; ++k) acc[k] += p * kv[b][k];
        }
        m = m_new;
    }
    __shared__ float part_m[WARPS], part_l[WARPS], part_w[WARPS];
    __shared__ float part_acc[WARPS * D];
    if (lane == 0) { part_m[warp] = m; part_l[warp] = l; }
    for (int k = 0; k < PER; ++k) part_acc[warp * D + lane + 32 * k] = acc[k];
    __syncthreads();
    float top = -INFINITY;
    for (int w = 0; w < WARPS; ++w) top = fmaxf(top, part_m[w]);
    // each warp's weight exp(m_w - top) once (0 for a warp that saw no visible key)
    if ((int)threadIdx.x < WARPS) {
        const float mw = part_m[threadIdx.x];
        part_w[threadIdx.x] = mw == -INFINITY ? 0.0f : expf(mw - top);
    }
    __syncthreads();
    float total = 0.0f;
    for (int w = 0; w < WARPS; ++w) total += part_m[w] == -INFINITY ? 0.0f : part_l[w] * part_w[w];
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float o = 0.0f;
        for (int w = 0; w < WARPS; ++w)
            if (part_m[w] != -INFINITY) o += part_acc[w * D + d] * part_w[w];
        acc_out[d] = o;
    }
    m_out = top;
    l_out = total;
    __syncthreads();
}

// The weight of each of S shares of a head's keys in its sink softmax, from each share's m
// (largest scaled score, -INFINITY when none of its keys was visible) and l (sum of
// exp(score - m)): w[z] = exp(m[z] - top) / (exp(sink - top) + sum over z of l[z] * exp(m[z] - top)),
// top the largest of the sink and the m. decode_attention.cu's one share and
// attention_shares.cu's several take their output as sum over z of w[z] * acc[z].
template <int S>
__device__ __forceinline__ void ds4lab_share_weights(float sink, const float* m, const float* l, float* w) {
    float top = sink;
    for (int z = 0; z < S; ++z) top = fmaxf(top, m[z]);
    float denom = expf(sink - top);
    for (int z = 0; z < S; ++z) {
        w[z] = m[z] == -INFINITY ? 0.0f : expf(m[z] - top);
        denom += l[z] * w[z];
    }
    for (int z = 0; z < S; ++z) w[z] /= denom;
}

// A decode token's KV row finished in the attention launch (KVROW; one token): every block
// finishes it into `row` (shared memory, ds4lab_kv_row with eps[1]) to attend it as a key,
// and the blocks share writing keys_out = the kept window's n_keys[0] rows (`keys`), then the
// row, less the first n_keys[2] (those the window drops): the raw rows the layer's cache keeps
// (model/state.py `keep_window`), with no launch nor slice of their own. Synchronises the block.
template <int D, int NROT>
__device__ void ds4lab_token_row(const float* kv, const float* kv_weight, const float* eps, const float* rope_cos,
                                 const float* rope_sin, const int* carry, const float* keys, const int* n_keys,
                                 float* row, float* keys_out) {
    __shared__ float scratch[32];
    ds4lab_kv_row(kv, kv_weight, eps[1], 0, rope_cos, rope_sin, carry, row, D, NROT, scratch);
    const int blocks = gridDim.x * gridDim.y * gridDim.z;
    const int b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    const int skip = n_keys[2];
    for (int r = skip + b; r <= n_keys[0]; r += blocks) {
        const float* src = r < n_keys[0] ? keys + (size_t)r * D : row;
        for (int i = threadIdx.x; i < D; i += blockDim.x) keys_out[(size_t)(r - skip) * D + i] = src[i];
    }
}
