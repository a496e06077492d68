// A decode step's router and routed experts in one launch: router.cu's routing of each token,
// then expert_swiglu.cu's gate, up and SwiGLU of its pairs and its shared expert's (used when
// no hook reads or replaces the experts or their weights). One launch fewer a layer: each
// costs the host ~12-16 µs of encoding and ~13 of building on the H200 machines, the bound of
// a 43-layer step on their slower hosts.
// The pairs' rows need the router's choice, so thread blocks take their jobs in the order they
// arrive, not by block index: each takes a ticket (counter[0]); the first T * ROUTER_BLOCKS
// tickets make the tokens' router logits (a warp a row of rw, into logits) and the last of a
// token's blocks to finish (counter[2 + t]) routes it and raises its flag (counter[2 + T + t]);
// the next T * X_BLOCKS tickets make the shared expert's rows, which need no routing (they run
// while the router does); the rest make the pairs' rows, each block waiting for its token's
// flag first. A block waits only for tickets taken before its own, by blocks already running
// that wait for nothing, so no block can wait for one that is not running: no deadlock however
// few blocks fit on the device at once. The last block to leave (counter[1]) sets the flags
// back to zero for the next launch (the ticket and the router's counts reset themselves).
// Templates: expert_swiglu.cu's (X_DIV = K, the experts a token uses), E (experts), EPT
// (experts a thread routes: E <= EPT * block size), HAS_BIAS, HASH (router.cuh), ROUTER_BLOCKS
// (blocks of a token's logits: a warp a row), X_BLOCKS (blocks of a pair's, or a token's
// shared, output rows). Grid x: (T * (ROUTER_BLOCKS + X_BLOCKS * (X_DIV + (SHARED_ROWS > 0))))
// blocks; T, the tokens, follows from it.
// Inputs: raw_gate, raw_up, x [T, COLS], clamp, the shared expert's codes_g, scales_g, codes_u,
// scales_u (expert_swiglu.cu's), the router's rw [E, COLS] (float32 or F16), bias [E], scale [1],
// table and tokens (hash layers), counter (2 + 2T ints, zeroed), then scratch only this launch
// reads: logits [T, E] (the router's logits, then its probs) and route_w [T, X_DIV]; the
// format's tables. Outputs: mid [T, X_DIV, ROWS], shared [T, SHARED_ROWS], experts [T, X_DIV].
DS4LAB_DOT_STAGE
__shared__ int id_s;
__shared__ float w_s;
int* const count = const_cast<int*>(counter);
constexpr int PER_TOKEN = ROUTER_BLOCKS + X_BLOCKS * (X_DIV + (SHARED_ROWS > 0 ? 1 : 0));
const int n_tokens = gridDim.x / PER_TOKEN, n_pairs = n_tokens * X_DIV;
const int routers = n_tokens * ROUTER_BLOCKS, shared_jobs = SHARED_ROWS > 0 ? n_tokens * X_BLOCKS : 0;
const int job = ds4lab_ticket(count);
if (job < routers) {
    const int t = job / ROUTER_BLOCKS, lane = threadIdx.x & 31;
    const int r = (job % ROUTER_BLOCKS) * (blockDim.x >> 5) + (threadIdx.x >> 5);
    float b[EPT];
    const int hashed = ds4lab_route_reads<E, X_DIV, EPT, HAS_BIAS, HASH>(bias, table, tokens, t, b);
    float* const token_logits = const_cast<float*>(logits) + (size_t)t * E;
    if (r < E) {
        const float s = ds4lab_router_logit<COLS>(rw + (size_t)r * COLS, x + (size_t)t * COLS, lane);
        if (lane == 0) token_logits[r] = s;
    }
    if (ds4lab_last_block(count + 2 + t, ROUTER_BLOCKS)) {
        ds4lab_route<E, X_DIV, EPT, HAS_BIAS, HASH>(token_logits, token_logits, b, hashed, scale[0],
                                                     experts + t * X_DIV, const_cast<float*>(route_w) + t * X_DIV);
        if (threadIdx.x == 0) ds4lab_raise_flag(count + 2 + n_tokens + t);    // the thread that wrote them
    }
} else {
    const int j = job - routers;
    const bool is_shared = j < shared_jobs;
    const int p = is_shared ? n_pairs + j / X_BLOCKS : (j - shared_jobs) / X_BLOCKS;
    const int bx = is_shared ? j % X_BLOCKS : (j - shared_jobs) % X_BLOCKS;
    if (!is_shared) {
        if (threadIdx.x == 0) {
            ds4lab_wait_flag(count + 2 + n_tokens + p / X_DIV);
            id_s = __ldcg(experts + p);
            w_s = __ldcg(route_w + p);
        }
        __syncthreads();
    }
    ds4lab_swiglu_rows<ROWS, COLS, ROW_BYTES, EXPERT_BYTES, X_DIV, SHARED_ROWS, P>(
        bx, p, n_pairs, is_shared ? 0 : id_s, is_shared ? 0.0f : w_s, raw_gate, raw_up,
        x + (size_t)(is_shared ? p - n_pairs : p / X_DIV) * COLS, clamp[0], codes_g,
        scales_g, codes_u, scales_u, mid, shared DS4LAB_DOT_TABLES);
}
if (ds4lab_last_block(count + 1, gridDim.x)) {
    for (int t = threadIdx.x; t < n_tokens; t += blockDim.x) count[2 + n_tokens + t] = 0;
}
