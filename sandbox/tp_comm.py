"""The collectives a tensor-parallel step needs, through an existing NCCL engine.

    comm = make_communicator("auto", rank, world, device, port)
    comm.all_gather(send, recv)     # recv [world, *send.shape] <- every rank's send
    comm.all_reduce(buf)            # buf <- the sum of every rank's buf, in place
    comm.close()

Engines, all on the caller's current CuPy stream, CuPy arrays in place:

* ``cupy``: cupyx.distributed's NCCL backend (its TCP store on `port` for the rendezvous,
  served by a process rank 0 forks: its target holds a lock, so it cannot be spawned).
  Needs CuPy to find NCCL (the nvidia-nccl-cu13 wheel; torch brings one).
* ``torch``: torch.distributed with the nccl backend (tcp:// rendezvous on `port`), the
  CuPy arrays viewed as torch tensors through DLPack (no copy), CuPy's stream made torch's
  current stream for the call.
* ``auto``: ``torch`` where torch has NCCL, else ``cupy`` where CuPy finds NCCL, else a
  RuntimeError saying what is missing. torch first: it is the engine whose world-size-1
  run on an H200 passed (docs/tensor-parallel.md says what ran).
* ``fake``: FakeCommunicator, for the CPU suite: NumPy arrays through files in a directory,
  ranks in step by a barrier (threads or processes). Not a transport anyone should use.

NVLink multicast stays off (the launcher sets NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 before any engine loads); nothing
here calls cuMulticastCreate.
"""
from __future__ import annotations

import os
from contextlib import contextmanager, nullcontext

import numpy as np

__all__ = ["ENGINES", "NO_MULTICAST_ENV", "FakeCommunicator", "make_communicator",
           "engine_available", "resolve_engine", "visible_gpus", "start_method"]

ENGINES = ("auto", "cupy", "torch", "fake")
AUTO_ORDER = ("torch", "cupy")
# Set in every rank before NCCL loads: NVLink multicast can take a shared host's GPUs down.
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                    "NVSHMEM_DISABLE_NVLS": "1"}


def visible_gpus() -> int:
    """CUDA devices this process sees (0 where there is no driver or no CuPy)."""
    try:
        from cupy.cuda import runtime

        return int(runtime.getDeviceCount())
    except Exception:
        return 0


def _host(arr) -> np.ndarray:
    return arr.get() if hasattr(arr, "get") else np.asarray(arr)


def _assign(dst, src: np.ndarray) -> None:
    if hasattr(dst, "set"):   # a CuPy array: one host-to-device copy
        dst.set(np.ascontiguousarray(src, dtype=dst.dtype))
    else:
        dst[...] = src


def engine_available(engine: str) -> tuple[bool, str]:
    """(usable, why not) for the `cupy` or `torch` NCCL engine, without starting it."""
    if engine == "cupy":
        try:
            from cupy.cuda import nccl
        except Exception as exc:   # CuPy itself missing or broken
            return False, f"cupy.cuda.nccl cannot be imported: {exc}"
        if not nccl.available:
            return False, ("CuPy finds no NCCL library (libnccl.so.2): install "
                           "nvidia-nccl-cu13")
        return True, ""
    if engine == "torch":
        try:
            import torch.distributed as dist
        except Exception as exc:
            return False, f"torch.distributed cannot be imported: {exc}"
        if not dist.is_available() or not dist.is_nccl_available():
            return False, "this torch has no NCCL backend"
        return True, ""
    raise ValueError(f"engine must be cupy or torch here, got {engine!r}")


def resolve_engine(engine: str) -> str:
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if engine != "auto":
        return engine
    reasons = []
    for name in AUTO_ORDER:
        ok, why = engine_available(name)
        if ok:
            return name
        reasons.append(f"{name}: {why}")
    raise RuntimeError("no NCCL engine: " + "; ".join(reasons))


@contextmanager
def start_method(method: str):
    """multiprocessing's default start method set to `method` inside, restored after (a
    spawned process inherits its parent's default, which may be spawn)."""
    import multiprocessing as mp

    before = mp.get_start_method(allow_none=True)
    mp.set_start_method(method, force=True)
    try:
        yield
    finally:
        mp.set_start_method(before, force=True)


