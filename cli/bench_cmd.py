"""`mlasandbox bench`: the timed depth curve (mlasandbox.bench) on a GPU, and what runs
without one.

With no arguments: the 96-head preset (`h96`, f16 cache), contexts 64 .. 131072, every
variant and the cuBLAS engine; a progress bar on stderr, then the tables on stdout. Files:
`--json FILE`, `--csv FILE`, `--plot FILE.png`; `--vs BASELINE.json` compares with a saved
run. Without a GPU: says so, shows the compile-side tables (registers, occupancy) and the
schedule model's accuracy, and `--json FILE` writes them; `--csv`, `--plot` and `--vs` need
timings and exit 2 saying so, before any work. `--explain` prints the byte/FLOP formulas
either way.

With `--batch B` (or `--serving PRESET`): one serving step instead, B requests of `--lengths`
in a paged cache (`--page-size`, `--s-q`, `--causal`), per variant (default mma16, mma32,
split, batched16) and per `--peers` implementation: step µs, tokens/s, GB/s, TFLOP/s against
the ceilings, the CUDA-graph replay of the whole step, the A/A floor and the control phase.
Without a GPU: the chunk plan of the batch per variant. `--variants auto` is the paged API's
default, resolved for the batch on this device (sm_90 without one) and said: "auto ->
wgmma64: why", rows "auto (wgmma64)"; the batch-1 depth bench refuses it (exit 2).

Exit status: 0, or 1 when a variant fails its correctness check (its timings are not
results) or a requested output could not be written; 2 on bad input.
"""
from __future__ import annotations

import csv

import click
from rich import box
from rich.markup import escape

from mlasandbox import limits, metrics, registry, toolkit
from mlasandbox.baseline import SchemaError, compare_runs, load_result
from mlasandbox.bench import run_bench, write_csv
from mlasandbox.bench_config import DEFAULT_CONTEXTS, make_config, plan_work, q_dtype_of
from mlasandbox.bench_paged import (SERVING_PRESETS, make_paged_config, paged_work,
                                    plan_report, run_paged_bench, serving_help)
from mlasandbox.chunks import request_chunks
from mlasandbox.clocks import NO_CLOCKS, clock_cell, clocks_line
from mlasandbox.geometry import theoretical_blocks_per_sm
from mlasandbox.peers import PEER_NAMES
from mlasandbox.plot import PlotUnavailable, plot_depth
from mlasandbox.registry import HPB_VALUES
from mlasandbox.splits import default_gate, plan_splits

from . import lab_render, render
from .check_cmd import cpu_accuracy
from .options import (MAX_AA_ROUNDS, MAX_RUNS, FiniteFloatRange, NoGpu, arch_option, cache_option,
                      ctx_option, deliver_json, given_options, heads_option, hpb_list, json_option,
                      kernel_files, lengths_file, non_empty_path, output_option, paged_options,
                      peers_option, preset_option, progress_bar, q_option, refuse_overwrites,
                      refuse_paged_options, splits_option, stderr_console, timing_options,
                      variants_option, write_json)
from .regs_cmd import regs_rows
from .render import Column, FitTable, variant_label
from .tp_cmd import run_tp_cli, tp_engine_option, tp_option

__all__ = ["bench"]

BENCH_CTXS = (4096, 20000)  # what `bench` shows of the accuracy study where there is no GPU
HOW_TO_TIME = ("Timings need a CUDA GPU: run `mlasandbox bench` on a machine with one "
               "(an NVIDIA driver and a CuPy wheel matching it: cupy-cuda13x for CUDA 13 "
               "drivers, cupy-cuda12x for CUDA 12).")


def _run_gpu_bench(**opts):
    """Hook (tests replace it): the timed benchmark, mlasandbox.bench.run_bench."""

    return run_bench(**opts)


def _explain_costs(cfg, plans: dict | None):
    """PhaseCosts at the longest context: exact split counts from a run's plans, else from
    the launcher's rule with the occupancy model's blocks/SM (sm_90, 132 SMs)."""
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
    problems = []
    if json_out and json_out != "-":
        write_json(result, json_out)
        err.print(f"wrote {escape(str(json_out))}")
    if csv_out:
        try:
            write_csv(result, csv_out)
            err.print(f"wrote {escape(str(csv_out))}")
        except OSError as exc:
            problems.append(f"could not write {csv_out}: {exc.strerror}")
    if plot_out:
        try:
            plot_depth(result, plot_out)
            err.print(f"wrote {escape(str(plot_out))}")
        except PlotUnavailable as exc:
            problems.append(str(exc))
    return problems


