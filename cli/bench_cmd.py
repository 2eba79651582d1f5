"""`mlasandbox bench`: the timed depth curve (mlasandbox.bench), on a GPU.

With no arguments: the lecture preset (96 heads, f16 cache), contexts 64 .. 131072, every
variant and the cuBLAS engine; a progress bar on stderr, then the tables on stdout. Files:
`--json FILE`, `--csv FILE`, `--plot FILE.png`; `--vs BASELINE.json` compares with a saved
run. Without a GPU it hands over to the command it replaces (cli/main.py's `bench`), which
says so and shows what runs there; `--explain` prints the byte/FLOP formulas either way.

Exit status: 0, or 1 when a variant fails its correctness check (its timings are not
results) or a requested output could not be written; 2 on bad input.
"""
from __future__ import annotations

import click
from rich.markup import escape

from mlasandbox import registry
from mlasandbox.bench_config import DEFAULT_CONTEXTS
from mlasandbox.dims import PRESETS

from . import render
from .lab_options import (auto_or_int, int_list, json_option, progress_bar, stderr_console,
                          str_list, write_json)

__all__ = ["bench", "set_no_gpu_fallback"]

_no_gpu_fallback: dict = {"command": None}


def set_no_gpu_fallback(command) -> None:
    """The command to run where there is no GPU (main.py's original `bench`)."""
    _no_gpu_fallback["command"] = command


def _explain_costs(cfg, plans: dict | None):
    """PhaseCosts at the longest context: exact split counts from a run's plans, else from
    the launcher's rule with the occupancy model's blocks/SM (sm_90, 132 SMs)."""
    from mlasandbox import metrics
    from mlasandbox.bench_config import q_dtype_of

    n = max(cfg.contexts)
    cache = cfg.cache_dtypes[0]
    qd = q_dtype_of(cfg.q_dtype, cache)
    costs = [metrics.q_absorb_cost(cfg.dims, cache, qd)]
    for v in cfg.variants:
        var = registry.variant(v)
        s = 1
        if plans is not None:
            p = plans.get((v, n, cache))
            s = (p or {}).get("splits") or 1
        elif var.is_cuda:
            from mlasandbox.geometry import theoretical_blocks_per_sm
            from mlasandbox.splits import default_gate, plan_splits

            try:
                bps = theoretical_blocks_per_sm(var, cache, qd)["blocks_per_sm"]
                s = plan_splits(n, cfg.dims.n_head, var.hpb, num_sms=132,
                                blocks_per_sm=max(1, bps), split=var.splits,
                                splits=None if cfg.splits == "auto" else cfg.splits,
                                min_ctx=default_gate(var.hpb, cfg.min_ctx),
                                tile=registry.attention_instance(var, cache, qd).tile_rows).splits
            except Exception:  # no compiler: show the unsplit formulas
                s = 1
        costs.append(metrics.attn_cost(v, cfg.dims, n, cache, qd, s))
        c = metrics.combine_cost(v, cfg.dims, cache, s)
        if c is not None:
            costs.append(c)
    return costs


def _write_outputs(result, json_out, csv_out, plot_out, err) -> list[str]:
    from mlasandbox.bench import write_csv

    problems = []
    if json_out and json_out != "-":
        write_json(result, json_out)
        err.print(f"wrote {escape(str(json_out))}")
    if csv_out:
        write_csv(result, csv_out)
        err.print(f"wrote {escape(str(csv_out))}")
    if plot_out:
        from mlasandbox.plot import PlotUnavailable, plot_depth

        try:
            plot_depth(result, plot_out)
            err.print(f"wrote {escape(str(plot_out))}")
        except PlotUnavailable as exc:
            problems.append(str(exc))
    return problems


