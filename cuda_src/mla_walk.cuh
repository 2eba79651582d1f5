// mla_walk.cuh: where an attention block's query rows, cache positions and partials are.
//
// Each attention family's kernel body is written once against a walk W, and each of its two
// entry points (the batch-1 launch and the paged one) builds its walk from its arguments:
//
//   ContiguousWalk  batch 1, one contiguous cache [n_ctx, 576]: block (g, s) serves heads
//                   [g * heads, ...) of n_head over slice s of S (begin_slice). Its members
//                   spell exactly the expressions the batch-1 kernels always ran, so their
//                   machine code does not depend on the paged path (tools/ptx_digest.py).
//   PagedWalk       a batch of requests in a paged cache [num_pages, page_size, 576]:
//                   program (x, c, b) serves query rows [x * heads, ...) of request b's
//                   n_rows = s_q * H rows (row r = i * H + h: query token i, head h) over chunk c
//                   of that request (request_chunks, the arithmetic of sandbox/chunks.py).
//
// What a body asks of its walk:
//   w.begin(heads, latent, part_acc, part_m, part_l, slice)
//                                    the block's slice; false: nothing (more) to do, every
//                                    partial this program owes is written
//   w.rows()                         rows the launch serves (masks rows >= rows())
//   w.q(q)                           q's first row of the block's request
//   w.row_end(r, row_end)            the end of row r's visible positions in the slice
//   w.fetch<kRows, kThreads>(t, ...) look up what copying tile t needs (paged: its pages)
//   w.copy_tile<...>(...)            one tile's cp.async copy (cp_async_tile's arguments)
//   w.part_base()                    the slice's first partial, recomputed (attn_rows)
//   W::exp_offset(m), W::softmax_step(...)   the online softmax step, of a row that may see
//                                    no position of a tile or of the whole walk (paged)
// (No static data members: NVRTC emits each as a global symbol into every kernel's PTX.)
#pragma once
#include "mla_common.cuh"

namespace mla {

// ---- the chunk rule --------------------------------------------------------------------
// (n, chunk_len) of a request of `len` positions, exactly sandbox/chunks.py's request_chunks:
//   want = min(max_chunks, ceil(len / min_chunk)), per = ceil(len / max(want, 1)),
//   chunk_len = max(ceil(per / tile) * tile, tile), n = ceil(len / chunk_len).
// Chunks are whole tiles, so only a request's last chunk ends inside a tile; len 0 gives n 0.
struct ChunkSpan {
    int n, len;
};
__device__ __forceinline__ ChunkSpan request_chunks(int len, int max_chunks, int tile,
                                                    int min_chunk) {
    const int want = min(max_chunks, (len + min_chunk - 1) / min_chunk);
    const int per = (len + max(want, 1) - 1) / max(want, 1);
    const int chunk_len = max((per + tile - 1) / tile * tile, tile);
    return {(len + chunk_len - 1) / chunk_len, chunk_len};
}

// The neutral partial (m = -inf, l = 0, acc = 0) of rows [head0, head0 + heads) below `rows`,
// entries part_base + row: the combine weighs it by 0.
__device__ __forceinline__ void write_neutral(int heads, int rows, int latent, const BlockSlice& s,
                                              float* part_acc, float* part_m, float* part_l) {
    for (int j = 0; j < heads && s.head0 + j < rows; ++j) {
        const size_t partial = s.part_base + s.head0 + j;
        for (int c = threadIdx.x; c < latent; c += blockDim.x) part_acc[partial * latent + c] = 0.f;
        if (threadIdx.x == 0) { part_m[partial] = -INFINITY; part_l[partial] = 0.f; }
    }
}

// ---- batch 1, contiguous -------------------------------------------------------------------
template <typename CacheT>
struct ContiguousWalk {
    const CacheT* cache;
    int n_head, n_ctx, splits;

