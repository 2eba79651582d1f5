"""The bench's device side: inputs, prepared steps, timed phases, the correctness spot check.

`CupyBackend` is what `bench.run_bench` and `sweep.run_sweep` drive on a GPU. Everything runs
on one non-blocking stream of its own (CUDA graphs cannot be captured on the legacy default
stream), under the project's phase guard:

* the inputs are drawn once per cache dtype at the largest context (`make_inputs(xp=cupy)`,
  no NaN rows) and every `DecodeStep` reads a prefix of them: n_ctx is a parameter, so one
  131072-row cache serves every context;
* the step is chained as a decode step is: q_absorb writes q, attn reads it (launched as
  q_absorb's programmatic dependent where the step uses PDL: `run_attn(after_q_absorb=True)`);
* the timed phases are `run_attn`, `run_combine` (on the partials the last attn wrote) and the
  whole step; q_absorb alone is the control phase;
* graph mode captures a capture-safe twin of the phase: the same launches under a guard that
  does not poll (querying a capturing stream invalidates the capture). After the first
  replay a synchronizing guard polls, so a fault in a replay is still named by its phase.
  The cuBLAS engine is never captured: it allocates its temporaries per call.
* the launch floor (`time_floor`, the paged phase "floor"): a CUDA graph of one empty kernel
  per kernel of the step (q_absorb's, then the step's launches), with the same grids, block
  sizes and programmatic launches (timing.LaunchFloor), replayed and timed like the step.
* `pdl=False` builds every step with plain launches, for the PDL-against-plain comparison.
"""
from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
from dataclasses import replace
from importlib import metadata
from pathlib import Path

import numpy

from . import registry, toolkit
from .api import DecodeStep, QAbsorb
from .ceilings import measure_ceilings
from .clocks import ClockSampler
from .compare import DEFAULT_TOLERANCE, Tolerance, compare
from .compare_paged import compare_paged
from .cublas_engine import CUBLAS_TOLERANCE
from .guard import Launch, PhaseGuard
from .inputs import make_inputs
from .kernels import blocks_per_sm, device_info
from .paged import PagedResult
from .paged_api import PagedDecodeStep
from .paged_inputs import make_paged_inputs
from .peers import PeerInputs, PeerUnavailable, load_peers, peer_q, to_result, tolerance_of
from .provenance import sources_digest
from .reference import decode as reference_decode, decode_paged
from .timing import L2Flush, LaunchFloor, Spinner, time_gpu
from .user_kernel import is_user_kernel_spec

__all__ = ["CupyBackend", "PagedBackend", "CUBLAS_TOLERANCE", "tolerance_for", "run_meta"]

# The cuBLAS engine rounds q, p and latent to the cache dtype for its tensor-core GEMMs: its
# tolerance is that rounding (cublas_engine.CUBLAS_TOLERANCE). CUDA variants: compare's
# defaults (1e-4), from the f32 arithmetic; those that round p (Variant.round_p: wgmma64,
# mma16r, mma32r) registry.ROUND_P_RELL2_BOUND for out and latent.


def tolerance_for(variant: str, cache_dtype: str):
    if is_user_kernel_spec(variant):
        return DEFAULT_TOLERANCE
    if registry.variant(variant).round_p:   # p rounded to the cache dtype
        t = registry.ROUND_P_RELL2_BOUND[cache_dtype]
        return Tolerance(t, t, DEFAULT_TOLERANCE.lse_abs)
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
    """Device, versions, commit, the sources' digest (provenance.py: the code that ran, where
    a copied tree's .git may name another commit) and date: what a results file must say
    about itself."""
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
            "commit": _git_commit(), "sources": sources_digest(), "host": platform.node(),
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}


