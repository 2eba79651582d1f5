"""The largest problem the kernels can run, and the host memory the CPU engines need.

One validation, shared by the CLI, the float64 reference, the schedule model and the API:

* splits: the attention grid is (head blocks, S) and CUDA's grid y dimension holds at most
  65535 blocks on every architecture;
* n_ctx: the kernels take n_ctx and S as int32 and compute a slice's length as
  (n_ctx + S - 1) / S in int32, so n_ctx + S - 1 must stay below 2**31;
* n_head: the kernels index heads as int32 (head0 = blockIdx.x x heads per block, plus up
  to one head block of padding), so n_head keeps a head block of headroom below 2**31.

`check_host_memory` is the CPU engines' own limit: they hold the context in float32 and
float64 in host memory, and a request that cannot fit is refused before it allocates.
"""
from __future__ import annotations

import math
import numbers
import os

__all__ = ["MAX_SPLITS", "MAX_CTX", "MAX_HEADS", "check_problem", "check_int", "cpu_bytes",
           "host_memory_bytes", "check_host_memory"]

MAX_SPLITS = 65535
MAX_CTX = 2**31 - 1 - (MAX_SPLITS - 1)
MAX_HEADS = 2**31 - 1 - 64

_DEFAULT_NAMES = {"n_ctx": "n_ctx", "n_head": "n_head", "splits": "splits"}


def _check_int(label: str, value, low: int, high: int, why: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) and not hasattr(value, "__index__"):
        raise TypeError(f"{label} must be an integer, got {value!r}")
    value = int(value)
    if value < low:
        raise ValueError(f"{label} must be >= {low}, got {value}")
    if value > high:
        raise ValueError(f"{label} must be <= {high:,} ({why}), got {value:,}")
    return value


def check_int(name: str, value, low: int) -> int:
    """`value` as an int >= low: an integer or a whole-number float, never a bool, text or a
    fraction. ValueError naming `name` and the limit."""
    whole = isinstance(value, numbers.Integral) or (
        isinstance(value, numbers.Real) and math.isfinite(value) and float(value).is_integer())
    if isinstance(value, bool) or not whole or value < low:  # numpy bools are not numbers
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def check_problem(n_ctx=None, n_head=None, splits=None, names: dict | None = None) -> None:
    """Raise ValueError naming the parameter and the limit when a problem is too large for
    the kernels (None: not checked; splits 'auto' is not checked). `names` maps n_ctx /
    n_head / splits to what the caller calls them (e.g. '--ctx')."""
    label = {**_DEFAULT_NAMES, **(names or {})}
    if n_ctx is not None:
        _check_int(label["n_ctx"], n_ctx, 1, MAX_CTX,
                   "the kernels compute slice bounds as n_ctx + splits - 1 in int32")
    if n_head is not None:
        _check_int(label["n_head"], n_head, 1, MAX_HEADS, "the kernels index heads as int32")
    if splits not in (None, "auto"):
        _check_int(label["splits"], splits, 1, MAX_SPLITS,
                   "the grid's y dimension, one block row per split, holds at most 65535")


def cpu_bytes(n_ctx: int, n_head: int, key_dim: int = 576) -> int:
    """Host memory the CPU engines need for one step, an upper estimate: the cache as given
    (2 B per value) and widened to float32 (4 B), and float64 scores per head and position
    (the reference) with their float32 twins (the schedule model)."""
    return int(n_ctx) * (6 * key_dim + 12 * int(n_head))


def host_memory_bytes() -> int | None:
    """Physical memory of this machine, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB"


def check_host_memory(n_ctx: int, n_head: int, key_dim: int = 576, what: str = "n_ctx",
                      engine: str = "the CPU engines") -> None:
    """ValueError when one step of `engine` at (n_ctx, n_head) needs more host memory than
    the machine has."""
    have = host_memory_bytes()
    need = cpu_bytes(n_ctx, n_head, key_dim)
    if have is not None and need > have:
        raise ValueError(f"{what} {n_ctx:,} with {n_head} heads needs about {_gib(need)} of "
                         f"host memory for {engine}; this machine has {_gib(have)}")
