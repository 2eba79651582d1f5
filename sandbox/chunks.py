"""How a batch of requests of different lengths is cut into chunks: one rule for every set of
lengths, balanced across the whole batch, so one captured CUDA graph serves every set.

Flash-Decoding over a batch: each request's positions are cut into contiguous chunks, every
(head block, chunk, request) is one program of the attention kernel writing partials
(m, l, acc), and the combine merges a request's chunks. The host knows only the batch size
when it sizes the grid (lengths live on the device and change between graph replays), so:

* On the host, `plan_chunks`: the wave target ``target = max(1, slots // head_blocks)``
  (``slots = blocks_per_sm x SMs``: chunk programs of one head block that are resident at
  once) and the grid's chunk slots per request
  ``max_chunks = clamp(ceil(skew x target / batch), 1, min(cap, target))``: `skew` (2) times
  what a request of the mean length needs, so a request up to `skew` times the mean still
  gets chunks of the balanced length; 1 when batch >= target (requests alone fill the wave,
  and once the non-empty ones reach the target the rule below gives each one chunk).
  The grid is (head_blocks, max_chunks, batch).
* On the device, from every request's length (`batch_chunk_unit` and `request_chunks`, the
  integer arithmetic the attention programs and the combine both run): with t_b =
  ceil(len_b / tile) tiles per request, ``count(u) = sum_b min(max_chunks, ceil(t_b / u))``
  programs run at a chunk length of u tiles; u is the smallest u in [lo, hi] with
  count(u) <= target (binary search; hi if none), where
  ``lo = max(min_tiles, ceil(W / target))``, W = sum_b t_b, and
  ``hi = max(lo, min(max t_b, ceil(W / (target - B'))))`` (B' non-empty requests; max t_b when
  target <= B'), since each request wastes less than one chunk. So the programs fill one
  wave (the longest chunk, the critical path, is as short as one wave allows) and a long
  request takes more chunks, a short one fewer.
  Request b then runs ``n0 = min(max_chunks, ceil(t_b / u))`` chunks of
  ``chunk_len = max(1, ceil(t_b / n0)) x tile`` positions (equal whole-tile chunks; only its
  last chunk ends inside a tile), ``n = ceil(len_b / chunk_len) <= n0``. A program whose
  chunk index is >= n exits at once; an empty request (len 0) has n = 0 and its rows get
  latent 0, lse -inf.
* The grid: (head_blocks, P, 1), P = max(target, batch) chunk programs a row block, at least
  the chunks any lengths make. Program p runs the p-th chunk of the batch, the requests'
  chunks numbered request by request (`ChunkPlan.program_chunks`, the kernels'
  locate_chunk): no program waits on another's exit, and the chunks of a wave are all real.
  Row block 0's program 0 writes every request's chunk count to a [B] buffer, which the
  combine reads (it derives nothing itself).
* Single pass: with max_chunks == 1 (`ChunkPlan.single_pass`) every request runs at most one
  chunk, program p is request p (P = batch) and no rule runs; the attention kernel then
  also writes latent = acc / l and lse itself (latent 0, lse -inf for an empty request), so
  the step needs no merge.
* The flat schedule (a plan with `flat`: kernels that carry a program across requests,
  registry.runs_flat): program p runs tiles [p U, (p + 1) U) of the batch's requests laid end
  to end, one partial a request its range meets, so every program gets the same tiles:
  ``U = max(min_tiles, ceil(W / target), ceil(max t_b / (max_chunks - 1)))`` (the last term
  keeps a request within its max_chunks partial slots). It runs where it shortens the
  critical path, ``U + FLAT_MARGIN < u``, with two non-empty requests or more and
  max_chunks >= 2; else the per-request rule above. Request b's partial c is that of program
  ``floor(T_b / U) + c`` (T_b its first tile in the concatenation), and its count is the
  programs its tiles meet (`flat_counts`).
* The combine merges a request's n partials a tile of `combine_tile` chunks per step: the
  chunk cap rounded up to a power of two, at most COMBINE_TILE_MAX.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["CHUNK_CAP", "CHUNK_SKEW", "COMBINE_TILE_MAX", "MIN_TILES_PER_CHUNK", "FLAT_MARGIN",
           "ChunkPlan", "plan_chunks", "batch_chunk_unit", "single_request_unit",
           "request_chunks", "flat_unit", "flat_counts", "batch_chunks", "chunk_bounds"]

CHUNK_CAP = 256          # chunks of one request, at most (as the batch-1 split cap)
CHUNK_SKEW = 2           # chunk slots per request: this many times the mean request's need
MIN_TILES_PER_CHUNK = 1  # a chunk is at least this many tiles long, unless the request is
COMBINE_TILE_MAX = 64    # chunk partials the combine merges in one step, at most
# Tiles the flat schedule's U must undercut the per-request unit u by before it runs: a
# program that crosses into a request pays that piece's start (its partial written, its q
# staged from L2: a fraction of a tile), and the merge reads a partial more per crossing.
FLAT_MARGIN = 1


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
    target: int = 0      # chunk programs of a head block in one wave; 0: slots // head_blocks
    flat: bool = False   # the kernel may run the flat schedule (registry.runs_flat)

    def __post_init__(self):
        if self.target == 0:
            object.__setattr__(self, "target", max(1, self.slots // self.head_blocks))

    @property
    def programs_per_block(self) -> int:
        """Chunk programs of a row block: one a request in a single pass, else
        max(target, batch), at least the chunks any set of lengths makes."""
        return self.batch if self.single_pass else max(self.target, self.batch)

    @property
    def grid(self) -> tuple[int, int, int]:
        """(head blocks, chunk programs, 1): fixed for a batch size, whatever the lengths."""
        return (self.head_blocks, self.programs_per_block, 1)

    @property
    def programs(self) -> int:
        return self.head_blocks * self.programs_per_block

    @property
    def single_pass(self) -> bool:
        """Every request runs at most one chunk: the attention kernel writes latent and lse."""
        return self.max_chunks == 1

    @property
    def combine_tile(self) -> int:
        return min(COMBINE_TILE_MAX, 1 << (self.max_chunks - 1).bit_length())

    def unit(self, lengths) -> int:
        """U of the flat schedule these lengths run, 0 where the per-request rule runs."""
        if not self.flat or self.single_pass:
            return 0
        return flat_unit(lengths, self.max_chunks, self.tile, self.min_chunk, self.target)

    def for_lengths(self, lengths):
        """(n_chunks [B], chunk_len [B]) for these lengths: each request's partials (the
        counts the kernel publishes) and the longest of its pieces, in positions."""
        if self.single_pass:
            return request_chunks(lengths, 1, self.tile, self.min_chunk, self.target)
        return batch_chunks(lengths, self.max_chunks, self.tile, self.min_chunk, self.target,
                            self.flat)

    def program_segments(self, lengths) -> list:
        """Per chunk program p of a row block, the pieces it runs in order, as (request,
        partial slot, start, end) positions: one chunk under the per-request rule (none past
        the last), and under the flat schedule every request its tiles [p U, (p + 1) U) of
        the batch's concatenation meet (mla_walk.cuh, PagedWalk::begin and next_piece)."""
        lens, t = _tiles(lengths, self.tile)
        unit = self.unit(lens)
        progs: list = [[] for _ in range(self.programs_per_block)]
        if not unit:
            n, clen = request_chunks(lens, 1 if self.single_pass else self.max_chunks,
                                     self.tile, self.min_chunk, self.target)
            for p, (b, c) in enumerate(zip(*self._request_order(n))):
                if b >= 0:
                    start, end = chunk_bounds(int(lens[b]), int(clen[b]), int(c))
                    progs[p].append((int(b), int(c), start, end))
            return progs
        t0 = np.concatenate([[0], np.cumsum(t)[:-1]])
        for b in np.flatnonzero(t > 0):
            first, last = int(t0[b]) // unit, (int(t0[b] + t[b]) - 1) // unit
            for p in range(first, last + 1):
                s = max(p * unit, int(t0[b])) - int(t0[b])
                e = min((p + 1) * unit, int(t0[b] + t[b])) - int(t0[b])
                progs[p].append((int(b), p - first, s * self.tile,
                                 min(e * self.tile, int(lens[b]))))
        return progs

    def program_chunks(self, lengths):
        """(request [P], partial slot [P]) of the first piece of each chunk program p of a
        row block, -1 where it runs none: under the per-request rule its one chunk, the
        requests' chunks numbered request by request (the kernels' locate_chunk)."""
        segs = self.program_segments(lengths)
        return (np.array([s[0][0] if s else -1 for s in segs], np.int64),
                np.array([s[0][1] if s else 0 for s in segs], np.int64))

    def _request_order(self, n):
        """program_chunks of the per-request rule, from its chunk counts n."""
        if self.single_pass:
            b = np.arange(self.batch)
            return np.where(n > 0, b, -1), np.zeros(self.batch, np.int64)
        req = np.repeat(np.arange(len(n)), n)
        chunk = np.concatenate([np.arange(k) for k in n]) if n.sum() else np.zeros(0, np.int64)
        pad = self.programs_per_block - len(req)
        return (np.concatenate([req, np.full(pad, -1)]),
                np.concatenate([chunk, np.zeros(pad, np.int64)]))


