// Shared helpers of the block-format GEMM (quant_gemm.cu).
#include <cuda_fp16.h>

// d += a * b on the tensor cores: a 16x16 f16 tile (row-major fragment: 4 registers of two
// halves), b 16x8 f16 (column fragment: 2 registers), d 16x8 float32 (4 per thread).
__device__ __forceinline__ void ds4lab_mma_f16(float d[4], const uint32_t a[4], const uint32_t b[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// The 16 bytes at `bytes` (4-byte aligned) as four words.
__device__ __forceinline__ void ds4lab_gemm_words4(const uint8_t* bytes, uint32_t w[4]) {
    const uint32_t* src = reinterpret_cast<const uint32_t*>(bytes);
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = src[i];
}

// The 16 bytes of w as q[i] = (byte_i >> shift) & mask (the K-quant code layouts).
__device__ __forceinline__ void ds4lab_gemm_codes16(const uint32_t w[4], int shift, uint32_t mask, __half q[16]) {
#pragma unroll
    for (int k = 0; k < 16; ++k) q[k] = __uint2half_rn((w[k >> 2] >> (8 * (k & 3) + shift)) & mask);
}
