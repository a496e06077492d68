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
// Inputs: x [COLS] float32, w_kv / w_gate [R, COLS], ape [RATIO, R], kv / score [ROWS, R],
// at [2] int32 (frontier row, APE row). Grid: 32 threads per warp, 2·R warps.
const int lane = threadIdx.x & 31;
const int warp = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
if (warp >= 2 * R) return;
const bool is_score = warp >= R;
const int c = is_score ? warp - R : warp;
const float* w = (is_score ? w_gate : w_kv) + (size_t)c * COLS;
float acc = 0.0f;
for (int j = lane; j < COLS; j += 32) acc += w[j] * x[j];
#pragma unroll
for (int offset = 16; offset > 0; offset >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, offset);
const int row = at[0];
const float value = is_score ? acc + ape[(size_t)at[1] * R + c] : acc;
const float* src = is_score ? score : kv;
float* dst = is_score ? score_out : kv_out;
for (int i = lane; i < ROWS; i += 32) {
    const int from = SHIFT && i < RATIO ? i + RATIO : i;
    dst[(size_t)i * R + c] = from == row ? value : src[(size_t)from * R + c];
}
