// mla_project.cu: the output projection out = wv_b[h] @ latent of every row, batched, on the
// tensor cores. Two kernels: `project` for a few latent rows a head (batch 1, small
// batches), `project_wide` for many (sandbox/registry.py, project_kind, picks).
//
// Template parameters (both)
//   WvT  wv_b element: __half or __nv_bfloat16
// Shared by both
//   latent [M][H][512] f32, out [M][H][v_head] f32: row m of head h is m * H + h. Batch 1 has
//   M = 1 (latent [H][512]); a paged batch M = B * s_q (latent [B][s_q][H][512]).
//   Exactness: A = the latent, split into hi + lo 16-bit parts of wv_b's type as its
//   fragments are built (mla_common.cuh, split_hi_lo: the mma* attention kernels' split of q
//   and p), so the latent keeps 2^-22 (f16) or 2^-16 (bf16) of its relative precision; B =
//   wv_b, exact in 16 bits; every sum is f32.
//   The k order: the product sums over k, so a k16 step's columns may be dealt to the
//   fragments in any order A and B share: lane c4 takes columns 4 c4 .. 4 c4 + 3 of each step
//   (the MMA's 2 c4, 2 c4 + 1, 2 c4 + 8, 2 c4 + 9), one float4 of a latent row and 8 bytes of
//   a wv_b row, where the MMA's own order takes two loads of each.
//   Programmatic dependent launch: wv_b is not the previous kernel's output, so its first
//   loads are issued before mla::pdl_wait (the merge, or an attention kernel that wrote the
//   latent itself) and overlap that kernel's tail; the latent is read after it.
//
// project: kPmThreads = 256 (8 warps); a block computes a kPmM x kPmV = 32 x 32 tile of out
//   for one head: 32 latent rows x 32 wv_b rows, as 2 m16 x 4 n8 mma.sync m16n8k16 tiles. Its
//   warps each take an eighth of the 512 latent columns (4 k16 steps, one round trip of
//   loads, fragments straight from global memory), and their partial tiles are added in
//   shared memory in warp order (deterministic): eight warps of loads in flight per tile,
//   which is what a single row needs. Grid (H, ceil(v_head / kPmV), ceil(M / kPmM)), 40 KB
//   static shared memory. Rows past M and wv_b rows past v_head are read from the last valid
//   one and never stored. Tensor cores at batch 1 too: a CUDA-core form, a warp's dot product
//   and shuffle reduction per output, was no faster at one row and 4-5x slower at 128
//   (docs/combine-and-q-absorb-deep-dive.md).
//
// project_wide: the same 256 threads over a kPwM x kPwV = 64 x 128 tile of one head, the
//   whole of a 128-row wv_b, so each latent row is read once and wv_b once per 64 rows:
//   project's 32 x 32 tiles read the latent v_head / 32 = 4 times and wv_b M / 32 times, and
//   at 128 heads x 128 rows that is 201 MB of loads for 59 MB of data (it took 41.5 us, ncu,
//   H200). Warp w owns rows 16 (w % 4) .. + 15 and wv_b rows 64 (w / 4) .. + 63 (8 n8 tiles)
//   over all 512 columns: no reduction across warps. The k dimension streams through a
//   kPwStages-deep cp.async ring of kPwK columns (the latent f32, wv_b 16-bit); rows past M
//   and v_head are zero-filled and never stored. Grid (H, ceil(v_head / kPwV),
//   ceil(M / kPwM)), 48 KB static shared memory.
#include "mla_common.cuh"

