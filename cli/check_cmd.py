"""`mlasandbox check`: accuracy against the float64 reference, each check with its negative
control shown failing.

Always the schedule model (the kernels' arithmetic in NumPy float32); on a GPU also every
CUDA variant and the cuBLAS engine on the device (mlasandbox.device_check). Without a GPU it
says that it checked the CPU model only, and why.
"""
from __future__ import annotations

import click

from mlasandbox import archs, limits, registry, schedule, toolkit
from mlasandbox.compare import DEFAULT_TOLERANCE
from mlasandbox.device_check import device_checks
from mlasandbox.dims import preset as get_preset

from . import render
from .options import (MAX_SEEDS, cache_option, ctx_option, given_options, json_option,
                      preset_option, splits_option, variants_option, write_json)

__all__ = ["check", "cpu_accuracy", "CHECK_CTXS", "CHECK_SEEDS"]

# The schedule model's default study: the gate (4095/4096/4097), the next boundaries
# (12287/12288/12289) and 20000, several seeds.
CHECK_CTXS = (1, 4095, 4096, 4097, 12287, 12288, 12289, 20000)
CHECK_SEEDS = 3
STUDY_PRESET = "h96-tp8"  # 12 heads: a tensor-parallel shard, the study's default dims
# The study passes only where the split is at least as accurate as the unsplit walk in the
# median (schedule.judge_study), and a split's f32 sums are shorter only when its slices
# are long enough: with one position a slice (S >= n_ctx: empty slices past it) the split is
# the combine alone, an n_ctx-term sum like the walk plus a rescale per term, 0.75-0.83x as
# accurate on the model; with two the gain straddles 1 (0.84-1.19x), with three it dips to
# 0.88x; from four positions on it was 1.09x or more at n_ctx 100, 1000, 4096 and 12289,
# five seeds each. Shorter slices make a correct combine fail the study, so --splits must
# leave every context that splits slices of at least this many positions.
MIN_SLICE = 4


