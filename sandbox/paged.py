"""The paged contract of a serving decode step: its inputs, their validation, its result.

    q             [B, s_q, H, kv_lora + rope]    f16 / bf16 / f32: s_q query tokens per request
    kv_cache      [num_pages, page_size, kv_lora + rope]   f16 / bf16, pages in any order
                  (FlashMLA's [num_pages, page_size, 1, kv_lora + rope] is accepted too)
    block_table   [B, max_pages] int32: the page ids of request b, in order
    cache_seqlens [B] int32: the tokens of request b (0 allowed)
    wv_b          [H, v_head, kv_lora], like the cache, or None (no `out`)

    latent [B, s_q, H, kv_lora], lse [B, s_q, H] (natural log), out [B, s_q, H, v_head]

Position t of request b lives in page block_table[b, t // page_size], row t % page_size.
With `causal` and s_q > 1, query i of request b sees positions < len_b - (s_q - 1 - i),
FlashMLA's multi-token-prediction convention. A query that sees no position (an empty
request, or an early causal query of a short one) has latent 0, lse -inf and out 0: never NaN.

Host-side checks (`check_paged_inputs`) read only .shape, .dtype and .ndim, so they run on
NumPy, CuPy and torch arrays alike, before anything launches. Value checks
(`check_paged_values`) read the table and the lengths, so they need host copies.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .dims import Dims, dtype_name
from .limits import INT32_MAX, check_int, check_scale

__all__ = ["PagedShape", "PagedResult", "check_paged_inputs", "check_paged_values",
           "visible_lengths", "pages_needed", "INVALID_PAGE", "MAX_SEQLEN"]

# What unused block-table entries hold in the tests: far past any real page, so a kernel that
# reads an entry it should not faults under the sanitizer instead of reading a real page.
INVALID_PAGE = np.iinfo(np.int32).max
# The longest request: cache_seqlens is int32 on the device.
MAX_SEQLEN = np.iinfo(np.int32).max


@dataclass(frozen=True)
class PagedShape:
    """The sizes of one paged decode step, as validated."""

    batch: int
    s_q: int
    num_pages: int
    page_size: int
    max_pages: int
    dims: Dims
    cache_dtype: str
    q_dtype: str
    has_wv_b: bool

    @property
    def n_head(self) -> int:
        return self.dims.n_head

    @property
    def max_len(self) -> int:
        """The longest request the table can describe."""
        return self.max_pages * self.page_size


@dataclass
class PagedResult:
    """latent [B, s_q, H, kv_lora], lse [B, s_q, H], out [B, s_q, H, v_head] or None."""

    latent: Any
    lse: Any
    out: Any = None


def _shape(name, arr, ndims):
    if not hasattr(arr, "shape") or not hasattr(arr, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(arr).__name__}")
    if arr.ndim not in ndims:
        want = " or ".join(f"{n}-D" for n in ndims)
        raise ValueError(f"{name} must be {want}, got shape {tuple(arr.shape)}")
    return tuple(int(x) for x in arr.shape)


def _int_dtype(name, arr):
    # torch dtypes print as 'torch.int32'; numpy and cupy as 'int32'
    if str(arr.dtype).replace("torch.", "") != "int32":
        raise TypeError(f"{name} must be int32, got {arr.dtype}")


def check_paged_inputs(q, kv_cache, block_table, cache_seqlens, wv_b=None, *,
                       scale=None, causal=False, kv_lora: int = 512):
    """Validate the host-visible facts of one paged step; return (PagedShape, scale).

    `kv_lora` splits the cache row into latent and rope; wv_b must agree with it.
    Raises ValueError/TypeError naming the parameter and the limit.
    """
    kv_lora = check_int("kv_lora", kv_lora, 1)
    qb, s_q, n_head, key_dim = _shape("q", q, (4,))
    cshape = _shape("kv_cache", kv_cache, (3, 4))
    if len(cshape) == 4:
        if cshape[2] != 1:
            raise ValueError("a 4-D kv_cache must be [num_pages, page_size, 1, kv_lora+rope] "
                             f"(one KV head), got {cshape}")
        cshape = (cshape[0], cshape[1], cshape[3])
    num_pages, page_size, cache_dim = cshape
    tb, max_pages = _shape("block_table", block_table, (2,))
    (lb,) = _shape("cache_seqlens", cache_seqlens, (1,))
    if qb < 1 or s_q < 1 or n_head < 1:
        raise ValueError(f"q must be [B >= 1, s_q >= 1, H >= 1, kv_lora+rope], got "
                         f"{tuple(q.shape)}")
    if num_pages < 1 or page_size < 1:
        raise ValueError(f"kv_cache must hold at least one page of at least one row, got "
                         f"{tuple(kv_cache.shape)}")
    if tb != qb or lb != qb:
        raise ValueError(f"q has batch {qb}, so block_table must be [{qb}, max_pages] and "
                         f"cache_seqlens [{qb}]; got {tuple(block_table.shape)} and "
                         f"{tuple(cache_seqlens.shape)}")
    if max_pages < 1:
        raise ValueError(f"block_table must have at least one column, got "
                         f"{tuple(block_table.shape)}")
    if max_pages > INT32_MAX:   # the kernels take max_pages as an int
        raise ValueError(f"block_table may have at most {INT32_MAX:,} columns (max_pages, an "
                         f"int32 of the kernels), got {tuple(block_table.shape)}")
    _int_dtype("block_table", block_table)
    _int_dtype("cache_seqlens", cache_seqlens)
    v_head = _shape("wv_b", wv_b, (3,))[1] if wv_b is not None else Dims().v_head
    if v_head < 1:
        raise ValueError(f"wv_b must be [n_head, v_head >= 1, kv_lora], got {tuple(wv_b.shape)}")
    if cache_dim <= kv_lora:
        raise ValueError(f"kv_cache rows ({cache_dim}) must be longer than the latent width "
                         f"kv_lora={kv_lora} (the rest is rope)")
    dims = Dims(n_head=n_head, kv_lora=kv_lora, rope=cache_dim - kv_lora, v_head=v_head)
    if key_dim != dims.key_dim:
        raise ValueError(f"q rows must match kv_cache rows: kv_lora+rope={dims.key_dim}, got "
                         f"q {tuple(q.shape)}")
    if wv_b is not None and tuple(wv_b.shape) != (n_head, v_head, kv_lora):
        raise ValueError(f"wv_b must be [n_head={n_head}, v_head, kv_lora={kv_lora}], got "
                         f"{tuple(wv_b.shape)}")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    scale = dims.default_scale if scale is None else check_scale(scale)
    q_dt, cache_dt = _dtype("q", q), _dtype("kv_cache", kv_cache)
    if cache_dt == "f32":
        raise TypeError("kv_cache must be float16 or bfloat16, got float32")
    if q_dt not in ("f32", cache_dt):
        raise TypeError(f"q must be float32 or the cache dtype ({cache_dt}), got {q_dt}")
    if wv_b is not None and _dtype("wv_b", wv_b) != cache_dt:
        raise TypeError(f"wv_b must have the cache dtype ({cache_dt}), got {wv_b.dtype}")
    shape = PagedShape(batch=qb, s_q=s_q, num_pages=num_pages, page_size=page_size,
                       max_pages=max_pages, dims=dims, cache_dtype=cache_dt, q_dtype=q_dt,
                       has_wv_b=wv_b is not None)
    return shape, scale


_TORCH_DTYPES = {"torch.float16": "f16", "torch.bfloat16": "bf16", "torch.float32": "f32"}


def _dtype(name, arr) -> str:
    s = str(arr.dtype)
    if s in _TORCH_DTYPES:
        return _TORCH_DTYPES[s]
    try:
        return dtype_name(arr)
    except TypeError as exc:
        raise TypeError(f"{name}: {exc}") from None


def pages_needed(lengths, page_size: int):
    """Pages that hold a request's positions: ceil(len / page_size), 0 for an empty one."""
    return -(-np.asarray(lengths, dtype=np.int64) // int(page_size))


def tight_max_pages(lengths, page_size: int) -> int:
    """The block table's width that just holds these lengths (at least one page): what
    make_paged_inputs builds, so the bench plans its steps for the capacity they run with."""
    return max(1, int(pages_needed(lengths, page_size).max()))


def tight_max_len(lengths, page_size: int) -> int:
    """The longest request that table holds (PagedShape.max_len of its step): the max_len
    of a plan made without the step (paged_api.plan_for_lengths, tp_bench)."""
    return tight_max_pages(lengths, page_size) * int(page_size)


def check_paged_values(block_table, cache_seqlens, shape: PagedShape) -> None:
    """Lengths in 0..max_pages*page_size and every table entry a request uses (its first
    ceil(len/page_size)) in 0..num_pages-1; NumPy arrays. Raises naming the request and entry.
    Entries past a request's length are never read, so they may hold anything."""
    lengths = np.asarray(cache_seqlens, dtype=np.int64)
    table = np.asarray(block_table)
    bad = np.flatnonzero((lengths < 0) | (lengths > shape.max_len))
    if bad.size:
        b = int(bad[0])
        raise ValueError(
            f"cache_seqlens[{b}] = {int(lengths[b])} is outside 0..{shape.max_len} "
            f"(max_pages={shape.max_pages} x page_size={shape.page_size})")
    needed = pages_needed(lengths, shape.page_size)
    cols = int(needed.max(initial=0))   # the columns any request reads; past them, anything
    used = np.arange(cols)[None, :] < needed[:, None]
    table = table[:, :cols].astype(np.int64)
    wrong = used & ((table < 0) | (table >= shape.num_pages))
    if wrong.any():
        b, j = (int(x) for x in np.argwhere(wrong)[0])
        raise ValueError(
            f"block_table[{b}, {j}] = {int(table[b, j])} is not a page id in "
            f"0..{shape.num_pages - 1}, and request {b} (length {int(lengths[b])}) reads it")


def visible_lengths(cache_seqlens, s_q: int, causal: bool) -> np.ndarray:
    """[B, s_q]: how many leading positions query i of request b sees."""
    lengths = np.asarray(cache_seqlens, dtype=np.int64)[:, None]
    if not causal:
        return np.repeat(lengths, s_q, axis=1)
    behind = (s_q - 1 - np.arange(s_q))[None, :]
    return np.maximum(lengths - behind, 0)
