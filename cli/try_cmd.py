"""`mlasandbox try FILE.cu`: compile, check, time and sweep a user kernel (docs/byok.md).

1. the compile report of every parameter set (NVRTC with -Xptxas -v, no GPU needed);
2. on a GPU, the correctness battery (sandbox/battery.py) on the first parameter set and its
   fast subset on the others; `--sanitize`: compute-sanitizer memcheck and racecheck over one
   case;
3. timing by the paged bench (cold L2, CUDA-graph replay, the A/A floor, the control phase)
   of every parameter set beside the built-in variant `auto` picks and the peers installed;
4. `--repro FILE`: the self-contained repro script with the kernel's source embedded.
Exit 0 when every check passes, 1 when one fails (named, with its worst position), 2 on bad
input.
"""
from __future__ import annotations

import os
import time

import click

from mlasandbox import limits, toolkit
from mlasandbox.occupancy import arch_limits
from mlasandbox.user_kernel import UserCompileError, compile_report, load_kernel

from . import render
from .options import (JsonAwareException, OutputFile, bad_input, int_list, json_option,
                      kernel_files, lengths_file, refuse_overwrites, require_gpu, seed_option,
                      write_json)


def _params(values) -> dict:
    out = {}
    for item in values or ():
        name, eq, vals = item.partition("=")
        name = name.strip()
        try:
            ints = tuple(int(v) for v in vals.split(","))
        except ValueError:
            eq = ""
        if not eq or not name:
            bad_input(f"--params {item!r}: expected NAME=v1,v2 (integers)")
        if name in out:
            bad_input(f"--params {name} is given more than once: list its values in one "
                      f"--params {name}=v1,v2")
        twice = [v for v in ints if ints.count(v) > 1]
        if twice:
            bad_input(f"--params {item!r}: {name}={twice[0]} is given twice")
        out[name] = ints
    return out


def _compile(path, params, arch):
    try:
        kernel = load_kernel(path)
        return kernel, compile_report(kernel, params_override=params, arch=arch)
    except ValueError as exc:  # HeaderError, or a file that is missing or unreadable
        bad_input(str(exc))
    except UserCompileError as exc:
        raise JsonAwareException(f"compile: {exc.summary}",
                                 {"check": "compile", "where": exc.where, "log": exc.log})


def _compile_table(rows):
    cols = [render.Column("params"), render.Column("registers", "right"),
            render.Column("spills", "right"), render.Column("code", "right"),
            render.Column("smem static+dyn", "right", drop=2),
            render.Column("threads", "right", drop=1), render.Column("blocks/SM", "right"),
            render.Column("limited by")]
    body = []
    for r in rows:
        spills = f"{r.spill_stores}+{r.spill_loads} B" if r.spill_stores or r.spill_loads else "0"
        step = "  <- occupancy step" if r.occupancy_step else ""
        body.append([",".join(f"{k}={v}" for k, v in r.params.items()) or "-",
                     str(r.registers), spills, render.fmt_bytes(r.code_bytes),
                     f"{r.static_smem}+{r.dynamic_smem} B",
                     str(r.threads), f"{r.blocks_per_sm}{step}", r.limiter])
    return render.FitTable(cols, body, title="compile (NVRTC -Xptxas -v)")


def _battery(kernel, sets, opts, say):
    from mlasandbox import battery

    rows_per_block = kernel.with_params(sets[0]).hpb
    heads = tuple(opts["heads"] or (16,))
    ctx = tuple(opts["ctx"] or battery.BOUNDARY_CONTEXTS)
    full = battery.battery_cases(heads, ctx, rows_per_block, opts["batch"], opts["lengths"])
    results = {}
    for i, params in enumerate(sets):
        k = kernel.with_params(params)
        cases = full if i == 0 and not opts["fast"] else battery.fast_cases(k.hpb)
        res = battery.run_battery(k, cases, seed=opts["seed"],
                                  progress=lambda r: say(
                                      f"  {'ok  ' if r.ok else 'FAIL'} {r.case.what}: "
                                      f"{r.case.label()}" + ("" if r.ok else
                                                            f"\n       {r.reason}\n       "
                                                            f"worst: {r.worst}")))
        results[k.name] = [r.as_dict() for r in res]
    return results


