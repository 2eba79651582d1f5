"""The phase guard: every phase of a decode step ends with a poll for CUDA errors.

CUDA errors are sticky and surface at the next API call that checks, so
without a poll per phase a broken attention launch is reported somewhere else entirely.
The guard turns any error into a `PhaseError` that names the phase, the variant, the kernel,
the grid, the block and the shared memory.

* A launch the driver refuses (grid or shared memory past a limit) raises inside
  `cuLaunchKernel`, at once: the guard catches it in the phase that made it.
* An asynchronous fault (an out-of-bounds access) surfaces only when the stream is queried or
  synchronized. The default poll (`cudaStreamQuery`-like, non-blocking) catches faults that
  have already happened; `sync_check=True` synchronizes at the end of every phase, so the
  fault is reported by the phase that caused it. That costs a sync per phase: off by default
  for timing, on for `--sync-check` and the tests.
* Inside a CUDA-graph capture the guard does not poll: a query or a sync of a capturing
  stream would invalidate the capture. A refused launch still raises at once; the code that
  replays the graph checks the replay (the bench polls after the first one). `captured`
  counts the phases that skipped their poll this way.
* `launch(..., pdl=True)` launches with programmatic dependent launch (sandbox/pdl.py) where
  the device has it, a plain launch otherwise; `programmatic` counts the launches that were.
  A programmatic launch is refused or faults like any other, and is reported the same way.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

from .pdl import launch as pdl_launch

__all__ = ["PhaseError", "Launch", "PhaseGuard"]


class PhaseError(RuntimeError):
    """A CUDA error, located: which phase, which variant, which launch."""

    def __init__(self, phase: str, variant: str, launch: "Launch | None", cause: BaseException):
        self.phase, self.variant, self.launch, self.cause = phase, variant, launch, cause
        where = f" {launch}" if launch is not None else ""
        super().__init__(f"phase {phase!r} of variant {variant!r} failed:{where}: "
                         f"{type(cause).__name__}: {cause}")


@dataclass(frozen=True)
class Launch:
    kernel: str
    grid: tuple
    block: tuple
    smem_bytes: int
    pdl: bool = False   # launched with programmatic stream serialization

    def __str__(self) -> str:
        return (f"kernel {self.kernel}, grid {tuple(self.grid)}, block {tuple(self.block)}, "
                f"dynamic shared memory {self.smem_bytes} B"
                + (", programmatic dependent launch" if self.pdl else ""))


def _cuda_error_types() -> tuple:
    from cupy_backends.cuda.api import driver, runtime

    return (driver.CUDADriverError, runtime.CUDARuntimeError)


class PhaseGuard:
    def __init__(self, variant: str, sync_check: bool = False):
        self.variant = variant
        self.sync_check = sync_check
        self.polls = 0     # counted, so a test can assert the guard actually ran
        self.captured = 0  # phases that ran inside a graph capture, where polling is not allowed
        self.programmatic = 0  # launches made with programmatic dependent launch

    @contextmanager
    def phase(self, name: str, launch: Launch | None = None):
        import cupy

        errors = _cuda_error_types()
        try:
            yield
            stream = cupy.cuda.get_current_stream()
            if stream.is_capturing():
                self.captured += 1
                return
            if self.sync_check:
                stream.synchronize()
            else:
                stream.done  # a non-blocking query: raises the sticky error if one is pending
            self.polls += 1
        except errors as exc:
            raise PhaseError(name, self.variant, launch, exc) from exc

    def launch(self, name: str, kernel, grid, block, args, smem_bytes: int = 0,
               kernel_name: str | None = None, pdl: bool = False):
        """Launch `kernel` as phase `name`, under the guard; `pdl`: with programmatic
        dependent launch where the device has it (pdl.launch)."""
        launch = Launch(kernel_name or getattr(kernel, "name", "?"), tuple(grid), tuple(block),
                        int(smem_bytes), bool(pdl))
        with self.phase(name, launch):
            if not pdl:
                kernel(tuple(grid), tuple(block), args, shared_mem=int(smem_bytes))
            elif pdl_launch(kernel, grid, block, args, smem_bytes):
                self.programmatic += 1
