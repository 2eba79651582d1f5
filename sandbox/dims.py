"""The dimensions of one MLA decode step, the presets, and input validation.

Every variant computes, for one layer at batch 1 (see DESIGN.md):

    s[h,t]    = scale * q[h] . cache[t]                 t < n_ctx
    lse[h]    = log sum_t exp(s[h,t])
    latent[h] = sum_t exp(s[h,t] - lse[h]) * cache[t, :kv_lora]
    out[h]    = wv_b[h] @ latent[h]                      -> [H, v_head], f32

Validation lives here, in one place, so that the NumPy reference, the CUDA launchers
and the CLI reject the same bad inputs with the same words, before any launch.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace

import numpy as np

from .limits import check_problem, check_scale

__all__ = ["Dims", "PRESETS", "preset", "DTYPES", "dtype_name", "check_inputs"]


@dataclass(frozen=True)
class Dims:
    """Head and latent sizes. `key_dim` = kv_lora + rope is the cache row (576)."""

    n_head: int = 96
    kv_lora: int = 512
    rope: int = 64
    v_head: int = 128
    nope: int = 128  # q_nope width, the input of q_absorb (q_nope[h] @ wk_b[h])

    def __post_init__(self):
        # whole numbers (NumPy's too, stored as int), never bools, text or fractions; every
        # width at least 1 but rope, which may be 0; heads within the kernels' int32 limit
        for name, low in (("n_head", 1), ("kv_lora", 1), ("rope", 0), ("v_head", 1),
                          ("nope", 1)):
            value = getattr(self, name)
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
                raise TypeError(f"Dims.{name} must be an integer, got {value!r}")
            if value < low:
                raise ValueError(f"Dims.{name} must be >= {low}, got {value}")
            object.__setattr__(self, name, int(value))
        check_problem(n_head=self.n_head, names={"n_head": "Dims.n_head"})

    @property
    def key_dim(self) -> int:
        return self.kv_lora + self.rope

    @property
    def default_scale(self) -> float:
        # DeepSeek's softmax scale: 1/sqrt(qk_nope_head_dim + qk_rope_head_dim).
        return 1.0 / math.sqrt(self.nope + self.rope)

    def with_heads(self, n_head: int) -> "Dims":
        return replace(self, n_head=n_head)


# 96 heads, DeepSeek-V3's 128, and per-rank shards of them under
# tensor parallelism (96/8 = 12, 128/8 = 16).
PRESETS = {
    "h96": Dims(n_head=96),
    "dsv3": Dims(n_head=128),
    "h96-tp8": Dims(n_head=12),
    "dsv3-tp8": Dims(n_head=16),
}


def preset(name: str) -> Dims:
    if not isinstance(name, str):
        raise TypeError(f"a preset is a name (str), one of {', '.join(PRESETS)}; got {name!r}")
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None


# Dtype names used across the project. bf16 travels as raw 16-bit words
# (`uint16` in CuPy, `ml_dtypes.bfloat16` or `uint16` in NumPy): see bf16.py.
DTYPES = ("f16", "bf16", "f32")


def dtype_name(arr, bf16_as_uint16: bool = True) -> str:
    """'f16' | 'bf16' | 'f32' for an array, or raise naming what was given."""
    dt = np.dtype(arr.dtype)
    if dt == np.float16:
        return "f16"
    if dt == np.float32:
        return "f32"
    if dt.name == "bfloat16" or (bf16_as_uint16 and dt == np.uint16):
        return "bf16"
    raise TypeError(
        f"dtype {dt} is not supported: use float16, float32, or bfloat16 "
        "(ml_dtypes.bfloat16, or uint16 holding bf16 bit patterns)"
    )


def _check_array(name: str, arr, ndim: int) -> None:
    """NumPy or CuPy arrays only: other array types (torch tensors) are named, not read."""
    mod = type(arr).__module__
    if mod.startswith("torch"):
        raise TypeError(
            f"{name} is a torch tensor ({type(arr).__name__}); pass a NumPy or CuPy array: a "
            "CUDA torch tensor converts without a copy with cupy.from_dlpack(tensor), a CPU "
            "one with tensor.numpy() (the functions do not take torch tensors yet)")
    if not (isinstance(arr, np.ndarray) or mod.startswith("cupy")):
        raise TypeError(f"{name} must be a NumPy or CuPy array, got {mod}.{type(arr).__name__}")
    if arr.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(arr.shape)}")


def _row_width(q_width: int, cache_width: int) -> int:
    """The row layout, kv_lora + rope: the cache's, unless q has the standard width and the
    cache does not (then the cache is the odd one out and is the one blamed)."""
    standard = Dims().key_dim
    if q_width != cache_width and q_width == standard:
        return q_width
    return cache_width


def check_inputs(q, cache, wv_b, n_ctx=None, scale=None, dims: Dims | None = None):
    """Validate one decode step's inputs; return (dims, n_ctx, scale, dtypes).

    Raises ValueError/TypeError naming the parameter and the limit. Works on NumPy
    and CuPy arrays alike (it reads only .shape, .dtype and .ndim).
    """
    for name, arr, nd in (("q", q, 2), ("cache", cache, 2), ("wv_b", wv_b, 3)):
        _check_array(name, arr, nd)
    n_head, key_dim = (int(x) for x in q.shape)
    n_alloc, cache_dim = (int(x) for x in cache.shape)
    if n_head < 1:
        raise ValueError(f"q must have at least one head, got shape {tuple(q.shape)}")
    if int(wv_b.shape[1]) < 1 or int(wv_b.shape[2]) < 1:
        raise ValueError(f"wv_b must be [n_head, v_head >= 1, kv_lora >= 1], got "
                         f"{tuple(wv_b.shape)}")
    if dims is None:
        # kv_lora and v_head come from wv_b, the rest of a row is rope.
        v_head, kv_lora = int(wv_b.shape[1]), int(wv_b.shape[2])
        if cache_dim < kv_lora:
            raise ValueError(f"cache rows ({cache_dim}) are shorter than wv_b's latent dim "
                             f"({kv_lora})")
        row = _row_width(key_dim, cache_dim)
        if row - kv_lora > kv_lora:
            hint = (f"; is it transposed? [n_head, v_head, kv_lora] would be "
                    f"{(int(wv_b.shape[0]), kv_lora, v_head)}" if row - v_head <= v_head
                    else "")
            raise ValueError(
                f"wv_b must be [n_head, v_head, kv_lora] with kv_lora the latent part of a "
                f"{row}-wide row (kv_lora >= rope); got {tuple(wv_b.shape)}, which leaves "
                f"rope = {row - kv_lora}{hint}")
        dims = Dims(n_head=n_head, kv_lora=kv_lora, rope=row - kv_lora, v_head=v_head)
    if dims.rope < 0:
        raise ValueError(
            f"cache rows ({cache_dim}) are shorter than wv_b's latent dim ({dims.kv_lora})"
        )
    if n_head != dims.n_head or key_dim != dims.key_dim:
        raise ValueError(
            f"q must be [n_head={dims.n_head}, kv_lora+rope={dims.key_dim}], "
            f"got {tuple(q.shape)}"
        )
    if cache_dim != dims.key_dim:
        raise ValueError(
            f"cache must be [N_alloc, kv_lora+rope={dims.key_dim}] (the width of q's rows), "
            f"got {tuple(cache.shape)}"
        )
    if tuple(int(x) for x in wv_b.shape) != (dims.n_head, dims.v_head, dims.kv_lora):
        raise ValueError(
            f"wv_b must be [n_head={dims.n_head}, v_head={dims.v_head}, "
            f"kv_lora={dims.kv_lora}], got {tuple(wv_b.shape)}"
        )
    if n_alloc < 1:
        raise ValueError("cache must hold at least one row (N_alloc >= 1)")
    if n_ctx is None:
        n_ctx = n_alloc
    if (isinstance(n_ctx, bool) or not isinstance(n_ctx, numbers.Real)
            or not math.isfinite(n_ctx) or int(n_ctx) != n_ctx):  # int() raises on nan, inf
        raise TypeError(f"n_ctx must be an integer, got {n_ctx!r}")
    n_ctx = int(n_ctx)
    if not 1 <= n_ctx <= n_alloc:
        raise ValueError(f"n_ctx must be in 1..N_alloc={n_alloc}, got {n_ctx}")
    check_problem(n_ctx=n_ctx, n_head=n_head)
    scale = dims.default_scale if scale is None else check_scale(scale)
    q_dt, cache_dt, wv_dt = dtype_name(q), dtype_name(cache), dtype_name(wv_b)
    if cache_dt == "f32":
        raise TypeError("cache must be float16 or bfloat16 (the f32 cache is not a contract dtype)")
    if q_dt not in ("f32", cache_dt):
        raise TypeError(f"q must be float32 or the cache dtype ({cache_dt}), got {q_dt}")
    if wv_dt != cache_dt:
        raise TypeError(f"wv_b must have the cache dtype ({cache_dt}), got {wv_dt}")
    return dims, n_ctx, scale, {"q": q_dt, "cache": cache_dt}
