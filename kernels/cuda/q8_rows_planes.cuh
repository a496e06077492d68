// ds4lab_q8_dots (q8_rows.cuh) on the input as byte planes (expert_planes.cuh): the shared
// expert's Q8_0 gate and up in expert_swiglu_planes.cu, on integers as its routed rows are, so
// that the launch reads no float input at all. The same lanes and chunks as the float loop (a
// lane takes 16 values of a 32-value group, chunk j; a row's 16 codes are one 16-byte load).
// A Q8_0 byte is code + 128, so byte ^ 0x80 is the code as a signed byte: four codes a logic
// operation, then one dp4a a plane for four values, where the float loop spends a permute, a
// subtraction and an FMA on each value. The codes reach 128 in magnitude (the IQ2_XXS levels
// only 43), so p0's sum cannot share the int32 chain of the other two (16 * 128 * 32 * 65536 =
// 2^32): it has its own (|hi| <= 2^16), p1's and p2's make the other (|lo| <= 16 * 128 * 255
// * 257 < 2^28), and they meet in float as hi * 65536 + lo (an exact product, one rounding),
// times the row's block scale and the input group's.
template <int NR, int COLS>
__device__ __forceinline__ void ds4lab_q8_dots(const uint4* const* w, const float* const* s, ds4lab_planes xin,
                                               int lane, float* acc) {
#pragma unroll
    for (int i = 0; i < NR; ++i) acc[i] = 0.0f;
#pragma unroll (NR < 8 ? 8 / NR : 1)
    for (int j = lane; j < COLS / 16; j += 32) {
        const uint4* planes = reinterpret_cast<const uint4*>(xin.bytes + (j >> 1) * 96 + (j & 1) * 16);
        const uint4 p0 = planes[0], p1 = planes[2], p2 = planes[4];
        const float xscale = xin.scales[j >> 1];
#pragma unroll
        for (int i = 0; i < NR; ++i) {
            const uint4 q = w[i][j];
            const uint32_t c[4] = {q.x ^ 0x80808080u, q.y ^ 0x80808080u, q.z ^ 0x80808080u, q.w ^ 0x80808080u};
            const int hi = ds4lab_plane_dot_ss(c, p0, 0);
            const int lo = ds4lab_plane_dot_su(c, p2, ds4lab_plane_dot_su(c, p1, 0) * 256);
            acc[i] = fmaf(s[i][j >> 1] * xscale, fmaf((float)hi, 65536.0f, (float)lo), acc[i]);
        }
    }
}