def _floor_table(result: dict, cache: str) -> FitTable | None:
    """Per variant and context: the step (q_absorb + attn + combine) against its launch
    floor, a graph of the same launches with empty kernels. None where no floor was timed."""
    by = {(r["variant"], r["n_ctx"], r["phase"]): r for r in result["rows"]
          if r["cache"] == cache and r["phase"] in ("step", "floor")}
    cells = []
    for (v, n, ph), fl in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        st = by.get((v, n, "step"))
        if ph != "floor" or st is None:
            continue
        cells.append((v, str(n), f"{st['median_us']:,.1f}", f"{fl['median_us']:,.1f}",
                      f"{st['median_us'] - fl['median_us']:,.1f}", st["mode"]))
    if not cells:
        return None
    columns = (Column("variant"), Column("n_ctx", "right"), Column("step us", "right"),
               Column("floor us", "right"), Column("step - floor", "right"),
               Column("step mode", drop=1))
    return FitTable(columns, cells, title=f"launch floor, cache {cache}: the step's launches "
                    "(same grids and blocks) with empty kernels, as a CUDA graph",
                    title_justify="left", box=box.SIMPLE_HEAD)


def _render(result, details, cmp):
    con = render.console()
    cfg = result["config"]
    for cache in cfg["cache_dtypes"]:
        con.print(lab_render.depth_table(result, cache))
        ctxs = cfg["contexts"] if details else sorted({min(cfg["contexts"]),
                                                      max(cfg["contexts"])})
        for n in ctxs:
            con.print(lab_render.phase_table(result, n, cache))
        floor = _floor_table(result, cache)
        if floor is not None:
            con.print(floor)
    if result["checks"] and (details or not all(c["ok"] for c in result["checks"])):
        con.print(lab_render.checks_table(result))
    elif result["checks"]:
        worst = max((c.get("latent_relL2") or 0.0) for c in result["checks"])
        con.print(f"correctness: every variant matches the float64 reference at n_ctx "
                  f"{result['checks'][0]['n_ctx']} ({result['checks'][0]['heads']} heads; worst "
                  f"latent relL2 {worst:.1e}; --details for the table)")
    con.print(lab_render.summary_table(result))
    if line := clocks_line(result):
        con.print(escape(line))
    if cmp is not None:
        con.print(lab_render.vs_table(cmp))
        for w in cmp["warnings"]:
            con.print(f"[yellow]vs baseline:[/yellow] {escape(w)}")
    for w in result["warnings"]:
        con.print(f"[bold yellow]warning:[/bold yellow] {escape(w)}")


def _refuse(opts: list[str], one: str, several: str) -> None:
    """click.UsageError: the options `opts`, then `one` (one option) or `several`."""
    if opts:
        raise click.UsageError(f"{', '.join(opts)} {one if len(opts) == 1 else several}")


# What the tensor-parallel bench does not use: it times the sharded step with --warmup and
# --repeats on every rank, always checks its output, and writes no file but --json.
TP_IGNORED = ("csv_out", "explain", "peers", "min_repeats", "target_ms", "graph", "aa_rounds",
              "check", "check_heads")


