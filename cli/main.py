"""`mlasandbox`: the click + rich front end.

Every command takes `--json` (machine-readable output on stdout) and exits non-zero on
failure: 1 when a check or a compile fails, 2 on bad input. The commands are thin: the
logic lives in the library (toolkit, ptxas, geometry, schedule), the tables in render.py.
"""
from __future__ import annotations

import platform
from importlib import metadata

import click

from mlasandbox.dims import PRESETS

from . import render
from .lab_options import auto_or_int, int_list, str_list

PRESET_NAMES = tuple(PRESETS)

# The schedule model's default study: the gate (4095/4096/4097), the next boundaries
# (12287/12288/12289) and the lecture's 20000, several seeds (issue 2).
CHECK_CTXS = (1, 4095, 4096, 4097, 12287, 12288, 12289, 20000)
CHECK_SEEDS = 3
BENCH_CTXS = (4096, 20000)  # what `bench` shows of the accuracy study where there is no GPU
HOW_TO_TIME = ("Timings need a CUDA GPU: run `mlasandbox bench` on a machine with one "
               "(an NVIDIA driver and a CuPy wheel matching it: cupy-cuda13x for CUDA 13 "
               "drivers, cupy-cuda12x for CUDA 12).")


def _json_option(f):
    return click.option("--json", "as_json", is_flag=True,
                        help="Print machine-readable JSON on stdout instead of tables.")(f)


def _bad_input(msg: str, as_json: bool):
    """Exit 2 with `msg` (and a JSON error object on stdout under --json)."""
    if as_json:
        render.emit_json({"ok": False, "error": msg})
    raise click.UsageError(msg)


def _failure(msg: str, as_json: bool, payload: dict | None = None):
    """Exit 1 with `msg`."""
    if as_json:
        render.emit_json({**(payload or {}), "ok": False, "error": msg})
    raise click.ClickException(msg)


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(_version("mlasandbox") or "unknown", prog_name="mlasandbox")
def main():
    """A CuPy kernel sandbox for MLA decode attention: where the time goes as context grows."""


# ---------------------------------------------------------------------------- info

def _cupy_dist() -> tuple[str | None, str | None]:
    for dist in ("cupy-cuda13x", "cupy-cuda12x", "cupy-cuda11x", "cupy"):
        v = _version(dist)
        if v:
            return dist, v
    return None, None


def collect_info() -> dict:
    from mlasandbox import toolkit

    dist, cupy_v = _cupy_dist()
    info: dict = {
        "versions": {
            "mlasandbox": _version("mlasandbox"), "python": platform.python_version(),
            "numpy": _version("numpy"), "cupy": cupy_v, "cupy_package": dist,
            "click": _version("click"), "rich": _version("rich"),
            "ml_dtypes": _version("ml_dtypes"),
            "nvidia-cuda-nvrtc": _version("nvidia-cuda-nvrtc") or _version(
                "nvidia-cuda-nvrtc-cu12"),
            "nvidia-cuda-runtime": _version("nvidia-cuda-runtime") or _version(
                "nvidia-cuda-runtime-cu12"),
        },
        "toolkit": {}, "problems": [],
    }
    tk = info["toolkit"]
    try:
        tk["nvrtc"] = "%d.%d" % toolkit.nvrtc_version()
    except Exception as exc:
        tk["nvrtc"] = None
        info["problems"].append(str(exc))
    try:
        tk["include_dirs"] = toolkit.cuda_include_dirs()
        hv = toolkit.headers_version(tk["include_dirs"][0])
        tk["headers_version"] = "%d.%d" % hv if hv else None
    except Exception as exc:
        tk["include_dirs"] = []
        tk["headers_version"] = None
        info["problems"].append(str(exc))
    try:
        from mlasandbox.kernels import cupy_caches_name_expressions

        tk["cupy_caches_name_expressions"] = bool(cupy_caches_name_expressions())
    except Exception:
        tk["cupy_caches_name_expressions"] = None
    ok, why = toolkit.device_available()
    if ok:
        try:
            info["device"] = toolkit.device_info()
        except Exception as exc:  # listed but unusable: say so, no traceback
            info["device"] = None
            info["device_reason"] = f"{why}, but its properties could not be read: {exc}"
    else:
        info["device"] = None
        info["device_reason"] = why
    info["ok"] = not info["problems"]
    return info


