// Shared device helpers of the fast-path kernels (ds4lab/model/kernels.py): warp and
// thread-block reductions, and ds4's scaled small-float round trip (FP8 E4M3FN, FP4 E2M1).
// Passed as the `header` of every kernel that includes this file's functions.
#include <cuda_fp16.h>

// A weight as float32: F16 matrices are read as stored (`LayerWeights.kernel_dense`: half
// the bytes) and widened as loaded, which is exact, so a kernel gives the same bits from
// either form. ds4lab_load4 reads 4 consecutive weights (16-byte or, F16, 8-byte aligned).
__device__ __forceinline__ float ds4lab_widen(float w) { return w; }
__device__ __forceinline__ float ds4lab_widen(__half w) { return __half2float(w); }
__device__ __forceinline__ float4 ds4lab_load4(const float* w, int j) { return reinterpret_cast<const float4*>(w)[j]; }
__device__ __forceinline__ float4 ds4lab_load4(const __half* w, int j) {
    const uint2 bits = reinterpret_cast<const uint2*>(w)[j];
    const float2 lo = __half22float2(*reinterpret_cast<const __half2*>(&bits.x));
    const float2 hi = __half22float2(*reinterpret_cast<const __half2*>(&bits.y));
    return make_float4(lo.x, lo.y, hi.x, hi.y);
}

// acc + a . b over one float4 of each, the products added to acc in element order (x, y, z,
// w): a float4 read of a row kept as the scalar sum of its four values.
__device__ __forceinline__ float ds4lab_dot4_add(float acc, float4 a, float4 b) {
    acc += a.x * b.x;
    acc += a.y * b.y;
    acc += a.z * b.z;
    acc += a.w * b.w;
    return acc;
}

__device__ __forceinline__ float ds4lab_warp_sum_all(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

// The warp's totals of the 32 values each lane holds in v, lane l getting value l's (returned;
// v is spent): each step a lane keeps half of its values, adds its partner's of that half and
// sends the other, so 31 shuffles make the 32 totals where 32 butterflies take 160. A
// total's terms are added in the butterfly's tree (lanes 16 apart, then 8, ...), so it has
// ds4lab_warp_sum_all's bits. Each step is a template of its own so that every index into v
// is a constant: as one loop over the steps NVRTC kept v in local memory.
template <int HALF>
__device__ __forceinline__ void ds4lab_transpose_step(float (&v)[32], int lane) {
    const bool upper = lane & HALF;
#pragma unroll
    for (int i = 0; i < HALF; ++i) {
        const float send = upper ? v[i] : v[i + HALF];
        const float keep = upper ? v[i + HALF] : v[i];
        v[i] = keep + __shfl_xor_sync(0xffffffffu, send, HALF);
    }
}

__device__ __forceinline__ float ds4lab_transpose_sum32(float (&v)[32], int lane) {
    ds4lab_transpose_step<16>(v, lane);
    ds4lab_transpose_step<8>(v, lane);
    ds4lab_transpose_step<4>(v, lane);
    ds4lab_transpose_step<2>(v, lane);
    ds4lab_transpose_step<1>(v, lane);
    return v[0];
}

__device__ __forceinline__ float ds4lab_warp_max_all(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

// Sum of v over the thread block (blockDim.x a multiple of 32, at most 1024); every thread
// gets the result. `scratch` is __shared__ float[32]; the call synchronises the block.
__device__ float ds4lab_block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    v = ds4lab_warp_sum_all(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float total = 0.0f;
    for (int w = 0; w < n_warps; ++w) total += scratch[w];
    __syncthreads();
    return total;
}

// A thread block's sums of M values each thread holds (acc[0..M)), in a fixed order: each
// warp's butterfly, then the warps in turn; out[j * stride] for j < M. scratch: 32 * M floats
// of shared memory. Mixer partial sums (hc_mix.cu, q8_hc.cu's NEXT) are made with it, a
// block's M sums `stride` apart (output-major: a warp per output reads its partials
// contiguously).
template <int M>
__device__ __forceinline__ void ds4lab_block_sums(const float* acc, float* scratch, float* out, int stride = 1) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int j = 0; j < M; ++j) {
        const float w = ds4lab_warp_sum_all(acc[j]);
        if (lane == 0) scratch[warp * M + j] = w;
    }
    __syncthreads();
    for (int j = threadIdx.x; j < M; j += blockDim.x) {
        float s = 0.0f;
        for (int w = 0; w < (int)(blockDim.x >> 5); ++w) s += scratch[w * M + j];
        out[(size_t)j * stride] = s;
    }
}

