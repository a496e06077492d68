// Shared helpers of the routed-expert matvec kernels (ds4lab/model/kernels.py).
// One warp computes one output row of one (token, expert) pair: each lane takes 8
// consecutive values of every 256-value block, decodes them from the block bytes and
// multiplies them with the activation; the warp then sums its lanes.
#include <cuda_fp16.h>

__device__ __forceinline__ float ds4lab_f16_at(const uint8_t* p) {
    unsigned short bits = (unsigned short)p[0] | ((unsigned short)p[1] << 8);
    return __half2float(__ushort_as_half(bits));
}

__device__ __forceinline__ float ds4lab_warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
    return v;
}

// The row a thread's warp computes, and where its weights and activation start. Each
// kernel body opens with this and ends with DS4LAB_EXPERT_ROW_END(acc).
#define DS4LAB_EXPERT_ROW_BEGIN(BLOCK_BYTES)                                                   \
    const int lane = threadIdx.x & 31;                                                          \
    const int row = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;                               \
    const int p = blockIdx.y;                                                                   \
    if (row >= ROWS) return;                                                                    \
    const uint8_t* w = raw + (size_t)ids[p] * EXPERT_BYTES + (size_t)row * (COLS / 256) * (BLOCK_BYTES); \
    const float* xv = x + (size_t)p * COLS;

#define DS4LAB_EXPERT_ROW_END(acc)                                                              \
    acc = ds4lab_warp_sum(acc);                                                                 \
    if (lane == 0) y[(size_t)p * ROWS + row] = acc;
