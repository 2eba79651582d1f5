"""The paged bench on the CPU: options, serving presets, length specs, the byte and FLOP
formulas against hand-computed values, the chunk plans without a GPU, a whole run driven by
a fake backend (A/A, control phase, checks, peers skipped), and the CLI's paged branch."""
from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from click.testing import CliRunner
from gpu_support import fresh_seed, gpu

from mlasandbox import bench_gpu, metrics, toolkit
from mlasandbox.auto_variant import AutoFacts, auto_name
from mlasandbox.bench_gpu import PagedBackend
from mlasandbox.bench_paged import (DEFAULT_PAGED_VARIANTS, PAGED_PHASES, SERVING_PRESETS,
                                    make_paged_config, paged_work, plan_report,
                                    resolve_auto, run_paged_bench)
from mlasandbox.cli import bench_cmd
from mlasandbox.cli.main import main as cli
from mlasandbox.dims import PRESETS
from mlasandbox.paged_inputs import parse_lengths
from mlasandbox.timing import Timing, summarize

DSV3 = PRESETS["dsv3"]


# ---------------------------------------------------------------------------- options

def test_the_serving_presets_are_the_table_of_shapes():
    want = {"b128-4k-h128": (128, "4096", 128, 1, False),
            "b128-4k-h128-mtp2": (128, "4096", 128, 2, True),
            "b128-4k-h16": (128, "4096", 16, 1, False),
            "b32-8k-var-h16": (32, "normal:8192:4096", 16, 1, False),
            "b8-32k-var-h128": (8, "normal:32768:16384", 128, 1, False)}
    for name, (b, spec, h, s_q, causal) in want.items():
        cfg = make_paged_config(serving=name)
        assert (cfg.batch, cfg.lengths_spec, cfg.dims.n_head, cfg.s_q, cfg.causal) == \
            (b, spec, h, s_q, causal), name
        assert len(cfg.lengths) == b and cfg.page_size == 64
    assert set(want) == set(SERVING_PRESETS)


def test_explicit_options_override_a_preset_and_defaults_hold():
    cfg = make_paged_config(serving="b128-4k-h16", batch=4, s_q=3, causal=True)
    assert (cfg.batch, cfg.s_q, cfg.causal, cfg.dims.n_head) == (4, 3, True, 16)
    assert cfg.lengths == (4096,) * 4 and cfg.tokens == 12
    assert cfg.variants == DEFAULT_PAGED_VARIANTS == ("mma16", "mma32", "split", "batched16")
    assert cfg.q_dtype == "cache" and cfg.peers == ()


def test_normal_lengths_are_drawn_from_the_seed_and_clipped():
    a = make_paged_config(batch=64, lengths="normal:100:200", seed=3).lengths
    assert a == make_paged_config(batch=64, lengths="normal:100:200", seed=3).lengths
    assert a != make_paged_config(batch=64, lengths="normal:100:200", seed=4).lengths
    assert min(a) == 0 and max(a) > 100


def test_a_lengths_file_is_read_one_per_line(tmp_path):
    f = tmp_path / "lens.txt"
    f.write_text("# lengths\n5\n\n0\n70000\n")
    assert parse_lengths(f"@{f}", 5).tolist() == [5, 0, 70000, 5, 0]
    bad = tmp_path / "bad.txt"
    bad.write_text("5\nseven\n")
    with pytest.raises(ValueError, match="line 2: 'seven'"):
        parse_lengths(f"@{bad}", 2)
    with pytest.raises(ValueError, match="No such file"):
        parse_lengths(f"@{tmp_path / 'none'}", 2)
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(ValueError, match="holds no lengths"):
        parse_lengths(f"@{tmp_path / 'empty'}", 2)


@pytest.mark.parametrize("kw,words", [
    ({}, "needs --batch"), ({"batch": 0}, "batch must be"), ({"batch": 2, "page_size": 32},
                                                             "page size"),
    ({"batch": 2, "lengths": "4,-1"}, "outside 0.."), ({"batch": 2, "lengths": "normal:1"}, "normal"),
    ({"batch": 2, "variants": ("per_head",)}, "batch 1"),
    ({"batch": 2, "variants": ("tiled16",)}, "batch 1"),
    ({"batch": 2, "variants": ("cublas",)}, "cannot be captured"),
    ({"batch": 2, "peers": ("vllm",)}, "unknown peer"), ({"serving": "huge"}, "serving preset"),
    ({"batch": 2, "s_q": 0}, "s_q"), ({"batch": 2, "aa_rounds": 1}, "2 rounds"),
    ({"batch": 2, "cache_dtype": "f32"}, "cache dtype"),
    # refused with the options, not after the plans: wgmma64 is built for a 16-bit q only
    ({"batch": 2, "variants": ("wgmma64",), "q_dtype": "f32"},
     r"wgmma64 takes q in the cache dtype \(f16\), got q=f32")])
def test_bad_options_are_named(kw, words):
    with pytest.raises(ValueError, match=words):
        make_paged_config(**kw)


