"""Option parsing and output helpers shared by the lab commands (bench, sweep, repro).

The parsers mirror those of cli/main.py (same messages, same exit code 2 on bad input); they
live here because main.py imports the lab commands at its end, so the lab modules cannot
import main.py at import time.
"""
from __future__ import annotations

import json

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                           TimeElapsedColumn)

__all__ = ["int_list", "str_list", "auto_or_int", "json_option", "write_json", "deliver_json",
           "stderr_console", "progress_bar"]


def int_list(ctx, param, value):
    if value is None:
        return None
    out = []
    for part in str(value).split(","):
        part = part.strip()
        if not part:
            continue
        try:
            out.append(int(part))
        except ValueError:
            raise click.BadParameter(f"{part!r} is not an integer") from None
    if not out:
        raise click.BadParameter("give at least one value")
    return tuple(out)


def str_list(choices):
    def cb(ctx, param, value):
        if value is None:
            return None
        out = tuple(p.strip() for p in str(value).split(",") if p.strip())
        bad = [p for p in out if p not in choices]
        if bad or not out:
            raise click.BadParameter(
                f"{', '.join(bad) or 'nothing'} not among {', '.join(choices)}")
        return out
    return cb


def auto_or_int(ctx, param, value):
    if value in (None, "auto"):
        return "auto"
    try:
        v = int(value)
    except ValueError:
        raise click.BadParameter(f"must be 'auto' or an integer >= 1, got {value!r}") from None
    if v < 1:
        raise click.BadParameter(f"must be 'auto' or an integer >= 1, got {v}")
    return v


def json_option(f):
    """`--json` alone: JSON on stdout instead of tables (as every command); `--json FILE`:
    tables on stdout and the JSON written to FILE."""
    return click.option("--json", "json_out", is_flag=False, flag_value="-", default=None,
                        metavar="[FILE]",
                        help="JSON on stdout instead of tables, or with FILE: write it there.")(f)


def write_json(obj, path) -> None:
    from .render import _jsonable

    with open(path, "w", encoding="utf-8") as f:
        json.dump(_jsonable(obj), f, indent=2)
        f.write("\n")


def deliver_json(result, json_out, err: Console) -> bool:
    """Where `--json` sends a finished result: to FILE (saying so on `err`), or to stdout
    instead of the tables. True when it went to stdout (the command prints nothing else)."""
    from .render import emit_json

    if json_out == "-":
        emit_json(result)
        return True
    if json_out:
        write_json(result, json_out)
        err.print(f"wrote {escape(str(json_out))}")
    return False


def stderr_console() -> Console:
    return Console(stderr=True, highlight=False, emoji=False)


def progress_bar(console: Console) -> Progress:
    return Progress(TextColumn("{task.description}", style="bold"), BarColumn(),
                    MofNCompleteColumn(), TimeElapsedColumn(), console=console,
                    transient=False)
