// The HC mixer product of a decode step's tokens, spread over the GPU: partial sums of
// mix[j] . streams[t] (the raw flattened streams, N * E values; mix [(2 + N) * N, N * E]),
// one per block of 256 columns, for hc_pre.cu to add up in block order.
// Why: hc_pre runs one thread block per token, and a token's product reads the whole
// 1.6 MB mixer (flash: 24 x 16384 floats); one block on one SM read it in ~80 µs, twice a
// layer. Here each thread reads one column (its stream value and the 24 mixer values: all
// its loads in flight at once) and the block sums the 24 products in warp order.
// Grid: x = PARTS blocks of blockDim.x (256) threads, y = the token. Output: part
// [T, M, PARTS] (output-major, as hc_pre reads it). Templates: N (streams), E (width), PARTS.
constexpr int M = (2 + N) * N;
__shared__ float warp_sums[32 * M];
const int t = blockIdx.y;
const int i = blockIdx.x * blockDim.x + threadIdx.x;
float acc[M];
const float v = i < N * E ? streams[(size_t)t * N * E + i] : 0.0f;
#pragma unroll
for (int j = 0; j < M; ++j) acc[j] = i < N * E ? v * mix[(size_t)j * N * E + i] : 0.0f;
ds4lab_block_sums<M>(acc, warp_sums, part + (size_t)t * M * PARTS + blockIdx.x, PARTS);
