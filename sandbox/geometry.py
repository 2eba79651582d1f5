"""Launch geometry and resources, as plain rows: what `mlasandbox regs` and `grid` show.

* `resource_rows` joins the ptxas report (registers, spills, machine-code size, stack, static
  smem) with each instance's block size and dynamic shared memory and the theoretical
  occupancy (`mlasandbox.occupancy`), and marks the occupancy step along the heads-per-block
  sweep.
* `grid_report` is the launch geometry of one variant for one shape (splits.plan_splits):
  grid, blocks vs SMs, waves, idle SMs, positions and tiles per block, empty slices.
  With `blocks_per_sm="auto"` the resident-block count is the theoretical occupancy of the
  variant's attention instance, from a real ptxas compile of it (about 0.3 s, no GPU).

Everything returns dicts of plain values, so the CLI renders them as tables or JSON.
"""
from __future__ import annotations

import math

from . import occupancy, ptxas, registry
from .registry import HPB_VALUES, KINDS
from .splits import plan_splits, slice_bounds

__all__ = ["DEFAULT_ARCH", "DEFAULT_SMS", "KINDS", "instances_for", "occupancy_of", "resource_rows",
           "theoretical_blocks_per_sm", "grid_report"]

DEFAULT_ARCH = "sm_90"
DEFAULT_SMS = 132  # H100 SXM / H200


def occupancy_of(arch: str, registers: int, threads: int, smem_bytes: int) -> dict:
    """{'blocks_per_sm', 'limiter', 'warp_occupancy'} from the occupancy calculator.

    An unknown arch raises ValueError; a kernel that cannot fit on an SM at all (over a
    per-block limit) gets blocks_per_sm 0 and the calculator's reason as its limiter.
    """
    occupancy.arch_limits(arch)  # ValueError naming the known archs
    try:
        occ = occupancy.occupancy(arch, registers, threads, smem_bytes)
    except ValueError as exc:
        return {"blocks_per_sm": 0, "limiter": f"does not fit: {exc}", "warp_occupancy": 0.0}
    return {"blocks_per_sm": int(occ.blocks_per_sm), "limiter": str(occ.limiter),
            "warp_occupancy": float(occ.fraction)}


LADDER_KINDS = ("attn_rows", "attn")  # the heads-per-block ladder: HPB 1, then attn<HPB>


def instances_for(hpbs=HPB_VALUES, caches=("f16", "bf16"), q_dtypes=("f32", "cache"),
                  controls: bool = True, kinds=KINDS) -> list:
    """The registry instances `regs` reports: attn for each HPB, then q_absorb and combine."""
    for h in hpbs:
        if h not in HPB_VALUES:
            raise ValueError(f"heads per block must be among {HPB_VALUES}, got {h}")
    wanted = registry.all_instances(tuple(caches), tuple(q_dtypes), negative_controls=controls)
    return [inst for inst in wanted if inst.kind in kinds
            and (inst.kind not in LADDER_KINDS or inst.heads in hpbs)]


def _resource_row(inst, r, arch: str) -> dict:
    """One instance's ptxas resources (`r`), block size, shared memory and occupancy."""
    occ = occupancy_of(arch, r.registers, inst.threads, r.smem_bytes + inst.smem_bytes)
    return {"name": inst.name, "kind": inst.kind, "heads": inst.heads, "cache": inst.cache,
            "q": inst.q, "rescale": inst.rescale, "min_arch": inst.min_arch,
            "registers": r.registers,
            "spill_stores": r.spill_stores, "spill_loads": r.spill_loads,
            "code_bytes": r.code_bytes,
            "stack_bytes": r.stack_bytes, "static_smem": r.smem_bytes,
            "dynamic_smem": inst.smem_bytes, "threads": inst.threads, **occ, "step": False,
            "cmem0_bytes": r.cmem0_bytes, "barriers": r.barriers, "arch": arch}


