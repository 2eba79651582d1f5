"""A float32 NumPy model of the paged schedule: the chunk rule, the per-chunk online softmax,
and the combine that merges a tile of chunk partials per step, at the real dims.

It runs what the paged kernels run, in the order they run it, so the CPU suite reaches the
rule's corners (mixed lengths, empty requests, chunk slots past a request's end, causal
queries that see nothing) without a GPU. What it models:

* Chunks from `chunks.request_chunks`, the kernels' integer arithmetic, run program by
  program (`ChunkPlan.program_chunks`: the p-th chunk of the batch in request order); a
  program past the batch's last chunk does nothing, and the combine merges the n_b chunks
  each request's count names (a missing one raises: the grid did not cover it).
* Per chunk, an online softmax over tiles of `tile` positions, every (query, head) row at
  once: m_new = max(m, tile max), alpha = exp(m - m_new), l = l alpha + sum p,
  acc = acc alpha + p @ rows, in f32. Positions a row must not see (past the chunk, or past
  its causal limit) have score -inf, so p = 0 there; a row that has seen nothing keeps
  m = -inf, l = 0, acc = 0 (never NaN).
* A request of one chunk (every request under `plan.single_pass`): latent = acc / l and
  lse = m + log l straight from the chunk's partial, as the built-in attention kernels write
  them (PagedWalk::single()), no merge.
* The combine, per request of two chunks or more (and of none): the partials merged
  `combine_tile` at a time, each step one online-softmax update with the tile's max, then
  latent = acc / l and lse = m + log l; a row with l = 0 gets latent 0 and lse -inf. `rescale=False` drops every exp(m_i - m)
  factor: the negative control. The projection by wv_b runs on the merged latent.

Not modelled: the order of the 576-term score dot products and of p @ rows (BLAS here);
both are O(1 ulp) per term and do not grow with the context.
"""
from __future__ import annotations

import numpy as np

from .bf16 import as_f32
from .chunks import ChunkPlan, chunk_bounds
from .paged import PagedResult, check_paged_inputs, check_paged_values, visible_lengths
from .limits import check_flags, check_host_bytes
from .reference import to_host

__all__ = ["run_paged_schedule"]


def _chunk_partial(q_rows, rows, start, end, visible, tile, scale, kv_lora):
    """(m [R], l [R], acc [R, kv_lora]) of positions [start, end) for R rows in f32."""
    n_rows = q_rows.shape[0]
    m = np.full(n_rows, -np.inf, np.float32)
    l = np.zeros(n_rows, np.float32)
    acc = np.zeros((n_rows, kv_lora), np.float32)
    for t0 in range(start, end, tile):
        t1 = min(end, t0 + tile)
        block = rows[t0:t1]
        s = (q_rows @ block.T) * np.float32(scale)
        s = np.where(np.arange(t0, t1)[None, :] < visible[:, None], s, np.float32(-np.inf))
        m_new = np.maximum(m, s.max(axis=1))
        seen = m_new > -np.inf
        m_ref = np.where(seen, m_new, np.float32(0))
        alpha = np.where(seen, np.exp(m - m_ref), np.float32(1))
        p = np.exp(s - m_ref[:, None])
        l = l * alpha + p.sum(axis=1)
        acc = acc * alpha[:, None] + p @ block[:, :kv_lora]
        m = m_new
    return m, l, acc


def _finish(m, l, acc):
    """(latent, lse) of merged (m, l, acc): a row with l == 0 gets latent 0, lse -inf."""
    live = l > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        latent = np.where(live[:, None], acc / l[:, None], np.float32(0))
        lse = np.where(live, m + np.log(l), np.float32(-np.inf))
    return latent.astype(np.float32), lse.astype(np.float32)


