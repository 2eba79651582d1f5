"""`mlasandbox stalls`: where one variant's warps wait, per SASS instruction (mlasandbox.stalls).

Profiles the variant's attention kernel under Nsight Compute (mlasandbox.ncu; needs a GPU and
ncu): of a batch-1 step, or with --batch / --serving of a paged serving step (wgmma64 runs
only there); or reads a profile saved earlier with --save. Prints the kernel-wide issue
figures, then the hottest blocks of equally-often-run instructions with each opcode's share of
the block's instructions against its share of the block's stall samples.
"""
from __future__ import annotations

import os

import click
from rich import box
from rich.markup import escape
from rich.table import Table

from mlasandbox import registry
from mlasandbox import stalls as st
from mlasandbox.bench_paged import SERVING_PRESETS, serving_help
from mlasandbox.ncu import NcuError, PagedSpec, profile_attention

from . import render
from .options import (cache_option, ctx_option, deliver_json, given_options, heads_option,
                      json_option, lengths_file, non_empty_path, output_problem, paged_options,
                      paged_step_config, q_of, q_option, refuse_overwrites,
                      refuse_paged_options, require_gpu, seed_option, splits_option,
                      stderr_console)

__all__ = ["stalls"]

CUDA_VARIANTS = tuple(n for n in registry.variant_names() if registry.variant(n).is_cuda) + \
    tuple(registry.PAGED_ONLY_VARIANTS)
# What describes a profile to run; --from reads one made earlier, so none of them applies.
PROFILE_OPTIONS = ("variant", "heads", "n_ctx", "cache", "q_dtype", "splits", "seed",
                   "ncu_path", "save_dir", "batch", "lengths_spec", "page_size", "s_q",
                   "causal", "serving", "warm")
# The files ncu's run leaves in --save DIR (mlasandbox.ncu.profile_attention).
SAVED_FILES = ("stalls.ncu-rep", "raw.csv", "source.csv")
# An opcode "waits" when its share of a block's samples is at least this many times its share
# of the block's instructions (and it holds at least MIN_WAIT_SHARE of the samples).
WAIT_RATIO = 2.0
MIN_WAIT_SHARE = 0.05


def _profile(**opts):
    """Hook (tests replace it): mlasandbox.ncu.profile_attention."""

    return profile_attention(**opts)


def _read_saved(path: str) -> tuple[str, str | None]:
    """(source page CSV, raw page CSV or None) of --from PATH (mlasandbox.stalls.read_saved),
    a file it cannot read named as bad input."""
    try:
        return st.read_saved(path)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="'--from'") from None


def short_name(kernel: str) -> str:
    """`mla::attn_tiled<(int)16, __half, float>` of ncu's `void mla::attn_tiled<(int)16, __half,
    float>(const T3 *, ...)`: the parameter list is the first "(" outside the template."""
    depth = 0
    for i, ch in enumerate(kernel):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0:
            kernel = kernel[:i]
            break
    return kernel.removeprefix("void ").strip()


def _reasons(pairs, total, n=3) -> str:
    return ", ".join(f"{r} {100 * s / total:.0f}%" for r, s in pairs[:n]) if total else "-"


def kernel_table(metrics: dict, title: str) -> Table:
    stall_rows = {st.stall_metric(r) for r in st.STALL_REASONS}

    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, caption_justify="left",
              caption="stalled X (per issue): warps found waiting for X per instruction "
                      "issued; 'selected' is the issue itself")
    t.add_column("metric")
    t.add_column("value", justify="right")
    for name, label in st.KERNEL_METRICS.items():
        if name in metrics:
            v = metrics[name]
            if name in stall_rows and v < 0.005:
                continue  # a reason no warp waited on
            t.add_row(label, f"{v:,.2f}" if v < 1000 else f"{v:,.0f}")
    return t


