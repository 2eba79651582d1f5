"""Every bad input: exit 2 with a message naming the parameter and the limit, before any work.

Each case runs the real command through CliRunner; the ones that would compile or time
something first (sweep, stalls) are checked not to start that work.
"""
from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
import pytest
from click.testing import CliRunner

from mlasandbox import limits, reference
from mlasandbox.archs import ARCH_NAMES
from mlasandbox.cli.main import main
from mlasandbox.dims import Dims, check_inputs
from mlasandbox.inputs import make_inputs
from mlasandbox.splits import SPLIT_MIN_CTX


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def words(res) -> str:
    return " ".join(res.stderr.split())


def unwritable_dir(tmp_path) -> str:
    """A directory that takes no new file: chmod'ed for a user, /sys for root (whom file
    modes do not stop)."""
    if os.geteuid() != 0:
        d = tmp_path / "ro"
        d.mkdir()
        d.chmod(0o500)
        return str(d)
    if not os.path.isdir("/sys") or os.access("/sys", os.W_OK) and _writable("/sys"):
        pytest.skip("no directory here refuses a new file to root")
    return "/sys"


def _writable(d) -> bool:
    try:
        open(os.path.join(d, ".probe"), "w").close()
    except OSError:
        return False
    os.unlink(os.path.join(d, ".probe"))
    return True


# ---------------------------------------------------------------------------- arch

ARCH_LIMIT = f"--arch must be one of {', '.join(ARCH_NAMES)}"
ARCH_COMMANDS = [
    ("regs",), ("sweep", "--no-gpu"), ("bench",),
    ("grid", "--variant", "split", "--heads", "8", "--ctx", "10"),
    ("repro", "--variant", "split"),
]


@pytest.mark.parametrize("cmd", ARCH_COMMANDS, ids=lambda c: c[0])
@pytest.mark.parametrize("arch", ["sm_12", "sm_90a", "compute_90"])
def test_every_command_rejects_an_unknown_arch_the_same_way(cmd, arch):
    res = run(*cmd, "--arch", arch)
    assert res.exit_code == 2, res.output
    assert ARCH_LIMIT in words(res) and repr(arch) in words(res)
    assert "NVRTC" not in res.output and "Traceback" not in res.output


def test_regs_on_an_older_arch_says_which_kernel_needs_sm_90_and_prints_the_rest():
    res = run("regs", "--arch", "sm_80", "--cache", "f16", "--q", "f32", "--json")
    assert res.exit_code == 0, res.output
    rows = {r["name"]: r for r in json.loads(res.stdout)["rows"]}
    assert rows["attn_tiled<heads=16,cache=f16,q=f32>"]["needs"] == "sm_90"
    others = [r for n, r in rows.items() if not n.startswith("attn_tiled")]
    assert others and all(r["registers"] > 0 for r in others)


def test_grid_of_a_kernel_the_arch_cannot_build():
    res = run("grid", "--variant", "tiled16", "--heads", "16", "--ctx", "4096", "--arch",
              "sm_86")
    assert res.exit_code == 2 and "tiled16 needs sm_90" in words(res)


# ---------------------------------------------------------------------------- output paths

def _output_cases(tmp_path):
    ro = unwritable_dir(tmp_path)
    return [("/nonexistent_dir/x.py", "directory '/nonexistent_dir' does not exist"),
            (os.path.join(ro, "x.py"), f"directory {ro!r} does not take new files"),
            ("/dev/full", "'/dev/full' is not a regular file"),
            (str(tmp_path), "is a directory")]


@pytest.mark.parametrize("case", range(4))
def test_repro_output_path_is_checked(tmp_path, case):
    path, msg = _output_cases(tmp_path)[case]
    res = run("repro", "--variant", "split", "--blocks-per-sm", "2", "-o", path)
    assert res.exit_code == 2 and "'-o' / '--output'" in words(res) and msg in words(res)


@pytest.mark.parametrize("case", range(4))
def test_json_file_is_checked_before_any_work(tmp_path, case, monkeypatch):
    from mlasandbox.cli import sweep_cmd

    path, msg = _output_cases(tmp_path)[case]
    monkeypatch.setattr(sweep_cmd, "_run_sweep", lambda **k: pytest.fail("sweep ran"))
    res = run("sweep", "--no-gpu", "--json", path)
    assert res.exit_code == 2 and "'--json'" in words(res) and msg in words(res)


