"""Per-kernel resources from ptxas, through NVRTC with `-Xptxas -v`, for an explicit arch.

NVRTC runs ptxas when it targets a real architecture (`sm_XX`) and, with `-Xptxas -v`,
prints ptxas's report into the program log. That needs the NVRTC library and the CUDA
headers but no GPU, so the report works in CI. Every call is a real compile: a module
loaded from CuPy's cache prints no log, so nothing here goes through `cupy.RawModule`.

The log looks like this (CUDA 12/13; sm_80 also prints `N bytes cmem[0]`, sm_90+ does not;
`N bytes smem` is omitted when a kernel has no static shared memory):

    ptxas info    : Compiling entry function '_ZN3mla4attnILi12E6__halffEEvv' for 'sm_90'
    ptxas info    : Function properties for _ZN3mla4attnILi12E6__halffEEvv
    ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
    ptxas info    : Used 125 registers, used 1 barriers, 16 bytes smem

Each kernel's block is parsed strictly: a missing line, or an item on the `Used` line that
is not understood, raises PtxasParseError naming the function and the line, never a zero.

The same compile's cubin gives each kernel's machine-code size (`code_bytes`, its
`.text.<mangled name>` section, read by `elf.text_sizes`): the instruction footprint, which
the log does not print.
"""
from __future__ import annotations

import itertools
import os
import re
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Iterable, Mapping, NamedTuple

from . import elf, toolkit
from .sources import read_source

__all__ = ["KernelResources", "PtxasParseError", "NvrtcCompileError", "ptxas_report",
           "ptxas_report_source", "Compiled", "compile_program", "compile_log",
           "parse_ptxas_log", "code_sizes", "target_arch"]


class PtxasParseError(ValueError):
    """The ptxas log does not say what a kernel uses (or says it in a form not understood)."""


class NvrtcCompileError(RuntimeError):
    """NVRTC rejected the source; the message carries the NVRTC log."""


@dataclass(frozen=True)
class KernelResources:
    """What ptxas says one kernel uses, per thread (registers, stack) or per block (smem).

    `cmem0_bytes` (kernel parameters / constant bank 0) is None where ptxas does not print
    it (sm_90 and later with CUDA 12.8+); `barriers` is None where ptxas predates that field.
    `code_bytes` is the kernel's own SASS, from the cubin: code in a function it calls
    without inlining lies in that function's section and is not counted.
    """

    name: str            # the readable instance name (KernelInstance.name)
    mangled: str         # the lowered name ptxas reports
    arch: str
    registers: int
    spill_stores: int    # bytes
    spill_loads: int     # bytes
    stack_bytes: int     # stack frame per thread
    smem_bytes: int      # static shared memory per block (0 when ptxas prints none)
    cmem0_bytes: int | None
    barriers: int | None
    code_bytes: int      # bytes of machine code: the kernel's .text section in the cubin

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0

    def as_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------------------- parsing

_ENTRY = re.compile(r"^ptxas\s+info\s*:\s*Compiling entry function '([^']+)' for '([^']+)'\s*$")
_PROPS = re.compile(r"^ptxas\s+info\s*:\s*Function properties for (\S+)\s*$")
_FRAME = re.compile(r"^ptxas\s+\.\s+(.*)$")
_USED = re.compile(r"^ptxas\s+info\s*:\s*Used\s+(.*)$")
_FRAME_ITEMS = {
    "stack_bytes": re.compile(r"^(\d+) bytes stack frame$"),
    "spill_stores": re.compile(r"^(\d+) bytes spill stores$"),
    "spill_loads": re.compile(r"^(\d+) bytes spill loads$"),
}
_USED_ITEMS = (
    ("registers", re.compile(r"^(?:Used\s+)?(\d+) registers$")),
    ("barriers", re.compile(r"^used (\d+) barriers$")),
    ("smem_bytes", re.compile(r"^(\d+) bytes smem$")),
    ("cmem0_bytes", re.compile(r"^(\d+) bytes cmem\[0\]$")),
    (None, re.compile(r"^\d+ bytes cmem\[\d+\]$")),           # other constant banks
    (None, re.compile(r"^\d+ bytes cumulative stack size$")),  # = stack frame + callees
    (None, re.compile(r"^\d+ textures$|^\d+ samplers$|^\d+ surfaces$")),
    (None, re.compile(r"^\d+ bytes lmem$")),                   # old ptxas: local memory
)


def _parse_frame(fn: str, line: str) -> dict:
    m = _FRAME.match(line.strip())
    body = m.group(1) if m else ""
    got: dict = {}
    for item in (x.strip() for x in body.split(",")):
        for key, rx in _FRAME_ITEMS.items():
            mm = rx.match(item)
            if mm:
                got[key] = int(mm.group(1))
                break
        else:
            raise PtxasParseError(
                f"ptxas log: cannot parse {item!r} in the properties of {fn}: {line.strip()!r}")
    missing = [k for k in _FRAME_ITEMS if k not in got]
    if missing:
        raise PtxasParseError(
            f"ptxas log: the properties of {fn} lack {', '.join(missing)}: {line.strip()!r}")
    return got


