"""The timing statistics and the repeat/pre-roll arithmetic (CPU); the GPU path is in
test_gpu_lab.py."""
from __future__ import annotations

import math

import numpy as np
import pytest

from mlasandbox.timing import (Timing, choose_repeats, percentile, preroll_us, summarize)


@pytest.mark.parametrize("q", [0.0, 0.1, 0.25, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("n", [1, 2, 7, 10, 101])
def test_percentile_matches_numpy_linear(q, n, seeds):
    xs = sorted(np.random.default_rng(seeds.one()).uniform(1, 100, n).tolist())
    assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, 100 * q)), rel=1e-12)


def test_percentile_rejects_bad_input():
    with pytest.raises(ValueError):
        percentile([], 0.5)
    with pytest.raises(ValueError):
        percentile([1.0], 1.5)


def test_summarize_median_spread_and_mad():
    s = summarize([10, 11, 9, 10, 50])  # one outlier
    assert s.n == 5 and s.median_us == 10 and s.min_us == 9 and s.max_us == 50
    assert s.mad_us == 1.0          # |x - 10| = 0, 1, 1, 0, 40 -> median 1: robust
    assert s.mean_us == pytest.approx(18.0)
    assert s.p10_us == pytest.approx(np.percentile([9, 10, 10, 11, 50], 10))
    assert s.p90_us == pytest.approx(np.percentile([9, 10, 10, 11, 50], 90))
    assert s.rel_mad == pytest.approx(0.1)


def test_summarize_even_count_median_is_the_mean_of_the_middle_two():
    assert summarize([1, 2, 3, 4]).median_us == 2.5


@pytest.mark.parametrize("bad", [[], [1.0, float("nan")], [1.0, -2.0], [math.inf]])
def test_summarize_rejects_broken_timers(bad):
    with pytest.raises(ValueError):
        summarize(bad)


def test_choose_repeats_fills_the_target_within_bounds():
    # a 6 ms phase (per_head at 131072) gets its minimum, a 5 us phase its maximum
    assert choose_repeats(6000.0, 0.15, 10, 100) == 25
    assert choose_repeats(7000.0, 0.15, 10, 100) == 22   # 21.4: rounded up, the target filled
    assert choose_repeats(6000.0, 0.01, 10, 100) == 10
    assert choose_repeats(5.0, 0.15, 10, 100) == 100
    assert choose_repeats(0.0, 0.15, 10, 100) == 100
    with pytest.raises(ValueError):
        choose_repeats(10.0, 0.1, 5, 4)


def test_preroll_covers_the_cpu_enqueue_time():
    assert preroll_us(0.0) == 20.0
    assert preroll_us(30.0) == 80.0       # 2 x 30 + 20
    assert preroll_us(1e9) == 5000.0      # capped
    assert preroll_us(float("nan")) == 5000.0  # unknown enqueue time: the cap


def test_timing_as_dict_is_flat_and_serialisable():
    import json

    t = Timing(summarize([1.0, 2.0, 3.0]), "graph", "", [1.0, 2.0, 3.0], 20.0)
    d = t.as_dict()
    assert d["mode"] == "graph" and d["median_us"] == 2.0 and "samples_us" not in d
    assert t.as_dict(samples=True)["samples_us"] == [1.0, 2.0, 3.0]
    json.dumps(d)
