"""The tensor-parallel launcher: N ranks, one per GPU, each its band of heads; the parent
collects every rank's report.

    run = launch(TPJob(dims=Dims(n_head=128), lengths=(131072,)), world=8)
    run.raise_for_failure()        # TPError naming the rank, the phase and the launch
    run.reports[r]                 # rank r: device, band, plan, timings, env, error

Ranks are processes started with multiprocessing's "spawn" (a fresh interpreter: no CUDA
state inherited), non-daemonic (cupyx.distributed's rank 0 starts its own store process),
with NVLink multicast off in each (tp_comm.NO_MULTICAST_ENV, set in the parent's environment
for the spawn and again in the child before anything loads CUDA). Rank r makes device r
current. `mode="thread"` runs the ranks as threads of this process (the fake communicator
and the schedule executor only: the CPU suite).

The checkpoint: before each collective every rank meets the others at a host barrier and
says whether it failed a phase. A rank that failed reports its PhaseError (phase, variant,
kernel, grid, block, shared memory); the others report PeerFailed and never enter the
collective, so nobody waits in NCCL for a dead rank. A rank that dies without reporting is
reported by its exit code; one that does not report within the timeout is terminated.
"""
from __future__ import annotations

import os
import socket
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field, replace

import numpy as np

from .dims import Dims
from .guard import PhaseError
from .tp import check_tp, head_bands
from .tp_comm import NO_MULTICAST_ENV, make_communicator, resolve_engine, visible_gpus
from .tp_rank import D_MODEL, PeerFailed, TensorParallelStep, band_view, make_w_o

__all__ = ["TPJob", "TPRun", "TPError", "TPResult", "launch", "run_rank", "tp_decode", "FORMS",
           "TIMED_PHASES"]

FORMS = ("all_gather", "all_reduce")
TIMED_PHASES = ("attn", "combine", "o_proj", "all_gather", "all_reduce", "step")
BARRIER_TIMEOUT_S = 300.0
GRACE_S = 30.0   # after one rank fails, how long the others get to reach the checkpoint


@dataclass(frozen=True)
class TPJob:
    """What every rank runs. Inputs are drawn in each rank from `seed` (the same arrays on
    every rank: make_paged_inputs, make_w_o), or taken from `arrays` (host NumPy: q,
    kv_cache, block_table, cache_seqlens, wv_b, w_o)."""

    dims: Dims
    lengths: tuple = (4096,)
    s_q: int = 1
    causal: bool = False
    page_size: int = 64
    cache_dtype: str = "f16"
    q_dtype: str = "f32"
    seed: int = 0
    d_model: int = D_MODEL
    scale: float | None = None
    variant: str = "auto"
    budgets: tuple = ("band",)
    splits: object = None
    forms: tuple = FORMS
    engine: str = "auto"
    executor: str = "gpu"
    fault_rank: int | None = None
    return_outputs: bool = True    # rank 0 sends back gathered out and y (first budget)
    check_requests: int | None = None   # only the first this many requests of them
    timing: dict | None = None     # {"warmup", "repeats", "flush"}: time every phase
    num_sms: int = 132             # the schedule executor's model device
    blocks_per_sm: int = 1
    arrays: dict | None = field(default=None, repr=False)

    def host_inputs(self) -> dict:
        if self.arrays is not None:
            return dict(self.arrays)
        from .paged_inputs import make_paged_inputs

        inp = make_paged_inputs(self.dims, self.lengths, s_q=self.s_q,
                                page_size=self.page_size, cache_dtype=self.cache_dtype,
                                q_dtype=self.q_dtype, causal=self.causal, seed=self.seed)
        return {"q": inp.q, "kv_cache": inp.kv_cache, "block_table": inp.block_table,
                "cache_seqlens": inp.cache_seqlens, "wv_b": inp.wv_b, "w_o": None}


class TPError(RuntimeError):
    """A tensor-parallel run failed: the first failing rank's own report, located."""

    def __init__(self, report: dict):
        self.report = report
        super().__init__(f"rank {report['rank']}, phase {report.get('phase')!r}: "
                         f"{report.get('error')}")


