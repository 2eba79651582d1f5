"""The float64 NumPy reference for one paged decode step (see paged.py for the contract).

Request by request: its first ceil(len / page_size) table entries name its pages, those pages
alone are gathered (a page past a request's length is never touched, nor a table entry past
it), the positions past its length in its last page are cut before any conversion (they may
be NaN on purpose), and then, for every (query token, head) row,

    s[r, t]    = scale * q[r] . cache[t]             t < visible(r)
    lse[r]     = log sum_t exp(s[r, t])
    latent[r]  = sum_t exp(s[r, t] - lse[r]) * cache[t, :kv_lora]
    out[r]     = wv_b[h(r)] @ latent[r]

with visible(r) = len_b, or len_b - (s_q - 1 - i) for query i under `causal`.
"""
from __future__ import annotations

import numpy as np

from .bf16 import array_module, as_f64
from .paged import PagedResult, check_paged_inputs, check_paged_values, visible_lengths
from .reference import to_host

__all__ = ["decode_paged"]


def decode_paged(q, kv_cache, block_table, cache_seqlens, wv_b=None, *, causal: bool = False,
                 scale=None, kv_lora: int = 512) -> PagedResult:
    """The float64 reference of the paged step. NumPy or CuPy inputs (copied to the host);
    f16 / bf16 (ml_dtypes or uint16 bits) / f32. Returns float64 NumPy arrays."""
    shape, scale = check_paged_inputs(q, kv_cache, block_table, cache_seqlens, wv_b,
                                      scale=scale, causal=causal, kv_lora=kv_lora)
    table, lengths = to_host(block_table), to_host(cache_seqlens)
    check_paged_values(table, lengths, shape)
    d = shape.dims
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
