"""`bench --vs BASELINE.json`: compare a run with a saved one, phase by phase.

Rows are matched on (variant, cache dtype, q dtype, n_ctx, phase). Each pair gets a verdict
against the noise floor (noise.verdict): the larger of the two runs' A/A floors, since either
run's noise can fake a difference. Under it the pair prints "no measurable difference".

The control phase is reported before/after: q_absorb's median over each
run's control series. If it moved by more than the floor, the box or the harness changed
between the runs, and every other difference in the table is suspect: the comparison says so
(`control.moved`), instead of letting a faster box pass for a faster kernel.

Pure Python: tested on the CPU.
"""
from __future__ import annotations

import json
import math
import statistics

from .limits import MAX_INPUT_FILE_BYTES, read_input_text
from .noise import NO_DIFFERENCE, verdict

__all__ = ["load_result", "compare_runs", "SchemaError"]


class SchemaError(ValueError):
    """The file is not a saved `mlasandbox bench` result."""


# A saved bench result is a few MB at most: rows of variants x contexts x phases
MAX_BASELINE_BYTES = MAX_INPUT_FILE_BYTES


def load_result(path) -> dict:
    """The saved `bench --json` result at `path` (the file of `bench --vs`), checked as deep
    as compare_runs reads it, so that a bad baseline is refused before anything runs.
    SchemaError naming --vs and what is wrong."""
    try:
        text = read_input_text(path, "baseline", MAX_BASELINE_BYTES)
    except ValueError as exc:   # missing, not a regular file, oversize, not UTF-8
        raise SchemaError(f"--vs: {exc}") from None
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested past the parser
        raise SchemaError(f"--vs: baseline {str(path)!r} is not JSON: "
                          f"{exc or type(exc).__name__}") from None
    schema = data.get("schema") if isinstance(data, dict) else None
    if not (isinstance(schema, str) and schema.startswith("mlasandbox.bench/")):
        raise SchemaError(f"--vs: baseline {str(path)!r} is not a saved `mlasandbox bench "
                          f"--json` result (schema {schema!r})")
    problem = _run_problem(data)
    if problem:
        raise SchemaError(f"--vs: baseline {str(path)!r} {problem}")
    return data


