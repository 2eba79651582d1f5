"""The GPU-only CI scripts refuse what they cannot do with exit 2 and one clear line.

`.ci/gpu-sanitize` and `.ci/gpu-goals` run on the device; a developer who starts them (or
`.ci/sanitize_cases.py` alone) on a machine without one, or with a wrong argument, gets the
reason, not a traceback from deep in CuPy. `merge_label`, the column of the sanitizer's
paged lines that says which merge a case reached, is checked on stand-in steps here because
the sanitizer run that prints it has no host-side check of its own.
"""
from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from gpu_support import HAVE_GPU

ROOT = Path(__file__).resolve().parent.parent
CASES = ROOT / ".ci" / "sanitize_cases.py"
no_gpu = pytest.mark.skipif(HAVE_GPU, reason="checks the refusal where no CUDA device is")


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)


def _cases_module():
    spec = importlib.util.spec_from_file_location("sanitize_cases", CASES)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # the module's own `if __name__ == "__main__"` stays idle
    return mod


@pytest.mark.parametrize("args", [["--help"], ["--planted"], ["--planted", "memchek"],
                                  ["--planted", "memcheck", "extra"], ["cases"]])
def test_sanitize_cases_refuses_unknown_arguments(args):
    r = _run(sys.executable, str(CASES), *args)
    assert r.returncode == 2, r
    assert "usage: sanitize_cases.py [--planted {memcheck,racecheck,synccheck,initcheck}]" \
        in r.stderr
    assert "Traceback" not in r.stderr


@no_gpu
@pytest.mark.parametrize("args", [[], ["--planted", "racecheck"]])
def test_sanitize_cases_without_a_device_says_so(args):
    r = _run(sys.executable, str(CASES), *args)
    assert r.returncode == 2, r
    assert r.stderr.startswith("sanitize_cases.py needs a CUDA device: no CUDA device"), r.stderr
    assert "Traceback" not in r.stderr


@no_gpu
def test_gpu_goals_without_a_device_says_so(tmp_path):
    out = tmp_path / "run"
    r = _run("bash", ".ci/gpu-goals", str(out), "--no-suite")
    assert r.returncode == 2, r
    assert "no CUDA device here" in r.stderr
    assert not out.exists()  # refused before it made a run folder


def test_gpu_goals_wants_its_folder_first(tmp_path):
    r = _run("bash", ".ci/gpu-goals", "bf16")
    assert r.returncode == 2 and "OUTDIR first" in r.stderr, r
    r = _run("bash", ".ci/gpu-goals", str(tmp_path / "run"), "f32")
    assert r.returncode == 2 and "unknown argument 'f32'" in r.stderr, r


@pytest.mark.skipif(shutil.which("compute-sanitizer") is not None,
                    reason="checks the refusal where compute-sanitizer is not on PATH")
def test_gpu_sanitize_without_the_sanitizer_says_so(tmp_path):
    r = _run("bash", ".ci/gpu-sanitize", str(tmp_path / "san"))
    assert r.returncode == 2 and "compute-sanitizer is not on PATH" in r.stderr, r


def _step(**kw):
    base = dict(launches_merge=True, merges_in_attn=False, fused_combine=False,
                merge=SimpleNamespace(kind="warp", col_blocks=4, prefetch=2))
    return SimpleNamespace(**{**base, **kw})


def test_merge_label_names_each_merge():
    label = _cases_module().merge_label
    assert label(_step(launches_merge=False)) == "none"
    assert label(_step(launches_merge=False, merges_in_attn=True)) == "in-attn"
    assert label(_step(fused_combine=True)) == "fused"
    assert label(_step()) == "warp/4/2"
    # the label follows the step: another merge kernel's form reads differently
    assert label(_step(merge=SimpleNamespace(kind="deep", col_blocks=8, prefetch=1))) \
        == "deep/8/1"
