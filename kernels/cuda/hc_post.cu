// HC post-sublayer (model/hc.py `hc_expand`), one thread per output value: stream c of the
// new residual gets post[c] * out + sum_a comb[a][c] * streams[a] (ds4lab_hc_value). [T, N, E]
// from out [T, E]; with ADD, out is out + add (the FFN's routed and shared outputs, added as
// the reference does).
const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
if (i >= (size_t)n_tok[0] * N * E) return;
const int d = i % E;
const int c = (i / E) % N;
const size_t t = i / ((size_t)E * N);
const float o = ADD ? out[t * E + d] + add[t * E + d] : out[t * E + d];
y[i] = ds4lab_hc_value<N, E>(o, streams, post, comb, t, c, d);
