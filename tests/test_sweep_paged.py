"""`mlasandbox sweep --batch / --serving` (sandbox/sweep_paged.py): the rows-per-block sweep
of one paged step. CPU: the rows from an injected ptxas report and measuring function, the
variants and what is skipped, the real compile without a GPU, the CLI; GPU: one small step
timed through PagedBackend."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from gpu_support import gpu
from mlasandbox import registry, toolkit
from mlasandbox.bench_paged import make_paged_config
from mlasandbox.cli import sweep_cmd
from mlasandbox.cli.main import main
from mlasandbox.ptxas import KernelResources
from mlasandbox.sweep_paged import paged_sweep_rows, paged_sweep_variants, run_paged_sweep
from mlasandbox.timing import Timing, summarize

CFG = dict(batch=4, lengths="3000,100,0,9000", heads=16)


def _res(name, regs, spills=0, smem=0):
    return KernelResources(name=name, mangled=name, arch="sm_90", registers=regs,
                           spill_stores=spills, spill_loads=spills, stack_bytes=0,
                           smem_bytes=smem, cmem0_bytes=0, barriers=1, code_bytes=4096)


def _t(us):
    xs = [us * (1 + 0.001 * i) for i in range(10)]
    return Timing(summarize(xs), "events", "", xs, 0.0, True)


def _report(variants, cfg, regs):
    return {registry.paged_attention_instance(v, cfg.cache_dtype, "f16").name:
            _res(v, regs.get(v, 64)) for v in variants}


def test_variants_follow_the_hpbs_and_the_dtypes():
    v, skipped = paged_sweep_variants((1, 8, 16), True, "f16", "f16", 1, 16)
    assert v == ["split", "batched8", "batched16", "mma16", "mma32", "wgmma64"] and not skipped
    v, skipped = paged_sweep_variants((1, 8), True, "f16", "f32", 1, 16)
    assert v == ["split", "batched8", "mma16", "mma32"]
    assert skipped[0]["variant"] == "wgmma64" and "cache dtype" in skipped[0]["reason"]
    assert paged_sweep_variants((4,), False, "bf16", "bf16", 2, 9)[0] == ["batched4"]
    with pytest.raises(ValueError):
        paged_sweep_variants((5,), False, "f16", "f16", 1, 16)


def test_rows_carry_the_report_the_plan_and_the_marks():
    cfg = make_paged_config(**CFG)
    variants = ["batched4", "batched8", "batched16", "mma16", "wgmma64"]
    # batched8 at 168 registers x 256 threads: one block an SM, where its shared memory
    # alone allows two, as batched4 and batched16 get at 64 registers
    regs = {"batched4": 64, "batched8": 168, "batched16": 64, "mma16": 178, "wgmma64": 212}
    report = _report(variants, cfg, regs)
    times = {"batched4": 90.0, "batched8": 80.0, "batched16": 85.0, "mma16": 40.0,
             "wgmma64": 45.0}
    calls = []

    def measure(v):
        calls.append(v)
        inst = registry.paged_attention_instance(v, "f16", "f16")
        return {"timing": _t(times[v]),
                "plan": {"head_blocks": -(-16 // inst.heads), "grid": [1, 132, 1],
                         "max_chunks": 9, "n_chunks": [3, 1, 0, 8], "chunk_len_max": 1152,
                         "attn_num_regs": regs[v], "driver_blocks_per_sm": None}}
    rows = paged_sweep_rows(variants=variants, cfg=cfg, q="f16", arch="sm_90", num_sms=132,
                            report=report, measure=measure)
    assert calls == variants and [r["variant"] for r in rows] == variants
    by = {r["variant"]: r for r in rows}
    assert by["batched8"]["registers"] == 168 and by["wgmma64"]["rows_per_block"] == 64
    assert [by[v]["blocks_per_sm_model"] for v in variants[:3]] == [2, 1, 2]
    assert by["batched8"]["step"] and not by["batched4"]["step"] and not by["batched16"]["step"]
    # the tensor-core rows are not on the heads-per-block chain: never a step
    assert not by["mma16"]["step"] and not by["wgmma64"]["step"]
    assert by["mma16"]["fastest"] and sum(r["fastest"] for r in rows) == 1
    assert by["batched4"]["programs_run"] == 12 * 4 and by["mma16"]["programs_run"] == 12
    assert by["mma16"]["median_us"] == pytest.approx(40.0, rel=0.01)
    # negative control: the same rows without the register wall mark no step
    flat = paged_sweep_rows(variants=variants, cfg=cfg, q="f16", arch="sm_90", num_sms=132,
                            report=_report(variants, cfg, {}), measure=measure)
    assert not any(r["step"] for r in flat)


def test_without_a_device_the_plan_comes_from_the_model():
    cfg = make_paged_config(**CFG)
    rows = paged_sweep_rows(variants=["mma16"], cfg=cfg, q="f16", arch="sm_90", num_sms=132,
                            report=_report(["mma16"], cfg, {"mma16": 178}))
    r = rows[0]
    assert r["median_us"] is None and not r["fastest"] and r["blocks_per_sm_driver"] is None
    assert r["head_blocks"] == 1 and r["max_chunks"] >= 2 and r["programs_run"] >= 4
    # the plan at the modelled occupancy (mma16 at 178 registers: one block an SM), its
    # grid one wave of 132 slots
    assert r["blocks_per_sm_model"] == 1 and r["grid"][1] == 132


def test_the_real_compile_without_a_gpu():
    cfg = make_paged_config(**CFG)
    res = run_paged_sweep(cfg, hpbs=(1,), tensor_cores=True, use_gpu=False)
    assert not res["timed"] and res["config"]["variants"] == ["split", "mma16", "mma32",
                                                               "wgmma64"]
    by = {r["variant"]: r for r in res["rows"]}
    assert all(r["registers"] > 0 and r["spill_stores"] == 0 for r in res["rows"])
    assert by["wgmma64"]["kernel"].startswith("wgmma_attn") and by["mma32"]["rows_per_block"] == 32


class FakeBackend:
    arch, num_sms = "sm_90", 132

    def __init__(self):
        self.calls = []

    def meta(self):
        return {"device": "fake"}

    def prepare_paged(self, cfg):
        self.calls.append(("prepare", cfg.batch))

    def paged_plan(self, v, arm=0):
        return {"head_blocks": 1, "grid": [1, 132, 1], "max_chunks": 9,
                "n_chunks": [1, 1, 0, 2], "chunk_len_max": 4096, "attn_num_regs": -1,
                "driver_blocks_per_sm": 1}

    def time_paged(self, v, phase, kw, arm=0):
        self.calls.append((v, phase))
        return _t(50.0 if v == "mma16" else 70.0)

    def release_steps(self):
        pass

    def release(self):
        self.calls.append("release")


def test_a_device_run_times_the_attention_phase_of_each_variant():
    be = FakeBackend()
    cfg = make_paged_config(**CFG)
    res = run_paged_sweep(cfg, hpbs=(16,), tensor_cores=True, backend=be)
    assert res["timed"] and res["meta"] == {"device": "fake"}
    assert be.calls == [("prepare", 4), ("batched16", "attn"), ("mma16", "attn"),
                        ("mma32", "attn"), ("wgmma64", "attn"), "release"]
    assert next(r for r in res["rows"] if r["fastest"])["variant"] == "mma16"


# ---------------------------------------------------------------------------- CLI

def _cli(*args):
    return CliRunner().invoke(main, ["sweep", *args])


def test_cli_without_a_gpu_prints_the_compile_side(monkeypatch):
    monkeypatch.setattr(toolkit, "device_available", lambda: (False, "no CUDA device (test)"))
    r = _cli("--serving", "b32-8k-var-h16", "--hpb", "16", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["config"]["batch"] == 32 and data["config"]["q"] == "f16"
    assert [x["variant"] for x in data["rows"]] == ["batched16", "mma16", "mma32", "wgmma64"]
    r = _cli("--batch", "2", "--lengths", "500", "--heads", "16", "--hpb", "1",
             "--no-tensor-cores")
    assert r.exit_code == 0, r.output
    out = " ".join(r.output.split())
    assert "rows-per-block sweep of the paged step B=2 x 500" in out and "NO GPU" in out


def test_cli_an_f32_q_skips_wgmma_with_the_reason(monkeypatch):
    monkeypatch.setattr(toolkit, "device_available", lambda: (False, "no CUDA device (test)"))
    r = _cli("--batch", "2", "--heads", "16", "--hpb", "16", "--q", "f32", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert "wgmma64" not in [x["variant"] for x in data["rows"]]
    assert any("wgmma64 skipped" in w for w in data["warnings"])


@pytest.mark.parametrize("args,words", [
    (["--batch", "2", "--ctx", "100"], "--lengths"),
    (["--tensor-cores"], "need --batch"),
    (["--lengths", "5"], "need"),
    (["--batch", "2", "--page-size", "32"], "page-size"),
    (["--serving", "nope"], "nope"),
])
def test_cli_bad_paged_sweeps_exit_2(monkeypatch, args, words):
    monkeypatch.setattr(toolkit, "device_available", lambda: (False, "no CUDA device (test)"))
    r = _cli(*args)
    assert r.exit_code == 2 and words in r.output, r.output


def test_cli_on_a_gpu_renders_the_timed_rows(monkeypatch):
    monkeypatch.setattr(toolkit, "device_available", lambda: (True, ""))
    seen = {}

    def fake(cfg, **opts):
        seen["cfg"], seen["opts"] = cfg, opts
        return run_paged_sweep(cfg, **{**opts, "backend": FakeBackend()})
    monkeypatch.setattr(sweep_cmd, "_run_paged_sweep", fake)
    r = _cli("--serving", "b128-4k-h16", "--hpb", "16")
    assert r.exit_code == 0, r.output
    assert seen["cfg"].batch == 128 and seen["opts"]["use_gpu"]
    out = " ".join(r.output.split())
    assert "rows-per-block sweep" in out and "50.0" in out and "*" in out


# ---------------------------------------------------------------------------- on a GPU

@gpu
def test_gpu_paged_sweep_times_every_variant():
    cfg = make_paged_config(batch=3, lengths="3000,0,700", heads=16, s_q=2, causal=True,
                            page_size=16)
    res = run_paged_sweep(cfg, hpbs=(1, 16), tensor_cores=True,
                          timing_kw={"warmup": 1, "min_repeats": 3, "max_repeats": 5,
                                     "target_s": 0.005})
    assert res["timed"]
    assert [r["variant"] for r in res["rows"]] == ["split", "batched16", "mma16", "mma32",
                                                   "wgmma64"]
    for r in res["rows"]:
        assert r["median_us"] > 0 and r["blocks_per_sm_driver"] >= 1
        assert r["driver_num_regs"] in (-1, r["registers"]), r
