"""Shared pieces of the GPU tests: the skip marker, fresh seeds, poisoned runs.

Every GPU check draws fresh random inputs (the seed is printed in every failure message, so a
failure can be replayed with MLASANDBOX_GPU_SEED=<that seed>; MLASANDBOX_SEED is the CPU tests'
run entropy, see conftest.py), NaN-fills the cache past n_ctx, and poisons
the outputs and the split scratch before each launch, so an element the kernel failed to
write shows up as NaN instead of as last run's value.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import tempfile

import pytest

from mlasandbox.toolkit import device_available

HAVE_GPU, GPU_REASON = device_available()
gpu = pytest.mark.skipif(not HAVE_GPU, reason=f"needs a CUDA GPU: {GPU_REASON}")
# A test that must have the GPU to itself (ncu's profiles: with other workers of the suite
# launching kernels beside them they failed with "Failed to prepare kernel for profiling ...
# Unknown Error on device 0", twice in a row on an H100, 2026-12-06). conftest.py's
# pytest_runtest_protocol gives it the GPU alone; every other test of a GPU run shares it.
gpu_alone = pytest.mark.gpu_alone


def lock_paths() -> tuple[str, str]:
    """(gate, turn): the lock files the workers of one user's GPU runs share."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    base = os.path.join(tempfile.gettempdir(), f"mlasandbox-tests-gpu-{uid}")
    return base + ".gate", base + ".turn"


@contextlib.contextmanager
def gpu_turn(alone: bool):
    """Hold the GPU shared (alone=False) or alone, across processes (the suite's xdist workers)
    by flock. A test that waits to be alone holds the gate while it waits, so tests that come
    after it wait at the gate instead of taking the GPU turn by turn ahead of it (flock alone
    would let a stream of shared holders starve it). Without fcntl (not POSIX), no lock."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    gate_path, turn_path = lock_paths()
    with open(gate_path, "a") as gate, open(turn_path, "a") as turn:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(turn, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            if not alone:
                fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(turn, fcntl.LOCK_UN)
            if alone:
                fcntl.flock(gate, fcntl.LOCK_UN)


def fresh_seed() -> int:
    fixed = os.environ.get("MLASANDBOX_GPU_SEED")
    return int(fixed) if fixed else secrets.randbits(31)


def poison(step) -> None:
    """NaN-fill everything a run of `step` (a DecodeStep or a PagedDecodeStep) must write: the
    outputs (a paged step without wv_b has no out), the split partials and the one-kernel
    combine's out parts; and set a paged step's chunk counts to -1, which merges no chunk, so
    counts the attention kernel failed to publish (or left in the per-device scratch by an
    earlier step of the same inputs) fail every row that sees a position, as in
    sandbox/battery.py. The fills go on the current stream: a run on another stream (a
    graph's) must wait for them."""
    import cupy

    for name in ("out", "latent", "lse", "part_acc", "part_m", "part_l", "out_part"):
        buf = getattr(step, name, None)
        if buf is not None:
            buf.fill(cupy.nan)
    counts = getattr(step, "chunk_counts", None)
    if counts is not None:
        counts.fill(-1)


def run_poisoned(step):
    poison(step)
    return step.run()


def device_inputs(dims, n_ctx, cache_dtype="f16", q_dtype="f32", seed=None, extra_rows=7,
                  rising=False):
    """Inputs on the device with `extra_rows` NaN rows past n_ctx; `rising`: scores that climb
    over the context (mlasandbox.inputs.make_rising_inputs)."""
    import cupy

    from mlasandbox.inputs import make_inputs, make_rising_inputs

    seed = fresh_seed() if seed is None else seed
    inp = (make_rising_inputs if rising else make_inputs)(dims, n_ctx + extra_rows, n_ctx, cache_dtype, q_dtype, seed=seed,
                      nan_fill=True, xp=cupy)
    return inp, seed


def compile_with(inst, *defines):
    """`inst` compiled with extra -D options (a deliberately broken build for a negative
    control), ready to swap into a DecodeStep's attn_kernel."""
    from mlasandbox.kernels import get_kernel

    return get_kernel(inst, defines)
