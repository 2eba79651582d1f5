"""Rendering for the CLI: rich tables for people, JSON for machines. No logic here."""
from __future__ import annotations

import json
import math
import os
import sys

import click
from rich import box
from rich.console import Console
from rich.table import Table

__all__ = ["console", "emit_json", "kv_table", "regs_table", "grid_table", "accuracy_table",
           "fmt_bytes", "fmt_sci"]


def console() -> Console:
    """A console on the current stdout (CliRunner swaps it), wide enough when piped."""
    out = sys.stdout
    tty = hasattr(out, "isatty") and out.isatty()
    wide = None if tty or os.environ.get("COLUMNS") else 200
    return Console(file=out, width=wide, soft_wrap=False,
                   highlight=False, emoji=False)


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "item") and callable(x.item):  # numpy scalars
        return _jsonable(x.item())
    return x


def emit_json(obj) -> None:
    click.echo(json.dumps(_jsonable(obj), indent=2, sort_keys=False))


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


def regs_table(rows: list[dict], arch: str) -> Table:
    t = Table(title=f"ptxas resources and theoretical occupancy, {arch} (NVRTC -Xptxas -v)",
              caption="smem: static (ptxas); dyn smem: at launch; warps: resident warps over "
                      "the SM's maximum; <- step: fewer blocks/SM than the previous HPB",
              title_justify="left", caption_justify="left", box=box.SIMPLE_HEAD)
    for col, j in (("kernel", "left"), ("regs", "right"), ("spill st/ld", "right"),
                   ("stack", "right"), ("smem", "right"), ("dyn smem", "right"),
                   ("threads", "right"), ("blocks/SM", "left"), ("warps", "right"),
                   ("limiter", "left")):
        t.add_column(col, justify=j, no_wrap=True)
    for r in rows:
        spills = f"{r['spill_stores']}/{r['spill_loads']}"
        bps = str(r["blocks_per_sm"]) + (" <- step" if r.get("step") else "")
        t.add_row(r["name"], str(r["registers"]),
                  f"[red]{spills}[/red]" if r["spill_stores"] or r["spill_loads"] else spills,
                  str(r["stack_bytes"]), fmt_bytes(r["static_smem"]),
                  fmt_bytes(r["dynamic_smem"]), str(r["threads"]),
                  f"[yellow]{bps}[/yellow]" if r.get("step") else bps,
                  f"{r['warp_occupancy']:.0%}", r["limiter"])
    return t


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
