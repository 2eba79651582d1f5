"""The lab commands through click's CliRunner: `bench` (with a fake GPU backend and without a
GPU), `sweep`, `repro`."""
from __future__ import annotations

import csv
import io
import json

import pytest
from click.testing import CliRunner

from lab_fakes import FakeBackend
from mlasandbox import bench_gpu, registry, toolkit
from mlasandbox.cli.main import main

HAVE_GPU, GPU_REASON = toolkit.device_available()
SMALL = ["--ctx", "64,8192", "--variants", "per_head,split,batched12,cublas"]


def run(*args, ok=True):
    res = CliRunner().invoke(main, [str(a) for a in args])
    if ok and res.exit_code != 0:
        raise AssertionError(f"exit {res.exit_code}\nstdout:\n{res.stdout}\nstderr:\n"
                             f"{res.stderr}\n{res.exception!r}")
    return res


@pytest.fixture
def fake_gpu(monkeypatch):
    """A 'GPU' whose timings come from lab_fakes.FakeBackend."""
    made = []

    def factory(*a, **k):
        made.append(FakeBackend(*a, **k))
        return made[-1]

    monkeypatch.setattr(toolkit, "device_available", lambda: (True, "device 0: Fake H200"))
    monkeypatch.setattr(bench_gpu, "CupyBackend", factory)
    return made


def test_help_lists_the_lab_commands():
    out = run("--help").stdout
    for cmd in ("bench", "sweep", "repro", "ablate"):
        assert cmd in out


# ---------------------------------------------------------------------------- bench

def test_bench_tables_and_files(fake_gpu, tmp_path):
    js, cs, png = tmp_path / "b.json", tmp_path / "b.csv", tmp_path / "b.png"
    res = run("bench", *SMALL, "--json", js, "--csv", cs, "--plot", png, "--explain")
    out = " ".join(res.stdout.split())
    assert "step time (us, median)" in out and "depth term" in out and "share" in out
    assert "phases at n_ctx 8192" in out and "phases at n_ctx 64" in out
    assert "A/A noise floor" in out and "control q_absorb" in out and "stable" in out
    assert "FLOPs = 2 x H 96 x n_ctx 8192 x (576 + 512)" in out  # --explain
    assert "correctness: every variant matches" in out
    # cells, not headers: the fake's timings put these numbers in these places
    for row in ("per_head 12.9 378.7 365.8 97% ok", "split 12.9 56.5 43.5 77% ok",
                "batched12 11.5 * 23.2 * 11.6 50% ok", "cublas 54.1 70.4 16.2 23% ok",
                "variant 64 (g) 8192 depth term share check",
                "split 8 96 4.99 49.1 [48.9-49.3] 2.40 56.5 229 18,522 5.7% 34.86 1,905 cap "
                "54% FMA events",
                "SM MHz: the median SM clock over each phase's timed runs (NVML every 5 ms "
                "(fake)); cap / hot: the power cap / a thermal slowdown held the clock in",
                "split 8192 56.5 4.0 52.5 events", "per_head 64 12.9 4.0 8.9 graph",
                "start 5.00 us, end 4.99 us, max move 0.16% over 6 measurements: stable"):
        assert row in out, row
    assert "UNSTABLE" not in out
    data = json.loads(js.read_text())
    assert data["schema"] == "mlasandbox.bench/1" and data["ok"]
    assert cs.read_text().startswith("variant,cache,q,n_ctx,phase")
    rows = list(csv.DictReader(io.StringIO(cs.read_text())))
    assert {r["sm_mhz"] for r in rows} == {"1905"}      # the fake's clocks, in every row
    assert {r["power_capped"] for r in rows} == {"0.75"}
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    assert "estimate:" in res.stderr and f"wrote {js}" in " ".join(res.stderr.split())


def test_bench_json_on_stdout(fake_gpu):
    res = run("bench", *SMALL, "--json")
    data = json.loads(res.stdout)
    assert data["config"]["contexts"] == [64, 8192]
    assert {r["variant"] for r in data["rows"]} == {"-", "per_head", "split", "batched12",
                                                    "cublas"}
    assert data["noise_floor"]["floor"] > 0


def test_bench_vs_a_baseline(fake_gpu, tmp_path):
    base = tmp_path / "base.json"
    run("bench", *SMALL, "--json", base)
    res = run("bench", *SMALL, "--vs", base)
    out = " ".join(res.stdout.split())
    assert "against the baseline" in out and "control" in out
    assert "no measurable difference" in out
    res = run("bench", *SMALL, "--vs", base, "--json")
    data = json.loads(res.stdout)
    assert data["vs"]["baseline"] == str(base) and data["vs"]["control"]["moved"] is False


