"""`mlasandbox sweep`: the heads-per-block sweep (the register wall), one row per HPB value.

Per HPB (HPB 1 is `split`, the others `batched<HPB>`), at one context (default 131072, 96
heads): the attention phase's time, registers and spills (ptxas, through NVRTC for
the device's arch), static + dynamic shared memory, blocks/SM from the occupancy model and
from the driver's occupancy API, the split count and the waves of head_blocks x splits over
the resident slots. The table marks the occupancy step (blocks/SM lower than the previous
HPB's: the register wall) and the fastest value.

The step can be read off the compile (`-Xptxas -v`) before any
timing: without a GPU the sweep still prints every column but the time and the driver's
figure, with the split plan computed from the modelled blocks/SM.

`sweep_rows` assembles the rows from injected pieces (a ptxas report, a measuring function),
so it is tested on the CPU; `run_sweep` supplies the real ones.
"""
from __future__ import annotations

from . import bench_gpu, registry, toolkit
from .dims import PRESETS, Dims
from .geometry import occupancy_of
from .ptxas import ptxas_report
from .registry import variant_for_hpb
from .splits import plan_splits

__all__ = ["SWEEP_CTX", "variant_for_hpb", "sweep_rows", "run_defaults", "run_sweep",
           "SCHEMA"]

SCHEMA = "mlasandbox.sweep/1"
SWEEP_CTX = 131072


def sweep_rows(*, hpbs, n_ctx: int, dims: Dims, cache: str, q: str, arch: str, num_sms: int,
               report: dict, measure=None, splits="auto",
               min_ctx: int | None = None) -> list[dict]:
    """One row per HPB. `report`: {instance name: KernelResources} (ptxas). `measure(hpb)`:
    None (no device) or {'timing': Timing, 'driver_blocks_per_sm': int, 'plan': dict,
    'num_regs': int}."""

    rows = []
    for hpb in hpbs:
        inst = registry.attn_instance(hpb, cache, q)
        res = report[inst.name]
        smem_total = res.smem_bytes + inst.smem_bytes
        occ = occupancy_of(arch, res.registers, inst.threads, smem_total)
        m = measure(hpb) if measure is not None else None
        driver_bps = m.get("driver_blocks_per_sm") if m else None
        if m and m.get("plan"):
            plan = m["plan"]
        else:
            bps = driver_bps or occ["blocks_per_sm"]
            p = plan_splits(n_ctx, dims.n_head, hpb, num_sms=num_sms, blocks_per_sm=max(1, bps),
                            splits=splits, split=True, min_ctx=min_ctx, tile=inst.tile_rows)
            plan = {"splits": p.splits, "head_blocks": p.head_blocks, "waves": p.waves,
                    "blocks": p.blocks, "slots": p.slots, "reason": p.reason}
        t = m.get("timing") if m else None
        rows.append({
            "hpb": hpb, "variant": variant_for_hpb(hpb), "kernel": inst.name,
            "registers": res.registers, "spill_stores": res.spill_stores,
            "spill_loads": res.spill_loads, "stack_bytes": res.stack_bytes,
            "static_smem": res.smem_bytes, "dynamic_smem": inst.smem_bytes,
            "smem_total": smem_total, "threads": inst.threads,
            "blocks_per_sm_model": occ["blocks_per_sm"], "limiter": occ["limiter"],
            "warp_occupancy": occ["warp_occupancy"],
            "blocks_per_sm_driver": driver_bps,
            "driver_num_regs": m.get("num_regs") if m else None,
            "splits": plan["splits"], "head_blocks": plan["head_blocks"],
            "waves": plan["waves"], "plan_reason": plan.get("reason"),
            "median_us": t.median_us if t else None,
            "p10_us": t.stats.p10_us if t else None, "p90_us": t.stats.p90_us if t else None,
            "mode": t.mode if t else None,
            "step": False, "driver_step": False, "fastest": False,
        })
    prev_m = prev_d = None
    for r in rows:
        if prev_m is not None and r["blocks_per_sm_model"] < prev_m:
            r["step"] = True
        if (prev_d is not None and r["blocks_per_sm_driver"] is not None
                and r["blocks_per_sm_driver"] < prev_d):
            r["driver_step"] = True
        prev_m = r["blocks_per_sm_model"]
        prev_d = r["blocks_per_sm_driver"]
    timed = [r for r in rows if r["median_us"] is not None]
    if timed:
        min(timed, key=lambda r: r["median_us"])["fastest"] = True
    return rows


