// mla_attn_rows.cu: the one-head-per-block attention of mlasandbox, mla::attn_rows<CacheT, QT>.
// per_head (one slice) and split (S slices) are its two launches.
//
// Template parameters
//   CacheT  cache element: __half or __nv_bfloat16
//   QT      query element: float, or CacheT
// Fixed geometry
//   kThreads = 128 (4 warps), kTile = 32 cache rows per step (8 per warp, taken 2 at a time),
//   6 resident blocks per SM (the launch bounds: 80 registers); MLA_KV_LORA = 512 and
//   MLA_ROPE = 64 come from the compile options. sandbox/registry.py passes its own values
//   for the block, the tile and the shared memory; the kernel static_asserts them.
//
// Launch: grid = (H, S), block = kThreads, dynamic smem = RowsSmem::bytes (36,864 B).
// mla::attn_rows_paged<CacheT, QT>, the paged launch of the same body (mla_walk.cuh):
// grid = (n_rows, P, 1) (P chunk programs, mla_walk.cuh), one query row r = i * H + h of a
// request per block, the same block and shared memory, 5 resident blocks per SM (see the
// kernel).
// Block (h, s) serves head h over the contiguous slice s of [0, n_ctx) (begin_slice) and writes
// the partial of mla_attn.cu, in the log2 domain (q is pre-scaled by scale * log2(e)):
//   l = sum_t 2^(s2[t] - m),  acc = sum_t 2^(s2[t] - m) * cache[t, :512]
// where m is the lazy running max (kLazyLog2), not necessarily the slice's max: the combine
// weighs each partial by 2^(m - m_max), right for any m that l and acc were scaled to. An empty
// slice writes m = -inf, l = 0, acc = 0. wv_b runs in the combine, after the merge.
//
// Why a kernel of its own: with one head, no cache row is reused across heads, so no row
// needs to be seen by the whole block. Here a warp owns whole rows. Lane l holds the same
// columns of q, of every row it reads and of its value accumulator: latent 8l..8l+7 and
// 256+8l..256+8l+7 (two 16-byte chunks) and rope 2l, 2l+1. One shared-memory read of a row
// (9 wavefronts) feeds both its score and its value update, and each warp runs its own online
// softmax, with no block barrier between scores and values. The heads-batched kernel with one
// head would read each row twice and broadcast q from shared memory.
//
// One step of two rows, per warp:
//   1. each lane converts its 18 elements of both rows and takes its partial dot products with q;
//   2. a transposed butterfly (5 shuffles for the two sums) leaves lanes 0-15 with row 0's score
//      and lanes 16-31 with row 1's; a shuffle gives every lane the step's max;
//   3. the lazy max moves only when the step's max passes it by kLazyLog2 (then the accumulators
//      are rescaled); each lane computes p for its row, two shuffles broadcast both;
//   4. acc += p0 * row0 + p1 * row1 over the lane's 16 latent columns, still in registers.
// After the slice, the 4 warps' (m, l, acc) merge through the idle tile buffer.
//
// Single stage: the next tile is copied once every warp is done with this one, and other
// resident blocks (6 per SM) cover the copy's latency. A lone block -- per_head's 96 on 132
// SMs -- has nothing to cover it with: the shape that cannot scale with depth.
// Registers: q (18) + acc (16) + two converted rows (32) are live across a step, and the
// kernel sits at its 80-register limit (6 blocks of 4 warps).
// The slice's last tile goes one row a step, which frees the registers its bookkeeping needs.
// Shared memory is O(tile), never O(n_ctx).
#include "mla_walk.cuh"

