"""Shared fixtures: fresh random seeds that a failure can replay.

Every run draws a new entropy (so a constant seed cannot hide a bug), prints it in the
header, and every test derives its seeds from it and its own name. A failing test's message
names the entropy; `MLASANDBOX_SEED=<entropy> pytest ...` replays exactly that run.
"""
from __future__ import annotations

import os
import zlib

import numpy as np
import pytest

_ENTROPY = int(os.environ.get("MLASANDBOX_SEED") or np.random.SeedSequence().entropy)


def pytest_report_header(config):
    return f"mlasandbox seed entropy {_ENTROPY} (replay: MLASANDBOX_SEED={_ENTROPY})"


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
