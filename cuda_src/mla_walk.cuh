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
//                   program (x, p) serves query rows [x * heads, ...) of request b's
//                   n_rows = s_q * H rows (row r = i * H + h: query token i, head h) over chunk c
//                   of that request, (b, c) the p-th chunk of the batch in request order
//                   (locate_chunk, the arithmetic of sandbox/chunks.py).
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
//   w.stream_tiles<kRows>(s, e)      tiles the body runs: the slice's, or under the flat
//                                    schedule all the program's pieces' (PagedWalk<.., true>)
//   w.piece_tile(it)                 the body's tile `it` as a tile of its current slice
//   W::flat()                        the walk may carry the body across pieces: where
//                                    w.piece_done(it), the body writes the piece's partials,
//                                    calls w.next_piece(slice, it + 1) and stages its q
//   w.single()                       whether the program's rows get all their positions in
//                                    this one slice: then the body also writes latent and lse
//   w.latent_row(partial)            the latent / lse row of partial `partial` (single())
//   W::latent_is_partial()           latent_row is the identity (batch 1): a body may index
//                                    the latent as its partials, the batch-1 expression (an
//                                    inlined identity alone reorders mma_attn's PTX)
//   W::exp_offset(m), W::softmax_step(...)   the online softmax step, of a row that may see
//                                    no position of a tile or of the whole walk (paged)
// (No static data members: NVRTC emits each as a global symbol into every kernel's PTX.)
#pragma once
#include "mla_common.cuh"

