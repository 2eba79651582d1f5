"""The tensor-parallel launcher without a GPU: ranks as threads and as spawned processes,
the fake communicator, the float32 schedule model as each rank's step; the CLI's --tp."""
from __future__ import annotations

import json
import os
from dataclasses import replace

import numpy as np
import pytest
from click.testing import CliRunner

import mlasandbox as mla
from mlasandbox import toolkit
from mlasandbox.cli import tp_cmd
from mlasandbox.cli.main import main
from mlasandbox.compare import DEFAULT_TOLERANCE, rel_l2
from mlasandbox.dims import Dims
from mlasandbox.reference import decode_paged
from mlasandbox.tp import head_bands
from mlasandbox.tp_bench import check_y
from mlasandbox.tp_comm import NO_MULTICAST_ENV
from mlasandbox.tp_launch import TPError, TPJob, launch
from mlasandbox.tp_rank import make_w_o

HAVE_GPU, _ = toolkit.device_available()
# Mixed lengths (empty, one position, across pages, cut into many chunks), two causal
# query tokens, an odd head count: 41 heads over 3 ranks are bands of 14, 14 and 13, each
# 28 or 26 rows (one mma32 block) where all 82 rows take three, so the bands' budget gives
# them more chunks than TP 1's.
LENGTHS = (0, 1, 200, 1500, 2100)
SHORT = (0, 700)   # where only the launcher is under test


def job(seed, **kw):
    base = dict(dims=Dims(n_head=41), lengths=LENGTHS, s_q=2, causal=True, page_size=16,
                seed=seed, d_model=96, engine="fake", executor="schedule")
    return TPJob(**(base | kw))


@pytest.fixture(scope="module")
def runs(module_seeds):
    """TP 1 and TP 3 of one batch, as threads; its float64 reference."""
    j = job(module_seeds.one())
    host = j.host_inputs()
    ref = decode_paged(host["q"], host["kv_cache"], host["block_table"],
                       host["cache_seqlens"], host["wv_b"], causal=True)
    return j, ref, launch(j, 1, mode="thread"), launch(j, 3, mode="thread")


def test_the_gathered_out_matches_one_gpu_and_the_float64_reference(runs):
    # Tolerance: the project's f32 relL2 on out (compare.DEFAULT_TOLERANCE, derived in
    # docs/numerics.md for f32 accumulation over up to 131072 positions); TP 1 and TP 3 are
    # each within it of the reference, so within twice it of each other.
    j, ref, one, three = runs
    assert one.ok and three.ok, [r.get("error") for r in one.reports + three.reports]
    tol = DEFAULT_TOLERANCE.out
    out1, out3 = one.reports[0]["out"], three.reports[0]["out"]
    assert out3.shape == ref.out.shape == (5, 2, 41, 128)
    assert rel_l2(out1, ref.out) <= tol and rel_l2(out3, ref.out) <= tol
    assert rel_l2(out3, out1) <= 2 * tol
    assert np.all(out3[0] == 0) and np.all(out3[1, 0] == 0)   # rows that see nothing
    # the bands ran their own plans: the budget was re-derived, not copied from TP 1
    assert three.reports[0]["plans"]["band"]["grid"] != one.reports[0]["plans"]["band"]["grid"]


def test_the_all_reduced_projection_is_the_sum_over_every_band(runs):
    j, ref, one, three = runs
    w = make_w_o(41, 128, j.d_model, seed=j.seed)
    for run in (one, three):
        y, out = run.reports[0]["y"], run.reports[0]["out"]
        assert y.shape == (5, 2, j.d_model)
        assert check_y(y, out, w)["ok"]
    # y is the projection of the right out, not only consistent with its own
    y64 = np.einsum("bihv,hvd->bid", ref.out, w)
    assert rel_l2(three.reports[0]["y"], y64) <= 2 * DEFAULT_TOLERANCE.out


def test_every_rank_reports_its_band(runs):
    _, _, _, three = runs
    assert [r["band"] for r in three.reports] == [[0, 14], [14, 28], [28, 41]]
    assert [r["rank"] for r in three.reports] == [0, 1, 2]
    assert all(r["engine"] == "fake" for r in three.reports)


