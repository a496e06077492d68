// A compressor's decode step that completes no window, one or two compressors of a layer
// (compressor_slot.cuh): the whole grid on the slot. Inputs and outputs as there.
ds4lab_compressor_slot<R, COLS, ROWS, R2, ROWS2, RATIO, SHIFT>(blockIdx.x, gridDim.x, x, w_kv, w_gate, ape, kv,
                                                              score, w_kv2, w_gate2, ape2, kv2, score2, at,
                                                              kv_out, score_out, kv_out2, score_out2);
