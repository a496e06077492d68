// expert_swiglu.cu for IQ2_XXS gate and up with the routed pairs' input as byte planes
// (expert_planes.cuh, made by router_planes.cu in the launch before): the same launch, grid
// and outputs, the routed rows' dots on integers (expert_dot_iq2_xxs_planes.cuh), and the
// shared expert's Q8_0 rows' too (q8_rows_planes.cuh): nothing reads x.
// Inputs: expert_swiglu.cu's but x, then planes (the buffer for the T tokens of x), then the grid.
DS4LAB_DOT_STAGE
DS4LAB_PLANES_STAGE
const int p = blockIdx.y, n_pairs = SHARED_ROWS > 0 ? gridDim.y / (X_DIV + 1) * X_DIV : gridDim.y;
const int token = p < n_pairs ? p / X_DIV : p - n_pairs;
ds4lab_swiglu_rows<ROWS, COLS, ROW_BYTES, EXPERT_BYTES, X_DIV, SHARED_ROWS, P>(
    blockIdx.x, p, n_pairs, p < n_pairs ? ids[p] : 0, p < n_pairs ? w[p] : 0.0f, raw_gate, raw_up,
    ds4lab_token_planes<COLS>(planes, n_pairs / X_DIV, token), clamp[0],
    codes_g, scales_g, codes_u, scales_u, mid, shared DS4LAB_PLANES_TABLES);
