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
//   w.single()                       whether the program's rows get all their positions in
//                                    this one slice: then the body also writes latent and lse
//   w.latent_row(partial)            the latent / lse row of partial `partial` (single())
//   W::latent_is_partial()           latent_row is the identity (batch 1): a body may index
//                                    the latent as its partials, the batch-1 expression (an
//                                    inlined identity alone reorders mma_attn's PTX)
//   w.finish<kHeads, kThreads>(tickets, rescale, part_acc, part_m, part_l)
//                                    after the partials (or a false begin): the paged walk's
//                                    merge by the request's last program where the host passes
//                                    tickets (mma); nothing otherwise
//   W::exp_offset(m), W::softmax_step(...)   the online softmax step, of a row that may see
//                                    no position of a tile or of the whole walk (paged)
// (No static data members: NVRTC emits each as a global symbol into every kernel's PTX.)
#pragma once
#include "mla_common.cuh"

namespace mla {

// ---- the chunk rule --------------------------------------------------------------------
// Exactly sandbox/chunks.py (batch_chunk_unit, request_chunks): with t_b = ceil(len_b / tile)
// tiles per request of the batch, count(u) = sum_b min(max_chunks, ceil(t_b / u)) programs
// run at chunks of u tiles; u = the smallest u in [lo, hi] with count(u) <= target (a search
// of three candidates a step, hi if none), lo = max(min_chunk / tile, ceil(W / target)),
// W = sum_b t_b, hi = max(lo, min(max t_b, ceil(W / (target - B')))) (B' non-empty requests;
// max t_b when target <= B'). Request b runs n0 = min(max_chunks, ceil(t_b / u)) chunks of
// chunk_len = max(1, ceil(t_b / n0)) * tile positions, n = ceil(len_b / chunk_len) of them.
// Every warp of a block computes it on its own (no shared memory, no barrier): each lane
// reads the lengths b = lane, lane + 32, ... (the first kHeldTiles of them once, into
// registers), and the sums are warp reductions.
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
// The batch's tiles: W = sum_b t_b, B' (non-empty requests), max t_b, and each lane's first
// kHeldTiles requests' t (lane, lane + 32, ...; 0 past the batch), which the search reads from
// registers on every step. Called by whole warps.
enum : int { kHeldTiles = 4 };  // B <= 128 held whole (an enum: NVRTC emits namespace
                                // constants into every PTX)
struct BatchTiles {
    long long total;
    int busy, max_t;
    int t[kHeldTiles];
};
__device__ __forceinline__ int tiles_of(const int* __restrict__ lengths, int b, int tile) {
    return (__ldg(lengths + b) + tile - 1) / tile;
}
__device__ __forceinline__ BatchTiles batch_tiles(const int* __restrict__ lengths, int batch,
                                                  int tile) {
    const int lane = threadIdx.x & 31;
    BatchTiles bt;
    long long total = 0;
    int busy = 0, max_t = 0;
    // All of a lane's held loads are issued together: this runs ahead of every program's
    // first copy.
#pragma unroll
    for (int k = 0; k < kHeldTiles; ++k) {
        const int b = lane + 32 * k;
        bt.t[k] = b < batch ? tiles_of(lengths, b, tile) : 0;
    }
#pragma unroll
    for (int k = 0; k < kHeldTiles; ++k) {
        total += bt.t[k];
        busy += bt.t[k] > 0;
        max_t = max(max_t, bt.t[k]);
    }
    for (int b = lane + 32 * kHeldTiles; b < batch; b += 32) {
        const int t = tiles_of(lengths, b, tile);
        total += t;
        busy += t > 0;
        max_t = max(max_t, t);
    }
    bt.total = warp_sum_ll(total);
    bt.busy = warp_sum_int(busy);
    bt.max_t = warp_max_int(max_t);
    return bt;
}
// u, the balanced chunk length in tiles, of the batch of `batch` lengths on `target` programs.
// kGuardHeld: how a step skips the held tile counts past the batch (32 k >= batch, none of a
// warp's lanes holds a request there). false, the built-in kernels: the loop over them ends
// there (a break); the guard instead cost mma16 3-4 us at B = 96 / 128 x N(4096, 2048) and
// 1 us at B = 32 x N(8192, 4096) (docs/schedule.md, "A cheaper search"). true, the
// user-kernel helper (mla_user.cuh): each held entry is tested on its own, since the break
// made NVRTC 13.5's ptxas spill a 128-thread user kernel (tests/data/byok_bad_pages.cu).
// count(u) does not increase with u, so the smallest fitting u is found by testing three
// candidates a step, which cut [lo, hi) in four: the first that fits (or hi) bounds the next
// range. Their counts and warp reductions are independent, so a step costs about one
// reduction's latency, and a range of d values takes log4(d) steps where halving takes
// log2(d). Called by whole warps.
template <bool kGuardHeld = false>
__device__ __forceinline__ int batch_chunk_unit(const int* __restrict__ lengths, int batch,
                                                int max_chunks, int tile, int min_chunk,
                                                int target, const BatchTiles& bt) {
    const int lane = threadIdx.x & 31;
    const long long total = bt.total;
    const int busy = bt.busy, max_t = bt.max_t;
    int lo = max(min_chunk / tile, static_cast<int>((total + target - 1) / target));
    int hi = target <= busy
                 ? max_t
                 : static_cast<int>(min(static_cast<long long>(max_t),
                                        (total + (target - busy) - 1) / (target - busy)));
    hi = max(lo, hi);
    // lo >= 1 wherever lo < hi (hi > 0 means some t > 0, so W >= 1): no division by 0.
    while (lo < hi) {
        const int d = hi - lo;  // candidates lo + floor(k d / 4), k = 1..3: in [lo, hi)
        const int u1 = lo + (d >> 2), u2 = lo + (d >> 1), u3 = lo + ((3 * d) >> 2);
        int c1 = 0, c2 = 0, c3 = 0;
#pragma unroll
        for (int k = 0; k < kHeldTiles; ++k) {
            if (!kGuardHeld && 32 * k >= batch) break;  // skip the divisions of empty entries
            if (!kGuardHeld || 32 * k < batch) {
                const int t = bt.t[k];
                c1 += min(max_chunks, (t + u1 - 1) / u1);
                c2 += min(max_chunks, (t + u2 - 1) / u2);
                c3 += min(max_chunks, (t + u3 - 1) / u3);
            }
        }
        for (int b = lane + 32 * kHeldTiles; b < batch; b += 32) {
            const int t = tiles_of(lengths, b, tile);
            c1 += min(max_chunks, (t + u1 - 1) / u1);
            c2 += min(max_chunks, (t + u2 - 1) / u2);
            c3 += min(max_chunks, (t + u3 - 1) / u3);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            c1 += __shfl_xor_sync(0xffffffffu, c1, o);
            c2 += __shfl_xor_sync(0xffffffffu, c2, o);
            c3 += __shfl_xor_sync(0xffffffffu, c3, o);
        }
        if (c1 <= target) hi = u1;
        else if (c2 <= target) { lo = u1 + 1; hi = u2; }
        else if (c3 <= target) { lo = u2 + 1; hi = u3; }
        else lo = u3 + 1;
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
// request b; b = -1 past the last (the program has nothing to do). The rule runs on target
// programs, or on 2 target where the grid (gridDim.y >= 2 target, B < target) offers a second
// wave and the lengths take it. `counts` not null: the
// warp also writes every request's chunk count there (the combine reads them). Called by
// whole warps; an exclusive prefix sum of the counts over 32 requests a round.
struct ChunkSlot {
    int b, c, n, len;
};
template <bool kGuardHeld = false>
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
    const BatchTiles bt = batch_tiles(lengths, batch, tile);
    int u = batch_chunk_unit<kGuardHeld>(lengths, batch, max_chunks, tile, min_chunk, target,
                                         bt);
    // The second wave a grid of 2 target programs offers (sandbox/chunks.py, two_waves):
    // taken where one wave's unit is over 5/2 of two waves'. Two waves' unit is at least
    // ceil(W / 2 target) (the search's lower end), so where one wave's is not over 5/2 of
    // that (equal lengths) no second search runs.
    const int lo2 = max(min_chunk / tile,
                        static_cast<int>((bt.total + 2 * target - 1) / (2 * target)));
    if (static_cast<int>(gridDim.y) >= 2 * target && batch < target && 2 * u > 5 * lo2) {
        const int u2 =
            batch_chunk_unit<kGuardHeld>(lengths, batch, max_chunks, tile, min_chunk,
                                         2 * target, bt);
        if (2 * u > 5 * u2) u = u2;
    }
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
// Single pass: the two functions below, shared by both walks and by the merges of
// mla_combine.cu. Where w.single() (batch 1: one slice for every head; paged: the program's
// request runs one chunk) the kernel also writes latent = acc / l and lse = (m + log2 l) ln 2
// (latent 0, lse -inf where l == 0) at row w.latent_row(partial); its partials are written as
// well, so a merge that does run gives the same words.
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
    // batch 1 never merges in the attention kernel: the combine does (DecodeStep)
    template <int kHeads, int kThreads>
    __device__ __forceinline__ void finish(unsigned int*, int, const float*, const float*,
                                           const float*) const {}
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
// The most chunk slots a request may have where the attention kernel merges them itself
// (finish): past it one block would read too many partials. registry.ATTN_MERGE_MAX_CHUNKS.
enum : int { kAttnMergeMaxChunks = 16 };
#ifdef MLA_REGISTRY_FACTS
static_assert(MLA_ATTN_MERGE_MAX_CHUNKS == kAttnMergeMaxChunks,
              "registry.ATTN_MERGE_MAX_CHUNKS differs from kAttnMergeMaxChunks");
#endif

// PagedWalk::finish's merge of one row over its request's n chunks (partial first + i stride):
// kTpr threads a row, each the float4s c, c + kTpr, ... of its 512 columns (passes of at most
// 8). Online over the chunks, kMergeInFlight at a time: each group's (m, l) and acc are loaded
// together and the running sums rescaled to the group's new max, so no round trip for the
// chunks' m lies ahead of the first acc load (ceil(n / 2) dependent loads a pass, not
// 1 + ceil(n / 2)). Loads through L2 (ld.global.cg): other SMs wrote them during this kernel.
// Called at the end of the kernel with nothing else live, so its registers (about 100 at
// 8 float4s a thread) are not added to the tile loop's.
enum : int { kMergeInFlight = 2 };
template <int kTpr>
__device__ __forceinline__ void merge_chunks(const float* part_acc, const float* part_m,
                                          const float* part_l, size_t first, int stride, int n,
                                          int rescale, float* latent, float* lse, size_t row) {
    constexpr int kVec = MLA_KV_LORA / 4 / kTpr, kPass = kVec < 8 ? kVec : 8;
    static_assert((MLA_KV_LORA / 4) % kTpr == 0 && kVec % kPass == 0, "whole float4 passes");
    const int c = threadIdx.x % kTpr;
    float m = -INFINITY, l = 0.f;  // m: -inf until a chunk with l > 0
    float4* dst = reinterpret_cast<float4*>(latent + row * MLA_KV_LORA) + c;
#pragma unroll 1
    for (int v0 = 0; v0 < kVec; v0 += kPass) {
        float4 acc[kPass];
#pragma unroll
        for (int v = 0; v < kPass; ++v) acc[v] = make_float4(0.f, 0.f, 0.f, 0.f);
        m = -INFINITY;
        l = 0.f;
#pragma unroll 1
        for (int i0 = 0; i0 < n; i0 += kMergeInFlight) {
            float li[kMergeInFlight], mi[kMergeInFlight];
            float4 a[kMergeInFlight][kPass];
#pragma unroll
            for (int j = 0; j < kMergeInFlight; ++j) {
                const bool has = i0 + j < n;  // past n: an empty partial, nothing loaded
                const size_t k = first + static_cast<size_t>(i0 + j) * stride;
                const float4* src =
                    reinterpret_cast<const float4*>(part_acc + k * MLA_KV_LORA) + c + v0 * kTpr;
                li[j] = has ? __ldcg(part_l + k) : 0.f;
                mi[j] = has ? __ldcg(part_m + k) : -INFINITY;
#pragma unroll
                for (int v = 0; v < kPass; ++v)
                    a[j][v] = has ? __ldcg(src + v * kTpr) : make_float4(0.f, 0.f, 0.f, 0.f);
            }
            float m_new = m;
#pragma unroll
            for (int j = 0; j < kMergeInFlight; ++j)
                if (li[j] > 0.f) m_new = fmaxf(m_new, mi[j]);
            // The sums so far move to m_new; while m is -inf they are 0 and stay so (the
            // weight 1 avoids exp2(-inf + inf)). rescale 0: the negative control, no exp2.
            const float w_old = rescale && m != -INFINITY ? exp2f(m - m_new) : 1.f;
            l *= w_old;
#pragma unroll
            for (int v = 0; v < kPass; ++v) {
                acc[v].x *= w_old; acc[v].y *= w_old; acc[v].z *= w_old; acc[v].w *= w_old;
            }
#pragma unroll
            for (int j = 0; j < kMergeInFlight; ++j) {
                const float w = li[j] > 0.f ? (rescale ? exp2f(mi[j] - m_new) : 1.f) : 0.f;
                l = fmaf(w, li[j], l);
#pragma unroll
                for (int v = 0; v < kPass; ++v) {
                    acc[v].x = fmaf(w, a[j][v].x, acc[v].x);
                    acc[v].y = fmaf(w, a[j][v].y, acc[v].y);
                    acc[v].z = fmaf(w, a[j][v].z, acc[v].z);
                    acc[v].w = fmaf(w, a[j][v].w, acc[v].w);
                }
            }
            m = m_new;
        }
        const float inv_l = single_pass_inv_l(l);
#pragma unroll
        for (int v = 0; v < kPass; ++v)
            dst[(v0 + v) * kTpr] = make_float4(acc[v].x * inv_l, acc[v].y * inv_l,
                                               acc[v].z * inv_l, acc[v].w * inv_l);
    }
    if (c == 0) lse[row] = single_pass_lse(m, l);
}

template <typename CacheT, int kTile>
struct PagedWalk {
    const CacheT* cache;
    const int* table;           // block_table [B, max_pages]
    const int* cache_seqlens;
    int n_rows, n_head, s_q, causal, max_pages, page_shift, max_chunks, min_chunk, target;
    int batch;
    int* chunk_counts;          // [B]: each request's chunk count, for the combine
    float* latent;              // [B][n_rows][512] and [B][n_rows]: written where single()
    float* lse;
    size_t q_row0 = 0;          // request b's first q row (also its first latent row)
    int visible0 = 0;           // row r sees positions < visible0 (+ r / n_head when causal)
    int req = 0, chunk = 0;     // the program's request and chunk (begin)
    int chunks = 1;             // the request's chunk count (begin; 1 in a single-pass plan)
    int page[kPagedMaxPasses] = {};  // the pages of this thread's rows of the next tile to copy

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
    // y = B): request p, chunk 0. Else (grid y = max(target, B), or 2 target offering a
    // second wave) the p-th chunk of the batch in request order (locate_chunk), nothing past
    // the last. Row block 0's program 0 (single-
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
            const ChunkSlot slot = locate_chunk(cache_seqlens, batch, p, max_chunks, kTile,
                                                min_chunk, target,
                                                publish ? chunk_counts : nullptr);
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
        if (out.row_start < out.row_end) return true;
        write_neutral(heads, n_rows, latent_dim, out, part_acc, part_m, part_l);
        if (single()) write_empty_latent(heads, head0, q_row0, latent_dim);
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
    // The merge in the attention kernel, where the host passes tickets (a ticket a (request,
    // row block), zero between launches; PagedDecodeStep.merges_in_attn), called by every
    // program once its partials are written or begin() returned false: a program that ran a
    // chunk of a request of several takes its ticket, and the last of them merges the
    // request's rows of the block as combine_paged would, then resets the ticket. Program
    // p < B also writes latent 0, lse -inf for request p if it is empty (no program runs it).
    // rescale 0: the negative control's merge (no exp2(m_i - m)). tickets and rescale come
    // from the kernel's parameters, not the walk, so nothing extra stays live in the tile loop.
    template <int kHeads, int kThreads>
    __device__ __forceinline__ void finish(unsigned int* tickets, int rescale,
                                           const float* part_acc, const float* part_m,
                                           const float* part_l) const {
        if (tickets == nullptr) return;
        const int p = blockIdx.y;
        if (p < batch && __ldg(cache_seqlens + p) == 0)
            write_empty_latent(kHeads, blockIdx.x * kHeads, static_cast<size_t>(p) * n_rows,
                               MLA_KV_LORA);
        if (chunks < 2) return;  // no chunk (past the last), or its request's only one
        __shared__ int last;
        unsigned int* ticket = tickets + static_cast<size_t>(req) * gridDim.x + blockIdx.x;
        __threadfence();  // this program's partials, before its ticket
        __syncthreads();
        if (threadIdx.x == 0) last = atomicAdd(ticket, 1u) == static_cast<unsigned>(chunks - 1);
        __syncthreads();
        if (!last) return;
        __threadfence();  // every other chunk's partials, after their tickets
        const int r = static_cast<int>(blockIdx.x) * kHeads + static_cast<int>(threadIdx.x) /
                                                                  (kThreads / kHeads);
        if (r < n_rows)
            merge_chunks<kThreads / kHeads>(part_acc, part_m, part_l,
                                            static_cast<size_t>(req) * max_chunks * n_rows + r,
                                            n_rows, chunks, rescale, latent, lse,
                                            q_row0 + r);
        if (threadIdx.x == 0) *ticket = 0u;
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
        constexpr int kRowsPerPass = kThreadsT / 8, kPasses = kRows / kRowsPerPass;
        static_assert(kPasses <= kPagedMaxPasses, "a thread copies at most 2 rows a tile");
        const int* pages = request_pages();
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
    // a row-address callback reorders the batch-1 kernels' PTX.
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
            fetch<kRows, kThreadsT>(tile_index + 1, row_start, row_end);
            return;
        }
#pragma unroll
        for (int pass = 0; pass < kRows / kRowsPerPass; ++pass) {
            const int row = row0 + pass * kRowsPerPass + copy_row;
            const bool valid = row < row_end;
            const size_t cache_row =
                (static_cast<size_t>(page[pass]) << page_shift) + (row & in_page);
            const CacheT* src = cache + cache_row * (kChunks * 8) + copy_lane * 8;
#pragma unroll
            for (int i = 0; i < kChunks / 8; ++i)
                cp_async_16(dst + (pass * kRowsPerPass * kChunks + 8 * i), src + 64 * i, valid);
        }
        cp_async_commit();
        fetch<kRows, kThreadsT>(tile_index + 1, row_start, row_end);
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