def _real(v) -> bool:
    """A finite JSON number: an integer too large for a float is not one (isfinite would
    raise OverflowError on it)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def _positive(v) -> bool:
    return _real(v) and v > 0


def _run_problem(data: dict) -> str | None:
    """What in a saved result compare_runs could not read, or None."""
    for key, kind in (("rows", list), ("noise_floor", dict), ("control", dict)):
        if key not in data:
            return f"lacks {key!r}"
        if not isinstance(data[key], kind):
            return f"has {key!r} of type {type(data[key]).__name__}, not {kind.__name__}"
    for key in ("meta", "config"):
        if not isinstance(data.get(key, {}), dict):
            return f"has {key!r} of type {type(data[key]).__name__}, not dict"
    floor = data["noise_floor"].get("floor")
    if floor is not None and not (_real(floor) and floor >= 0):
        return f"has a noise floor of {floor!r:.40}, not a number >= 0 or null"
    series = data["control"].get("series", [])
    if not isinstance(series, list):
        return "has a control series that is not a list"
    for i, s in enumerate(series):
        if not (isinstance(s, dict) and _positive(s.get("median_us"))):
            return f"has control series entry {i} without a median_us > 0: {s!r:.80}"
    for i, r in enumerate(data["rows"]):
        if not isinstance(r, dict):
            return f"has rows[{i}] that is not an object: {r!r:.80}"
        if not isinstance(r.get("phase"), str):
            return f"has rows[{i}] without a phase"
        if r["phase"] == "q_absorb":   # the control's rows: compare_runs reads the series
            continue
        for key, ok, want in (
                ("variant", lambda v: isinstance(v, str), "a name"),
                ("cache", lambda v: isinstance(v, str), "a dtype"),
                ("q", lambda v: v is None or isinstance(v, str), "a dtype or null"),
                ("n_ctx", lambda v: v is None or isinstance(v, int) and not isinstance(v, bool),
                 "an integer or null"),
                ("median_us", _positive, "a number > 0"),
                ("sm_mhz", lambda v: v is None or _positive(v), "a number > 0 or null")):
            # compare_runs reads q and sm_mhz (absent before clocks were read) with .get
            if key not in r and key not in ("q", "sm_mhz"):
                return f"has rows[{i}] without {key!r}"
            if not ok(r.get(key)):
                return f"has rows[{i}] whose {key!r} is {r.get(key)!r:.40}, not {want}"
    return None


def _key(r):
    return (r["variant"], r["cache"], r.get("q"), r["n_ctx"], r["phase"])


def _control_median(run: dict) -> float | None:
    vals = [s["median_us"] for s in run["control"].get("series", [])]
    return statistics.median(vals) if vals else None


# Two medians of the SM clock within this relative distance are one power state: the board
# moves its clock in 15 MHz steps (0.8% of the H100's 1,980), so 2% is two steps either way.
CLOCK_TOLERANCE = 0.02


def _clocks_differ(old: float | None, new: float | None) -> bool | None:
    """Whether two phases ran at different SM clocks (None where a run did not read it;
    load_result has refused a clock that is not a number > 0)."""
    if old is None or new is None:
        return None
    return abs(new - old) / old > CLOCK_TOLERANCE


def compare_runs(current: dict, baseline: dict) -> dict:
    """Phase-by-phase verdicts, the control phase before/after, and what does not match:
    among it the phases whose SM clock (sandbox/clocks.py) moved between the runs."""
    floors = [r["noise_floor"].get("floor") for r in (current, baseline)]
    floors = [f for f in floors if f is not None]
    floor = max(floors) if floors else None
    warnings = []
    if floor is None:
        warnings.append("neither run has a noise floor: every difference is reported as "
                        "measured, none is judged")
    cm, bm = current.get("meta", {}), baseline.get("meta", {})
    for field in ("device", "driver", "cuda_runtime", "cupy"):
        if cm.get(field) != bm.get(field):
            warnings.append(f"{field} differs: baseline {bm.get(field)!r}, now {cm.get(field)!r}")
    cd = current.get("config", {}).get("dims")
    bd = baseline.get("config", {}).get("dims")
    if cd != bd:
        warnings.append(f"dims differ: baseline {bd}, now {cd}")

    cur = {_key(r): r for r in current["rows"] if r["phase"] != "q_absorb"}
    base = {_key(r): r for r in baseline["rows"] if r["phase"] != "q_absorb"}
    order = {v: i for i, v in enumerate(current.get("config", {}).get("variants", []))}
    phase_order = {"attn": 0, "combine": 1, "step": 2}
    rows = []
    for k in sorted(set(cur) & set(base), key=lambda k: (order.get(k[0], len(order)), k[0],
                                                         k[1], str(k[2]), k[3] or 0,
                                                         phase_order.get(k[4], 9))):
        new, old = cur[k]["median_us"], base[k]["median_us"]
        mhz_old, mhz_new = base[k].get("sm_mhz"), cur[k].get("sm_mhz")
        row = {"variant": k[0], "cache": k[1], "q": k[2], "n_ctx": k[3], "phase": k[4],
               "baseline_us": old, "current_us": new, "ratio": old / new,
               "baseline_mhz": mhz_old, "current_mhz": mhz_new,
               "clock_differs": _clocks_differ(mhz_old, mhz_new)}
        if cur[k].get("check_ok") is False or base[k].get("check_ok") is False:
            # a wrong kernel's time is not a result, faster or not
            row.update(verdict="invalid", text="not a result: failed its correctness check",
                       threshold=None, rel=abs(new - old) / old)
        elif floor is not None:
            v = verdict(new, old, floor)
            row.update(verdict=v.kind, text=v.text, threshold=v.threshold, rel=v.rel)
        else:
            row.update(verdict=None, text=f"{old / new:.2f}x (no floor)", threshold=None,
                       rel=abs(new - old) / old)
        rows.append(row)

    moved = [r for r in rows if r["clock_differs"]]
    if moved:
        r = moved[0]
        warnings.append(
            f"the SM clock moved by more than {CLOCK_TOLERANCE:.0%} between the runs at "
            f"{len(moved)} of {len(rows)} phases (first: {r['variant']} {r['phase']} at n_ctx "
            f"{r['n_ctx']}, {r['baseline_mhz']:,.0f} then, {r['current_mhz']:,.0f} now): their "
            "differences are partly the board's power state, not only the kernels'")

    c_old, c_new = _control_median(baseline), _control_median(current)
    control = {"phase": "q_absorb", "baseline_us": c_old, "current_us": c_new,
               "baseline_series": baseline["control"].get("series", []),
               "current_series": current["control"].get("series", []), "moved": None,
               "text": None}
    if c_old and c_new:
        if floor is not None:
            v = verdict(c_new, c_old, floor)
            control.update(moved=v.measurable, rel=v.rel, threshold=v.threshold,
                           text=(NO_DIFFERENCE if not v.measurable else
                                 f"moved {v.rel:.1%} ({v.text})"))
            if v.measurable:
                warnings.append(
                    f"the control phase q_absorb moved {v.rel:.1%} between the runs (floor "
                    f"{v.threshold:.1%}): the harness or the box changed, so the differences "
                    "below may not be the kernels'")
        else:
            control.update(rel=abs(c_new - c_old) / c_old)
    return {"floor": floor, "rows": rows, "control": control,
            "only_in_baseline": [list(k) for k in sorted(set(base) - set(cur), key=str)],
            "only_in_current": [list(k) for k in sorted(set(cur) - set(base), key=str)],
            "warnings": warnings,
            "summary": {kind: sum(1 for r in rows if r["verdict"] == kind)
                        for kind in ("faster", "slower", "same", "invalid")}}
