// mla_attn.cu: the heads-batched attention of mlasandbox. batched<HPB> is an instance of one
// kernel, mla::attn<HPB, CacheT, QT>; one head per block (per_head, split) has a kernel of its
// own, mla_attn_rows.cu, since with one head no cache row is shared between heads.
//
// Template parameters
//   HPB     heads served by one pass over the cache: 2, 4, 8, 12, 16, 24
//   CacheT  cache element: __half or __nv_bfloat16
//   QT      query element: float, or CacheT
// Fixed geometry
//   kThreads = 256 (8 warps), kTile = 32 cache rows per step,
//   MLA_KV_LORA = 512 and MLA_ROPE = 64 come from the compile options.
//   sandbox/registry.py passes its own values for these and for the shared memory
//   (AttnSmem<HPB>::bytes); the kernel static_asserts them (mla_common.cuh).
//
// Launch: grid = (ceil(H / HPB), S), block = kThreads, dynamic smem = attn_smem_bytes(HPB).
// mla::attn_paged<HPB, CacheT, QT>, the paged launch of the same body (mla_walk.cuh):
// grid = (ceil(n_rows / HPB), P, 1) (P chunk programs, mla_walk.cuh), same block and shared
// memory; a block's HPB heads are HPB query rows r = i * H + h of its request, partials
// [B][max_chunks][n_rows].
// Block (g, s) serves heads g*HPB .. g*HPB+HPB-1 (heads >= H are masked, not dropped) over
// the contiguous slice s of [0, n_ctx): [s*L, min(n_ctx, s*L + L)), L = ceil(n_ctx / S).
// Contiguous, not strided, so each block's walk stays sequential for the prefetcher.
// It writes each head's partial in the log2 domain (q is pre-scaled by scale * log2(e)):
//   m   = max_t s2[t]            l = sum_t 2^(s2[t] - m)
//   acc = sum_t 2^(s2[t] - m) * cache[t, :512]
// An empty slice writes m = -inf, l = 0, acc = 0: neutral in the combine, never NaN.
// The output projection wv_b is NOT applied here: it is a function of the merged latent,
// so it runs in the combine (mla_combine.cu), after the merge.
//
// One tile of kTile rows:
//   1. cp.async of the NEXT tile into the other buffer once this tile's softmax is done
//      (double buffer); rows past the slice end are zero-filled, never read, so a NaN-filled
//      cache past n_ctx cannot leak.
//   2. scores: warp w owns the 9 key-column chunks w, w+8, ..., w+64 (8 elements each); a
//      lane owns TPT rows x HPT heads, reads its rows with 16-byte loads and q as
//      shared-memory broadcasts; the 8 column partials of each score go to `red`.
//   3. softmax: warp w finishes heads w, w+8, ...: sums the partials of its 32 rows, takes
//      the tile max, writes p = 2^(s2 - m_new) and alpha = 2^(m_old - m_new), updates (m, l).
//   4. values: thread owns 4 latent columns for all HPB heads over half of each tile's rows,
//      in registers across the whole slice: acc = acc * alpha + sum_t p[t] * cache[t, cols];
//      the two row halves are summed once, when the slice is done.
// Shared memory is O(key_dim * HPB + tile), never O(n_ctx): see attn_smem_bytes().
#include "mla_walk.cuh"

