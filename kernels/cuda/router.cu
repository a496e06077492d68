// The router of each token in its own launch (router.cuh has the routing): one thread an
// expert (E at most the block size).
// Without PRODUCT x holds the logits [T, E] (a prefill chunk's, from a GEMM): one thread
// block a token (grid x). With PRODUCT (a decode step) the logits are made here: x is the
// FFN input [T, N], w the router matrix [E, N], and grid x's blocks each take a warp's row
// of w; each writes its logits into probs, and the last block of the token to finish
// (ds4lab_last_block, on counter[t]) reads them back and routes. Those layers' routing was
// five MLX operations and their launches. Templates: E, K, N, HAS_BIAS, PRODUCT, HASH.
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