def plan_chunks(batch: int, head_blocks: int, *, num_sms: int, blocks_per_sm: int, tile: int,
                min_tiles: int = MIN_TILES_PER_CHUNK, cap: int = CHUNK_CAP,
                chunks: int | None = None, skew: int = CHUNK_SKEW,
                flat: bool = False) -> ChunkPlan:
    """The chunk plan of a batch. `chunks` overrides the chunk slots: every request may take
    up to that many chunks (still balanced on the wave target and cut by its length).
    `flat`: the kernel runs the flat schedule where it pays (registry.runs_flat)."""
    batch, head_blocks = _positive_int("batch", batch), _positive_int("head_blocks", head_blocks)
    num_sms, blocks_per_sm = (_positive_int("num_sms", num_sms),
                              _positive_int("blocks_per_sm", blocks_per_sm))
    tile, min_tiles, cap = (_positive_int("tile", tile), _positive_int("min_tiles", min_tiles),
                            _positive_int("cap", cap))
    skew = _positive_int("skew", skew)
    slots = num_sms * blocks_per_sm
    target = max(1, slots // head_blocks)
    if chunks is not None:
        max_chunks = _positive_int("chunks", chunks)
        if max_chunks > cap:
            raise ValueError(f"chunks must be at most the chunk cap {cap}, got {max_chunks}")
        why = f"override: up to {max_chunks} chunks a request, balanced on {target} programs"
    else:
        max_chunks = 1 if batch >= target else max(1, min(cap, target,
                                                            -(-skew * target // batch)))
        why = (f"balanced: {head_blocks} head blocks x {target} chunk programs on {slots} "
               f"slots ({blocks_per_sm}/SM x {num_sms} SMs), up to {max_chunks} chunks a "
               f"request ({skew}x the mean of {batch} requests)")
    if flat and max_chunks > 1:
        why += "; the flat schedule where it shortens the longest program"
    return ChunkPlan(batch, head_blocks, max_chunks, slots, tile, min_tiles * tile, why, target,
                     bool(flat))


def _tiles(lengths, tile):
    n = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if (n < 0).any():
        raise ValueError(f"lengths must be >= 0, got {int(n.min())}")
    return n, -(-n // tile)


def single_request_unit(length: int, tile: int, min_chunk: int, target: int) -> int:
    """u of a batch of one request, in closed form (the kernels' locate_chunk takes this
    path): lo = max(min_tiles, ceil(t / target)) has count(lo) <= ceil(t / ceil(t / target))
    <= target, so the binary search ends at lo."""
    return max(min_chunk // tile, -(-(-(-int(length) // tile)) // target))


def batch_chunk_unit(lengths, max_chunks: int, tile: int, min_chunk: int, target: int) -> int:
    """u, the balanced chunk length in tiles of this batch: the kernels' binary search (a
    batch of one request ends it at single_request_unit, which the kernels compute directly)."""
    _, t = _tiles(lengths, tile)
    total, busy = int(t.sum()), int((t > 0).sum())
    max_t = int(t.max()) if t.size else 0
    lo = max(min_chunk // tile, -(-total // target))
    hi = max_t if target <= busy else min(max_t, -(-total // (target - busy)))
    hi = max(lo, hi)
    while lo < hi:
        mid = (lo + hi) // 2
        if int(np.minimum(max_chunks, -(-t // mid)).sum()) <= target:
            hi = mid
        else:
            lo = mid + 1
    return lo


def flat_unit(lengths, max_chunks: int, tile: int, min_chunk: int, target: int) -> int:
    """U, the tiles of every program under the flat schedule, or 0 where the per-request
    rule runs (mla_walk.cuh, flat_unit; the module docstring)."""
    n, t = _tiles(lengths, tile)
    if max_chunks < 2 or int((t > 0).sum()) < 2:
        return 0
    unit = max(min_chunk // tile, -(-int(t.sum()) // target), -(-int(t.max()) // (max_chunks - 1)))
    u = batch_chunk_unit(n, max_chunks, tile, min_chunk, target)
    return unit if unit + FLAT_MARGIN < u else 0


def flat_counts(lengths, tile: int, unit: int) -> np.ndarray:
    """Partials per request under the flat schedule of `unit` tiles a program: the programs
    its tiles [T_b, T_b + t_b) of the batch's concatenation meet; 0 for an empty request."""
    _, t = _tiles(lengths, tile)
    t0 = np.concatenate([[0], np.cumsum(t)[:-1]])
    return np.where(t > 0, (t0 + t - 1) // unit - t0 // unit + 1, 0)


def batch_chunks(lengths, max_chunks: int, tile: int, min_chunk: int, target: int,
                 flat: bool = False):
    """(n_chunks, chunk_len) per request as a kernel runs the batch: with `flat` (a kernel
    that runs the flat schedule) and where flat_unit chooses it, each request's partials
    and U x tile, the longest any of its pieces is; else request_chunks."""
    n, _ = _tiles(lengths, tile)
    unit = flat_unit(n, max_chunks, tile, min_chunk, target) if flat else 0
    if unit:
        return flat_counts(n, tile, unit), np.full(n.shape, unit * tile, np.int64)
    return request_chunks(n, max_chunks, tile, min_chunk, target)


def request_chunks(lengths, max_chunks: int, tile: int, min_chunk: int, target: int):
    """(n_chunks, chunk_len) per request of the batch `lengths` under the per-request rule,
    in the kernels' integer arithmetic (the module docstring). Vectorized over the batch."""
    n, t = _tiles(lengths, tile)
    u = batch_chunk_unit(n, max_chunks, tile, min_chunk, target)
    want = np.minimum(max_chunks, -(-t // u))                  # 0 for an empty request
    chunk_len = np.maximum(-(-t // np.maximum(want, 1)), 1) * tile
    return -(-n // chunk_len), chunk_len


def chunk_bounds(length: int, chunk_len: int, c: int) -> tuple[int, int]:
    """[start, end) of chunk c of a request; empty (start == end) past its last chunk."""
    start = min(c * chunk_len, length)
    return start, min(length, start + chunk_len)
