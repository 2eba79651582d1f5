"""run_bench driven by a fake backend (CPU): the work plan, the estimate, the A/A floor, the
control phase, the depth term, the fastest variant, the check gate, the CSV."""
from __future__ import annotations

import csv
import json
import types

import pytest

from lab_fakes import FakeBackend
from mlasandbox import registry
from mlasandbox.bench import SCHEMA, run_bench, write_csv
from mlasandbox.bench_config import (DEFAULT_CONTEXTS, estimate_seconds, make_config,
                                     plan_work, use_graph)
from mlasandbox.noise import NO_DIFFERENCE

SMALL = dict(contexts=(64, 4096, 131072), variants=("per_head", "split", "batched12", "cublas"))


def bench(backend=None, **kw):
    opts = {**SMALL, **kw}
    return run_bench(backend=backend or FakeBackend(), **opts)


# ---------------------------------------------------------------------------- config

def test_defaults_are_the_96_head_depth_run():
    cfg = make_config()
    assert cfg.dims.n_head == 96 and cfg.dims.key_dim == 576
    assert cfg.contexts == DEFAULT_CONTEXTS == (64, 512, 4096, 8192, 32768, 131072)
    assert set(cfg.variants) == set(registry.variant_names()) and "cublas" in cfg.variants
    assert cfg.cache_dtypes == ("f16",) and cfg.aa_context == 4095


def test_config_options():
    cfg = make_config(preset="dsv3", heads=16, contexts=(8192, 64, 64), hpbs=(1, 12),
                      cache_dtypes=("f16", "bf16"), q_dtype="cache", splits=7)
    assert cfg.dims.n_head == 16 and cfg.contexts == (64, 8192) and cfg.splits == 7
    # --hpb narrows the batched family only: the other families stay
    others = {n for n in registry.variant_names()
              if registry.variant(n).family not in ("batched", "split")}
    assert set(cfg.variants) == {"split", "batched12"} | others


@pytest.mark.parametrize("kw,words", [
    ({"preset": "nope"}, "unknown preset"), ({"contexts": (0, 5)}, ">= 1"),
    ({"variants": ("warp",)}, "unknown variant"), ({"hpbs": (3,)}, "heads_per_block"),
    ({"aa_ctx": 4096}, "below the split gate"), ({"aa_rounds": 1}, "2 rounds"),
    ({"q_dtype": "f8"}, "q dtype"), ({"cache_dtypes": ("f32",)}, "cache dtype"),
    ({"graph": "sometimes"}, "graph"), ({"min_repeats": 20, "max_repeats": 10}, "min_repeats"),
    ({"splits": 0}, "splits")])
def test_config_rejects_bad_options(kw, words):
    with pytest.raises(ValueError, match=words):
        make_config(**kw)


def test_work_plan_covers_every_measurement_once():
    cfg = make_config(**SMALL, aa_rounds=4)
    items = plan_work(cfg)
    times = [i for i in items if i.kind == "time"]
    # 4 variants (the cuBLAS engine too) x 3 contexts x (attn, combine, step)
    assert len(times) == 4 * 3 * 3
    assert any(i.variant == "cublas" and i.phase == "combine" for i in times)
    assert [i.variant for i in items if i.kind == "aa"] == ["per_head", "split"] * 4
    assert sum(i.kind == "control" for i in items) == 1 + 4 + 1
    assert sum(i.kind == "check" for i in items) == 4


def test_graph_mode_choice():
    cfg = make_config(**SMALL)
    assert use_graph(cfg, "split", 4096) and not use_graph(cfg, "split", 8192)
    assert not use_graph(cfg, "cublas", 64)            # the engine allocates per call
    assert use_graph(make_config(graph="always"), "per_head", 131072)
    assert not use_graph(make_config(graph="never"), "per_head", 64)


def test_default_estimate_fits_the_budget():
    est = estimate_seconds(make_config(), copy_GBps=4000.0)
    assert 1 < est["seconds"] < 480, est
    assert "n_ctx=131072" in est["slowest"]  # the longest context costs most


# ---------------------------------------------------------------------------- the run

