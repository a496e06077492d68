// The indexer's choice of compressed rows (model/indexer.py `select_rows`) written straight
// into the attention mask: one thread block per token. Row mask = [window | rows], the
// token's raw-window columns copied from `window` [T, W], then over the N compressed rows:
// every visible row when at most K are visible, else the K visible rows with the highest
// scores, ties to the lower row (ds4 takes the best one by one; a stable sort does the same).
//   scores [T, N], visible [T, N], window [T, W], sizes [2] = (N, W). Output mask [T, W + N].
// The K-th highest score is found bit by bit on order-preserving keys (32 counting passes
// over the row's scores), then the rows tied with it are ranked by index with a block scan.
const int t = blockIdx.x, n = sizes[0], W = sizes[1];
const float* sc = scores + (size_t)t * n;
const bool* vis = visible + (size_t)t * n;
bool* out = mask + (size_t)t * (W + n);
for (int i = threadIdx.x; i < W; i += blockDim.x) out[i] = window[(size_t)t * W + i];
// A visible row's key grows with its score (-0 and +0 tie); invisible rows are 0, never chosen.
auto key_of = [&](int i) -> uint32_t {
    if (!vis[i]) return 0u;
    const float f = sc[i] == 0.0f ? 0.0f : sc[i];
    const uint32_t b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
};
__shared__ int total;
__shared__ int scan[1024];
auto count_at_least = [&](uint32_t v) -> int {
    if (threadIdx.x == 0) total = 0;
    __syncthreads();
    int c = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) c += key_of(i) >= v;
    atomicAdd(&total, c);
    __syncthreads();
    const int r = total;
    __syncthreads();
    return r;
};
if (count_at_least(1u) <= K) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[W + i] = vis[i];
    return;
}
uint32_t v = 0u;                                        // the K-th highest key
for (int bit = 31; bit >= 0; --bit)
    if (count_at_least(v | (1u << bit)) >= K) v |= 1u << bit;
const int need = K - (v == 0xffffffffu ? 0 : count_at_least(v + 1u));   // rows tied at v to take
// Contiguous spans per thread, so that thread order is row order for the ranking of ties.
const int span = (n + blockDim.x - 1) / blockDim.x;
const int lo = min(n, (int)threadIdx.x * span), hi = min(n, lo + span);
int tied = 0;
for (int i = lo; i < hi; ++i) tied += key_of(i) == v;
scan[threadIdx.x] = tied;
__syncthreads();
for (int offset = 1; offset < (int)blockDim.x; offset <<= 1) {
    const int add = threadIdx.x >= offset ? scan[threadIdx.x - offset] : 0;
    __syncthreads();
    scan[threadIdx.x] += add;
    __syncthreads();
}
int before = scan[threadIdx.x] - tied;                  // tied rows in earlier spans
for (int i = lo; i < hi; ++i) {
    const uint32_t k = key_of(i);
    out[W + i] = k > v || (k == v && before++ < need);
}
