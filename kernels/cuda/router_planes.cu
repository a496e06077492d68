// router.cu's decode form (PRODUCT: the logits made here from the FFN input) that also writes
// that input as byte planes for the IQ2_XXS gate and up (expert_planes.cuh; output `planes`):
// the warps of a token's blocks take its 32-value groups in turn before the routing.
// Templates and inputs: router.cu's (PRODUCT always).
const int t = blockIdx.y, lane = threadIdx.x & 31, n_warps = gridDim.x * (blockDim.x >> 5);
ds4lab_make_token_planes<N>(x + (size_t)t * N, planes, gridDim.y, t, blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5),
                            n_warps, lane);
ds4lab_router_token<E, K, N, HAS_BIAS, true, HASH>(x, w, bias, scale, counter, table, tokens, probs, experts, weights);
