"""The clock sampler (sandbox/clocks.py) on the host: its summary, its thread, its failure
modes and the cells the bench prints. The device side (NVML on a real board, the bench's rows)
is in tests/test_gpu_lab.py."""
from __future__ import annotations

import ctypes
import threading
import time

import pytest

from mlasandbox import clocks
from mlasandbox.clocks import ClockSample, ClockSampler, clock_cell, clocks_line, summarize_samples


def test_the_summary_is_medians_least_and_shares_of_the_reads():
    s = summarize_samples([ClockSample(1980, 0x0, 500_000), ClockSample(1900, 0x4, 700_000),
                           ClockSample(1890, 0x4 | 0x20, 690_000),
                           ClockSample(1950, 0x80, 650_000)])
    assert s == {"clock_samples": 4, "sm_mhz": 1925.0, "sm_mhz_min": 1890.0,
                 "power_w": 670.0, "power_capped": 0.75, "thermal": 0.25}
    assert set(s) == set(clocks.NO_CLOCKS)
    assert summarize_samples([]) is None
    # reasons that are neither power nor heat (idle 0x1, a clock setting 0x2) count as neither
    idle = summarize_samples([ClockSample(345, 0x1 | 0x2, 70_000)])
    assert idle["power_capped"] == 0.0 and idle["thermal"] == 0.0


@pytest.mark.parametrize("row, cell", [
    ({}, "-"), ({"sm_mhz": None, "power_capped": None}, "-"),
    ({"sm_mhz": 1980.0, "power_capped": 0.0, "thermal": 0.0}, "1,980"),
    ({"sm_mhz": 1905.0, "power_capped": 0.25, "thermal": 0.0}, "1,905 cap"),
    ({"sm_mhz": 1905.0, "power_capped": 0.24, "thermal": 0.0}, "1,905"),
    ({"sm_mhz": 1755.0, "power_capped": 1.0, "thermal": 0.5}, "1,755 cap hot"),
])
def test_the_cell_marks_a_clock_the_cap_held(row, cell):
    assert clock_cell(row) == cell


def test_the_line_under_the_table_says_how_or_why_not():
    rows = [{"sm_mhz": 1905.0}]
    assert clocks_line({"rows": rows}) == ""  # a result from before clocks were read
    line = clocks_line({"meta": {"clocks": "NVML every 5 ms"}, "rows": rows})
    assert line.startswith("SM MHz: the median SM clock") and "NVML every 5 ms" in line
    assert ">= 25%" in line
    why = "clocks not read: no NVML library (libnvidia-ml.so.1: cannot open)"
    assert clocks_line({"meta": {"clocks": why}, "rows": [{"sm_mhz": None}]}) == why


def _counting_read(state):
    def read():
        state["n"] += 1
        return ClockSample(1900 + state["n"], 0x4 if state["n"] % 2 else 0, 600_000)
    return read


def _wait_for(cond, timeout_s=5.0):
    """Until cond() holds (a loaded CI machine may wake the sampler's thread late)."""
    t0 = time.perf_counter()
    while not cond():
        assert time.perf_counter() - t0 < timeout_s, "the sampler's thread never read"
        time.sleep(0.001)
    return time.perf_counter() - t0


def test_the_sampler_reads_at_start_on_its_thread_and_at_stop():
    state = {"n": 0}
    sampler = ClockSampler(_counting_read(state), interval_s=0.001)
    t0 = time.perf_counter()
    sampler.start()
    _wait_for(lambda: state["n"] >= 4)
    s = sampler.stop()
    elapsed_ms = (time.perf_counter() - t0) * 1e3
    # one read at start, one at stop, and the thread's in between: at most one a ms
    assert 4 <= s["clock_samples"] == state["n"] <= elapsed_ms + 2
    assert s["sm_mhz_min"] == 1901.0 and 0.3 <= s["power_capped"] <= 0.7
    assert not any(t.name == "mlasandbox-clocks" for t in threading.enumerate())
    # a second measurement starts from no samples
    sampler.start()
    s2 = sampler.stop()
    assert s2["clock_samples"] < s["clock_samples"] + 60 and s2["sm_mhz_min"] > 1901.0


def test_a_failing_read_ends_the_sampling_and_keeps_what_it_had():
    calls = {"n": 0}

    def read():
        calls["n"] += 1
        if calls["n"] > 2:
            raise RuntimeError("nvmlDeviceGetClockInfo failed: GPU is lost")
        return ClockSample(1980, 0, 500_000)

    sampler = ClockSampler(read, interval_s=0.001)
    sampler.start()
    _wait_for(lambda: sampler.error is not None)
    s = sampler.stop()
    assert s["clock_samples"] == 2 and "GPU is lost" in sampler.error
    assert calls["n"] == 3   # no read after the failure, the one at stop included


def test_misuse_is_an_error_not_a_silent_sample():
    with pytest.raises(ValueError, match="interval_s"):
        ClockSampler(lambda: ClockSample(1, 0, 0), interval_s=0)
    sampler = ClockSampler(lambda: ClockSample(1, 0, 0))
    with pytest.raises(RuntimeError, match="without start"):
        sampler.stop()
    sampler.start()
    with pytest.raises(RuntimeError, match="already sampling"):
        sampler.start()
    sampler.stop()


def test_open_without_nvml_says_why_and_gives_no_sampler(monkeypatch):
    cupy = pytest.importorskip("cupy")
    monkeypatch.setattr(cupy.cuda.runtime, "deviceGetPCIBusId", lambda d: "0000:00:06.0")

    def no_lib(name, *a, **k):
        raise OSError(f"{name}: cannot open shared object file")
    monkeypatch.setattr(ctypes, "CDLL", no_lib)
    sampler, note = ClockSampler.open(0)
    assert sampler is None
    assert note.startswith("clocks not read: no NVML library") and "libnvidia-ml" in note


def test_open_on_a_machine_without_a_device_gives_no_sampler():
    cupy = pytest.importorskip("cupy")
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception:
        n = 0
    if n:
        pytest.skip("a device is here: tests/test_gpu_lab.py reads its clocks")
    sampler, note = ClockSampler.open(0)
    assert sampler is None and note.startswith("clocks not read:")


def test_a_timing_without_clocks_still_has_the_columns():
    from mlasandbox.timing import Timing, summarize

    d = Timing(summarize([1.0, 2.0]), "events").as_dict()
    assert all(k in d and d[k] is None for k in clocks.NO_CLOCKS)
    s = summarize_samples([ClockSample(1900, 4, 600_000)])
    d = Timing(summarize([1.0, 2.0]), "events", clocks=s).as_dict()
    assert d["sm_mhz"] == 1900.0 and d["power_capped"] == 1.0
