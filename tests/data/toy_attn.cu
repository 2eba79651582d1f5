// A small stand-in for cuda_src/mla_attn.cu, used by tests/test_ptxas.py: templated on
// heads per block and the element types, with static shared memory and a barrier, so that
// the ptxas report has registers, smem and barriers to show. toy<64, ...> holds 64 running
// sums per thread, so under -maxrregcount=32 it must spill (no __launch_bounds__: it would
// take precedence over -maxrregcount).
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace mla {

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

template <int HPB, typename CacheT, typename QT>
__global__ void toy(const QT* __restrict__ q,
                    const CacheT* __restrict__ cache,
                    float* __restrict__ out, int n_ctx) {
  __shared__ float tile[128];
  float acc[HPB];
#pragma unroll
  for (int h = 0; h < HPB; ++h) acc[h] = 0.f;
  for (int t = threadIdx.x; t < n_ctx; t += blockDim.x) {
    tile[threadIdx.x] = to_f32(cache[t * MLA_KV_LORA + threadIdx.x]);
    __syncthreads();
#pragma unroll
    for (int h = 0; h < HPB; ++h)
      acc[h] = fmaf(to_f32(q[h * 128 + threadIdx.x]), tile[(threadIdx.x + h) & 127], acc[h] * 0.5f + acc[(h + 1) % HPB]);
    __syncthreads();
  }
#pragma unroll
  for (int h = 0; h < HPB; ++h) out[h * blockDim.x + threadIdx.x] = acc[h];
}

extern "C" __global__ void toy_plain(float* y) { y[threadIdx.x] = 1.f; }

}  // namespace mla
