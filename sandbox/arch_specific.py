"""Kernels built for an arch-specific target (sm_90a): NVRTC here, loaded by CuPy.

cupy.RawModule(code=...) compiles for the device's own architecture (sm_90) and adds that
option itself, so a kernel that needs the `a` feature set of Hopper (wgmma.mma_async) cannot
be built through it. For such an instance (`KernelInstance.min_arch` ends in "a") this module
runs NVRTC itself, through `cupy.cuda.nvrtc` (the library CuPy loads), with
`--gpu-architecture=sm_90a` and the same options as every other kernel (plus CuPy's own
-ftz=true, so that the code matches what `mlasandbox regs` reports), takes the whole cubin
(`toolkit.nvrtc_cubin`: CuPy's getCUBIN drops its last byte), writes it to a
content-addressed file and loads it with `cupy.RawModule(path=...)`, asking for the lowered name NVRTC gave the name expression.
Code for sm_90a runs on compute capability 9.0 only: any other device is refused before the
compile, naming the kernel, the target and the device.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

from . import toolkit

__all__ = ["is_arch_specific", "base_arch", "check_device_arch", "compile_cubin",
           "load_function", "cache_dir"]


def is_arch_specific(arch: str) -> bool:
    """True for an arch-specific target such as sm_90a."""
    return toolkit.check_arch(arch).endswith("a")


def base_arch(arch: str) -> str:
    """The device architecture an arch-specific target runs on: sm_90 for sm_90a."""
    return arch[:-1] if is_arch_specific(arch) else arch


def check_device_arch(name: str, target: str, device_arch: str, device_name: str) -> None:
    """ValueError unless a kernel built for `target` runs on a device of `device_arch`."""
    if is_arch_specific(target) and device_arch != base_arch(target):
        raise ValueError(f"{name} is built for {target} (Hopper's wgmma) and runs on "
                         f"{base_arch(target)} devices only; this device, {device_name}, is "
                         f"{device_arch}: pick another variant (mma16, mma32)")


def cache_dir() -> Path:
    """Where cubins are kept: $MLASANDBOX_CUBIN_CACHE, else mlasandbox-cubins in the temp
    directory."""
    d = os.environ.get("MLASANDBOX_CUBIN_CACHE") or os.path.join(tempfile.gettempdir(),
                                                                 "mlasandbox-cubins")
    path = Path(d)
    path.mkdir(parents=True, exist_ok=True)
    return path


def compile_cubin(source: str, expression: str, arch: str, options=(),
                  filename: str = "kernel.cu") -> tuple[bytes, str]:
    """(cubin, lowered name) of one name expression of `source` for `arch`, by NVRTC.
    Raises ptxas.NvrtcCompileError with the program log when NVRTC rejects it."""
    from .ptxas import NvrtcCompileError

    nvrtc = toolkit._nvrtc()
    opts = list(toolkit.compile_options(arch, extra=("-ftz=true", *options)))
    prog = nvrtc.createProgram(source, filename, [], [])
    try:
        nvrtc.addNameExpression(prog, expression)
        try:
            nvrtc.compileProgram(prog, opts)
        except Exception as exc:
            log = nvrtc.getProgramLog(prog).rstrip("\x00")
            raise NvrtcCompileError(f"NVRTC failed to compile {filename} for {arch} ({exc}):"
                                    f"\n{log}\noptions: {' '.join(opts)}") from None
        return toolkit.nvrtc_cubin(prog), nvrtc.getLoweredName(prog, expression)
    finally:
        nvrtc.destroyProgram(prog)


def load_function(source: str, expression: str, arch: str, options=(),
                  filename: str = "kernel.cu"):
    """The cupy.RawKernel of `expression` built for `arch`; the cubin is compiled once per
    (source, expression, arch, options, NVRTC version) and kept under cache_dir()."""
    import cupy

    key = "\0".join([source, expression, arch, *map(str, options),
                     repr(toolkit.nvrtc_version()), *toolkit.compile_options(arch)])
    digest = hashlib.sha256(key.encode()).hexdigest()[:32]
    cubin_path = cache_dir() / f"{digest}.cubin"
    name_path = cache_dir() / f"{digest}.name"
    if not (cubin_path.is_file() and name_path.is_file()):
        cubin, lowered = compile_cubin(source, expression, arch, options, filename)
        # write then rename: a reader never sees half a file
        for path, data in ((cubin_path, cubin), (name_path, lowered.encode())):
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
    module = cupy.RawModule(path=str(cubin_path))
    return module.get_function(name_path.read_text())