def run_defaults(use_gpu, backend, progress, timing_kw):
    """(use_gpu, progress, timing_kw) of a sweep run: on the device where there is one (or a
    backend is given), a progress callback that does nothing, the sweep's timing budget."""
    if use_gpu is None:
        use_gpu = backend is not None or toolkit.device_available()[0]
    return (use_gpu, progress or (lambda label, advance=1: None),
            timing_kw or {"warmup": 3, "min_repeats": 10, "max_repeats": 100, "target_s": 0.3})


def run_sweep(*, n_ctx: int = SWEEP_CTX, preset: str = "h96", heads: int | None = None,
              hpbs=registry.HPB_VALUES, cache: str = "f16", q: str = "f32", splits="auto",
              arch: str | None = None, num_sms: int | None = None, seed: int = 0,
              timing_kw: dict | None = None, use_gpu: bool | None = None, backend=None,
              progress=None) -> dict:
    """The sweep on the device (use_gpu None: when there is one), else compile-side only."""

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    dims = PRESETS[preset] if heads is None else PRESETS[preset].with_heads(heads)
    q = cache if q == "cache" else q
    hpbs = tuple(hpbs)
    insts = [registry.attn_instance(h, cache, q) for h in hpbs]  # ValueError for bad values
    use_gpu, progress, timing_kw = run_defaults(use_gpu, backend, progress, timing_kw)
    meta: dict = {}
    measure_fn = None
    if use_gpu:
        if backend is None:
            backend = bench_gpu.CupyBackend()
        meta = backend.meta()
        arch, num_sms = backend.arch, backend.num_sms  # the device's, not the options'
        backend.prepare(dims, n_ctx, cache, q, seed)

        def _measure(hpb):
            v = variant_for_hpb(hpb)
            plan = backend.plan(v, n_ctx, splits)
            # events, not a graph: one long kernel per run, launch overhead is noise here
            t = backend.time(v, n_ctx, "attn", splits, False, timing_kw)
            progress(f"HPB {hpb}", 1)
            return {"timing": t, "plan": plan, "num_regs": plan.get("attn_num_regs"),
                    "driver_blocks_per_sm": plan.get("driver_blocks_per_sm")}
        measure_fn = _measure
    else:
        arch = arch or "sm_90"
        num_sms = num_sms or 132
    toolkit.check_arch(arch)
    report = ptxas_report(insts, arch=arch)
    rows = sweep_rows(hpbs=hpbs, n_ctx=n_ctx, dims=dims, cache=cache, q=q, arch=arch,
                      num_sms=num_sms, report=report, measure=measure_fn, splits=splits)
    if use_gpu:
        backend.release()
    mismatch = [r["hpb"] for r in rows if r["driver_num_regs"] not in (None, -1, r["registers"])]
    return {"schema": SCHEMA, "ok": True, "timed": bool(use_gpu), "meta": meta,
            "config": {"n_ctx": n_ctx, "preset": preset, "n_head": dims.n_head, "cache": cache,
                       "q": q, "splits": splits, "arch": arch, "num_sms": num_sms,
                       "hpbs": list(hpbs), "seed": seed},
            "rows": rows,
            "warnings": [f"ptxas and the loaded kernel disagree on registers at HPB "
                         f"{', '.join(map(str, mismatch))}"] if mismatch else []}
