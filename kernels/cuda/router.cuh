// A token's router (model/moe.py `router_probs`, `select_experts`, `route_weights` for biased
// top-k layers), shared by router.cu (its own launch) and routed_swiglu.cu (inside the routed
// experts' launch):
//   probs   = sqrt(softplus(logit)), softplus as the reference writes it (exp below -20,
//             identity above 20);
//   experts = the K best of probs + bias (the bias only selects), best first, ties to the
//             lower expert id;
//   weights = the chosen probs / max(their sum, 2^-14) * scale.
// On hash layers (HASH) the experts are instead the token's row of the hash table, in its order.
// A thread block routes one token, a thread taking experts e = threadIdx.x + j * blockDim.x for
// j < EPT (E <= EPT * blockDim.x): the choice is the same whatever the block size, since each
// step keeps the best value and, among equal ones, the lowest id.

// A router logit: row wr [N] (float32, or F16 widened as loaded) . xt [N], a warp's sum, every
// lane the total. The row is read as float4 (N a multiple of 4), 8 a lane made into an array
// first: as an unrolled scalar sum the compiler kept a few 4-byte loads in flight, and a
// 4096-wide row took 16 DRAM round trips in turn.
template <int N, typename W>
__device__ __forceinline__ float ds4lab_router_logit(const W* wr, const float* xt, int lane) {
    constexpr int BATCH = 8;
    const float4* xt4 = reinterpret_cast<const float4*>(xt);
    float s = 0.0f;
    for (int j0 = lane; j0 < N / 4; j0 += 32 * BATCH) {
        float4 wv[BATCH];
#pragma unroll
        for (int k = 0; k < BATCH; ++k) wv[k] = ds4lab_load4(wr, j0 + 32 * k < N / 4 ? j0 + 32 * k : 0);
#pragma unroll
        for (int k = 0; k < BATCH; ++k) {
            if (j0 + 32 * k < N / 4) s = ds4lab_dot4_add(s, wv[k], xt4[j0 + 32 * k]);
        }
    }
    return ds4lab_warp_sum_all(s);
}

// What the routing reads besides the logits, loaded before a launch-wide wait (read after it,
// each was one more round trip of the last block's, from DRAM): the bias of the thread's
// experts into b, and (returned) thread k < K's expert from token t's row of the hash table.
template <int E, int K, int EPT, bool HAS_BIAS, bool HASH>
__device__ __forceinline__ int ds4lab_route_reads(const float* bias, const int* table, const int* tokens, int t,
                                                  float (&b)[EPT]) {
#pragma unroll
    for (int j = 0; j < EPT; ++j) {
        const int e = threadIdx.x + j * blockDim.x;
        b[j] = HAS_BIAS && e < E ? bias[e] : 0.0f;
    }
    return HASH && threadIdx.x < K ? table[(size_t)tokens[t] * K + threadIdx.x] : 0;
}

// Routes one token from its logits [E] (read through L2: other blocks may have written them):
// probs [E] (may be the logits' own buffer) and, by thread 0, experts [K] and weights [K].
// b and hashed: `ds4lab_route_reads`. Every thread of the block must call it.
template <int E, int K, int EPT, bool HAS_BIAS, bool HASH>
__device__ void ds4lab_route(const float* logits, float* probs, const float (&b)[EPT], int hashed, float scale,
                             int* experts, float* weights) {
    __shared__ float best_v[32];
    __shared__ int best_i[32];
    __shared__ int chosen[K];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    float sel[EPT];
#pragma unroll
    for (int j = 0; j < EPT; ++j) {
        const int e = threadIdx.x + j * blockDim.x;
        sel[j] = -INFINITY;
        if (e < E) {
            const float l = __ldcg(logits + e);
            const float sp = l > 20.0f ? l : (l < -20.0f ? expf(l) : log1pf(expf(l)));
            const float p = sqrtf(sp);
            probs[e] = p;
            sel[j] = HAS_BIAS ? p + b[j] : p;
        }
    }
    if (HASH) {
        if (threadIdx.x < K) chosen[threadIdx.x] = hashed;
        __syncthreads();
    }
    for (int k = 0; k < (HASH ? 0 : K); ++k) {
        float v = sel[0];
        int i = threadIdx.x;
#pragma unroll
        for (int j = 1; j < EPT; ++j) {             // a thread's experts in id order: strict > keeps the lower
            if (sel[j] > v) { v = sel[j]; i = threadIdx.x + j * blockDim.x; }
        }
        for (int offset = 16; offset > 0; offset >>= 1) {
            const float v2 = __shfl_xor_sync(0xffffffffu, v, offset);
            const int i2 = __shfl_xor_sync(0xffffffffu, i, offset);
            if (v2 > v || (v2 == v && i2 < i)) { v = v2; i = i2; }
        }
        if (lane == 0) { best_v[warp] = v; best_i[warp] = i; }
        __syncthreads();
        if (threadIdx.x == 0) {
            float bv = best_v[0];
            int bi = best_i[0];
            for (int w = 1; w < n_warps; ++w)
                if (best_v[w] > bv || (best_v[w] == bv && best_i[w] < bi)) { bv = best_v[w]; bi = best_i[w]; }
            chosen[k] = bi;
        }
        __syncthreads();
#pragma unroll
        for (int j = 0; j < EPT; ++j) {
            if (threadIdx.x + j * (int)blockDim.x == chosen[k]) sel[j] = -INFINITY;
        }
    }
    if (threadIdx.x == 0) {
        float sum = 0.0f;
        for (int k = 0; k < K; ++k) sum += probs[chosen[k]];
        const float denom = fmaxf(sum, 6.103515625e-05f);
        for (int k = 0; k < K; ++k) {
            experts[k] = chosen[k];
            weights[k] = probs[chosen[k]] / denom * scale;
        }
    }
}

// router.cu's work for its thread block (router.cu says what it makes): token blockIdx.y with
// PRODUCT (grid x's blocks a warp a row of w, the last to finish routing), else blockIdx.x.
template <int E, int K, int N, bool HAS_BIAS, bool PRODUCT, bool HASH, typename W>
__device__ __forceinline__ void ds4lab_router_token(const float* x, const W* w, const float* bias, const float* scale,
                                                    const int* counter, const int* table, const int* tokens,
                                                    float* probs, int* experts, float* weights) {
    const int t = PRODUCT ? blockIdx.y : blockIdx.x;
    float b[1];
    const int hashed = ds4lab_route_reads<E, K, 1, HAS_BIAS, HASH>(bias, table, tokens, t, b);
    if (PRODUCT) {
        const int lane = threadIdx.x & 31, r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
        if (r < E) {
            const float s = ds4lab_router_logit<N>(w + (size_t)r * N, x + (size_t)t * N, lane);
            if (lane == 0) probs[(size_t)t * E + r] = s;
        }
        if (!ds4lab_last_block(const_cast<int*>(counter) + t, gridDim.x)) return;
    }
    ds4lab_route<E, K, 1, HAS_BIAS, HASH>((PRODUCT ? probs : x) + (size_t)t * E, probs + (size_t)t * E, b, hashed,
                                          scale[0], experts + t * K, weights + t * K);
}