def _parse_used(fn: str, line: str) -> dict:
    m = _USED.match(line.strip())
    body = "Used " + m.group(1) if m else ""
    got: dict = {}
    for item in (x.strip() for x in body.split(",")):
        for key, rx in _USED_ITEMS:
            mm = rx.match(item)
            if mm:
                if key is not None:
                    got[key] = int(mm.group(1))
                break
        else:
            raise PtxasParseError(
                f"ptxas log: cannot parse {item!r} in the resource line of {fn}: "
                f"{line.strip()!r}")
    if "registers" not in got:
        raise PtxasParseError(
            f"ptxas log: no register count for {fn}: {line.strip()!r}")
    return got


def parse_ptxas_log(log: str) -> dict[str, dict]:
    """Every entry function in a ptxas -v log: {mangled name: fields}, strictly parsed.

    Fields: arch, registers, spill_stores, spill_loads, stack_bytes, smem_bytes,
    cmem0_bytes (or None), barriers (or None).
    """
    out: "OrderedDict[str, dict]" = OrderedDict()
    lines = [ln.rstrip("\x00").rstrip() for ln in log.splitlines()]
    entry = None            # the entry function whose block we are in
    props_for = None        # the function named by the last "Function properties for"
    frames: dict[str, dict] = {}

    def close(fn):
        if fn is None:
            return
        rec = out[fn]
        if fn not in frames:
            raise PtxasParseError(
                f"ptxas log: no 'bytes stack frame, spill stores, spill loads' line for {fn}")
        if "registers" not in rec:
            raise PtxasParseError(f"ptxas log: no 'Used N registers' line for {fn}")
        rec.update(frames[fn])

    for line in lines:
        s = line.strip()
        if not s.startswith("ptxas"):
            continue
        m = _ENTRY.match(s)
        if m:
            close(entry)
            entry, arch = m.group(1), m.group(2)
            if entry in out:
                raise PtxasParseError(f"ptxas log: {entry} is compiled twice: {s!r}")
            out[entry] = {"arch": arch}
            props_for = None
            continue
        m = _PROPS.match(s)
        if m:
            props_for = m.group(1)
            continue
        if _FRAME.match(s):
            fn = props_for or entry
            if fn is None:
                raise PtxasParseError(f"ptxas log: a properties line belongs to no function: {s!r}")
            frames[fn] = _parse_frame(fn, s)
            props_for = None
            continue
        if _USED.match(s):
            if entry is None:
                raise PtxasParseError(f"ptxas log: a resource line belongs to no function: {s!r}")
            if "registers" in out[entry]:
                raise PtxasParseError(f"ptxas log: two resource lines for {entry}: {s!r}")
            used = _parse_used(entry, s)
            used.setdefault("smem_bytes", 0)      # ptxas omits "0 bytes smem"
            used.setdefault("cmem0_bytes", None)  # not printed for sm_90+ by CUDA 12.8+
            used.setdefault("barriers", None)
            out[entry].update(used)
            continue
        # other ptxas lines ("0 bytes gmem", "Compile time", warnings) carry nothing per kernel
    close(entry)
    return dict(out)


# ---------------------------------------------------------------------------- compiling

_NONCE = itertools.count()


class Compiled(NamedTuple):
    log: str                  # the program log: ptxas's -v report
    lowered: dict[str, str]   # {name expression: lowered (mangled) name}
    cubin: bytes              # whole (toolkit.nvrtc_cubin)


def compile_program(source: str, name_expressions: Iterable[str] = (), *, arch: str = "sm_90",
                    extra_options=(), filename: str = "kernel.cu") -> Compiled:
    """Compile `source` for `arch` with -Xptxas -v: its log, lowered names and cubin.

    Raises NvrtcCompileError with the NVRTC log if compilation fails.
    """
    toolkit.check_arch(arch)
    nvrtc = toolkit._nvrtc()
    toolkit.nvrtc_version()  # a clear error if the library is missing
    exprs = list(dict.fromkeys(name_expressions))
    # A cached compile prints no ptxas log. The H200 image's NVRTC (13.0) returned an empty
    # log for a second compile of the same PTX in one process, even with a new -D: the cache
    # is keyed on the PTX. A device variable with a new name on every call changes the PTX.
    nonce = f"{next(_NONCE)}_{os.getpid()}"
    source = f"{source}\n__device__ int mlasandbox_ptxas_report_nonce_{nonce};\n"
    # cupy.RawModule compiles every kernel with -ftz=true (cupy/cuda/compiler.py), and ftz
    # changes the code (FFMA.FTZ, exp2f without its denormal fix-up): the report must see the
    # kernels that run (attn_tiled: 127 registers with it, 126 without).
    opts = list(toolkit.compile_options(arch, extra=("-ftz=true", "-Xptxas", "-v", *extra_options)))
    prog = nvrtc.createProgram(source, filename, [], [])
    try:
        for e in exprs:
            nvrtc.addNameExpression(prog, e)
        try:
            nvrtc.compileProgram(prog, opts)
        except Exception as exc:
            try:
                log = nvrtc.getProgramLog(prog).rstrip("\x00")
            except Exception:
                log = "(no log)"
            raise NvrtcCompileError(
                f"NVRTC failed to compile {filename} for {arch} ({exc}):\n{log}\n"
                f"options: {' '.join(opts)}") from None
        log = nvrtc.getProgramLog(prog).rstrip("\x00")
        lowered = {e: nvrtc.getLoweredName(prog, e) for e in exprs}
        cubin = toolkit.nvrtc_cubin(prog)
    finally:
        nvrtc.destroyProgram(prog)
    return Compiled(log, lowered, cubin)