def _render(result, details, cmp):
    from . import lab_render

    con = render.console()
    cfg = result["config"]
    for cache in cfg["cache_dtypes"]:
        con.print(lab_render.depth_table(result, cache))
        ctxs = cfg["contexts"] if details else sorted({min(cfg["contexts"]),
                                                      max(cfg["contexts"])})
        for n in ctxs:
            con.print(lab_render.phase_table(result, n, cache))
    if result["checks"] and (details or not all(c["ok"] for c in result["checks"])):
        con.print(lab_render.checks_table(result))
    elif result["checks"]:
        worst = max((c.get("latent_relL2") or 0.0) for c in result["checks"])
        con.print(f"correctness: every variant matches the float64 reference at n_ctx "
                  f"{result['checks'][0]['n_ctx']} ({result['checks'][0]['heads']} heads; worst "
                  f"latent relL2 {worst:.1e}; --details for the table)")
    con.print(lab_render.summary_table(result))
    if cmp is not None:
        con.print(lab_render.vs_table(cmp))
        for w in cmp["warnings"]:
            con.print(f"[yellow]vs baseline:[/yellow] {escape(w)}")
    for w in result["warnings"]:
        con.print(f"[bold yellow]warning:[/bold yellow] {escape(w)}")


@click.command("bench")
@click.option("--preset", type=click.Choice(sorted(PRESETS)), default="lecture",
              show_default=True, help="Head dims preset.")
@click.option("--heads", type=click.IntRange(min=1), default=None,
              help="Query heads (overrides the preset's).")
@click.option("--ctx", "contexts", callback=int_list,
              default=",".join(map(str, DEFAULT_CONTEXTS)), show_default=True,
              help="Context lengths, comma-separated.")
@click.option("--variants", callback=str_list(tuple(registry.variant_names())), default=None,
              help="Variants, comma-separated (default: all, the cuBLAS engine included).")
@click.option("--hpb", "hpbs", callback=int_list, default=None,
              help="Heads-per-block values of the batched family to run (1 is split).")
@click.option("--cache", "caches", callback=str_list(("f16", "bf16")), default="f16",
              show_default=True, help="Cache dtypes, comma-separated.")
@click.option("--q", "q_dtype", type=click.Choice(["f32", "cache"]), default="f32",
              show_default=True, help="q dtype: f32 or the cache dtype.")
@click.option("--splits", callback=auto_or_int, default="auto", show_default=True,
              help="'auto' (the split rule) or S for split/batched.")
@click.option("--repeats", type=click.IntRange(min=1), default=100, show_default=True,
              help="Most timed runs per measurement.")
@click.option("--min-repeats", type=click.IntRange(min=1), default=10, show_default=True,
              help="Fewest timed runs per measurement (long phases stop here).")
@click.option("--target-ms", type=click.FloatRange(min=0.1), default=150.0, show_default=True,
              help="GPU time each measurement aims for (sets the runs between the two).")
@click.option("--warmup", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--graph", type=click.Choice(["auto", "always", "never"]), default="auto",
              show_default=True,
              help="CUDA-graph replay: auto = at n_ctx <= --graph-max-ctx (short contexts).")
@click.option("--graph-max-ctx", type=click.IntRange(min=1), default=4096, show_default=True)
@click.option("--aa-ctx", type=click.IntRange(min=1), default=None,
              help="A/A context, below the split gate (default: gate - 1 = 4095).")
@click.option("--aa-rounds", type=click.IntRange(min=2), default=10, show_default=True)
@click.option("--check/--no-check", default=True, show_default=True,
              help="Correctness spot check of every variant before timing.")
@click.option("--check-ctx", type=click.IntRange(min=1), default=20000, show_default=True)
@click.option("--check-heads", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--budget-s", type=click.FloatRange(min=1), default=480.0, show_default=True,
              help="Time budget of the timed work; the per-measurement target shrinks to fit.")
@json_option
@click.option("--csv", "csv_out", type=click.Path(dir_okay=False), default=None,
              help="Write the rows as CSV.")
@click.option("--plot", "plot_out", type=click.Path(dir_okay=False), default=None,
              help="Draw the depth curves (log-log) into FILE.png (needs matplotlib).")
@click.option("--vs", "vs_path", type=click.Path(dir_okay=False), default=None,
              help="Compare with a saved run (a --json FILE of an earlier bench).")
