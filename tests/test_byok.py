"""Bring your own kernel without a GPU: the header, the contract, `new` and `try`'s compile.

`new` for every template writes a file that `try` compiles (NVRTC with -Xptxas -v, no GPU)
and reports registers for; a syntax error is reported at its file and line; a bad header is
a usage error (exit 2) naming the field; a smem declaration smaller than the kernel's
MLA_SMEM_NEEDS fails the compile; a signature off the contract fails the compile.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from mlasandbox import user_kernel as uk
from mlasandbox.chunks import plan_chunks
from mlasandbox.user_new import TEMPLATES
from mlasandbox.cli.main import main
from mlasandbox.paged_api import PagedDecodeStep, paged_variant

DATA = Path(__file__).parent / "data"
CORRECT = DATA / "byok_warp_rows.cu"
PLANTED = sorted(DATA.glob("byok_bad_*.cu"))
GOOD_HEADER = ("// mlasandbox: entry=k threads=128 tile_rows=32 heads_per_block=HPB smem=0\n"
               "// mlasandbox: params HPB=4,8\n")


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def try_json(path, *extra):
    res = cli("try", path, "--json", *extra)
    out = res.output.lstrip()
    return res, (json.JSONDecoder().raw_decode(out)[0] if out.startswith("{") else None)


# ---- the header ------------------------------------------------------------------------

def test_header_fields_and_params():
    h = uk.parse_header(GOOD_HEADER)
    assert h.params == {"HPB": (4, 8)} and h.kind == "attn"
    assert h.evaluate({"HPB": 8}) == {"threads": 128, "tile_rows": 32, "heads_per_block": 8,
                                      "smem": 0}
    assert [p["HPB"] for p in h.param_sets({"HPB": (12, 16)})] == [12, 16]


def test_smem_expression_is_c_integer_arithmetic():
    h = uk.parse_header("// mlasandbox: entry=k threads=256 tile_rows=32 heads_per_block=H "
                        "smem=3*((H+3)/4*4)*4+max(KEY_DIM,TILE_ROWS)\n"
                        "// mlasandbox: params H=5\n")
    assert h.evaluate({"H": 5})["smem"] == 3 * 8 * 4 + 576


@pytest.mark.parametrize("text, words", [
    ("int x;\n", ["no `// mlasandbox:` header"]),
    ("// mlasandbox: entry=k threads=128 tile_rows=32 smem=0\n", ["lacks heads_per_block"]),
    ("// mlasandbox: entry=k threads=128 tile_rows=32 heads_per_block=1 smem=0 tile=4\n",
     ["unknown field 'tile'"]),
    ("// mlasandbox: entry=k threads=100 tile_rows=32 heads_per_block=1 smem=0\n",
     ["threads=100", "multiple of 32"]),
    ("// mlasandbox: entry=k threads=128 tile_rows=32 heads_per_block=HPB smem=0\n",
     ["heads_per_block=HPB", "unknown name 'HPB'"]),
    ("// mlasandbox: entry=k threads=128 tile_rows=32 heads_per_block=1 smem=10**6\n",
     ["smem=10**6", "only integers"]),
    ("// mlasandbox: entry=k threads=128 tile_rows=32 heads_per_block=1 smem=300000\n",
     ["smem=300000", "0..232448"]),
    ("// mlasandbox: entry=k kind=fused threads=128 tile_rows=32 heads_per_block=1 smem=0\n",
     ["kind=fused"]),
    ("// mlasandbox: entry=k( threads=128 tile_rows=32 heads_per_block=1 smem=0\n",
     ["entry=k("]),
    (GOOD_HEADER + "// mlasandbox: params MLA_X=1\n", ["MLA_X is reserved"]),
    # a name the sandbox defines for the kernel: a param of that name would change the
    # header's own expressions (smem=TILE_ROWS*KEY_DIM*2) behind the user's back
    (GOOD_HEADER + "// mlasandbox: params KEY_DIM=1\n", ["KEY_DIM is reserved"]),
    (GOOD_HEADER + "// mlasandbox: params N=4\n// mlasandbox: params N=8\n",
     ["N is declared twice"]),
    (GOOD_HEADER + "// mlasandbox: params N=4,4\n", ["N=4,4 repeats a value"]),
    ("// mlasandbox: entry=k threads=128 tile_rows=32 heads_per_block=1 smem=0 threads=64\n",
     ["field threads is given twice"]),
    ("// mlasandbox: entry=k threads=128 tile_rows=32 heads_per_block=1 smem=0\n"
     "// mlasandbox: params N=1,x\n", ["N=1,x", "integers"]),
])
def test_bad_header_names_the_field(text, words):
    with pytest.raises(uk.HeaderError) as e:
        uk.parse_header(text, "my.cu")
    for w in words:
        assert w in str(e.value)


_EDGE = "// mlasandbox: entry=k threads={t} tile_rows={r} heads_per_block={h} smem={s}\n"


@pytest.mark.parametrize("t, r, h, s, params, said", [
    (0, 32, 1, 0, "", "threads must be a multiple of 32 in 32..1024"),
    (1056, 32, 1, 0, "", "threads must be a multiple of 32 in 32..1024"),
    (128, 0, 1, 0, "", "tile_rows must be in 1..65535"),
    (128, 65536, 1, 0, "", "tile_rows must be in 1..65535"),
    (128, 32, 0, 0, "", "heads_per_block must be in 1..64"),
    (128, 32, 65, 0, "", "heads_per_block must be in 1..64"),
    (32, 32, 1, 232449, "", "smem must be in 0..232448 B"),
    (128, 32, 1, 0, "Z=-2147483648", "Z must be an integer >= -2147483647"),
    (128, 32, 1, 0, "Z=2147483648", "must be in -2147483647..2147483647"),
])
def test_header_values_past_each_edge_are_refused(t, r, h, s, params, said):
    text = _EDGE.format(t=t, r=r, h=h, s=s) + (f"// mlasandbox: params {params}\n"
                                              if params else "")
    with pytest.raises(uk.HeaderError, match=re.escape(said)):
        uk.parse_header(text, "my.cu")


def test_header_values_at_each_edge_are_taken():
    for t, r, h, s in ((32, 1, 1, 0), (1024, 65535, 64, 232448)):
        uk.parse_header(_EDGE.format(t=t, r=r, h=h, s=s)
                        + "// mlasandbox: params Z=-2147483647,2147483647\n", "my.cu")


def test_dynamic_smem_without_its_statement_is_refused(tmp_path):
    p = tmp_path / "k.cu"
    p.write_text(GOOD_HEADER + "extern __shared__ float s[];\n")
    with pytest.raises(uk.HeaderError, match="MLA_SMEM_NEEDS"):
        uk.load_kernel(str(p))


# ---- the contract ----------------------------------------------------------------------

def test_contract_is_read_from_attn_args():
    """The names are the attributes PagedDecodeStep.attn_args() reads, in its order (its
    source is the one list: a new argument there is one here, or an error naming it)."""
    import inspect

    names = [a.name for a in uk.contract_args()]
    src = inspect.getsource(PagedDecodeStep.attn_args)
    assert len(names) == src.count("np.int32(") + src.count("np.float32(") + sum(
        f"self.{n}" in src for n in ("q", "kv_cache", "block_table", "cache_seqlens",
                                     "part_acc", "part_m", "part_l", "chunk_counts",
                                     "latent", "lse"))
    assert names[:4] == ["q", "kv_cache", "block_table", "cache_seqlens"]
    assert names[13:16] == ["part_acc", "part_m", "part_l"] and "scale_log2" in names
    assert names[-5:] == ["target", "batch", "chunk_counts", "latent", "lse"]
    assert uk.contract_args("step") == uk.contract_args()


def test_docs_list_the_contract():
    doc = (Path(__file__).parents[1] / "docs" / "byok.md").read_text()
    sig = re.search(r"```cuda\n(__global__ void my_attn\(.*?\))", doc, re.S).group(1)
    for a in uk.contract_args():
        assert f"{a.ctype} {a.name}" in " ".join(sig.split()), a


def test_paged_variant_takes_a_user_kernel():
    v = paged_variant(f"{CORRECT}:ROWS=8", 1, 16)
    assert v.family == "user" and v.params == {"ROWS": 8} and v.hpb == 8
    assert paged_variant(v, 1, 16) is v
    with pytest.raises(ValueError, match="no such file"):
        paged_variant("missing.cu", 1, 16)
    with pytest.raises(uk.HeaderError, match="no parameter X"):
        uk.load_kernel(str(CORRECT), X=1)


# ---- compiling (NVRTC, no GPU) -----------------------------------------------------------

@pytest.mark.parametrize("template", list(TEMPLATES))
def test_new_writes_a_kernel_try_compiles(tmp_path, template):
    path = tmp_path / f"exp_{template}.cu"
    res = cli("new", path, "--from", template)
    assert res.exit_code == 0, res.output
    assert cli("new", path).exit_code == 2          # no silent overwrite
    res, data = try_json(path, "--no-time")
    assert res.exit_code == 0, res.output
    assert data["compile"] and all(r["registers"] > 0 for r in data["compile"])
    assert all(r["code_bytes"] > 0 and r["code_bytes"] % 16 == 0 for r in data["compile"])
    inst = uk.load_kernel(str(path)).instance()
    builtin = {"split": 36864, "batched": 93280, "mma16": 188608, "mma32": 229760}[template]
    assert inst.smem_bytes == builtin   # the header's formula is the registry's


def test_try_reports_a_syntax_error_at_its_line(tmp_path):
    lines = CORRECT.read_text().splitlines()
    no = next(i for i, ln in enumerate(lines, 1) if "float m = -INFINITY" in ln)
    lines[no - 1] = lines[no - 1].replace(";", " oops;", 1)
    p = tmp_path / "syntax.cu"
    p.write_text("\n".join(lines))
    res, data = try_json(p)
    assert res.exit_code == 1
    assert f"syntax.cu:{no}: error" in data["error"] and "oops" in data["error"]


def test_try_bad_header_is_a_usage_error(tmp_path):
    p = tmp_path / "hdr.cu"
    p.write_text(CORRECT.read_text().replace("tile_rows=32", "tile_row=32"))
    res, data = try_json(p)
    assert res.exit_code == 2 and "unknown field 'tile_row'" in data["error"]
    assert cli("try", tmp_path / "none.cu").exit_code == 2


def test_too_small_smem_fails_at_compile(tmp_path):
    p = tmp_path / "small.cu"
    cli("new", p, "--from", "split")
    text = p.read_text().replace("smem=TILE_ROWS*KEY_DIM*2", "smem=TILE_ROWS*KEY_DIM")
    p.write_text(text)
    res, data = try_json(p)
    assert res.exit_code == 1
    assert "needs more dynamic shared memory" in data["error"]
    assert "18432 B" in data["error"]            # what the header declared


@pytest.mark.parametrize("old, new, said", [
    ("int n_rows, int n_head", "float n_rows, int n_head",
     "argument 5 of the entry must be int n_rows"),
    # the last argument too: every one of the 21 is checked, not a prefix
    ("float* latent, float* lse)", "float* latent, int* lse)",
     "argument 21 of the entry must be float* lse"),
    # one argument more than the contract
    ("float* latent, float* lse)", "float* latent, float* lse, int extra)",
     "the entry must be a __global__ void function of the 21 arguments"),
], ids=["first-int", "last", "extra"])
def test_signature_off_the_contract_fails_at_compile(tmp_path, old, new, said):
    p = tmp_path / "sig.cu"
    text = CORRECT.read_text()
    assert old in text
    p.write_text(text.replace(old, new))
    res, data = try_json(p)
    assert res.exit_code == 1 and said in data["error"], data["error"]


@pytest.mark.parametrize("path", [CORRECT, DATA / "byok_step.cu", *PLANTED], ids=lambda p: p.stem)
def test_test_kernels_compile(path):
    rows = uk.compile_report(uk.load_kernel(str(path)))
    assert rows and all(r.spill_stores == 0 for r in rows)
    assert all(r.code_bytes > 0 and r.code_bytes % 16 == 0 for r in rows)
    if path.stem == "byok_bad_race":   # it stages q in a static float [ROWS][576] (ROWS = 4)
        assert (rows[0].static_smem, rows[0].dynamic_smem) == (4 * 576 * 4, 0)
    else:
        assert all(r.static_smem == 0 for r in rows)


# byok_warp_rows.cu under a 32-register cap (__launch_bounds__ minBlocksPerSM): ptxas spills
SPILLS = DATA / "byok_spills.cu"


@pytest.fixture
def ptxas_logs(monkeypatch):
    """Every (log, lowered names) that compile_report got from NVRTC, as NVRTC printed it:
    the real compile_program, watched."""
    seen = []
    real = uk.compile_program

    def watched(*args, **kw):
        compiled = real(*args, **kw)
        seen.append((compiled.log, compiled.lowered))
        return compiled

    monkeypatch.setattr(uk, "compile_program", watched)
    return seen


def logged_spills(log: str, mangled: str) -> tuple[int, int]:
    """(spill store bytes, spill load bytes) of `mangled` read off the ptxas log by this
    test's own pattern, not by ptxas.parse_ptxas_log: the line after its properties header."""
    m = re.search(rf"Function properties for {re.escape(mangled)}\s*\n\s*ptxas\s+\.\s+"
                  r"\d+ bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                  log)
    assert m, f"no properties line for {mangled} in the ptxas log:\n{log}"
    return int(m.group(1)), int(m.group(2))


def test_a_spilling_kernels_report_has_the_logs_spill_bytes(ptxas_logs):
    """compile_report's spill stores and loads are the ptxas log's for the kernel, each in
    its own field: no other test kernel spills, so a report of 0 spills or of the two
    swapped would pass them all. The byte counts are the compiler's (392/364 from NVRTC
    13.5 for sm_90): read from the log rather than pinned, they need only be nonzero and
    differ."""
    rows = uk.compile_report(uk.load_kernel(str(SPILLS)))
    assert len(rows) == 1 and len(ptxas_logs) == 1
    log, lowered = ptxas_logs[0]
    stores, loads = logged_spills(log, lowered["warp_rows"])
    assert stores > 0 and loads > 0, f"byok_spills.cu no longer spills:\n{log}"
    # the test's power against a swap: equal counts would hide one
    assert stores != loads, f"spill stores = loads = {stores}: a swap would pass\n{log}"
    r = rows[0]
    assert (r.spill_stores, r.spill_loads) == (stores, loads), (r, log)
    assert r.registers <= 32    # ptxas kept the launch bounds' cap


def test_try_shows_the_spills(ptxas_logs, monkeypatch):
    """`try` prints the report's spills as STORES+LOADS B and carries both in its JSON (no
    device: the compile report alone, on any machine)."""
    from mlasandbox import toolkit

    monkeypatch.setattr(toolkit, "device_available", lambda: (False, "the test's: no device"))
    res = cli("try", SPILLS, "--no-time", "--arch", "sm_90")
    assert res.exit_code == 0, res.output
    res_json, data = try_json(SPILLS, "--no-time", "--arch", "sm_90")
    assert res_json.exit_code == 0, res_json.output
    # one compile each: the table's, then the JSON's
    (table_log, lowered), (json_log, _) = ptxas_logs
    stores, loads = logged_spills(table_log, lowered["warp_rows"])
    assert stores > 0 and loads > 0 and stores != loads, table_log
    assert f"{stores}+{loads} B" in res.output, res.output
    (row,) = data["compile"]
    assert ((row["spill_stores"], row["spill_loads"])
            == logged_spills(json_log, lowered["warp_rows"])), row


def test_sweep_marks_the_occupancy_step():
    rows = uk.compile_report(uk.load_kernel(str(CORRECT)), params_override={"ROWS": (4, 8)})
    assert [r.threads for r in rows] == [128, 256]
    assert rows[1].occupancy_step == (rows[0].blocks_per_sm != rows[1].blocks_per_sm)


def test_repro_embeds_the_source(tmp_path):
    out = tmp_path / "r.py"
    res = cli("try", CORRECT, "--no-time", "--repro", out)
    assert res.exit_code == 0, res.output
    text = out.read_text()
    assert "Lane l owns latent columns" in text and "-DMLA_PARAM_ROWS=4" in text
    assert "ATTN = {'source': 'byok_warp_rows.cu', 'expression': 'warp_rows'" in text
    # the script sizes the grid (row blocks, max(target, B), 1) from the plan's target
    plan = re.search(r"^PLAN = (\{.*?\})", text, re.M)
    assert plan and set(eval(plan.group(1))) >= {"max_chunks", "min_chunk", "tile",
                                                 "rows_per_block", "target"}, text[:2000]
    # its values are the plan of this kernel at ROWS=4 (4 rows a block, 32-row tiles) for
    # the script's batch, as the step makes it
    plan = eval(plan.group(1))
    lengths = eval(re.search(r"^LENGTHS = (\(.*?\))", text, re.M).group(1))
    sms, bps = map(int, re.search(r"plan_chunks with (\d+) SMs and (\d+) blocks/SM",
                                  text).groups())
    want = plan_chunks(len(lengths), -(-16 // 4), num_sms=sms, blocks_per_sm=bps, tile=32)
    assert (plan["rows_per_block"], plan["tile"]) == (4, 32)
    assert plan == {"max_chunks": want.max_chunks, "min_chunk": want.min_chunk, "tile": 32,
                    "rows_per_block": 4, "target": want.target,
                    "programs": want.programs_per_block}
    # a user kernel may write partials only: the script's merge takes every request
    assert "'attn_writes_single': 0," in text


def test_includes_resolve_and_keep_line_numbers(tmp_path):
    shutil.copy(CORRECT, tmp_path / CORRECT.name)
    src = uk.expanded_source((DATA / "byok_bad_race.cu").read_text(), "bad.cu", tmp_path)
    assert f'#line 1 "{tmp_path / CORRECT.name}"' in src and '#line 7 "bad.cu"' in src
    assert '#line 1 "mla_walk.cuh"' in src and os.sep not in "mla_walk.cuh"


def test_try_compile_table_shows_each_rows_own_cells():
    """Each cell of `try`'s compile table is its own row's field: the rows' numbers come
    from the same compile report, and ROWS=4 and 8 differ in threads and code size."""
    from mlasandbox.cli.render import fmt_bytes

    rows = uk.compile_report(uk.load_kernel(str(CORRECT)), params_override={"ROWS": (4, 8)})
    assert rows[0].code_bytes != rows[1].code_bytes and rows[0].threads != rows[1].threads
    res = CliRunner(env={"COLUMNS": "200"}).invoke(
        main, ["try", str(CORRECT), "--no-time", "--params", "ROWS=4,8"])
    assert res.exit_code == 0, res.output
    for r in rows:
        params = ",".join(f"{k}={v}" for k, v in r.params.items())
        line = next(ln for ln in res.stdout.splitlines() if f"│ {params} " in ln)
        cells = [c.strip() for c in line.strip().strip("│").split("│")]
        step = "  <- occupancy step" if r.occupancy_step else ""
        assert cells == [params, str(r.registers), "0", fmt_bytes(r.code_bytes),
                         f"{r.static_smem}+{r.dynamic_smem} B", str(r.threads),
                         f"{r.blocks_per_sm}{step}".strip(), r.limiter], line


def test_sweep_table_marks_the_step_and_judges_against_the_floor():
    """The timing table of `try` from a bench result (synthetic numbers: the table's logic,
    not a measurement): graph replay wins over events, the verdict uses the A/A floor."""
    from rich.console import Console

    from mlasandbox.cli.try_cmd import _sweep_table

    k = uk.load_kernel(str(CORRECT))
    rows = uk.compile_report(k, params_override={"ROWS": (4, 8)})
    n4, n8 = (k.with_params(r.params).name for r in rows)

    def row(v, phase, us, kind="variant"):
        return {"variant": v, "phase": phase, "median_us": us, "kind": kind, "GBps_ideal": 1e3}

    res = {"config": {"variants": [n4, n8, "mma16"]}, "noise_floor": {"floor": 0.02},
           "control": {}, "rows": [row(n4, "step", 99.0), row(n4, "graph", 50.0),
                                   row(n8, "graph", 100.5), row("mma16", "graph", 100.0),
                                   row("flashmla", "step", 80.0, "peer")]}
    con = Console(width=200, record=True)
    con.print(_sweep_table(k, rows, res))
    text = con.export_text()
    assert "2.00x faster" in text                    # n4: graph 50 us, not events 99 us
    assert "no measurable difference" in text        # n8: 0.5% < the 2% floor
    assert "flashmla" in text and "1.25x faster" in text
    assert ("<- occupancy step" in text) == rows[1].occupancy_step


def test_try_bad_params_are_usage_errors():
    assert cli("try", CORRECT, "--params", "ROWS=x").exit_code == 2
    for bad in (("--heads", "0"), ("--ctx", "-1"), ("--arch", "compute_90"), ("--arch", "sm_70"),
                ("--lengths", "4,5")):
        res = cli("try", CORRECT, *bad)
        assert res.exit_code == 2 and bad[0] in res.output, (bad, res.output)
    res = cli("try", CORRECT, "--params", "HPB=4")
    assert res.exit_code == 2 and "declares no parameter HPB" in res.output
    # one name twice would keep only its last values; a value twice would compile twice
    res = cli("try", CORRECT, "--params", "ROWS=4", "--params", "ROWS=8")
    assert res.exit_code == 2 and "--params ROWS is given more than once" in res.output
    res = cli("try", CORRECT, "--params", "ROWS=8,4,8")
    assert res.exit_code == 2 and "ROWS=8 is given twice" in res.output


def test_watch_reruns_on_a_save(tmp_path):
    """--watch's loop: a run per change of the file; a broken save reports its error and
    the loop goes on (two rounds here; the command runs until Ctrl-C)."""
    import threading
    import time

    from mlasandbox.cli.try_cmd import _watch

    p = tmp_path / "w.cu"
    p.write_text(CORRECT.read_text())
    said = []
    opts = {"params": {}, "heads": None, "ctx": None, "batch": None, "lengths": None,
            "lengths_spec": None, "sanitize": False, "repro": None, "time": False,
            "repeats": 20, "seed": 0, "arch": "sm_90", "fast": True, "quiet": True}

    def save_broken():
        time.sleep(1.0)
        p.write_text(CORRECT.read_text().replace("float m = -INFINITY", "float m = -INFINITY x"))
        os.utime(p, (time.time() + 5, time.time() + 5))

    threading.Thread(target=save_broken).start()
    _watch(str(p), opts, said.append, rounds=2, poll_s=0.1)
    verdicts = [s for s in said if not s.startswith("---")]
    assert len([s for s in said if s.startswith("---")]) == 2
    assert verdicts[-1].startswith("error: compile: ") and "w.cu:" in verdicts[-1]


def test_the_bench_holds_a_user_kernel_to_the_cuda_tolerance():
    from mlasandbox.bench_gpu import tolerance_for
    from mlasandbox.compare import DEFAULT_TOLERANCE

    assert tolerance_for(f"{CORRECT}:ROWS=8", "f16") == DEFAULT_TOLERANCE
    assert tolerance_for("cublas", "f16") != DEFAULT_TOLERANCE
