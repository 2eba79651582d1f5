// mla_combine.cu: merge the per-slice partials of mla_attn.cu, then apply wv_b.
//
// Template parameters
//   WvT      wv_b element: __half or __nv_bfloat16
//   RESCALE  true: the real merge. false: the NEGATIVE CONTROL, which drops the
//            exp(m_i - m) rescale; every correctness check must reject it.
// Fixed geometry
//   kThreads = 256 = kGroups (8) split groups x 32 threads of 4 latent columns,
//   kColBlocks = 4 blocks per head, each merging 128 of the MLA_KV_LORA = 512 columns,
//   kSplitTile = 256 split weights computed per step. sandbox/registry.py passes its own
//   block size and blocks per head; the kernel static_asserts them.
//
// Launch: grid = (H, kColBlocks), block = kThreads, no dynamic shared memory.
// Block (h, cb) merges columns [128 cb, 128 cb + 128) of head h:
//   m   = max_i m_i                      (over non-empty partials, l_i > 0)
//   w_i = 2^(m_i - m)                    (0 for an empty partial: never exp(-inf - -inf))
//   l   = sum_i w_i l_i,   latent = sum_i w_i acc_i / l,   lse = (m + log2 l) * ln 2
//   out = wv_b[h] @ latent               (after the merge: it is a function of the merged
//                                         latent, so it cannot run per slice)
// Each block projects its 128 columns into out_part[h][cb][:]; the last of the head's
// kColBlocks blocks to finish (a ticket per head) adds the four parts in a fixed order, so
// `out` is deterministic run to run, and resets the ticket for the next launch.
// Four blocks per head and eight split groups per block keep many partial loads in flight:
// at batch 1 a merge that waits on one split's load at a time costs ~0.2 us a split.
//
// mla::combine_paged<WvT, RESCALE>, the paged launch: grid = (n_rows, kColBlocks, B). Block
// (r, cb, b) merges row r of request b over chunks 0..n-1 of that request (n as the attention
// launch wrote it, chunk_counts[b]; the chunk rule is mla_walk.cuh's), partials
// [B][max_chunks][n_rows]; latent [B][n_rows][512], lse [B][n_rows], and when wv_b is not null out [B][n_rows][v_head] = wv_b[r % n_head] @
// latent, out_part [B][n_rows][kColBlocks][v_head] and tickets [B][n_rows]. A row with
// l == 0 (an empty request, a causal row that sees nothing) gets latent 0, lse -inf, out 0.
#include "mla_walk.cuh"

