// The hyper-connection split of one token (ds4's hc_split_sinkhorn), run by one thread:
// from the mixer outputs m ((2 + N) * N values, already RMS-scaled) the collapse weights
// pre[N], the spread weights post[N] and the Sinkhorn-normalised stream mix comb[N][N]
// (row i = destination-major index). The steps of ds4lab/model/hc.py `_split`, in the
// same order, in float32:
//   pre  = sigmoid(m[i] * scale[0] + base[i]) + eps
//   post = 2 * sigmoid(m[N + i] * scale[1] + base[N + i])
//   comb = softmax over j of (m[2N + iN + j] * scale[2] + base[2N + iN + j]) + eps,
//          then columns normalised (c / (sum over i + eps)), then ITERS - 1 times rows
//          (sum over j) and columns again.
template <int N, int ITERS>
__device__ void ds4lab_hc_split(const float* m, const float* scale, const float* base, float eps,
                                float* pre, float* post, float* comb) {
    for (int i = 0; i < N; ++i) {
        pre[i] = 1.0f / (1.0f + expf(-(m[i] * scale[0] + base[i]))) + eps;
        post[i] = 2.0f / (1.0f + expf(-(m[N + i] * scale[1] + base[N + i])));
    }
    float c[N][N];
    for (int i = 0; i < N; ++i) {
        float top = -INFINITY;
        for (int j = 0; j < N; ++j) {
            c[i][j] = m[2 * N + i * N + j] * scale[2] + base[2 * N + i * N + j];
            top = fmaxf(top, c[i][j]);
        }
        float s = 0.0f;
        for (int j = 0; j < N; ++j) { c[i][j] = expf(c[i][j] - top); s += c[i][j]; }
        for (int j = 0; j < N; ++j) c[i][j] = c[i][j] / s + eps;
    }
    for (int it = 0; it < ITERS; ++it) {
        if (it > 0) {
            for (int i = 0; i < N; ++i) {
                float s = 0.0f;
                for (int j = 0; j < N; ++j) s += c[i][j];
                for (int j = 0; j < N; ++j) c[i][j] = c[i][j] / (s + eps);
            }
        }
        for (int j = 0; j < N; ++j) {
            float s = 0.0f;
            for (int i = 0; i < N; ++i) s += c[i][j];
            for (int i = 0; i < N; ++i) c[i][j] = c[i][j] / (s + eps);
        }
    }
    for (int i = 0; i < N; ++i)
        for (int j = 0; j < N; ++j) comb[i * N + j] = c[i][j];
}
