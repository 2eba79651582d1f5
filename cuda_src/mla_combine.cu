// mla_combine.cu: merge the per-slice partials of the attention kernels, optionally apply wv_b.
//
// Template parameters
//   WvT      wv_b element: __half or __nv_bfloat16
//   RESCALE  true: the real merge. false: the NEGATIVE CONTROL, which drops the
//            exp(m_i - m) rescale; every correctness check must reject it.
//   PREFETCH float4s of partials a thread loads before the max is known (below): 8
//            (kPrefetch; three blocks an SM by its launch bounds) or 16
//            (kDeepPrefetch, the deep merge: at most 128 registers by its launch bounds, two
//            blocks an SM, so half the column blocks prefetch as many chunks in one wave;
//            registry.merge_form picks it for a paged merge of 132..264 blocks at half the
//            column blocks, where 8 would leave a partial second wave)
// Fixed geometry
//   kCombineThreads = 256 threads; a block merges cols = 512 / gridDim.y latent columns of one
//   row, gridDim.y (the column blocks) a power of two up to kMaxColBlocks = 16 (32 columns:
//   8 threads of a float4). Its threads are 256 / (cols / 4) split groups of cols / 4
//   threads, each thread a float4 of columns; kSplitTile = 256 split weights per step. Up to
//   PREFETCH splits a thread (and 256 in all), the partials are loaded together with the
//   (m, l) pairs: the whole merge waits on memory once.
//   sandbox/registry.py passes its block size and kMaxColBlocks; the kernel static_asserts them.
//
// Launch: grid = (H, column blocks), block = kCombineThreads, no dynamic shared memory.
// Block (h, cb) merges columns [cols cb, cols cb + cols) of head h:
//   m   = max_i m_i                      (over non-empty partials, l_i > 0)
//   w_i = 2^(m_i - m)                    (0 for an empty partial: never exp(-inf - -inf))
//   l   = sum_i w_i l_i,   latent = sum_i w_i acc_i / l,   lse = (m + log2 l) * ln 2
// The split groups are summed in a fixed order, so the latent is deterministic run to run
// (for one launch geometry: another column-block count sums in another order).
//
// wv_b == nullptr: the merge only. The paged steps launch it so, then the batched projection
// (mla_project.cu) over every row: out = wv_b[h] @ latent after the merge, since it is a
// function of the merged latent and cannot run per slice.
// wv_b != nullptr: the block also projects its columns into out_part[row][cb][:], and the
// last of the row's gridDim.y blocks to finish (a ticket per row) adds the parts in a fixed
// order into out and resets the ticket for the next launch. Its wv_b words (a thread pair
// per wv_b row, half of the block's columns each) are loaded before the wait, so at batch 1
// they overlap the attention kernel's tail. The batch-1 step launches this form (one kernel
// where the merge-only form and the projection are two); a paged batch has many rows a head,
// and the tensor-core projection reads wv_b once per 32 of them (mla_project.cu).
//
// Programmatic dependent launch: the kernel waits (mla::pdl_wait) before it reads any
// partial, so it may be launched with programmatic stream serialization behind the attention
// kernel; it then lets the projection launch (pdl_launch_dependents).
//
// mla::combine_paged<WvT, RESCALE, PREFETCH>, the paged launch: grid = (n_rows, column
// blocks, B). Block (r, cb, b) merges row r of request b over chunks 0..n-1 of that request
// (n as the attention launch wrote it, chunk_counts[b]; the chunk rule is mla_walk.cuh's),
// partials [B][max_chunks][n_rows]; latent [B][n_rows][512], lse [B][n_rows], and with wv_b,
// out [B][n_rows][v_head] = wv_b[r % n_head] @ latent, out_part [B][n_rows][gridDim.y][v_head]
// and tickets [B][n_rows]. A row with l == 0 (an empty request, a causal row that sees
// nothing) gets latent 0, lse -inf, out 0. With attn_writes_single set, a request of one chunk
// is not merged: the attention kernel wrote its latent and lse (PagedWalk::single()).
//
// mla::combine_warp_paged<RESCALE>, the warp merge of a paged batch (merge only): one warp a
// (row, column block) of kWarpColBlocks = 2 blocks a row, no barrier and no shared memory.
// grid = (ceil(n_rows * 2 / 8), 1, B), block = kCombineThreads (8 warps); warp w of block
// (x, 0, b) merges column block u % 2 of row u / 2 of request b, u = 8 x + w. Each lane holds
// two float4s of columns of every chunk: the first kWarpPrefetch = 8 chunks' partials and
// (m, l) are loaded at once, the rest's (m, l) then partials after the max (a shuffle
// reduction). registry.merge_form runs it where the block merge has one column block a row
// and more blocks than one wave (B = 8 x 128 heads: 1,024 rows) and a request has at most
// COMBINE_WARP_MAX_CHUNKS chunk slots (past the prefetch a lane loads the partials a chunk at
// a time), at two blocks an SM by its launch bounds: 256 rows a wave, no barrier.
#include "mla_walk.cuh"

