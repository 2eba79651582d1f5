// mla_combine.cu: merge the per-slice partials of mla_attn.cu, then apply wv_b.
//
// Template parameters
//   WvT      wv_b element: __half or __nv_bfloat16
//   RESCALE  true: the real merge. false: the NEGATIVE CONTROL, which drops the
//            exp(m_i - m) rescale; every correctness check must reject it.
// Fixed geometry
//   kThreads = 1024 (32 warps) = kGroups (4) split groups x 256 threads of 2 latent columns,
//   kSplitTile = 256 split weights computed per step, MLA_KV_LORA = 512
//
// Launch: grid = H, block = kThreads, no dynamic shared memory. Block h merges head h:
//   m   = max_i m_i                      (over non-empty partials, l_i > 0)
//   w_i = 2^(m_i - m)                    (0 for an empty partial: never exp(-inf - -inf))
//   l   = sum_i w_i l_i,   latent = sum_i w_i acc_i / l,   lse = (m + log2 l) * ln 2
//   out = wv_b[h] @ latent               (after the merge: it is a function of the merged
//                                         latent, so it cannot run per slice)
// The weights of a tile of splits are computed together, and the four split groups each
// keep 8 partial loads in flight, so the merge never waits on one split's load at a time
// (seed 001: at batch 1 a merge that loads one split per iteration costs ~0.2 us a split).
#include "mla_common.cuh"

namespace mla {

constexpr int kCombineThreads = 1024;
constexpr int kColThreads = 256;
constexpr int kGroups = kCombineThreads / kColThreads;
constexpr int kSplitTile = 256;
constexpr int kCombineLora = MLA_KV_LORA;
static_assert(kCombineLora == 2 * kColThreads, "each thread of a group merges two latent columns");
static_assert(kCombineLora == 2 * 32 * 8, "the wv_b rows are read as two 16-byte chunks per lane");

template <typename Op>
__device__ __forceinline__ float block_reduce(float v, float* scratch, Op op) {
    constexpr int kW = kCombineThreads / 32;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
    __syncthreads();
    float r = scratch[0];
#pragma unroll
    for (int w = 1; w < kW; ++w) r = op(r, scratch[w]);
    __syncthreads();
    return r;
}

template <typename WvT, bool RESCALE>
__global__ void __launch_bounds__(kCombineThreads)
combine(const float* __restrict__ part_acc, const float* __restrict__ part_m,
        const float* __restrict__ part_l, int n_head, int splits, const WvT* __restrict__ wv_b,
        int v_head, float* __restrict__ out, float* __restrict__ latent, float* __restrict__ lse) {
    __shared__ float scratch[kCombineThreads / 32];
    __shared__ float w_s[kSplitTile];
    __shared__ __align__(16) float group_acc[kGroups - 1][kCombineLora];
    __shared__ __align__(16) float lat_s[kCombineLora];
    const int h = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int group = tid / kColThreads, col = tid % kColThreads;
    const auto fmax_op = [](float a, float b) { return fmaxf(a, b); };
    const auto sum_op = [](float a, float b) { return a + b; };

    float m_local = -INFINITY;
    for (int i = tid; i < splits; i += kCombineThreads) {
        const size_t k = static_cast<size_t>(i) * n_head + h;
        if (part_l[k] > 0.f) m_local = fmaxf(m_local, part_m[k]);
    }
    const float m = block_reduce(m_local, scratch, fmax_op);  // finite: n_ctx >= 1 fills a slice

    float2 acc = make_float2(0.f, 0.f);
    float wl = 0.f;  // this thread's share of l = sum_i w_i l_i
    for (int i0 = 0; i0 < splits; i0 += kSplitTile) {
        const int n = min(kSplitTile, splits - i0);
        if (tid < n) {
            const size_t k = static_cast<size_t>(i0 + tid) * n_head + h;
            const float li = part_l[k];
            const float w = (li > 0.f) ? (RESCALE ? exp2f(part_m[k] - m) : 1.f) : 0.f;
            w_s[tid] = w;
            wl += w * li;
        }
        __syncthreads();
#pragma unroll 8
        for (int i = group; i < n; i += kGroups) {
            const float2 a = reinterpret_cast<const float2*>(
                part_acc + (static_cast<size_t>(i0 + i) * n_head + h) * kCombineLora)[col];
            const float w = w_s[i];
            acc.x = fmaf(w, a.x, acc.x);
            acc.y = fmaf(w, a.y, acc.y);
        }
        __syncthreads();
    }
    const float l = block_reduce(wl, scratch, sum_op);
    if (group > 0) reinterpret_cast<float2*>(group_acc[group - 1])[col] = acc;
    __syncthreads();
    if (group == 0) {
#pragma unroll
        for (int g = 0; g < kGroups - 1; ++g) {
            const float2 o = reinterpret_cast<const float2*>(group_acc[g])[col];
            acc.x += o.x;
            acc.y += o.y;
        }
        const float inv_l = 1.f / l;
        const float2 lat = make_float2(acc.x * inv_l, acc.y * inv_l);
        reinterpret_cast<float2*>(latent + static_cast<size_t>(h) * kCombineLora)[col] = lat;
        reinterpret_cast<float2*>(lat_s)[col] = lat;
        if (tid == 0) lse[h] = (m + log2f(l)) * 0.69314718055994531f;
    }
    __syncthreads();

    // out[h, v] = wv_b[h, v, :] . latent: one warp per row, lanes over 8 columns at a time.
    float lat_reg[2][8];
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int e = 0; e < 8; ++e) lat_reg[half][e] = lat_s[half * 256 + lane * 8 + e];
    for (int v = warp; v < v_head; v += kCombineThreads / 32) {
        const WvT* row = wv_b + (static_cast<size_t>(h) * v_head + v) * kCombineLora;
        float sum = 0.f;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const uint4 raw = *reinterpret_cast<const uint4*>(row + half * 256 + lane * 8);
            const unsigned int words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float2 f = pair_to_f32<WvT>(words[e]);
                sum = fmaf(f.x, lat_reg[half][2 * e], sum);
                sum = fmaf(f.y, lat_reg[half][2 * e + 1], sum);
            }
        }
        sum = warp_sum(sum);
        if (lane == 0) out[static_cast<size_t>(h) * v_head + v] = sum;
    }
}

}  // namespace mla
