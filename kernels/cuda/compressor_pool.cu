// The row a compressor emits when a decode token completes its window (model/compressor.py
// `_pool` over `compress_chunk`'s candidates), before the row steps (`row_finish.cu`): per
// output dim d, a softmax over the candidates' scores weighs their kv values; a dim whose
// candidates all hold the empty score (-1e30) pools to 0.
// Candidates come from the frontier after the token (new_*, `compressor_slot.cu`): its window,
// rows 0..RATIO-1. With OVERLAP (ratio 4, frontier rows of 2·WIDTH) they are the previous
// window's first halves (old_* rows 0..RATIO-1, dims 0..WIDTH-1) and the new window's second
// halves (new_* rows 0..RATIO-1, dims WIDTH..2·WIDTH-1), in that order.
// Inputs: old_kv, old_score, new_kv, new_score [rows, R]. One thread per dim of out [1, WIDTH].
const int d = blockIdx.x * blockDim.x + threadIdx.x;
if (d >= WIDTH) return;
constexpr int N = OVERLAP ? 2 * RATIO : RATIO;
// Candidate i: row i % RATIO; from the old frontier (dim d) for the first RATIO with OVERLAP,
// else from the new one (dim d, or WIDTH + d with OVERLAP).
auto is_old = [&](int i) { return OVERLAP && i < RATIO; };
auto at = [&](int i) { return (size_t)(i % RATIO) * R + d + (OVERLAP && !is_old(i) ? WIDTH : 0); };
auto score = [&](int i) { return is_old(i) ? old_score[at(i)] : new_score[at(i)]; };
float top = score(0);
for (int i = 1; i < N; ++i) top = fmaxf(top, score(i));
float weights = 0.0f, acc = 0.0f;
for (int i = 0; i < N; ++i) {
    const float w = expf(score(i) - top);
    weights += w;
    acc += w * (is_old(i) ? old_kv[at(i)] : new_kv[at(i)]);
}
out[d] = top <= -0.5e30f ? 0.0f : acc / weights;
