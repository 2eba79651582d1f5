"""Run Nsight Compute over one attention launch of a variant: the data of `mlasandbox stalls`.

ncu profiles a process, so the launch runs in a child, `python -m mlasandbox.ncu`, which draws
the inputs, compiles, and runs the attn phase once (twice for a warm profile): of a batch-1
step (one contiguous cache of n_ctx positions), or, given a PagedSpec, of a paged serving step
(the paged launch of the variant's kernel; wgmma64 has no other). ncu, filtered to that
kernel's name, collects the per-SASS warp-state samples (sections SourceCounters and
WarpStateStats) and the kernel-wide metrics of mlasandbox.stalls.KERNEL_METRICS into one
report, replaying the kernel for as many passes as they need (with the clock locked:
durations read longer than timed ones; every pass after a flush of the caches unless warm),
then prints the report's raw and source pages as CSV for mlasandbox.stalls to read.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from . import registry
from .api import DecodeStep
from .dims import Dims
from .inputs import make_inputs
from .stalls import KERNEL_METRICS

__all__ = ["NcuError", "NcuRun", "PagedSpec", "find_ncu", "kernel_filter", "profile_attention"]



def _ncu_places() -> list:
    """Where ncu is looked for when --ncu / $NCU do not name it and it is not on PATH: the
    CUDA roots the header lookup uses (mlasandbox.toolkit), then Nsight Compute's own."""
    roots = [os.environ[v] for v in ("CUDA_PATH", "CUDA_HOME") if os.environ.get(v)]
    return [os.path.join(r, "bin", "ncu") for r in (*roots, "/usr/local/cuda")] + \
        ["/opt/nvidia/nsight-compute/ncu"]


class NcuError(RuntimeError):
    """ncu is missing, failed, or profiled no kernel."""


@dataclass(frozen=True)
class PagedSpec:
    """The paged step a profile runs: one length per request, page size, query tokens."""
    lengths: tuple
    page_size: int = 64
    s_q: int = 1
    causal: bool = False

    def argv(self) -> list:
        return [str(self.page_size), str(self.s_q), str(int(self.causal)),
                ",".join(str(int(n)) for n in self.lengths)]


@dataclass(frozen=True)
class NcuRun:
    raw_csv: str       # --page raw --csv: the kernel-wide metrics
    source_csv: str    # --page source --print-source sass --csv: the per-SASS samples
    kernel: str        # the attention instance's readable name
    command: tuple     # the profiling command line


def find_ncu(explicit: str | None = None) -> str:
    """The ncu executable: `explicit`, else $NCU, else ncu on PATH, else _ncu_places()."""
    for cand in (explicit, os.environ.get("NCU")):
        if cand:
            path = shutil.which(cand)
            if path is None:
                raise NcuError(f"ncu not found at {cand!r}")
            return path
    places = _ncu_places()
    path = shutil.which("ncu") or next((p for p in places if os.access(p, os.X_OK)), None)
    if path is None:
        raise NcuError(f"ncu (Nsight Compute) is not on PATH nor in {', '.join(places)}: "
                       "install it with the CUDA toolkit, or name it with --ncu PATH or $NCU")
    return path


def kernel_filter(instance: registry.KernelInstance) -> str:
    """An ncu `-k regex:` that matches the instance's kernel however ncu spells the name
    (`attn_tiled`, `void mla::attn_tiled<(int)16, ...>(...)`) and no other kernel of the
    sandbox (`attn` must not match `attn_tiled`)."""
    base = instance.expression.split("<")[0].split("::")[-1]
    return rf"(^|::| ){re.escape(base)}(<|\(|$)"


def _tail(text: str, lines: int = 15) -> str:
    """ncu's own ==ERROR== lines (which the child's traceback can push out of a tail), then
    the last `lines` lines of its output."""
    all_lines = text.strip().splitlines()
    errors = [ln for ln in all_lines[:-lines] if ln.startswith("==ERROR==")][:10]
    return "\n".join(errors + all_lines[-lines:])


def _run(cmd: list, timeout: float) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise NcuError(f"ncu ran past {timeout:.0f} s: {' '.join(cmd[:4])} ...") from None
    out = done.stdout + done.stderr
    if done.returncode != 0:
        raise NcuError(f"ncu exited {done.returncode}:\n{_tail(out)}")
    return out


