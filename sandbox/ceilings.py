"""Ceilings measured on the same device, in the same run as the bench (never a spec sheet).

* **Copy bandwidth**: a device-to-device cudaMemcpyAsync of `copy_bytes` (default 1 GiB, far
  past any L2), counting the bytes read plus the bytes written (2 x size per copy). This is
  what a streaming kernel can reach on this box today: the denominator of "% of copy".
* **Matrix throughput**: a large cuBLAS f16 GEMM through cupy.matmul (default 8192^3, f32
  accumulate, tensor cores), 2 n^3 FLOPs per call, on random data: zeros would let the
  hardware's power management run the tensor cores faster than real data allows.

* **f32 FMA throughput**: `cuda_src/ceiling_fma.cu`, independent FMA chains on every SM
  (2 FLOPs per FMA): the arithmetic roof of the CUDA-core variants, whose arithmetic is
  almost all FFMA. At the clock the GPU holds under that load, not the datasheet's boost.

All are timed with `timing.time_gpu` (events, warm-up, median). The attention variants of
this sandbox run on CUDA cores, so their fraction of the GEMM ceiling is expected to be small:
it says how far a tensor-core kernel (the `mma` variant of DESIGN.md) could go.
"""
from __future__ import annotations

import numpy as np

from .kernels import device_info
from .sources import read_source
from .timing import time_gpu

__all__ = ["copy_bandwidth", "gemm_throughput", "fma_throughput", "measure_ceilings",
           "DEFAULT_COPY_BYTES", "DEFAULT_GEMM_N", "FMA_BLOCKS_PER_SM", "FMA_THREADS"]

DEFAULT_COPY_BYTES = 1 << 30
DEFAULT_GEMM_N = 8192
FMA_THREADS = 256
FMA_BLOCKS_PER_SM = 8      # 64 warps: the SM's limit, so no scheduler waits on latency
FMA_ITERS = 4096           # x 16 x 8 FMAs per thread: about a millisecond on an H200
_FMA_CHAINS, _FMA_PER_ITER = 8, 16  # kChains, kPerIter of ceiling_fma.cu


def copy_bandwidth(copy_bytes: int = DEFAULT_COPY_BYTES, *, stream=None, **timing_kw) -> dict:
    """{'copy_GBps', 'copy_bytes', 'timing'}: (read + written) bytes over the median time."""
    import cupy
    from cupy.cuda import runtime


    n = int(copy_bytes)
    src = cupy.empty(n, cupy.uint8)
    dst = cupy.empty(n, cupy.uint8)
    src.fill(7)
    stream = stream or cupy.cuda.get_current_stream()

    def copy():
        runtime.memcpyAsync(dst.data.ptr, src.data.ptr, n, runtime.memcpyDeviceToDevice,
                            stream.ptr)

    t = time_gpu(copy, stream=stream, flush=None, **timing_kw)
    moved = 2 * n
    return {"copy_GBps": moved / (t.median_us * 1e-6) / 1e9,
            "copy_GBps_best": moved / (t.stats.min_us * 1e-6) / 1e9,
            "copy_bytes": n, "counted_bytes": moved, "timing": t.as_dict()}


def gemm_throughput(n: int = DEFAULT_GEMM_N, *, seed: int = 0, stream=None, **timing_kw) -> dict:
    """{'gemm_TFLOPs', 'gemm_n', 'timing'}: 2 n^3 over the median time of an f16 GEMM."""
    import cupy

    stream = stream or cupy.cuda.get_current_stream()
    with stream:
        rng = cupy.random.RandomState(seed)
        a = rng.standard_normal((n, n), dtype=cupy.float32).astype(cupy.float16)
        b = rng.standard_normal((n, n), dtype=cupy.float32).astype(cupy.float16)
        c = cupy.empty((n, n), cupy.float16)

    def gemm():
        cupy.matmul(a, b, out=c)

    t = time_gpu(gemm, stream=stream, flush=None, **timing_kw)
    flops = 2 * n ** 3
    return {"gemm_TFLOPs": flops / (t.median_us * 1e-6) / 1e12,
            "gemm_TFLOPs_best": flops / (t.stats.min_us * 1e-6) / 1e12,
            "gemm_n": n, "dtype": "f16 in, f32 accumulate (cupy.matmul -> cuBLAS)",
            "timing": t.as_dict()}


def fma_throughput(iters: int = FMA_ITERS, *, stream=None, **timing_kw) -> dict:
    """{'fma_TFLOPs', 'timing'}: 2 FLOPs per FMA over the median time of ceiling_fma.cu."""
    import cupy

    stream = stream or cupy.cuda.get_current_stream()
    kernel = cupy.RawModule(code=read_source("ceiling_fma.cu")).get_function("fma_ceiling")
    blocks = device_info().num_sms * FMA_BLOCKS_PER_SM
    out = cupy.zeros(1, cupy.float32)
    args = (out, np.int32(iters), np.float32(0.999), np.float32(1e-3))

    def run():
        with stream:
            kernel((blocks,), (FMA_THREADS,), args)

    t = time_gpu(run, stream=stream, flush=None, **timing_kw)
    flops = 2 * blocks * FMA_THREADS * iters * _FMA_CHAINS * _FMA_PER_ITER
    return {"fma_TFLOPs": flops / (t.median_us * 1e-6) / 1e12,
            "fma_TFLOPs_best": flops / (t.stats.min_us * 1e-6) / 1e12,
            "fma_blocks": blocks, "fma_flops": flops, "timing": t.as_dict()}


def measure_ceilings(copy_bytes: int = DEFAULT_COPY_BYTES, gemm_n: int = DEFAULT_GEMM_N, *,
                     stream=None, **timing_kw) -> dict:
    """All three ceilings; the big buffers are freed before returning."""
    import cupy

    out = {}
    out.update(copy_bandwidth(copy_bytes, stream=stream, **timing_kw))
    copy_timing = out.pop("timing")
    out.update(gemm_throughput(gemm_n, stream=stream, **timing_kw))
    gemm_timing = out.pop("timing")
    out.update(fma_throughput(stream=stream, **timing_kw))
    out["timings"] = {"copy": copy_timing, "gemm": gemm_timing, "fma": out.pop("timing")}
    cupy.get_default_memory_pool().free_all_blocks()
    return out