def test_the_vs_table_puts_baseline_before_now_and_the_floor_in_percent(monkeypatch, tmp_path):
    """A second run 10% slower than its baseline: each row reads baseline, then now, then
    the verdict; the control row likewise; the floor in the title in percent."""
    from mlasandbox.cli.lab_render import fmt_us

    scales = iter([1.0, 1.1, 1.1])
    monkeypatch.setattr(toolkit, "device_available", lambda: (True, "device 0: Fake H200"))
    monkeypatch.setattr(bench_gpu, "CupyBackend",
                        lambda *a, **k: FakeBackend(*a, scale=next(scales), **k))
    base = tmp_path / "base.json"
    run("bench", *SMALL, "--json", base)
    data = json.loads(run("bench", *SMALL, "--vs", base, "--json").stdout)["vs"]
    out = " ".join(run("bench", *SMALL, "--vs", base).stdout.split())
    row = next(r for r in data["rows"] if (r["variant"], r["cache"], r["n_ctx"], r["phase"])
               == ("per_head", "f16", 64, "attn"))
    assert row["current_us"] > row["baseline_us"] and row["verdict"] == "slower"
    # both runs' SM clocks (the fake's), the same power state: no mark, no warning
    assert row["baseline_mhz"] == row["current_mhz"] == 1905.0 and not row["clock_differs"]
    assert (f"per_head f16 64 attn {fmt_us(row['baseline_us'])} {fmt_us(row['current_us'])} "
            f"1,905/1,905 {row['text']}") in out
    assert "SM clock moved" not in out
    c = data["control"]
    assert c["current_us"] > c["baseline_us"]
    assert f"q_absorb {fmt_us(c['baseline_us'])} {fmt_us(c['current_us'])}" in out
    assert f"(noise floor {data['floor']:.1%})" in out and data["floor"] > 0.001


def test_bench_bad_baseline_is_bad_input(fake_gpu, tmp_path):
    res = run("bench", "--vs", tmp_path / "missing.json", ok=False)
    assert res.exit_code == 2 and "cannot read baseline" in res.stderr
    assert not fake_gpu  # rejected before anything ran


@pytest.mark.parametrize("args,words", [(["--aa-ctx", "5000"], "below the split gate"),
                                        (["--variants", "warp"], "not among"),
                                        (["--hpb", "3"], "heads_per_block"),
                                        (["--ctx", "x"], "not an integer")])
def test_bench_bad_input_exits_2(fake_gpu, args, words):
    res = run("bench", *args, ok=False)
    assert res.exit_code == 2 and words in " ".join(res.stderr.split())


def test_a_wrong_kernel_fails_the_bench(monkeypatch):
    monkeypatch.setattr(toolkit, "device_available", lambda: (True, "device 0: Fake H200"))
    monkeypatch.setattr(bench_gpu, "CupyBackend",
                        lambda *a, **k: FakeBackend(fail_check={"batched12"}))
    res = run("bench", *SMALL, ok=False)
    assert res.exit_code == 1
    out = " ".join(res.stdout.split())
    assert "WRONG: not a result" in out and "planted failure" in out


def test_an_unstable_harness_is_a_warning(monkeypatch):
    monkeypatch.setattr(toolkit, "device_available", lambda: (True, "device 0: Fake H200"))
    monkeypatch.setattr(bench_gpu, "CupyBackend", lambda *a, **k: FakeBackend(drift=0.1))
    out = " ".join(run("bench", *SMALL).stdout.split())
    assert "UNSTABLE" in out and "harness is unstable" in out


def test_plot_without_matplotlib_says_how_to_get_it(fake_gpu, tmp_path, monkeypatch):
    from mlasandbox import plot

    def missing():
        raise plot.PlotUnavailable("--plot needs matplotlib (x); install the plot extra: "
                                   "pip install 'mlasandbox[plot]'")
    monkeypatch.setattr(plot, "_pyplot", missing)
    res = run("bench", *SMALL, "--plot", tmp_path / "p.png", ok=False)
    assert res.exit_code == 1 and "mlasandbox[plot]" in res.stderr


@pytest.mark.skipif(HAVE_GPU, reason="this machine has a GPU")
def test_bench_without_a_gpu_explains_and_shows_what_runs(monkeypatch):
    from mlasandbox.cli import bench_cmd

    # the no-GPU report's own content is test_cli.py's business: keep it cheap here
    monkeypatch.setattr(bench_cmd, "cpu_accuracy", lambda *a, **k: ([], {
        "ok": True, "problems": [], "median_gain": 1.0, "tolerance": 1e-4}))
    monkeypatch.setattr(bench_cmd, "regs_rows", lambda *a, **k: [])
    res = run("bench", "--explain", "--variants", "per_head,batched12")
    out = " ".join(res.stdout.split())
    assert "Byte and FLOP formulas" in out and "No GPU here" in out and "blocks/SM" in out
    assert "x head_blocks 8" in out  # batched12 at 96 heads
    data = json.loads(run("bench", "--json").stdout)
    assert data["timings"] is None and data["no_device_reason"] == GPU_REASON