def test_run_is_json_and_complete():
    res = bench()
    json.dumps(res)  # plain values only
    assert res["schema"] == SCHEMA and res["ok"] is True and res["harness_stable"] is True
    assert res["meta"]["device"] == "Fake H200"
    phases = {(r["variant"], r["n_ctx"], r["phase"]) for r in res["rows"] if r["variant"] != "-"}
    assert ("cublas", 64, "combine") in phases and ("split", 131072, "combine") in phases
    row = next(r for r in res["rows"] if (r["variant"], r["n_ctx"], r["phase"]) ==
               ("per_head", 131072, "attn"))
    assert row["splits"] == 1 and row["head_blocks"] == 96 and row["mode"] == "events"
    assert row["issued_bytes"] == 96 * 131072 * 576 * 2 + 96 * 576 * 4 + 96 * 514 * 4
    assert row["GBps_issued"] == pytest.approx(row["issued_bytes"] / row["median_us"] / 1e3)
    assert row["frac_copy_ideal"] == pytest.approx(row["GBps_ideal"] / 4000.0)
    short = next(r for r in res["rows"] if (r["variant"], r["n_ctx"], r["phase"]) ==
                 ("split", 64, "step"))
    assert short["mode"] == "graph"


# The bytes of `split`'s rows counted by hand: H = 4 heads, n_ctx = 4096, f16 cache (2 B),
# f32 q (4 B), K = 576 key columns, L = 512 latent, V = 128 value dims, S context slices.
# split runs one block per (head, slice): head_blocks = H = 4. A head's S blocks read n_ctx / S
# rows each, so between them they read the cache once: it is issued H times, whatever S is.
#   attn      cache rows        ideal 4096 x 576 x 2 = 4,718,592; issued x H = 18,874,368
#             q                 ideal 4 x 576 x 4 = 9,216; issued x S (each slice loads q)
#             partials written  S x 4 x (512 + 2) x 4 = S x 8,224 (m, l, acc), ideal = issued
#   combine   partials read     S x 8,224
#             wv_b              4 x 128 x 512 x 2 = 524,288
#             out, latent, lse  4 x (128 + 512 + 1) x 4 = 10,256
#   q_absorb  wk_b 524,288 + q_nope, q_rope 4 x (128 + 64) x 2 = 1,536 + q 9,216 = 535,040
#   step      q_absorb + attn + combine
# S = 1: attn    ideal 4,718,592 + 9,216 + 8,224 = 4,736,032
#                issued 18,874,368 + 9,216 + 8,224 = 18,891,808
#        combine 8,224 + 524,288 + 10,256 = 542,768
#        step    ideal 535,040 + 4,736,032 + 542,768 = 5,813,840
#                issued 535,040 + 18,891,808 + 542,768 = 19,969,616
# S = 4: attn    ideal 4,718,592 + 9,216 + 32,896 = 4,760,704
#                issued 18,874,368 + 36,864 + 32,896 = 18,944,128
#        combine 32,896 + 524,288 + 10,256 = 567,440
#        step    ideal 535,040 + 4,760,704 + 567,440 = 5,863,184
#                issued 535,040 + 18,944,128 + 567,440 = 20,046,608
SPLIT_BYTES = {   # S -> phase -> (ideal, issued)
    1: {"attn": (4_736_032, 18_891_808), "combine": (542_768, 542_768),
        "step": (5_813_840, 19_969_616)},
    4: {"attn": (4_760_704, 18_944_128), "combine": (567_440, 567_440),
        "step": (5_863_184, 20_046_608)},
}


