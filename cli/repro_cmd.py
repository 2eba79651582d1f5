"""`mlasandbox repro`: write a self-contained bug-report script (mlasandbox.repro)."""
from __future__ import annotations

import shlex
import sys

import click
from rich.markup import escape

from mlasandbox import registry
from mlasandbox.dims import PRESETS
from mlasandbox.repro import REPRO_CONTEXTS

from . import render
from .lab_options import auto_or_int, int_list

__all__ = ["repro"]


@click.command("repro")
@click.option("--variant", "variant_name", required=True,
              type=click.Choice(registry.variant_names()), help="The variant to reproduce.")
@click.option("--preset", type=click.Choice(sorted(PRESETS)), default="lecture",
              show_default=True)
@click.option("--heads", type=click.IntRange(min=1), default=None,
              help="Query heads (overrides the preset's).")
@click.option("--ctx", "contexts", callback=int_list,
              default=",".join(map(str, REPRO_CONTEXTS)), show_default=True,
              help="Context lengths, comma-separated.")
@click.option("--cache", type=click.Choice(["f16", "bf16"]), default="f16", show_default=True)
@click.option("--q", "q_dtype", type=click.Choice(["f32", "cache"]), default="f32",
              show_default=True)
@click.option("--splits", callback=auto_or_int, default="auto", show_default=True,
              help="'auto' (resolved now, pinned in the script) or S.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--negative-control", is_flag=True,
              help="Use the combine without its rescale: the script must FAIL.")
@click.option("--sms", type=click.IntRange(min=1), default=None,
              help="SM count for 'auto' splits without a GPU (default 132).")
@click.option("--blocks-per-sm", "bps", callback=auto_or_int, default="auto",
              show_default=True, help="Blocks/SM for 'auto' splits ('auto': driver or model).")
@click.option("--arch", default="sm_90", show_default=True,
              help="Arch of the occupancy model for 'auto' splits without a GPU.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None,
              help="Script path (default: a name built from the case).")
@click.option("--json", "as_json", is_flag=True, help="Print what was written as JSON.")
def repro(variant_name, preset, heads, contexts, cache, q_dtype, splits, seed,
          negative_control, sms, bps, arch, output, as_json):
    """Write one self-contained Python script (CuPy + NumPy only) reproducing a case.

    The script prints the GPU and versions, runs the kernels under a phase guard, compares
    with an embedded float64 reference and prints one PASS/FAIL line (exit 0 / 1 / 2).
    """
    from mlasandbox.repro import make_case, write_script

    command = "mlasandbox repro " + " ".join(shlex.quote(a) for a in sys.argv[2:]) \
        if len(sys.argv) > 1 and sys.argv[1] == "repro" else ""
    try:
        case = make_case(variant_name, preset=preset, heads=heads, contexts=contexts,
                         cache=cache, q=q_dtype, splits=splits, seed=seed,
                         negative_control=negative_control, num_sms=sms, blocks_per_sm=bps,
                         arch=arch, command=command)
    except ValueError as exc:
        if as_json:
            render.emit_json({"ok": False, "error": str(exc)})
        raise click.UsageError(str(exc)) from None
    path = write_script(case, output)
    info = {"ok": True, "path": path, "variant": case.variant, "n_head": case.dims.n_head,
            "contexts": list(case.contexts), "splits": {str(k): v for k, v in case.splits.items()},
            "splits_from": case.splits_from, "cache": case.cache_dtype, "q": case.q_dtype,
            "seed": case.seed, "negative_control": case.negative_control,
            "expect": "FAIL" if case.negative_control else "PASS"}
    if as_json:
        render.emit_json(info)
        return
    con = render.console()
    con.print(escape(f"wrote {path}"))
    con.print(escape(f"  {case.variant}, H={case.dims.n_head}, cache {case.cache_dtype}, q "
                     f"{case.q_dtype}, seed {case.seed}; splits {case.splits} "
                     f"({case.splits_from})"))
    con.print(escape(f"  run it on a GPU: python {path}   (expect {info['expect']})"))