def _paged_bench(o: dict):
    """The paged branch of `bench`: options validated here, the run in paged_bench_view."""
    ctx = click.get_current_context()
    _refuse(given_options(ctx, ("contexts", "hpbs", "aa_ctx", "graph_max_ctx", "check_ctx",
                                "vs_path", "plot_out", "budget_s", "details", "arch")),
            "belongs to the depth bench, not the paged step (--batch)",
            "belong to the depth bench, not the paged step (--batch)")
    if o["tp"] is not None:
        tp_does = ("the tensor-parallel bench (--tp) times every rank with --warmup and "
                   "--repeats, always checks its output, and writes no file but --json")
        _refuse(given_options(ctx, TP_IGNORED), f"is not taken with --tp: {tp_does}",
                f"are not taken with --tp: {tp_does}")
    if len(o["caches"]) != 1:
        raise click.UsageError("the paged step takes one --cache dtype")
    preset = o["preset"] if ctx.get_parameter_source("preset") == \
        click.core.ParameterSource.COMMANDLINE else "dsv3"
    try:
        cfg = make_paged_config(
            batch=o["batch"], lengths=o["lengths_spec"], s_q=o["s_q"], causal=o["causal"],
            page_size=o["page_size"], serving=o["serving"], preset=preset, heads=o["heads"],
            variants=o["variants"] or (("auto",) if o["tp"] else None), peers=o["peers"],
            cache_dtype=o["caches"][0],
            q_dtype="cache" if ctx.get_parameter_source("q_dtype") != \
            click.core.ParameterSource.COMMANDLINE else o["q_dtype"],
            splits=o["splits"], seed=o["seed"], max_repeats=o["repeats"],
            min_repeats=o["min_repeats"], target_ms=o["target_ms"], warmup=o["warmup"],
            graph=o["graph"] != "never", aa_rounds=o["aa_rounds"], check=o["check"],
            check_heads=o["check_heads"])
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if o["tp"] is not None:
        repeats = o["repeats"] if ctx.get_parameter_source("repeats") == \
            click.core.ParameterSource.COMMANDLINE else 20
        return run_tp_cli(cfg, o["tp"], engine=o["tp_engine"], repeats=repeats,
                          json_out=o["json_out"], require_gpu=o["require_gpu"])
    run_paged_cli(cfg, json_out=o["json_out"], csv_out=o["csv_out"], explain=o["explain"],
                  require_gpu=o["require_gpu"], run=_run_paged_bench)


def _run_paged_bench(**opts):
    """Hook (tests replace it): the timed paged bench, mlasandbox.bench_paged.run_paged_bench."""
    return run_paged_bench(**opts)


PAGED_CSV_COLUMNS = ("variant", "kind", "phase", "cache", "q", "median_us", "p10_us", "p90_us",
                     "mad_us", "n", "mode", "tokens_per_s", "flops", "ideal_bytes",
                     "issued_bytes", "GBps_ideal", "frac_copy_ideal", "TFLOPs", "roof",
                     "frac_roof", "max_chunks", "control_label", "check_ok", "asked",
                     *NO_CLOCKS)


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def _waves(waves) -> str:
    """'2 of 2' or '1 of 2' where the grid offers a second wave, '1' where it does not."""
    taken, offered = waves
    return f"{taken} of {offered}" if offered > 1 else str(taken)


def _paged_plan_table(rep: dict) -> FitTable:
    """The chunk plan of each variant; at a narrow console the derived columns go first."""
    columns = (Column("variant"), Column("rows/block", "right", drop=3),
               Column("tile", "right", drop=2), Column("grid"), Column("chunks/request", "right"),
               Column("programs run", "right"), Column("waves", "right", drop=7),
               Column("merge", drop=6, fold=True),
               Column("FLOPs", "right", drop=4),
               Column("bytes (ideal)", "right", drop=5), Column("how", drop=1, fold=True))
    cells = [(variant_label(r), str(r["rows_per_block"]), str(r["tile"]), str(tuple(r["grid"])),
              f"{r['chunks_min']}..{r['chunks_max']}", f"{r['programs_run']} of {r['programs']}",
              _waves(r["waves"]), r["merge"], f"{r['flops']:.3e}",
              f"{r['ideal_bytes'] / 1e6:,.1f} MB",
              escape(r["blocks_per_sm"])) for r in rep["plans"]]
    return FitTable(columns, cells,
                    title=f"chunk plans: B={rep['batch']}, lengths {rep['lengths']['spec']} "
                          f"(min {rep['lengths']['min']}, mean {rep['lengths']['mean']:.0f}, max "
                          f"{rep['lengths']['max']}), H={rep['heads']}, s_q={rep['s_q']}"
                          f"{' causal' if rep['causal'] else ''}, page {rep['page_size']}, "
                          f"{rep['num_sms']} SMs")


