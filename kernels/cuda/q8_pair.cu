// Two Q8_0 matrices times one input vector in one launch (the attention's q_a and kv
// projections, both of the sublayer input): ya[t] = A x[t], yb[t] = B x[t]. Warps take R
// rows of A, then of B (R divides both row counts); q8_rows.cuh has the loop.
// NORM_A: the launch also writes ya_n[t] = RMSNorm(ya[t]) * norm_w, as row_finish(ya; eps[0],
// norm_w) would (the same block-wide sum: this launch's blocks and row_finish's are both 128
// threads), made by the last block to finish (ds4lab_last_block: it reads the others' ya
// through L2). q_b multiplies ya_n: the norm made once a token, where the q_b product made it
// in each of its 2048 blocks (ncu: 31 µs for its 35.6 MB, 1.2 TB/s, the warps waiting on the
// norm's loads and barriers before their first weights).
// THEN (with NORM_A): the launch also makes yc[t] = C ya_n[t] (q_b's product, C [ROWS_C,
// ROWS_A]; R_C rows a warp, SPLIT_C as SPLIT), one launch fewer a layer (the host's encoding
// and build of a launch, ~25 µs on the H200 machines). Its blocks need ya_n, so thread blocks
// take their jobs in arrival order (counter[1], a ticket): the first T * PAIR_BLOCKS make the
// pair's rows, the last of them the norm, then it raises a flag (counter[3]); the others
// (C_BLOCKS a token) first ask L2 for their rows of C (the weights stream in while the pair
// and the norm run), wait for the flag, copy ya_n[t] into shared memory and make their rows.
// A block waits only for tickets taken before its own, by running blocks that wait for
// nothing (no deadlock, whatever fits on the device). The last block to leave (counter[2])
// sets the flag back to zero (the ticket resets itself).
// SLOT (one token): the launch also makes the layer's compressor frontiers after the token
// (compressor_slot.cuh, which reads the same input x), by SLOT_BLOCKS blocks that follow the
// pair's (by ticket with THEN: the slot waits for nothing, so its jobs come before C's, which
// wait), one launch fewer a compressed layer.
// Inputs: codes_a [ROWS_A, COLS / 4], scales_a [ROWS_A, COLS / 32], the same of B, x [T, COLS],
// norm_w [ROWS_A] and eps [1] (NORM_A), counter (arrival counters, NORM_A), the same of C (THEN),
// the slot's (SLOT; compressor_slot.cuh's, S_ before its template names, slot_ before its
// arguments). Grid: x = 32 threads per warp, R rows per warp over ROWS_A + ROWS_B; y = the
// token. THEN or SLOT: x = T * (PAIR_BLOCKS + C_BLOCKS) + SLOT_BLOCKS blocks, y = 1.
const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
int* const count = const_cast<int*>(counter);
const int n_tokens = SLOT ? 1 : THEN ? gridDim.x / (PAIR_BLOCKS + C_BLOCKS) : gridDim.y;
// The jobs in order: the tokens' pair blocks, the slot's, then the tokens' C blocks.
int bx = blockIdx.x, t = blockIdx.y;
const int job = THEN ? ds4lab_ticket(count + 1) : blockIdx.x;
const int pair_jobs = THEN || SLOT ? n_tokens * PAIR_BLOCKS : (int)gridDim.x;
const bool in_pair = job < pair_jobs, in_slot = SLOT && !in_pair && job < pair_jobs + SLOT_BLOCKS;
const bool product_c = THEN && !in_pair && !in_slot;
if (THEN || SLOT) {
    const int first = in_pair ? 0 : in_slot ? pair_jobs : pair_jobs + SLOT_BLOCKS;
    const int per = max(in_pair ? PAIR_BLOCKS : in_slot ? SLOT_BLOCKS : C_BLOCKS, 1);
    bx = (job - first) % per;
    t = (job - first) / per;
}
const int r0 = (SPLIT > 1 ? bx : bx * (blockDim.x >> 5) + warp) * R;
const int cols_part = SPLIT > 1 ? warp : 0;
if (in_pair && r0 < ROWS_A + ROWS_B) {
    // (Written out, not ds4lab_q8_rows_times of the chosen matrix: choosing the pointers first
    // left 45-64 more instructions in the loop, 515-534 against 470.)
    const bool in_a = r0 < ROWS_A;
    const int rb = in_a ? r0 : r0 - ROWS_A;
    const float4* xv = reinterpret_cast<const float4*>(x + (size_t)t * COLS);
    const uint4* w[R];
    const float* s[R];
#pragma unroll
    for (int i = 0; i < R; ++i) {
        if (in_a) ds4lab_q8_row<COLS>(codes_a, scales_a, rb + i, w[i], s[i]);
        else ds4lab_q8_row<COLS>(codes_b, scales_b, rb + i, w[i], s[i]);
    }
    float acc[R];
    ds4lab_q8_dots<R, COLS, SPLIT>(w, s, xv, lane, acc, cols_part);
    ds4lab_q8_totals<R, SPLIT>(acc, cols_part, lane);
#pragma unroll
    for (int i = 0; i < R; ++i) {
        if (lane == 0 && cols_part == 0) (in_a ? ya + (size_t)t * ROWS_A : yb + (size_t)t * ROWS_B)[rb + i] = acc[i];
    }
}
if (NORM_A && in_pair) {
    // Every thread of every pair block gets here (a block's warps past the rows included):
    // the arrival count is the pair's blocks.
    __shared__ float scratch[32];
    __shared__ float row[NORM_A ? ROWS_A : 1];
    __shared__ float row_w[NORM_A ? ROWS_A : 1];
    if (ds4lab_last_block(count, n_tokens * PAIR_BLOCKS)) {
        for (int tt = 0; tt < n_tokens; ++tt) {
            // The row and the norm's weights into shared memory, eight of each in flight a
            // thread: as plain loops (the block size known only at run time) each load waited
            // for the one before, eight L2 round trips for the row and then eight DRAM ones
            // for the weights.
            constexpr int LOADS = 8;
            for (int i0 = threadIdx.x; i0 < ROWS_A; i0 += LOADS * blockDim.x) {
                float v[LOADS], w[LOADS];
#pragma unroll
                for (int k = 0; k < LOADS; ++k) {
                    const int i = i0 + k * (int)blockDim.x;
                    v[k] = i < ROWS_A ? __ldcg(ya + (size_t)tt * ROWS_A + i) : 0.0f;
                    w[k] = i < ROWS_A ? norm_w[i] : 0.0f;
                }
#pragma unroll
                for (int k = 0; k < LOADS; ++k) {
                    const int i = i0 + k * (int)blockDim.x;
                    if (i < ROWS_A) {
                        row[i] = v[k];
                        row_w[i] = w[k];
                    }
                }
            }
            __syncthreads();
            const float inv = ds4lab_rms_inverse(row, ROWS_A, eps[0], scratch);
            for (int i = threadIdx.x; i < ROWS_A; i += blockDim.x)
                ya_n[(size_t)tt * ROWS_A + i] = __fmul_rn(__fmul_rn(row[i], inv), row_w[i]);
            __syncthreads();
        }
        if (THEN) {                             // every thread's ya_n visible, then the flag
            __threadfence();
            __syncthreads();
            if (threadIdx.x == 0) ds4lab_raise_flag(count + 3);
        }
    }
}
if (in_slot)
    ds4lab_compressor_slot<S_R, COLS, S_ROWS, S_R2, S_ROWS2, S_RATIO, S_SHIFT>(
        bx, SLOT_BLOCKS, x, slot_w_kv, slot_w_gate, slot_ape, slot_kv, slot_score, slot_w_kv2, slot_w_gate2,
        slot_ape2, slot_kv2, slot_score2, slot_at, slot_kv_out, slot_score_out, slot_kv_out2, slot_score_out2);
