"""One rank of a tensor-parallel paged decode step: its band of heads, its phases, its
collectives.

    step = mla.TensorParallelStep(comm, q_band, kv_cache, block_table, cache_seqlens,
                                  wv_b_band, w_o_band, n_head=H)
    out, y = step.run()      # out [B, s_q, H, v_head] (all-gathered), y [B, s_q, d_model]
    step.variant             # the variant the band runs ("auto" resolved)

The two ways an engine combines head bands, both here:

* all-gather of `out`: every rank sends its band's out [B, s_q, H_band, v_head] (padded to
  the largest band when bands are uneven) and assembles the whole [B, s_q, H, v_head];
* the output projection's all-reduce: every rank multiplies its band's out by its rows of
  the output projection w_o [H, v_head, d_model] (a partial y over its heads) and the
  partials are summed: y = sum over ranks of out_band @ w_o_band.

Phases, each under the launch guard with a sync check, so a fault is reported by the rank
and the phase that made it: attn, combine (the paged step's kernels, with their launch
geometry), o_proj (the partial projection), then the collective (all_gather or all_reduce).
Before a collective the rank passes a checkpoint (a host barrier given by the launcher):
when any rank failed a phase, the others stop there instead of waiting in NCCL for a rank
that will never come, and the failure is reported as that rank's phase.

Executors: "gpu" (PagedDecodeStep on the rank's device, CuPy arrays) and "schedule" (the
float32 NumPy model of the same chunk plan, sandbox/schedule_paged.py, for the CPU suite).
`variant="auto"` is resolved as PagedDecodeStep resolves it on one GPU, by the rows and the
step's facts (auto_variant.AutoFacts.of: the batch, the table's room, q's dtype) on the
rank's device, or on the H200 (sm_90) the schedule executor models: a band takes the variant
a single-GPU step of its heads would, and the unsharded budget the one of all heads.
"""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np

from .guard import Launch, PhaseError, PhaseGuard
from .tp import BUDGETS, Band, as_unsharded, head_bands, unsharded_chunks

__all__ = ["TensorParallelStep", "PeerFailed", "HostGuard", "EXECUTORS", "band_view",
           "make_w_o", "assemble_gathered"]

EXECUTORS = ("gpu", "schedule")
D_MODEL = 7168   # DeepSeek-V3's hidden size: the output projection's width


class PeerFailed(RuntimeError):
    """Another rank failed a phase; this rank stopped at the checkpoint before the
    collective."""


class HostGuard(PhaseGuard):
    """The phase guard of the schedule executor: no stream to poll (NumPy), the same
    PhaseError for a CUDA error raised inside a phase."""

    @contextmanager
    def phase(self, name: str, launch: Launch | None = None):
        from .guard import _cuda_error_types

        try:
            yield
            self.polls += 1
        except _cuda_error_types() as exc:
            raise PhaseError(name, self.variant, launch, exc) from exc


def make_w_o(n_head: int, v_head: int, d_model: int = D_MODEL, *, seed: int = 0,
             heads: slice | None = None) -> np.ndarray:
    """The output projection [heads, v_head, d_model] f32, drawn head by head from
    (seed, head) so every rank draws its own band's rows and they agree with the whole."""
    hs = range(n_head)[heads or slice(None)]
    std = np.float32((n_head * v_head) ** -0.5)
    return np.stack([np.random.default_rng([seed, h]).standard_normal((v_head, d_model),
                                                                       dtype=np.float32) * std
                     for h in hs])


def band_view(band: Band, q, wv_b=None, w_o=None) -> tuple:
    """The band's q [B, s_q, H_band, D], wv_b [H_band, ...] and w_o [H_band, ...], contiguous."""
    def cut(a, axis):
        if a is None:
            return None
        idx = [slice(None)] * a.ndim
        idx[axis] = band.slice
        return a[tuple(idx)].copy()
    return cut(q, 2), cut(wv_b, 0), cut(w_o, 0)


