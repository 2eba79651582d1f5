"""`mlasandbox ablate`: what the cache loads cost each kernel (mlasandbox.ablate).

Times each variant's attention phase real and with its cache copies removed, interleaved
with an A/A pair of the real kernel for the noise floor: of the batch-1 step, or with --batch
/ --serving of a paged serving step (wgmma64 runs only there). Needs a CUDA device; without
one it says so and exits 2.
"""
from __future__ import annotations

import dataclasses

import click
from rich import box
from rich.markup import escape

from mlasandbox import registry
from mlasandbox.ablate import ablate as run
from mlasandbox.ablate import ablate_paged as run_paged
from mlasandbox.bench_gpu import run_meta
from mlasandbox.bench_paged import SERVING_PRESETS, serving_help
from mlasandbox.dims import preset as get_preset
from mlasandbox.noise import NO_DIFFERENCE

from . import render
from .lab_render import fmt_us
from .options import (MAX_AA_ROUNDS, cache_option, ctx_option, deliver_json, heads_option,
                      json_option, lengths_file, paged_options, paged_step_config, preset_option,
                      progress_bar, q_of, q_option, refuse_overwrites, refuse_paged_options,
                      require_gpu, seed_option, splits_option, stderr_console,
                      variants_option)
from .render import Column, FitTable

__all__ = ["ablate"]

CUDA_VARIANTS = tuple(n for n in registry.variant_names() if registry.variant(n).is_cuda) + \
    tuple(registry.PAGED_ONLY_VARIANTS)
DEFAULT_VARIANTS = ("per_head", "split", "batched16", "tiled16", "mma16", "mma32")
DEFAULT_PAGED_VARIANTS = ("split", "batched16", "mma16", "mma32")  # the batch-1-only two out


def _run_ablation(**opts):
    """Hook (tests replace it): mlasandbox.ablate.ablate."""

    return run(**opts)


def _run_paged_ablation(**opts):
    """Hook (tests replace it): mlasandbox.ablate.ablate_paged."""

    return run_paged(**opts)


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
@variants_option(CUDA_VARIANTS, DEFAULT_VARIANTS,
                 help="CUDA variants, comma-separated (with --batch: default "
                      f"{','.join(DEFAULT_PAGED_VARIANTS)}; wgmma64 only there).")
@ctx_option(131072, multiple=False, dest="n_ctx")
@preset_option()
@heads_option()
@cache_option()
@q_option()
@splits_option()
@click.option("--rounds", type=click.IntRange(2, MAX_AA_ROUNDS), default=5, show_default=True,
              help="Interleaved rounds (A A' B) per variant.")
@seed_option()
@paged_options(SERVING_PRESETS, serving_help())
@json_option
def ablate(variants, n_ctx, preset, heads, cache, q_dtype, splits, rounds, seed, batch,
           lengths_spec, page_size, s_q, causal, serving, json_out):
    """What the cache loads cost each kernel: real vs loads-ablated time of the attn phase.

    A loads share near 0 means the kernel's instructions, not its memory traffic, set its
    time: fewer bytes or a faster memory would not speed it up. With --batch B or --serving
    PRESET the step is a paged one (--lengths, --page-size, --s-q, --causal as in bench; q
    in the cache dtype unless --q says).
    """
    ctx = click.get_current_context()
    refuse_overwrites([("--lengths", lengths_file(lengths_spec))], [("--json", json_out)])
    cfg = None
    if batch is not None or serving is not None:
        if ctx.get_parameter_source("variants") != click.core.ParameterSource.COMMANDLINE:
            variants = DEFAULT_PAGED_VARIANTS
        cfg, q = paged_step_config(locals(), ctx, variants, heads, preset)
        dims = cfg.dims
    else:
        paged_only = [v for v in variants if v in registry.PAGED_ONLY_VARIANTS]
        if paged_only:
            verb = "serves" if len(paged_only) == 1 else "serve"
            raise click.UsageError(f"{', '.join(paged_only)} {verb} the paged step only: give "
                                   "--batch B (or --serving PRESET)")
        refuse_paged_options(lengths_spec, s_q, causal)
        dims = get_preset(preset)
        if heads is not None:
            dims = dataclasses.replace(dims, n_head=heads)
        q = q_of(q_dtype, cache)
    why = require_gpu("ablate times kernels on a GPU")
    err = stderr_console()
    rows = []
    split_arg = None if splits == "auto" else splits
    try:
        with progress_bar(err) as bar:
            task = bar.add_task("ablate", total=len(variants))
            for name in variants:
                bar.update(task, description=name)
                if cfg is None:
                    res = _run_ablation(variant=name, dims=dims, n_ctx=n_ctx, cache=cache, q=q,
                                        splits=split_arg, rounds=rounds, seed=seed)
                else:
                    res = _run_paged_ablation(variant=name, dims=dims, lengths=cfg.lengths,
                                              page_size=cfg.page_size, s_q=cfg.s_q,
                                              causal=cfg.causal, cache=cache, q=q,
                                              splits=split_arg, rounds=rounds, seed=seed)
                rows.append(res.as_dict())
                bar.update(task, advance=1)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    config = {"n_ctx": n_ctx, "preset": preset, "n_head": dims.n_head, "cache": cache, "q": q,
              "rounds": rounds, "seed": seed}
    where = f"n_ctx {n_ctx}"
    if cfg is not None:
        del config["n_ctx"]
        config["paged"] = {"batch": cfg.batch, "lengths_spec": cfg.lengths_spec,
                           "lengths": list(cfg.lengths), "page_size": cfg.page_size,
                           "s_q": cfg.s_q, "causal": cfg.causal, "serving": cfg.serving}
        where = (f"the paged step B={cfg.batch} x {cfg.lengths_spec}, s_q {cfg.s_q}"
                 f"{' causal' if cfg.causal else ''}, page {cfg.page_size} (S: chunk slots)")
    result = {"ok": True, "config": config, "meta": _run_meta(), "rows": rows}
    if deliver_json(result, json_out, err):
        return
    render.console().print(ablate_table(
        rows, f"memory ablation of the attn phase at {where}, H={dims.n_head}, cache "
              f"{cache}, q {q} ({escape(why)})"))
