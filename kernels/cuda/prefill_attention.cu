// Attention of a chunk's tokens on the tensor cores (prefill; model/attention.py `attend`
// + the inverse RoPE), the same function as decode_attention.cu: softmax with the head's
// sink logit in the denominator over the keys the token may see, K = V.
//   q [T, H, D]; keys [n_keys, D] (raw window rows, then compressed rows); mask [T, n_keys];
//   sinks [H]; rope_cos/rope_sin [T, NROT/2] of the query positions. Output [T, H, D].
//
// All heads read the same keys (one KV row per position), so a thread block takes one token
// and 16 heads (the mma's 16 rows; heads past H are zero rows) and reads each visible key
// once for them. The keys are stored f16-exact (kv_row and the compressors round them), so
// the tensor cores multiply them exactly; q and the probabilities are split into f16 halves
// hi + lo (q rows are unit-RMS heads: |q| <= sqrt(D), well inside f16) and every product is
// summed in float32.
// Per block: the token's mask is compacted into a list of visible keys (1024 columns at a
// time); per tile of 16 listed keys, staged in shared memory as f16, each of the 4 warps
// computes the scores over its quarter of the D dims, the block adds the quarters, 16
// threads (one per head) run the online softmax, and each warp accumulates P . V into its
// quarter of the output dims.
constexpr int HG = 16, KT = 16, SEG = 1024, WARPS = 4, DW = D / WARPS, KS = DW / 16, NT = DW / 8;
__shared__ __align__(16) __half tile_k[KT][D + 8];
__shared__ float s_part[WARPS][HG][KT + 1];
__shared__ __align__(16) __half p_hi[HG][KT + 8];
__shared__ __align__(16) __half p_lo[HG][KT + 8];
__shared__ float m_run[HG], l_run[HG], corr[HG];
__shared__ int list[SEG];
__shared__ int warp_total[WARPS];

const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
const int h0 = blockIdx.x * HG, t = blockIdx.y;
const int nk = n_keys[0];
const float scale = 1.0f / sqrtf((float)D);
const int d_warp = warp * DW;

// q fragments of this warp's dims, hi and lo: rows g and g + 8 of the head group.
uint32_t qh[KS][4], ql[KS][4];
#pragma unroll
for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        const int row = g + 8 * (r & 1), col = d_warp + 16 * ks + 2 * t4 + 8 * (r >> 1);
        float2 v = make_float2(0.0f, 0.0f);
        if (h0 + row < H) v = *reinterpret_cast<const float2*>(q + ((size_t)t * H + h0 + row) * D + col);
        const __half2 hi = __floats2half2_rn(v.x, v.y);
        const float2 back = __half22float2(hi);
        const __half2 lo = __floats2half2_rn(v.x - back.x, v.y - back.y);
        qh[ks][r] = *reinterpret_cast<const uint32_t*>(&hi);
        ql[ks][r] = *reinterpret_cast<const uint32_t*>(&lo);
    }
}
float o[NT][4];
#pragma unroll
for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c) o[j][c] = 0.0f;
if (tid < HG) { m_run[tid] = -INFINITY; l_run[tid] = 0.0f; }

const bool* visible = mask + (size_t)t * nk;
for (int base = 0; base < nk; base += SEG) {
    // The visible columns of [base, base + SEG), in order: 8 per thread, a block-wide scan.
    int cnt = 0;
    bool v[SEG / 128];
#pragma unroll
    for (int i = 0; i < SEG / 128; ++i) {
        const int col = base + tid * (SEG / 128) + i;
        v[i] = col < nk && visible[col];
        cnt += v[i];
    }
    int incl = cnt;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const int up = __shfl_up_sync(0xffffffffu, incl, off);
        if (lane >= off) incl += up;
    }
    if (lane == 31) warp_total[warp] = incl;
    __syncthreads();
    int before = 0, n_list = 0;
    for (int w = 0; w < WARPS; ++w) {
        before += w < warp ? warp_total[w] : 0;
        n_list += warp_total[w];
    }
    int at = before + incl - cnt;
