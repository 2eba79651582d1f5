"""Tensor parallelism over query heads: the bands, and every grid re-derived per band.

Each of N ranks computes a contiguous band of the H query heads for the whole batch (the
latent cache is shared by all heads in MLA, so every rank reads the whole cache for its
band). Bands are uneven when N does not divide H: the first H mod N ranks take
ceil(H / N) heads, the rest floor(H / N), so no two bands differ by more than one head.
N must be at least 1 and at most H (a rank with no head is an error).

Sharding divides the head axis, and the attention grid is head blocks x chunks x requests:
the same shard that cuts a rank's work by N also cuts its grid by N. So the chunk budget is
re-derived per band (``budget="band"``): chunks.plan_chunks with the band's head blocks,
which lets a request take more chunks as the band shrinks. ``budget="unsharded"`` keeps the
chunk count the full H would get (the constant a single-GPU engine tuned), with the band's
head blocks: the comparison that shows what re-deriving the budget is worth.

Nothing here needs a GPU: the CLI's `grid --tp` and `bench --tp` without a device print
these plans, and the launcher (tp_launch.py) sizes its steps from them.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .chunks import ChunkPlan, plan_chunks

__all__ = ["BUDGETS", "Band", "RankPlan", "check_tp", "head_bands", "band_of", "rank_plans",
           "fixed_facts", "unsharded_chunks", "rank_grids"]

BUDGETS = ("band", "unsharded")


@dataclass(frozen=True)
class Band:
    """Heads [start, stop) of rank `rank`."""

    rank: int
    start: int
    stop: int

    @property
    def heads(self) -> int:
        return self.stop - self.start

    @property
    def slice(self) -> slice:
        return slice(self.start, self.stop)

    def __str__(self) -> str:
        return f"rank {self.rank}: heads {self.start}..{self.stop - 1} ({self.heads})"


def check_tp(tp, n_head: int | None = None, gpus: int | None = None) -> int:
    """`tp` as an int, or a ValueError naming the limit it breaks: an integer >= 1, at most
    the heads (every rank needs a head), at most the visible GPUs (one rank per GPU)."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be an integer >= 1 (ranks, one per GPU), got {tp!r}")
    if n_head is not None and tp > n_head:
        raise ValueError(f"tp={tp} is more ranks than the {n_head} heads: every rank needs at "
                         f"least one head (tp <= {n_head})")
    if gpus is not None and tp > gpus:
        raise ValueError(f"tp={tp} needs {tp} GPUs (one rank per GPU), but {gpus} "
                         f"{'is' if gpus == 1 else 'are'} visible")
    return tp


def head_bands(n_head: int, tp: int) -> tuple[Band, ...]:
    """The N bands of H heads: contiguous, in rank order, sizes differing by at most one."""
    if isinstance(n_head, bool) or not isinstance(n_head, int) or n_head < 1:
        raise ValueError(f"n_head must be an integer >= 1, got {n_head!r}")
    check_tp(tp, n_head)
    base, extra = divmod(n_head, tp)
    bands, start = [], 0
    for r in range(tp):
        size = base + (1 if r < extra else 0)
        bands.append(Band(r, start, start + size))
        start += size
    return tuple(bands)


def band_of(n_head: int, tp: int, rank: int) -> Band:
    bands = head_bands(n_head, tp)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < tp:
        raise ValueError(f"rank must be an integer in 0..{tp - 1}, got {rank!r}")
    return bands[rank]


@dataclass(frozen=True)
class RankPlan:
    """The chunk plan of one rank's band, and how full it keeps the GPU."""

    band: Band
    plan: ChunkPlan
    budget: str

    @property
    def fill(self) -> float:
        """Programs of the grid per resident-block slot (1.0: one full wave)."""
        return self.plan.programs / self.plan.slots

    def as_dict(self) -> dict:
        p = self.plan
        return {"rank": self.band.rank, "heads": [self.band.start, self.band.stop],
                "n_heads": self.band.heads, "budget": self.budget,
                "head_blocks": p.head_blocks, "max_chunks": p.max_chunks,
                "grid": list(p.grid), "programs": p.programs, "slots": p.slots,
                "fill": self.fill, "min_chunk": p.min_chunk, "reason": p.reason}


