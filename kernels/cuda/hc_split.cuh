// The hyper-connection split of one token (ds4's hc_split_sinkhorn), run by one warp: from
// the mixer outputs m ((2 + N) * N values, already RMS-scaled) the collapse weights pre[N],
// the spread weights post[N] and the Sinkhorn-normalised stream mix comb[N][N] (row i =
// destination-major index). The steps of ds4lab/model/hc.py `_split`, in the same order,
// in float32:
//   pre  = sigmoid(m[i] * scale[0] + base[i]) + eps
//   post = 2 * sigmoid(m[N + i] * scale[1] + base[N + i])
//   comb = softmax over j of (m[2N + iN + j] * scale[2] + base[2N + iN + j]) + eps,
//          then columns normalised (c / (sum over i + eps)), then ITERS - 1 times rows
//          (sum over j) and columns again.
// Why a warp: the ~40 normalisations are a chain of dependent divisions, ~15 µs on one
// thread, and a decode step runs two splits per layer back to back. Lane l holds cell l of
// c in a register (N * N <= 32), and every lane of a row (or column) gathers that row's
// cells with shuffles and adds them in the serial order, so each value is the one a single
// thread would compute, bit for bit. The loop is unrolled (ITERS is a template), so the
// chain is straight-line shuffles, adds and divisions. Kept in shared memory, with a warp
// barrier around every normalisation and the row-or-column choice a branch, hc_pre read 15.5
// µs in ncu (base clock), 13.5 with the shuffles.

// The sum of the N cells of row `row` (or, with `column`, of column `row`) of the warp's
// cells (lane l holds cell l), added in index order.
template <int N>
__device__ __forceinline__ float ds4lab_hc_line_sum(float v, int row, bool column) {
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < N; ++k) s += __shfl_sync(0xffffffffu, v, column ? k * N + row : row * N + k);
    return s;
}

// pre[i] of the split: sigmoid(m[i] * scale[0] + base[i]) + eps (hc_pre's collapse computes
// it with this same function, so its weights are the split's bits).
__device__ __forceinline__ float ds4lab_hc_pre_weight(const float* m, const float* scale, const float* base, float eps,
                                                     int i) {
    return 1.0f / (1.0f + expf(-(m[i] * scale[0] + base[i]))) + eps;
}

// The sum of a mixer output's PARTS partial sums (from the blocks of the product that made
// the streams: hc_mix.cu's, or q8_hc.cu's NEXT), by a warp: lane l adds partials 4l..4l+3,
// 128 + 4l.., ... (16-byte loads, BATCH of them in flight at once), then the warp's butterfly
// adds the lanes'. q8_hc's last block adds ~1000 partials for each of 25 sums, 7 a warp: with
// one float a load, 8 in flight, that was 28 round trips to L2 a warp (the launch's tail ran
// ~20 µs longer than hc_pre, measured as the device's step time); now one a sum. All of a
// lane's at once took 32 registers (every thread of the product pays the tail's registers).
// Loads bypass L1 (__ldcg): q8_hc's last block reads partials the other blocks of its launch
// wrote. A row of partials starts 16-byte aligned when PARTS is a multiple of 4 (else one
// float a load, the others zero: the same sums).
template <int WIDTH>
__device__ __forceinline__ float4 ds4lab_hc_parts_load(const float* parts, int i) {
    if constexpr (WIDTH == 4) return __ldcg(reinterpret_cast<const float4*>(parts) + i);
    else return make_float4(__ldcg(parts + i), 0.0f, 0.0f, 0.0f);
}

