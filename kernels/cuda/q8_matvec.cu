// Q8_0 matvec on the model's 8-bit codes (model/weights.py `Q8Matrix`: byte = code + 128,
// one float32 scale per 32 values), one warp per output row: y[t][r] = sum over the row's
// blocks of scale[r][b] * sum_i (byte - 128) * x[t][g(r)][i], where rows come in groups of
// GROUP_ROWS and group g reads its own input vector (the grouped attention output projection;
// one group of all ROWS for a plain matvec). Lanes read 4 bytes at a time.
// Inputs: codes [ROWS, COLS / 4] uint32, scales [ROWS, COLS / 32], x [T, ROWS / GROUP_ROWS, COLS].
const int lane = threadIdx.x & 31;
const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
const int t = blockIdx.y;
if (r >= ROWS) return;
const uint32_t* w = codes + (size_t)r * (COLS / 4);
const float* s = scales + (size_t)r * (COLS / 32);
const float* xv = x + ((size_t)t * (ROWS / GROUP_ROWS) + r / GROUP_ROWS) * COLS;
float acc = 0.0f;
for (int j = lane; j < COLS / 4; j += 32) {
    const uint32_t word = w[j];
    const float4 xs = *reinterpret_cast<const float4*>(xv + 4 * j);
    const float dot = (float)((int)(word & 0xffu) - 128) * xs.x + (float)((int)((word >> 8) & 0xffu) - 128) * xs.y
                    + (float)((int)((word >> 16) & 0xffu) - 128) * xs.z + (float)((int)(word >> 24) - 128) * xs.w;
    acc += s[j / 8] * dot;
}
acc = ds4lab_warp_sum_all(acc);
if (lane == 0) y[(size_t)t * ROWS + r] = acc;
