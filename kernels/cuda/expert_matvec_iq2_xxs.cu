// y[p, row] = sum_c W[ids[p]][row, c] * x[p, c] for IQ2_XXS blocks (66 bytes per 256 values):
// f16 d, then per 32 values 4 grid indices and a u32 of four 7-bit sign indices plus a
// 4-bit scale s; w = d * (0.5 + s) * 0.25 * grid * sign.
DS4LAB_EXPERT_ROW_BEGIN(66)
const int sub = lane >> 2, part = lane & 3;
float acc = 0.0f;
for (int b = 0; b < COLS / 256; ++b) {
    const uint8_t* blk = w + b * 66;
    const uint8_t* s8 = blk + 2 + 8 * sub;
    const uint32_t aux = (uint32_t)s8[4] | ((uint32_t)s8[5] << 8) | ((uint32_t)s8[6] << 16) | ((uint32_t)s8[7] << 24);
    const float db = ds4lab_f16_at(blk) * (0.5f + (float)(aux >> 28)) * 0.25f;
    const uint8_t* g = grid + 8 * (int)s8[part];
    const uint8_t signs = ksigns[(aux >> (7 * part)) & 127];
    const float* xs = xv + b * 256 + lane * 8;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const float v = (signs >> k) & 1 ? -(float)g[k] : (float)g[k];
        acc += db * v * xs[k];
    }
}
DS4LAB_EXPERT_ROW_END(acc)
