// mla_common.cuh: helpers shared by the mlasandbox kernel families.
//
// Conversions from the cache element types to f32, 16-byte cp.async with zero fill, and
// warp reductions. Nothing here depends on the MLA dims.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

// NVRTC compiles without the C library headers that define INFINITY.
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

namespace mla {

// ---- element conversions -------------------------------------------------------------
__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

// Two packed 16-bit elements (one 32-bit word) to two floats.
template <typename T> __device__ __forceinline__ float2 pair_to_f32(unsigned int w);
template <> __device__ __forceinline__ float2 pair_to_f32<__half>(unsigned int w) {
    __half2 h = *reinterpret_cast<__half2*>(&w);
    return __half22float2(h);
}
template <> __device__ __forceinline__ float2 pair_to_f32<__nv_bfloat16>(unsigned int w) {
    // bf16 is the top half of an f32: two integer ops, no float pipe.
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}

// ---- cp.async (sm_80+) -----------------------------------------------------------------
// Copies 16 bytes, or zero-fills the destination when `valid` is false (src-size 0): rows
// past the end of a slice become zeros in shared memory and are never read from global,
// so a NaN-filled cache past n_ctx cannot leak into a product.
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, bool valid) {
    unsigned int dst = static_cast<unsigned int>(__cvta_generic_to_shared(smem_dst));
    int src_bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src),
                 "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// ---- warp reductions -------------------------------------------------------------------
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// One online-softmax step of head h for one tile (one lane calls it): rescale the running sum
// to the new max and add the tile's sum. alpha = 2^(m_old - m_new) also rescales the value
// accumulators; m_old = -inf on the first tile gives alpha = 0, never NaN (m_new is finite:
// every tile holds at least one valid row).
__device__ __forceinline__ void online_softmax_step(float* m_s, float* l_s, float* alpha_s, int h,
                                                    float m_old, float m_new, float p_sum) {
    const float alpha = exp2f(m_old - m_new);
    alpha_s[h] = alpha;
    l_s[h] = l_s[h] * alpha + p_sum;
    m_s[h] = m_new;
}

// The lazy running max (mla_attn_tiled.cu, mla_mma.cu): a head's reference max moves only when
// a tile's max exceeds it by more than this many log2 units, so p = 2^(s - m) <= 2^8 and the
// value accumulators are rescaled only on the tiles where some head's max moved (alpha is
// exactly 1 for the others). A huge value (-DMLA_LAZY_LOG2=1e30f) never moves the max after
// the first tile: the GPU tests' negative control, which rising scores overflow.
#ifndef MLA_LAZY_LOG2
#define MLA_LAZY_LOG2 8.f
#endif
constexpr float kLazyLog2 = MLA_LAZY_LOG2;

// A kernel that needs `need` bytes of dynamic shared memory traps when launched with less,
// so a launcher whose smem formula drifted from the kernel fails loudly, not wrongly.
__device__ __forceinline__ void require_dynamic_smem(unsigned int need) {
    unsigned int have;
    asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(have));
    if (have < need) __trap();
}

}  // namespace mla
