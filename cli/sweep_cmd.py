"""`mlasandbox sweep`: the heads-per-block sweep (mlasandbox.sweep): the register wall.

On a GPU every column; without one the compile-side columns (registers, spills, shared
memory, modelled blocks/SM, the split plan from them) and no time, said in the title.
"""
from __future__ import annotations

import click
from rich.markup import escape

from mlasandbox import registry, toolkit
from mlasandbox.ptxas import NvrtcCompileError, PtxasParseError
from mlasandbox.sweep import SWEEP_CTX, run_sweep
from mlasandbox.toolkit import ToolkitError

from . import render
from .lab_render import sweep_table
from .options import (arch_option, cache_option, ctx_option, deliver_json, heads_option, hpb_list,
                      json_option, preset_option, progress_bar, q_option, splits_option,
                      stderr_console, timing_options)

__all__ = ["sweep"]


def _run_sweep(**opts):
    """Hook (tests replace it): mlasandbox.sweep.run_sweep."""

    return run_sweep(**opts)


@click.command("sweep")
@ctx_option(SWEEP_CTX, multiple=False, dest="n_ctx")
@preset_option()
@heads_option()
@click.option("--hpb", "hpbs", callback=hpb_list, default=None,
              help="Heads-per-block values (default: every instantiated one).")
@cache_option()
@q_option()
@splits_option()
@arch_option("Arch to compile for without a GPU (with one: the device's).")
@click.option("--sms", type=click.IntRange(min=1), default=132, show_default=True,
              help="SM count without a GPU (with one: the device's).")
@timing_options(target_ms=300.0)
@click.option("--no-gpu", is_flag=True, help="Compile-side columns only, even with a GPU.")
@json_option
def sweep(n_ctx, preset, heads, hpbs, cache, q_dtype, splits, arch, sms, repeats, min_repeats,
          target_ms, seed, no_gpu, json_out):
    """Heads per block: time, registers, spills, smem, blocks/SM (model and driver), waves.

    Marks the occupancy step (blocks/SM drops: the register wall) and the fastest value.
    """
    hpbs = hpbs or registry.HPB_VALUES
    if min_repeats > repeats:
        raise click.UsageError(f"--min-repeats {min_repeats} exceeds --repeats {repeats}")
    use_gpu = False if no_gpu else toolkit.device_available()[0]
    err = stderr_console()
    opts = dict(n_ctx=n_ctx, preset=preset, heads=heads, hpbs=hpbs, cache=cache, q=q_dtype,
                splits=splits, arch=arch, num_sms=sms, seed=seed, use_gpu=use_gpu,
                timing_kw={"warmup": 3, "min_repeats": min_repeats, "max_repeats": repeats,
                           "target_s": target_ms / 1e3})
    try:
        if use_gpu:
            with progress_bar(err) as bar:
                task = bar.add_task("sweep", total=len(hpbs))
                result = _run_sweep(**opts, progress=lambda label, advance=1: bar.update(
                    task, advance=advance, description=label))
        else:
            result = _run_sweep(**opts)
    except (ToolkitError, NvrtcCompileError, PtxasParseError) as exc:
        raise click.ClickException(str(exc)) from None
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if deliver_json(result, json_out, err):
        return
    con = render.console()
    con.print(sweep_table(result))
    if not result["timed"]:
        why = "--no-gpu" if no_gpu else toolkit.device_available()[1]
        con.print(f"No timings ({escape(why)}). The occupancy step is visible without them: "
                  "it is a property of the compile.")
    for w in result.get("warnings", []):
        con.print(f"[bold yellow]warning:[/bold yellow] {escape(w)}")