namespace mla {

// ---- the chunk rule --------------------------------------------------------------------
// Exactly sandbox/chunks.py (batch_chunk_unit, request_chunks): with t_b = ceil(len_b / tile)
// tiles per request of the batch, count(u) = sum_b min(max_chunks, ceil(t_b / u)) programs
// run at chunks of u tiles; u = the smallest u in [lo, hi] with count(u) <= target (binary
// search, hi if none), lo = max(min_chunk / tile, ceil(W / target)), W = sum_b t_b,
// hi = max(lo, min(max t_b, ceil(W / (target - B')))) (B' non-empty requests; max t_b when
// target <= B'). Request b runs n0 = min(max_chunks, ceil(t_b / u)) chunks of
// chunk_len = max(1, ceil(t_b / n0)) * tile positions, n = ceil(len_b / chunk_len) of them.
// Every warp of a block computes it on its own (no shared memory, no barrier): each lane
// reads the lengths b = lane, lane + 32, ..., and the sums are warp reductions.
struct ChunkSpan {
    int n, len;
};
__device__ __forceinline__ long long warp_sum_ll(long long v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ int warp_sum_int(int v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ int warp_max_int(int v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
// W = sum_b t_b, the non-empty requests and max t_b of the batch. Called by whole warps.
struct BatchTiles {
    long long total;
    int busy, max_t;
};
__device__ __forceinline__ BatchTiles batch_tiles(const int* __restrict__ lengths, int batch,
                                                  int tile) {
    const int lane = threadIdx.x & 31;
    long long total = 0;
    int busy = 0, max_t = 0;
    for (int i = lane; i < batch; i += 32) {
        const int t = (__ldg(lengths + i) + tile - 1) / tile;
        total += t;
        busy += t > 0;
        max_t = max(max_t, t);
    }
    return {warp_sum_ll(total), warp_sum_int(busy), warp_max_int(max_t)};
}
// u, the balanced chunk length in tiles, of the batch of `batch` lengths, whose sums `bt`
// are. Called by whole warps.
__device__ __forceinline__ int batch_chunk_unit(const int* __restrict__ lengths, int batch,
                                                int max_chunks, int tile, int min_chunk,
                                                int target, const BatchTiles& bt) {
    const int lane = threadIdx.x & 31;
    int lo = max(min_chunk / tile, static_cast<int>((bt.total + target - 1) / target));
    int hi = target <= bt.busy
                 ? bt.max_t
                 : static_cast<int>(min(static_cast<long long>(bt.max_t),
                                        (bt.total + (target - bt.busy) - 1) / (target - bt.busy)));
    hi = max(lo, hi);
    while (lo < hi) {
        const int mid = lo + (hi - lo) / 2;
        int count = 0;
        for (int i = lane; i < batch; i += 32) {
            const int t = (__ldg(lengths + i) + tile - 1) / tile;
            count += min(max_chunks, (t + mid - 1) / mid);
        }
        if (warp_sum_int(count) <= target) hi = mid; else lo = mid + 1;
    }
    return lo;
}
// (n, chunk_len) of one request of `len` positions, at the batch's unit u.
__device__ __forceinline__ ChunkSpan request_span(int len, int u, int max_chunks, int tile) {
    const int t = (len + tile - 1) / tile;
    const int want = min(max_chunks, (t + u - 1) / u);
    const int chunk_len = max((t + max(want, 1) - 1) / max(want, 1), 1) * tile;
    return {(len + chunk_len - 1) / chunk_len, chunk_len};
}

// Where chunk program p of a row block lies (sandbox/chunks.py, program_chunks): the
// requests' chunks numbered request by request, program p runs the p-th one, chunk c of
// request b; b = -1 past the last (the program has nothing to do). `counts` not null: the
// warp also writes every request's chunk count there (the combine reads them). Called by
// whole warps; an exclusive prefix sum of the counts over 32 requests a round.
struct ChunkSlot {
    int b, c, n, len;
};
__device__ __forceinline__ ChunkSlot locate_chunk_at(const int* __restrict__ lengths, int batch,
                                                     int p, int u, int max_chunks, int tile,
                                                     int* __restrict__ counts);
__device__ __forceinline__ ChunkSlot locate_chunk(const int* __restrict__ lengths, int batch,
                                                  int p, int max_chunks, int tile,
                                                  int min_chunk, int target,
                                                  int* __restrict__ counts) {
    const int lane = threadIdx.x & 31;
    ChunkSlot slot{-1, 0, 0, tile};
    if (batch == 1) {
        // One request (sandbox/chunks.py, single_request_unit): count(lo) <= target, so the
        // search ends at lo, and the prefix sum is the identity. No shuffle lies between the
        // length's load and the program's first table lookup.
        const int len = __ldg(lengths);
        const int t = (len + tile - 1) / tile;
        const int u = max(min_chunk / tile, (t + target - 1) / target);
        const ChunkSpan span = request_span(len, u, max_chunks, tile);
        if (counts != nullptr && lane == 0) counts[0] = span.n;
        if (p < span.n) slot = {0, p, span.n, span.len};
        return slot;
    }
    return locate_chunk_at(lengths, batch, p,
                           batch_chunk_unit(lengths, batch, max_chunks, tile, min_chunk, target,
                                            batch_tiles(lengths, batch, tile)),
                           max_chunks, tile, counts);
}
// locate_chunk at the batch's unit u (batch_chunk_unit).
__device__ __forceinline__ ChunkSlot locate_chunk_at(const int* __restrict__ lengths, int batch,
                                                     int p, int u, int max_chunks, int tile,
                                                     int* __restrict__ counts) {
    const int lane = threadIdx.x & 31;
    ChunkSlot slot{-1, 0, 0, tile};
    int before = 0;  // chunks of the requests of earlier rounds
    for (int r0 = 0; r0 < batch; r0 += 32) {
        const int b = r0 + lane;
        const ChunkSpan span = b < batch ? request_span(__ldg(lengths + b), u, max_chunks, tile)
                                         : ChunkSpan{0, tile};
        if (counts != nullptr && b < batch) counts[b] = span.n;
        int incl = span.n;  // inclusive scan over the lanes
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int v = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += v;
        }
        const int start = before + incl - span.n;
        const unsigned mine = __ballot_sync(0xffffffffu, p >= start && p < start + span.n);
        if (mine != 0u) {
            const int src = __ffs(mine) - 1;
            slot.b = r0 + src;
            slot.c = p - __shfl_sync(0xffffffffu, start, src);
            slot.n = __shfl_sync(0xffffffffu, span.n, src);
            slot.len = __shfl_sync(0xffffffffu, span.len, src);
            if (counts == nullptr) break;
        }
        before += __shfl_sync(0xffffffffu, incl, 31);
    }
    return slot;
}

// ---- the flat schedule (sandbox/chunks.py, flat_unit) ------------------------------------
// Program p runs tiles [p U, (p + 1) U) of the batch's requests laid end to end, across
// request boundaries, one partial a request it meets: U = max(min_chunk / tile,
// ceil(W / target), ceil(max t_b / (max_chunks - 1))) (the last term: a request meets at most
// max_chunks programs). Chosen over the per-request rule's unit u when the batch has two
// non-empty requests or more, max_chunks >= 2 and U + kFlatMargin < u; 0: the per-request
// rule runs. Only a kernel built on PagedWalk<..., true> runs it (registry.runs_flat).
enum : int { kFlatMargin = 1 };  // sandbox/chunks.py FLAT_MARGIN
#ifdef MLA_REGISTRY_FACTS
static_assert(kFlatMargin == MLA_FLAT_MARGIN, "chunks.FLAT_MARGIN differs from kFlatMargin");
#endif
__device__ __forceinline__ int flat_unit(const BatchTiles& bt, int u, int max_chunks, int tile,
                                         int min_chunk, int target) {
    if (max_chunks < 2 || bt.busy < 2) return 0;
    const int unit = max(max(min_chunk / tile, static_cast<int>((bt.total + target - 1) / target)),
                         (bt.max_t + max_chunks - 2) / (max_chunks - 1));
    return unit + kFlatMargin < u ? unit : 0;
}
// Partials of a request of t tiles whose first tile is t0 of the concatenation: the programs
// its tiles meet (0 for an empty request).
__device__ __forceinline__ int flat_count(int t0, int t, int unit) {
    return t > 0 ? (t0 + t - 1) / unit - t0 / unit + 1 : 0;
}
// A request as the flat schedule sees it: b, its tiles t, its first tile t0 of the batch's
// concatenation, its length.
struct FlatRequest {
    int b, t, len, t0;
};
// The request in which program p's range [p U, (p + 1) U) starts (b = -1: p U is past the
// batch's last tile). `counts` not null: the warp also writes every request's partial count.
// Called by whole warps; a prefix sum of the tile counts over 32 requests a round.
__device__ __forceinline__ FlatRequest flat_locate(const int* __restrict__ lengths, int batch,
                                                   int p, int unit, int tile,
                                                   int* __restrict__ counts) {
    const int lane = threadIdx.x & 31;
    const int p0 = p * unit;
    FlatRequest found{-1, 0, 0, 0};
    int before = 0;  // tiles of the requests of earlier rounds
    for (int r0 = 0; r0 < batch; r0 += 32) {
        const int b = r0 + lane;
        const int len = b < batch ? __ldg(lengths + b) : 0;
        const int t = (len + tile - 1) / tile;
        int incl = t;  // inclusive scan over the lanes
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int v = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += v;
        }
        const int t0 = before + incl - t;
        if (counts != nullptr && b < batch) counts[b] = flat_count(t0, t, unit);
        const unsigned mine = __ballot_sync(0xffffffffu, t > 0 && t0 <= p0 && p0 < t0 + t);
        if (mine != 0u) {
            const int src = __ffs(mine) - 1;
            found = {r0 + src, __shfl_sync(0xffffffffu, t, src),
                     __shfl_sync(0xffffffffu, len, src), __shfl_sync(0xffffffffu, t0, src)};
            if (counts == nullptr) break;
        }
        before += __shfl_sync(0xffffffffu, incl, 31);
    }
    return found;
}
// The next request after request `after`, whose tiles end at tile `t0` of the
// concatenation, with a position, if it starts before tile `end` (b = -1 if none): what a
// program's range meets after `after`.
__device__ __forceinline__ FlatRequest flat_next(const int* __restrict__ lengths, int batch,
                                                 int after, int t0, int end, int tile) {
    for (int b = after + 1; b < batch && t0 < end; ++b) {
        const int len = __ldg(lengths + b);
        const int t = (len + tile - 1) / tile;
        if (t > 0) return {b, t, len, t0};
    }
    return {-1, 0, 0, t0};
}

// Asks for the 128-byte line at p to be brought into L2 (no register is written).
__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
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
// Single pass: the two functions below, shared by both walks. Where w.single() (batch 1: one
// slice for every head; paged: the program's request runs one chunk) the kernel also writes
// latent = acc / l and lse = (m + log2 l) ln 2 (latent 0, lse -inf where l == 0) at row
// w.latent_row(partial); its partials are written as well, so a merge that does run gives
// the same words.
__device__ __forceinline__ float single_pass_inv_l(float l) { return l > 0.f ? 1.f / l : 0.f; }
__device__ __forceinline__ float single_pass_lse(float m, float l) {
    return l > 0.f ? (m + log2f(l)) * 0.69314718055994531f : -INFINITY;
}

template <typename CacheT>
struct ContiguousWalk {
    const CacheT* cache;
    int n_head, n_ctx, splits;
    float* latent;  // [n_head][512] and [n_head]: written when splits == 1
    float* lse;
    __device__ __forceinline__ bool single() const { return splits == 1; }
    // With one slice, partial h is head h's latent row.
    __device__ __forceinline__ size_t latent_row(size_t partial) const { return partial; }
    __device__ __forceinline__ static constexpr bool latent_is_partial() { return true; }
    __device__ __forceinline__ static constexpr bool flat() { return false; }

    __device__ __forceinline__ bool begin(int heads, int latent, float* part_acc, float* part_m,
                                          float* part_l, BlockSlice& out) const {
        return begin_slice(heads, n_head, n_ctx, splits, latent, part_acc, part_m, part_l, out);
    }
    // One slice a block: its tiles, and tile `it` is the slice's.
    template <int kRows>
    __device__ __forceinline__ static int stream_tiles(int row_start, int row_end) {
        return (row_end - row_start + kRows - 1) / kRows;
    }
    __device__ __forceinline__ static int piece_tile(int it) { return it; }
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
// The pages of a thread's rows of the next tile are looked up while this tile is copied
// (fetch), so a copy never waits on a table read: one lookup per copy pass (one a tile where
// the tile lies in one page), off the critical path, and nothing in the loops over a tile.
enum : int { kPagedMaxPasses = 2 };  // copy passes of a tile per thread, at most (an enum:
                                     // NVRTC emits namespace constants into every PTX)

// 0: a planted defect for a negative control (tests/test_gpu_paged_kernels.py): the merge
// in the attention kernel (PagedWalk::arrive) adds the partials without rescaling them.
#ifndef MLA_MERGE_RESCALE
#define MLA_MERGE_RESCALE 1
#endif

// kFlat: the walk also runs the flat schedule (flat_unit), carrying a program from one
// request's piece to the next: the body calls next_piece() where piece_done(), and the copy
// cursor (cp_req, cp_row, cp_end) runs a tile ahead across the same boundaries.
template <typename CacheT, int kTile, bool kFlat = false>
struct PagedWalk {
    const CacheT* cache;
    const int* table;           // block_table [B, max_pages]
    const int* cache_seqlens;
    int n_rows, n_head, s_q, causal, max_pages, page_shift, max_chunks, min_chunk, target;
    int batch;
    int* chunk_counts;          // [B]: each request's chunk count, for the combine
    float* latent;              // [B][n_rows][512] and [B][n_rows]: written where single()
    float* lse;
    // kFlat only: where set ([B][row blocks], zero between launches), the attention kernel
    // merges every request of two chunks or more itself (arrive) and no combine runs.
    int* merge_tickets = nullptr;
    size_t q_row0 = 0;          // request b's first q row (also its first latent row)
    int visible0 = 0;           // row r sees positions < visible0 (+ r / n_head when causal)
    int req = 0, chunk = 0;     // the program's request and chunk (begin)
    int chunks = 1;             // the request's chunk count (begin; 1 in a single-pass plan)
    int page[kPagedMaxPasses] = {};  // the pages of this thread's rows of the next tile to copy
    // kFlat only. The flat schedule's U (0: the per-request rule, one piece) and the end of
    // the program's range, (p + 1) U, in tiles of the concatenation. The body's piece is of
    // request req, whose tiles end at tile req_end of the concatenation; it began at the
    // body's tile piece_it0 and ends before piece_end. The copy cursor is at position cp_row
    // of request cp_req (tiles ending at cp_req_end), whose piece ends at position cp_end.
    int unit = 0, prog_end = 0, prog_tiles = 0, req_end = 0, piece_it0 = 0, piece_end = 0;
    int cp_req = 0, cp_req_end = 0, cp_row = 0, cp_end = 0;
    bool cp_first = false;  // the cursor's tile is the first of a piece after the program's first
    bool wrote_neutral = false;  // begin wrote the block's neutral partial (and returned false)

    __device__ __forceinline__ static constexpr bool flat() { return kFlat; }
    // The plan: one chunk slot a request (grid y = B, program p is request p).
    __device__ __forceinline__ bool single_plan() const { return max_chunks == 1; }
    // The program's request runs exactly one chunk (every request in a single-pass plan):
    // its rows' partials are final, and the body writes latent and lse itself.
    __device__ __forceinline__ bool single() const { return chunks == 1; }
    // Where single(): chunk 0 of request req, partial (req * max_chunks) * n_rows + r, is
    // row r of the request, latent row q_row0 + r.
    __device__ __forceinline__ size_t latent_row(size_t partial) const {
        return q_row0 + (partial - static_cast<size_t>(req) * max_chunks * n_rows);
    }
    __device__ __forceinline__ static constexpr bool latent_is_partial() { return false; }

    __device__ __forceinline__ int visible(int r) const {
        return causal ? visible0 + r / n_head : visible0;
    }
    // Program p = blockIdx.y of row block blockIdx.x. Single-pass plan (max_chunks 1, grid
    // y = B): request p, chunk 0. Else (grid y = max(target, B)) the p-th chunk of the batch
    // in request order (locate_chunk), nothing past the last. Row block 0's program 0 (single-
    // pass plan: each request's program of row block 0) publishes the chunk counts. A block
    // none of whose rows sees a position of its chunk (causal) writes their neutral partials,
    // and where its request runs one chunk (single()) their latent 0 and lse -inf.
    __device__ __forceinline__ bool begin(int heads, int latent_dim, float* part_acc,
                                          float* part_m, float* part_l, BlockSlice& out) {
        const int p = blockIdx.y;
        const int head0 = static_cast<int>(blockIdx.x) * heads;
        // One line of the table into L2 before the program knows its chunk: line p of
        // gridDim.y spread over the table, where chunks in request order put program p's
        // first lookups when the requests' page counts follow their lengths. In the table's
        // bounds; a prefetch reads nothing into the program.
        const size_t entries = static_cast<size_t>(batch) * max_pages;
        if (threadIdx.x == 0) prefetch_l2(table + static_cast<size_t>(p) * entries / gridDim.y);
        int len;
        if (single_plan()) {
            req = p;
            chunk = 0;
            len = __ldg(cache_seqlens + p);
            if (blockIdx.x == 0 && threadIdx.x == 0) chunk_counts[p] = len > 0;
            if (len == 0) {  // an empty request's rows get latent 0, lse -inf here
                write_empty_latent(heads, head0, static_cast<size_t>(p) * n_rows, latent_dim);
                return false;
            }
            out = {head0, 0, 0, static_cast<size_t>(p) * n_rows};
            out.row_end = len;
        } else {
            const bool publish = blockIdx.x == 0 && p == 0 && threadIdx.x < 32;
            ChunkSlot slot;
            if constexpr (kFlat) {
                if (batch > 1) {
                    const BatchTiles bt = batch_tiles(cache_seqlens, batch, kTile);
                    const int u = batch_chunk_unit(cache_seqlens, batch, max_chunks, kTile,
                                                   min_chunk, target, bt);
                    unit = flat_unit(bt, u, max_chunks, kTile, min_chunk, target);
                    if (unit > 0)
                        return begin_flat(head0, static_cast<int>(bt.total),
                                          publish ? chunk_counts : nullptr, out);
                    slot = locate_chunk_at(cache_seqlens, batch, p, u, max_chunks, kTile,
                                           publish ? chunk_counts : nullptr);
                } else {
                    slot = locate_chunk(cache_seqlens, batch, p, max_chunks, kTile, min_chunk,
                                        target, publish ? chunk_counts : nullptr);
                }
            } else {
                slot = locate_chunk(cache_seqlens, batch, p, max_chunks, kTile, min_chunk,
                                    target, publish ? chunk_counts : nullptr);
            }
            if (slot.b < 0) return false;
            req = slot.b;
            chunk = slot.c;
            chunks = slot.n;
            len = __ldg(cache_seqlens + req);
            const int start = chunk * slot.len;
            out = {head0, start, min(len, start + slot.len),
                   (static_cast<size_t>(req) * max_chunks + chunk) * n_rows};
        }
        q_row0 = static_cast<size_t>(req) * n_rows;
        visible0 = causal ? len - (s_q - 1) : len;
        out.row_end = max(min(out.row_end, visible(min(head0 + heads, n_rows) - 1)),
                          out.row_start);
        if (out.row_start < out.row_end) {
            if constexpr (kFlat) {  // one piece: the cursor walks the slice
                cp_req = req;
                cp_row = out.row_start;
                cp_end = out.row_end;
                prog_tiles = piece_end = (out.row_end - out.row_start + kTile - 1) / kTile;
            }
            return true;
        }
        write_neutral(heads, n_rows, latent_dim, out, part_acc, part_m, part_l);
        if (single()) write_empty_latent(heads, head0, q_row0, latent_dim);
        if constexpr (kFlat) wrote_neutral = true;
        return false;
    }
    // latent 0 and lse -inf for rows [head0, head0 + heads) below n_rows of the request whose
    // first latent row is `base` (q_row0), rows that see no position.
    __device__ __forceinline__ void write_empty_latent(int heads, int head0, size_t base,
                                                       int latent_dim) const {
        for (int j = 0; j < heads && head0 + j < n_rows; ++j) {
            const size_t row = base + head0 + j;
            for (int k = threadIdx.x; k < latent_dim; k += blockDim.x)
                latent[row * latent_dim + k] = 0.f;
            if (threadIdx.x == 0) lse[row] = -INFINITY;
        }
    }
    // ---- the merge in the attention kernel (kFlat, merge_tickets set) --------------------
    // A block that has written its partial of a request of two chunks or more takes the
    // ticket of (request, row block); the block whose ticket is the request's last merges
    // the request's partials of its rows, rescaled as the combine does (mla_combine.cu), into
    // latent and lse, and sets the ticket back to 0 for the next launch. Each thread's fence
    // before the tickets publishes its partials; the merger's fence after them orders its
    // reads (L2, __ldcg) after every other block's partial.
    //
    // A piece that ends inside the program (the end of a request, at the program's start)
    // only notes its request (defer); the tickets of every piece are taken together at the
    // program's end (finish). A fence and a ticket round trip at each piece switch held the
    // whole block inside its tile loop: with them there, the merge made the kernel 8-10 us
    // slower at B = 32 x N(8192, 4096) (docs/schedule.md). Pieces ending early are rarely a
    // request's last, so the merges still run at the programs' end, in parallel.
    // Pieces between a program's first and last are whole requests (one partial, no merge),
    // so only the first is noted; a second note would take the tickets at once.
    static constexpr int kPending = 1;
    int n_pending = 0;                  // the same in every thread
    __device__ __forceinline__ static int* pending_slots() {  // (req, chunks) a piece, and last
        __shared__ int slots[3 * (kPending + 1)];
        return slots;
    }
    template <int kHeads, int kThreads>
    __device__ __forceinline__ void defer(int head0, const float* part_acc, const float* part_m,
                                          const float* part_l) {
        if (merge_tickets == nullptr || chunks < 2) return;
        if (n_pending == kPending) {
            finish<kHeads, kThreads>(head0, part_acc, part_m, part_l);
            return;
        }
        if (threadIdx.x == 0) {  // read by the end's barrier, after many more
            pending_slots()[3 * n_pending] = req;
            pending_slots()[3 * n_pending + 1] = chunks;
        }
        ++n_pending;
    }
    // The current piece and the noted ones take their tickets; their last blocks merge.
    template <int kHeads, int kThreads>
    __device__ __forceinline__ void finish(int head0, const float* part_acc, const float* part_m,
                                           const float* part_l) {
        if (merge_tickets == nullptr) return;
        int* slots = pending_slots();
        if (chunks >= 2) {
            if (threadIdx.x == 0) {
                slots[3 * n_pending] = req;
                slots[3 * n_pending + 1] = chunks;
            }
            ++n_pending;
        }
        if (n_pending == 0) return;
        __threadfence();
        __syncthreads();
        if (static_cast<int>(threadIdx.x) < n_pending) {
            int* s = slots + 3 * threadIdx.x;
            int* ticket = merge_tickets + static_cast<size_t>(s[0]) * gridDim.x + blockIdx.x;
            s[2] = atomicAdd(ticket, 1) == s[1] - 1;
            if (s[2]) *ticket = 0;
        }
        __syncthreads();
        const int n = n_pending;
        n_pending = 0;
        bool fenced = false;
        for (int i = 0; i < n; ++i) {
            if (!slots[3 * i + 2]) continue;
            if (!fenced) __threadfence();
            fenced = true;
            merge<kHeads, kThreads>(head0, slots[3 * i], slots[3 * i + 1], part_acc, part_m,
                                    part_l);
        }
        __syncthreads();  // the slots are free for the next notes
    }
    // The merge of request b's `n` partials of rows [head0, head0 + kHeads). Lane c of a
    // row's kTpr threads loads chunk c's (m, l) (so n <= ATTN_MERGE_MAX_CHUNKS <= kTpr), the
    // row's max and l are shuffle reductions in a fixed order, and the partials are then
    // read kMergeUnroll chunks at a time, each chunk's weight shuffled from its lane: the
    // merge waits on memory a few times, not twice a chunk.
    template <int kHeads, int kThreads>
    __device__ __forceinline__ void merge(int head0, int b, int n, const float* part_acc,
                                          const float* part_m, const float* part_l) const {
        constexpr int kTpr = kThreads / kHeads, kPer = MLA_KV_LORA / 4 / kTpr;
        static_assert(kThreads % kHeads == 0 && MLA_KV_LORA % (4 * kTpr) == 0,
                      "whole float4 columns per thread of a row");
        static_assert(kTpr <= 32 && (kTpr & (kTpr - 1)) == 0, "a row's threads within a warp");
#ifdef MLA_REGISTRY_FACTS
        static_assert(MLA_ATTN_MERGE_MAX_CHUNKS <= kTpr,
                      "registry.ATTN_MERGE_MAX_CHUNKS: one lane a chunk's (m, l)");
#endif
        constexpr int kMergeUnroll = 2;
        const int j = static_cast<int>(threadIdx.x) / kTpr, lane = static_cast<int>(threadIdx.x) % kTpr;
        const bool row = head0 + j < n_rows;  // every lane stays for the shuffles
        const size_t first = static_cast<size_t>(b) * max_chunks * n_rows + head0 + j;
        float lc = 0.f, mc = -INFINITY;
        if (row && lane < n) {
            const size_t k = first + static_cast<size_t>(lane) * n_rows;
            lc = __ldcg(part_l + k);
            const float m_raw = __ldcg(part_m + k);
            if (lc > 0.f) mc = m_raw;
        }
        float m = mc;
#pragma unroll
        for (int o = kTpr / 2; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o, kTpr));
        const float wc = lc > 0.f ? (MLA_MERGE_RESCALE ? exp2f(mc - m) : 1.f) : 0.f;
        float l = wc * lc;
#pragma unroll
        for (int o = kTpr / 2; o > 0; o >>= 1) l += __shfl_xor_sync(0xffffffffu, l, o, kTpr);
        float4 acc[kPer];
#pragma unroll
        for (int i = 0; i < kPer; ++i) acc[i] = make_float4(0.f, 0.f, 0.f, 0.f);
        const float4* src0 = reinterpret_cast<const float4*>(part_acc + first * MLA_KV_LORA) + lane;
        const size_t chunk_stride = static_cast<size_t>(n_rows) * (MLA_KV_LORA / 4);
#pragma unroll kMergeUnroll
        for (int c = 0; c < n; ++c) {
            const float w = __shfl_sync(0xffffffffu, wc, c, kTpr);
            if (!row) continue;
            const float4* src = src0 + c * chunk_stride;
#pragma unroll
            for (int i = 0; i < kPer; ++i) {
                const float4 a = __ldcg(src + i * kTpr);
                acc[i].x = fmaf(w, a.x, acc[i].x);
                acc[i].y = fmaf(w, a.y, acc[i].y);
                acc[i].z = fmaf(w, a.z, acc[i].z);
                acc[i].w = fmaf(w, a.w, acc[i].w);
            }
        }
        if (!row) return;
        const float inv_l = single_pass_inv_l(l);
        const size_t out_row = static_cast<size_t>(b) * n_rows + head0 + j;
        float4* dst = reinterpret_cast<float4*>(latent + out_row * MLA_KV_LORA) + lane;
#pragma unroll
        for (int i = 0; i < kPer; ++i)
            dst[i * kTpr] = make_float4(acc[i].x * inv_l, acc[i].y * inv_l, acc[i].z * inv_l,
                                        acc[i].w * inv_l);
        if (lane == 0) lse[out_row] = single_pass_lse(m, l);
    }
    // An empty request has no chunk, so no block merges it: program p < B writes request p's
    // rows of its row block (latent 0, lse -inf) where the kernel merges (merge_tickets).
    __device__ __forceinline__ void write_if_empty(int heads, int latent_dim) const {
        const int p = blockIdx.y;
        if (merge_tickets == nullptr || p >= batch || __ldg(cache_seqlens + p) != 0) return;
        write_empty_latent(heads, static_cast<int>(blockIdx.x) * heads,
                           static_cast<size_t>(p) * n_rows, latent_dim);
    }
    // ---- the flat schedule (kFlat, unit > 0) -------------------------------------------
    // Program p's first piece: the request its range [p U, (p + 1) U) starts in, from the
    // tile its range starts at to its end or the range's. Every piece has a tile or more;
    // its rows are not clipped to what a causal row sees (the body masks each row), so a
    // block whose rows see nothing of a piece writes their neutral partial through the body.
    __device__ __forceinline__ bool begin_flat(int head0, int total, int* counts,
                                               BlockSlice& out) {
        const int p = blockIdx.y;
        const FlatRequest first = flat_locate(cache_seqlens, batch, p, unit, kTile, counts);
        if (first.b < 0) return false;
        prog_end = (p + 1) * unit;
        prog_tiles = min(prog_end, total) - p * unit;
        out.head0 = head0;
        enter_piece(first, out);
        cp_req = req;
        cp_req_end = req_end;
        cp_row = out.row_start;
        cp_end = out.row_end;
        return true;
    }
    // Positions [start, end) of request r within the program's range.
    __device__ __forceinline__ void piece_rows(const FlatRequest& r, int& start, int& end) const {
        start = (max(prog_end - unit, r.t0) - r.t0) * kTile;
        end = min(r.len, (min(prog_end, r.t0 + r.t) - r.t0) * kTile);
    }
    // The body's piece becomes request r's: its partial slot, count, q rows and slice (the
    // body's tiles from piece_it0 on).
    __device__ __forceinline__ void enter_piece(const FlatRequest& r, BlockSlice& out) {
        req = r.b;
        req_end = r.t0 + r.t;
        chunk = static_cast<int>(blockIdx.y) - r.t0 / unit;
        chunks = flat_count(r.t0, r.t, unit);
        q_row0 = static_cast<size_t>(req) * n_rows;
        visible0 = causal ? r.len - (s_q - 1) : r.len;
        piece_rows(r, out.row_start, out.row_end);
        out.part_base = (static_cast<size_t>(req) * max_chunks + chunk) * n_rows;
        piece_end = piece_it0 + (out.row_end - out.row_start + kTile - 1) / kTile;
    }
    // Tiles of kRows the program's body runs (kFlat: all its pieces').
    template <int kRows>
    __device__ __forceinline__ int stream_tiles(int row_start, int row_end) const {
        static_assert(!kFlat || kRows == kTile, "the flat schedule counts the walk's tiles");
        if constexpr (kFlat) return prog_tiles;
        else return (row_end - row_start + kRows - 1) / kRows;
    }
    // Tile `it` of the program as a tile of its piece.
    __device__ __forceinline__ int piece_tile(int it) const {
        if constexpr (kFlat) return it - piece_it0;
        else return it;
    }
    // Whether the body's tile `it` of `n_tiles` is its piece's last and another piece follows.
    __device__ __forceinline__ bool piece_done(int it, int n_tiles) const {
        return it + 1 < n_tiles && it + 1 == piece_end;
    }
    // The next piece, whose first tile is the body's tile `it0`.
    __device__ __forceinline__ void next_piece(BlockSlice& out, int it0) {
        piece_it0 = it0;
        enter_piece(flat_next(cache_seqlens, batch, req, req_end, prog_end, kTile), out);
    }
    __device__ __forceinline__ int rows() const { return n_rows; }
    // The request's row of the table.
    __device__ __forceinline__ const int* request_pages() const {
        return table + static_cast<size_t>(req) * max_pages;
    }
    template <typename QT> __device__ __forceinline__ const QT* q(const QT* q0) const {
        return q0 + q_row0 * (MLA_KV_LORA + MLA_ROPE);
    }
    __device__ __forceinline__ int row_end(int r, int slice_end) const {
        return min(slice_end, visible(r));
    }
    // Whether each tile of a slice starting at row_start lies in one page: pages of at least
    // kRows positions and tiles on page boundaries (chunks are whole tiles from position 0,
    // so this holds at page sizes >= the tile). Then a tile needs one table entry, and its
    // copy is the contiguous one from that page, where per-row page arithmetic made the
    // paged copy block 79 warp instructions a tile against the contiguous 49 (ncu, H200,
    // 1 x 131072 x 16 heads, mma16, page 64; docs/schedule.md has the rest of the gap).
    template <int kRows>
    __device__ __forceinline__ bool tile_in_page(int row_start) const {
        static_assert((kRows & (kRows - 1)) == 0, "tiles of a power-of-two rows");
        return (1 << page_shift) >= kRows && (row_start & (kRows - 1)) == 0;
    }
    // The pages of this thread's rows of tile `tile_index` (rows past row_end: page 0, never
    // read, and their table entries are not looked up). A tile in one page: its entry, in
    // page[0], the same word for every thread (one broadcast load).
    template <int kRows, int kThreadsT>
    __device__ __forceinline__ void fetch(int tile_index, int row_start, int row_end) {
        if constexpr (kFlat)  // the copy cursor's tile
            fetch_in<kRows, kThreadsT>(table + static_cast<size_t>(cp_req) * max_pages, 0,
                                       cp_row, cp_end);
        else
            fetch_in<kRows, kThreadsT>(request_pages(), tile_index, row_start, row_end);
    }
    // fetch, from the table row `pages`.
    template <int kRows, int kThreadsT>
    __device__ __forceinline__ void fetch_in(const int* pages, int tile_index, int row_start,
                                             int row_end) {
        constexpr int kRowsPerPass = kThreadsT / 8, kPasses = kRows / kRowsPerPass;
        static_assert(kPasses <= kPagedMaxPasses, "a thread copies at most 2 rows a tile");
        if (tile_in_page<kRows>(row_start)) {
            const int row = row_start + tile_index * kRows;
            page[0] = row < row_end ? __ldg(pages + (row >> page_shift)) : 0;
            return;
        }
        const int row0 = row_start + tile_index * kRows + static_cast<int>(threadIdx.x >> 3);
        // Every pass loads its own entry, the same word as the pass before where both rows
        // lie in one page (an L1 hit): nothing here waits for a load, whose value the next
        // tile's copy needs a tile of compute later. Reusing the entry of the pass before
        // instead made the copy wait for the table on every tile (ncu, H200, 1 x 131072 x 16
        // heads, mma16: a SEL on the load's register held 7% of the kernel's stall samples).
#pragma unroll
        for (int pass = 0; pass < kPasses; ++pass) {
            const int row = row0 + pass * kRowsPerPass;
            page[pass] = row < row_end ? __ldg(pages + (row >> page_shift)) : 0;
        }
    }
    // cp_async_tile's copy, each row's address through the pages of this tile (fetched one
    // copy ago), then the next tile's pages. A loop of its own: routing cp_async_tile through
    // a row-address callback reorders the batch-1 kernels' PTX. kFlat: the tile at the copy
    // cursor, which then moves a tile on, into the program's next piece past its piece's end;
    // entered(b) tells the body, as the cursor copies the first tile of a piece of request b
    // (not the program's first), that the body stages b's q after its next tile;
    // tile_index, row_start and row_end are the per-request walk's.
    template <int kRows, int kChunks, int kStages, int kThreadsT, bool kSwizzle = true>
    __device__ __forceinline__ void copy_tile(uint4* tiles, int buf, int tile_index, int row_start,
                                              int row_end) {
        copy_tile<kRows, kChunks, kStages, kThreadsT, kSwizzle>(tiles, buf, tile_index,
                                                                row_start, row_end, [](int) {});
    }
    template <int kRows, int kChunks, int kStages, int kThreadsT, bool kSwizzle = true,
              typename Entered>
    __device__ __forceinline__ void copy_tile(uint4* tiles, int buf, int tile_index, int row_start,
                                              int row_end, Entered&& entered) {
        if (kAblateCacheLoads && tile_index >= kStages) return;
        if constexpr (kFlat) {
            if (cp_first) {
                cp_first = false;
                entered(cp_req);
            }
            copy_rows<kRows, kChunks, kThreadsT, kSwizzle>(tiles, buf, cp_row, cp_row, cp_end, [&] {
                cp_row += kRows;
                if (cp_row >= cp_end && unit > 0) {
                    const FlatRequest next =
                        flat_next(cache_seqlens, batch, cp_req, cp_req_end, prog_end, kTile);
                    if (next.b >= 0) {
                        cp_req = next.b;
                        cp_req_end = next.t0 + next.t;
                        piece_rows(next, cp_row, cp_end);
                        cp_first = true;
                    }
                }
                fetch<kRows, kThreadsT>(0, 0, 0);
            });
        } else {
            copy_rows<kRows, kChunks, kThreadsT, kSwizzle>(
                tiles, buf, row_start + tile_index * kRows, row_start, row_end,
                [&] { fetch<kRows, kThreadsT>(tile_index + 1, row_start, row_end); });
        }
    }
    // The copy of rows [row0, row0 + kRows) (below row_end) of a slice starting at row_start,
    // through page[], into stage buffer `buf`, one commit group; then next() (the next tile's
    // lookups, in each branch: one call after both reorders the batch-1 kernels' PTX).
    template <int kRows, int kChunks, int kThreadsT, bool kSwizzle, typename Next>
    __device__ __forceinline__ void copy_rows(uint4* tiles, int buf, int row0, int row_start,
                                              int row_end, Next&& next) {
        constexpr int kRowsPerPass = kThreadsT / 8;
        static_assert(kThreadsT % 64 == 0 && kRows % kRowsPerPass == 0,
                      "8 threads per row, a pass of rows a multiple of 8 (one swizzle a thread)");
        static_assert(kChunks % 8 == 0, "the XOR swizzle permutes chunks within groups of 8");
        const int copy_row = threadIdx.x >> 3, copy_lane = threadIdx.x & 7;
        const int in_page = (1 << page_shift) - 1;
        uint4* dst = tiles + buf * kRows * kChunks + copy_row * kChunks +
                     (kSwizzle ? (copy_lane ^ (copy_row & 7)) : copy_lane);
        if (tile_in_page<kRows>(row_start)) {
            // One page: row row0 + k is row (row0 & in_page) + k of page page[0]. Rows past
            // row_end stay inside that page (or page 0 past the slice), never read.
            const size_t tile_row = (static_cast<size_t>(page[0]) << page_shift) + (row0 & in_page);
            const CacheT* src = cache + (tile_row + copy_row) * (kChunks * 8) + copy_lane * 8;
#pragma unroll
            for (int pass = 0; pass < kRows / kRowsPerPass; ++pass) {
                const bool valid = row0 + pass * kRowsPerPass + copy_row < row_end;
#pragma unroll
                for (int i = 0; i < kChunks / 8; ++i)
                    cp_async_16(dst + (pass * kRowsPerPass * kChunks + 8 * i),
                                src + pass * kRowsPerPass * (kChunks * 8) + 64 * i, valid);
            }
            cp_async_commit();
            next();
            return;
        }
#pragma unroll
        for (int pass = 0; pass < kRows / kRowsPerPass; ++pass) {
            const int row = row0 + pass * kRowsPerPass + copy_row;
            const bool valid = row < row_end;
            const size_t cache_row = (static_cast<size_t>(page[pass]) << page_shift) + (row & in_page);
            const CacheT* src = cache + cache_row * (kChunks * 8) + copy_lane * 8;
#pragma unroll
            for (int i = 0; i < kChunks / 8; ++i)
                cp_async_16(dst + (pass * kRowsPerPass * kChunks + 8 * i), src + 64 * i, valid);
        }
        cp_async_commit();
        next();
    }
    __device__ __forceinline__ size_t part_base() const {
        return (static_cast<size_t>(req) * max_chunks + chunk) * n_rows;
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
