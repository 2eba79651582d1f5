"""`mlasandbox stalls`: ncu's per-SASS stall samples turned into blocks and opcode shares.

The claims: instructions that ran equally often form one block, so a kernel's loops stand
out; within a block an opcode whose share of the samples is far above its share of the
instructions is where warps wait. A recorded profile of tiled16 at 16 heads on an H200
(tests/data/ncu_tiled16_sass.csv.gz) must read back as the kernel is known to run: the score
loop, 295 instructions run 147,456 times, whose 16 f16 -> f32 conversions hold over three
times their share of its instructions in samples.
"""
from __future__ import annotations

import csv
import gzip
import json
import os
import shutil
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from mlasandbox import ncu, registry, stalls
from mlasandbox.cli.main import main

from gpu_support import HAVE_GPU, gpu, gpu_alone

RECORDED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data",
                        "ncu_tiled16_sass.csv.gz")
# wgmma64 at 1 x 64 x 128 (one paged launch, page 64, f16, L2 flushed; an H100, 2026-12-05,
# the kernels of 78c74e7): only the address, source, executions and stall columns ncu filled.
RECORDED_WGMMA = os.path.join(os.path.dirname(RECORDED), "ncu_wgmma64_1x64x128_sass.csv.gz")

HEADER = ('"Address","Source","Instructions Executed","stall_selected","stall_math",'
          '"stall_wait","stall_selected (Not Issued)"')


def sass_csv(rows) -> str:
    """ncu's source page as it prints it: a kernel line, the header, one row per instruction."""
    lines = ['==PROF== Connected to process 1', '"Kernel Name","void k<1>(float *)",', HEADER]
    for i, (source, executed, selected, math, wait) in enumerate(rows):
        lines.append(f'"0x{16 * i:x}","      {source}","{executed}","{selected}","{math}",'
                     f'"{wait}","999"')
    return "\n".join(lines) + "\n"


# A loop of 3 FFMA and a predicated conversion (100 runs each), a prologue of 2 instructions
# (1 run each), and an instruction that never ran.
LOOP = [("FFMA.FTZ R1, R2, R3, R1", 100, 10, 0, 0), ("FFMA.FTZ R4, R2, R5, R4", 100, 10, 0, 0),
        ("FFMA.FTZ R6, R2, R7, R6", 100, 10, 0, 2), ("@!P0 HADD2.F32 R2, -RZ, R8.H0_H0", 100, 2, 20, 0)]
PROLOGUE = [("LDC R1, c[0x0][0x28]", 1, 0, 0, 3), ("MOV R9, RZ", 1, 1, 0, 0)]
NEVER = [("BRA 0x100", 0, 0, 0, 0)]


def test_source_page_reads_every_instruction_and_drops_predicates_and_not_issued_copies():
    kernel, lines = stalls.read_source_csv(sass_csv(LOOP + PROLOGUE + NEVER))
    assert kernel == "void k<1>(float *)"
    assert len(lines) == 7
    conv = lines[3]
    assert conv.opcode == "HADD2.F32" and conv.source.startswith("@!P0 HADD2.F32")
    assert conv.executed == 100
    assert conv.samples == {"selected": 2.0, "math": 20.0, "wait": 0.0}  # not the 999s


def test_blocks_group_equally_often_run_instructions_and_share_their_samples():
    kernel, lines = stalls.read_source_csv(sass_csv(LOOP + PROLOGUE + NEVER))
    report = stalls.summarize(kernel, lines)
    assert report.samples == 58 and report.instructions == 7
    assert report.reasons == (("selected", 33.0), ("math", 20.0), ("wait", 5.0))
    loop, prologue = report.blocks  # the never-run instruction forms no block
    assert (loop.executed, loop.instructions, loop.samples) == (100, 4, 54)
    assert loop.sample_share == pytest.approx(54 / 58)
    assert (prologue.executed, prologue.instructions, prologue.samples) == (1, 2, 4)
    conv = next(o for o in loop.opcodes if o.opcode == "HADD2.F32")
    assert conv.instr_share == pytest.approx(1 / 4) and conv.sample_share == pytest.approx(22 / 54)
    assert conv.reasons == (("math", 20.0), ("selected", 2.0))
    ffma = loop.opcodes[0]
    assert ffma.opcode == "FFMA.FTZ" and ffma.instructions == 3 and ffma.samples == 32