def compile_log(source: str, name_expressions: Iterable[str] = (), *, arch: str = "sm_90",
                extra_options=(), filename: str = "kernel.cu") -> tuple[str, dict[str, str]]:
    """compile_program's (log, {expression: lowered name}), for callers that read the log."""
    c = compile_program(source, name_expressions, arch=arch, extra_options=extra_options,
                        filename=filename)
    return c.log, c.lowered


def code_sizes(compiled: Compiled, mangled: Iterable[str], *, arch: str,
               filename: str) -> dict[str, int]:
    """{mangled name: bytes of its .text section} for each kernel named, from the cubin.
    PtxasParseError naming the file and arch where the cubin cannot be read or lacks one."""
    mangled = list(mangled)
    try:
        sizes = elf.text_sizes(compiled.cubin)
    except elf.ElfError as exc:
        raise PtxasParseError(f"the cubin of {filename} for {arch}: {exc}") from None
    missing = [m for m in mangled if m not in sizes]
    if missing:
        raise PtxasParseError(
            f"the cubin of {filename} for {arch} has no .text section for "
            f"{', '.join(missing)}; functions: {', '.join(sizes) or 'none'}")
    return {m: sizes[m] for m in mangled}


def ptxas_report_source(source: str, expressions: Mapping[str, str], *, arch: str = "sm_90",
                        extra_options=(), filename: str = "kernel.cu"
                        ) -> dict[str, KernelResources]:
    """The report for one source text: {name: KernelResources} for {name: name expression}."""
    compiled = compile_program(source, expressions.values(), arch=arch,
                               extra_options=extra_options, filename=filename)
    log, lowered = compiled.log, compiled.lowered
    try:
        parsed = parse_ptxas_log(log)
    except PtxasParseError as exc:
        raise PtxasParseError(f"{exc}\n(in the log of {filename} for {arch})") from None
    sizes = code_sizes(compiled, lowered.values(), arch=arch, filename=filename)
    out: dict[str, KernelResources] = {}
    for name, expr in expressions.items():
        mangled = lowered[expr]
        if mangled not in parsed:
            raise PtxasParseError(
                f"ptxas log of {filename} for {arch} has no entry for {name} ({expr} -> "
                f"{mangled}); entries: {', '.join(parsed) or 'none'}\n{log}")
        rec = parsed[mangled]
        if rec["arch"] != arch:
            raise PtxasParseError(
                f"ptxas compiled {mangled} for {rec['arch']!r}, not the requested {arch!r}")
        out[name] = KernelResources(name=name, mangled=mangled, **rec,
                                    code_bytes=sizes[mangled])
    return out


def target_arch(inst, arch: str) -> str:
    """The target an instance is compiled for on `arch`: its arch-specific target (sm_90a)
    where that runs on `arch` (sm_90), else `arch` itself."""
    need = getattr(inst, "min_arch", "")
    return need if need.endswith("a") and need[:-1] == arch else arch


def ptxas_report(instances, arch: str = "sm_90", extra_options=()
                 ) -> dict[str, KernelResources]:
    """The report for registry KernelInstances, keyed by instance name, in the given order.

    One NVRTC program per source file (text from sources.read_source), every instance's
    name expression added to it, one real compile each.
    """

    by_source: "OrderedDict[tuple[str, str], dict[str, str]]" = OrderedDict()
    order = []
    for inst in instances:
        by_source.setdefault((inst.source, target_arch(inst, arch)), {})[inst.name] = (
            inst.expression)
        order.append(inst.name)
    found: dict[str, KernelResources] = {}
    for (src, target), exprs in by_source.items():
        found.update(ptxas_report_source(read_source(src), exprs, arch=target,
                                         extra_options=extra_options, filename=src))
    return {n: found[n] for n in dict.fromkeys(order)}