def _paged_table(result: dict) -> FitTable:
    """Per variant and phase; at a narrow console the spread, fractions and mode go first,
    never the time."""
    cfg = result["config"]
    columns = (Column("variant"), Column("phase"), Column("median us", "right"),
               Column("p10..p90", "right", drop=3), Column("tokens/s", "right", drop=7),
               Column("GB/s", "right"), Column("of copy", "right", drop=5),
               Column("TFLOP/s", "right", drop=6), Column("of roof", "right", drop=4),
               Column("SM MHz", "right", drop=2), Column("mode", drop=1), Column("check"))
    cells = []
    for r in result["rows"]:
        if r["variant"] == "-":
            continue
        cells.append((variant_label(r) + (" (peer)" if r["kind"] == "peer" else ""), r["phase"],
                      f"{r['median_us']:,.1f}", f"{r['p10_us']:,.1f}..{r['p90_us']:,.1f}",
                      _fmt(r.get("tokens_per_s"), ",.0f"), _fmt(r.get("GBps_ideal"), ",.0f"),
                      _fmt(r.get("frac_copy_ideal"), ".0%"), _fmt(r.get("TFLOPs"), ",.1f"),
                      (_fmt(r.get("frac_roof"), ".0%") + f" {r.get('roof')}")
                      if r.get("frac_roof") is not None else "-", clock_cell(r), r["mode"],
                      {True: "ok", False: "[red]FAIL[/red]", None: "-"}[r["check_ok"]]))
    return FitTable(columns, cells,
                    title=f"paged step: B={cfg['batch']}, lengths {cfg['lengths_spec']}, "
                          f"H={cfg['dims']['n_head']}, s_q={cfg['s_q']}"
                          f"{' causal' if cfg['causal'] else ''}, page {cfg['page_size']}, cache "
                          f"{cfg['cache_dtype']}")


def _auto_line(pick: dict, device: str = "") -> str:
    """What `auto` resolved to on `device` (the pick's arch if not given) and why; the variant
    it names runs once, asked by name too or not."""
    also = (f"; {pick['variant']} was asked by name too: it runs once"
            if pick["also_asked"] else "")
    return f"auto -> {pick['variant']} on {device or pick['arch']}: {pick['why']}{also}"


def run_paged_cli(cfg, *, json_out, csv_out, explain, require_gpu, run) -> None:
    """The paged bench from the CLI: the run on a GPU, the chunk plans without one."""
    as_json = json_out == "-"
    err, con = stderr_console(), render.console()
    has_gpu, why = toolkit.device_available()
    if not has_gpu:
        if csv_out:
            raise NoGpu(f"--csv needs timings, and there is no GPU here ({why}); "
                        "--json FILE writes what runs without one")
        rep = plan_report(cfg)
        data = {"ok": not rep["problems"] and not require_gpu, "device": None,
                "no_device_reason": why, "timings": None, "how_to_time": HOW_TO_TIME,
                "config": cfg.as_dict(), "plan": rep, "problems": rep["problems"]}
        if explain and not as_json:
            con.print(lab_render.explain_text([_paged_cost(cfg, rep)]), markup=False)
        if not deliver_json(data, json_out, err):
            con.print(f"[bold]No GPU here, so no timings of the paged step.[/bold] "
                      f"{escape(why)}")
            if rep["auto"]:
                pick = rep["auto"]
                con.print(escape(_auto_line(pick, f"{pick['arch']}, the H200 the plans model")))
            con.print(_paged_plan_table(rep))
            if cfg.peers:
                con.print(f"peers {', '.join(cfg.peers)}: loaded and timed on a GPU only")
            for p in rep["problems"]:
                con.print(f"[red]problem:[/red] {escape(p)}")
            con.print(HOW_TO_TIME)
        if rep["problems"]:
            raise SystemExit(1)
        if require_gpu:
            raise NoGpu(f"--require-gpu: {why}")
        return
    with progress_bar(err) as bar:
        task = bar.add_task("bench", total=paged_work(cfg))
        result = run(config=cfg, progress=lambda label, advance=1: bar.update(
            task, advance=advance, description=label),
            log=lambda text: bar.console.print(escape(text)))
    problems = []
    if csv_out:
        try:
            _write_paged_csv(result, csv_out)
            err.print(f"wrote {escape(str(csv_out))}")
        except OSError as exc:
            problems.append(f"could not write {csv_out}: {exc.strerror}")
    if not deliver_json(result, json_out, err):
        if explain:
            plans = {"plans": list(result["plans"].values())}
            con.print(lab_render.explain_text([_paged_cost(cfg, plans)]), markup=False)
        if result["auto"]:
            con.print(escape(_auto_line(result["auto"])))
        con.print(_paged_table(result))
        if line := clocks_line(result):
            con.print(escape(line))
        nf = result["noise_floor"]
        con.print(f"A/A floor: {_fmt(nf['floor'], '.1%')} ({escape(nf['how'])})")
        if result["fastest"]:
            f = result["fastest"]
            con.print(f"fastest step: {variant_label(f)} ({f['phase']}, {f['median_us']:,.1f} us)"
                      + (f"; within the floor: {', '.join(f['ties'])}" if f["ties"] else ""))
        if result.get("like_for_like"):
            f = result["like_for_like"]
            con.print(f"same work as the peers (latent and lse, no wv_b): fastest "
                      f"{f['variant']} ({f['median_us']:,.1f} us)"
                      + (f"; within the floor: {', '.join(f['ties'])}" if f["ties"] else ""))
        for c in result["checks"]:
            if not c["ok"]:
                con.print(f"[red]check {escape(c['variant'])}:[/red] {escape(c['detail'])}")
        for w in result["warnings"]:
            con.print(f"[bold yellow]warning:[/bold yellow] {escape(w)}")
    for p in problems:
        err.print(f"[red]problem:[/red] {escape(p)}")
    if not result["ok"] or problems:
        raise SystemExit(1)