if (product_c) {
    __shared__ float4 xs[THEN ? ROWS_A / 4 : 1];
    const int c0 = (SPLIT_C > 1 ? bx : bx * (blockDim.x >> 5)) * R_C;
    const int c_rows = min(SPLIT_C > 1 ? R_C : (int)(blockDim.x >> 5) * R_C, ROWS_C - c0);
    // This block's rows of C asked of L2 while the pair runs: ROWS_A code bytes and
    // ROWS_A / 32 scales a row, 128-byte lines.
    const char* codes_at = reinterpret_cast<const char*>(codes_c) + (size_t)c0 * ROWS_A;
    const char* scales_at = reinterpret_cast<const char*>(scales_c + (size_t)c0 * (ROWS_A / 32));
    for (int i = threadIdx.x; i < (c_rows * ROWS_A + 127) / 128; i += blockDim.x)
        ds4lab_prefetch_l2(codes_at + (size_t)i * 128);
    for (int i = threadIdx.x; i < (c_rows * (ROWS_A / 32) * 4 + 127) / 128; i += blockDim.x)
        ds4lab_prefetch_l2(scales_at + (size_t)i * 128);
    if (threadIdx.x == 0) ds4lab_wait_flag(count + 3);
    __syncthreads();
    for (int i = threadIdx.x; i < ROWS_A / 4; i += blockDim.x)
        xs[i] = __ldcg(reinterpret_cast<const float4*>(ya_n + (size_t)t * ROWS_A) + i);
    __syncthreads();
    const int rc = (SPLIT_C > 1 ? bx : bx * (blockDim.x >> 5) + warp) * R_C;
    const int c_part = SPLIT_C > 1 ? warp : 0;
    if (rc < ROWS_C)
        ds4lab_q8_rows_times<R_C, THEN ? ROWS_A : 32, SPLIT_C>(codes_c, scales_c, reinterpret_cast<const float*>(xs),
                                                              yc + (size_t)t * ROWS_C, rc, c_part, lane);
}
if (THEN && ds4lab_last_block(count + 2, gridDim.x) && threadIdx.x == 0) count[3] = 0;
