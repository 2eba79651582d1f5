"""The Python API: one decode step on CuPy arrays, by any registered variant.

    import mlasandbox as mla
    res = mla.decode(q, cache, wv_b, n_ctx=None, variant="split", splits=None,
                     heads_per_block=None, scale=None)
    res.out, res.latent, res.lse            # CuPy f32 arrays

`DecodeStep` is the same step prepared once and run by phase (q_absorb, attn, combine): the
bench times phases through it, and the tests poke at its plan and scratch. Its combine phase
is two launches: the merge of the partials (mla_combine.cu, merge only) and the batched
output projection (mla_project.cu), each launched with programmatic dependent launch
(sandbox/pdl.py) behind the kernel before it where the device has it (`pdl=False`: plain
launches). Right after this package's q_absorb (`QAbsorb.run()`), `run_attn(after_q_absorb=True)`
launches the attention the same way: its blocks stage their first cache tiles while q_absorb
runs, and wait for it before they read q.
"""
from __future__ import annotations

import numpy as np

from . import registry
from .cublas_engine import cublas_attention, cublas_projection
from .dims import Dims, check_inputs, dtype_name
from .guard import Launch, PhaseGuard
from .kernels import blocks_per_sm, device_info, get_kernel
from .limits import LOG2E as _LOG2E
from .limits import check_bool, check_flags, check_problem
from .pdl import supported as pdl_supported
from .reference import DecodeResult
from .splits import SplitPlan, plan_splits

__all__ = ["DecodeResult", "DecodeStep", "check_device_array", "decode", "q_absorb",
           "scratch_for_device", "NULL_PTR"]

NULL_PTR = np.uint64(0)  # a null pointer argument: the merge-only combine takes no wv_b
# variant="batched" without heads_per_block: the fastest of the heads-per-block sweep on the
# H200 at 131072 context, the largest HPB that keeps two blocks per SM.
DEFAULT_BATCHED_HPB = 16
# The families whose attention kernels write latent and lse themselves where a row's context
# is one piece: every row under a single-pass plan (SplitPlan / ChunkPlan .single_pass), where
# the merge is skipped, and on the paged path also each request of one chunk at run time,
# which the paged merge then skips (combine_paged's attn_writes_single). tiled16 and user
# kernels write partials only and are always merged.
SINGLE_PASS_FAMILIES = ("per_head", "split", "batched", "mma", "wgmma")


# Scratch for the split partials, one pool per device: a single static pointer allocated by
# whichever rank arrives first would be dereferenced on devices it does not belong to. Grown
# on demand, never shrunk. Every DecodeStep on a device shares it, so steps on one device
# must run on one stream (or be synchronized between), as a decode loop's layers do; two
# concurrent streams would race on the partials and the tickets.
_scratch: dict[int, dict[str, object]] = {}


def scratch_for_device(device_id: int, name: str, size: int, dtype="float32"):
    """A scratch buffer of at least `size` elements on `device_id`. New buffers are zeroed:
    the combine's per-head tickets rely on starting at 0 (each launch leaves them at 0)."""
    import cupy

    pool = _scratch.setdefault(device_id, {})
    buf = pool.get(name)
    if buf is not None and buf.dtype != cupy.dtype(dtype):
        raise TypeError(f"scratch {name!r} on device {device_id} holds {buf.dtype}, not {dtype}")
    if buf is None or buf.size < size:
        with cupy.cuda.Device(device_id):
            buf = cupy.zeros(max(size, 1), dtype)
        pool[name] = buf
    return buf[:size]


def check_device_array(name, arr):
    import cupy

    if not isinstance(arr, cupy.ndarray):
        raise TypeError(f"{name} must be a CuPy array on the device (got {type(arr).__name__}); "
                        "torch tensors convert without a host copy via cupy.from_dlpack")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (got strides {arr.strides}); "
                         "use cupy.ascontiguousarray")
    if arr.data.ptr % 16:
        raise ValueError(f"{name} must be 16-byte aligned for the kernels' vector loads")
    if arr.device.id != cupy.cuda.Device().id:
        raise ValueError(f"{name} is on device {arr.device.id}, the current device is "
                         f"{cupy.cuda.Device().id}")


