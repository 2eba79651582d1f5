"""Find NVRTC and the CUDA headers explicitly, and say what the machine has.

Compile-only work (the ptxas report, `mlasandbox regs`) needs two things and no GPU:

* the NVRTC library, loaded by CuPy (`cupy.cuda.nvrtc`); the `nvidia-cuda-nvrtc` wheel
  provides it;
* the CUDA headers the kernels include (`cuda_fp16.h`, `cuda_bf16.h`), from a toolkit or
  from the NVIDIA wheels (`nvidia-cuda-runtime`).

The header lookup is explicit, in this order; the first directory holding both headers wins
(one toolkit's headers, never a mix of two), preferring one whose CUDA major version
(CUDART_VERSION in cuda_runtime_api.h) matches NVRTC's:

1. `MLASANDBOX_CUDA_INCLUDE` (one or more directories, separated by os.pathsep): used as
   given, and an error if the headers are not there;
2. `$CUDA_PATH/include`, then `$CUDA_HOME/include`;
3. the NVIDIA pip wheels on sys.path: `nvidia/cu13/include` (CUDA 13 wheels),
   `nvidia/cuda_runtime/include`, `nvidia/cuda_nvrtc/include` (CUDA 12 wheels), then
   whatever `cuda.pathfinder` finds for `cudart` (it also knows conda layouts);
4. `/usr/local/cuda/include`.

Everything here that inspects the device has a never-raising twin (`device_available`),
which the GPU tests and the CLI use to skip or explain.
"""
from __future__ import annotations

import ctypes
import os
import re
import sys
from functools import lru_cache
from pathlib import Path

from . import registry

__all__ = [
    "ENV_INCLUDE", "REQUIRED_HEADERS", "ToolkitError", "NoDeviceError", "nvrtc_version",
    "include_setting_problem", "cuda_include_dirs", "include_candidates", "headers_version",
    "compile_options",
    "check_arch", "arch_of_device", "device_available", "device_properties", "nvrtc_cubin",
]

ENV_INCLUDE = "MLASANDBOX_CUDA_INCLUDE"
REQUIRED_HEADERS = ("cuda_fp16.h", "cuda_bf16.h")
_WHEEL_SUBDIRS = ("nvidia/cu13/include", "nvidia/cuda_runtime/include",
                  "nvidia/cuda_nvrtc/include")
_ARCH = re.compile(r"^sm_(\d+)([af]?)$")


class ToolkitError(RuntimeError):
    """A piece of the CUDA toolkit that compile-only work needs is missing."""


class NoDeviceError(RuntimeError):
    """There is no usable CUDA device (no GPU, no driver, or a driver too old)."""


# ---------------------------------------------------------------------------- NVRTC

def _nvrtc():
    try:
        from cupy.cuda import nvrtc
    except Exception as exc:  # ImportError, or CuPy failing to load its own pieces
        raise ToolkitError(
            f"cannot import cupy.cuda.nvrtc ({type(exc).__name__}: {exc}); install CuPy "
            "(`pip install cupy-cuda13x`, or cupy-cuda12x for a CUDA 12 driver)") from exc
    return nvrtc