def test_stalls_json_file_is_checked_before_reading(tmp_path):
    res = run("stalls", "--from", tmp_path / "absent.csv", "--json", "/nonexistent/x.json")
    assert res.exit_code == 2 and "directory '/nonexistent' does not exist" in words(res)


@pytest.mark.parametrize("opt", ["--csv", "--plot"])
def test_bench_output_files_are_checked(opt):
    res = run("bench", opt, "/nonexistent_dir/b.out")
    assert res.exit_code == 2 and f"'{opt}'" in words(res) and "does not exist" in words(res)


def test_stalls_from_a_file_that_is_not_gzip(tmp_path):
    bad = tmp_path / "x.csv.gz"
    bad.write_text("Address,Source\n")
    res = run("stalls", "--from", bad)
    assert res.exit_code == 2 and "'--from'" in words(res)
    assert "is not a gzip-compressed ncu CSV" in words(res)


# ---------------------------------------------------------------------------- limits

HUGE = "99999999999999999999999"


@pytest.mark.parametrize("cmd", [
    ("grid", "--variant", "split", "--heads", "8", "--blocks-per-sm", "2", "--ctx", HUGE),
    ("repro", "--variant", "split", "--ctx", HUGE),
    ("check", "--ctx", "99999999999"),
    ("sweep", "--no-gpu", "--ctx", HUGE),
    ("bench", "--ctx", HUGE),
], ids=lambda c: c[0])
def test_contexts_past_the_int32_limit(cmd):
    res = run(*cmd)
    assert res.exit_code == 2, res.output
    assert "'--ctx'" in words(res) and f"<= {limits.MAX_CTX:,}" in words(res)
    assert "int32" in words(res)


@pytest.mark.parametrize("cmd", [
    ("grid", "--variant", "split", "--ctx", "10", "--blocks-per-sm", "2"),
    ("repro", "--variant", "split"),
], ids=lambda c: c[0])
def test_heads_past_the_int32_limit(cmd):
    res = run(*cmd, "--heads", "99999999999")
    assert res.exit_code == 2 and "'--heads'" in words(res)
    # int32 less 64: room for a block's rows past the last head (MAX_HEADS)
    assert limits.MAX_HEADS == 2**31 - 1 - 64 and "<= 2,147,483,583" in words(res)


@pytest.mark.parametrize("cmd", [
    ("grid", "--variant", "split", "--heads", "8", "--ctx", "10", "--blocks-per-sm", "2"),
    ("repro", "--variant", "split"), ("check", "--ctx", "4096"),
], ids=lambda c: c[0])
def test_splits_past_the_grid_limit(cmd):
    res = run(*cmd, "--splits", "100000")
    assert res.exit_code == 2 and "'--splits'" in words(res)
    assert "<= 65,535" in words(res) and "grid's y dimension" in words(res)


@pytest.mark.parametrize("args, hint", [
    (("--ctx", "1,100"), f"at least {SPLIT_MIN_CTX} positions"),
    (("--ctx", "1", "--splits", "4"), "at least 2 positions")])
def test_check_contexts_that_no_split_reaches(args, hint):
    # every row unsplit (or split with one non-empty slice): the negative control could
    # not run, so the study could only report "no power": bad input, named up front
    res = run("check", "--no-gpu", *args)
    assert res.exit_code == 2 and "--ctx: no context splits" in words(res), res.output
    assert hint in words(res)


def test_check_one_split_names_splits():
    # --splits 1 leaves every context unsplit: the option to change is --splits, not --ctx
    res = run("check", "--no-gpu", "--ctx", "4096", "--splits", "1")
    assert res.exit_code == 2 and "--splits 1: one slice is the unsplit walk" in words(res)
    assert "--ctx" not in words(res), res.output


def test_check_context_past_host_memory(monkeypatch):
    # 2e6 rows x (6 x 576 + 12 x 12) B = 7.2 GB, over the 1 GiB this test pretends to have
    monkeypatch.setattr(limits, "host_memory_bytes", lambda: 1 << 30)
    res = run("check", "--ctx", "2000000")
    assert res.exit_code == 2 and "n_ctx 2,000,000 with 12 heads needs about 6.7 GiB" \
        in words(res)
    assert "this machine has 1.0 GiB" in words(res)


