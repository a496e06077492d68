// The FFN input as the IQ2_XXS gate and up take it on the integer path (router_planes.cu makes
// it, expert_swiglu_planes.cu reads it; ds4lab/model/kernels.py `input_planes` is the same in
// numpy). Why: the float dot spends a byte permute and an FMA on every weight, plus its share
// of the signs and scales (5.4 instructions a weight); with the input as integers a weight
// byte, sign included, comes from one permute for four values and dp4a multiplies four
// values at once (~2.6 instructions a weight).
// Each 32-value group of a token's input row is held as three byte planes and a power of two:
//   x = scale * (p0 * 65536 + p1 * 256 + p2),  p0 signed (int8), p1 and p2 unsigned (uint8),
// where scale = 2^(E - 20) and E is the exponent of the group's largest magnitude m
// (2^E <= m < 2^(E+1)): q = rint(x / scale) is exact to compute (a power of two, then one
// rounding) and |q| <= 2^21, so p0 = q >> 16 (floor) lies in [-32, 32]. Each value keeps 21
// bits below the group's largest, as a float keeps 24 of its own: the rounding error is at
// most 2^-21 of m. (p0 that small lets the IQ2_XXS dot keep one int32 sum:
// expert_dot_iq2_xxs_planes.cuh.) A group whose largest magnitude is below 2^-100 is held as
// zeros (scale 0); one holding an infinity or a NaN gets scale NaN, so that the dots it feeds
// are NaN (those values' bytes are zeros).
// Layout of a launch's buffer for T tokens of COLS values (G = COLS / 32 groups a token):
// first the planes, token t's group g at byte (t * G + g) * 96: p0 of its 32 values, then
// p1, then p2 (32 bytes each, 16-byte aligned); then the scales, float32 [T, G].
struct ds4lab_planes {
    const uint8_t* bytes;   // the token's first group
    const float* scales;    // the token's first group's scale
};

// The planes of token t in a buffer of T tokens of COLS values.
template <int COLS>
__device__ __forceinline__ ds4lab_planes ds4lab_token_planes(const uint8_t* buffer, int n_tokens, int t) {
    constexpr int G = COLS / 32;
    return {buffer + (size_t)t * G * 96, reinterpret_cast<const float*>(buffer + (size_t)n_tokens * G * 96) + t * G};
}

// Group g of token row xt into its planes (one warp, lane k the group's value k).
__device__ __forceinline__ void ds4lab_make_planes(const float* xt, uint8_t* bytes_t, float* scales_t, int g, int lane) {
    const float v = xt[g * 32 + lane];
    const bool finite = fabsf(v) <= 3.402823466e38f;          // false for inf and NaN
    float m = finite ? fabsf(v) : 0.0f;
    for (int offset = 16; offset > 0; offset >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
    const uint32_t e = __float_as_uint(m) >> 23;               // m >= 0: the biased exponent
    const bool zero = e < 27;                                  // m < 2^-100 (or 0)
    // x / scale = x * 2^(20 - E): biased exponent 147 - e + 127; scale's e - 20 (both normal for 27 <= e <= 254)
    const int q = zero || !finite ? 0 : __float2int_rn(v * __uint_as_float((274u - e) << 23));
    uint8_t* out = bytes_t + g * 96;
    out[lane] = (uint8_t)(q >> 16);
    out[32 + lane] = (uint8_t)(q >> 8);
    out[64 + lane] = (uint8_t)q;
    const bool all_finite = __all_sync(0xffffffffu, finite);
    if (lane == 0) scales_t[g] = !all_finite ? __int_as_float(0x7fc00000) : zero ? 0.0f : __uint_as_float((e - 20u) << 23);
}

// One token's planes, warp `warp` of `n_warps` taking every n_warps-th group.
template <int COLS>
__device__ __forceinline__ void ds4lab_make_token_planes(const float* xt, uint8_t* buffer, int n_tokens, int t,
                                                         int warp, int n_warps, int lane) {
    constexpr int G = COLS / 32;
    uint8_t* bytes_t = buffer + (size_t)t * G * 96;
    float* scales_t = reinterpret_cast<float*>(buffer + (size_t)n_tokens * G * 96) + t * G;
    for (int g = warp; g < G; g += n_warps) ds4lab_make_planes(xt, bytes_t, scales_t, g, lane);
}

// dp4a, as the dots on the planes use it: c + the dot of a's four signed bytes with b's four
// bytes, signed (ss) or unsigned (su).
#ifdef __CUDA_ARCH__
__device__ __forceinline__ int ds4lab_dp4a_ss(uint32_t a, uint32_t b, int c) {
    int d;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
__device__ __forceinline__ int ds4lab_dp4a_su(uint32_t a, uint32_t b, int c) {
    int d;
    asm("dp4a.s32.u32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
#endif

// c + the dot of 16 signed bytes v (four words) with a plane's 16 bytes: p0 signed (ss), p1
// and p2 unsigned (su); four dp4a in one chain.
__device__ __forceinline__ int ds4lab_plane_dot_ss(const uint32_t (&v)[4], uint4 plane, int c) {
    return ds4lab_dp4a_ss(v[3], plane.w, ds4lab_dp4a_ss(v[2], plane.z, ds4lab_dp4a_ss(v[1], plane.y,
                          ds4lab_dp4a_ss(v[0], plane.x, c))));
}
__device__ __forceinline__ int ds4lab_plane_dot_su(const uint32_t (&v)[4], uint4 plane, int c) {
    return ds4lab_dp4a_su(v[3], plane.w, ds4lab_dp4a_su(v[2], plane.z, ds4lab_dp4a_su(v[1], plane.y,
                          ds4lab_dp4a_su(v[0], plane.x, c))));
}
