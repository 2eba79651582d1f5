"""The reference engine: the decode step as a user would write it with CuPy and cuBLAS.

    s      = q . cache[:n_ctx]^T          cuBLAS GEMM, 16-bit operands, f32 accumulate and out
    p      = softmax(scale * s)           CuPy elementwise + reductions, f32
    latent = p . cache[:n_ctx, :512]      cuBLAS GEMM, p rounded to the cache dtype
    out    = wv_b @ latent                batched cuBLAS GEMV, latent rounded to the cache dtype

Tensor-core GEMMs take both operands in one 16-bit dtype, so q (when f32), p and latent are
rounded to the cache dtype on the way in: this engine's error is that rounding (about 2^-11
relative for f16, 2^-8 for bf16), which is why its tolerance is looser than the CUDA
variants', which keep q and p in f32.
"""
from __future__ import annotations

from .bf16 import bf16_bits_to_f32, f32_to_bf16_bits

__all__ = ["cublas_attention", "cublas_projection"]

_CUDA_R_16F, _CUDA_R_32F, _CUDA_R_16BF = 2, 0, 14   # cudaDataType_t
_COMPUTE_32F = 68                                   # cublasComputeType_t CUBLAS_COMPUTE_32F
_OP_N, _OP_T = 0, 1


def _gemm(transa, transb, m, n, k, a, a_type, lda, b, b_type, ldb, c, ldc):
    """Column-major C[m,n] (f32) = op(A) op(B), f32 compute, via cublasGemmEx."""
    import cupy
    import numpy as np
    from cupy_backends.cuda.libs import cublas

    handle = cupy.cuda.device.get_cublas_handle()
    one, zero = np.array(1.0, np.float32), np.array(0.0, np.float32)
    mode = cublas.getPointerMode(handle)
    cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
    try:
        cublas.gemmEx(handle, transa, transb, m, n, k, one.ctypes.data, a.data.ptr, a_type, lda,
                      b.data.ptr, b_type, ldb, zero.ctypes.data, c.data.ptr, _CUDA_R_32F, ldc,
                      _COMPUTE_32F, -1)  # CUBLAS_GEMM_DEFAULT
    finally:
        cublas.setPointerMode(handle, mode)


def _to_cache_dtype(x, cache_dtype):
    import cupy

    if cache_dtype == "f16":
        return x.astype(cupy.float16)
    return f32_to_bf16_bits(x.astype(cupy.float32, copy=False))


def cublas_attention(q, cache, n_ctx: int, scale: float, cache_dtype: str, latent, lse) -> None:
    """The attn phase: scores, softmax, latent (written into `latent` [H, kv_lora] and
    `lse` [H], both f32)."""
    import cupy

    n_head, key_dim = q.shape
    kv_lora = latent.shape[1]
    dtype_code = _CUDA_R_16F if cache_dtype == "f16" else _CUDA_R_16BF
    q16 = q if q.dtype == cache.dtype else _to_cache_dtype(q, cache_dtype)
    q16 = cupy.ascontiguousarray(q16)
    scores = cupy.empty((n_head, n_ctx), cupy.float32)
    # row-major scores[H, n] = q[H, K] cache[n, K]^T  <=>  column-major scores^T = cache q^T
    _gemm(_OP_T, _OP_N, n_ctx, n_head, key_dim, cache, dtype_code, key_dim, q16, dtype_code,
          key_dim, scores, n_ctx)
    scores *= scale
    m = scores.max(axis=1, keepdims=True)
    p = cupy.exp(scores - m)
    l = p.sum(axis=1, keepdims=True)
    p /= l
    lse[...] = (m + cupy.log(l)).ravel()
    p16 = _to_cache_dtype(p, cache_dtype)
    # latent[H, 512] = p[H, n] cache[n, :512]  <=>  column-major latent^T = cache_lora^T p^T
    _gemm(_OP_N, _OP_N, kv_lora, n_head, n_ctx, cache, dtype_code, key_dim, p16, dtype_code,
          n_ctx, latent, kv_lora)


def cublas_projection(wv_b, latent, cache_dtype: str, out) -> None:
    """The combine phase: out[h] = wv_b[h] @ latent[h] (batched cuBLAS), into `out` (f32)."""
    import cupy

    lat16 = _to_cache_dtype(latent, cache_dtype)
    if cache_dtype == "f16":
        out[...] = cupy.matmul(wv_b, lat16[:, :, None])[:, :, 0]
    else:  # CuPy has no bf16 matmul: widen (the reference engine is not the fast path)
        out[...] = cupy.matmul(bf16_bits_to_f32(wv_b), bf16_bits_to_f32(lat16)[:, :, None])[:, :, 0]