namespace mla {

constexpr int kCombineThreads = 256;
constexpr int kColBlocks = 4;
constexpr int kBlockCols = MLA_KV_LORA / kColBlocks;     // 128
constexpr int kGroupThreads = kBlockCols / 4;            // 32: 4 columns (a float4) each
constexpr int kGroups = kCombineThreads / kGroupThreads; // 8
constexpr int kSplitTile = 256;
static_assert(kBlockCols == 4 * 32, "a warp projects a row's 128 columns, 4 per lane");

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

// Paged: row r = x of request b = blockIdx.z merges that request's chunks 0..n-1 (the chunk
// rule, request_chunks), partial (b * max_chunks + i) * n_rows + r; results at row
// b * n_rows + r; wv_b of head r % n_head. A row with l == 0 (an empty request, or a causal row
// that sees nothing) has latent 0, lse -inf and out 0.
struct PagedMerge {
    int n_rows, n_head, max_chunks, n, r, b;  // r = blockIdx.x, b = blockIdx.z
    __device__ __forceinline__ int parts() const { return n; }
    __device__ __forceinline__ size_t first() const {
        return static_cast<size_t>(b) * max_chunks * n_rows + r;
    }
    __device__ __forceinline__ int stride() const { return n_rows; }
    __device__ __forceinline__ size_t row() const { return static_cast<size_t>(b) * n_rows + r; }
    __device__ __forceinline__ int head() const { return r % n_head; }
    __device__ __forceinline__ size_t part(int i) const {
        return first() + static_cast<size_t>(i) * n_rows;
    }
    __device__ __forceinline__ static float inv_l(float l) { return l > 0.f ? 1.f / l : 0.f; }
    __device__ __forceinline__ static float lse(float m, float l) {
        return l > 0.f ? (m + log2f(l)) * 0.69314718055994531f : -INFINITY;
    }
};

// The paged combine's body: the batch-1 kernel's merge (below) over the partials PagedMerge
// names, with the l == 0 rows and an optional wv_b. It is a copy rather than a body the two
// kernels share: routing the batch-1 kernel through a shared body reorders its PTX.
template <typename WvT, bool RESCALE, typename M>
__device__ __forceinline__ void combine_body(const M& merge, const float* __restrict__ part_acc,
                                             const float* __restrict__ part_m,
                                             const float* __restrict__ part_l,
                                             const WvT* __restrict__ wv_b, int v_head,
                                             float* __restrict__ out, float* __restrict__ latent,
                                             float* __restrict__ lse, float* __restrict__ out_part,
                                             unsigned int* __restrict__ tickets) {
    __shared__ float scratch[kCombineThreads / 32];
    __shared__ float w_s[kSplitTile];
    __shared__ __align__(16) float group_acc[kGroups][kBlockCols];
    __shared__ bool is_last;
#ifdef MLA_REGISTRY_FACTS
    static_assert(MLA_COMBINE_THREADS == kCombineThreads,
                  "registry.COMBINE_THREADS differs from kCombineThreads");
    static_assert(MLA_COMBINE_COL_BLOCKS == kColBlocks,
                  "registry.COMBINE_COL_BLOCKS differs from kColBlocks");
#endif
    const int cb = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int group = tid / kGroupThreads, col4 = tid % kGroupThreads;  // columns 4*col4 .. +3
    const auto fmax_op = [](float a, float b) { return fmaxf(a, b); };
    const auto sum_op = [](float a, float b) { return a + b; };

    float m_local = -INFINITY;
    const int splits = merge.parts();
    for (int i = tid; i < splits; i += kCombineThreads) {
        const size_t k = merge.part(i);
        if (part_l[k] > 0.f) m_local = fmaxf(m_local, part_m[k]);
    }
    const float m = block_reduce(m_local, scratch, fmax_op);  // -inf only where l == 0

    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    float wl = 0.f;  // this thread's share of l = sum_i w_i l_i
    const float* acc_base =
        part_acc + static_cast<size_t>(merge.first()) * MLA_KV_LORA + cb * kBlockCols + 4 * col4;
    const size_t split_stride = static_cast<size_t>(merge.stride()) * MLA_KV_LORA;
    for (int i0 = 0; i0 < splits; i0 += kSplitTile) {
        const int n = min(kSplitTile, splits - i0);
        if (tid < n) {
            const size_t k = merge.part(i0 + tid);
            const float li = part_l[k];
            const float w = (li > 0.f) ? (RESCALE ? exp2f(part_m[k] - m) : 1.f) : 0.f;
            w_s[tid] = w;
            wl += w * li;
        }
        __syncthreads();
#pragma unroll 8
        for (int i = group; i < n; i += kGroups) {
            const float4 a = *reinterpret_cast<const float4*>(acc_base + (i0 + i) * split_stride);
            const float w = w_s[i];
            acc.x = fmaf(w, a.x, acc.x);
            acc.y = fmaf(w, a.y, acc.y);
            acc.z = fmaf(w, a.z, acc.z);
            acc.w = fmaf(w, a.w, acc.w);
        }
        __syncthreads();
    }
    const float l = block_reduce(wl, scratch, sum_op);
    *reinterpret_cast<float4*>(&group_acc[group][4 * col4]) = acc;
    __syncthreads();
    // Sum the split groups in a fixed order (deterministic), normalize, publish the latent.
    if (group == 0) {
        float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int g = 0; g < kGroups; ++g) {
            const float4 o = *reinterpret_cast<const float4*>(&group_acc[g][4 * col4]);
            sum.x += o.x; sum.y += o.y; sum.z += o.z; sum.w += o.w;
        }
        const float inv_l = M::inv_l(l);
        const float4 lat = make_float4(sum.x * inv_l, sum.y * inv_l, sum.z * inv_l, sum.w * inv_l);
        float* lat_dst = latent + merge.row() * MLA_KV_LORA + cb * kBlockCols + 4 * col4;
        *reinterpret_cast<float4*>(lat_dst) = lat;
        *reinterpret_cast<float4*>(&group_acc[0][4 * col4]) = lat;  // group 0's row now holds the latent
        if (tid == 0 && cb == 0) lse[merge.row()] = M::lse(m, l);
    }
    __syncthreads();
    if (wv_b == nullptr) return;  // no out wanted

