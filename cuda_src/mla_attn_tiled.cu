// mla_attn_tiled.cu: the register-tiled CUDA-core attention family, mla::attn_tiled.
//
// Template parameters
//   HPB     heads per block: 16 (the thread tiles below are sized for it)
//   CacheT  cache element: __half or __nv_bfloat16
//   QT      query element: float, or CacheT
// Fixed geometry (sandbox/registry.py mirrors it: change both together)
//   kThreads = 256 (8 warps), kTile = 64 cache rows per step, two cp.async stages,
//   one block per SM (the value accumulators take most of the register file).
//
// Same contract, launch and partials as mla::attn (mla_attn.cu): grid (ceil(H/HPB), S),
// block (g, s) serves heads g*HPB.. over the contiguous slice s, and writes (m, l, acc) in
// the log2 domain; empty slices are neutral; wv_b runs in the combine.
//
// Why another family. attn<16> spends a third of its issue slots on shared-memory loads,
// conversions and addressing (ncu: 63% of instructions are FFMA), because its thread tiles
// are small (2 rows x 8 heads for scores, 16 heads x 2 columns for values) so that two
// blocks fit an SM. Here one block owns the SM and each thread owns GEMM-style tiles:
//   scores  S[64 x 16] = X[64 x 576] Q[576 x 16]: a thread owns 4 rows x 16 heads over 36
//           key columns (one of 16 k-slices), so per key column 4 conversions and 4
//           broadcast loads of q feed 64 FMAs. The two k-slices of a warp are summed
//           through shuffles, the 8 warps' partials through shared memory.
//   values  O[16 x 512] += P[16 x 64] X[64 x 512]: a thread owns 16 heads x 8 columns (128
//           accumulators in registers for the whole slice) over a quarter of each tile's
//           rows, so per row 8 conversions and 4 broadcast loads feed 128 FMAs. The four row
//           quarters are summed once, when the slice is done.
// The softmax is lazy (kLazyLog2, mla_common.cuh): a head's reference max m moves only when a
// tile's max exceeds it by more than 2^8, so the value accumulators are rescaled only on
// the few tiles where some head's max moved; the partial (m, l, acc) is exact for any m.
#include "mla_common.cuh"