namespace mla {

constexpr int kCombineThreads = 256;
constexpr int kMaxColBlocks = 16;
constexpr int kMinBlockCols = MLA_KV_LORA / kMaxColBlocks;  // 32
constexpr int kSplitTile = 256;
constexpr int kPrefetch = 8;       // float4s of partials a thread loads before the max is known
constexpr int kDeepPrefetch = 16;  // the deep merge's: 64 registers of them
// Blocks an SM each merge is built for (its launch bounds): at most 85 registers (80 on NVRTC
// 13.0), and the deep merge's at most 128, what makes half the column blocks one wave
// (registry.merge_form). Without the bound ptxas is free to take more: a bound of one block
// gave the merge 102 registers on NVRTC 13.0 (two blocks an SM).
constexpr int kMinBlocks = 3;
constexpr int kDeepMinBlocks = 2;
constexpr int kWPrefetch = 4;  // 16-byte words of wv_b a thread loads before the wait (cols <= 128)
constexpr int kWarpColBlocks = 2;  // the warp merge: column blocks a row, one warp each
constexpr int kWarpPrefetch = 8;   // chunks whose partials a lane loads before the max
constexpr int kWarpF4 = MLA_KV_LORA / kWarpColBlocks / 4 / 32;  // float4s of a chunk a lane holds
static_assert(kWarpF4 * 4 * 32 * kWarpColBlocks == MLA_KV_LORA, "whole float4s a lane");
static_assert(kWarpPrefetch >= 1 && kWarpPrefetch * kWarpF4 <= 16,
              "a lane's prefetched partials: at most 64 registers of the bounds' 128");
static_assert(kCombineThreads / 2 >= 1 && MLA_KV_LORA / kMaxColBlocks % 16 == 0,
              "thread pairs per wv_b row, whole 16-byte words of a half of the columns");
static_assert(kMinBlockCols % 4 == 0 && kCombineThreads % (kMinBlockCols / 4) == 0,
              "a split group is a whole number of float4 threads");
static_assert(MLA_KV_LORA / 4 <= kCombineThreads, "one column block fits a block's threads");

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

// Batch 1: head h = blockIdx.x of n_head, partial i at i * n_head + h, result row h.
struct ContiguousMerge {
    int n_head, splits, h;
    __device__ __forceinline__ int parts() const { return splits; }
    __device__ __forceinline__ size_t first() const { return static_cast<size_t>(h); }
    __device__ __forceinline__ int stride() const { return n_head; }
    __device__ __forceinline__ size_t row() const { return static_cast<size_t>(h); }
    __device__ __forceinline__ int head() const { return h; }
    // a merge that runs merges (S = 1 launches none: DecodeStep.single_pass)
    __device__ __forceinline__ bool attn_wrote() const { return false; }
    __device__ __forceinline__ void settle() {}  // the split count is a launch argument
};

// Paged: row r = x of request b = blockIdx.z merges that request's chunks 0..n-1 (the chunk
// rule, request_chunks), partial (b * max_chunks + i) * n_rows + r; results at row
// b * n_rows + r; wv_b of head r % n_head. written: the attention kernel wrote the row's
// latent and lse itself (its request runs one chunk), so there is nothing to merge. n and
// written come from chunk_counts, the attention kernel's output: settle() reads it, after
// the wait, so what precedes the wait (the wv_b words) needs neither.
struct PagedMerge {
    int n_rows, n_head, max_chunks, r, b;  // r = blockIdx.x, b = blockIdx.z
    const int* counts;
    int attn_writes_single;
    int n = 0;
    bool written = false;
    __device__ __forceinline__ void settle() {
        n = counts[b];  // as the attention launch derived it
        written = attn_writes_single != 0 && n == 1;
    }
    __device__ __forceinline__ int parts() const { return n; }
    __device__ __forceinline__ size_t first() const {
        return static_cast<size_t>(b) * max_chunks * n_rows + r;
    }
    __device__ __forceinline__ int stride() const { return n_rows; }
    __device__ __forceinline__ size_t row() const { return static_cast<size_t>(b) * n_rows + r; }
    __device__ __forceinline__ int head() const { return r % n_head; }
    __device__ __forceinline__ bool attn_wrote() const { return written; }
};

// The merge of one row's column block, then the optional one-kernel projection. A row whose
// partials are all empty (l == 0) gets latent 0, lse -inf (and out 0): a batch-1 row never
// is one, since n_ctx >= 1 fills a slice. A row the attention kernel wrote itself
// (merge.attn_wrote()) is not merged; with wv_b its latent is projected.
template <typename WvT, bool RESCALE, int PREFETCH, typename M>
__device__ __forceinline__ void combine_body(M merge, const float* __restrict__ part_acc,
                                             const float* __restrict__ part_m,
                                             const float* __restrict__ part_l,
                                             const WvT* __restrict__ wv_b, int v_head,
                                             float* __restrict__ out, float* __restrict__ latent,
                                             float* __restrict__ lse, float* __restrict__ out_part,
                                             unsigned int* __restrict__ tickets) {
#ifdef MLA_REGISTRY_FACTS
    static_assert(MLA_COMBINE_THREADS == kCombineThreads,
                  "registry.COMBINE_THREADS differs from kCombineThreads");
    static_assert(MLA_COMBINE_COL_BLOCKS == kMaxColBlocks,
                  "registry.COMBINE_COL_BLOCKS differs from kMaxColBlocks");
    static_assert(MLA_COMBINE_PREFETCH == kPrefetch && MLA_COMBINE_DEEP_PREFETCH == kDeepPrefetch,
                  "registry.COMBINE_PREFETCH differs from kPrefetch, kDeepPrefetch");
#endif
    static_assert(PREFETCH == kPrefetch || PREFETCH == kDeepPrefetch,
                  "the merge prefetches kPrefetch or kDeepPrefetch float4s a thread");
    __shared__ float scratch[kCombineThreads / 32];
    __shared__ float w_s[kSplitTile];
    __shared__ float4 group_acc[kCombineThreads];  // [group][col4]; group 0's row: the latent
    __shared__ bool is_last;
    const int col_blocks = gridDim.y, cb = blockIdx.y, tid = threadIdx.x;
    if (col_blocks > kMaxColBlocks || (col_blocks & (col_blocks - 1)) != 0) __trap();
    const int cols = MLA_KV_LORA / col_blocks, tpr = cols / 4;  // threads per split row
    const int groups = kCombineThreads / tpr, group = tid / tpr, col4 = tid % tpr;
    const auto fmax_op = [](float a, float b) { return fmaxf(a, b); };
    const auto sum_op = [](float a, float b) { return a + b; };

    // The projection's wv_b slice is a weight no kernel of the step writes: with wv_b, each
    // thread loads its first row's words now, before the wait, so at batch 1 the loads
    // overlap the attention kernel's tail (programmatic launch) and the merge.
    uint4 w_pre[kWPrefetch];
    const int w_words = cols / 16;  // 16-byte words of a thread's half of a wv_b row
    const int w_v = tid >> 1, w_half = tid & 1;
    if (wv_b != nullptr && w_words <= kWPrefetch) {
        const uint4* row = reinterpret_cast<const uint4*>(
            wv_b + (static_cast<size_t>(merge.head()) * v_head + min(w_v, v_head - 1)) *
                       MLA_KV_LORA + cb * cols +
            w_half * (cols / 2));
#pragma unroll
        for (int i = 0; i < kWPrefetch; ++i)
            if (i < w_words) w_pre[i] = __ldg(row + i);
    }

    pdl_wait();  // the partials are the attention kernel's: nothing above reads them
    pdl_launch_dependents();
    merge.settle();

    if (merge.attn_wrote()) {
        // The row's one chunk: the attention kernel wrote its latent and lse itself
        // (mla_walk.cuh, single pass); the one-kernel step still projects that latent.
        if (wv_b == nullptr) return;
        if (group == 0)
            group_acc[col4] = *reinterpret_cast<const float4*>(
                latent + merge.row() * MLA_KV_LORA + cb * cols + 4 * col4);
    } else {
        const int splits = merge.parts();
        const size_t stride = static_cast<size_t>(merge.stride());
        const float* acc_base = part_acc + merge.first() * MLA_KV_LORA + cb * cols + 4 * col4;
        const size_t split_stride = stride * MLA_KV_LORA;
        // Where a thread has at most PREFETCH splits of columns (and one tile of weights), its
        // partials are loaded with split tid's (l, m) before the max is known: one round trip
        // to memory instead of three (l, then m, then acc).
        const bool prefetch = splits <= kSplitTile && splits <= groups * PREFETCH;
        float my_l = 0.f, my_m = -INFINITY;
        if (tid < splits) {
            const size_t k = merge.first() + tid * stride;
            my_l = part_l[k];
            my_m = part_m[k];
        }
        float4 pre[PREFETCH];
        if (prefetch) {
#pragma unroll
            for (int j = 0; j < PREFETCH; ++j) {
                const int i = group + j * groups;
                if (i < splits) pre[j] = *reinterpret_cast<const float4*>(acc_base + i * split_stride);
            }
        }
        float m_local = my_l > 0.f ? my_m : -INFINITY;
        for (int i = tid + kCombineThreads; i < splits; i += kCombineThreads) {
            const size_t k = merge.first() + i * stride;
            if (part_l[k] > 0.f) m_local = fmaxf(m_local, part_m[k]);
        }
        const float m = block_reduce(m_local, scratch, fmax_op);  // -inf only where l == 0

        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        float wl = 0.f;  // this thread's share of l = sum_i w_i l_i
        if (prefetch) {
            if (tid < splits) {
                const float w = (my_l > 0.f) ? (RESCALE ? exp2f(my_m - m) : 1.f) : 0.f;
                w_s[tid] = w;
                wl = w * my_l;
            }
            __syncthreads();
#pragma unroll
            for (int j = 0; j < PREFETCH; ++j) {
                const int i = group + j * groups;
                if (i < splits) {
                    const float w = w_s[i];
                    acc.x = fmaf(w, pre[j].x, acc.x);
                    acc.y = fmaf(w, pre[j].y, acc.y);
                    acc.z = fmaf(w, pre[j].z, acc.z);
                    acc.w = fmaf(w, pre[j].w, acc.w);
                }
            }
        }
        for (int i0 = 0; !prefetch && i0 < splits; i0 += kSplitTile) {
            const int n = min(kSplitTile, splits - i0);
            if (tid < n) {
                const size_t k = merge.first() + (i0 + tid) * stride;
                const float li = part_l[k];
                const float w = (li > 0.f) ? (RESCALE ? exp2f(part_m[k] - m) : 1.f) : 0.f;
                w_s[tid] = w;
                wl += w * li;
            }
            __syncthreads();
#pragma unroll 4
            for (int i = group; i < n; i += groups) {
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
        group_acc[tid] = acc;
        __syncthreads();
        // Sum the split groups in a fixed order (deterministic), normalize, publish the latent.
        if (group == 0) {
            float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
            for (int g = 0; g < groups; ++g) {
                const float4 o = group_acc[g * tpr + col4];
                sum.x += o.x; sum.y += o.y; sum.z += o.z; sum.w += o.w;
            }
            const float inv_l = single_pass_inv_l(l);
            const float4 lat =
                make_float4(sum.x * inv_l, sum.y * inv_l, sum.z * inv_l, sum.w * inv_l);
            float* lat_dst = latent + merge.row() * MLA_KV_LORA + cb * cols + 4 * col4;
            *reinterpret_cast<float4*>(lat_dst) = lat;
            group_acc[col4] = lat;
            if (tid == 0 && cb == 0)
                lse[merge.row()] = single_pass_lse(m, l);
        }
    }
    if (wv_b == nullptr) return;  // the merge only: the projection is mla_project.cu's
    __syncthreads();

    // This block's share of out[row, :] = wv_b[head, :, cols] . latent[cols]: thread pairs
    // per wv_b row (v = tid / 2 + 128 i), each thread half of the block's columns as 16-byte
    // words of wv_b against float4s of the merged latent (a pair reads two addresses of
    // group_acc a step: broadcasts), the pair's halves added by one shuffle.
    float* my_part = out_part + (merge.row() * col_blocks + cb) * v_head;
    const float4* lat_half = group_acc + w_half * (tpr / 2);
    for (int v0 = 0; v0 < v_head; v0 += kCombineThreads / 2) {  // every thread, every trip
        const int v = min(v0 + w_v, v_head - 1);  // past v_head: row v_head - 1, not stored
        const uint4* row = reinterpret_cast<const uint4*>(
            wv_b + (static_cast<size_t>(merge.head()) * v_head + v) * MLA_KV_LORA + cb * cols +
            w_half * (cols / 2));
        const bool pre = v0 == 0 && w_words <= kWPrefetch;
        float sum = 0.f;
#pragma unroll
        for (int i = 0; i < kWPrefetch; ++i) {
            if (i >= w_words) break;
            const uint4 w = pre ? w_pre[i] : __ldg(row + i);
            float x[8];
            unpack_f32<WvT>(w, x);
            const float4 a = lat_half[2 * i], b = lat_half[2 * i + 1];
            sum = fmaf(x[0], a.x, sum); sum = fmaf(x[1], a.y, sum);
            sum = fmaf(x[2], a.z, sum); sum = fmaf(x[3], a.w, sum);
            sum = fmaf(x[4], b.x, sum); sum = fmaf(x[5], b.y, sum);
            sum = fmaf(x[6], b.z, sum); sum = fmaf(x[7], b.w, sum);
        }
        for (int i = kWPrefetch; i < w_words; ++i) {  // wide column blocks (cols > 128)
            float x[8];
            unpack_f32<WvT>(__ldg(row + i), x);
            const float4 a = lat_half[2 * i], b = lat_half[2 * i + 1];
            sum = fmaf(x[0], a.x, sum); sum = fmaf(x[1], a.y, sum);
            sum = fmaf(x[2], a.z, sum); sum = fmaf(x[3], a.w, sum);
            sum = fmaf(x[4], b.x, sum); sum = fmaf(x[5], b.y, sum);
            sum = fmaf(x[6], b.z, sum); sum = fmaf(x[7], b.w, sum);
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        if (w_half == 0 && v0 + w_v < v_head) my_part[v] = sum;
    }

    // The last block of the row to get here adds the col_blocks parts, in order.
    __threadfence();
    __syncthreads();
    if (tid == 0) is_last = atomicAdd(&tickets[merge.row()], 1u) == col_blocks - 1u;
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    const float* parts = out_part + merge.row() * col_blocks * v_head;
    for (int v = tid; v < v_head; v += kCombineThreads) {
        float sum = __ldcg(parts + v);
        for (int c = 1; c < col_blocks; ++c) sum += __ldcg(parts + c * v_head + v);
        out[merge.row() * v_head + v] = sum;
    }
    if (tid == 0) tickets[merge.row()] = 0;
}

template <typename WvT, bool RESCALE, int PREFETCH>
__global__ void
__launch_bounds__(kCombineThreads, PREFETCH == kDeepPrefetch ? kDeepMinBlocks : kMinBlocks)
combine(const float* __restrict__ part_acc, const float* __restrict__ part_m,
        const float* __restrict__ part_l, int n_head, int splits, const WvT* __restrict__ wv_b,
        int v_head, float* __restrict__ out, float* __restrict__ latent, float* __restrict__ lse,
        float* __restrict__ out_part, unsigned int* __restrict__ tickets) {
    combine_body<WvT, RESCALE, PREFETCH>(
        ContiguousMerge{n_head, splits, static_cast<int>(blockIdx.x)}, part_acc, part_m, part_l,
        wv_b, v_head, out, latent, lse, out_part, tickets);
}

// The paged launch: grid (n_rows, column blocks, B). chunk_counts[b] is request b's chunk count
// as the attention launch derived and wrote it (mla_walk.cuh, the chunk rule), so n is the
// number of chunks the attention programs of the request wrote. attn_writes_single != 0: the
// attention family writes latent and lse itself for a request of one chunk (PagedWalk::
// single(): the built-in families), so a block of such a request has nothing to merge and,
// merge only (wv_b null), returns at once. 0 (user kernels, which may write partials only):
// every request is merged. n == 0 (an empty request) is merged either way: latent 0, lse -inf.
template <typename WvT, bool RESCALE, int PREFETCH>
__global__ void
__launch_bounds__(kCombineThreads, PREFETCH == kDeepPrefetch ? kDeepMinBlocks : kMinBlocks)
combine_paged(const float* __restrict__ part_acc, const float* __restrict__ part_m,
              const float* __restrict__ part_l, const int* __restrict__ cache_seqlens,
              int n_rows, int n_head, int max_chunks, int attn_writes_single,
              const WvT* __restrict__ wv_b, int v_head, float* __restrict__ out,
              float* __restrict__ latent, float* __restrict__ lse, float* __restrict__ out_part,
              unsigned int* __restrict__ tickets, const int* __restrict__ chunk_counts) {
    // chunk_counts, like the partials, is the attention kernel's: PagedMerge::settle reads
    // it after the wait, and a written row without wv_b returns there
    const int r = blockIdx.x, b = blockIdx.z;
    combine_body<WvT, RESCALE, PREFETCH>(
        PagedMerge{n_rows, n_head, max_chunks, r, b, chunk_counts, attn_writes_single}, part_acc,
        part_m, part_l, wv_b, v_head, out, latent, lse, out_part, tickets);
}

// The warp merge (merge only; see the header). A row whose chunks are all empty gets latent
// 0 and lse -inf; a request of one chunk the attention kernel wrote (attn_writes_single) is
// skipped, as in combine_paged.
template <bool RESCALE>
__global__ void __launch_bounds__(kCombineThreads, kDeepMinBlocks)
combine_warp_paged(const float* __restrict__ part_acc, const float* __restrict__ part_m,
                   const float* __restrict__ part_l, const int* __restrict__ cache_seqlens,
                   int n_rows, int n_head, int max_chunks, int attn_writes_single,
                   const void* __restrict__ wv_b, int v_head, float* __restrict__ out,
                   float* __restrict__ latent, float* __restrict__ lse,
                   float* __restrict__ out_part, unsigned int* __restrict__ tickets,
                   const int* __restrict__ chunk_counts) {
#ifdef MLA_REGISTRY_FACTS
    static_assert(MLA_COMBINE_WARP_THREADS == kCombineThreads,
                  "registry.COMBINE_THREADS differs from kCombineThreads");
    static_assert(MLA_COMBINE_WARP_COL_BLOCKS == kWarpColBlocks &&
                      MLA_COMBINE_WARP_PREFETCH == kWarpPrefetch,
                  "registry.COMBINE_WARP_COL_BLOCKS / _PREFETCH differ from the kernel's");
#endif
    if (wv_b != nullptr) __trap();  // merge only: the projection is mla_project.cu's
    const int lane = threadIdx.x & 31;
    const int u = blockIdx.x * (kCombineThreads / 32) + (threadIdx.x >> 5);
    const int cb = u % kWarpColBlocks, r = u / kWarpColBlocks, b = blockIdx.z;
    pdl_wait();  // the partials and the chunk counts are the attention kernel's
    pdl_launch_dependents();
    if (r >= n_rows) return;
    const int n = chunk_counts[b];
    if (attn_writes_single != 0 && n == 1) return;
    const size_t first = static_cast<size_t>(b) * max_chunks * n_rows + r;
    const size_t stride = static_cast<size_t>(n_rows) * MLA_KV_LORA;
    constexpr int kCols = MLA_KV_LORA / kWarpColBlocks;
    const float* acc_base = part_acc + first * MLA_KV_LORA + cb * kCols + 4 * kWarpF4 * lane;

    float4 pre[kWarpPrefetch][kWarpF4];
    float pm[kWarpPrefetch], pl[kWarpPrefetch];
#pragma unroll
    for (int j = 0; j < kWarpPrefetch; ++j) {
        pm[j] = -INFINITY;
        pl[j] = 0.f;
        if (j < n) {
            pm[j] = part_m[first + static_cast<size_t>(j) * n_rows];
            pl[j] = part_l[first + static_cast<size_t>(j) * n_rows];
#pragma unroll
            for (int k = 0; k < kWarpF4; ++k)
                pre[j][k] = *reinterpret_cast<const float4*>(acc_base + j * stride + 4 * k);
        }
    }
    float m = -INFINITY;
#pragma unroll
    for (int j = 0; j < kWarpPrefetch; ++j) m = pl[j] > 0.f ? fmaxf(m, pm[j]) : m;
    // past the prefetch the lanes share the (m, l) loads, then the warp takes the max
    for (int i = kWarpPrefetch + lane; i < n; i += 32) {
        const size_t k = first + static_cast<size_t>(i) * n_rows;
        const float li = part_l[k], mi = part_m[k];
        m = li > 0.f ? fmaxf(m, mi) : m;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));

    float4 acc[kWarpF4];
#pragma unroll
    for (int k = 0; k < kWarpF4; ++k) acc[k] = make_float4(0.f, 0.f, 0.f, 0.f);
    float l = 0.f;  // every lane sums every chunk's weight: the same l in each
    const auto add = [&](float w, const float4 (&a)[kWarpF4]) {
#pragma unroll
        for (int k = 0; k < kWarpF4; ++k) {
            acc[k].x = fmaf(w, a[k].x, acc[k].x);
            acc[k].y = fmaf(w, a[k].y, acc[k].y);
            acc[k].z = fmaf(w, a[k].z, acc[k].z);
            acc[k].w = fmaf(w, a[k].w, acc[k].w);
        }
    };
#pragma unroll
    for (int j = 0; j < kWarpPrefetch; ++j) {
        if (j < n) {
            const float w = pl[j] > 0.f ? (RESCALE ? exp2f(pm[j] - m) : 1.f) : 0.f;
            l = fmaf(w, pl[j], l);
            add(w, pre[j]);
        }
    }
#pragma unroll 4
    for (int i = kWarpPrefetch; i < n; ++i) {
        const size_t k0 = first + static_cast<size_t>(i) * n_rows;
        const float li = part_l[k0];
        const float w = li > 0.f ? (RESCALE ? exp2f(part_m[k0] - m) : 1.f) : 0.f;
        l = fmaf(w, li, l);
        float4 a[kWarpF4];
#pragma unroll
        for (int k = 0; k < kWarpF4; ++k)
            a[k] = *reinterpret_cast<const float4*>(acc_base + i * stride + 4 * k);
        add(w, a);
    }
    const float inv_l = single_pass_inv_l(l);
    float* dst = latent + (static_cast<size_t>(b) * n_rows + r) * MLA_KV_LORA + cb * kCols +
                 4 * kWarpF4 * lane;
#pragma unroll
    for (int k = 0; k < kWarpF4; ++k)
        *reinterpret_cast<float4*>(dst + 4 * k) =
            make_float4(acc[k].x * inv_l, acc[k].y * inv_l, acc[k].z * inv_l, acc[k].w * inv_l);
    if (lane == 0 && cb == 0) lse[static_cast<size_t>(b) * n_rows + r] = single_pass_lse(m, l);
}

}  // namespace mla
