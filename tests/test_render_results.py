"""tools/render_results.py renders docs/results.md from a run's JSON: every cell must be the
file's number, formatted as the CLI formats it, in the row and column it belongs to.

The fixture (tests/data/results_run/) is a hand-made run whose numbers are chosen so that each
cell has one right value (variant i, context j: attn = base * (i + 1) * (j + 1) + 0.123, step =
attn + 29.5, combine 11 + i, plus 10 at 96 heads), so a table that swaps rows, columns, phases
or files shows a wrong number here.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = Path(__file__).resolve().parent / "data" / "results_run"


def _load_tool(name: str):
    """A script of tools/ as a module (tools/ is not a package: the scripts run as files)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


rr = _load_tool("render_results")


@pytest.fixture()
def run(tmp_path):
    """A copy of the fixture run, so a test may change it."""
    dst = tmp_path / "runs" / "fixture-gpu-2026-01-02-abc1234"
    shutil.copytree(FIXTURE, dst)
    return dst


def _render(run_dir: Path) -> str:
    out_dir = run_dir.parent.parent / "docs"
    return rr.render([run_dir], out_dir)


def _row(text: str, first_cell: str, after: str) -> str:
    """The table row that starts with first_cell, in the first table after the line `after`."""
    body = text[text.index(after):]
    for line in body.splitlines():
        if line.startswith(f"| {first_cell} |"):
            return line
    raise AssertionError(f"no row {first_cell!r} after {after!r}")


def test_kinds_follow_content():
    kinds = {p.name: rr.kind_of(json.loads(p.read_text())) for p in FIXTURE.glob("*.json")}
    assert kinds == {"bench_h16.json": "phases", "bench_h96.json": "phases",
                     "depth_h16.json": "depth", "sweep.json": "sweep", "ablate.json": "ablate",
                     "other.json": None, "manifest.json": None,
                     "serving.json": "serving", "sweep_paged.json": "sweep_paged"}


def test_phase_table_cells(run):
    text = _render(run)
    assert text.startswith(rr.HEADER)
    head = ("| variant | attn, 16 heads | attn, 96 heads | combine, 16 heads | combine, 96 heads | "
            "step, 16 heads | step, 96 heads |")
    assert head in text
    # 16 heads: base 100; 96 heads: base 1000 (>= 1000 prints without decimals)
    assert _row(text, "split", "### Phases") == (
        "| split | 100.1 | 1,000 | 11.0 | 21.0 | 129.6 | 1,030 |")
    assert _row(text, "mma16", "### Phases") == (
        "| mma16 | 200.1 | 2,000 | 12.0 | 22.0 | 229.6 | 2,030 |")
    assert ("ceilings 4,322 GB/s copy, 654 TFLOP/s f16 GEMM, 61.2 TFLOP/s f32 FMA; "
            "A/A floor 0.23%; control phase q_absorb 18.5 -> 18.6 us (moved at most 0.51%)"
            in text)


# (first cell, the heading the table follows, how the row starts): exact cells of each table
ROWS = [
    ("split", "### Checks",
     "| split | 16 | 20,000 | 49 | 1.75e-07 | 1.23e-07 | 9.9e-07 | 0.0001 | ok |"),
    ("mma16", "### Checks",
     "| mma16 | 16 | 20,000 | 63 | 3.10e-04 | 2.50e-03 | 1.2e-05 | 0.0001 | FAIL |"),
    ("split", "### Depth curve", "| split | 39.6 | 49.6 | 4,321 |"),
    ("mma16", "### Depth curve", "| mma16 | 49.6 | 69.6 | - |"),
    ("24", "### Heads per block", "| 24 | attn<hpb=24,cache=f16,q=f32> | 854.1 | 168 | 0/0 | "
     "129.3 KiB | 1 / 1 | registers | 33 | step |"),
    # the driver's register count wins over ptxas's where the device reported one
    ("16", "### Heads per block", "| 16 | attn<hpb=16,cache=f16,q=f32> | 818.8 | 128 |"),
    ("mma16", "### What the cache loads cost",
     "| mma16 | 16 | 4,096 | 45.9 | 38.1 | 17% | 1.09% |"),
    ("32 x normal:8192:4096 x 16 heads, page 64", "### Serving steps",
     "| 32 x normal:8192:4096 x 16 heads, page 64 | mma16 | 128.9 | 31.1 | 158.4 | 156.4 | "
     "149.7 | 1,848 |"),
    ("mma16", "### Rows per block on the paged step 4 x 3000,100,0,9000 x 16 heads, page 64",
     "| mma16 | 16 | 50.7 | 178 | 0/0 | 184.2 KiB | 1 / 1 | registers | 4 | 4,096 |"),
    ("wgmma64", "### Rows per block", "| wgmma64 | 64 | 67.1 | 212 |"),

]


