// ceiling_fma.cu: the f32 FMA ceiling the bench measures next to copy and GEMM (ceilings.py).
//
// Template parameters: none. Fixed: kChains independent FMA chains per thread, kPerIter FMAs
// per chain per loop iteration. kChains = 8 covers the FMA latency (4 cycles) with two warps
// per scheduler; the launch (ceilings.py) puts far more warps than that on every SM.
// a and b are kernel arguments, so nothing folds at compile time; |a| < 1 keeps x bounded.
// The CUDA-core attention kernels (per_head, split, batched, tiled) issue FFMA for almost all
// of their arithmetic: this is their arithmetic roof, measured, not taken from a datasheet.

constexpr int kChains = 8;
constexpr int kPerIter = 16;

extern "C" __global__ void fma_ceiling(float* __restrict__ out, int iters, float a, float b) {
    float x[kChains];
#pragma unroll
    for (int i = 0; i < kChains; ++i) x[i] = threadIdx.x * 1e-3f + i;
    for (int it = 0; it < iters; ++it) {
#pragma unroll
        for (int k = 0; k < kPerIter; ++k)
#pragma unroll
            for (int i = 0; i < kChains; ++i) x[i] = fmaf(x[i], a, b);
    }
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < kChains; ++i) s += x[i];
    if (s == 1234.5f) out[0] = s;  // keeps the chains live; never true for these a, b
}