// K sums at once (outputs `stride` floats apart, the first `count` of them wanted; K * BATCH
// loads in flight), each added in the same order as alone: q8_hc's last block adds two a
// warp at a time.
template <int PARTS, int K>
__device__ __forceinline__ void ds4lab_hc_parts_sums(const float* parts, size_t stride, int count, int lane,
                                                    float (&out)[K]) {
    constexpr int WIDTH = PARTS % 4 == 0 ? 4 : 1, UNITS = PARTS / WIDTH, PER_LANE = (UNITS + 31) / 32;
    constexpr int BATCH = 8 / K > 0 ? 8 / K : 1;
    float sum[K];
#pragma unroll
    for (int j = 0; j < K; ++j) sum[j] = 0.0f;
#pragma unroll 1
    for (int k0 = 0; k0 < PER_LANE; k0 += BATCH) {
        float4 got[K][BATCH];
#pragma unroll
        for (int j = 0; j < K; ++j) {
#pragma unroll
            for (int k = 0; k < BATCH; ++k) {
                const int i = lane + 32 * (k0 + k);
                got[j][k] = j < count && k0 + k < PER_LANE && i < UNITS
                                ? ds4lab_hc_parts_load<WIDTH>(parts + j * stride, i)
                                : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            }
        }
#pragma unroll
        for (int j = 0; j < K; ++j) {
#pragma unroll
            for (int k = 0; k < BATCH; ++k) sum[j] += (got[j][k].x + got[j][k].y) + (got[j][k].z + got[j][k].w);
        }
    }
#pragma unroll
    for (int j = 0; j < K; ++j) out[j] = ds4lab_warp_sum_all(sum[j]);
}

template <int PARTS>
__device__ __forceinline__ float ds4lab_hc_parts_sum(const float* parts, int lane) {
    float one[1];
    ds4lab_hc_parts_sums<PARTS, 1>(parts, 0, 1, lane, one);
    return one[0];
}

// The sum over warps 1.. of each thread's v (warp 0 runs the split meanwhile), on barrier 1
// (those warps' threads only: `threads` of them); each of them gets the total, the warps
// added in order. hc_pre's and q8_hc's collapse take their norm's sum of squares with it.
__device__ __forceinline__ float ds4lab_collapse_sum(float v, float* scratch, int threads) {
    v = ds4lab_warp_sum_all(v);
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
    asm volatile("bar.sync 1, %0;" ::"r"(threads) : "memory");
    float total = 0.0f;
    for (int w = 1; w < (int)(blockDim.x >> 5); ++w) total += scratch[w];
    return total;
}

// Not inlined: inlined into q8_hc.cu's last-block tail (NEXT), ptxas gave that whole product
// kernel 96-127 registers a thread (72 without the split), and so fewer of its ~1000 blocks
// resident at once; as a call it stays at 72 (NVRTC, sm_90a; tests/test_cubin.py).
template <int N, int ITERS>
__device__ __noinline__ void ds4lab_hc_split(const float* m, const float* scale, const float* base, float eps, float* pre,
                                float* post, float* comb, int lane) {
    static_assert(N * N <= 32, "ds4lab_hc_split: a lane a cell");
    for (int i = lane; i < N; i += 32) {
        pre[i] = ds4lab_hc_pre_weight(m, scale, base, eps, i);
        post[i] = 2.0f / (1.0f + expf(-(m[N + i] * scale[1] + base[N + i])));
    }
    const int l = lane < N * N ? lane : 0;          // lanes past the cells shadow cell 0 (unused)
    const int i = l / N, j = l % N;
    float v = m[2 * N + l] * scale[2] + base[2 * N + l];
    float top = -INFINITY;
#pragma unroll
    for (int k = 0; k < N; ++k) top = fmaxf(top, __shfl_sync(0xffffffffu, v, i * N + k));
    v = expf(v - top);
    // it = 0: the softmax's sum (then + eps); then columns (odd it) and rows (even), ending
    // on columns: 2 * ITERS - 1 normalisations.
    v = v / ds4lab_hc_line_sum<N>(v, i, false) + eps;
#pragma unroll
    for (int it = 1; it < 2 * ITERS; ++it) v = v / (ds4lab_hc_line_sum<N>(v, it % 2 ? j : i, it % 2) + eps);
    if (lane < N * N) comb[lane] = v;
}