    __device__ __forceinline__ bool begin(int heads, int latent, float* part_acc, float* part_m,
                                          float* part_l, BlockSlice& out) const {
        return begin_slice(heads, n_head, n_ctx, splits, latent, part_acc, part_m, part_l, out);
    }
    __device__ __forceinline__ int rows() const { return n_head; }
    template <typename QT> __device__ __forceinline__ const QT* q(const QT* q0) const { return q0; }
    __device__ __forceinline__ int row_end(int, int slice_end) const { return slice_end; }
    template <int kRows, int kThreadsT>
    __device__ __forceinline__ void fetch(int, int, int) {}
    template <int kRows, int kChunks, int kStages, int kThreadsT, bool kSwizzle = true>
    __device__ __forceinline__ void copy_tile(uint4* tiles, int buf, int tile_index, int row_start,
                                              int row_end) {
        cp_async_tile<kRows, kChunks, kStages, kThreadsT, kSwizzle>(tiles, buf, tile_index, cache,
                                                                     row_start, row_end);
    }
    __device__ __forceinline__ size_t part_base() const { return slice_part_base(n_head); }
    __device__ __forceinline__ static float exp_offset(float m) { return m; }
    __device__ __forceinline__ static void softmax_step(float* m_s, float* l_s, float* alpha_s,
                                                        int h, float m_old, float m_new,
                                                        float p_sum) {
        online_softmax_step(m_s, l_s, alpha_s, h, m_old, m_new, p_sum);
    }
};

// ---- a batch of requests in a paged cache ------------------------------------------------
// kTile: the family's tile (the registry's tile_rows), the unit of the chunk rule.
// Position t of the request is row t & (page_size - 1) of page table[t >> page_shift]; only
// t < len is ever looked up, so a table entry past the request's pages is never read.
// kPrefetch: the pages of a thread's rows of the next tile are looked up while this tile is
// copied (fetch), so a copy never waits on a table read: one lookup per copied row per tile,
// off the critical path, and nothing in the loops over a tile. Without it (attn_rows, at its
// register limit) each copy looks its pages up first, and the SM's other resident blocks
// cover the wait.
enum : int { kPagedMaxPasses = 2 };  // copy passes of a tile per thread, at most (an enum:
                                     // NVRTC emits namespace constants into every PTX)

template <typename CacheT, int kTile, bool kPrefetch = true>
struct PagedWalk {
    const CacheT* cache;
    const int* table;           // block_table [B, max_pages]
    const int* cache_seqlens;
    int n_rows, n_head, s_q, causal, max_pages, page_shift, max_chunks, min_chunk;
    size_t q_row0 = 0;          // request b's first q row
    int visible0 = 0;           // row r sees positions < visible0 (+ r / n_head when causal)
    int page[kPagedMaxPasses] = {};  // the pages of this thread's rows of the next tile to copy