@main.command()
@_json_option
def info(as_json):
    """Versions, NVRTC and CUDA headers, and the device (or why there is none)."""
    data = collect_info()
    if as_json:
        render.emit_json(data)
    else:
        con = render.console()
        con.print(render.kv_table("versions", data["versions"].items()))
        tk = data["toolkit"]
        con.print(render.kv_table("compile-only toolkit (NVRTC)", [
            ("NVRTC", tk.get("nvrtc") or "MISSING"),
            ("CUDA include dirs", "\n".join(tk.get("include_dirs") or []) or "MISSING"),
            ("headers version", tk.get("headers_version")),
            ("CuPy caches name expressions", tk.get("cupy_caches_name_expressions")),
        ]))
        dev = data["device"]
        if dev:
            con.print(render.kv_table("device", [
                ("name", dev["name"]), ("arch", dev["arch"]), ("SMs", dev["sms"]),
                ("L2", render.fmt_bytes(dev["l2_bytes"])),
                ("memory", render.fmt_bytes(dev["global_mem_bytes"])),
                ("smem/block (opt-in)", render.fmt_bytes(dev["smem_per_block_optin"])),
                ("driver / runtime", f"{dev['driver_version']} / {dev['runtime_version']}"),
            ]))
        else:
            con.print(f"device: none ({data['device_reason']})")
        for p in data["problems"]:
            con.print(f"[red]problem:[/red] {p}")
    if not data["ok"]:
        raise SystemExit(1)


# ---------------------------------------------------------------------------- regs

def _regs_rows(arch, hpbs, caches, qs, controls):
    from mlasandbox import geometry, toolkit

    toolkit.check_arch(arch)
    return geometry.resource_rows(arch, hpbs=hpbs, caches=caches, q_dtypes=qs,
                                  controls=controls)


def _compile_errors():
    from mlasandbox.ptxas import NvrtcCompileError, PtxasParseError
    from mlasandbox.toolkit import ToolkitError

    # RuntimeError: also a missing piece of the library (e.g. the occupancy calculator)
    return (ToolkitError, NvrtcCompileError, PtxasParseError, RuntimeError)


@main.command()
@click.option("--arch", default="sm_90", show_default=True,
              help="Real architecture to compile for (sm_80, sm_86, sm_89, sm_90, ...).")
@click.option("--hpb", "hpbs", callback=int_list, default=None,
              help="Heads per block to show, comma-separated (default: all instantiated).")
@click.option("--cache", "caches", callback=str_list(("f16", "bf16")), default="f16,bf16",
              show_default=True, help="Cache dtypes.")
@click.option("--q", "qs", callback=str_list(("f32", "cache")), default="f32,cache",
              show_default=True, help="q dtypes: f32 and/or the cache dtype.")
@click.option("--no-controls", is_flag=True,
              help="Leave out the negative-control combine (no rescale).")
@_json_option
def regs(arch, hpbs, caches, qs, no_controls, as_json):
    """ptxas registers, spills, smem and theoretical occupancy of every kernel instance.

    A real NVRTC compile with -Xptxas -v for ARCH: needs no GPU.
    """
    from mlasandbox.registry import HPB_VALUES

    hpbs = hpbs or HPB_VALUES
    try:
        rows = _regs_rows(arch, hpbs, caches, qs, not no_controls)
    except _compile_errors() as exc:
        _failure(str(exc), as_json)
    except ValueError as exc:
        _bad_input(str(exc), as_json)
    if as_json:
        render.emit_json({"ok": True, "arch": arch, "rows": rows})
    else:
        render.console().print(render.regs_table(rows, arch))


# ---------------------------------------------------------------------------- grid

@main.command()
@click.option("--variant", "variant_name", required=True,
              help="per_head, split, batched<HPB> (or batched with --hpb).")
@click.option("--heads", type=click.IntRange(min=1), required=True, help="Query heads.")
@click.option("--ctx", type=click.IntRange(min=1), required=True, help="Context length n_ctx.")
@click.option("--splits", callback=auto_or_int, default="auto", show_default=True,
              help="'auto' (the split rule) or a split count S >= 1.")
@click.option("--hpb", type=int, default=None, help="Heads per block (for --variant batched).")
@click.option("--sms", type=click.IntRange(min=1), default=132, show_default=True,
              help="SM count (132: H100 SXM / H200).")
@click.option("--blocks-per-sm", "bps", callback=auto_or_int, default="auto",
              show_default=True,
              help="Resident blocks per SM: 'auto' compiles the instance and takes its "
                   "theoretical occupancy (~0.3 s, no GPU), or give k.")