namespace mla {
namespace tiled {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kTile = 64;
constexpr int kKvLora = MLA_KV_LORA;
constexpr int kKeyDim = MLA_KV_LORA + MLA_ROPE;
constexpr int kChunkElems = 8;                          // 16 bytes of 16-bit elements
constexpr int kChunksPerRow = kKeyDim / kChunkElems;    // 72
constexpr int kHeads = 16;
// scores
constexpr int kRowGroups = 16;                          // a thread owns rows rg + 16 i
constexpr int kRowsPerThread = kTile / kRowGroups;      // 4
constexpr int kKSlices = kThreads / kRowGroups;         // 16, two per warp
constexpr int kSliceCols = kKeyDim / kKSlices;          // 36 key columns
constexpr int kUnitCols = 4;                            // read as 8-byte units
constexpr int kUnitsPerSlice = kSliceCols / kUnitCols;  // 9
constexpr int kQSliceStride = kSliceCols * kHeads + 8;  // floats; the pad keeps the two
                                                        // k-slices of a warp on other banks
constexpr int kRedHeadStride = kTile + 2;               // floats; ditto for the two halves
constexpr int kPStride = kHeads + 4;                    // floats per row of p
// values
constexpr int kValueCols = 8;                           // one 16-byte chunk
constexpr int kColGroups = kKvLora / kValueCols;        // 64
constexpr int kRowQuarters = kThreads / kColGroups;     // 4
constexpr int kRowsPerQuarter = kTile / kRowQuarters;   // 16

// Tuning knobs, overridable with -D for experiments (the registry compiles the defaults).
#ifndef MLA_TILED_SCORE_UNROLL
#define MLA_TILED_SCORE_UNROLL 1
#endif
#ifndef MLA_TILED_VALUE_UNROLL
#define MLA_TILED_VALUE_UNROLL 2
#endif

static_assert(kKeyDim % (kKSlices * kUnitCols) == 0 && kSliceCols % kUnitCols == 0, "k-slices");
static_assert(kChunksPerRow % 8 == 0 && kThreads == 32 * 8, "tile copy: 8 threads per row");
static_assert(kRowGroups == 16 && kKSlices == 2 * kWarps, "two k-slices per warp, split at lane 16");

struct Smem {
    static constexpr int tile_bytes = kTile * kKeyDim * 2;
    static constexpr int tiles = 0;                                           // 2 x [64][72] x 16 B
    static constexpr int q = tiles + 2 * tile_bytes;                          // [16][36 x 16 + 8] f32
    static constexpr int red = q + kKSlices * kQSliceStride * 4;              // [8][16][66] f32
    static constexpr int p = red + kWarps * kHeads * kRedHeadStride * 4;      // [64][20] f32
    static constexpr int alpha = p + kTile * kPStride * 4;                    // [16] f32
    static constexpr int bytes = alpha + kHeads * 4;
    static_assert((kRowQuarters - 1) * kHeads * kKvLora * 4 <= 2 * tile_bytes,
                  "the row-quarter sum borrows the tile buffers");
};

template <typename CacheT>
__device__ __forceinline__ void unpack4(uint2 raw, float (&x)[4]) {
    const float2 a = pair_to_f32<CacheT>(raw.x), b = pair_to_f32<CacheT>(raw.y);
    x[0] = a.x; x[1] = a.y; x[2] = b.x; x[3] = b.y;
}

}  // namespace tiled

template <int HPB, typename CacheT, typename QT>
__global__ void __launch_bounds__(tiled::kThreads, 1)
attn_tiled(const QT* __restrict__ q, const CacheT* __restrict__ cache, int n_head, int n_ctx,
           int splits, float scale_log2, float* __restrict__ part_acc, float* __restrict__ part_m,
           float* __restrict__ part_l) {
    using namespace tiled;
    static_assert(HPB == kHeads, "attn_tiled's thread tiles are sized for 16 heads per block");
    require_dynamic_smem(Smem::bytes);
    extern __shared__ __align__(16) unsigned char smem[];
    uint4* tiles = reinterpret_cast<uint4*>(smem + Smem::tiles);
    float* q_s = reinterpret_cast<float*>(smem + Smem::q);
    float* red = reinterpret_cast<float*>(smem + Smem::red);
    float* p_s = reinterpret_cast<float*>(smem + Smem::p);
    float* alpha_s = reinterpret_cast<float*>(smem + Smem::alpha);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    BlockSlice work;  // an empty slice (S > n_ctx) writes its neutral partial and is done
    if (!begin_slice(HPB, n_head, n_ctx, splits, kKvLora, part_acc, part_m, part_l, work)) return;
    const int head0 = work.head0, row_start = work.row_start, row_end = work.row_end;
    const size_t part_base = work.part_base;

    auto load_tile = [&](int tile_index, int buf) {  // two stage buffers
        cp_async_tile<kTile, kChunksPerRow, 2, kThreads>(tiles, buf, tile_index, cache, row_start, row_end);
    };
    load_tile(0, 0);

    // q in f32, pre-scaled into the log2 domain, as [k-slice][column][head].
    stage_q<HPB, kKeyDim, kThreads>(q, head0, n_head, scale_log2, [&](int j, int k, float x) {
        const int ks = k / kSliceCols, kk = k - ks * kSliceCols;
        q_s[ks * kQSliceStride + kk * kHeads + j] = x;
    });

    // Score-phase identity: row group rg (rows rg + 16 i, one swizzle for all four), k-slice ks.
    const int rg = lane & 15, k_half = lane >> 4, ks = 2 * warp + k_half;
    const int swz = rg & 7;
    const float* q_slice = q_s + ks * kQSliceStride;
    // Softmax identity: head sm_h over rows rg + 16 i. Its (m, l) live in these registers.
    const int sm_h = tid >> 4;
    float m_ref = -INFINITY, l_run = 0.f;
    // Value identity: columns [8 cg, 8 cg + 8) of every head over row quarter rq.
    const int cg = tid % kColGroups, rq = tid / kColGroups;

    float acc[kHeads][kValueCols];
#pragma unroll
    for (int j = 0; j < kHeads; ++j)
#pragma unroll
        for (int e = 0; e < kValueCols; ++e) acc[j][e] = 0.f;

    const int n_tiles = (row_end - row_start + kTile - 1) / kTile;
    for (int it = 0; it < n_tiles; ++it) {
        const int buf = it & 1;
        cp_async_wait<0>();
        // Tile `it` is visible; every thread is done with tile it-1 (values) and with the
        // partials and p of the last softmax, so the other buffer takes the next tile now.
        __syncthreads();
        if (it + 1 < n_tiles) load_tile(it + 1, buf ^ 1);
        const unsigned char* tile = reinterpret_cast<const unsigned char*>(tiles + buf * kTile * kChunksPerRow);

        // ---- scores: 4 rows x 16 heads over this thread's 36 key columns ----
        float sacc[kRowsPerThread][kHeads];
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i)
#pragma unroll
            for (int j = 0; j < kHeads; ++j) sacc[i][j] = 0.f;
#pragma unroll MLA_TILED_SCORE_UNROLL
        for (int u = 0; u < kUnitsPerSlice; ++u) {
            const int g = ks * kUnitsPerSlice + u;                       // 4-column unit of the row
            const int off = (((g >> 1) ^ swz) << 4) + ((g & 1) << 3);    // byte offset in a row
            float x[kRowsPerThread][kUnitCols];
#pragma unroll
            for (int i = 0; i < kRowsPerThread; ++i)
                unpack4<CacheT>(*reinterpret_cast<const uint2*>(tile + (rg + 16 * i) * (kChunksPerRow * 16) + off), x[i]);
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
        // The two k-slices of a warp hold the same rows: lane half 0 keeps heads 0-7 and
        // takes the other half's, lane half 1 keeps heads 8-15; one shuffle per pair.
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i)
#pragma unroll
            for (int j = 0; j < kHeads / 2; ++j) {
                const float send = k_half ? sacc[i][j] : sacc[i][j + 8];
                const float keep = k_half ? sacc[i][j + 8] : sacc[i][j];
                const float sum = keep + __shfl_xor_sync(0xffffffffu, send, 16);
                red[(warp * kHeads + k_half * 8 + j) * kRedHeadStride + rg + 16 * i] = sum;
            }
        __syncthreads();

        // ---- softmax: head sm_h, rows rg + 16 i; 16 lanes per head ----
        const int row0 = row_start + it * kTile;
        float s[kRowsPerThread];
        float t_max = -INFINITY;
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i) {
            float v = 0.f;
#pragma unroll
            for (int w = 0; w < kWarps; ++w) v += red[(w * kHeads + sm_h) * kRedHeadStride + rg + 16 * i];
            s[i] = (row0 + rg + 16 * i < row_end) ? v : -INFINITY;
            t_max = fmaxf(t_max, s[i]);
        }
#pragma unroll
        for (int o = 8; o > 0; o >>= 1) t_max = fmaxf(t_max, __shfl_xor_sync(0xffffffffu, t_max, o));
        // t_max is finite: every tile holds a valid row. m_ref = -inf on the first tile, so
        // it moves there, with alpha = 2^-inf = 0 on accumulators that are still 0.
        const bool move = t_max > m_ref + kLazyLog2;
        const float m_new = move ? t_max : m_ref;
        const float alpha = move ? exp2f(m_ref - m_new) : 1.f;
        float p_sum = 0.f;
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i) {
            const float p = exp2f(s[i] - m_new);
            p_s[(rg + 16 * i) * kPStride + sm_h] = p;
            p_sum += p;
        }
