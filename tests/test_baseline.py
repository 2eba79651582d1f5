"""`bench --vs`: phase-by-phase verdicts, the control phase before/after (CPU)."""
from __future__ import annotations

import copy
import json

import pytest

from lab_fakes import FakeBackend
from mlasandbox.baseline import SchemaError, compare_runs, load_result
from mlasandbox.bench import run_bench
from mlasandbox.noise import NO_DIFFERENCE

OPTS = dict(contexts=(64, 131072), variants=("per_head", "split", "batched12"))


@pytest.fixture(scope="module")
def base():
    return run_bench(backend=FakeBackend(seed=1), **OPTS)


def test_a_rerun_of_the_same_code_is_no_measurable_difference(base):
    again = run_bench(backend=FakeBackend(seed=2), **OPTS)
    cmp = compare_runs(again, base)
    assert cmp["floor"] == max(base["noise_floor"]["floor"], again["noise_floor"]["floor"])
    assert cmp["rows"] and all(r["text"] == NO_DIFFERENCE for r in cmp["rows"])
    assert cmp["summary"]["same"] == len(cmp["rows"])
    assert cmp["control"]["moved"] is False and cmp["control"]["text"] == NO_DIFFERENCE
    assert not cmp["warnings"]


def test_a_real_change_is_reported_with_its_ratio(base):
    faster = copy.deepcopy(base)
    for r in faster["rows"]:
        if r["variant"] == "batched12" and r["n_ctx"] == 131072 and r["phase"] == "attn":
            r["median_us"] /= 2
    cmp = compare_runs(faster, base)
    row = next(r for r in cmp["rows"] if (r["variant"], r["n_ctx"], r["phase"]) ==
               ("batched12", 131072, "attn"))
    assert row["verdict"] == "faster" and row["text"] == "2.00x faster"
    assert row["ratio"] == pytest.approx(2.0)               # baseline / current
    assert row["baseline_us"] == pytest.approx(2 * row["current_us"])
    assert cmp["summary"]["faster"] == 1


def _clock(run, mhz, where=lambda r: True):
    for r in run["rows"]:
        if r["phase"] != "q_absorb" and where(r):
            r["sm_mhz"] = mhz


def test_a_phase_whose_clock_moved_is_marked_and_warned(base):
    """The SM clock of a phase moving by more than 2% (two of the board's 15 MHz steps either
    way, baseline.CLOCK_TOLERANCE) between two runs is a different power state: the row says
    so and a warning counts them; 2% or less is not, and a run without clocks says nothing."""
    then = copy.deepcopy(base)
    _clock(then, 1980.0)
    now = copy.deepcopy(base)
    _clock(now, 1980.0)
    _clock(now, 1935.0, lambda r: r["variant"] == "split" and r["n_ctx"] == 131072)  # -2.3%
    _clock(now, 1941.0, lambda r: r["variant"] == "per_head")                       # -1.97%
    cmp = compare_runs(now, then)
    moved = [(r["variant"], r["n_ctx"]) for r in cmp["rows"] if r["clock_differs"]]
    assert moved and set(moved) == {("split", 131072)}
    assert all(r["clock_differs"] is False for r in cmp["rows"] if r["variant"] == "per_head")
    row = next(r for r in cmp["rows"] if r["clock_differs"])
    assert (row["baseline_mhz"], row["current_mhz"]) == (1980.0, 1935.0)
    assert row["verdict"] == "same"   # the time is judged as before: the clock is beside it
    (w,) = [w for w in cmp["warnings"] if "SM clock moved" in w]
    assert f"at {len(moved)} of {len(cmp['rows'])} phases" in w and "1,980 then, 1,935 now" in w
    # the same clocks: no warning
    assert not [w for w in compare_runs(then, copy.deepcopy(then))["warnings"]
                if "SM clock" in w]
    # the table beside the verdicts: both clocks, the moved one marked
    import io

    from rich.console import Console

    from mlasandbox.cli.lab_render import vs_table
    out = io.StringIO()
    Console(file=out, width=140, color_system=None).print(vs_table(cmp))
    text = out.getvalue()
    assert "SM MHz then/now" in text and "1,980/1,935 *" in text
    assert "1,980/1,941" in text and "1,980/1,941 *" not in text


