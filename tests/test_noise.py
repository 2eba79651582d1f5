"""Noise-floor arithmetic, verdicts against it, and the control-phase judgement (CPU)."""
from __future__ import annotations

import pytest

from mlasandbox.noise import (NO_DIFFERENCE, control_report, interleave_order, noise_floor,
                              threshold, verdict)
from mlasandbox.timing import EVENT_RESOLUTION_US


def test_interleave_alternates_the_order_of_the_arms():
    assert interleave_order(4) == [("a", "b"), ("b", "a"), ("a", "b"), ("b", "a")]
    with pytest.raises(ValueError):
        interleave_order(0)


def test_noise_floor_is_the_p90_of_paired_relative_differences():
    b = [100.0] * 10
    a = [100.0 + d for d in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9)]  # 0 .. 9 %
    nf = noise_floor(a, b)
    assert nf.rel_diffs == tuple(d / 100 for d in range(10))
    assert nf.p90 == pytest.approx(0.081)      # linear interpolation between 8 % and 9 %
    assert nf.max_rel == pytest.approx(0.09)
    assert nf.median_rel == pytest.approx(0.045)
    assert nf.floor == pytest.approx(0.081)    # above the resolution term (0.5 us / ~104 us)
    assert nf.rounds == 10


def test_noise_floor_never_below_the_timer_resolution():
    # identical medians of a 5 us kernel: the timer cannot resolve 10 % there
    nf = noise_floor([5.0] * 10, [5.0] * 10)
    assert nf.p90 == 0.0
    assert nf.floor == pytest.approx(EVENT_RESOLUTION_US / 5.0)
    # unequal arms of a few us: the term is the resolution over the median of all the
    # medians (4.0 here: 3 and 4 us in one arm, 4 and 6 in the other), not one arm's
    nf = noise_floor([3.0, 4.0, 4.0], [4.0, 6.0, 6.0])
    assert nf.resolution_term == pytest.approx(EVENT_RESOLUTION_US / 4.0)
    assert nf.floor == pytest.approx(max(nf.p90, EVENT_RESOLUTION_US / 4.0))


@pytest.mark.parametrize("a,b", [([1.0], [1.0, 2.0]), ([], []), ([0.0], [1.0]),
                                 ([float("nan")], [1.0])])
def test_noise_floor_rejects_bad_input(a, b):
    with pytest.raises(ValueError):
        noise_floor(a, b)


def test_threshold_grows_for_short_times():
    assert threshold(1000.0, 1000.0, 0.02) == 0.02
    assert threshold(5.0, 10.0, 0.02) == pytest.approx(EVENT_RESOLUTION_US / 5.0)


def test_verdicts_against_the_floor():
    v = verdict(98.0, 100.0, 0.03)            # 2 % under a 3 % floor: no number
    assert v.kind == "same" and v.text == NO_DIFFERENCE and not v.measurable
    v = verdict(50.0, 100.0, 0.03)
    assert v.kind == "faster" and v.text == "2.00x faster" and v.ratio == 2.0
    v = verdict(110.0, 100.0, 0.03)
    assert v.kind == "slower" and v.text == "1.10x slower"
    # a 0.8 % cost under a 2 % floor is "no measurable cost"
    assert verdict(142.54, 141.35, 0.02).text == NO_DIFFERENCE
    # exactly at the floor is not above it
    assert verdict(103.0, 100.0, 0.03).kind == "same"
    with pytest.raises(ValueError):
        verdict(0.0, 1.0, 0.1)


def test_control_stable_and_unstable():
    series = [("start", 10.0), ("before a", 10.1), ("end", 9.95)]
    ok = control_report(series, 0.05)
    assert ok.stable is True and ok.warning is None
    assert ok.max_move == pytest.approx(0.01) and ok.drift == pytest.approx(-0.005)
    bad = control_report([("start", 10.0), ("before x", 11.0), ("end", 10.0)], 0.05)
    assert bad.stable is False
    assert "harness is unstable" in bad.warning and "before x" in bad.warning
    # a 5 us control: 6% is under the timer's resolution there (0.5 / 5 = 10%), so stable
    # even at a 2% floor; the same move of a 50 us control is not
    assert control_report([("start", 5.0), ("before x", 5.3), ("end", 5.0)], 0.02).stable
    assert not control_report([("start", 50.0), ("before x", 53.0), ("end", 50.0)],
                              0.02).stable
    unjudged = control_report(series, None)
    assert unjudged.stable is None and unjudged.warning is None
    with pytest.raises(ValueError):
        control_report([], 0.1)
