"""The paged contract on the CPU: its float64 reference, its input validation, the chunk rule,
and the float32 model of the paged schedule at the real dims, with its negative control."""
from __future__ import annotations

import math

import numpy as np
import pytest

from mlasandbox import registry
from mlasandbox.chunks import (CHUNK_CAP, batch_chunk_unit, chunk_bounds, plan_chunks,
                               request_chunks, single_request_unit, two_waves)
from mlasandbox.compare_paged import compare_paged
from mlasandbox.dims import Dims
from mlasandbox.paged import INVALID_PAGE, check_paged_inputs, visible_lengths
from mlasandbox.paged_api import plan_for
from mlasandbox.paged_inputs import make_paged_inputs, parse_lengths
from mlasandbox.reference import decode, to_host
from mlasandbox.reference import decode_paged
from mlasandbox.schedule_paged import run_paged_schedule

SMALL = Dims(n_head=3, kv_lora=16, rope=8, v_head=4)


def _naive(inp, dims, causal):
    """Position by position through the table, in Python floats: shares no code with
    decode_paged beyond the inputs."""
    from mlasandbox.bf16 import as_f64

    q, cache, wv = (as_f64(np.asarray(a)) for a in (inp.q, inp.kv_cache, inp.wv_b))
    table, lengths = np.asarray(inp.block_table), np.asarray(inp.cache_seqlens)
    B, s_q, H, _ = q.shape
    P = cache.shape[1]
    latent = np.zeros((B, s_q, H, dims.kv_lora))
    lse = np.full((B, s_q, H), -math.inf)
    for b in range(B):
        for i in range(s_q):
            see = int(lengths[b]) - (s_q - 1 - i if causal else 0)
            for h in range(H):
                rows = [cache[table[b, t // P], t % P] for t in range(max(see, 0))]
                if not rows:
                    continue
                s = [inp.scale * float(q[b, i, h] @ r) for r in rows]
                m = max(s)
                w = [math.exp(x - m) for x in s]
                lat = sum(wt * r[:dims.kv_lora] for wt, r in zip(w, rows)) / sum(w)
                latent[b, i, h] = lat
                lse[b, i, h] = m + math.log(sum(w))
    out = np.einsum("hvk,bihk->bihv", wv, latent)
    return latent, lse, out


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("cache_dtype", ["f16", "bf16"])
def test_reference_matches_a_position_by_position_loop(seeds, causal, cache_dtype):
    # Both are float64 over the same exact inputs: they differ only in summation order,
    # a few ulp of 1e-16 over at most 13 terms; 1e-12 leaves room and catches any wrong row.
    inp = make_paged_inputs(SMALL, [0, 1, 5, 13, 4], s_q=3, page_size=4, causal=causal,
                            cache_dtype=cache_dtype, seed=seeds.one())
    got = decode_paged(**inp.decode_args(), kv_lora=SMALL.kv_lora)
    latent, lse, out = _naive(inp, SMALL, causal)
    assert np.array_equal(np.isneginf(got.lse), np.isneginf(lse)), seeds
    live = np.isfinite(lse)
    assert np.abs(got.lse[live] - lse[live]).max() < 1e-12, seeds
    assert np.abs(got.latent - latent).max() < 1e-12, seeds
    assert np.abs(got.out - out).max() < 1e-12, seeds


def test_reference_at_batch_one_is_the_contiguous_reference(seeds):
    # The same rows in one contiguous cache through reference.decode: float64 both, the
    # gather must not change a value (1e-12: summation-order rounding only).
    dims = Dims(n_head=5)
    inp = make_paged_inputs(dims, [1000], page_size=64, seed=seeds.one())
    got = decode_paged(**inp.decode_args())
    n_pages = -(-1000 // 64)
    rows = np.asarray(inp.kv_cache)[np.asarray(inp.block_table)[0, :n_pages]]
    want = decode(inp.q[0, 0], rows.reshape(-1, dims.key_dim)[:1000], inp.wv_b)
    assert np.abs(got.latent[0, 0] - want.latent).max() < 1e-12, seeds
    assert np.abs(got.lse[0, 0] - want.lse).max() < 1e-12, seeds
    assert np.abs(got.out[0, 0] - want.out).max() < 1e-12, seeds


def test_rows_that_see_nothing_are_zero_and_minus_inf(seeds):
    inp = make_paged_inputs(SMALL, [0, 2], s_q=4, page_size=16, causal=True, seed=seeds.one())
    got = decode_paged(**inp.decode_args(), kv_lora=SMALL.kv_lora)
    # request 0 is empty; request 1 (length 2) seen by its queries 2 and 3 only
    blind = np.zeros((2, 4), bool)
    blind[0] = True
    blind[1, :2] = True
    assert np.array_equal(np.isneginf(got.lse).all(axis=2), blind)
    assert not np.isnan(got.latent).any() and not np.isnan(got.out).any()
    assert (got.latent[blind] == 0).all() and (got.out[blind] == 0).all()
    assert np.isfinite(got.lse[~blind]).all()


def test_the_nan_fill_has_power(seeds):
    # The inputs NaN-fill the tail of each last page and every unused page; a reference that
    # read one position too many would be NaN. Claim one more position than the request has.
    inp = make_paged_inputs(SMALL, [5, 7], page_size=4, seed=seeds.one())
    assert np.isfinite(decode_paged(**inp.decode_args(), kv_lora=SMALL.kv_lora).latent).all()
    args = inp.decode_args()
    args["cache_seqlens"] = np.array([6, 7], np.int32)
    assert np.isnan(decode_paged(**args, kv_lora=SMALL.kv_lora).latent[0]).all()


def test_causal_query_is_the_shorter_noncausal_request(seeds):
    inp = make_paged_inputs(SMALL, [9], s_q=3, page_size=4, causal=True, seed=seeds.one())
    got = decode_paged(**inp.decode_args(), kv_lora=SMALL.kv_lora)
    for i, n in enumerate((7, 8, 9)):
        args = inp.decode_args() | {"causal": False, "q": inp.q[:, i:i + 1],
                                    "cache_seqlens": np.array([n], np.int32)}
        want = decode_paged(**args, kv_lora=SMALL.kv_lora)
        assert np.abs(got.latent[0, i] - want.latent[0, 0]).max() < 1e-12


def test_inputs_tables_are_permutations_with_invalid_tails(seeds):
    inp = make_paged_inputs(SMALL, [0, 3, 8, 9], page_size=4, seed=seeds.one())
    table = np.asarray(inp.block_table)
    used = table[table != INVALID_PAGE]
    assert len(set(used.tolist())) == used.size == 0 + 1 + 2 + 3
    assert (table[0] == INVALID_PAGE).all() and (table[1, 1:] == INVALID_PAGE).all()
    assert inp.kv_cache.shape[0] > used.size  # spare pages, NaN
    spare = np.setdiff1d(np.arange(inp.kv_cache.shape[0]), used)
    assert np.isnan(np.asarray(inp.kv_cache, np.float32)[spare]).all()
    # shuffled, so a kernel that ignores the table reads the wrong pages: over 125 pages a
    # random order puts page p + 1 right after page p about once a request (a Poisson count
    # of mean ~1); 10 or more such steps has probability below 1e-6, and an identity table
    # would have 123
    big = np.asarray(make_paged_inputs(SMALL, [200, 300], page_size=4,
                                       seed=seeds.one()).block_table)
    steps = sum(int((np.diff(row[row != INVALID_PAGE]) == 1).sum()) for row in big)
    assert steps < 10, f"{steps} of 123 consecutive table entries are adjacent pages"


def test_flashmla_cache_layout_is_accepted(seeds):
    inp = make_paged_inputs(SMALL, [5, 11], page_size=4, seed=seeds.one())
    args = inp.decode_args()
    want = decode_paged(**args, kv_lora=SMALL.kv_lora)
    args["kv_cache"] = inp.kv_cache[:, :, None, :]
    got = decode_paged(**args, kv_lora=SMALL.kv_lora)
    assert np.array_equal(got.latent, want.latent)


def _args(**change):
    inp = make_paged_inputs(SMALL, [3, 6], s_q=2, page_size=4, seed=0)
    return inp.decode_args() | change


@pytest.mark.parametrize("change, words", [
    ({"q": np.zeros((2, 3, 24), np.float32)}, "q must be 4-D"),
    ({"q": np.zeros((2, 2, 3, 20), np.float32)}, "kv_lora+rope=24"),
    ({"kv_cache": np.zeros((5, 4, 2, 24), np.float16)}, "one KV head"),
    ({"block_table": np.zeros((2, 2), np.int64)}, "block_table must be int32"),
    ({"block_table": np.zeros((3, 2), np.int32)}, "block_table must be [2, max_pages]"),
    ({"cache_seqlens": np.zeros(2, np.int64)}, "cache_seqlens must be int32"),
    ({"cache_seqlens": np.array([3, 9], np.int32)}, "cache_seqlens[1] = 9 is outside 0..8"),
    ({"cache_seqlens": np.array([-1, 3], np.int32)}, "cache_seqlens[0] = -1"),
    ({"wv_b": np.zeros((3, 16, 4), np.float16)}, "wv_b must be [n_head=3, v_head, kv_lora=16], got (3, 16, 4)"),
    ({"scale": "abc"}, "scale must be a real number"),
    ({"scale": float("inf")}, "scale must be finite"),
    ({"causal": "yes"}, "causal must be True or False"),
])
def test_bad_inputs_name_the_parameter(change, words):
    with pytest.raises((TypeError, ValueError)) as err:
        decode_paged(**_args(**change), kv_lora=SMALL.kv_lora)
    assert words in str(err.value)


def test_a_bad_table_entry_names_the_request_and_the_entry():
    args = _args()
    table = np.array(args["block_table"])
    table[1, 1] = 999
    with pytest.raises(ValueError, match=r"block_table\[1, 1\] = 999 is not a page id"):
        decode_paged(**(args | {"block_table": table}), kv_lora=SMALL.kv_lora)
    table[1, 1] = INVALID_PAGE  # past request 1's pages (length 6 needs 2): not read, fine
    table[1, 1], table[0, 1] = args["block_table"][1, 1], INVALID_PAGE
    decode_paged(**(args | {"block_table": table}), kv_lora=SMALL.kv_lora)


def test_a_table_is_read_only_as_far_as_the_lengths_reach():
    # max_pages is an int of the kernels: a wider table is refused by name. A table of
    # 2^31 - 1 columns (a zero-stride view: no memory) whose requests use two pages is
    # checked and gathered over those two, never widened in full (17 GB at int64)
    args = _args()
    wide = np.broadcast_to(args["block_table"][:, :1], (2, 2**31))
    with pytest.raises(ValueError, match=r"block_table may have at most 2,147,483,647 columns"):
        decode_paged(**(args | {"block_table": wide}), kv_lora=SMALL.kv_lora)
    table = np.broadcast_to(args["block_table"][:, :1], (2, 2**31 - 1))
    lengths = np.array([3, 4], np.int32)        # one page each: column 0 of each row
    got = decode_paged(**(args | {"block_table": table, "cache_seqlens": lengths}),
                       kv_lora=SMALL.kv_lora)
    want = decode_paged(**(args | {"cache_seqlens": lengths}), kv_lora=SMALL.kv_lora)
    np.testing.assert_array_equal(got.latent, want.latent)
    bad = np.broadcast_to(np.array([[999], [0]], np.int32), (2, 2**31 - 1))
    with pytest.raises(ValueError, match=r"block_table\[0, 0\] = 999 is not a page id"):
        decode_paged(**(args | {"block_table": bad, "cache_seqlens": lengths}),
                     kv_lora=SMALL.kv_lora)


def test_host_checks_take_any_array_by_shape_and_dtype():
    shape, scale = check_paged_inputs(*(_args()[k] for k in ("q", "kv_cache", "block_table",
                                                              "cache_seqlens", "wv_b")),
                                      kv_lora=SMALL.kv_lora)
    assert (shape.batch, shape.s_q, shape.n_head, shape.page_size) == (2, 2, 3, 4)
    assert scale == pytest.approx(SMALL.default_scale)


def test_visible_lengths():
    assert visible_lengths([5, 1], 3, True).tolist() == [[3, 4, 5], [0, 0, 1]]
    assert visible_lengths([5, 1], 2, False).tolist() == [[5, 5], [1, 1]]


def test_parse_lengths():
    assert parse_lengths(7, 3).tolist() == [7, 7, 7]
    assert parse_lengths("1,2", 5).tolist() == [1, 2, 1, 2, 1]
    drawn = parse_lengths("normal:4096:2048", 1000, seed=1)
    assert (drawn >= 0).all() and abs(drawn.mean() - 4096) < 300
    assert parse_lengths([3.0, 2**31 - 1], 2).tolist() == [3, 2**31 - 1]
    # past int32, non-integers, non-finite draws: named, never wrapped, truncated or negative
    for bad in ("normal:1", "x", "-3", [], "normal:-1:2", "normal:10:inf", "normal:nan:1",
                "normal:1e30:0", str(2**31), "99999999999999999999999", [1.5], [True],
                "@/nonexistent/lengths.txt"):
        with pytest.raises(ValueError, match="lengths"):
            parse_lengths(bad, 2)
    for batch in (0, 1.5, True, "2"):
        with pytest.raises(ValueError, match="batch"):
            parse_lengths(4, batch)


def test_kv_lora_must_be_a_positive_integer():
    args = [_args()[k] for k in ("q", "kv_cache", "block_table", "cache_seqlens", "wv_b")]
    for bad in (0, -5, 1.5, "a", True):
        with pytest.raises(ValueError, match="kv_lora must be an integer >= 1"):
            check_paged_inputs(*args, kv_lora=bad)


def test_paged_inputs_refuse_a_causal_or_seed_of_the_wrong_kind():
    for kw, word in (({"causal": "no"}, "causal"), ({"seed": -1}, "seed"),
                     ({"seed": 1.5}, "seed"), ({"lengths": [1.7]}, "lengths")):
        with pytest.raises(ValueError, match=word):
            make_paged_inputs(SMALL, **{"lengths": [5, 1], **kw})


# -- the chunk rule ---------------------------------------------------------------------

def _brute_unit(lengths, max_chunks, tile, min_chunk, target):
    """The smallest u in the rule's [lo, hi] with count(u) <= target, by trying every u."""
    t = -(-np.asarray(lengths, np.int64) // tile)
    total, busy = int(t.sum()), int((t > 0).sum())
    lo = max(min_chunk // tile, -(-total // target))
    hi = int(t.max()) if target <= busy else min(int(t.max()), -(-total // (target - busy)))
    hi = max(lo, hi)
    ok = [u for u in range(lo, hi + 1) if np.minimum(max_chunks, -(-t // u)).sum() <= target]
    return ok[0] if ok else hi


def test_chunks_cover_each_request_once_in_whole_tiles(seeds):
    rng = np.random.default_rng(seeds.one())
    lengths = np.concatenate([[0, 1, 63, 64, 65, 255, 256, 257, 4095, 4096, 4097, 131072],
                              rng.integers(0, 200_000, 200)])
    for max_chunks, target in ((1, 132), (2, 264), (7, 50), (22, 132), (132, 132),
                               (CHUNK_CAP, 1000)):
        n, clen = request_chunks(lengths, max_chunks, 64, 64, target)
        assert (n <= max_chunks).all() and (clen % 64 == 0).all()
        for length, k, c in zip(lengths, n, clen):
            spans = [chunk_bounds(int(length), int(c), j) for j in range(max_chunks)]
            live = [s for s in spans if s[1] > s[0]]
            assert len(live) == k, seeds              # exactly the counted chunks run
            assert sum(e - s for s, e in live) == length, seeds
            assert all(a[1] == b[0] for a, b in zip(live, live[1:]))  # contiguous, in order
            assert (k == 0) == (length == 0)
            assert length == 0 or (k - 1) * c < length <= k * c


@pytest.mark.parametrize("draw", range(12))
def test_the_search_finds_the_smallest_balanced_unit(draw, seeds):
    # three candidates a step: ranges [lo, hi] of 1 to thousands of values (a few requests
    # far longer than the rest at small targets) reach every branch of the step
    rng = np.random.default_rng(seeds.one())
    batch = int(rng.integers(1, 200))
    lengths = np.clip(rng.normal(8192, 6000, batch), 0, None).astype(int)
    lengths[rng.random(batch) < 0.2] = 0                  # empty requests among them
    lengths[rng.random(batch) < 0.05] = 400_000           # and a few very long ones
    for max_chunks, target in ((1, 132), (3, 40), (9, 132), (64, 132), (256, 264),
                               (5, 7), (2, 300), (132, 792)):
        got = batch_chunk_unit(lengths, max_chunks, 64, 64, target)
        assert got == _brute_unit(lengths, max_chunks, 64, 64, target), (max_chunks, target,
                                                                         seeds)


def test_one_request_takes_the_closed_form_and_it_equals_the_search():
    # the kernels' locate_chunk skips the search for a batch of one: the closed form must be
    # the search's answer at every length, cap, target and minimum chunk
    lengths = [0, 1, 63, 64, 65, 4095, 4096, 4097, 65536, 131072, 131073, 1 << 20]
    for length in lengths:
        for max_chunks, target, min_chunk in ((1, 132, 64), (2, 132, 64), (66, 66, 64),
                                              (132, 132, 64), (100, 264, 256),
                                              (256, 256, 64), (7, 9, 128), (200, 100, 64)):
            want = _brute_unit([length], max_chunks, 64, min_chunk, target)
            assert single_request_unit(length, 64, min_chunk, target) == want
            assert batch_chunk_unit([length], max_chunks, 64, min_chunk, target) == want
    # negative control: with two requests or more the search is needed; its lower end (the
    # closed form's expression over the batch) is not its answer at B = 32 x N(8192, 4096).
    # A fixed draw (docs/schedule.md's): a fresh one could, rarely, land on lo itself.
    rng = np.random.default_rng(3)
    batch = np.clip(np.round(rng.normal(8192, 4096, 32)), 0, None).astype(int)
    lo = -(-(-(-batch // 64)).sum() // 132)
    assert batch_chunk_unit(batch, 9, 64, 64, 132) > lo


@pytest.mark.parametrize("draw", range(8))
def test_the_balance_fills_one_wave_and_long_requests_take_the_chunks(draw, seeds):
    # B = 32, lengths N(8192, 4096), 16 heads on 132 SMs: the case the per-request cap left
    # at twice the ideal critical path (every request cut into 4, the longest's chunks long)
    rng = np.random.default_rng(seeds.one())
    lengths = np.clip(np.round(rng.normal(8192, 4096, 32)), 0, None).astype(int)
    plan = plan_chunks(32, 1, num_sms=132, blocks_per_sm=1, tile=64)
    assert plan.max_chunks == 9 and plan.target == 132 and plan.grid == (1, 132, 1)
    n, clen = plan.for_lengths(lengths)
    assert n.sum() <= 132, seeds                           # one wave of programs
    # The critical path's bound: the unit u = ceil(total / (target - busy)) tiles fits, since
    # sum ceil(t_b / u) <= total / u + busy <= target, so the search's u is no longer; a
    # request capped at 9 chunks runs ceil(t_b / 9) tiles a chunk, which may exceed u.
    t = -(-lengths // 64)
    busy = int((t > 0).sum())
    bound = max(-(-int(t.sum()) // (132 - busy)), -(-int(t.max()) // 9))
    assert clen.max() // 64 <= bound, (clen.max() // 64, bound, seeds)
    order = np.argsort(lengths, kind="stable")
    assert n[order[-1]] > n[order[0]], seeds               # the longest takes more chunks
    assert (np.diff(n[order]) >= 0).all(), seeds           # never fewer for a longer request
    req, chunk = plan.program_chunks(lengths)              # program p: the p-th chunk
    assert len(req) == 132 and (req[:n.sum()] >= 0).all() and (req[n.sum():] == -1).all()
    for b in range(32):
        assert sorted(chunk[req == b]) == list(range(n[b]))


def test_a_second_wave_is_offered_from_one_to_four_programs_a_request():
    # 132 slots, one head block: offered for 33 <= B < 132 (the grid then has 264 programs
    # and chunk slots for them); B = 32 keeps one wave's grid, B >= 132 is a single pass
    for batch, waves in ((2, 1), (32, 1), (33, 2), (64, 2), (128, 2), (131, 2), (132, 1)):
        plan = plan_chunks(batch, 1, num_sms=132, blocks_per_sm=1, tile=64)
        assert plan.waves == waves, batch
        assert plan.grid == (1, {1: max(132, batch) if batch < 132 else batch, 2: 264}[waves], 1)
        if waves == 2:
            assert plan.max_chunks == -(-2 * 264 // batch) and "second wave" in plan.reason
    # head blocks divide the slots: at 4 blocks the target is 33, so B = 9 .. 32 are offered
    assert plan_chunks(9, 4, num_sms=132, blocks_per_sm=1, tile=64).grid == (4, 66, 1)
    assert plan_chunks(8, 4, num_sms=132, blocks_per_sm=1, tile=64).waves == 1
    # an override caps the chunks; the offer stays
    assert plan_chunks(64, 1, num_sms=132, blocks_per_sm=1, tile=64, chunks=3).grid == (1, 264, 1)
    assert plan_chunks(64, 1, num_sms=132, blocks_per_sm=1, tile=64, chunks=1).single_pass


def test_the_lengths_take_the_second_wave_where_one_request_would_set_one_wave():
    rng = np.random.default_rng(5)
    varlen = np.clip(np.round(rng.normal(4096, 2048, 128)), 0, None).astype(int)
    plan = plan_chunks(128, 1, num_sms=132, blocks_per_sm=1, tile=64)
    args = (plan.max_chunks, 64, 64, plan.target)
    u1 = batch_chunk_unit(varlen, *args)
    u2 = batch_chunk_unit(varlen, plan.max_chunks, 64, 64, 2 * plan.target)
    assert 2 * u1 > 5 * u2 and two_waves(varlen, *args, programs=264)
    n, clen = plan.for_lengths(varlen)
    assert 132 < n.sum() <= 264 and clen.max() == u2 * 64
    req, chunk = plan.program_chunks(varlen)
    assert len(req) == 264 and (req[:n.sum()] >= 0).all() and (req[n.sum():] == -1).all()
    # equal requests: two waves would only split each in two, one wave stays (programs past
    # its 128 chunks exit)
    even = [4096] * 128
    assert not two_waves(even, *args, programs=264)
    n, clen = plan.for_lengths(even)
    assert n.sum() == 128 and (clen == 4096).all()
    # negative control: the grid of one wave never takes the second, whatever the lengths
    assert not two_waves(varlen, *args, programs=132)
    n1, _ = request_chunks(varlen, *args)
    assert n1.sum() <= 132 and (n1 != plan.for_lengths(varlen)[0]).any()


@pytest.mark.parametrize("batch, seed, std, u1, u2, waves", [
    (40, 0, 0.3, 23, 11, 1),      # one wave's unit 2.09 x two waves': one wave
    (64, 0, 1.5, 50, 20, 1),      # exactly 5/2: the rule's '>' keeps one wave
    (128, 413, 1.5, 168, 67, 2),  # 2.51: two waves
])
def test_two_waves_are_taken_past_five_halves_of_the_unit(batch, seed, std, u1, u2, waves):
    """The second wave is taken where one wave's chunk unit is over 5/2 of two waves' (the
    kernels' locate_chunk): cases on either side of that ratio, one exactly at it."""
    lengths = np.clip(np.round(np.random.default_rng(seed).normal(4096, 4096 * std, batch)),
                      0, None).astype(int)
    plan = plan_chunks(batch, 1, num_sms=132, blocks_per_sm=1, tile=64)
    args = (plan.max_chunks, 64, 64, plan.target)
    assert plan.grid[1] == 2 * plan.target                      # the grid offers two waves
    assert batch_chunk_unit(lengths, *args) == u1
    assert batch_chunk_unit(lengths, plan.max_chunks, 64, 64, 2 * plan.target) == u2
    assert two_waves(lengths, *args, programs=2 * plan.target) == (waves == 2)


def test_a_batch_of_the_wave_target_is_a_single_pass():
    # B = 132 requests on 132 slots: one program a request, no chunk slots to merge
    plan = plan_chunks(132, 1, num_sms=132, blocks_per_sm=1, tile=64)
    assert plan.single_pass and plan.max_chunks == 1 and plan.grid == (1, 132, 1)
    assert not plan_chunks(131, 1, num_sms=132, blocks_per_sm=1, tile=64).single_pass


def test_a_single_pass_runs_request_p_on_program_p():
    plan = plan_chunks(200, 1, num_sms=132, blocks_per_sm=1, tile=64)
    assert plan.single_pass and plan.grid == (1, 200, 1)
    lengths = [0, 5, 70000] * 66 + [1, 0]
    req, chunk = plan.program_chunks(lengths)
    assert (req == np.where(np.asarray(lengths) > 0, np.arange(200), -1)).all()
    assert (chunk == 0).all() and (plan.for_lengths(lengths)[0] <= 1).all()


def test_a_request_past_the_skew_gets_longer_chunks_not_more():
    lengths = [100_000] + [1000] * 31
    plan = plan_chunks(32, 1, num_sms=132, blocks_per_sm=1, tile=64)
    n, clen = plan.for_lengths(lengths)
    assert n[0] == plan.max_chunks and clen[0] * n[0] >= 100_000


def test_short_batches_cut_into_single_tiles_and_batch_one_fills_the_gpu():
    one = plan_chunks(1, 1, num_sms=132, blocks_per_sm=1, tile=64)
    assert one.max_chunks == 132 and one.grid == (1, 132, 1) and not one.single_pass
    n, clen = one.for_lengths([131072])
    assert n[0] == 128 and clen[0] == 1024                 # 16 tiles, one wave
    n, clen = one.for_lengths([1024])
    assert n[0] == 16 and clen[0] == 64                    # a tile a program
    n, clen = one.for_lengths([64])
    assert n[0] == 1


def test_the_grid_is_skew_times_the_mean_need_and_single_pass_at_one():
    for batch, head_blocks in ((2, 1), (8, 6), (32, 1), (128, 8), (1, 300), (4000, 1)):
        plan = plan_chunks(batch, head_blocks, num_sms=132, blocks_per_sm=2, tile=64)
        target = max(1, 264 // head_blocks)
        assert plan.target == target
        want = 1 if batch >= target else min(CHUNK_CAP, target, -(-2 * target // batch))
        assert plan.max_chunks == want
        assert plan.single_pass == (plan.max_chunks == 1)
    assert plan_chunks(4000, 1, num_sms=132, blocks_per_sm=1, tile=64).single_pass
    assert plan_chunks(1, 1, num_sms=132, blocks_per_sm=1, tile=64, chunks=1).single_pass


def test_combine_tile_is_the_cap_rounded_up_to_a_power_of_two():
    plan = plan_chunks(6, 1, num_sms=132, blocks_per_sm=1, tile=64)
    assert plan.max_chunks == 44 and plan.combine_tile == 64
    assert plan_chunks(12, 1, num_sms=132, blocks_per_sm=1, tile=64).combine_tile == 32
    assert plan_chunks(64, 4, num_sms=132, blocks_per_sm=1, tile=64).combine_tile == 1


def _bound_cases(rng):
    """(batch, head_blocks, tile, min_tiles, chunks, max_len) plans where the table may hold
    one chunk at most, or more: short and long capacities, overrides, two waves."""
    for _ in range(300):
        yield (int(rng.choice([1, 2, 3, 8, 40, 131])), int(rng.choice([1, 2, 8])),
               int(rng.choice([16, 64])), int(rng.choice([1, 2, 4])),
               None if rng.random() < 0.7 else int(rng.integers(1, CHUNK_CAP + 1)),
               int(rng.choice([1, 20, 64, 65, 1024, 4096, 20000, 131072])))


def test_a_table_of_one_chunk_is_one_pass_and_changes_no_chunk(module_seeds):
    """plan_chunks(max_len=): one chunk slot where ceil(max_len / tile) <= min_tiles, the
    free plan's slots otherwise; every set of lengths of at most max_len runs the same
    chunks, program by program, as on the plan without max_len."""
    rng = np.random.default_rng(module_seeds.one())
    one_pass = 0
    for batch, hb, tile, mt, chunks, max_len in _bound_cases(rng):
        kw = dict(num_sms=132, blocks_per_sm=1, tile=tile, min_tiles=mt, chunks=chunks)
        free, plan = plan_chunks(batch, hb, **kw), plan_chunks(batch, hb, max_len=max_len, **kw)
        fits = -(-max_len // tile) <= mt
        assert plan.max_chunks == (1 if fits else free.max_chunks)
        assert plan == free or plan.single_pass
        one_pass += plan.max_chunks < free.max_chunks
        for lengths in (rng.integers(0, max_len + 1, batch), np.full(batch, max_len),
                        np.r_[max_len, np.zeros(batch - 1, np.int64)]):
            n, clen = plan.for_lengths(lengths)
            n0, clen0 = free.for_lengths(lengths)
            assert (n == n0).all() and (clen[n > 0] == clen0[n0 > 0]).all(), (batch, max_len)
            if not plan.single_pass:
                req, ch = plan.program_chunks(lengths)
                req0, ch0 = free.program_chunks(lengths)
                assert (req == req0).all() and (ch == ch0).all()
    assert one_pass > 40   # the cases reach the one-pass plan, not only the free one


def test_one_pass_is_tight_a_request_past_max_len_would_take_two_chunks():
    """Negative control: a request one tile longer than the table holds (which the host and
    device index checks refuse) would be cut into two chunks by the free plan, so the
    comparison above has power."""
    free = plan_chunks(1, 1, num_sms=132, blocks_per_sm=1, tile=64)
    plan = plan_chunks(1, 1, num_sms=132, blocks_per_sm=1, tile=64, max_len=64)
    assert plan.max_chunks == 1 and free.max_chunks == 132
    assert tuple(plan.for_lengths([64])) == tuple(free.for_lengths([64])) == ([1], [64])
    assert (tuple(plan.for_lengths([128])), tuple(free.for_lengths([128]))) == (
        ([1], [128]), ([2], [64]))


def test_only_a_table_of_one_chunk_changes_the_plan():
    """One tile of capacity (or min_tiles tiles) runs one pass and says why; a table of 16
    tiles keeps every slot, so the merge stays a launch: the mma kernel's own merge of 16
    chunks in one head block was slower than the launch (H100, 2026-12-07: 17.50 against
    14.37 us at 1 x 1024 x 16, docs/schedule.md)."""
    kw = dict(num_sms=132, blocks_per_sm=1, tile=64)
    one = plan_chunks(1, 1, max_len=64, **kw)
    assert one.single_pass and one.grid == (1, 1, 1) and "one pass" in one.reason
    assert "max_len = 64 positions (1 tile of 64)" in one.reason
    assert plan_chunks(1, 1, max_len=128, min_tiles=2, **kw).single_pass
    assert not plan_chunks(1, 1, max_len=128, **kw).single_pass
    short, free = plan_chunks(1, 1, max_len=1024, **kw), plan_chunks(1, 1, **kw)
    assert short == free and short.max_chunks == 132 and "max_len" not in short.reason
    assert not registry.attn_merges("mma", short.max_chunks, "f16", "f16")


def test_plan_for_passes_the_shape_s_table():
    dims = Dims(n_head=16)
    inst = registry.paged_attention_instance("mma16", "f16", "f32")
    free = plan_chunks(3, 1, num_sms=132, blocks_per_sm=1, tile=inst.tile_rows)
    for lengths, max_len, single in (([64, 0, 30], 64, True), ([1000, 0, 300], 1024, False)):
        inp = make_paged_inputs(dims, lengths, s_q=1, page_size=64, seed=0)
        shape, _ = check_paged_inputs(**inp.decode_args())
        assert shape.max_len == max_len
        plan = plan_for(shape, inst, num_sms=132, blocks_per_sm=1)
        assert plan.single_pass == single and (single or plan == free)


@pytest.mark.parametrize("bad", [{"batch": 0}, {"head_blocks": 1.5}, {"chunks": 0},
                                 {"chunks": CHUNK_CAP + 1}, {"tile": True}, {"skew": 0},
                                 {"max_len": 0}, {"max_len": True}, {"max_len": 2.5}])
def test_plan_chunks_rejects_bad_values(bad):
    kwargs = {"batch": 2, "head_blocks": 1, "num_sms": 132, "blocks_per_sm": 1, "tile": 64}
    with pytest.raises(ValueError, match=next(iter(bad))):
        plan_chunks(**(kwargs | bad))


# -- the float32 model of the paged schedule, at the real dims --------------------------

@pytest.fixture(scope="module")
def mixed_batch(module_seeds):
    # Lengths of the device case grid, mixed in one batch: empty, one position, shorter
    # than a tile, across tile and page boundaries, and long enough for many chunks.
    dims = Dims(n_head=16)
    inp = make_paged_inputs(dims, [0, 1, 20, 140, 4095, 4097, 20000], s_q=2, page_size=16,
                            causal=True, seed=module_seeds.one())
    return dims, inp, decode_paged(**inp.decode_args())


@pytest.mark.parametrize("num_sms,chunks", [(132, None), (132, 1), (132, 3), (132, 200),
                                            (5, None), (2, 4), (40, None)])
def test_paged_schedule_matches_the_reference(mixed_batch, num_sms, chunks):
    # The default tolerances (compare.py) bound f32 accumulation over up to 131072 terms;
    # here a chunk holds at most 20000 positions, well inside them. A bug in the chunk
    # bounds, the causal mask or the merge moves relL2 by 1e-3 or more (the negative control
    # below measures the merge's). Few SMs make a small wave target: the balance then gives
    # the long requests the chunks and caps them (132 SMs: 20000 is 5x the mean and hits
    # the 38 slots; 5 SMs: batch 7 >= the target, one slot a request, a single pass; 2 SMs
    # with 4 slots: more requests than the wave, every request one chunk).
    dims, inp, want = mixed_batch
    plan = plan_chunks(7, 1, num_sms=num_sms, blocks_per_sm=1, tile=64, chunks=chunks)
    n, _ = plan.for_lengths(to_host(inp.cache_seqlens))
    assert n[0] == 0 and (n <= plan.max_chunks).all()
    got = run_paged_schedule(**inp.decode_args(), plan=plan)
    result = compare_paged(got, want)
    assert result.ok, result.summary()
    assert result.empty_rows == 2 * 16 + 16  # request 0, and query 0 of request 1


def test_the_balance_puts_the_chunks_on_the_long_request(mixed_batch):
    dims, inp, want = mixed_batch
    lengths = to_host(inp.cache_seqlens)                # 0, 1, 20, 140, 4095, 4097, 20000
    plan = plan_chunks(7, 1, num_sms=40, blocks_per_sm=1, tile=64)
    n, clen = plan.for_lengths(lengths)
    assert n.sum() <= plan.target == 40 and n[-1] == plan.max_chunks == 12
    assert n[1] == n[2] == 1 and n[4] < n[-1]           # short ones one chunk, never split
    # chunk slots past a request's count do nothing: the model's result is the same with
    # every chunk slot the grid has (max_chunks) and with the chunks the requests need
    got = run_paged_schedule(**inp.decode_args(), plan=plan)
    assert compare_paged(got, want).ok


def test_the_model_runs_the_second_wave_the_lengths_take(mixed_batch):
    # 12 SMs: the grid offers 24 programs; the 20000-position request would set one wave of
    # 12 (63 tiles a chunk against 19 on two), so the lengths take both (its 7 chunks, the
    # cap), and the model still matches
    dims, inp, want = mixed_batch
    lengths = to_host(inp.cache_seqlens)
    plan = plan_chunks(7, 1, num_sms=12, blocks_per_sm=1, tile=64)
    assert plan.grid == (1, 24, 1)
    assert two_waves(lengths, plan.max_chunks, 64, 64, plan.target, programs=24)
    n, _ = plan.for_lengths(lengths)
    assert 12 < n.sum() <= 24 and n[-1] == plan.max_chunks == 7
    assert compare_paged(run_paged_schedule(**inp.decode_args(), plan=plan), want).ok


def test_paged_schedule_without_rescale_fails(mixed_batch):
    dims, inp, want = mixed_batch
    plan = plan_chunks(7, 1, num_sms=132, blocks_per_sm=1, tile=64)
    lengths = to_host(inp.cache_seqlens)
    assert plan.for_lengths(lengths)[0][-1] > 1  # the merge has chunks to rescale
    got = run_paged_schedule(**inp.decode_args(), plan=plan, rescale=False)
    result = compare_paged(got, want)
    assert not result.ok
    # far outside the tolerance, not at its edge: the check has power
    assert result.live.latent.value > 100 * result.live.latent.limit


def test_the_empty_row_check_has_power(mixed_batch):
    dims, inp, want = mixed_batch
    for field, index, value in (("lse", (0, 0, 0), 0.0), ("latent", (1, 0, 3, 7), 1e-30),
                                ("out", (0, 1, 2, 5), -1e-30)):
        got = type(want)(latent=want.latent.copy(), lse=want.lse.copy(), out=want.out.copy())
        getattr(got, field)[index] = value
        assert compare_paged(got, want).empty_wrong == 1, field
    assert compare_paged(want, want).ok
