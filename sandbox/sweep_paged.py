"""`mlasandbox sweep --batch B` (or `--serving NAME`): the sweep over rows per block on one
paged serving step, one row per attention variant: split (1 row a block), batched<HPB>, and
the tensor-core families mma16, mma32 and wgmma64 (16, 32 and 64 rows).

Per variant, its paged instance's registers and spills (ptxas through NVRTC, sm_90a for
wgmma64), static + dynamic shared memory, blocks/SM from the occupancy model and from the
driver, the chunk plan of the batch (head blocks, chunk programs, chunk slots, the longest
chunk) and, on a GPU, the attention phase of the step (cold L2, events; PagedDecodeStep).
The table marks the register wall (a batched HPB with fewer blocks/SM than the one before
it) and the fastest variant.

`paged_sweep_rows` assembles the rows from injected pieces (a ptxas report, a measuring
function), so it is tested on the CPU; `run_paged_sweep` supplies the real ones.
"""
from __future__ import annotations

from dataclasses import replace

from . import registry, toolkit
from .bench_config import q_dtype_of
from .geometry import occupancy_of
from .limits import check_s_q
from .paged_api import paged_variant, plan_for_lengths
from .ptxas import ptxas_report
from .sweep import run_defaults

__all__ = ["SCHEMA", "TENSOR_CORE_VARIANTS", "paged_sweep_variants", "paged_sweep_rows",
           "run_paged_sweep"]

SCHEMA = "mlasandbox.sweep-paged/1"
TENSOR_CORE_VARIANTS = ("mma16", "mma32", "wgmma64")
_CHAIN = ("split", "batched")   # the families whose rows form the heads-per-block chain


def paged_sweep_variants(hpbs, tensor_cores: bool, cache: str, q: str, s_q: int,
                         n_head: int) -> tuple[list, list]:
    """(variants, skipped): HPB 1 as split, the others as batched<HPB>, then the tensor-core
    families. A tensor-core family these dtypes do not build (wgmma64 takes q in the cache
    dtype) is skipped with the reason; a bad HPB raises ValueError."""
    names = [registry.variant_for_hpb(h) for h in hpbs]
    skipped = []
    for v in TENSOR_CORE_VARIANTS if tensor_cores else ():
        try:
            registry.paged_attention_instance(v, cache, q)
        except ValueError as exc:
            skipped.append({"variant": v, "reason": str(exc)})
            continue
        names.append(v)
    for v in names:
        paged_variant(v, s_q, n_head)   # ValueError for a variant without a paged kernel
    return names, skipped


def _plan_row(cfg, inst, bps: int, num_sms: int) -> dict:
    """The chunk plan of the batch at `bps` blocks/SM (no GPU: the occupancy model's)."""
    n_rows = cfg.s_q * cfg.dims.n_head
    plan = plan_for_lengths(cfg.lengths, cfg.page_size, n_rows, inst, num_sms=num_sms,
                            blocks_per_sm=bps, splits=cfg.splits)
    n_chunks, chunk_len = plan.for_lengths(cfg.lengths)
    return {"head_blocks": plan.head_blocks, "grid": list(plan.grid),
            "max_chunks": plan.max_chunks, "n_chunks": [int(c) for c in n_chunks],
            "chunk_len_max": int(chunk_len.max()), "reason": plan.reason}


