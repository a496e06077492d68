// The router of a token (model/moe.py `router_probs`, `select_experts`, `route_weights` for
// biased top-k layers), one thread an expert:
//   probs   = sqrt(softplus(logit)), softplus as the reference writes it (exp below -20,
//             identity above 20);
//   experts = the K best of probs + bias (the bias only selects), best first, ties to the
//             lower expert id;
//   weights = the chosen probs / max(their sum, 2^-14) * scale[0].
// With HASH (the first n_hash_layer layers) the experts are instead the token's row of the
// hash table (`select_experts`: table [vocab, K] int32, tokens [T] int32), in its order; probs
// and weights as above. Those layers' routing was five MLX operations and their launches.
// Without PRODUCT x holds the logits [T, E] (a prefill chunk's, from a GEMM): one thread
// block a token (grid x). With PRODUCT (a decode step) the logits are made here: x is the
// FFN input [T, N], w the router matrix [E, N], and grid x's blocks each take a warp's row
// of w; each writes its logits into probs, and the last block of the token to finish
// (ds4lab_last_block, on counter[t]) reads them back and routes. Templates: E (experts, at
// most the block size), K, N, HAS_BIAS, PRODUCT, HASH.
const int t = PRODUCT ? blockIdx.y : blockIdx.x, e = threadIdx.x;
const int lane = e & 31, warp = e >> 5, n_warps = blockDim.x >> 5;
__shared__ float best_v[32];
__shared__ int best_i[32];
__shared__ int chosen[K];
// What the routing reads besides the logits, loaded before the logits' launch-wide wait (read
// after it, each was one more round trip of the last block's, from DRAM).
const float expert_bias = HAS_BIAS && e < E ? bias[e] : 0.0f;
const int hashed = HASH && e < K ? table[(size_t)tokens[t] * K + e] : 0;
if (PRODUCT) {
    const int r = blockIdx.x * n_warps + warp;
    if (r < E) {
        const auto* wr = w + (size_t)r * N;                 // float32, or F16 widened as loaded
        const float* xt = x + (size_t)t * N;
        // The row read as float4 (N: a multiple of 4), 8 a lane made into an array first:
        // written as an unrolled scalar sum the compiler kept the kernel to 30 registers, a few
        // 4-byte loads in flight, and a 4096-wide row took 16 DRAM round trips in turn.
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
        s = ds4lab_warp_sum_all(s);
        if (lane == 0) probs[(size_t)t * E + r] = s;
    }
    if (!ds4lab_last_block(const_cast<int*>(counter) + t, gridDim.x)) return;
}
float p = 0.0f, sel = -INFINITY;
if (e < E) {
    const float l = PRODUCT ? __ldcg(probs + (size_t)t * E + e) : x[(size_t)t * E + e];
    const float sp = l > 20.0f ? l : (l < -20.0f ? expf(l) : log1pf(expf(l)));
    p = sqrtf(sp);
    probs[(size_t)t * E + e] = p;
    sel = HAS_BIAS ? p + expert_bias : p;
}
if (HASH) {
    if (e < K) chosen[e] = hashed;
    __syncthreads();
}
for (int k = 0; k < (HASH ? 0 : K); ++k) {
    float v = sel;
    int i = e;
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float v2 = __shfl_xor_sync(0xffffffffu, v, offset);
        const int i2 = __shfl_xor_sync(0xffffffffu, i, offset);
        if (v2 > v || (v2 == v && i2 < i)) { v = v2; i = i2; }
    }
    if (lane == 0) { best_v[warp] = v; best_i[warp] = i; }
    __syncthreads();
    if (e == 0) {
        float bv = best_v[0];
        int bi = best_i[0];
        for (int w = 1; w < n_warps; ++w)
            if (best_v[w] > bv || (best_v[w] == bv && best_i[w] < bi)) { bv = best_v[w]; bi = best_i[w]; }
        chosen[k] = bi;
    }
    __syncthreads();
    if (e == chosen[k]) sel = -INFINITY;
}
if (e == 0) {
    float sum = 0.0f;
    for (int k = 0; k < K; ++k) sum += probs[(size_t)t * E + chosen[k]];
    const float denom = fmaxf(sum, 6.103515625e-05f);
    for (int k = 0; k < K; ++k) {
        experts[t * K + k] = chosen[k];
        weights[t * K + k] = probs[(size_t)t * E + chosen[k]] / denom * scale[0];
    }
}
