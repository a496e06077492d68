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
