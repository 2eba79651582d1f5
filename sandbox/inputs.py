"""Random inputs for one decode step, on the host (NumPy) or on the device (CuPy).

Every value is drawn in float32 and then rounded to its storage dtype, so the arrays the
kernels read are exactly representable in float64: the reference then sees the very same
numbers and any error is the kernel's own.

* ``q_nope [H, nope]``, ``q_rope [H, rope]``, ``wk_b [H, nope, kv_lora]`` are the inputs of the
  ``q_absorb`` phase (the control phase): ``q[h] = q_nope[h] @ wk_b[h] || q_rope[h]``.
* ``q [H, kv_lora + rope]`` IS that absorbed query, computed in float64 and rounded to the q
  dtype, so a ``q_absorb`` kernel can be checked against it and the attention phase can run
  on it directly. Its entries are ~N(0, 1): wk_b's 1/sqrt(nope) scale makes the dot product
  over `nope` unit normals unit-variance.
* ``cache [N_alloc, kv_lora + rope]`` ~ N(0, 1); rows ``>= n_ctx`` are NaN when `nan_fill`, so
  a kernel that reads past the context poisons its output instead of passing by luck (as in
  FlashMLA's tests).
* ``wv_b [H, v_head, kv_lora]`` ~ N(0, 1/kv_lora), so ``out`` stays O(|latent|).

bf16 arrays are uint16 bit patterns (see bf16.py). Every draw is made on the host by NumPy's
``default_rng(seed)`` and rounded there; ``xp=cupy`` then copies the finished arrays to the
device. So ``xp=numpy`` and ``xp=cupy`` give bit-identical values for the same seed, and no
curand is needed (``cupy.random`` loads libcurand, which none of the dependencies ship). The
price is host time: a 131072-row cache (75M values) took 3-5 s on a busy 2-core machine, so
draw once per case and reuse. Picking a fresh seed per call is the caller's job.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from .bf16 import BF16_NAN_BITS, as_f32, to_storage
from .dims import Dims, check_inputs, preset
from .limits import MAX_CTX, check_bool, check_host_bytes, check_int, check_int_at_most
from .reference import q_absorb

__all__ = ["DecodeInputs", "make_inputs", "make_rising_inputs", "RISING_SPAN", "rising_q",
           "rising_ramp"]


@dataclass
class DecodeInputs:
    """One decode step's arrays (NumPy or CuPy) and its scalars."""

    q: Any
    cache: Any
    wv_b: Any
    n_ctx: int
    scale: float
    q_nope: Any
    q_rope: Any
    wk_b: Any

    def decode_args(self) -> dict:
        """The keyword arguments of reference.decode / schedule.run_schedule / the API."""
        return {"q": self.q, "cache": self.cache, "wv_b": self.wv_b,
                "n_ctx": self.n_ctx, "scale": self.scale}


def _normal(rng, shape, std=1.0):
    out = rng.standard_normal(shape, dtype=np.float32)
    if std != 1.0:
        out *= np.float32(std)
    return out