def block_table(block, title: str, top_opcodes: int) -> Table:
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)
    for col, j in (("opcode", "left"), ("instr", "right"), ("of instr", "right"),
                   ("of samples", "right")):
        t.add_column(col, justify=j, no_wrap=True, min_width=len(col))
    t.add_column("top reasons")  # wraps before anything else is cut
    t.add_column("", no_wrap=True)
    for o in block.opcodes[:top_opcodes]:
        waits = o.sample_share >= WAIT_RATIO * o.instr_share and o.sample_share >= MIN_WAIT_SHARE
        t.add_row(o.opcode, str(o.instructions), f"{100 * o.instr_share:.1f}%",
                  f"{100 * o.sample_share:.1f}%", _reasons(o.reasons, o.samples, 2),
                  "<- waits" if waits else "")
    rest = block.opcodes[top_opcodes:]
    if rest:
        n = sum(o.instructions for o in rest)
        t.add_row(f"({len(rest)} more opcodes)", str(n), f"{100 * n / block.instructions:.1f}%",
                  f"{100 * sum(o.sample_share for o in rest):.1f}%", "", "")
    return t


def _paged_spec(o: dict, ctx) -> tuple[PagedSpec, int, str]:
    """(the paged step, its heads, its q dtype) from the paged options; a preset's heads hold
    unless --heads says (without a preset, --heads' default)."""
    heads_given = ctx.get_parameter_source("heads") == click.core.ParameterSource.COMMANDLINE
    cfg, q = paged_step_config(o, ctx, (o["variant"],),
                               heads=o["heads"] if heads_given or o["serving"] is None else None)
    return PagedSpec(cfg.lengths, cfg.page_size, cfg.s_q, cfg.causal), cfg.dims.n_head, q


@click.command("stalls")
@click.option("--variant", type=click.Choice(CUDA_VARIANTS), default="tiled16",
              show_default=True, help="The CUDA variant to profile (wgmma64: with --batch).")
@heads_option(16, help="Query heads.")
@ctx_option(131072, multiple=False, dest="n_ctx")
@cache_option()
@q_option()
@splits_option()
@seed_option()
@click.option("--blocks", "top_blocks", type=click.IntRange(min=1), default=4, show_default=True,
              help="How many of the hottest instruction blocks to show.")
@click.option("--opcodes", "top_opcodes", type=click.IntRange(min=1), default=8,
              show_default=True, help="Opcodes listed per block (the rest are summed).")
@click.option("--ncu", "ncu_path", default=None, metavar="PATH",
              help="The ncu executable (default: $NCU, then PATH, then /usr/local/cuda/bin).")
@click.option("--save", "save_dir", default=None, metavar="DIR",
              type=click.Path(file_okay=False), callback=non_empty_path,
              help="Keep ncu's report and its raw.csv / source.csv pages in DIR.")
@click.option("--warm", is_flag=True,
              help="Profile a second launch with ncu's caches kept: the kernel's code (and what "
                   "of its data fits) in L2 from the launch before. By default every pass "
                   "starts from flushed caches, as the bench's launches do.")
@click.option("--from", "from_path", default=None, metavar="PATH", type=click.Path(),
              callback=non_empty_path,
              help="Read a profile saved with --save (or ncu's per-SASS CSV, .gz allowed) "
                   "instead of running ncu; needs no GPU.")