def test_the_shared_validation_names_the_callers_parameter():
    with pytest.raises(ValueError, match=r"n_ctx must be <= 2,147,418,113"):
        limits.check_problem(n_ctx=limits.MAX_CTX + 1)
    limits.check_problem(n_ctx=limits.MAX_CTX, n_head=limits.MAX_HEADS,
                         splits=limits.MAX_SPLITS)
    # the kernels' slice length (n_ctx + S - 1) / S stays in int32 at both limits
    assert limits.MAX_CTX + limits.MAX_SPLITS - 1 <= 2**31 - 1
    with pytest.raises(ValueError, match="--splits must be <= 65,535"):
        limits.check_problem(splits=65536, names={"splits": "--splits"})


# ---------------------------------------------------------------------------- conventions

def test_grid_names_the_hpb_limit():
    res = run("grid", "--variant", "batched", "--hpb", "5", "--heads", "16", "--ctx", "4096")
    assert res.exit_code == 2 and "'--hpb'" in words(res)
    assert "among 1, 2, 4, 8, 12, 16, 24" in words(res) and "batched5" not in words(res)


@pytest.mark.parametrize("cmd", [
    ("regs", "--cache", "f32"), ("grid", "--variant", "split"),
    ("sweep", "--ctx", "x"), ("check", "--seeds", "0"), ("repro", "--variant", "nope"),
], ids=lambda c: c[0])
def test_click_errors_print_the_json_error_object(cmd):
    res = run(*cmd, "--json")
    assert res.exit_code == 2
    data = json.loads(res.stdout)
    assert data["ok"] is False and data["error"]


# ---------------------------------------------------------------------------- the library

@pytest.fixture
def args():
    return make_inputs(Dims(n_head=4), 50, seed=1).decode_args()


class FakeTorchTensor:
    """Stands in for torch.Tensor: the check goes by the type's module, never imports torch."""

    __module__ = "torch"
    shape, ndim, dtype = (4, 576), 2, "torch.float16"


@pytest.mark.parametrize("change, exc, match", [
    (lambda a: {"cache": a["cache"][:, :512]}, ValueError,
     r"cache must be \[N_alloc, kv_lora\+rope=576\]"),
    (lambda a: {"wv_b": np.ascontiguousarray(a["wv_b"].transpose(0, 2, 1))}, ValueError,
     r"wv_b must be \[n_head, v_head, kv_lora\].*is it transposed\? .* \(4, 128, 512\)"),
    (lambda a: {"scale": "abc"}, TypeError, "scale must be a real number, got 'abc'"),
    (lambda a: {"chunk_rows": 0}, ValueError, "chunk_rows must be an integer >= 1"),
    (lambda a: {"chunk_rows": -5}, ValueError, "chunk_rows must be an integer >= 1"),
    (lambda a: {"chunk_rows": 2.5}, TypeError, "chunk_rows must be an integer"),
    (lambda a: {"q": FakeTorchTensor()}, TypeError, r"q is a torch tensor.*cupy\.from_dlpack"),
    (lambda a: {"cache": [[0.0] * 576]}, TypeError, "cache must be a NumPy or CuPy array"),
    # a 16-bit q of the other 16-bit dtype: f32 or the cache's own, never a silent mix
    (lambda a: {"q": np.zeros((4, 576), np.uint16).view(ml_dtypes.bfloat16)}, TypeError,
     r"q must be float32 or the cache dtype \(f16\), got bf16"),
])
def test_reference_names_the_parameter(args, change, exc, match):
    args.update(change(args))
    with pytest.raises(exc, match=match):
        reference.decode(**args)


def test_a_cache_too_wide_for_q_blames_q_and_one_too_narrow_blames_the_cache(args):
    with pytest.raises(ValueError, match="^q must be"):
        check_inputs(args["q"][:, :500], args["cache"], args["wv_b"])
    with pytest.raises(ValueError, match="^cache must be"):
        check_inputs(args["q"], args["cache"][:, :520], args["wv_b"])


# ------------------------------------------------- files, lengths and plans a user gives

def test_lengths_past_int32_or_not_finite_are_named():
    # a length that overflows int64, a draw that is not finite, a float: never a traceback,
    # a wrapped int32 or a negative length
    for spec, phrase in (("99999999999999999999999", "outside 0..2,147,483,647"),
                         (str(2**31), "outside 0..2,147,483,647"),
                         ("normal:10:inf", "must be finite"), ("normal:1e30:0", "past"),
                         ("normal:-100:10", "finite and >= 0"),
                         ("normal:100:-10", "finite and >= 0"),
                         ("4.5", "expected N")):
        for cmd in (("bench", "--batch", "4"), ("repro", "--variant", "split", "--batch", "4")):
            res = run(*cmd, "--lengths", spec)
            assert res.exit_code == 2 and phrase in words(res), (cmd, spec, res.output)