namespace mla {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kTile = 32;
constexpr int kKvLora = MLA_KV_LORA;
constexpr int kKeyDim = MLA_KV_LORA + MLA_ROPE;
constexpr int kChunkElems = 8;                             // 16 bytes of 16-bit elements
constexpr int kChunksPerRow = kKeyDim / kChunkElems;       // 72
constexpr int kChunksPerWarp = kChunksPerRow / kWarps;     // 9
static_assert(kKeyDim % (kChunkElems * kWarps) == 0, "key columns must split evenly over warps");
static_assert(kChunksPerRow % 8 == 0, "the XOR swizzle permutes chunks within groups of 8");
static_assert(kWarps == 8, "the score phase gives warp w the chunks w + 8 cc (one per swizzle group)");
static_assert(kTile == 32, "the softmax phase maps one tile row to one lane");

// Tuning knobs, overridable with -D for experiments (the registry compiles the defaults).
// Full unrolls (9 score chunks, 4 steps of 4 rows) let every shared-memory address be a base
// register plus an immediate.
#ifndef MLA_SCORE_UNROLL
#define MLA_SCORE_UNROLL 9
#endif
#ifndef MLA_VALUE_UNROLL
#define MLA_VALUE_UNROLL 4
#endif
#ifndef MLA_WIDE_HPB          // from this HPB up: two head groups in the score phase and two
#define MLA_WIDE_HPB 12       // value columns per thread (four below it)
#endif
// Resident blocks per SM the register allocation must allow (the launch-bounds minimum):
// 2 up to HPB 16; 1 above, where shared memory already limits the SM to one block (the wall).
template <int HPB> __host__ __device__ constexpr int attn_min_blocks() { return HPB <= 16 ? 2 : 1; }

__host__ __device__ constexpr int round4(int x) { return (x + 3) / 4 * 4; }

// Shared-memory layout in bytes; registry.attn_smem_bytes() computes the same total.
// The cache tile is double-buffered, so a block overlaps its next load with its own compute.
// The cross-warp score partials (`red`, [kWarps][HPB][kTile] f32) live in the spare tile
// buffer: the next tile is only issued once the softmax has consumed them, so one buffer
// serves both, and HPB 16 fits two blocks per SM.
template <int HPB> struct AttnSmem {
    static_assert(HPB >= 2, "one head per block is attn_rows (mla_attn_rows.cu)");
    static constexpr int stages = 2;
    static constexpr int tile_bytes = kTile * kKeyDim * 2;
    static constexpr int red_bytes = kWarps * HPB * kTile * 4;
    static constexpr int tiles = 0;                                        // 2 x [kTile][72] x 16 B
    static constexpr int q = tiles + stages * tile_bytes;                  // [kKeyDim][HPB] f32
    static constexpr int p = q + kKeyDim * HPB * 4;                        // [HPB][kTile] f32
    static constexpr int m = p + HPB * kTile * 4;                          // [HPB] f32 each
    static constexpr int l = m + round4(HPB) * 4;
    static constexpr int alpha = l + round4(HPB) * 4;
    static constexpr int bytes = alpha + round4(HPB) * 4;
    static_assert(red_bytes <= tile_bytes, "the partials must fit in the spare tile");
    static_assert(HPB * kKvLora * 4 <= stages * tile_bytes, "the row-half sum borrows the tile buffers");
};

// HPT consecutive f32 from shared memory, as wide as alignment allows.
template <int HPT, int HPB>
__device__ __forceinline__ void load_heads(const float* src, float (&dst)[HPT]) {
    static_assert(HPT <= HPB, "a lane's heads are a subset of the block's");
    if constexpr (HPT % 4 == 0 && HPB % 4 == 0) {
#pragma unroll
        for (int j = 0; j < HPT; j += 4) {
            const float4 v = *reinterpret_cast<const float4*>(src + j);
            dst[j] = v.x; dst[j + 1] = v.y; dst[j + 2] = v.z; dst[j + 3] = v.w;
        }
    } else if constexpr (HPT % 2 == 0 && HPB % 2 == 0) {
#pragma unroll
        for (int j = 0; j < HPT; j += 2) {
            const float2 v = *reinterpret_cast<const float2*>(src + j);
            dst[j] = v.x; dst[j + 1] = v.y;
        }
    } else {
#pragma unroll
        for (int j = 0; j < HPT; ++j) dst[j] = src[j];
    }
}

// The kernel body, on the walk W of its launch (mla_walk.cuh).
template <int HPB, typename CacheT, typename QT, typename W>
__device__ __forceinline__ void attn_body(const QT* __restrict__ q, W& walk, float scale_log2,
                                          float* __restrict__ part_acc, float* __restrict__ part_m,
                                          float* __restrict__ part_l) {
    using Smem = AttnSmem<HPB>;
#ifdef MLA_REGISTRY_FACTS
    static_assert(MLA_ATTN_THREADS == kThreads, "registry.ATTN_THREADS differs from kThreads");
    static_assert(MLA_ATTN_TILE == kTile, "registry.ATTN_TILE differs from kTile");
    static_assert(registry_fact(HPB, MLA_ATTN_SMEM) == Smem::bytes,
                  "registry.attn_smem_bytes(HPB) differs from AttnSmem<HPB>::bytes");
#endif
    // Score phase: a lane owns TPT rows x HPT heads. Two head groups of 8 at HPB 16 keep a
    // lane at 2 rows x 8 heads (16 FMAs per 2 q broadcasts and 2 conversions); one below.
    constexpr int HG = (HPB >= 16 && HPB >= MLA_WIDE_HPB) ? 2 : 1;
    constexpr int HPT = HPB / HG;          // heads per lane
    constexpr int RG = 32 / HG;            // row groups per warp
    constexpr int TPT = kTile / RG;        // rows per lane
    static_assert(HPB % HG == 0, "HPB must split evenly into head groups");
    static_assert(RG % 8 == 0, "a lane's rows must share a swizzle (the score loop's base pointer)");
    // Value phase: a thread owns kCols latent columns for all HPB heads. With 4 columns
    // (HPB <= 8) the threads also split each tile's rows in two halves, summed once at the
    // end of the slice; at HPB >= 12, 4 x HPB accumulators would spill, so 2 columns.
    constexpr int kCols = (HPB >= MLA_WIDE_HPB) ? 2 : 4;
    constexpr int kColGroups = kKvLora / kCols;            // 128 or 256
    constexpr int kRowHalves = kThreads / kColGroups;      // 2 or 1
    constexpr int kRowsPerHalf = kTile / kRowHalves;       // 16 or 32
    constexpr int kGroupsPerChunk = kChunkElems / kCols;   // 2 or 4
    static_assert(kColGroups * kRowHalves == kThreads && kRowsPerHalf % 4 == 0, "value mapping");

    require_dynamic_smem(Smem::bytes);
    extern __shared__ __align__(16) unsigned char smem[];
    uint4* tiles = reinterpret_cast<uint4*>(smem + Smem::tiles);
    float* q_s = reinterpret_cast<float*>(smem + Smem::q);
    float* p_s = reinterpret_cast<float*>(smem + Smem::p);
    float* m_s = reinterpret_cast<float*>(smem + Smem::m);
    float* l_s = reinterpret_cast<float*>(smem + Smem::l);
    float* alpha_s = reinterpret_cast<float*>(smem + Smem::alpha);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    BlockSlice work;  // an empty slice (S > n_ctx) writes its neutral partial and is done
    if (!walk.begin(HPB, kKvLora, part_acc, part_m, part_l, work)) return;
    const int head0 = work.head0, row_start = work.row_start, row_end = work.row_end;
    const size_t part_base = work.part_base;
    const int n_head = walk.rows();  // rows of q (heads; paged: s_q x heads of a request)

    auto load_tile = [&](int tile_index, int buf) {
        walk.template copy_tile<kTile, kChunksPerRow, Smem::stages, kThreads>(tiles, buf, tile_index,
                                                                              row_start, row_end);
    };
    walk.template fetch<kTile, kThreads>(0, row_start, row_end);
    load_tile(0, 0);

    pdl_wait();  // q is the kernel before's (q_absorb, api.DecodeStep): nothing above reads it
    // q in f32, pre-scaled into the log2 domain, laid out [key column][head] so that the
    // score phase reads HPT heads of one column with one broadcast.
    stage_q<HPB, kKeyDim, kThreads>(walk.q(q), head0, n_head, scale_log2,
                                    [&](int j, int k, float x) { q_s[k * HPB + j] = x; });
    for (int j = tid; j < HPB; j += kThreads) { m_s[j] = -INFINITY; l_s[j] = 0.f; }

    float out_acc[HPB][kCols];
#pragma unroll
    for (int j = 0; j < HPB; ++j)
#pragma unroll
        for (int e = 0; e < kCols; ++e) out_acc[j][e] = 0.f;

    const int n_tiles = (row_end - row_start + kTile - 1) / kTile;
    const int rg = lane % RG, hg = lane / RG;
    const int col_group = tid % kColGroups, row_half = tid / kColGroups;
    const int col_chunk = col_group / kGroupsPerChunk, col_sub = col_group % kGroupsPerChunk;

    for (int it = 0; it < n_tiles; ++it) {
        const int buf = it & 1;
        cp_async_wait<0>();
        // Tile `it` is visible to every thread, and every thread has finished the value
        // phase of tile it-1, so the spare buffer is free for the score partials.
        __syncthreads();
        const uint4* tile = tiles + buf * kTile * kChunksPerRow;
        float* red = reinterpret_cast<float*>(tiles + (buf ^ 1) * kTile * kChunksPerRow);

        // ---- 2. scores: partial dot products over this warp's key columns ----
        float sacc[TPT][HPT];
#pragma unroll
        for (int i = 0; i < TPT; ++i)
#pragma unroll
            for (int j = 0; j < HPT; ++j) sacc[i][j] = 0.f;
        // Warp w owns chunks w + 8 cc. The swizzle permutes chunks within groups of 8 and a
        // lane's rows share their low three bits (RG is a multiple of 8), so the lane's chunk
        // cc of row i sits at one base plus immediates, and so do its q columns: the fully
        // unrolled loop does no address arithmetic (it cost 9% of attn<1>'s instructions when
        // a warp owned 9 adjacent chunks, whose swizzled offsets vary with cc).
        const uint4* x_base = tile + rg * kChunksPerRow + (warp ^ (rg & 7));
#pragma unroll MLA_SCORE_UNROLL
        for (int cc = 0; cc < kChunksPerWarp; ++cc) {
            float x[TPT][kChunkElems];
#pragma unroll
            for (int i = 0; i < TPT; ++i) {
                unpack_f32<CacheT>(x_base[i * RG * kChunksPerRow + 8 * cc], x[i]);
            }
            const int c = warp + kWarps * cc;
#pragma unroll
            for (int kk = 0; kk < kChunkElems; ++kk) {
                float qv[HPT];
                load_heads<HPT, HPB>(q_s + (c * kChunkElems + kk) * HPB + hg * HPT, qv);
#pragma unroll
                for (int i = 0; i < TPT; ++i)
#pragma unroll
                    for (int j = 0; j < HPT; ++j) sacc[i][j] = fmaf(x[i][kk], qv[j], sacc[i][j]);
            }
        }
#pragma unroll
        for (int i = 0; i < TPT; ++i)
#pragma unroll
            for (int j = 0; j < HPT; ++j)
                red[(warp * HPB + hg * HPT + j) * kTile + i * RG + rg] = sacc[i][j];
        __syncthreads();

        // ---- 3. online softmax over the tile, one head per warp at a time ----
        const int row = row_start + it * kTile + lane;
        for (int j = warp; j < HPB; j += kWarps) {
            float s = 0.f;
#pragma unroll
            for (int w = 0; w < kWarps; ++w) s += red[(w * HPB + j) * kTile + lane];
            s = (row < walk.row_end(head0 + j, row_end)) ? s : -INFINITY;
            const float m_old = m_s[j];
            // finite: row_start + it*kTile < row_end, but for a paged row that sees nothing
            // yet (-inf, which W::exp_offset and W::softmax_step keep from NaN)
            const float m_new = fmaxf(m_old, warp_max(s));
            const float p = exp2f(s - W::exp_offset(m_new));
            const float p_sum = warp_sum(p);
            p_s[j * kTile + lane] = p;
            // Every lane has read m_s[] above; lane 0 overwrites it. The shuffles order the
            // two in practice, the barrier makes it formal (racecheck flags it otherwise).
            __syncwarp();
            if (lane == 0) W::softmax_step(m_s, l_s, alpha_s, j, m_old, m_new, p_sum);
        }
        __syncthreads();
        // The partials are consumed: the spare buffer can take the next tile, which lands
        // while this tile's value phase runs (and while the SM's other block computes).
        if (it + 1 < n_tiles) load_tile(it + 1, buf ^ 1);

        // ---- 4. values: acc = acc * alpha + p @ cache[:, cols] over this thread's rows ----
#pragma unroll
        for (int j = 0; j < HPB; ++j) {
            const float a = alpha_s[j];
#pragma unroll
            for (int e = 0; e < kCols; ++e) out_acc[j][e] *= a;
        }
#pragma unroll MLA_VALUE_UNROLL
        for (int t4 = row_half * kRowsPerHalf; t4 < (row_half + 1) * kRowsPerHalf; t4 += 4) {
            float v[4][kCols];
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const int chunk = swizzled_chunk(t4 + u, col_chunk, kChunksPerRow);
                if constexpr (kCols == 4)
                    unpack_f32<CacheT>(reinterpret_cast<const uint2*>(tile)[chunk * 2 + col_sub], v[u]);
                else
                    unpack_f32<CacheT>(reinterpret_cast<const unsigned int*>(tile)[chunk * 4 + col_sub], v[u]);
            }
#pragma unroll
            for (int j = 0; j < HPB; ++j) {
                const float4 p = *reinterpret_cast<const float4*>(p_s + j * kTile + t4);
                const float pv[4] = {p.x, p.y, p.z, p.w};
#pragma unroll
                for (int u = 0; u < 4; ++u)
#pragma unroll
                    for (int e = 0; e < kCols; ++e) out_acc[j][e] = fmaf(pv[u], v[u][e], out_acc[j][e]);
            }
        }
    }

