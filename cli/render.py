"""Rendering for the CLI: rich tables for people, JSON for machines. No logic here."""
from __future__ import annotations

import json
import math
import os
import sys

import click
from dataclasses import dataclass

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table

__all__ = ["console", "emit_json", "jsonable", "kv_table", "regs_table", "grid_table",
           "accuracy_table", "fmt_bytes", "fmt_sci", "Column", "FitTable", "gpu_checks_table",
           "escape", "variant_label"]


# A COLUMNS below this is taken for a mistake: rich would print nothing at 0 and a character a
# line at 1, and the tables need about this much for their first columns.
MIN_COLUMNS = 40


def console_width(out) -> int | None:
    """The width for a console on `out`: COLUMNS where it is a usable width, else the
    terminal's (None: rich asks it), else 200 when piped."""
    tty = hasattr(out, "isatty") and out.isatty()
    raw = os.environ.get("COLUMNS")
    if raw is not None and raw.strip().isdigit() and int(raw) >= MIN_COLUMNS:
        return int(raw)
    if raw is not None and tty:   # rich would read the bad COLUMNS itself
        try:
            return os.get_terminal_size(out.fileno()).columns
        except (OSError, ValueError):
            return 200
    return None if tty else 200


def console() -> Console:
    """A console on the current stdout (CliRunner swaps it), wide enough when piped."""
    out = sys.stdout
    return Console(file=out, width=console_width(out), soft_wrap=False,
                   highlight=False, emoji=False)


def jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if hasattr(x, "item") and callable(x.item):  # numpy scalars
        return jsonable(x.item())
    return x


def emit_json(obj) -> None:
    click.echo(json.dumps(jsonable(obj), indent=2, sort_keys=False))


@dataclass(frozen=True)
class Column:
    """A table column. `drop`: the order in which it goes when the table is too wide for
    the console (1 first; None: never, it is what the table is for). `fold`: its text may
    wrap (a long name) instead of being cut."""

    header: str
    justify: str = "left"
    drop: int | None = None
    fold: bool = False


class FitTable:
    """A table that fits the console it is printed on: where its natural width is more than
    the console's, droppable columns go one by one (their names listed in the caption),
    then the folding columns wrap. The columns that never drop are never cut."""

    def __init__(self, columns, rows, **table_kw):
        self.columns = list(columns)
        self.rows = [list(r) for r in rows]
        self.table_kw = table_kw

    def table(self, dropped=()) -> Table:
        kw = dict(self.table_kw)
        if dropped:
            note = f"(left out to fit the width: {', '.join(dropped)})"
            kw["caption"] = f"{kw['caption']} {note}" if kw.get("caption") else note
        t = Table(**kw)
        keep = [i for i, c in enumerate(self.columns) if c.header not in dropped]
        for i in keep:
            c = self.columns[i]
            t.add_column(c.header, justify=c.justify, no_wrap=not c.fold,
                         overflow="fold" if c.fold else "ellipsis",
                         min_width=None if c.fold else len(c.header))
        for r in self.rows:
            t.add_row(*(r[i] for i in keep))
        return t

    def fitted(self, width: int, console: Console) -> Table:
        order = sorted((c for c in self.columns if c.drop is not None), key=lambda c: c.drop)
        dropped: list[str] = []
        t = self.table()
        unbounded = console.options.update_width(10_000)  # the natural width, not clamped
        while True:
            if Measurement.get(console, unbounded, t).maximum <= width:
                return t
            if not order:
                return t  # the folding columns wrap; nothing else can go
            dropped.append(order.pop(0).header)
            t = self.table(tuple(dropped))

    def __rich_console__(self, console, options):
        yield self.fitted(options.max_width, console)


def variant_label(row: dict) -> str:
    """A row's variant, after the name asked where that differs: "auto (wgmma64)"."""
    asked = row.get("asked") or row["variant"]
    return row["variant"] if asked == row["variant"] else f"{asked} ({row['variant']})"


def fmt_bytes(n) -> str:
    if n is None:
        return "-"
    n = int(n)
    if n < 1024:
        return f"{n} B"
    if n < 1 << 20:
        return f"{n / 1024:.1f} KiB"
    return f"{n / (1 << 20):.1f} MiB"


def fmt_sci(x) -> str:
    if x is None:
        return "-"
    return f"{x:.3e}"


