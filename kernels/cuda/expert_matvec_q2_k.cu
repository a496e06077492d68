// y[p, row] = sum_c W[ids[p]][row, c] * x[p, c] for Q2_K blocks (84 bytes per 256 values):
// 16 scale bytes (low nibble scale, high nibble min, per 16 values), 64 bytes of 2-bit
// codes, f16 d and dmin; w = d * scale * q - dmin * min.
DS4LAB_EXPERT_ROW_BEGIN(84)
const int first = lane * 8, half = first >> 7, within = first & 127;
const int shift = 2 * (within >> 5), k0 = within & 31;
float acc = 0.0f;
for (int b = 0; b < COLS / 256; ++b) {
    const uint8_t* blk = w + b * 84;
    const uint8_t sc = blk[lane >> 1];
    const float dl = ds4lab_f16_at(blk + 80) * (float)(sc & 15);
    const float ml = ds4lab_f16_at(blk + 82) * (float)(sc >> 4);
    const uint8_t* q = blk + 16 + 32 * half + k0;
    const float* xs = xv + b * 256 + first;
#pragma unroll
    for (int k = 0; k < 8; ++k) acc += (dl * (float)((q[k] >> shift) & 3) - ml) * xs[k];
}
DS4LAB_EXPERT_ROW_END(acc)