def test_the_control_moving_between_runs_is_a_warning(base):
    box_changed = copy.deepcopy(base)
    for s in box_changed["control"]["series"]:
        s["median_us"] *= 1.5
    cmp = compare_runs(box_changed, base)
    assert cmp["control"]["moved"] is True and "moved" in cmp["control"]["text"]
    assert cmp["control"]["current_us"] == pytest.approx(1.5 * cmp["control"]["baseline_us"])
    # the median of each run's control series, not one point of it
    uneven = copy.deepcopy(base)
    series = uneven["control"]["series"]
    for s, us in zip(series, [10.0, 12.0, 11.0, 30.0] * len(series)):
        s["median_us"] = us
    vals = sorted(s["median_us"] for s in series)
    mid = (vals[(len(vals) - 1) // 2] + vals[len(vals) // 2]) / 2
    assert len(series) >= 3 and mid != series[-1]["median_us"]
    assert compare_runs(uneven, base)["control"]["current_us"] == pytest.approx(mid)
    assert any("control phase q_absorb moved" in w for w in cmp["warnings"])


def test_mismatches_are_listed(base):
    other = run_bench(backend=FakeBackend(), contexts=(64, 8192),
                      variants=("per_head", "split"))
    other["meta"]["device"] = "Another GPU"
    cmp = compare_runs(other, base)
    assert ["per_head", "f16", "f32", 8192, "attn"] in cmp["only_in_current"]
    assert ["batched12", "f16", "f32", 64, "step"] in cmp["only_in_baseline"]
    assert any("device differs" in w for w in cmp["warnings"])


def test_no_floor_means_no_verdicts(base):
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    a["noise_floor"]["floor"] = b["noise_floor"]["floor"] = None
    cmp = compare_runs(a, b)
    assert cmp["floor"] is None and all(r["verdict"] is None for r in cmp["rows"])
    assert any("neither run has a noise floor" in w for w in cmp["warnings"])


def test_load_result(tmp_path, base):
    good = tmp_path / "b.json"
    good.write_text(json.dumps(base))
    assert load_result(good)["schema"] == base["schema"]
    for text, words in (("{", "not JSON"), ('{"schema": "x"}', "not a saved"),
                        ('{"schema": "mlasandbox.bench/1"}', "lacks")):
        p = tmp_path / "bad.json"
        p.write_text(text)
        with pytest.raises(SchemaError, match=words):
            load_result(p)
    with pytest.raises(SchemaError, match="cannot read"):
        load_result(tmp_path / "missing.json")


def test_a_variant_that_failed_its_check_is_not_judged(base):
    wrong = run_bench(backend=FakeBackend(fail_check={"batched12"}, scale=0.5), **OPTS)
    cmp = compare_runs(wrong, base)
    rows = [r for r in cmp["rows"] if r["variant"] == "batched12"]
    assert rows and all(r["verdict"] == "invalid" for r in rows)
    # a baseline whose check failed judges nothing either, whichever side it is on
    back = compare_runs(base, wrong)
    rows = [r for r in back["rows"] if r["variant"] == "batched12"]
    assert rows and all(r["verdict"] == "invalid" for r in rows)
    assert all(r["verdict"] == "faster" for r in cmp["rows"] if r["variant"] == "split"
               and r["n_ctx"] == 131072)
    # rows follow the run's variant order, then context, then phase
    assert [r["variant"] for r in cmp["rows"]][:1] == ["per_head"]
    assert [r["phase"] for r in cmp["rows"][:3]] == ["attn", "combine", "step"]
