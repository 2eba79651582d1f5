"""The paged decode step of a serving batch, on torch tensors or CuPy arrays.

    import mlasandbox as mla
    res = mla.decode_paged(q, kv_cache, block_table, cache_seqlens, wv_b=None, *,
                           causal=False, variant="auto", splits=None, scale=None,
                           check_indices=True)
    res.latent [B, s_q, H, 512] f32   res.lse [B, s_q, H] f32   res.out [B, s_q, H, 128] f32

    step = mla.PagedDecodeStep(q, kv_cache, block_table, cache_seqlens, wv_b, ...)
    step.run()                      # or step.run_attn(); step.run_combine()
    step.launches()                 # attn, the merge, the projection: grids and blocks
    graph = step.capture()          # StepGraph: the whole step's cupy.cuda.Graph (.graph)
    graph.launch(stream)            # replays read the same table and length buffers

The contract (shapes, causal rule, empty rows) is sandbox/paged.py's; the chunk rule is
sandbox/chunks.py's. The grid is (head blocks, chunk programs, 1) whatever the lengths: every
program derives its request and chunk from the lengths on the device and exits if it is
past the batch's last chunk, so changing the contents of `cache_seqlens` and `block_table`
between replays needs no recapture.

The combine phase is two launches: the merge of each row's chunks (combine_paged, merge only,
one block per row and column block) and, with wv_b, the output projection of every
(request, query token, head) row at once (mla_project.cu: wv_b read once per 32 rows of a
head, not once per row). The built-in families' attention kernels write the latent and lse
of every request that runs one chunk themselves: under a plan with `single_pass` (one chunk a
request) the merge is not launched, and otherwise its blocks of such a request return at once
(`attn_writes_single`; a user kernel's requests are all merged). Both launch with
programmatic dependent launch (sandbox/pdl.py) where the device has it. A batch of at most 16
rows (the merge's narrowest column blocks) runs one kernel instead, the merge whose blocks
also project their columns (`fused_combine`). Under a plan of 2 to 16 chunk slots a request
with q in the cache dtype the mma kernels merge each request themselves and no merge is
launched (`merges_in_attn`, registry.attn_merges).

`decode()` (batch 1, one contiguous cache) stays beside this path with its own kernels'
machine code; batch 1 through the paged path agrees with it within the float64 tolerances.
"""
from __future__ import annotations

import numbers

import numpy as np

from . import interop, registry, tensor_map
from .auto_variant import AutoFacts, auto_name
from .api import (DEFAULT_BATCHED_HPB, SINGLE_PASS_FAMILIES, check_device_array,
                  scratch_for_device)
from .chunks import CHUNK_CAP, ChunkPlan, plan_chunks
from .cublas_engine import cublas_paged_attention, cublas_projection
from .guard import Launch, PhaseGuard
from .kernels import blocks_per_sm, device_info, get_kernel
from .limits import LOG2E as _LOG2E
from .limits import check_flags, check_s_q
from .pdl import supported as pdl_supported
from .paged import (PagedResult, PagedShape, check_paged_inputs, check_paged_values,
                    pages_needed, tight_max_len, visible_lengths)
from .timing import capture_graph

__all__ = ["decode_paged", "PagedDecodeStep", "StepGraph", "PagedResult", "PAGE_SIZES",
           "paged_variant", "paged_variant_names", "plan_for", "plan_for_lengths",
           "check_page_size", "check_capturable", "raise_for_index_report"]

# The page sizes the CUDA kernels address by a shift (FlashMLA's is 64).
PAGE_SIZES = (1, 16, 64)
# The kernel families that take the paged contract; per_head and tiled16 stay batch 1.
PAGED_FAMILIES = ("split", "batched", "mma")
MAX_GRID_Z = 65535   # CUDA's grid z limit: requests of one launch
_NULL = np.uint64(0)  # a null pointer argument: the merge takes no wv_b (the projection does)