namespace mla {
namespace rows {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kTile = 32;
constexpr int kMinBlocks = 6;
constexpr int kKvLora = MLA_KV_LORA;
constexpr int kRope = MLA_ROPE;
constexpr int kKeyDim = kKvLora + kRope;
constexpr int kChunksPerRow = kKeyDim / 8;           // 72 chunks of 16 bytes
constexpr int kRowsPerWarp = kTile / kWarps;         // 8
constexpr int kPair = 2;                             // rows per step
static_assert(kKvLora == 2 * 32 * 8, "a lane holds two 8-element chunks of the latent");
static_assert(kRope == 2 * 32, "a lane holds two rope columns");
static_assert(kRowsPerWarp % kPair == 0, "a warp's rows split into steps of two");

// Shared memory: one tile of kTile unswizzled rows (36,864 B). After the slice, the merge of
// the warps borrows it: each warp's m and l, then from float 64 on, [kWarps][512] acc.
struct RowsSmem {
    static constexpr int bytes = kTile * kKeyDim * 2;
    static constexpr int merge_acc = 64;  // in floats
    static_assert(merge_acc * 4 + kWarps * kKvLora * 4 <= bytes, "the merge fits in the tile");
};

// One warp's 8 rows of the tile in the buffer, kRows at a time: two (steps 1-4 above) for
// every tile but the slice's last, one at a time for the last (kMasked), where rows from
// rows_left on lie past the slice end (zero-filled) and score -inf. One row a step needs 16
// registers less than two, which the last tile's bookkeeping needs at the 80-register limit
// (with two rows, ptxas parked values in local memory there); it is one tile in hundreds.
template <int kRows, bool kMasked, typename CacheT>
__device__ __forceinline__ void warp_rows(const uint4* lat_row, const unsigned int* rope_row,
                                          const float2 q_rope, const float (&q_lat)[16],
                                          float (&acc)[16], float& m, float& l_own,
                                          int rows_left) {
    static_assert(kRows == 1 || kRows == 2, "one or two rows a step");
    // the row of the step this lane scores: lanes 0-15 row 0, lanes 16-31 row 1 (of two)
    const int own = kRows == 2 ? (threadIdx.x & 31) >> 4 : 0;
    const bool counts = kRows == 2 || (threadIdx.x & 16) == 0;  // one half-warp per row adds to l
#pragma unroll 1
    for (int r = 0; r < kRowsPerWarp; r += kRows) {
        // 1. partial dot products over this lane's 18 columns
        float x[kRows][16], part[kRows];
#pragma unroll
        for (int i = 0; i < kRows; ++i) {
            unpack_f32<CacheT>(lat_row[(r + i) * kChunksPerRow], x[i]);
            unpack_f32<CacheT>(lat_row[(r + i) * kChunksPerRow + 32], x[i] + 8);
            const float2 rope = pair_to_f32<CacheT>(rope_row[(r + i) * kChunksPerRow * 4]);
            float sa = rope.x * q_rope.x, sb = rope.y * q_rope.y;
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                sa = fmaf(x[i][e], q_lat[e], sa);
                sb = fmaf(x[i][8 + e], q_lat[8 + e], sb);
            }
            part[i] = sa + sb;
        }
        // 2. the warp sums. Two rows: a transposed butterfly, lanes 0-15 keep row 0's partial
        //    and send row 1's, lanes 16-31 the reverse; four more steps finish each half.
        float s = kRows == 1 ? part[0] + __shfl_xor_sync(0xffffffffu, part[0], 16)
                             : (own ? part[kRows - 1] : part[0]) +
                                   __shfl_xor_sync(0xffffffffu, own ? part[0] : part[kRows - 1], 16);
#pragma unroll
        for (int bit = 8; bit >= 1; bit >>= 1) s += __shfl_xor_sync(0xffffffffu, s, bit);
        if (kMasked && r + own >= rows_left) s = -INFINITY;
        const float step_max = kRows == 1 ? s : fmaxf(s, __shfl_xor_sync(0xffffffffu, s, 16));
        // 3. the lazy max; step_max is the same in every lane, so the branch does not diverge
        if (step_max > m + kLazyLog2) {
            const float alpha = exp2_ftz(m - step_max);  // 0 on the first step (m = -inf)
#pragma unroll
            for (int e = 0; e < 16; ++e) acc[e] *= alpha;
            l_own *= alpha;
            m = step_max;
        }
        // m is finite from the first row on; a masked row's p is 0 (never 2^(-inf + inf))
        const float p_own = (!kMasked || s > -INFINITY) ? exp2_ftz(s - m) : 0.f;
        if (counts) l_own += p_own;
        // 4. values
        if constexpr (kRows == 1) {
#pragma unroll
            for (int e = 0; e < 16; ++e) acc[e] = fmaf(p_own, x[0][e], acc[e]);
        } else {
            const float p0 = __shfl_sync(0xffffffffu, p_own, 0);
            const float p1 = __shfl_sync(0xffffffffu, p_own, 16);
#pragma unroll
            for (int e = 0; e < 16; ++e) acc[e] = fmaf(p1, x[kRows - 1][e], fmaf(p0, x[0][e], acc[e]));
        }
    }
}

}  // namespace rows