def resource_rows(arch: str = DEFAULT_ARCH, hpbs=HPB_VALUES, caches=("f16", "bf16"),
                  q_dtypes=("f32", "cache"), controls: bool = True, kinds=KINDS,
                  report=None) -> list[dict]:
    """One row per kernel instance: ptxas resources, block size, smem, blocks/SM, limiter.

    `step` is True on a ladder row (attn_rows, attn) whose blocks/SM is below the previous
    HPB's for the same dtypes and launch (batch 1 or paged): the occupancy step of the
    register wall.
    """
    insts = instances_for(hpbs, caches, q_dtypes, controls, kinds)
    occupancy.arch_limits(arch)  # an unknown arch fails before the compile
    rep = report if report is not None else ptxas.ptxas_report(insts, arch=arch)
    rows = []
    prev: dict[tuple, int] = {}
    for inst in insts:
        row = _resource_row(inst, rep[inst.name], arch)
        if row["kind"] in LADDER_KINDS:
            key = (row.get("cache"), row.get("q"), inst.paged)
            if key in prev and row["blocks_per_sm"] < prev[key]:
                row["step"] = True
            prev[key] = row["blocks_per_sm"]
        rows.append(row)
    return rows


def theoretical_blocks_per_sm(variant, cache: str = "f16", q: str = "f32",
                              arch: str = DEFAULT_ARCH) -> dict:
    """Blocks/SM of a registry Variant's attention kernel on `arch`, from a real compile:
    a resource row."""
    inst = registry.attention_instance(variant, cache, q)  # ValueError for a bad dtype pair
    occupancy.arch_limits(arch)
    return _resource_row(inst, ptxas.ptxas_report([inst], arch=arch)[inst.name], arch)


def grid_report(variant: str, heads: int, ctx: int, *, splits="auto", hpb: int | None = None,
                sms: int = DEFAULT_SMS, blocks_per_sm="auto", arch: str = DEFAULT_ARCH,
                cache: str = "f16", q: str = "f32") -> dict:
    """The launch geometry of `variant` for `heads` heads at context `ctx`."""
    v = registry.resolve_variant(variant, hpb, option="--hpb")
    if not v.is_cuda:
        raise ValueError(f"variant {v.name} is CuPy matmuls (cuBLAS): it has no launch "
                         "geometry of its own; pick one of "
                         + ", ".join(n for n, x in registry.VARIANTS.items() if x.is_cuda))
    for name, val in (("heads", heads), ("ctx", ctx), ("sms", sms)):
        if isinstance(val, bool) or int(val) != val or val < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {val!r}")
    occ_row = None
    if blocks_per_sm in (None, "auto"):
        occ_row = theoretical_blocks_per_sm(v, cache, q, arch)
        bps = occ_row["blocks_per_sm"]
        if bps < 1:
            raise ValueError(f"{occ_row['name']} does not fit on an SM of {arch} "
                             f"(limiter: {occ_row['limiter']})")
        bps_source = (f"theoretical occupancy of {occ_row['name']} on {arch}: "
                      f"{occ_row['registers']} registers x {occ_row['threads']} threads, "
                      f"{occ_row['static_smem'] + occ_row['dynamic_smem']} B smem -> "
                      f"{bps}/SM (limited by {occ_row['limiter']}; ptxas compile)")
    else:
        bps = int(blocks_per_sm)
        bps_source = "given (--blocks-per-sm)"
    inst = registry.attention_instance(v, cache, q)
    plan = plan_splits(int(ctx), int(heads), v.hpb, num_sms=int(sms), blocks_per_sm=bps,
                       splits=splits, split=v.splits, tile=inst.tile_rows)
    lengths = [e - s for s, e in (slice_bounds(plan.n_ctx, plan.splits, i)
                                  for i in range(plan.splits))]
    nonempty = [n for n in lengths if n > 0]
    waves = plan.blocks / plan.slots
    return {
        "variant": v.name, "family": v.family, "heads_per_block": v.hpb,
        "n_head": plan.n_head, "n_ctx": plan.n_ctx, "arch": arch, "cache": cache, "q": q,
        "grid": list(plan.grid), "blocks": plan.blocks, "threads_per_block": inst.threads,
        "splits": plan.splits, "splits_requested": str(splits),
        "num_sms": plan.num_sms, "blocks_per_sm": bps, "blocks_per_sm_source": bps_source,
        "slots": plan.slots, "waves": waves, "full_waves": math.ceil(waves),
        "idle_sms": plan.idle_sms,
        "positions_per_block": max(nonempty), "positions_min_block": min(nonempty),
        "tiles_per_block": plan.tiles_per_block(), "tile": plan.tile,
        "empty_slices": plan.empty_slices, "combine": plan.splits > 1,
        "estimated_tile_steps": plan.estimated_steps(), "reason": plan.reason,
        "registers": occ_row["registers"] if occ_row else None,
        "limiter": occ_row["limiter"] if occ_row else None,
    }
