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
// Why a warp: the ~40 normalisations are a chain of dependent divisions, and a decode step
// runs two splits per layer back to back. Every lane holds the whole N x N matrix in
// registers and runs the same steps (lane l then writes cells l, l + 32, ... of comb): each
// sum is a few register adds in the serial order and a row's N divisions are independent,
// where cells in shared memory made every step wait on loads and the warp's barriers.
// Each value is the one a single thread computes, bit for bit.
// pre[i] of the split: sigmoid(m[i] * scale[0] + base[i]) + eps (hc_pre's collapse computes
// it with this same function, so its weights are the split's bits).
__device__ __forceinline__ float ds4lab_hc_pre_weight(const float* m, const float* scale, const float* base, float eps,
                                                     int i) {
    return 1.0f / (1.0f + expf(-(m[i] * scale[0] + base[i]))) + eps;
}

template <int N, int ITERS>
__device__ void ds4lab_hc_split(const float* m, const float* scale, const float* base, float eps, float* pre,
                                float* post, float* comb, int lane) {
    static_assert(N <= 8, "ds4lab_hc_split: the N x N mix is held in each lane's registers");
    for (int i = lane; i < N; i += 32) {
        pre[i] = ds4lab_hc_pre_weight(m, scale, base, eps, i);
        post[i] = 2.0f / (1.0f + expf(-(m[N + i] * scale[1] + base[N + i])));
    }
    float c[N][N];
#pragma unroll
    for (int i = 0; i < N; ++i) {
        float top = -INFINITY;
#pragma unroll
        for (int j = 0; j < N; ++j) {
            c[i][j] = m[2 * N + i * N + j] * scale[2] + base[2 * N + i * N + j];
            top = fmaxf(top, c[i][j]);
        }
#pragma unroll
        for (int j = 0; j < N; ++j) c[i][j] = expf(c[i][j] - top);
    }
    for (int it = 0; it < 2 * ITERS; ++it) {
        // it = 0: the softmax's sum (then + eps); then columns (odd it) and rows (even),
        // ending on columns: 2 * ITERS - 1 normalisations.
        if (it % 2) {
#pragma unroll
            for (int j = 0; j < N; ++j) {
                float s = 0.0f;
#pragma unroll
                for (int i = 0; i < N; ++i) s += c[i][j];
#pragma unroll
                for (int i = 0; i < N; ++i) c[i][j] = c[i][j] / (s + eps);
            }
        } else {
#pragma unroll
            for (int i = 0; i < N; ++i) {
                float s = 0.0f;
#pragma unroll
                for (int j = 0; j < N; ++j) s += c[i][j];
#pragma unroll
                for (int j = 0; j < N; ++j) c[i][j] = it == 0 ? c[i][j] / s + eps : c[i][j] / (s + eps);
            }
        }
    }
#pragma unroll
    for (int l = 0; l < N * N; ++l)
        if (l % 32 == lane) comb[l] = c[l / N][l % N];
}
