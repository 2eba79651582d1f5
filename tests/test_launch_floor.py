"""The launch floor in the bench (CPU, fake backend): a `floor` row per CUDA variant and
context, none for the cuBLAS engine, and the CLI's table of the step against it. On the
device: tests/test_gpu_phases.py times a real one."""
from __future__ import annotations

from click.testing import CliRunner

from lab_fakes import FakeBackend
from mlasandbox import bench_gpu, toolkit
from mlasandbox.bench import run_bench
from mlasandbox.cli.main import main

VARIANTS = ("split", "mma16", "cublas")


def test_every_cuda_step_gets_its_floor_and_the_engine_none():
    be = FakeBackend()
    res = run_bench(backend=be, contexts=(64, 4096), variants=VARIANTS)
    floors = {(r["variant"], r["n_ctx"]): r for r in res["rows"] if r["phase"] == "floor"}
    assert set(floors) == {(v, n) for v in ("split", "mma16") for n in (64, 4096)}
    assert ("floor", "cublas", 64) in be.calls  # asked, and it said None
    for r in floors.values():
        assert r["mode"] == "graph" and r["median_us"] > 0 and r["GBps_ideal"] is None
    # the derived figures read the steps only: a floor is never "the fastest step"
    assert all(f["phase"] == "step" for f in res["fastest"])


def test_the_bench_prints_the_step_against_its_floor(monkeypatch):
    monkeypatch.setattr(toolkit, "device_available", lambda: (True, "device 0: Fake H200"))
    monkeypatch.setattr(bench_gpu, "CupyBackend", lambda *a, **k: FakeBackend(*a, **k))
    res = CliRunner().invoke(main, ["bench", "--ctx", "64", "--variants", "mma16,cublas"])
    assert res.exit_code == 0, res.output
    out = " ".join(res.stdout.split())
    assert "launch floor, cache f16" in out and "step - floor" in out
    line = next(ln for ln in res.stdout.splitlines() if ln.strip().startswith("mma16")
                and "graph" in ln and len(ln.split()) == 6)
    step, floor, gap = (float(x.replace(",", "")) for x in line.split()[2:5])
    assert floor == 4.0 and abs(step - floor - gap) < 0.11  # the fake's floor: 4 us
