"""Compile the registry's kernel instances with cupy.RawModule and hand out launchable kernels.

One module per instance (source + one name expression), compiled for the arch of the device
it runs on. Builds are cached in memory per (device, instance) and on disk by CuPy across
processes: CuPy >= 14 keys that cache on the name expressions too, so a templated module is
not recompiled per process. `mlasandbox info` says whether the installed CuPy does this.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import arch_specific
from .registry import KernelInstance
from .sources import read_source
from .toolkit import NoDeviceError, compile_options, device_available, device_properties

__all__ = ["get_kernel", "DeviceInfo", "device_info", "blocks_per_sm",
           "cupy_caches_name_expressions"]

_kernels: dict = {}


@dataclass(frozen=True)
class DeviceInfo:
    device_id: int
    name: str
    arch: str              # "sm_90"
    num_sms: int
    l2_bytes: int
    smem_per_block_optin: int
    smem_per_sm: int
    max_grid_y: int


_device_infos: dict[int, DeviceInfo] = {}


def device_info(device_id: int | None = None) -> DeviceInfo:
    """The launch-relevant limits of a device (the current one by default), read once from
    toolkit.device_properties."""
    import cupy

    if device_id is None:
        ok, why = device_available()   # cupy.cuda.Device() would raise the driver's error
        if not ok:
            raise NoDeviceError(why)
        device_id = cupy.cuda.Device().id
    info = _device_infos.get(device_id)
    if info is None:
        d = device_properties(device_id)
        info = DeviceInfo(device_id=d["index"], name=d["name"], arch=d["arch"],
                          num_sms=d["sms"], l2_bytes=d["l2_bytes"],
                          smem_per_block_optin=d["smem_per_block_optin"],
                          smem_per_sm=d["smem_per_sm"], max_grid_y=d["max_grid_y"])
        _device_infos[device_id] = info
    return info


def cupy_caches_name_expressions() -> bool:
    import cupy

    return int(cupy.__version__.split(".")[0]) >= 14


def _nvrtc_options() -> tuple[str, ...]:
    # CuPy adds the arch option for the current device itself; passing a second one clashes.
    return tuple(o for o in compile_options() if not o.startswith(("--gpu-architecture", "-arch")))


def get_kernel(inst: KernelInstance, defines: tuple[str, ...] = ()):
    """The cupy.RawKernel of `inst` on the current device, compiled on first use.

    `defines` ("NAME" or "NAME=VALUE", passed as -D) build another kernel from the same
    source with the same launch settings: the memory ablation (mlasandbox.ablate) and the
    tests' deliberately broken builds. Each set of defines is a kernel of its own.
    """
    import cupy

    defines = tuple(defines)
    device_id = cupy.cuda.Device().id
    key = (device_id, inst.name, defines)
    kernel = _kernels.get(key)
    if kernel is None:
        info = device_info(device_id)
        if inst.smem_bytes > info.smem_per_block_optin:
            raise ValueError(
                f"{inst.name} needs {inst.smem_bytes} B of shared memory per block; "
                f"{info.name} allows at most {info.smem_per_block_optin} B")
        if arch_specific.is_arch_specific(inst.min_arch):
            # sm_90a: NVRTC here, CuPy loads the cubin (sandbox/arch_specific.py)
            arch_specific.check_device_arch(inst.name, inst.min_arch, info.arch, info.name)
            kernel = arch_specific.load_function(read_source(inst.source), inst.expression,
                                                 inst.min_arch, tuple(f"-D{d}" for d in defines),
                                                 inst.source)
        else:
            module = cupy.RawModule(code=read_source(inst.source),
                                    options=_nvrtc_options() + tuple(f"-D{d}" for d in defines),
                                    name_expressions=[inst.expression])
            kernel = module.get_function(inst.expression)
        if inst.smem_bytes > 48 * 1024:
            kernel.max_dynamic_shared_size_bytes = inst.smem_bytes
        if inst.smem_bytes:
            # The largest carveout, so that the blocks the occupancy model counts (two of
            # ~113 KB, or five of ~40 KB) really share an SM.
            kernel.preferred_shared_memory_carveout = 100
        _kernels[key] = kernel
    return kernel


def blocks_per_sm(inst: KernelInstance) -> int:
    """Resident blocks per SM from the driver's occupancy API (the real, not modelled, value)."""
    from cupy_backends.cuda.api import driver

    kernel = get_kernel(inst)
    return int(driver.occupancyMaxActiveBlocksPerMultiprocessor(
        kernel.kernel.ptr, inst.threads, inst.smem_bytes))