#pragma unroll
    for (int i = 0; i < SEG / 128; ++i)
        if (v[i]) list[at++] = base + tid * (SEG / 128) + i;
    __syncthreads();

    for (int k0 = 0; k0 < n_list; k0 += KT) {
        for (int i = tid; i < KT * D / 4; i += 128) {
            const int key = i / (D / 4), c4 = i % (D / 4);
            float4 kv = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (k0 + key < n_list) kv = *reinterpret_cast<const float4*>(keys + (size_t)list[k0 + key] * D + 4 * c4);
            *reinterpret_cast<__half2*>(&tile_k[key][4 * c4]) = __floats2half2_rn(kv.x, kv.y);
            *reinterpret_cast<__half2*>(&tile_k[key][4 * c4 + 2]) = __floats2half2_rn(kv.z, kv.w);
        }
        __syncthreads();
        // Scores over this warp's dims: [16 heads x 16 keys] as two n8 tiles.
        float sp[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
            const int col = d_warp + 16 * ks + 2 * t4;
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
                const uint32_t b[2] = {*reinterpret_cast<const uint32_t*>(&tile_k[8 * nt + g][col]),
                                       *reinterpret_cast<const uint32_t*>(&tile_k[8 * nt + g][col + 8])};
                ds4lab_mma_f16(sp[nt], qh[ks], b);
                ds4lab_mma_f16(sp[nt], ql[ks], b);
            }
        }
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
            s_part[warp][g][8 * nt + 2 * t4] = sp[nt][0];
            s_part[warp][g][8 * nt + 2 * t4 + 1] = sp[nt][1];
            s_part[warp][g + 8][8 * nt + 2 * t4] = sp[nt][2];
            s_part[warp][g + 8][8 * nt + 2 * t4 + 1] = sp[nt][3];
        }
        __syncthreads();
        if (tid < HG) {
            const int valid = min(KT, n_list - k0);
            float s[KT];
            float top = m_run[tid];
#pragma unroll
            for (int j = 0; j < KT; ++j) {
                s[j] = (s_part[0][tid][j] + s_part[1][tid][j] + s_part[2][tid][j] + s_part[3][tid][j]) * scale;
                if (j < valid) top = fmaxf(top, s[j]);
            }
            const float c = expf(m_run[tid] - top);
            float l = l_run[tid] * c;
#pragma unroll
            for (int j = 0; j < KT; ++j) {
                const float p = j < valid ? expf(s[j] - top) : 0.0f;
                l += p;
                const __half hi = __float2half_rn(p);
                p_hi[tid][j] = hi;
                p_lo[tid][j] = __float2half_rn(p - __half2float(hi));
            }
            m_run[tid] = top;
            l_run[tid] = l;
            corr[tid] = c;
        }
        __syncthreads();
        // O = O * corr + P . V over this warp's dims.
        const float ca = corr[g], cb = corr[g + 8];
        const uint32_t ah[4] = {*reinterpret_cast<const uint32_t*>(&p_hi[g][2 * t4]),
                                *reinterpret_cast<const uint32_t*>(&p_hi[g + 8][2 * t4]),
                                *reinterpret_cast<const uint32_t*>(&p_hi[g][2 * t4 + 8]),
                                *reinterpret_cast<const uint32_t*>(&p_hi[g + 8][2 * t4 + 8])};
        const uint32_t al[4] = {*reinterpret_cast<const uint32_t*>(&p_lo[g][2 * t4]),
                                *reinterpret_cast<const uint32_t*>(&p_lo[g + 8][2 * t4]),
                                *reinterpret_cast<const uint32_t*>(&p_lo[g][2 * t4 + 8]),
                                *reinterpret_cast<const uint32_t*>(&p_lo[g + 8][2 * t4 + 8])};
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const int dim = d_warp + 8 * nt + g;
            const __half2 b0 = __halves2half2(tile_k[2 * t4][dim], tile_k[2 * t4 + 1][dim]);
            const __half2 b1 = __halves2half2(tile_k[2 * t4 + 8][dim], tile_k[2 * t4 + 9][dim]);
            const uint32_t b[2] = {*reinterpret_cast<const uint32_t*>(&b0), *reinterpret_cast<const uint32_t*>(&b1)};
            o[nt][0] *= ca;
            o[nt][1] *= ca;
            o[nt][2] *= cb;
            o[nt][3] *= cb;
            ds4lab_mma_f16(o[nt], ah, b);
            ds4lab_mma_f16(o[nt], al, b);
        }
        __syncthreads();
    }
}
// The sink joins the denominator: out = O * e^(m - top) / (l * e^(m - top) + e^(sink - top)).
if (tid < HG) {
    const float sink = h0 + tid < H ? sinks[h0 + tid] : 0.0f;
    const float top = fmaxf(sink, m_run[tid]);
    const float w = expf(m_run[tid] - top);
    corr[tid] = w / (l_run[tid] * w + expf(sink - top));
}
__syncthreads();
#pragma unroll
for (int rr = 0; rr < 2; ++rr) {
    const int row = g + 8 * rr;
    if (h0 + row >= H) continue;
    const float f = corr[row];
    float* oh = out + ((size_t)t * H + h0 + row) * D;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const int d0 = d_warp + 8 * nt + 2 * t4;
        float o0 = o[nt][2 * rr] * f, o1 = o[nt][2 * rr + 1] * f;
        ds4lab_unrotate_pair(o0, o1, d0, D, NROT, t, rope_cos, rope_sin);
        oh[d0] = o0;
        oh[d0 + 1] = o1;
    }
}
