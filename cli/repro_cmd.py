"""`mlasandbox repro`: write a self-contained bug-report script (mlasandbox.repro)."""
from __future__ import annotations

import shlex
import sys

import click
from rich.markup import escape

from mlasandbox import registry
from mlasandbox.dims import PRESETS
from mlasandbox.repro import (REPRO_CONTEXTS, default_filename, default_paged_filename,
                              make_case, make_paged_case, paged_runs_on, write_paged_script,
                              write_script)

from . import render
from .tp_cmd import band_heads, tp_option
from .options import (OutputFile, arch_option, blocks_per_sm, cache_option, ctx_option,
                      deliver_json, given_options, heads_option, json_option, lengths_file,
                      paged_options, output_problem, preset_option, q_option, refuse_overwrites,
                      refuse_paged_options, seed_option, sms_option, splits_option,
                      stderr_console)

__all__ = ["repro"]


@click.command("repro")
@click.option("--variant", "variant_name", required=True,
              type=click.Choice([*registry.variant_names(), *registry.PAGED_ONLY_VARIANTS,
                                 "auto"]),
              help="The variant to reproduce (wgmma64, and auto: the paged step's choice for "
                   "the case on --arch, else this GPU, pinned in the script: with --batch).")
@preset_option()
@heads_option()
@ctx_option(REPRO_CONTEXTS, dest="contexts")
@cache_option()
@q_option()
@splits_option(help="'auto' (resolved now, pinned in the script) or S (1..65535).")
@seed_option()
@click.option("--negative-control", is_flag=True,
              help="Merge without the rescale (the combine's, or the attention kernel's "
                   "own merge where it merges): the script must FAIL.")
@sms_option(None, "SM count for 'auto' splits without a GPU (default 132).")
@click.option("--blocks-per-sm", "bps", callback=blocks_per_sm, default="auto",
              show_default=True, help="Blocks/SM for 'auto' splits ('auto': driver or model).")
@arch_option("Arch of the occupancy model for 'auto' splits without a GPU.")
@click.option("-o", "--output", type=OutputFile(), default=None, metavar="FILE",
              help="Script path (default: a name built from the case, in the current "
                   "directory).")
@json_option
@paged_options()
@tp_option("The case of one rank's band of the heads over N ranks (--rank), its split or "
           "chunk budget derived for the band.")
@click.option("--rank", type=click.IntRange(min=0), default=None,
              help="The rank whose band --tp reproduces (default 0).")
def repro(variant_name, preset, heads, contexts, cache, q_dtype, splits, seed,
          negative_control, sms, bps, arch, output, json_out, batch, lengths_spec, page_size,
          s_q, causal, tp, rank):
    """Write one self-contained Python script (CuPy + NumPy only) reproducing a case.

    The script prints the GPU and versions, runs the kernels under a phase guard, compares
    with an embedded float64 reference and prints one verdict line: PASS (exit 0), FAIL
    (1: wrong numbers), ERROR (2: compile, launch, fault or out of memory) or NOT RUN (3: no
    usable GPU).

    With --batch B: a batched paged case (--lengths, --page-size, --s-q, --causal; heads of
    --preset, dsv3 unless given), its lengths, page size, seed and chunk plan embedded,
    checked against an embedded float64 paged reference. wgmma64 runs only there (q in the
    cache dtype unless --q says): its script builds the sm_90a kernel and is NOT RUN (3) on
    a device that is not sm_90.
    """
    command = "mlasandbox repro " + " ".join(shlex.quote(a) for a in sys.argv[2:]) \
        if len(sys.argv) > 1 and sys.argv[1] == "repro" else ""
    _refuse_overwrites(output, json_out, lengths_spec)
    if rank is not None and tp is None:
        raise click.UsageError("--rank needs --tp N")
    if batch is None and variant_name == "auto":
        raise click.BadParameter("auto is the paged step's choice (by the batch's rows and "
                                 "size): give --batch B (the batched paged case), or name the "
                                 "variant", param_hint="'--variant'")
    if batch is None and variant_name in registry.PAGED_ONLY_VARIANTS:
        raise click.UsageError(f"variant {variant_name} serves the paged step only: give "
                               "--batch B (the batched paged case)")
    if tp is not None:
        full = heads or PRESETS["dsv3" if batch is not None and click.get_current_context(
        ).get_parameter_source("preset") != click.core.ParameterSource.COMMANDLINE
            else preset].n_head
        heads = band_heads(tp, full, rank)
    if batch is not None:
        return _paged_repro(variant_name, batch, lengths_spec, s_q, causal, page_size, preset,
                            heads, cache, q_dtype, splits, seed, negative_control, sms, bps,
                            arch, output, json_out, command)
    refuse_paged_options(lengths_spec, s_q, causal, needs="--batch B (the batched paged case)")
    planners = given_options(click.get_current_context(), ("sms", "bps", "arch"))
    if splits != "auto" and planners:
        raise click.UsageError(f"{', '.join(planners)} plan 'auto' splits; with --splits "
                               f"{splits} they change nothing: drop them, or use --splits auto")
    try:
        case = make_case(variant_name, preset=preset, heads=heads, contexts=contexts,
                         cache=cache, q=q_dtype, splits=splits, seed=seed,
                         negative_control=negative_control, num_sms=sms, blocks_per_sm=bps,
                         arch=arch, command=command)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    _write_and_say(case, write_script, output or _default_path(default_filename(case)), json_out,
                   {"contexts": list(case.contexts),
                    "splits": {str(k): v for k, v in case.splits.items()},
                    "splits_from": case.splits_from},
                   f"splits {case.splits} ({case.splits_from})")