@dataclass
class TPRun:
    world: int
    engine: str
    reports: list
    wall_s: float

    @property
    def ok(self) -> bool:
        return all(r.get("ok") for r in self.reports)

    def failures(self) -> list:
        """The ranks that failed on their own (a PeerFailed rank only stopped for them)."""
        return [r for r in self.reports if not r.get("ok") and not r.get("peer_failed")]

    def raise_for_failure(self) -> None:
        bad = self.failures() or [r for r in self.reports if not r.get("ok")]
        if bad:
            raise TPError(bad[0])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Checkpoint:
    """The host barrier before a collective (see the module docstring)."""

    def __init__(self, rank, world, status, barrier):
        self.rank, self.world, self.status, self.barrier = rank, world, status, barrier

    def __call__(self, phase: str, failed: BaseException | None = None) -> None:
        self.status[self.rank] = 1 if failed is not None else 0
        self.barrier.wait(BARRIER_TIMEOUT_S)
        bad = [r for r in range(self.world) if self.status[r]]
        self.barrier.wait(BARRIER_TIMEOUT_S)   # all have read before the next round
        if failed is None and bad:
            raise PeerFailed(f"rank {bad[0]} failed a phase; rank {self.rank} stopped before "
                             f"{phase} instead of waiting in the collective")


def _timed(step, job, check):
    """Every phase of `step` timed with CUDA events (sandbox/timing.py), the same number of
    runs on every rank (a collective needs all ranks in every run)."""
    import cupy

    from .kernels import device_info
    from .timing import L2Flush, Spinner, time_gpu

    t = job.timing
    kw = dict(warmup=int(t.get("warmup", 3)), min_repeats=int(t.get("repeats", 20)),
              max_repeats=int(t.get("repeats", 20)), target_s=0.0)
    flush = L2Flush(device_info(step.device_id).l2_bytes) if t.get("flush", True) else None
    spinner = Spinner()
    zeros_y = None if step.y is None else cupy.zeros_like(step.y)
    comm = step.comm
    fns = {"attn": step.run_attn, "combine": step.run_combine}
    if "all_reduce" in job.forms:
        fns["o_proj"] = step.run_o_proj
        fns["all_reduce"] = lambda: comm.all_reduce(zeros_y)
    if "all_gather" in job.forms:
        fns["all_gather"] = lambda: comm.all_gather(step.send, step.recv)

    def whole():
        step.run_attn()
        step.run_combine()
        if "all_reduce" in job.forms:
            step.run_o_proj()
        if "all_gather" in job.forms:
            step.send[:, :, :step.band.heads] = step.out
            comm.all_gather(step.send, step.recv)
        if "all_reduce" in job.forms:
            comm.all_reduce(step.y)
    fns["step"] = whole
    step.step.guard.sync_check = False   # a sync per phase would be timed too
    out = {}
    for name in TIMED_PHASES:
        if name in fns:
            check(f"timing {name}")
            out[name] = time_gpu(fns[name], flush=flush, spinner=spinner, **kw).as_dict()
    step.step.guard.sync_check = True
    return out