def test_processes_compute_what_threads_do_with_multicast_off_in_every_child(runs,
                                                                            monkeypatch):
    j, _, _, three = runs
    for k in NO_MULTICAST_ENV:
        monkeypatch.delenv(k, raising=False)
    run = launch(j, 3, mode="process", timeout_s=120)
    assert run.ok, [r.get("error") for r in run.reports]
    np.testing.assert_array_equal(run.reports[0]["out"], three.reports[0]["out"])
    pids = {r["pid"] for r in run.reports}
    assert len(pids) == 3 and os.getpid() not in pids
    for r in run.reports:
        assert r["env"] == NO_MULTICAST_ENV, r["rank"]
    assert not any(k in os.environ for k in NO_MULTICAST_ENV)   # the parent's is restored


@pytest.mark.parametrize("fault_rank", [0, 2])
def test_a_fault_in_one_ranks_attention_is_reported_as_that_rank_and_phase(fault_rank,
                                                                          seeds):
    run = launch(job(seeds.one(), lengths=SHORT, fault_rank=fault_rank), 3, mode="process",
                 timeout_s=120)
    assert not run.ok
    bad = run.failures()
    assert [r["rank"] for r in bad] == [fault_rank]
    r = bad[0]
    assert r["phase"] == "attn" and "cudaErrorIllegalAddress" in r["error"]
    assert r["launch"]["grid"] == r["plans"]["band"]["grid"]
    assert r["launch"]["kernel"] == r["plans"]["band"]["kernel"]
    assert f"grid {tuple(r['launch']['grid'])}" in r["error"]
    for other in run.reports:
        if other["rank"] != fault_rank:   # stopped at the checkpoint, not in a collective
            assert other["peer_failed"] and f"rank {fault_rank} failed" in other["error"]
            assert "all_gather" in other["error"]
    with pytest.raises(TPError, match=f"rank {fault_rank}, phase 'attn'"):
        run.raise_for_failure()


def test_without_the_fault_the_same_job_passes(seeds):
    """The fault test's negative control: nothing else in the job fails."""
    assert launch(job(seeds.one(), lengths=SHORT), 3, mode="process", timeout_s=120).ok


def test_the_unsharded_budget_computes_the_same_step(seeds):
    j = job(seeds.one(), lengths=SHORT, budgets=("band", "unsharded"))
    run = launch(j, 3, mode="thread")
    assert run.ok
    p = run.reports[0]["plans"]
    assert p["unsharded"]["max_chunks"] < p["band"]["max_chunks"]
    assert "as if not sharded" in p["unsharded"]["reason"]


@pytest.mark.parametrize("world, kw, match", [
    (0, {}, "tp must be an integer >= 1"),
    (42, {}, "tp=42 is more ranks than the 41 heads"),
    (2, {"fault_rank": 2}, "fault_rank must be in 0..1"),
    (2, {"engine": "torch"}, "the schedule executor computes on the host"),
])
def test_bad_launches_are_refused_before_any_rank_starts(world, kw, match):
    with pytest.raises(ValueError, match=match):
        launch(job(0, **kw), world, mode="process")


def test_a_gpu_job_needs_a_gpu_per_rank_and_a_thread_needs_the_fake_engine():
    with pytest.raises(ValueError, match="tp=2 needs 2 GPUs .* but 1 is visible"):
        launch(job(0, executor="gpu"), 2, gpus=1)
    with pytest.raises(ValueError, match="mode must be process or thread"):
        launch(job(0), 1, mode="fork")


def test_the_python_entry_point(seeds):
    j = job(seeds.one(), lengths=SHORT)
    host = j.host_inputs()
    w = make_w_o(41, 128, 32, seed=1)
    args = (host["q"], host["kv_cache"], host["block_table"], host["cache_seqlens"],
            host["wv_b"], w)
    res = mla.tp_decode(*args, tp=2, causal=True, engine="fake", executor="schedule")
    ref = decode_paged(*args[:5], causal=True)
    assert rel_l2(res.out, ref.out) <= DEFAULT_TOLERANCE.out
    assert check_y(res.y, res.out, w)["ok"]
    assert [r["band"] for r in res.run.reports] == [[0, 21], [21, 41]]
    with pytest.raises(TypeError, match="host NumPy arrays"):
        mla.tp_decode(*args[:4], list(host["wv_b"]), tp=2)
    with pytest.raises(ValueError, match=r"w_o must be \[n_head=41, v_head=128"):
        mla.tp_decode(*args[:5], w[:3], tp=2, engine="fake", executor="schedule")


