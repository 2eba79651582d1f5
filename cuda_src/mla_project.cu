// mla_project.cu: the output projection out = wv_b[h] @ latent of every row, batched.
//
// Template parameters
//   WvT  wv_b element: __half or __nv_bfloat16
// Fixed geometry
//   kProjectThreads = 256 (8 warps); a block serves kVRows = 32 rows of wv_b[h] (4 a warp) for
//   kMRows = 16 latent rows of head h; lane l owns the columns 4 l + 128 j, j = 0..3 (an
//   8-byte load of wv_b, a conflict-free float4 of the staged latent). sandbox/registry.py
//   passes its block size and kVRows, kMRows; the kernel static_asserts them.
//
// Launch: grid = (H, ceil(v_head / kVRows), ceil(M / kMRows)), block = kProjectThreads,
// no dynamic shared memory (the staged latent is 32 KB of static shared memory).
// latent [M][H][512] f32, out [M][H][v_head] f32: row m of head h is m * H + h. Batch 1 has
// M = 1 (latent [H][512]); a paged batch M = B * s_q (latent [B][s_q][H][512]).
// Each block reads its 32 x 512 slice of wv_b[h] once for its 16 rows, so wv_b is read
// ceil(M / 16) times in all (from L2 after the first), where a projection per row would read
// it M times.
//
// Programmatic dependent launch: a block loads its wv_b slice into registers, then waits
// (mla::pdl_wait) for the kernel before it (the merge, or an attention kernel that wrote the
// latent itself) before it reads the latent. Launched behind that kernel with programmatic
// stream serialization, the wv_b loads overlap its tail.
#include "mla_common.cuh"

namespace mla {

constexpr int kProjectThreads = 256;
constexpr int kVRows = 32;
constexpr int kMRows = 16;
constexpr int kProjectWarps = kProjectThreads / 32;
constexpr int kVPerWarp = kVRows / kProjectWarps;  // 4
constexpr int kColSteps = MLA_KV_LORA / 128;       // 4 float4s of columns per lane
constexpr int kStage = kMRows * (MLA_KV_LORA / 4) / kProjectThreads;  // 8 float4s a thread
static_assert(kVRows % kProjectWarps == 0, "whole wv_b rows per warp");
static_assert(MLA_KV_LORA % 128 == 0, "a warp covers 128 columns a step");
static_assert(kMRows * (MLA_KV_LORA / 4) % kProjectThreads == 0, "whole staging steps");

template <typename WvT>
__global__ void __launch_bounds__(kProjectThreads)
project(const float* __restrict__ latent, const WvT* __restrict__ wv_b, int n_head, int m_rows,
        int v_head, float* __restrict__ out) {
#ifdef MLA_REGISTRY_FACTS
    static_assert(MLA_PROJECT_THREADS == kProjectThreads,
                  "registry.PROJECT_THREADS differs from kProjectThreads");
    static_assert(MLA_PROJECT_V_ROWS == kVRows, "registry.PROJECT_V_ROWS differs from kVRows");
    static_assert(MLA_PROJECT_M_ROWS == kMRows, "registry.PROJECT_M_ROWS differs from kMRows");
#endif
    __shared__ __align__(16) float lat_s[kMRows][MLA_KV_LORA];
    const int h = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int v0 = blockIdx.y * kVRows + warp * kVPerWarp, m0 = blockIdx.z * kMRows;

    // wv_b first: it is a weight, written by no kernel of the step.
    uint2 raw[kVPerWarp][kColSteps];
#pragma unroll
    for (int r = 0; r < kVPerWarp; ++r) {
        const int v = v0 + r;
        const WvT* row = wv_b + (static_cast<size_t>(h) * v_head + min(v, v_head - 1)) *
                                    MLA_KV_LORA + 4 * lane;
#pragma unroll
        for (int j = 0; j < kColSteps; ++j)
            raw[r][j] = *reinterpret_cast<const uint2*>(row + 128 * j);
    }

    pdl_wait();  // the latent is the previous kernel's

    // Stage the block's latent rows, kStage / 2 loads a thread in flight at a time (all of
    // them at once would hold 32 more registers beside the packed wv_b).
    const int rows = min(kMRows, m_rows - m0);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        float4 stage[kStage / 2];
#pragma unroll
        for (int s = 0; s < kStage / 2; ++s) {
            const int k = tid + (half * (kStage / 2) + s) * kProjectThreads;
            const int mr = k / (MLA_KV_LORA / 4), c4 = k % (MLA_KV_LORA / 4);
            const float* src = latent + (static_cast<size_t>(m0 + mr) * n_head + h) * MLA_KV_LORA;
            if (mr < rows) stage[s] = *reinterpret_cast<const float4*>(src + 4 * c4);
        }
#pragma unroll
        for (int s = 0; s < kStage / 2; ++s) {
            const int k = tid + (half * (kStage / 2) + s) * kProjectThreads;
            const int mr = k / (MLA_KV_LORA / 4), c4 = k % (MLA_KV_LORA / 4);
            if (mr < rows) *reinterpret_cast<float4*>(&lat_s[mr][4 * c4]) = stage[s];
        }
    }
    __syncthreads();

    // One wv_b row at a time, widened once and dotted with every staged latent row: its
    // packed loads stay 32 registers, the widened row 16.
#pragma unroll
    for (int r = 0; r < kVPerWarp; ++r) {
        float w[4 * kColSteps];
#pragma unroll
        for (int j = 0; j < kColSteps; ++j) {
            const float2 a = pair_to_f32<WvT>(raw[r][j].x), b = pair_to_f32<WvT>(raw[r][j].y);
            w[4 * j] = a.x; w[4 * j + 1] = a.y; w[4 * j + 2] = b.x; w[4 * j + 3] = b.y;
        }
        const int v = v0 + r;
        for (int mr = 0; mr < rows; ++mr) {
            float s = 0.f;
#pragma unroll
            for (int j = 0; j < kColSteps; ++j) {
                const float4 x = *reinterpret_cast<const float4*>(&lat_s[mr][128 * j + 4 * lane]);
                s = fmaf(w[4 * j], x.x, s);
                s = fmaf(w[4 * j + 1], x.y, s);
                s = fmaf(w[4 * j + 2], x.z, s);
                s = fmaf(w[4 * j + 3], x.w, s);
            }
            s = warp_sum(s);
            if (lane == (mr & 31) && v < v_head)
                out[(static_cast<size_t>(m0 + mr) * n_head + h) * v_head + v] = s;
        }
    }
}

}  // namespace mla