def _head_blocks(s_q: int, heads: int, rows_per_block: int) -> int:
    return -(-(s_q * heads) // rows_per_block)


def fixed_facts(rows_per_block: int, tile: int, blocks_per_sm: int):
    """A `facts` of rank_plans for one kernel instance whatever the heads."""
    return lambda heads: (rows_per_block, tile, blocks_per_sm)


def unsharded_chunks(batch: int, s_q: int, n_head: int, facts, *, num_sms: int) -> int:
    """The chunks a request may take when all H heads run on one GPU (with the instance
    `facts(n_head)` names): the budget a band inherits under budget="unsharded"."""
    rows, tile, bps = facts(n_head)
    return plan_chunks(batch, _head_blocks(s_q, n_head, rows), num_sms=num_sms,
                       blocks_per_sm=max(1, bps), tile=tile).max_chunks


def as_unsharded(plan: ChunkPlan, chunks: int, n_head: int, batch: int) -> ChunkPlan:
    """`plan` (made with chunks=`chunks`, the unsharded budget), its reason saying so in
    place of plan_chunks's first clause (the override), its others kept (one pass for a
    table of one chunk, the second wave)."""
    why = (f"as if not sharded: the {chunks} chunks a request takes with all {n_head} heads "
           f"on one GPU, on {batch} requests x {plan.head_blocks} head blocks")
    rest = plan.reason.partition("; ")[2]
    return replace(plan, reason=f"{why}; {rest}" if rest else why)


def rank_plans(batch: int, s_q: int, n_head: int, tp: int, facts, *, num_sms: int,
               budget: str = "band", splits: int | None = None,
               max_len: int | None = None) -> list[RankPlan]:
    """Every rank's chunk plan. `facts(heads)` -> (rows per block, tile, blocks/SM) of the
    attention instance a step of that many heads runs ("auto" picks by the rows as well as
    the step's facts, so a band may run another instance than all heads would). `splits`
    overrides both budgets (every rank, every request up to that many chunks), as on one
    GPU."""
    if budget not in BUDGETS:
        raise ValueError(f"budget must be one of {', '.join(BUDGETS)}, got {budget!r}")
    inherited = None
    if splits is None and budget == "unsharded":
        inherited = unsharded_chunks(batch, s_q, n_head, facts, num_sms=num_sms)
    out = []
    for band in head_bands(n_head, tp):
        rows, tile, bps = facts(band.heads)
        hb = _head_blocks(s_q, band.heads, rows)
        kw = dict(num_sms=num_sms, blocks_per_sm=max(1, bps), tile=tile, max_len=max_len)
        if inherited is not None:
            plan = as_unsharded(plan_chunks(batch, hb, chunks=inherited, **kw), inherited,
                                n_head, batch)
        else:
            plan = plan_chunks(batch, hb, chunks=splits, **kw)
        out.append(RankPlan(band, plan, budget))
    return out


def rank_grids(variant: str, heads: int, ctx: int, tp: int, **grid_kw) -> list[dict]:
    """Batch-1 launch geometry per rank (geometry.grid_report at the band's heads), with the
    band's own split budget and, beside it, the split count all H heads would get."""
    from .geometry import grid_report

    full = grid_report(variant, heads, ctx, **grid_kw)
    rows, seen = [], {}
    for band in head_bands(heads, tp):
        if band.heads not in seen:   # uneven bands: two sizes at most
            g = grid_report(variant, band.heads, ctx, **grid_kw)
            kw = {k: v for k, v in grid_kw.items() if k != "splits"}
            u = grid_report(variant, band.heads, ctx, splits=full["splits"], **kw) \
                if full["combine"] or full["splits"] > 1 else g
            seen[band.heads] = (g, u)
        g, u = seen[band.heads]
        rows.append({"rank": band.rank, "heads": [band.start, band.stop], "band": g,
                     "unsharded": {k: u[k] for k in ("grid", "blocks", "splits", "waves",
                                                     "idle_sms")}})
    return rows
