"""The bench's device side: inputs, prepared steps, timed phases, the correctness spot check.

`CupyBackend` is what `bench.run_bench` and `sweep.run_sweep` drive on a GPU. Everything runs
on one non-blocking stream of its own (CUDA graphs cannot be captured on the legacy default
stream), under the project's phase guard:

* the inputs are drawn once per cache dtype at the largest context (`make_inputs(xp=cupy)`,
  no NaN rows) and every `DecodeStep` reads a prefix of them: n_ctx is a parameter, so one
  131072-row cache serves every context;
* the step is chained as a decode step is: q_absorb writes q, attn reads it;
* the timed phases are `run_attn`, `run_combine` (on the partials the last attn wrote) and the
  whole step; q_absorb alone is the control phase;
* graph mode captures a capture-safe twin of the phase: the same launches under a guard that
  does not poll (querying a capturing stream invalidates the capture). After the first
  replay a synchronizing guard polls, so a fault in a replay is still named by its phase.
  The cuBLAS engine is never captured: it allocates its temporaries per call.
"""
from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

import numpy

from . import registry, toolkit
from .api import DecodeStep, QAbsorb
from .ceilings import measure_ceilings
from .compare import DEFAULT_TOLERANCE, Tolerance, compare
from .guard import PhaseGuard
from .inputs import make_inputs
from .kernels import blocks_per_sm, device_info
from .reference import decode as reference_decode
from .timing import L2Flush, Spinner, time_gpu

__all__ = ["CupyBackend", "CUBLAS_TOLERANCE", "tolerance_for", "run_meta"]

# The cuBLAS engine rounds q, p and latent to the cache dtype for its tensor-core GEMMs: its
# tolerance is that rounding (as in tests/test_gpu_kernels.py). CUDA variants: compare's
# defaults (1e-4), from the f32 arithmetic.
CUBLAS_TOLERANCE = {"f16": 3e-3, "bf16": 2e-2}


def tolerance_for(variant: str, cache_dtype: str):
    if registry.variant(variant).is_cuda:
        return DEFAULT_TOLERANCE
    t = CUBLAS_TOLERANCE[cache_dtype]
    return Tolerance(t, t, t)


def _version(dist: str):
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    """HEAD of the checkout (with -dirty), or $MLASANDBOX_COMMIT where the tree was copied
    without its .git (a remote GPU machine)."""
    root = Path(__file__).resolve().parent.parent
    if os.environ.get("MLASANDBOX_COMMIT"):
        return os.environ["MLASANDBOX_COMMIT"]
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=5)
        if out.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except Exception:
        return None


def run_meta() -> dict:
    """Device, versions, commit and date: what a results file must say about itself."""
    import cupy

    dev = toolkit.device_properties(cupy.cuda.Device().id)
    try:
        nvrtc = "%d.%d" % toolkit.nvrtc_version()
    except Exception:
        nvrtc = None
    return {"device": dev["name"], "arch": dev["arch"], "num_sms": dev["sms"],
            "l2_bytes": dev["l2_bytes"], "memory_bytes": dev["global_mem_bytes"],
            "driver": dev["driver_version"], "cuda_runtime": dev["runtime_version"],
            "nvrtc": nvrtc, "cupy": cupy.__version__, "numpy": numpy.__version__,
            "python": platform.python_version(), "mlasandbox": _version("mlasandbox"),
            "commit": _git_commit(), "host": platform.node(),
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}


