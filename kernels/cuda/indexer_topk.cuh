// The lightning indexer's choice of compressed rows for one token (model/indexer.py
// `select_rows`), written straight into its attention mask row, by one thread block (any
// number of whole warps up to 1024): out = [window | rows], the token's raw-window columns
// copied from `window` (W of them), then over its n compressed rows every visible row when
// at most K are visible, else the K visible rows with the highest scores, ties to the lower
// row (ds4 takes the best one by one; a stable sort does the same). indexer_scores.cu's last
// block of a token runs it on the scores its launch just wrote (read through L2: `__ldcg`).
//   sc, vis: the token's n scores and visible flags; window: its W window flags.
// The K-th highest score is found on order-preserving 32-bit keys a byte at a time, highest
// byte first: each of 4 passes makes a histogram of the next byte over the keys that share
// the bytes found so far, and one warp walks it from the top to the bin that holds the K-th
// key (a bit at a time this took 33 passes of block-wide counting, each three barriers and a
// contended atomic: 28 us a ratio-4 layer on the flash shape). The rows tied with that key
// are then ranked by index with a scan.
// Every pass and the ranking read the keys again: the first CACHED of them are kept in shared
// memory from the first read on (a ratio-4 layer's rows up to 16k tokens of context; rows
// past it are read through L2 each time). Read through L2 every time, the passes' reads were
// a chain of ~20 round trips.
template <int K>
__device__ void ds4lab_indexer_choose(const float* sc, const bool* vis, const bool* window, bool* out, int n,
                                      int W) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int i = threadIdx.x; i < W; i += blockDim.x) out[i] = window[i];
    // A visible row's key grows with its score (-0 and +0 tie); invisible rows are 0, never chosen.
    auto load_key = [&](int i) -> uint32_t {
        if (!vis[i]) return 0u;
        const float s = __ldcg(sc + i);
        const float f = s == 0.0f ? 0.0f : s;
        const uint32_t b = __float_as_uint(f);
        return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    };
    constexpr int CACHED = 4096;
    __shared__ uint32_t cached[CACHED];
    auto key_of = [&](int i) -> uint32_t { return i < CACHED ? cached[i] : load_key(i); };
    __shared__ int warp_counts[32];
    __shared__ int hist[256];
    __shared__ uint32_t found[2];                            // the key's bytes so far; keys above it
    // The block's total of one int a thread (every thread gets it; two barriers).
    auto block_total = [&](int c) -> int {
        for (int offset = 16; offset > 0; offset >>= 1) c += __shfl_xor_sync(0xffffffffu, c, offset);
        if (lane == 0) warp_counts[warp] = c;
        __syncthreads();
        int total = 0;
        for (int w = 0; w < (int)(blockDim.x >> 5); ++w) total += warp_counts[w];
        __syncthreads();
        return total;
    };
    int visible_here = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const uint32_t k = load_key(i);
        if (i < CACHED) cached[i] = k;
        visible_here += k >= 1u;
    }
    if (block_total(visible_here) <= K) {                   // (its barriers publish cached[])
        for (int i = threadIdx.x; i < n; i += blockDim.x) out[W + i] = vis[i];
        return;
    }
    uint32_t prefix = 0u;                                    // the K-th highest key's bytes found
    int rank = K;                                            // its rank among keys sharing them
    int above = 0;                                           // keys greater than it
    for (int shift = 24; shift >= 0; shift -= 8) {
        const uint32_t high = shift == 24 ? 0u : 0xffffffffu << (shift + 8);
        for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        // Every warp runs the same trips (lanes past n hold no key), so that a warp's lanes with
        // equal bytes add to their bin once: the first pass's bytes are a few exponents.
        for (int base = 0; base < n; base += blockDim.x) {
            const int i = base + threadIdx.x;
            uint32_t bin = 256u;
            if (i < n) {
                const uint32_t k = key_of(i);
                if ((k & high) == prefix) bin = (k >> shift) & 255u;
            }
            const unsigned peers = __match_any_sync(0xffffffffu, bin);
            if (bin < 256u && lane == __ffs(peers) - 1) atomicAdd(&hist[bin], __popc(peers));
        }
        __syncthreads();
        if (warp == 0) {
            // Lane l holds bins 255 - 8l down to 248 - 8l; the lanes' counts summed from the top.
            int mine = 0;
    #pragma unroll
            for (int b = 0; b < 8; ++b) mine += hist[255 - 8 * lane - b];
            int upto = mine;                                 // bins from 255 down to this lane's last
            for (int offset = 1; offset < 32; offset <<= 1) {
                const int v = __shfl_up_sync(0xffffffffu, upto, offset);
                if (lane >= offset) upto += v;
            }
            const unsigned reached = __ballot_sync(0xffffffffu, upto >= rank);
            if (lane == __ffs(reached) - 1) {
                int before = upto - mine;                    // keys in higher bins
                int bin = 255 - 8 * lane;
                while (before + hist[bin] < rank) before += hist[bin--];
                found[0] = prefix | ((uint32_t)bin << shift);
                found[1] = (uint32_t)before;
            }
        }
        __syncthreads();
        prefix = found[0];
        rank -= (int)found[1];
        above += (int)found[1];
        __syncthreads();                                     // found[] is rewritten by the next pass
    }
    const uint32_t v = prefix;                               // the K-th highest key
    const int need = K - above;                              // rows tied at v to take
    // Contiguous spans per thread, so that thread order is row order for the ranking of ties.
    const int span = (n + blockDim.x - 1) / blockDim.x;
    const int lo = min(n, (int)threadIdx.x * span), hi = min(n, lo + span);
    int tied = 0;
    for (int i = lo; i < hi; ++i) tied += key_of(i) == v;
    int upto = tied;                                         // the warp's inclusive scan
    for (int offset = 1; offset < 32; offset <<= 1) {
        const int add = __shfl_up_sync(0xffffffffu, upto, offset);
        if (lane >= offset) upto += add;
    }
    if (lane == 31) warp_counts[warp] = upto;
    __syncthreads();
    int before = upto - tied;                                // tied rows in earlier spans
    for (int w = 0; w < warp; ++w) before += warp_counts[w];
    for (int i = lo; i < hi; ++i) {
        const uint32_t k = key_of(i);
        out[W + i] = k > v || (k == v && before++ < need);
    }
}
