"""How a batch of requests of different lengths is cut into chunks: one rule for every length,
so one captured CUDA graph serves every set of lengths.

Flash-Decoding over a batch: each request's positions are cut into contiguous chunks, every
(head block, chunk, request) is one program of the attention kernel writing partials
(m, l, acc), and the combine merges a request's chunks. The host knows only the batch size
when it sizes the grid (lengths live on the device and change between graph replays), so:

* On the host, `plan_chunks`: the most chunks any request may take at this batch,
  ``max_chunks = clamp(floor(slots / (batch x head_blocks)), 1, cap)``, with
  ``slots = blocks_per_sm x SMs``. The budget is on batch x head blocks x chunks against the
  resident-block slots, so the grid fills the GPU once when every request is long, and shrinks
  per request as the batch or the head blocks grow (head sharding makes head_blocks small and
  the chunks many). The grid is (head_blocks, max_chunks, batch) for every length.
* On the device, per request (`request_chunks`, the same integer arithmetic the kernels and
  the combine run): ``n0 = min(max_chunks, ceil(len / min_chunk))`` chunks would do, each
  ``chunk_len = ceil(ceil(len / n0) / tile) x tile`` positions (whole tiles, so only a
  request's last chunk has a partial tile), which covers the request in
  ``n = ceil(len / chunk_len) <= n0`` chunks. A program whose chunk index is >= n exits at
  once; an empty request (len 0) has n = 0 and its rows get latent 0, lse -inf.
* ``min_chunk = min_tiles x tile`` keeps a chunk long enough that its partial (a 512-wide
  row per head to write and merge) costs little against the rows it reads; short requests
  in a batch stay coarse.
* The combine merges a request's n partials a tile of `combine_tile` chunks per step: the
  chunk cap rounded up to a power of two, at most COMBINE_TILE_MAX.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["CHUNK_CAP", "COMBINE_TILE_MAX", "ChunkPlan", "plan_chunks", "request_chunks",
           "chunk_bounds"]

CHUNK_CAP = 256          # chunks of one request, at most (as the batch-1 split cap)
MIN_TILES_PER_CHUNK = 4  # a chunk is at least this many tiles long, unless the request is
COMBINE_TILE_MAX = 64    # chunk partials the combine merges in one step, at most


def _positive_int(name, value):
    if isinstance(value, (bool, np.bool_)) or int(value) != value or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class ChunkPlan:
    """The host side of the rule: what the grid and the scratch are sized for."""

    batch: int
    head_blocks: int
    max_chunks: int
    slots: int
    tile: int
    min_chunk: int
    reason: str

    @property
    def grid(self) -> tuple[int, int, int]:
        """(head blocks, chunk slots, requests): fixed for a batch size, whatever the lengths."""
        return (self.head_blocks, self.max_chunks, self.batch)

    @property
    def programs(self) -> int:
        return self.head_blocks * self.max_chunks * self.batch

    @property
    def combine_tile(self) -> int:
        return min(COMBINE_TILE_MAX, 1 << (self.max_chunks - 1).bit_length())

    def for_lengths(self, lengths):
        """(n_chunks [B], chunk_len [B]) for these lengths: what each request runs."""
        return request_chunks(lengths, self.max_chunks, self.tile, self.min_chunk)


def plan_chunks(batch: int, head_blocks: int, *, num_sms: int, blocks_per_sm: int, tile: int,
                min_tiles: int = MIN_TILES_PER_CHUNK, cap: int = CHUNK_CAP,
                chunks: int | None = None) -> ChunkPlan:
    """The chunk plan of a batch. `chunks` overrides the budget: every request may take up to
    that many chunks (still cut by `min_chunk` and its length)."""
    batch, head_blocks = _positive_int("batch", batch), _positive_int("head_blocks", head_blocks)
    num_sms, blocks_per_sm = (_positive_int("num_sms", num_sms),
                              _positive_int("blocks_per_sm", blocks_per_sm))
    tile, min_tiles, cap = (_positive_int("tile", tile), _positive_int("min_tiles", min_tiles),
                            _positive_int("cap", cap))
    slots = num_sms * blocks_per_sm
    if chunks is not None:
        max_chunks = _positive_int("chunks", chunks)
        if max_chunks > cap:
            raise ValueError(f"chunks must be at most the chunk cap {cap}, got {max_chunks}")
        why = f"override: up to {max_chunks} chunks a request"
    else:
        max_chunks = max(1, min(cap, slots // (batch * head_blocks)))
        why = (f"budget: {batch} requests x {head_blocks} head blocks x {max_chunks} chunks "
               f"on {slots} slots ({blocks_per_sm}/SM x {num_sms} SMs)")
    return ChunkPlan(batch, head_blocks, max_chunks, slots, tile, min_tiles * tile, why)


def request_chunks(lengths, max_chunks: int, tile: int, min_chunk: int):
    """(n_chunks, chunk_len) per request, in the kernels' integer arithmetic. Vectorized."""
    n = np.asarray(lengths, dtype=np.int64)
    if (n < 0).any():
        raise ValueError(f"lengths must be >= 0, got {int(n.min())}")
    want = np.minimum(max_chunks, -(-n // min_chunk))           # 0 for an empty request
    per = -(-n // np.maximum(want, 1))
    chunk_len = np.maximum(-(-per // tile) * tile, tile)
    return -(-n // chunk_len), chunk_len


def chunk_bounds(length: int, chunk_len: int, c: int) -> tuple[int, int]:
    """[start, end) of chunk c of a request; empty (start == end) past its last chunk."""
    start = min(c * chunk_len, length)
    return start, min(length, start + chunk_len)