@click.option("--arch", default="sm_90", show_default=True, help="Arch for 'auto' occupancy.")
@click.option("--cache", type=click.Choice(["f16", "bf16"]), default="f16", show_default=True)
@click.option("--q", "q_dtype", type=click.Choice(["f32", "f16", "bf16"]), default="f32",
              show_default=True)
@_json_option
def grid(variant_name, heads, ctx, splits, hpb, sms, bps, arch, cache, q_dtype, as_json):
    """Launch geometry of a variant: grid, blocks vs SMs, waves, idle SMs, work per block."""
    from mlasandbox import geometry, toolkit

    try:
        toolkit.check_arch(arch)
        g = geometry.grid_report(variant_name, heads, ctx, splits=splits, hpb=hpb, sms=sms,
                                 blocks_per_sm=bps, arch=arch, cache=cache, q=q_dtype)
    except _compile_errors() as exc:
        _failure(f"{exc}\n(pass --blocks-per-sm k to skip the compile)", as_json)
    except ValueError as exc:
        _bad_input(str(exc), as_json)
    if as_json:
        render.emit_json({"ok": True, **g})
    else:
        render.console().print(render.grid_table(g))


# ---------------------------------------------------------------------------- check

def cpu_accuracy(ctxs, seeds, splits="auto", preset: str | None = None,
                 cache: str = "f16") -> tuple[list[dict], dict]:
    """The schedule model's study and verdict (mlasandbox.schedule), as plain rows.

    Per row: the three relL2(latent) figures against the float64 reference and display flags
    against the latent tolerance; the verdict (ok, problems, median gain) is judge_study's.
    """
    try:
        from mlasandbox import schedule
        from mlasandbox.compare import DEFAULT_TOLERANCE
        from mlasandbox.dims import preset as get_preset
    except ImportError as exc:
        raise RuntimeError(f"the schedule model (mlasandbox.schedule) is not available: "
                           f"{exc}") from exc
    kwargs = {"cache_dtype": cache}
    if preset:
        kwargs["dims"] = get_preset(preset)
    raw = schedule.accuracy_study(list(ctxs), list(range(seeds)), splits=splits, **kwargs)
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
                  "median_gain": verdict.median_gain, "tolerance": tol}


def _gpu_checks(as_json: bool) -> list[dict]:
    """Hook: run the CUDA variants against the float64 reference on the device.

    Returns rows like {"name", "ok", "detail"}; [] until the GPU checks are written.
    Called by `check` only when toolkit.device_available() says there is a device.
    """
    return []


@main.command()
@click.option("--ctx", "ctxs", callback=int_list, default=",".join(map(str, CHECK_CTXS)),
              show_default=True, help="Context lengths, comma-separated.")
@click.option("--seeds", type=click.IntRange(min=1), default=CHECK_SEEDS, show_default=True,
              help="Seeds per context.")
@click.option("--splits", callback=auto_or_int, default="auto", show_default=True,
              help="Split count of the split schedule ('auto': the launch plan's).")
@click.option("--preset", type=click.Choice(sorted(PRESET_NAMES)), default=None,
              help="Head dims preset (default: lecture-tp8, 12 heads, as the lecture's tests).")