@click.option("--explain", is_flag=True, help="Print the byte and FLOP formulas.")
@click.option("--details", is_flag=True, help="Phase tables at every context, checks table.")
@click.option("--arch", default="sm_90", show_default=True,
              help="Arch for the register table when there is no GPU.")
@click.option("--require-gpu", is_flag=True, help="Exit 1 when there is no GPU to time on.")
@click.pass_context
def bench(ctx, preset, heads, contexts, variants, hpbs, caches, q_dtype, splits, repeats,
          min_repeats, target_ms, warmup, seed, graph, graph_max_ctx, aa_ctx, aa_rounds, check,
          check_ctx, check_heads, budget_s, json_out, csv_out, plot_out, vs_path, explain,
          details, arch, require_gpu):
    """Time every variant over a depth curve, with the noise floor and the control phase.

    On a GPU: ceilings, a correctness spot check, the A/A noise floor, then q_absorb / attn /
    combine / step per variant and context. Without one: says so and shows what runs there.
    """
    from mlasandbox import toolkit
    from mlasandbox.bench_config import make_config

    as_json = json_out == "-"
    try:
        cfg = make_config(preset=preset, heads=heads, contexts=contexts, variants=variants,
                          hpbs=hpbs, cache_dtypes=caches, q_dtype=q_dtype, splits=splits,
                          max_repeats=repeats, min_repeats=min_repeats, target_ms=target_ms,
                          warmup=warmup, seed=seed, graph=graph, graph_max_ctx=graph_max_ctx,
                          aa_ctx=aa_ctx, aa_rounds=aa_rounds, check=check, check_ctx=check_ctx,
                          check_heads=check_heads, budget_s=budget_s)
    except ValueError as exc:
        if as_json:
            render.emit_json({"ok": False, "error": str(exc)})
        raise click.UsageError(str(exc)) from None
    baseline = None
    if vs_path:
        from mlasandbox.baseline import SchemaError, load_result

        try:
            baseline = load_result(vs_path)
        except SchemaError as exc:
            if as_json:
                render.emit_json({"ok": False, "error": str(exc)})
            raise click.UsageError(str(exc)) from None
    err = stderr_console()

    has_gpu, why = toolkit.device_available()
    if not has_gpu:
        if explain and not as_json:
            from .lab_render import explain_text

            render.console().print(explain_text(_explain_costs(cfg, None)), markup=False)
        if json_out not in (None, "-") or csv_out or plot_out or vs_path:
            err.print("[yellow]no GPU: no timings, so --json FILE / --csv / --plot / --vs "
                      "produce nothing[/yellow]")
        fallback = _no_gpu_fallback["command"]
        if fallback is None:
            from . import main as main_module

            fallback = main_module.bench
        ctx.invoke(fallback, arch=arch, require_gpu=require_gpu, as_json=as_json)
        return

    from mlasandbox.bench_config import plan_work

    from . import main as main_module

    with progress_bar(err) as bar:
        task = bar.add_task("bench", total=len(plan_work(cfg)))

        def progress(label, advance=1):
            bar.update(task, advance=advance, description=label)

        result = main_module._run_gpu_bench(config=cfg, progress=progress,
                                            log=lambda text: bar.console.print(escape(text)),
                                            as_json=as_json)
    if not isinstance(result, dict) or "rows" not in result:
        # Not a bench result (a stand-in run_bench): print what came back, nothing else.
        if as_json and result is not None:
            render.emit_json(result)
        return
    cmp = None
    if baseline is not None:
        from mlasandbox.baseline import compare_runs

        cmp = compare_runs(result, baseline)
        result["vs"] = {"baseline": vs_path, **cmp}
    problems = _write_outputs(result, json_out, csv_out, plot_out, err)
    if as_json:
        render.emit_json(result)
    else:
        if explain:
            from .lab_render import explain_text

            plans = {(p["variant"], p["n_ctx"], p["cache"]): p for p in result["plans"]}
            render.console().print(explain_text(_explain_costs(cfg, plans)), markup=False)
        _render(result, details, cmp)
    for p in problems:
        err.print(f"[red]problem:[/red] {escape(p)}")
    if not result["ok"] or problems:
        raise SystemExit(1)
