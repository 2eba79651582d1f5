"""Shared fixtures: fresh random seeds that a failure can replay; skips summed up by reason;
no terminal width from the shell (tables are laid out as piped).

Every run draws a new entropy (so a constant seed cannot hide a bug), prints it in the
header, and every test derives its seeds from it and its own name. A failing test's message
names the entropy; `MLASANDBOX_SEED=<entropy> pytest ...` replays exactly that run.

Without a GPU a few hundred tests skip for one reason, so instead of a line per skip
(`-rs`) the end of the run prints one line per distinct reason, "N skipped: reason"
(`pytest -rs` still lists them one by one). pytest's own closing line is left as it is.
"""
from __future__ import annotations

import os
import zlib
from collections import Counter

import numpy as np
import pytest

_ENTROPY = int(os.environ.get("MLASANDBOX_SEED") or np.random.SeedSequence().entropy)


def pytest_report_header(config):
    return f"mlasandbox seed entropy {_ENTROPY} (replay: MLASANDBOX_SEED={_ENTROPY})"


def skip_reason(report) -> str:
    """The reason of a skipped test's report, without pytest's "Skipped: " prefix."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def skip_summary(reports) -> list[str]:
    """"N skipped: reason" for each distinct reason, the most frequent first."""
    counts = Counter(skip_reason(r) for r in reports)
    return [f"{n} skipped: {reason}" for reason, n in counts.most_common()]


def pytest_terminal_summary(terminalreporter):
    lines = skip_summary(terminalreporter.stats.get("skipped", []))
    if lines:
        terminalreporter.write_sep("=", "skips by reason")
        for line in lines:
            terminalreporter.write_line(line)


class Seeds:
    """Seeds derived from the run's entropy and a key (the test's name by default)."""

    def __init__(self, entropy: int, key: str):
        self.entropy, self.key = entropy, key
        self._taken = 0

    def take(self, n: int = 1) -> list:
        # A new spawn key per call: two calls in one test never repeat a seed.
        ss = np.random.SeedSequence(self.entropy,
                                    spawn_key=(zlib.crc32(self.key.encode()), self._taken))
        self._taken += 1
        return [int(x) for x in ss.generate_state(n, dtype=np.uint32)]

    def one(self) -> int:
        return self.take(1)[0]

    def __str__(self) -> str:
        return f"[seeds of {self.key!r}: replay with MLASANDBOX_SEED={self.entropy}]"


@pytest.fixture
def seeds(request) -> Seeds:
    return Seeds(_ENTROPY, request.node.nodeid)


@pytest.fixture(scope="module")
def module_seeds(request) -> Seeds:
    """For module-scoped fixtures that share one expensive computation between tests."""
    return Seeds(_ENTROPY, request.module.__name__)


@pytest.fixture(scope="session")
def cupy_device():
    """The cupy module when a CUDA device can allocate; the test is skipped otherwise."""
    try:
        import cupy

        cupy.zeros(1)
    except Exception as exc:  # ImportError, no driver, no device
        pytest.skip(f"needs a CUDA device: {type(exc).__name__}: {exc}")
    return cupy


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu_alone: has the GPU to itself while it runs "
                            "(tests/gpu_support.gpu_turn)")


def gpu_turn_of(item, have_gpu: bool):
    """None where the run has no GPU (no lock at all), else "alone" for a test marked
    gpu_alone and "shared" for every other: a test without the gpu mark may still launch
    kernels (through the CLI, a subprocess), so on a GPU machine every test takes a turn."""
    if not have_gpu:
        return None
    return "alone" if item.get_closest_marker("gpu_alone") is not None else "shared"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Tests marked gpu_alone have the GPU to themselves (gpu_support.gpu_turn). The turn
    covers the whole protocol of a test, so the module and session fixtures it sets up or
    tears down (compiled steps, device inputs) run inside it too."""
    from gpu_support import HAVE_GPU, gpu_turn

    turn = gpu_turn_of(item, HAVE_GPU)
    if turn is None:
        yield
        return
    with gpu_turn(alone=turn == "alone"):
        yield


@pytest.fixture(autouse=True)
def _no_terminal_width(monkeypatch):
    """The tables' layout in a test does not depend on the shell that runs it: without
    COLUMNS a piped console is 200 wide (cli/render.console), and a test that wants another
    width passes COLUMNS to its CliRunner. A COLUMNS of 80 from the shell dropped columns
    that five table tests read (seen on the device machine)."""
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.delenv("LINES", raising=False)
