"""The SM clock and the board's power while a measurement runs (NVML, through ctypes).

A Hopper board holds its power under a cap (700 W on the H100 machines here, nvidia-smi) by
lowering the SM clock, so a step's microseconds depend on how much power it draws as well as
on its work, and on what ran before it. docs/measurement.md ("The SM clock beside every
time") has the measurements: timed on end as the bench times a phase, wgmma64 at B = 128 x
4096 x 128 heads ran under the cap at 1,890-1,928 MHz where FlashMLA's call ran uncapped at
1,980. So the bench reports, for every timed phase, the SM clock over its timed runs and how
often the cap held it: two kernels timed at different clocks are compared under different
power, not only different code.

`ClockSampler.open(device_id)` gives `(sampler, note)`: a sampler, or None and why not (no
NVML library, no such device). `start()` takes a sample and starts a thread that takes one
every `interval_s`; `stop()` takes a last one, joins the thread and returns `summary()` of the
samples: the SM clock (median and least, MHz), NVML's board power (median, W; NVML averages
it over its own window, so it lags a short run) and the share of samples in which the power
cap (NVML's software power cap or hardware power brake) or a thermal slowdown held the clock.
The reads release the GIL (ctypes), so the thread does not hold up the timer's launches.
"""
from __future__ import annotations

import ctypes
import statistics
import threading
from dataclasses import dataclass
from typing import Callable

__all__ = ["ClockSampler", "ClockSample", "summarize_samples", "POWER_CAP_BITS",
           "THERMAL_BITS", "CAPPED_SHARE", "NO_CLOCKS", "clock_cell", "clocks_line"]

# nvmlClocksEventReasons bits (nvml.h): SwPowerCap 0x4, HwPowerBrakeSlowdown 0x80;
# SwThermalSlowdown 0x20, HwThermalSlowdown 0x40.
POWER_CAP_BITS = 0x4 | 0x80
THERMAL_BITS = 0x20 | 0x40
NVML_CLOCK_SM = 1
# A phase is called held by the cap where at least this share of its samples saw it.
CAPPED_SHARE = 0.25
DEFAULT_INTERVAL_S = 0.005


@dataclass(frozen=True)
class ClockSample:
    sm_mhz: int
    reasons: int     # the clock-event reason bits
    power_mw: int


# The summary's keys, every one None: a timing without samples still has the columns.
NO_CLOCKS = dict.fromkeys(("clock_samples", "sm_mhz", "sm_mhz_min", "power_w", "power_capped",
                           "thermal"))


def summarize_samples(samples: list[ClockSample]) -> dict | None:
    """The summary the bench stores with a timing (NO_CLOCKS' keys; None for no samples)."""
    if not samples:
        return None
    n = len(samples)
    return {"clock_samples": n,
            "sm_mhz": float(statistics.median(s.sm_mhz for s in samples)),
            "sm_mhz_min": float(min(s.sm_mhz for s in samples)),
            "power_w": float(statistics.median(s.power_mw for s in samples)) / 1000.0,
            "power_capped": sum(1 for s in samples if s.reasons & POWER_CAP_BITS) / n,
            "thermal": sum(1 for s in samples if s.reasons & THERMAL_BITS) / n}


def clock_cell(row: dict) -> str:
    """A table cell: the median SM clock, and `cap` / `hot` where the power cap / a thermal
    slowdown held the clock in at least CAPPED_SHARE of the samples; '-' without samples."""
    if row.get("sm_mhz") is None:
        return "-"
    cell = f"{row['sm_mhz']:,.0f}"
    if (row.get("power_capped") or 0.0) >= CAPPED_SHARE:
        cell += " cap"
    if (row.get("thermal") or 0.0) >= CAPPED_SHARE:
        cell += " hot"
    return cell


