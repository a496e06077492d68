// y[p, row] = sum_c W[ids[p]][row, c] * x[p, c] for Q4_K blocks (144 bytes per 256 values):
// f16 d and dmin, 12 bytes of 6-bit (scale, min) pairs for 8 groups of 32, 128 bytes of
// nibbles (low nibbles first, per 64 values); w = d * scale * q - dmin * min.
DS4LAB_EXPERT_ROW_BEGIN(144)
const int first = lane * 8, group = first >> 5, chunk = first >> 6;
const int shift = 4 * ((first >> 5) & 1), k0 = first & 31;
float acc = 0.0f;
for (int b = 0; b < COLS / 256; ++b) {
    const uint8_t* blk = w + b * 144;
    const uint8_t* s = blk + 4;
    int sc, mn;
    if (group < 4) {
        sc = s[group] & 63;
        mn = s[group + 4] & 63;
    } else {
        sc = (s[group + 4] & 15) | ((s[group - 4] >> 6) << 4);
        mn = (s[group + 4] >> 4) | ((s[group] >> 6) << 4);
    }
    const float dl = ds4lab_f16_at(blk) * (float)sc;
    const float ml = ds4lab_f16_at(blk + 2) * (float)mn;
    const uint8_t* q = blk + 16 + 32 * chunk + k0;
    const float* xs = xv + b * 256 + first;
#pragma unroll
    for (int k = 0; k < 8; ++k) acc += (dl * (float)((q[k] >> shift) & 15) - ml) * xs[k];
}
DS4LAB_EXPERT_ROW_END(acc)
