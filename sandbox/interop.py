"""The caller's framework: torch tensors or CuPy arrays in, results back in the same framework.

* Detection reads the type's module (`torch.Tensor` lives in `torch`, `cupy.ndarray` in
  `cupy`), so torch is imported only once the caller has handed over a torch tensor, and a
  CPU-only process never pays for it.
* Arrays cross by DLPack (`cupy.from_dlpack`, `torch.from_dlpack`): zero copy, the same device
  memory. A torch bfloat16 tensor is viewed as int16 before it crosses and as uint16 after, so
  the kernels see raw bf16 words, the sandbox's bf16 storage; uint16 CuPy words keep meaning
  bf16.
* Launches go on the caller's current stream: torch's (`torch.cuda.current_stream()`, handed
  to `cupy.cuda.Stream.from_external` under the CUDA stream protocol) for torch inputs, so a
  capture under `torch.cuda.graph` records them; CuPy's current stream otherwise. The
  conversions run on that stream too, so DLPack's stream handshake has nothing to order.
* Every input must come from one framework and sit on the caller's current device (torch's
  current device for torch inputs, CuPy's otherwise).
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

__all__ = ["framework_of", "common_framework", "Caller", "from_caller"]

FRAMEWORKS = ("torch", "cupy")


def framework_of(arr) -> str:
    """'torch', 'cupy', 'numpy', ... : the top-level package of the array's type."""
    return type(arr).__module__.split(".")[0]


def common_framework(arrays: dict) -> str:
    """The one framework of the named arrays (None entries skipped), or a TypeError naming
    which input came from where."""
    kinds = {name: framework_of(a) for name, a in arrays.items() if a is not None}
    found = sorted(set(kinds.values()))
    if len(found) > 1:
        where = ", ".join(f"{name} is {fw}" for name, fw in kinds.items())
        raise TypeError(f"the inputs mix frameworks ({where}); pass all torch tensors or all "
                        "CuPy arrays")
    fw = found[0]
    if fw not in FRAMEWORKS:
        names = ", ".join(kinds)
        hint = " (copy NumPy arrays to the device with cupy.asarray)" if fw == "numpy" else ""
        raise TypeError(f"{names} must be torch tensors or CuPy arrays on a CUDA device, got "
                        f"{fw} arrays{hint}")
    return fw


def _torch():
    import torch  # only reached with a torch tensor in hand

    return torch


class _StreamProtocol:
    """A torch stream under the CUDA stream protocol (`__cuda_stream__`: version 0 and the
    cudaStream_t), which CuPy 14's Stream.from_external takes in place of the deprecated
    ExternalStream; torch releases before the protocol have `cuda_stream` alone. Holding the
    torch stream keeps it alive as long as CuPy's wrapper."""

    def __init__(self, stream):
        self.stream = stream

    def __cuda_stream__(self):
        return (0, int(self.stream.cuda_stream))


@dataclass(frozen=True)
class Caller:
    """The caller's framework and device: where launches go and what results come back as."""

    framework: str
    device_id: int

    def current_stream(self):
        """The caller's current stream on its device, as a CuPy stream."""
        import cupy

        if self.framework == "torch":
            s = _torch().cuda.current_stream(self.device_id)
            return cupy.cuda.Stream.from_external(_StreamProtocol(s))
        return cupy.cuda.get_current_stream(self.device_id)

    @contextmanager
    def on(self, stream=None):
        """The caller's device and `stream` (its current stream by default) made CuPy's
        current ones for the body: CuPy kernels launch on the current stream."""
        import cupy

        here = cupy.cuda.runtime.getDevice() == self.device_id
        with nullcontext() if here else cupy.cuda.Device(self.device_id):
            with (stream if stream is not None else self.current_stream()):
                yield

    def to_device(self, name: str, arr):
        """`arr` as a CuPy array over the same memory (bf16 as uint16 words)."""
        import cupy

        if arr is None:
            return None
        if self.framework == "torch":
            if not arr.is_cuda:
                raise ValueError(f"{name} is a torch tensor on {arr.device}; it must be on a "
                                 "CUDA device")
            torch = _torch()
            arr = arr.detach()   # the same memory; DLPack refuses a tensor that needs grad
            bf16 = arr.dtype == torch.bfloat16
            out = cupy.from_dlpack(arr.view(torch.int16) if bf16 else arr)
            return out.view(cupy.uint16) if bf16 else out
        if arr.dtype.name == "bfloat16":  # a CuPy bf16 array: the kernels take its words
            return arr.view(cupy.uint16)
        return arr

    def to_caller(self, arr):
        """A CuPy result in the caller's framework (a zero-copy torch view for torch)."""
        if arr is None or self.framework != "torch":
            return arr
        return _torch().from_dlpack(arr)


def _device_of(framework: str, name: str, arr) -> int:
    if framework == "torch":
        return arr.device.index if arr.is_cuda else -1
    return arr.device.id


def from_caller(arrays: dict):
    """(Caller, {name: CuPy array}) for the named inputs (None entries stay None). Raises a
    TypeError for mixed or host frameworks and a ValueError for an input on another device."""
    fw = common_framework(arrays)
    if fw == "torch":
        device_id = _torch().cuda.current_device()
    else:
        import cupy

        device_id = cupy.cuda.Device().id
    for name, arr in arrays.items():
        if arr is not None:
            dev = _device_of(fw, name, arr)
            if dev != device_id:
                where = "the host" if dev < 0 else f"device {dev}"
                raise ValueError(f"{name} is on {where}, the current {fw} device is {device_id}; "
                                 "every input must be on the current device")
    caller = Caller(fw, device_id)
    with caller.on():
        converted = {name: caller.to_device(name, arr) for name, arr in arrays.items()}
    return caller, converted