def _store(x, dtype: str) -> np.ndarray:
    """bf16.to_storage on the host, bf16 through ml_dtypes' cast: bit-identical to
    bf16.f32_to_bf16_bits (tests/test_inputs.py checks both against ml_dtypes) and about 50x
    faster on a 131072-row cache."""
    if dtype == "bf16":
        return np.asarray(x, dtype=np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
    return to_storage(x, dtype, np)


def _copy_to(xp, *arrays) -> tuple:
    """The finished host arrays in `xp`'s memory: one copy each, nothing drawn there."""
    return arrays if xp is np else tuple(xp.asarray(a) for a in arrays)


def make_inputs(dims, n_alloc: int, n_ctx: int | None = None, cache_dtype: str = "f16",
                q_dtype: str = "f32", seed: int = 0, nan_fill: bool = True,
                xp=np) -> DecodeInputs:
    """Draw one decode step's inputs. `dims` is a Dims or a preset name."""
    if isinstance(dims, str):
        dims = preset(dims)
    if not isinstance(dims, Dims):
        raise TypeError(f"dims must be a Dims or a preset name, got {type(dims).__name__}")
    n_alloc = check_int_at_most("n_alloc", n_alloc, 1, MAX_CTX,
                                "the kernels index cache rows as int32")
    n_ctx = n_alloc if n_ctx is None else check_int("n_ctx", n_ctx, 1)
    seed = check_int("seed", seed, 0)
    nan_fill = check_bool("nan_fill", nan_fill)
    if cache_dtype not in ("f16", "bf16"):
        raise ValueError(f"cache_dtype must be 'f16' or 'bf16', got {cache_dtype!r}")
    if q_dtype not in ("f32", cache_dtype):
        raise ValueError(f"q_dtype must be 'f32' or the cache dtype ({cache_dtype!r}), "
                         f"got {q_dtype!r}")
    if not 1 <= int(n_ctx) <= n_alloc:
        # check_inputs would say the same, but only after a possibly large draw
        raise ValueError(f"n_ctx must be in 1..N_alloc={n_alloc}, got {n_ctx}")
    # drawn in float32 and stored (8 B a value at most), before anything is allocated
    check_host_bytes(8 * (n_alloc * dims.key_dim + dims.n_head * (
        dims.key_dim + dims.nope + (dims.nope + dims.v_head) * dims.kv_lora)),
        f"the inputs of n_alloc {n_alloc:,} and {dims.n_head} heads")

    H = dims.n_head
    rng = np.random.default_rng(seed)
    # Weights and q_absorb inputs first, then the cache: the large draw comes last, so the
    # small arrays do not depend on n_alloc for a given seed.
    q_nope = _store(_normal(rng, (H, dims.nope)), cache_dtype)
    q_rope = _store(_normal(rng, (H, dims.rope)), cache_dtype)
    wk_b = _store(_normal(rng, (H, dims.nope, dims.kv_lora), dims.nope ** -0.5), cache_dtype)
    wv_b = _store(_normal(rng, (H, dims.v_head, dims.kv_lora), dims.kv_lora ** -0.5),
                  cache_dtype)
    cache = _store(_normal(rng, (n_alloc, dims.key_dim)), cache_dtype)
    if nan_fill and n_ctx < n_alloc:
        cache[n_ctx:] = BF16_NAN_BITS if cache_dtype == "bf16" else np.nan
    # The absorb is the reference's formula (float64), so the GPU q_absorb kernel is checked
    # against the one definition.
    q = _store(q_absorb(q_nope, q_rope, wk_b), q_dtype)

    q, cache, wv_b, q_nope, q_rope, wk_b = _copy_to(xp, q, cache, wv_b, q_nope, q_rope, wk_b)
    inputs = DecodeInputs(q=q, cache=cache, wv_b=wv_b, n_ctx=int(n_ctx),
                          scale=dims.default_scale, q_nope=q_nope, q_rope=q_rope, wk_b=wk_b)
    check_inputs(q, cache, wv_b, inputs.n_ctx, inputs.scale, dims)
    return inputs


# make_rising_inputs: how far (natural log units) the score max climbs over the context.
# 2^128 overflows f32, i.e. e^88.7: a softmax that never moved its reference max after the
# first tile would overflow, so this span makes a check fail on such a kernel.
RISING_SPAN = 110.0
RISING_ALONG = 10.0   # q . u of every row after rising_q (u = ones / sqrt(key_dim))


def rising_q(q32: np.ndarray, key_dim: int) -> np.ndarray:
    """f32 q (the key along the last axis) with its component along u = ones / sqrt(key_dim)
    set to RISING_ALONG, exactly before rounding: make_rising_inputs' q."""
    v = np.float32(key_dim ** -0.5)
    return q32 + (np.float32(RISING_ALONG) - q32.sum(axis=-1, keepdims=True) * v) * v


def rising_ramp(n: int, scale: float, key_dim: int) -> np.ndarray:
    """[n, 1] f32: c_t u, added to cache row t of n, c_t from -RISING_SPAN / slope to
    8 / slope (slope = scale x RISING_ALONG): against rising_q's q the scores climb by about
    RISING_SPAN (natural log) over the n rows. make_rising_inputs' ramp."""
    v = np.float32(key_dim ** -0.5)
    slope = scale * RISING_ALONG                    # score per unit of c_t
    c_lo, c_hi = -RISING_SPAN / slope, 8.0 / slope
    return (np.linspace(c_lo, c_hi, n, dtype=np.float32) * v)[:, None]


def make_rising_inputs(dims, n_alloc: int, n_ctx: int | None = None, cache_dtype: str = "f16",
                       q_dtype: str = "f32", seed: int = 0, nan_fill: bool = True,
                       xp=np) -> DecodeInputs:
    """Inputs whose scores climb by about RISING_SPAN (natural log) from the first position to
    the last, for every head: the running max of the online softmax keeps moving, a path that
    random inputs hardly take after the first tiles (their max settles within a few units).

    make_inputs, then along the unit vector u = ones / sqrt(key_dim) every head's q gets the
    component 10 (q[h].u = 10 exactly, before rounding) and cache row t < n_ctx gets c_t u,
    c_t from -RISING_SPAN/slope to 8/slope, so s[h, t] ~ slope * c_t + N(0, ~2) with the same
    slope = 10 scale for every head. The last positions hold
    the weight; lse stays ~10..20 as in make_inputs. q is set here, not made by q_absorb
    from q_nope and wk_b, so those inputs are None.
    """
    # Built on the host like make_inputs, then copied: the same values for xp=numpy and cupy.
    base = make_inputs(dims, n_alloc, n_ctx, cache_dtype, q_dtype, seed, nan_fill, np)
    d = dims if isinstance(dims, Dims) else preset(dims)
    n = base.n_ctx
    q = rising_q(as_f32(base.q, np), d.key_dim)
    cache32 = as_f32(base.cache[:n], np) + rising_ramp(n, base.scale, d.key_dim)
    cache = base.cache  # freshly drawn by make_inputs: ramped in place, rows >= n_ctx untouched
    cache[:n] = _store(cache32, cache_dtype)
    q, wv_b = _store(q, q_dtype), base.wv_b
    q, cache, wv_b = _copy_to(xp, q, cache, wv_b)
    out = DecodeInputs(q=q, cache=cache, wv_b=wv_b, n_ctx=n, scale=base.scale,
                       q_nope=None, q_rope=None, wk_b=None)
    check_inputs(out.q, out.cache, out.wv_b, n, out.scale, d)
    return out