namespace mla {

// Both kernels
constexpr int kPmThreads = 256;
constexpr int kPmWarps = kPmThreads / 32;
// project
constexpr int kPmM = 32, kPmV = 32;                        // the block's output tile
constexpr int kPmMT = kPmM / 16, kPmNT = kPmV / 8;         // 2 m16 tiles, 4 n8 tiles
constexpr int kPmKSteps = MLA_KV_LORA / 16 / kPmWarps;     // 4 k16 steps a warp
constexpr int kPmBatch = 4;                                // latent k-steps loaded together
constexpr int kPmRedStride = kPmV + 8;  // a fragment's 8 row groups on distinct bank pairs
static_assert(MLA_KV_LORA % (16 * kPmWarps) == 0, "whole k16 steps per warp");
static_assert(kPmKSteps % kPmBatch == 0, "whole batches of k-steps");
constexpr int kPmOut = kPmM * kPmV / kPmThreads;          // outputs a thread adds up: 4
static_assert(kPmOut % 4 == 0 && kPmV % kPmOut == 0, "the final sum: whole float4s of a row");

// project_wide
constexpr int kPwM = 64, kPwV = 128;                   // the block's output tile
constexpr int kPwWarpsM = kPwM / 16;                   // 4 warps down the rows
constexpr int kPwWarpsV = kPmWarps / kPwWarpsM;        // 2 across wv_b rows
constexpr int kPwNT = kPwV / kPwWarpsV / 8;            // 8 n8 tiles a warp
constexpr int kPwK = 32;                               // latent columns a stage: 2 k16 steps
constexpr int kPwStages = 3;
constexpr int kPwKTiles = MLA_KV_LORA / kPwK;          // 16 stages' worth over k
constexpr int kPwAChunks = kPwK * 4 / 16;              // 16-byte chunks of an A row a stage: 8
constexpr int kPwBChunks = kPwK * 2 / 16;              // of a B row: 4
constexpr int kPwStageBytes = kPwM * kPwK * 4 + kPwV * kPwK * 2;  // 8 KB + 8 KB
static_assert(kPwWarpsM * kPwWarpsV == kPmWarps && kPwNT * 8 * kPwWarpsV == kPwV,
              "warps tile the block's output");
static_assert(MLA_KV_LORA % kPwK == 0 && kPwK % 16 == 0, "whole k16 steps a stage");
static_assert((kPwM * kPwAChunks) % kPmThreads == 0 && (kPwV * kPwBChunks) % kPmThreads == 0,
              "whole copies per thread");
static_assert(kPwStages * kPwStageBytes <= 48 * 1024, "static shared memory");
static_assert(kPwKTiles >= kPwStages, "the ring fills before the first product");

// The A fragment of an m16n8k16 product from the lane's float4s of rows g and g + 8 (its 4
// columns of a k16 step, the k order above), as hi and lo 16-bit parts: a0, a1 the first
// pair of columns of rows g, g + 8; a2, a3 their second pair.
template <typename WvT>
__device__ __forceinline__ void a_fragment_hi_lo(const float4& row_g, const float4& row_g8,
                                                 unsigned (&hi)[4], unsigned (&lo)[4]) {
    const float2 pairs[4] = {make_float2(row_g.x, row_g.y), make_float2(row_g8.x, row_g8.y),
                             make_float2(row_g.z, row_g.w), make_float2(row_g8.z, row_g8.w)};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        WvT h0, l0, h1, l1;
        split_hi_lo(pairs[e].x, h0, l0);
        split_hi_lo(pairs[e].y, h1, l1);
        hi[e] = bits16(h0) | (bits16(h1) << 16);
        lo[e] = bits16(l0) | (bits16(l1) << 16);
    }
}