def _as_variant_name(variant, heads_per_block) -> str:
    """The registry name of `variant` with `heads_per_block` (registry.resolve_variant)."""
    return registry.resolve_variant(variant, heads_per_block,
                                    default_hpb=DEFAULT_BATCHED_HPB).name


class DecodeStep:
    """One decode step, validated, planned and compiled; run by phase.

    The inputs are validated (shapes, dtypes, contiguity, n_ctx) before anything launches.
    """

    def __init__(self, q, cache, wv_b, n_ctx=None, variant="split", splits=None,
                 heads_per_block=None, scale=None, *, min_ctx: int | None = None,
                 sync_check: bool = False, rescale: bool = True, pdl: bool = True,
                 fused_combine: bool | None = None):
        import cupy

        check_flags(("fused_combine",), sync_check=sync_check, rescale=rescale, pdl=pdl,
                    fused_combine=fused_combine)
        var = registry.resolve_variant(variant, heads_per_block, default_hpb=DEFAULT_BATCHED_HPB)
        self.dims, self.n_ctx, self.scale, dts = check_inputs(q, cache, wv_b, n_ctx, scale)
        check_problem(splits=splits)
        for name, arr in (("q", q), ("cache", cache), ("wv_b", wv_b)):
            check_device_array(name, arr)
        if var.is_cuda:
            registry.check_cuda_dims(self.dims.kv_lora, self.dims.rope)
        self.variant = var
        self.q, self.cache, self.wv_b = q, cache, wv_b
        self.cache_dtype, self.q_dtype = dts["cache"], dts["q"]
        self.guard = PhaseGuard(var.name, sync_check=sync_check)
        self.device_id = cupy.cuda.Device().id
        h, d = self.dims.n_head, self.dims
        self.out = cupy.empty((h, d.v_head), cupy.float32)
        self.latent = cupy.empty((h, d.kv_lora), cupy.float32)
        self.lse = cupy.empty((h,), cupy.float32)
        self.plan: SplitPlan | None = None
        if not var.is_cuda:
            if splits not in (None, "auto"):
                raise ValueError("the cublas engine does not split; splits must be None")
            return

        hpb = var.hpb
        self.attn_inst = registry.attention_instance(var, self.cache_dtype, self.q_dtype)
        self.combine_inst = registry.combine_instance(self.cache_dtype, rescale)
        info = device_info(self.device_id)
        self.plan = plan_splits(self.n_ctx, h, hpb, num_sms=info.num_sms,
                                blocks_per_sm=max(1, blocks_per_sm(self.attn_inst)),
                                splits=splits, split=var.splits, min_ctx=min_ctx,
                                tile=self.attn_inst.tile_rows)
        if self.plan.splits > info.max_grid_y:
            raise ValueError(f"splits={self.plan.splits} exceeds the grid's y limit "
                             f"{info.max_grid_y} on {info.name}")
        self.attn_kernel = get_kernel(self.attn_inst)
        self.combine_kernel = get_kernel(self.combine_inst)
        self.project_inst = registry.project_instance(self.cache_dtype)
        self.project_kernel = get_kernel(self.project_inst)
        self.col_blocks = registry.combine_col_blocks(h, info.num_sms)
        self.pdl = bool(pdl) and pdl_supported(self.device_id)
        s = self.plan.splits
        self.part_acc = scratch_for_device(self.device_id, "part_acc", s * h * d.kv_lora)
        self.part_m = scratch_for_device(self.device_id, "part_m", s * h)
        self.part_l = scratch_for_device(self.device_id, "part_l", s * h)
        # where the plan splits: the combine in one kernel, or the merge then the projection
        self.fused_combine = registry.combine_in_one_kernel(self.col_blocks, fused_combine)
        self.out_part = self.tickets = None
        if self.fused_combine:
            self.out_part = scratch_for_device(self.device_id, "out_part",
                                               h * self.col_blocks * d.v_head)
            self.tickets = scratch_for_device(self.device_id, "tickets", h, "uint32")

    # ---- phases -------------------------------------------------------------------------
    def run_attn(self, after_q_absorb: bool = False) -> None:
        """The attention phase. after_q_absorb=True: the kernel just before it on the stream is
        this package's q_absorb (QAbsorb.run, launched in stream order), and the attention
        kernel launches as its programmatic dependent: its blocks start while q_absorb runs,
        read the cache and stage their first tiles, and wait for q_absorb's grid before they
        read q. Only there: before that wait the kernel reads the cache, which a kernel of the
        caller's right before it (an append of the new token) may still be writing; behind
        q_absorb every such kernel has completed, since q_absorb itself waited for them."""
        check_bool("after_q_absorb", after_q_absorb)
        if not self.variant.is_cuda:
            with self.guard.phase("attn"):
                cublas_attention(self.q, self.cache, self.n_ctx, self.scale, self.cache_dtype,
                                 self.latent, self.lse)
            return
        p = self.plan
        self.guard.launch(
            "attn", self.attn_kernel, (p.head_blocks, p.splits, 1), (self.attn_inst.threads, 1, 1),
            (self.q, self.cache, np.int32(self.dims.n_head), np.int32(self.n_ctx),
             np.int32(p.splits), np.float32(self.scale * _LOG2E), self.part_acc, self.part_m,
             self.part_l, self.latent, self.lse),
            smem_bytes=self.attn_inst.smem_bytes, kernel_name=self.attn_inst.name,
            pdl=bool(after_q_absorb) and self.pdl)

    def run_combine(self) -> None:
        if not self.variant.is_cuda:
            with self.guard.phase("combine"):
                cublas_projection(self.wv_b, self.latent, self.cache_dtype, self.out)
            return
        if self.single_pass:
            self.run_project()
        elif self.fused_combine:
            self.run_merge(project=True)
        else:
            self.run_merge()
            self.run_project()

    def run_merge(self, project: bool = False) -> None:
        """The merge of the partials into latent and lse; with project=True the same kernel
        also applies wv_b (mla_combine.cu's one-kernel form), else the merge only."""
        dims = self.dims
        wv_b, out, out_part, tickets = (
            (self.wv_b, self.out, self.out_part, self.tickets) if project
            else (NULL_PTR, NULL_PTR, NULL_PTR, NULL_PTR))
        self.guard.launch(
            "combine", self.combine_kernel, self.combine_grid, (self.combine_inst.threads, 1, 1),
            (self.part_acc, self.part_m, self.part_l, np.int32(dims.n_head),
             np.int32(self.plan.splits), wv_b, np.int32(dims.v_head), out,
             self.latent, self.lse, out_part, tickets),
            kernel_name=self.combine_inst.name, pdl=self.pdl)

    def run_project(self) -> None:
        """out = wv_b[h] @ latent[h] for every head (mla_project.cu, one latent row)."""
        dims = self.dims
        self.guard.launch(
            "combine", self.project_kernel, self.project_grid, (self.project_inst.threads, 1, 1),
            (self.latent, self.wv_b, np.int32(dims.n_head), np.int32(1),
             np.int32(dims.v_head), self.out), kernel_name=self.project_inst.name, pdl=self.pdl)

    @property
    def single_pass(self) -> bool:
        """Whether the attention kernel writes the latent and lse itself (one slice a head
        block): then the combine phase is the projection alone. tiled16 writes partials only,
        so its one slice is still merged."""
        return (bool(getattr(self.plan, "single_pass", False))
                and self.variant.family in SINGLE_PASS_FAMILIES)

    @property
    def combine_grid(self) -> tuple:
        """The merge's grid: (heads, column blocks) (registry.combine_col_blocks)."""
        return (self.dims.n_head, self.col_blocks, 1)

    @property
    def project_grid(self) -> tuple:
        return registry.project_grid(self.dims.n_head, self.dims.v_head, 1,
                                     self.project_inst.kind)

    def run(self) -> DecodeResult:
        self.run_attn()
        self.run_combine()
        return DecodeResult(self.out, self.latent, self.lse)

    @property
    def launches(self) -> list[Launch]:
        if not self.variant.is_cuda:
            return []
        p = self.plan
        merge = [] if self.single_pass else [
            Launch(self.combine_inst.name, self.combine_grid, (self.combine_inst.threads, 1, 1),
                   0, self.pdl)]
        project = [] if merge and self.fused_combine else [
            Launch(self.project_inst.name, self.project_grid,
                   (self.project_inst.threads, 1, 1), 0, self.pdl)]
        return [Launch(self.attn_inst.name, (p.head_blocks, p.splits, 1),
                       (self.attn_inst.threads, 1, 1), self.attn_inst.smem_bytes),
                *merge, *project]