@lru_cache(maxsize=None)
def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the NVRTC library CuPy loads; ToolkitError if it cannot load one."""
    nvrtc = _nvrtc()
    try:
        major, minor = nvrtc.getVersion()
    except Exception as exc:
        raise ToolkitError(
            f"the NVRTC library could not be loaded ({type(exc).__name__}: {exc}); "
            "install it with `pip install nvidia-cuda-nvrtc` (CUDA 13; `nvidia-cuda-nvrtc-cu12` "
            "for CUDA 12) or put a CUDA toolkit's lib64 on LD_LIBRARY_PATH") from exc
    return int(major), int(minor)


def _loaded_nvrtc() -> ctypes.CDLL:
    """The NVRTC library CuPy compiles with (so that its program handles are valid here).

    CuPy 14 loads it through cuda.pathfinder, which caches what it loaded: asking it again
    gives the same file. Without pathfinder, the one libnvrtc mapped into the process; two
    different ones (another package's beside CuPy's) are an error, not a guess."""
    _nvrtc()
    nvrtc_version()  # CuPy loads the library on its first call
    try:
        from cuda import pathfinder

        return ctypes.CDLL(pathfinder.load_nvidia_dynamic_lib("nvrtc").abs_path)
    except Exception:
        pass
    try:
        with open("/proc/self/maps") as f:
            mapped = {line.split(None, 5)[5].strip() for line in f if len(line.split()) == 6}
    except OSError as exc:
        raise ToolkitError(f"cannot read /proc/self/maps to find the NVRTC library: {exc}")
    found = sorted({os.path.realpath(p) for p in mapped
                    if os.path.basename(p).startswith("libnvrtc.so")})
    if len(found) != 1:
        raise ToolkitError("cannot tell which NVRTC library CuPy loaded: "
                           f"{', '.join(found) or 'none'} mapped, and no cuda.pathfinder")
    return ctypes.CDLL(found[0])


def nvrtc_cubin(prog: int) -> bytes:
    """The whole cubin of a compiled NVRTC program (a cupy.cuda.nvrtc program handle).

    CuPy 14's nvrtc.getCUBIN returns it one byte short: it drops the last byte, as it does
    PTX's terminating NUL, but a cubin's size (nvrtcGetCUBINSize) counts no terminator. The
    driver loads the short image from memory, where a bytes object ends in a NUL, but a file
    of it is not a whole ELF: cuobjdump and nvdisasm refuse it ("invalid ELF file"). So the
    cubin is read here from the library itself, at the size NVRTC gives."""
    lib = _loaded_nvrtc()
    handle = ctypes.c_void_p(int(prog))
    size = ctypes.c_size_t()
    status = lib.nvrtcGetCUBINSize(handle, ctypes.byref(size))
    if status != 0 or size.value == 0:
        raise ToolkitError(f"nvrtcGetCUBINSize returned status {status}, size {size.value}: "
                           "the program has no cubin (compiled for a virtual arch?)")
    buf = ctypes.create_string_buffer(size.value)
    status = lib.nvrtcGetCUBIN(handle, buf)
    if status != 0:
        raise ToolkitError(f"nvrtcGetCUBIN returned status {status}")
    return buf.raw


# ---------------------------------------------------------------------------- headers

def _has_headers(d: Path) -> bool:
    return all((d / h).is_file() for h in REQUIRED_HEADERS)


def _site_dirs() -> list[Path]:
    """Roots that may hold the `nvidia` namespace package: its own __path__ first."""
    roots: list[Path] = []
    try:
        import nvidia  # namespace package of the NVIDIA wheels

        roots += [Path(p).parent for p in getattr(nvidia, "__path__", [])]
    except ImportError:
        pass
    roots += [Path(p) for p in sys.path if p]
    out: list[Path] = []
    for r in roots:
        if r not in out:
            out.append(r)
    return out


def include_candidates() -> list[tuple[str, Path]]:
    """Every place looked at, in order, as (where it came from, directory).

    Directories that do not exist are listed too, so that the error can say where it looked.
    """
    out: list[tuple[str, Path]] = []
    for var in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(var):
            out.append((f"${var}/include", Path(os.environ[var]) / "include"))
    for root in _site_dirs():
        for sub in _WHEEL_SUBDIRS:
            d = root / sub
            if d.is_dir():
                out.append((f"pip wheel ({sub})", d))
    try:
        from cuda import pathfinder  # shipped with CuPy 14 as cuda-pathfinder

        found = pathfinder.find_nvidia_header_directory("cudart")
        if found:
            out.append(("cuda.pathfinder (cudart)", Path(found)))
    except Exception:  # absent, or an older API: it is only an extra candidate
        pass
    out.append(("/usr/local/cuda/include", Path("/usr/local/cuda/include")))
    seen: set[Path] = set()
    uniq = []
    for label, d in out:
        if d not in seen:
            seen.add(d)
            uniq.append((label, d))
    return uniq


def _missing_message(looked: list[str]) -> str:
    return (
        f"CUDA headers {' and '.join(REQUIRED_HEADERS)} were not found; looked in:\n  "
        + "\n  ".join(looked)
        + "\nInstall them with `pip install nvidia-cuda-runtime nvidia-cuda-nvrtc` (CUDA 13 "
        "wheels; for CUDA 12: `pip install nvidia-cuda-runtime-cu12 nvidia-cuda-nvrtc-cu12`), "
        f"or point {ENV_INCLUDE} at a directory holding them (e.g. /usr/local/cuda/include)."
    )


def _setting_problem(env_value: str) -> str | None:
    dirs = [Path(p) for p in env_value.split(os.pathsep) if p]
    missing = [h for h in REQUIRED_HEADERS if not any((d / h).is_file() for d in dirs)]
    if not missing:
        return None
    return (f"{ENV_INCLUDE}={env_value!r} does not hold {', '.join(missing)}; point it at a "
            "directory with cuda_fp16.h and cuda_bf16.h, or unset it to search the toolkit "
            "and the NVIDIA wheels")


def include_setting_problem() -> str | None:
    """What is wrong with the user's MLASANDBOX_CUDA_INCLUDE (None where it is unset or
    holds the headers): a setting the user gave, so the CLI refuses it as bad input."""
    env_value = os.environ.get(ENV_INCLUDE)
    return _setting_problem(env_value) if env_value else None


def _include_dirs(env_value: str | None) -> tuple[str, ...]:
    if env_value:
        problem = _setting_problem(env_value)
        if problem:
            raise ToolkitError(problem)
        return tuple(str(Path(p).resolve()) for p in env_value.split(os.pathsep) if p)
    looked, found = [], []
    for label, d in include_candidates():
        if _has_headers(d):
            found.append(d)
        looked.append(f"{label}: {d}" + ("" if d.is_dir() else " (no such directory)"))
    if found:
        # One toolkit's headers, never a mix: the first whose CUDA major version matches
        # NVRTC's (a CUDA 12 NVRTC next to CUDA 13 wheels, say), else simply the first.
        try:
            major = nvrtc_version()[0]
        except ToolkitError:
            major = None
        for d in found:
            hv = headers_version(str(d))
            if major is not None and hv is not None and hv[0] == major:
                return (str(d.resolve()),)
        return (str(found[0].resolve()),)
    raise ToolkitError(_missing_message(looked))


def cuda_include_dirs() -> list[str]:
    """Directories to pass with -I so that NVRTC finds cuda_fp16.h and cuda_bf16.h.

    Raises ToolkitError naming every place looked at and how to get the headers.
    """
    return list(_include_dirs(os.environ.get(ENV_INCLUDE)))


def headers_version(include_dir: str | None = None) -> tuple[int, int] | None:
    """The CUDA version of a header directory (CUDART_VERSION in cuda_runtime_api.h), or None."""
    try:
        d = Path(include_dir or cuda_include_dirs()[0])
        text = (d / "cuda_runtime_api.h").read_text(errors="replace")
    except (OSError, ToolkitError):
        return None
    m = re.search(r"#define\s+CUDART_VERSION\s+(\d+)", text)
    if not m:
        return None
    v = int(m.group(1))
    return v // 1000, (v % 1000) // 10


# ---------------------------------------------------------------------------- options

def check_arch(arch: str) -> str:
    """Validate a real architecture name such as 'sm_90' (ptxas runs only for sm_XX)."""
    if not isinstance(arch, str) or not _ARCH.match(arch):
        raise ValueError(
            f"arch must be a real GPU architecture such as sm_80 or sm_90, got {arch!r} "
            "(a virtual compute_XX target runs no ptxas, so it has no register report)")
    return arch


def compile_options(arch: str = "sm_90", extra=()) -> tuple[str, ...]:
    """NVRTC options for the kernels of cuda_src/ for one architecture: the dims they are
    built for and the registry's launch values, which the kernels static_assert."""
    check_arch(arch)
    opts = ["-std=c++17", f"--gpu-architecture={arch}",
            f"-DMLA_KV_LORA={registry.KV_LORA}", f"-DMLA_ROPE={registry.ROPE}",
            *registry.compile_defines()]
    opts += [f"-I{d}" for d in cuda_include_dirs()]
    opts += [str(x) for x in extra]
    return tuple(opts)