def cpu_accuracy(ctxs, seeds, splits="auto", preset: str | None = None,
                 cache: str = "f16") -> tuple[list[dict], dict]:
    """The schedule model's study and verdict (mlasandbox.schedule), as plain rows.

    Per row: the three relL2(latent) figures against the float64 reference and display flags
    against the latent tolerance; the verdict (ok, problems, median gain) is judge_study's.
    """
    dims = get_preset(preset or STUDY_PRESET)
    for n in ctxs:
        limits.check_host_memory(n, dims.n_head, dims.key_dim, what="n_ctx",
                                 engine="the schedule model and the float64 reference")
    counts = {n: schedule.study_splits(n, splits, dims) for n in ctxs}
    if not any(schedule.splits_with_power(n, s) for n, s in counts.items()):
        # the study would run, and its verdict could only be "no power": say why up front
        given = ", ".join(f"{n} -> S = {s}" for n, s in counts.items())
        if splits != "auto" and int(splits) < 2:
            raise ValueError(f"--splits {splits}: one slice is the unsplit walk, so the split "
                             "path and its negative control would not run; give --splits of "
                             "at least 2, or 'auto'")
        if splits == "auto":
            first = next((n for n in (2 ** k for k in range(1, 21))
                          if schedule.splits_with_power(n, schedule.study_splits(n, "auto", dims))),
                         None)
            hint = (f"give a context of at least {first} positions (the split plan's gate)"
                    if first else "the split plan splits no context of this preset")
        else:
            hint = "give a context of at least 2 positions"
        raise ValueError(f"--ctx: no context splits into two or more non-empty slices ({given}), "
                         f"so the split path and its negative control would not run; {hint}")
    short = [n for n, s in counts.items()
             if schedule.splits_with_power(n, s) and -(-n // s) < MIN_SLICE]
    if short:
        most = min(-(-n // (MIN_SLICE - 1)) - 1 for n in short)
        fix = (f"give --splits <= {most}" if most >= 2 else
               f"leave out the contexts under {2 * MIN_SLICE - 1} positions, which cannot "
               f"split into slices of {MIN_SLICE}")
        raise ValueError(
            f"--splits {splits} leaves slices of fewer than {MIN_SLICE} positions at --ctx "
            f"{', '.join(map(str, short))}: there splitting shortens the f32 sums too little to "
            "beat the unsplit walk (one position a slice makes the split the combine alone, "
            "an n_ctx-term sum), so the study's accuracy-gain test can fail a correct "
            f"combine; {fix} ('auto' splits into slices of a tile or more)")
    raw = schedule.accuracy_study(list(ctxs), list(range(seeds)), splits=splits, dims=dims,
                                  cache_dtype=cache)
    verdict = schedule.judge_study(raw)
    tol = DEFAULT_TOLERANCE.latent
    rows = []
    for r in raw:
        applies = bool(r.control_applies)
        within = r.unsplit <= tol and r.split <= tol
        rejected = (r.split_no_rescale > tol) if applies else None
        rows.append({
            "n_ctx": r.n_ctx, "seed": r.seed, "splits": r.splits,
            "relL2_unsplit": r.unsplit, "relL2_split": r.split,
            "relL2_no_rescale": r.split_no_rescale if applies else None,
            "gain": r.gain if r.split > 0 else None,
            "split_ok": bool(within), "control_rejected": rejected,
            "ok": bool(within and rejected is not False),
        })
    return rows, {"ok": bool(verdict.ok), "problems": list(verdict.problems),
                  "median_gain": verdict.median_gain, "tolerance": tol,
                  "n_head": dims.n_head}


def _gpu_checks(variants, cache: str) -> list[dict]:
    """Hook (tests replace it): mlasandbox.device_check.device_checks on the device."""

    return device_checks(variants, cache=cache)


def _device_variants(variants) -> tuple[list[str], list[str]]:
    """(variants the device can run, 'name (needs sm_XX)' for the others)."""
    names = list(variants or registry.variant_names())
    try:
        arch = archs.check_arch(toolkit.arch_of_device())
    except Exception:  # an arch the table lacks, or none readable: each launch says
        return names, []
    run = [n for n in names if not archs.variant_needs(arch, n)]
    skipped = [f"{n} (needs {archs.variant_needs(arch, n)})" for n in names if n not in run]
    return run, skipped


@click.command()
@ctx_option(CHECK_CTXS, dest="ctxs",
            help="Context lengths of the schedule-model study, comma-separated.")
@click.option("--seeds", type=click.IntRange(1, MAX_SEEDS), default=CHECK_SEEDS,
              show_default=True,
              help="Seeds per context.")
@splits_option(help="Split count of the split schedule: 'auto' (the launch plan's) or S "
                    "(1..65535).")
@preset_option(STUDY_PRESET)
@cache_option()
@variants_option(help="Variants to check on the device (default: all).")
@click.option("--no-gpu", is_flag=True, help="Skip the GPU checks even where there is a device.")
@json_option
def check(ctxs, seeds, splits, preset, cache, variants, no_gpu, json_out):
    """Accuracy: the schedule model, and on a GPU every variant, against the float64 reference.

    Each check runs with its negative control (a combine without its exp(m_i - m) rescale),
    which must fail: a check that cannot fail has no power. Exit 1 when a check fails or a
    control passes, 2 on bad input.
    """
    ctx = click.get_current_context()
    if no_gpu and given_options(ctx, ["variants"]):
        raise click.UsageError("--variants picks the variants of the GPU checks, and --no-gpu "
                               "runs none: give one or the other")
    try:
        rows, verdict = cpu_accuracy(ctxs, seeds, splits, preset, cache)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    has_gpu, why = toolkit.device_available()
    gpu_rows, skipped = [], []
    if has_gpu and not no_gpu:
        run, skipped = _device_variants(variants)
        gpu_rows = _gpu_checks(run, cache)
    gpu_failed = [r for r in gpu_rows if not r["ok"]]
    ok = verdict["ok"] and not gpu_failed
    if gpu_rows:
        scope = f"the schedule model and {len(run)} variants on {why}"
    elif has_gpu:
        scope = "the CPU model only (--no-gpu)"
    else:
        scope = f"the CPU model only (no GPU: {why})"
    failed = [f"schedule model: {p}" for p in verdict["problems"]]
    failed += [f"GPU {r['name']}: {r.get('detail', '')}" for r in gpu_failed]
    data = {"ok": ok, "checked": scope, "schedule_model": {"rows": rows, **verdict},
            "gpu": gpu_rows, "gpu_not_run": skipped, "device": why if has_gpu else None,
            "no_device_reason": None if has_gpu else why, "failed": failed}
    if json_out == "-":
        render.emit_json(data)
    else:
        if json_out:
            write_json(data, json_out)
        _print(data, verdict, gpu_rows, skipped)
    if not ok:
        raise SystemExit(1)


def _print(data, verdict, gpu_rows, skipped) -> None:
    con = render.console()
    con.print(render.accuracy_table(
        data["schedule_model"]["rows"],
        f"schedule model (float32, {verdict['n_head']} heads) vs float64 reference, "
        f"relL2(latent), tolerance {verdict['tolerance']:.0e}; 'no rescale' is the negative "
        "control: it must fail"))
    gain = verdict["median_gain"]
    con.print(f"split vs unsplit: median {gain:.2f}x more accurate over the rows that split"
              if gain == gain else "no row split the context")
    if gpu_rows:
        con.print(render.gpu_checks_table(gpu_rows))
    for s in skipped:
        con.print(f"GPU check not run: {s}")
    for p in data["failed"]:
        con.print(f"[red]FAIL[/red] {render.escape(p)}")
    con.print(f"checked {render.escape(data['checked'])}")
    if data["ok"]:
        con.print("[green]all checks pass; the negative controls fail as they must[/green]")
    else:
        n = len(data["failed"])
        con.print(f"[red]checks FAILED[/red]: {n} failed check{'s' if n != 1 else ''} "
                  f"(listed above), first: {render.escape(data['failed'][0])}")