def paged_variant_names() -> list[str]:
    """The registered variants that take the paged contract, the paged-only ones (wgmma64)
    last."""
    return [n for n, v in registry.VARIANTS.items()
            if v.family in PAGED_FAMILIES or not v.is_cuda] + list(registry.PAGED_ONLY_VARIANTS)


def paged_variant(name: str, s_q: int, n_head: int,
                  facts: AutoFacts | None = None) -> registry.Variant:
    """The Variant of `name` for the paged step: "auto" is auto_variant.auto_name's choice
    for the rows and, where given, the device and step `facts`; "batched" is
    batched<DEFAULT_BATCHED_HPB>."""
    if getattr(name, "family", None) == "user" or (isinstance(name, str) and name.split(
            ":", 1)[0].endswith(".cu")):   # a user kernel (sandbox/user_kernel.py)
        from .user_kernel import load_kernel

        return load_kernel(name)
    if not isinstance(name, str):
        raise TypeError(f"variant must be a name, got {name!r}")
    if name == "auto":
        name = auto_name(s_q, n_head, facts)
    known = ", ".join(["auto", *paged_variant_names()])
    if name in registry.PAGED_ONLY_VARIANTS:   # wgmma64: the sm_90a kernel, paged only
        return registry.PAGED_ONLY_VARIANTS[name]
    var = registry.VARIANTS.get(name)
    if var is not None and var.name not in paged_variant_names():
        raise ValueError(f"variant {name} serves batch 1 from a contiguous cache only (use "
                         f"mla.decode); the paged step takes {known}")
    if var is None and name != "batched":
        raise ValueError(f"unknown paged variant {name!r}; known: {known}")
    return registry.resolve_variant(name, None, default_hpb=DEFAULT_BATCHED_HPB)


def check_page_size(page_size: int) -> int:
    """The log2 of a page size the CUDA kernels take, or a ValueError naming the allowed."""
    if isinstance(page_size, (bool, np.bool_)) or not isinstance(page_size, numbers.Integral):
        raise TypeError(f"page_size must be an integer, one of "
                        f"{', '.join(map(str, PAGE_SIZES))}; got {page_size!r}")
    page_size = int(page_size)
    if page_size not in PAGE_SIZES:
        raise ValueError(f"page_size {page_size} is not supported by the CUDA variants: "
                         f"page_size must be one of {', '.join(map(str, PAGE_SIZES))} (the "
                         "kernels address a page by a shift; the cublas engine takes any)")
    return page_size.bit_length() - 1


def check_capturable(variant: registry.Variant) -> None:
    if not variant.is_cuda:
        raise ValueError(f"variant {variant.name} cannot be captured in a CUDA graph: it "
                         "reads the lengths and the block table to the host to size its "
                         "GEMMs; capture split, batched<HPB>, mma16 or mma32")


def plan_for(shape: PagedShape, inst, *, num_sms: int, blocks_per_sm: int,
             splits=None) -> ChunkPlan:
    """The chunk plan of a paged step on attention instance `inst`: head blocks of
    inst.heads query rows, its tile, splits=N as every request's chunk cap, and one pass
    where the table's max_len fits in one chunk."""
    return _plan(shape.batch, shape.s_q * shape.n_head, inst, max_len=shape.max_len,
                 num_sms=num_sms, blocks_per_sm=blocks_per_sm, splits=splits)


def plan_for_lengths(lengths, page_size: int, n_rows: int, inst, *, num_sms: int,
                     blocks_per_sm: int, splits=None) -> ChunkPlan:
    """plan_for of the step whose block table just holds `lengths` (paged.tight_max_len: the
    table make_paged_inputs builds), for n_rows = s_q x heads query rows a request. What
    the bench, the sweep and the repro scripts plan without a step in hand, so that each
    reports the plan its run launches."""
    return _plan(len(lengths), n_rows, inst, max_len=tight_max_len(lengths, page_size),
                 num_sms=num_sms, blocks_per_sm=blocks_per_sm, splits=splits)


