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
  count(u) <= target (three candidates a step; hi if none), where
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
* A second wave, offered by the grid and taken on the device from the lengths. Where
  2 <= B < target <= 4 B (one to four programs a request), whole chunks of a request cannot
  even out one wave: the longest request's chunks set it. The host then sizes the grid for
  two waves (P = 2 target programs, `waves` = 2, max_chunks from 2 target) and the device
  takes them (`two_waves`) where one wave's unit u1 (at target) is over 5/2 of the unit u2
  at 2 target: two waves of chunks of at most u2 tiles take 2 u2, plus a second program
  start, a merge a request and the rule's second search; measured (docs/schedule.md) they
  tie with one wave at u1 = 2.26 u2 and gain 8-17% from 2.53 u2. Else it runs one wave (u1,
  with the grid's larger cap) and the programs past its chunks exit. `programs` (the
  grid's P) tells the rule its grid.
* The grid: (head_blocks, P, 1), P = max(target, batch) chunk programs a row block (2 target
  where the grid offers a second wave), at least the chunks any lengths make. Program p runs
  the p-th chunk of the batch, the requests' chunks numbered request by request
  (`ChunkPlan.program_chunks`, the kernels' locate_chunk): no program waits on another's
  exit, and the chunks of a wave are all real. Row block 0's program 0 writes every
  request's chunk count to a [B] buffer, which the combine reads (it derives nothing itself).
* Single pass: with max_chunks == 1 (`ChunkPlan.single_pass`) every request runs at most one
  chunk, program p is request p (P = batch) and no rule runs; the attention kernel then
  also writes latent = acc / l and lse itself (latent 0, lse -inf for an empty request), so
  the step needs no merge.
* The combine merges a request's n partials a tile of `combine_tile` chunks per step: the
  chunk cap rounded up to a power of two, at most COMBINE_TILE_MAX.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .limits import INT32_MAX, MAX_SPLITS, check_int, check_int_array, check_int_at_most

__all__ = ["CHUNK_CAP", "CHUNK_SKEW", "COMBINE_TILE_MAX", "MIN_TILES_PER_CHUNK", "ChunkPlan",
           "plan_chunks", "batch_chunk_unit", "single_request_unit", "request_chunks",
           "chunk_bounds", "offers_two_waves", "two_waves"]

CHUNK_CAP = 256          # chunks of one request, at most (as the batch-1 split cap)
CHUNK_SKEW = 2           # chunk slots per request: this many times the mean request's need
MIN_TILES_PER_CHUNK = 1  # a chunk is at least this many tiles long, unless the request is
COMBINE_TILE_MAX = 64    # chunk partials the combine merges in one step, at most


def _positive_int(name, value):
    return check_int(name, value, 1)


# The rule's arguments as the kernels take them: int32 (the device's cache_seqlens too).
_SEQLEN_WHY = "cache_seqlens is int32 on the device"


def _kernel_int(name, value, low=1):
    return check_int_at_most(name, value, low, INT32_MAX, "the kernels take it as int32")


def _length(length):
    return check_int_at_most("length", length, 0, INT32_MAX, _SEQLEN_WHY)


def _lengths(lengths):
    return check_int_array("lengths", lengths, 0, INT32_MAX, _SEQLEN_WHY)


def _sizes(tile, min_chunk, target):
    """(tile, min_chunk, target), checked: a chunk is at least one tile, so the rule's unit
    (min_chunk // tile tiles at the least) is never 0, even for a batch of empty requests."""
    tile = _kernel_int("tile", tile)
    return tile, _kernel_int("min_chunk", min_chunk, tile), _kernel_int("target", target)


def _rule_args(lengths, max_chunks, tile, min_chunk, target):
    """(lengths [B], tiles [B], max_chunks, tile, min_chunk, target), checked once at the
    entry points: the search below them runs on these without checking again."""
    tile, min_chunk, target = _sizes(tile, min_chunk, target)
    n = _lengths(lengths)
    return n, -(-n // tile), _kernel_int("max_chunks", max_chunks), tile, min_chunk, target


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
    waves: int = 1       # 2: the grid offers a second wave, which the lengths may take

    def __post_init__(self):
        # a hand-made plan (run_paged_schedule takes one) is held to what plan_chunks makes
        for name in ("batch", "head_blocks", "max_chunks", "slots", "tile", "min_chunk"):
            object.__setattr__(self, name, check_int(f"ChunkPlan {name}", getattr(self, name),
                                                     1))
        object.__setattr__(self, "target", check_int("ChunkPlan target", self.target, 0))
        if self.waves not in (1, 2) or isinstance(self.waves, bool):
            raise ValueError(f"ChunkPlan waves must be 1 or 2, got {self.waves!r}")
        if self.target == 0:
            object.__setattr__(self, "target", max(1, self.slots // self.head_blocks))

    @property
    def programs_per_block(self) -> int:
        """Chunk programs of a row block: one a request in a single pass, 2 target where
        the grid offers a second wave, else max(target, batch); at least the chunks any set
        of lengths makes."""
        if self.single_pass:
            return self.batch
        return 2 * self.target if self.waves == 2 else max(self.target, self.batch)

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

    def _batch_lengths(self, lengths):
        lengths = _lengths(lengths)
        if lengths.size != self.batch:
            raise ValueError(f"lengths: the plan is for a batch of {self.batch}, got "
                             f"{lengths.size} lengths")
        return lengths

    def for_lengths(self, lengths):
        """(n_chunks [B], chunk_len [B]) for these lengths: what each request runs."""
        return request_chunks(self._batch_lengths(lengths), self.max_chunks, self.tile,
                              self.min_chunk, self.target, programs=self.programs_per_block)

    def waves_taken(self, lengths) -> int:
        """The waves of chunk programs these lengths run on the plan's grid (two_waves)."""
        return 2 if two_waves(self._batch_lengths(lengths), self.max_chunks, self.tile,
                              self.min_chunk, self.target, programs=self.programs_per_block) else 1

    def program_chunks(self, lengths):
        """(request [P], chunk [P]) of each chunk program p of a row block, -1 past the last
        chunk: the requests' chunks numbered request by request (the kernels' locate)."""
        n, _ = self.for_lengths(lengths)
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
                max_len: int | None = None) -> ChunkPlan:
    """The chunk plan of a batch. `chunks` overrides the chunk slots: every request may take
    up to that many chunks (still balanced on the wave target and cut by its length).
    `max_len`: the longest request the step can hold (its block table's max_pages x
    page_size). Where no such request fills more than one chunk (max_len within min_tiles
    tiles), the plan is a single pass: one program a request, no partials, no merge launch.
    Every valid set of lengths runs the same chunks (one) as without the bound. A bound of
    two or more slots is not taken: it would hand a few chunks' merge to the attention
    kernel (registry.attn_merges), slower than the merge launch where the head blocks are
    few (docs/schedule.md, "A table of one chunk runs one pass")."""
    batch, head_blocks = _positive_int("batch", batch), _positive_int("head_blocks", head_blocks)
    num_sms, blocks_per_sm = (_positive_int("num_sms", num_sms),
                              _positive_int("blocks_per_sm", blocks_per_sm))
    tile, min_tiles, cap = (_positive_int("tile", tile), _positive_int("min_tiles", min_tiles),
                            _positive_int("cap", cap))
    skew = _positive_int("skew", skew)
    slots = num_sms * blocks_per_sm
    target = max(1, slots // head_blocks)
    waves = 2 if offers_two_waves(batch, target) else 1
    if chunks is not None:
        max_chunks = _positive_int("chunks", chunks)
        if max_chunks > cap:
            raise ValueError(f"chunks must be at most the chunk cap {cap}, got {max_chunks}")
        why = f"override: up to {max_chunks} chunks a request, balanced on {target} programs"
    else:
        fill = waves * target
        max_chunks = 1 if batch >= target else max(1, min(cap, fill, -(-skew * fill // batch)))
        why = (f"balanced: {head_blocks} head blocks x {target} chunk programs on {slots} "
               f"slots ({blocks_per_sm}/SM x {num_sms} SMs), up to {max_chunks} chunks a "
               f"request ({skew}x the mean of {batch} requests)")
    if max_len is not None:
        tiles = -(-check_int("max_len", max_len, 1) // tile)
        if tiles <= min_tiles and max_chunks > 1:
            max_chunks = 1
            why += (f"; one pass: a request holds at most max_len = {max_len} positions "
                    f"({tiles} tile{'s' if tiles > 1 else ''} of {tile}), within one chunk of "
                    f"at least {min_tiles}")
    waves = waves if max_chunks > 1 else 1
    if waves == 2:
        why += ("; a second wave of as many programs where one wave's chunks would be over "
                "5/2 of two waves' (chosen on the device from the lengths)")
    plan = ChunkPlan(batch, head_blocks, max_chunks, slots, tile, min_tiles * tile, why, target,
                     waves)
    if plan.programs_per_block > MAX_SPLITS:
        raise ValueError(f"the plan needs {plan.programs_per_block:,} chunk programs a head "
                         f"block (num_sms={num_sms} x blocks_per_sm={blocks_per_sm} over "
                         f"{head_blocks} head blocks, batch {batch}): the grid's y dimension "
                         f"holds at most {MAX_SPLITS:,}")
    return plan


def offers_two_waves(batch: int, target: int) -> bool:
    """Whether the grid offers a second wave: one to four programs of a wave a request
    (the kernels' locate_chunk reads the offer from the grid: P = 2 target, B < target)."""
    return 2 <= batch < target <= 4 * batch


def single_request_unit(length: int, tile: int, min_chunk: int, target: int) -> int:
    """u of a batch of one request, in closed form (the kernels' locate_chunk takes this
    path): lo = max(min_tiles, ceil(t / target)) has count(lo) <= ceil(t / ceil(t / target))
    <= target, so the search ends at lo."""
    length = _length(length)
    tile, min_chunk, target = _sizes(tile, min_chunk, target)
    return max(min_chunk // tile, -(-(-(-length // tile)) // target))


def batch_chunk_unit(lengths, max_chunks: int, tile: int, min_chunk: int, target: int) -> int:
    """u, the balanced chunk length in tiles of this batch: the kernels' search, three
    candidates lo + floor(k d / 4) (k = 1..3, d = hi - lo) a step, the first that fits (or
    hi) bounding the next range (a batch of one request ends it at single_request_unit,
    which the kernels compute directly)."""
    _, t, max_chunks, tile, min_chunk, target = _rule_args(lengths, max_chunks, tile,
                                                          min_chunk, target)
    return _unit(t, max_chunks, tile, min_chunk, target)


def _unit(t, max_chunks: int, tile: int, min_chunk: int, target: int) -> int:
    """batch_chunk_unit on checked arguments, `t` the requests' tiles."""
    total, busy = int(t.sum()), int((t > 0).sum())
    max_t = int(t.max())
    lo = max(min_chunk // tile, -(-total // target))
    hi = max_t if target <= busy else min(max_t, -(-total // (target - busy)))
    hi = max(lo, hi)

    def fits(u: int) -> bool:
        return int(np.minimum(max_chunks, -(-t // u)).sum()) <= target

    while lo < hi:
        d = hi - lo
        u1, u2, u3 = lo + (d >> 2), lo + (d >> 1), lo + ((3 * d) >> 2)
        if fits(u1):
            hi = u1
        elif fits(u2):
            lo, hi = u1 + 1, u2
        elif fits(u3):
            lo, hi = u2 + 1, u3
        else:
            lo = u3 + 1
    return lo


def _unit_and_waves(t, max_chunks: int, tile: int, min_chunk: int, target: int,
                    programs: int) -> tuple[int, int]:
    """(u, waves) on a grid of `programs` chunk programs a row block: two waves (u on
    2 target) where the grid offers them (programs >= 2 target, 2 <= B < target) and one
    wave's unit is over 5/2 of two waves'; else one (the kernels' locate_chunk). Checked
    arguments, `t` the requests' tiles."""
    u1 = _unit(t, max_chunks, tile, min_chunk, target)
    if not (programs >= 2 * target and 2 <= len(t) < target):
        return u1, 1
    u2 = _unit(t, max_chunks, tile, min_chunk, 2 * target)
    return (u2, 2) if 2 * u1 > 5 * u2 else (u1, 1)


def two_waves(lengths, max_chunks: int, tile: int, min_chunk: int, target: int,
              programs: int) -> bool:
    """Whether a batch on a grid of `programs` chunk programs a row block runs two waves."""
    _, t, *args = _rule_args(lengths, max_chunks, tile, min_chunk, target)
    return _unit_and_waves(t, *args, _kernel_int("programs", programs, 0))[1] == 2


def request_chunks(lengths, max_chunks: int, tile: int, min_chunk: int, target: int, *,
                   programs: int = 0):
    """(n_chunks, chunk_len) per request of the batch `lengths`, in the kernels' integer
    arithmetic (the module docstring), on a grid of `programs` chunk programs a row block
    (0: max(target, B), one wave). Vectorized over the batch."""
    n, t, max_chunks, tile, min_chunk, target = _rule_args(lengths, max_chunks, tile,
                                                           min_chunk, target)
    u, _ = _unit_and_waves(t, max_chunks, tile, min_chunk, target,
                           _kernel_int("programs", programs, 0))
    want = np.minimum(max_chunks, -(-t // u))                  # 0 for an empty request
    chunk_len = np.maximum(-(-t // np.maximum(want, 1)), 1) * tile
    return -(-n // chunk_len), chunk_len


def chunk_bounds(length: int, chunk_len: int, c: int) -> tuple[int, int]:
    """[start, end) of chunk c of a request; empty (start == end) past its last chunk."""
    length, c = _length(length), _kernel_int("c", c, 0)
    chunk_len = _kernel_int("chunk_len", chunk_len)
    start = min(c * chunk_len, length)
    return start, min(length, start + chunk_len)
