"""The float64 NumPy reference for one decode step, and the result type every engine returns.

    s[h,t]    = scale * q[h] . cache[t]                 t < n_ctx
    lse[h]    = log sum_t exp(s[h,t])
    latent[h] = sum_t exp(s[h,t] - lse[h]) * cache[t, :kv_lora]
    out[h]    = wv_b[h] @ latent[h]

Two-pass softmax: the first pass computes every score and the max, the second sums
exp(s - max) and the weighted cache rows. Only rows ``t < n_ctx`` are ever read (sliced
before any conversion), because rows past the context may be NaN on purpose.

Memory stays modest at n_ctx = 131072, H = 128: the scores are kept ([H, n] float64, 134 MB)
but the cache is widened to float64 one chunk of rows at a time, never whole (600 MB).

CuPy inputs are accepted (copied to the host, only the rows that are read), so GPU tests can
call this directly.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from .bf16 import array_module, as_f64
from .dims import check_inputs
from .limits import check_host_bytes, check_host_memory
from .paged import PagedResult, check_paged_inputs, check_paged_values, visible_lengths

__all__ = ["DecodeResult", "decode", "decode_paged", "q_absorb", "to_host", "CHUNK_ROWS"]

# Rows of cache widened to float64 at once: 8192 x 576 x 8 B = 38 MB.
CHUNK_ROWS = 8192


@dataclass
class DecodeResult:
    """What every engine returns: NumPy float64 here, float32 from the schedule model,
    CuPy float32 arrays from the kernels (same fields, same shapes).

    out [H, v_head], latent [H, kv_lora], lse [H] (natural log).
    """

    out: Any
    latent: Any
    lse: Any

    def to_host(self) -> "DecodeResult":
        """The same result with NumPy arrays (a copy from the device where needed)."""
        return DecodeResult(*(to_host(getattr(self, f.name)) for f in fields(self)))


def to_host(arr):
    """A NumPy view/copy of a NumPy or CuPy array (ml_dtypes arrays pass through)."""
    if type(arr).__module__.startswith("cupy"):
        import cupy

        return cupy.asnumpy(arr)
    return np.asarray(arr)


def decode(q, cache, wv_b, n_ctx: int | None = None, scale: float | None = None,
           *, chunk_rows: int = CHUNK_ROWS) -> DecodeResult:
    """The float64 reference. Inputs f16 / bf16 (ml_dtypes or uint16 bits) / f32, NumPy or
    CuPy; validated by dims.check_inputs, so errors name the parameter and the limit."""
    dims, n_ctx, scale, _ = check_inputs(q, cache, wv_b, n_ctx, scale)
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, numbers.Integral):
        raise TypeError(f"chunk_rows must be an integer >= 1, got {chunk_rows!r}")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be an integer >= 1 (rows widened to float64 at "
                         f"once), got {chunk_rows}")
    check_host_memory(n_ctx, dims.n_head, dims.key_dim, engine="the float64 reference")
    q64 = as_f64(to_host(q))
    wv64 = as_f64(to_host(wv_b))
    live = cache[:n_ctx]  # the only rows read, on whichever device they live
    chunks = [(t0, min(n_ctx, t0 + chunk_rows)) for t0 in range(0, n_ctx, chunk_rows)]

    def rows(t0, t1):
        return as_f64(to_host(live[t0:t1]))

    # Pass 1: every score, then the max per head.
    scores = np.empty((dims.n_head, n_ctx), dtype=np.float64)
    for t0, t1 in chunks:
        scores[:, t0:t1] = q64 @ rows(t0, t1).T
    scores *= scale
    m = scores.max(axis=1)

    # Pass 2: weights relative to the max (all <= 1, the max itself exactly 1), their sum,
    # and the weighted sum of the latent part of the rows.
    np.exp(scores - m[:, None], out=scores)
    l = scores.sum(axis=1)
    acc = np.zeros((dims.n_head, dims.kv_lora), dtype=np.float64)
    for t0, t1 in chunks:
        acc += scores[:, t0:t1] @ rows(t0, t1)[:, :dims.kv_lora]
    latent = acc / l[:, None]
    out = np.einsum("hvk,hk->hv", wv64, latent)
    return DecodeResult(out=out, latent=latent, lse=m + np.log(l))


def q_absorb(q_nope, q_rope, wk_b) -> np.ndarray:
    """The absorbed query in float64: q[h] = q_nope[h] @ wk_b[h] || q_rope[h], [H, kv_lora+rope].

    q_nope [H, nope], q_rope [H, rope], wk_b [H, nope, kv_lora]; f16 / bf16 / f32, NumPy or CuPy.
    """
    q_nope, q_rope, wk_b = (as_f64(to_host(a)) for a in (q_nope, q_rope, wk_b))
    if q_nope.ndim != 2 or q_rope.ndim != 2 or wk_b.ndim != 3:
        raise ValueError(
            "q_absorb expects q_nope [H, nope], q_rope [H, rope], wk_b [H, nope, kv_lora]; got "
            f"{q_nope.shape}, {q_rope.shape}, {wk_b.shape}")
    n_head, nope = q_nope.shape
    if q_rope.shape[0] != n_head or wk_b.shape[:2] != (n_head, nope):
        raise ValueError(
            f"q_absorb: q_nope is [H={n_head}, nope={nope}], so q_rope must be [{n_head}, rope] "
            f"and wk_b [{n_head}, {nope}, kv_lora]; got {q_rope.shape} and {wk_b.shape}")
    absorbed = np.einsum("hn,hnk->hk", q_nope, wk_b)
    return np.concatenate([absorbed, q_rope], axis=1)



# The paged step (paged.py holds its contract and checks). Request by request: its first
# ceil(len / page_size) table entries name its pages, those pages alone are gathered (a page
# or a table entry past a request's length is never touched), the positions past its length
# in its last page are cut before any conversion (they may be NaN on purpose), and every
# (query token, head) row r sees positions t < visible(r): len_b, or len_b - (s_q - 1 - i)
# for query i under `causal`. A row that sees nothing has latent 0, lse -inf, out 0.
def decode_paged(q, kv_cache, block_table, cache_seqlens, wv_b=None, *, causal: bool = False,
                 scale=None, kv_lora: int = 512) -> PagedResult:
    """The float64 reference of the paged step. NumPy or CuPy inputs (copied to the host);
    f16 / bf16 (ml_dtypes or uint16 bits) / f32. Returns float64 NumPy arrays."""
    shape, scale = check_paged_inputs(q, kv_cache, block_table, cache_seqlens, wv_b,
                                      scale=scale, causal=causal, kv_lora=kv_lora)
    table, lengths = to_host(block_table), to_host(cache_seqlens)
    check_paged_values(table, lengths, shape)
    d = shape.dims
    # one request at a time: its rows in float64 and as gathered (12 B a value at most), its
    # scores and weights (s_q x H x n, float64, with a temporary each); q and the results
    n_max, rows_q = int(np.max(lengths, initial=0)), shape.s_q * d.n_head
    check_host_bytes(n_max * (12 * d.key_dim + 24 * rows_q)
                     + 8 * shape.batch * rows_q * (d.key_dim + d.kv_lora + d.v_head),
                     f"the float64 paged reference of cache_seqlens up to {n_max:,} with "
                     f"s_q {shape.s_q} x {d.n_head} heads and batch {shape.batch}")
    pages = kv_cache.reshape(shape.num_pages, shape.page_size, d.key_dim)
    q64 = as_f64(to_host(q))                                   # [B, s_q, H, key_dim]
    wv64 = as_f64(to_host(wv_b)) if wv_b is not None else None
    visible = visible_lengths(lengths, shape.s_q, causal)      # [B, s_q]

    latent = np.zeros((shape.batch, shape.s_q, d.n_head, d.kv_lora))
    lse = np.full((shape.batch, shape.s_q, d.n_head), -np.inf)
    for b in range(shape.batch):
        n = int(lengths[b])
        if n == 0:
            continue
        n_pages = -(-n // shape.page_size)
        ids = np.asarray(table[b, :n_pages], dtype=np.int64)
        ids = array_module(kv_cache).asarray(ids)            # index where the pages live
        rows = as_f64(to_host(pages[ids]).reshape(-1, d.key_dim)[:n])  # [n, key_dim]
        s = np.einsum("ihk,tk->iht", q64[b], rows) * scale   # [s_q, H, n]
        t = np.arange(n)
        seen = t[None, :] < visible[b][:, None]               # [s_q, n]
        s = np.where(seen[:, None, :], s, -np.inf)
        live = visible[b] > 0                                 # queries that see something
        m = np.where(live[:, None], s.max(axis=2, initial=-np.inf), 0.0)
        w = np.exp(s - m[:, :, None])                         # 0 where unseen
        l = w.sum(axis=2)
        acc = np.einsum("iht,tk->ihk", w, rows[:, :d.kv_lora])
        with np.errstate(divide="ignore", invalid="ignore"):
            latent[b] = np.where(live[:, None, None], acc / l[:, :, None], 0.0)
            lse[b] = np.where(live[:, None], m + np.log(l), -np.inf)
    out = None if wv64 is None else np.einsum("hvk,bihk->bihv", wv64, latent)
    return PagedResult(latent=latent, lse=lse, out=out)