def kv_table(title: str, items) -> Table:
    t = Table(title=title, show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    for k, v in items:
        t.add_row(str(k), "-" if v is None else str(v))
    return t


# "code KiB" is the last column to drop: the instruction footprint is what no other shows.
REGS_COLUMNS = (
    Column("kernel", fold=True), Column("regs", "right"), Column("spill st/ld", "right"),
    Column("code KiB", "right", drop=7),
    Column("stack", "right", drop=1), Column("smem", "right", drop=4),
    Column("dyn smem", "right", drop=5), Column("threads", "right", drop=2),
    Column("blocks/SM", "left"), Column("warps", "right", drop=3),
    Column("limiter", "left", drop=6),
)


def _regs_cells(r: dict, limiter: str) -> list[str]:
    """A compiled row's cells, in REGS_COLUMNS order."""
    spills = f"{r['spill_stores']}/{r['spill_loads']}"
    bps = str(r["blocks_per_sm"]) + (" <- step" if r.get("step") else "")
    return [r["name"], str(r["registers"]),
            f"[red]{spills}[/red]" if r["spill_stores"] or r["spill_loads"] else spills,
            f"{r['code_bytes'] / 1024:.1f}", str(r["stack_bytes"]),
            fmt_bytes(r["static_smem"]), fmt_bytes(r["dynamic_smem"]), str(r["threads"]),
            f"[yellow]{bps}[/yellow]" if r.get("step") else bps,
            f"{r['warp_occupancy']:.0%}", limiter]


def regs_table(rows: list[dict], arch: str) -> FitTable:
    """Registers, spills and blocks/SM per instance: those columns never drop; then the
    machine-code size; a row of a kernel that needs a newer arch says so instead."""
    cells, reasons = [], []
    for r in rows:
        limiter = r.get("limiter") or ""
        if limiter.startswith("does not fit"):
            # the calculator's full reason goes to the caption, once per distinct reason
            why = limiter.split(":", 1)[-1].strip()
            if why not in reasons:
                reasons.append(why)
            limiter = f"does not fit [{reasons.index(why) + 1}]"
        if r.get("needs"):
            cells.append([r["name"], "-", "-", "-", "-", "-", "-", "-",
                          f"[yellow]needs {r['needs']}[/yellow]", "-", "not compiled"])
            continue
        cells.append(_regs_cells(r, limiter))
    notes = "".join(f"\n[{i}] {escape(w)}" for i, w in enumerate(reasons, 1))
    return FitTable(REGS_COLUMNS, cells,
                    title=f"ptxas resources and theoretical occupancy, {arch} (NVRTC -Xptxas -v)",
                    caption="code: the kernel's machine code (its .text in the cubin); "
                            "smem: static (ptxas); dyn smem: at launch; warps: resident warps "
                            "over the SM's maximum; <- step: fewer blocks/SM than the previous "
                            "HPB; needs sm_XX: the kernel does not compile for this arch" + notes,
                    title_justify="left", caption_justify="left", box=box.SIMPLE_HEAD)


def _n(k: int, word: str) -> str:
    return f"{k} {word}" + ("" if k == 1 else "s")


def grid_table(g: dict) -> Table:
    items = [
        ("variant", f"{g['variant']} ({_n(g['heads_per_block'], 'head')} per block)"),
        ("shape", f"{_n(g['n_head'], 'head')} x n_ctx {g['n_ctx']}"),
        ("grid", f"({_n(g['grid'][0], 'head block')}, {_n(g['grid'][1], 'split')}) x "
                 f"{g['threads_per_block']} threads"),
        ("blocks vs SMs", f"{g['blocks']} blocks on {g['num_sms']} SMs "
                          f"({g['blocks_per_sm']}/SM -> {g['slots']} slots)"),
        ("blocks/SM from", g["blocks_per_sm_source"]),
        ("waves", f"{g['waves']:.2f} ({_n(g['full_waves'], 'launch wave')})"),
        ("idle SMs", f"{g['idle_sms']}" + (" (no block at all)" if g["idle_sms"] else "")),
        ("positions per block", f"{g['positions_per_block']}"
         + (f" (shortest non-empty slice {g['positions_min_block']})"
            if g["positions_min_block"] != g["positions_per_block"] else "")),
        ("tiles per block", f"{g['tiles_per_block']} of {g['tile']} rows"),
        ("empty slices", g["empty_slices"]),
        ("combine", "yes (partials merged, then wv_b)" if g["combine"] else
         "no (one slice: wv_b applied to the only partial)"),
        ("tile-steps (critical path)", g["estimated_tile_steps"]),
        ("splits", f"{g['splits']} ({g['reason']})"),
    ]
    return kv_table("launch geometry", items)


def accuracy_table(rows: list[dict], title: str) -> Table:
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)
    for col in ("n_ctx", "seed", "S", "unsplit", "split", "gain", "no rescale",
                "within tol", "control rejected"):
        t.add_column(col, justify="right")

    def yn(b):
        return "n/a" if b is None else ("[green]yes[/green]" if b else "[red]NO[/red]")

    for r in rows:
        gain = r.get("gain")
        t.add_row(str(r["n_ctx"]), str(r["seed"]), str(r.get("splits", "-")),
                  fmt_sci(r["relL2_unsplit"]), fmt_sci(r["relL2_split"]),
                  "-" if gain is None else f"{gain:.2f}x",
                  fmt_sci(r["relL2_no_rescale"]), yn(r.get("split_ok")),
                  yn(r.get("control_rejected")))
    return t


def gpu_checks_table(rows: list[dict]) -> Table:
    """The device checks: each variant against the reference, then the negative controls."""
    t = Table(title="on the device: every variant vs the float64 reference; the negative "
                    "controls (combine without rescale) must fail", title_justify="left",
              box=box.SIMPLE_HEAD)
    for col, j in (("check", "left"), ("n_ctx", "right"), ("heads", "right"), ("S", "right"),
                   ("latent relL2", "right"), ("verdict", "left")):
        t.add_column(col, justify=j, overflow="fold")
    for r in rows:
        rel = r.get("latent_relL2")
        t.add_row(escape(r["name"]), str(r.get("n_ctx", "-")), str(r.get("heads", "-")),
                  "-" if r.get("splits") is None else str(r["splits"]),
                  "-" if rel is None else f"{rel:.2e}",
                  ("[green]ok[/green] " if r["ok"] else "[red]FAIL[/red] ")
                  + escape(r.get("detail", "")))
    return t
