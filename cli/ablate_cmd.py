"""`mlasandbox ablate`: what the cache loads cost each kernel (mlasandbox.ablate).

Times each variant's attention phase real and with its cache copies removed, interleaved
with an A/A pair of the real kernel for the noise floor. Needs a CUDA device; without one it
says so and exits 1.
"""
from __future__ import annotations

import click
from rich import box
from rich.markup import escape
from rich.table import Table

from mlasandbox import registry
from mlasandbox.dims import PRESETS
from mlasandbox.noise import NO_DIFFERENCE

from . import render
from .lab_options import auto_or_int, deliver_json, json_option, progress_bar, stderr_console, \
    str_list

__all__ = ["ablate"]

CUDA_VARIANTS = tuple(n for n in registry.variant_names() if registry.variant(n).is_cuda)
DEFAULT_VARIANTS = ("per_head", "split", "batched16", "tiled16", "mma16", "mma32")


def _run_ablation(**opts):
    """Hook (tests replace it): mlasandbox.ablate.ablate."""
    from mlasandbox.ablate import ablate as run

    return run(**opts)


def _run_meta() -> dict:
    """Hook (tests replace it): device, versions, commit and date (bench_gpu.run_meta)."""
    from mlasandbox.bench_gpu import run_meta

    return run_meta()


def ablate_table(rows: list[dict], title: str) -> Table:
    from .lab_render import fmt_us

    t = Table(title=title, title_justify="left", caption_justify="left", box=box.SIMPLE_HEAD,
              caption="loads ablated: the same kernel built with -DMLA_ABLATE_CACHE_LOADS (only "
                      "the first tile per stage buffer is copied; its results are wrong by "
                      "design and only checked to differ); loads share: 1 - ablated / real, "
                      "the part of the time the cache copies add; floor: A/A of the real "
                      "kernel, interleaved with the ablated one")
    for col, j in (("variant", "left"), ("S", "right"), ("head blocks", "right"),
                   ("real us", "right"), ("loads ablated us", "right"),
                   ("loads share", "right"), ("floor", "right")):
        t.add_column(col, justify=j, no_wrap=True)
    for r in rows:
        v = r["verdict"]
        share = f"{100 * r['share']:.0f}%" if v["kind"] != "same" else NO_DIFFERENCE
        t.add_row(r["variant"], str(r["splits"]), str(r["head_blocks"]), fmt_us(r["real_us"]),
                  fmt_us(r["ablated_us"]), share, f"{100 * r['floor']['floor']:.2f}%")
    return t


@click.command("ablate")
@click.option("--variant", "variants", callback=str_list(CUDA_VARIANTS),
              default=",".join(DEFAULT_VARIANTS), show_default=True,
              help="CUDA variants, comma-separated.")
@click.option("--ctx", "n_ctx", type=click.IntRange(min=1), default=131072, show_default=True)
@click.option("--preset", type=click.Choice(sorted(PRESETS)), default="lecture",
              show_default=True)
@click.option("--heads", type=click.IntRange(min=1), default=None,
              help="Query heads (overrides the preset's).")
@click.option("--cache", type=click.Choice(["f16", "bf16"]), default="f16", show_default=True)
@click.option("--q", "q_dtype", type=click.Choice(["f32", "cache"]), default="f32",
              show_default=True)
@click.option("--splits", callback=auto_or_int, default="auto", show_default=True)
@click.option("--rounds", type=click.IntRange(min=2), default=5, show_default=True,
              help="Interleaved rounds (A A' B) per variant.")
@click.option("--seed", type=int, default=0, show_default=True)
@json_option
def ablate(variants, n_ctx, preset, heads, cache, q_dtype, splits, rounds, seed, json_out):
    """What the cache loads cost each kernel: real vs loads-ablated time of the attn phase.

    A loads share near 0 means the kernel's instructions, not its memory traffic, set its
    time: fewer bytes or a faster memory would not speed it up.
    """
    import dataclasses

    from mlasandbox import toolkit
    from mlasandbox.dims import preset as get_preset

    as_json = json_out == "-"
    ok, why = toolkit.device_available()
    if not ok:
        if as_json:
            render.emit_json({"ok": False, "error": f"ablate times kernels on a GPU: {why}"})
        raise click.ClickException(f"ablate times kernels on a GPU: {why}")
    dims = get_preset(preset)
    if heads is not None:
        dims = dataclasses.replace(dims, n_head=heads)
    q = cache if q_dtype == "cache" else q_dtype
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
        if as_json:
            render.emit_json({"ok": False, "error": str(exc)})
        raise click.UsageError(str(exc)) from None
    result = {"ok": True, "config": {"n_ctx": n_ctx, "preset": preset, "n_head": dims.n_head,
                                     "cache": cache, "q": q, "rounds": rounds, "seed": seed},
              "meta": _run_meta(), "rows": rows}
    if deliver_json(result, json_out, err):
        return
    render.console().print(ablate_table(
        rows, f"memory ablation of the attn phase at n_ctx {n_ctx}, H={dims.n_head}, cache "
              f"{cache}, q {q} ({escape(why)})"))
