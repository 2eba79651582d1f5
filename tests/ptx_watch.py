"""The PTX of the NVRTC compiles that code under test runs: what its options did to the code.

cupy.RawModule compiles every kernel with -ftz=true, so the three places that run NVRTC
themselves (ptxas.compile_log, arch_specific.compile_cubin and the repro script's
cubin_for_arch) add it to their own option lists. Their outputs (a ptxas log, a cubin) do
not show it, so `watch_ptx` wraps nvrtc.compileProgram (the module all three import from
cupy.cuda) to take each program's PTX right after the real compile, and `flush_forms` reads
off it what -ftz did to FTZ_SOURCE's multiply and exp2f: with it NVVM writes mul.ftz.f32 and
ex2.approx.ftz.f32, without it mul.f32 and ex2.approx.f32 (tests/test_ptxas.py checks the
second half on a plain compile, so that the probe tells the two apart).
"""
from __future__ import annotations

import re

# one f32 multiply and one exp2f, each of which has an .ftz form in PTX
FTZ_SOURCE = r'''
extern "C" __global__ void ftz_probe(float* x, float a) {
    x[threadIdx.x] = exp2f(x[threadIdx.x] * a);
}
'''
FTZ_ENTRY = "ftz_probe"

_MUL = re.compile(r"^\s*mul(?:\.rn)?(\.ftz)?\.f32\s", re.M)
_EX2 = re.compile(r"^\s*ex2\.approx(\.ftz)?\.f32\s", re.M)


def watch_ptx(monkeypatch) -> list[str]:
    """A list that gets the PTX of every NVRTC program compiled from now on (the test's
    end undoes the watch)."""
    from cupy.cuda import nvrtc

    real = nvrtc.compileProgram
    seen: list[str] = []

    def compile_program(prog, *args, **kw):
        out = real(prog, *args, **kw)
        ptx = nvrtc.getPTX(prog)
        seen.append((ptx.decode() if isinstance(ptx, bytes) else ptx).rstrip("\x00"))
        return out

    monkeypatch.setattr(nvrtc, "compileProgram", compile_program)
    return seen


def flush_forms(ptx: str) -> dict:
    """{'mul': [...], 'ex2': [...]}: for each f32 multiply and ex2 of `ptx`, whether it is the
    flush-to-zero form."""
    return {"mul": [bool(m.group(1)) for m in _MUL.finditer(ptx)],
            "ex2": [bool(m.group(1)) for m in _EX2.finditer(ptx)]}