def test_more_lengths_than_the_batch_are_refused_and_fewer_cycled(tmp_path):
    # fewer are cycled, as the --lengths help says; more would drop requests unsaid
    for spec in ("1,2,3", [1, 2, 3], np.array([1, 2, 3])):
        with pytest.raises(ValueError, match="lengths: 3 given for a batch of 2"):
            parse_lengths(spec, 2)
    f = tmp_path / "lens.txt"
    f.write_text("5\n6\n7\n")
    with pytest.raises(ValueError, match=r"lengths file '.*lens\.txt': 3 given for a batch "
                                         "of 2; give at most 2"):
        parse_lengths(f"@{f}", 2)
    assert parse_lengths(f"@{f}", 3).tolist() == [5, 6, 7]
    assert parse_lengths("1,2", 5).tolist() == [1, 2, 1, 2, 1]
    with pytest.raises(ValueError, match="for a batch of 2"):
        make_paged_config(batch=2, lengths="1,2,3")


@pytest.mark.parametrize("seed", [-1, 1.5, True, "3"])
def test_a_bad_seed_is_named(seed):
    with pytest.raises(ValueError, match=f"seed must be an integer >= 0, got {seed!r}"):
        parse_lengths("normal:100:10", 4, seed)


def test_s_q_is_bounded_by_the_kernels_rows_and_the_projection_grid():
    # batch x s_q rows a head: the projection's grid z holds ceil(. / 32) <= 65535 blocks
    assert make_paged_config(batch=2, s_q=1_048_560).s_q == 1_048_560
    for s_q in (1_048_561, 2**31, 2**70):
        with pytest.raises(ValueError, match=r"s_q must be <= 1,048,560 \(the output "
                                             r"projection's grid z dimension holds "
                                             r"ceil\(batch 2 x s_q / 32\) blocks"):
            make_paged_config(batch=2, s_q=s_q)
    # s_q x heads query rows are int32 in the kernels: at 4096 heads that is the tighter limit
    with pytest.raises(ValueError, match=r"s_q must be <= 524,287 \(the kernels index s_q x "
                                         "4096 heads query rows as int32"):
        make_paged_config(batch=1, heads=4096, s_q=524_288)
    for s_q in (0, 1.5, "2"):
        with pytest.raises(ValueError, match="s_q must be an integer >= 1"):
            make_paged_config(batch=2, s_q=s_q)


def test_the_paged_sweep_checks_s_q_before_compiling(monkeypatch):
    from mlasandbox import sweep_paged

    monkeypatch.setattr(sweep_paged, "ptxas_report", lambda *a, **k: pytest.fail("compiled"))
    cfg = replace(make_paged_config(batch=2), s_q=2**31)
    with pytest.raises(ValueError, match="s_q must be <= 1,048,560"):
        sweep_paged.run_paged_sweep(cfg, use_gpu=False)