def _plan(batch: int, n_rows: int, inst, *, max_len: int, num_sms: int, blocks_per_sm: int,
          splits) -> ChunkPlan:
    chunks = None if isinstance(splits, str) and splits == "auto" else splits
    if chunks is not None and (isinstance(chunks, (bool, np.bool_, str))
                               or not isinstance(chunks, (int, np.integer))
                               or not 1 <= chunks <= CHUNK_CAP):
        raise ValueError(f"splits must be None, 'auto' or an integer 1..{CHUNK_CAP} (the "
                         f"chunks a request may take), got {splits!r}")
    return plan_chunks(batch, -(-n_rows // inst.heads), num_sms=num_sms,
                       blocks_per_sm=max(1, blocks_per_sm), tile=inst.tile_rows, chunks=chunks,
                       max_len=max_len)


def raise_for_index_report(report, block_table, cache_seqlens, shape: PagedShape) -> None:
    """Turn the index validator's report {flag, request, entry, value} into the host check's
    error (check_paged_values on host copies of the same buffers: the same words, the first
    bad request and entry in order). A report the host check cannot confirm is a
    validator bug, raised as such."""
    flag, b, j, value = (int(x) for x in report)
    if flag == 0:
        return
    check_paged_values(block_table, cache_seqlens, shape)
    raise RuntimeError(f"the index validator reported flag {flag} at request {b}, entry {j} "
                       f"(value {value}), but check_paged_values finds the same table and "
                       "lengths valid: the validator and the host check disagree")


class PagedDecodeStep:
    """One paged decode step: validated, planned and compiled once; run by phase.

    torch tensors or CuPy arrays (zero copy); results in the caller's framework, the same
    buffers every run. Launches go on the caller's current stream at each call (torch's for
    torch inputs). Scratch (the partials) is per device and shared with DecodeStep: steps
    on one device must run on one stream, as api.scratch_for_device says. A captured graph
    refers to this step's buffers: keep the step alive while the graph is replayed.
    The plan serves every length block_table can hold (max_pages x page_size); a table
    whose requests fit in one chunk runs one pass (plan_for).
    """

    def __init__(self, q, kv_cache, block_table, cache_seqlens, wv_b=None, *,
                 causal: bool = False, variant: str = "auto", splits=None, scale=None,
                 sync_check: bool = False, rescale: bool = True, pdl: bool = True,
                 fused_combine: bool | None = None, merge_in_attn: bool | None = None):
        check_flags(("fused_combine", "merge_in_attn"), sync_check=sync_check,
                    rescale=rescale, pdl=pdl, fused_combine=fused_combine,
                    merge_in_attn=merge_in_attn)
        self.shape, self.scale = check_paged_inputs(q, kv_cache, block_table, cache_seqlens,
                                                    wv_b, scale=scale, causal=causal)
        sh = self.shape
        self.causal = bool(causal)
        # "auto" here is the device-free choice; it is refined below once the device is known
        # (both choices are CUDA variants: the checks of this block hold for either)
        var = paged_variant(variant, sh.s_q, sh.n_head)
        self.page_shift = None
        if var.is_cuda:
            self.page_shift = check_page_size(sh.page_size)
            registry.check_cuda_dims(sh.dims.kv_lora, sh.dims.rope)
            if sh.batch > MAX_GRID_Z:
                raise ValueError(f"batch {sh.batch} exceeds the grid's z limit {MAX_GRID_Z}")
            check_s_q(sh.s_q, sh.n_head, sh.batch if sh.has_wv_b else None)
        elif splits not in (None, "auto"):
            raise ValueError("the cublas engine does not split; splits must be None")
        self.caller, arrs = interop.from_caller(
            {"q": q, "kv_cache": kv_cache, "block_table": block_table,
             "cache_seqlens": cache_seqlens, "wv_b": wv_b})
        self.device_id = self.caller.device_id
        if isinstance(variant, str) and variant == "auto" and merge_in_attn is not True:
            # (merge_in_attn=True asks for the mma kernels' own merge: the device-free choice)
            var = paged_variant(variant, sh.s_q, sh.n_head,
                                AutoFacts.of(sh, device_info(self.device_id).arch))
        self.variant = var
        self._stream = None   # the capture stream while capture() runs
        self.guard = PhaseGuard(var.name, sync_check=sync_check)
        self.pdl = bool(pdl)
        with self.caller.on():
            self._setup(arrs, splits, rescale, fused_combine, merge_in_attn)

    def _setup(self, arrs, splits, rescale, fused_combine, merge_in_attn) -> None:
        import cupy

        sh, d = self.shape, self.shape.dims
        for name, arr in arrs.items():
            if arr is not None:
                check_device_array(name, arr)
        self.q, self.block_table, self.cache_seqlens = (arrs["q"], arrs["block_table"],
                                                        arrs["cache_seqlens"])
        self.kv_cache = arrs["kv_cache"].reshape(sh.num_pages, sh.page_size, d.key_dim)
        self.wv_b = arrs["wv_b"]
        rows = (sh.batch, sh.s_q, sh.n_head)
        self.latent = cupy.empty((*rows, d.kv_lora), cupy.float32)
        self.lse = cupy.empty(rows, cupy.float32)
        self.out = cupy.empty((*rows, d.v_head), cupy.float32) if sh.has_wv_b else None
        self.result = PagedResult(*(self.caller.to_caller(a)
                                    for a in (self.latent, self.lse, self.out)))
        self.fused_combine, self.out_part, self.tickets = False, None, None
        self.merges_in_attn, self.attn_tickets, self.merge_rescale = False, None, bool(rescale)
        self.check_inst = self.check_kernel = None
        self.kv_map = None
        self.plan: ChunkPlan | None = None
        if not self.variant.is_cuda:
            return
        user = self.variant if self.variant.family == "user" else None
        self.attn_inst = (user.instance(sh.cache_dtype, sh.q_dtype) if user else
                          registry.paged_attention_instance(self.variant, sh.cache_dtype,
                                                            sh.q_dtype))
        info = device_info(self.device_id)
        # the driver's occupancy of the attention kernel, which the plan's wave target uses
        bps = user.blocks_per_sm(self.attn_inst) if user else blocks_per_sm(self.attn_inst)
        self.attn_blocks_per_sm = bps
        self.plan = plan_for(sh, self.attn_inst, num_sms=info.num_sms, blocks_per_sm=bps,
                             splits=1 if user and user.kind == "step" else splits)
        if self.plan.programs_per_block > info.max_grid_y:
            raise ValueError(f"{self.plan.programs_per_block} chunk programs a row block "
                             f"exceed the grid's y limit {info.max_grid_y} on {info.name}")
        if not user:  # a single-pass plan runs no merge: the instance that skips the partials
            self.attn_inst = registry.instance_for_plan(self.attn_inst, self.plan.single_pass)
        self.attn_kernel = user.kernel(self.attn_inst) if user else get_kernel(self.attn_inst)
        # the wgmma family's bulk tensor copies read the cache through its tensor maps
        # (sandbox/tensor_map.py, one device buffer); None: cp.async
        if self.variant.family == "wgmma":
            self.kv_map = tensor_map.step_map(self.kv_cache)
        self.project_inst = self.project_kernel = None
        if self.out is not None:
            kind = registry.project_kind(sh.batch * sh.s_q, sh.n_head, info.num_sms)
            self.project_inst = registry.project_instance(sh.cache_dtype, kind)
            self.project_kernel = get_kernel(self.project_inst)
        self.col_blocks = registry.combine_col_blocks(sh.batch * self.n_rows, info.num_sms)
        self.pdl = self.pdl and pdl_supported(self.device_id)
        n = sh.batch * self.plan.max_chunks * self.n_rows
        dev = self.device_id
        self.part_acc = scratch_for_device(dev, "part_acc", n * d.kv_lora)
        self.part_m = scratch_for_device(dev, "part_m", n)
        self.part_l = scratch_for_device(dev, "part_l", n)
        self.chunk_counts = scratch_for_device(dev, "chunk_counts", sh.batch, "int32")
        self.merges_in_attn = self._attn_merges(merge_in_attn)
        if self.merges_in_attn:  # zeroed when made; each launch leaves them at 0
            self.attn_tickets = scratch_for_device(dev, "attn_tickets",
                                                   sh.batch * self.plan.head_blocks, "uint32")
        # where the merge kernel runs: the combine in one kernel (a batch of at most 16 rows),
        # or the merge then the tensor-core projection, which batches many rows a head
        self.fused_combine = (self.out is not None and self.launches_merge
                              and registry.combine_in_one_kernel(self.col_blocks, fused_combine))
        if self.fused_combine:
            rows = sh.batch * self.n_rows
            self.out_part = scratch_for_device(dev, "out_part",
                                               rows * self.col_blocks * d.v_head)
            self.tickets = scratch_for_device(dev, "tickets", rows, "uint32")
        self.merge = registry.MergeForm("combine", self.col_blocks, registry.COMBINE_PREFETCH)
        if self.launches_merge and not self.fused_combine:
            # the merge only: the deep or the warp merge where the block merge is not one wave
            per_sm = [blocks_per_sm(registry.paged_combine_instance(sh.cache_dtype, rescale, p))
                      for p in (registry.COMBINE_PREFETCH, registry.COMBINE_DEEP_PREFETCH)]
            self.merge = registry.merge_form(sh.batch * self.n_rows, info.num_sms, *per_sm,
                                             self.plan.max_chunks)
            self.col_blocks = self.merge.col_blocks
        self.combine_inst = registry.paged_merge_instance(self.merge, sh.cache_dtype, rescale)
        self.combine_kernel = get_kernel(self.combine_inst)

    def _attn_merges(self, choice: bool | None) -> bool:
        """Whether the attention kernel merges each request's chunks itself (its last program,
        PagedWalk::finish) and no merge is launched: registry.attn_merges, a plan of 2 to
        ATTN_MERGE_MAX_CHUNKS chunk slots a request (where one block reads a request's
        partials in about the time the merge kernel takes to start) and q in the cache dtype
        (the kernels built with the merge: mla_mma.cu says why). choice False keeps the
        merge kernel; True asks for the kernel's merge and raises where the rule refuses it."""
        p, sh = self.plan, self.shape
        able = registry.attn_merges(self.variant.family, p.max_chunks, sh.q_dtype,
                                    sh.cache_dtype)
        if choice and not able:
            raise ValueError(
                f"merge_in_attn=True needs a family of {registry.ATTN_MERGE_FAMILIES}, q in the "
                f"cache dtype and a plan of 2 to {registry.ATTN_MERGE_MAX_CHUNKS} chunk slots a "
                f"request; {self.variant.name} has q {sh.q_dtype}, cache {sh.cache_dtype} and "
                f"plans {p.max_chunks}")
        return able if choice is None else bool(choice)

    @property
    def n_rows(self) -> int:
        """Query rows of a request, (query token, head): what the kernels serve as heads."""
        return self.shape.s_q * self.shape.n_head

    # ---- where launches go ---------------------------------------------------------------
    def launch_stream(self):
        """The stream the next phase launches on: the capture stream inside capture(), the
        caller's current stream otherwise."""
        return self._stream if self._stream is not None else self.caller.current_stream()

    def capturing(self) -> bool:
        """Whether the stream the next phase launches on is capturing a CUDA graph."""
        with self.caller.on(self._stream):
            return bool(self.launch_stream().is_capturing())

    # ---- phases --------------------------------------------------------------------------
    @property
    def attn_grid(self) -> tuple:
        return self.plan.grid

    @property
    def combine_grid(self) -> tuple:
        """The merge's grid (registry.merge_grid): (rows, column blocks, B) for the block
        merge (registry.combine_col_blocks; merge only: registry.merge_form), fewer blocks of
        eight rows' warps for the warp merge."""
        return registry.merge_grid(self.merge, self.n_rows, self.shape.batch)

    @property
    def project_grid(self) -> tuple:
        """The projection's grid over the B x s_q latent rows of each head."""
        sh = self.shape
        return registry.project_grid(sh.n_head, sh.dims.v_head, sh.batch * sh.s_q,
                                     self.project_inst.kind)

    @property
    def single_pass(self) -> bool:
        """Whether the attention kernel writes the latent and lse of every request (a plan of
        one chunk a request): then the merge is not launched and only the projection runs."""
        return bool(getattr(self.plan, "single_pass", False)) and self.attn_writes_single

    def attn_args(self) -> tuple:
        """The paged attention kernel's arguments, in the kernels' order. latent and lse
        come last: with a single-pass plan (ChunkPlan.single_pass) the kernel writes them."""
        sh, p = self.shape, self.plan
        return (self.q, self.kv_cache, self.block_table, self.cache_seqlens,
                np.int32(self.n_rows), np.int32(sh.n_head), np.int32(sh.s_q),
                np.int32(self.causal), np.int32(sh.max_pages), np.int32(self.page_shift),
                np.int32(p.max_chunks), np.int32(p.min_chunk),
                np.float32(self.scale * _LOG2E), self.part_acc, self.part_m, self.part_l,
                np.int32(p.target), np.int32(sh.batch), self.chunk_counts, self.latent,
                self.lse)

    def attn_launch_args(self) -> tuple:
        """attn_args() and, for the wgmma family, the cache's tensor maps last (a null pointer
        where the copies go by cp.async); for the mma family its merge's tickets (a null
        pointer where the combine merges) and the merge's rescale flag. The contract a user
        kernel takes stays attn_args()."""
        if self.variant.family == "mma":  # the kernel's own merge: tickets, or null
            tickets = self.attn_tickets if self.merges_in_attn else _NULL
            return self.attn_args() + (tickets, np.int32(self.merge_rescale))
        if self.variant.family != "wgmma":
            return self.attn_args()
        return self.attn_args() + (self.kv_map if self.kv_map is not None else _NULL,)

    @property
    def uses_tma(self) -> bool:
        """Whether the attention kernel copies whole tiles by bulk tensor copy."""
        return self.kv_map is not None

    @property
    def attn_writes_single(self) -> bool:
        """Whether the attention kernel writes the latent and lse of a request that runs one
        chunk (the built-in families): the merge then skips that request."""
        return self.variant.family in SINGLE_PASS_FAMILIES

    def combine_args(self) -> tuple:
        """The merge's arguments, in the paged combine's order. Merge only, wv_b, out,
        out_part and tickets are null pointers (the projection applies wv_b); the one-kernel
        form (fused_combine) passes them."""
        sh, p = self.shape, self.plan
        wv_b, out, out_part, tickets = ((self.wv_b, self.out, self.out_part, self.tickets)
                                        if self.fused_combine else (_NULL, _NULL, _NULL, _NULL))
        return (self.part_acc, self.part_m, self.part_l, self.cache_seqlens,
                np.int32(self.n_rows), np.int32(sh.n_head), np.int32(p.max_chunks),
                np.int32(self.attn_writes_single), wv_b, np.int32(sh.dims.v_head), out,
                self.latent, self.lse, out_part, tickets, self.chunk_counts)

    @property
    def launches_merge(self) -> bool:
        """Whether the step launches the merge: not where the attention kernel writes every
        latent (single_pass) or merges the chunks itself (merges_in_attn)."""
        return not (self.single_pass or self.merges_in_attn)

    @property
    def projects_alone(self) -> bool:
        """Whether the projection is a launch of its own: with wv_b, unless the one-kernel
        combine runs (fused_combine, only where the merge kernel is launched)."""
        return self.out is not None and not self.fused_combine

    def project_args(self) -> tuple:
        """The projection's arguments: latent [B*s_q][H][512] in, out [B*s_q][H][v_head]."""
        sh = self.shape
        return (self.latent, self.wv_b, np.int32(sh.n_head), np.int32(sh.batch * sh.s_q),
                np.int32(sh.dims.v_head), self.out)

    def run_attn(self) -> None:
        with self.caller.on(self._stream):
            if not self.variant.is_cuda:
                if self.launch_stream().is_capturing():
                    check_capturable(self.variant)
                with self.guard.phase("attn"):
                    self._cublas_attention()
                return
            args = self.attn_launch_args()
            self.guard.launch("attn", self.attn_kernel, self.attn_grid,
                              (self.attn_inst.threads, 1, 1), args,
                              smem_bytes=self.attn_inst.smem_bytes,
                              kernel_name=self.attn_inst.name)

    def _cublas_attention(self) -> None:
        """The engine's attn phase: the table and the lengths read to the host (the engine
        sizes its GEMMs by them) and checked there before any page is gathered."""
        sh = self.shape
        table, lengths = self.block_table.get(), self.cache_seqlens.get()
        check_paged_values(table, lengths, sh)
        cublas_paged_attention(self.q, self.kv_cache, table, pages_needed(lengths, sh.page_size),
                               visible_lengths(lengths, sh.s_q, self.causal), self.scale,
                               sh.cache_dtype, self.latent, self.lse)

    @property
    def whole_step(self) -> bool:
        """A user kernel of kind=step writes latent and lse itself: no combine."""
        return getattr(self.variant, "kind", "attn") == "step"

    def run_combine(self) -> None:
        with self.caller.on(self._stream):
            if self.whole_step:
                if self.out is not None:
                    with self.guard.phase("combine"):
                        self.variant.project(self.wv_b, self.latent, self.out)
                return
            if not self.variant.is_cuda:
                if self.out is not None:
                    with self.guard.phase("combine"):
                        cublas_projection(self.wv_b, self.latent, self.shape.cache_dtype,
                                          self.out)
                return
            if self.launches_merge:
                self.guard.launch("combine", self.combine_kernel, self.combine_grid,
                                  (self.combine_inst.threads, 1, 1), self.combine_args(),
                                  kernel_name=self.combine_inst.name, pdl=self.pdl)
            if self.projects_alone:
                self.guard.launch("combine", self.project_kernel, self.project_grid,
                                  (self.project_inst.threads, 1, 1), self.project_args(),
                                  kernel_name=self.project_inst.name, pdl=self.pdl)

    def run(self) -> PagedResult:
        self.run_attn()
        self.run_combine()
        return self.result

    def launches(self) -> list[Launch]:
        """The step's kernel launches (none for the cublas engine), for the bench."""
        if not self.variant.is_cuda:
            return []
        out = [Launch(self.attn_inst.name, self.attn_grid, (self.attn_inst.threads, 1, 1),
                      self.attn_inst.smem_bytes)]
        if self.whole_step:
            return out
        if self.launches_merge:
            out.append(Launch(self.combine_inst.name, self.combine_grid,
                              (self.combine_inst.threads, 1, 1), 0, self.pdl))
        if self.projects_alone:
            out.append(Launch(self.project_inst.name, self.project_grid,
                              (self.project_inst.threads, 1, 1), 0, self.pdl))
        return out

    # ---- the index validator -------------------------------------------------------------
    def index_report(self) -> np.ndarray:
        """The index validator's verdict on the current table and lengths, read back to the
        host: [flag, request, entry, value], flag 0 when every length is in
        0..max_pages*page_size and every entry a request reads in 0..num_pages-1 (1: a bad
        length, entry -1; 2: a bad entry). Cannot run inside a graph capture."""
        import cupy

        sh = self.shape
        with self.caller.on(self._stream):
            if self.launch_stream().is_capturing():
                raise RuntimeError("the index check reads its verdict to the host and cannot "
                                   "run inside a CUDA-graph capture; check before capturing")
            if self.check_kernel is None:
                self.check_inst = registry.paged_check_instance()
                self.check_kernel = get_kernel(self.check_inst)
            error = cupy.zeros(4, cupy.int32)
            self.guard.launch("check", self.check_kernel, (sh.batch, 1, 1),
                              (self.check_inst.threads, 1, 1),
                              (self.block_table, self.cache_seqlens, np.int32(sh.batch),
                               np.int32(sh.max_pages), np.int32(sh.page_size),
                               np.int32(sh.num_pages), error),
                              kernel_name=self.check_inst.name)
            return error.get()

    def check_indices(self) -> None:
        """Run the index validator; a bad length or table entry raises a ValueError naming
        the request and the entry (check_paged_values' words, from host copies of the same
        buffers, which are read only when the validator flags something)."""
        report = self.index_report()
        if report[0]:
            with self.caller.on(self._stream):
                table, lengths = self.block_table.get(), self.cache_seqlens.get()
            raise_for_index_report(report, table, lengths, self.shape)

    # ---- CUDA graphs ---------------------------------------------------------------------
    def capture(self) -> "StepGraph":
        """The whole step (attn, combine) captured into a cupy.cuda.Graph on a non-default
        stream of its own (`self.graph_stream`), returned as a StepGraph that holds this step.
        `graph.launch(stream)` replays it: the replay reads cache_seqlens and block_table from
        the same device buffers, so new contents need no recapture. Raises for the cublas
        engine."""
        import cupy

        check_capturable(self.variant)
        with cupy.cuda.Device(self.device_id):
            stream = cupy.cuda.Stream(non_blocking=True)
            self._stream = stream
            try:
                graph = capture_graph(self._run_phases, stream)
            finally:
                self._stream = None
        self.graph_stream = stream
        return StepGraph(graph, self)

    def _run_phases(self) -> None:
        self.run_attn()
        self.run_combine()


class StepGraph:
    """A captured PagedDecodeStep: `graph`, the cupy.cuda.Graph, and `step`, whose buffers the
    graph's kernels read and write (its latent, lse and out, the partials, the tickets, the
    tensor map, and the caller's inputs it holds). A bare graph does not keep them alive, so a
    graph replayed after its step was collected would run into freed memory (an illegal
    address, or silently wrong numbers where the memory was reused); this one keeps the step
    for as long as it can be replayed."""

    __slots__ = ("graph", "step")

    def __init__(self, graph, step) -> None:
        self.graph = graph
        self.step = step

    def launch(self, stream=None) -> None:
        """Replays the step on `stream` (the current stream where None)."""
        self.graph.launch(stream)

    def upload(self, stream=None) -> None:
        """Loads the executable graph onto the device ahead of its first launch."""
        self.graph.upload(stream)


def decode_paged(q, kv_cache, block_table, cache_seqlens, wv_b=None, *, causal: bool = False,
                 variant: str = "auto", splits=None, scale=None,
                 check_indices: bool = True) -> PagedResult:
    """One paged decode step (see the module docstring and sandbox/paged.py). With
    `check_indices` the index validator runs first (not inside a graph capture, where it
    cannot read its verdict back): a bad table entry or length raises naming the request
    and the entry instead of reading out of bounds. It allocates its outputs: to capture a
    step, build a PagedDecodeStep before the capture and run it inside."""
    check_flags(check_indices=check_indices)
    step = PagedDecodeStep(q, kv_cache, block_table, cache_seqlens, wv_b, causal=causal,
                           variant=variant, splits=splits, scale=scale)
    if check_indices and not step.capturing():
        step.check_indices()
    return step.run()
