"""Bring your own kernel on the device: the battery passes a correct user kernel written
unlike every built-in one (tests/data/byok_warp_rows.cu) and fails each planted wrong kernel
for its own reason, which the cases it still passes pin down (the negative controls of
sandbox/battery.py); racecheck reports the racing one; `try` runs end to end.

Tolerances: the battery's (compare.py's relL2 1e-4 for out and latent, 1e-4 absolute for
lse; a correct f32 kernel errs by 1e-6 .. 5e-6 at these depths, each planted bug by far more
or by NaN, as the assertions on the failing fields show).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from gpu_support import fresh_seed, gpu, poison
from mlasandbox import battery
from mlasandbox import user_kernel as uk

pytestmark = [pytest.mark.gpu, gpu]

DATA = Path(__file__).parent / "data"
CORRECT = DATA / "byok_warp_rows.cu"


def by_what(results):
    return {r.case.what: r for r in results}


def failures(results):
    return [r.as_dict() for r in results if not r.ok]


@pytest.mark.parametrize("rows", [4, 8])
def test_correct_kernel_passes_the_battery(rows):
    k = uk.load_kernel(str(CORRECT), ROWS=rows)
    res = battery.run_battery(k, battery.battery_cases((16, 3), rows_per_block=rows),
                              seed=fresh_seed())
    assert not failures(res)
    assert len(res) > 25


def test_whole_step_kernel_passes_the_battery():
    k = uk.load_kernel(str(DATA / "byok_step.cu"))
    assert k.kind == "step"
    res = battery.run_battery(k, battery.battery_cases((16,), rows_per_block=4),
                              seed=fresh_seed())
    assert not failures(res)


def test_forgotten_rescale_fails_every_multi_position_case():
    """byok_warp_rows.cu keeps an exact running max, moved by every position whose score
    passes all before it in its chunk; the planted kernel then leaves acc unscaled (l is
    rescaled), so every row whose max moves after its chunk's first position is wrong. Every
    case but "context 1" has rows with chunks of at least 20 positions (the shortest: the
    request of 20 in "more chunks than a short request can take"; a chunk is at least one
    32-row tile), where the first position is the max with probability 1/20 a row at most.
    The planted kernel simulated in float64 on every case (seeds 0-4, the chunk plans of 1, 4
    and 16 blocks an SM): latent relL2 at least 0.47 on that case, 0.58 and more on the
    others, 4700x the limit 1e-4 and more."""
    seed = fresh_seed()
    res = by_what(battery.run_battery(uk.load_kernel(str(DATA / "byok_bad_no_rescale.cu")),
                                      battery.battery_cases(), seed=seed))
    assert res["context 1"].ok, f"seed={seed}"      # one position: nothing to rescale
    for what, r in res.items():
        if what == "context 1":
            continue
        assert not r.ok and "latent" in r.reason, f"{what}: passed (seed {r.seed}) {r.reason}"
        err = r.errors.get("latent", float("nan"))
        assert err > 1e-2, f"{what}: latent relL2 {err:.3g} (seed {r.seed}) {r.reason}"
    assert "request 0" in res["context 4097"].worst, f"seed={seed}"


def test_reading_past_the_length_hits_the_nan_tail():
    res = by_what(battery.run_battery(uk.load_kernel(str(DATA / "byok_bad_past_length.cu")),
                                      battery.battery_cases(), seed=fresh_seed()))
    assert res["context 4096"].ok                    # 64 full pages: no tail to read
    bad = res["context 4097"]
    assert not bad.ok and "NaN/inf" in bad.reason


def test_a_mishandled_partial_head_group_fails_only_partial_groups():
    res = by_what(battery.run_battery(uk.load_kernel(str(DATA / "byok_bad_partial_group.cu")),
                                      battery.battery_cases(rows_per_block=4),
                                      seed=fresh_seed()))
    partial = [r for w, r in res.items() if w.startswith("partial head group")]
    assert partial and not any(r.ok for r in partial)
    assert all(res[f"context {n}"].ok for n in battery.BOUNDARY_CONTEXTS)   # H=16: 4 groups of 4


needs_sanitizer = pytest.mark.skipif(battery.sanitizer_path() is None,
                                     reason="compute-sanitizer not installed")


@needs_sanitizer
def test_racecheck_reports_the_race():
    bad = battery.sanitize(uk.load_kernel(str(DATA / "byok_bad_race.cu")), "racecheck")
    assert bad["ok"] is False and bad["errors"] and bad["errors"] > 0, bad["output"]


@needs_sanitizer
@pytest.mark.parametrize("tool", battery.SANITIZER_TOOLS)
def test_sanitizer_passes_the_correct_kernel(tool):
    good = battery.sanitize(uk.load_kernel(str(CORRECT)), tool)
    assert good["ok"] and good["errors"] == 0, good["output"]


def test_decode_paged_and_graph_replay_take_a_user_kernel():
    """decode_paged, then a captured step replayed on new lengths (shorter prefixes of the
    same pages, so every position they read is a real row). Before the replay everything the
    step writes is poisoned: the outputs, the partials in the per-device scratch (where the
    decode_paged call left this very batch's partials) and the chunk counts (-1). With the
    lengths changed too, a replay that skipped the user kernel, or ran it on the captured
    lengths, cannot give the new reference."""
    import cupy as cp

    import mlasandbox as mla
    from mlasandbox.compare_paged import compare_paged
    from mlasandbox.dims import preset
    from mlasandbox.paged_inputs import make_paged_inputs

    seed = fresh_seed()
    v = mla.load_kernel(str(CORRECT))
    host = make_paged_inputs(preset("dsv3").with_heads(5), (0, 300, 4097), s_q=2,
                             causal=True, page_size=16, seed=seed)
    dev = {k: (cp.asarray(a) if isinstance(a, np.ndarray) else a)
           for k, a in host.decode_args().items()}
    ref = mla.reference.decode_paged(**host.decode_args())
    cmp = compare_paged(mla.decode_paged(**dev, variant=v), ref)
    assert cmp.ok, f"seed={seed}\n{cmp.summary()}"
    step = mla.PagedDecodeStep(**dev, variant=v)
    graph = step.capture()
    for lengths in ((0, 17, 2000), (0, 300, 4097)):
        step.cache_seqlens[...] = cp.asarray(lengths, dtype=cp.int32)
        poison(step)
        cp.cuda.Device().synchronize()   # the writes are on another stream than the replay
        graph.launch(step.graph_stream)
        step.graph_stream.synchronize()
        want = mla.reference.decode_paged(**{**host.decode_args(),
                                             "cache_seqlens": np.asarray(lengths, np.int32)})
        cmp = compare_paged(step.result, want)
        assert cmp.ok, f"replay with lengths {lengths}, seed={seed}\n{cmp.summary()}"


def test_try_end_to_end(tmp_path):
    from mlasandbox.cli.main import main

    res = CliRunner().invoke(main, ["try", str(CORRECT), "--json", "--ctx", "1,4097",
                                    "--batch", "8", "--lengths", "0,20,4097,1000",
                                    "--repeats", "20", "--repro", str(tmp_path / "r.py")])
    assert res.exit_code == 0, res.output
    data = json.JSONDecoder().raw_decode(res.output.lstrip())[0]
    assert data["ok"] and len(data["battery"]) == 2              # ROWS=4 full, ROWS=8 fast
    names = {r["variant"] for r in data["timing"]["rows"]}
    assert f"{CORRECT}:ROWS=4" in names and f"{CORRECT}:ROWS=8" in names
    assert data["timing"]["noise_floor"]["runs"]
    bad = CliRunner().invoke(main, ["try", str(DATA / "byok_bad_no_rescale.cu"), "--no-time",
                                    "--ctx", "4097", "--json"])
    assert bad.exit_code == 1
    err = json.JSONDecoder().raw_decode(bad.output.lstrip())[0]["error"]
    assert "context 4097" in err and "worst: request 0, query 0, head" in err


def test_a_fault_names_the_phase_and_the_user_kernel():
    """A kernel that follows table entries past a request's pages faults; in a process of
    its own (a fault ends the CUDA context), the synchronizing guard names the phase and the
    kernel, and the battery reports the case failed."""
    import subprocess
    import sys

    spec = str(DATA / "byok_bad_pages.cu")
    proc = subprocess.run([sys.executable, "-m", "mlasandbox.battery", spec],
                          capture_output=True, text=True, timeout=120)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1, text
    assert "PhaseError: phase 'attn'" in text and "byok_bad_pages<ROWS=4" in text, text
    assert "illegal" in text.lower(), text
