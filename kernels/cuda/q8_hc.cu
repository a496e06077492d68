// A sublayer's last Q8_0 product and the hyper-connection step after it in one launch
// (model/hc.py `hc_expand`): out[t] = W x[t] (plus add[t] with ADD: the FFN's routed output
// beside the shared expert's), then stream c of the new residual gets
// post[c] * out + sum_a comb[a][c] * streams[a] (ds4lab_hc_value, as hc_post.cu).
// Each warp owns R rows (R output dims); lanes c < N write stream c of them.
// NEXT: the launch also makes the next sublayer's input from these new streams, as hc_pre.cu
// does (its HC control pre, post, comb and x = RMSNorm(sum_a pre[a] * streams[a]) * norm),
// so a decode step launches no hc_pre: two launches fewer a layer, each ~15 µs of the host's
// encoding. Each block sums, while its streams are still in registers, its share of the
// next mixer's product (mix [M, N * E], M = (2 + N) * N) and of the streams' squares (the
// RMS the product is scaled by): part[t, j, block] for j < M, and j = M the squares; each
// lane c < N its rows, then the warps in order (ds4lab_block_sums). The last block to finish
// (ds4lab_last_block) then does what hc_pre does with them: each sum's PARTS partials added
// by a warp, two sums' loads in flight at once (ds4lab_hc_parts_sums, as hc_pre adds its
// own); warp 0 runs the split (ds4lab_hc_split) while warps 1.. collapse the streams and norm
// the result. The streams are read through L2, four columns a thread, two such loads in
// flight; the collapsed row is kept unnormed in shared memory, then scaled once its norm is
// known. E is a multiple of 4 (16-byte loads). The tail runs on the last block alone, after
// every other: it is the launch's critical path (ncu: ~20 of 33 µs, the SMs active 39% of the
// launch), so the weights it reads are fetched into L2 as it starts and its loops keep
// several loads in flight.
// Routed (the kernels built with a block format's dot header, ds4lab_q8_hc_<format>, which
// defines DS4LAB_DOT_STAGE): out also gets a token's K routed experts' down products,
// sum over u of D[ids[t][u]] . mid[t][u] (mid: their route-weighted SwiGLU, expert_swiglu.cu;
// D: raw [n_expert, EXPERT_BYTES], ROW_BYTES a row of COLS values), so the FFN launches no
// down expert_matvec: one launch fewer a layer, and the 16.5 MB of a flash layer's down rows
// stream beside the shared expert's instead of in a launch of their own (in place, the down
// launch took ~40 µs a layer of device time at ~0.4 TB/s). The SPLIT warps sharing R rows
// (which split the Q8_0 columns) share the pairs' rows as K * PIECES pieces (pair u's row cut
// into PIECES runs of whole blocks; kernels.py picks PIECES so that the pieces divide evenly:
// 6 pairs over 4 warps are 12 half rows, 3 a warp, where whole rows would give two warps 2
// and two warps 1, the block waiting on the slowest); warp part k takes pieces k, k + SPLIT,
// ..., its lanes' sums joining their Q8_0 sums before the warps' totals (one order of
// additions: not the separate launch's bits, within float rounding of them).
// Inputs: codes [E, COLS / 4], scales [E, COLS / 32], x [T, COLS], add [T, E] (or one unused
// value), streams [T, N, E], post [T, N], comb [T, N, N]; with NEXT the next sublayer's mixer
// and its weights: mix, next_scale [3], next_base [M], next_norm [E], eps [2] (RMS, HC), and
// counter (an arrival counter), part [T, M + 1, PARTS] (the blocks' partial sums, scratch the
// last block reads: an input, kernels.py `_launch_scratch`), else one unused value each;
// pre_codes, pre_scales and pre_x [T, PRE_ROWS / PRE_GROUP_ROWS * PRE_COLS] with PRE, else one
// unused value each.
// PRE (with NEXT; the attention's output): x is first made in the launch, the grouped product
// x[t] = P pre_x[t] (as q8_matvec.cu: PRE_ROWS rows of PRE_COLS in groups of PRE_GROUP_ROWS,
// group g times its own slice of pre_x; PRE_R rows a warp, PRE_SPLIT warps sharing them,
// PRE_SETS such sets a block), one launch fewer a layer. Thread blocks take their jobs in
// arrival order (counter[3], a ticket, set back to zero by the block that draws the last):
// the first T * PRE_BLOCKS make x (into the input buffer x: scratch of this launch) and the
// last of them (counter[1]) raises a flag (counter[2]); the rest, PARTS a token, wait for it
// and run as above, bx and t their job's. A block waits only for tickets taken before its own,
// by running blocks that wait for nothing. The tail's block, which every other has reached
// after its wait, sets the flag back to zero.
// routed: raw, ids [T, K] int32, mid [T, K, COLS] and the format's tables.
// Outputs: y [T, N, E]; with NEXT x_next [T, E], post_next [T, N], comb_next [T, N, N] (one
// unused value each without). The split's pre weights go to the input pre_next [T, N]:
// scratch, since a decode step reads only x, post and comb of a sublayer's input (an output
// costs the host ~2 µs of encoding a launch).
// Grid: x = 32 threads per warp, R rows per warp (with SPLIT, R rows per SPLIT warps, which
// split the columns, q8_rows.cuh; the first writes; GROUPS such sets a block), PARTS blocks;
// y = the token. GROUPS > 1 is for the tail: the last block's threads collapse the streams
// and add the partials, and there are 1 / GROUPS as many partials (E: a multiple of
// R * GROUPS, so that every warp of a block has rows). PRE: x = T * (PRE_BLOCKS + PARTS)
// blocks, y = 1.
#ifdef DS4LAB_DOT_STAGE
DS4LAB_DOT_STAGE
#endif
constexpr int M = (2 + N) * N;
const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
int* const arrivals = const_cast<int*>(counter);
const int n_tokens = PRE ? gridDim.x / (PRE_BLOCKS + PARTS) : gridDim.y;
int bx = blockIdx.x, t = blockIdx.y;
if (PRE) {
    const int ticket = ds4lab_ticket(arrivals + 3);
    const bool pre_job = ticket < n_tokens * PRE_BLOCKS;
    const int job = pre_job ? ticket : ticket - n_tokens * PRE_BLOCKS, per = pre_job ? PRE_BLOCKS : PARTS;
    bx = job % per;
    t = job / per;
    if (pre_job) {
        const int p0 = (bx * PRE_SETS + (PRE_SPLIT > 1 ? warp / PRE_SPLIT : warp)) * PRE_R;
        const int p_part = PRE_SPLIT > 1 ? warp % PRE_SPLIT : 0;
        if (p0 < PRE_ROWS)
            ds4lab_q8_rows_times<PRE_R, PRE_COLS, PRE_SPLIT, PRE_SETS>(
                pre_codes, pre_scales,
                pre_x + ((size_t)t * (PRE_ROWS / PRE_GROUP_ROWS) + p0 / PRE_GROUP_ROWS) * PRE_COLS,
                const_cast<float*>(x) + (size_t)t * PRE_ROWS, p0, p_part, lane, PRE_SPLIT > 1 ? warp / PRE_SPLIT : 0);
        if (ds4lab_last_block(arrivals + 1, n_tokens * PRE_BLOCKS) && threadIdx.x == 0) ds4lab_raise_flag(arrivals + 2);
        return;
    }
    // After the wait the block reads x with plain loads: thread 0's acquire, then the barrier,
    // orders them after the pre blocks' writes (and the acquire leaves no stale line in this
    // SM's L1). x must stay a plain pointer: no __ldg, no __restrict__.
    if (threadIdx.x == 0) ds4lab_wait_flag(arrivals + 2);
    __syncthreads();
}
const int r0 = (SPLIT > 1 ? bx * GROUPS + warp / SPLIT : bx * (blockDim.x >> 5) + warp) * R;
const int cols_part = SPLIT > 1 ? warp % SPLIT : 0;
float mixed[NEXT ? M + 1 : 1] = {};
if (r0 < E) {
    const float4* xv = reinterpret_cast<const float4*>(x + (size_t)t * COLS);
    const uint4* w[R];
    const float* s[R];
#pragma unroll
    for (int i = 0; i < R; ++i) ds4lab_q8_row<COLS>(codes, scales, r0 + i, w[i], s[i]);
    float acc[R];
    ds4lab_q8_dots<R, COLS, SPLIT>(w, s, xv, lane, acc, cols_part);
#ifdef DS4LAB_DOT_STAGE
    for (int piece = cols_part; piece < K * PIECES; piece += SPLIT) {
        const int u = piece / PIECES, from = piece % PIECES;
        const uint8_t* expert = raw + (size_t)ids[(size_t)t * K + u] * EXPERT_BYTES + from * (ROW_BYTES / PIECES);
        const uint8_t* rows[R];
#pragma unroll
        for (int i = 0; i < R; ++i) rows[i] = expert + (size_t)(r0 + i) * ROW_BYTES;
        ds4lab_expert_dot<COLS / PIECES, R>(rows, mid + ((size_t)t * K + u) * COLS + from * (COLS / PIECES), lane,
                                            acc DS4LAB_DOT_TABLES);
    }
#endif
    ds4lab_q8_totals<R, SPLIT, GROUPS>(acc, cols_part, lane, warp / SPLIT);
#pragma unroll
    for (int i = 0; i < R; ++i) {
        const float total = acc[i];
        const int d = r0 + i;
        if (lane < N && cols_part == 0) {
            const float o = ADD ? total + add[(size_t)t * E + d] : total;
            const float v = ds4lab_hc_value<N, E>(o, streams, post, comb, t, lane, d);
            y[((size_t)t * N + lane) * E + d] = v;
            if (NEXT) {
#pragma unroll
                for (int j = 0; j < M; ++j) mixed[j] += mix[((size_t)j * N + lane) * E + d] * v;
                mixed[M] += v * v;
            }
        }
    }
}
// (MLX's kernel is no template: the branch below is compiled without NEXT too, so what it
// instantiates must hold for any N: the split's a-lane-a-cell warp is for N * N <= 32.)
if (NEXT) {
    __shared__ float warp_mixed[NEXT ? 32 * (M + 1) : 1];
    ds4lab_block_sums<M + 1>(mixed, warp_mixed, const_cast<float*>(part) + (size_t)t * (M + 1) * PARTS + bx, PARTS);
    __shared__ float m[NEXT ? M + 1 : 1];
    __shared__ float scratch[32];
    __shared__ float4 stage[NEXT ? E / 4 : 1];
    if (!ds4lab_last_block(arrivals, PARTS * n_tokens)) return;
    if (PRE && threadIdx.x == 0) arrivals[2] = 0;      // every other block is past its wait
    // The weights the tail reads after its sums (the norm's, the split's) have not been read
    // this step: into L2 now, while the partials are added (from DRAM, each later loop would
    // wait ~1 µs a step).
    for (int i = threadIdx.x * 32; i < E; i += blockDim.x * 32) ds4lab_prefetch_l2(next_norm + i);
    if (threadIdx.x == 0) {
        ds4lab_prefetch_l2(next_scale);
        for (int i = 0; i < M; i += 32) ds4lab_prefetch_l2(next_base + i);
    }
    const int threads = (int)blockDim.x - 32, id = (int)threadIdx.x - 32;
    for (int tt = 0; tt < n_tokens; ++tt) {
        const int n_warps = (int)(blockDim.x >> 5);
        for (int i = warp; i <= M; i += 2 * n_warps) {             // sums i and i + n_warps
            const int count = i + n_warps <= M ? 2 : 1;
            float two[2];
            ds4lab_hc_parts_sums<PARTS, 2>(part + ((size_t)tt * (M + 1) + i) * PARTS, (size_t)n_warps * PARTS, count,
                                           lane, two);
            if (lane == 0) {
                m[i] = two[0];
                if (count == 2) m[i + n_warps] = two[1];
            }
        }
        __syncthreads();
        const float inv = 1.0f / sqrtf(m[M] / (float)(N * E) + eps[0]);
        for (int i = threadIdx.x; i < M; i += blockDim.x) m[i] *= inv;
        __syncthreads();
        if (warp == 0) {
            ds4lab_hc_split<NEXT ? N : 1, ITERS>(m, next_scale, next_base, eps[1],
                                                 const_cast<float*>(pre_next) + tt * N, post_next + tt * N,
                                                 comb_next + (size_t)tt * N * N, lane);
        } else {
            float weights[N];
#pragma unroll
            for (int a = 0; a < N; ++a) weights[a] = ds4lab_hc_pre_weight(m, next_scale, next_base, eps[1], a);
            // Four columns a thread, two steps' loads in flight; the unnormed row is kept in
            // shared memory for the scaling (a read back through L2 cost a round trip a step).
            const float4* s = reinterpret_cast<const float4*>(y + (size_t)tt * N * E);
            constexpr int QUADS = E / 4;
            float ss = 0.0f;
            for (int q0 = id; q0 < QUADS; q0 += 2 * threads) {
                float4 v[2][N];
#pragma unroll
                for (int k = 0; k < 2; ++k) {
                    const int q = q0 + k * threads;
#pragma unroll
                    for (int a = 0; a < N; ++a) v[k][a] = q < QUADS ? __ldcg(s + a * QUADS + q) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                }
#pragma unroll
                for (int k = 0; k < 2; ++k) {
                    const int q = q0 + k * threads;
                    float4 x_q = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
                    for (int a = 0; a < N; ++a) {
                        x_q.x += v[k][a].x * weights[a];
                        x_q.y += v[k][a].y * weights[a];
                        x_q.z += v[k][a].z * weights[a];
                        x_q.w += v[k][a].w * weights[a];
                    }
                    if (q < QUADS) stage[q] = x_q;
                    ss += x_q.x * x_q.x + x_q.y * x_q.y + x_q.z * x_q.z + x_q.w * x_q.w;
                }
            }
            const float total = ds4lab_collapse_sum(ss, scratch, threads);
            const float inv2 = 1.0f / sqrtf(total / (float)E + eps[0]);
            const float4* nw = reinterpret_cast<const float4*>(next_norm);
            float4* xt = reinterpret_cast<float4*>(x_next + (size_t)tt * E);
            constexpr int B = 4;                       // the norm weights' loads in flight
            for (int q0 = id; q0 < QUADS; q0 += B * threads) {
                float4 w4[B];
#pragma unroll
                for (int k = 0; k < B; ++k) {
                    const int q = q0 + k * threads;
                    w4[k] = q < QUADS ? nw[q] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                }
#pragma unroll
                for (int k = 0; k < B; ++k) {
                    const int q = q0 + k * threads;
                    if (q < QUADS) {
                        const float4 xq = stage[q];
                        xt[q] = make_float4(xq.x * inv2 * w4[k].x, xq.y * inv2 * w4[k].y, xq.z * inv2 * w4[k].z,
                                            xq.w * inv2 * w4[k].w);
                    }
                }
            }
        }
        __syncthreads();
    }
}
