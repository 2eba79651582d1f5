"""The sources' digest a results file carries (sandbox/provenance.py) and the tool that names
its commits (tools/which_commit.py): the digest must follow every byte of every source and
nothing else, and the installed package and a commit's tree must give the same one."""
from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest

from mlasandbox import provenance

ROOT = Path(__file__).resolve().parent.parent
FILES = [("mlasandbox/a.py", b"x = 1\n"), ("mlasandbox/cuda_src/k.cu", b"__global__ void k(){}\n")]

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def _tool(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_digest_follows_every_byte_and_name_and_not_the_order():
    d = provenance.digest(FILES)
    assert len(d) == provenance.DIGEST_CHARS and int(d, 16) >= 0
    assert provenance.digest(FILES[::-1]) == d
    assert provenance.digest([FILES[0], (FILES[1][0], FILES[1][1] + b" ")]) != d
    assert provenance.digest([FILES[0], ("mlasandbox/cuda_src/j.cu", FILES[1][1])]) != d
    assert provenance.digest(FILES[:1]) != d


def _git(repo, *args):
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t",
                    "-c", "commit.gpgsign=false", *args], check=True, capture_output=True)


def _repo_of_installed(tmp_path):
    """A repository whose one commit holds the installed package's counted sources, laid out
    as this repository lays them out (REPO_FOLDERS), plus a file the digest must not count."""
    repo = tmp_path / "repo"
    by_prefix = {pkg.replace(".", "/"): folder for pkg, folder in provenance.REPO_FOLDERS.items()}
    for name, data in provenance._installed_files():
        prefix, leaf = name.rsplit("/", 1)
        dst = repo / by_prefix[prefix] / leaf
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(data)
    (repo / "sandbox" / "notes.txt").write_text("not a source\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "one")
    return repo


@needs_git
def test_the_installed_package_and_its_commit_give_one_digest(tmp_path):
    repo = _repo_of_installed(tmp_path)
    assert provenance.digest(provenance.commit_sources("HEAD", str(repo))) \
        == provenance.sources_digest()


@needs_git
def test_which_commit_names_the_commit_of_a_digest(tmp_path, capsys):
    tool = _tool("which_commit")
    repo = _repo_of_installed(tmp_path)
    first = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True,
                           text=True, check=True).stdout.strip()
    with open(repo / "cuda_src" / "mla_common.cuh", "a") as f:
        f.write("// one more line\n")
    _git(repo, "commit", "-q", "-am", "two")
    mine = provenance.sources_digest()
    assert tool.main([mine, "--repo", str(repo)]) == 0
    assert capsys.readouterr().out.split() == [first]  # the second commit's digest differs
    assert tool.main(["0" * provenance.DIGEST_CHARS, "--repo", str(repo)]) == 1
    assert "no commit of the 2 searched" in capsys.readouterr().err


@pytest.mark.parametrize("args, said", [
    (["abc"], "DIGEST must be 12 hex digits"),
    (["g" * 12], "DIGEST must be 12 hex digits"),
    (["0" * 12, "--max", "0"], "--max must be at least 1"),
])
def test_which_commit_refuses_bad_arguments(args, said, capsys):
    assert _tool("which_commit").main(args) == 2
    assert said in capsys.readouterr().err


@needs_git
def test_which_commit_names_a_repository_it_cannot_read(tmp_path, capsys):
    assert _tool("which_commit").main(["0" * 12, "--repo", str(tmp_path)]) == 2
    assert "cannot list the commits" in capsys.readouterr().err


def test_a_manifest_records_the_digest_without_a_gpu():
    facts = _tool("write_manifest")._device_facts()
    assert facts["sources"] == provenance.sources_digest()


def test_the_bench_summary_names_the_sources():
    from rich.console import Console

    from mlasandbox.cli import lab_render

    def summary(meta):
        result = {"meta": meta, "noise_floor": {"runs": []},
                  "ceilings": {"copy_GBps": 4000.0, "copy_bytes": 1 << 30,
                               "gemm_TFLOPs": 700.0, "gemm_n": 8192},
                  "control": {"series": [1.0], "stable": True, "start_us": 5.0,
                              "end_us": 5.0, "max_move": 0.0},
                  "estimate": {"seconds": 1.0, "measurements": 1, "target_ms": 20.0},
                  "elapsed_s": 1.0}
        con = Console(width=200, record=True)
        con.print(lab_render.summary_table(result))
        return con.export_text()

    assert "abc1234 / 0123456789ab / 2026" in summary(
        {"commit": "abc1234", "sources": "0123456789ab", "date": "2026-12-04"})
    # a saved bench from before the field: said so, not left blank
    assert "abc1234 / not recorded / 2026" in summary({"commit": "abc1234", "date": "2026-12-04"})
