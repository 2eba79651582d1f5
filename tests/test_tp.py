"""Tensor parallelism without a GPU: the band and budget arithmetic at the real dims, the
collectives' semantics (the fake communicator), and the combine of band outputs."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from mlasandbox import geometry
from mlasandbox.chunks import plan_chunks
from mlasandbox.tp import (as_unsharded, check_tp, fixed_facts, head_bands, rank_grids,
                           rank_plans, unsharded_chunks)
from mlasandbox.tp_bench import check_y, out_tolerance, summarize_tp
from mlasandbox.tp_comm import (NO_MULTICAST_ENV, FakeCommunicator, make_communicator,
                                resolve_engine, start_method)
from mlasandbox.tp_rank import assemble_gathered, make_w_o

# The paged instances' facts (registry: mma16 serves 16 rows a block, mma32 32, both with a
# 64-position tile), at one block per SM: "auto" picks by the rows of a step.
AUTO = (lambda heads: (16, 64, 1) if heads <= 16 else (32, 64, 1))


# ---- bands ----------------------------------------------------------------------------

@pytest.mark.parametrize("n_head", [96, 128, 16, 12, 7, 1])
@pytest.mark.parametrize("tp", [1, 2, 3, 4, 5, 8])
def test_bands_cover_the_heads_once_in_order_and_differ_by_at_most_one(n_head, tp):
    if tp > n_head:
        with pytest.raises(ValueError, match=f"tp={tp} is more ranks than the {n_head} heads"):
            head_bands(n_head, tp)
        return
    bands = head_bands(n_head, tp)
    assert [b.rank for b in bands] == list(range(tp))
    assert bands[0].start == 0 and bands[-1].stop == n_head
    assert all(a.stop == b.start for a, b in zip(bands, bands[1:]))
    sizes = [b.heads for b in bands]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    assert sizes == sorted(sizes, reverse=True)   # the larger bands first


def test_the_real_shards_are_even_and_odd_counts_uneven():
    assert [b.heads for b in head_bands(96, 8)] == [12] * 8       # the lecture's 12 heads
    assert [b.heads for b in head_bands(128, 8)] == [16] * 8      # DeepSeek-V3's 16
    assert [b.heads for b in head_bands(7, 2)] == [4, 3]
    assert [b.heads for b in head_bands(128, 3)] == [43, 43, 42]
    assert [(b.start, b.stop) for b in head_bands(10, 4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]


@pytest.mark.parametrize("bad, match", [(0, "integer >= 1"), (-2, "integer >= 1"),
                                        (True, "integer >= 1"), (2.0, "integer >= 1"),
                                        ("2", "integer >= 1")])
def test_check_tp_rejects_what_is_not_a_rank_count(bad, match):
    with pytest.raises(ValueError, match=match):
        check_tp(bad)


def test_check_tp_names_the_visible_gpus():
    assert check_tp(2, 128, 2) == 2
    with pytest.raises(ValueError, match="tp=4 needs 4 GPUs .* but 1 is visible"):
        check_tp(4, 128, 1)
    with pytest.raises(ValueError, match="but 0 are visible"):
        check_tp(1, 128, 0)


# ---- the budget, re-derived per band ----------------------------------------------------

def test_the_band_budget_keeps_the_grid_full_where_the_unsharded_one_starves_it():
    # B=4 requests x 131072, 128 heads on 132 SMs x 1 block, under the balanced chunk rule.
    # All heads on one GPU: mma32, 128 rows / 32 = 4 head blocks, a wave target of 132 / 4 =
    # 33 programs and ceil(2 x 33 / 4) = 17 chunks a request. A band of 16 heads (TP 8):
    # mma16, 1 head block, a target of 132 and up to 66 chunks, so 4 equal requests run 33
    # chunks each: 132 programs, one full wave. With the 17 inherited chunks a request the
    # band runs 4 x 17 = 68 of its 132 programs: 52% of the slots.
    assert unsharded_chunks(4, 1, 128, AUTO, num_sms=132) == 17
    band = rank_plans(4, 1, 128, 8, AUTO, num_sms=132, budget="band")
    flat = rank_plans(4, 1, 128, 8, AUTO, num_sms=132, budget="unsharded")
    lengths = [131072] * 4
    for b, u in zip(band, flat):
        assert b.plan.grid == u.plan.grid == (1, 132, 1) and b.fill == 1.0
        assert b.plan.max_chunks == 66 and u.plan.max_chunks == 17
        assert b.plan.for_lengths(lengths)[0].sum() == 132
        assert u.plan.for_lengths(lengths)[0].sum() == 68
        assert "as if not sharded" in u.plan.reason and "balanced:" in b.plan.reason


@pytest.mark.parametrize("n_head", [96, 128])
@pytest.mark.parametrize("batch", [1, 32])
def test_at_tp_1_both_budgets_are_the_single_gpu_plan(n_head, batch):
    single = plan_chunks(batch, -(-n_head // 32), num_sms=132, blocks_per_sm=1, tile=64)
    for budget in ("band", "unsharded"):
        (rp,) = rank_plans(batch, 1, n_head, 1, AUTO, num_sms=132, budget=budget)
        assert rp.plan.grid == single.grid and rp.plan.max_chunks == single.max_chunks


@pytest.mark.parametrize("n_head, tp", [(96, 8), (128, 8), (128, 3), (96, 5), (7, 2)])
@pytest.mark.parametrize("batch", [1, 32])
def test_the_band_budget_never_exceeds_the_slots_and_never_takes_fewer_chunks(n_head, tp,
                                                                              batch):
    band = rank_plans(batch, 1, n_head, tp, AUTO, num_sms=132, budget="band")
    flat = rank_plans(batch, 1, n_head, tp, AUTO, num_sms=132, budget="unsharded")
    for b, u in zip(band, flat):
        assert b.plan.head_blocks == u.plan.head_blocks
        assert b.plan.max_chunks >= u.plan.max_chunks
        # the budget: batch x head blocks x chunks <= slots (twice them where the grid offers
        # a second wave), unless one chunk already exceeds
        assert b.plan.programs <= b.plan.waves * b.plan.slots or b.plan.max_chunks == 1


def test_splits_override_both_budgets():
    for budget in ("band", "unsharded"):
        for rp in rank_plans(2, 1, 128, 4, AUTO, num_sms=132, budget=budget, splits=5):
            assert rp.plan.max_chunks == 5 and "override" in rp.plan.reason
    with pytest.raises(ValueError, match="budget must be one of band, unsharded"):
        rank_plans(2, 1, 128, 4, AUTO, num_sms=132, budget="flat")


def test_fixed_facts_is_one_instance_for_every_band():
    # s_q 2 x 4 heads = 8 rows per band, one 16-row block: a wave target of the 264 slots
    rp = rank_plans(1, 2, 12, 3, fixed_facts(16, 64, 2), num_sms=132)
    assert [r.plan.grid for r in rp] == [(1, 264, 1)] * 3
    rp = rank_plans(1, 2, 12, 3, fixed_facts(16, 64, 1), num_sms=132)
    assert [r.plan.grid for r in rp] == [(1, 132, 1)] * 3


def test_batch_one_grids_per_rank_split_the_context_further_than_the_unsharded_count():
    # split (1 head a block) at 96 heads x 131072 on 132 SMs x 2: the split rule's choice
    # for 12 heads against the one it makes for all 96 (geometry.grid_report, the same rule
    # as the launcher); sharding by 8 leaves 12 blocks a split, so the band takes more.
    kw = dict(sms=132, blocks_per_sm=2)
    rows = rank_grids("split", 96, 131072, 8, **kw)
    full = geometry.grid_report("split", 96, 131072, **kw)
    band = geometry.grid_report("split", 12, 131072, **kw)
    assert len(rows) == 8 and {r["band"]["splits"] for r in rows} == {band["splits"]}
    assert {r["unsharded"]["splits"] for r in rows} == {full["splits"]}
    assert band["splits"] > full["splits"]
    assert rows[0]["band"]["waves"] > rows[0]["unsharded"]["waves"]
    assert [r["heads"] for r in rows[:2]] == [[0, 12], [12, 24]]


# ---- combining band outputs ------------------------------------------------------------

def test_assemble_gathered_puts_every_band_back_in_place_and_reads_no_padding(seeds):
    rng = np.random.default_rng(seeds.take())
    n_head, tp, v = 7, 3, 5
    full = rng.standard_normal((2, 3, n_head, v))
    bands = head_bands(n_head, tp)
    h_max = max(b.heads for b in bands)
    recv = np.full((tp, 2, 3, h_max, v), np.nan)       # padding that must not be read
    for b in bands:
        recv[b.rank, :, :, :b.heads] = full[:, :, b.slice]
    np.testing.assert_array_equal(assemble_gathered(recv, bands), full)
    # negative control: the bands in the wrong order are caught
    swapped = (bands[1], bands[0], bands[2])
    assert not np.array_equal(assemble_gathered(recv[[1, 0, 2]], swapped), full)


def _run_threads(world, body):
    results, errors = [None] * world, []

    def run(r):
        try:
            results[r] = body(r)
        except Exception as exc:   # surfaced below, in the test's thread
            errors.append(exc)
    ts = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    if errors:
        raise errors[0]
    return results


def test_the_fake_communicator_gathers_in_rank_order_and_sums_the_same_everywhere(tmp_path,
                                                                                  seeds):
    world = 3
    rng = np.random.default_rng(seeds.take())
    data = rng.standard_normal((world, 4, 6)).astype(np.float32)
    barrier = threading.Barrier(world)

    def body(r):
        comm = FakeCommunicator(r, world, barrier, str(tmp_path))
        recv = np.zeros((world, 4, 6), np.float32)
        comm.all_gather(data[r], recv)
        buf = data[r].copy()
        comm.all_reduce(buf)
        return recv, buf
    for recv, buf in _run_threads(world, body):
        np.testing.assert_array_equal(recv, data)
        np.testing.assert_array_equal(buf, data[0] + data[1] + data[2])  # rank order
    assert list(tmp_path.iterdir()) == []     # the exchange files are removed
    comm = FakeCommunicator(0, 2, threading.Barrier(1), str(tmp_path))
    with pytest.raises(ValueError, match=r"recv must be \(2, 3\)"):
        comm.all_gather(np.zeros(3), np.zeros((3, 3)))


def test_check_y_bounds_the_projection_and_catches_a_missing_partial(seeds):
    rng = np.random.default_rng(seeds.take())
    n_head, v, d, tp = 8, 128, 64, 4
    out = rng.standard_normal((3, 1, n_head, v)).astype(np.float32)
    w = make_w_o(n_head, v, d, seed=seeds.one())
    parts = [out[:, :, b.slice].reshape(3, -1) @ w[b.slice].reshape(-1, d)
             for b in head_bands(n_head, tp)]
    y = parts[0].copy()
    for p in parts[1:]:
        y += p
    assert check_y(y.reshape(3, 1, d), out, w)["ok"]
    short = sum(parts[1:])          # negative control: rank 0's partial never arrived
    res = check_y(short.reshape(3, 1, d), out, w)
    assert not res["ok"] and res["worst_err_over_bound"] > 100


def test_w_o_drawn_per_band_agrees_with_the_whole():
    whole = make_w_o(10, 4, 6, seed=5)
    assert whole.shape == (10, 4, 6) and whole.dtype == np.float32
    for b in head_bands(10, 3):
        np.testing.assert_array_equal(make_w_o(10, 4, 6, seed=5, heads=b.slice), whole[b.slice])


# ---- engines ---------------------------------------------------------------------------

def test_engine_names_are_checked():
    with pytest.raises(ValueError, match="engine must be one of auto, cupy, torch, fake"):
        resolve_engine("mpi")
    assert resolve_engine("fake") == "fake"


def test_an_nccl_engine_refuses_to_start_with_multicast_on(monkeypatch):
    for k in NO_MULTICAST_ENV:
        monkeypatch.delenv(k, raising=False)
    for engine in ("cupy", "torch"):
        with pytest.raises(RuntimeError, match="NCCL_NVLS_ENABLE must be 0 before NCCL"):
            make_communicator(engine, 0, 1, 0, 12345)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "0")
    with pytest.raises(RuntimeError, match="TORCH_SYMM_MEM_DISABLE_MULTICAST must be 1"):
        make_communicator("cupy", 0, 1, 0, 12345)


def test_start_method_is_set_inside_and_restored_after():
    import multiprocessing as mp

    before = mp.get_start_method(allow_none=True)
    for method in ("fork", "spawn"):
        with start_method(method):
            assert mp.get_start_method() == method
        assert mp.get_start_method(allow_none=True) == before


def test_cupyx_store_starts_from_a_rank_whose_start_method_is_spawn():
    """What failed on the H200, reproduced without a GPU: rank 0 of cupyx.distributed serves
    its TCP store from a child process whose target holds a lock, which spawn (the default a
    spawned rank may inherit) cannot pickle; _CupyNccl starts it under fork."""
    from cupyx.distributed import _store

    from mlasandbox.tp_launch import _free_port

    with pytest.raises(TypeError, match="cannot pickle"):   # the failure, as on the device
        with start_method("spawn"):
            _store.TCPStore(1).run("127.0.0.1", _free_port())
    port = _free_port()
    with start_method("fork"):
        store = _store.TCPStore(1)
        store.run("127.0.0.1", port)
    try:
        proxy = _store.TCPStoreProxy("127.0.0.1", port)
        proxy["nccl_id"] = 7
        assert proxy["nccl_id"] == 7
    finally:
        store.stop()
    assert not store._process.is_alive()


def test_the_fake_engine_needs_its_barrier_and_directory():
    with pytest.raises(ValueError, match="needs a barrier and a directory"):
        make_communicator("fake", 0, 1, 0, 0)


# ---- the summary ------------------------------------------------------------------------

def _slow(attn, step, gather=0.0, reduce=0.0):
    return {"attn": {"max_us": attn}, "step": {"max_us": step},
            "all_gather": {"max_us": gather}, "all_reduce": {"max_us": reduce}}


def test_summary_scaling_collective_share_and_budget_effect():
    runs = {1: {"slowest": {"band": _slow(800.0, 1000.0, 10.0, 10.0)}},
            8: {"slowest": {"band": _slow(125.0, 200.0, 30.0, 20.0),
                            "unsharded": _slow(135.0, 210.0, 30.0, 20.0)}}}
    s = summarize_tp(runs, 8)
    assert s["tp8/band"]["attn_efficiency"] == pytest.approx(800 / (8 * 125))   # 0.8
    assert s["tp8/band"]["attn_vs_ideal"] == pytest.approx(125 / 100)          # 1.25x ideal
    assert s["tp8/band"]["step_efficiency"] == pytest.approx(1000 / (8 * 200))
    assert s["tp8/band"]["collective_share"] == pytest.approx(50 / 200)
    assert s["tp1/band"]["attn_efficiency"] == pytest.approx(1.0)
    assert s["budget_effect_attn"] == pytest.approx(135 / 125 - 1)


def test_the_out_tolerance_is_that_of_the_loosest_variant_a_rank_ran():
    from mlasandbox.compare import DEFAULT_TOLERANCE
    from mlasandbox.registry import ROUND_P_RELL2_BOUND
    from mlasandbox.tp_launch import TPRun

    def run(*variants):   # one report per rank, its plans under both budgets
        return TPRun(len(variants), "fake", [{"plans": {"band": {"variant": v},
                                                        "unsharded": {"variant": v}}}
                                             for v in variants], 0.0)
    f32_kernels = run("mma16", "mma16")
    assert out_tolerance([f32_kernels], "f16") == DEFAULT_TOLERANCE.out
    # TP 1 ran wgmma64 (p rounded to f16), the bands mma16: the looser bound holds for both
    assert out_tolerance([run("wgmma64"), f32_kernels], "f16") == ROUND_P_RELL2_BOUND["f16"]
    assert ROUND_P_RELL2_BOUND["f16"] > DEFAULT_TOLERANCE.out
    assert out_tolerance([run()], "bf16") == DEFAULT_TOLERANCE.out   # no plans reported


def test_a_band_is_planned_with_its_own_instance_and_every_query_row():
    """facts(heads) may name another instance for a band than for all heads (auto), and a
    block holds rows of (query token x head): a band of 16 heads at s_q 2 is two 16-row blocks,
    where all 32 heads would run one 64-row block and s_q 1 one 16-row block."""
    def facts(heads):
        return (16, 64, 1) if heads <= 16 else (64, 64, 1)

    plans = rank_plans(4, 2, 32, 2, facts, num_sms=132)
    assert [p.plan.head_blocks for p in plans] == [2, 2]
    want = plan_chunks(4, 2, num_sms=132, blocks_per_sm=1, tile=64)
    assert all(p.plan.max_chunks == want.max_chunks for p in plans)
    # the unsharded budget counts every query row too: 16 heads x s_q 4 = 4 blocks of 16
    budget = unsharded_chunks(4, 4, 16, fixed_facts(16, 64, 1), num_sms=132)
    kw = dict(num_sms=132, blocks_per_sm=1, tile=64)
    assert budget == plan_chunks(4, 4, **kw).max_chunks != plan_chunks(4, 1, **kw).max_chunks


def test_the_unsharded_reason_keeps_the_one_pass_and_the_second_wave_clauses():
    """as_unsharded names the budget in place of the override's clause and keeps what else
    shaped the plan: 20 inherited chunks made one pass by a table of one tile; 20 on a grid
    that offers a second wave (40 requests, 132 programs)."""
    kw = dict(num_sms=132, blocks_per_sm=1, tile=64, chunks=20)
    one = plan_chunks(40, 1, max_len=64, **kw)
    assert one.max_chunks == 1
    why = as_unsharded(one, 20, 128, 40).reason
    assert why.startswith("as if not sharded: the 20 chunks a request takes with all 128 ")
    assert "one pass: a request holds at most max_len = 64" in why and "override" not in why
    two = plan_chunks(40, 1, max_len=4096, **kw)
    assert two.max_chunks == 20 and two.waves == 2
    why = as_unsharded(two, 20, 128, 40).reason
    assert "second wave" in why and "one pass" not in why and "override" not in why
