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
// thread, and a decode step runs two splits per layer back to back. Here lane l owns cells
// l, l + 32, ... of c (kept in the shared `c` [N * N]); every lane of a row (or column)
// sums that row from shared memory in the serial order, so each value is the one a single
// thread would compute, bit for bit.
template <int N>
__device__ __forceinline__ float ds4lab_hc_row_sum(const float* c, int i) {
    float s = 0.0f;
    for (int j = 0; j < N; ++j) s += c[i * N + j];
    return s;
}

template <int N>
__device__ __forceinline__ float ds4lab_hc_col_sum(const float* c, int j) {
    float s = 0.0f;
    for (int i = 0; i < N; ++i) s += c[i * N + j];
    return s;
}

// pre[i] of the split: sigmoid(m[i] * scale[0] + base[i]) + eps (hc_pre's collapse computes
// it with this same function, so its weights are the split's bits).
__device__ __forceinline__ float ds4lab_hc_pre_weight(const float* m, const float* scale, const float* base, float eps,
                                                     int i) {
    return 1.0f / (1.0f + expf(-(m[i] * scale[0] + base[i]))) + eps;
}

template <int N, int ITERS>
__device__ void ds4lab_hc_split(const float* m, const float* scale, const float* base, float eps, float* pre,
                                float* post, float* comb, float* c, int lane) {
    constexpr int CELLS = (N * N + 31) / 32;
    for (int i = lane; i < N; i += 32) {
        pre[i] = ds4lab_hc_pre_weight(m, scale, base, eps, i);
        post[i] = 2.0f / (1.0f + expf(-(m[N + i] * scale[1] + base[N + i])));
    }
    float v[CELLS] = {};
#pragma unroll
    for (int k = 0; k < CELLS; ++k) {
        const int l = lane + 32 * k;
        if (l < N * N) c[l] = v[k] = m[2 * N + l] * scale[2] + base[2 * N + l];
    }
    __syncwarp();
#pragma unroll
    for (int k = 0; k < CELLS; ++k) {
        const int l = lane + 32 * k;
        if (l < N * N) {
            float top = -INFINITY;
            for (int j = 0; j < N; ++j) top = fmaxf(top, c[(l / N) * N + j]);
            v[k] = expf(v[k] - top);
        }
    }
    __syncwarp();
#pragma unroll
    for (int k = 0; k < CELLS; ++k)
        if (lane + 32 * k < N * N) c[lane + 32 * k] = v[k];
    __syncwarp();
    for (int it = 0; it < 2 * ITERS; ++it) {
        // it = 0: the softmax's sum (then + eps); then columns (odd it) and rows (even),
        // ending on columns: 2 * ITERS - 1 normalisations.
        float s[CELLS];
#pragma unroll
        for (int k = 0; k < CELLS; ++k) {
            const int l = lane + 32 * k;
            s[k] = l >= N * N ? 1.0f : it % 2 ? ds4lab_hc_col_sum<N>(c, l % N) : ds4lab_hc_row_sum<N>(c, l / N);
        }
        __syncwarp();
#pragma unroll
        for (int k = 0; k < CELLS; ++k) {
            const int l = lane + 32 * k;
            if (l < N * N) c[l] = v[k] = it == 0 ? v[k] / s[k] + eps : v[k] / (s[k] + eps);
        }
        __syncwarp();
    }
#pragma unroll
    for (int k = 0; k < CELLS; ++k)
        if (lane + 32 * k < N * N) comb[lane + 32 * k] = v[k];
}
