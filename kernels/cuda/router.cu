// The router of each token in its own launch (router.cuh has the routing): one thread an
// expert (E at most the block size).
// Without PRODUCT x holds the logits [T, E] (a prefill chunk's, from a GEMM): one thread
// block a token (grid x). With PRODUCT (a decode step) the logits are made here: x is the
// FFN input [T, N], w the router matrix [E, N], and grid x's blocks each take a warp's row
// of w; each writes its logits into probs, and the last block of the token to finish
// (ds4lab_last_block, on counter[t]) reads them back and routes. Those layers' routing was
// five MLX operations and their launches. Templates: E, K, N, HAS_BIAS, PRODUCT, HASH.
// (ds4lab_router_token, router.cuh, is the body; router_planes.cu runs it too.)
ds4lab_router_token<E, K, N, HAS_BIAS, PRODUCT, HASH>(x, w, bias, scale, counter, table, tokens, probs, experts,
                                                     weights);
