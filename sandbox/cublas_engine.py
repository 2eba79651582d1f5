"""The reference engine: the decode step as a user would write it with CuPy and cuBLAS.

    s      = scale * q . cache[:n_ctx]^T  cuBLAS GEMM, 16-bit operands, f32 accumulate and out
    p      = softmax(s)                   CuPy max and sum (CUB), exp(s - m) in place, and one
                                          e / l pass that writes p in 16 bits
    latent = p . cache[:n_ctx, :512]      cuBLAS GEMM, p rounded to the cache dtype
    out    = wv_b @ latent                batched cuBLAS GEMV, latent rounded to the cache dtype

The scale rides on the first GEMM's alpha, and the softmax moves 28 bytes per score element
in all (metrics.CUBLAS_SCORE_PASSES). Written as CuPy one-liners (scale, subtract, exp, sum,
divide, cast) it moved 52, and the engine took twice torch eager's time at 128 heads.

Tensor-core GEMMs take both operands in one 16-bit dtype, so q (when f32), p and latent are
rounded to the cache dtype on the way in: this engine's error is that rounding (about 2^-11
relative for f16, 2^-8 for bf16), which is why its tolerance is looser than the CUDA
variants', which keep q and p in f32.
"""
from __future__ import annotations

import numpy as np

from .bf16 import bf16_bits_to_f32, f32_to_bf16_bits

__all__ = ["cublas_attention", "cublas_projection", "cublas_paged_attention",
           "CUBLAS_TOLERANCE"]

# The engine's check bound for out, latent and lse, by cache dtype: the rounding of q, p and
# latent above, about 6 units of f16 and 5 of bf16 in their last place (docs/numerics.md;
# tests/test_gpu_kernels.py). The bench and the repro scripts both take it from here.
CUBLAS_TOLERANCE = {"f16": 3e-3, "bf16": 2e-2}

_CUDA_R_16F, _CUDA_R_32F, _CUDA_R_16BF = 2, 0, 14   # cudaDataType_t
_COMPUTE_32F = 68                                   # cublasComputeType_t CUBLAS_COMPUTE_32F
_OP_N, _OP_T = 0, 1


def _gemm(transa, transb, m, n, k, a, a_type, lda, b, b_type, ldb, c, ldc, alpha=1.0):
    """Column-major C[m,n] (f32) = alpha op(A) op(B), f32 compute, via cublasGemmEx."""
    import cupy
    from cupy_backends.cuda.libs import cublas

    handle = cupy.cuda.device.get_cublas_handle()
    # CuPy's handle keeps whatever stream its last user set: put this GEMM on the current one,
    # where the engine's other passes run.
    cublas.setStream(handle, cupy.cuda.get_current_stream().ptr)
    one, zero = np.array(alpha, np.float32), np.array(0.0, np.float32)
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


_SOFTMAX_KERNELS = {}


def _softmax_kernels():
    """The softmax's elementwise passes, built once per process (CuPy caches the compiles on
    disk): exp_shift: e = exp(e - m) in place over the scores; f16 / bf16: p = e / l in 16
    bits, bf16 rounded to nearest even (the quiet NaN for NaN) like f32_to_bf16_bits. The
    row sums stay CuPy's own `sum`, which runs on CUB: a ReductionKernel over 131072-long
    rows gets one block per row from CuPy's generic reduction and took 5.7 ms at 96 heads."""
    import cupy

    if not _SOFTMAX_KERNELS:
        _SOFTMAX_KERNELS["exp_shift"] = cupy.ElementwiseKernel(
            "float32 m", "float32 e", "e = exp(e - m)", "mla_engine_exp_shift")
        _SOFTMAX_KERNELS["f16"] = cupy.ElementwiseKernel(
            "float32 e, float32 l", "float16 p", "p = (float16)(e / l)", "mla_engine_p_f16")
        _SOFTMAX_KERNELS["bf16"] = cupy.ElementwiseKernel(
            "float32 e, float32 l", "uint16 p",
            """
            const unsigned int b = __float_as_uint(e / l);
            p = ((b & 0x7fffffffu) > 0x7f800000u)
                    ? (unsigned short)(((b >> 16) & 0x8000u) | 0x7fc0u)
                    : (unsigned short)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
            """, "mla_engine_p_bf16")
    return _SOFTMAX_KERNELS


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
          key_dim, scores, n_ctx, alpha=scale)
    kernels = _softmax_kernels()
    m = scores.max(axis=1, keepdims=True)
    kernels["exp_shift"](m, scores)          # scores now hold exp(s - m)
    l = scores.sum(axis=1, keepdims=True)
    lse[...] = (m + cupy.log(l)).ravel()
    p16 = kernels[cache_dtype](scores, l)
    # latent[H, 512] = p[H, n] cache[n, :512]  <=>  column-major latent^T = cache_lora^T p^T
    _gemm(_OP_N, _OP_N, kv_lora, n_head, n_ctx, cache, dtype_code, key_dim, p16, dtype_code,
          n_ctx, latent, kv_lora)


def cublas_projection(wv_b, latent, cache_dtype: str, out) -> None:
    """The combine phase: out[..., h, :] = wv_b[h] @ latent[..., h, :] (batched cuBLAS), into
    `out` (f32). latent [H, kv_lora], or [..., H, kv_lora] for a batch of query rows."""
    import cupy

    lat16 = _to_cache_dtype(latent, cache_dtype)
    if cache_dtype == "f16":
        out[...] = cupy.matmul(wv_b, lat16[..., None])[..., 0]
    else:  # CuPy has no bf16 matmul: widen (the reference engine is not the fast path)
        out[...] = cupy.matmul(bf16_bits_to_f32(wv_b), bf16_bits_to_f32(lat16)[..., None])[..., 0]


def cublas_paged_attention(q, kv_cache, table, pages, visible, scale: float,
                           cache_dtype: str, latent, lse) -> None:
    """The attn phase of a paged step, request by request, from host copies of the block
    `table` [B, max_pages], each request's page count `pages` [B] and what each query sees,
    `visible` [B, s_q] (the caller checks them first): the request's pages gathered into
    one contiguous run of rows, then `cublas_attention` over its (query token x head) rows,
    query by query where their visible lengths differ (causal). q [B, s_q, H, K], kv_cache
    [num_pages, page_size, K]; rows that see nothing get latent 0, lse -inf.

    The GEMMs are sized by the lengths, which is why they are read to the host: the engine
    cannot be captured in a CUDA graph."""
    import cupy

    s_q, key_dim, kv_lora = q.shape[1], q.shape[-1], latent.shape[-1]
    latent.fill(0)
    lse.fill(-np.inf)
    for b in range(q.shape[0]):
        vis = visible[b]
        if vis.max() == 0:
            continue
        ids = cupy.asarray(table[b, :pages[b]].astype(np.int64))
        rows = kv_cache[ids].reshape(-1, key_dim)[:vis.max()]
        same = bool((vis == vis[0]).all())
        for i0, i1 in [(0, s_q)] if same else [(i, i + 1) for i in range(s_q)]:
            if vis[i0] == 0:
                continue
            cublas_attention(q[b, i0:i1].reshape(-1, key_dim), rows, int(vis[i0]), scale,
                             cache_dtype, latent[b, i0:i1].reshape(-1, kv_lora),
                             lse[b, i0:i1].reshape(-1))
