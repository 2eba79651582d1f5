"""Bit-exact bfloat16 <-> float32 conversion for NumPy and CuPy arrays, and widening helpers.

How bf16 travels in this project:

* In CuPy, as raw ``uint16`` words: CuPy has no native bfloat16 dtype, and the kernels take
  ``__nv_bfloat16*`` pointers, for which a ``uint16`` buffer has the right size and layout.
* In NumPy, as ``ml_dtypes.bfloat16`` or as the same ``uint16`` words.

So the conversions are pure integer operations (views, shifts, masks, ``where``) that run
unchanged on either array module; `xp` is inferred from the argument, or given.

Rounding is round-to-nearest-even, subnormals are kept, +-inf stays +-inf, and every NaN
becomes the quiet NaN ``sign | 0x7fc0``: bit-for-bit what ``ml_dtypes`` does. (CUDA's
``__float2bfloat16_rn`` returns ``0x7fff`` for NaN instead; both are NaN, which is all the
sandbox relies on.)
"""
from __future__ import annotations

import numpy as np

__all__ = [
    "array_module", "f32_to_bf16_bits", "bf16_bits_to_f32", "is_bf16", "as_f32", "as_f64",
    "to_storage", "BF16_NAN_BITS",
]

try:  # ml_dtypes is a dependency, but the integer paths below do not need it
    import ml_dtypes as _ml_dtypes

    _BF16 = np.dtype(_ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - exercised only without ml_dtypes
    _BF16 = None

BF16_NAN_BITS = 0x7FC0  # the canonical quiet NaN; also what rows past n_ctx are filled with


def array_module(arr, xp=None):
    """`xp` if given, else cupy for a CuPy array and numpy for anything else."""
    if xp is not None:
        return xp
    # Only ask CuPy about objects that could be CuPy arrays, so a NumPy-only install (or a
    # CuPy without a device) never pays for, or trips over, the import.
    if type(arr).__module__.startswith("cupy"):
        import cupy

        return cupy.get_array_module(arr)
    return np


def is_bf16(arr) -> bool:
    """True for ml_dtypes.bfloat16 arrays and for uint16 arrays (bf16 bit patterns)."""
    dt = np.dtype(arr.dtype)
    return dt == np.uint16 or dt.name == "bfloat16"


def _bits_u16(arr, xp):
    """The 16-bit words of a bf16 array, whichever way it is stored."""
    dt = np.dtype(arr.dtype)
    if dt == np.uint16:
        return arr
    if dt.name == "bfloat16":
        return arr.view(xp.uint16)
    raise TypeError(f"expected bf16 bits (uint16) or ml_dtypes.bfloat16, got {dt}")


def f32_to_bf16_bits(x, xp=None):
    """float32 (or anything castable to it) -> uint16 bf16 bit patterns, round-to-nearest-even."""
    xp = array_module(x, xp)
    bits = xp.ascontiguousarray(xp.asarray(x, dtype=xp.float32)).view(xp.uint32)
    # Adding 0x7fff plus the lowest kept bit, then truncating, rounds half to even. It cannot
    # overflow for non-NaN inputs: the largest is -max_finite, 0xff7fffff + 0x8000.
    lsb = (bits >> 16) & 1
    rounded = ((bits + 0x7FFF + lsb) >> 16).astype(xp.uint16)
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    quiet_nan = (((bits >> 16) & 0x8000) | BF16_NAN_BITS).astype(xp.uint16)
    return xp.where(is_nan, quiet_nan, rounded)


def bf16_bits_to_f32(u16, xp=None):
    """uint16 bf16 bit patterns (or ml_dtypes.bfloat16) -> float32, exactly (bf16 is the top
    half of an f32)."""
    xp = array_module(u16, xp)
    words = _bits_u16(xp.asarray(u16), xp)
    return (words.astype(xp.uint32) << 16).view(xp.float32)


def as_f32(arr, xp=None):
    """f16 / f32 / bf16 (ml_dtypes or uint16 bits) -> float32. Exact for every accepted dtype
    (all are subsets of f32); float64 is rounded, which callers use only for model inputs."""
    xp = array_module(arr, xp)
    arr = xp.asarray(arr)
    if is_bf16(arr):
        return bf16_bits_to_f32(arr, xp)
    dt = np.dtype(arr.dtype)
    if dt in (np.float16, np.float32, np.float64):
        return arr.astype(xp.float32, copy=False)
    raise TypeError(f"as_f32: unsupported dtype {dt} (float16, float32, float64, bfloat16)")


def as_f64(arr, xp=None):
    """f16 / f32 / f64 / bf16 (ml_dtypes or uint16 bits) -> float64, exactly."""
    xp = array_module(arr, xp)
    arr = xp.asarray(arr)
    if np.dtype(arr.dtype) == np.float64:
        return arr
    return as_f32(arr, xp).astype(xp.float64)


def to_storage(x, dtype: str, xp=None):
    """Round float values to a storage dtype name: 'f16' | 'bf16' (uint16 bits) | 'f32'."""
    xp = array_module(x, xp)
    if dtype == "f32":
        return xp.asarray(x, dtype=xp.float32)
    if dtype == "f16":
        return xp.asarray(x).astype(xp.float16)
    if dtype == "bf16":
        # f64 -> f32 -> bf16 rounds twice; inputs here are drawn in f32, so it is once.
        return f32_to_bf16_bits(xp.asarray(x, dtype=xp.float32), xp)
    raise ValueError(f"dtype must be one of 'f16', 'bf16', 'f32', got {dtype!r}")
