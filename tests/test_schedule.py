"""The split and batched schedules, tested where the short-context gate cannot reach them
(a gate on a device runs below the split gate, so it cannot reach them): at depth, at the slice boundaries, with empty slices, with a partial
head group, and against a negative control that shows the check has power.

Every input is fresh per run (see conftest.py); a failure prints how to replay it.
"""
from __future__ import annotations

import statistics

import numpy as np
import pytest

from mlasandbox.compare import DEFAULT_TOLERANCE, compare, rel_l2
from mlasandbox.dims import Dims, preset
from mlasandbox.inputs import RISING_SPAN, make_inputs, make_rising_inputs
from mlasandbox.reference import decode
from mlasandbox.schedule import (AccuracyRow, accuracy_study, judge_study, run_schedule,
                                 splits_with_power)
from mlasandbox.splits import SPLIT_MIN_CTX, plan_splits, slice_bounds
from tolerances import f32_error_scale

SHARD = preset("h96-tp8")   # 12 heads at the real 576 / 512 / 128: a 96-head model's 8-way shard
DEPTH = 20000                # a depth where the split's accuracy gain is well above noise
TOL = DEFAULT_TOLERANCE


def planned_splits(n_ctx, n_head, hpb=1):
    return plan_splits(n_ctx, n_head, hpb, num_sms=132, blocks_per_sm=2).splits


def test_numpy_adds_along_a_non_inner_axis_in_order(seeds):
    # The model's accumulation order rests on this: the sum over the tile axis of
    # [S, G, tile+1, kv] adds position by position, like a thread's FMA chain, not pairwise.
    rng = np.random.default_rng(seeds.one())
    x = (rng.standard_normal((3, 2, 33, 512)) * 10.0 ** rng.uniform(-4, 4, (3, 2, 33, 1))
         ).astype(np.float32)
    in_order = x[:, :, 0].copy()
    for t in range(1, 33):
        in_order = in_order + x[:, :, t]
    np.testing.assert_array_equal(x.sum(axis=2), in_order, err_msg=str(seeds))


# ---- accuracy at depth (the split's summation order) -------------------------------------------------

@pytest.fixture(scope="module")
def depth_study(module_seeds):
    seeds = module_seeds.take(8)
    return accuracy_study([DEPTH], seeds, "auto", dims=SHARD), module_seeds


def test_split_is_at_least_as_accurate_as_unsplit_at_long_context(depth_study):
    rows, seeds = depth_study
    for r in rows:
        print(f"\nn_ctx={r.n_ctx} S={r.splits} seed={r.seed}: relL2(latent) unsplit "
              f"{r.unsplit:.3e}  split {r.split:.3e}  ({r.gain:.1f}x more accurate)")
    assert all(r.splits > 1 for r in rows), "the plan did not split at depth"
    # Every seed must gain, and the median must show the pairwise-summation effect, not a
    # coin flip. Derivation (tests/tolerances.py): an f32 chain's rms error grows like
    # sqrt(its length), and the split's chains are 909 rows plus a 22-term combine, so the
    # rounding model predicts 3.6-3.8x between their rms (it overcounts the split's share of
    # the score error, common to both). One seed's gain is a ratio of two errors that a few
    # heavy positions dominate, so it has a low tail: over 240 seeds of this model at 20000
    # (seeds 1000-1039 and 5000-5199) the median gain was 4.6-4.7, 2.5% of seeds fell below
    # 3 and the lowest was 1.36 (a per-seed floor of 1.5 failed one run in ~50). So each
    # seed must be at least as accurate (>= 1), and the median of 8 must reach 3: with 2.5%
    # of seeds below 3, four of eight fall there about 3 times in 100,000 runs.
    gains = [r.gain for r in rows]
    assert min(gains) >= 1.0, f"gains {gains} {seeds}"
    assert statistics.median(gains) >= 3.0, f"gains {gains} {seeds}"


