"""Ceilings measured on the same device, in the same run as the bench (never a spec sheet).

* **Copy bandwidth**: a device-to-device cudaMemcpyAsync of `copy_bytes` (default 1 GiB, far
  past any L2), counting the bytes read plus the bytes written (2 x size per copy). This is
  what a streaming kernel can reach on this box today: the denominator of "% of copy".
* **Matrix throughput**: a large cuBLAS f16 GEMM through cupy.matmul (default 8192^3, f32
  accumulate, tensor cores), 2 n^3 FLOPs per call, on random data: zeros would let the
  hardware's power management run the tensor cores faster than real data allows.

Both are timed with `timing.time_gpu` (events, warm-up, median). The attention variants of
this sandbox run on CUDA cores, so their fraction of the GEMM ceiling is expected to be small:
it says how far a tensor-core kernel (the `mma` variant of DESIGN.md) could go.
"""
from __future__ import annotations

__all__ = ["copy_bandwidth", "gemm_throughput", "measure_ceilings", "DEFAULT_COPY_BYTES",
           "DEFAULT_GEMM_N"]

DEFAULT_COPY_BYTES = 1 << 30
DEFAULT_GEMM_N = 8192


def copy_bandwidth(copy_bytes: int = DEFAULT_COPY_BYTES, *, stream=None, **timing_kw) -> dict:
    """{'copy_GBps', 'copy_bytes', 'timing'}: (read + written) bytes over the median time."""
    import cupy
    from cupy.cuda import runtime

    from .timing import time_gpu

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

    from .timing import time_gpu

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


def measure_ceilings(copy_bytes: int = DEFAULT_COPY_BYTES, gemm_n: int = DEFAULT_GEMM_N, *,
                     stream=None, **timing_kw) -> dict:
    """Both ceilings; the big buffers are freed before returning."""
    import cupy

    out = {}
    out.update(copy_bandwidth(copy_bytes, stream=stream, **timing_kw))
    copy_timing = out.pop("timing")
    out.update(gemm_throughput(gemm_n, stream=stream, **timing_kw))
    out["timings"] = {"copy": copy_timing, "gemm": out.pop("timing")}
    cupy.get_default_memory_pool().free_all_blocks()
    return out
