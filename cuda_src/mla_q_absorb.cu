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
//   kThreads = 128, kNope = 128 (q_nope width), MLA_KV_LORA = 512, MLA_ROPE = 64;
//   sandbox/registry.py passes its own block size, which the kernel static_asserts.
//
// Launch: grid = H, block = kThreads. Thread t owns q[h, 4t .. 4t+3]; the rows of wk_b[h]
// are read whole by the block, so the loads are coalesced.
#include "mla_common.cuh"

namespace mla {

constexpr int kAbsorbThreads = 128;
constexpr int kNope = 128;
constexpr int kAbsorbLora = MLA_KV_LORA;
constexpr int kAbsorbRope = MLA_ROPE;
static_assert(kAbsorbLora == 4 * kAbsorbThreads, "each thread owns four latent columns");
static_assert(kAbsorbRope <= kAbsorbThreads && kNope <= kAbsorbThreads, "one element per thread");

template <typename InT, typename QT>
__global__ void __launch_bounds__(kAbsorbThreads)
q_absorb(const InT* __restrict__ q_nope, const InT* __restrict__ q_rope,
         const InT* __restrict__ wk_b, int n_head, QT* __restrict__ q) {
#ifdef MLA_REGISTRY_FACTS
    static_assert(MLA_Q_ABSORB_THREADS == kAbsorbThreads,
                  "registry.Q_ABSORB_THREADS differs from kAbsorbThreads");
#endif
    __shared__ float qn[kNope];
    const int h = blockIdx.x, tid = threadIdx.x;
    if (tid < kNope) qn[tid] = to_f32(q_nope[static_cast<size_t>(h) * kNope + tid]);
    __syncthreads();

    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    const InT* w = wk_b + static_cast<size_t>(h) * kNope * kAbsorbLora + 4 * tid;
#pragma unroll 8
    for (int i = 0; i < kNope; ++i) {
        const uint2 raw = *reinterpret_cast<const uint2*>(w + static_cast<size_t>(i) * kAbsorbLora);
        const float2 a = pair_to_f32<InT>(raw.x), b = pair_to_f32<InT>(raw.y);
        const float x = qn[i];
        acc[0] = fmaf(x, a.x, acc[0]);
        acc[1] = fmaf(x, a.y, acc[1]);
        acc[2] = fmaf(x, b.x, acc[2]);
        acc[3] = fmaf(x, b.y, acc[3]);
    }
    QT* dst = q + static_cast<size_t>(h) * (kAbsorbLora + kAbsorbRope);
#pragma unroll
    for (int e = 0; e < 4; ++e) dst[4 * tid + e] = from_f32<QT>(acc[e]);
    if (tid < kAbsorbRope)
        dst[kAbsorbLora + tid] = from_f32<QT>(to_f32(q_rope[static_cast<size_t>(h) * kAbsorbRope + tid]));
}

}  // namespace mla