def _paged_cost(cfg, rep):
    """The formulas of the first variant's step at the plan's chunk counts (--explain)."""
    p = rep["plans"][0] if rep["plans"] else None
    n_chunks = None
    if p is not None:
        n_chunks, _ = request_chunks(cfg.lengths, p["max_chunks"], p["tile"], p["min_chunk"],
                                     p["target"])
    name = (p or {}).get("variant", cfg.variants[0])   # the plan's: what auto resolved to
    return metrics.paged_step_cost(name, cfg.dims, cfg.lengths, cfg.s_q, cfg.causal,
                                   cfg.cache_dtype, q_dtype_of(cfg.q_dtype, cfg.cache_dtype),
                                   n_chunks, p["grid"][0] if p else 1)


def _write_paged_csv(result, path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=PAGED_CSV_COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in result["rows"]:
            w.writerow({k: "" if r.get(k) is None else r[k] for k in PAGED_CSV_COLUMNS})


def no_gpu_report(arch: str, why: str) -> dict:
    """What `bench` shows where there is no GPU: the register table and the schedule model's
    accuracy at two contexts, with the problems met producing them."""
    data: dict = {"ok": True, "device": None, "no_device_reason": why, "timings": None,
                  "how_to_time": HOW_TO_TIME, "regs": None, "accuracy": None, "problems": []}
    try:
        data["regs"] = {"arch": arch, "rows": regs_rows(arch, HPB_VALUES, ("f16", "bf16"),
                                                        ("f32",), False)}
    except Exception as exc:  # a missing toolkit: say so, show the rest
        data["problems"].append(f"register report: {exc}")
    try:
        rows, verdict = cpu_accuracy(BENCH_CTXS, 1, "auto")
        data["accuracy"] = {"rows": rows, **verdict}
        data["problems"] += [f"schedule-model accuracy: {p}" for p in verdict["problems"]]
    except Exception as exc:
        data["problems"].append(f"schedule-model accuracy: {exc}")
    data["ok"] = not data["problems"]
    return data


def _print_no_gpu(data, arch, why) -> None:
    con = render.console()
    con.print(f"[bold]No GPU here, so no timings.[/bold] {escape(why)}")
    con.print("What runs without one:")
    if data["regs"]:
        con.print(render.regs_table(data["regs"]["rows"], arch))
    if data["accuracy"]:
        con.print(render.accuracy_table(
            data["accuracy"]["rows"],
            "schedule model accuracy, relL2(latent) vs float64 (full study: mlasandbox check)"))
    for p in data["problems"]:
        con.print(f"[red]problem:[/red] {escape(p)}")
    con.print(HOW_TO_TIME)


@click.command("bench")
@preset_option()
@heads_option()
@ctx_option(DEFAULT_CONTEXTS, dest="contexts")
@variants_option(help="Variants, comma-separated (default: all, the cuBLAS engine included); "
                 "with --batch also auto (the paged step's choice for the batch on this "
                 "device) and user kernels, FILE.cu (docs/byok.md).", user_kernels=True,
                 auto=True)
@click.option("--hpb", "hpbs", callback=hpb_list, default=None,
              help="Heads-per-block values of the batched family to run (1 is split): "
                   "alone, the family narrowed to them; with --variants, added to those.")
@cache_option(multiple=True)
@q_option()
@splits_option(help="'auto' (the split rule) or S (1..65535; with --batch, every request's "
               "chunk cap, 1..256) for the splitting variants.")
@timing_options(target_ms=150.0)
@click.option("--warmup", type=click.IntRange(1, MAX_RUNS), default=3, show_default=True,
              help="Untimed runs before each measurement.")
@click.option("--graph", type=click.Choice(["auto", "always", "never"]), default="auto",
              show_default=True,
              help="CUDA-graph replay: auto = at n_ctx <= --graph-max-ctx (short contexts).")
@click.option("--graph-max-ctx", type=click.IntRange(min=1), default=4096, show_default=True,
              help="Longest context replayed as a CUDA graph under --graph auto.")
@click.option("--aa-ctx", type=click.IntRange(min=1), default=None,
              help="A/A context, below the split gate (default: gate - 1 = 4095).")
@click.option("--aa-rounds", type=click.IntRange(2, MAX_AA_ROUNDS), default=10, show_default=True,
              help="Interleaved rounds of the A/A noise-floor measurement.")
@click.option("--check/--no-check", default=True, show_default=True,
              help="Correctness spot check of every variant before timing.")
@click.option("--check-ctx", type=click.IntRange(1, limits.MAX_CTX), default=20000,
              show_default=True, help="Context of the correctness spot check.")
@click.option("--check-heads", type=click.IntRange(1, limits.MAX_HEADS), default=16,
              show_default=True,
              help="Heads of the correctness spot check.")
@click.option("--budget-s", type=FiniteFloatRange(min=1), default=480.0, show_default=True,
              help="Time budget of the timed work; the per-measurement target shrinks to fit.")
@json_option
@output_option("--csv", dest="csv_out", help="Write the timed rows as CSV (needs a GPU).")
@output_option("--plot", dest="plot_out",
               help="Draw the depth curves (log-log) into FILE.png (needs a GPU and "
                    "matplotlib).")
@click.option("--vs", "vs_path", type=click.Path(dir_okay=False), default=None,
              callback=non_empty_path,
              help="Compare with a saved run (a --json FILE of an earlier bench).")
@click.option("--explain", is_flag=True, help="Print the byte and FLOP formulas.")
@click.option("--details", is_flag=True, help="Phase tables at every context, checks table.")
@arch_option("Arch of the register table when there is no GPU.")
@click.option("--require-gpu", is_flag=True, help="Exit 2 when there is no GPU to time on.")
@paged_options(SERVING_PRESETS, serving_help())
@peers_option(PEER_NAMES)
@tp_option("Shard the paged step's heads over N GPUs, one rank each (uneven bands when N "
           "does not divide the heads); times every rank against TP 1. Needs --batch.")
@tp_engine_option()
def bench(preset, heads, contexts, variants, hpbs, caches, q_dtype, splits, repeats,
          min_repeats, target_ms, warmup, seed, graph, graph_max_ctx, aa_ctx, aa_rounds, check,
          check_ctx, check_heads, budget_s, json_out, csv_out, plot_out, vs_path, explain,
          details, arch, require_gpu, batch, lengths_spec, page_size, s_q, causal, serving,
          peers, tp, tp_engine):
    """Time every variant over a depth curve, with the noise floor and the control phase.

    On a GPU: ceilings, a correctness spot check, the A/A noise floor, then q_absorb / attn /
    combine / step per variant and context. Without one: says so and shows what runs there.

    With --batch B or --serving PRESET: one paged serving step per variant and peer instead
    (--lengths, --page-size, --s-q, --causal; presets: b128-4k-h128, b128-4k-h128-mtp2,
    b128-4k-h16, b32-8k-var-h16, b8-32k-var-h128; --preset dsv3 heads unless set).
    """
    as_json = json_out == "-"
    paged = batch is not None or serving is not None
    ctx = click.get_current_context()
    kernels = [v for v in variants or () if v.split(":", 1)[0].endswith(".cu")]
    refuse_overwrites([("--lengths", lengths_file(lengths_spec)), ("--vs", vs_path),
                       *(f for k in kernels for f in kernel_files("--variants", k))],
                      [("--json", json_out), ("--csv", csv_out), ("--plot", plot_out)])
    if tp is None:
        _refuse(given_options(ctx, ("tp_engine",)), "needs --tp N (the tensor-parallel bench)", "")
    if not paged:
        refuse_paged_options(lengths_spec, s_q, causal, also=[
            *(o for o, v in (("--peers", peers), ("--tp", tp)) if v is not None), *kernels])
        if "auto" in (variants or ()):
            raise click.BadParameter(
                "auto is the paged step's choice (mma16, mma32 or wgmma64 by the batch's rows "
                "and size): give --batch B or --serving PRESET to bench it, or name the "
                "variants of the depth bench", param_hint="'--variants'")
        if variants and hpbs:
            variants = tuple(dict.fromkeys((*variants,
                                            *(registry.variant_for_hpb(h) for h in hpbs))))
            hpbs = None
    else:
        return _paged_bench(locals())
    try:
        cfg = make_config(preset=preset, heads=heads, contexts=contexts, variants=variants,
                          hpbs=hpbs, cache_dtypes=caches, q_dtype=q_dtype, splits=splits,
                          max_repeats=repeats, min_repeats=min_repeats, target_ms=target_ms,
                          warmup=warmup, seed=seed, graph=graph, graph_max_ctx=graph_max_ctx,
                          aa_ctx=aa_ctx, aa_rounds=aa_rounds, check=check, check_ctx=check_ctx,
                          check_heads=check_heads, budget_s=budget_s)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    baseline = None
    if vs_path:
        try:
            baseline = load_result(vs_path)
        except SchemaError as exc:
            raise click.UsageError(str(exc)) from None
    err = stderr_console()

    has_gpu, why = toolkit.device_available()
    if not has_gpu:
        wanted = [name for name, v in (("--csv", csv_out), ("--plot", plot_out),
                                       ("--vs", vs_path)) if v]
        if wanted:
            raise NoGpu(
                f"{' and '.join(wanted)} need{'s' if len(wanted) == 1 else ''} timings, and "
                f"there is no GPU here ({why}); --json FILE writes what runs without one")
        if explain and not as_json:
            render.console().print(lab_render.explain_text(_explain_costs(cfg, None)),
                                   markup=False)
        data = no_gpu_report(arch, why)
        if require_gpu:
            data["ok"] = False
        if as_json:
            render.emit_json(data)
        else:
            if json_out:
                write_json(data, json_out)
                err.print(f"wrote {escape(str(json_out))} (no timings: the compile-side tables "
                          "and the schedule model's accuracy)")
            _print_no_gpu(data, arch, why)
        if data["problems"]:
            raise SystemExit(1)
        if require_gpu:
            raise NoGpu(f"--require-gpu: {why}")
        return

    with progress_bar(err) as bar:
        task = bar.add_task("bench", total=len(plan_work(cfg)))

        def progress(label, advance=1):
            bar.update(task, advance=advance, description=label)

        result = _run_gpu_bench(config=cfg, progress=progress,
                                log=lambda text: bar.console.print(escape(text)),
                                as_json=as_json)
    cmp = None
    if baseline is not None:
        cmp = compare_runs(result, baseline)
        result["vs"] = {"baseline": vs_path, **cmp}
    problems = _write_outputs(result, json_out, csv_out, plot_out, err)
    if as_json:
        render.emit_json(result)
    else:
        if explain:
            plans = {(p["variant"], p["n_ctx"], p["cache"]): p for p in result["plans"]}
            render.console().print(lab_render.explain_text(_explain_costs(cfg, plans)),
                                   markup=False)
        _render(result, details, cmp)
    for p in problems:
        err.print(f"[red]problem:[/red] {escape(p)}")
    if not result["ok"] or problems:
        raise SystemExit(1)