template <typename WvT>
__global__ void __launch_bounds__(kPmThreads)
project(const float* __restrict__ latent, const WvT* __restrict__ wv_b, int n_head, int m_rows,
        int v_head, float* __restrict__ out) {
#ifdef MLA_REGISTRY_FACTS
    static_assert(MLA_PROJECT_THREADS == kPmThreads,
                  "registry.PROJECT_THREADS differs from kPmThreads");
    static_assert(MLA_PROJECT_M_ROWS == kPmM, "registry.PROJECT_M_ROWS differs from kPmM");
    static_assert(MLA_PROJECT_V_ROWS == kPmV, "registry.PROJECT_V_ROWS differs from kPmV");
#endif
    using M = MmaType<WvT>;
    __shared__ __align__(16) float red[kPmWarps][kPmM][kPmRedStride];
    const int h = blockIdx.x, v0 = blockIdx.y * kPmV, m0 = blockIdx.z * kPmM;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, c4 = lane & 3;       // fragment row group and column pair
    // The product sums over k, so a k16 step's columns may be dealt to the fragments in any
    // order A and B share: lane c4 takes columns 4 c4 .. 4 c4 + 3 of each step (the MMA's
    // 2 c4, 2 c4 + 1 and 2 c4 + 8, 2 c4 + 9), one float4 of a latent row and 8 bytes of a
    // wv_b row, where the MMA's own order would take two loads each (half the L1 wavefronts).
    const int k0 = warp * kPmKSteps * 16 + 4 * c4;  // this lane's first column

    // B, wv_b[h][v][k] (column-major k x n is wv_b's row-major v x k): rows past v_head read
    // the last row and are never stored.
    unsigned b[kPmKSteps][kPmNT][2];
#pragma unroll
    for (int nt = 0; nt < kPmNT; ++nt) {
        const int v = min(v0 + 8 * nt + g, v_head - 1);
        const WvT* row = wv_b + (static_cast<size_t>(h) * v_head + v) * MLA_KV_LORA + k0;
#pragma unroll
        for (int j = 0; j < kPmKSteps; ++j) {
            const uint2 w = __ldg(reinterpret_cast<const uint2*>(row + 16 * j));
            b[j][nt][0] = w.x;
            b[j][nt][1] = w.y;
        }
    }

    pdl_wait();  // the latent is the previous kernel's

    // A, the latent: rows g and g + 8 of each m16 tile; rows past m_rows read the last row.
    const float* a_row[kPmMT][2];
#pragma unroll
    for (int mt = 0; mt < kPmMT; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int m = min(m0 + 16 * mt + g + 8 * hh, m_rows - 1);
            a_row[mt][hh] = latent + (static_cast<size_t>(m) * n_head + h) * MLA_KV_LORA + k0;
        }
    const bool second_tile = m0 + 16 < m_rows;  // warp-uniform: m tile 1 has a real row

    float acc[kPmMT][kPmNT][4];
#pragma unroll
    for (int mt = 0; mt < kPmMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kPmNT; ++nt) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.f;

#pragma unroll
    for (int j0 = 0; j0 < kPmKSteps; j0 += kPmBatch) {
        float4 x[kPmBatch][kPmMT][2];  // rows g, g + 8 of each step and m tile
#pragma unroll
        for (int j = 0; j < kPmBatch; ++j)
#pragma unroll
            for (int mt = 0; mt < kPmMT; ++mt) {
                if (mt == 1 && !second_tile) continue;
                const int k = 16 * (j0 + j);
                x[j][mt][0] = __ldg(reinterpret_cast<const float4*>(a_row[mt][0] + k));
                x[j][mt][1] = __ldg(reinterpret_cast<const float4*>(a_row[mt][1] + k));
            }
#pragma unroll
        for (int j = 0; j < kPmBatch; ++j)
#pragma unroll
            for (int mt = 0; mt < kPmMT; ++mt) {
                if (mt == 1 && !second_tile) continue;
                unsigned hi[4], lo[4];
                a_fragment_hi_lo<WvT>(x[j][mt][0], x[j][mt][1], hi, lo);
#pragma unroll
                for (int nt = 0; nt < kPmNT; ++nt) {
                    M::mma(acc[mt][nt], hi, b[j0 + j][nt][0], b[j0 + j][nt][1]);
                    M::mma(acc[mt][nt], lo, b[j0 + j][nt][0], b[j0 + j][nt][1]);
                }
            }
    }

    // acc[mt][nt][2 hh + e]: row 16 mt + g + 8 hh, column 8 nt + 2 c4 + e of the tile.
#pragma unroll
    for (int mt = 0; mt < kPmMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kPmNT; ++nt)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh)
                *reinterpret_cast<float2*>(&red[warp][16 * mt + g + 8 * hh][8 * nt + 2 * c4]) =
                    make_float2(acc[mt][nt][2 * hh], acc[mt][nt][2 * hh + 1]);
    __syncthreads();
    // The warps' k-slices in warp order; thread t: row t / (kPmV / kPmOut), kPmOut columns.
    constexpr int kPerRow = kPmV / kPmOut;
    const int r = tid / kPerRow, c8 = (tid % kPerRow) * kPmOut, m = m0 + r;
    if (m >= m_rows) return;
    float sum[kPmOut];