def decode(q, cache, wv_b, n_ctx=None, variant="split", splits=None, heads_per_block=None,
           scale=None, *, min_ctx: int | None = None, sync_check: bool = False) -> DecodeResult:
    """One decode step. CuPy arrays in (q f32 or cache dtype; cache and wv_b f16, or bf16 as
    raw uint16 words), CuPy f32 arrays out. See DecodeStep for the checks."""
    return DecodeStep(q, cache, wv_b, n_ctx, variant, splits, heads_per_block, scale,
                      min_ctx=min_ctx, sync_check=sync_check).run()


def _dtype_or_none(arr) -> str | None:
    """dims.dtype_name of `arr`, None for a dtype the kernels do not take."""
    try:
        return dtype_name(arr)
    except TypeError:
        return None


class QAbsorb:
    """The q_absorb phase, prepared: q[h] = (q_nope[h] @ wk_b[h]) || q_rope[h]."""

    def __init__(self, q_nope, q_rope, wk_b, q_dtype: str = "f32", dims: Dims | None = None,
                 sync_check: bool = False):
        import cupy

        named = (("q_nope", q_nope), ("q_rope", q_rope), ("wk_b", wk_b))
        # the host's facts first (shapes, dtypes), so each error names its parameter
        for name, arr in named:
            if not hasattr(arr, "shape") or not hasattr(arr, "dtype"):
                raise TypeError(f"{name} must be a CuPy array, got {type(arr).__name__}")
        if q_nope.ndim != 2 or q_nope.shape[0] < 1:
            raise ValueError(f"q_nope must be [n_head >= 1, nope], got {list(q_nope.shape)}")
        h = int(q_nope.shape[0])
        dims = dims or Dims(n_head=h)
        want = {"q_nope": (h, dims.nope), "q_rope": (h, dims.rope),
                "wk_b": (h, dims.nope, dims.kv_lora)}
        for name, arr in named:
            if tuple(arr.shape) != want[name]:
                raise ValueError(f"{name} must be {list(want[name])}, got {list(arr.shape)}")
        in_dt = _dtype_or_none(wk_b)
        if in_dt not in ("f16", "bf16"):
            raise TypeError(f"wk_b must be float16 or bfloat16 (uint16 words of bf16), got "
                            f"{wk_b.dtype}")
        for name, arr in named[:2]:
            if _dtype_or_none(arr) != in_dt:
                raise TypeError(f"{name} must have wk_b's dtype ({wk_b.dtype}), got {arr.dtype}")
        if q_dtype not in ("f32", "cache", in_dt):
            raise ValueError(f"q_dtype must be 'f32' or 'cache' (the weights' {in_dt}), got "
                             f"{q_dtype!r}")
        for name, arr in named:
            check_device_array(name, arr)
        q_dt = in_dt if q_dtype == "cache" else q_dtype
        self.inst = registry.q_absorb_instance(in_dt, q_dt)
        self.kernel = get_kernel(self.inst)
        self.args = (q_nope, q_rope, wk_b)
        self.n_head = h
        storage = {"f32": cupy.float32, "f16": cupy.float16, "bf16": cupy.uint16}[q_dt]
        self.q = cupy.empty((h, dims.key_dim), storage)
        self.guard = PhaseGuard("q_absorb", sync_check=sync_check)

    @property
    def grid(self) -> tuple:
        return registry.q_absorb_grid(self.n_head)

    def run(self):
        self.guard.launch("q_absorb", self.kernel, self.grid, (self.inst.threads, 1, 1),
                          (*self.args, np.int32(self.n_head), self.q), kernel_name=self.inst.name)
        return self.q


def q_absorb(q_nope, q_rope, wk_b, q_dtype: str = "f32"):
    return QAbsorb(q_nope, q_rope, wk_b, q_dtype).run()
