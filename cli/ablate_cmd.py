"""`mlasandbox ablate`: what the cache loads cost each kernel (mlasandbox.ablate).

Times each variant's attention phase real and with its cache copies removed, interleaved
with an A/A pair of the real kernel for the noise floor. Needs a CUDA device; without one it
says so and exits 1.
"""
from __future__ import annotations

import dataclasses

import click
from rich import box
from rich.markup import escape

from mlasandbox import registry, toolkit
from mlasandbox.ablate import ablate as run
from mlasandbox.bench_gpu import run_meta
from mlasandbox.dims import preset as get_preset
from mlasandbox.noise import NO_DIFFERENCE

from . import render
from .lab_render import fmt_us
from .options import (cache_option, ctx_option, deliver_json, heads_option, json_option,
                      preset_option, progress_bar, q_of, q_option, splits_option, stderr_console,
                      variants_option)
from .render import Column, FitTable

__all__ = ["ablate"]

CUDA_VARIANTS = tuple(n for n in registry.variant_names() if registry.variant(n).is_cuda)
DEFAULT_VARIANTS = ("per_head", "split", "batched16", "tiled16", "mma16", "mma32")


def _run_ablation(**opts):
    """Hook (tests replace it): mlasandbox.ablate.ablate."""

    return run(**opts)


def _run_meta() -> dict:
    """Hook (tests replace it): device, versions, commit and date (bench_gpu.run_meta)."""
    return run_meta()


def ablate_table(rows: list[dict], title: str) -> FitTable:
    """The ablation table; at a narrow console the geometry columns go first, never the
    times or the share the table exists for."""
    columns = (Column("variant"), Column("S", "right", drop=2),
               Column("head blocks", "right", drop=1), Column("real us", "right"),
               Column("loads ablated us", "right"), Column("loads share", "right"),
               Column("floor", "right", drop=3))
    cells = []
    for r in rows:
        v = r["verdict"]
        share = f"{100 * r['share']:.0f}%" if v["kind"] != "same" else NO_DIFFERENCE
        cells.append((r["variant"], str(r["splits"]), str(r["head_blocks"]),
                      fmt_us(r["real_us"]), fmt_us(r["ablated_us"]), share,
                      f"{100 * r['floor']['floor']:.2f}%"))
    return FitTable(columns, cells, title=title, title_justify="left", caption_justify="left",
                    box=box.SIMPLE_HEAD,
                    caption="loads ablated: the same kernel built with "
                            "-DMLA_ABLATE_CACHE_LOADS (only the first tile per stage buffer is "
                            "copied; its results are wrong by design and only checked to "
                            "differ); loads share: 1 - ablated / real, the part of the time the "
                            "cache copies add; floor: A/A of the real kernel, interleaved with "
                            "the ablated one")


@click.command("ablate")
@variants_option(CUDA_VARIANTS, DEFAULT_VARIANTS, help="CUDA variants, comma-separated.")
@ctx_option(131072, multiple=False, dest="n_ctx")
@preset_option()
@heads_option()
@cache_option()
@q_option()
@splits_option()
@click.option("--rounds", type=click.IntRange(min=2), default=5, show_default=True,
              help="Interleaved rounds (A A' B) per variant.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the inputs.")
@json_option
def ablate(variants, n_ctx, preset, heads, cache, q_dtype, splits, rounds, seed, json_out):
    """What the cache loads cost each kernel: real vs loads-ablated time of the attn phase.

    A loads share near 0 means the kernel's instructions, not its memory traffic, set its
    time: fewer bytes or a faster memory would not speed it up.
    """
    ok, why = toolkit.device_available()
    if not ok:
        raise click.ClickException(f"ablate times kernels on a GPU: {why}")
    dims = get_preset(preset)
    if heads is not None:
        dims = dataclasses.replace(dims, n_head=heads)
    q = q_of(q_dtype, cache)
    err = stderr_console()
    rows = []
    try:
        with progress_bar(err) as bar:
            task = bar.add_task("ablate", total=len(variants))
            for name in variants:
                bar.update(task, description=name)
                res = _run_ablation(variant=name, dims=dims, n_ctx=n_ctx, cache=cache, q=q,
                                    splits=None if splits == "auto" else splits,
                                    rounds=rounds, seed=seed)
                rows.append(res.as_dict())
                bar.update(task, advance=1)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    result = {"ok": True, "config": {"n_ctx": n_ctx, "preset": preset, "n_head": dims.n_head,
                                     "cache": cache, "q": q, "rounds": rounds, "seed": seed},
              "meta": _run_meta(), "rows": rows}
    if deliver_json(result, json_out, err):
        return
    render.console().print(ablate_table(
        rows, f"memory ablation of the attn phase at n_ctx {n_ctx}, H={dims.n_head}, cache "
              f"{cache}, q {q} ({escape(why)})"))