// The kernel body, on the walk W of its launch (mla_walk.cuh). A block serves one row, so a
// paged causal row's limit is the block's slice end (W::begin) and the last-tile masking
// covers it.
template <typename CacheT, typename QT, typename W>
__device__ __forceinline__ void attn_rows_body(const QT* __restrict__ q, W& walk, float scale_log2,
                                               float* __restrict__ part_acc,
                                               float* __restrict__ part_m,
                                               float* __restrict__ part_l) {
    using namespace rows;
#ifdef MLA_REGISTRY_FACTS
    static_assert(MLA_ROWS_THREADS == kThreads, "registry.ROWS_THREADS differs from kThreads");
    static_assert(MLA_ROWS_TILE == kTile, "registry.ROWS_TILE differs from kTile");
    static_assert(registry_fact(1, MLA_ROWS_SMEM) == RowsSmem::bytes,
                  "registry.rows_smem_bytes() differs from RowsSmem::bytes");
#endif
    require_dynamic_smem(RowsSmem::bytes);
    extern __shared__ __align__(16) unsigned char smem[];
    uint4* tile = reinterpret_cast<uint4*>(smem);

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    BlockSlice work;  // an empty slice (S > n_ctx) writes its neutral partial and is done
    if (!walk.begin(1, kKvLora, part_acc, part_m, part_l, work)) return;
    const int head = work.head0, row_start = work.row_start, row_end = work.row_end;
    // (work.part_base is not held across the walk: the end recomputes it, one register less)

    walk.template fetch<kTile, kThreads>(0, row_start, row_end);
    walk.template copy_tile<kTile, kChunksPerRow, 1, kThreads, false>(tile, 0, 0, row_start,
                                                                      row_end);

    pdl_wait();  // q is the kernel before's (q_absorb, api.DecodeStep): nothing above reads it
    // q in f32, pre-scaled into the log2 domain: this lane's 16 latent and 2 rope columns.
    const QT* q_head = walk.q(q) + static_cast<size_t>(head) * kKeyDim;
    float q_lat[16];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        q_lat[e] = to_f32(__ldcg(q_head + 8 * lane + e)) * scale_log2;
        q_lat[8 + e] = to_f32(__ldcg(q_head + 256 + 8 * lane + e)) * scale_log2;
    }
    const float2 q_rope = make_float2(to_f32(__ldcg(q_head + kKvLora + 2 * lane)) * scale_log2,
                                      to_f32(__ldcg(q_head + kKvLora + 2 * lane + 1)) * scale_log2);

    float acc[16];
#pragma unroll
    for (int e = 0; e < 16; ++e) acc[e] = 0.f;
    float m = -INFINITY;  // the lazy reference max, the same in every lane of the warp
    float l_own = 0.f;    // sum of p over the rows this lane's half-warp scored

    // This lane's chunks of the warp's first row: chunk `lane` of the latent (+32 for the
    // second) and 4-byte word `lane` of the rope (chunks 64..71); unswizzled rows.
    const uint4* lat_row = tile + warp * kRowsPerWarp * kChunksPerRow + lane;
    const unsigned int* rope_row =
        reinterpret_cast<const unsigned int*>(tile + warp * kRowsPerWarp * kChunksPerRow + 64) + lane;

    // Every tile but the slice's last: all 8 rows of each warp lie in the slice.
    int row0 = row_start;
    for (; row0 + kTile < row_end; row0 += kTile) {
        cp_async_wait<0>();
        __syncthreads();
        warp_rows<kPair, false, CacheT>(lat_row, rope_row, q_rope, q_lat, acc, m, l_own, kRowsPerWarp);
        __syncthreads();  // every warp is done reading the one tile buffer
        // the next tile: tile 1 counted from this one (the memory ablation skips it)
        walk.template copy_tile<kTile, kChunksPerRow, 1, kThreads, false>(tile, 0, 1, row0,
                                                                          row_end);
    }
    // The last tile, whose rows may run past the slice end: each warp checks its rows.
    cp_async_wait<0>();
    __syncthreads();
    warp_rows<1, true, CacheT>(lat_row, rope_row, q_rope, q_lat, acc, m, l_own,
                               row_end - (row0 + warp * kRowsPerWarp));

    // Merge the 4 warps through the idle tile buffer: m_b = max m_w, each warp's l and acc
    // scaled by 2^(m_w - m_b) (0 for a warp that saw no row: m_w = -inf), then summed.
    const float l_warp = l_own + __shfl_xor_sync(0xffffffffu, l_own, 16);
    __syncthreads();  // every warp is done with the last tile
    float* merge_m = reinterpret_cast<float*>(smem);
    float* merge_l = merge_m + kWarps;
    float* merge_acc = merge_m + RowsSmem::merge_acc;
    if (lane == 0) { merge_m[warp] = m; merge_l[warp] = l_warp; }
    __syncthreads();
    float m_block = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) m_block = fmaxf(m_block, merge_m[w]);  // finite: warp 0 has a row
    const float scale = exp2f(m - m_block);
    float4* dst = reinterpret_cast<float4*>(merge_acc + warp * kKvLora);