#pragma unroll
        for (int o = 8; o > 0; o >>= 1) p_sum += __shfl_xor_sync(0xffffffffu, p_sum, o);
        l_run = l_run * alpha + p_sum;
        m_ref = m_new;
        if (rg == 0) alpha_s[sm_h] = alpha;
        const int rescale = __syncthreads_or(move);

        // ---- values: acc = acc * alpha + p @ cache[rows of quarter rq, 8 columns] ----
        if (rescale) {
#pragma unroll
            for (int j = 0; j < kHeads; ++j) {
                const float a = alpha_s[j];
#pragma unroll
                for (int e = 0; e < kValueCols; ++e) acc[j][e] *= a;
            }
        }
        const uint4* tile4 = reinterpret_cast<const uint4*>(tile);
#pragma unroll MLA_TILED_VALUE_UNROLL
        for (int r = rq * kRowsPerQuarter; r < (rq + 1) * kRowsPerQuarter; ++r) {
            const uint4 raw = tile4[swizzled_chunk(r, cg, kChunksPerRow)];
            float x[kValueCols];
            unpack4<CacheT>(make_uint2(raw.x, raw.y), *reinterpret_cast<float(*)[4]>(x));
            unpack4<CacheT>(make_uint2(raw.z, raw.w), *reinterpret_cast<float(*)[4]>(x + 4));
            const float4* pr = reinterpret_cast<const float4*>(p_s + r * kPStride);
#pragma unroll
            for (int j4 = 0; j4 < kHeads / 4; ++j4) {
                const float4 pv = pr[j4];
                const float pj[4] = {pv.x, pv.y, pv.z, pv.w};
#pragma unroll
                for (int jj = 0; jj < 4; ++jj)
#pragma unroll
                    for (int e = 0; e < kValueCols; ++e)
                        acc[4 * j4 + jj][e] = fmaf(pj[jj], x[e], acc[4 * j4 + jj][e]);
            }
        }
    }

    // Sum the row quarters through the (now idle) tile buffers, then write the partial.
    cp_async_wait<0>();
    __syncthreads();
    float* quarters = reinterpret_cast<float*>(tiles);  // [3][16][512]
    if (rq > 0) {
#pragma unroll
        for (int j = 0; j < kHeads; ++j) {
            float4* dst = reinterpret_cast<float4*>(quarters + ((rq - 1) * kHeads + j) * kKvLora + cg * kValueCols);
            dst[0] = make_float4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]);
            dst[1] = make_float4(acc[j][4], acc[j][5], acc[j][6], acc[j][7]);
        }
    }
    __syncthreads();
    if (rq == 0) {
#pragma unroll
        for (int j = 0; j < kHeads; ++j) {
            if (head0 + j >= n_head) continue;
            float v[kValueCols];
#pragma unroll
            for (int e = 0; e < kValueCols; ++e) v[e] = acc[j][e];
#pragma unroll
            for (int qq = 0; qq < kRowQuarters - 1; ++qq) {
                const float4* src = reinterpret_cast<const float4*>(quarters + (qq * kHeads + j) * kKvLora + cg * kValueCols);
                const float4 a = src[0], b = src[1];
                v[0] += a.x; v[1] += a.y; v[2] += a.z; v[3] += a.w;
                v[4] += b.x; v[5] += b.y; v[6] += b.z; v[7] += b.w;
            }
            float4* dst = reinterpret_cast<float4*>(part_acc + (part_base + head0 + j) * kKvLora + cg * kValueCols);
            dst[0] = make_float4(v[0], v[1], v[2], v[3]);
            dst[1] = make_float4(v[4], v[5], v[6], v[7]);
        }
    }
    if (rg == 0 && head0 + sm_h < n_head) {
        part_m[part_base + head0 + sm_h] = m_ref;
        part_l[part_base + head0 + sm_h] = l_run;
    }
}

}  // namespace mla