    // This block's share of out[h, :] = wv_b[h, :, cols] . latent[cols]: a warp per row.
    const float4 lat = *reinterpret_cast<const float4*>(&group_acc[0][4 * lane]);
    float* my_part = out_part + (static_cast<size_t>(merge.row()) * kColBlocks + cb) * v_head;
    for (int v = warp; v < v_head; v += kCombineThreads / 32) {
        const WvT* row = wv_b + (static_cast<size_t>(merge.head()) * v_head + v) * MLA_KV_LORA +
                         cb * kBlockCols + 4 * lane;
        const uint2 raw = *reinterpret_cast<const uint2*>(row);
        const float2 a = pair_to_f32<WvT>(raw.x), b = pair_to_f32<WvT>(raw.y);
        float sum = a.x * lat.x;
        sum = fmaf(a.y, lat.y, sum);
        sum = fmaf(b.x, lat.z, sum);
        sum = fmaf(b.y, lat.w, sum);
        sum = warp_sum(sum);
        if (lane == 0) my_part[v] = sum;
    }

    // The last block of head h to get here adds the kColBlocks parts, in order.
    __threadfence();
    __syncthreads();
    if (tid == 0) is_last = atomicAdd(&tickets[merge.row()], 1u) == kColBlocks - 1;
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    const float* parts = out_part + static_cast<size_t>(merge.row()) * kColBlocks * v_head;
    for (int v = tid; v < v_head; v += kCombineThreads) {
        float sum = __ldcg(parts + v);
#pragma unroll
        for (int c = 1; c < kColBlocks; ++c) sum += __ldcg(parts + c * v_head + v);
        out[static_cast<size_t>(merge.row()) * v_head + v] = sum;
    }
    if (tid == 0) tickets[merge.row()] = 0;
}