@pytest.mark.parametrize("first, after, expected", ROWS, ids=[f"{a[4:]}:{f}" for f, a, _ in ROWS])
def test_checks_depth_sweep_ablate_cells(run, first, after, expected):
    text = _render(run)
    assert "### Checks against the float64 reference ([`bench_h16.json`]" in text
    assert "| variant | 64 | 4,096 | depth term |" in text
    assert _row(text, first, after).startswith(expected)


def test_a_serving_row_without_a_phase_shows_a_dash(run):
    # the peer's call has no attn, combine, graph or latent phase of ours
    text = _render(run)
    assert ("| 32 x normal:8192:4096 x 16 heads, page 64 | flashmla | - | - | 85.9 | - | - |"
            in text)


def test_a_serving_row_names_a_cache_dtype_other_than_f16(run):
    path = run / "serving.json"
    doc = json.loads(path.read_text())
    assert doc["config"].get("cache_dtype", "f16") == "f16"
    assert "16 heads, page 64, " not in _render(run)
    doc["config"]["cache_dtype"] = "bf16"
    path.write_text(json.dumps(doc))
    assert "| 32 x normal:8192:4096 x 16 heads, page 64, bf16 cache | flashmla |" in _render(run)


def test_a_run_that_read_the_clock_gets_its_column_and_one_that_did_not_none(run):
    assert "SM MHz" not in _render(run)   # the fixture's rows predate the clock
    path = run / "serving.json"
    doc = json.loads(path.read_text())
    for r in doc["rows"]:
        capped = r["variant"] == "mma16" and r["phase"] == "latent"
        r.update(sm_mhz=1905.0 if capped else 1980.0, power_capped=0.5 if capped else 0.0,
                 thermal=0.0)
    path.write_text(json.dumps(doc))
    text = _render(run)
    assert "| GB/s (step) | SM MHz | file |" in text
    # ours: the latent's clock (capped); the peer's: its call's
    assert _row(text, "32 x normal:8192:4096 x 16 heads, page 64", "### Serving steps"
                ).startswith("| 32 x normal:8192:4096 x 16 heads, page 64 | mma16 | 128.9 | "
                             "31.1 | 158.4 | 156.4 | 149.7 | 1,848 | 1,905 cap |")
    assert "| flashmla | - | - | 85.9 | - | - | " in text and "| 1,980 | [`serving.json`]" in text


def test_run_header_names_unknown_facts(run):
    text = _render(run)
    assert "## fixture-gpu-2026-01-02-abc1234" in text
    assert ("Fixture GPU (sm_90, 8 SMs), driver unknown, CUDA runtime 13.2, NVRTC 13.0, CuPy "
            "14.2.0; commit abc1234, 2026-01-02T03:04:05+00:00.") in text
    assert "A hand-made run for the renderer's test." in text
    assert "](../runs/fixture-gpu-2026-01-02-abc1234/bench_h16.json)" in text


def test_a_changed_number_changes_the_page(run):
    """Negative control: the page follows the file, so editing one median moves one cell."""
    before = _render(run)
    doc = json.loads((run / "bench_h16.json").read_text())
    for r in doc["rows"]:
        if r["variant"] == "mma16" and r["phase"] == "attn":
            r["median_us"] = 77.7
    (run / "bench_h16.json").write_text(json.dumps(doc))
    after = _render(run)
    assert _row(after, "mma16", "### Phases") == (
        "| mma16 | 77.7 | 2,000 | 12.0 | 22.0 | 229.6 | 2,030 |")
    assert _row(before, "split", "### Phases") == _row(after, "split", "### Phases")


def test_check_mode_detects_a_stale_page(run, tmp_path, capsys):
    out = tmp_path / "docs" / "results.md"
    assert rr.main([str(run), "-o", str(out)]) == 0
    assert rr.main([str(run), "-o", str(out), "--check"]) == 0
    out.write_text(out.read_text().replace("100.1", "100.2"))
    assert rr.main([str(run), "-o", str(out), "--check"]) == 1
    assert "is stale" in capsys.readouterr().err


