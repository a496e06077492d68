// The routed experts' gate, up and SwiGLU for a decode step on the tensor cores: what
// expert_swiglu.cu computes, mid[p][row] = swiglu(G . x, U . x) * w[p], for the block formats
// with a tensor-core decode (expert_tc_*.cuh, one lane's 8 values of a 32-value group as f16).
// Why: the scalar kernel spends ~11 instructions on every IQ2_XXS value (its decode and
// conversion) and is bound by instruction issue; here a lane decodes 8 values in ~20 and one
// mma.m16n8k16 multiplies 16 rows by 16 of them. Exact to float32 as quant_gemm.cu is: q are
// small integers, x is two f16 halves (hi + lo) of x scaled by a power of two, the products
// over a group are float32 sums of exact products, and the group's dl is applied outside.
//
// Tile: a warp takes 8 output rows, gate's as the mma's rows 0-7 and up's as rows 8-15, over
// its share of the row's 256-value blocks (warp w: blocks w, w + WARPS, ...: more warps, so
// more loads in flight, than a warp per row-tile would give); the block's warps then add
// their sums in warp order. Inside a 32-value group the k order is permuted so that lane
// (g, t4) holds grid entry t4 of row g: mma h in {0, 1} takes the entry's values 4h + {0, 1}
// in k slots {2t4, 2t4 + 1} and 4h + {2, 3} in slots {2t4 + 8, 2t4 + 9}, and the x fragment
// takes the same columns. x's column 0 is its hi half (lanes g = 0), column 1 its lo half
// (g = 1), the rest zero: D's columns 0 and 1 (lanes t4 = 0) are the row's two partial
// products, added and scaled by the group's dl.
// Each warp stages the x of its own blocks in shared memory, scaled by 2^k (its largest
// value just under 2^14, gemm_split_x.cu's rule) and split into hi and lo halves.
//
// Inputs: raw_gate, raw_up [n_expert, EXPERT_BYTES] uint8 (ROW_BYTES per row), ids (pairs,
// int32), x [pairs / X_DIV, COLS], w (pairs), clamp [1] (0: none), the format's tables.
// Grid: x = WARPS warps per 8 rows; y = the pair.
constexpr int NB = COLS / 256, SPAN = (NB + WARPS - 1) / WARPS;
__shared__ __align__(16) __half xs[WARPS][2][SPAN * 256];
__shared__ float sums[WARPS][8][2];
DS4LAB_DOT_STAGE
const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t4 = lane & 3;
const int p = blockIdx.y, row = blockIdx.x * 8 + g;
const size_t at = (size_t)ids[p] * EXPERT_BYTES + (size_t)min(row, ROWS - 1) * ROW_BYTES;
const uint8_t* gate_row = raw_gate + at;
const uint8_t* up_row = raw_up + at;
const float* xp = x + (size_t)(p / X_DIV) * COLS;

float amax = 0.0f;
for (int i = 0; i < SPAN && warp + WARPS * i < NB; ++i)
    for (int c = lane; c < 256; c += 32) amax = fmaxf(amax, fabsf(xp[256 * (warp + WARPS * i) + c]));
int ex = 0;
frexpf(ds4lab_warp_max_all(amax), &ex);
const int k = min(14 - ex, 100);
const float scale = ds4lab_pow2(k);
for (int i = 0; i < SPAN && warp + WARPS * i < NB; ++i)
    for (int c = lane; c < 256; c += 32) {
        const float v = xp[256 * (warp + WARPS * i) + c] * scale;
        const __half hi = __float2half_rn(v);
        xs[warp][0][256 * i + c] = hi;
        xs[warp][1][256 * i + c] = __float2half_rn(v - __half2float(hi));
    }
__syncwarp();

const __half* my_x = xs[warp][g & 1];
float acc_g = 0.0f, acc_u = 0.0f;
for (int i = 0; i < SPAN && warp + WARPS * i < NB; ++i) {
    const int b = warp + WARPS * i;
    const uint32_t dg = ds4lab_tc_block_d(gate_row, b), du = ds4lab_tc_block_d(up_row, b);
    ds4lab_tc_group rg[8], ru[8];
#pragma unroll
    for (int group = 0; group < 8; ++group) {
        rg[group] = ds4lab_tc_load(gate_row, b, group, t4);
        ru[group] = ds4lab_tc_load(up_row, b, group, t4);
    }
#pragma unroll
    for (int group = 0; group < 8; ++group) {
        uint32_t qg[4], qu[4];
        const float dlg = ds4lab_tc_unpack(rg[group], dg, t4, ds4lab_grid_s, ds4lab_ksigns_s, qg);
        const float dlu = ds4lab_tc_unpack(ru[group], du, t4, ds4lab_grid_s, ds4lab_ksigns_s, qu);
        float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const uint2 xv = *reinterpret_cast<const uint2*>(my_x + 256 * i + 32 * group + 8 * t4 + 4 * h);
            const uint32_t bf[2] = {g < 2 ? xv.x : 0u, g < 2 ? xv.y : 0u};
            const uint32_t af[4] = {qg[2 * h], qu[2 * h], qg[2 * h + 1], qu[2 * h + 1]};
            ds4lab_mma_f16(d, af, bf);
        }
        acc_g = fmaf(dlg, d[0] + d[1], acc_g);
        acc_u = fmaf(dlu, d[2] + d[3], acc_u);
    }
}
const float unscale = ds4lab_pow2(-k);
if (t4 == 0) {
    sums[warp][g][0] = acc_g * unscale;
    sums[warp][g][1] = acc_u * unscale;
}
__syncthreads();
if (warp == 0 && t4 == 0 && row < ROWS) {
    float gate = 0.0f, up = 0.0f;
    for (int from = 0; from < WARPS; ++from) {
        gate += sums[from][g][0];
        up += sums[from][g][1];
    }
    mid[(size_t)p * ROWS + row] = ds4lab_swiglu(gate, up, clamp[0]) * w[p];
}