def _sanitize(kernel, say):
    from mlasandbox.battery import sanitize

    out = {}
    for tool in ("memcheck", "racecheck"):
        rep = sanitize(kernel, tool)
        out[tool] = rep
        say(f"  {'ok  ' if rep['ok'] else 'FAIL'} compute-sanitizer {tool}: {rep['summary']}")
    return out


def _timing(kernel, sets, opts, say):
    from mlasandbox.bench_paged import run_paged_bench
    from mlasandbox.paged_api import paged_variant

    heads = (opts["heads"] or (16,))[0]
    builtin = paged_variant("auto", 1, heads).name
    names = [kernel.with_params(p).name for p in sets] + [builtin]
    res = run_paged_bench(batch=opts["batch"] or 32, lengths=opts["lengths_spec"] or "4096",
                          heads=heads, variants=names, peers=("flashmla",),
                          max_repeats=opts["repeats"], min_repeats=min(10, opts["repeats"]),
                          progress=lambda label, advance=1: None)
    for w in res["warnings"]:
        say(f"  warning: {w}")
    return res


def _step_us(res) -> dict:
    """variant or peer -> its whole step's median: graph replay where timed, else events."""
    out: dict = {}
    for r in res["rows"]:
        if r["variant"] != "-" and (r["phase"] == "graph" or (
                r["phase"] == "step" and r["variant"] not in out)):
            out[r["variant"]] = r
    return out


def _sweep_table(kernel, rows, res):
    """Per parameter set: registers, blocks/SM (model and driver), the step's time and
    GB/s, against the built-in variant, with the noise floor's verdict."""
    from mlasandbox.noise import verdict

    steps = _step_us(res)
    floor = res["noise_floor"]["floor"]
    names = [kernel.with_params(r.params).name for r in rows]
    builtin = res["config"]["variants"][-1]     # _timing lists the user's sets, then it
    base = steps[builtin]["median_us"]
    cols = [render.Column("variant", fold=True), render.Column("registers", "right"),
            render.Column("blocks/SM", "right"), render.Column("step us", "right"),
            render.Column("GB/s", "right", drop=1), render.Column(f"vs {builtin}")]
    body = []
    for r, name in zip(rows, names):
        t = steps.get(name)
        if t is None:
            continue
        v = verdict(t["median_us"], base, floor or 0.0).text
        mark = " <- occupancy step" if r.occupancy_step else ""
        body.append([name, str(r.registers), f"{r.blocks_per_sm}{mark}",
                     f"{t['median_us']:.2f}", f"{t.get('GBps_ideal') or 0:.0f}", v])
    for name, t in steps.items():
        if name not in names:
            body.append([name, "-", "-", f"{t['median_us']:.2f}",
                         f"{t.get('GBps_ideal') or 0:.0f}", "" if name == builtin else
                         verdict(t["median_us"], base, floor or 0.0).text])
    caption = (f"A/A floor {floor:.1%}" if floor is not None else "no valid A/A floor")
    ctl = res.get("control") or {}
    if ctl.get("drift") is not None:
        caption += f"; control phase q_absorb drift {ctl['drift']:+.1%}"
    if ctl.get("warning"):
        caption += f"; control phase: {ctl['warning']}"
    return render.FitTable(cols, body, title="sweep (cold L2, graph replay)", caption=caption)