#pragma unroll
    for (int e = 0; e < kPmOut; e += 4) {
        float4 s4 = *reinterpret_cast<const float4*>(&red[0][r][c8 + e]);
#pragma unroll
        for (int w = 1; w < kPmWarps; ++w) {
            const float4 o = *reinterpret_cast<const float4*>(&red[w][r][c8 + e]);
            s4.x += o.x; s4.y += o.y; s4.z += o.z; s4.w += o.w;
        }
        sum[e] = s4.x; sum[e + 1] = s4.y; sum[e + 2] = s4.z; sum[e + 3] = s4.w;
    }
    float* dst = out + (static_cast<size_t>(m) * n_head + h) * v_head;
#pragma unroll
    for (int e = 0; e < kPmOut; ++e)
        if (v0 + c8 + e < v_head) dst[v0 + c8 + e] = sum[e];
}

// ---- project_wide ------------------------------------------------------------------------
// Shared-memory layouts (one stage): A [kPwM rows][8 chunks of 4 f32], chunk c of row r at
// c ^ ((r & 1) << 2); B [kPwV rows][4 chunks of 8 16-bit], chunk c of row r at
// c ^ (((r >> 1) & 1) << 1). A lane (g, c4) reads a float4 (its 4 columns of a k16 step) of
// rows g and g + 8 and 8 bytes of wv_b rows 8 nt + g: with these swizzles the 8 lanes of a
// quarter-warp (16-byte loads) and the 16 of a half-warp (8-byte loads) touch distinct banks.
__device__ __forceinline__ int pw_a_chunk(int r, int c) { return c ^ ((r & 1) << 2); }
__device__ __forceinline__ int pw_b_chunk(int r, int c) { return c ^ (((r >> 1) & 1) << 1); }

