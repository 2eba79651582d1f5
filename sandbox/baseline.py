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
import statistics

from .noise import NO_DIFFERENCE, verdict

__all__ = ["load_result", "compare_runs", "SchemaError"]


class SchemaError(ValueError):
    """The file is not a saved `mlasandbox bench` result."""


def load_result(path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as exc:
        raise SchemaError(f"cannot read baseline {path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise SchemaError(f"baseline {path} is not JSON: {exc}") from None
    schema = data.get("schema") if isinstance(data, dict) else None
    if not (isinstance(schema, str) and schema.startswith("mlasandbox.bench/")):
        raise SchemaError(f"baseline {path} is not a saved `mlasandbox bench --json` result "
                          f"(schema {schema!r})")
    for key in ("rows", "noise_floor", "control"):
        if key not in data:
            raise SchemaError(f"baseline {path} lacks {key!r}")
    return data


def _key(r):
    return (r["variant"], r["cache"], r.get("q"), r["n_ctx"], r["phase"])


def _control_median(run: dict) -> float | None:
    vals = [s["median_us"] for s in run["control"].get("series", [])]
    return statistics.median(vals) if vals else None


def compare_runs(current: dict, baseline: dict) -> dict:
    """Phase-by-phase verdicts, the control phase before/after, and what does not match."""
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
        row = {"variant": k[0], "cache": k[1], "q": k[2], "n_ctx": k[3], "phase": k[4],
               "baseline_us": old, "current_us": new, "ratio": old / new}
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