def test_code_footprint_counts_the_lines_of_code_that_ran():
    # 20 instructions at 16 bytes: lines 0 (0-7), 1 (8-15) and 2 (16-19); line 1 never ran
    rows = [("FFMA R1, R2, R3, R1", 0 if 8 <= i < 16 else 1, 0, 0, 0) for i in range(20)]
    kernel, lines = stalls.read_source_csv(sass_csv(rows))
    code = stalls.summarize(kernel, lines).code
    assert (code.code_bytes, code.lines, code.lines_run) == (320, 3, 2)
    # negative control: one run instruction in line 1 makes it count
    rows[12] = ("FFMA R1, R2, R3, R1", 5, 0, 0, 0)
    kernel, lines = stalls.read_source_csv(sass_csv(rows))
    assert stalls.summarize(kernel, lines).code.lines_run == 3
    # an address that is not a number: no footprint, the rest of the report stands
    odd = [stalls.SassLine("pc?", ln.source, ln.opcode, ln.executed, ln.samples) for ln in lines]
    report = stalls.summarize(kernel, odd)
    assert report.code is None and report.instructions == 20


def test_the_recorded_wgmma64_launch_ran_389_of_its_883_lines():
    with gzip.open(RECORDED_WGMMA, "rt", encoding="utf-8") as f:
        kernel, lines = stalls.read_source_csv(f.read())
    assert "wgmma_attn_paged" in kernel and len(lines) == 7064
    code = stalls.summarize(kernel, lines).code
    assert (code.code_bytes, code.lines, code.lines_run) == (7064 * 16, 883, 389)


def test_blocks_below_the_minimum_share_and_past_the_top_are_left_out():
    kernel, lines = stalls.read_source_csv(sass_csv(LOOP + PROLOGUE))
    assert [b.executed for b in stalls.summarize(kernel, lines, min_share=0.1).blocks] == [100]
    assert [b.executed for b in stalls.summarize(kernel, lines, top_blocks=1).blocks] == [100]


@pytest.mark.parametrize("text, why", [
    ("", "no per-SASS table"),
    ('"Address","Source","stall_selected"\n"0x0","FFMA","1"\n', "'Instructions Executed'"),
    ('"Address","Source","Instructions Executed"\n"0x0","FFMA","1"\n', "stall_<reason>"),
    (HEADER + "\n", "no instruction rows"),
])
def test_text_that_is_not_the_source_page_is_refused_with_what_is_missing(text, why):
    with pytest.raises(stalls.NcuFormatError, match=why.replace("(", r"\(")):
        stalls.read_source_csv(text)


def test_raw_page_gives_the_first_kernels_metrics_by_name():
    text = ('"ID","Kernel Name","gpu__time_duration.sum","smsp__inst_executed.sum"\n'
            '"","","us","inst"\n'
            '"0","void k<1>(float *)","32.608000","12,715,312"\n')
    assert stalls.read_raw_csv("==PROF== x\n" + text) == {
        "Kernel Name": "void k<1>(float *)", "gpu__time_duration.sum": 32.608,
        "smsp__inst_executed.sum": 12715312.0}
    with pytest.raises(stalls.NcuFormatError, match="no kernel row"):
        stalls.read_raw_csv(text.splitlines()[0])


def recorded_text() -> str:
    with gzip.open(RECORDED, "rt", encoding="utf-8") as f:
        return f.read()


def test_the_recorded_tiled16_profile_shows_the_conversions_waiting_in_the_score_loop():
    kernel, lines = stalls.read_source_csv(recorded_text())
    assert "attn_tiled" in kernel
    report = stalls.summarize(kernel, lines)
    score = report.blocks[0]
    assert (score.executed, score.instructions) == (147456, 295)
    ops = {o.opcode: o for o in score.opcodes}
    assert ops["FFMA.FTZ"].instructions == 256
    conv = ops["HADD2.F32"]
    assert conv.instructions == 16 and conv.sample_share > 3 * conv.instr_share
    assert conv.reasons[0][0] == "math"
    value = report.blocks[1]
    assert (value.executed, value.instructions) == (65536, 601)


