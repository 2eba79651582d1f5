"""The .cu sources are found the same way from the checkout and from a built wheel; what the
build and CI need is declared.

Builds a wheel from a copy of the source tree (so the checkout gets no build/ or egg-info
litter), checks its contents, installs it into a scratch --target directory and imports
`mlasandbox.sources.read_source` from there in a fresh interpreter. The build runs with
--no-build-isolation (no index needed), i.e. with this environment's setuptools, which the
`test` extra therefore declares. About 10 s; set MLASANDBOX_SKIP_PACKAGING=1 to leave it out
of a quick run.
"""
from __future__ import annotations

import configparser
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from mlasandbox import sources

ROOT = Path(__file__).resolve().parents[1]
TREE = ("setup.cfg", "pyproject.toml", "README.md", "sandbox", "cli", "cuda_src")

pytestmark = pytest.mark.skipif(os.environ.get("MLASANDBOX_SKIP_PACKAGING") == "1",
                                reason="MLASANDBOX_SKIP_PACKAGING=1")


def _setup_cfg() -> configparser.ConfigParser:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    return cfg


def _requirement_lines(value: str) -> set[str]:
    return {ln.split("#")[0].replace(" ", "") for ln in value.splitlines()} - {""}


def test_the_test_extra_brings_the_build_backend():
    text = (ROOT / "pyproject.toml").read_text()
    found = re.search(r"^requires\s*=\s*\[([^\]]*)\]", text, re.M)
    assert found, "pyproject.toml has no [build-system] requires"
    build = {r.replace(" ", "") for r in re.findall(r'"([^"]+)"', found.group(1))}
    test = _requirement_lines(_setup_cfg()["options.extras_require"]["test"])
    assert build and build <= test, (
        f"the wheel below is built with --no-build-isolation, so the test extra {sorted(test)} "
        f"must hold every build requirement {sorted(build)}")


def test_ci_runs_the_readme_commands_and_installs_nothing_else():
    res = subprocess.run(["bash", str(ROOT / ".ci" / "run"), "--print-commands"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    commands = res.stdout.splitlines()
    readme = (ROOT / "README.md").read_text().splitlines()
    assert len(commands) == 2 and all(c in readme for c in commands), commands
    assert commands[0].endswith("&& python -m pytest -q"), commands[0]
    assert commands[1].endswith("&& mlasandbox bench"), commands[1]
    # an install step of CI's own would hide a step the README lacks
    assert "pip install" not in (ROOT / ".ci" / "run").read_text()


def _checkout_cu_files() -> list[str]:
    return sorted(p.name for p in (ROOT / "cuda_src").iterdir()
                  if p.suffix in (".cu", ".cuh"))


def test_checkout_finds_the_sources_in_cuda_src():
    from importlib import resources

    root = Path(str(resources.files("mlasandbox.cuda_src")))
    assert root.resolve() == (ROOT / "cuda_src").resolve(), \
        "the tests should run against this checkout (pip install -e .)"
    assert sources.source_names() == _checkout_cu_files()
    for name in sources.source_names():
        assert sources.read_source(name)


def _pip(*args, cwd=None):
    cmd = [sys.executable, "-m", "pip", *args]
    res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)
    if res.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{res.stdout}\n{res.stderr}")
    return res


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in TREE:
        p = ROOT / name
        if p.is_dir():
            shutil.copytree(p, src / name, ignore=shutil.ignore_patterns(
                "__pycache__", "*.pyc", "*.egg-info"))
        else:
            shutil.copy2(p, src / name)
    out = tmp_path_factory.mktemp("wheel")
    _pip("wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src))
    wheels = list(out.glob("mlasandbox-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_wheel_contents(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert "mlasandbox" in tops
    assert not tops & {"cli", "sandbox", "cuda_src", "tests"}, tops
    assert all(t == "mlasandbox" or t.endswith((".dist-info", ".data")) for t in tops), tops
    shipped = sorted(n.split("/")[-1] for n in names
                     if n.startswith("mlasandbox/cuda_src/") and n.endswith((".cu", ".cuh")))
    assert shipped == _checkout_cu_files()
    for mod in ("mlasandbox/__init__.py", "mlasandbox/sources.py", "mlasandbox/toolkit.py",
                "mlasandbox/ptxas.py", "mlasandbox/cli/__init__.py", "mlasandbox/cli/main.py",
                "mlasandbox/cuda_src/__init__.py"):
        assert mod in names, mod
    entry = [n for n in names if n.endswith("entry_points.txt")]
    assert entry and "mlasandbox = mlasandbox.cli.main:main" in zipfile.ZipFile(wheel).read(
        entry[0]).decode()


def test_installed_wheel_reads_the_same_sources(wheel, tmp_path):
    target = tmp_path / "site"
    _pip("install", "--no-deps", "-q", "--target", str(target), str(wheel))
    assert not (target / "cli").exists() and not (target / "sandbox").exists()
    probe = (
        "import json, mlasandbox, mlasandbox.sources as s\n"
        "print(json.dumps({'file': mlasandbox.__file__, 'names': s.source_names(),\n"
        "  'texts': {n: s.read_source(n) for n in s.source_names()}}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    res = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                         text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    assert Path(got["file"]).resolve().is_relative_to(target.resolve()), got["file"]
    assert got["names"] == sources.source_names()
    for name, text in got["texts"].items():
        assert text == sources.read_source(name), name
    # every local #include was expanded from the wheel's own files
    assert all('#include "' not in t for t in got["texts"].values())
