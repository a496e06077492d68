// Attention of one (token, head) per thread block over the keys the token may see
// (decode_attention.cuh), with the head's sink logit in the denominator, then the inverse
// RoPE of the query position on the output's last NROT dims (model/attention.py `attend` +
// `output_heads`). Inputs as decode_attention.cuh's, and sinks [H]; output [T, H, D]. With
// KVROW (one token) keys is the kept window and kv the token's KV product: the kernel
// finishes its row (kv_weight, eps[1], carry) and writes keys_out, the window then the row
// (ds4lab_token_row).
// Grid: x = the heads (WARPS warps each), y = the tokens.
const int h = blockIdx.x, t = blockIdx.y, n_head = gridDim.x;
__shared__ float acc[D];
__shared__ float row[KVROW ? D : 1];
if (KVROW) ds4lab_token_row<D, NROT>(kv, kv_weight, eps, rope_cos, rope_sin, carry, keys, n_keys, row, keys_out);
float m, l;
ds4lab_attend_keys<D, NROT, WARPS, QFINISH>(q, keys, KVROW ? row : nullptr, comp, mask, n_keys, eps, rope_cos,
                                            rope_sin, 0, n_keys[1], m, l, acc);
float weight;
ds4lab_share_weights<1>(sinks[h], &m, &l, &weight);
float* oh = out + ((size_t)t * n_head + h) * D;
for (int j = threadIdx.x; j < D / 2; j += blockDim.x) {
    float o0 = acc[2 * j] * weight, o1 = acc[2 * j + 1] * weight;
    ds4lab_unrotate_pair(o0, o1, 2 * j, D, NROT, t, rope_cos, rope_sin);
    oh[2 * j] = o0;
    oh[2 * j + 1] = o1;
}
