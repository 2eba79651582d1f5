// mla_q_absorb.cu: the absorbed query, q[h] = (q_nope[h] @ wk_b[h]) || q_rope[h].
//
// No attention variant touches this phase, so the bench reports it before and after every
// comparison as the CONTROL phase: if it moves more than the noise floor, the harness moved,
// not the kernel.
//
// Template parameters
//   InT  q_nope, q_rope and wk_b element: __half or __nv_bfloat16
//   QT   q element written: float, or InT
// Fixed geometry
//   kAbsorbThreads = 256, kNope = 128 (q_nope width), MLA_KV_LORA = 512, MLA_ROPE = 64;
//   kAbsorbColBlocks = 8 blocks per head, each kAbsorbCols = 64 latent columns.
//   sandbox/registry.py passes its block size and column blocks; the kernel static_asserts
//   them.
//
// Launch: grid = (H, kAbsorbColBlocks), block = kAbsorbThreads. Block (h, cb) reads the
// 128 x 64 slice wk_b[h][:, 64 cb .. 64 cb + 63] (16 KB at 16 bits): thread t loads 8
// columns (16 bytes) of rows k = t / 8 + 32 j, j = 0..3, so the block's 1024 loads are all in
// flight at once and a row's 128 bytes are read by 8 neighbouring threads. The 32 row
// groups' partial sums are added in shared memory in a fixed order (deterministic). 8 blocks
// a head fill the GPU from 16 heads up (128 blocks at 16 heads; 1024 at 128, one wave at 8
// blocks an SM), so the phase runs at the bandwidth of its weights (2 MB at 16 heads, 16.8 MB
// at 128) instead of one block per head reading its 128 KB alone. Block (h, 0) also copies
// q_rope[h].
#include "mla_common.cuh"

namespace mla {

constexpr int kAbsorbThreads = 256;
constexpr int kNope = 128;
constexpr int kAbsorbLora = MLA_KV_LORA;
constexpr int kAbsorbRope = MLA_ROPE;
constexpr int kAbsorbColBlocks = 8;
constexpr int kAbsorbCols = kAbsorbLora / kAbsorbColBlocks;  // 64
constexpr int kColThreads = kAbsorbCols / 8;                 // 8 threads of 8 columns a row
constexpr int kRowGroups = kAbsorbThreads / kColThreads;     // 32
constexpr int kRowsPerThread = kNope / kRowGroups;           // 4
constexpr int kParts = kAbsorbThreads / kAbsorbCols;         // 4: the reduction's middle step
static_assert(kAbsorbCols % 8 == 0 && kNope % kRowGroups == 0, "whole 16-byte loads");
static_assert(kAbsorbRope <= kAbsorbThreads, "one rope element per thread");
static_assert(kRowGroups % kParts == 0, "the reduction: kParts parts of whole row groups");

template <typename InT, typename QT>
__global__ void __launch_bounds__(kAbsorbThreads)
q_absorb(const InT* __restrict__ q_nope, const InT* __restrict__ q_rope,
         const InT* __restrict__ wk_b, int n_head, QT* __restrict__ q) {
#ifdef MLA_REGISTRY_FACTS
    static_assert(MLA_Q_ABSORB_THREADS == kAbsorbThreads,
                  "registry.Q_ABSORB_THREADS differs from kAbsorbThreads");
    static_assert(MLA_Q_ABSORB_COL_BLOCKS == kAbsorbColBlocks,
                  "registry.Q_ABSORB_COL_BLOCKS differs from kAbsorbColBlocks");
#endif
    // The attention kernel after it may start now (api.DecodeStep.run_attn(after_q_absorb=
    // True)): it reads only the cache until its pdl_wait, which waits for all of this grid.
    pdl_launch_dependents();
    __shared__ __align__(16) float part[kRowGroups][kAbsorbCols];
    __shared__ float part_p[kParts][kAbsorbCols];
    const int h = blockIdx.x, cb = blockIdx.y, tid = threadIdx.x;
    const int group = tid / kColThreads, c8 = tid % kColThreads;  // columns 8 c8 .. 8 c8 + 7

    const InT* w = wk_b + static_cast<size_t>(h) * kNope * kAbsorbLora + cb * kAbsorbCols + 8 * c8;
    uint4 raw[kRowsPerThread];
    float x[kRowsPerThread];
#pragma unroll
    for (int j = 0; j < kRowsPerThread; ++j) {
        const int k = group + j * kRowGroups;
        raw[j] = *reinterpret_cast<const uint4*>(w + static_cast<size_t>(k) * kAbsorbLora);
        x[j] = to_f32(q_nope[static_cast<size_t>(h) * kNope + k]);
    }
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int j = 0; j < kRowsPerThread; ++j) {
        float a[8];
        unpack_f32<InT>(raw[j], a);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] = fmaf(x[j], a[e], acc[e]);
    }
    float4* mine = reinterpret_cast<float4*>(&part[group][8 * c8]);
    mine[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    mine[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
    __syncthreads();
    // 32 row groups -> kParts parts (thread (p, c) adds groups p G .. p G + G - 1 of column c,
    // G = 8) -> 1, each in a fixed order.
    {
        constexpr int kG = kRowGroups / kParts;
        const int c = tid % kAbsorbCols, p = tid / kAbsorbCols;
        float s = 0.f;
#pragma unroll
        for (int g = 0; g < kG; ++g) s += part[p * kG + g][c];
        part_p[p][c] = s;
    }
    __syncthreads();
    QT* dst = q + static_cast<size_t>(h) * (kAbsorbLora + kAbsorbRope);
    if (tid < kAbsorbCols) {
        float s = 0.f;
#pragma unroll
        for (int p = 0; p < kParts; ++p) s += part_p[p][tid];
        dst[cb * kAbsorbCols + tid] = from_f32<QT>(s);
    }
    if (cb == 0 && tid < kAbsorbRope) {
        const InT r = q_rope[static_cast<size_t>(h) * kAbsorbRope + tid];
        dst[kAbsorbLora + tid] = from_f32<QT>(to_f32(r));
    }
}

}  // namespace mla