// Asks L2 for the 128-byte line holding p (no register written, nothing waited for): a last
// block's tail issues these for weights it reads only after its first round trips.
__device__ __forceinline__ void ds4lab_prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// Whether this thread block is the last of `blocks` to get here (every thread gets the
// answer): each block's writes before the call are then visible to the last one, which reads
// them with __ldcg (not through its L1). `counter` is an int in a buffer the kernel is given
// zeroed (kernels.py `_arrival_counters`): the last block sets it back to 0 for the next launch.
// So two launches must not share a counter at once (MLX runs a stream's kernels in order).
__device__ bool ds4lab_last_block(int* counter, int blocks) {
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(counter, 1) == blocks - 1;
        if (last) atomicExch(counter, 0);
    }
    __syncthreads();
    __threadfence();
    return last;
}

// This thread block's job in a launch whose blocks take their jobs in arrival order (every
// thread gets it): a ticket from `counter`, which the block drawing the last ticket sets back
// to zero (none is left to draw). A ticket past the grid means the counter was not zero at
// launch: the kernel traps rather than run past its outputs.
__device__ int ds4lab_ticket(int* counter) {
    __shared__ int job;
    if (threadIdx.x == 0) {
        job = atomicAdd(counter, 1);
        if (job == (int)gridDim.x - 1) atomicExch(counter, 0);
        if (job >= (int)gridDim.x) __trap();
    }
    __syncthreads();
    return job;
}

// A flag one thread block raises for others of the same launch once what it wrote is visible
// to them: called by the thread that wrote it, after the writes. The waiting block's thread
// reads the flag with acquire semantics, then what it guards through L2 (__ldcg), and hands
// that to its block after a __syncthreads. The flag must be zero at launch (and set back to
// zero by the launch, for the next). A wait lasts microseconds; one still waiting after a
// second (a flag never raised: a bug, or counters not zero at launch) traps, so that the
// launch fails with an error instead of holding the GPU until its process is killed.
__device__ __forceinline__ void ds4lab_raise_flag(int* flag) {
    __threadfence();
    atomicExch(flag, 1);
}
__device__ __forceinline__ unsigned long long ds4lab_nanoseconds() {
    unsigned long long ns;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
    return ns;
}
__device__ __forceinline__ void ds4lab_wait_flag(const int* flag) {
    const unsigned long long start = ds4lab_nanoseconds();
    for (;;) {
        int v;
        asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(flag) : "memory");
        if (v) return;
        __nanosleep(100);
        if (ds4lab_nanoseconds() - start > 1000000000ull) __trap();
    }
}

// RMSNorm's 1 / sqrt(mean(x^2) + eps) of the row xr (D values) over the thread block: each
// thread sums every blockDim.x-th square, then the block sums. row_finish (NORM) and q8_pair
// (NORM_A: q_a's norm) share it, so with equal blocks they give the same bits.
// A thread's loads go out eight at a time: with D known only at run time the compiler issues
// a plain loop's loads one after another, each an L2 round trip (a q_b product that normed q_a
// itself had eight of them before its first weight load). The squares are added in the loop's order.
__device__ float ds4lab_rms_inverse(const float* xr, int D, float eps, float* scratch) {
    constexpr int LOADS = 8;
    float ss = 0.0f;
    const int step = blockDim.x;
    int i = threadIdx.x;
    for (; i + (LOADS - 1) * step < D; i += LOADS * step) {
        float v[LOADS];
#pragma unroll
        for (int k = 0; k < LOADS; ++k) v[k] = xr[i + k * step];
#pragma unroll
        for (int k = 0; k < LOADS; ++k) ss += v[k] * v[k];
    }
    for (; i < D; i += step) ss += xr[i] * xr[i];
    ss = ds4lab_block_sum(ss, scratch);
    return 1.0f / sqrtf(ss / (float)D + eps);
}

// The f16 in the low 16 bits of `bits` (block scales read as words), as a float.
__device__ __forceinline__ float ds4lab_f16_bits(uint32_t bits) {
    return __half2float(__ushort_as_half((unsigned short)(bits & 0xffffu)));
}

// 2^k for integer k in [-126, 127], from the bits (exact).
__device__ __forceinline__ float ds4lab_pow2(int k) { return __int_as_float((k + 127) << 23); }