def lock_path() -> str:
    """The file whose lock one profiling run of this user holds at a time."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return os.path.join(tempfile.gettempdir(), f"mlasandbox-ncu-{uid}.lock")


@contextlib.contextmanager
def _one_profile_at_a_time():
    """Hold lock_path()'s exclusive lock: ncu sessions of several processes (the GPU suite's
    workers, two `mlasandbox stalls` in two shells) would share the GPU's performance
    counters, which ncu does not support. Without fcntl (not POSIX), no lock."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(lock_path(), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def profile_attention(variant: str, n_head: int, n_ctx: int, cache: str = "f16",
                      q: str = "f32", splits: int | None = None, seed: int = 0,
                      ncu: str | None = None, save_dir: str | None = None,
                      timeout: float = 600.0, paged: PagedSpec | None = None,
                      warm: bool = False) -> NcuRun:
    """Profile the attention kernel of one decode step of `variant` under ncu: batch 1 over
    n_ctx positions, or the paged step `paged` (n_ctx unused).

    By default ncu flushes every cache before each replay pass (`--cache-control all`), as
    the bench flushes L2 before each launch: the kernel's code comes from DRAM, as its data
    does. `warm`: the child launches the phase twice and ncu profiles the second launch with
    the caches kept (`--cache-control none`), so the code and whatever of the data L2 holds
    are there from the launch before. docs/wgmma-deep-dive.md ("The cold start") compares the
    two, and where ncu's kernel-wide and per-SASS readings of them disagree."""
    var = registry.variant(variant)
    if not var.is_cuda:
        raise ValueError(f"variant {variant!r} launches no attention kernel of its own (it runs "
                         "cuBLAS); stalls profiles the CUDA variants")
    if paged is None and variant in registry.PAGED_ONLY_VARIANTS:
        raise ValueError(f"variant {variant} serves the paged step only: profile it with a "
                         "batch (--batch B or --serving PRESET)")
    instance = (registry.paged_attention_instance(var, cache, q) if paged is not None
                else registry.attention_instance(var, cache, q))
    child = ([variant, str(n_head), str(n_ctx), cache, q, str(splits or 0), str(seed)]
             if paged is None else
             ["paged", variant, str(n_head), cache, q, str(splits or 0), str(seed),
              *paged.argv()])
    if warm:
        child = ["warm", *child]
    caches = ["--cache-control", "none", "--launch-skip", "1"] if warm else \
        ["--cache-control", "all"]
    exe = find_ncu(ncu)
    with tempfile.TemporaryDirectory() as tmp:
        where = save_dir or tmp
        os.makedirs(where, exist_ok=True)
        report = os.path.join(where, "stalls")
        metrics = ",".join(KERNEL_METRICS)
        cmd = [exe, "-f", "-o", report, "--section", "SourceCounters", "--section",
               "WarpStateStats", "--metrics", metrics, "-k", f"regex:{kernel_filter(instance)}",
               *caches, "--launch-count", "1", sys.executable, "-m", "mlasandbox.ncu", *child]
        with _one_profile_at_a_time():
            log = _run(cmd, timeout)
        if not os.path.exists(report + ".ncu-rep"):
            raise NcuError(f"ncu profiled no {instance.name} launch:\n{_tail(log)}")
        rep = report + ".ncu-rep"
        raw = _run([exe, "-i", rep, "--page", "raw", "--csv", "--metrics", metrics], timeout)
        source = _run([exe, "-i", rep, "--page", "source", "--print-source", "sass", "--csv"],
                      timeout)
        if save_dir:
            for name, text in (("raw.csv", raw), ("source.csv", source)):
                with open(os.path.join(save_dir, name), "w", encoding="utf-8") as f:
                    f.write(text)
    return NcuRun(raw, source, instance.name, tuple(cmd))


def _paged_step(argv: list):
    """The paged step of VARIANT H CACHE Q SPLITS SEED PAGE_SIZE S_Q CAUSAL LENGTHS
    (comma-separated)."""
    import cupy

    from .paged_api import PagedDecodeStep
    from .paged_inputs import make_paged_inputs

    variant, n_head, cache, q, splits, seed, page_size, s_q, causal, lengths = argv
    inputs = make_paged_inputs(Dims(n_head=int(n_head)), [int(n) for n in lengths.split(",")],
                               s_q=int(s_q), page_size=int(page_size), cache_dtype=cache,
                               q_dtype=q, causal=bool(int(causal)), seed=int(seed), xp=cupy)
    return PagedDecodeStep(**inputs.decode_args(), variant=variant, splits=int(splits) or None)


def _batch1_step(argv: list):
    """The batch-1 step of VARIANT H N_CTX CACHE Q SPLITS SEED."""
    import cupy

    variant, n_head, n_ctx, cache, q, splits, seed = argv
    n_head, n_ctx, splits, seed = int(n_head), int(n_ctx), int(splits), int(seed)
    inputs = make_inputs(Dims(n_head=n_head), n_ctx, n_ctx, cache, q, seed=seed, xp=cupy)
    return DecodeStep(**inputs.decode_args(), variant=variant, splits=splits or None)


def _launch(argv: list) -> int:
    """The child ncu profiles: the attn phase of a batch-1 step (_batch1_step's arguments) or
    of a paged step (`paged` first, _paged_step's), once; twice after `warm` (ncu profiles
    the second launch)."""
    import cupy

    launches = 1
    if argv and argv[0] == "warm":
        launches, argv = 2, argv[1:]
    step = _paged_step(argv[1:]) if argv and argv[0] == "paged" else _batch1_step(argv)
    for _ in range(launches):
        step.run_attn()
        cupy.cuda.Device().synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(_launch(sys.argv[1:]))
