"""`mlasandbox new NAME [--from split|batched|mma16|mma32]`: a user kernel to start from."""
from __future__ import annotations

import os

import click

from mlasandbox.user_new import TEMPLATES, new_kernel_source

from . import render
from .options import bad_input, json_option, output_problem, refuse_overwrites, write_json


@click.command("new")
@click.argument("name")
@click.option("--from", "template", type=click.Choice(list(TEMPLATES)), default="split",
              show_default=True, help="The built-in kernel to copy.")
@click.option("--force", is_flag=True, help="Overwrite NAME.cu if it exists.")
@json_option
def new(name, template, force, json_out):
    """Write NAME.cu: a working copy of a built-in paged kernel with its mlasandbox header
    filled in (it passes `mlasandbox try NAME.cu`); docs/byok.md is the contract."""
    path = name if name.endswith(".cu") else f"{name}.cu"
    stem = os.path.splitext(os.path.basename(path))[0]
    if os.path.exists(path) and not force:
        bad_input(f"{path} exists; pass --force to overwrite it")
    refuse_overwrites([], [("NAME", path), ("--json", json_out)])
    problem = output_problem(path)  # a missing folder, a directory, a device, read-only
    if problem:
        bad_input(f"NAME {name}: {problem}")
    try:
        text = new_kernel_source(stem, template)
    except ValueError as exc:
        bad_input(str(exc))
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    data = {"ok": True, "path": path, "entry": stem, "template": template,
            "lines": text.count("\n")}
    if json_out == "-":
        render.emit_json(data)
        return
    if json_out:
        write_json(data, json_out)
    render.console().print(f"wrote {path} (entry {stem}, a copy of the built-in {template} "
                           f"kernel); next: mlasandbox try {path}")