def test_repro_reads_a_lengths_file(tmp_path):
    (tmp_path / "lens.txt").write_text("5\n70\n")
    out = tmp_path / "r.py"
    res = run("repro", "--variant", "split", "--batch", "4", "--lengths",
              f"@{tmp_path / 'lens.txt'}", "-o", out)
    assert res.exit_code == 0, res.output
    assert "(5, 70, 5, 70)" in out.read_text()


def test_a_plan_past_the_grid_limit_is_refused(tmp_path):
    from gpu_support import HAVE_GPU

    # --blocks-per-sm stops at the 32 blocks an SM keeps resident, so a plan reaches the
    # grid's limit only through a planned SM count: --sms, taken without a GPU only (with
    # one, the device's is used)
    cases = [(("--blocks-per-sm", "9999999"), "from 1 to 32")]
    if not HAVE_GPU:
        cases.append((("--sms", "65535", "--blocks-per-sm", "32", "--heads", "1"),
                      "holds at most 65,535"))
    cases.append((("--sms", "65536"), "1<=x<=65535"))
    for opt, phrase in cases:
        res = run("repro", "--variant", "split", "--batch", "4", *opt, "-o", tmp_path / "r.py")
        assert res.exit_code == 2 and phrase in words(res), res.output
        assert not (tmp_path / "r.py").exists()


@pytest.mark.parametrize("make", ["missing", "directory", "binary"])
def test_a_user_kernel_that_cannot_be_read(tmp_path, make):
    path = tmp_path / "k.cu"
    if make == "directory":
        path.mkdir()
    elif make == "binary":
        path.write_bytes(b"\xff\xfe not text")
    phrase = {"missing": "no such file", "directory": "a directory",
              "binary": "not UTF-8 text"}[make]
    res = run("bench", "--batch", "4", "--variants", path)
    assert res.exit_code == 2 and phrase in words(res), res.output
    res = run("try", path, "--no-time")  # an uncaught exception would be exit code 1
    assert res.exit_code == 2 and phrase.split()[-1] in words(res), res.output


def test_new_and_try_check_the_files_they_write(tmp_path):
    (tmp_path / "d.cu").mkdir()
    res = run("new", tmp_path / "d.cu", "--force")
    assert res.exit_code == 2 and "is a directory" in words(res)
    res = run("new", tmp_path / "no" / "k")
    assert res.exit_code == 2 and "does not exist" in words(res)
    assert run("new", tmp_path / "k").exit_code == 0
    res = run("try", tmp_path / "k.cu", "--no-time", "--repro", tmp_path / "no" / "r.py")
    assert res.exit_code == 2 and "--repro" in words(res) and "does not exist" in words(res)


@pytest.mark.parametrize("cmd", [("info", "--json", ""), ("bench", "--csv", ""),
                                 ("bench", "--vs", ""), ("repro", "--variant", "split", "-o", "")])
def test_an_empty_path_is_not_taken_as_no_path(cmd):
    res = run(*cmd)
    assert res.exit_code == 2 and "an empty path" in words(res), res.output


def test_paged_bench_options_are_named_as_typed():
    res = run("bench", "--batch", "4", "--hpb", "4")
    assert res.exit_code == 2 and "--hpb belongs to the depth bench" in words(res)
    res = run("bench", "--batch", "4", "--splits", "300")
    assert res.exit_code == 2 and "at most 256" in words(res)


@pytest.mark.parametrize("cmd", [("bench", "--check-ctx", str(2**40)),
                                 ("bench", "--check-heads", str(2**40))])
def test_spot_check_sizes_past_int32(cmd):
    res = run(*cmd)
    opt = cmd[1]
    limit = limits.MAX_CTX if opt == "--check-ctx" else limits.MAX_HEADS
    assert res.exit_code == 2 and f"'{opt}'" in words(res), res.output
    assert f"{limit}" in words(res).replace(",", ""), res.output