def test_the_rank_step_checks_its_band():
    from mlasandbox.tp_comm import FakeCommunicator

    j = job(0)
    host = j.host_inputs()
    comm = FakeCommunicator(1, 3, None, "/nonexistent")
    with pytest.raises(ValueError, match=r"rank 1 of 3 holds heads 14..27 \(14\), but q has 41"):
        mla.TensorParallelStep(comm, host["q"], host["kv_cache"], host["block_table"],
                               host["cache_seqlens"], host["wv_b"], n_head=41,
                               executor="schedule")


def test_auto_on_a_rank_is_what_one_gpu_picks_for_the_band_and_for_all_heads():
    from mlasandbox import registry
    from mlasandbox.paged_api import paged_variant
    from mlasandbox.tp import fixed_facts, unsharded_chunks
    from mlasandbox.tp_comm import FakeCommunicator
    from mlasandbox.tp_rank import band_view

    # 128 heads over 2 ranks: a band of 64 heads, q f16, 4 requests of 8192, so 64 rows x
    # 8192 of room x 4 = 2^21, a large step: wgmma64 on the H200 the schedule executor
    # models, as on one GPU (the rows alone would say mma32)
    j = TPJob(dims=Dims(n_head=128), lengths=(8192,) * 4, q_dtype="f16", seed=0,
              engine="fake", executor="schedule")
    host = j.host_inputs()
    q, wv_b, _ = band_view(head_bands(128, 2)[0], host["q"], host["wv_b"])

    def rank0(q, budget="band"):
        return mla.TensorParallelStep(FakeCommunicator(0, 2, None, "/nonexistent"), q,
                                      host["kv_cache"], host["block_table"],
                                      host["cache_seqlens"], wv_b, n_head=128, budget=budget,
                                      executor="schedule")
    step = rank0(q, "unsharded")
    assert step.guard.variant == "wgmma64" and "wgmma" in step.attn_launch.kernel

    # the unsharded budget: the chunks of wgmma64 at all 128 heads (2 head blocks of 64
    # rows), not those of mma32 (4 of 32)
    def budget(name):
        inst = registry.paged_attention_instance(paged_variant(name, 1, 128), "f16", "f16")
        return unsharded_chunks(4, 1, 128, fixed_facts(inst.heads, inst.tile_rows, 1),
                                num_sms=132)
    assert step.plan.max_chunks == budget("wgmma64") != budget("mma32")
    # an f32 q, which wgmma64 does not take: mma32
    assert rank0(q.astype(np.float32)).guard.variant == "mma32"
    # over 8 ranks a band is 16 heads, 16 rows: auto runs mma16 there, where all 128 heads
    # on one GPU run wgmma64 (its rows, not all heads', decide a band's kernel)
    q16, wv16, _ = band_view(head_bands(128, 8)[0], host["q"], host["wv_b"])
    step = mla.TensorParallelStep(FakeCommunicator(0, 8, None, "/nonexistent"), q16,
                                  host["kv_cache"], host["block_table"], host["cache_seqlens"],
                                  wv16, n_head=128, executor="schedule")
    assert step.guard.variant == "mma16" and "mma" in step.attn_launch.kernel


# ---- the CLI ----------------------------------------------------------------------------

def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.mark.parametrize("args, match", [
    (("bench", "--tp", "2"), "--tp needs --batch B or --serving PRESET"),
    (("bench", "--batch", "2", "--heads", "7", "--tp", "8"), "tp=8 is more ranks than the 7"),
    (("bench", "--batch", "2", "--tp", "0"), "0 is not in the range x>=1"),
    (("grid", "--variant", "split", "--heads", "8", "--ctx", "100", "--tp", "9",
      "--blocks-per-sm", "1"), "tp=9 is more ranks than the 8 heads"),
    (("repro", "--variant", "split", "--rank", "1"), "--rank needs --tp N"),
    (("repro", "--variant", "split", "--heads", "4", "--tp", "2", "--rank", "2"),
     "rank must be in 0..1"),
])
def test_bad_tp_values_exit_2_naming_the_limit(args, match):
    r = cli(*args)
    assert r.exit_code == 2, r.output
    assert match in " ".join(r.output.split())


