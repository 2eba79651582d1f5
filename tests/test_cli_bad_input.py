"""Bad input the commands must refuse (exit 2, the option named, nothing written or run): an
output that would overwrite an input or another output, seeds and times numpy or the
timer cannot take, '-' where no stdout is offered, options a path would ignore, and lists
that name nothing or name a value twice."""
from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from mlasandbox import bench_gpu, schedule, toolkit
from mlasandbox.cli.main import main
from mlasandbox.cli.options import str_list

KERNEL_TEXT = "// a user's kernel: the command must never write over it\n"
LENGTHS_TEXT = "5\n7\n"


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def words(res) -> str:
    return " ".join(res.stderr.split())


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    """Every test in a directory of its own: a command that should have refused its input
    but wrote a default-named file writes it there."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def files(tmp_path):
    """A kernel file, a lengths file, a saved bench run and ncu pages, in the current
    directory."""
    (tmp_path / "k.cu").write_text(KERNEL_TEXT)
    (tmp_path / "L.txt").write_text(LENGTHS_TEXT)
    (tmp_path / "base.json").write_text("{}\n")
    (tmp_path / "prof.csv").write_text("ncu,source,page\n")
    (tmp_path / "saved").mkdir()
    (tmp_path / "saved" / "source.csv").write_text("ncu,source,page\n")
    return tmp_path


def _snapshot(d):
    return {p: p.read_bytes() for p in d.rglob("*") if p.is_file()}


# ---------------------------------------------------------------- A1: outputs over inputs

LENGTHS_INTO_JSON = ("--batch", "2", "--lengths", "@L.txt", "--json", "L.txt")
OVERWRITES = [
    # (arguments, the output option named, what it would have overwritten)
    (("try", "k.cu", "--repro", "k.cu"), "--repro", "FILE"),
    (("try", "k.cu", "--json", "k.cu"), "--json", "FILE"),
    (("try", "k.cu", "--repro", "base.json", "--json", "base.json"), "--json", "--repro"),
    (("new", "k", "--force", "--json", "k.cu"), "--json", "NAME"),
    (("repro", "--variant", "split", "-o", "base.json", "--json", "base.json"), "--json",
     "--output"),
    (("repro", "--variant", "split", "--batch", "2", "--lengths", "@L.txt", "-o", "L.txt"),
     "--output", "--lengths"),
    (("bench", "--batch", "2", "--variants", "split,k.cu", "--json", "k.cu"), "--json",
     "--variants"),
    (("bench", "--vs", "base.json", "--json", "base.json"), "--json", "--vs"),
    (("bench", "--json", "base.json", "--csv", "base.json"), "--csv", "--json"),
    (("bench", "--csv", "base.json", "--plot", "base.json"), "--plot", "--csv"),
    (("stalls", "--from", "prof.csv", "--json", "prof.csv"), "--json", "--from"),
    (("stalls", "--from", "saved", "--json", "saved/source.csv"), "--json", "--from"),
    (("stalls", "--save", "saved", "--json", "saved/source.csv"), "--save", "--json"),
    *(((*cmd, *LENGTHS_INTO_JSON), "--json", "--lengths") for cmd in (
        ("try", "k.cu"), ("repro", "--variant", "split"), ("bench",), ("sweep",), ("ablate",),
        ("stalls",))),
]


@pytest.mark.parametrize("args, opt, other", OVERWRITES, ids=lambda a: " ".join(a)
                         if isinstance(a, tuple) else None)
def test_an_output_never_overwrites_an_input_or_another_output(files, args, opt, other):
    before = _snapshot(files)
    res = run(*args)
    assert res.exit_code == 2, res.output
    assert f"Invalid value for '{opt}'" in words(res) and other in words(res), res.output
    assert "give another path" in words(res)
    assert _snapshot(files) == before  # every file as it was, none added


INCLUDING = ('#include "mla_user.cuh"\n#include "inc/helpers.cuh"\n'
             "// the kernel: its includes are the user's files too\n")


@pytest.mark.parametrize("args, opt", [
    (("try", "k2.cu", "--repro", "inc/helpers.cuh"), "--repro"),
    (("try", "k2.cu", "--json", "inc/deeper.cuh"), "--json"),
    (("bench", "--batch", "2", "--variants", "k2.cu:X=1", "--csv", "inc/deeper.cuh"), "--csv"),
], ids=["try-repro-include", "try-json-nested-include", "bench-csv-nested-include"])
def test_an_output_never_overwrites_a_file_the_kernel_includes(files, args, opt):
    (files / "inc").mkdir()
    (files / "k2.cu").write_text(INCLUDING)
    (files / "inc" / "helpers.cuh").write_text('#include "deeper.cuh"\n')  # from inc/
    (files / "inc" / "deeper.cuh").write_text("// nested\n")
    before = _snapshot(files)
    res = run(*args)
    assert res.exit_code == 2, res.output
    assert f"Invalid value for '{opt}'" in words(res) and "(#include)" in words(res)
    assert _snapshot(files) == before


def test_a_package_header_the_kernel_includes_is_not_an_input(files):
    # control: mla_user.cuh is the package's header, not a file of the user's folder, so an
    # output of that name here is refused for nothing (the command goes on, to its no-GPU exit)
    (files / "k2.cu").write_text('#include "mla_user.cuh"\n')
    res = run("bench", "--batch", "2", "--variants", "k2.cu", "--json", "mla_user.cuh")
    assert "(#include)" not in words(res) and "give another path" not in words(res), res.output


def test_the_same_file_under_another_name_is_the_same_file(files):
    os.link(files / "L.txt", files / "hard.txt")
    os.symlink(files / "L.txt", files / "soft.txt")
    for lengths, out in (("@hard.txt", "L.txt"), ("@soft.txt", "./L.txt"),
                         ("@L.txt", str(files / "soft.txt"))):
        res = run("bench", "--batch", "2", "--lengths", lengths, "--json", out)
        assert res.exit_code == 2 and "'--json'" in words(res), (lengths, out, res.output)
    assert (files / "L.txt").read_text() == LENGTHS_TEXT


def test_repro_checks_its_default_script_name_too(files):
    # the name repro builds for the case, when -o is not given
    name = "repro_split_H96_f16_qf32_n100.py"
    (files / name).write_text("# the user's\n")
    res = run("repro", "--variant", "split", "--ctx", "100", "--blocks-per-sm", "2",
              "--json", name)
    assert res.exit_code == 2 and "'--json'" in words(res) and name in words(res)
    assert (files / name).read_text() == "# the user's\n"


def test_the_overwrite_error_is_a_json_error_object(files):
    res = run("try", "k.cu", "--repro", "k.cu", "--json")
    assert res.exit_code == 2
    data = json.loads(res.stdout)
    assert data["ok"] is False and "'--repro'" in data["error"]
    assert (files / "k.cu").read_text() == KERNEL_TEXT


# ---------------------------------------------------------------- A2: --seed

SEED_COMMANDS = [
    ("bench",), ("bench", "--batch", "2"), ("sweep", "--no-gpu"), ("repro", "--variant", "split"),
    ("repro", "--variant", "split", "--batch", "2"), ("try", "k.cu"), ("stalls",), ("ablate",),
    # the seed draws these lengths: it is checked first, by name
    ("bench", "--batch", "2", "--lengths", "normal:100:10"),
]


@pytest.mark.parametrize("cmd", SEED_COMMANDS, ids=" ".join)
@pytest.mark.parametrize("seed", ["-1", str(2**63)])
def test_seed_is_checked_when_parsed(files, cmd, seed):
    before = _snapshot(files)
    res = run(*cmd, "--seed", seed, "-o" if cmd[0] == "repro" else "--json",
              "out.py" if cmd[0] == "repro" else "out.json")
    assert res.exit_code == 2, res.output
    assert "Invalid value for '--seed'" in words(res) and "9223372036854775807" in words(res)
    assert _snapshot(files) == before


def test_the_largest_seed_is_taken(files):
    res = run("repro", "--variant", "split", "--ctx", "100", "--blocks-per-sm", "2",
              "--seed", str(2**63 - 1), "-o", "r.py", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["seed"] == 2**63 - 1


# ---------------------------------------------------------------- A3: finite floats

@pytest.mark.parametrize("args", [
    ("bench", "--target-ms", "nan"), ("bench", "--target-ms", "inf"),
    ("bench", "--budget-s", "nan"), ("bench", "--budget-s", "inf"),
    ("sweep", "--no-gpu", "--target-ms", "nan"),
    ("bench", "--batch", "2", "--target-ms", "nan"),
], ids=" ".join)
def test_times_and_budgets_must_be_finite(args):
    res = run(*args)
    assert res.exit_code == 2, res.output
    assert f"Invalid value for '{args[-2]}'" in words(res) and "not a finite number" in words(res)


# ---------------------------------------------------------------- A5: what --tp would ignore

@pytest.mark.parametrize("extra, named", [
    (("--csv", "t.csv"), "--csv"), (("--explain",), "--explain"),
    (("--peers", "flashmla"), "--peers"), (("--no-check",), "--check/--no-check"),
    (("--target-ms", "50"), "--target-ms"), (("--aa-rounds", "3"), "--aa-rounds"),
], ids=lambda x: x[0] if isinstance(x, tuple) else None)
def test_the_tensor_parallel_bench_refuses_what_it_would_ignore(files, extra, named):
    res = run("bench", "--batch", "2", "--tp", "2", *extra)
    assert res.exit_code == 2, res.output
    assert f"{named} is not taken with --tp" in words(res)
    assert not (files / "t.csv").exists()


# ---------------------------------------------------------------- A7: '-' is not a file

@pytest.mark.parametrize("args, opt", [
    (("repro", "--variant", "split", "-o", "-"), "'-o' / '--output'"),
    (("try", "k.cu", "--repro", "-"), "'--repro'"),
    (("bench", "--csv", "-"), "'--csv'"),
])
def test_dash_is_refused_where_no_stdout_is_offered(files, args, opt):
    res = run(*args)
    assert res.exit_code == 2 and f"Invalid value for {opt}" in words(res), res.output
    assert "(stdout) is not taken here" in words(res)
    assert not (files / "-").exists()


# ---------------------------------------------------------------- D18, D19: messages

def test_bench_hpb_names_the_option():
    res = run("bench", "--hpb", "0")
    assert res.exit_code == 2 and "Invalid value for '--hpb'" in words(res)
    assert "among 1, 2, 4, 8, 12, 16, 24" in words(res)


@pytest.mark.parametrize("opt", ["--variants", "--peers"])
def test_an_empty_list_says_so(opt):
    res = run("bench", "--batch", "2", opt, "")
    assert res.exit_code == 2 and f"Invalid value for '{opt}'" in words(res)
    assert "give at least one value" in words(res) and "nothing not among" not in words(res)


def test_a_user_kernels_parameters_are_colon_separated(files):
    res = run("bench", "--batch", "2", "--variants", "k.cu:ROWS=4,ROWS=8")
    assert res.exit_code == 2 and "Invalid value for '--variants'" in words(res)
    assert "ROWS=8 is not a variant" in words(res) and "colon-separated" in words(res)
    assert "k.cu:ROWS=4,k.cu:ROWS=8" not in words(res)  # the hint is generic: FILE.cu
    assert "FILE.cu:NAME=4,FILE.cu:NAME=8" in words(res)


def test_a_list_names_each_value_once():
    assert str_list(("f16", "bf16"))(None, None, "f16, bf16,f16") == ("f16", "bf16")
    assert str_list(("a",), user_kernels=True)(None, None, "k.cu,a,k.cu") == ("k.cu", "a")


# ---------------------------------------------------------------- D20: check --splits

def _study_reached(monkeypatch):
    reached = []

    def study(n_ctxs, seeds, splits="auto", **kw):
        reached.append(splits)
        return [schedule.AccuracyRow(n_ctx=n, seed=s, splits=splits, unsplit=2e-6,
                                     split=1e-6, split_no_rescale=0.4)
                for n in n_ctxs for s in seeds]

    monkeypatch.setattr(schedule, "accuracy_study", study)
    return reached


@pytest.mark.parametrize("splits", ["65535", "4096", "2048", "1366"])
def test_check_refuses_slices_too_short_to_judge(monkeypatch, splits):
    # 1366 slices of 4096 positions hold 3 each, 1365 hold 4
    reached = _study_reached(monkeypatch)
    res = run("check", "--no-gpu", "--seeds", "1", "--ctx", "4096", "--splits", splits)
    assert res.exit_code == 2, res.output
    assert f"--splits {splits} leaves slices of fewer than 4 positions at --ctx 4096" \
        in words(res)
    assert "give --splits <= 1365" in words(res) and not reached


def test_check_takes_the_longest_split_it_can_judge(monkeypatch):
    reached = _study_reached(monkeypatch)
    res = run("check", "--no-gpu", "--seeds", "1", "--ctx", "4096", "--splits", "1365")
    assert res.exit_code == 0, res.output
    assert reached == [1365]


def test_check_short_contexts_that_cannot_split_into_slices_of_four(monkeypatch):
    reached = _study_reached(monkeypatch)
    res = run("check", "--no-gpu", "--seeds", "1", "--ctx", "5,4096", "--splits", "2")
    assert res.exit_code == 2 and "at --ctx 5:" in words(res)
    assert "leave out the contexts under 7 positions" in words(res) and not reached


# ---------------------------------------------------------------- E: options not ignored

@pytest.mark.parametrize("args, named", [
    (("bench", "--tp-engine", "torch"), "--tp-engine needs --tp N"),
    (("bench", "--batch", "2", "--tp-engine", "cupy"), "--tp-engine needs --tp N"),
    (("bench", "--batch", "2", "--arch", "sm_80"), "--arch belongs to the depth bench"),
    (("bench", "--batch", "2", "--details"), "--details belongs to the depth bench"),
    (("bench", "--page-size", "16"), "--page-size needs --batch B"),
    (("sweep", "--no-gpu", "--page-size", "16"), "--page-size needs --batch B"),
    (("ablate", "--page-size", "16"), "--page-size needs --batch B"),
    (("stalls", "--page-size", "16"), "--page-size needs --batch B"),
    (("repro", "--variant", "split", "--page-size", "16"), "--page-size needs --batch B"),
], ids=lambda a: " ".join(a) if isinstance(a, tuple) else None)
def test_an_option_the_path_would_ignore_is_refused(files, args, named):
    before = _snapshot(files)
    res = run(*args)
    assert res.exit_code == 2 and named in words(res), res.output
    assert _snapshot(files) == before


@pytest.mark.parametrize("extra, named", [
    (("--variant", "mma16"), "--variant"), (("--batch", "2"), "--batch"),
    (("--ncu", "/bin/false"), "--ncu"), (("--save", "out"), "--save"),
    (("--seed", "3"), "--seed"),
])
def test_stalls_from_a_saved_profile_refuses_the_profiling_options(files, extra, named):
    res = run("stalls", "--from", "prof.csv", *extra)
    assert res.exit_code == 2, res.output
    assert named in words(res) and "--from reads a saved one" in words(res)
    assert not (files / "out").exists()


@pytest.fixture
def no_run(monkeypatch):
    from mlasandbox.cli import try_cmd

    def must_not_run(*a, **k):
        raise AssertionError("the kernel was compiled or run")

    monkeypatch.setattr(try_cmd, "_run", must_not_run)


def test_try_sanitize_without_a_gpu_is_not_a_pass(files, monkeypatch, no_run):
    monkeypatch.setattr(toolkit, "device_available", lambda: (False, "no CUDA device: planted"))
    res = run("try", "k.cu", "--sanitize", "--no-time")
    assert res.exit_code == 2, res.output
    assert "--sanitize runs the kernel under compute-sanitizer on a GPU" in words(res)
    assert "planted" in words(res)


def test_try_sanitize_without_compute_sanitizer_is_not_a_failure(files, monkeypatch, no_run):
    from mlasandbox import battery

    monkeypatch.setattr(toolkit, "device_available", lambda: (True, "device 0: planted"))
    monkeypatch.setattr(battery, "sanitizer_path", lambda: None)
    res = run("try", "k.cu", "--sanitize", "--no-time")
    assert res.exit_code == 2, res.output
    assert "--sanitize: compute-sanitizer is not installed here" in words(res)


def test_bench_variants_with_hpb_times_both(monkeypatch):
    """--hpb with --variants adds its batched variants to those named (split stays), and a
    cache named twice is timed once."""
    from lab_fakes import FakeBackend

    monkeypatch.setattr(toolkit, "device_available", lambda: (True, "device 0: Fake H200"))
    monkeypatch.setattr(bench_gpu, "CupyBackend", lambda *a, **k: FakeBackend(*a, **k))
    res = run("bench", "--ctx", "64", "--variants", "split", "--hpb", "16", "--cache",
              "f16,f16", "--no-check", "--aa-rounds", "2", "--json")
    assert res.exit_code == 0, res.output
    cfg = json.loads(res.stdout)["config"]
    assert cfg["variants"] == ["split", "batched16"] and cfg["cache_dtypes"] == ["f16"]


@pytest.mark.parametrize("cmd, opt", [
    (("check", "--no-gpu"), "--ctx"),
    (("grid", "--variant", "split", "--heads", "16", "--blocks-per-sm", "2"), "--ctx"),
    (("repro", "--variant", "split", "-o", "r.py"), "--ctx"),
    (("regs", "--no-controls"), "--hpb"),
], ids=lambda v: v if isinstance(v, str) else v[0])
@pytest.mark.parametrize("value", ["4096,,16", "16,", ",16"])
def test_an_integer_list_with_an_empty_item_is_refused(cmd, opt, value):
    # an empty item is a typo, not a value to skip: `--lengths 1,,2` is refused the same way
    value = value.replace("4096", "16") if opt == "--hpb" else value
    res = run(*cmd, opt, value)
    assert res.exit_code == 2 and f"Invalid value for '{opt}'" in words(res), res.output
    assert "has an empty item" in words(res)
    assert not os.path.exists("r.py")


def test_an_integer_too_long_for_python_is_named_briefly():
    res = run("check", "--no-gpu", "--ctx", "9" * 5000)
    assert res.exit_code == 2 and "is not an integer" in words(res)
    assert "9" * 41 not in words(res)


def test_repro_refuses_an_empty_lengths_spec():
    # an empty --lengths is a spec like any other (bench refuses it), not "use the default"
    res = run("repro", "--variant", "split", "--batch", "4", "--lengths", "", "-o", "r.py")
    assert res.exit_code == 2 and "lengths (--lengths) ''" in words(res), res.output
    assert not os.path.exists("r.py")


@pytest.mark.parametrize("cmd", [
    ("grid", "--variant", "split", "--heads", "16", "--ctx", "4096"),
    ("repro", "--variant", "split", "-o", "r.py"),
], ids=lambda c: c[0])
def test_blocks_per_sm_past_any_arch_is_refused(cmd):
    # sm_80 .. sm_100 keep at most 32 blocks resident on an SM: 33 plans waves no device runs
    res = run(*cmd, "--blocks-per-sm", "33")
    assert res.exit_code == 2 and "Invalid value for '--blocks-per-sm'" in words(res)
    assert "from 1 to 32" in words(res) and "got 33" in words(res)
    assert not os.path.exists("r.py")
    assert run(*cmd, "--blocks-per-sm", "32").exit_code in (0, 1), "32 is a real count"


def test_stalls_save_under_a_missing_directory_names_that_directory(tmp_path):
    # the directory that is missing, not the first one above it that exists
    missing = tmp_path / "no" / "such"
    res = run("stalls", "--save", missing / "prof")
    assert res.exit_code == 2 and "Invalid value for '--save'" in words(res)
    assert f"directory {str(missing)!r} does not exist" in words(res), res.output
    assert not missing.exists()


@pytest.mark.parametrize("cmd, opt, value, bound", [
    (("bench",), "--warmup", "999999999999", "1<=x<=100000"),
    (("bench",), "--repeats", "100001", "1<=x<=100000"),
    (("bench",), "--min-repeats", "100001", "1<=x<=100000"),
    (("bench",), "--aa-rounds", "1001", "2<=x<=1000"),
    (("sweep",), "--repeats", "100001", "1<=x<=100000"),
], ids=lambda v: v if isinstance(v, str) else v[0])
def test_run_counts_past_hours_of_gpu_time_are_refused(cmd, opt, value, bound):
    # a typo of a few digits would otherwise hold the GPU for days, on a GPU only
    res = run(*cmd, opt, value)
    assert res.exit_code == 2 and f"Invalid value for '{opt}'" in words(res), res.output
    assert bound in words(res)


def test_check_refuses_variants_it_would_not_check():
    # --no-gpu runs the CPU model alone: a --variants beside it would be ignored
    res = run("check", "--no-gpu", "--variants", "split", "--ctx", "4096", "--seeds", "1")
    assert res.exit_code == 2 and "--variants" in words(res) and "--no-gpu" in words(res)
    assert run("check", "--no-gpu", "--ctx", "4096", "--seeds", "1").exit_code == 0


# ---------------------------------------------------------------- outputs, counts, the console

def test_an_output_that_is_a_dangling_link_is_judged_by_its_target(tmp_path):
    # exists() is False for a link to nowhere: the checks passed and the write failed (exit 1)
    os.symlink(tmp_path / "no" / "where", "dang.json")
    os.symlink(tmp_path / "no" / "where", "dang.cu")
    for cmd in (("grid", "--variant", "split", "--heads", "16", "--ctx", "4096",
                 "--blocks-per-sm", "2", "--json", "dang.json"),
                ("repro", "--variant", "split", "--ctx", "4096", "-o", "dang.json"),
                ("new", "dang")):
        res = run(*cmd)
        assert res.exit_code == 2, (cmd, res.output)
        assert "is a link to" in words(res) and "does not exist" in words(res), cmd
    os.symlink(tmp_path / "target.json", "good.json")   # a link to a file it may create
    res = run("grid", "--variant", "split", "--heads", "16", "--ctx", "4096",
              "--blocks-per-sm", "2", "--json", "good.json")
    assert res.exit_code == 0 and json.loads((tmp_path / "target.json").read_text())["ok"]


def test_repro_checks_its_default_script_name():
    os.mkdir("repro_split_H96_f16_qf32_n4096.py")   # the name repro would pick
    res = run("repro", "--variant", "split", "--ctx", "4096")
    assert res.exit_code == 2
    assert ("the script's path: 'repro_split_H96_f16_qf32_n4096.py' is a directory; give "
            "another with -o FILE") in words(res)


@pytest.mark.parametrize("args, phrase", [
    (("check", "--no-gpu", "--seeds", "1001"), "1<=x<=1000"),
    (("check", "--no-gpu", "--ctx", ",".join(["4096"] * 257)), "at most 256 context lengths"),
    (("ablate", "--rounds", "1001"), "2<=x<=1000"),
])
def test_counts_that_would_run_for_days_are_refused(args, phrase):
    # check --seeds 10**12 ran out of memory in the study (a traceback); 10**6 ran on
    res = run(*args)
    assert res.exit_code == 2 and phrase in words(res), res.output


def test_watch_takes_no_json():
    with open("k.cu", "w") as f:
        f.write("// not compiled: refused before\n")
    for json_arg in (("--json",), ("--json", "w.json")):
        res = run("try", "k.cu", "--watch", *json_arg)
        assert res.exit_code == 2 and "it takes no --json" in words(res), res.output
    assert not os.path.exists("w.json")


def test_watch_waits_out_a_file_saved_by_rename(monkeypatch):
    # an editor that saves by rename leaves no file for a moment: the poll waits for it
    from mlasandbox.cli import try_cmd

    times = iter([FileNotFoundError("gone"), 5.0])

    def getmtime(path):
        t = next(times)
        if isinstance(t, Exception):
            raise t
        return t

    monkeypatch.setattr(try_cmd.os.path, "getmtime", getmtime)
    monkeypatch.setattr(try_cmd, "_run", lambda file, opts, say: {"ok": True, "skipped": True})
    said = []
    try_cmd._watch("k.cu", {}, said.append, rounds=1, poll_s=0.0)
    assert said[-1] == "compiled; nothing checked on a GPU" and len(said) == 2


@pytest.mark.parametrize("columns", ["0", "1", "abc"])
def test_a_columns_too_narrow_to_print_in_is_ignored(columns):
    # rich printed nothing at COLUMNS=0 (exit 0) and a character a line at 1
    res = CliRunner(env={"COLUMNS": columns}).invoke(main, ["grid", "--variant", "split",
                                                           "--heads", "16", "--ctx", "4096",
                                                           "--blocks-per-sm", "2"])
    assert res.exit_code == 0 and "tile-steps (critical path)" in res.stdout, res.output


def test_an_aa_context_past_the_split_gate_names_the_option():
    # click bounds --aa-ctx below (>= 1); the split gate above it is the library's rule
    res = run("bench", "--aa-ctx", "99999")
    assert res.exit_code == 2, res.output
    assert "the A/A context (aa_context, --aa-ctx) must be below the split gate" in words(res)