def test_the_negative_control_fails_the_check_the_real_combine_passes(depth_study):
    rows, seeds = depth_study
    for r in rows:
        print(f"\nseed={r.seed}: relL2(latent) combine {r.split:.3e}, "
              f"without exp(m_i - m) {r.split_no_rescale:.3e} (limit {TOL.latent:.0e})")
        # TOL is compare's default: above MARGIN x the model's rms of an unsplit chain at
        # 20000 (1.7e-5) and at 131072 (4.3e-5), see tests/test_tolerances.py
        assert r.unsplit <= TOL.latent and r.split <= TOL.latent, f"{r} {seeds}"
        # not a near miss: the control is off by orders of magnitude
        assert r.split_no_rescale > 100 * TOL.latent, f"{r} {seeds}"
    verdict = judge_study(rows)
    assert verdict.ok, f"{verdict.problems} {seeds}"


def test_the_full_comparison_rejects_the_combine_without_rescale(seeds):
    inp = make_inputs(SHARD, n_alloc=5000, n_ctx=4097, seed=seeds.one())
    args = inp.decode_args()
    ref = decode(**args)
    s = planned_splits(4097, SHARD.n_head)
    good = compare(run_schedule(**args, schedule="split", splits=s), ref)
    bad = compare(run_schedule(**args, schedule="split", splits=s, rescale=False), ref)
    assert good.ok, f"{good.summary()} {seeds}"
    assert not bad.ok and not bad.latent.ok and not bad.out.ok and not bad.lse.ok, \
        f"{bad.summary()} {seeds}"


def test_below_the_split_gate_a_missing_rescale_is_invisible(seeds):
    # Why the gate cannot test the combine: with one slice exp(m_0 - m) = 1, so dropping it
    # changes no bit. The negative control only has power where the context is split.
    n_ctx = SPLIT_MIN_CTX - 1
    assert planned_splits(n_ctx, SHARD.n_head) == 1
    inp = make_inputs(SHARD, n_alloc=n_ctx, seed=seeds.one())
    with_rescale = run_schedule(**inp.decode_args(), schedule="split", splits=1)
    without = run_schedule(**inp.decode_args(), schedule="split", splits=1, rescale=False)
    np.testing.assert_array_equal(with_rescale.latent, without.latent)
    np.testing.assert_array_equal(with_rescale.lse, without.lse)


@pytest.mark.parametrize("n_ctx, s", [(1, 4), (2, 4), (3, 2), (5, 4), (9, 1), (64, 64)])
def test_the_control_has_power_exactly_where_two_slices_hold_positions(n_ctx, s, seeds):
    # splits_with_power decides which study rows carry the negative control: it must say
    # yes exactly where dropping the rescale changes the latent (two or more non-empty
    # slices, whose maxima differ on random scores), no where it changes no bit
    inp = make_inputs(SHARD, n_alloc=n_ctx, seed=seeds.one())
    with_rescale = run_schedule(**inp.decode_args(), schedule="split", splits=s).latent
    without = run_schedule(**inp.decode_args(), schedule="split", splits=s,
                           rescale=False).latent
    assert splits_with_power(n_ctx, s) == (not np.array_equal(with_rescale, without)), seeds


def _row(**kw):
    base = dict(n_ctx=DEPTH, seed=0, splits=22, unsplit=2e-6, split=3e-7, split_no_rescale=0.3)
    base.update(kw)
    return AccuracyRow(**base)


@pytest.mark.parametrize("rows, complaint", [
    ([_row(split_no_rescale=5e-5)], "no power"),
    ([_row(split=3e-6)], "less accurate"),
    ([_row(split=2e-4)], "split relL2"),
    ([_row(unsplit=float("nan"))], "unsplit relL2"),
    ([_row(splits=1, split=2e-6, split_no_rescale=float("nan"))], "never ran"),
    ([_row(n_ctx=1, splits=4, split=2e-6, split_no_rescale=float("nan"))], "never ran"),
])
def test_the_study_verdict_catches_each_kind_of_failure(rows, complaint):
    assert judge_study([_row()]).ok  # the baseline row passes...
    verdict = judge_study(rows)       # ...and each doctored one does not
    assert not verdict.ok
    assert any(complaint in p for p in verdict.problems), verdict.problems