class CupyBackend:
    """Timed phases on the current CUDA device (see the module docstring)."""

    def __init__(self, flush: bool = True, preroll: bool = True, pdl: bool = True):
        import cupy

        self.cupy = cupy
        self.pdl = pdl
        self._floor = None
        self.info = device_info()
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.flush = L2Flush(self.info.l2_bytes) if flush else None
        self.spinner = Spinner() if preroll else None
        self.clocks, self.clocks_note = ClockSampler.open(cupy.cuda.Device().id)
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
        m["clocks"] = self.clocks_note
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
                                  splits=s, scale=self.inp.scale, pdl=self.pdl)
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
                step.run_attn(after_q_absorb=True)
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
                        after_graph_check=check_replay, clocks=self.clocks, **timing_kw)

    def time(self, variant: str, n_ctx: int, phase: str, splits, use_graph: bool,
             timing_kw: dict):
        step = self._step(variant, n_ctx, splits)
        if phase == "combine":
            with self.stream:
                step.run_attn()  # the partials the combine merges
        fn = self._phase_fn(step, phase)
        # the phase guards do not poll inside a capture (guard.py), so fn itself is captured
        return self._time(fn, use_graph and step.variant.is_cuda, phase, variant, timing_kw)

    def _time_floor(self, launches, variant: str, timing_kw: dict):
        if self._floor is None:
            self._floor = LaunchFloor()
        launches = list(launches)
        return self._time(lambda: self._floor(launches), True, "floor", variant, timing_kw)

    def time_floor(self, variant: str, n_ctx: int, splits, timing_kw: dict):
        """The launch floor of the whole step (q_absorb, attn, combine): None for the cuBLAS
        engine, whose launches are CuPy's and cuBLAS's."""
        step = self._step(variant, n_ctx, splits)
        if not step.variant.is_cuda:
            return None
        qa = self.qa
        absorb = Launch(qa.inst.name, qa.grid, (qa.inst.threads, 1, 1), 0)
        attn, *rest = step.launches  # the step phase launches attn behind q_absorb (PDL)
        return self._time_floor([absorb, replace(attn, pdl=step.pdl), *rest], variant,
                                timing_kw)

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


def _refuse_auto(variants) -> None:
    """The paged backend takes the variants a run resolved: on the check's cut of the batch
    (fewer heads and requests) `auto` could pick another kernel than the one timed."""
    if "auto" in variants:
        raise ValueError("the paged backend takes concrete variants: resolve auto for the "
                         "batch first (bench_paged.resolve_auto)")