def _default_path(name: str) -> str:
    """The script's default name, checked as -o FILE is when given (a directory of that name,
    a cwd that takes no file)."""
    problem = output_problem(name)
    if problem:
        raise click.UsageError(f"the script's path: {problem}; give another with -o FILE")
    return name


def _refuse_overwrites(output, json_out, lengths_spec) -> None:
    """The script and --json FILE: neither over the lengths file, nor over each other."""
    refuse_overwrites([("--lengths", lengths_file(lengths_spec))],
                      [("--output", output), ("--json", json_out)])


def _write_and_say(case, write, output, json_out, facts: dict, summary: str,
                   runs_on: str = "", chosen: str = "") -> None:
    """Write the script, then its facts as JSON or lines of text. `runs_on` names the
    arch the script's kernel needs, where it needs one; `chosen`, what auto resolved to."""
    _refuse_overwrites(output, json_out, getattr(case, "lengths_spec", None))
    try:
        path = write(case, output)
    except OSError as exc:
        raise click.ClickException(f"could not write the script: {exc}") from None
    expect = "FAIL" if case.negative_control else "PASS"
    info = {"ok": True, "path": path, "variant": case.variant, "n_head": case.dims.n_head,
            **facts, "cache": case.cache_dtype, "q": case.q_dtype, "seed": case.seed,
            "negative_control": case.negative_control, "expect": expect}
    if deliver_json(info, json_out, stderr_console()):
        return
    con = render.console()
    if chosen:
        con.print(escape(f"{chosen} (pinned in the script)"))
    con.print(escape(f"wrote {path}"))
    con.print(escape(f"  {case.variant}, H={case.dims.n_head}, cache {case.cache_dtype}, q "
                     f"{case.q_dtype}, seed {case.seed}; {summary}"))
    gpu = f"{runs_on} GPU" if runs_on else "GPU"
    con.print(escape(f"  run it on {'an' if runs_on else 'a'} {gpu}: python {path}   (expect "
                     f"{expect}; NOT RUN, exit 3, means there was no {gpu} to run it on)"))


def _paged_repro(variant, batch, lengths_spec, s_q, causal, page_size, preset, heads, cache,
                 q_dtype, splits, seed, negative_control, sms, bps, arch, output, json_out,
                 command):
    ctx = click.get_current_context()
    if ctx.get_parameter_source("contexts") == click.core.ParameterSource.COMMANDLINE:
        raise click.UsageError("--ctx belongs to the batch-1 case; a batched case takes "
                               "--lengths")
    if ctx.get_parameter_source("preset") != click.core.ParameterSource.COMMANDLINE:
        preset = "dsv3"
    # wgmma takes q in the cache dtype only (registry.wgmma_instance): that is its default,
    # as bench --batch's; an explicit --q f32 is refused by name. auto's default is bench
    # --batch's too, so that it resolves to the kernel that bench timed.
    if ((variant == "auto" or registry.variant(variant).family == "wgmma")
            and ctx.get_parameter_source("q_dtype") != click.core.ParameterSource.COMMANDLINE):
        q_dtype = "cache"
    try:
        case = make_paged_case(variant, batch=batch,
                               lengths="4096" if lengths_spec is None else lengths_spec,
                               s_q=s_q or 1, causal=bool(causal), page_size=page_size,
                               preset=preset, heads=heads, cache=cache, q=q_dtype,
                               splits=splits, seed=seed, negative_control=negative_control,
                               num_sms=sms, blocks_per_sm=bps, arch=arch, command=command)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    _write_and_say(case, write_paged_script, output or _default_path(default_paged_filename(case)),
                   json_out,
                   {"asked": variant, "chosen": case.chosen or None, "batch": len(case.lengths),
                    "lengths": list(case.lengths), "s_q": case.s_q,
                    "causal": case.causal, "page_size": case.page_size, "plan": case.plan,
                    "plan_from": case.plan_from, "attn_merges": case.attn_merges},
                   f"paged: B={len(case.lengths)}, s_q={case.s_q}"
                   f"{' causal' if case.causal else ''}, page {case.page_size}; chunk plan "
                   f"{case.plan}", runs_on=paged_runs_on(case), chosen=case.chosen)