def _combine(parts, combine_tile, rescale, kv_lora, n_rows):
    """Merge the chunk partials of one request, `combine_tile` at a time."""
    m = np.full(n_rows, -np.inf, np.float32)
    l = np.zeros(n_rows, np.float32)
    acc = np.zeros((n_rows, kv_lora), np.float32)
    for i0 in range(0, len(parts), combine_tile):
        tile = parts[i0:i0 + combine_tile]
        mi = np.stack([p[0] for p in tile])                 # [T, R]
        m_new = np.maximum(m, mi.max(axis=0))
        seen = m_new > -np.inf
        m_ref = np.where(seen, m_new, np.float32(0))
        if rescale:
            alpha = np.where(seen, np.exp(m - m_ref), np.float32(1))
            w = np.exp(mi - m_ref[None, :])                 # exp(-inf) = 0 for empty ones
        else:
            alpha, w = np.ones_like(m), np.ones_like(mi)
        l = l * alpha + (w * np.stack([p[1] for p in tile])).sum(axis=0)
        acc = acc * alpha[:, None] + (w[:, :, None] * np.stack([p[2] for p in tile])).sum(axis=0)
        m = m_new
    return _finish(m, l, acc)


def run_paged_schedule(q, kv_cache, block_table, cache_seqlens, wv_b=None, *, plan: ChunkPlan,
                       causal: bool = False, scale=None, rescale: bool = True,
                       kv_lora: int = 512) -> PagedResult:
    """The paged step under `plan` in float32 (NumPy inputs; CuPy ones are copied)."""
    if not isinstance(plan, ChunkPlan):
        raise TypeError(f"plan must be a ChunkPlan (chunks.plan_chunks), got {plan!r:.60}")
    check_flags(rescale=rescale)
    shape, scale = check_paged_inputs(q, kv_cache, block_table, cache_seqlens, wv_b,
                                      scale=scale, causal=causal, kv_lora=kv_lora)
    table, lengths = to_host(block_table), to_host(cache_seqlens)
    check_paged_values(table, lengths, shape)
    # the partials of every chunk program (m, l and kv_lora floats a row) and one request's
    # rows in float32 and as gathered
    rows_q, d, n_max = shape.s_q * shape.n_head, shape.dims, int(np.max(lengths, initial=0))
    check_host_bytes(4 * plan.programs_per_block * rows_q * (d.kv_lora + 2)
                     + 8 * n_max * d.key_dim,
                     f"the paged schedule model of {plan.programs_per_block:,} chunk programs "
                     f"of {rows_q} rows and cache_seqlens up to {n_max:,}")
    if plan.batch != shape.batch:
        raise ValueError(f"the plan is for batch {plan.batch}, the inputs have {shape.batch}")
    d, H, s_q = shape.dims, shape.n_head, shape.s_q
    pages = to_host(kv_cache).reshape(shape.num_pages, shape.page_size, d.key_dim)
    q32 = as_f32(to_host(q)).reshape(shape.batch, s_q * H, d.key_dim)   # row r = i*H + h
    visible = np.repeat(visible_lengths(lengths, s_q, causal), H, axis=1)  # [B, s_q*H]
    n_chunks, chunk_len = plan.for_lengths(lengths)

    latent = np.zeros((shape.batch, s_q * H, d.kv_lora), np.float32)
    lse = np.full((shape.batch, s_q * H), -np.inf, np.float32)
    slots = {}                             # (request, chunk) -> partial, as the grid writes
    for b, c in zip(*plan.program_chunks(lengths)):   # every chunk program of a row block
        if b < 0:
            continue                       # past the batch's last chunk: nothing to do
        n = int(lengths[b])
        ids = np.asarray(table[b, :-(-n // shape.page_size)], dtype=np.int64)
        rows = as_f32(pages[ids].reshape(-1, d.key_dim)[:n])
        start, end = chunk_bounds(n, int(chunk_len[b]), int(c))
        slots[int(b), int(c)] = _chunk_partial(q32[b], rows, start, end, visible[b],
                                               plan.tile, scale, d.kv_lora)
    for b in range(shape.batch):
        parts = [slots[b, c] for c in range(int(n_chunks[b]))]   # the combine's n_b chunks
        if not parts:
            continue                       # an empty request: latent 0, lse -inf
        if len(parts) == 1:                # the attention kernel's own latent and lse
            latent[b], lse[b] = _finish(*parts[0])
        else:
            latent[b], lse[b] = _combine(parts, plan.combine_tile, rescale, d.kv_lora, s_q * H)
    latent = latent.reshape(shape.batch, s_q, H, d.kv_lora)
    lse = lse.reshape(shape.batch, s_q, H)
    out = None
    if wv_b is not None:
        out = np.einsum("hvk,bihk->bihv", as_f32(to_host(wv_b)), latent).astype(np.float32)
    return PagedResult(latent=latent, lse=lse, out=out)
