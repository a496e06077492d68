// The rows a decode token's completed window makes, one thread block a compressor: the
// layer's one, or (WIDTH2 > 0) a ratio-4 layer's two, the attention's then the indexer's.
// Per output dim d (model/compressor.py `_pool` over `compress_chunk`'s candidates) a softmax
// over the candidates' scores weighs their kv values; a dim whose candidates all hold the
// empty score (-1e30) pools to 0. With FINISH the row then takes its row steps in the same
// block (`Compressor._finished`, row_finish.cu's: RMSNorm with eps[0] times the norm's
// weight, RoPE of the last NROT dims at row pos[0] of the full (rope_cos, rope_sin) tables,
// Hadamard + FP4 (QAT: hscale, carry) or FP8 (FP8), f16): the same float operations over
// a block of row_finish's size, so the same bits as pool then row_finish; one launch for an
// emission instead of a pool, a row_finish and two table slices a compressor.
// Candidates come from the frontier after the token (new_*, `compressor_slot.cuh`): its
// window, rows 0..RATIO-1. With OVERLAP (ratio 4, frontier rows of 2·WIDTH) they are the
// previous window's first halves (old_* rows 0..RATIO-1, dims 0..WIDTH-1) and the new
// window's second halves (new_* rows 0..RATIO-1, dims WIDTH..2·WIDTH-1), in that order.
// Inputs: old_kv, old_score, new_kv, new_score [rows, R], norm [WIDTH], then the second's
// (R2, WIDTH2, QAT2, FP8_2), eps [2], rope_cos / rope_sin [positions, NROT / 2], pos [1],
// hscale [2] (1 / sqrt of each width, for QAT), carry. Outputs: out [1, WIDTH], out2 [1, WIDTH2].
// Grid: a block of 128 threads (row_finish's) a compressor.
__shared__ float row[WIDTH > WIDTH2 ? WIDTH : WIDTH2];
if (blockIdx.x == 0)
    ds4lab_emitted_row<R, WIDTH, RATIO, OVERLAP, FINISH, NROT, QAT, FP8>(
        old_kv, old_score, new_kv, new_score, norm, eps[0], rope_cos, rope_sin, pos[0], hscale[0], carry, row, out);
else
    ds4lab_emitted_row<R2, WIDTH2, RATIO, OVERLAP, FINISH, NROT, QAT2, FP8_2>(
        old_kv2, old_score2, new_kv2, new_score2, norm2, eps[1], rope_cos, rope_sin, pos[0], hscale[1], carry, row,
        out2);