def test_render_results_names_a_file_it_cannot_render(tmp_path):
    import subprocess
    import sys

    tool = os.path.join(os.path.dirname(__file__), "..", "tools", "render_results.py")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "manifest.json").write_text("[1]")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "manifest.json").write_text('{"date": "x"}')
    (tmp_path / "b" / "x.json").write_text('{"schema": "mlasandbox.bench/1", "rows": []}')
    for d, phrase in (("a", "a manifest is a JSON object"), ("b", "not a complete phases")):
        p = subprocess.run([sys.executable, tool, str(tmp_path / d), "-o",
                            str(tmp_path / "out.md")], capture_output=True, text=True)
        assert p.returncode == 2 and phrase in p.stderr and "Traceback" not in p.stderr, p.stderr


# ------------------------------------------------------------- the paged step's options

def _paged_cmd(cmd, tmp_path) -> list:
    """`cmd` with what it needs to run here: repro a file to write (checked not written),
    try its kernel file and no timing."""
    if cmd[0] == "repro":
        return [*cmd, "-o", tmp_path / "r.py"]
    if cmd[0] == "try":
        return [cmd[0], os.path.join(os.path.dirname(__file__), "data", "toy_attn.cu"),
                "--no-time", *cmd[1:]]
    return list(cmd)


PAGED_COMMANDS = [("bench",), ("repro", "--variant", "split"), ("sweep", "--no-gpu"),
                  ("ablate",), ("stalls",), ("try",)]


@pytest.mark.parametrize("cmd", PAGED_COMMANDS, ids=lambda c: c[0])
def test_more_lengths_than_the_batch_exit_2(cmd, tmp_path):
    # fewer are cycled to the batch (the --lengths help says so); more would drop requests
    res = run(*_paged_cmd(cmd, tmp_path), "--batch", "2", "--lengths", "1,2,3")
    assert res.exit_code == 2, res.output
    assert "lengths: 3 given for a batch of 2; give at most 2" in words(res)
    assert not (tmp_path / "r.py").exists()


@pytest.mark.parametrize("cmd", PAGED_COMMANDS[:-1], ids=lambda c: c[0])
def test_s_q_past_the_projection_grid_exits_2(cmd, tmp_path):
    # 2 x 1,048,560 latent rows a head fill the projection's 65535 grid z blocks of 32
    for s_q in ("1048561", "2147483648"):
        res = run(*_paged_cmd(cmd, tmp_path), "--batch", "2", "--s-q", s_q)
        assert res.exit_code == 2, res.output
        assert "s_q must be <= 1,048,560 (the output projection's grid z dimension holds " \
               "ceil(batch 2 x s_q / 32) blocks, at most 65535)" in words(res)
        assert not (tmp_path / "r.py").exists()


@pytest.mark.parametrize("cmd", [("bench", "--variants", "wgmma64"),
                                 ("ablate", "--variants", "wgmma64"),
                                 ("stalls", "--variant", "wgmma64"),
                                 ("repro", "--variant", "wgmma64")], ids=lambda c: c[0])
def test_wgmma64_with_an_f32_q_exits_2(cmd, tmp_path):
    res = run(*_paged_cmd(cmd, tmp_path), "--batch", "2", "--q", "f32")
    assert res.exit_code == 2, res.output
    assert "wgmma64 takes q in the cache dtype (f16), got q=f32" in words(res)


def test_paged_inputs_past_host_memory_are_refused_before_allocating(monkeypatch):
    from mlasandbox.paged_inputs import make_paged_inputs

    monkeypatch.setattr(limits, "host_memory_bytes", lambda: 1 << 30)
    assert make_paged_inputs(Dims(n_head=16), [4096, 4096], s_q=2).q.shape == (2, 2, 16, 576)
    # q alone: 2 x 8192 x 16 x 576 values drawn in float32 and stored, 8 B each: 1.1 GiB
    with pytest.raises(ValueError, match=r"need about 1\.2 GiB of host memory \(q: batch 2 x "
                                         r"s_q 8192 x 16 heads x 576.*this machine has 1\.0 GiB"):
        make_paged_inputs(Dims(n_head=16), [4096, 4096], s_q=8192)
    with pytest.raises(ValueError, match=r"4 pages x page_size 2147483648 x 576"):
        make_paged_inputs(Dims(n_head=16), [4096], page_size=2**31)


