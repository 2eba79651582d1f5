"""`mlasandbox`: the click + rich front end.

Every command takes `--json [FILE]` (machine-readable output on stdout, or into FILE) and
exits non-zero on failure: 1 when a check or a compile fails, 2 on bad input (with `--json`
on stdout, click's own usage errors print the JSON error object too). The commands are
thin: the logic lives in the library, the tables in render.py; each command has its module.
"""
from __future__ import annotations

import platform
from importlib import metadata

import click

from mlasandbox import arch_specific, toolkit
from mlasandbox.kernels import cupy_caches_name_expressions

from . import render
from .ablate_cmd import ablate
from .bench_cmd import bench
from .check_cmd import check
from .new_cmd import new
from .options import json_option, write_json
from .regs_cmd import grid, regs
from .repro_cmd import repro
from .stalls_cmd import stalls
from .sweep_cmd import sweep
from .try_cmd import try_


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _json_on_stdout(args) -> bool:
    """Whether the raw arguments of a command ask for JSON on stdout (`--json` bare)."""
    args = list(args)
    for i, a in enumerate(args):
        if a == "--json":
            nxt = args[i + 1] if i + 1 < len(args) else None
            return nxt is None or nxt == "-" or nxt.startswith("-")
        if a == "--json=-":
            return True
    return False


class Group(click.Group):
    """The command group: a usage error or a failure of any command, click's own parsing
    errors included, also prints {"ok": false, "error": ...} on stdout under `--json`."""

    @staticmethod
    def _refuse_bad_toolkit_setting(args) -> None:
        """A MLASANDBOX_CUDA_INCLUDE without the headers, or a MLASANDBOX_CUBIN_CACHE that
        cannot hold cubins, is bad input (exit 2) for every command but `info`, which
        reports it among its problems, and `--help`."""
        args = list(args)
        if not args or args[0] == "info" or {"--help", "-h"} & set(args):
            return
        problem = toolkit.include_setting_problem() or arch_specific.cache_setting_problem()
        if problem:
            raise click.UsageError(problem)

    def parse_args(self, ctx, args):
        ctx.meta["mlasandbox.raw_args"] = list(args)
        return super().parse_args(ctx, args)

    def invoke(self, ctx):
        try:
            self._refuse_bad_toolkit_setting(ctx.meta.get("mlasandbox.raw_args", ()))
            return super().invoke(ctx)
        except click.ClickException as exc:
            if _json_on_stdout(ctx.meta.get("mlasandbox.raw_args", ())):
                payload = getattr(exc, "payload", None) or {}
                render.emit_json({**payload, "ok": False, "error": exc.format_message()})
            raise


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
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
    tk["cubin_cache"] = str(arch_specific.cache_path())    # where sm_90a kernels are kept
    problem = arch_specific.cache_setting_problem()
    if problem:
        info["problems"].append(problem)
    try:
        tk["cupy_caches_name_expressions"] = bool(cupy_caches_name_expressions())
    except Exception:
        tk["cupy_caches_name_expressions"] = None
    ok, why = toolkit.device_available()
    if ok:
        try:
            info["device"] = toolkit.device_properties()
        except Exception as exc:  # listed but unusable: say so, no traceback
            info["device"] = None
            info["device_reason"] = f"{why}, but its properties could not be read: {exc}"
    else:
        info["device"] = None
        info["device_reason"] = why
    info["ok"] = not info["problems"]
    return info


@main.command()
@json_option
def info(json_out):
    """Versions, NVRTC and CUDA headers, and the device (or why there is none)."""
    data = collect_info()
    if json_out == "-":
        render.emit_json(data)
    else:
        if json_out:
            write_json(data, json_out)
        con = render.console()
        con.print(render.kv_table("versions", data["versions"].items()))
        tk = data["toolkit"]
        con.print(render.kv_table("compile-only toolkit (NVRTC)", [
            ("NVRTC", tk.get("nvrtc") or "MISSING"),
            ("CUDA include dirs", "\n".join(tk.get("include_dirs") or []) or "MISSING"),
            ("headers version", tk.get("headers_version")),
            ("CuPy caches name expressions", tk.get("cupy_caches_name_expressions")),
            ("sm_90a cubin cache", tk.get("cubin_cache")),
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


for _cmd in (bench, sweep, regs, grid, check, repro, ablate, stalls, new, try_):
    main.add_command(_cmd)


if __name__ == "__main__":  # pragma: no cover
    main()
