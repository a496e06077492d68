// A decode (token, head)'s attention over SHARES equal shares of its keys, a thread block a
// share (decode_attention.cuh): a long key list over more thread blocks than the 64 heads (an
// H200 has 132 SMs, and a block of 512 threads at 128 registers fills one). Each block writes
// its share's m, l and weighted keys; the last of a head's blocks to finish
// (ds4lab_last_block on counter[t * H + h]) adds them with the head's sink logit in the
// denominator (ds4lab_share_weights) and turns the sum back by the query position's angle on
// its last NROT dims: what decode_attention.cu computes in one block.
// Inputs as decode_attention.cuh's, then sinks [H] and the zeroed counters; KVROW as
// decode_attention.cu's; then part_ml [T, H, SHARES, 2] and part_acc [T, H, SHARES, D], the
// shares' (m, l) and sums, which only the last block reads (scratch: inputs the kernel writes,
// kernels.py `_launch_scratch`). Outputs: out [T, H, D], keys_out (KVROW). Grid: x = the heads
// (WARPS warps each), y = the tokens, z = the shares.
const int h = blockIdx.x, t = blockIdx.y, z = blockIdx.z, n_head = gridDim.x;
const int nk = n_keys[1], chunk = (nk + SHARES - 1) / SHARES;
const int lo = min(nk, z * chunk), hi = min(nk, lo + chunk);
__shared__ float acc[D];
__shared__ float row[KVROW ? D : 1];
if (KVROW) ds4lab_token_row<D, NROT>(kv, kv_weight, eps, rope_cos, rope_sin, carry, keys, n_keys, row, keys_out);
float m, l;
ds4lab_attend_keys<D, NROT, WARPS, QFINISH>(q, keys, KVROW ? row : nullptr, comp, mask, n_keys, eps, rope_cos,
                                            rope_sin, lo, hi, m, l, acc);
const size_t first = ((size_t)t * n_head + h) * SHARES;
if (threadIdx.x == 0) {
    const_cast<float*>(part_ml)[2 * (first + z)] = m;
    const_cast<float*>(part_ml)[2 * (first + z) + 1] = l;
}
for (int d = threadIdx.x; d < D; d += blockDim.x) const_cast<float*>(part_acc)[(first + z) * D + d] = acc[d];
const float sink = sinks[h];                  // loaded before the wait: not a round trip after it
if (!ds4lab_last_block(const_cast<int*>(counter) + t * n_head + h, SHARES)) return;
float ms[SHARES], ls[SHARES], w[SHARES];
for (int s = 0; s < SHARES; ++s) {
    ms[s] = __ldcg(part_ml + 2 * (first + s));
    ls[s] = __ldcg(part_ml + 2 * (first + s) + 1);
}
ds4lab_share_weights<SHARES>(sink, ms, ls, w);
float* oh = out + ((size_t)t * n_head + h) * D;
for (int j = threadIdx.x; j < D / 2; j += blockDim.x) {
    float o0 = 0.0f, o1 = 0.0f;
    for (int s = 0; s < SHARES; ++s) {
        o0 += __ldcg(part_acc + (first + s) * D + 2 * j) * w[s];
        o1 += __ldcg(part_acc + (first + s) * D + 2 * j + 1) * w[s];
    }
    ds4lab_unrotate_pair(o0, o1, 2 * j, D, NROT, t, rope_cos, rope_sin);
    oh[2 * j] = o0;
    oh[2 * j + 1] = o1;
}