@pytest.mark.parametrize("splits", sorted(SPLIT_BYTES))
def test_split_rows_count_the_bytes_of_their_slices(splits):
    """The bytes behind a split row's GB/s, exactly: an S-fold cache count, a partials term
    left out or not multiplied by S, or the row's S not reaching the formulas moves a total
    by 8,224 B or more (S = 1 catches a missing term, S = 4 an off-by-S)."""
    res = bench(heads=4, contexts=(4096,), variants=("split",), splits=splits)
    rows = {r["phase"]: r for r in res["rows"] if r["variant"] == "split"}
    assert {rows[p]["splits"] for p in SPLIT_BYTES[splits]} == {splits}
    assert {rows[p]["head_blocks"] for p in SPLIT_BYTES[splits]} == {4}
    got = {p: (rows[p]["ideal_bytes"], rows[p]["issued_bytes"]) for p in SPLIT_BYTES[splits]}
    assert got == SPLIT_BYTES[splits]
    # the rate is these bytes over the time (B / us / 1e3 = GB/s); the code divides by
    # us x 1e-6 and by 1e9 instead: the two differ by at most six roundings (1e-6 itself
    # inexact in binary), each within 2^-53 = 1.1e-16 relative, under 7e-16 in all
    for p, (ideal, issued) in SPLIT_BYTES[splits].items():
        us = rows[p]["median_us"]
        assert rows[p]["GBps_issued"] == pytest.approx(issued / us / 1e3, rel=1e-15), p
        assert rows[p]["GBps_ideal"] == pytest.approx(ideal / us / 1e3, rel=1e-15), p


def test_the_aa_runs_identical_code_interleaved():
    fake = FakeBackend()
    res = bench(fake, aa_rounds=4)
    aa = [c for c in fake.calls if c[0] == "time" and c[2] == 4095]
    assert [c[1] for c in aa] == ["per_head", "split", "split", "per_head"] * 2
    run = res["noise_floor"]["runs"][0]
    assert run["same_code"] and run["kernel"] == "attn_rows<cache=f16,q=f32>"
    assert run["rounds"] == 4 and res["noise_floor"]["floor"] == run["floor"] > 0
    # the two arms' own medians, each arm's timings in its own list (the fake's jitter
    # makes every timing differ): a floor from an arm against itself would read p90 0
    assert len(run["a_us"]) == len(run["b_us"]) == 4 and run["a_us"] != run["b_us"]
    assert run["p90"] > 0 and run["floor"] == max(run["p90"], run["resolution_term"])


def test_aa_floor_pairs_the_two_arms_round_by_round():
    from mlasandbox.bench import aa_floor
    from mlasandbox.noise import noise_floor

    times = {"a": iter([100.0, 104.0, 100.0]), "b": iter([101.0, 100.0, 110.0])}
    done = []
    nf, modes = aa_floor(lambda n: types.SimpleNamespace(median_us=next(times[n]),
                                                         mode="graph"),
                         ("a", "b"), 3, done.append)
    assert done == ["a", "b", "b", "a", "a", "b"] and modes == "graph"
    assert nf.a_us == (100.0, 104.0, 100.0) and nf.b_us == (101.0, 100.0, 110.0)
    assert nf == noise_floor([100.0, 104.0, 100.0], [101.0, 100.0, 110.0])
    assert nf.p90 > 0.05


def test_an_aa_that_is_not_aa_gives_no_floor():
    fake = FakeBackend(aa_kernels={"split": "attn<hpb=2,cache=f16,q=f32>"})
    res = bench(fake)
    assert res["noise_floor"]["floor"] is None and res["harness_stable"] is None
    assert any("is not A/A" in w for w in res["warnings"])


def test_depth_term_and_its_share():
    res = bench()
    d = {x["variant"]: x for x in res["depth"]}
    ph = d["per_head"]
    assert ph["short_ctx"] == 64 and ph["long_ctx"] == 131072
    assert ph["depth_us"] == pytest.approx(ph["t_long_us"] - ph["t_short_us"])
    assert ph["share"] > 0.95 and ph["measurable"] is True
    for x in res["depth"]:   # the depth term's share of the long context's time
        assert x["share"] == pytest.approx(x["depth_us"] / x["t_long_us"]) and x["share"] <= 1
    assert d["batched12"]["depth_us"] < ph["depth_us"]


def test_a_flat_curve_prints_no_measurable_difference():
    class Flat(FakeBackend):
        def _attn_us(self, variant, n_ctx, splits):
            return 1000.0
    res = bench(Flat(jitter=0.0))
    d = {x["variant"]: x for x in res["depth"]}
    assert d["per_head"]["measurable"] is False and d["per_head"]["text"] == NO_DIFFERENCE


