// mla_project.cu: the output projection out = wv_b[h] @ latent of every row, batched, on the
// tensor cores.
//
// Template parameters
//   WvT  wv_b element: __half or __nv_bfloat16
// Fixed geometry
//   kPmThreads = 256 (8 warps); a block computes a kPmM x kPmV = 32 x 32 tile of out for one
//   head: 32 latent rows x 32 wv_b rows, as 2 m16 x 4 n8 mma.sync m16n8k16 tiles. Its warps
//   each take an eighth of the 512 latent columns (4 k16 steps, one round trip of loads),
//   and their partial tiles are added in shared memory in warp order (deterministic). sandbox/registry.py passes its
//   block size and kPmM, kPmV; the kernel static_asserts them.
//
// Launch: grid = (H, ceil(v_head / kPmV), ceil(M / kPmM)), block = kPmThreads, no dynamic
// shared memory (40 KB static: the eight partial tiles).
// latent [M][H][512] f32, out [M][H][v_head] f32: row m of head h is m * H + h. Batch 1 has
// M = 1 (latent [H][512]); a paged batch M = B * s_q (latent [B][s_q][H][512]). Rows past M
// and wv_b rows past v_head are read from the last valid one and never stored.
//
// Exactness: A = the latent, split into hi + lo 16-bit parts of wv_b's type as its fragments
// are loaded (mla_common.cuh, split_hi_lo: the mma* attention kernels' split of q and p), so
// the latent keeps 2^-22 (f16) or 2^-16 (bf16) of its relative precision; B = wv_b, exact in
// 16 bits; every sum is f32.
//
// Loads: fragments come straight from global memory. The product sums over k, so a k16
// step's columns may be dealt to the fragments in any order A and B share: lane c4 takes
// columns 4 c4 .. 4 c4 + 3 of each step (the MMA's 2 c4, 2 c4 + 1, 2 c4 + 8, 2 c4 + 9), one
// float4 of a latent row and 8 bytes of a wv_b row, where the MMA's own order takes two
// loads of each.
// A warp's 4 k-steps of wv_b are loaded at once, then its 4 of the latent. A block
// reads its wv_b slice once for its 32 latent rows, so wv_b is read ceil(M / 32) times in all
// (from L2 after the first).
//
// Tensor cores at batch 1 too: a CUDA-core form, a warp's dot product and shuffle reduction
// per output, was no faster at one row and 4-5x slower at 128 (docs/combine-and-q-absorb-
// deep-dive.md).
//
// Programmatic dependent launch: a block loads its wv_b slice into registers, then waits
// (mla::pdl_wait) for the kernel before it (the merge, or an attention kernel that wrote the
// latent itself) before it reads the latent. Launched behind that kernel with programmatic
// stream serialization, the wv_b loads overlap its tail.
#include "mla_common.cuh"

namespace mla {

constexpr int kPmThreads = 256;
constexpr int kPmWarps = kPmThreads / 32;
constexpr int kPmM = 32, kPmV = 32;                        // the block's output tile
constexpr int kPmMT = kPmM / 16, kPmNT = kPmV / 8;         // 2 m16 tiles, 4 n8 tiles
constexpr int kPmKSteps = MLA_KV_LORA / 16 / kPmWarps;     // 4 k16 steps a warp
constexpr int kPmBatch = 4;                                // latent k-steps loaded together
constexpr int kPmRedStride = kPmV + 8;  // a fragment's 8 row groups on distinct bank pairs
static_assert(MLA_KV_LORA % (16 * kPmWarps) == 0, "whole k16 steps per warp");
static_assert(kPmKSteps % kPmBatch == 0, "whole batches of k-steps");
constexpr int kPmOut = kPmM * kPmV / kPmThreads;          // outputs a thread adds up: 4
static_assert(kPmOut % 4 == 0 && kPmV % kPmOut == 0, "the final sum: whole float4s of a row");

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
                // a0, a1: the first pair of rows g, g + 8; a2, a3: their second pair
                const float2 pairs[4] = {make_float2(x[j][mt][0].x, x[j][mt][0].y),
                                         make_float2(x[j][mt][1].x, x[j][mt][1].y),
                                         make_float2(x[j][mt][0].z, x[j][mt][0].w),
                                         make_float2(x[j][mt][1].z, x[j][mt][1].w)};
                unsigned hi[4], lo[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    WvT h0, l0, h1, l1;
                    split_hi_lo(pairs[e].x, h0, l0);
                    split_hi_lo(pairs[e].y, h1, l1);
                    hi[e] = bits16(h0) | (bits16(h1) << 16);
                    lo[e] = bits16(l0) | (bits16(l1) << 16);
                }
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

}  // namespace mla
