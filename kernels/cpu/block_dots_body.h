/* The block-format row dots of block_dots.h, included once per instruction set with
 * DOT_TARGET (a target attribute), DOT_NAME (the name's suffix) and WIDEN8 (eight bytes to
 * int32 lanes) defined. The float operations are the same in every copy. */
DOT_TARGET static float DOT_NAME(dot_iq2_xxs)(const uint8_t *row, const float *x, int64_t n, const uint8_t *grid,
                                               const uint8_t *ksigns) {
    static const ilanes_t bit = {1, 2, 4, 8, 16, 32, 64, 128};
    lanes_t a[4] = {{0}, {0}, {0}, {0}};
    for (int64_t b = 0; b < n / QK; b++) {
        const uint8_t *blk = row + b * 66;
        const float d = half_to_float(blk);
        for (int s = 0; s < 8; s++) {
            uint32_t index, aux;
            memcpy(&index, blk + 2 + 8 * s, 4);
            memcpy(&aux, blk + 6 + 8 * s, 4);
            const float db = d * (0.5f + (float)(aux >> 28)) * 0.25f;
            for (int l = 0; l < 4; l++) {
                const ilanes_t g = WIDEN8(grid + 8 * ((index >> 8 * l) & 255));
                /* -1 in the lanes whose sign bit is set, else 0: (g ^ flip) - flip negates those */
                const ilanes_t flip = (((ilanes_t){0} + ksigns[(aux >> 7 * l) & 127]) & bit) != 0;
                const lanes_t v = __builtin_convertvector((g ^ flip) - flip, lanes_t);
                a[l] = a[l] + (db * v) * load_floats(x + b * QK + 32 * s + 8 * l);
            }
        }
    }
    return sum_accumulators(a);
}

DOT_TARGET static float DOT_NAME(dot_q2_k)(const uint8_t *row, const float *x, int64_t n, const uint8_t *grid,
                                            const uint8_t *ksigns) {
    (void)grid, (void)ksigns;
    lanes_t a[4] = {{0}, {0}, {0}, {0}};
    for (int64_t b = 0; b < n / QK; b++) {
        const uint8_t *blk = row + b * 84;
        const float d = half_to_float(blk + 80), dmin = half_to_float(blk + 82);
        for (int h = 0; h < 2; h++)
            for (int j = 0; j < 4; j++)
                for (int c = 0; c < 4; c++) {               /* chunk c: values 8c..8c+7 of 32 */
                    const uint8_t sc = blk[8 * h + 2 * j + c / 2];
                    const float dl = d * (float)(sc & 15), ml = dmin * (float)(sc >> 4);
                    const ilanes_t q = (WIDEN8(blk + 16 + 32 * h + 8 * c) >> (2 * j)) & 3;
                    a[c] = a[c] + kquant_terms(dl, ml, q, x + b * QK + 128 * h + 32 * j + 8 * c);
                }
    }
    return sum_accumulators(a);
}

DOT_TARGET static float DOT_NAME(dot_q4_k)(const uint8_t *row, const float *x, int64_t n, const uint8_t *grid,
                                            const uint8_t *ksigns) {
    (void)grid, (void)ksigns;
    lanes_t a[4] = {{0}, {0}, {0}, {0}};
    for (int64_t b = 0; b < n / QK; b++) {
        const uint8_t *blk = row + b * 144, *s = blk + 4;
        const float d = half_to_float(blk), dmin = half_to_float(blk + 2);
        for (int g = 0; g < 8; g++) {
            const int sc = g < 4 ? s[g] & 63 : (s[g + 4] & 15) | (s[g - 4] >> 6) << 4;
            const int mn = g < 4 ? s[g + 4] & 63 : (s[g + 4] >> 4) | (s[g] >> 6) << 4;
            const float dl = d * (float)sc, ml = dmin * (float)mn;
            for (int c = 0; c < 4; c++) {
                const ilanes_t q = (WIDEN8(blk + 16 + 32 * (g / 2) + 8 * c) >> (4 * (g & 1))) & 15;
                a[c] = a[c] + kquant_terms(dl, ml, q, x + b * QK + 32 * g + 8 * c);
            }
        }
    }
    return sum_accumulators(a);
}