// Unbiased exponent of a non-negative float (-127 for zero and subnormals).
__device__ __forceinline__ int ds4lab_exponent(float a) { return (__float_as_int(a) >> 23) - 127; }

// ceilf(log2f(q)) for a positive normal q as ds4 computes it on glibc: the exponent, plus
// one when the mantissa reaches carry[e + 126] (model/numerics.py `log2f_carry_table`).
__device__ __forceinline__ int ds4lab_ceil_log2f(float q, const int* carry) {
    const int bits = __float_as_int(q);
    const int e = (bits >> 23) - 127;
    return e + ((bits & 0x7fffff) >= carry[e + 126] ? 1 : 0);
}

// One warp rounds the BLOCK values at p in place (model/numerics.py `_block_minifloat_round`):
// scale = 2^ceil(log2f(max(amax, floor) / fmax)), v = clamp(x / scale), then the nearest
// value of the format (MANT mantissa bits, smallest exponent MIN_EXP), ties to the even code.
template <int BLOCK, int MANT, int MIN_EXP>
__device__ void ds4lab_block_minifloat(float* p, float fmax, float amax_floor, const int* carry) {
    constexpr int PER = BLOCK / 32;
    const int lane = threadIdx.x & 31;
    float v[PER];
    float amax = 0.0f;
    for (int k = 0; k < PER; ++k) {
        v[k] = p[lane + 32 * k];
        amax = fmaxf(amax, fabsf(v[k]));
    }
    amax = fmaxf(ds4lab_warp_max_all(amax), amax_floor);
    const float scale = ds4lab_pow2(ds4lab_ceil_log2f(amax / fmax, carry));
    for (int k = 0; k < PER; ++k) {
        const float c = fminf(fmaxf(v[k] / scale, -fmax), fmax);
        const float a = fabsf(c);
        const float step = ds4lab_pow2(max(ds4lab_exponent(a), MIN_EXP) - MANT);
        const float r = rintf(a / step) * step;
        p[lane + 32 * k] = (c < 0.0f ? -r : r) * scale;
    }
}

// ds4's indexer rounding of a row of D_ values in place (model/numerics.py `indexer_qat`):
// the Hadamard transform (butterflies with stride 1, 2, ...: each sum and difference rounded
// as the reference rounds them), times hscale = 1/sqrt(D_), then FP4 E2M1 in blocks of 32,
// a warp a block. The whole thread block calls it on a row it has written and synchronised;
// the call synchronises the block.
__device__ void ds4lab_hadamard_fp4(float* row, int D_, float hscale, const int* carry) {
    const int warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    for (int stride = 1; stride < D_; stride *= 2) {
        for (int j = threadIdx.x; j < D_ / 2; j += blockDim.x) {
            const int i = (j / stride) * 2 * stride + j % stride;
            const float a = row[i], b = row[i + stride];
            row[i] = __fadd_rn(a, b);
            row[i + stride] = __fsub_rn(a, b);
        }
        __syncthreads();
    }
    for (int i = threadIdx.x; i < D_; i += blockDim.x) row[i] = __fmul_rn(row[i], hscale);
    __syncthreads();
    for (int b = warp; b < D_ / 32; b += n_warps)
        ds4lab_block_minifloat<32, 1, 0>(row + 32 * b, 6.0f, 7.052966104933725e-38f, carry);
    __syncthreads();
}

// RoPE (or with `inverse` its inverse) of a row's last NROT_ of D_ dims, GPT-J pairs, at row
// `pos` of (rope_cos, rope_sin) [positions, NROT_ / 2], in place, a pair a thread of the block;
// each product rounded as the reference composition rounds it. The caller synchronises.
__device__ void ds4lab_rope_tail(float* row, int D_, int NROT_, int pos, const float* rope_cos,
                                 const float* rope_sin, bool inverse) {
    for (int j = threadIdx.x; j < NROT_ / 2; j += blockDim.x) {
        const float c = rope_cos[pos * (NROT_ / 2) + j];
        const float sn = inverse ? -rope_sin[pos * (NROT_ / 2) + j] : rope_sin[pos * (NROT_ / 2) + j];
        float* p = row + (D_ - NROT_) + 2 * j;
        const float x0 = p[0], x1 = p[1];
        p[0] = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, sn));
        p[1] = __fadd_rn(__fmul_rn(x0, sn), __fmul_rn(x1, c));
    }
}

