// A decode (token, head)'s attention over one of gridDim.z equal shares of its keys
// (decode_attention.cuh), for attention_combine.cu to add with the sink: a long key list
// split over more thread blocks than the 64 heads (an H200 has 132 SMs, and a block of
// 512 threads at 128 registers fills one). Inputs as decode_attention.cuh's.
// Outputs: part_ml [T, H, S, 2] (m, l of the share), part_acc [T, H, S, D].
// Grid: x = the heads (WARPS warps each), y = the tokens, z = the shares.
const int h = blockIdx.x, t = blockIdx.y, z = blockIdx.z, n_head = gridDim.x, shares = gridDim.z;
const int nk = n_keys[1], chunk = (nk + shares - 1) / shares;
const int lo = min(nk, z * chunk), hi = min(nk, lo + chunk);
__shared__ float acc[D];
float m, l;
ds4lab_attend_keys<D, NROT, WARPS, QFINISH>(q, keys, comp, mask, n_keys, eps, rope_cos, rope_sin, lo, hi, m, l,
                                            acc);
const size_t at = ((size_t)t * n_head + h) * shares + z;
if (threadIdx.x == 0) {
    part_ml[2 * at] = m;
    part_ml[2 * at + 1] = l;
}
for (int d = threadIdx.x; d < D; d += blockDim.x) part_acc[at * D + d] = acc[d];