class PagedBackend(CupyBackend):
    """The paged bench's device side (bench_paged.run_paged_bench): one batch's inputs,
    PagedDecodeSteps per variant (two per variant for the A/A), the peers, and the control
    phase q_absorb of CupyBackend on a short batch-1 cache of the same heads."""

    CONTROL_ROWS = 64   # the control phase reads no cache: a short one serves it

    def __init__(self, flush: bool = True, preroll: bool = True, pdl: bool = True):
        super().__init__(flush, preroll, pdl)
        self.cfg = self.paged = None
        self._peers: dict = {}
        self._skipped: list = []

    def prepare_paged(self, cfg) -> None:
        _refuse_auto(cfg.variants)
        qd = "f32" if cfg.q_dtype == "f32" else cfg.cache_dtype
        self.prepare(cfg.dims, self.CONTROL_ROWS, cfg.cache_dtype, qd, cfg.seed)
        self.cfg = cfg
        host = make_paged_inputs(cfg.dims, cfg.lengths, s_q=cfg.s_q, page_size=cfg.page_size,
                                 cache_dtype=cfg.cache_dtype, q_dtype=qd, causal=cfg.causal,
                                 seed=cfg.seed)
        self.paged_host = host
        with self.stream:
            self.paged = self._to_device(host)
        self.stream.synchronize()
        self._peers, self._skipped = load_peers(cfg.peers)
        self._peer_runs: dict = {}

    def _to_device(self, host):
        cp = self.cupy
        return {k: (None if v is None else cp.asarray(v)) for k, v in (
            ("q", host.q), ("kv_cache", host.kv_cache), ("block_table", host.block_table),
            ("cache_seqlens", host.cache_seqlens), ("wv_b", host.wv_b))}

    def skipped_peers(self) -> list:
        return list(self._skipped)

    def available_peers(self) -> list:
        return [p for p in self._peers if p not in {s["name"] for s in self._skipped}]

    def release(self) -> None:
        super().release()
        self.paged = None
        self._peer_runs = {}

    # ---- steps -----------------------------------------------------------------------
    def _paged_step(self, variant: str, arm: int = 0, wv_b: bool = True):

        key = ("paged", variant, arm, wv_b)
        step = self._steps.get(key)
        if step is None:
            cfg = self.cfg
            inputs = self.paged if wv_b else {**self.paged, "wv_b": None}
            with self.stream:
                step = PagedDecodeStep(**inputs, causal=cfg.causal, variant=variant,
                                       splits=None if cfg.splits == "auto" else cfg.splits,
                                       scale=self.paged_host.scale, pdl=self.pdl)
                step.check_indices()
            self._steps[key] = step
        return step

    def paged_plan(self, variant: str, arm: int = 0) -> dict:
        step = self._paged_step(variant, arm)
        p = step.plan
        n_chunks, chunk_len = p.for_lengths(self.cfg.lengths)
        return {"variant": step.variant.name, "grid": list(p.grid), "max_chunks": p.max_chunks,
                "head_blocks": p.head_blocks, "min_chunk": p.min_chunk, "tile": p.tile,
                "target": p.target, "single_pass": p.single_pass,
                "merges_in_attn": step.merges_in_attn,
                "reason": p.reason, "n_chunks": [int(c) for c in n_chunks],
                "waves": [p.waves_taken(self.cfg.lengths), p.waves],
                "chunk_len_max": int(chunk_len.max()),
                "launches": [(ln.kernel, list(ln.grid), list(ln.block)) for ln in step.launches()],
                "attn_kernel": step.attn_inst.name,
                "attn_num_regs": int(getattr(step.attn_kernel, "num_regs", -1)),
                "driver_blocks_per_sm": step.attn_blocks_per_sm,
                "tile_copy": "tma" if step.uses_tma else "cp.async"}

    def time_paged(self, variant: str, phase: str, timing_kw: dict, arm: int = 0):
        step = self._paged_step(variant, arm)
        if phase == "combine":
            with self.stream:
                step.run_attn()  # the partials the combine merges
        fns = {"attn": step.run_attn, "combine": step.run_combine, "step": step.run}
        if phase == "floor":  # the step's launches, empty, as a graph (as "graph" replays it)
            return self._time_floor(step.launches(), variant, timing_kw)
        if phase == "graph":
            graph = step.capture()
            return self._time(lambda: graph.launch(self.stream), False, "step (graph replay)",
                              variant, timing_kw)
        if phase == "latent":  # the step without wv_b: latent and lse, as the peers return
            lat = self._paged_step(variant, arm, wv_b=False)
            if not self.cfg.graph:
                return self._time(lat.run, False, "latent step", variant, timing_kw)
            graph = lat.capture()
            return self._time(lambda: graph.launch(self.stream), False,
                              "latent step (graph replay)", variant, timing_kw)
        return self._time(fns[phase], False, phase, variant, timing_kw)

    def time_peer(self, name: str, timing_kw: dict):
        run = self._peer_runs.get(name)
        if run is None:
            run = self._peer_run(name, self.paged, self.paged_host)
            self._peer_runs[name] = run
        return time_gpu(run, stream=self.stream, flush=self.flush, spinner=self.spinner,
                        clocks=self.clocks, **timing_kw)

    def _peer_run(self, name, dev: dict, host):

        q = dev["q"]
        if str(q.dtype) == "float32":
            with self.stream:
                q = self.cupy.asarray(peer_q(host.q, self.cfg.cache_dtype))
        inp = PeerInputs(q, dev["kv_cache"], dev["block_table"], dev["cache_seqlens"],
                         numpy.asarray(host.cache_seqlens), numpy.asarray(host.block_table),
                         self.cfg.cache_dtype, host.scale, host.causal,
                         self.cfg.dims.kv_lora)
        return self._peers[name].prepare(inp, self.stream.ptr)

    # ---- correctness ------------------------------------------------------------------
    def check_paged(self, cfg, rescale: bool = True) -> list[dict]:
        """Every variant and peer once on a cut of the batch (its first check_batch requests,
        check_heads heads) against the float64 paged reference, outputs NaN-poisoned first.
        The peers run on q rounded to the cache dtype, and are checked against the reference
        of that q. rescale=False runs the negative control's combine."""

        _refuse_auto(cfg.variants)
        cupy = self.cupy
        qd = "f32" if cfg.q_dtype == "f32" else cfg.cache_dtype
        host = make_paged_inputs(cfg.check_dims(), cfg.check_lengths(), s_q=cfg.s_q,
                                 page_size=cfg.page_size, cache_dtype=cfg.cache_dtype,
                                 q_dtype=qd, causal=cfg.causal, seed=cfg.seed + 1)
        ref = decode_paged(**host.decode_args())
        with self.stream:
            dev = self._to_device(host)
        self.stream.synchronize()
        rows = []
        for name in cfg.variants:
            row = {"variant": name, "kind": "variant", "batch": len(cfg.check_lengths()),
                   "heads": cfg.check_dims().n_head}
            try:
                with self.stream:
                    step = PagedDecodeStep(**dev, causal=cfg.causal, variant=name,
                                           splits=None if cfg.splits == "auto" else cfg.splits,
                                           scale=host.scale, sync_check=True, rescale=rescale)
                    step.check_indices()
                    for arr in (step.out, step.latent, step.lse):
                        arr.fill(cupy.nan)
                    res = step.run()
                self.stream.synchronize()
                cmp = compare_paged(res, ref, tolerance_for(name, cfg.cache_dtype))
                row.update(self._cmp_row(cmp))
            except Exception as exc:  # a launch or validation failure is a failed check
                row.update({"ok": False, "detail": f"{type(exc).__name__}: {exc}"})
            rows.append(row)
        if not self._peers:
            return rows
        peer_host = host
        if qd == "f32":
            peer_host = replace(host, q=peer_q(host.q, cfg.cache_dtype))
        pref = decode_paged(**{**peer_host.decode_args(), "wv_b": None})
        pref = PagedResult(pref.latent, pref.lse)
        with self.stream:
            pdev = self._to_device(peer_host)
        for name in list(self._peers):
            row = {"variant": name, "kind": "peer", "batch": len(cfg.check_lengths()),
                   "heads": cfg.check_dims().n_head}
            try:
                latent, lse = self._peer_run(name, pdev, peer_host)()
                self.stream.synchronize()
                cmp = compare_paged(to_result(latent, lse), pref,
                                    tolerance_of(name, cfg.cache_dtype))
                row.update(self._cmp_row(cmp))
            except PeerUnavailable as exc:  # a shape the peer does not take
                self._skipped.append({"name": name, "reason": str(exc)})
                continue
            except Exception as exc:
                row.update({"ok": False, "detail": f"{type(exc).__name__}: {exc}"})
            rows.append(row)
        return rows

    @staticmethod
    def _cmp_row(cmp) -> dict:
        live = cmp.live
        return {"ok": cmp.ok, "out_relL2": live.out.value if live else None,
                "latent_relL2": live.latent.value if live else None,
                "lse_abs": live.lse.value if live else None,
                "tolerance": live.tolerance.out if live else None,
                "empty_rows": cmp.empty_rows, "empty_wrong": cmp.empty_wrong,
                "detail": "" if cmp.ok else cmp.summary()}
