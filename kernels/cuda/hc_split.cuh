// HC split (ds4's hc_split_sinkhorn) for one token per thread: from the mixer outputs
// mix[t] ((2 + N) * N values) the collapse weights pre[t][N], the spread weights post[t][N]
// and the Sinkhorn-normalised stream mix comb[t][N][N] (row i = destination-major index).
// The steps of ds4lab/model/hc.py `_split`, in the same order, in float32:
//   pre  = sigmoid(mix[i] * scale[0] + base[i]) + eps
//   post = 2 * sigmoid(mix[N + i] * scale[1] + base[N + i])
//   comb = softmax over j of (mix[2N + iN + j] * scale[2] + base[2N + iN + j]) + eps,
//          then columns normalised (c / (sum over i + eps)), then ITERS - 1 times rows
//          (sum over j) and columns again.
// Templates: N (streams), ITERS (Sinkhorn iterations); inputs eps[0] and n_tok[0] (tokens,
// an input rather than a template so that one compiled kernel serves every chunk size).
const int t = blockIdx.x * blockDim.x + threadIdx.x;
if (t >= n_tok[0]) return;
const float* m = mix + (size_t)t * (2 + N) * N;
const float e = eps[0];
for (int i = 0; i < N; ++i) {
    pre[t * N + i] = 1.0f / (1.0f + expf(-(m[i] * scale[0] + base[i]))) + e;
    post[t * N + i] = 2.0f / (1.0f + expf(-(m[N + i] * scale[1] + base[N + i])));
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
    for (int j = 0; j < N; ++j) c[i][j] = c[i][j] / s + e;
}
for (int it = 0; it < ITERS; ++it) {
    if (it > 0) {
        for (int i = 0; i < N; ++i) {
            float s = 0.0f;
            for (int j = 0; j < N; ++j) s += c[i][j];
            for (int j = 0; j < N; ++j) c[i][j] = c[i][j] / (s + e);
        }
    }
    for (int j = 0; j < N; ++j) {
        float s = 0.0f;
        for (int i = 0; i < N; ++i) s += c[i][j];
        for (int i = 0; i < N; ++i) c[i][j] = c[i][j] / (s + e);
    }
}
for (int i = 0; i < N; ++i)
    for (int j = 0; j < N; ++j) comb[((size_t)t * N + i) * N + j] = c[i][j];