def _run(path, opts, say):
    arch = opts["arch"]
    ok_dev, why = toolkit.device_available()
    if arch is None:
        arch = toolkit.device_properties()["arch"] if ok_dev else "sm_90"
    kernel, rows = _compile(path, opts["params"], arch)
    sets = [r.params for r in rows]
    data = {"file": path, "kind": kernel.kind, "arch": arch,
            "compile": [r.as_dict() for r in rows], "ok": True, "failed": []}
    if not opts["quiet"]:
        render.console().print(_compile_table(rows))
    if opts["repro"]:
        from mlasandbox.user_repro import make_user_case, write_user_script

        try:
            case = make_user_case(kernel.with_params(sets[0]),
                                  heads=(opts["heads"] or (16,))[0],
                                  blocks_per_sm=rows[0].blocks_per_sm,
                                  command=f"mlasandbox try {path} --repro {opts['repro']}")
        except ValueError as exc:
            bad_input(f"--repro: {exc}")
        data["repro"] = write_user_script(case, opts["repro"])
        say(f"repro script: {data['repro']}")
    if not ok_dev:
        data["device"] = None
        data["skipped"] = f"battery and timing not run: {why}"
        say(data["skipped"])
        return data
    say("battery (float64 reference, NaN-poisoned outputs and partials, sync guard):")
    data["battery"] = _battery(kernel, sets, opts, say)
    for name, res in data["battery"].items():
        for r in res:
            if not r["ok"]:   # the whole reason is in the battery's lines and the JSON
                why = ", ".join(r["failed"]) if r["failed"] else r["reason"]
                data["failed"].append(f"{name}: {r['what']} ({r['case']}): {why}; worst: "
                                      f"{r['worst']}")
    if opts["sanitize"]:
        say("compute-sanitizer:")
        data["sanitize"] = _sanitize(kernel.with_params(sets[0]), say)
        data["failed"] += [f"compute-sanitizer {t}: {r['summary']}"
                           for t, r in data["sanitize"].items() if not r["ok"]]
    if not data["failed"] and opts["time"]:
        say("timing (paged bench: cold L2, graph replay, A/A floor, control phase):")
        data["timing"] = _timing(kernel, sets, opts, say)
        data["failed"] += [f"bench check of {c['variant']}: {c.get('detail', '')}"
                           for c in data["timing"]["checks"]
                           if not c["ok"] and c.get("kind") == "variant"]
        if not opts["quiet"]:
            render.console().print(_sweep_table(kernel, rows, data["timing"]))
    data["ok"] = not data["failed"]
    return data


@click.command("try")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--params", "params", multiple=True, metavar="NAME=v1,v2",
              help="Parameter values to compile and sweep instead of the header's.")
@click.option("--heads", callback=int_list, default=None, help="Head counts of the battery's "
              "context cases; the first is the timing's (default 16).")
@click.option("--ctx", callback=int_list, default=None,
              help="Contexts of the battery (default 1,4095,4096,4097,12289,20000).")
@click.option("--batch", type=click.IntRange(1, 65535), default=None,
              help="Batch of the timing and of one more battery case.")
@click.option("--lengths", default=None, help="Request lengths: N, N,N,... or "
              "normal:MEAN:STD or @FILE (with --batch).")
@click.option("--sanitize", is_flag=True, help="compute-sanitizer memcheck and racecheck "
              "over one case (where compute-sanitizer is installed).")
@click.option("--repro", type=OutputFile(), default=None, metavar="FILE",
              help="Write the repro script here.")
@click.option("--watch", is_flag=True, help="Re-run the compile and the fast checks on every "
              "save of FILE (Ctrl-C stops).")
@click.option("--no-time", "no_time", is_flag=True, help="Check only, no timing.")
@click.option("--repeats", type=click.IntRange(5, 100000), default=200, show_default=True,
              help="Timed repeats per measurement, at most.")
@seed_option(None, help="Battery seed (default: a fresh one).")
@click.option("--arch", default=None, help="Compile report arch (default: the device's, "
              "else sm_90).")
