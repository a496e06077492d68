// Shared helpers of the routed-expert matvec (ds4lab/model/kernels.py `expert_matvec`).
// Each block format's header (expert_dot_*.cuh) defines ds4lab_expert_dot<COLS, R>: one
// lane's share of the dot products of R weight rows in that format with one activation,
// added to acc[R]. Lanes take 8 or 16 consecutive values of a 256-value block (the format
// says which), decode them from the block bytes and multiply them with the activation; the
// kernels sum the lanes.
// The R rows share the lane's activation loads: on these shapes the kernels read more bytes
// of the (cached) activation than of the weights, so a warp takes two rows (expert_matvec)
// or a row of gate and of up (expert_swiglu) at once. Each row keeps its own sum, in the
// same order as one row alone.
// A block gives a lane only a few bytes, far too little to hide the memory latency, so each
// format walks the rows U steps at a time (a step: a block, or two blocks for formats whose
// lanes take 16 values): first the loads of all U steps of every row (in flight together),
// then their arithmetic.
// A format may need lookup tables in shared memory: its DS4LAB_DOT_STAGE copies them there
// (the whole thread block, before any thread returns) and DS4LAB_DOT_TABLES passes them on.
// prmt.b32 as PTX defines it: byte n of the result is byte (s >> 4n) & 7 of {b, a}, or, when
// bit 3 of that nibble is set, that byte's top bit copied into all 8 bits (its sign mode,
// which __byte_perm's documentation leaves out). The host tests define their own copy.
// A Metal port has no byte permute: shifts and masks make the same word.
#ifdef __CUDA_ARCH__
__device__ __forceinline__ uint32_t ds4lab_prmt(uint32_t a, uint32_t b, uint32_t s) {
    uint32_t r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(s));
    return r;
}
#endif
__device__ __forceinline__ float ds4lab_warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
    return v;
}

// Steps at a time for R rows: the largest of 8 / R, 4, 2, 1 (at most 8 / R) that divides
// the row's step count NB, so that at most 8 steps' loads are in flight per lane.
template <int NB, int R>
struct ds4lab_step {
    static constexpr int M = 8 / R;
    static constexpr int U = M >= 8 && NB % 8 == 0 ? 8 : M >= 4 && NB % 4 == 0 ? 4 : M >= 2 && NB % 2 == 0 ? 2 : 1;
};

// 8 activations from at (16-byte aligned), as two float4 loads.
__device__ __forceinline__ void ds4lab_load8(const float* at, float xs[8]) {
    const float4 a = *reinterpret_cast<const float4*>(at);
    const float4 c = *reinterpret_cast<const float4*>(at + 4);
    xs[0] = a.x; xs[1] = a.y; xs[2] = a.z; xs[3] = a.w; xs[4] = c.x; xs[5] = c.y; xs[6] = c.z; xs[7] = c.w;
}

// The lane's 8 activations of block b (formats whose lanes take 8 values of every block).
__device__ __forceinline__ void ds4lab_lane_inputs(const float* xv, int b, int lane, float xs[8]) {
    ds4lab_load8(xv + b * 256 + lane * 8, xs);
}

// The sum of the lane's 8 activations (the K-quant formats' min term, shared by its R rows).
__device__ __forceinline__ float ds4lab_sum8(const float xs[8]) {
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; ++k) s += xs[k];
    return s;
}

// A small unsigned integer v (< 2^23) as a float without a conversion instruction (those run
// at 1/8 of the FMA rate, and the expert kernels convert every weight): 2^23 + v is the float
// whose mantissa bits are v, and subtracting 2^23 is exact.
__device__ __forceinline__ float ds4lab_small_uint(uint32_t v) { return __uint_as_float(v | 0x4B000000u) - 8388608.0f; }

// Small codes as subnormal floats (every expert dot): a word holding the code c
// (< 2^23) in its low bits, and a sign in bit 31, is the float +-c * 2^-149, exactly. With the
// inputs scaled by 2^64 as loaded (DS4LAB_INPUT_SCALE) each product c * x * 2^-85 is a normal
// float, and so every sum of them is the unscaled sum times 2^-85 with the same roundings (the
// same bits once the block's scale, times 2^85, multiplies it: DS4LAB_CODE_SCALE). A value then
// costs a byte permute and an FMA (FP32 FMA takes subnormal operands at full rate; nothing here
// flushes them). Inputs of magnitude 2^64 or more would overflow: activations are far below.
// A port to a GPU or compiler mode that flushes subnormals (Metal's fast math) must use the
// normal form instead: the code moved into the mantissa of 2^23, 2^23 subtracted (one more
// instruction a value, q8_rows.cuh's form), with unscaled inputs.
#define DS4LAB_INPUT_SCALE 0x1p64f
#define DS4LAB_CODE_SCALE 0x1p85f

// A lane's N inputs as the subnormal codes' dots take them: times DS4LAB_INPUT_SCALE (exact).
template <int N>
__device__ __forceinline__ void ds4lab_scale_inputs(float (&xs)[N]) {
#pragma unroll
    for (int k = 0; k < N; ++k) xs[k] *= DS4LAB_INPUT_SCALE;
}

// A K-quant block's d * scale and dmin * min (dd: f16 d, then f16 dmin) for ds4lab_kquant_dot8
// and the Q2_K dot, each times the power of two that the scaled codes and inputs undo: the same
// bits in the end.
__device__ __forceinline__ void ds4lab_kquant_scales(uint32_t dd, uint32_t scale, uint32_t min, float& dl, float& ml) {
    dl = ds4lab_f16_bits(dd) * ((float)scale * DS4LAB_CODE_SCALE);
    ml = ds4lab_f16_bits(dd >> 16) * ((float)min * (1.0f / DS4LAB_INPUT_SCALE));
}

// acc + sum over k < 4 of byte k of `bytes` times xs[k] (xs scaled by DS4LAB_INPUT_SCALE; the
// sum then is 2^-85 times the codes' dot), the bytes small codes (a K-quant's bits already
// masked out of their byte): each becomes its subnormal float by one byte permute.
__device__ __forceinline__ float ds4lab_codes4_dot(float acc, uint32_t bytes, const float* xs) {
#pragma unroll
    for (int k = 0; k < 4; ++k) acc = fmaf(__uint_as_float(__byte_perm(bytes, 0u, 0x4440u | k)), xs[k], acc);
    return acc;
}

// acc + sum over the lane's 8 values xs of a block of (dl * q - ml) * x, the K-quant row form
// (d * scale * q - dmin * min), with q = (byte >> shift) & MASK of the 8 code bytes in lo, hi:
// computed as dl * sum(q * x) - ml * xsum (xsum = ds4lab_sum8(xs)), the codes as subnormals
// (xs scaled by DS4LAB_INPUT_SCALE, dl by DS4LAB_CODE_SCALE, ml by 1 / DS4LAB_INPUT_SCALE).
template <uint32_t MASK>
__device__ __forceinline__ float ds4lab_kquant_dot8(float acc, float dl, float ml, uint32_t lo, uint32_t hi, int shift,
                                                   const float xs[8], float xsum) {
    constexpr uint32_t BYTES = MASK * 0x01010101u;
    const float qx = ds4lab_codes4_dot(ds4lab_codes4_dot(0.0f, (lo >> shift) & BYTES, xs), (hi >> shift) & BYTES, xs + 4);
    return fmaf(dl, qx, fmaf(-ml, xsum, acc));
}