def test_a_header_directory_without_the_headers_is_bad_input(tmp_path, monkeypatch):
    # MLASANDBOX_CUDA_INCLUDE is a setting the user gave: every command refuses it, exit 2,
    # naming it, before any work (check --no-gpu compiles nothing and would pass without
    # this); info lists it among its problems (exit 1) and --help still prints
    from mlasandbox import toolkit

    monkeypatch.setenv(toolkit.ENV_INCLUDE, str(tmp_path))  # empty: no headers
    for cmd in (("regs",), ("sweep", "--no-gpu"), ("check", "--no-gpu"),
                ("repro", "--variant", "split", "--splits", "2", "-o", tmp_path / "r.py")):
        res = run(*cmd)
        assert res.exit_code == 2, (cmd, res.output)
        assert f"{toolkit.ENV_INCLUDE}={str(tmp_path)!r} does not hold" in words(res), cmd
    assert not (tmp_path / "r.py").exists()
    res = run("regs", "--json")
    assert res.exit_code == 2 and json.loads(res.stdout)["ok"] is False
    res = run("info")
    assert res.exit_code == 1 and toolkit.ENV_INCLUDE in res.output
    assert run("regs", "--help").exit_code == 0


def test_a_cubin_cache_that_cannot_hold_cubins_is_bad_input(tmp_path, monkeypatch):
    # MLASANDBOX_CUBIN_CACHE (where the sm_90a kernels are kept) is a setting too: a file,
    # or a path through one, is refused by every command, exit 2, naming it; info lists it
    from mlasandbox import arch_specific

    afile = tmp_path / "afile"
    afile.write_text("x")
    for value, said in ((afile, "exists and is not a directory"),
                        (afile / "sub", f"{str(afile)!r} is not a directory")):
        monkeypatch.setenv(arch_specific.ENV_CACHE, str(value))
        res = run("regs")
        assert res.exit_code == 2, res.output
        assert f"{arch_specific.ENV_CACHE}={str(value)!r}: " in words(res) and said in words(res)
        with pytest.raises(ValueError, match=arch_specific.ENV_CACHE):
            arch_specific.cache_dir()
    res = run("info")
    assert res.exit_code == 1 and arch_specific.ENV_CACHE in res.output
    monkeypatch.setenv(arch_specific.ENV_CACHE, str(tmp_path / "new" / "deep"))
    assert arch_specific.cache_setting_problem() is None     # a missing folder is made
    assert arch_specific.cache_dir() == tmp_path / "new" / "deep" and (tmp_path / "new").is_dir()


def test_a_damaged_cached_cubin_is_compiled_afresh_once(tmp_path, monkeypatch):
    # the cache is keyed on the source: a file there that does not load (a damaged cubin) is
    # rebuilt, not an error; a kernel whose fresh build does not load either still raises
    import cupy

    from mlasandbox import arch_specific

    class DriverError(Exception):
        def __init__(self, status):
            self.status = status

    loads = []

    class Module:
        def __init__(self, path):
            self.data = open(path, "rb").read()

        def get_function(self, name):
            loads.append(self.data)
            if self.data != b"CUBIN":
                raise DriverError(200)       # CUDA_ERROR_INVALID_IMAGE
            return ("fn", name)

    built = []

    def compile_cubin(*a):
        built.append(a)
        return b"CUBIN", "lowered"

    monkeypatch.setenv(arch_specific.ENV_CACHE, str(tmp_path))
    monkeypatch.setattr(cupy.cuda.driver, "CUDADriverError", DriverError, raising=False)
    monkeypatch.setattr(cupy, "RawModule", Module)
    monkeypatch.setattr(arch_specific, "compile_cubin", compile_cubin)
    assert arch_specific.load_function("src", "k", "sm_90a") == ("fn", "lowered")
    assert len(built) == 1
    assert arch_specific.load_function("src", "k", "sm_90a") == ("fn", "lowered")
    assert len(built) == 1                  # from the cache
    (cubin,) = tmp_path.glob("*.cubin")
    cubin.write_bytes(b"CUB")               # damaged
    assert arch_specific.load_function("src", "k", "sm_90a") == ("fn", "lowered")
    assert len(built) == 2 and cubin.read_bytes() == b"CUBIN" and loads[-2:] == [b"CUB",
                                                                                 b"CUBIN"]
    monkeypatch.setattr(arch_specific, "compile_cubin", lambda *a: (b"BAD", "lowered"))
    with pytest.raises(DriverError):
        arch_specific.load_function("other", "k", "sm_90a")


