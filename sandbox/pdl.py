"""Programmatic dependent launch (PDL): a kernel launched so that it may start while the
kernel before it on the stream is still running.

CuPy's RawKernel launches through cuLaunchKernel, which takes no launch attributes, and
cupy.cuda.driver does not expose cuLaunchKernelEx. `launch` calls cuLaunchKernelEx from
libcuda through ctypes, with the CUfunction CuPy loaded (`RawKernel.kernel.ptr`) and the
attribute CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION set: the launch may begin once
every block of the previous kernel has executed `griddepcontrol.launch_dependents` (or
exited), and the kernel's `griddepcontrol.wait` (mla::pdl_wait in mla_common.cuh) blocks
until that kernel has completed and its writes are visible. Whatever a kernel does before its
wait must not read what the previous kernel writes: the combine and the projection only
prefetch wv_b there.

Under stream capture the attribute becomes a programmatic edge of the graph (CUDA 12.3 and
later), so a captured step replays with the same overlap. PDL needs sm_90 or later; on an
older device, or where libcuda lacks cuLaunchKernelEx, `supported()` is False and the
launchers use a plain launch (a kernel's wait is then a no-op). On the default streams
(CuPy's null stream, the legacy and per-thread handles 0, 1 and 2) the launch is plain too:
their implicit synchronization with every other stream is what a caller on them relies on,
so a programmatic launch is made only on a stream of the caller's own, which is where the
bench, the graph captures and serving loops run.

The structures are cuda.h's, laid out by hand (tests/test_pdl.py checks the sizes and
offsets against the header's): CUlaunchAttribute is an int id padded to 8 bytes and a
64-byte value union; CUlaunchConfig is the grid, the block, the dynamic shared memory, the
stream, and the attribute list.
"""
from __future__ import annotations

import ctypes

import numpy as np

__all__ = ["LaunchAttribute", "LaunchConfig", "PROGRAMMATIC_STREAM_SERIALIZATION",
           "DEFAULT_STREAMS", "kernel_params", "launch_config", "supported", "launch"]

PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
MIN_ARCH = 90                          # griddepcontrol: sm_90 and later
DEFAULT_STREAMS = (0, 1, 2)  # CU_STREAM_LEGACY = 1, CU_STREAM_PER_THREAD = 2, NULL


class _AttributeValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("as_int", ctypes.c_int),
                ("as_u64", ctypes.c_uint64)]


class LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _AttributeValue)]


class LaunchConfig(ctypes.Structure):
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint),
                ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


_SCALARS = {np.dtype(np.int32): ctypes.c_int32, np.dtype(np.uint32): ctypes.c_uint32,
            np.dtype(np.int64): ctypes.c_int64, np.dtype(np.uint64): ctypes.c_uint64,
            np.dtype(np.float32): ctypes.c_float, np.dtype(np.float64): ctypes.c_double}


def kernel_params(args) -> tuple:
    """(the void** array cuLaunchKernelEx takes, the ctypes values it points to: keep them
    alive until the launch returns). Device arrays pass their pointer; NumPy scalars their
    value at their own width, as CuPy's launcher does."""
    values = []
    for i, a in enumerate(args):
        ptr = getattr(getattr(a, "data", None), "ptr", None)
        if ptr is not None and not isinstance(a, np.generic):
            values.append(ctypes.c_uint64(ptr))
            continue
        ctype = _SCALARS.get(getattr(a, "dtype", None)) if isinstance(a, np.generic) else None
        if ctype is None:
            raise TypeError(f"kernel argument {i}: a device array or a NumPy scalar of "
                            f"{', '.join(str(d) for d in _SCALARS)}, got {type(a).__name__}")
        values.append(ctype(a.item()))
    params = (ctypes.c_void_p * max(1, len(values)))(
        *[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
    return params, values


def launch_config(grid, block, smem_bytes: int, stream_ptr: int, pdl: bool) -> tuple:
    """(the CUlaunchConfig, its attribute array): one attribute, programmatic stream
    serialization, when `pdl`; none otherwise. `grid` and `block` of 1 to 3 dimensions."""
    attrs = (LaunchAttribute * 1)()
    attrs[0].id = PROGRAMMATIC_STREAM_SERIALIZATION
    attrs[0].value.as_int = 1
    grid, block = (tuple(int(x) for x in d) + (1,) * (3 - len(d)) for d in (grid, block))
    cfg = LaunchConfig(*grid, *block, int(smem_bytes),
                       ctypes.c_void_p(int(stream_ptr) or None),
                       ctypes.cast(attrs, ctypes.POINTER(LaunchAttribute)), 1 if pdl else 0)
    return cfg, attrs


_libcuda = None
_supported: dict[int, bool] = {}


def _cuda():
    """libcuda's cuLaunchKernelEx, or None where there is none."""
    global _libcuda
    if _libcuda is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            fn = lib.cuLaunchKernelEx
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p,
                           ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
            _libcuda = fn
        except (OSError, AttributeError):
            _libcuda = False
    return _libcuda or None


def supported(device_id: int | None = None) -> bool:
    """Whether a PDL launch is possible on the device: sm_90 or later and a libcuda with
    cuLaunchKernelEx (CUDA 12.0 and later)."""
    import cupy

    dev = cupy.cuda.Device(device_id) if device_id is not None else cupy.cuda.Device()
    ok = _supported.get(dev.id)
    if ok is None:
        ok = int(dev.compute_capability) >= MIN_ARCH and _cuda() is not None
        _supported[dev.id] = ok
    return ok


def launch(kernel, grid, block, args, smem_bytes: int = 0, *, pdl: bool = True) -> bool:
    """Launch the cupy.RawKernel `kernel` on CuPy's current stream, with programmatic stream
    serialization when `pdl`, the stream is not a default stream and the device supports it
    (else a plain launch). Returns
    whether the launch was programmatic. A refused launch raises CUDADriverError, as CuPy's
    own launcher does, so the phase guard reports it."""
    import cupy
    from cupy_backends.cuda.api import driver

    stream = cupy.cuda.get_current_stream().ptr
    if not (pdl and stream not in DEFAULT_STREAMS and supported()):
        kernel(tuple(grid), tuple(block), tuple(args), shared_mem=int(smem_bytes))
        return False
    params, keep = kernel_params(args)
    cfg, attrs = launch_config(grid, block, smem_bytes, stream, True)
    status = _cuda()(ctypes.byref(cfg), ctypes.c_void_p(kernel.kernel.ptr), params, None)
    del keep, attrs
    if status != 0:
        raise driver.CUDADriverError(status)
    return True