def test_fastest_names_ties_within_the_floor():
    res = bench()
    f = {(x["n_ctx"]): x for x in res["fastest"]}
    assert f[131072]["variant"] == "batched12"
    # at 64, per_head and split both run one slice (split's gate): same model time -> ties
    # (batched12 splits 64 positions into two one-tile slices and is faster)
    f = {(x["n_ctx"]): x for x in bench(variants=("per_head", "split"))["fastest"]}
    assert set(f[64]["ties"]) | {f[64]["variant"]} >= {"per_head", "split"}


def test_a_wrong_kernel_is_never_the_fastest():
    res = bench(FakeBackend(fail_check={"batched12"}))
    assert res["ok"] is False
    assert all(x["variant"] != "batched12" for x in res["fastest"])
    assert any("batched12" in w and "FAILED" in w for w in res["warnings"])
    assert all(r["check_ok"] is False for r in res["rows"] if r["variant"] == "batched12")
    assert all(r["check_ok"] is True for r in res["rows"] if r["variant"] == "split")


def test_the_control_phase_moving_warns_that_the_harness_is_unstable():
    res = bench(FakeBackend(drift=0.05))
    assert res["harness_stable"] is False
    assert any("harness is unstable" in w for w in res["warnings"])
    labels = [s["label"] for s in res["control"]["series"]]
    assert labels[0] == "start" and labels[-1] == "end"
    assert labels[1:-1] == [f"before {v}" for v in SMALL["variants"]]


def test_inputs_allocated_once_per_dtype_at_the_largest_context():
    fake = FakeBackend()
    bench(fake, cache_dtypes=("f16", "bf16"), q_dtype="cache")
    prep = [c for c in fake.calls if c[0] == "prepare"]
    assert prep == [("prepare", 96, 131072, "f16", "f16"), ("prepare", 96, 131072, "bf16", "bf16")]
    checks = [c for c in fake.calls if c[0] == "check"]
    assert checks and all(c[2] == 16 and c[3] == 20000 for c in checks)


def test_two_caches_take_the_larger_floor_and_depth_slopes_are_per_1k_positions():
    res = bench(FakeBackend(), cache_dtypes=("f16", "bf16"), q_dtype="cache")
    runs = res["noise_floor"]["runs"]
    assert [r["cache"] for r in runs] == ["f16", "bf16"] and runs[0]["floor"] != runs[1]["floor"]
    assert res["noise_floor"]["floor"] == max(r["floor"] for r in runs)
    for d in res["depth"]:
        assert d["slope_us_per_1k"] == pytest.approx(
            d["depth_us"] / (d["long_ctx"] - d["short_ctx"]) * 1000)


def test_over_budget_cuts_the_target_and_says_so():
    logs = []
    res = bench(budget_s=2.0, log=logs.append)
    assert any("exceeds the budget" in w for w in res["warnings"])
    assert res["config"]["target_ms"] < 150 and res["estimate"]["seconds"] <= 480
    assert logs and logs[0].startswith("estimate:")


def test_progress_counts_every_unit_of_work():
    seen = []
    cfg = make_config(**SMALL)
    run_bench(backend=FakeBackend(), config=cfg, progress=lambda label, adv=1: seen.append(adv))
    assert sum(seen) == len(plan_work(cfg))


def test_csv_has_one_line_per_row(tmp_path):
    res = bench()
    path = tmp_path / "b.csv"
    write_csv(res, path)
    with open(path) as f:
        lines = list(csv.DictReader(f))
    assert len(lines) == len(res["rows"])
    assert {"variant", "n_ctx", "phase", "median_us", "GBps_ideal", "mode"} <= set(lines[0])
    assert any(r["phase"] == "q_absorb" and r["control_label"] == "start" for r in lines)


def test_the_allocation_also_covers_the_aa_context():
    fake = FakeBackend()
    run_bench(backend=fake, contexts=(64, 512), variants=("per_head", "split"))
    assert [c for c in fake.calls if c[0] == "prepare"] == [("prepare", 96, 4095, "f16", "f32")]