class _CupyNccl:
    name = "cupy"

    def __init__(self, rank: int, world: int, port: int):
        import cupyx.distributed

        self.rank, self.world = rank, world
        with start_method("fork"):   # rank 0's store process (see the module docstring)
            self._comm = cupyx.distributed.init_process_group(world, rank, backend="nccl",
                                                              host="127.0.0.1", port=port)

    def all_gather(self, send, recv) -> None:
        self._comm.all_gather(send, recv, send.size)

    def all_reduce(self, buf) -> None:
        self._comm.all_reduce(buf, buf, "sum")

    def close(self) -> None:
        self._comm.stop()

    def abort(self) -> None:
        """After a failure: stop rank 0's store process, make no NCCL call."""
        if self.rank == 0:
            self._comm._store.stop()


class _TorchNccl:
    name = "torch"

    def __init__(self, rank: int, world: int, device: int, port: int):
        import torch
        import torch.distributed as dist

        self.rank, self.world = rank, world
        self._torch, self._dist = torch, dist
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, device_id=torch.device("cuda", device))

    def _on_cupy_stream(self):
        import cupy

        ptr = cupy.cuda.get_current_stream().ptr
        if not ptr:   # the legacy default stream is torch's default stream too
            return nullcontext()
        return self._torch.cuda.stream(self._torch.cuda.ExternalStream(ptr))

    def all_gather(self, send, recv) -> None:
        t = self._torch.from_dlpack
        with self._on_cupy_stream():
            self._dist.all_gather_into_tensor(t(recv), t(send))

    def all_reduce(self, buf) -> None:
        with self._on_cupy_stream():
            self._dist.all_reduce(self._torch.from_dlpack(buf))

    def close(self) -> None:
        self._dist.destroy_process_group()

    def abort(self) -> None:
        """After a failure: nothing that could wait on a faulted device (the process exits)."""


class FakeCommunicator:
    """The collectives' semantics for the CPU suite (NumPy arrays, or CuPy ones through
    host copies): every rank writes its array to `directory`, waits for the others at
    `barrier`, reads all of them in rank order (so the sum is the same on every rank), and
    waits again before the files are reused."""

    name = "fake"

    def __init__(self, rank: int, world: int, barrier, directory: str):
        self.rank, self.world, self.barrier, self.directory = rank, world, barrier, directory
        self.calls = 0

    def _exchange(self, arr) -> list:
        self.calls += 1
        path = os.path.join(self.directory, f"{self.calls}.{self.rank}.npy")
        np.save(path, _host(arr))
        self.barrier.wait()
        got = [np.load(os.path.join(self.directory, f"{self.calls}.{r}.npy"))
               for r in range(self.world)]
        self.barrier.wait()
        if self.rank == 0:
            for r in range(self.world):
                os.remove(os.path.join(self.directory, f"{self.calls}.{r}.npy"))
        return got

    def all_gather(self, send, recv) -> None:
        if recv.shape != (self.world, *send.shape):
            raise ValueError(f"all_gather: recv must be {(self.world, *send.shape)}, got "
                             f"{recv.shape}")
        _assign(recv, np.stack(self._exchange(send)))

    def all_reduce(self, buf) -> None:
        parts = self._exchange(buf)
        total = parts[0].copy()
        for p in parts[1:]:
            total += p
        _assign(buf, total)

    def close(self) -> None:
        pass

    abort = close


def make_communicator(engine: str, rank: int, world: int, device: int, port: int, *,
                      barrier=None, directory: str | None = None):
    """The communicator of `rank` (see the module docstring). The GPU engines need the
    rank's device current and the multicast variables set (tp_launch does both)."""
    engine = resolve_engine(engine)
    if engine == "fake":
        if barrier is None or directory is None:
            raise ValueError("the fake communicator needs a barrier and a directory")
        return FakeCommunicator(rank, world, barrier, directory)
    for k, v in NO_MULTICAST_ENV.items():
        if os.environ.get(k) != v:
            raise RuntimeError(f"{k} must be {v} before NCCL starts (NVLink multicast off), "
                               f"got {os.environ.get(k)!r}")
    if engine == "cupy":
        return _CupyNccl(rank, world, port)
    return _TorchNccl(rank, world, device, port)
