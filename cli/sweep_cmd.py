"""`mlasandbox sweep`: the heads-per-block sweep (mlasandbox.sweep): the register wall; with
--batch / --serving, the rows-per-block sweep of one paged step (mlasandbox.sweep_paged),
the tensor-core families included.

On a GPU every column; without one the compile-side columns (registers, spills, shared
memory, modelled blocks/SM, the split or chunk plan from them) and no time, said in the title.
"""
from __future__ import annotations

import click
from rich.markup import escape

from mlasandbox import registry, toolkit
from mlasandbox.ptxas import NvrtcCompileError, PtxasParseError
from mlasandbox.bench_paged import SERVING_PRESETS, serving_help
from mlasandbox.sweep import SWEEP_CTX, run_sweep
from mlasandbox.sweep_paged import run_paged_sweep
from mlasandbox.toolkit import ToolkitError

from . import render
from .lab_render import paged_sweep_table, sweep_table
from .options import (arch_option, cache_option, ctx_option, deliver_json, heads_option, hpb_list,
                      json_option, lengths_file, paged_options, paged_step_config,
                      preset_option, progress_bar, q_option, refuse_overwrites,
                      refuse_paged_options, sms_option, splits_option, stderr_console,
                      timing_options)

__all__ = ["sweep"]


def _run_sweep(**opts):
    """Hook (tests replace it): mlasandbox.sweep.run_sweep."""

    return run_sweep(**opts)


def _run_paged_sweep(cfg, **opts):
    """Hook (tests replace it): mlasandbox.sweep_paged.run_paged_sweep."""

    return run_paged_sweep(cfg, **opts)


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
@sms_option(132, "SM count without a GPU (with one: the device's).")
@timing_options(target_ms=300.0)
@click.option("--no-gpu", is_flag=True, help="Compile-side columns only, even with a GPU.")
@paged_options(SERVING_PRESETS, serving_help())
@click.option("--tensor-cores/--no-tensor-cores", default=True, show_default=True,
              help="With --batch / --serving: also mma16, mma32 and wgmma64 (16, 32 and 64 "
                   "rows a block).")
@json_option
@click.pass_context
def sweep(ctx, n_ctx, preset, heads, hpbs, cache, q_dtype, splits, arch, sms, repeats,
          min_repeats, target_ms, seed, no_gpu, batch, lengths_spec, page_size, s_q, causal,
          serving, tensor_cores, json_out):
    """Heads per block: time, registers, spills, smem, blocks/SM (model and driver), waves.

    Marks the occupancy step (blocks/SM drops: the register wall) and the fastest value.
    With --batch B or --serving NAME: the same over rows per block on that paged step, the
    tensor-core families included (their attention phase, the chunk plan instead of S).
    """
    hpbs = hpbs or registry.HPB_VALUES
    refuse_overwrites([("--lengths", lengths_file(lengths_spec))], [("--json", json_out)])
    if min_repeats > repeats:
        raise click.UsageError(f"--min-repeats {min_repeats} exceeds --repeats {repeats}")
    use_gpu = False if no_gpu else toolkit.device_available()[0]
    err = stderr_console()
    timing_kw = {"warmup": 3, "min_repeats": min_repeats, "max_repeats": repeats,
                 "target_s": target_ms / 1e3}
    if batch is not None or serving is not None:
        cfg, _ = paged_step_config(dict(batch=batch, lengths_spec=lengths_spec, s_q=s_q,
                                        causal=causal, page_size=page_size, serving=serving,
                                        cache=cache, q_dtype=q_dtype, splits=splits,
                                        seed=seed), ctx, ("split",), heads=heads, preset=preset)
        _paged(cfg, hpbs, tensor_cores, arch, sms, use_gpu, no_gpu, timing_kw, json_out, err)
        return
    refuse_paged_options(lengths_spec, s_q, causal)
    if ctx.get_parameter_source("tensor_cores") == click.core.ParameterSource.COMMANDLINE:
        raise click.UsageError("--tensor-cores / --no-tensor-cores need --batch B or --serving "
                               "PRESET (the paged step's sweep)")
    opts = dict(n_ctx=n_ctx, preset=preset, heads=heads, hpbs=hpbs, cache=cache, q=q_dtype,
                splits=splits, arch=arch, num_sms=sms, seed=seed, use_gpu=use_gpu,
                timing_kw=timing_kw)
    _run_and_show(lambda **kw: _run_sweep(**opts, **kw), len(hpbs), use_gpu, no_gpu, json_out,
                  err, sweep_table, "The occupancy step is visible without them: it is a "
                  "property of the compile.")


def _run_and_show(run, total: int, use_gpu, no_gpu, json_out, err, table, untimed: str):
    """run() (with a progress bar on a GPU), then its JSON or its table and warnings; bad
    options exit 2, a compile or toolkit failure 1."""
    try:
        if use_gpu:
            with progress_bar(err) as bar:
                task = bar.add_task("sweep", total=total)
                result = run(progress=lambda label, advance=1: bar.update(
                    task, advance=advance, description=label))
        else:
            result = run()
    except (ToolkitError, NvrtcCompileError, PtxasParseError) as exc:
        raise click.ClickException(str(exc)) from None
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if deliver_json(result, json_out, err):
        return
    con = render.console()
    con.print(table(result))
    if not result["timed"]:
        why = "--no-gpu" if no_gpu else toolkit.device_available()[1]
        con.print(f"No timings ({escape(why)}). {untimed}")
    for w in result.get("warnings", []):
        con.print(f"[bold yellow]warning:[/bold yellow] {escape(w)}")


def _paged(cfg, hpbs, tensor_cores, arch, sms, use_gpu, no_gpu, timing_kw, json_out, err):
    """The paged step's sweep, rendered (sweep --batch / --serving)."""
    opts = dict(hpbs=hpbs, tensor_cores=tensor_cores, arch=arch, num_sms=sms, use_gpu=use_gpu,
                timing_kw=timing_kw)
    _run_and_show(lambda **kw: _run_paged_sweep(cfg, **opts, **kw),
                  len(hpbs) + 3 * tensor_cores, use_gpu, no_gpu, json_out, err,
                  paged_sweep_table, "Registers, spills and blocks/SM are properties of the "
                  "compile, and the chunk plan follows from them.")
