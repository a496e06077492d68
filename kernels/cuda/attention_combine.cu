// The shares of a decode (token, head)'s attention (attention_partial.cu) added with the
// head's sink logit in the denominator, then the inverse RoPE of the query position on the
// output's last NROT dims: what decode_attention.cu computes in one block.
// Inputs: part_ml [T, H, SHARES, 2], part_acc [T, H, SHARES, D], sinks [H], rope_cos/rope_sin
// [T, NROT/2]. Output [T, H, D]. Grid: x = the heads (a block each), y = the tokens.
const int h = blockIdx.x, t = blockIdx.y, n_head = gridDim.x;
const size_t first = ((size_t)t * n_head + h) * SHARES;
float m[SHARES], l[SHARES], w[SHARES];
for (int z = 0; z < SHARES; ++z) {
    m[z] = part_ml[2 * (first + z)];
    l[z] = part_ml[2 * (first + z) + 1];
}
ds4lab_share_weights<SHARES>(sinks[h], m, l, w);
float* oh = out + ((size_t)t * n_head + h) * D;
for (int j = threadIdx.x; j < D / 2; j += blockDim.x) {
    float o0 = 0.0f, o1 = 0.0f;
    for (int z = 0; z < SHARES; ++z) {
        o0 += part_acc[(first + z) * D + 2 * j] * w[z];
        o1 += part_acc[(first + z) * D + 2 * j + 1] * w[z];
    }
    ds4lab_unrotate_pair(o0, o1, 2 * j, D, NROT, t, rope_cos, rope_sin);
    oh[2 * j] = o0;
    oh[2 * j + 1] = o1;
}