def clocks_line(result: dict) -> str:
    """The line under a bench table that says how its SM MHz column was read, or why it was
    not ('' where the run says nothing of clocks: a result written before they were read)."""
    note = (result.get("meta") or {}).get("clocks")
    if not note:
        return ""
    if not any(r.get("sm_mhz") is not None for r in result.get("rows", ())):
        return note if note.startswith("clocks not read") else f"SM MHz: no samples ({note})"
    return (f"SM MHz: the median SM clock over each phase's timed runs ({note}); cap / hot: "
            f"the power cap / a thermal slowdown held the clock in >= {CAPPED_SHARE:.0%} of "
            f"the reads, so the time depends on the board's power as well as the work")


class _Nvml:
    """The few NVML calls the sampler makes, on one device found by its PCI bus id."""

    def __init__(self, pci_bus_id: str):
        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
        except OSError as exc:
            raise RuntimeError(f"no NVML library ({exc})") from None
        self.lib = lib
        self._check(lib.nvmlInit_v2(), "nvmlInit_v2")
        handle = ctypes.c_void_p()
        self._check(lib.nvmlDeviceGetHandleByPciBusId_v2(pci_bus_id.encode(),
                                                          ctypes.byref(handle)),
                    f"nvmlDeviceGetHandleByPciBusId_v2({pci_bus_id})")
        self.handle = handle
        # the reasons' call was renamed in CUDA 12.x's NVML; older drivers have only the old one
        self._reasons = getattr(lib, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            lib.nvmlDeviceGetCurrentClocksThrottleReasons

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            self.lib.nvmlErrorString.restype = ctypes.c_char_p
            raise RuntimeError(f"{what} failed: {self.lib.nvmlErrorString(rc).decode()}")

    def read(self) -> ClockSample:
        mhz, mw, reasons = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_ulonglong()
        self._check(self.lib.nvmlDeviceGetClockInfo(self.handle, NVML_CLOCK_SM,
                                                    ctypes.byref(mhz)), "nvmlDeviceGetClockInfo")
        self._check(self._reasons(self.handle, ctypes.byref(reasons)),
                    "nvmlDeviceGetCurrentClocksEventReasons")
        self._check(self.lib.nvmlDeviceGetPowerUsage(self.handle, ctypes.byref(mw)),
                    "nvmlDeviceGetPowerUsage")
        return ClockSample(mhz.value, reasons.value, mw.value)


class ClockSampler:
    """Samples `read()` from start() to stop() on a thread of its own (see the module)."""

    def __init__(self, read: Callable[[], ClockSample], interval_s: float = DEFAULT_INTERVAL_S):
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.read, self.interval_s = read, interval_s
        self.samples: list[ClockSample] = []
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def open(cls, device_id: int, interval_s: float = DEFAULT_INTERVAL_S
             ) -> tuple["ClockSampler | None", str]:
        """(a sampler of CUDA device `device_id`, a note on how it samples), or (None, why
        not): the bench runs without clock figures where NVML cannot be read."""
        try:
            import cupy

            bus = cupy.cuda.runtime.deviceGetPCIBusId(device_id)
            nvml = _Nvml(bus)
            nvml.read()
        except Exception as exc:  # no NVML, no device: a figure the bench goes without
            return None, f"clocks not read: {exc}"
        return (cls(nvml.read, interval_s),
                f"NVML every {interval_s * 1e3:g} ms, device {bus}")

    def _take(self) -> None:
        try:
            self.samples.append(self.read())
        except Exception as exc:  # a failed read ends the sampling, and is said
            self.error = str(exc)
            self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._take()

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("ClockSampler.start() while already sampling")
        self.samples, self.error = [], None
        self._stop.clear()
        self._take()
        self._thread = threading.Thread(target=self._loop, name="mlasandbox-clocks",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> dict | None:
        if self._thread is None:
            raise RuntimeError("ClockSampler.stop() without start()")
        if self.error is None:
            self._take()
        self._stop.set()
        self._thread.join()
        self._thread = None
        return self.summary()

    def summary(self) -> dict | None:
        return summarize_samples(self.samples)