@paged_options(SERVING_PRESETS, serving_help())
@json_option
def stalls(variant, heads, n_ctx, cache, q_dtype, splits, seed, top_blocks, top_opcodes, ncu_path,
           save_dir, warm, from_path, batch, lengths_spec, page_size, s_q, causal, serving,
           json_out):
    """Where a variant's warps wait: ncu's stall samples per SASS instruction.

    Instructions that ran equally often form a block (a loop body is one), so the hot loops
    are the blocks with the most samples. Within a block, an opcode whose share of the
    samples is well above its share of the instructions is where the warps wait.
    With --batch B or --serving PRESET the kernel is the paged step's (--lengths,
    --page-size, --s-q, --causal as in bench; q in the cache dtype unless --q says).
    """
    def fail(msg, usage=False):
        raise (click.UsageError if usage else click.ClickException)(msg)

    ctx = click.get_current_context()
    if from_path:
        ignored = given_options(ctx, PROFILE_OPTIONS)
        if ignored:
            raise click.UsageError(
                f"{', '.join(ignored)} describe{'s' if len(ignored) == 1 else ''} a profile to "
                "run; --from reads a saved one (with it, only --blocks, --opcodes and --json "
                "apply)")
    inputs = [("--lengths", lengths_file(lengths_spec))]
    if from_path:
        inputs += [("--from", f) for f in st.saved_files(from_path) if f]
    refuse_overwrites(inputs, [("--json", json_out), *(
        ("--save", os.path.join(save_dir, f)) for f in (SAVED_FILES if save_dir else ()))])
    err = stderr_console()
    q = q_of(q_dtype, cache)
    paged = None
    if batch is not None or serving is not None:
        paged, heads, q = _paged_spec(locals(), ctx)
    elif variant in registry.PAGED_ONLY_VARIANTS:
        raise click.UsageError(f"variant {variant} serves the paged step only: give --batch B "
                               "(or --serving PRESET)")
    else:
        refuse_paged_options(lengths_spec, s_q, causal)
    if save_dir:
        problem = output_problem(save_dir, directory=True)
        if problem and os.path.exists(save_dir):
            raise click.BadParameter(problem, param_hint="'--save'")
        parent = os.path.dirname(os.path.abspath(save_dir))
        if not os.path.exists(save_dir):
            # a missing parent first: output_problem of it would name the first directory
            # above it that exists
            problem = (f"directory {parent!r} does not exist" if not os.path.isdir(parent)
                       else output_problem(parent, directory=True))
            if problem:
                raise click.BadParameter(problem, param_hint="'--save'")
    if from_path:
        source_text, raw_text = _read_saved(from_path)
        config = {"from": from_path}
    else:
        require_gpu("stalls profiles a kernel on a GPU (or reads a saved profile with "
                    "--from)")
        config = {"variant": variant, "n_head": heads, "n_ctx": n_ctx, "cache": cache, "q": q,
                  "splits": splits, "seed": seed, "warm": warm}
        what = f"H={heads}, n_ctx={n_ctx}"
        kw = {}
        if paged is not None:
            del config["n_ctx"]
            config["paged"] = {"batch": len(paged.lengths), "lengths": list(paged.lengths),
                               "page_size": paged.page_size, "s_q": paged.s_q,
                               "causal": paged.causal}
            what = f"B={len(paged.lengths)}, H={heads}, s_q={paged.s_q}, page {paged.page_size}"
            kw["paged"] = paged
        if warm:
            kw["warm"] = True
        try:
            with err.status(f"ncu: profiling {variant} ({what}{', warm' if warm else ''})"):
                run = _profile(variant=variant, n_head=heads, n_ctx=n_ctx, cache=cache, q=q,
                               splits=None if splits == "auto" else splits, seed=seed,
                               ncu=ncu_path, save_dir=save_dir, **kw)
        except ValueError as exc:
            fail(str(exc), usage=True)
        except NcuError as exc:
            fail(str(exc))
        source_text, raw_text = run.source_csv, run.raw_csv
        if save_dir:
            err.print(f"saved the report and its pages in {escape(save_dir)}")
    source_file, raw_file = st.saved_files(from_path) if from_path else (None, None)
    try:
        where = source_file
        kernel, lines = st.read_source_csv(source_text)
        where = raw_file
        metrics = st.read_raw_csv(raw_text) if raw_text else {}
    except st.NcuFormatError as exc:
        # a saved profile or CSV that is not ncu's is bad input, named by its file; a live
        # run's is ncu's problem
        fail(f"--from: {where}: {exc}" if from_path else str(exc), usage=from_path is not None)
    report = st.summarize(kernel, lines, top_blocks=top_blocks)
    result = {"ok": True, "config": config, "kernel_metrics": metrics, **report.as_dict()}
    if deliver_json(result, json_out, err):
        return
    out = render.console()
    name = escape(short_name(kernel or metrics.get("Kernel Name", "") or "kernel"))
    if metrics:
        out.print(f"[bold]{name}[/bold]")
        out.print(kernel_table(metrics, "kernel-wide (ncu's raw page)"))
    out.print(f"{name}: {report.samples:,.0f} stall samples over {report.instructions} SASS "
              "instructions;"
              f" by reason: {_reasons(report.reasons, report.samples, 6)}")
    if report.code is not None:
        c = report.code
        out.print(f"code: the launch ran {c.lines_run} of the kernel's {c.lines} lines of "
                  f"{st.CODE_LINE} bytes ({c.lines_run * st.CODE_LINE / 1024:.1f} of "
                  f"{c.code_bytes / 1024:.1f} KiB); each line's first run fetches it, from "
                  "DRAM after an L2 flush")
    for b in report.blocks:
        out.print(block_table(
            b, f"instructions run {b.executed:,} times each: {b.instructions} of them, "
               f"{100 * b.sample_share:.1f}% of the samples ({_reasons(b.reasons, b.samples)})",
            top_opcodes))