def test_kernel_filter_matches_its_kernel_in_every_spelling_and_no_other():
    import re

    tiled = re.compile(ncu.kernel_filter(registry.tiled_instance(16)))
    batched = re.compile(ncu.kernel_filter(registry.attn_instance(16)))
    tiled_names = ("attn_tiled", "void mla::attn_tiled<(int)16, __half, float>(const T3 *)",
                   "void attn_tiled<16, __half, float>(const T3 *, const T2 *)")
    batched_names = ("attn", "void mla::attn<(int)16, __half, float>(const T3 *)")
    assert all(tiled.search(n) for n in tiled_names)
    assert all(batched.search(n) for n in batched_names)
    assert not any(batched.search(n) for n in tiled_names + ("attn_rows", "mma_attn"))
    assert not tiled.search("void mla::attn_tiled2<16>(float *)")


def test_a_missing_ncu_is_reported_with_where_it_was_looked_for(monkeypatch):
    for var in ("NCU", "CUDA_PATH", "CUDA_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(ncu.NcuError, match="not on PATH.*--ncu PATH or \\$NCU"):
        ncu.find_ncu()
    monkeypatch.setenv("CUDA_HOME", "/opt/cuda-x")
    with pytest.raises(ncu.NcuError, match="/opt/cuda-x/bin/ncu, /usr/local/cuda/bin/ncu"):
        ncu.find_ncu()
    with pytest.raises(ncu.NcuError, match="ncu not found at '/nowhere/ncu'"):
        ncu.find_ncu("/nowhere/ncu")


def test_the_cublas_engine_is_refused_before_ncu_is_looked_for(monkeypatch):
    monkeypatch.setattr(ncu, "find_ncu", lambda *a: pytest.fail("looked for ncu"))
    with pytest.raises(ValueError, match="cublas.*launches no attention kernel"):
        ncu.profile_attention("cublas", 16, 4096)


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture
def saved(tmp_path):
    (tmp_path / "source.csv").write_text(recorded_text(), encoding="utf-8")
    (tmp_path / "raw.csv").write_text(
        '"ID","Kernel Name","smsp__issue_active.avg.pct_of_peak_sustained_active",'
        '"smsp__inst_executed.sum"\n"","","%","inst"\n"0","attn_tiled","69.94","91463680"\n',
        encoding="utf-8")
    return tmp_path


def test_cli_reads_a_saved_profile_and_marks_where_warps_wait(saved):
    res = run("stalls", "--from", saved, "--blocks", "2")
    assert res.exit_code == 0, res.output
    assert "issue active (% of cycles)" in res.output and "91,463,680" in res.output
    assert "run 147,456 times each: 295 of them" in res.output
    conv_row = next(line for line in res.output.splitlines() if "HADD2.F32" in line)
    assert "<- waits" in conv_row
    assert "run 16,384 times" not in res.output  # --blocks 2
    # only opcodes that hold many more samples than instructions, and enough of them: the
    # recorded profile's FFMAs (its most-run opcode) are not where the warps wait
    marked = [ln for ln in res.output.splitlines() if "<- waits" in ln]
    assert len(marked) == 4, marked
    assert all("FFMA.FTZ" not in ln for ln in marked)


def test_cli_json_carries_the_blocks_and_the_kernel_metrics(saved):
    res = run("stalls", "--from", saved / "source.csv", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["ok"] and data["kernel_metrics"] == {}  # a lone source CSV has no raw page
    assert data["blocks"][0]["executed"] == 147456
    assert data["blocks"][0]["opcodes"][0]["opcode"] == "FFMA.FTZ"


def test_cli_reads_the_recorded_gzipped_page_as_it_is():
    res = run("stalls", "--from", RECORDED, "--blocks", "1")
    assert res.exit_code == 0, res.output
    assert "run 147,456 times each: 295 of them" in res.output


def test_cli_prints_and_writes_the_code_footprint():
    res = run("stalls", "--from", RECORDED_WGMMA, "--blocks", "1")
    assert res.exit_code == 0, res.output
    assert "code: the launch ran 389 of the kernel's 883 lines of 128 bytes" in res.output
    assert "(48.6 of 110.4 KiB)" in res.output
    data = json.loads(run("stalls", "--from", RECORDED_WGMMA, "--json").output)
    assert data["code"] == {"code_bytes": 7064 * 16, "lines": 883, "lines_run": 389}


def test_cli_refuses_a_missing_or_foreign_profile(tmp_path):
    res = run("stalls", "--from", tmp_path / "nothing.csv")
    assert res.exit_code == 2 and "does not exist" in res.output
    (tmp_path / "x.csv").write_text("not ncu\n")
    res = run("stalls", "--from", tmp_path / "x.csv")
    assert res.exit_code == 2 and "no per-SASS table" in res.output
    res = run("stalls", "--from", "")
    assert res.exit_code == 2 and "an empty path" in res.output


def test_cli_refuses_a_saved_profile_it_cannot_read(saved):
    (saved / "raw.csv").write_bytes(b"\xff\xfe not text")
    res = run("stalls", "--from", saved)
    assert res.exit_code == 2 and "ncu raw page" in res.output \
        and "is not UTF-8 text" in res.output, res.output
    (saved / "raw.csv").unlink()
    (saved / "raw.csv").mkdir()
    res = run("stalls", "--from", saved)
    assert res.exit_code == 2 and "raw.csv" in res.output, res.output
    (saved / "raw.csv").rmdir()


def _with_cell(column_of, value) -> str:
    """The recorded per-SASS page with the first instruction row's cell in the column that
    `column_of(header)` picks set to `value`."""
    lines = recorded_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith('"Address"'))
    header = next(csv.reader([lines[at]]))
    col = header.index(column_of(header))
    first = next(i for i, line in enumerate(lines) if line.startswith('"0x'))
    cells = next(csv.reader([lines[first]]))
    cells[col] = value
    lines[first] = ",".join(f'"{c}"' for c in cells)
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("column_of", [
    lambda h: "Instructions Executed",
    lambda h: next(c for c in h if c.startswith("stall_")),
], ids=["executed", "stall"])
@pytest.mark.parametrize("value", ["nan", "abc", "-5", "0.5", "1e308", "inf"])
def test_a_cell_ncu_would_not_write_is_refused_naming_file_and_column(saved, column_of, value):
    # a count is a whole number of executions or samples: text read as 0, a negative or a
    # fraction would sum into a profile that looks real
    (saved / "source.csv").write_text(_with_cell(column_of, value), encoding="utf-8")
    res = run("stalls", "--from", saved)
    text = " ".join(res.output.split())
    assert res.exit_code == 2 and f"{saved / 'source.csv'}" in text, res.output
    assert f"cell of {value!r}" in text and "whole count" in text, res.output


def test_a_row_cut_short_is_refused(saved):
    lines = recorded_text().splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith('"0x'))
    lines[first] = ",".join(f'"{c}"' for c in next(csv.reader([lines[first]]))[:3])
    (saved / "source.csv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    res = run("stalls", "--from", saved)
    assert res.exit_code == 2 and "has 3 cells where the header has" in res.output, res.output
    # the recorded page itself reads (the control: the checks above refuse only the damage)
    (saved / "source.csv").write_text(recorded_text(), encoding="utf-8")
    assert run("stalls", "--from", saved).exit_code == 0


def test_the_raw_page_skips_text_and_refuses_a_negative_rate():
    head = '"Kernel Name","device__attribute_display_name","sm__cycles_elapsed.avg.per_second"'
    page = lambda v: f'{head}\n"","","Ghz"\n"k","NVIDIA H200","{v}"\n'
    got = stalls.read_raw_csv(page("1.98"))
    assert got["sm__cycles_elapsed.avg.per_second"] == 1.98 and got["Kernel Name"] == "k"
    assert "device__attribute_display_name" not in got  # text, not a figure
    assert "sm__cycles_elapsed.avg.per_second" not in stalls.read_raw_csv(page("n/a"))
    with pytest.raises(stalls.NcuFormatError, match="below 0"):
        stalls.read_raw_csv(page("-1.5"))


@pytest.mark.skipif(HAVE_GPU, reason="this machine has a GPU")
def test_cli_without_a_gpu_says_so_and_how_to_read_a_saved_profile():
    res = run("stalls", "--variant", "tiled16")
    assert res.exit_code == 2
    assert "stalls profiles a kernel on a GPU" in res.output and "--from" in res.output


def test_cli_profiles_through_ncu_and_names_ncu_failures(monkeypatch, saved):
    from mlasandbox import toolkit
    from mlasandbox.cli import stalls_cmd

    monkeypatch.setattr(toolkit, "device_available", lambda: (True, "device 0: fake"))
    calls = []

    def fake(**opts):
        calls.append(opts)
        return ncu.NcuRun((saved / "raw.csv").read_text(), recorded_text(), "attn_tiled<...>", ())

    monkeypatch.setattr(stalls_cmd, "_profile", fake)
    res = run("stalls", "--variant", "batched16", "--heads", "96", "--ctx", "8192", "--q", "cache",
              "--cache", "bf16", "--splits", "7")
    assert res.exit_code == 0, res.output
    assert calls == [{"variant": "batched16", "n_head": 96, "n_ctx": 8192, "cache": "bf16",
                      "q": "bf16", "splits": 7, "seed": 0, "ncu": None, "save_dir": None}]
    calls.clear()
    res = run("stalls", "--variant", "mma16", "--warm", "--json")
    assert res.exit_code == 0, res.output
    assert calls[0]["warm"] is True and json.loads(res.output)["config"]["warm"] is True

    def broken(**opts):
        raise ncu.NcuError("ncu exited 1:\n==ERROR== ERR_NVGPUCTRPERM")

    monkeypatch.setattr(stalls_cmd, "_profile", broken)
    res = run("stalls")
    assert res.exit_code == 1 and "ERR_NVGPUCTRPERM" in res.output


def test_cli_profiles_a_paged_step_with_a_presets_shape_or_the_options(monkeypatch, saved):
    """--serving / --batch profile the paged step: the profile gets the requests' lengths, page
    size, query tokens and causality, the preset's heads unless --heads says, and q in the
    cache dtype unless --q says (as bench --batch)."""
    from mlasandbox import toolkit
    from mlasandbox.cli import stalls_cmd

    monkeypatch.setattr(toolkit, "device_available", lambda: (True, "device 0: fake"))
    calls = []

    def fake(**opts):
        calls.append(opts)
        return ncu.NcuRun((saved / "raw.csv").read_text(), recorded_text(), "wgmma<...>", ())

    monkeypatch.setattr(stalls_cmd, "_profile", fake)
    res = run("stalls", "--variant", "wgmma64", "--serving", "b128-4k-h128", "--json")
    assert res.exit_code == 0, res.output
    (c,) = calls
    assert (c["variant"], c["n_head"], c["cache"], c["q"]) == ("wgmma64", 128, "f16", "f16")
    assert c["paged"] == ncu.PagedSpec((4096,) * 128, 64, 1, False)
    paged = json.loads(res.output)["config"]["paged"]
    assert (paged["batch"], paged["page_size"], paged["s_q"]) == (128, 64, 1)
    assert "n_ctx" not in json.loads(res.output)["config"]

    calls.clear()
    res = run("stalls", "--variant", "mma16", "--batch", "3", "--lengths", "5,0,700",
              "--page-size", "16", "--s-q", "2", "--causal", "--q", "f32", "--heads", "9")
    assert res.exit_code == 0, res.output
    (c,) = calls
    assert (c["n_head"], c["q"]) == (9, "f32")
    assert c["paged"] == ncu.PagedSpec((5, 0, 700), 16, 2, True)


@pytest.mark.parametrize("args, message", [
    (("--variant", "wgmma64"), "wgmma64 serves the paged step only: give --batch"),
    (("--variant", "tiled16", "--batch", "2"), "tiled16 serves batch 1"),
    (("--batch", "2", "--ctx", "100"), "--ctx is the batch-1 step's context"),
    (("--lengths", "5"), "--lengths needs --batch B or --serving PRESET"),
    (("--variant", "mma16", "--batch", "2", "--lengths", "-3"), "lengths"),
])
def test_cli_refuses_a_paged_profile_it_cannot_run_before_looking_for_a_gpu(
        monkeypatch, args, message):
    from mlasandbox import toolkit

    monkeypatch.setattr(toolkit, "device_available", lambda: pytest.fail("looked for a GPU"))
    res = run("stalls", *args)
    assert res.exit_code == 2 and message in res.output, res.output


def test_a_paged_profile_runs_the_paged_child_and_filters_the_paged_kernel(monkeypatch,
                                                                             tmp_path):
    import re

    monkeypatch.setattr(ncu, "find_ncu", lambda *a: "/fake/ncu")
    seen = []

    def fake_run(cmd, timeout):
        seen.append(cmd)
        if "-o" in cmd:  # the profiling run writes its report
            open(cmd[cmd.index("-o") + 1] + ".ncu-rep", "w").close()
        return "page"

    monkeypatch.setattr(ncu, "_run", fake_run)
    spec = ncu.PagedSpec((300, 0, 4097), 16, 2, True)
    run_ = ncu.profile_attention("wgmma64", 16, 131072, cache="bf16", q="bf16", seed=3,
                                 save_dir=str(tmp_path), paged=spec)
    cmd = seen[0]
    child = cmd[cmd.index("mlasandbox.ncu") + 1:]
    assert child == ["paged", "wgmma64", "16", "bf16", "bf16", "0", "3", "16", "2", "1",
                     "300,0,4097"]
    pattern = re.compile(cmd[cmd.index("-k") + 1].removeprefix("regex:"))
    assert pattern.search("void mla::wgmma_attn_paged<__nv_bfloat16, __nv_bfloat16>(const T2 *)")
    assert run_.kernel == "wgmma_attn<cache=bf16,q=bf16,partials=true,paged=true>"
    # the single-pass instance (partials=false) has the same base name: the filter takes it
    assert pattern.search("void mla::wgmma_attn_paged<__half, __half, (bool)0>(const T2 *)")
    ncu.profile_attention("mma16", 16, 1, paged=spec)  # batch-1 variants: their paged launch
    assert re.compile(seen[-3][seen[-3].index("-k") + 1].removeprefix("regex:")).search(
        "void mla::mma_attn_paged<(int)16, __half, float>(const T3 *)")
    with pytest.raises(ValueError, match="wgmma64 serves the paged step only"):
        ncu.profile_attention("wgmma64", 16, 4096)


def test_a_warm_profile_keeps_the_caches_and_profiles_the_second_launch(monkeypatch):
    """Cold (the default): every pass after ncu's flush of the caches, the first launch.
    Warm: the caches kept, the child launches twice, ncu skips the first."""
    monkeypatch.setattr(ncu, "find_ncu", lambda *a: "/fake/ncu")
    seen = []

    def fake_run(cmd, timeout):
        seen.append(cmd)
        if "-o" in cmd:
            open(cmd[cmd.index("-o") + 1] + ".ncu-rep", "w").close()
        return "page"

    monkeypatch.setattr(ncu, "_run", fake_run)

    def opts(cmd):
        at = cmd.index("mlasandbox.ncu")
        return cmd[:at], cmd[at + 1:]

    ncu.profile_attention("mma16", 16, 4096)
    before, child = opts(seen[0])
    assert before[before.index("--cache-control") + 1] == "all"
    assert "--launch-skip" not in before and child[0] == "mma16"
    spec = ncu.PagedSpec((300, 5000), 64, 1, False)
    ncu.profile_attention("wgmma64", 64, 0, q="f16", paged=spec, warm=True)
    before, child = opts(seen[-3])
    assert before[before.index("--cache-control") + 1] == "none"
    assert before[before.index("--launch-skip") + 1] == "1"
    assert before[before.index("--launch-count") + 1] == "1"
    assert child[:3] == ["warm", "paged", "wgmma64"]


@pytest.mark.parametrize("argv, kind", [
    (["mma16", "16", "4096", "f16", "f32", "0", "0"], "batch1"),
    (["warm", "mma16", "16", "4096", "f16", "f32", "0", "0"], "batch1"),
    (["paged", "mma16", "16", "f16", "f32", "0", "0", "64", "1", "0", "300,5"], "paged"),
    (["warm", "paged", "mma16", "16", "f16", "f32", "0", "0", "64", "1", "0", "300"], "paged")])
def test_the_child_launches_the_attn_phase_once_or_twice_when_warm(monkeypatch, argv, kind):
    import cupy

    launched = []

    class Step:
        def run_attn(self):
            launched.append(kind)

    def step(n_args):
        def make(args):
            assert args == argv[-n_args:]
            return Step()
        return make

    monkeypatch.setattr(ncu, "_batch1_step", step(7))
    monkeypatch.setattr(ncu, "_paged_step", step(10))
    monkeypatch.setattr(cupy.cuda, "Device", lambda *a: SimpleNamespace(synchronize=lambda: None))
    assert ncu._launch(argv) == 0
    assert launched == [kind] * (2 if argv[0] == "warm" else 1)


def _have_ncu() -> bool:
    try:
        ncu.find_ncu()
    except ncu.NcuError:
        return False
    return True


# What ncu prints when its kernel replay fails on the device rather than on the kernel. Under
# pytest -n 16 with the other workers sharing the GPU, ncu's replay (which saves and restores
# the memory the kernel touches) ended once in "LaunchFailed" after all four passes and, on
# an H200 and twice in a row on an H100, in "Failed to prepare kernel for profiling ...
# Unknown Error on device 0". So these profiles have the GPU alone (gpu_alone), and take one
# more try on these lines alone; a second failure, or any other ncu failure, is reported as
# it is.
# Once (H200, paged mma16 at 3 x (300, 0, 5000), 2026-12-03) the source page of a profile
# taken under -n 16 came back without its stall_<reason> columns (no warp-state samples),
# and the same test passed three times alone: that takes the one more try too.
_NCU_DEVICE_FAILURES = ("LaunchFailed", "Failed to prepare kernel for profiling",
                        "Unknown Error on device")
_NCU_NO_SAMPLES = "no stall_<reason> columns"


def _profile_with_one_retry(*args, **kwargs):
    try:
        run_ = ncu.profile_attention(*args, **kwargs)
        stalls.read_source_csv(run_.source_csv)
        return run_
    except ncu.NcuError as exc:
        if not any(line in str(exc) for line in _NCU_DEVICE_FAILURES):
            raise
    except stalls.NcuFormatError as exc:
        if _NCU_NO_SAMPLES not in str(exc):
            raise
    return ncu.profile_attention(*args, **kwargs)


def test_ncu_profiles_one_process_at_a_time(monkeypatch, tmp_path):
    """The profiling run holds the lock file's exclusive lock (a second holder, here a second
    open file in this process, cannot take it then); outside the run anyone can. The file is
    this test's own, so a real profile on another worker of the GPU suite cannot hold it."""
    fcntl = pytest.importorskip("fcntl")
    monkeypatch.setattr(ncu, "lock_path", lambda: str(tmp_path / "ncu.lock"))

    def held() -> bool:
        with open(ncu.lock_path(), "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(f, fcntl.LOCK_UN)
            return False

    seen = []
    monkeypatch.setattr(ncu, "find_ncu", lambda explicit=None: "ncu-stand-in")
    monkeypatch.setattr(ncu, "_run", lambda cmd, timeout: seen.append(held()) or "")
    assert not held()  # the control: nobody holds it now
    with pytest.raises(ncu.NcuError, match="profiled no"):
        ncu.profile_attention("mma16", 16, 1024)
    assert seen == [True]
    assert not held()


def test_an_ncu_failure_keeps_ncus_error_lines_ahead_of_the_tail():
    """ncu's ==ERROR== line (what _profile_with_one_retry matches) survives a long traceback
    of the child after it."""
    out = "==PROF== Connected\n==ERROR== LaunchFailed\n" + "\n".join(
        f"  traceback line {i}" for i in range(40))
    tail = ncu._tail(out)
    assert tail.splitlines()[0] == "==ERROR== LaunchFailed"
    assert tail.splitlines()[-1] == "  traceback line 39" and "line 20" not in tail


def test_only_ncus_device_failures_are_profiled_again(monkeypatch):
    calls = []

    def fails(message):
        def profile(*args, **kwargs):
            calls.append(args)
            if len(calls) == 1:
                raise ncu.NcuError(message)
            return "second"
        return profile

    monkeypatch.setattr(ncu, "profile_attention", fails("ncu exited 9:\n==ERROR== LaunchFailed"))
    assert _profile_with_one_retry("mma16") == "second" and len(calls) == 2
    calls.clear()
    monkeypatch.setattr(ncu, "profile_attention", fails("ncu exited 1: bad option"))
    with pytest.raises(ncu.NcuError, match="bad option"):
        _profile_with_one_retry("mma16")
    assert len(calls) == 1


def test_a_profile_without_stall_samples_is_taken_again_once(monkeypatch):
    # the first profile's source page lacks the stall columns (no warp-state samples), the
    # second has them; a page with no per-SASS table at all is a format error, raised as is
    calls = []
    header = '"Address","Source","Instructions Executed"'
    pages = {1: header, 2: header + ',"stall_wait"'}

    def profile(*args, **kwargs):
        calls.append(args)
        return SimpleNamespace(source_csv=pages.get(len(calls), "nothing"))

    monkeypatch.setattr(ncu, "profile_attention", profile)
    assert "stall_wait" in _profile_with_one_retry("mma16").source_csv and len(calls) == 2
    calls.clear()
    pages = {}
    with pytest.raises(stalls.NcuFormatError, match="no per-SASS table"):
        _profile_with_one_retry("mma16")
    assert len(calls) == 1


@pytest.mark.skipif(not _have_ncu(), reason="needs ncu (Nsight Compute)")
@gpu  # checked first: without a GPU, that is the reason to give
@gpu_alone
def test_on_the_gpu_ncu_profiles_tiled16_and_its_score_loop_is_found(tmp_path):
    run_ = _profile_with_one_retry("tiled16", 16, 8192, save_dir=str(tmp_path))
    kernel, lines = stalls.read_source_csv(run_.source_csv)
    report = stalls.summarize(kernel, lines)
    # 8192 rows over S slices of 32-row tiles: whatever S is, the score loop's 295-ish
    # instructions run 9 units x 4 warps x tiles x slices times, more than anything else
    # but the FFMA-dense value loop, and both loops are among the hottest blocks.
    loops = [b for b in report.blocks if any(o.opcode == "FFMA.FTZ" and o.instructions >= 256
                                             for o in b.opcodes)]
    assert len(loops) == 2, [(b.executed, b.instructions) for b in report.blocks]
    metrics = stalls.read_raw_csv(run_.raw_csv)
    assert metrics["smsp__inst_executed.sum"] > 0
    assert 0 < metrics["smsp__issue_active.avg.pct_of_peak_sustained_active"] <= 100
    assert (tmp_path / "source.csv").exists() and (tmp_path / "stalls.ncu-rep").exists()


@pytest.mark.skipif(not _have_ncu(), reason="needs ncu (Nsight Compute)")
@gpu
@gpu_alone
@pytest.mark.parametrize("variant, spec, kernel, warm", [
    ("mma16", ncu.PagedSpec((300, 0, 5000), 16, 2, True), "mma_attn_paged", False),
    ("wgmma64", ncu.PagedSpec((4096, 70), 64, 1, False), "wgmma_attn_paged", False),
    ("wgmma64", ncu.PagedSpec((4096, 70), 64, 1, False), "wgmma_attn_paged", True)])
def test_on_the_gpu_ncu_profiles_a_paged_step_and_finds_its_tile_loop(variant, spec, kernel,
                                                                       warm):
    q = "f16" if variant == "wgmma64" else "f32"
    run_ = _profile_with_one_retry(variant, 16, 0, q=q, paged=spec, warm=warm)
    name, lines = stalls.read_source_csv(run_.source_csv)
    assert kernel in name
    report = stalls.summarize(name, lines)
    # a loop: some block of instructions ran more often than another
    runs = [b.executed for b in report.blocks]
    assert report.samples > 0 and len(runs) >= 2 and max(runs) > min(runs) >= 1, runs
    assert stalls.read_raw_csv(run_.raw_csv)["smsp__inst_executed.sum"] > 0
    # ncu prints where the code was loaded: a footprint, some but not all of its lines run
    code = report.code
    assert code is not None and 0 < code.lines_run < code.lines, code
    assert code.code_bytes == 16 * len(lines)


def test_kernel_names_lose_their_parameter_list_not_their_template_arguments():
    from mlasandbox.cli.stalls_cmd import short_name

    assert short_name("void mla::attn_tiled<(int)16, __half, float>(const T3 *, int)") == \
        "mla::attn_tiled<(int)16, __half, float>"
    assert short_name("attn_rows") == "attn_rows"
