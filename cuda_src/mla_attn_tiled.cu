// mla_attn_tiled.cu: the register-tiled, warp-specialized CUDA-core attention family,
// mla::attn_tiled.
//
// Template parameters
//   HPB     heads per block: 16 (the thread tiles below are sized for it)
//   CacheT  cache element: __half or __nv_bfloat16
//   QT      query element: float, or CacheT
// Fixed geometry
//   kThreads = 256: warps 0-3 compute scores, warps 4-7 copy tiles, run the softmax and
//   accumulate values; kTile = 32 cache rows per tile, kStages = 3 tile buffers; one block
//   per SM (the shared memory below). sandbox/registry.py passes its own values for the
//   block, the tile and the shared memory; the kernel static_asserts them.
//
// Same contract, launch and partials as mla::attn (mla_attn.cu): grid (ceil(H/HPB), S),
// block (g, s) serves heads g*HPB.. over the contiguous slice s, and writes (m, l, acc) in
// the log2 domain; empty slices are neutral; wv_b runs in the combine.
//
// Why warp-specialized: a kernel that runs both phases in every warp holds 16 x 8 value
// accumulators and 4 x 16 score accumulators at once; its loops cannot keep loads ahead of
// their uses, and both warps of a scheduler stall at the same places. Here the two phases are
// two pipelines of 128 threads, one tile apart:
//   score warps   S[32 x 16] = X[32 x 576] Q[576 x 16] for tile i+1: a thread owns 4 rows x
//                 16 heads over 36 key columns (one of 16 k-slices); per key column, 4
//                 conversions and 4 broadcast loads of q feed 64 FMAs. The partials go to
//                 `red`, whose 16 k-slices the value warps sum.
//   value warps   for tile i: sum the partials, run the lazy softmax, then
//                 O[16 x 512] += P[16 x 32] X[32 x 512]: a thread owns 16 heads x 4 columns
//                 over all rows (64 accumulators for the whole slice); per row, 4
//                 conversions and 4 broadcast loads of p feed 64 FMAs. Then they refill the
//                 tile buffer they are done with, three tiles ahead.
// Each scheduler holds one warp of each pipeline, and the two stall at different places.
//
// Synchronization (no __syncthreads after the prologue):
//   full[b]     mbarrier of tile buffer b: each value thread arrives once its cp.async copies
//               of the tile have landed (cp.async.mbarrier.arrive.noinc); the score warps
//               wait on its phase parity.
//   red_full    mbarrier: each score thread arrives when its part of tile i's partials is in
//               `red`; the value warps wait on its phase parity.
//   red_free    mbarrier: each value thread arrives once it has read tile i's partials; the
//               score warps wait on it before writing tile i+1's.
//   Values      named barrier of the 128 value threads (p, alpha, the rescale vote, and the
//               end of a tile buffer's use).
// red_full and red_free are mbarriers, not named barriers (bar.arrive -> bar.sync), which
// would order the same edges: compute-sanitizer's racecheck does not model named barriers and
// reports every read of `red` as racing the next tile's writes; it does model an mbarrier's
// release arrive -> acquire wait, and reports no race.
//
// The softmax is lazy (kLazyLog2, mla_common.cuh): a head's reference max m moves only when a
// tile's max exceeds it by more than 2^8, so the value accumulators are rescaled only on
// the few tiles where some head's max moved; the partial (m, l, acc) is exact for any m.
#include "mla_common.cuh"