# ---------------------------------------------------------------------------- sweep

def test_sweep_with_a_gpu(fake_gpu, tmp_path):
    js = tmp_path / "s.json"
    res = run("sweep", "--hpb", "8,12,16", "--ctx", "32768", "--json", js)
    out = " ".join(res.stdout.split())
    assert "heads-per-block sweep at n_ctx 32768" in out and "*" in out
    data = json.loads(js.read_text())
    assert data["timed"] and [r["hpb"] for r in data["rows"]] == [8, 12, 16]
    # the mark sits on the fastest row's time alone (the caption's "* fastest" aside)
    best = [r for r in data["rows"] if r["fastest"]]
    assert len(best) == 1
    marked = [ln for ln in res.stdout.splitlines() if " *" in ln and "fastest" not in ln]
    assert len(marked) == 1 and f"{best[0]['hpb']}" in marked[0].split()[0:2], marked
    # each row's plan in its columns: S, head blocks, waves
    flat = " ".join(res.stdout.split())
    assert [(r["splits"], r["head_blocks"]) for r in data["rows"]] == [(22, 12), (32, 8), (43, 6)]
    for r in data["rows"]:
        assert f"{r['splits']} {r['head_blocks']} {r['waves']:.2f}" in flat, r


def test_sweep_without_a_gpu_json():
    data = json.loads(run("sweep", "--hpb", "1,12", "--no-gpu", "--json").stdout)
    assert data["timed"] is False and data["config"]["num_sms"] == 132
    assert all(r["median_us"] is None for r in data["rows"])
    out = " ".join(run("sweep", "--hpb", "12", "--no-gpu").stdout.split())
    assert "NO GPU" in out and "property of the compile" in out


def test_sweep_bad_input():
    res = run("sweep", "--hpb", "3", "--no-gpu", ok=False)
    assert res.exit_code == 2 and "heads per block must be among 1, 2, 4" in " ".join(
        res.stderr.split())


# ---------------------------------------------------------------------------- repro

def test_repro_writes_a_script(tmp_path):
    path = tmp_path / "r.py"
    res = run("repro", "--variant", "batched12", "--ctx", "20000", "--blocks-per-sm", "2",
              "-o", path)
    assert f"wrote {path}" in res.stdout and "expect PASS" in res.stdout
    assert "mla::attn<12, __half, float>" in path.read_text()
    info = json.loads(run("repro", "--variant", "split", "--ctx", "20000", "--blocks-per-sm",
                          "2", "--negative-control", "-o", tmp_path / "n.py", "--json").stdout)
    assert info["expect"] == "FAIL" and info["negative_control"] is True


def test_repro_refuses_a_control_that_cannot_fail(tmp_path):
    res = run("repro", "--variant", "per_head", "--negative-control", "-o", tmp_path / "x.py",
              ok=False)
    assert res.exit_code == 2 and "needs a split" in " ".join(res.stderr.split())
    assert not (tmp_path / "x.py").exists()


@pytest.mark.parametrize("variant", registry.variant_names())
def test_repro_every_variant(tmp_path, variant):
    path = tmp_path / f"{variant}.py"
    run("repro", "--variant", variant, "--heads", "16", "--blocks-per-sm", "2", "-o", path)
    compile(path.read_text(), str(path), "exec")


def test_the_depth_table_marks_the_fastest_row_and_its_ties_only():
    from rich.console import Console

    from lab_fakes import FakeBackend
    from mlasandbox.bench import run_bench
    from mlasandbox.cli import lab_render

    res = run_bench(backend=FakeBackend(), contexts=(64, 8192),
                    variants=("per_head", "split", "batched12"))
    # a tie at 8192 (the fake's timings give none): split within the floor of the fastest
    f8192 = next(f for f in res["fastest"] if f["n_ctx"] == 8192)
    assert f8192["variant"] != "split"
    f8192["ties"] = ["split"]
    con = Console(width=250, record=True)
    con.print(lab_render.depth_table(res, "f16"))
    rows = {ln.split()[0]: ln for ln in con.export_text().splitlines()
            if ln.strip() and ln.split()[0] in ("per_head", "split", "batched12")}
    fastest = [f for f in res["fastest"] if f["cache"] == "f16"]
    assert len(fastest) == 2 and len(rows) == 3
    for v, ln in rows.items():   # '*' on the fastest's cell, '=' on a tie's, nowhere else
        assert ("*" in ln) == any(f["variant"] == v for f in fastest), ln
        assert (" =" in ln) == any(v in f["ties"] for f in fastest), ln
    assert " =" in rows["split"]