# ---- boundaries of the split arithmetic ------------------------------------------------------

BOUNDARIES = [1, 4095, 4096, 4097, 12287, 12288, 12289, 20000]


@pytest.mark.parametrize("n_ctx", BOUNDARIES)
def test_every_split_count_matches_the_reference_at_the_boundaries(n_ctx, seeds):
    inp = make_inputs(SHARD, n_alloc=n_ctx + 3, n_ctx=n_ctx, seed=seeds.one())
    args = inp.decode_args()
    ref = decode(**args)
    planned = planned_splits(n_ctx, SHARD.n_head)
    # the plan's S, odd counts whose slices end mid-tile, and more slices than tiles
    counts = sorted({planned, 3, 7, 64, max(1, n_ctx // 2 + 1)})
    results = {"per_head": run_schedule(**args, schedule="per_head")}
    for s in counts:
        results[f"split S={s}"] = run_schedule(**args, schedule="split", splits=s)
    for name, result in results.items():
        c = compare(result, ref)
        assert c.ok, f"n_ctx={n_ctx} {name} (plan S={planned}):\n{c.summary()}\n{seeds}"


def test_slices_cover_the_context_exactly_once():
    # The model trusts splits.slice_bounds; check the partition it walks, at the boundaries.
    for n_ctx in BOUNDARIES:
        for s_count in {1, 2, 3, 7, 64, planned_splits(n_ctx, 12), n_ctx, n_ctx + 5}:
            bounds = [slice_bounds(n_ctx, s_count, s) for s in range(s_count)]
            covered = np.concatenate([np.arange(a, b) for a, b in bounds])
            np.testing.assert_array_equal(covered, np.arange(n_ctx),
                                          err_msg=f"n_ctx={n_ctx} S={s_count}")


# ---- empty slices, NaN past n_ctx, partial head groups --------------------------------------

@pytest.mark.parametrize("n_ctx", [1, 5, 50])
def test_empty_slices_stay_neutral(n_ctx, seeds):
    inp = make_inputs(SHARD, n_alloc=n_ctx, seed=seeds.one())
    args = inp.decode_args()
    exact_fit = run_schedule(**args, schedule="split", splits=n_ctx)
    for s in (n_ctx + 1, 2 * n_ctx + 3, 256):
        padded = run_schedule(**args, schedule="split", splits=s)
        for name in ("out", "latent", "lse"):
            got = getattr(padded, name)
            assert np.isfinite(got).all(), f"S={s} > n_ctx={n_ctx}: NaN in {name} {seeds}"
            # empty slices weigh exp(-inf) = 0 and add exact zeros: the same bits
            np.testing.assert_array_equal(got, getattr(exact_fit, name),
                                          err_msg=f"S={s} vs S={n_ctx} {seeds}")
    assert compare(exact_fit, decode(**args)).ok


@pytest.mark.parametrize("schedule, kw", [("per_head", {}), ("split", {"splits": 5}),
                                          ("batched", {"splits": 5, "heads_per_block": 4})])
@pytest.mark.parametrize("cache_dtype", ["f16", "bf16"])
def test_nan_rows_past_n_ctx_never_leak(schedule, kw, cache_dtype, seeds):
    n_ctx = 4097
    inp = make_inputs(SHARD, n_alloc=n_ctx + 77, n_ctx=n_ctx, cache_dtype=cache_dtype,
                      seed=seeds.one())
    poisoned = run_schedule(**inp.decode_args(), schedule=schedule, **kw)
    clean = run_schedule(inp.q, inp.cache[:n_ctx].copy(), inp.wv_b, schedule=schedule, **kw)
    for name in ("out", "latent", "lse"):
        assert np.isfinite(getattr(poisoned, name)).all(), f"{name} {seeds}"
        np.testing.assert_array_equal(getattr(poisoned, name), getattr(clean, name))


@pytest.mark.parametrize("n_head, hpb", [(13, 4), (3, 16), (12, 12), (16, 12)])
def test_batched_masks_the_last_partial_head_group(n_head, hpb, seeds):
    dims = Dims(n_head=n_head)
    inp = make_inputs(dims, n_alloc=5000, seed=seeds.one())
    args = inp.decode_args()
    splits = planned_splits(5000, n_head, hpb)
    batched = run_schedule(**args, schedule="batched", heads_per_block=hpb, splits=splits)
    c = compare(batched, decode(**args))
    assert c.ok, f"H={n_head} HPB={hpb} S={splits}:\n{c.summary()}\n{seeds}"
    # Per head, batching shares the cache pass and changes nothing else: the last group's
    # heads agree with the one-head-per-block split as closely as any other head.
    split = run_schedule(**args, schedule="split", splits=splits)
    # Both round the same slices' chains but their score GEMMs differ (another head count
    # picks another BLAS kernel), so each is its own f32 result: by the triangle inequality
    # they differ by at most twice the bound a correct f32 schedule keeps from float64
    # (tests/tolerances.py: MARGIN x an rms of 1-3e-6 per head here). A wrong mask writes
    # a padded zero-query head's uniform average, or another head's result: relL2 O(1),
    # more than 1e4 x the bound.
    scale = f32_error_scale(**args, splits=splits)
    uniform = inp.cache[:inp.n_ctx, :dims.kv_lora].astype(np.float64).mean(axis=0)
    for h in range(n_head):
        bound = 2 * scale.latent_bound(h)
        assert rel_l2(batched.latent[h], split.latent[h]) < bound, f"head {h} {seeds}"
        assert rel_l2(uniform, split.latent[h]) > 1e4 * bound, f"head {h} {seeds}"


# ---- tiled16's lazy max ----------------------------------------------------------------------

LAZY_LOG2 = 8.0  # kLazyLog2 of cuda_src/mla_common.cuh (tiled16, mma), in log2 units


@pytest.mark.parametrize("cache_dtype", ["f16", "bf16"])
def test_rising_inputs_climb_far_enough_to_overflow_a_max_that_never_moves(cache_dtype, seeds):
    """make_rising_inputs must give the rescale path its power: from the first 64-row tile to
    the last, every head's max score climbs by more than 2^128 can hold (88.7 natural)."""
    inp = make_rising_inputs(Dims(n_head=5), 4100, 4095, cache_dtype=cache_dtype,
                             seed=seeds.one())
    from mlasandbox.bf16 import as_f64
    s = inp.scale * as_f64(inp.q) @ as_f64(inp.cache[:inp.n_ctx]).T        # [H, n]
    climb = s[:, -64:].max(axis=1) - s[:, :64].max(axis=1)
    assert (climb > 88.7).all() and (climb < RISING_SPAN + 20).all(), f"{climb} {seeds}"
    assert np.isnan(as_f64(inp.cache[inp.n_ctx:])).all(), "rows past n_ctx stay NaN"


def test_the_lazy_max_is_as_accurate_as_the_eager_one_and_never_moving_it_overflows(seeds):
    """The model of tiled16's schedule (16 heads, 32-row tiles) on scores that keep rising:
    moving the max only past 2^8 gives the eager max's accuracy; never moving it after the
    first tile (the GPU tests' broken build) overflows, and the check rejects it."""
    inp = make_rising_inputs(Dims(n_head=16), 4100, 4095, seed=seeds.one())
    args = inp.decode_args()
    ref = decode(**args)
    kw = dict(schedule="batched", heads_per_block=16, tile=32)
    eager = compare(run_schedule(**args, **kw), ref)
    lazy = compare(run_schedule(**args, **kw, lazy=LAZY_LOG2 * np.log(2)), ref)
    with np.errstate(over="ignore", invalid="ignore"):
        never = compare(run_schedule(**args, **kw, lazy=1e30), ref)
    assert eager.ok and lazy.ok, f"{eager.summary()}\n{lazy.summary()} {seeds}"
    # p up to 2^8 instead of 1 changes no relative rounding, so both stay within the one
    # bound an f32 chain over these 4095 rows keeps (tests/tolerances.py, ~1.2e-5 for
    # these climbing scores; both measure ~1e-6); never moving the max overflows to inf/NaN
    bound = f32_error_scale(**args).latent_bound()
    assert max(eager.latent.value, lazy.latent.value) < bound, \
        f"{eager.summary()}\n{lazy.summary()}\nbound {bound:.2e} {seeds}"
    assert not never.ok, f"{never.summary()} {seeds}"


# ---- argument checks -------------------------------------------------------------------------

@pytest.mark.parametrize("kw, match", [
    (dict(schedule="per_head", splits=2), "splits must be 1"),
    (dict(schedule="split", heads_per_block=4), "heads_per_block must be 1"),
    (dict(schedule="tiled"), "schedule must be one of"),
    (dict(schedule="split", splits=0), "splits must be an integer >= 1"),
    (dict(schedule="batched", heads_per_block=4, tile=0), "tile"),
    (dict(schedule="batched", heads_per_block=2, lazy=-1.0), "lazy must be >= 0"),
])
def test_run_schedule_rejects_bad_arguments_by_name(kw, match, seeds):
    inp = make_inputs(Dims(n_head=2), n_alloc=8, seed=seeds.one())
    with pytest.raises(ValueError, match=match):
        run_schedule(**inp.decode_args(), **kw)


def test_the_split_gate_is_split_s_alone():
    # one head per block (split) keeps the split gate, or the one given; blocks serving
    # several heads have none, and the latency model sizes their slices instead
    from mlasandbox.splits import SPLIT_MIN_CTX, default_gate, plan_splits

    assert default_gate(1) == SPLIT_MIN_CTX and default_gate(1, 8192) == 8192
    assert default_gate(16) == default_gate(16, 8192) == 1
    assert default_gate(2) == 1   # batched2, the smallest multi-head block
    assert plan_splits(4095, 96, 1, num_sms=132, blocks_per_sm=5).splits == 1
    batched = plan_splits(4095, 96, 16, num_sms=132, blocks_per_sm=2)
    assert batched.splits > 1 and batched.blocks <= batched.slots   # one wave
    assert plan_splits(4095, 96, 16, num_sms=132, blocks_per_sm=2, min_ctx=4096).splits == 1


# ---- the short-context rule and its latency model ------------------------------------------

@pytest.mark.parametrize("n_ctx,heads,hpb,splits", [
    (64, 16, 16, 1),         # one tile: a single pass
    (1024, 16, 16, 16),      # 16 tiles: one a block, 16 of 132 SMs busy for one tile-step
    (4096, 16, 16, 64),      # 64 tiles: still one a block
    (4096, 128, 32, 32),     # 4 head blocks: 33 slices would be 132 blocks of 2 tiles too,
                             # the smallest within 2% wins
    (131072, 16, 16, 128),   # one wave of 16-tile slices
    (100, 16, 16, 1),        # 1.6 tiles: a slice is at least a whole tile, so one
    (1000, 16, 16, 8),       # 15.6 tiles: at most 15 slices of a tile or more, so two
                             # tiles a slice whatever S, and the fewest slices that give it
])
def test_short_caches_cover_the_sms_with_one_or_two_tiles_a_block(n_ctx, heads, hpb, splits):
    plan = plan_splits(n_ctx, heads, hpb, num_sms=132, blocks_per_sm=1, tile=64)
    assert plan.splits == splits
    assert plan.single_pass == (splits == 1)
    assert plan.blocks <= plan.slots or plan.tiles_per_block() <= 2


def test_the_rule_takes_the_least_cost_and_the_old_floor_was_slower():
    # at 1024 positions the 4-tile floor gave 4 slices; the model prices them above 16
    from mlasandbox.splits import FIXED_TILES, MERGE_TILES

    best = plan_splits(1024, 16, 16, num_sms=132, blocks_per_sm=1, tile=64)
    floor = plan_splits(1024, 16, 16, num_sms=132, blocks_per_sm=1, tile=64, min_tiles=4)
    assert floor.splits == 4 and best.cost() < floor.cost()
    # the floor holds for a length of no whole number of tiles: 1000 positions are 3.9
    # slices of 4 tiles, so 3 (each of at least 256 positions)
    part = plan_splits(1000, 16, 16, num_sms=132, blocks_per_sm=1, tile=64, min_tiles=4)
    assert part.splits == 3 and 1000 // part.splits >= 4 * 64
    assert best.cost() == pytest.approx(FIXED_TILES + 1 + 16 * MERGE_TILES)
    for s in range(1, 257):
        other = plan_splits(1024, 16, 16, num_sms=132, blocks_per_sm=1, tile=64, splits=s)
        assert other.cost() >= best.cost() or s > 16


def test_a_cost_within_the_tie_takes_the_fewer_splits():
    # 96 heads one a block, 4096 positions (128 tiles of 32), 264 slots (2 a SM): 8 splits
    # cost 3 waves x (3 fixed + 16 tiles) + 8/256 = 57.03125 tile-steps, the least; 5 splits
    # 2 waves x (3 + 26) + 5/256 = 58.01953125, within 2% of it, and fewer slices to merge
    plan = lambda s=None: plan_splits(4096, 96, 1, num_sms=132, blocks_per_sm=2, splits=s)
    assert plan(8).cost() == 57.03125 and plan(5).cost() == 58.01953125
    assert min(plan(k).cost() for k in range(1, 129)) == 57.03125
    assert plan().splits == 5


def test_predict_us_follows_waves_and_the_bandwidth_bound():
    from mlasandbox.splits import H200_BANDWIDTH, latency_model, predict_us

    m = latency_model("mma", 16)
    one = predict_us(plan_splits(64, 16, 16, num_sms=132, blocks_per_sm=1, tile=64), "mma")
    assert one["attn"] == pytest.approx(m.launch_us + m.fixed_us + m.tile_us)
    assert one["combine"] == pytest.approx(m.merge_us + 16 * m.merge_head_us)
    long = predict_us(plan_splits(131072, 16, 16, num_sms=132, blocks_per_sm=1, tile=64),
                      "mma")
    # 128 blocks stream 16 tiles of 64 x 576 x 2 bytes each: at the bandwidth or the
    # latency bound, whichever is slower; 4x the bytes a slice is bandwidth-bound
    bw_tile = 128 * 64 * 576 * 2 / H200_BANDWIDTH * 1e6
    assert long["attn"] == pytest.approx(m.launch_us + m.fixed_us + 16 * max(m.tile_us, bw_tile))
    # the merge's cost grows by a slice's partials: 128 slices add 127 of them
    assert long["combine"] == pytest.approx(m.merge_us + 16 * m.merge_head_us
                                            + 127 * m.merge_slice_us)
    assert m.merge_slice_us > 0
    wide = predict_us(plan_splits(131072, 16, 16, num_sms=132, blocks_per_sm=1, tile=64),
                      "mma", cache_bytes=8)
    assert wide["attn"] == pytest.approx(m.launch_us + m.fixed_us + 16 * 4 * bw_tile)
    # 16 heads of one slice read the same rows: split's 16 head blocks stream one slice's
    # bytes, and 6 blocks an SM split its issue slots
    s = latency_model("split", 1)
    assert latency_model("per_head", 1) == s and latency_model("mma", 20) == m
    plan = plan_splits(131072, 16, 1, num_sms=132, blocks_per_sm=6, tile=32)
    got = predict_us(plan, "split")["attn"]
    per_sm = -(-plan.blocks // 132)
    assert got == pytest.approx(s.launch_us + s.fixed_us
                                + plan.tiles_per_block() * per_sm * s.sm_tile_us)
    with pytest.raises(ValueError, match="no latency model"):
        latency_model("cublas", 1)


def test_predict_us_pays_each_wave_in_full():
    # 16 heads x 4 slices of 8192 = 64 blocks of one head, 64 tiles of 32 positions each,
    # one block an SM (blocks_per_sm = 1). On 64 SMs that is one wave; on 16, 8 and 4 SMs
    # the same blocks run in 4, 8 and 16 waves, each wave the same one-block-an-SM work, so
    # the time past the launch is exactly that many times one wave's: fixed + 64 tiles, a
    # tile at the model's one-block latency (its bytes, 32 x 576 x 2 B at a few TB/s, take
    # ~0.01 us: not the bound).
    from mlasandbox.splits import latency_model, predict_us

    m = latency_model("split", 1)

    def past_launch(num_sms):
        plan = plan_splits(8192, 16, 1, num_sms=num_sms, blocks_per_sm=1, splits=4)
        assert plan.blocks == 64 and plan.tiles_per_block() == 64 and plan.tile == 32
        return predict_us(plan, "split")["attn"] - m.launch_us

    one_wave = m.fixed_us + 64 * m.tile_us
    assert past_launch(64) == pytest.approx(one_wave)
    for num_sms, waves in ((16, 4), (8, 8), (4, 16)):
        assert past_launch(num_sms) == pytest.approx(waves * one_wave), num_sms


@pytest.mark.parametrize("kw, kind, said", [
    ({"bandwidth": 0}, ValueError, "bandwidth must be > 0"),
    ({"bandwidth": float("nan")}, ValueError, "bandwidth must be finite"),
    ({"bandwidth": "fast"}, TypeError, "bandwidth must be a real number"),
    ({"cache_bytes": 0}, ValueError, "cache_bytes"),
    ({"key_dim": 2.5}, (TypeError, ValueError), "key_dim"),
])
def test_the_latency_model_refuses_what_would_divide_by_zero(kw, kind, said):
    from mlasandbox.splits import predict_us

    plan = plan_splits(4096, 16, 16, num_sms=132, blocks_per_sm=1)
    assert predict_us(plan, "split")["attn"] > 0
    with pytest.raises(kind, match=said):
        predict_us(plan, "split", **kw)


def test_hand_made_plans_are_held_to_what_the_planners_make():
    # run_schedule, run_paged_schedule and predict_us take a plan object: a zero count in a
    # hand-made one was a ZeroDivisionError (ChunkPlan's target) or a wrong model, now named
    from dataclasses import replace

    from mlasandbox.chunks import ChunkPlan, plan_chunks
    from mlasandbox.splits import SplitPlan

    split = plan_splits(4096, 16, 16, num_sms=132, blocks_per_sm=1)
    chunk = plan_chunks(4, 1, num_sms=132, blocks_per_sm=1, tile=64)
    assert replace(split, slots=264.0).slots == 264     # a whole float is kept as an int
    assert type(replace(split, slots=264.0).slots) is int
    for field in ("slots", "splits", "num_sms", "head_blocks"):
        with pytest.raises(ValueError, match=f"SplitPlan {field} must be an integer >= 1"):
            replace(split, **{field: 0})
    for field in ("head_blocks", "slots", "max_chunks", "tile"):
        with pytest.raises(ValueError, match=f"ChunkPlan {field} must be an integer >= 1"):
            replace(chunk, **{field: 0})
    with pytest.raises(ValueError, match="ChunkPlan waves must be 1 or 2"):
        replace(chunk, waves=3)
    assert replace(chunk, target=0).target == 132      # 0: the slots a head block gets
    with pytest.raises(ValueError, match="SplitPlan tile must be an integer >= 1"):
        SplitPlan(**{**split.__dict__, "tile": True})
    with pytest.raises(ValueError, match="ChunkPlan target must be an integer >= 0"):
        ChunkPlan(**{**chunk.__dict__, "target": -1})