    // Sum the row halves through the (now idle) tile buffers, then write the partial.
    // The last softmax step's (m, l) are visible since the barrier before the value phase.
    if constexpr (kRowHalves == 2) {
        __syncthreads();
        float* halves = reinterpret_cast<float*>(tiles);  // [HPB][kKvLora]
        if (row_half == 1) {
#pragma unroll
            for (int j = 0; j < HPB; ++j)
#pragma unroll
                for (int e = 0; e < kCols; ++e) halves[j * kKvLora + col_group * kCols + e] = out_acc[j][e];
        }
        __syncthreads();
        if (row_half == 1) return;
#pragma unroll
        for (int j = 0; j < HPB; ++j)
#pragma unroll
            for (int e = 0; e < kCols; ++e) out_acc[j][e] += halves[j * kKvLora + col_group * kCols + e];
    }
    const bool single = walk.single();  // also latent = acc / l and lse (mla_walk.cuh)
#pragma unroll
    for (int j = 0; j < HPB; ++j) {
        if (head0 + j < n_head) {
            const size_t col0 = (part_base + head0 + j) * kKvLora + col_group * kCols;
            float* dst = part_acc + col0;
#pragma unroll
            for (int e = 0; e < kCols; ++e) dst[e] = out_acc[j][e];
            if (single) {
                const float inv_l = single_pass_inv_l(l_s[j]);
                float* lat = walk.latent + walk.latent_row(part_base + head0 + j) * kKvLora +
                             col_group * kCols;
#pragma unroll
                for (int e = 0; e < kCols; ++e) lat[e] = out_acc[j][e] * inv_l;
            }
        }
    }
    if (tid < HPB && head0 + tid < n_head) {
        part_m[part_base + head0 + tid] = m_s[tid];
        part_l[part_base + head0 + tid] = l_s[tid];
        if (single)
            walk.lse[walk.latent_row(part_base + head0 + tid)] =
                single_pass_lse(m_s[tid], l_s[tid]);
    }
}