class CupyBackend:
    """Timed phases on the current CUDA device (see the module docstring)."""

    def __init__(self, flush: bool = True, preroll: bool = True):
        import cupy

        self.cupy = cupy
        self.info = device_info()
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.flush = L2Flush(self.info.l2_bytes) if flush else None
        self.spinner = Spinner() if preroll else None
        self.inp = None
        self.qa = None
        self._steps: dict = {}

    # ---- run-level ------------------------------------------------------------------
    @property
    def arch(self) -> str:
        return self.info.arch

    @property
    def num_sms(self) -> int:
        return self.info.num_sms

    def meta(self) -> dict:
        m = run_meta()
        m["l2_flush_bytes"] = self.flush.nbytes if self.flush else 0
        return m

    def ceilings(self, copy_bytes: int, gemm_n: int, timing_kw: dict) -> dict:
        return measure_ceilings(copy_bytes, gemm_n, stream=self.stream, **timing_kw)

    def prepare(self, dims, n_alloc: int, cache_dtype: str, q_dtype: str, seed: int) -> None:
        self.release()
        with self.stream:
            self.inp = make_inputs(dims, n_alloc, n_alloc, cache_dtype, q_dtype, seed=seed,
                                   nan_fill=False, xp=self.cupy)
            self.qa = QAbsorb(self.inp.q_nope, self.inp.q_rope, self.inp.wk_b, q_dtype, dims)
            self.qa.run()
        self.stream.synchronize()
        self.dims, self.cache_dtype, self.q_dtype = dims, cache_dtype, q_dtype

    def release_steps(self) -> None:
        self._steps.clear()

    def release(self) -> None:
        self._steps.clear()
        self.inp = self.qa = None
        self.cupy.get_default_memory_pool().free_all_blocks()

    # ---- steps ------------------------------------------------------------------------
    def _step(self, variant: str, n_ctx: int, splits):
        v = registry.variant(variant)
        s = splits if (v.is_cuda and v.splits and splits not in (None, "auto")) else None
        key = (variant, n_ctx, s)
        step = self._steps.get(key)
        if step is None:
            with self.stream:
                step = DecodeStep(self.qa.q, self.inp.cache, self.inp.wv_b, n_ctx, variant,
                                  splits=s, scale=self.inp.scale)
            self._steps[key] = step
        return step

    def plan(self, variant: str, n_ctx: int, splits) -> dict:
        step = self._step(variant, n_ctx, splits)
        if not step.variant.is_cuda:
            return {"splits": None, "head_blocks": None, "heads_per_block": None,
                    "attn_kernel": "cuBLAS engine (CuPy)", "combine_kernel": None,
                    "reason": "the cuBLAS engine does not split"}
        p = step.plan
        return {"splits": p.splits, "head_blocks": p.head_blocks,
                "heads_per_block": p.heads_per_block, "grid": list(p.grid),
                "blocks": p.blocks, "slots": p.slots, "waves": p.waves,
                "idle_sms": p.idle_sms, "attn_kernel": step.attn_inst.name,
                "combine_kernel": step.combine_inst.name, "reason": p.reason,
                "attn_num_regs": int(getattr(step.attn_kernel, "num_regs", -1)),
                "driver_blocks_per_sm": blocks_per_sm(step.attn_inst)}

    def _phase_fn(self, step, phase: str):
        qa = self.qa
        if phase == "attn":
            fn = step.run_attn
        elif phase == "combine":
            fn = step.run_combine
        elif phase == "step":
            def fn():
                qa.run()
                step.run_attn()
                step.run_combine()
        else:
            raise ValueError(f"unknown phase {phase!r}")
        return fn

    def _time(self, fn, use_graph: bool, phase: str, variant: str, timing_kw: dict):
        def check_replay():
            with PhaseGuard(variant, sync_check=True).phase(f"{phase} (graph replay)"):
                pass

        return time_gpu(fn, stream=self.stream, flush=self.flush,
                        graph_fn=fn if use_graph else None, spinner=self.spinner,
                        after_graph_check=check_replay, **timing_kw)

    def time(self, variant: str, n_ctx: int, phase: str, splits, use_graph: bool,
             timing_kw: dict):
        step = self._step(variant, n_ctx, splits)
        if phase == "combine":
            with self.stream:
                step.run_attn()  # the partials the combine merges
        fn = self._phase_fn(step, phase)
        # the phase guards do not poll inside a capture (guard.py), so fn itself is captured
        return self._time(fn, use_graph and step.variant.is_cuda, phase, variant, timing_kw)

    def time_control(self, use_graph: bool, timing_kw: dict):
        return self._time(self.qa.run, use_graph, "q_absorb", "q_absorb", timing_kw)

    # ---- correctness ------------------------------------------------------------------
    def check(self, variants, dims, n_ctx: int, cache_dtype: str, q_dtype: str, seed: int,
              splits, rescale: bool = True) -> list[dict]:
        """Each variant once against the float64 reference, on fresh inputs with NaN rows past
        n_ctx and NaN-poisoned outputs and partials (an unwritten element shows as NaN).
        rescale=False runs the negative control's combine (no exp(m_i - m) rescale)."""

        cupy = self.cupy
        with self.stream:
            inp = make_inputs(dims, n_ctx + 7, n_ctx, cache_dtype, q_dtype, seed=seed + 1,
                              nan_fill=True, xp=cupy)
        # The reference copies to the host on the legacy stream, which does not wait for a
        # non-blocking stream: finish the draws first.
        self.stream.synchronize()
        ref = reference_decode(**inp.decode_args())
        out = []
        for name in variants:
            v = registry.variant(name)
            s = splits if (v.is_cuda and v.splits and splits not in (None, "auto")) else None
            row = {"variant": name, "n_ctx": n_ctx, "heads": dims.n_head, "splits": None}
            try:
                with self.stream:
                    step = DecodeStep(**inp.decode_args(), variant=name, splits=s,
                                      sync_check=True, rescale=rescale)
                    for arr in (step.out, step.latent, step.lse):
                        arr.fill(cupy.nan)
                    for buf in ("part_acc", "part_m", "part_l"):
                        if getattr(step, buf, None) is not None:
                            getattr(step, buf).fill(cupy.nan)
                    res = step.run()
                self.stream.synchronize()
                cmp = compare(res, ref, tolerance_for(name, cache_dtype))
                row.update({"ok": cmp.ok, "splits": step.plan.splits if step.plan else None,
                            "out_relL2": cmp.out.value, "latent_relL2": cmp.latent.value,
                            "lse_abs": cmp.lse.value, "tolerance": cmp.tolerance.out,
                            "detail": "" if cmp.ok else cmp.summary()})
            except Exception as exc:  # a launch or validation failure is a failed check
                row.update({"ok": False, "detail": f"{type(exc).__name__}: {exc}"})
            out.append(row)
        return out
