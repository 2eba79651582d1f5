"""Random inputs for one paged decode step, built so that a kernel that reads what it must not
fails loudly (FlashMLA's dense-decoding test does the same):

* the block table is a random permutation of the pages, so no request's pages are adjacent
  or in order;
* every page no request uses, and the rows past each request's length in its last page, are
  NaN: a read of either poisons the output;
* every table entry past a request's pages holds INVALID_PAGE, far past the cache, so a
  kernel that follows it faults under the sanitizer instead of reading a real page.

Values are drawn in float32 on the host (NumPy's Generator; no cuRAND) and rounded to their
storage dtype, so they are exact in float64. With ``xp=cupy`` the arrays are copied to the
device: the same seed gives the same values on either.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .bf16 import BF16_NAN_BITS, to_storage
from .dims import Dims, preset
from .limits import (GRID_Z_MAX, check_host_bytes, check_int, check_int_at_most,
                     read_input_text)
from .paged import INVALID_PAGE, MAX_SEQLEN, pages_needed, tight_max_pages

__all__ = ["PagedInputs", "make_paged_inputs", "check_inputs_fit", "parse_lengths", "as_lengths",
           "MAX_LENGTHS_FILE_BYTES"]

MAX_LENGTHS_FILE_BYTES = 16 << 20  # a lengths file larger than this is refused, not read


@dataclass
class PagedInputs:
    q: Any
    kv_cache: Any
    block_table: Any
    cache_seqlens: Any
    wv_b: Any
    scale: float
    causal: bool

    def decode_args(self) -> dict:
        """Keyword arguments of reference.decode_paged (and the paged API)."""
        return {"q": self.q, "kv_cache": self.kv_cache, "block_table": self.block_table,
                "cache_seqlens": self.cache_seqlens, "wv_b": self.wv_b,
                "causal": self.causal, "scale": self.scale}


def as_lengths(values) -> np.ndarray:
    """`values` as int64 request lengths, each an integer in 0..MAX_SEQLEN (cache_seqlens is
    int32 on the device); a float is taken only where it is a whole number. ValueError naming
    the request and the limit."""
    arr = np.atleast_1d(np.asarray(values, dtype=object))
    if arr.ndim != 1:
        raise ValueError(f"lengths must be a 1-D list (one length a request), got shape "
                         f"{arr.shape}")
    if arr.size == 0:
        raise ValueError(f"lengths must be one or more integers >= 0, got {values!r}")
    out = np.empty(arr.size, dtype=np.int64)
    for i, v in enumerate(arr):
        whole = isinstance(v, (float, np.floating)) and math.isfinite(v) and float(v).is_integer()
        if isinstance(v, (bool, np.bool_)) or not (isinstance(v, (int, np.integer)) or whole):
            raise ValueError(f"lengths must be integers, got {v!r} (request {i})")
        if not 0 <= int(v) <= MAX_SEQLEN:
            raise ValueError(f"lengths: request {i} has {int(v):,}, outside 0..{MAX_SEQLEN:,} "
                             "(cache_seqlens is int32)")
        out[i] = int(v)
    return out


def _lengths_file(path: str) -> list:
    text = read_input_text(path, "lengths file", MAX_LENGTHS_FILE_BYTES)
    values = []
    for i, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            values.append(int(line))
        except ValueError:
            raise ValueError(f"lengths file {str(path)!r}, line {i}: {line[:40]!r} is "
                             "not an integer") from None
    if not values:
        raise ValueError(f"lengths file {str(path)!r} holds no lengths")
    return values


def _to_batch(lengths: np.ndarray, batch: int, what: str) -> np.ndarray:
    """`lengths` cycled to the batch; more lengths than requests is an error, not a cut."""
    if lengths.size > batch:
        raise ValueError(f"{what}: {lengths.size} given for a batch of {batch}; give at most "
                         f"{batch} (fewer are cycled to the batch)")
    return np.resize(lengths, batch)


def parse_lengths(spec, batch: int, seed: int = 0) -> np.ndarray:
    """Request lengths from a spec: an int (every request), a list of ints or 'N,N,...'
    (cycled to the batch), 'normal:MEAN:STD' (drawn from the seed, rounded, clipped at 0),
    or '@FILE' (one length per line; blank lines and lines starting with '#' skipped, cycled
    to the batch). A list or file of more lengths than the batch is refused. Each length is
    in 0..MAX_SEQLEN. ValueError naming what is wrong."""
    batch = check_int_at_most("batch", batch, 1, GRID_Z_MAX,
                              "a paged step's grid holds one request a block along z")
    seed = check_int("seed", seed, 0)
    if isinstance(spec, str) and spec.startswith("@"):
        path = spec[1:]
        return _to_batch(as_lengths(_lengths_file(path)), batch, f"lengths file {path!r}")
    if isinstance(spec, str) and spec.startswith("normal:"):
        try:
            _, mean, std = spec.split(":")
            mean, std = float(mean), float(std)
        except ValueError:
            raise ValueError(f"lengths (--lengths) {spec!r}: expected "
                             "normal:MEAN:STD") from None
        if not (math.isfinite(mean) and math.isfinite(std) and mean >= 0 and std >= 0):
            raise ValueError(f"lengths (--lengths) {spec!r}: MEAN and STD must be finite "
                             "and >= 0")
        draw = np.maximum(np.rint(np.random.default_rng(seed).normal(mean, std, batch)), 0)
        if draw.max() > MAX_SEQLEN:
            raise ValueError(f"lengths (--lengths) {spec!r} drew a length of "
                             f"{draw.max():,.0f}, past {MAX_SEQLEN:,} (cache_seqlens is int32)")
        return draw.astype(np.int64)
    if isinstance(spec, str):
        try:
            spec = [int(x) for x in spec.split(",")]
        except ValueError:
            raise ValueError(f"lengths (--lengths) {spec!r}: expected N, N,N,..., "
                             "normal:MEAN:STD or @FILE") from None
    return _to_batch(as_lengths(spec), batch, "lengths")


def check_inputs_fit(lengths, s_q: int, page_size: int, dims, spare_pages: int = 2) -> None:
    """ValueError where make_paged_inputs(dims, lengths, s_q=..., page_size=...,
    spare_pages=...) could not fit in this machine's memory (the same rule it applies)."""
    need = pages_needed(as_lengths(lengths), page_size)
    _check_inputs_fit(need.size, s_q, dims.n_head, dims.key_dim,
                      int(need.sum()) + int(spare_pages) + 1, page_size, dims)