def test_the_step_cost_does_not_grow_with_s_q():
    import time

    d = DSV3.with_heads(16)
    t0 = time.perf_counter()
    c = metrics.paged_step_cost("mma16", d, [5, 10**6], s_q=10**7, causal=True)
    assert time.perf_counter() - t0 < 1.0   # closed form: a loop over 10**7 queries is not
    # causal: request 5 sees 5+4+3+2+1, request 10**6 sees n + (n-1) + ... + 1
    seen = 16 * (15 + 10**6 * (10**6 + 1) // 2)
    assert c.flops == 2 * seen * (576 + 512) + 2 * 2 * 10**7 * 16 * 128 * 512


# ---------------------------------------------------------------------------- formulas

def test_paged_step_bytes_and_flops_by_hand():
    # 2 requests of 100 and 0 tokens, s_q 2 causal, 4 heads, f16 cache, f32 q, chunks (3, 0)
    d = DSV3.with_heads(4)
    c = metrics.paged_step_cost("mma16", d, [100, 0], s_q=2, causal=True, cache_dtype="f16",
                                q_dtype="f32", n_chunks=[3, 0], head_blocks=2)
    rows = 8   # s_q 2 x 4 heads
    # query 0 sees 99 positions, query 1 sees 100; the empty request none
    assert c.flops == 2 * 4 * (99 + 100) * (576 + 512) + 2 * 2 * rows * 128 * 512
    terms = {t.name: t for t in c.terms}
    assert terms["cache rows"].ideal == 100 * 576 * 2
    assert terms["cache rows"].issued == 100 * 576 * 2 * 2
    assert terms["q"].ideal == 2 * rows * 576 * 4 and terms["q"].issued == 3 * rows * 576 * 4
    assert terms["wv_b"].ideal == 4 * 128 * 512 * 2
    assert terms["wv_b"].issued == 2 * rows * 128 * 512 * 2
    assert terms["partials"].ideal == 2 * 3 * rows * 514 * 4
    assert terms["outputs"].ideal == 2 * rows * (128 + 512 + 1) * 4
    assert c.ideal_bytes == sum(t.ideal for t in c.terms)


def test_a_peer_step_has_no_partials_and_no_wv_b():
    c = metrics.paged_step_cost("flashmla", DSV3, [4096] * 128, with_wv_b=False)
    assert {t.name for t in c.terms} == {"cache rows", "q", "outputs"}
    assert c.flops == 2 * 128 * 128 * 4096 * (576 + 512)
    # FlashMLA's 240 us at this shape is the 608 TFLOP/s of its own figures
    assert c.flops / 240e-6 / 1e12 == pytest.approx(608, abs=1)


def test_non_causal_flops_are_rows_times_length():
    c = metrics.paged_step_cost("split", DSV3.with_heads(16), [7, 9], s_q=3)
    assert c.flops == 2 * 3 * 16 * 16 * 1088 + 2 * 2 * 48 * 128 * 512


def test_formula_bad_input():
    with pytest.raises(ValueError, match="lengths"):
        metrics.paged_step_cost("split", DSV3, [-1])
    with pytest.raises(ValueError, match="one entry per request"):
        metrics.paged_step_cost("split", DSV3, [1, 2], n_chunks=[1])


# ---------------------------------------------------------------------------- no GPU

def test_plan_report_runs_the_chunk_rule_per_variant():
    cfg = make_paged_config(batch=3, lengths="0,300,5000", heads=16)
    rep = plan_report(cfg, num_sms=132, blocks_per_sm=2)
    assert not rep["problems"] and [r["variant"] for r in rep["plans"]] == list(cfg.variants)
    mma16 = rep["plans"][0]
    assert mma16["grid"] == [1, 264, 1] and mma16["tile"] == 64   # 264 chunk programs
    assert mma16["chunks_min"] == 0            # the empty request runs nothing
    # 84 tiles in all on 264 programs: a tile a chunk, 5000 -> 79 chunks, 300 -> 5
    assert mma16["chunks_max"] == 79 and mma16["programs_run"] == 84
    assert mma16["merge"] == "merge kernel"    # 176 chunk slots a request: past 16


def test_plan_report_plans_a_user_kernel_from_its_own_header_and_compile():
    # rows a block and blocks/SM are the user file's (ROWS=4: 4 rows, 128 threads), not
    # those of a built-in kernel; a value outside the built-ins' instances (3) is planned too
    from pathlib import Path

    from mlasandbox.geometry import theoretical_blocks_per_sm
    from mlasandbox.registry import resolve_variant
    from mlasandbox.user_kernel import compile_report, load_kernel

    src = Path(__file__).parent / "data" / "byok_warp_rows.cu"
    cfg = make_paged_config(batch=4, lengths="4096", heads=16,
                            variants=(f"{src}:ROWS=4", f"{src}:ROWS=3"))
    rep = plan_report(cfg, num_sms=132)
    assert not rep["problems"], rep["problems"]
    four, three = rep["plans"]
    want = compile_report(load_kernel(f"{src}:ROWS=4"), params_override={"ROWS": [4]})[0]
    builtin = theoretical_blocks_per_sm(resolve_variant("batched", 4), "f16", "f32")
    assert want.blocks_per_sm != builtin["blocks_per_sm"]    # so the test can tell them apart
    assert four["rows_per_block"] == 4 and four["grid"][0] == 4
    assert four["blocks_per_sm"].startswith(f"{want.blocks_per_sm} blocks/SM from its compile")
    assert three["rows_per_block"] == 3 and three["grid"][0] == 6     # ceil(16 / 3)


def test_plan_report_resolves_auto_as_on_the_h200_and_plans_each_variant_once():
    # 128 rows x 4096 of room x 4 requests: a large step, q f16: wgmma64 on the sm_90 modelled
    cfg = make_paged_config(batch=4, lengths="4096", heads=128,
                            variants=("auto", "wgmma64", "mma32"))
    rep = plan_report(cfg, num_sms=132, blocks_per_sm=1)
    assert [(r["asked"], r["variant"]) for r in rep["plans"]] == [("auto", "wgmma64"),
                                                                 ("mma32", "mma32")]
    assert rep["auto"]["variant"] == "wgmma64" and rep["auto"]["also_asked"]
    assert rep["plans"][0]["rows_per_block"] == 64
    # the same batch with an f32 q: mma32, which wgmma64 cannot take
    f32 = make_paged_config(batch=4, lengths="4096", heads=128, variants=("auto",),
                            q_dtype="f32")
    (row,) = plan_report(f32, num_sms=132, blocks_per_sm=1)["plans"]
    assert (row["asked"], row["variant"], row["rows_per_block"]) == ("auto", "mma32", 32)
    assert plan_report(f32, blocks_per_sm=1)["auto"]["also_asked"] is False


def test_resolve_auto_follows_the_device_arch_and_keeps_named_variants():
    cfg = make_paged_config(batch=4, lengths="4096", heads=128, variants=("auto", "mma16"))
    names, pick = resolve_auto(cfg, "sm_90")
    assert names == ("wgmma64", "mma16") and "large step" in pick["why"]
    names, pick = resolve_auto(cfg, "sm_80")   # no wgmma there
    assert names == ("mma32", "mma16") and pick["arch"] == "sm_80"
    facts = AutoFacts.of_lengths(cfg.lengths, cfg.page_size, "f16", "f16", "sm_80")
    assert pick["variant"] == auto_name(1, 128, facts)
    plain = make_paged_config(batch=4, heads=128, variants=("mma16", "split"))
    assert resolve_auto(plain) == (("mma16", "split"), None)


@pytest.mark.parametrize("batch,q,merge", [
    (32, "cache", "attention kernel"),          # 9 chunk slots, q f16: the kernel merges
    (32, "f32", "merge kernel"),                # the f32-q kernels are built without it
    (200, "cache", "none: one chunk a request")])  # a single pass
def test_plan_report_says_where_the_chunks_are_merged(batch, q, merge):
    cfg = make_paged_config(batch=batch, lengths="4096", heads=16, variants=["mma16"], q_dtype=q)
    (row,) = plan_report(cfg, num_sms=132, blocks_per_sm=1)["plans"]
    assert row["merge"] == merge, row


@pytest.mark.parametrize("lengths,merge", [("64", "none: one chunk a request"),
                                           ("65", "merge kernel")])
def test_plan_report_plans_for_the_table_the_run_builds(lengths, merge):
    # the bench's tight table: 64 positions at page 64 hold one tile, a single pass as the
    # step would plan it (plan_for); 65 take two pages, room for two chunks: the free plan
    cfg = make_paged_config(batch=1, lengths=lengths, heads=16, variants=["mma16"])
    (row,) = plan_report(cfg, num_sms=132, blocks_per_sm=1)["plans"]
    assert row["merge"] == merge and (row["grid"] == [1, 1, 1]) == (lengths == "64"), row


@pytest.mark.parametrize("lengths,waves", [("4096", [1, 2]), ("normal:4096:2048", [2, 2])])
def test_plan_report_says_which_waves_the_lengths_take(lengths, waves):
    # B = 128 on 132 slots: the grid offers a second wave; equal requests keep one, varied
    # ones (the longest would set one wave) take both. B = 32 is offered none.
    cfg = make_paged_config(batch=128, lengths=lengths, heads=16, variants=["mma16"])
    (row,) = plan_report(cfg, num_sms=132, blocks_per_sm=1)["plans"]
    assert row["waves"] == waves and row["grid"] == [1, 264, 1], row
    assert (row["programs_run"] > 132) == (waves[0] == 2)
    cfg = make_paged_config(batch=32, lengths="normal:8192:4096", heads=16, variants=["mma16"])
    assert plan_report(cfg, num_sms=132, blocks_per_sm=1)["plans"][0]["waves"] == [1, 1]


# ---------------------------------------------------------------------------- a fake run

class FakePagedBackend:
    def __init__(self, fail=(), skipped=(), aa_differs=False, arch="sm_90", peer_us=80.0):
        self.fail, self.skipped, self.aa_differs = set(fail), list(skipped), aa_differs
        self.arch = arch   # the device's, which "auto" is resolved for
        self.peer_us = peer_us
        self.calls, self.arms = [], []

    def meta(self):
        return {"device": "Fake H200", "clocks": "NVML every 5 ms (fake)"}

    def ceilings(self, copy_bytes, gemm_n, kw):
        return {"copy_GBps": 4000.0, "gemm_TFLOPs": 700.0, "fma_TFLOPs": 65.0}

    def prepare_paged(self, cfg):
        bench_gpu._refuse_auto(cfg.variants)   # as PagedBackend
        self.cfg = cfg
        self.calls.append("prepare")

    def time_control(self, graph, kw):
        self.calls.append("control")
        return _t(10.0)

    def skipped_peers(self):
        return list(self.skipped)

    def available_peers(self):
        return [p for p in self.cfg.peers if p not in {s["name"] for s in self.skipped}]

    def check_paged(self, cfg):
        names = list(cfg.variants) + self.available_peers()
        return [{"variant": n, "ok": n not in self.fail, "detail": "relL2 1"} for n in names]

    def paged_plan(self, v, arm=0):
        return {"grid": [1, 2 + (arm if self.aa_differs else 0), self.cfg.batch],
                "max_chunks": 2, "head_blocks": 1, "n_chunks": [1] * self.cfg.batch}

    def time_paged(self, v, phase, kw, arm=0):
        self.calls.append((v, phase))
        self.arms.append((v, phase, arm))
        return _t({"attn": 90.0, "combine": 10.0, "step": 100.0, "graph": 95.0,
                   "latent": 85.0, "floor": 8.0}[phase]
                  * (1.2 if v == "split" else 1.0))

    def time_peer(self, name, kw):
        self.calls.append((name, "peer"))
        return _t(self.peer_us, UNCAPPED)

    def release_steps(self):
        pass

    def release(self):
        pass


# the fake's clocks: our phases held by the power cap, the peers not
CAPPED = {"clock_samples": 9, "sm_mhz": 1905.0, "sm_mhz_min": 1890.0, "power_w": 681.0,
          "power_capped": 0.5, "thermal": 0.0}
UNCAPPED = dict(CAPPED, sm_mhz=1980.0, sm_mhz_min=1980.0, power_w=560.0, power_capped=0.0)


def _t(us, clocks=CAPPED):
    xs = [us * (1 + 0.001 * i) for i in range(10)]
    return Timing(summarize(xs), "events", "", xs, 0.0, True, clocks)


def test_a_run_times_every_phase_and_peer_with_the_instruments():
    cfg = make_paged_config(batch=4, lengths="4096", heads=16, peers=("torch", "flashmla"),
                            aa_rounds=4)
    be = FakePagedBackend(skipped=[{"name": "flashmla", "reason": "ImportError: no flash_mla"}])
    res = run_paged_bench(backend=be, config=cfg)
    assert res["ok"] and res["noise_floor"]["floor"] is not None
    phases = [(r["variant"], r["phase"]) for r in res["rows"] if r["variant"] != "-"]
    assert phases == [(v, p) for v in cfg.variants for p in PAGED_PHASES] + [("torch", "step")]
    # the control phase at the start, before every variant and peer, and at the end
    labels = [r["control_label"] for r in res["rows"] if r["variant"] == "-"]
    assert labels == ["start"] + [f"before {v}" for v in cfg.variants] + ["before torch", "end"]
    step = next(r for r in res["rows"] if r["variant"] == "mma16" and r["phase"] == "graph")
    assert step["tokens_per_s"] == pytest.approx(4 / 95e-6, rel=0.01)
    cost = metrics.paged_step_cost("mma16", cfg.dims, cfg.lengths, cfg.s_q, cfg.causal,
                                   "f16", "f16", [1] * 4, 1)
    assert step["GBps_ideal"] == pytest.approx(cost.ideal_bytes / step["median_us"] / 1e3)
    assert step["TFLOPs"] == pytest.approx(cost.flops / step["median_us"] / 1e6)
    peer = next(r for r in res["rows"] if r["variant"] == "torch")
    assert peer["kind"] == "peer" and peer["roof"] == "GEMM"
    assert res["skipped_peers"] == [{"name": "flashmla", "reason": "ImportError: no flash_mla"}]
    assert any("flashmla skipped: ImportError" in w for w in res["warnings"])
    # our fastest whole step excludes the peers (no wv_b in their call); the same work is
    # our latent step against them: the peer's 80 beats the latent 85, the graph 95 would
    # have lost by more
    assert res["fastest"]["variant"] == "mma16" and res["fastest"]["phase"] == "graph"
    assert set(res["fastest"]["ties"]) == {"mma32", "batched16"}
    lfl = res["like_for_like"]
    assert lfl["variant"] == "torch" and lfl["median_us"] == pytest.approx(80.0, rel=0.01)
    latent = next(r for r in res["rows"] if r["variant"] == "mma16" and r["phase"] == "latent")
    lat_cost = metrics.paged_step_cost("mma16", cfg.dims, cfg.lengths, cfg.s_q, cfg.causal,
                                       "f16", "f16", [1] * 4, 1, with_wv_b=False)
    assert latent["flops"] == lat_cost.flops < step["flops"]
    assert latent["tokens_per_s"] == pytest.approx(4 / 85e-6, rel=0.01)
    assert paged_work(cfg) >= len([c for c in be.calls if c != "prepare"])


def test_our_side_of_the_like_for_like_is_the_latent_step_and_the_aa_times_both_arms():
    # a peer at 90 us loses to our latent step (85), which beats it; our whole step (95,
    # with wv_b) is not the same work and must not stand in for it
    cfg = make_paged_config(batch=4, lengths="4096", heads=16, peers=("torch",),
                            aa_rounds=4, variants=("mma16",))
    be = FakePagedBackend(peer_us=90.0)
    res = run_paged_bench(backend=be, config=cfg)
    lfl = res["like_for_like"]
    assert lfl["variant"] == "mma16" and lfl["phase"] == "latent"
    assert lfl["median_us"] == pytest.approx(85.0, rel=0.01)
    # the A/A step: both arms (its two steps of identical code), interleaved
    aa = [arm for v, phase, arm in be.arms if (v, phase) == ("mma16", "step")][-8:]
    assert sorted(aa) == [0, 0, 0, 0, 1, 1, 1, 1]


def test_tokens_a_second_count_every_query_token():
    cfg = make_paged_config(batch=4, lengths="4096", heads=16, s_q=2, causal=True,
                            aa_rounds=2, variants=("mma16",))
    res = run_paged_bench(backend=FakePagedBackend(), config=cfg)
    graph = next(r for r in res["rows"] if r["variant"] == "mma16" and r["phase"] == "graph")
    assert cfg.tokens == 8 and graph["tokens_per_s"] == pytest.approx(8 / 95e-6, rel=0.01)


def test_auto_is_checked_timed_and_labelled_as_the_variant_it_resolves_to():
    cfg = make_paged_config(batch=4, lengths="4096", heads=128, aa_rounds=2,
                            variants=("auto", "wgmma64", "mma16"))
    be = FakePagedBackend()
    res = run_paged_bench(backend=be, config=cfg)
    # the backend never sees "auto", and wgmma64, asked twice, is checked and timed once
    assert be.cfg.variants == ("wgmma64", "mma16")
    timed = [c for c in be.calls if isinstance(c, tuple) and c[1] == "attn"]
    assert timed == [("wgmma64", "attn"), ("mma16", "attn")]
    assert [c["variant"] for c in res["checks"]] == ["wgmma64", "mma16"]
    ours = [r for r in res["rows"] if r["variant"] != "-"]
    assert {(r["asked"], r["variant"]) for r in ours} == {("auto", "wgmma64"),
                                                          ("mma16", "mma16")}
    assert res["auto"] == {"asked": "auto", "variant": "wgmma64", "arch": "sm_90",
                           "also_asked": True, "why": res["auto"]["why"]}
    assert res["config"]["variants"] == ["auto", "wgmma64", "mma16"]   # as asked
    assert res["noise_floor"]["runs"][0]["variant"] == "wgmma64"
    assert paged_work(cfg) >= len([c for c in be.calls if c != "prepare"])
    # the device decides: on an sm_80 the same batch runs mma32
    be80 = FakePagedBackend(arch="sm_80")
    res80 = run_paged_bench(backend=be80, config=replace(cfg, variants=("auto", "mma16")))
    assert be80.cfg.variants == ("mma32", "mma16")
    assert res80["auto"]["variant"] == "mma32" and not res80["auto"]["also_asked"]


def test_the_paged_backend_refuses_an_unresolved_auto():
    with pytest.raises(ValueError, match="resolve auto"):
        bench_gpu._refuse_auto(("mma16", "auto"))
    bench_gpu._refuse_auto(("mma16", "wgmma64"))


def test_like_for_like_needs_a_timed_peer_and_a_passing_check():
    cfg = make_paged_config(batch=2, heads=16, aa_rounds=2, variants=("mma16", "split"))
    assert run_paged_bench(backend=FakePagedBackend(), config=cfg)["like_for_like"] is None
    cfg = make_paged_config(batch=2, heads=16, aa_rounds=2, variants=("mma16", "split"),
                            peers=("torch",))
    res = run_paged_bench(backend=FakePagedBackend(fail={"torch"}), config=cfg)
    assert res["like_for_like"] is None           # the only peer failed its check
    res = run_paged_bench(backend=FakePagedBackend(fail={"mma16"}), config=cfg)
    assert res["like_for_like"]["variant"] == "torch"
    assert res["fastest"]["variant"] == "split"   # mma16 failed: out of both


def test_a_failed_check_fails_the_run_and_loses_the_fastest_title():
    cfg = make_paged_config(batch=2, heads=16, aa_rounds=2, variants=("mma16", "split"))
    res = run_paged_bench(backend=FakePagedBackend(fail={"mma16"}), config=cfg)
    assert not res["ok"] and res["fastest"]["variant"] == "split"
    assert any("mma16 FAILED" in w for w in res["warnings"])


def test_a_failing_peer_is_a_warning_not_a_failed_run():
    cfg = make_paged_config(batch=2, heads=16, aa_rounds=2, peers=("torch",))
    res = run_paged_bench(backend=FakePagedBackend(fail={"torch"}), config=cfg)
    assert res["ok"] and any("torch FAILED" in w for w in res["warnings"])


def test_an_aa_that_is_not_identical_code_gives_no_floor():
    cfg = make_paged_config(batch=2, heads=16, aa_rounds=2)
    res = run_paged_bench(backend=FakePagedBackend(aa_differs=True), config=cfg)
    assert res["noise_floor"]["floor"] is None
    assert any("not A/A" in w for w in res["warnings"])


# ---------------------------------------------------------------------------- CLI

def _no_gpu(monkeypatch):
    monkeypatch.setattr(toolkit, "device_available", lambda: (False, "no CUDA device (test)"))


def test_cli_without_gpu_prints_the_chunk_plans(monkeypatch):
    _no_gpu(monkeypatch)
    r = CliRunner().invoke(cli, ["bench", "--batch", "4", "--lengths", "100,5000",
                                 "--heads", "16", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["timings"] is None and data["plan"]["batch"] == 4
    assert data["config"]["lengths"] == [100, 5000, 100, 5000]
    r = CliRunner().invoke(cli, ["bench", "--serving", "b128-4k-h16"])
    assert r.exit_code == 0 and "No GPU here" in r.output and "chunk plans" in r.output


def test_cli_without_gpu_says_what_auto_resolves_to(monkeypatch):
    _no_gpu(monkeypatch)
    args = ["bench", "--batch", "4", "--lengths", "4096", "--heads", "128", "--variants"]
    r = CliRunner(env={"COLUMNS": "100"}).invoke(cli, [*args, "auto"])
    assert r.exit_code == 0, r.output
    assert "auto -> wgmma64 on sm_90" in r.output and "auto (wgmma64)" in r.output
    r = CliRunner().invoke(cli, [*args, "auto,wgmma64", "--json"])
    data = json.loads(r.output)
    assert data["plan"]["auto"]["variant"] == "wgmma64" and data["plan"]["auto"]["also_asked"]
    assert [(p["asked"], p["variant"]) for p in data["plan"]["plans"]] == [("auto", "wgmma64")]
    r = CliRunner().invoke(cli, [*args, "auto", "--q", "f32"])
    assert r.exit_code == 0 and "auto -> mma32" in r.output and "auto (mma32)" in r.output


def test_cli_depth_bench_refuses_auto_naming_batch(monkeypatch):
    _no_gpu(monkeypatch)
    r = CliRunner().invoke(cli, ["bench", "--variants", "split,auto"])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert "'--variants'" in r.output and "--batch" in r.output and "auto" in r.output


@pytest.mark.parametrize("args,words", [
    (["--csv", "{tmp}/p.csv"], "--csv needs timings"), (["--require-gpu"], "--require-gpu"),
    (["--tp", "2", "--require-gpu"], "--require-gpu")])
def test_cli_paged_options_that_need_a_gpu_exit_2_without_one(monkeypatch, tmp_path, args,
                                                              words):
    # no GPU is an input the run cannot take (exit 2, as bad input), not a failed check (1)
    _no_gpu(monkeypatch)
    args = [a.format(tmp=tmp_path) for a in args]
    r = CliRunner().invoke(cli, ["bench", "--batch", "4", "--lengths", "100", *args])
    assert r.exit_code == 2 and words in r.output and "no CUDA device (test)" in r.output, \
        r.output
    assert not (tmp_path / "p.csv").exists()


@pytest.mark.parametrize("args,words", [
    (["--lengths", "5"], "needs --batch"), (["--batch", "2", "--ctx", "64"], "depth bench"),
    (["--batch", "2", "--page-size", "32"], "page-size"),
    (["--batch", "70000"], "at most 65535"), (["--batch", "2", "--peers", "vllm"], "vllm"),
    (["--batch", "2", "--variants", "per_head"], "batch 1"),
    (["--batch", "2", "--lengths", "@/nonexistent/x"], "No such file"),
    (["--batch", "2", "--cache", "f16,bf16"], "one --cache")])
def test_cli_bad_paged_options_exit_2(monkeypatch, args, words):
    _no_gpu(monkeypatch)
    r = CliRunner().invoke(cli, ["bench", *args])
    assert r.exit_code == 2 and words in r.output, r.output


def test_cli_on_a_gpu_renders_the_run(monkeypatch, tmp_path):
    monkeypatch.setattr(toolkit, "device_available", lambda: (True, ""))
    seen = {}

    def fake_run(config, progress, log):
        seen["cfg"] = config
        return run_paged_bench(backend=FakePagedBackend(), config=config, progress=progress)
    monkeypatch.setattr(bench_cmd, "_run_paged_bench", fake_run)
    out = tmp_path / "p.csv"
    r = CliRunner().invoke(cli, ["bench", "--serving", "b32-8k-var-h16", "--aa-rounds", "2",
                                 "--peers", "torch", "--csv", str(out)])
    assert r.exit_code == 0, r.output
    assert seen["cfg"].batch == 32 and seen["cfg"].peers == ("torch",)
    assert "paged step" in r.output and "A/A floor" in r.output
    # the clock of each phase: ours held by the power cap (the fake's), the peer's not
    text = " ".join(r.output.split())
    assert "1,905 cap" in text and "1,980 " in text and "1,980 cap" not in text, r.output
    assert "SM MHz: the median SM clock over each phase's timed runs (NVML every 5 ms" in text
    lines = out.read_text().splitlines()
    assert lines[0].startswith("variant,kind,phase") and any("torch,peer" in x for x in lines)
    assert np.isfinite(float(lines[1].split(",")[5]))
    head = lines[0].split(",")
    by = {(x.split(",")[0], x.split(",")[2]): x.split(",") for x in lines[1:]}
    assert float(by[("torch", "step")][head.index("sm_mhz")]) == 1980.0
    assert float(by[("mma16", "attn")][head.index("power_capped")]) == 0.5


def test_cli_on_a_gpu_says_and_labels_what_auto_ran(monkeypatch, tmp_path):
    monkeypatch.setattr(toolkit, "device_available", lambda: (True, ""))

    def fake_run(config, progress, log):
        return run_paged_bench(backend=FakePagedBackend(), config=config)
    monkeypatch.setattr(bench_cmd, "_run_paged_bench", fake_run)
    out = tmp_path / "p.csv"
    r = CliRunner(env={"COLUMNS": "120"}).invoke(
        cli, ["bench", "--batch", "4", "--heads", "128", "--variants", "auto,wgmma64",
              "--aa-rounds", "2", "--csv", str(out)])
    assert r.exit_code == 0, r.output
    assert "auto -> wgmma64 on sm_90" in r.output and "it runs once" in r.output
    assert "auto (wgmma64)" in r.output and "fastest step: auto (wgmma64)" in r.output
    lines = out.read_text().splitlines()
    asked = lines[0].split(",").index("asked")
    assert {ln.split(",")[asked] for ln in lines[1:] if ln.startswith("wgmma64,")} == {"auto"}


# ---------------------------------------------------------------------------- on a GPU

@gpu
def test_gpu_paged_bench_checks_times_and_replays_every_variant():
    seed = fresh_seed()
    cfg = make_paged_config(batch=3, lengths="0,300,5000", heads=16, s_q=2, causal=True,
                            page_size=16, peers=("torch", "flashmla"), aa_rounds=2,
                            target_ms=5.0, max_repeats=20, min_repeats=3,
                            copy_bytes=64 << 20, gemm_n=2048, seed=seed)
    res = run_paged_bench(backend=PagedBackend(), config=cfg)
    ours = [c for c in res["checks"] if c["kind"] == "variant"]
    assert [c["variant"] for c in ours] == list(cfg.variants)
    assert all(c["ok"] for c in ours), (seed, [c["detail"] for c in ours if not c["ok"]])
    assert res["ok"] and res["noise_floor"]["runs"][0]["same_code"], f"seed={seed}"
    graph = [r for r in res["rows"] if r["phase"] == "graph"]
    assert len(graph) == len(cfg.variants) and all(r["tokens_per_s"] > 0 for r in graph)
    # the latent step (no wv_b) of every variant, its work that of the peers
    latent = {r["variant"]: r for r in res["rows"] if r["phase"] == "latent"}
    assert set(latent) == set(cfg.variants)
    assert all(latent[g["variant"]]["flops"] < g["flops"] for g in graph)
    if any(c["kind"] == "peer" and c["ok"] for c in res["checks"]):
        assert res["like_for_like"] is not None
    # a peer is checked and timed, or skipped with its reason (flashmla: page size 16)
    named = {c["variant"] for c in res["checks"] if c["kind"] == "peer"} | \
        {s["name"] for s in res["skipped_peers"]}
    assert named == {"torch", "flashmla"}
    assert all(s["reason"] for s in res["skipped_peers"])


@gpu
def test_gpu_paged_bench_checks_and_times_what_auto_resolves_to_on_this_device():
    import cupy

    from mlasandbox.paged_api import PagedDecodeStep
    from mlasandbox.paged_inputs import make_paged_inputs

    # 128 rows x 4096 x 4 requests, q f16: a large step, wgmma64 on an H200 (sm_90)
    seed = fresh_seed()
    cfg = make_paged_config(batch=4, lengths="4096", heads=128, aa_rounds=2, target_ms=5.0,
                            max_repeats=20, min_repeats=3, copy_bytes=64 << 20, gemm_n=2048,
                            seed=seed)
    arch = toolkit.arch_of_device()
    want = auto_name(1, 128, AutoFacts.of_lengths(cfg.lengths, 64, "f16", "f16", arch))
    if arch == "sm_90":
        assert want == "wgmma64"
    res = run_paged_bench(backend=PagedBackend(), config=replace(cfg, variants=("auto", want)))
    assert res["auto"]["variant"] == want and res["auto"]["also_asked"]
    assert res["ok"] and [c["variant"] for c in res["checks"]] == [want], \
        (seed, res["checks"])
    assert res["plans"][want]["variant"] == want          # the step built and timed
    ours = [r for r in res["rows"] if r["variant"] != "-"]
    assert ours and all((r["asked"], r["variant"]) == ("auto", want) for r in ours)
    # the bench's resolution is the step's own on this device
    host = make_paged_inputs(cfg.dims, cfg.lengths, page_size=64, cache_dtype="f16",
                             q_dtype="f16", seed=0)
    dev = {k: cupy.asarray(v) if hasattr(v, "shape") else v
           for k, v in host.decode_args().items()}
    assert PagedDecodeStep(**dev, variant="auto").variant.name == want


@gpu
def test_gpu_paged_check_has_power_without_the_rescale():
    seed = fresh_seed()
    cfg = make_paged_config(batch=2, lengths="5000,3000", heads=16, aa_rounds=2, seed=seed)
    be = PagedBackend()
    be.prepare_paged(cfg)
    rows = be.check_paged(cfg, rescale=False)
    assert rows and not any(r["ok"] for r in rows if r["kind"] == "variant"), (seed, rows)


def test_a_peer_the_check_finds_unfit_is_skipped_not_timed():
    class Refusing(FakePagedBackend):
        def check_paged(self, cfg):
            rows = super().check_paged(cfg)
            self.skipped.append({"name": "flashmla", "reason": "FlashMLA takes page_size 64"})
            return [r for r in rows if r["variant"] != "flashmla"]

    cfg = make_paged_config(batch=2, heads=16, aa_rounds=2, page_size=16,
                            peers=("flashmla", "torch"))
    be = Refusing()
    res = run_paged_bench(backend=be, config=cfg)
    assert res["skipped_peers"] == [{"name": "flashmla", "reason": "FlashMLA takes page_size 64"}]
    assert ("flashmla", "peer") not in be.calls and ("torch", "peer") in be.calls


def test_the_paged_tables_fit_100_columns_and_keep_the_times():
    import io

    from rich.console import Console

    from mlasandbox.cli import bench_cmd

    row = {"variant": "mma16", "kind": "variant", "phase": "step", "median_us": 158.4,
           "p10_us": 157.2, "p90_us": 159.9, "tokens_per_s": 201959.0, "GBps_ideal": 1848.0,
           "frac_copy_ideal": 0.43, "TFLOPs": 53.9, "frac_roof": 0.08, "roof": "GEMM",
           "mode": "events", "check_ok": True}
    peer = dict(row, variant="flashmla", kind="peer", median_us=85.9, check_ok=None)
    result = {"config": {"batch": 32, "lengths_spec": "normal:8192:4096", "dims": {"n_head": 16},
                         "s_q": 1, "causal": False, "page_size": 64, "cache_dtype": "f16"},
              "rows": [row, peer]}
    rep = {"batch": 32, "lengths": {"spec": "normal:8192:4096", "min": 0, "mean": 7611.0,
                                    "max": 13789}, "heads": 16, "s_q": 1, "causal": False,
           "page_size": 64, "num_sms": 132,
           "plans": [{"variant": "mma16", "rows_per_block": 16, "tile": 64, "grid": [1, 4, 32],
                      "chunks_min": 0, "chunks_max": 4, "programs_run": 124, "programs": 128,
                      "waves": [2, 2], "merge": "attention kernel", "flops": 8.547e9,
                      "ideal_bytes": 292.7e6,
                      "blocks_per_sm": "1 blocks/SM from the occupancy model"}]}
    for table, must in ((bench_cmd._paged_table(result), ("158.4", "85.9", "1,848")),
                        (bench_cmd._paged_plan_table(rep), ("0..4", "124 of 128", "2 of 2"))):
        out = io.StringIO()
        Console(file=out, width=100, color_system=None).print(table)
        text = out.getvalue()
        assert max(len(line) for line in text.splitlines()) <= 100, text
        assert all(m in text for m in must), text