# ---------------------------------------------------------------------------- device

def device_available() -> tuple[bool, str]:
    """(True, 'device 0: NAME') or (False, why not). Never raises."""
    try:
        from cupy.cuda import runtime
    except Exception as exc:
        return False, f"CuPy is not importable ({type(exc).__name__}: {exc})"
    try:
        n = runtime.getDeviceCount()
    except Exception as exc:
        why = str(exc) or type(exc).__name__
        try:
            if runtime.driverGetVersion() == 0:
                why += " (no NVIDIA driver is loaded on this machine)"
        except Exception:
            pass
        return False, f"no CUDA device: {why}"
    if n < 1:
        return False, "no CUDA device: the driver reports 0 devices"
    try:
        props = runtime.getDeviceProperties(0)
        name = props["name"]
        name = name.decode() if isinstance(name, bytes) else str(name)
        return True, f"device 0 of {n}: {name}"
    except Exception as exc:
        return False, f"a CUDA device is listed but not usable: {exc}"


def arch_of_device(device: int | None = None) -> str:
    """'sm_90' for the current (or given) device; NoDeviceError when there is none."""
    ok, why = device_available()
    if not ok:
        raise NoDeviceError(why)
    import cupy

    dev = cupy.cuda.Device(device) if device is not None else cupy.cuda.Device()
    return f"sm_{dev.compute_capability}"


