"""Dump the PTX of every registry kernel instance, or compare two dumps, byte for byte.

    python tools/ptx_digest.py dump DIR [--arch sm_90]
    python tools/ptx_digest.py compare BEFORE AFTER

`dump` compiles each instance in a program of its own through NVRTC, with the options the
runtime uses (toolkit.compile_options plus what cupy.RawModule adds: -ftz=true and
--device-as-default-execution-space; CuPy picks the arch), and writes DIR/<name>.ptx with
the kernel's lowered name replaced by `KERNEL`, so that a change of template spelling that
changes only the mangled name compares equal. Besides the registry instances it compiles the
attention kernels with the defines the memory ablation and the negative controls use, and
ceiling_fma.cu; an sm_90a instance is compiled for sm_90a when ARCH is sm_90, and left out
(with a line saying so) for any other ARCH. A refactor that must not change machine code dumps before and after and
runs `compare`, which ignores only NVRTC's header comments and the hashed name NVRTC gives
the program's internal-linkage namespace (it changes with any edit of the source, comments
included). `compare` checks every file of BEFORE; files only AFTER has (instances added
since) are listed, not failed. No GPU is needed.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from cupy.cuda import nvrtc

from mlasandbox import registry, toolkit
from mlasandbox.sources import read_source

RUNTIME_EXTRA = ("-ftz=true", "--device-as-default-execution-space")
ATTENTION_DEFINES = ((), ("MLA_ABLATE_CACHE_LOADS",), ("MLA_LAZY_LOG2=1e30f",))
ATTENTION_SOURCES = ("mla_attn_rows.cu", "mla_attn.cu", "mla_attn_tiled.cu", "mla_mma.cu")


def compile_ptx(source: str, expression: str | None, arch: str, defines=()) -> str:
    opts = list(toolkit.compile_options(arch, extra=RUNTIME_EXTRA + tuple(
        f"-D{d}" for d in defines)))
    prog = nvrtc.createProgram(source, "kernel.cu", [], [])
    try:
        if expression:
            nvrtc.addNameExpression(prog, expression)
        try:
            nvrtc.compileProgram(prog, opts)
        except Exception as exc:
            raise RuntimeError(f"{expression}: {exc}\n{nvrtc.getProgramLog(prog)}") from None
        ptx = nvrtc.getPTX(prog).rstrip(b"\x00").decode()
        if expression:
            ptx = ptx.replace(nvrtc.getLoweredName(prog, expression), "KERNEL")
    finally:
        nvrtc.destroyProgram(prog)
    return ptx


def _file_name(name: str, defines) -> str:
    stem = re.sub(r"[^A-Za-z0-9_.=,-]+", "_", name)
    if defines:
        stem += "__" + "__".join(re.sub(r"[^A-Za-z0-9_.=-]+", "_", d) for d in defines)
    return stem + ".ptx"


def dump(out_dir: Path, arch: str) -> int:
    out_dir.mkdir(parents=True, exist_ok=True)
    n = 0
    for inst in registry.all_instances():
        # An arch-specific instance (sm_90a: wgmma) is built for its own target where ARCH
        # is its base, and left out otherwise (its source stops at an #error elsewhere).
        target = arch
        if inst.min_arch.endswith("a"):
            if inst.min_arch[:-1] != arch:
                print(f"left out: {inst.name} (needs {inst.min_arch})")
                continue
            target = inst.min_arch
        sets = ATTENTION_DEFINES if inst.source in ATTENTION_SOURCES else ((),)
        for defines in sets:
            ptx = compile_ptx(read_source(inst.source), inst.expression, target, defines)
            (out_dir / _file_name(inst.name, defines)).write_text(ptx)
            n += 1
    (out_dir / "fma_ceiling.ptx").write_text(
        compile_ptx(read_source("ceiling_fma.cu"), None, arch))
    return n + 1


# NVRTC's header comments, and the name it gives the program's internal-linkage namespace
# (a hash that changes with the source text, comments included).
_HEADER = re.compile(r"^//.*\n", re.MULTILINE)
_INTERNAL = re.compile(r"_ZN\d+_INTERNAL_[0-9a-f]+_\d+_kernel_cu_[0-9a-f]+_\d+")


def normalize(ptx: str) -> str:
    return _INTERNAL.sub("_ZN_INTERNAL_", _HEADER.sub("", ptx))


def compare(before: Path, after: Path) -> int:
    a = {p.name: normalize(p.read_text()) for p in before.glob("*.ptx")}
    b = {p.name: normalize(p.read_text()) for p in after.glob("*.ptx")}
    bad = sorted(set(a) - set(b)) + sorted(k for k in set(a) & set(b) if a[k] != b[k])
    for k in bad:
        print(f"differs or missing: {k}")
    for k in sorted(set(b) - set(a)):
        print(f"new (not compared): {k}")
    if bad:
        return 1
    print(f"PTX identical for {len(a)} instances")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("dir", type=Path)
    d.add_argument("--arch", default="sm_90")
    c = sub.add_parser("compare")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "dump":
        print(f"wrote {dump(args.dir, args.arch)} PTX files to {args.dir}")
        return 0
    return compare(args.before, args.after)


if __name__ == "__main__":
    sys.exit(main())