#pragma unroll
    for (int c = 0; c < 2; ++c) {
        const float* a = acc + 8 * c;
        dst[64 * c + 2 * lane] = make_float4(a[0] * scale, a[1] * scale, a[2] * scale, a[3] * scale);
        dst[64 * c + 2 * lane + 1] = make_float4(a[4] * scale, a[5] * scale, a[6] * scale, a[7] * scale);
    }
    __syncthreads();
    const size_t partial = walk.part_base() + blockIdx.x;  // + head, from blockIdx
    float l = 0.f;  // the block's l, as every thread computes it (the same words)
#pragma unroll
    for (int w = 0; w < kWarps; ++w) l += merge_l[w] * exp2f(merge_m[w] - m_block);
    const bool single = walk.single();  // also latent = acc / l and lse (mla_walk.cuh)
    const float inv_l = single_pass_inv_l(l);
    for (int col = threadIdx.x; col < kKvLora; col += kThreads) {
        float sum = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) sum += merge_acc[w * kKvLora + col];
        part_acc[partial * kKvLora + col] = sum;
        if (single) walk.latent[walk.latent_row(partial) * kKvLora + col] = sum * inv_l;
    }
    if (threadIdx.x == 0) {
        part_m[partial] = m_block;
        part_l[partial] = l;
        if (single) walk.lse[walk.latent_row(partial)] = single_pass_lse(m_block, l);
    }
}

template <typename CacheT, typename QT>
__global__ void __launch_bounds__(rows::kThreads, rows::kMinBlocks)
attn_rows(const QT* __restrict__ q, const CacheT* __restrict__ cache, int n_head, int n_ctx,
          int splits, float scale_log2, float* __restrict__ part_acc, float* __restrict__ part_m,
          float* __restrict__ part_l, float* __restrict__ latent, float* __restrict__ lse) {
    pdl_launch_dependents();  // the combine may launch now; it waits for this grid
    ContiguousWalk<CacheT> walk{cache, n_head, n_ctx, splits, latent, lse};
    attn_rows_body<CacheT>(q, walk, scale_log2, part_acc, part_m, part_l);
}

// The paged launch (mla_walk.cuh, PagedWalk): grid (n_rows, P, 1). ptxas gives it
// 90 registers (at the 80 of kMinBlocks it spills: its slice bounds derive from a length in
// device memory, not from launch arguments it can reread), so it allows 5 blocks per SM.
enum : int { kPagedMinBlocks = 5 };
template <typename CacheT, typename QT>
__global__ void __launch_bounds__(rows::kThreads, kPagedMinBlocks)
attn_rows_paged(const QT* __restrict__ q, const CacheT* __restrict__ kv_cache,
                const int* __restrict__ block_table, const int* __restrict__ cache_seqlens,
                int n_rows, int n_head, int s_q, int causal, int max_pages, int page_shift,
                int max_chunks, int min_chunk, float scale_log2, float* __restrict__ part_acc,
                float* __restrict__ part_m, float* __restrict__ part_l, int target,
                int batch, int* __restrict__ chunk_counts,
                float* __restrict__ latent, float* __restrict__ lse) {
    pdl_launch_dependents();  // the combine may launch now; it waits for this grid
    PagedWalk<CacheT, rows::kTile> walk{kv_cache, block_table, cache_seqlens, n_rows, n_head,
                                        s_q, causal, max_pages, page_shift, max_chunks,
                                        min_chunk, target, batch, chunk_counts, latent, lse};
    attn_rows_body<CacheT>(q, walk, scale_log2, part_acc, part_m, part_l);
}

}  // namespace mla
