"""`--tp N` of `bench` (the paged step), `grid` and `repro`: tensor parallelism over heads.

bench: on N GPUs the TP bench (sandbox/tp_bench.py); with no GPU, every rank's chunk plan;
with fewer GPUs than N, exit 2 before any work. grid: each rank's batch-1 grid against the
SMs, with the band's split budget and the unsharded one. repro: the case of one rank's band.
"""
from __future__ import annotations

import click
from rich.markup import escape

from mlasandbox import toolkit
from mlasandbox.tp import check_tp, head_bands
from mlasandbox.tp_bench import TP_PHASES, run_tp_bench, tp_plan_report
from mlasandbox.tp_comm import visible_gpus

from . import render
from .options import NoGpu, deliver_json, progress_bar, stderr_console
from .render import Column, FitTable, variant_label

__all__ = ["tp_option", "tp_engine_option", "run_tp_cli", "grid_tp_table", "band_heads"]

HOW_TO_RUN = ("Tensor-parallel timings need N GPUs on one host: run `mlasandbox bench --tp N` "
              "there (NCCL through CuPy's nvidia-nccl-cu13 wheel or torch.distributed).")


def tp_option(help_text: str):
    return click.option("--tp", type=click.IntRange(min=1), default=None, metavar="N",
                        help=help_text)


def tp_engine_option():
    return click.option("--tp-engine", type=click.Choice(["auto", "cupy", "torch"]),
                        default="auto", show_default=True,
                        help="NCCL engine of --tp: cupyx.distributed, torch.distributed, or "
                             "auto (cupy where CuPy finds NCCL, else torch).")


def band_heads(tp: int, heads: int, rank: int | None) -> int:
    """The heads of rank `rank`'s band of `heads` over `tp` ranks (UsageError if bad)."""
    try:
        bands = head_bands(heads, check_tp(tp, heads))
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    r = 0 if rank is None else rank
    if not 0 <= r < tp:
        raise click.BadParameter(f"rank must be in 0..{tp - 1}, got {r}",
                                 param_hint="'--rank'")
    return bands[r].heads


def _plan_table(rep: dict) -> FitTable:
    columns = (Column("variant"), Column("budget"), Column("rank", "right"),
               Column("heads"), Column("head blocks", "right", drop=3), Column("grid"),
               Column("programs", "right", drop=2), Column("of slots", "right"),
               Column("how", drop=1, fold=True))
    cells = [(variant_label(r), r["budget"], str(r["rank"]),
              f"{r['heads'][0]}..{r['heads'][1] - 1}",
              str(r["head_blocks"]), str(tuple(r["grid"])), str(r["programs"]),
              f"{r['fill']:.0%}", escape(r["reason"])) for r in rep["ranks"]]
    return FitTable(columns, cells, title=f"TP {rep['tp']}: every rank's chunk plan, B="
                    f"{rep['batch']}, H={rep['heads']}, {rep['num_sms']} SMs")


def _result_table(result: dict) -> FitTable:
    columns = (Column("variant"), Column("TP", "right"), Column("budget"),
               *(Column(f"{p} us", "right", drop=None if p in ("attn", "step") else 2)
                 for p in TP_PHASES),
               Column("coll. share", "right", drop=3), Column("attn eff.", "right"),
               Column("step eff.", "right", drop=4))
    cells = []
    for v, vr in result["variants"].items():
        if "error" in vr:
            continue
        for key, s in vr["summary"].items():
            if "/" not in key:
                continue
            n, budget = key.split("/")
            slow = vr["runs"][n[2:]]["slowest"][budget]
            cells.append((v, n[2:], budget, *(
                "-" if p not in slow else f"{slow[p]['max_us']:,.1f}" for p in TP_PHASES),
                _pct(s["collective_share"]), _pct(s["attn_efficiency"]),
                _pct(s["step_efficiency"])))
    return FitTable(columns, cells, title=f"TP {result['tp']} ({result['engine']}): the "
                    "slowest rank's median per phase")


def _pct(x) -> str:
    return "-" if x is None else f"{x:.0%}"