def test_more_ranks_than_visible_gpus_exits_2_before_any_work(monkeypatch):
    monkeypatch.setattr(tp_cmd.toolkit, "device_available", lambda: (True, "device 0: fake"))
    monkeypatch.setattr(tp_cmd, "visible_gpus", lambda: 2)

    def must_not_run(*a, **k):
        raise AssertionError("the bench ran")
    monkeypatch.setattr(tp_cmd, "run_tp_bench", must_not_run)
    r = cli("bench", "--batch", "2", "--tp", "4")
    assert r.exit_code == 2, r.output
    assert "tp=4 needs 4 GPUs (one rank per GPU), but 2 are visible" in " ".join(
        r.output.split())


@pytest.mark.skipif(HAVE_GPU, reason="shows what runs without a GPU")
def test_bench_tp_without_a_gpu_shows_every_ranks_plan():
    r = cli("bench", "--batch", "4", "--lengths", "131072", "--heads", "128", "--tp", "8",
            "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["timings"] is None and data["plan"]["tp"] == 8
    ranks = data["plan"]["ranks"]
    assert len(ranks) == 2 * 8   # one variant ("auto"), two budgets, eight ranks
    band = [x for x in ranks if x["budget"] == "band"]
    flat = [x for x in ranks if x["budget"] == "unsharded"]
    assert all(x["max_chunks"] > y["max_chunks"] for x, y in zip(band, flat))
    table = cli("bench", "--batch", "4", "--heads", "128", "--tp", "8").output
    assert "every rank's chunk plan" in table and "unsharded" in table


def test_tp_plans_resolve_auto_for_the_batch_as_the_paged_plans_do():
    from mlasandbox.bench_paged import make_paged_config
    from mlasandbox.tp_bench import tp_plan_report

    def ranks(tp, **kw):
        cfg = make_paged_config(batch=4, lengths="131072", heads=128, variants=("auto",), **kw)
        return tp_plan_report(cfg, tp, blocks_per_sm=1)["ranks"]
    # all 128 heads, q f16, a large step: wgmma64 on the modelled H200; f32 q: mma32
    assert {(r["asked"], r["variant"]) for r in ranks(1)} == {("auto", "wgmma64")}
    assert {r["variant"] for r in ranks(1, q_dtype="f32")} == {"mma32"}
    # a band of 16 heads runs mma16; its unsharded budget is wgmma64's at all heads
    tp8 = [r for r in ranks(8) if r["budget"] == "unsharded"]
    assert {r["variant"] for r in tp8} == {"mma16"}
    assert {r["max_chunks"] for r in tp8} == {ranks(1)[0]["max_chunks"]} != \
        {r["max_chunks"] for r in ranks(8, q_dtype="f32") if r["budget"] == "unsharded"}


def test_grid_tp_shows_every_rank():
    r = cli("grid", "--variant", "split", "--heads", "10", "--ctx", "131072", "--tp", "4",
            "--blocks-per-sm", "2", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert [x["heads"] for x in data["ranks"]] == [[b.start, b.stop]
                                                   for b in head_bands(10, 4)]
    assert cli("grid", "--variant", "split", "--heads", "10", "--ctx", "131072", "--tp", "4",
               "--blocks-per-sm", "2").exit_code == 0


def test_repro_tp_writes_one_ranks_band(tmp_path):
    out = tmp_path / "case.py"
    r = cli("repro", "--variant", "mma16", "--batch", "2", "--lengths", "300", "--heads", "7",
            "--tp", "3", "--rank", "2", "-o", out, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["n_head"] == 2 and out.exists()


def test_bench_tp_reaches_the_tp_bench_with_its_options(monkeypatch):
    seen = {}
    monkeypatch.setattr(tp_cmd.toolkit, "device_available", lambda: (True, "device 0: fake"))
    monkeypatch.setattr(tp_cmd, "visible_gpus", lambda: 8)

    def fake(cfg, tp, **kw):
        seen.update(cfg=cfg, tp=tp, **kw)
        return {"ok": True, "tp": tp, "engine": "fake", "variants": {}, "warnings": []}
    monkeypatch.setattr(tp_cmd, "run_tp_bench", fake)
    r = cli("bench", "--batch", "3", "--heads", "96", "--tp", "8", "--tp-engine", "torch")
    assert r.exit_code == 0, r.output
    assert seen["tp"] == 8 and seen["engine"] == "torch" and seen["gpus"] == 8
    assert seen["cfg"].variants == ("auto",) and seen["repeats"] == 20
    assert replace(seen["cfg"]).dims.n_head == 96
