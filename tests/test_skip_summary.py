"""The run's end sums skips up by reason (tests/conftest.py) and keeps pytest's closing line.

Runs pytest on a throwaway test file next to a copy of this suite's conftest.py.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

SAMPLE = '''
import pytest

@pytest.mark.parametrize("i", range(3))
def test_skipped_for_one_reason(i):
    pytest.skip("needs a CUDA device: none here")

@pytest.mark.skipif(True, reason="needs ncu")
def test_skipped_for_another():
    pass

def test_passes():
    pass
'''


def test_skips_are_counted_by_reason_and_the_closing_line_is_pytests(tmp_path):
    shutil.copy2(HERE / "conftest.py", tmp_path / "conftest.py")
    shutil.copy2(HERE / "gpu_support.py", tmp_path / "gpu_support.py")  # conftest's turns
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}  # this run's own
    # On a GPU machine the copied conftest takes a GPU turn per sample test. With the suite's
    # lock files it would wait at the gate behind a gpu_alone test of another worker, which
    # waits for this test's own shared turn to end: both stuck until the timeout (seen in
    # the GPU suite, -n 16, on an H100). A TMPDIR of its own gives the child its own locks.
    env["TMPDIR"] = str(tmp_path)
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider",
                          "test_sample.py"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.strip().splitlines()
    assert "3 skipped: needs a CUDA device: none here" in lines, res.stdout
    assert "1 skipped: needs ncu" in lines, res.stdout
    assert lines.index("3 skipped: needs a CUDA device: none here") < lines.index(
        "1 skipped: needs ncu"), "the most frequent reason comes first"
    assert not any(ln.startswith("SKIPPED [") for ln in lines), res.stdout
    assert re.fullmatch(r"1 passed, 4 skipped in [0-9.]+s", lines[-1]), lines[-1]