def _exit_without_gpu(problems: bool, require_gpu: bool, why: str) -> None:
    """Exit 1 when the plans met a problem, 2 when --require-gpu was given; else return."""
    if problems:
        raise SystemExit(1)
    if require_gpu:
        raise NoGpu(f"--require-gpu: {why}")


def run_tp_cli(cfg, tp: int, *, engine: str, repeats: int, json_out, require_gpu) -> None:
    """`bench --batch B --tp N`: the run on N GPUs, the plans without a GPU."""
    try:
        check_tp(tp, cfg.dims.n_head)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    err, con = stderr_console(), render.console()
    has_gpu, why = toolkit.device_available()
    if not has_gpu:
        rep = tp_plan_report(cfg, tp)
        data = {"ok": not rep["problems"] and not require_gpu, "device": None,
                "no_device_reason": why, "timings": None, "how_to_run": HOW_TO_RUN,
                "config": cfg.as_dict(), "plan": rep, "problems": rep["problems"]}
        if not deliver_json(data, json_out, err):
            con.print(f"[bold]No GPU here, so no tensor-parallel timings.[/bold] {escape(why)}")
            con.print(_plan_table(rep))
            for p in rep["problems"]:
                con.print(f"[red]problem:[/red] {escape(p)}")
            con.print(HOW_TO_RUN)
        _exit_without_gpu(bool(rep["problems"]), require_gpu, why)
        return
    gpus = visible_gpus()
    try:
        check_tp(tp, cfg.dims.n_head, gpus)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    with progress_bar(err) as bar:
        task = bar.add_task("bench --tp", total=len(cfg.variants) * (1 + (tp > 1)))
        result = run_tp_bench(cfg, tp, engine=engine, repeats=repeats, gpus=gpus,
                              progress=lambda label, advance=1: bar.update(
                                  task, advance=advance, description=label))
    if not deliver_json(result, json_out, err):
        con.print(_result_table(result))
        for v, vr in result["variants"].items():
            if "error" in vr:
                e = vr["error"]
                con.print(f"[red]{escape(v)}: rank {e['rank']}, phase {e.get('phase')}:[/red] "
                          f"{escape(str(e['error']))}")
                continue
            c, s = vr["check"], vr["summary"]
            con.print(f"{escape(v)} check: {'ok' if c['ok'] else '[red]FAIL[/red]'} (out vs "
                      f"float64 relL2 {c.get('out_vs_reference_relL2', float('nan')):.1e}, vs "
                      f"TP 1 {c.get('out_vs_tp1_relL2') or 0:.1e}; y "
                      f"{'ok' if c.get('y', {}).get('ok', True) else 'FAIL'})")
            if s.get("budget_effect_attn") is not None:
                con.print(f"{escape(v)} budget: attention {s['budget_effect_attn']:+.1%} with "
                          "the chunks of the unsharded budget instead of the band's")
        for w in result["warnings"]:
            con.print(f"[bold yellow]warning:[/bold yellow] {escape(w)}")
    if not result["ok"]:
        raise SystemExit(1)


def grid_tp_table(rows: list, tp: int) -> FitTable:
    columns = (Column("rank", "right"), Column("heads"), Column("grid"),
               Column("blocks", "right"), Column("splits", "right"), Column("waves", "right"),
               Column("idle SMs", "right", drop=2), Column("unsharded grid", drop=3),
               Column("unsharded waves", "right", drop=1))
    cells = [(str(r["rank"]), f"{r['heads'][0]}..{r['heads'][1] - 1}",
              str(tuple(r["band"]["grid"])), str(r["band"]["blocks"]),
              str(r["band"]["splits"]), f"{r['band']['waves']:.2f}",
              str(r["band"]["idle_sms"]), str(tuple(r["unsharded"]["grid"])),
              f"{r['unsharded']['waves']:.2f}") for r in rows]
    g = rows[0]["band"]
    return FitTable(columns, cells, title=f"TP {tp}: {g['variant']} per rank at n_ctx "
                    f"{g['n_ctx']}, {g['num_sms']} SMs x {g['blocks_per_sm']} blocks/SM "
                    "(split budget per band; unsharded: the splits all heads get)")
