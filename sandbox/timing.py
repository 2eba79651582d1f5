"""Time one GPU callable with CUDA events: warm-up, N timed runs, median and spread.

What one timed run looks like on the stream (the order matters):

    flush L2  |  pre-roll spin  |  start event  |  fn()  |  end event

* **L2 flush, outside the timed region.** A buffer of at least 2x the device's L2 is written
  (every line of the previous run is evicted) and then read back, so L2 ends up holding clean
  lines of the flush buffer: the timed phase then pays neither a warm cache nor the write-back
  of dirty flush lines (a write-only flush leaves up to one L2 of dirty lines, ~50 MB on an
  H200, for the timed kernel to write back first).
* **Pre-roll spin.** A one-thread kernel spins on the GPU's global timer for a little longer
  than the CPU takes to enqueue `fn` (measured during warm-up). Without it, a short phase on an
  idle GPU is timed from the moment the start event is recorded, which is *before* Python has
  finished launching the phase: the measurement would include the CPU's launch overhead. With
  it, the whole phase is queued behind the spin and the events bracket GPU time only.
* **CUDA-graph replay (optional).** Where launch overhead dominates (short contexts), the
  phase can be captured once into a CUDA graph and `graph.launch()` timed instead: that also
  removes the driver's per-launch work between the kernels of a multi-kernel phase. The
  callable captured must not poll or synchronize the stream (a capture is invalidated by a
  stream query): the phase guards skip their poll while the stream captures (guard.py).
  `Timing.mode` says which mode produced the numbers, and `Timing.note` why a requested graph
  was not used.

* **The launch floor.** `LaunchFloor` launches one empty kernel per kernel of a step, with
  the step's grids and block sizes (and its programmatic launches as such), no shared memory:
  replayed as a CUDA graph, that is what the step's launches cost with no work in them, the
  floor a short-context step is read against. Same grids rather than 1-block kernels,
  because dispatching a grid's blocks is part of what the step cannot avoid (a 2048-block
  merge pays it, a 1-block kernel would hide it).

The number of timed runs adapts to the phase: after warm-up one probe run is timed and
`choose_repeats` picks enough runs to fill `target_s` of GPU time, never fewer than
`min_repeats` nor more than `max_repeats` (a 6 ms phase gets its minimum, a 5 us phase its
maximum), so a full bench stays within its time budget.

The statistics (`summarize`) are pure Python and tested on the CPU; `time_gpu` needs CuPy and
a device.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from .clocks import NO_CLOCKS as CLOCK_FIELDS
from .pdl import launch as pdl_launch

__all__ = ["TimingStats", "Timing", "summarize", "percentile", "choose_repeats",
           "preroll_us", "L2Flush", "Spinner", "LaunchFloor", "capture_graph", "time_gpu",
           "EVENT_RESOLUTION_US"]

# cudaEventElapsedTime: "this value has a resolution of around 0.5 microseconds".
EVENT_RESOLUTION_US = 0.5


# ---------------------------------------------------------------------------- statistics

def percentile(sorted_xs, q: float) -> float:
    """The q-quantile (0..1) of an ascending sequence, linear interpolation between the
    closest ranks (NumPy's default method), so p50 of an even count is the usual median."""
    n = len(sorted_xs)
    if n == 0:
        raise ValueError("percentile of no samples")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    pos = q * (n - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, n - 1)
    frac = pos - lo
    return float(sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * frac)


@dataclass(frozen=True)
class TimingStats:
    """Median and spread of one measurement, in microseconds."""

    n: int
    median_us: float
    min_us: float
    p10_us: float
    p90_us: float
    max_us: float
    mad_us: float      # median absolute deviation from the median: robust to a few outliers
    mean_us: float

    @property
    def rel_mad(self) -> float:
        return self.mad_us / self.median_us if self.median_us > 0 else math.nan

    def as_dict(self) -> dict:
        return asdict(self)


def summarize(samples_us) -> TimingStats:
    """Statistics of a list of run times (us). Non-finite or negative samples are errors:
    a timer that produced one is broken, and hiding it would hide the bug."""
    xs = [float(x) for x in samples_us]
    if not xs:
        raise ValueError("no samples to summarize")
    bad = [x for x in xs if not math.isfinite(x) or x < 0]
    if bad:
        raise ValueError(f"invalid run times (us): {bad[:5]}")
    xs.sort()
    med = percentile(xs, 0.5)
    dev = sorted(abs(x - med) for x in xs)
    return TimingStats(n=len(xs), median_us=med, min_us=xs[0], p10_us=percentile(xs, 0.1),
                       p90_us=percentile(xs, 0.9), max_us=xs[-1],
                       mad_us=percentile(dev, 0.5), mean_us=sum(xs) / len(xs))


def choose_repeats(probe_us: float, target_s: float, min_repeats: int, max_repeats: int) -> int:
    """Timed runs for a phase whose one probe run took `probe_us`: enough to fill `target_s`
    of GPU time, clamped to [min_repeats, max_repeats]."""
    if min_repeats < 1 or max_repeats < min_repeats:
        raise ValueError(f"need 1 <= min_repeats <= max_repeats, got {min_repeats}, "
                         f"{max_repeats}")
    if not math.isfinite(probe_us) or probe_us <= 0:
        return max_repeats
    want = math.ceil(target_s * 1e6 / probe_us)
    return int(min(max_repeats, max(min_repeats, want)))


def preroll_us(enqueue_us: float, floor_us: float = 20.0, cap_us: float = 5000.0) -> float:
    """How long the GPU should spin before the start event: twice the CPU's enqueue time of
    the phase plus a margin, so the phase is entirely queued when the spin ends."""
    if not math.isfinite(enqueue_us) or enqueue_us < 0:
        enqueue_us = cap_us / 2
    return float(min(cap_us, max(floor_us, 2.0 * enqueue_us + floor_us)))


@dataclass
class Timing:
    """One measurement: statistics, how it was taken, and the raw samples."""

    stats: TimingStats
    mode: str                     # "events" | "graph"
    note: str = ""                # e.g. why a requested graph was not used
    samples_us: list = field(default_factory=list)
    preroll_us: float = 0.0
    flushed: bool = True
    clocks: dict | None = None    # clocks.summarize_samples over the timed runs, or None

    @property
    def median_us(self) -> float:
        return self.stats.median_us

    def as_dict(self, samples: bool = False) -> dict:
        d = {"mode": self.mode, "note": self.note, "preroll_us": self.preroll_us,
             "flushed": self.flushed, **self.stats.as_dict(), **CLOCK_FIELDS,
             **(self.clocks or {})}
        if samples:
            d["samples_us"] = list(self.samples_us)
        return d


# ---------------------------------------------------------------------------- GPU pieces

class L2Flush:
    """Evict L2 between runs: write a buffer of `factor` x L2 bytes, then read it back."""

    def __init__(self, l2_bytes: int, factor: int = 2):
        import cupy

        if factor < 2:
            raise ValueError("the flush buffer must be at least 2x the L2 size")
        nbytes = max(int(factor) * int(l2_bytes), 8 << 20)
        self.buf = cupy.empty(nbytes // 4, cupy.float32)
        self.sink = cupy.empty((), cupy.float32)
        self.nbytes = self.buf.nbytes
        self._value = 0.0

    def __call__(self) -> None:
        import cupy

        # A different value each time, so no layer can treat the write as a no-op.
        self._value = 1.0 - self._value
        self.buf.fill(self._value)
        cupy.sum(self.buf, out=self.sink)


_SPIN_SOURCE = r"""
extern "C" __global__ void mlasandbox_spin(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
"""


class Spinner:
    """A one-thread kernel that keeps the stream busy for `us` microseconds (the pre-roll)."""

    def __init__(self):
        import cupy

        self.kernel = cupy.RawKernel(_SPIN_SOURCE, "mlasandbox_spin")

    def __call__(self, us: float) -> None:
        if us > 0:
            self.kernel((1,), (1,), (np.uint64(int(us * 1000)),))


_EMPTY_SOURCE = r"""
extern "C" __global__ void mlasandbox_empty() {}
"""


class LaunchFloor:
    """Empty kernels in place of a step's: `floor(launches)` launches one per guard.Launch
    (its grid and block; programmatic where the Launch was), on CuPy's current stream."""

    def __init__(self):
        import cupy

        self.kernel = cupy.RawKernel(_EMPTY_SOURCE, "mlasandbox_empty")

    def __call__(self, launches) -> None:
        for ln in launches:
            pdl_launch(self.kernel, ln.grid, ln.block, (), 0, pdl=ln.pdl)


def capture_graph(fn, stream):
    """Capture `fn` (which must not poll or synchronize the stream) into a CUDA graph on
    `stream` (a non-default stream). Returns the cupy.cuda.Graph; raises if capture fails,
    after ending the capture so the stream is usable again."""
    with stream:
        stream.begin_capture()
        try:
            fn()
        except BaseException:
            try:
                stream.end_capture()
            except Exception:
                pass
            raise
        graph = stream.end_capture()
    if hasattr(graph, "upload"):  # pre-load the executable graph, off the timed path
        graph.upload(stream)
    return graph


def _timed_runs(launch, n: int, stream, flush, spinner, spin_us: float) -> list:
    import cupy

    pairs = []
    with stream:
        for _ in range(n):
            if flush is not None:
                flush()
            if spinner is not None:
                spinner(spin_us)
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record(stream)
            launch()
            end.record(stream)
            pairs.append((start, end))
        pairs[-1][1].synchronize()
    return [cupy.cuda.get_elapsed_time(s, e) * 1000.0 for s, e in pairs]


def time_gpu(fn, *, stream=None, flush: L2Flush | None = None, graph_fn=None,
             warmup: int = 3, min_repeats: int = 10, max_repeats: int = 100,
             target_s: float = 0.2, spinner: Spinner | None = None,
             after_graph_check=None, clocks=None) -> Timing:
    """Time `fn` on `stream`: warm-up, a probe, then choose_repeats(...) timed runs.

    graph_fn: a capture-safe `fn` (often `fn` itself); when given, it is captured once and the graph
    replayed instead of calling `fn` (mode "graph"). If the capture fails, `fn` is timed
    with events and Timing.note says why. after_graph_check: called once after the first
    replay (the caller's guard polls for errors there, since the replay itself is unguarded).
    clocks: a clocks.ClockSampler that samples over the timed runs (Timing.clocks).
    """
    import cupy

    stream = stream or cupy.cuda.get_current_stream()
    mode, note, launch = "events", "", fn
    if graph_fn is not None:
        try:
            graph = capture_graph(graph_fn, stream)
            mode, launch = "graph", (lambda: graph.launch(stream))
            with stream:
                launch()
                if after_graph_check is not None:
                    after_graph_check()
                stream.synchronize()
        except Exception as exc:  # capture refused: fall back, and say so
            if mode == "graph":  # the replay itself failed: that is an error, not a fallback
                raise
            note = f"graph capture failed ({type(exc).__name__}: {exc}); timed with events"
            mode, launch = "events", fn
    # Warm-up, measuring how long the CPU takes to enqueue one run (for the pre-roll).
    enqueue = []
    with stream:
        for _ in range(max(1, warmup)):
            t0 = time.perf_counter()
            launch()
            enqueue.append((time.perf_counter() - t0) * 1e6)
        stream.synchronize()
    spin = preroll_us(sorted(enqueue)[len(enqueue) // 2]) if spinner is not None else 0.0
    probe = _timed_runs(launch, 1, stream, flush, spinner, spin)[0]
    n = choose_repeats(probe, target_s, min_repeats, max_repeats)
    if clocks is not None:
        clocks.start()
    try:
        samples = _timed_runs(launch, n, stream, flush, spinner, spin)
    finally:
        clock = clocks.stop() if clocks is not None else None
    return Timing(summarize(samples), mode, note, samples, spin, flush is not None, clock)
