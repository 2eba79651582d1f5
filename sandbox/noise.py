"""The noise floor and the control phase: when a difference is a result.

* **A/A noise floor** (the A/A test). Below the split gate, `split` launches exactly the kernel
  `per_head` launches (same instance, one slice): identical code, so any difference between
  them is measurement noise. The bench times the two interleaved (A B B A A B ...: drift
  through the run hits both arms alike) for `rounds` rounds, each round a full median of
  many runs, and the floor is the p90 of the paired relative differences |a_i - b_i| / b_i.
  The event timer's resolution (~0.5 us) bounds what any one median can resolve, so the
  floor is never below 0.5 us / median either.
* **Verdicts.** A difference between two medians counts only when it exceeds the floor (and
  the timer resolution at that size): otherwise it prints as "no measurable difference",
  never as a small number: a difference smaller than the noise floor is not a small
  difference, it is no measurement at all.
* **Control phase.** q_absorb is untouched by every variant; it is timed at the
  start, before each variant and at the end. If it moves more than the floor, the harness
  moved, and the bench says so.

Pure Python: tested on the CPU.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from .timing import EVENT_RESOLUTION_US, percentile

__all__ = ["NoiseFloor", "noise_floor", "interleave_order", "threshold", "Verdict", "verdict",
           "ControlReport", "control_report", "NO_DIFFERENCE", "FLOOR_QUANTILE"]

NO_DIFFERENCE = "no measurable difference"
FLOOR_QUANTILE = 0.9


def interleave_order(rounds: int) -> list[tuple[str, str]]:
    """The order of the two arms per round: AB, BA, AB, ... (ABBA pairs cancel linear drift)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    return [("a", "b") if i % 2 == 0 else ("b", "a") for i in range(rounds)]


@dataclass(frozen=True)
class NoiseFloor:
    floor: float              # relative: max(p90 of the paired differences, resolution term)
    p90: float                # p90 of |a_i - b_i| / b_i
    max_rel: float            # the largest paired difference
    median_rel: float
    resolution_term: float    # EVENT_RESOLUTION_US / median of the arms
    rounds: int
    a_us: tuple
    b_us: tuple
    rel_diffs: tuple

    def as_dict(self) -> dict:
        d = asdict(self)
        d["a_us"], d["b_us"], d["rel_diffs"] = list(self.a_us), list(self.b_us), \
            list(self.rel_diffs)
        return d


def noise_floor(a_us, b_us, quantile: float = FLOOR_QUANTILE,
                resolution_us: float = EVENT_RESOLUTION_US) -> NoiseFloor:
    """The floor from paired medians of two arms that run identical code."""
    a, b = [float(x) for x in a_us], [float(x) for x in b_us]
    if len(a) != len(b) or not a:
        raise ValueError(f"need the same number (>= 1) of medians per arm, got {len(a)} "
                         f"and {len(b)}")
    if any(not (x > 0 and math.isfinite(x)) for x in a + b):
        raise ValueError("medians must be positive and finite")
    rel = [abs(x - y) / y for x, y in zip(a, b)]
    srt = sorted(rel)
    mid = percentile(sorted(a + b), 0.5)
    res = resolution_us / mid
    p = percentile(srt, quantile)
    return NoiseFloor(floor=max(p, res), p90=p, max_rel=srt[-1],
                      median_rel=percentile(srt, 0.5), resolution_term=res, rounds=len(a),
                      a_us=tuple(a), b_us=tuple(b), rel_diffs=tuple(rel))


def threshold(x_us: float, y_us: float, floor: float,
              resolution_us: float = EVENT_RESOLUTION_US) -> float:
    """The smallest relative difference between x and y that counts as a result."""
    return max(float(floor), resolution_us / max(1e-12, min(x_us, y_us)))


@dataclass(frozen=True)
class Verdict:
    kind: str          # "faster" | "slower" | "same"
    ratio: float       # old / new: > 1 means `new` is faster
    rel: float         # |new - old| / old
    threshold: float
    text: str

    @property
    def measurable(self) -> bool:
        return self.kind != "same"

    def as_dict(self) -> dict:
        return asdict(self)


def verdict(new_us: float, old_us: float, floor: float) -> Verdict:
    """How `new` compares with `old`, against the noise floor."""
    if not (new_us > 0 and old_us > 0):
        raise ValueError(f"times must be positive, got {new_us}, {old_us}")
    rel = abs(new_us - old_us) / old_us
    thr = threshold(new_us, old_us, floor)
    ratio = old_us / new_us
    if rel <= thr:
        return Verdict("same", ratio, rel, thr, NO_DIFFERENCE)
    if new_us < old_us:
        return Verdict("faster", ratio, rel, thr, f"{ratio:.2f}x faster")
    return Verdict("slower", ratio, rel, thr, f"{1 / ratio:.2f}x slower")


@dataclass(frozen=True)
class ControlReport:
    series: tuple            # (label, median_us) in the order measured
    start_us: float
    end_us: float
    drift: float             # (end - start) / start
    max_move: float          # max |c_i - start| / start
    floor: float | None
    stable: bool | None      # None when there is no floor to judge against
    warning: str | None

    def as_dict(self) -> dict:
        d = asdict(self)
        d["series"] = [{"label": lab, "median_us": v} for lab, v in self.series]
        return d


def control_report(series, floor: float | None) -> ControlReport:
    """Judge the control phase's medians (label, us) against the floor."""
    series = tuple((str(lab), float(v)) for lab, v in series)
    if not series:
        raise ValueError("the control phase was never measured")
    start, end = series[0][1], series[-1][1]
    moves = [abs(v - start) / start for _, v in series]
    max_move = max(moves)
    stable, warning = None, None
    if floor is not None:
        worst = max(range(len(series)), key=lambda i: moves[i])
        thr = threshold(series[worst][1], start, floor)
        stable = max_move <= thr
        if not stable:
            warning = (f"the control phase q_absorb moved {max_move:.1%} "
                       f"({start:.2f} -> {series[worst][1]:.2f} us at '{series[worst][0]}'), "
                       f"more than the noise floor ({thr:.1%}): the harness is unstable; "
                       f"differences in this run may be the box, not the kernels")
    return ControlReport(series, start, end, (end - start) / start, max_move, floor, stable,
                         warning)