def test_repro_refuses_a_case_its_script_could_not_hold(tmp_path, monkeypatch):
    # the script draws its inputs and runs the float64 reference on the host, by the rules
    # check and make_paged_inputs apply: 2e6 rows x (6 x 576 + 12 x 16) B = 7.3 GB, and a
    # paged cache of 2 x 2e6 rows drawn in float32 and stored, 8 B a value: 17.2 GiB,
    # each over the 1 GiB this test pretends to have; the case below them is written
    monkeypatch.setattr(limits, "host_memory_bytes", lambda: 1 << 30)
    out = tmp_path / "r.py"
    res = run("repro", "--variant", "split", "--heads", "16", "--ctx", "2000000", "-o", out)
    assert res.exit_code == 2, res.output
    assert ("context 2,000,000 with 16 heads needs about 6.8 GiB of host memory for the "
            "script's inputs and float64 reference; this machine has 1.0 GiB") in words(res)
    res = run("repro", "--variant", "split", "--batch", "2", "--lengths", "2000000", "-o", out)
    assert res.exit_code == 2 and "this machine has 1.0 GiB" in words(res), res.output
    assert not out.exists()
    res = run("repro", "--variant", "split", "--batch", "2", "--lengths", "20000", "-o", out)
    assert res.exit_code == 0 and out.exists(), res.output


def test_try_repro_sizes_its_case_as_repro_does(tmp_path, monkeypatch):
    # wv_b alone: 100,000 heads x 128 x 512 values drawn in float32 and stored, 8 B each:
    # 48.8 GiB, over the 1 GiB this test pretends to have
    monkeypatch.chdir(tmp_path)
    assert run("new", "k").exit_code == 0
    monkeypatch.setattr(limits, "host_memory_bytes", lambda: 1 << 30)
    from mlasandbox.cli import try_cmd

    compiled = []   # refused before the compile (seconds of NVRTC), not after it
    monkeypatch.setattr(try_cmd, "_compile", lambda *a: compiled.append(a) or 1 / 0)
    res = run("try", "k.cu", "--repro", "r.py", "--heads", "100000", "--no-time")
    assert res.exit_code == 2 and "--repro: the paged inputs need about 50.6 GiB" in words(res)
    assert not (tmp_path / "r.py").exists() and not compiled


def _q_absorb_args(**change):
    h = 4
    args = {"q_nope": np.zeros((h, 128), np.float16), "q_rope": np.zeros((h, 64), np.float16),
            "wk_b": np.zeros((h, 128, 512), np.float16)}
    return args | change


@pytest.mark.parametrize("change, kind, said", [
    ({"wk_b": np.zeros((4, 128, 512), np.float32)}, TypeError,
     "wk_b must be float16 or bfloat16 (uint16 words of bf16), got float32"),
    ({"wk_b": np.zeros((4, 128, 512), np.int8)}, TypeError, "wk_b must be float16 or bfloat16"),
    ({"q_rope": np.zeros((4, 64), ml_dtypes.bfloat16)}, TypeError,
     "q_rope must have wk_b's dtype (float16), got bfloat16"),
    ({"q_dtype": "f64"}, ValueError, "q_dtype must be 'f32' or 'cache' (the weights' f16)"),
    ({"q_dtype": "bf16"}, ValueError, "q_dtype must be 'f32' or 'cache'"),
    ({"q_nope": np.zeros(3, np.float16)}, ValueError, "q_nope must be [n_head >= 1, nope]"),
    ({"q_nope": np.zeros((0, 128), np.float16)}, ValueError, "q_nope must be [n_head >= 1"),
    ({"wk_b": np.zeros((4, 128, 64), np.float16)}, ValueError, "wk_b must be [4, 128, 512]"),
    ({"q_rope": [1, 2]}, TypeError, "q_rope must be a CuPy array, got list"),
])
def test_q_absorb_names_the_parameter_before_touching_the_device(change, kind, said):
    # q_absorb's shapes and dtypes are host facts: each error names its parameter, before
    # the device is asked (so no GPU is needed to see them); a right set of host arrays
    # gets as far as the device check
    import mlasandbox as mla

    with pytest.raises(kind) as err:
        mla.q_absorb(**_q_absorb_args(**change))
    assert said in str(err.value)
    with pytest.raises(TypeError, match="q_nope must be a CuPy array on the device"):
        mla.q_absorb(**_q_absorb_args())
