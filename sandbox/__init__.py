"""mlasandbox: a CuPy kernel sandbox for MLA (multi-head latent attention) decode.

    import mlasandbox as mla
    res = mla.decode(q, cache, wv_b, variant="batched12")      # CuPy arrays in
    ref = mla.reference.decode(q_np, cache_np, wv_b_np)          # NumPy float64
    res = mla.decode_paged(q, kv_cache, block_table, cache_seqlens, wv_b)  # a serving batch
    ref = mla.reference.decode_paged(q_np, kv_np, table_np, lengths_np, wv_b_np)
    res = mla.tp_decode(q_np, kv_np, table_np, lengths_np, wv_b_np, w_o_np, tp=8)  # 8 GPUs
    v = mla.load_kernel("my.cu")                                   # a user kernel as a variant

Importing the package needs neither a GPU nor CuPy; the CUDA paths import CuPy lazily.
"""
from . import dims, registry, splits  # noqa: F401
from .dims import PRESETS, Dims, preset  # noqa: F401

__version__ = "0.1.0"


def __getattr__(name):
    # reference, schedule, etc. load on first use so `import mlasandbox` stays light
    import importlib

    if name in ("reference", "schedule", "occupancy", "compare", "inputs", "bf16", "ptxas",
                "toolkit", "kernels", "guard", "api", "bench", "sweep", "sweep_paged", "repro",
                "timing", "paged", "paged_api", "interop", "chunks", "paged_inputs",
                "compare_paged", "tp", "tp_comm", "tp_rank", "tp_launch", "tp_bench",
                "user_kernel", "battery"):
        return importlib.import_module(f".{name}", __name__)
    if name in ("decode", "DecodeStep", "DecodeResult", "q_absorb"):
        from . import api

        return getattr(api, name)
    if name == "load_kernel":   # a user kernel file as a variant (user_kernel.py)
        from .user_kernel import load_kernel

        return load_kernel
    if name in ("decode_paged", "PagedDecodeStep", "PagedResult"):
        from . import paged_api

        return getattr(paged_api, name)
    if name in ("tp_decode", "TensorParallelStep"):
        from . import tp_launch, tp_rank

        return getattr(tp_launch if name == "tp_decode" else tp_rank, name)
    raise AttributeError(f"module 'mlasandbox' has no attribute {name!r}")
