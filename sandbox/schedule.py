"""A float32 NumPy model of the attention kernels' SCHEDULES, at the real dims.

The correctness gate on a device runs at short context, below the split gate, so it takes the
un-split path and cannot see the split or batched code: a path the gate cannot reach. This
model runs the same schedules on the CPU at any context, so tests reach them at 12289 or 20000
tokens without a GPU: it models the schedule, not the kernel.

What is modelled exactly as the kernels do it:

* Contiguous slices from `splits.slice_bounds`, the kernel's own arithmetic.
* Per block, an online softmax over tiles of `tile` rows: per tile, m_new = max(m, tile max),
  alpha = exp(m - m_new), p = exp(s - m_new), l = l*alpha + sum(p), and
  acc = acc*alpha followed by the tile's rows added ONE AT A TIME, in order, in f32. That is
  what a thread that owns a few latent columns does with its FMA chain, and it is the
  summation order that decides the accuracy (why splitting can improve it): a NumPy
  reduction over a non-innermost axis adds in order (tests/test_schedule.py pins that
  assumption).
* Positions past a slice's end are zero rows with score -inf (the kernels zero-fill their
  cp.async loads), so nothing at or past n_ctx is ever read: NaN rows cannot leak.
* Empty slices (splits > n_ctx) stay neutral: m = -inf, l = 0, acc = 0, never NaN.
* The combine: m = max_i m_i, w_i = exp(m_i - m), l = sum_i l_i w_i, acc = sum_i acc_i w_i
  (in slice order), latent = acc / l, lse = m + log l, and only THEN out = wv_b @ latent.
  `rescale=False` drops the w_i: the negative control, which any real check must reject.
* batched: heads in groups of `heads_per_block`; the last partial group is padded with
  zero-query heads whose results are masked off, not dropped from the grid.
* `lazy`: the lazy max of attn_rows, tiled16 and mma. A head's reference max moves only when
  a tile's max exceeds it by more than `lazy` (natural log units; the kernels' 8 in log2 is
  8 ln 2), so p can reach e^lazy; 0 is the eager max of attn<HPB> (batched).

Not modelled: attn_rows (per_head, split) runs four chains per block, one per warp over its
8 rows of each tile (two rows a step), merged at the slice's end like slices in the combine;
the model runs one chain per block (the GPU tests check the kernel itself against the
float64 reference). Nor the order inside the 576-term score dot products (BLAS here), or the
fast exp2 approximation: both are O(1 ulp) per term and do not grow with n_ctx.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import numpy as np

from .bf16 import as_f32
from .compare import DEFAULT_TOLERANCE, rel_l2
from .dims import Dims, check_inputs, preset
from .inputs import make_inputs
from .limits import (INT32_MAX, MAX_CTX, MAX_HEADS, MAX_SPLITS, check_flags,
                     check_host_memory, check_int_at_most, check_real)
from .reference import DecodeResult, decode, to_host
from .registry import ATTN_TILE
from .splits import plan_splits, slice_bounds

__all__ = ["SCHEDULES", "run_schedule", "AccuracyRow", "StudyVerdict", "accuracy_study",
           "study_splits", "splits_with_power", "judge_study", "DEFAULT_STUDY_DIMS"]

SCHEDULES = ("per_head", "split", "batched")

# Elements of the per-step [slices, heads, tile+1, kv_lora] work array before the model
# processes slices in chunks (16M f32 = 64 MB), so splits ~ n_ctx stays within memory.
_STEP_ELEMENTS = 1 << 24

# The accuracy study runs at 12 heads: 96 heads sharded over 8 ranks (head sharding).
DEFAULT_STUDY_DIMS = preset("h96-tp8")


def _check_schedule(schedule, splits, heads_per_block, tile) -> tuple[int, int, int]:
    """(splits, heads_per_block, tile) as ints, checked against the schedule."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    splits = check_int_at_most("splits", splits, 1, MAX_SPLITS, "the grid's y dimension")
    heads_per_block = check_int_at_most("heads_per_block", heads_per_block, 1,
                                        INT32_MAX - MAX_HEADS, "n_head's int32 headroom "
                                        "holds one head block of at most that many heads")
    tile = check_int_at_most("tile", tile, 1, MAX_CTX, "a tile is at most the longest context")
    if schedule == "per_head" and splits != 1:
        raise ValueError(
            f"per_head walks all of n_ctx in one block: splits must be 1, got {splits}")
    if schedule in ("per_head", "split") and heads_per_block != 1:
        raise ValueError(f"{schedule} serves one head per block: heads_per_block must be 1, "
                         f"got {heads_per_block} (use schedule='batched')")
    return splits, heads_per_block, tile


