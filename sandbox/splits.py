"""How many contiguous slices to split the context into: the launch geometry of one step.

The rule (Flash-Decoding's split over context, budgeted against the SM count):

* Below the split gate there is one slice. The gate is 4096 for one head per block
  (`split`): its 96 head blocks already fill most of the GPU, the combine's extra work costs
  more than the parallelism buys, and below it `split` runs per_head's kernel on one slice,
  the same code (the A/A pair). Blocks that serve several heads (batched, tiled, mma) are
  few, 6 at 96 heads for 16 per block, and one slice leaves most SMs idle, so they have no
  gate. `min_ctx=` sets the gate for any variant.
* Above it, S minimises a latency model of the attention phase, in tile-steps (the time a
  lone block takes to stream and score one tile of cache rows):

      cost(S) = waves(S) x (FIXED_TILES + tiles_per_slice(S)) + S x MERGE_TILES

  with waves = ceil(head_blocks x S / slots) (slots = blocks/SM x SMs, so the budget is on
  the PRODUCT head_blocks x S, and S grows as the head blocks shrink), FIXED_TILES = 3 a
  block's fixed cost (its start, q staged, the first tile's memory latency, the partial
  written) and MERGE_TILES = 1/256 what one more partial adds to the merge. Among S in
  1..cap (each slice at least `min_tiles` tiles, 1 by default) the plan takes the S of
  least cost, and the smallest S within 2% of it. So a short cache gets enough blocks to
  cover the SMs with one or two tiles each (1024 positions at 16 heads: 16 slices of one
  64-row tile, not 4 of four), a long one one wave of equal slices, and a cache of one tile
  one slice: a single pass (`SplitPlan.single_pass`), where the attention kernel writes
  latent and lse itself and no merge is needed.
* `splits=` overrides the rule (any S >= 1, S > n_ctx included: empty slices are neutral).

`predict_us` turns the model into microseconds for a variant (docs/schedule.md has the
constants and the predicted-vs-measured table).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .limits import (MAX_CTX, MAX_SMS, MAX_SPLITS, check_bool, check_int, check_int_at_most,
                     check_problem, check_real, is_int_in)
from .registry import ATTN_TILE

__all__ = ["SPLIT_MIN_CTX", "SPLIT_CAP", "MIN_TILES_PER_SPLIT", "FIXED_TILES", "MERGE_TILES",
           "SplitPlan", "default_gate", "plan_splits", "slice_bounds", "LatencyModel",
           "LATENCY_MODELS", "latency_model", "predict_us"]

SPLIT_MIN_CTX = 4096
SPLIT_CAP = 256
MIN_TILES_PER_SPLIT = 1
FIXED_TILES = 3.0      # a block's fixed cost, in tile-steps
MERGE_TILES = 1 / 256  # one more partial to write and merge, in tile-steps
_TIE = 1.02


@dataclass(frozen=True)
class SplitPlan:
    n_ctx: int
    n_head: int
    heads_per_block: int
    splits: int
    slice_len: int       # positions per slice, ceil(n_ctx / splits); the last may be shorter
    head_blocks: int
    slots: int           # blocks resident at once: blocks_per_sm x num_sms
    num_sms: int
    reason: str
    tile: int = ATTN_TILE  # cache rows per step of the kernel the plan is for

    def __post_init__(self):
        # a hand-made plan (run_schedule and predict_us take one): what plan_splits makes
        for name in ("n_ctx", "n_head", "heads_per_block", "splits", "slice_len",
                     "head_blocks", "slots", "num_sms", "tile"):
            object.__setattr__(self, name, check_int(f"SplitPlan {name}", getattr(self, name),
                                                     1))

    @property
    def grid(self) -> tuple[int, int]:
        return (self.head_blocks, self.splits)

    @property
    def blocks(self) -> int:
        return self.head_blocks * self.splits

    @property
    def waves(self) -> float:
        return self.blocks / self.slots

    @property
    def empty_slices(self) -> int:
        return sum(1 for s in range(self.splits)
                   if slice_bounds(self.n_ctx, self.splits, s)[0] >= self.n_ctx)

    @property
    def idle_sms(self) -> int:
        """SMs that get no block at all in the first wave (96 one-head blocks: 36 of 132)."""
        return max(0, self.num_sms - self.blocks)

    def tiles_per_block(self) -> int:
        return math.ceil(min(self.slice_len, self.n_ctx) / self.tile)

    @property
    def single_pass(self) -> bool:
        """One slice: the attention kernel writes latent and lse, no merge is needed."""
        return self.splits == 1

    def estimated_steps(self) -> int:
        """Tile-steps on the critical path: full waves times tiles per slice."""
        return math.ceil(self.blocks / self.slots) * self.tiles_per_block()

    def cost(self) -> float:
        """The rule's latency model, in tile-steps (the module docstring)."""
        waves = math.ceil(self.blocks / self.slots)
        return waves * (FIXED_TILES + self.tiles_per_block()) + self.splits * MERGE_TILES


