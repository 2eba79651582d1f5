"""`mlasandbox regs` and `grid`: what the compile and the launch rule say, without a GPU."""
from __future__ import annotations

import click

from mlasandbox import archs, geometry, registry
from mlasandbox.ptxas import NvrtcCompileError, PtxasParseError
from mlasandbox.registry import HPB_VALUES
from mlasandbox.toolkit import ToolkitError
from mlasandbox.tp import check_tp, rank_grids

from . import render
from .options import (arch_option, blocks_per_sm, cache_option, ctx_option, heads_option,
                      deliver_json, hpb_list, json_option, q_of, q_option, sms_option,
                      splits_option, stderr_console)
from .tp_cmd import grid_tp_table, tp_option

__all__ = ["regs", "grid", "regs_rows", "COMPILE_ERRORS"]

COMPILE_ERRORS = (ToolkitError, NvrtcCompileError, PtxasParseError)


def regs_rows(arch: str, hpbs=HPB_VALUES, caches=("f16", "bf16"), qs=("f32", "cache"),
              controls: bool = True) -> list[dict]:
    """geometry.resource_rows for `arch`, in registry order; an instance whose kernel needs a
    newer arch gets a row {"name", "needs"} instead, and is not compiled."""
    archs.check_arch(arch)
    blocked = tuple(k for k in geometry.KINDS if any(
        archs.instance_needs(arch, i)
        for i in geometry.instances_for(hpbs, caches, qs, controls, kinds=(k,))))
    allowed = tuple(k for k in geometry.KINDS if k not in blocked)
    compiled = {r["name"]: r for r in geometry.resource_rows(
        arch, hpbs=hpbs, caches=caches, q_dtypes=qs, controls=controls, kinds=allowed)}
    rows = []
    for inst in geometry.instances_for(hpbs, caches, qs, controls):
        if inst.name in compiled:
            rows.append(compiled[inst.name])
        else:
            rows.append({"name": inst.name, "needs": archs.instance_needs(arch, inst),
                         "arch": arch})
    return rows


@click.command()
@arch_option("Real architecture to compile for.")
@click.option("--hpb", "hpbs", callback=hpb_list, default=None,
              help="Heads per block to show, comma-separated (default: all instantiated: "
                   f"{', '.join(map(str, HPB_VALUES))}).")
@cache_option(multiple=True)
@q_option(multiple=True)
@click.option("--no-controls", is_flag=True,
              help="Leave out the negative-control combine (no rescale).")
@json_option
def regs(arch, hpbs, caches, qs, no_controls, json_out):
    """ptxas registers, spills, smem and theoretical occupancy of every kernel instance.

    A real NVRTC compile with -Xptxas -v for ARCH: needs no GPU. A kernel that needs a newer
    arch is listed as such; the others still print.
    """
    try:
        rows = regs_rows(arch, hpbs or HPB_VALUES, caches, qs, not no_controls)
    except COMPILE_ERRORS as exc:
        raise click.ClickException(str(exc)) from None
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    result = {"ok": True, "arch": arch, "rows": rows}
    if deliver_json(result, json_out, stderr_console()):
        return
    render.console().print(render.regs_table(rows, arch))


def _families() -> str:
    cuda = [v for v in registry.VARIANTS.values() if v.is_cuda]
    batched = [str(v.hpb) for v in cuda if v.family == "batched"]
    names = [v.name for v in cuda if v.family != "batched"]
    return (f"{', '.join(names[:2])}, batched<HPB> (HPB {', '.join(batched)}; or batched with "
            f"--hpb), {', '.join(names[2:])}")


@click.command()
@click.option("--variant", "variant_name", required=True,
              help=f"The CUDA variant: {_families()}.")
@heads_option(help="Query heads.")
@ctx_option(None, multiple=False, dest="ctx")
@splits_option()
@click.option("--hpb", type=int, default=None,
              help="Heads per block, for --variant batched "
                   f"({', '.join(map(str, HPB_VALUES))}; 1 is split).")
@sms_option(132, "SM count (132: H100 SXM / H200).")
@click.option("--blocks-per-sm", "bps", callback=blocks_per_sm, default="auto",
              show_default=True,
              help="Resident blocks per SM: 'auto' compiles the instance and takes its "
                   "theoretical occupancy (~0.3 s, no GPU), or give k.")
@arch_option("Arch of the 'auto' occupancy.")
@cache_option()
@q_option()
@tp_option("Each of N ranks' grid, its band of the heads, against the SMs (uneven bands "
           "when N does not divide the heads).")
@json_option
def grid(variant_name, heads, ctx, splits, hpb, sms, bps, arch, cache, q_dtype, tp,
         json_out):
    """Launch geometry of a variant: grid, blocks vs SMs, waves, idle SMs, work per block."""
    if heads is None:
        raise click.UsageError("Missing option '--heads'.")
    if ctx is None:
        raise click.UsageError("Missing option '--ctx'.")
    if hpb is not None and hpb not in HPB_VALUES:
        raise click.BadParameter(f"heads per block must be among "
                                 f"{', '.join(map(str, HPB_VALUES))} (the instantiated values), "
                                 f"got {hpb}", param_hint="'--hpb'")
    try:
        var = registry.resolve_variant(variant_name, hpb, option="--hpb")
        need = archs.variant_needs(arch, var.name)
        if need and bps == "auto":
            raise ValueError(f"{var.name} needs {need}: its 'auto' occupancy cannot be "
                             f"compiled for --arch {arch} (give --arch {need} or "
                             "--blocks-per-sm k)")
        kw = dict(splits=splits, hpb=hpb, sms=sms, blocks_per_sm=bps, arch=arch,
                  cache=cache, q=q_of(q_dtype, cache))
        if tp is not None:
            rows = rank_grids(variant_name, heads, ctx, check_tp(tp, heads), **kw)
            if not deliver_json({"ok": True, "tp": tp, "ranks": rows}, json_out,
                                stderr_console()):
                render.console().print(grid_tp_table(rows, tp))
            return
        g = geometry.grid_report(variant_name, heads, ctx, **kw)
    except COMPILE_ERRORS as exc:
        raise click.ClickException(f"{exc}\n(pass --blocks-per-sm k to skip the compile)") \
            from None
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    result = {"ok": True, **g}
    if deliver_json(result, json_out, stderr_console()):
        return
    render.console().print(render.grid_table(g))