def paged_sweep_rows(*, variants, cfg, q: str, arch: str, num_sms: int, report: dict,
                     measure=None) -> list[dict]:
    """One row per variant. `report`: {instance name: KernelResources} (ptxas). `measure(v)`:
    None (no device) or {'timing': Timing, 'plan': the backend's paged_plan}."""
    rows = []
    for v in variants:
        inst = registry.paged_attention_instance(v, cfg.cache_dtype, q)
        res = report[inst.name]
        smem_total = res.smem_bytes + inst.smem_bytes
        occ = occupancy_of(arch, res.registers, inst.threads, smem_total)
        m = measure(v) if measure is not None else None
        plan = m["plan"] if m else _plan_row(cfg, inst, occ["blocks_per_sm"], num_sms)
        driver_bps = plan.get("driver_blocks_per_sm") if m else None
        n_chunks = plan["n_chunks"]
        t = m.get("timing") if m else None
        rows.append({
            "variant": v, "family": registry.variant(v).family, "rows_per_block": inst.heads,
            "kernel": inst.name, "tile": inst.tile_rows, "registers": res.registers,
            "spill_stores": res.spill_stores, "spill_loads": res.spill_loads,
            "stack_bytes": res.stack_bytes, "static_smem": res.smem_bytes,
            "dynamic_smem": inst.smem_bytes, "smem_total": smem_total,
            "threads": inst.threads, "blocks_per_sm_model": occ["blocks_per_sm"],
            "limiter": occ["limiter"], "warp_occupancy": occ["warp_occupancy"],
            "blocks_per_sm_driver": driver_bps,
            "driver_num_regs": plan.get("attn_num_regs") if m else None,
            "head_blocks": plan["head_blocks"], "grid": plan["grid"],
            "max_chunks": plan["max_chunks"], "programs_run": int(sum(n_chunks)) *
            plan["head_blocks"], "chunks_max": int(max(n_chunks)) if n_chunks else 0,
            "chunk_len_max": plan["chunk_len_max"],
            "median_us": t.median_us if t else None,
            "p10_us": t.stats.p10_us if t else None, "p90_us": t.stats.p90_us if t else None,
            "mode": t.mode if t else None, "step": False, "fastest": False,
        })
    prev = None
    for r in rows:   # the register wall along split, batched2, batched4, ...
        if r["family"] not in _CHAIN:
            continue
        bps = r["blocks_per_sm_driver"] or r["blocks_per_sm_model"]
        r["step"] = prev is not None and bps < prev
        prev = bps
    timed = [r for r in rows if r["median_us"] is not None]
    if timed:
        min(timed, key=lambda r: r["median_us"])["fastest"] = True
    return rows


def run_paged_sweep(cfg, *, hpbs=registry.HPB_VALUES, tensor_cores: bool = True,
                    arch: str | None = None, num_sms: int | None = None,
                    timing_kw: dict | None = None, use_gpu: bool | None = None, backend=None,
                    progress=None) -> dict:
    """The sweep of one paged step (cfg: bench_paged.make_paged_config's) on the device
    (use_gpu None: when there is one), else compile-side only."""
    check_s_q(cfg.s_q, cfg.dims.n_head, cfg.batch)   # a cfg not made by make_paged_config
    q = q_dtype_of(cfg.q_dtype, cfg.cache_dtype)
    variants, skipped = paged_sweep_variants(tuple(hpbs), tensor_cores, cfg.cache_dtype, q,
                                             cfg.s_q, cfg.dims.n_head)
    cfg = replace(cfg, variants=tuple(variants))
    use_gpu, progress, timing_kw = run_defaults(use_gpu, backend, progress, timing_kw)
    meta: dict = {}
    measure_fn = None
    if use_gpu:
        if backend is None:
            from .bench_gpu import PagedBackend   # imports CuPy: only on a GPU run

            backend = PagedBackend()
        meta = backend.meta()
        arch, num_sms = backend.arch, backend.num_sms   # the device's, not the options'
        backend.prepare_paged(cfg)

        def _measure(v):
            plan = backend.paged_plan(v)
            t = backend.time_paged(v, "attn", timing_kw)
            backend.release_steps()
            progress(v, 1)
            return {"timing": t, "plan": plan}
        measure_fn = _measure
    else:
        arch = arch or "sm_90"
        num_sms = num_sms or 132
    toolkit.check_arch(arch)
    insts = [registry.paged_attention_instance(v, cfg.cache_dtype, q) for v in variants]
    report = ptxas_report(insts, arch=arch)
    rows = paged_sweep_rows(variants=variants, cfg=cfg, q=q, arch=arch, num_sms=num_sms,
                            report=report, measure=measure_fn)
    if use_gpu:
        backend.release()
    warnings = [f"{s['variant']} skipped: {s['reason']}" for s in skipped]
    mismatch = [r["variant"] for r in rows
                if r["driver_num_regs"] not in (None, -1, r["registers"])]
    if mismatch:
        warnings.append(f"ptxas and the loaded kernel disagree on registers for "
                        f"{', '.join(mismatch)}")
    return {"schema": SCHEMA, "ok": True, "timed": bool(use_gpu), "meta": meta,
            "config": {**cfg.as_dict(), "q": q, "arch": arch, "num_sms": num_sms,
                       "hpbs": list(hpbs), "tensor_cores": tensor_cores},
            "rows": rows, "skipped": skipped, "warnings": warnings}
