"""The heads-per-block sweep: rows from a ptxas report and a measuring function (CPU)."""
from __future__ import annotations

import json

import pytest

from lab_fakes import FakeBackend
from mlasandbox import registry
from mlasandbox.dims import PRESETS
from mlasandbox.ptxas import KernelResources
from mlasandbox.sweep import run_sweep, sweep_rows, variant_for_hpb
from mlasandbox.timing import Timing, summarize

# The register-wall table of a CUDA-core 96-head kernel: 8 -> 96 regs, 12 -> 125 regs (2 blocks/SM), 16 -> 148 (1).
LECTURE_REGS = {8: 96, 12: 125, 16: 148}


def fake_report(regs):
    out = {}
    for hpb, r in regs.items():
        inst = registry.attn_instance(hpb)
        out[inst.name] = KernelResources(inst.name, "_Z", "sm_90", r, 0, 0, 0, 0, None, None,
                                         code_bytes=4096)
    return out


def test_variant_names():
    assert variant_for_hpb(1) == "split" and variant_for_hpb(12) == "batched12"


def test_the_register_wall_is_marked_without_a_gpu():
    rows = sweep_rows(hpbs=(8, 12, 16), n_ctx=131072, dims=PRESETS["h96"], cache="f16",
                      q="f32", arch="sm_90", num_sms=132, report=fake_report(LECTURE_REGS))
    by = {r["hpb"]: r for r in rows}
    assert by[12]["blocks_per_sm_model"] == 2 and by[16]["blocks_per_sm_model"] == 1
    assert by[16]["step"] and not by[12]["step"] and not by[8]["step"]
    assert by[16]["limiter"] == "registers"
    assert all(r["median_us"] is None and not r["fastest"] for r in rows)
    # the plan follows the modelled occupancy: 8 head blocks x S on 264 slots at HPB 12
    assert by[12]["head_blocks"] == 8 and by[12]["splits"] >= 1
    assert by[12]["waves"] == pytest.approx(8 * by[12]["splits"] / 264)
    # at the register wall the plan has half the slots: 6 head blocks x 22 slices on 132
    assert by[16]["head_blocks"] == 6 and by[16]["splits"] == 22
    assert by[16]["waves"] == pytest.approx(6 * 22 / 132)


def test_timed_rows_mark_the_fastest_and_the_driver_step():
    times = {8: 141.1, 12: 133.9, 16: 149.9}  # that table's ms/token, as us here
    bps = {8: 2, 12: 2, 16: 1}

    def measure(hpb):
        t = Timing(summarize([times[hpb]] * 5), "events")
        return {"timing": t, "driver_blocks_per_sm": bps[hpb], "num_regs": LECTURE_REGS[hpb],
                "plan": {"splits": 33, "head_blocks": 96 // hpb, "waves": 1.0, "reason": "x"}}

    rows = sweep_rows(hpbs=(8, 12, 16), n_ctx=131072, dims=PRESETS["h96"], cache="f16",
                      q="f32", arch="sm_90", num_sms=132, report=fake_report(LECTURE_REGS),
                      measure=measure)
    by = {r["hpb"]: r for r in rows}
    assert by[12]["fastest"] and not by[8]["fastest"] and not by[16]["fastest"]
    assert by[16]["driver_step"] and by[16]["blocks_per_sm_driver"] == 1
    assert by[12]["splits"] == 33 and by[12]["median_us"] == 133.9


def test_run_sweep_without_a_gpu_compiles_and_models():
    res = run_sweep(hpbs=(8, 12, 16), use_gpu=False)
    json.dumps(res)
    assert res["timed"] is False and res["config"]["arch"] == "sm_90"
    assert [r["hpb"] for r in res["rows"]] == [8, 12, 16]
    assert all(r["registers"] > 0 and r["blocks_per_sm_model"] >= 1 for r in res["rows"])


def test_run_sweep_with_a_backend_uses_its_device_and_times():
    fake = FakeBackend()
    res = run_sweep(hpbs=(1, 12), n_ctx=32768, backend=fake, use_gpu=True)
    assert res["timed"] and res["meta"]["device"] == "Fake H200"
    assert [c[1:4] for c in fake.calls if c[0] == "time"] == [("split", 32768, "attn"),
                                                             ("batched12", 32768, "attn")]
    assert sum(r["fastest"] for r in res["rows"]) == 1
    assert all(r["blocks_per_sm_driver"] == 2 for r in res["rows"])
    assert res["warnings"]  # the fake's 100 registers disagree with ptxas


def test_run_sweep_rejects_bad_values():
    with pytest.raises(ValueError):
        run_sweep(hpbs=(3,), use_gpu=False)
    with pytest.raises(ValueError):
        run_sweep(preset="nope", use_gpu=False)