    __device__ __forceinline__ int visible(int r) const {
        return causal ? visible0 + r / n_head : visible0;
    }
    // Chunk c = blockIdx.y of request b = blockIdx.z. A chunk past the request's last writes
    // nothing (the combine merges chunks 0..n-1 only); a block none of whose rows sees a
    // position of its chunk (causal) writes their neutral partials.
    __device__ __forceinline__ bool begin(int heads, int latent, float* part_acc, float* part_m,
                                          float* part_l, BlockSlice& out) {
        const int b = blockIdx.z, c = blockIdx.y;
        const int len = cache_seqlens[b];
        const ChunkSpan span = request_chunks(len, max_chunks, kTile, min_chunk);
        if (c >= span.n) return false;
        q_row0 = static_cast<size_t>(b) * n_rows;
        visible0 = causal ? len - (s_q - 1) : len;
        const int head0 = static_cast<int>(blockIdx.x) * heads;
        const int start = c * span.len;
        const int end = min(min(len, start + span.len), visible(min(head0 + heads, n_rows) - 1));
        out = {head0, start, max(end, start),
               (static_cast<size_t>(b) * max_chunks + c) * n_rows};
        if (out.row_start < out.row_end) return true;
        write_neutral(heads, n_rows, latent, out, part_acc, part_m, part_l);
        return false;
    }
    __device__ __forceinline__ int rows() const { return n_rows; }
    // Request b's row of the table, rederived from the launch values at each lookup rather
    // than held across the walk.
    __device__ __forceinline__ const int* request_pages() const {
        return table + static_cast<size_t>(blockIdx.z) * max_pages;
    }
    template <typename QT> __device__ __forceinline__ const QT* q(const QT* q0) const {
        return q0 + q_row0 * (MLA_KV_LORA + MLA_ROPE);
    }
    __device__ __forceinline__ int row_end(int r, int slice_end) const {
        return min(slice_end, visible(r));
    }
    // The pages of this thread's rows of tile `tile_index` (rows past row_end: page 0, never
    // read, and their table entries are not looked up).
    template <int kRows, int kThreadsT>
    __device__ __forceinline__ void fetch(int tile_index, int row_start, int row_end) {
        constexpr int kRowsPerPass = kThreadsT / 8, kPasses = kRows / kRowsPerPass;
        static_assert(kPasses <= kPagedMaxPasses, "a thread copies at most 2 rows a tile");
        const int row0 = row_start + tile_index * kRows + static_cast<int>(threadIdx.x >> 3);
        const int* pages = request_pages();
#pragma unroll
        for (int pass = 0; pass < kPasses; ++pass) {
            const int row = row0 + pass * kRowsPerPass;
            page[pass] = row < row_end ? __ldg(pages + (row >> page_shift)) : 0;
        }
    }
    // cp_async_tile's copy, each row's address through the pages of this tile (fetched one
    // copy ago with kPrefetch, else now); with kPrefetch, then the next tile's pages. A loop
    // of its own: routing cp_async_tile through a row-address callback reorders the batch-1
    // kernels' PTX.
    template <int kRows, int kChunks, int kStages, int kThreadsT, bool kSwizzle = true>
    __device__ __forceinline__ void copy_tile(uint4* tiles, int buf, int tile_index, int row_start,
                                              int row_end) {
        constexpr int kRowsPerPass = kThreadsT / 8;
        static_assert(kThreadsT % 64 == 0 && kRows % kRowsPerPass == 0,
                      "8 threads per row, a pass of rows a multiple of 8 (one swizzle a thread)");
        static_assert(kChunks % 8 == 0, "the XOR swizzle permutes chunks within groups of 8");
        if (kAblateCacheLoads && tile_index >= kStages) return;
        const int row0 = row_start + tile_index * kRows;
        const int copy_row = threadIdx.x >> 3, copy_lane = threadIdx.x & 7;
        const int in_page = (1 << page_shift) - 1;
        uint4* dst = tiles + buf * kRows * kChunks + copy_row * kChunks +
                     (kSwizzle ? (copy_lane ^ (copy_row & 7)) : copy_lane);
#pragma unroll
        for (int pass = 0; pass < kRows / kRowsPerPass; ++pass) {
            const int row = row0 + pass * kRowsPerPass + copy_row;
            const bool valid = row < row_end;
            const int pg = kPrefetch ? page[pass]
                         : valid   ? __ldg(request_pages() + (row >> page_shift)) : 0;
            const size_t cache_row = (static_cast<size_t>(pg) << page_shift) + (row & in_page);
            const CacheT* src = cache + cache_row * (kChunks * 8) + copy_lane * 8;
#pragma unroll
            for (int i = 0; i < kChunks / 8; ++i)
                cp_async_16(dst + (pass * kRowsPerPass * kChunks + 8 * i), src + 64 * i, valid);
        }
        cp_async_commit();
        if (kPrefetch) fetch<kRows, kThreadsT>(tile_index + 1, row_start, row_end);
    }
    __device__ __forceinline__ size_t part_base() const {
        return (static_cast<size_t>(blockIdx.z) * max_chunks + blockIdx.y) * n_rows;
    }
    // A row that has seen no position yet has m = -inf and every score -inf: p = 2^(s - 0) = 0
    // and alpha = 1 keep it at (m, l, acc) = (-inf, 0, 0), where 2^(-inf + inf) would be NaN.
    // Rows see a prefix of the positions, so a row that sees nothing of a chunk's first row
    // sees nothing of the chunk and ends with the neutral partial.
    __device__ __forceinline__ static float exp_offset(float m) { return m == -INFINITY ? 0.f : m; }
    __device__ __forceinline__ static void softmax_step(float* m_s, float* l_s, float* alpha_s,
                                                        int h, float m_old, float m_new,
                                                        float p_sum) {
        const float alpha = m_new == -INFINITY ? 1.f : exp2f(m_old - m_new);
        alpha_s[h] = alpha;
        l_s[h] = l_s[h] * alpha + p_sum;
        m_s[h] = m_new;
    }
};

}  // namespace mla