@json_option
def try_(file, params, heads, ctx, batch, lengths, sanitize, repro, watch, no_time, repeats,
         seed, arch, json_out):
    """Compile, check, time and sweep a user kernel FILE.cu (docs/byok.md)."""
    if not os.path.exists(file):
        bad_input(f"FILE {file}: no such file")
    if lengths is not None and batch is None:
        bad_input("--lengths needs --batch")
    refuse_overwrites([*kernel_files("FILE", file), ("--lengths", lengths_file(lengths))],
                      [("--repro", repro), ("--json", json_out)])
    for opt, vals, low in (("--heads", heads, 1), ("--ctx", ctx, 0)):
        if vals and min(vals) < low:
            bad_input(f"{opt} must be integers >= {low}, got {min(vals)}")
    try:  # the kernels' int32 limits, as every command states them
        limits.check_problem(n_ctx=max(ctx) if ctx and max(ctx) else None,
                             n_head=max(heads) if heads else None,
                             names={"n_ctx": "--ctx", "n_head": "--heads"})
    except ValueError as exc:
        bad_input(str(exc))
    if arch is not None:
        try:
            toolkit.check_arch(arch)
            arch_limits(arch)
        except ValueError as exc:
            bad_input(f"--arch: {exc}")
    if watch and json_out:  # a loop that never ends has no one JSON document to give
        bad_input("--watch runs until interrupted and prints a verdict a change; it takes no "
                  "--json")
    lens = None
    if lengths is not None:
        from mlasandbox.paged_inputs import parse_lengths

        try:
            lens = [int(x) for x in parse_lengths(lengths, batch, 0)]
        except ValueError as exc:
            bad_input(f"--lengths: {exc}")
    if repro:   # the script's case (its default batch, --heads' first) sized before any compile
        from mlasandbox.user_repro import check_user_case

        try:
            check_user_case(heads=(heads or (16,))[0])
        except ValueError as exc:
            bad_input(f"--repro: {exc}")
    if sanitize:
        _sanitizer_ready()
    opts = {"params": _params(params), "heads": heads, "ctx": ctx, "batch": batch,
            "lengths": lens, "lengths_spec": lengths, "sanitize": sanitize, "repro": repro,
            "time": not no_time and not watch, "repeats": repeats, "seed": seed, "arch": arch,
            "fast": watch, "quiet": json_out == "-"}
    con = render.console()
    say = (lambda text: None) if json_out == "-" else con.print
    if watch:
        return _watch(file, opts, say)
    data = _run(file, opts, say)
    if json_out and json_out != "-":
        write_json(data, json_out)
    if not data["ok"]:   # under --json the group prints data with the error
        raise JsonAwareException("FAILED: " + " | ".join(data["failed"]), data)
    if json_out == "-":
        render.emit_json(data)
    say(_verdict(data))


def _sanitizer_ready() -> None:
    """--sanitize runs compute-sanitizer over the kernel on a GPU: without either, exit 2
    before any work rather than report a check that never ran."""
    from mlasandbox.battery import sanitizer_path

    require_gpu("--sanitize runs the kernel under compute-sanitizer on a GPU")
    if sanitizer_path() is None:
        bad_input("--sanitize: compute-sanitizer is not installed here (not on PATH nor in "
                  "/usr/local/cuda/bin); install it (the CUDA toolkit's) or leave --sanitize out")


def _verdict(data) -> str:
    if not data["ok"]:
        return "FAILED: " + " | ".join(data["failed"])
    return "compiled; nothing checked on a GPU" if data.get("skipped") else "PASS"


def _watch(file, opts, say, rounds: int | None = None, poll_s: float = 0.5):
    """Re-run on every change of FILE's modification time; `rounds` runs (None: forever)."""
    last = None
    while rounds is None or rounds > 0:
        try:
            mtime = os.path.getmtime(file)
        except OSError:  # an editor saving by rename: the file is back at the next poll
            mtime = last
        if mtime != last:
            last = mtime
            rounds = None if rounds is None else rounds - 1
            say(f"--- {time.strftime('%H:%M:%S')} {file}")
            try:
                data = _run(file, opts, say)
                say(_verdict(data))
            except click.ClickException as exc:
                say(f"error: {exc.format_message()}")
        if rounds != 0:
            time.sleep(poll_s)