def _to_host(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


def run_rank(job: TPJob, rank: int, world: int, port: int, status, barrier,
             fake_dir: str | None) -> dict:
    """Rank `rank`'s whole run, as a report (never raises)."""
    report: dict = {"rank": rank, "world": world, "pid": os.getpid(), "ok": False,
                    "env": {k: os.environ.get(k) for k in NO_MULTICAST_ENV},
                    "executor": job.executor}
    check = _Checkpoint(rank, world, status, barrier)
    comm = None
    try:
        band = head_bands(job.dims.n_head, world)[rank]
        report["band"] = [band.start, band.stop]
        host = job.host_inputs()
        if host.get("w_o") is None and "all_reduce" in job.forms:
            w_o = make_w_o(job.dims.n_head, job.dims.v_head, job.d_model, seed=job.seed,
                           heads=band.slice)
        else:
            w_o = host.get("w_o")
            w_o = None if w_o is None else w_o[band.slice]
        q, wv_b, _ = band_view(band, host["q"], host["wv_b"])
        shared = [host["kv_cache"], host["block_table"], host["cache_seqlens"]]
        if job.executor == "gpu":
            import cupy

            cupy.cuda.Device(rank).use()
            report["device"] = rank
            q, wv_b, w_o, *shared = (None if a is None else cupy.asarray(a)
                                     for a in (q, wv_b, w_o, *shared))
        report["engine"] = resolve_engine(job.engine)
        comm = make_communicator(job.engine, rank, world, rank, port, barrier=barrier,
                                 directory=fake_dir)
        report["plans"], report["timings"] = {}, {}
        for i, budget in enumerate(job.budgets):
            step = TensorParallelStep(comm, q, *shared, wv_b, w_o, n_head=job.dims.n_head,
                                      variant=job.variant, budget=budget, splits=job.splits,
                                      causal=job.causal, scale=job.scale,
                                      executor=job.executor,
                                      checkpoint=check, num_sms=job.num_sms,
                                      blocks_per_sm=job.blocks_per_sm)
            report["plans"][budget] = {"grid": list(step.plan.grid),
                                       "max_chunks": step.plan.max_chunks,
                                       "programs": step.plan.programs,
                                       "slots": step.plan.slots, "reason": step.plan.reason,
                                       "kernel": step.attn_launch.kernel,
                                       "variant": step.variant}
            if job.fault_rank == rank and i == 0:
                step.plant_fault()
            out, y = step.run(job.forms)
            if i == 0 and job.return_outputs and rank == 0:
                n = job.check_requests
                report["out"] = None if out is None else _to_host(out[:n])
                report["y"] = None if y is None else _to_host(y[:n])
            if job.timing is not None and job.executor == "gpu":
                report["timings"][budget] = _timed(step, job, check)
            if job.executor == "gpu":
                report["buffers_on"] = sorted({int(a.device.id)
                                               for a in step.buffers().values()})
        report["ok"] = True
    except PhaseError as exc:
        report.update(phase=exc.phase, error=str(exc), variant=exc.variant,
                      launch=None if exc.launch is None else {
                          "kernel": exc.launch.kernel, "grid": list(exc.launch.grid),
                          "block": list(exc.launch.block), "smem_bytes": exc.launch.smem_bytes})
    except PeerFailed as exc:
        report.update(peer_failed=True, error=str(exc))
    except threading.BrokenBarrierError:
        report.update(error="a peer did not reach the checkpoint in time")
    except Exception as exc:   # reported, with where it came from, never lost
        report.update(error=f"{type(exc).__name__}: {exc}",
                      traceback=traceback.format_exc(limit=8))
    finally:
        if comm is not None:
            try:
                comm.close() if report["ok"] else comm.abort()
            except Exception as exc:
                report["close_error"] = f"{type(exc).__name__}: {exc}"
    return report


def _child(job, rank, world, port, status, barrier, fake_dir, queue):
    os.environ.update(NO_MULTICAST_ENV)   # before anything in this process loads NCCL
    try:
        report = run_rank(job, rank, world, port, status, barrier, fake_dir)
    except BaseException as exc:   # even a KeyboardInterrupt is reported
        report = {"rank": rank, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
    queue.put(report)
    queue.close()
    queue.join_thread()   # the report is in the pipe
    sys.stdout.flush()
    sys.stderr.flush()
    # No interpreter teardown: after a device fault, destructors (an NCCL communicator's)
    # and the join of child processes at exit could wait forever.
    os._exit(0 if report.get("ok") else 1)


def launch(job: TPJob, world: int, *, mode: str = "process", timeout_s: float = 600.0,
           gpus: int | None = None) -> TPRun:
    """Run `job` on `world` ranks; every rank's report, in rank order. `gpus`: the visible
    device count, checked against `world` for the GPU executor."""
    check_tp(world, job.dims.n_head, gpus if job.executor == "gpu" else None)
    if mode not in ("process", "thread"):
        raise ValueError(f"mode must be process or thread, got {mode!r}")
    if job.fault_rank is not None and not 0 <= job.fault_rank < world:
        raise ValueError(f"fault_rank must be in 0..{world - 1}, got {job.fault_rank}")
    engine = resolve_engine(job.engine)
    if mode == "thread" and engine != "fake":
        raise ValueError("mode thread takes the fake communicator only (an NCCL rank is a "
                         "process of its own)")
    if job.executor == "schedule" and engine != "fake":
        raise ValueError("the schedule executor computes on the host: it takes the fake "
                         f"communicator, not {engine}")
    job = replace(job, engine=engine)
    t0 = time.perf_counter()
    fake_dir = tempfile.mkdtemp(prefix="mlasandbox-tp-") if engine == "fake" else None
    port = _free_port()
    try:
        if mode == "thread":
            reports = _run_threads(job, world, port, fake_dir, timeout_s)
        else:
            reports = _run_processes(job, world, port, fake_dir, timeout_s)
    finally:
        if fake_dir is not None:
            for f in os.listdir(fake_dir):
                os.remove(os.path.join(fake_dir, f))
            os.rmdir(fake_dir)
    return TPRun(world, engine, reports, time.perf_counter() - t0)


def _run_threads(job, world, port, fake_dir, timeout_s):
    barrier = threading.Barrier(world)
    status = [0] * world
    reports: list = [None] * world

    def body(r):
        reports[r] = run_rank(job, r, world, port, status, barrier, fake_dir)
    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    return [rep or {"rank": r, "ok": False, "error": f"no report within {timeout_s:.0f} s"}
            for r, rep in enumerate(reports)]


def _run_processes(job, world, port, fake_dir, timeout_s):
    import multiprocessing as mp
    from queue import Empty

    ctx = mp.get_context("spawn")
    status, barrier, queue = ctx.Array("i", world), ctx.Barrier(world), ctx.Queue()
    saved = {k: os.environ.get(k) for k in NO_MULTICAST_ENV}
    os.environ.update(NO_MULTICAST_ENV)   # the spawned interpreters start with these
    try:
        procs = [ctx.Process(target=_child, daemon=False, name=f"mlasandbox-tp-rank{r}",
                             args=(job, r, world, port, status, barrier, fake_dir, queue))
                 for r in range(world)]
        for p in procs:
            p.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    reports: dict = {}
    deadline = time.monotonic() + timeout_s
    while len(reports) < world and time.monotonic() < deadline:
        try:
            rep = queue.get(timeout=0.5)
            reports[rep["rank"]] = rep
            if not rep.get("ok"):
                deadline = min(deadline, time.monotonic() + GRACE_S)
        except Empty:
            if all(not p.is_alive() for p in procs) and queue.empty():
                break
    for r, p in enumerate(procs):
        p.join(5 if r in reports else 0.1)
        if p.is_alive():   # ours, by its own handle: stuck past the deadline
            p.terminate()
            p.join(5)
        if r not in reports:
            why = (f"terminated: no report within {timeout_s:.0f} s" if p.exitcode in
                   (None, -15) else f"exited with code {p.exitcode} before reporting")
            reports[r] = {"rank": r, "ok": False, "error": why}
    return [reports[r] for r in range(world)]


@dataclass
class TPResult:
    """out [B, s_q, H, v_head] all-gathered; y [B, s_q, d_model] all-reduced (None without
    w_o); run: every rank's report."""

    out: np.ndarray
    y: np.ndarray | None
    run: TPRun


def tp_decode(q, kv_cache, block_table, cache_seqlens, wv_b, w_o=None, *, tp: int,
              variant: str = "auto", budget: str = "band", engine: str = "auto",
              causal: bool = False, scale=None, executor: str = "gpu",
              timeout_s: float = 600.0) -> TPResult:
    """One paged decode step on `tp` GPUs, heads banded over them (host NumPy inputs, the
    paged contract of sandbox/paged.py; w_o [H, v_head, d_model] for the projection's
    all-reduce). Raises TPError naming the rank and the phase of a failure."""
    from .paged import check_paged_inputs

    arrays = {"q": q, "kv_cache": kv_cache, "block_table": block_table,
              "cache_seqlens": cache_seqlens, "wv_b": wv_b, "w_o": w_o}
    for name, a in arrays.items():
        if a is not None and not isinstance(a, np.ndarray):
            raise TypeError(f"tp_decode takes host NumPy arrays (each rank copies its band "
                            f"to its GPU); {name} is {type(a).__name__}")
    shape, _ = check_paged_inputs(q, kv_cache, block_table, cache_seqlens, wv_b,
                                  scale=scale, causal=causal)
    if wv_b is None:
        raise ValueError("tp_decode combines out: it needs wv_b")
    if w_o is not None and (w_o.ndim != 3 or w_o.shape[:2] != (shape.n_head,
                                                               shape.dims.v_head)):
        raise ValueError(f"w_o must be [n_head={shape.n_head}, v_head={shape.dims.v_head}, "
                         f"d_model], got {tuple(w_o.shape)}")
    gpus = None
    if executor == "gpu":
        gpus = visible_gpus()
    job = TPJob(dims=shape.dims, seed=0, variant=variant, budgets=(budget,), scale=scale,
                causal=causal, forms=FORMS if w_o is not None else ("all_gather",),
                engine=engine, executor=executor, arrays=arrays)
    run = launch(job, tp, timeout_s=timeout_s, gpus=gpus,
                 mode="process" if executor == "gpu" else "thread")
    run.raise_for_failure()
    return TPResult(run.reports[0]["out"], run.reports[0].get("y"), run)