def slice_bounds(n_ctx: int, splits: int, s: int) -> tuple[int, int]:
    """[start, end) of slice s, exactly as the kernel computes it; empty (start == end) past
    the last slice."""
    # plain ints in range skip the full checks: the schedule model calls this once a slice
    if not (is_int_in(n_ctx, 1, MAX_CTX) and is_int_in(splits, 1, MAX_SPLITS)
            and is_int_in(s, 0, math.inf)):
        n_ctx, splits = check_int("n_ctx", n_ctx, 1), check_int("splits", splits, 1)
        s = check_int("s", s, 0)
        check_problem(n_ctx=n_ctx, splits=splits)  # the kernels' int32 and grid limits
    length = -(-n_ctx // splits)
    start = min(s * length, n_ctx)
    return start, min(n_ctx, start + length)


def default_gate(heads_per_block: int, split_gate: int = SPLIT_MIN_CTX) -> int:
    """The split gate of blocks serving `heads_per_block` heads (see the module docstring):
    `split_gate` (SPLIT_MIN_CTX by default) for one head per block, none (1) for more."""
    return split_gate if heads_per_block == 1 else 1


def plan_splits(n_ctx: int, n_head: int, heads_per_block: int, *, num_sms: int,
                blocks_per_sm: int, splits: int | str | None = None, split: bool = True,
                min_ctx: int | None = None, cap: int = SPLIT_CAP,
                min_tiles: int = MIN_TILES_PER_SPLIT, tile: int = ATTN_TILE) -> SplitPlan:
    """The split plan for one step. `split=False` is per_head: always one slice.
    `min_ctx`: the split gate; None for default_gate(heads_per_block)."""
    n_ctx, n_head, heads_per_block, num_sms, blocks_per_sm, cap, min_tiles, tile = (
        check_int(name, value, 1) for name, value in (
            ("n_ctx", n_ctx), ("n_head", n_head), ("heads_per_block", heads_per_block),
            ("num_sms", num_sms), ("blocks_per_sm", blocks_per_sm), ("cap", cap),
            ("min_tiles", min_tiles), ("tile", tile)))
    check_problem(n_ctx=n_ctx, n_head=n_head, splits=splits)  # the kernels' int32 and grid
    for name, value, high, why in (   # the rule loops over split counts up to cap
            ("cap", cap, MAX_SPLITS, "the grid's y dimension, one block row per split"),
            ("num_sms", num_sms, MAX_SMS, "far above any GPU's"),
            ("heads_per_block", heads_per_block, max(n_head, 64), "at most n_head, or 64")):
        check_int_at_most(name, value, 1, high, why)
    split = check_bool("split", split)
    if min_ctx is not None:
        min_ctx = check_int("min_ctx", min_ctx, 0)
    head_blocks = -(-n_head // heads_per_block)
    slots = blocks_per_sm * num_sms

    def make(s: int, why: str) -> SplitPlan:
        return SplitPlan(n_ctx, n_head, heads_per_block, s, -(-n_ctx // s), head_blocks,
                         slots, num_sms, why, tile)

    if splits not in (None, "auto"):
        if isinstance(splits, bool) or int(splits) != splits or splits < 1:
            raise ValueError(f"splits must be 'auto' or an integer >= 1, got {splits!r}")
        if not split:
            raise ValueError("this variant does not split over context; splits must be 'auto'")
        return make(int(splits), "override")
    if not split:
        return make(1, "per_head: one block per head group walks all of n_ctx")
    gate = default_gate(heads_per_block) if min_ctx is None else min_ctx
    if n_ctx < gate:
        return make(1, f"below the split gate (n_ctx {n_ctx} < {gate})")
    max_s = max(1, min(cap, n_ctx // (min_tiles * tile)))
    cost = {s: make(s, "").cost() for s in range(1, max_s + 1)}
    best = min(cost.values())
    s = min(k for k, v in cost.items() if v <= best * _TIE)
    return make(s, f"auto: {head_blocks} head blocks x {s} splits on {slots} slots "
                   f"({blocks_per_sm}/SM x {num_sms} SMs)")


@dataclass(frozen=True)
class LatencyModel:
    """Microseconds of a variant's attention launch and of the merge, per the rule's model:

        attn    = launch + waves x (fixed + tiles_per_slice x tile)
        tile    = max(tile_us, blocks on an SM x sm_tile_us, slices streaming x tile bytes
                      / bandwidth)
        combine = merge_us + heads x merge_head_us + (slices - 1) x merge_slice_us

    A lone block is latency-bound (tile_us), blocks sharing an SM split its issue slots
    (sm_tile_us each), a full GPU is bandwidth-bound on the rows it streams (head blocks of
    one slice read the same rows, so the unique slices count). The constants are fit to the
    H200 sweep of 2026-12-01 (docs/schedule.md, docs/results.md): the table
    shows how well the model's shape fits, not an out-of-sample forecast."""

    launch_us: float       # the launch and drain of a kernel in a graph replay, cold L2
    fixed_us: float        # a block's fixed cost: its start, q staged, its partial written
    tile_us: float         # one tile of a lone block
    sm_tile_us: float      # SM time one block's tile takes when blocks share the SM
    merge_us: float = 11.4       # the combine at one slice (its launch, wv_b, the latent)
    merge_head_us: float = 0.025  # each head
    merge_slice_us: float = 0.017  # each further slice


H200_BANDWIDTH = 4.2e12   # B/s the attention kernels reach streaming the cache (mma16, 131072)
LATENCY_MODELS = {        # by (kernel family, heads per block)
    ("mma", 16): LatencyModel(2.0, 7.5, 2.3, 2.3),
    ("mma", 32): LatencyModel(2.0, 9.3, 3.4, 3.4),
    ("batched", 16): LatencyModel(2.0, 7.0, 4.4, 4.35),
    ("split", 1): LatencyModel(2.0, 3.7, 1.75, 0.52),
}


def latency_model(family: str, heads_per_block: int) -> LatencyModel:
    """The fitted model of a family at this many heads per block, else the nearest fitted
    one of the family (per_head is split's kernel)."""
    family = "split" if family == "per_head" else family
    fitted = [k for k in LATENCY_MODELS if k[0] == family]
    if not fitted:
        raise ValueError(f"no latency model for kernel family {family!r}")
    return LATENCY_MODELS[min(fitted, key=lambda k: abs(k[1] - heads_per_block))]


def predict_us(plan: SplitPlan, family: str, cache_bytes: int = 2, key_dim: int = 576,
               bandwidth: float = H200_BANDWIDTH) -> dict:
    """{"attn", "combine"} in microseconds for `plan` on kernel family `family`."""
    if check_real("bandwidth", bandwidth) <= 0:
        raise ValueError(f"bandwidth must be > 0 (bytes/s), got {bandwidth}")
    check_int("cache_bytes", cache_bytes, 1)
    check_int("key_dim", key_dim, 1)
    m = latency_model(family, plan.heads_per_block)
    waves = math.ceil(plan.blocks / plan.slots)
    active = min(plan.blocks, plan.slots)
    streaming = min(plan.splits, math.ceil(active / plan.head_blocks))
    tile = max(m.tile_us, math.ceil(active / plan.num_sms) * m.sm_tile_us,
               streaming * plan.tile * key_dim * cache_bytes / bandwidth * 1e6)
    attn = m.launch_us + waves * (m.fixed_us + plan.tiles_per_block() * tile)
    combine = m.merge_us + plan.n_head * m.merge_head_us + (plan.splits - 1) * m.merge_slice_us
    return {"attn": attn, "combine": combine}
