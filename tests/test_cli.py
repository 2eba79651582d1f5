"""The CLI through click's CliRunner: tables, --json on every command, non-zero exits."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from mlasandbox import registry, schedule, toolkit
from mlasandbox.cli.main import main

HAVE_GPU, GPU_REASON = toolkit.device_available()


def run(*args, ok=True):
    res = CliRunner().invoke(main, list(args))
    if ok and res.exit_code != 0:
        raise AssertionError(f"exit {res.exit_code}\nstdout:\n{res.stdout}\nstderr:\n"
                             f"{res.stderr}\n{res.exception!r}")
    return res


def run_json(*args, ok=True):
    res = run(*args, "--json", ok=ok)
    return res, json.loads(res.stdout)


def test_help_lists_the_commands():
    out = run("--help").stdout
    for cmd in ("info", "regs", "grid", "check", "bench"):
        assert cmd in out


def test_version():
    assert "mlasandbox" in run("--version").stdout


# ---------------------------------------------------------------------------- info

def test_info_table_and_json():
    out = run("info").stdout
    assert "NVRTC" in out and "numpy" in out and "device" in out
    _, data = run_json("info")
    assert data["ok"] is True
    assert data["versions"]["mlasandbox"] and data["versions"]["cupy"]
    assert data["toolkit"]["nvrtc"] == "%d.%d" % toolkit.nvrtc_version()
    assert data["toolkit"]["include_dirs"] == toolkit.cuda_include_dirs()
    if HAVE_GPU:
        assert data["device"]["sms"] > 0 and data["device"]["arch"].startswith("sm_")
    else:
        assert data["device"] is None and data["device_reason"] == GPU_REASON


def test_info_fails_when_headers_are_missing(tmp_path, monkeypatch):
    monkeypatch.setenv(toolkit.ENV_INCLUDE, str(tmp_path))  # empty: no headers
    res, data = run_json("info", ok=False)
    assert res.exit_code == 1
    assert data["ok"] is False and any("cuda_fp16.h" in p for p in data["problems"])


# ---------------------------------------------------------------------------- regs

def test_regs_json_rows():
    _, data = run_json("regs", "--hpb", "1,12", "--cache", "f16", "--q", "f32")
    rows = {r["name"]: r for r in data["rows"]}
    assert data["ok"] and data["arch"] == "sm_90"
    assert set(rows) == {"attn_rows<cache=f16,q=f32>", "attn<heads=12,cache=f16,q=f32>",
                         "attn_tiled<heads=16,cache=f16,q=f32>",
                         "mma_attn<heads=16,cache=f16,q=f32,round_p=false>",
                         "mma_attn<heads=32,cache=f16,q=f32,round_p=false>",
                         "mma_attn<heads=16,cache=f16,q=f32,round_p=true>",
                         "mma_attn<heads=32,cache=f16,q=f32,round_p=true>",
                         "q_absorb<cache=f16,q=f32>", "combine<cache=f16,rescale=true,prefetch=8>",
                         "combine<cache=f16,rescale=false,prefetch=8>", "project<cache=f16>",
                         "project_wide<cache=f16>",
                         # the paged launches of the same kernels, and the index validator
                         "attn_rows<cache=f16,q=f32,paged=true>",
                         "attn<heads=12,cache=f16,q=f32,paged=true>",
                         "mma_attn<heads=16,cache=f16,q=f32,round_p=false,paged=true>",
                         "mma_attn<heads=32,cache=f16,q=f32,round_p=false,paged=true>",
                         "mma_attn<heads=16,cache=f16,q=f32,round_p=true,paged=true>",
                         "mma_attn<heads=32,cache=f16,q=f32,round_p=true,paged=true>",
                         "combine<cache=f16,rescale=true,prefetch=8,paged=true>",
                         "combine<cache=f16,rescale=false,prefetch=8,paged=true>",
                         # the deep merge (registry.merge_form)
                         "combine<cache=f16,rescale=true,prefetch=16,paged=true>",
                         "combine<cache=f16,rescale=false,prefetch=16,paged=true>",
                         # the warp merge of many rows (registry.merge_form)
                         "combine_warp<rescale=true,paged=true>",
                         "combine_warp<rescale=false,paged=true>", "check_paged"}
    # The threads and dynamic smem in these rows are the registry's; the compile that made
    # the rows static_asserted them against each kernel (tests/test_kernel_facts.py).
    a12 = rows["attn<heads=12,cache=f16,q=f32>"]
    assert a12["registers"] > 0 and a12["blocks_per_sm"] >= 1 and a12["limiter"]
    tiled = rows["attn_tiled<heads=16,cache=f16,q=f32>"]
    assert tiled["blocks_per_sm"] == 1, "tiled16's shared memory takes the whole SM"
    assert tiled["min_arch"] == "sm_90"
    assert a12["spill_stores"] >= 0 and (a12["kind"], a12["heads"]) == ("attn", 12)
    one = rows["attn_rows<cache=f16,q=f32>"]  # HPB 1 of the ladder: per_head and split's kernel
    assert (one["kind"], one["heads"]) == ("attn_rows", 1)
    for r in rows.values():   # the machine code: whole 16-byte instructions
        assert r["code_bytes"] > 0 and r["code_bytes"] % 16 == 0, r["name"]


def test_regs_table():
    args = ("regs", "--hpb", "8", "--cache", "bf16", "--q", "cache", "--no-controls")
    out = run(*args).stdout
    assert "attn<heads=8,cache=bf16,q=bf16>" in out and "blocks/SM" in out
    assert "rescale=false" not in out
    assert "code KiB" in out and "left out" not in out
    _, data = run_json(*args)
    row = next(r for r in data["rows"] if r["name"] == "attn<heads=8,cache=bf16,q=bf16>")
    line = next(ln for ln in out.splitlines() if ln.split()[:1] == [row["name"]])
    cells = line.split()
    assert cells[1:4] == [str(row["registers"]), f"{row['spill_stores']}/{row['spill_loads']}",
                          f"{row['code_bytes'] / 1024:.1f}"], line


@pytest.mark.parametrize("args, words", [
    (("--arch", "compute_90"), "--arch must be one of sm_80, sm_86, sm_89, sm_90, sm_100"),
    (("--hpb", "3"), "heads per block"),
    (("--hpb", "x"), "not an integer"),
    (("--cache", "f32"), "f32 not among f16, bf16"),
])
def test_regs_bad_input_exits_2(args, words):
    res = run("regs", *args, ok=False)
    assert res.exit_code == 2
    assert words in res.stderr


def test_regs_bad_arch_json_error_on_stdout():
    res, data = run_json("regs", "--arch", "sm90", ok=False)
    assert res.exit_code == 2 and data["ok"] is False and "sm90" in data["error"]


# ---------------------------------------------------------------------------- grid

def test_grid_per_head_leaves_sms_idle():
    _, g = run_json("grid", "--variant", "per_head", "--heads", "96", "--ctx", "131072",
                    "--blocks-per-sm", "2")
    assert g["grid"] == [96, 1] and g["blocks"] == 96
    assert g["idle_sms"] == 36 and g["num_sms"] == 132
    assert g["positions_per_block"] == 131072
    assert g["tiles_per_block"] == 131072 // registry.ATTN_TILE
    assert g["splits"] == 1 and g["combine"] is False and g["empty_slices"] == 0
    assert "given" in g["blocks_per_sm_source"]


def test_grid_split_budgets_the_product():
    _, g = run_json("grid", "--variant", "split", "--heads", "12", "--ctx", "131072",
                    "--blocks-per-sm", "2")
    assert g["grid"][0] == 12 and g["splits"] > 1 and g["combine"]
    assert g["blocks"] == 12 * g["splits"] and g["idle_sms"] == max(0, 132 - g["blocks"])
    assert g["positions_per_block"] == -(-131072 // g["splits"])
    assert g["reason"].startswith("auto")


def test_grid_below_the_gate_split_does_not_split_but_batched_does():
    # the split gate is split's (96 head blocks); batched12's 8 head blocks on one slice
    # would leave 124 SMs idle, so it has none and its slices only need 4 tiles each
    _, g = run_json("grid", "--variant", "split", "--heads", "96", "--ctx", "4095",
                    "--blocks-per-sm", "5")
    assert g["grid"] == [96, 1] and "gate" in g["reason"]
    _, g = run_json("grid", "--variant", "batched12", "--heads", "96", "--ctx", "4095",
                    "--blocks-per-sm", "2")
    assert g["grid"][0] == 8 and g["grid"][1] > 1 and g["reason"].startswith("auto")
    assert -(-4095 // g["grid"][1]) >= 4 * 32   # every slice at least 4 tiles of 32 rows


def test_grid_empty_slices():
    _, g = run_json("grid", "--variant", "split", "--heads", "4", "--ctx", "100",
                    "--splits", "300", "--blocks-per-sm", "1")
    assert g["splits"] == 300 and g["empty_slices"] == 200
    assert g["positions_per_block"] == 1 and g["reason"] == "override"


def test_grid_batched_with_hpb_and_auto_occupancy():
    _, g = run_json("grid", "--variant", "batched", "--hpb", "12", "--heads", "96",
                    "--ctx", "131072")
    assert g["variant"] == "batched12" and g["grid"][0] == 8
    assert g["blocks_per_sm"] >= 1 and g["registers"] > 0
    assert "ptxas" in g["blocks_per_sm_source"]


def test_batched_with_one_head_per_block_is_split():
    # HPB 1 of the ladder has one kernel, attn_rows, and one name: split
    from mlasandbox.api import _as_variant_name

    assert _as_variant_name("batched", 1) == "split"
    assert _as_variant_name("batched", 12) == "batched12"
    _, g = run_json("grid", "--variant", "batched", "--hpb", "1", "--heads", "96",
                    "--ctx", "131072")
    assert g["variant"] == "split" and g["grid"][0] == 96
    assert g["blocks_per_sm"] == 6 and "attn_rows" in g["blocks_per_sm_source"]


def test_grid_table():
    out = run("grid", "--variant", "per_head", "--heads", "96", "--ctx", "131072",
              "--blocks-per-sm", "2").stdout
    flat = " ".join(out.replace("│", " ").split())
    # 96 blocks on 132 SMs: 36 SMs without a block, 96 of 264 slots a wave
    assert "idle SMs 36 (no block at all)" in flat and "waves 0.36 (1 launch wave)" in flat
    assert "96 blocks on 132 SMs (2/SM -> 264 slots)" in flat


@pytest.mark.parametrize("args, words", [
    (("--variant", "nope", "--heads", "8", "--ctx", "10"),
     "unknown variant 'nope'; known: " + ", ".join(registry.variant_names())),
    (("--variant", "split", "--heads", "8", "--ctx", "0"), "context lengths must be >= 1"),
    (("--variant", "split", "--heads", "0", "--ctx", "10"), "--heads"),
    (("--variant", "cublas", "--heads", "8", "--ctx", "10"), "no launch geometry"),
    (("--variant", "per_head", "--heads", "8", "--ctx", "10", "--splits", "4"),
     "does not split"),
    (("--variant", "split", "--heads", "8", "--ctx", "10", "--splits", "0"), "integer >= 1"),
    (("--variant", "batched", "--heads", "8", "--ctx", "10"), "needs --hpb"),
    (("--variant", "batched12", "--hpb", "8", "--heads", "8", "--ctx", "10"), "contradicts"),
    (("--variant", "split", "--heads", "8", "--ctx", "10", "--blocks-per-sm", "x"),
     "'auto' or an integer"),
])
def test_grid_bad_input_exits_2(args, words):
    if "--blocks-per-sm" not in args:
        args = (*args, "--blocks-per-sm", "2")  # no compile needed to reject the input
    res = run("grid", *args, ok=False)
    assert res.exit_code == 2, res.stdout
    assert words in " ".join(res.stderr.split()), res.stderr


def test_grid_unknown_variant_json():
    res, data = run_json("grid", "--variant", "nope", "--heads", "8", "--ctx", "10",
                         "--blocks-per-sm", "2", ok=False)
    assert res.exit_code == 2 and "per_head" in data["error"]


# ---------------------------------------------------------------------------- check

def test_check_json_small():
    _, data = run_json("check", "--ctx", "1,4096", "--seeds", "1", "--no-gpu")
    assert data["ok"] is True
    rows = data["schedule_model"]["rows"]
    assert [r["n_ctx"] for r in rows] == [1, 4096]
    short, long_ = rows
    assert short["splits"] == 1 and short["control_rejected"] is None
    assert long_["splits"] > 1 and long_["control_rejected"] is True
    assert long_["relL2_no_rescale"] > data["schedule_model"]["tolerance"]
    # chains of 187 rows + a 22-term combine against one of 4096: the model gains 1.6-2.1x
    # over seeds (the score's error, common to both, caps it), so never below 1
    assert long_["relL2_split"] <= long_["relL2_unsplit"]


def test_check_table_shows_the_control(monkeypatch):
    out = run("check", "--ctx", "4096", "--seeds", "1", "--no-gpu").stdout
    assert "no rescale" in out and "negative control" in out and "pass" in out
    # the gain is unsplit error over split error: 4e-6 / 1e-6, not its inverse
    monkeypatch.setattr(schedule, "accuracy_study", _fake_study(4e-6, 1e-6, 0.5))
    out = " ".join(run("check", "--ctx", "20000", "--seeds", "1", "--no-gpu").stdout.split())
    assert "median 4.00x more accurate" in out and "4.00x" in out.split("median")[0], out


def _fake_study(unsplit, split, control):
    def study(n_ctxs, seeds, splits="auto", **kw):
        return [schedule.AccuracyRow(n_ctx=n, seed=s, splits=8, unsplit=unsplit, split=split,
                                     split_no_rescale=control)
                for n in n_ctxs for s in seeds]
    return study


def test_check_fails_when_the_negative_control_passes(monkeypatch):
    # a "control" as accurate as the real thing: the check has no power and must say so
    monkeypatch.setattr(schedule, "accuracy_study", _fake_study(2e-6, 3e-7, 3e-7))
    res, data = run_json("check", "--ctx", "20000", "--seeds", "1", "--no-gpu", ok=False)
    assert res.exit_code == 1 and data["ok"] is False
    assert any("no power" in p for p in data["schedule_model"]["problems"])
    res = run("check", "--ctx", "20000", "--seeds", "1", "--no-gpu", ok=False)
    assert res.exit_code == 1 and "no power" in res.stdout


def test_check_fails_when_a_real_check_fails(monkeypatch):
    monkeypatch.setattr(schedule, "accuracy_study", _fake_study(2e-6, 5e-2, 0.4))
    res, data = run_json("check", "--ctx", "20000", "--seeds", "1", "--no-gpu", ok=False)
    assert res.exit_code == 1
    assert data["schedule_model"]["rows"][0]["split_ok"] is False


def test_check_gpu_hook_failures_fail_the_command(monkeypatch):
    from mlasandbox.cli import check_cmd

    monkeypatch.setattr(toolkit, "device_available", lambda: (True, "device 0: planted"))
    monkeypatch.setattr(toolkit, "arch_of_device", lambda device=None: "sm_80")
    seen = {}

    def fake(variants, cache):
        seen["variants"] = variants
        return [{"name": "split vs float64 reference", "ok": False, "detail": "planted"}]

    monkeypatch.setattr(check_cmd, "_gpu_checks", fake)
    res, data = run_json("check", "--ctx", "4096", "--seeds", "1", ok=False)
    assert res.exit_code == 1 and data["gpu"][0]["ok"] is False
    assert "tiled16" not in seen["variants"] and "split" in seen["variants"]
    assert data["gpu_not_run"] == ["tiled16 (needs sm_90)"]
    assert data["failed"] == ["GPU split vs float64 reference: planted"]
    res = run("check", "--ctx", "4096", "--seeds", "1", ok=False)
    out = " ".join(res.stdout.split())
    assert "checks FAILED: 1 failed check (listed above), first: GPU split vs" in out
    assert "GPU check not run: tiled16 (needs sm_90)" in out


@pytest.mark.skipif(HAVE_GPU, reason="this machine has a GPU")
def test_check_without_a_gpu_says_it_checked_the_cpu_model_only():
    res, data = run_json("check", "--ctx", "4096", "--seeds", "1")
    assert data["checked"] == f"the CPU model only (no GPU: {GPU_REASON})"
    assert data["gpu"] == [] and data["ok"] is True
    out = " ".join(run("check", "--ctx", "4096", "--seeds", "1").stdout.split())
    assert "checked the CPU model only (no GPU:" in out


def test_check_says_which_check_failed(monkeypatch):
    monkeypatch.setattr(schedule, "accuracy_study", _fake_study(2e-6, 3e-7, 3e-7))
    res = run("check", "--ctx", "20000", "--seeds", "1", "--no-gpu", ok=False)
    out = " ".join(res.stdout.split())
    assert "checks FAILED: 1 failed check (listed above), first: schedule model: " \
           "n_ctx=20000 seed=0 S=8: the combine without rescale passed" in out


def test_check_bad_ctx():
    res = run("check", "--ctx", "0,5", ok=False)
    assert res.exit_code == 2 and ">= 1" in res.stderr


# ---------------------------------------------------------------------------- bench

@pytest.mark.skipif(HAVE_GPU, reason="this machine has a GPU: bench times for real")
def test_bench_without_gpu_says_so_and_shows_what_runs():
    res, data = run_json("bench")
    assert data["device"] is None and data["no_device_reason"] == GPU_REASON
    assert data["timings"] is None and "GPU" in data["how_to_time"]
    assert data["regs"]["rows"] and data["accuracy"]["ok"] is True
    out = run("bench").stdout
    assert "No GPU here" in out and "blocks/SM" in out and "relL2" in out
    assert "Timings need a CUDA GPU" in " ".join(out.split())
    res = run("bench", "--require-gpu", ok=False)
    assert res.exit_code == 2 and "--require-gpu" in res.stderr


@pytest.mark.skipif(HAVE_GPU, reason="this machine has a GPU: bench times for real")
def test_bench_without_gpu_writes_what_it_can(tmp_path):
    js = tmp_path / "b.json"
    res = run("bench", "--json", str(js))
    data = json.loads(js.read_text())
    assert data["timings"] is None and data["regs"]["rows"] and data["accuracy"]["rows"]
    assert "No GPU here" in res.stdout and f"wrote {js}" in " ".join(res.stderr.split())
    for opt, name in (("--csv", "b.csv"), ("--plot", "b.png")):
        res = run("bench", opt, str(tmp_path / name), ok=False)
        assert res.exit_code == 2 and f"{opt} needs timings" in res.stderr
        assert "no GPU here" in res.stderr and not (tmp_path / name).exists()