namespace mla {
namespace tiled {

constexpr int kThreads = 256;
constexpr int kRoleThreads = 128;                       // per pipeline
constexpr int kTile = 32;
constexpr int kStages = 3;
constexpr int kKvLora = MLA_KV_LORA;
constexpr int kKeyDim = MLA_KV_LORA + MLA_ROPE;
constexpr int kChunksPerRow = kKeyDim / 8;              // 72 chunks of 16 bytes
constexpr int kRowBytes = kChunksPerRow * 16;           // 1152
constexpr int kHeads = 16;
// scores
constexpr int kRowGroups = 8;                           // a thread owns rows rg + 8 i
constexpr int kRowsPerThread = kTile / kRowGroups;      // 4
constexpr int kKSlices = kRoleThreads / kRowGroups;     // 16, four per warp
constexpr int kSliceCols = kKeyDim / kKSlices;          // 36 key columns
constexpr int kUnitCols = 4;                            // read as 8-byte units
constexpr int kUnits = kSliceCols / kUnitCols;          // 9
constexpr int kQSliceStride = kSliceCols * kHeads + 8;  // floats; the pad puts a warp's four
                                                        // k-slices of q on four bank groups
constexpr int kRedRowStride = kHeads + 4;               // floats; 8 rows x 4 heads of a warp
constexpr int kRedSliceStride = kTile * kRedRowStride;  // land on 32 banks
constexpr int kPStride = kHeads + 4;                    // floats per row of p
// values
constexpr int kValueCols = 4;
static_assert(kKvLora / kValueCols == kRoleThreads, "a value thread owns 4 columns of every head");
static_assert(kKeyDim % (kKSlices * kUnitCols) == 0, "k-slices of whole units");
static_assert(kRoleThreads == kRowGroups * kKSlices && kRowGroups == 8, "score threads: rg = lane & 7");
static_assert(kHeads * kTile == 4 * kRoleThreads, "softmax: a thread owns 4 (row, head) scores");
// named barrier of the value warps (0 is __syncthreads)
constexpr int kBarValues = 1;

// Tuning knobs, overridable with -D for experiments (the registry compiles the defaults).
// Score units (4 key columns) per loop trip, and value row-groups (4 rows) per loop trip:
// the two loops share each scheduler's instruction cache, which full unrolls (2,700
// instructions each) overflow.
#ifndef MLA_TILED_SCORE_UNROLL
#define MLA_TILED_SCORE_UNROLL 1
#endif
#ifndef MLA_TILED_VALUE_UNROLL
#define MLA_TILED_VALUE_UNROLL 2
#endif

struct Smem {
    static constexpr int tile_bytes = kTile * kRowBytes;                   // 36,864
    static constexpr int tiles = 0;                                        // 3 x [32][72] x 16 B
    static constexpr int q = tiles + kStages * tile_bytes;                 // [16][36 x 16 + 8] f32
    static constexpr int red = q + kKSlices * kQSliceStride * 4;           // [16][32][20] f32
    static constexpr int p = red + kKSlices * kRedSliceStride * 4;         // [32][20] f32
    static constexpr int alpha = p + kTile * kPStride * 4;                 // [16] f32
    static constexpr int full = alpha + kHeads * 4;                        // [3] mbarriers
    static constexpr int red_full = full + kStages * 8;                    // mbarrier
    static constexpr int red_free = red_full + 8;                          // mbarrier
    static constexpr int bytes = red_free + 8;
    static_assert(full % 8 == 0, "mbarriers are 8-byte aligned");
};

__device__ __forceinline__ void bar_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
// bar.sync that also returns whether any participating thread passed pred = true.
__device__ __forceinline__ bool bar_sync_or(int id, int threads, bool pred) {
    unsigned any;
    asm volatile(
        "{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n bar.red.or.pred q, %2, %3, p;\n"
        " selp.u32 %0, 1, 0, q;\n}\n"
        : "=r"(any) : "r"(static_cast<unsigned>(pred)), "r"(id), "r"(threads) : "memory");
    return any != 0;
}
}  // namespace tiled

template <int HPB, typename CacheT, typename QT>
__global__ void __launch_bounds__(tiled::kThreads, 1)
attn_tiled(const QT* __restrict__ q, const CacheT* __restrict__ cache, int n_head, int n_ctx,
           int splits, float scale_log2, float* __restrict__ part_acc, float* __restrict__ part_m,
           float* __restrict__ part_l) {
    pdl_launch_dependents();  // the combine may launch now; it waits for this grid
    using namespace tiled;
    static_assert(HPB == kHeads, "attn_tiled's thread tiles are sized for 16 heads per block");
#ifdef MLA_REGISTRY_FACTS
    static_assert(MLA_TILED_THREADS == kThreads, "registry.TILED_THREADS differs from kThreads");
    static_assert(MLA_TILED_TILE == kTile, "registry.TILED_TILE differs from kTile");
    static_assert(registry_fact(HPB, MLA_TILED_SMEM) == Smem::bytes,
                  "registry.tiled_smem_bytes(HPB) differs from tiled::Smem::bytes");
#endif
    require_dynamic_smem(Smem::bytes);
    extern __shared__ __align__(16) unsigned char smem[];
    uint4* tiles = reinterpret_cast<uint4*>(smem + Smem::tiles);
    float* q_s = reinterpret_cast<float*>(smem + Smem::q);
    float* red = reinterpret_cast<float*>(smem + Smem::red);
    float* p_s = reinterpret_cast<float*>(smem + Smem::p);
    float* alpha_s = reinterpret_cast<float*>(smem + Smem::alpha);
    unsigned long long* full = reinterpret_cast<unsigned long long*>(smem + Smem::full);
    unsigned long long* red_full = reinterpret_cast<unsigned long long*>(smem + Smem::red_full);
    unsigned long long* red_free = reinterpret_cast<unsigned long long*>(smem + Smem::red_free);

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    BlockSlice work;  // an empty slice (S > n_ctx) writes its neutral partial and is done
    if (!begin_slice(HPB, n_head, n_ctx, splits, kKvLora, part_acc, part_m, part_l, work)) return;
    const int head0 = work.head0, row_start = work.row_start, row_end = work.row_end;
    const int n_tiles = (row_end - row_start + kTile - 1) / kTile;

    if (tid == 0) {
        for (int b = 0; b < kStages; ++b) mbar_init(&full[b], kRoleThreads);
        mbar_init(red_full, kRoleThreads);
        mbar_init(red_free, kRoleThreads);
    }
    pdl_wait();  // q is the kernel before's (q_absorb, api.DecodeStep): nothing above reads it
    // q in f32, pre-scaled into the log2 domain, as [k-slice][column][head].
    stage_q<HPB, kKeyDim, kThreads>(q, head0, n_head, scale_log2, [&](int j, int k, float x) {
        const int ks = k / kSliceCols, kk = k - ks * kSliceCols;
        q_s[ks * kQSliceStride + kk * kHeads + j] = x;
    });
    __syncthreads();

    if (warp < kRoleThreads / 32) {
        // ---- score warps: 4 rows (rg + 8 i) x 16 heads over key columns [36 ks, 36 ks + 36) ----
        const int rg = lane & 7, ks = 4 * warp + (lane >> 3);
        const float* q_slice = q_s + ks * kQSliceStride;
        float* red_out = red + ks * kRedSliceStride + rg * kRedRowStride;
        // Byte offset of unit u (key columns 36 ks + 4u ..) in row rg: rows rg + 8i share the
        // swizzle (r & 7 = rg), so the other three rows are immediates away.
        auto unit_offset = [&](int u) {
            const int g = ks * kUnits + u;  // 4-column unit of the row
            return rg * kRowBytes + ((((g >> 1) ^ rg) << 4) + ((g & 1) << 3));
        };
        int buf = 0;
        unsigned parity = 0;
        for (int it = 0; it < n_tiles; ++it) {
            mbar_wait(&full[buf], parity);
            const unsigned char* tile = reinterpret_cast<const unsigned char*>(tiles) + buf * Smem::tile_bytes;
            float sacc[kRowsPerThread][kHeads];
#pragma unroll
            for (int i = 0; i < kRowsPerThread; ++i)
#pragma unroll
                for (int j = 0; j < kHeads; ++j) sacc[i][j] = 0.f;
            // The next unit's four row pieces are loaded before this unit's FMAs.
            uint2 next[kRowsPerThread];
#pragma unroll
            for (int i = 0; i < kRowsPerThread; ++i)
                next[i] = *reinterpret_cast<const uint2*>(tile + unit_offset(0) + 8 * i * kRowBytes);
#pragma unroll MLA_TILED_SCORE_UNROLL
            for (int u = 0; u < kUnits; ++u) {
                uint2 cur[kRowsPerThread];
#pragma unroll
                for (int i = 0; i < kRowsPerThread; ++i) cur[i] = next[i];
                if (u + 1 < kUnits) {
                    const int o = unit_offset(u + 1);
#pragma unroll
                    for (int i = 0; i < kRowsPerThread; ++i)
                        next[i] = *reinterpret_cast<const uint2*>(tile + o + 8 * i * kRowBytes);
                }
                float x[kRowsPerThread][kUnitCols];
#pragma unroll
                for (int i = 0; i < kRowsPerThread; ++i) unpack_f32<CacheT>(cur[i], x[i]);
#pragma unroll
                for (int kk = 0; kk < kUnitCols; ++kk) {
                    const float4* qk = reinterpret_cast<const float4*>(q_slice + (u * kUnitCols + kk) * kHeads);
                    float qv[kHeads];
#pragma unroll
                    for (int j4 = 0; j4 < kHeads / 4; ++j4) {
                        const float4 v = qk[j4];
                        qv[4 * j4] = v.x; qv[4 * j4 + 1] = v.y; qv[4 * j4 + 2] = v.z; qv[4 * j4 + 3] = v.w;
                    }
#pragma unroll
                    for (int i = 0; i < kRowsPerThread; ++i)
#pragma unroll
                        for (int j = 0; j < kHeads; ++j) sacc[i][j] = fmaf(x[i][kk], qv[j], sacc[i][j]);
                }
            }
            // The value warps are done with tile it-1's partials before these overwrite them.
            if (it > 0) mbar_wait(red_free, (it - 1) & 1);
#pragma unroll
            for (int i = 0; i < kRowsPerThread; ++i)
#pragma unroll
                for (int j4 = 0; j4 < kHeads / 4; ++j4)
                    *reinterpret_cast<float4*>(red_out + 8 * i * kRedRowStride + 4 * j4) =
                        make_float4(sacc[i][4 * j4], sacc[i][4 * j4 + 1], sacc[i][4 * j4 + 2], sacc[i][4 * j4 + 3]);
            mbar_arrive(red_full);
            if (++buf == kStages) { buf = 0; parity ^= 1u; }
        }
        return;
    }

    // ---- value warps: the tile copies, the softmax, and acc += p x ----
    const int vt = tid - kRoleThreads;
    // Softmax identity: head sm_h over rows sm_r + 8 m, m < 4; 8 lanes share a head, and
    // hold its running (m, l) in these registers.
    const int sm_h = vt >> 3, sm_r = vt & 7;
    // Value identity: latent columns [4 vt, 4 vt + 4) of every head, every row.
    const int col_chunk = vt >> 1, col_half = (vt & 1) << 3;  // 16-byte chunk, byte offset in it
    auto fill = [&](int b, int tile_index) {
        cp_async_tile<kTile, kChunksPerRow, kStages, kRoleThreads>(tiles, b, tile_index, cache, row_start, row_end, vt);
        mbar_arrive_after_copies(&full[b]);
    };
    for (int b = 0; b < kStages && b < n_tiles; ++b) fill(b, b);

    float m_ref = -INFINITY, l_run = 0.f;
    float acc[kHeads][kValueCols];
#pragma unroll
    for (int j = 0; j < kHeads; ++j)
#pragma unroll
        for (int e = 0; e < kValueCols; ++e) acc[j][e] = 0.f;

    int buf = 0;
    for (int it = 0; it < n_tiles; ++it) {
        mbar_wait(red_full, it & 1);
        __syncwarp();  // the softmax shuffles below need the whole warp, and mbar_wait spins per thread
        const int row0 = row_start + it * kTile;
        float s[4];
        float t_max = -INFINITY;
#pragma unroll
        for (int m = 0; m < 4; ++m) {
            const int r = sm_r + 8 * m;
            float v = 0.f;
#pragma unroll
            for (int k = 0; k < kKSlices; ++k) v += red[k * kRedSliceStride + r * kRedRowStride + sm_h];
            s[m] = (row0 + r < row_end) ? v : -INFINITY;
            t_max = fmaxf(t_max, s[m]);
        }
        if (it + 1 < n_tiles) mbar_arrive(red_free);
#pragma unroll
        for (int o = 4; o > 0; o >>= 1) t_max = fmaxf(t_max, __shfl_xor_sync(0xffffffffu, t_max, o));
        // t_max is finite: every tile holds a valid row. m_ref = -inf on the first tile, so
        // it moves there, with alpha = 2^-inf = 0 on accumulators that are still 0.
        const bool move = t_max > m_ref + kLazyLog2;
        const float m_new = move ? t_max : m_ref;
        const float alpha = move ? exp2f(m_ref - m_new) : 1.f;
        float p_sum = 0.f;
#pragma unroll
        for (int m = 0; m < 4; ++m) {
            const float p = exp2f(s[m] - m_new);
            p_s[(sm_r + 8 * m) * kPStride + sm_h] = p;
            p_sum += p;
        }
#pragma unroll
        for (int o = 4; o > 0; o >>= 1) p_sum += __shfl_xor_sync(0xffffffffu, p_sum, o);
        l_run = l_run * alpha + p_sum;
        m_ref = m_new;
        if (sm_r == 0) alpha_s[sm_h] = alpha;
        if (bar_sync_or(kBarValues, kRoleThreads, move)) {
#pragma unroll
            for (int j = 0; j < kHeads; ++j) {
                const float a = alpha_s[j];
#pragma unroll
                for (int e = 0; e < kValueCols; ++e) acc[j][e] *= a;
            }
        }
        // Rows c, c + 8, c + 16, c + 24 share a swizzle (r & 7 = c): one chunk offset serves
        // all four, whose addresses then differ by immediates.
        const unsigned char* tile = reinterpret_cast<const unsigned char*>(tiles) + buf * Smem::tile_bytes;
#pragma unroll MLA_TILED_VALUE_UNROLL
        for (int c = 0; c < 8; ++c) {
            const unsigned char* x_row = tile + c * kRowBytes + ((col_chunk ^ c) << 4) + col_half;
            const float* p_row = p_s + c * kPStride;
#pragma unroll
            for (int t = 0; t < kTile / 8; ++t) {
                float x[kValueCols];
                unpack_f32<CacheT>(*reinterpret_cast<const uint2*>(x_row + t * 8 * kRowBytes), x);
#pragma unroll
                for (int j4 = 0; j4 < kHeads / 4; ++j4) {
                    const float4 pv = reinterpret_cast<const float4*>(p_row + t * 8 * kPStride)[j4];
                    const float pj[4] = {pv.x, pv.y, pv.z, pv.w};
#pragma unroll
                    for (int jj = 0; jj < 4; ++jj)
#pragma unroll
                        for (int e = 0; e < kValueCols; ++e)
                            acc[4 * j4 + jj][e] = fmaf(pj[jj], x[e], acc[4 * j4 + jj][e]);
                }
            }
        }
        // Every value warp is done with this buffer and with p: refill it three tiles ahead.
        bar_sync(kBarValues, kRoleThreads);
        if (it + kStages < n_tiles) fill(buf, it + kStages);
        if (++buf == kStages) buf = 0;
    }

    const size_t part_base = work.part_base;
#pragma unroll
    for (int j = 0; j < kHeads; ++j) {
        if (head0 + j >= n_head) continue;
        *reinterpret_cast<float4*>(part_acc + (part_base + head0 + j) * kKvLora + kValueCols * vt) =
            make_float4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]);
    }
    if (sm_r == 0 && head0 + sm_h < n_head) {
        part_m[part_base + head0 + sm_h] = m_ref;
        part_l[part_base + head0 + sm_h] = l_run;
    }
}

}  // namespace mla