// ds4's KV rounding of a row in place (model/numerics.py `fp8_kv_round`): FP8 E4M3FN in blocks
// of 64 over the first D_ - NROT_ dims, a warp a block (row_finish's FP8, the KV row's finish
// in decode attention). The whole thread block calls it; the call synchronises the block.
__device__ void ds4lab_fp8_round(float* row, int D_, int NROT_, const int* carry) {
    const int warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    for (int b = warp; b < (D_ - NROT_) / 64; b += n_warps)
        ds4lab_block_minifloat<64, 3, -6>(row + 64 * b, 448.0f, 1.0e-4f, carry);
    __syncthreads();
}

// A KV row as stored (model/attention.py `kv_row`: row_finish's NORM, WEIGHT, RoPE, FP8 and
// F16 steps, the same float operations) from the product x [D_] into y (shared memory), by
// the whole thread block, at row `pos` of (rope_cos, rope_sin). Every block of a launch that
// calls it gets the same bits (the norm's sum in the block's order). Synchronises the block.
__device__ void ds4lab_kv_row(const float* x, const float* weight, float eps, int pos, const float* rope_cos,
                              const float* rope_sin, const int* carry, float* y, int D_, int NROT_, float* scratch) {
    const float inv = ds4lab_rms_inverse(x, D_, eps, scratch);
    for (int i = threadIdx.x; i < D_; i += blockDim.x) y[i] = __fmul_rn(__fmul_rn(x[i], inv), weight[i]);
    __syncthreads();
    ds4lab_rope_tail(y, D_, NROT_, pos, rope_cos, rope_sin, false);
    __syncthreads();
    ds4lab_fp8_round(y, D_, NROT_, carry);
    for (int i = threadIdx.x; i < D_; i += blockDim.x) y[i] = __half2float(__float2half_rn(y[i]));
    __syncthreads();
}

// The inverse RoPE of one output pair (o0, o1) at dims d, d + 1 of a row whose last NROT of
// D dims are rotated (d even), at row t's angle: ds4's rotation by -angle, each product
// rounded as the reference composition rounds it.
__device__ __forceinline__ void ds4lab_unrotate_pair(float& o0, float& o1, int d, int D_, int NROT_, int t,
                                                     const float* rope_cos, const float* rope_sin) {
    const int tail = d - (D_ - NROT_);
    if (tail < 0) return;
    const float c = rope_cos[t * (NROT_ / 2) + tail / 2];
    const float sn = -rope_sin[t * (NROT_ / 2) + tail / 2];
    const float r0 = __fsub_rn(__fmul_rn(o0, c), __fmul_rn(o1, sn));
    o1 = __fadd_rn(__fmul_rn(o0, sn), __fmul_rn(o1, c));
    o0 = r0;
}

// Stream c, dim d of token t's new residual from the sublayer output o there (model/hc.py
// `hc_expand`): post[c] * o + sum_a comb[a][c] * streams[a][d], the mix summed over a in order.
template <int N, int E>
__device__ __forceinline__ float ds4lab_hc_value(float o, const float* streams, const float* post, const float* comb,
                                                 size_t t, int c, int d) {
    float mixed = 0.0f;
    for (int a = 0; a < N; ++a) mixed += comb[(t * N + a) * N + c] * streams[(t * N + a) * E + d];
    return post[t * N + c] * o + mixed;
}

// SwiGLU of one gate and up value (model/moe.py `swiglu`): with a clamp (> 1e-6) the gate
// capped at it and up clipped to [-clamp, clamp], a NaN kept as MLX's minimum and clip keep
// it (comparisons, not fminf); then gate * sigmoid(gate) * up, the sigmoid as MLX computes it
// (1 / (1 + e^|g|), reflected for g >= 0).
__device__ __forceinline__ float ds4lab_swiglu(float g, float u, float clamp) {
    if (clamp > 1e-6f) {
        g = g > clamp ? clamp : g;
        u = u < -clamp ? -clamp : (u > clamp ? clamp : u);
    }
    const float e = 1.0f / (1.0f + expf(fabsf(g)));
    return g * (g < 0.0f ? e : 1.0f - e) * u;
}

// IQ2_XXS's 8 sign bits from a 7-bit sign index: the index, and an eighth bit that makes the
// count of set bits even (ggml's ksigns_iq2xs table, computed instead of looked up).
__device__ __forceinline__ uint32_t ds4lab_iq2_signs(uint32_t index7) {
    return index7 | ((uint32_t)(__popc(index7) & 1) << 7);
}