@click.option("--cache", type=click.Choice(["f16", "bf16"]), default="f16", show_default=True)
@click.option("--no-gpu", is_flag=True, help="Skip the GPU checks even where there is a device.")
@_json_option
def check(ctxs, seeds, splits, preset, cache, no_gpu, as_json):
    """Accuracy: the schedule model against the float64 reference, with its negative control.

    Fails (exit 1) if a real check fails, or if the negative control (a combine without its
    exp(m_i - m) rescale) passes: a check that cannot fail has no power.
    """
    from mlasandbox import toolkit

    if any(c < 1 for c in ctxs):
        _bad_input(f"--ctx values must be >= 1, got {', '.join(map(str, ctxs))}", as_json)
    try:
        rows, verdict = cpu_accuracy(ctxs, seeds, splits, preset, cache)
    except ValueError as exc:
        _bad_input(str(exc), as_json)
    except RuntimeError as exc:
        _failure(str(exc), as_json)
    has_gpu, why = toolkit.device_available()
    gpu_rows = _gpu_checks(as_json) if (has_gpu and not no_gpu) else []
    gpu_failed = [r for r in gpu_rows if not r["ok"]]
    ok = verdict["ok"] and not gpu_failed
    data = {"ok": ok, "schedule_model": {"rows": rows, **verdict}, "gpu": gpu_rows,
            "device": why if has_gpu else None, "no_device_reason": None if has_gpu else why}
    if as_json:
        render.emit_json(data)
    else:
        con = render.console()
        con.print(render.accuracy_table(
            rows, f"schedule model (float32) vs float64 reference, relL2(latent), tolerance "
                  f"{verdict['tolerance']:.0e}; 'no rescale' is the negative control: it must "
                  "fail"))
        gain = verdict["median_gain"]
        con.print(f"split vs unsplit: median {gain:.2f}x more accurate over the rows that split"
                  if gain == gain else "no row split the context")
        if gpu_rows:
            con.print(render.kv_table("GPU checks", [(r["name"], ("ok" if r["ok"] else "FAIL")
                                                      + f"  {r.get('detail', '')}")
                                                     for r in gpu_rows]))
        elif not has_gpu:
            con.print(f"GPU checks: not run ({why})")
        elif no_gpu:
            con.print("GPU checks: skipped (--no-gpu)")
        for p in verdict["problems"]:
            con.print(f"[red]FAIL[/red] {p}")
        for r in gpu_failed:
            con.print(f"[red]FAIL[/red] GPU {r['name']}: {r.get('detail', '')}")
        con.print("[green]all checks pass; the negative control fails as it must[/green]" if ok
                  else "[red]checks FAILED[/red]")
    if not ok:
        raise SystemExit(1)


# ---------------------------------------------------------------------------- bench

def _run_gpu_bench(**opts):
    """Hook: the timed benchmark, mlasandbox.bench.run_bench, imported only with a GPU."""
    try:
        from mlasandbox.bench import run_bench
    except ImportError as exc:
        raise click.ClickException(
            f"this build has no timed benchmark yet (mlasandbox.bench: {exc})") from exc
    return run_bench(**opts)


@main.command()
@click.option("--arch", default="sm_90", show_default=True,
              help="Arch for the register table when there is no GPU.")
@click.option("--require-gpu", is_flag=True, help="Exit 1 when there is no GPU to time on.")
@_json_option
def bench(arch, require_gpu, as_json):
    """Time the variants over a depth curve (GPU). Without a GPU: says so, shows what runs."""
    from mlasandbox import toolkit

    has_gpu, why = toolkit.device_available()
    if has_gpu:
        result = _run_gpu_bench(as_json=as_json)
        if as_json and result is not None:
            render.emit_json(result)
        return
    data: dict = {"ok": True, "device": None, "no_device_reason": why, "timings": None,
                  "how_to_time": HOW_TO_TIME, "regs": None, "accuracy": None, "problems": []}
    try:
        from mlasandbox.registry import HPB_VALUES

        data["regs"] = {"arch": arch, "rows": _regs_rows(arch, HPB_VALUES, ("f16", "bf16"),
                                                         ("f32",), False)}
    except Exception as exc:
        data["problems"].append(f"register report: {exc}")
    try:
        rows, verdict = cpu_accuracy(BENCH_CTXS, 1, "auto")
        data["accuracy"] = {"rows": rows, **verdict}
        data["problems"] += [f"schedule-model accuracy: {p}" for p in verdict["problems"]]
    except Exception as exc:
        data["problems"].append(f"schedule-model accuracy: {exc}")
    data["ok"] = not data["problems"] and not require_gpu
    if as_json:
        render.emit_json(data)
    else:
        con = render.console()
        con.print(f"[bold]No GPU here, so no timings.[/bold] {why}")
        con.print("What runs without one:")
        if data["regs"]:
            con.print(render.regs_table(data["regs"]["rows"], arch))
        if data["accuracy"]:
            con.print(render.accuracy_table(
                data["accuracy"]["rows"],
                "schedule model accuracy, relL2(latent) vs float64 (full study: mlasandbox "
                "check)"))
        for p in data["problems"]:
            con.print(f"[red]problem:[/red] {p}")
        con.print(HOW_TO_TIME)
    if data["problems"]:
        raise SystemExit(1)
    if require_gpu:
        raise click.ClickException(f"--require-gpu: {why}")


# ---------------------------------------------------------------------------- lab commands
# (issue 4) The timed `bench` (it keeps the command above for the no-GPU case), `sweep` and
# `repro` live in their own modules; see cli/lab.py.
from .lab import register as _register_lab_commands  # noqa: E402

_register_lab_commands(main)


if __name__ == "__main__":  # pragma: no cover
    main()