template <typename WvT>
__global__ void __launch_bounds__(kPmThreads)
project_wide(const float* __restrict__ latent, const WvT* __restrict__ wv_b, int n_head,
             int m_rows, int v_head, float* __restrict__ out) {
#ifdef MLA_REGISTRY_FACTS
    static_assert(MLA_PROJECT_WIDE_THREADS == kPmThreads,
                  "registry.PROJECT_THREADS differs from kPmThreads");
    static_assert(MLA_PROJECT_WIDE_M_ROWS == kPwM, "registry.PROJECT_WIDE_M_ROWS differs from kPwM");
    static_assert(MLA_PROJECT_WIDE_V_ROWS == kPwV, "registry.PROJECT_WIDE_V_ROWS differs from kPwV");
#endif
    using M = MmaType<WvT>;
    __shared__ __align__(16) unsigned char ring[kPwStages][kPwStageBytes];
    const int h = blockIdx.x, v0 = blockIdx.y * kPwV, m0 = blockIdx.z * kPwM;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, c4 = lane & 3;
    const int wm = warp % kPwWarpsM, wv = warp / kPwWarpsM;

    // This thread's copies: A chunks tid + 256 i of [64 rows][8], B chunks of [128 rows][4].
    // Rows past m_rows / v_head are zero-filled (the source is row 0, never read).
    auto copy_b = [&](int kt, int stage) {
        uint4* dst = reinterpret_cast<uint4*>(ring[stage] + kPwM * kPwK * 4);
#pragma unroll
        for (int i = 0; i < kPwV * kPwBChunks / kPmThreads; ++i) {
            const int idx = tid + i * kPmThreads, r = idx / kPwBChunks, c = idx % kPwBChunks;
            const bool valid = v0 + r < v_head;
            const WvT* src = wv_b + (static_cast<size_t>(h) * v_head + (valid ? v0 + r : 0)) *
                                        MLA_KV_LORA + kt * kPwK + c * 8;
            cp_async_16(dst + r * kPwBChunks + pw_b_chunk(r, c), src, valid);
        }
    };
    auto copy_a = [&](int kt, int stage) {
        uint4* dst = reinterpret_cast<uint4*>(ring[stage]);
#pragma unroll
        for (int i = 0; i < kPwM * kPwAChunks / kPmThreads; ++i) {
            const int idx = tid + i * kPmThreads, r = idx / kPwAChunks, c = idx % kPwAChunks;
            const bool valid = m0 + r < m_rows;
            const float* src = latent + (static_cast<size_t>(valid ? m0 + r : 0) * n_head + h) *
                                            MLA_KV_LORA + kt * kPwK + c * 4;
            cp_async_16(dst + r * kPwAChunks + pw_a_chunk(r, c), src, valid);
        }
    };
    // The ring's first stages: their wv_b before the wait, the latent after it; one group a
    // stage (the first also holds the early wv_b copies of the others).
#pragma unroll
    for (int s = 0; s < kPwStages - 1; ++s) copy_b(s, s);
    pdl_wait();  // the latent is the previous kernel's
#pragma unroll
    for (int s = 0; s < kPwStages - 1; ++s) {
        copy_a(s, s);
        cp_async_commit();
    }

    float acc[kPwNT][4];
#pragma unroll
    for (int nt = 0; nt < kPwNT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
    const int a_row = 16 * wm + g, b_row0 = kPwNT * 8 * wv + g;

#pragma unroll 1
    for (int kt = 0; kt < kPwKTiles; ++kt) {
        cp_async_wait<kPwStages - 2>();  // stage kt has landed (this thread's copies)
        __syncthreads();                 // everyone's; and stage kt - 1 is free to refill
        const int next = kt + kPwStages - 1;
        if (next < kPwKTiles) {
            copy_b(next, next % kPwStages);
            copy_a(next, next % kPwStages);
        }
        cp_async_commit();  // (an empty group past the end keeps the wait count uniform)
        const uint4* a_s = reinterpret_cast<const uint4*>(ring[kt % kPwStages]);
        const uint2* b_s = reinterpret_cast<const uint2*>(ring[kt % kPwStages] + kPwM * kPwK * 4);
#pragma unroll
        for (int j = 0; j < kPwK / 16; ++j) {
            // A: the float4 of columns 16 j + 4 c4 .. + 3, rows a_row and a_row + 8
            const int ac = 4 * j + c4;  // 16-byte chunk: 4 f32
            const float4 x0 = *reinterpret_cast<const float4*>(a_s + a_row * kPwAChunks + pw_a_chunk(a_row, ac));
            const float4 x1 = *reinterpret_cast<const float4*>(a_s + (a_row + 8) * kPwAChunks + pw_a_chunk(a_row + 8, ac));
            unsigned hi[4], lo[4];
            a_fragment_hi_lo<WvT>(x0, x1, hi, lo);
            // B: 8 bytes (4 columns) of wv_b row b_row0 + 8 nt; the 8-byte unit 2 c + half of
            // chunk c = 2 j + c4 / 2
            const int bc = 2 * j + (c4 >> 1), half = c4 & 1;
#pragma unroll
            for (int nt = 0; nt < kPwNT; ++nt) {
                const int r = b_row0 + 8 * nt;
                const uint2 w = b_s[(r * kPwBChunks + pw_b_chunk(r, bc)) * 2 + half];
                M::mma(acc[nt], hi, w.x, w.y);
                M::mma(acc[nt], lo, w.x, w.y);
            }
        }
    }

    // acc[nt][2 hh + e]: latent row a_row + 8 hh of the block, wv_b row
    // kPwNT * 8 wv + 8 nt + 2 c4 + e of it (the n8 tile's column 2 c4 + e).
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int m = m0 + a_row + 8 * hh;
        if (m >= m_rows) continue;
        float* dst = out + (static_cast<size_t>(m) * n_head + h) * v_head;
#pragma unroll
        for (int nt = 0; nt < kPwNT; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int v = v0 + kPwNT * 8 * wv + 8 * nt + 2 * c4 + e;
                if (v < v_head) dst[v] = acc[nt][2 * hh + e];
            }
    }
}

}  // namespace mla