def device_properties(device: int | None = None) -> dict:
    """Everything this project reads off a device (the current one by default): name, arch,
    SMs, L2, memory, the shared-memory and thread limits, and driver/runtime versions. The one
    place that calls getDeviceProperties; NoDeviceError without a device."""
    ok, why = device_available()
    if not ok:
        raise NoDeviceError(why)
    import cupy
    from cupy.cuda import runtime

    if device is None:
        device = cupy.cuda.Device().id
    p = runtime.getDeviceProperties(device)
    name = p["name"].decode() if isinstance(p["name"], bytes) else str(p["name"])

    def ver(v: int) -> str:
        return f"{v // 1000}.{(v % 1000) // 10}"

    return {
        "index": device,
        "name": name,
        "arch": f"sm_{p['major']}{p['minor']}",
        "sms": int(p["multiProcessorCount"]),
        "l2_bytes": int(p["l2CacheSize"]),
        "global_mem_bytes": int(p["totalGlobalMem"]),
        "smem_per_block": int(p.get("sharedMemPerBlock", 0)),
        "smem_per_block_optin": int(p.get("sharedMemPerBlockOptin", 0)),
        "smem_per_sm": int(p.get("sharedMemPerMultiprocessor", 0)),
        "smem_reserved_per_block": int(p.get("reservedSharedMemPerBlock", 1024)),
        "regs_per_sm": int(p.get("regsPerMultiprocessor", 0)),
        "max_threads_per_sm": int(p.get("maxThreadsPerMultiProcessor", 0)),
        "max_grid_y": int(p["maxGridSize"][1]),
        "clock_khz": int(p.get("clockRate", 0)),
        "driver_version": ver(runtime.driverGetVersion()),
        "runtime_version": ver(runtime.runtimeGetVersion()),
    }