template <typename WvT, bool RESCALE>
__global__ void __launch_bounds__(kCombineThreads)
combine(const float* __restrict__ part_acc, const float* __restrict__ part_m,
        const float* __restrict__ part_l, int n_head, int splits, const WvT* __restrict__ wv_b,
        int v_head, float* __restrict__ out, float* __restrict__ latent, float* __restrict__ lse,
        float* __restrict__ out_part, unsigned int* __restrict__ tickets) {
#ifdef MLA_REGISTRY_FACTS
    static_assert(MLA_COMBINE_THREADS == kCombineThreads,
                  "registry.COMBINE_THREADS differs from kCombineThreads");
    static_assert(MLA_COMBINE_COL_BLOCKS == kColBlocks,
                  "registry.COMBINE_COL_BLOCKS differs from kColBlocks");
#endif
    __shared__ float scratch[kCombineThreads / 32];
    __shared__ float w_s[kSplitTile];
    __shared__ __align__(16) float group_acc[kGroups][kBlockCols];
    __shared__ bool is_last;
    const int h = blockIdx.x, cb = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int group = tid / kGroupThreads, col4 = tid % kGroupThreads;  // columns 4*col4 .. +3
    const auto fmax_op = [](float a, float b) { return fmaxf(a, b); };
    const auto sum_op = [](float a, float b) { return a + b; };

    float m_local = -INFINITY;
    for (int i = tid; i < splits; i += kCombineThreads) {
        const size_t k = static_cast<size_t>(i) * n_head + h;
        if (part_l[k] > 0.f) m_local = fmaxf(m_local, part_m[k]);
    }
    const float m = block_reduce(m_local, scratch, fmax_op);  // finite: n_ctx >= 1 fills a slice

    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    float wl = 0.f;  // this thread's share of l = sum_i w_i l_i
    const float* acc_base = part_acc + static_cast<size_t>(h) * MLA_KV_LORA + cb * kBlockCols + 4 * col4;
    const size_t split_stride = static_cast<size_t>(n_head) * MLA_KV_LORA;
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
            const float4 a = *reinterpret_cast<const float4*>(acc_base + (i0 + i) * split_stride);
            const float w = w_s[i];
            acc.x = fmaf(w, a.x, acc.x);
            acc.y = fmaf(w, a.y, acc.y);
            acc.z = fmaf(w, a.z, acc.z);
            acc.w = fmaf(w, a.w, acc.w);
        }
        __syncthreads();
    }
    const float l = block_reduce(wl, scratch, sum_op);
    *reinterpret_cast<float4*>(&group_acc[group][4 * col4]) = acc;
    __syncthreads();
    // Sum the split groups in a fixed order (deterministic), normalize, publish the latent.
    if (group == 0) {
        float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int g = 0; g < kGroups; ++g) {
            const float4 o = *reinterpret_cast<const float4*>(&group_acc[g][4 * col4]);
            sum.x += o.x; sum.y += o.y; sum.z += o.z; sum.w += o.w;
        }
        const float inv_l = 1.f / l;
        const float4 lat = make_float4(sum.x * inv_l, sum.y * inv_l, sum.z * inv_l, sum.w * inv_l);
        *reinterpret_cast<float4*>(latent + static_cast<size_t>(h) * MLA_KV_LORA + cb * kBlockCols + 4 * col4) = lat;
        *reinterpret_cast<float4*>(&group_acc[0][4 * col4]) = lat;  // group 0's row now holds the latent
        if (tid == 0 && cb == 0) lse[h] = (m + log2f(l)) * 0.69314718055994531f;
    }
    __syncthreads();

    // This block's share of out[h, :] = wv_b[h, :, cols] . latent[cols]: a warp per row.
    const float4 lat = *reinterpret_cast<const float4*>(&group_acc[0][4 * lane]);
    float* my_part = out_part + (static_cast<size_t>(h) * kColBlocks + cb) * v_head;
    for (int v = warp; v < v_head; v += kCombineThreads / 32) {
        const WvT* row = wv_b + (static_cast<size_t>(h) * v_head + v) * MLA_KV_LORA + cb * kBlockCols + 4 * lane;
        const uint2 raw = *reinterpret_cast<const uint2*>(row);
        const float2 a = pair_to_f32<WvT>(raw.x), b = pair_to_f32<WvT>(raw.y);
        float sum = a.x * lat.x;
        sum = fmaf(a.y, lat.y, sum);
        sum = fmaf(b.x, lat.z, sum);
        sum = fmaf(b.y, lat.w, sum);
        sum = warp_sum(sum);
        if (lane == 0) my_part[v] = sum;
    }

    // The last block of head h to get here adds the kColBlocks parts, in order.
    __threadfence();
    __syncthreads();
    if (tid == 0) is_last = atomicAdd(&tickets[h], 1u) == kColBlocks - 1;
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    const float* parts = out_part + static_cast<size_t>(h) * kColBlocks * v_head;
    for (int v = tid; v < v_head; v += kCombineThreads) {
        float sum = __ldcg(parts + v);
#pragma unroll
        for (int c = 1; c < kColBlocks; ++c) sum += __ldcg(parts + c * v_head + v);
        out[static_cast<size_t>(h) * v_head + v] = sum;
    }
    if (tid == 0) tickets[h] = 0;
}

// The paged launch: grid (n_rows, kColBlocks, B). chunk_counts[b] is request b's chunk count
// as the attention launch derived and wrote it (mla_walk.cuh, the chunk rule), so n is the
// number of chunks the attention programs of the request wrote. (`tile`, `min_chunk`: the
// attention launch's, unused here.)
template <typename WvT, bool RESCALE>
__global__ void __launch_bounds__(kCombineThreads)
combine_paged(const float* __restrict__ part_acc, const float* __restrict__ part_m,
              const float* __restrict__ part_l, const int* __restrict__ cache_seqlens,
              int n_rows, int n_head, int max_chunks, int min_chunk, int tile,
              const WvT* __restrict__ wv_b, int v_head, float* __restrict__ out,
              float* __restrict__ latent, float* __restrict__ lse, float* __restrict__ out_part,
              unsigned int* __restrict__ tickets, const int* __restrict__ chunk_counts) {
    const int r = blockIdx.x, b = blockIdx.z;
    const int n = __ldg(chunk_counts + b);  // as the attention launch derived it
    combine_body<WvT, RESCALE>(PagedMerge{n_rows, n_head, max_chunks, n, r, b}, part_acc,
                               part_m, part_l, wv_b, v_head, out, latent, lse, out_part, tickets);
}

}  // namespace mla