def _attend(q_group, cache_pad, n_ctx, splits, slice_ids, tile, scale, kv_lora, lazy=0.0):
    """Partials (m [S, G], l [S, G], acc [S, G, kv_lora]) of the given slices for G heads,
    all slices advancing in lockstep, one tile per step.

    `cache_pad` holds rows 0..n_ctx-1 and one zero row at index n_ctx, where every position
    outside a slice points.
    """
    bounds = np.array([slice_bounds(n_ctx, splits, int(s)) for s in slice_ids], dtype=np.int64)
    starts, ends = bounds[:, 0], bounds[:, 1]
    longest = int((ends - starts).max(initial=0))
    # A tile never spans more positions than the longest slice holds: the masked tail of a
    # wider tile would only add exact zeros, so narrowing it changes no bit.
    width = max(1, min(tile, longest))
    steps = -(-longest // tile)
    n_slices, n_heads = len(slice_ids), q_group.shape[0]

    m = np.full((n_slices, n_heads), -np.inf, dtype=np.float32)
    l = np.zeros((n_slices, n_heads), dtype=np.float32)
    acc = np.zeros((n_slices, n_heads, kv_lora), dtype=np.float32)
    terms = np.empty((n_slices, n_heads, width + 1, kv_lora), dtype=np.float32)
    offsets = np.arange(width)
    scale32 = np.float32(scale)
    for k in range(steps):
        pos = starts[:, None] + k * tile + offsets            # [S, width]
        valid = pos < ends[:, None]
        rows = cache_pad[np.where(valid, pos, n_ctx)]         # [S, width, key_dim]
        s = np.matmul(q_group[None], rows.transpose(0, 2, 1)) * scale32   # [S, G, width]
        s = np.where(valid[:, None, :], s, np.float32(-np.inf))
        t_max = s.max(axis=2)
        # lazy = 0 is np.maximum(m, t_max); m = -inf moves on the first valid tile whatever
        # lazy is (lazy = inf is then "never again": the negative control of the lazy max)
        with np.errstate(invalid="ignore"):
            move = (m == -np.inf) | (t_max > m + np.float32(lazy))
        m_new = np.where(move, t_max, m)
        # Until a slice has seen a position its max is -inf, and exp(-inf - -inf) is NaN:
        # those (slice, head) pairs take a finite reference and stay exactly neutral.
        seen = m_new > -np.inf
        m_ref = np.where(seen, m_new, np.float32(0))
        alpha = np.where(seen, np.exp(m - m_ref), np.float32(1))
        p = np.exp(s - m_ref[:, :, None])                     # exactly 0 where masked
        l = l * alpha + p.sum(axis=2)
        terms[:, :, 0] = acc * alpha[:, :, None]
        np.multiply(p[:, :, :, None], rows[:, None, :, :kv_lora], out=terms[:, :, 1:])
        acc = terms.sum(axis=2)  # in order, position by position (non-innermost axis)
        m = m_new
    return m, l, acc


def _combine(m, l, acc, rescale):
    """Merge [S, G] partials into (latent [G, kv_lora], lse [G]), f32, in slice order."""
    m_all = m.max(axis=0)
    if rescale:
        # Empty slices have m_i = -inf, so their weight is exp(-inf) = 0, never NaN.
        w = np.exp(m - m_all[None, :])
    else:
        w = np.ones_like(m)
    l_all = (l * w).sum(axis=0)
    acc_all = (acc * w[:, :, None]).sum(axis=0)
    latent = acc_all / l_all[:, None]
    lse = m_all + np.log(l_all)
    return latent, lse


def run_schedule(q, cache, wv_b, n_ctx: int | None = None, scale: float | None = None, *,
                 schedule: str = "per_head", splits: int = 1, heads_per_block: int = 1,
                 tile: int = ATTN_TILE, rescale: bool = True, lazy: float = 0.0) -> DecodeResult:
    """Run one decode step under a kernel schedule, in float32. Returns f32 NumPy arrays."""
    dims, n_ctx, scale, _ = check_inputs(q, cache, wv_b, n_ctx, scale)
    splits, heads_per_block, tile = _check_schedule(schedule, splits, heads_per_block, tile)
    if check_real("lazy", lazy) < 0:
        raise ValueError(f"lazy must be >= 0 (natural log units), got {lazy!r}")
    check_flags(rescale=rescale)
    check_host_memory(n_ctx, dims.n_head, dims.key_dim, engine="the schedule model")
    q32 = as_f32(to_host(q))
    wv32 = as_f32(to_host(wv_b))
    cache_pad = np.zeros((n_ctx + 1, dims.key_dim), dtype=np.float32)
    cache_pad[:n_ctx] = as_f32(to_host(cache[:n_ctx]))

    hpb = heads_per_block if schedule == "batched" else dims.n_head
    latent = np.empty((dims.n_head, dims.kv_lora), dtype=np.float32)
    lse = np.empty(dims.n_head, dtype=np.float32)
    for h0 in range(0, dims.n_head, hpb):
        heads = min(hpb, dims.n_head - h0)
        q_group = np.zeros((hpb, dims.key_dim), dtype=np.float32)  # padded heads: q = 0
        q_group[:heads] = q32[h0:h0 + heads]
        chunk = max(1, _STEP_ELEMENTS // (hpb * (min(tile, n_ctx) + 1) * dims.kv_lora))
        parts = [_attend(q_group, cache_pad, n_ctx, splits, np.arange(s0, min(splits, s0 + chunk)),
                         tile, scale, dims.kv_lora, lazy)
                 for s0 in range(0, splits, chunk)]
        m, l, acc = (np.concatenate([p[i] for p in parts]) for i in range(3))
        lat, ls = _combine(m, l, acc, rescale)
        latent[h0:h0 + heads] = lat[:heads]  # the masked heads are computed, never written
        lse[h0:h0 + heads] = ls[:heads]
    # The projection needs the merged latent, so it runs after the combine, never per slice.
    out = np.matmul(wv32, latent[:, :, None])[:, :, 0]
    return DecodeResult(out=out, latent=latent, lse=lse)


@dataclass(frozen=True)
class AccuracyRow:
    """relL2(latent) against the float64 reference for one (n_ctx, seed)."""

    n_ctx: int
    seed: int
    splits: int
    unsplit: float            # per_head: one slice, sequential over all n_ctx
    split: float              # `splits` contiguous slices + the combine
    split_no_rescale: float   # the negative control (NaN where it cannot differ: fewer than
                              # two non-empty slices, splits_with_power)

    @property
    def gain(self) -> float:
        """How many times more accurate the split is than the unsplit walk."""
        return self.unsplit / self.split if self.split > 0 else math.inf

    @property
    def control_applies(self) -> bool:
        return splits_with_power(self.n_ctx, self.splits)


@dataclass(frozen=True)
class StudyVerdict:
    ok: bool
    problems: tuple
    median_gain: float

    def __bool__(self) -> bool:
        return self.ok


def study_splits(n_ctx: int, splits="auto", dims: Dims = DEFAULT_STUDY_DIMS, *,
                 num_sms: int = 132, blocks_per_sm: int = 2) -> int:
    """The split count accuracy_study runs `n_ctx` with (HPB = 1, as it does)."""
    return plan_splits(n_ctx, dims.n_head, 1, num_sms=num_sms, blocks_per_sm=blocks_per_sm,
                       splits=None if splits == "auto" else splits).splits


def splits_with_power(n_ctx: int, s: int) -> bool:
    """Whether a split of `n_ctx` into `s` slices of ceil(n_ctx / s) positions leaves two or
    more slices non-empty. With one, the merge has nothing to rescale: the combine without
    its rescale gives the same latent, and its negative control cannot fail."""
    return s > 1 and n_ctx > -(-n_ctx // s)


def accuracy_study(n_ctxs, seeds, splits="auto", dims: Dims = DEFAULT_STUDY_DIMS,
                   tile: int = ATTN_TILE, *, num_sms: int = 132, blocks_per_sm: int = 2,
                   cache_dtype: str = "f16", q_dtype: str = "f32") -> list:
    """Unsplit vs split vs split-without-rescale, relL2(latent) vs float64, per (n_ctx, seed).

    `splits` is an int, or "auto" for the plan `mlasandbox` would launch (split gate, budget on
    head blocks x splits against num_sms x blocks_per_sm slots; HPB = 1).
    """
    rows = []
    for n_ctx in n_ctxs:
        s = study_splits(n_ctx, splits, dims, num_sms=num_sms, blocks_per_sm=blocks_per_sm)
        for seed in seeds:
            inp = make_inputs(dims, n_ctx, n_ctx, cache_dtype=cache_dtype, q_dtype=q_dtype,
                              seed=seed)
            args = inp.decode_args()
            want = decode(**args).latent
            unsplit = run_schedule(**args, schedule="per_head", tile=tile).latent
            split = run_schedule(**args, schedule="split", splits=s, tile=tile).latent
            control = (run_schedule(**args, schedule="split", splits=s, tile=tile,
                                    rescale=False).latent
                       if splits_with_power(n_ctx, s) else None)
            rows.append(AccuracyRow(
                n_ctx=int(n_ctx), seed=int(seed), splits=s,
                unsplit=rel_l2(unsplit, want), split=rel_l2(split, want),
                split_no_rescale=rel_l2(control, want) if control is not None else math.nan))
    return rows


def judge_study(rows, tol: float | None = None, min_median_gain: float = 1.0) -> StudyVerdict:
    """Pass when every unsplit and split error is within `tol` (the latent tolerance by
    default), every negative control exceeds it, at least one row exercised the control
    (a check that never ran has not passed), and the split is not less accurate than the
    unsplit walk in the median over the rows that split (shorter f32 sums per slice make a
    correct split more accurate, so a split that degrades accuracy has a wrong combine).
    """
    if tol is None:
        tol = DEFAULT_TOLERANCE.latent
    problems = []
    for r in rows:
        where = f"n_ctx={r.n_ctx} seed={r.seed} S={r.splits}"
        if not r.unsplit <= tol:
            problems.append(f"{where}: unsplit relL2 {r.unsplit:.3e} > {tol:.1e}")
        if not r.split <= tol:
            problems.append(f"{where}: split relL2 {r.split:.3e} > {tol:.1e}")
        if r.control_applies and not r.split_no_rescale > tol:
            problems.append(f"{where}: the combine without rescale passed "
                            f"({r.split_no_rescale:.3e} <= {tol:.1e}): the check has no power")
    split_rows = [r for r in rows if r.control_applies]
    if not split_rows:
        problems.append("no row split the context (all S = 1): the split path and the "
                        "negative control never ran")
        median_gain = math.nan
    else:
        median_gain = statistics.median(r.gain for r in split_rows)
        if not median_gain >= min_median_gain:
            problems.append(f"median accuracy gain of the split {median_gain:.2f}x "
                            f"< {min_median_gain:.2f}x: splitting made it less accurate")
    return StudyVerdict(ok=not problems, problems=tuple(problems), median_gain=median_gain)