template <int HPB, typename CacheT, typename QT>
__global__ void __launch_bounds__(kThreads, attn_min_blocks<HPB>())
attn(const QT* __restrict__ q, const CacheT* __restrict__ cache, int n_head, int n_ctx,
     int splits, float scale_log2, float* __restrict__ part_acc, float* __restrict__ part_m,
     float* __restrict__ part_l, float* __restrict__ latent, float* __restrict__ lse) {
    pdl_launch_dependents();  // the combine may launch now; it waits for this grid
    ContiguousWalk<CacheT> walk{cache, n_head, n_ctx, splits, latent, lse};
    attn_body<HPB, CacheT>(q, walk, scale_log2, part_acc, part_m, part_l);
}

// The paged launch (mla_walk.cuh, PagedWalk): grid (ceil(n_rows / HPB), P, 1).
template <int HPB, typename CacheT, typename QT>
__global__ void __launch_bounds__(kThreads, attn_min_blocks<HPB>())
attn_paged(const QT* __restrict__ q, const CacheT* __restrict__ kv_cache,
           const int* __restrict__ block_table, const int* __restrict__ cache_seqlens,
           int n_rows, int n_head, int s_q, int causal, int max_pages, int page_shift,
           int max_chunks, int min_chunk, float scale_log2, float* __restrict__ part_acc,
           float* __restrict__ part_m, float* __restrict__ part_l, int target,
           int batch, int* __restrict__ chunk_counts,
           float* __restrict__ latent, float* __restrict__ lse) {
    pdl_launch_dependents();  // the combine may launch now; it waits for this grid
    PagedWalk<CacheT, kTile> walk{kv_cache, block_table, cache_seqlens, n_rows, n_head, s_q,
                                  causal, max_pages, page_shift, max_chunks, min_chunk,
                                  target, batch, chunk_counts, latent, lse};
    attn_body<HPB, CacheT>(q, walk, scale_log2, part_acc, part_m, part_l);
}

}  // namespace mla