def test_bad_runs_exit_2_naming_the_file(run, tmp_path, capsys):
    (run / "sweep.json").write_text("{ not json")
    assert rr.main([str(run), "-o", str(tmp_path / "x.md")]) == 2
    assert "sweep.json: not readable JSON" in capsys.readouterr().err
    empty = tmp_path / "empty-run"
    empty.mkdir()
    assert rr.main([str(empty), "-o", str(tmp_path / "x.md")]) == 2
    assert "no manifest.json" in capsys.readouterr().err
    assert not (tmp_path / "x.md").exists()


def test_unwritable_output_exits_2(run, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert rr.main([str(run), "-o", str(blocker / "results.md")]) == 2
    assert "cannot write --output" in capsys.readouterr().err


def test_manifest_keeps_facts_appends_commands_and_renders(tmp_path):
    """write_manifest: a second call (e.g. .ci/gpu-sanitize after .ci/gpu-lab) keeps the first
    call's facts, appends its own commands once, lists the run's files; unknown facts stay null
    and the page says "unknown" for them."""
    wm = _load_tool("write_manifest")
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    shutil.copy(FIXTURE / "bench_h16.json", run / "bench_h16.json")
    first = dict.fromkeys(wm.FIELDS)
    first.update(device="NVIDIA H200", commit="abc1234", date="2026-01-02T03:04:05+00:00")
    wm.write(run, ["mlasandbox bench"], facts=first)
    later = dict(first, device="another GPU", date="2027-01-01T00:00:00+00:00")
    man = json.loads(wm.write(run, ["mlasandbox bench", ".ci/gpu-sanitize"],
                              facts=later).read_text())
    assert man["device"] == "NVIDIA H200" and man["date"].startswith("2026-01-02")
    assert man["commands"] == ["mlasandbox bench", ".ci/gpu-sanitize"]
    assert man["files"] == ["bench_h16.json"] and man["driver"] is None
    assert wm.run_name(man) == "h200-2026-01-02-abc1234"
    assert wm.run_name(dict.fromkeys(wm.FIELDS)) == "unknown-unknown-unknown"
    assert "NVIDIA H200 (unknown, unknown SMs), driver unknown" in rr.render([run], tmp_path)


def test_manifest_commit_is_the_callers_where_the_tree_was_copied(monkeypatch):
    """On a GPU machine the copied tree's .git is stale: $MLASANDBOX_COMMIT names the commit."""
    wm = _load_tool("write_manifest")
    monkeypatch.setenv("MLASANDBOX_COMMIT", "99e592a")
    assert wm._commit() == "99e592a"
    monkeypatch.delenv("MLASANDBOX_COMMIT")
    assert wm._commit() != "99e592a"


def test_the_plan_table_puts_the_model_beside_the_measured_phases(run):
    from mlasandbox.cli.lab_render import fmt_us
    from mlasandbox.splits import plan_splits, predict_us

    path = run / "bench_h16.json"
    doc = json.loads(path.read_text())
    doc["config"]["dims"].update(kv_lora=512, rope=64)
    doc["plans"] = [{"variant": "mma16", "n_ctx": 4096, "splits": 4, "slots": 132,
                     "heads_per_block": 16},
                    {"variant": "split", "n_ctx": 4096, "splits": None, "slots": 132,
                     "heads_per_block": 1}]  # no split plan: no row
    path.write_text(json.dumps(doc))
    text = _render(run)
    pred = predict_us(plan_splits(4096, 16, 16, num_sms=132, blocks_per_sm=1, splits=4,
                                  tile=64), "mma", cache_bytes=2, key_dim=576)
    # measured: mma16's attn 200.123, combine 12.0, step 229.623 in the fixture
    assert _row(text, "mma16", "### Split plan, predicted vs measured, 16 heads") == (
        f"| mma16 | 4,096 | 4 | {fmt_us(pred['attn'])} | 200.1 | "
        f"{fmt_us(pred['attn'] + pred['combine'])} | 212.1 | 229.6 |")
    with pytest.raises(AssertionError, match="no row 'split'"):
        _row(text, "split", "### Split plan")


def test_the_vs_table_shows_before_after_and_the_floor(run):
    path = run / "bench_h16.json"
    doc = json.loads(path.read_text())
    doc["vs"] = {"baseline": "/somewhere/before.json", "floor": 0.0123,
                 "rows": [{"variant": "mma16", "phase": "attn", "baseline_us": 250.5,
                           "current_us": 200.123, "text": "faster by 20.1%"}]}
    path.write_text(json.dumps(doc))
    text = _render(run)
    assert _row(text, "mma16", "### Against a saved bench") == (
        "| mma16 | attn | 16 | 250.5 | 200.1 | faster by 20.1% | 1.23% | "
        "[`bench_h16.json`](../runs/fixture-gpu-2026-01-02-abc1234/bench_h16.json) vs "
        "`before.json` |")


def test_the_plan_table_models_the_blocks_an_sm_the_run_had(run):
    """264 slots on 132 SMs: the model plans two blocks an SM (256 blocks, one wave), not
    one (two waves), and says so in its prediction."""
    from mlasandbox.cli.lab_render import fmt_us
    from mlasandbox.splits import plan_splits, predict_us

    path = run / "bench_h16.json"
    doc = json.loads(path.read_text())
    doc["config"]["dims"].update(kv_lora=512, rope=64)
    doc["plans"] = [{"variant": "split", "n_ctx": 4096, "splits": 16, "slots": 264,
                     "heads_per_block": 1}]
    path.write_text(json.dumps(doc))
    row = _row(_render(run), "split", "### Split plan, predicted vs measured, 16 heads")

    def pred(bps):
        return predict_us(plan_splits(4096, 16, 1, num_sms=132, blocks_per_sm=bps, splits=16,
                                      tile=32), "split", cache_bytes=2, key_dim=576)
    assert fmt_us(pred(2)["attn"]) != fmt_us(pred(1)["attn"])
    assert row.startswith(f"| split | 4,096 | 16 | {fmt_us(pred(2)['attn'])} |"), row


def test_the_newest_run_comes_first(tmp_path):
    for name, date in (("a-2026-01-01-aaaaaaa", "2026-01-01T00:00:00+00:00"),
                       ("b-2027-01-01-bbbbbbb", "2027-01-01T00:00:00+00:00"),
                       ("c-2026-06-01-ccccccc", "2026-06-01T00:00:00+00:00")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text(json.dumps({"date": date}))
    assert [d.name for d in rr.default_runs(tmp_path)] == [
        "b-2027-01-01-bbbbbbb", "c-2026-06-01-ccccccc", "a-2026-01-01-aaaaaaa"]


def test_a_manifest_with_sources_names_them_beside_the_commit(run):
    man = json.loads((run / "manifest.json").read_text())
    man["sources"] = "0123456789ab"
    (run / "manifest.json").write_text(json.dumps(man))
    assert "; commit abc1234 (sources 0123456789ab), 2026-01-02" in _render(run)


def test_the_sweep_tables_show_the_model_and_the_driver_apart(run):
    # the fixture's model and driver blocks/SM agree; a driver that differs must show
    for name, key, first in (("sweep.json", "hpb", 24), ("sweep_paged.json", "variant", "mma16")):
        doc = json.loads((run / name).read_text())
        row = next(r for r in doc["rows"] if r[key] == first)
        assert row["blocks_per_sm_model"] == 1
        row["blocks_per_sm_driver"] = 2
        (run / name).write_text(json.dumps(doc))
    text = _render(run)
    assert "| 1 / 2 |" in _row(text, "24", "### Heads per block")
    assert "| 1 / 2 |" in _row(text, "mma16", "### Rows per block")


def test_a_cited_run_that_is_no_folder_is_named(tmp_path):
    runs = tmp_path / "runs"
    (runs / "h200-2026-01-01-aaaaaaa").mkdir(parents=True)
    page = tmp_path / "p.md"
    page.write_text("kept: runs/h200-2026-01-01-aaaaaaa; gone: runs/h200-2026-01-02-bbbbbbb/"
                    "x.txt; moved: history: h200-2026-01-03-ccccccc\n")
    assert rr.missing_citations([page], runs) == ["p.md: h200-2026-01-02-bbbbbbb"]


def _peer_row(text: str) -> str:
    return _row(text, "32 x normal:8192:4096 x 16 heads, page 64", "## Against FlashMLA")


def test_the_peer_table_divides_our_latent_by_the_peers_call(run):
    text = _render(run)
    head = text[text.index("## Against FlashMLA"):].splitlines()[4]
    assert head == "| shape | fixture 01-02 abc1234 |"  # the run: first word, date, commit
    # the fixture's mma16 latent 149.71 over flashmla's 85.936; no floor in the file: no tie
    assert _peer_row(text) == "| 32 x normal:8192:4096 x 16 heads, page 64 | 1.742 mma16 |"


def test_the_peer_table_marks_a_tie_and_skips_failed_checks(run):
    path = run / "serving.json"
    doc = json.loads(path.read_text())
    for r in doc["rows"]:
        if r["variant"] == "mma16" and r["phase"] == "latent":
            r["median_us"] = 86.2   # 0.31% slower than the peer
    doc["noise_floor"] = {"floor": 0.004}
    path.write_text(json.dumps(doc))
    assert _peer_row(_render(run)).endswith("| 1.003 = mma16 |")
    # the bench's rule (noise.verdict): under a floor of 0.1% the event timer's 0.5 us
    # resolution (0.58% of 85.9 us) still makes 0.31% a tie; 1.1% is not one
    doc["noise_floor"] = {"floor": 0.001}
    path.write_text(json.dumps(doc))
    assert _peer_row(_render(run)).endswith("| 1.003 = mma16 |")
    for r in doc["rows"]:
        if r["variant"] == "mma16" and r["phase"] == "latent":
            r["median_us"] = 86.9
    path.write_text(json.dumps(doc))
    assert _peer_row(_render(run)).endswith("| 1.011 mma16 |")
    # a latent whose check failed is not ours to compare; without one there is no row
    for r in doc["rows"]:
        if r["variant"] == "mma16":
            r["check_ok"] = False
    path.write_text(json.dumps(doc))
    assert "## Against FlashMLA" not in _render(run)


def test_a_shape_benched_twice_in_a_run_shows_both_ratios(run):
    # a second bench of the same shape in the run: both ratios in the cell, lowest first,
    # with the count of ties; keeping only one file's (the last read) would drop a bench
    doc = json.loads((run / "serving.json").read_text())
    for r in doc["rows"]:
        if r["variant"] == "mma16" and r["phase"] == "latent":
            r["median_us"] = 86.2   # a tie under the floor below; the fixture's is 1.742
    doc["noise_floor"] = {"floor": 0.004}
    (run / "serving_r2.json").write_text(json.dumps(doc))
    assert _peer_row(_render(run)).endswith("| 1.003..1.742 (2 benches, 1 =) mma16 |")
    (run / "serving_r2.json").unlink()
    assert _peer_row(_render(run)).endswith("| 1.742 mma16 |")


def test_peer_rows_keep_their_order_as_runs_come_and_group_cache_dtypes(run):
    # an older run benched the fixture's shape in f16; a newer one benches a new shape, then
    # the same shape in bf16: the rows stay in the older run's order, bf16 under its f16 row
    doc = json.loads((run / "serving.json").read_text())
    newer = run.parent / "fixture-gpu-2026-01-03-def5678"
    shutil.copytree(run, newer)
    (newer / "serving.json").unlink()
    new_shape = json.loads(json.dumps(doc))
    new_shape["config"]["batch"] = 8
    (newer / "a_serving.json").write_text(json.dumps(new_shape))
    bf16 = json.loads(json.dumps(doc))
    bf16["config"]["cache_dtype"] = "bf16"
    (newer / "b_serving.json").write_text(json.dumps(bf16))
    text = rr.render([newer, run], run.parent.parent / "docs")
    table = text[text.index("## Against FlashMLA"):].split("\n\n")[2].splitlines()
    assert [line.split(" | ")[0] for line in table[2:]] == [
        "| 32 x normal:8192:4096 x 16 heads, page 64",
        "| 32 x normal:8192:4096 x 16 heads, page 64, bf16 cache",
        "| 8 x normal:8192:4096 x 16 heads, page 64"]
    assert table[0] == "| shape | fixture 01-03 def5678 | fixture 01-02 abc1234 |"


def test_a_run_without_the_peer_has_no_peer_table(run):
    path = run / "serving.json"
    doc = json.loads(path.read_text())
    doc["rows"] = [r for r in doc["rows"] if r["variant"] != "flashmla"]
    path.write_text(json.dumps(doc))
    text = _render(run)
    assert "## Against FlashMLA" not in text
    assert "| 32 x normal:8192:4096 x 16 heads, page 64 | mma16 |" in text  # the run's own
