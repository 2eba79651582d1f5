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
           "load_function", "cache_dir", "cache_path", "cache_setting_problem"]


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


ENV_CACHE = "MLASANDBOX_CUBIN_CACHE"


def _default_cache() -> Path:
    # per user: another user's folder of the same name in a shared temp dir is not writable
    uid = getattr(os, "getuid", lambda: None)()
    return Path(tempfile.gettempdir()) / ("mlasandbox-cubins" + ("" if uid is None
                                                                 else f"-{uid}"))


def _folder_problem(path: Path) -> str | None:
    """Why cubins cannot be kept in `path` (created where missing), or None."""
    if path.exists() and not path.is_dir():
        return f"{str(path)!r} exists and is not a directory"
    probe = path
    while not probe.exists():          # the deepest existing folder must take the new ones
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        return f"{str(probe)!r} is not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{str(probe)!r} is not writable"
    return None


def cache_setting_problem() -> str | None:
    """What is wrong with the user's MLASANDBOX_CUBIN_CACHE (None where it is unset or
    usable): a setting the user gave, so the CLI refuses it as bad input."""
    value = os.environ.get(ENV_CACHE)
    problem = _folder_problem(Path(value)) if value else None
    return None if problem is None else (f"{ENV_CACHE}={value!r}: {problem}; point it at a "
                                         "writable directory, or unset it to use the temp "
                                         "directory")


def cache_path() -> Path:
    """The folder cache_dir() keeps cubins in, neither checked nor created."""
    return Path(os.environ.get(ENV_CACHE) or _default_cache())


def cache_dir() -> Path:
    """Where cubins are kept: $MLASANDBOX_CUBIN_CACHE, else mlasandbox-cubins-<uid> in the
    temp directory. ValueError naming the folder where it cannot hold them."""
    path = cache_path()
    problem = _folder_problem(path)
    if problem:
        raise ValueError(cache_setting_problem() or f"cannot keep cubins in {str(path)!r}: "
                         f"{problem}; set {ENV_CACHE} to a writable directory")
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
    folder = cache_dir()
    cubin_path, name_path = folder / f"{digest}.cubin", folder / f"{digest}.name"

    def build():
        cubin, lowered = compile_cubin(source, expression, arch, options, filename)
        # write then rename: a reader never sees half a file
        for path, data in ((cubin_path, cubin), (name_path, lowered.encode())):
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)

    def load():
        module = cupy.RawModule(path=str(cubin_path))
        return module.get_function(name_path.read_text(errors="replace"))

    if not (cubin_path.is_file() and name_path.is_file()):
        build()
        return load()
    try:
        return load()
    except cupy.cuda.driver.CUDADriverError as exc:
        if getattr(exc, "status", None) not in _DAMAGED_FILE:
            raise
    build()    # a cached file that does not load (damaged, or not this name's): once afresh
    return load()


# cuModuleLoad / cuModuleGetFunction on a file that is not a loadable cubin holding the name
_DAMAGED_FILE = {200, 209, 218, 301, 500}   # INVALID_IMAGE, NO_BINARY_FOR_GPU,
#                                             INVALID_PTX, FILE_NOT_FOUND, NOT_FOUND
