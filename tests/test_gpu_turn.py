"""The GPU suite's turns (gpu_support.gpu_turn, conftest.gpu_turn_of): on a GPU machine every
test shares the GPU except those marked gpu_alone, which have it to themselves; a test waiting
to be alone is not starved by the shared turns that keep coming. Locks on files of tmp_path,
probed without blocking from other open files (flock locks belong to an open file, so a
second open in the same process contends like another process)."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

import gpu_support
from conftest import gpu_turn_of

fcntl = pytest.importorskip("fcntl")


@pytest.fixture
def paths(monkeypatch, tmp_path):
    gate, turn = str(tmp_path / "t.gate"), str(tmp_path / "t.turn")
    monkeypatch.setattr(gpu_support, "lock_paths", lambda: (gate, turn))
    return gate, turn


def free(path, mode) -> bool:
    """Whether a lock of `mode` on `path` could be taken now (taken and given back)."""
    with open(path, "a") as f:
        try:
            fcntl.flock(f, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(f, fcntl.LOCK_UN)
        return True


def until(cond, seconds=30.0) -> bool:
    """Poll `cond` until it holds or `seconds` pass; whether it held."""
    end = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.001)
    return True


def test_which_turn_a_test_takes():
    marked = SimpleNamespace(get_closest_marker=lambda name: object() if name == "gpu_alone"
                             else None)
    plain = SimpleNamespace(get_closest_marker=lambda name: None)
    assert gpu_turn_of(marked, have_gpu=False) is None
    assert gpu_turn_of(plain, have_gpu=False) is None
    assert gpu_turn_of(marked, have_gpu=True) == "alone"
    assert gpu_turn_of(plain, have_gpu=True) == "shared"


def test_a_shared_turn_lets_others_share_and_keeps_a_lone_test_out(paths):
    gate, turn = paths
    with gpu_support.gpu_turn(alone=False):
        assert free(turn, fcntl.LOCK_SH) and not free(turn, fcntl.LOCK_EX)
        assert free(gate, fcntl.LOCK_EX)  # the gate is held only while a turn is taken
    assert free(turn, fcntl.LOCK_EX) and free(gate, fcntl.LOCK_EX)


def test_a_lone_turn_keeps_every_other_test_out(paths):
    gate, turn = paths
    with gpu_support.gpu_turn(alone=True):
        assert not free(turn, fcntl.LOCK_SH) and not free(gate, fcntl.LOCK_EX)
    assert free(turn, fcntl.LOCK_EX) and free(gate, fcntl.LOCK_EX)


def test_a_test_waiting_to_be_alone_holds_back_the_shared_turns_after_it(paths):
    gate, turn = paths
    release, entered = threading.Event(), threading.Event()

    def sharer():
        with gpu_support.gpu_turn(alone=False):
            release.wait(30)

    def loner():
        with gpu_support.gpu_turn(alone=True):
            entered.set()

    first = threading.Thread(target=sharer)
    first.start()
    assert until(lambda: not free(turn, fcntl.LOCK_EX))  # the sharer holds its turn
    alone = threading.Thread(target=loner)
    alone.start()
    # the loner waits for the sharer, holding the gate: a shared turn asked now waits too
    assert until(lambda: not free(gate, fcntl.LOCK_EX))
    time.sleep(0.05)
    assert not entered.is_set() and not free(gate, fcntl.LOCK_EX)
    release.set()
    first.join(30)
    assert entered.wait(30)
    alone.join(30)
    assert free(turn, fcntl.LOCK_EX) and free(gate, fcntl.LOCK_EX)
