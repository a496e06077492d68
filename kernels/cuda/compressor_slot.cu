// A compressor's decode step that completes no window (model/compressor.py `_decode_step`):
// the token's kv and score rows written into its frontier slot. The new frontier is the old
// one with row `at[0]` replaced: kv_out[at] = W_kv · x, score_out[at] = W_gate · x + ape[at[1]]
// (the APE row of the token's window slot). Every other row is copied unchanged, except with
// SHIFT (a ratio-4 compressor's step that completes its window, whose frontier holds two
// windows): rows 0..RATIO-1 then take the window just completed, rows RATIO..2·RATIO-1 with
// the token's row in its place (row 2·RATIO-1), so the last output row of that half is the token.
//
// One warp per output column c of one of the two matrices (warp w: matrix w / R, column
// w % R, R = the frontier's width): the lanes read the matrix row c (contiguous, COLS values)
// with a stride of 32, sum in column order, then a warp sum; the warp also copies its column
// of the frontier, lanes over the rows. Replaces two float32 GEMVs, a gather and two selects.
// The slot comes in as data (`at`), so one compiled kernel serves every position.
// A ratio-4 layer's two compressors (the attention's and the indexer's: the same ratio,
// slot and shift, other widths) take one launch: the second's warps follow the first's.
// Inputs: x [COLS] float32, w_kv / w_gate [R, COLS] (float32, or F16 widened as loaded:
// all four matrices alike), ape [RATIO, R], kv / score [ROWS, R],
// then the second compressor's (R2, ROWS2; R2 = 0: none, and its outputs are not written),
// at [2] int32 (frontier row, APE row). Outputs: kv_out, score_out, then the second's.
// Grid: 32 threads per warp, 2·R + 2·R2 warps.
const int lane = threadIdx.x & 31;
int warp = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
const bool second = warp >= 2 * R;
if (second) warp -= 2 * R;
const int r = second ? R2 : R, rows = second ? ROWS2 : ROWS;
if (warp >= 2 * r) return;
const bool is_score = warp >= r;
const int c = is_score ? warp - r : warp;
const auto* w = (second ? (is_score ? w_gate2 : w_kv2) : (is_score ? w_gate : w_kv)) + (size_t)c * COLS;
float acc = 0.0f;
for (int j = lane; j < COLS; j += 32) acc += ds4lab_widen(w[j]) * x[j];
#pragma unroll
for (int offset = 16; offset > 0; offset >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, offset);
const int row = at[0];
const float value = is_score ? acc + (second ? ape2 : ape)[(size_t)at[1] * r + c] : acc;
const float* src = second ? (is_score ? score2 : kv2) : (is_score ? score : kv);
float* dst = second ? (is_score ? score_out2 : kv_out2) : (is_score ? score_out : kv_out);
for (int i = lane; i < rows; i += 32) {
    const int from = SHIFT && i < RATIO ? i + RATIO : i;
    dst[(size_t)i * r + c] = from == row ? value : src[(size_t)from * r + c];
}