def _check_inputs_fit(batch, s_q, n_head, key_dim, num_pages, page_size, dims) -> None:
    """ValueError, before anything is allocated, where the inputs cannot fit in this
    machine's memory: each array is drawn in float32 (4 B a value) and kept in its storage
    dtype (at most 4 B more)."""
    q = batch * s_q * n_head * key_dim
    cache = num_pages * page_size * key_dim
    check_host_bytes(8 * (q + cache + n_head * dims.v_head * dims.kv_lora), "the paged inputs",
                     f" (q: batch {batch} x s_q {s_q} x {n_head} heads x {key_dim}; cache: "
                     f"{num_pages:,} pages x page_size {page_size} x {key_dim})", verb="need")


def make_paged_inputs(dims, lengths, *, s_q: int = 1, page_size: int = 64,
                      cache_dtype: str = "f16", q_dtype: str = "f32", causal: bool = False,
                      seed: int = 0, spare_pages: int = 2, with_wv_b: bool = True,
                      xp=np) -> PagedInputs:
    """One paged step's inputs for requests of `lengths` (one per request, 0 allowed)."""
    if isinstance(dims, str):
        dims = preset(dims)
    if not isinstance(dims, Dims):
        raise TypeError(f"dims must be a Dims or a preset name, got {type(dims).__name__}")
    lengths = as_lengths(lengths)
    if not isinstance(causal, (bool, np.bool_)):
        raise ValueError(f"causal must be True or False, got {causal!r}")
    check_int("seed", seed, 0)
    if cache_dtype not in ("f16", "bf16"):
        raise ValueError(f"cache_dtype must be 'f16' or 'bf16', got {cache_dtype!r}")
    if q_dtype not in ("f32", cache_dtype):
        raise ValueError(f"q_dtype must be 'f32' or the cache dtype ({cache_dtype!r}), "
                         f"got {q_dtype!r}")
    s_q, page_size, spare_pages = (check_int(name, value, low) for name, value, low in (
        ("s_q", s_q, 1), ("page_size", page_size, 1), ("spare_pages", spare_pages, 0)))
    batch, H, D = lengths.size, dims.n_head, dims.key_dim
    need = pages_needed(lengths, page_size)
    max_pages = tight_max_pages(lengths, page_size)
    num_pages = int(need.sum()) + int(spare_pages) + 1   # never zero pages
    _check_inputs_fit(batch, s_q, H, D, num_pages, page_size, dims)
    rng = np.random.default_rng(seed)

    def normal(shape, std=1.0):
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(std)

    nan = BF16_NAN_BITS if cache_dtype == "bf16" else np.nan
    q = to_storage(normal((batch, s_q, H, D)), q_dtype, np)
    wv_b = to_storage(normal((H, dims.v_head, dims.kv_lora), dims.kv_lora ** -0.5),
                      cache_dtype, np)
    cache = to_storage(normal((num_pages, page_size, D)), cache_dtype, np)
    order = rng.permutation(num_pages)
    table = np.full((batch, max_pages), INVALID_PAGE, dtype=np.int32)
    used = np.zeros(num_pages, dtype=bool)
    first = 0
    for b in range(batch):
        ids = order[first:first + need[b]]
        first += need[b]
        table[b, :need[b]] = ids
        used[ids] = True
        tail = int(lengths[b]) - (int(need[b]) - 1) * page_size  # rows used in the last page
        if need[b] and tail < page_size:
            cache[ids[-1], tail:] = nan
    cache[~used] = nan
    seqlens = lengths.astype(np.int32)
    arrays = [q, cache, table, seqlens, wv_b if with_wv_b else None]
    if xp is not np:
        arrays = [None if a is None else xp.asarray(a) for a in arrays]
    return PagedInputs(*arrays, scale=dims.default_scale, causal=bool(causal))