def assemble_gathered(recv, bands, xp=np):
    """[B, s_q, H, v] from the gathered [N, B, s_q, H_max, v] (band r in rows r of the first
    axis, its first bands[r].heads heads valid)."""
    n, b, s_q, h_max, v = recv.shape
    idx = np.concatenate([r * h_max + np.arange(bd.heads) for r, bd in enumerate(bands)])
    flat = recv.transpose(1, 2, 0, 3, 4).reshape(b, s_q, n * h_max, v)
    return xp.take(flat, xp.asarray(idx), axis=2)


class TensorParallelStep:
    """One rank's step (see the module docstring). `q`, `wv_b` and `w_o` hold this rank's
    band of the `n_head` heads (head_bands(n_head, comm.world)[comm.rank]); the cache, the
    table and the lengths are the whole batch's. `budget` "band" re-derives the chunk
    budget for the band, "unsharded" keeps the chunks all heads would get on one GPU.
    `checkpoint(phase, failed)` is the launcher's host barrier; without one (an engine's
    own processes) the collective runs unguarded by peers' state."""

    def __init__(self, comm, q, kv_cache, block_table, cache_seqlens, wv_b, w_o=None, *,
                 n_head: int, variant: str = "auto", budget: str = "band", splits=None,
                 causal: bool = False, scale=None, executor: str = "gpu",
                 sync_check: bool = True, checkpoint=None, num_sms: int = 132,
                 blocks_per_sm: int = 1):
        if budget not in BUDGETS:
            raise ValueError(f"budget must be one of {', '.join(BUDGETS)}, got {budget!r}")
        if executor not in EXECUTORS:
            raise ValueError(f"executor must be one of {', '.join(EXECUTORS)}, got "
                             f"{executor!r}")
        self.comm, self.executor, self.budget = comm, executor, budget
        self.bands = head_bands(n_head, comm.world)
        self.band = self.bands[comm.rank]
        if q.shape[2] != self.band.heads:
            raise ValueError(f"rank {comm.rank} of {comm.world} holds heads "
                             f"{self.band.start}..{self.band.stop - 1} ({self.band.heads}), "
                             f"but q has {q.shape[2]} heads")
        if w_o is not None and (w_o.ndim != 3 or w_o.shape[0] != self.band.heads):
            raise ValueError(f"w_o must be [{self.band.heads}, v_head, d_model] (this rank's "
                             f"band), got {tuple(w_o.shape)}")
        self.n_head, self._checkpoint = n_head, checkpoint
        self.batch, self.s_q = int(q.shape[0]), int(q.shape[1])
        if executor == "gpu":
            self._setup_gpu(q, kv_cache, block_table, cache_seqlens, wv_b, w_o, variant,
                            splits, causal, scale, sync_check)
        else:
            self._setup_schedule(q, kv_cache, block_table, cache_seqlens, wv_b, w_o, variant,
                                 splits, causal, scale, num_sms, blocks_per_sm)
        self._fault = False

    # ---- setup ---------------------------------------------------------------------------
    def _chunks(self, variant, splits, facts, num_sms):
        """The `splits` the band's step takes: the override, None (the band's own budget)
        or the chunks all heads would get on one GPU (budget unsharded), with the instance
        `variant` resolves to at all heads."""
        if splits not in (None, "auto") or self.budget == "band":
            return None if splits == "auto" else splits
        return unsharded_chunks(self.batch, self.s_q, self.n_head, facts, num_sms=num_sms)

    def _say_budget(self, plan, chunks, splits):
        """The plan, its reason naming the unsharded budget where that set the chunks."""
        if chunks is None or splits not in (None, "auto"):
            return plan
        return as_unsharded(plan, chunks, self.n_head, self.batch)

    def _facts(self, variant, shape, auto, blocks_per_sm):
        """facts(heads) of tp.rank_plans: the instance a step of that many heads runs, `auto`
        (AutoFacts) resolving "auto"."""
        from . import registry
        from .paged_api import paged_variant

        def facts(heads):
            inst = registry.paged_attention_instance(
                paged_variant(variant, self.s_q, heads, auto), shape.cache_dtype, shape.q_dtype)
            return inst.heads, inst.tile_rows, blocks_per_sm(inst)
        return facts

    def _setup_gpu(self, q, kv_cache, block_table, cache_seqlens, wv_b, w_o, variant, splits,
                   causal, scale, sync_check):
        import cupy

        from .auto_variant import AutoFacts
        from .kernels import blocks_per_sm, device_info
        from .paged import check_paged_inputs
        from .paged_api import PagedDecodeStep, paged_variant

        self.xp = cupy
        shape, _ = check_paged_inputs(q, kv_cache, block_table, cache_seqlens, wv_b,
                                      scale=scale, causal=causal)
        dev = cupy.cuda.Device().id
        info = device_info(dev)
        auto = AutoFacts.of(shape, info.arch)
        facts = self._facts(variant, shape, auto, blocks_per_sm)
        chunks = self._chunks(variant, splits, facts, info.num_sms)
        if isinstance(variant, str) and variant == "auto":
            # pinned: the band's step runs the variant its plan was made for
            variant = paged_variant(variant, self.s_q, self.band.heads, auto).name
        self.step = PagedDecodeStep(q, kv_cache, block_table, cache_seqlens, wv_b,
                                    causal=causal, variant=variant, splits=chunks,
                                    scale=scale, sync_check=sync_check)
        self.guard, self.device_id = self.step.guard, dev
        self.variant = self.step.variant.name
        self.plan = self._say_budget(self.step.plan, chunks, splits)
        self.attn_launch = self.step.launches()[0]
        self._alloc(cupy, w_o)

    def _setup_schedule(self, q, kv_cache, block_table, cache_seqlens, wv_b, w_o, variant,
                        splits, causal, scale, num_sms, blocks_per_sm):
        from . import registry
        from .auto_variant import WGMMA_ARCH, AutoFacts
        from .paged import check_paged_inputs
        from .paged_api import paged_variant, plan_for

        self.xp = np
        self.inputs = dict(q=q, kv_cache=kv_cache, block_table=block_table,
                           cache_seqlens=cache_seqlens, wv_b=wv_b, causal=causal, scale=scale)
        shape, _ = check_paged_inputs(q, kv_cache, block_table, cache_seqlens, wv_b,
                                      scale=scale, causal=causal)
        auto = AutoFacts.of(shape, WGMMA_ARCH)   # the H200 this executor models
        var = paged_variant(variant, self.s_q, self.band.heads, auto)
        inst = registry.paged_attention_instance(var, shape.cache_dtype, shape.q_dtype)
        facts = self._facts(variant, shape, auto, lambda inst: blocks_per_sm)
        chunks = self._chunks(variant, splits, facts, num_sms)
        self.plan = self._say_budget(plan_for(shape, inst, num_sms=num_sms,
                                              blocks_per_sm=blocks_per_sm, splits=chunks),
                                     chunks, splits)
        self.guard, self.device_id = HostGuard(var.name, sync_check=True), None
        self.variant = var.name
        self.attn_launch = Launch(inst.name, self.plan.grid, (inst.threads, 1, 1),
                                  inst.smem_bytes)
        self.result = None
        self._alloc(np, w_o)

    def _alloc(self, xp, w_o):
        b, s_q, v = self.batch, self.s_q, self._v_head()
        h_max = max(bd.heads for bd in self.bands)
        self.send = xp.zeros((b, s_q, h_max, v), xp.float32)
        self.recv = xp.zeros((self.comm.world, b, s_q, h_max, v), xp.float32)
        self.w_o = None if w_o is None else xp.asarray(w_o, dtype=xp.float32).reshape(
            self.band.heads * v, -1)
        self.y = None if w_o is None else xp.zeros((b * s_q, self.w_o.shape[1]), xp.float32)

    def _v_head(self) -> int:
        wv_b = self.step.wv_b if self.executor == "gpu" else self.inputs["wv_b"]
        if wv_b is None:
            raise ValueError("the tensor-parallel step combines `out`: it needs wv_b")
        return int(wv_b.shape[1])

    # ---- phases --------------------------------------------------------------------------
    def plant_fault(self) -> None:
        """A negative control: this rank's next attention launch faults (an out-of-bounds
        write launched with the attention kernel's geometry on the GPU; on the schedule
        executor, the CUDA error such a launch raises)."""
        self._fault = True
        if self.executor != "gpu":
            return
        import cupy

        bad = cupy.RawKernel(r'''
extern "C" __global__ void planted_oob(float* p) { p[threadIdx.x + (1ll << 38)] = 1.f; }
''', "planted_oob")
        bad.max_dynamic_shared_size_bytes = self.attn_launch.smem_bytes
        self.step.attn_kernel = bad

    def run_attn(self) -> None:
        if self.executor == "gpu":
            with self.device():
                self.step.run_attn()
            return
        from cupy_backends.cuda.api.runtime import CUDARuntimeError

        from .schedule_paged import run_paged_schedule

        with self.guard.phase("attn", self.attn_launch):
            if self._fault:
                raise CUDARuntimeError(700)  # cudaErrorIllegalAddress
            self.result = run_paged_schedule(**self.inputs, plan=self.plan)

    def run_combine(self) -> None:
        if self.executor == "gpu":
            with self.device():
                self.step.run_combine()
            self.out = self.step.out
            return
        with self.guard.phase("combine"):
            self.out = self.result.out   # the schedule model merges and projects in one go

    def run_o_proj(self) -> None:
        if self.w_o is None:
            raise ValueError("the output projection's all-reduce needs w_o")
        with self.device(), self.guard.phase("o_proj"):
            flat = self.out.reshape(self.batch * self.s_q, -1)
            if self.xp is np:
                self.y[...] = flat @ self.w_o
            else:
                self.xp.matmul(flat, self.w_o, out=self.y)

    def checkpoint(self, phase: str, failed: BaseException | None = None) -> None:
        if self._checkpoint is not None:
            self._checkpoint(phase, failed)

    def all_gather(self):
        """The band outs all-gathered and assembled: out [B, s_q, H, v_head]."""
        self.checkpoint("all_gather")
        with self.device(), self.guard.phase("all_gather"):
            self.send[:, :, :self.band.heads] = self.out
            self.comm.all_gather(self.send, self.recv)
            self.gathered = assemble_gathered(self.recv, self.bands, self.xp)
        return self.gathered

    def all_reduce(self):
        """The partial projections summed over the ranks: y [B, s_q, d_model]."""
        self.checkpoint("all_reduce")
        with self.device(), self.guard.phase("all_reduce"):
            self.comm.all_reduce(self.y)
        return self.y.reshape(self.batch, self.s_q, -1)

    def run(self, forms=("all_gather", "all_reduce")) -> tuple:
        """attn, combine, then the forms asked for: (gathered out or None, y or None)."""
        try:
            self.run_attn()
            self.run_combine()
            if "all_reduce" in forms:
                self.run_o_proj()
        except PhaseError as exc:
            self.checkpoint(exc.phase, exc)   # lets the others stop before the collective
            raise
        out = self.all_gather() if "all_gather" in forms else None
        y = self.all_reduce() if "all_reduce" in forms else None
        return out, y

    def device(self):
        if self.executor != "gpu":
            from contextlib import nullcontext
            return nullcontext()
        import cupy
        return cupy.cuda.Device(self.device_id)

    def buffers(self) -> dict:
        """The device arrays this rank's step owns (outputs, scratch, collective buffers)."""
        if self.executor != "gpu":
            return {}
        s = self.step
        named = {"latent": s.latent, "lse": s.lse, "out": s.out, "part_acc": s.part_acc,
                 "part_m": s.part_m, "part_l": s.part_l, "chunk_counts": s.chunk_counts,
                 "send": self.send, "recv": self.recv}
        if self.y is not None:
            named |= {"w_o": self.w_o, "y": self.y}
        return named
