// Kernels whose machine code differs by a known amount, used by tests/test_ptxas.py to check
// the code size read from the cubin (no GPU needed).
//
// sleeps<K>: K nanosleep instructions, each with its own immediate, fully unrolled: volatile,
// so ptxas can neither merge nor drop them: sleeps<64> has 64 NANOSLEEP instructions (1,024
// bytes on sm_90) that sleeps<0> has not.
// chain<U>: the same loop over n, unrolled U times: more copies of its body, more code.

namespace toy {

template <int K>
__global__ void sleeps(int* flag) {
#pragma unroll
  for (int i = 0; i < K; ++i) __nanosleep(100 + i);
  flag[threadIdx.x] = K;
}

template <int U>
__global__ void chain(const float* __restrict__ x, float* __restrict__ y, int n) {
  float acc = 0.f;
#pragma unroll U
  for (int i = 0; i < n; ++i) acc = fmaf(acc, x[i * blockDim.x + threadIdx.x], 1.f);
  y[threadIdx.x] = acc;
}

}  // namespace toy
