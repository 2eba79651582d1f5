"""The largest problem the kernels can run, and the host memory the CPU engines need.

One validation, shared by the CLI, the float64 reference, the schedule model and the API:

* splits: the attention grid is (head blocks, S) and CUDA's grid y dimension holds at most
  65535 blocks on every architecture;
* n_ctx: the kernels take n_ctx and S as int32 and compute a slice's length as
  (n_ctx + S - 1) / S in int32, so n_ctx + S - 1 must stay below 2**31;
* n_head: the kernels index heads as int32 (head0 = blockIdx.x x heads per block, plus up
  to one head block of padding), so n_head keeps a head block of headroom below 2**31;
* SMs: an SM count the split and chunk rules plan for (`--sms` without a GPU) is at most
  MAX_SMS, 65,535, far above any GPU's (132 on an H100 or H200), where a plan of one head
  block already passes the grid's y limit;
* s_q: a paged step's query rows s_q x heads are indexed as those heads are, and the output
  projection's grid z dimension holds batch x s_q / 32 blocks (`check_s_q`).

`read_input_bytes` / `read_input_text` read a file the user names (a lengths file, a
baseline, a saved profile): a regular file only, and a capped number of bytes.

`check_host_memory` is the CPU engines' own limit: they hold the context in float32 and
float64 in host memory, and a request that cannot fit is refused before it allocates.
"""
from __future__ import annotations

import math
import numbers
import os
import stat

import numpy as np

from .registry import PROJECT_M_ROWS, PROJECT_WIDE_M_ROWS

__all__ = ["MAX_SPLITS", "MAX_SMS", "MAX_CTX", "MAX_HEADS", "check_problem", "check_int",
           "cpu_bytes", "host_memory_bytes", "check_host_bytes", "check_host_memory"]

MAX_SPLITS = 65535
MAX_SMS = MAX_SPLITS
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


def check_host_bytes(need: int, what: str, detail: str = "", verb: str = "needs") -> None:
    """ValueError where `what` needs more than this machine's memory (`need` bytes):
    "WHAT VERB about N GiB of host memoryDETAIL; this machine has M GiB"."""
    have = host_memory_bytes()
    if have is not None and need > have:
        raise ValueError(f"{what} {verb} about {_gib(need)} of host memory{detail}; this "
                         f"machine has {_gib(have)}")


def check_host_memory(n_ctx: int, n_head: int, key_dim: int = 576, what: str = "n_ctx",
                      engine: str = "the CPU engines") -> None:
    """ValueError when one step of `engine` at (n_ctx, n_head) needs more host memory than
    the machine has."""
    check_host_bytes(cpu_bytes(n_ctx, n_head, key_dim), f"{what} {n_ctx:,} with {n_head} heads",
                     f" for {engine}")


# ---- the same checks for arguments of other kinds: the kernels' int32 arguments, arrays of
# lengths, real numbers and flags, with the same words wherever they are taken.

INT32_MAX = 2**31 - 1

__all__ += ["INT32_MAX", "is_int_in", "check_int_at_most", "check_int_array", "check_real",
            "check_bool"]


def is_int_in(value, low, high) -> bool:
    """Whether `value` is a plain int in low..high: the cheap test a hot loop makes first, so
    that it runs the full checks (NumPy ints, whole floats, the error) only when this fails."""
    return type(value) is int and low <= value <= high


def check_int_at_most(name: str, value, low: int, high: int, why: str) -> int:
    """check_int with an upper limit: ValueError naming `name`, `high` and `why` above it."""
    if is_int_in(value, low, high):
        return value
    return _check_int(name, check_int(name, value, low), low, high, why)


def check_int_array(name: str, values, low: int, high: int, why: str) -> np.ndarray:
    """`values` as a 1-D int64 array of at least one integer in low..high: integers or
    whole-number floats (as check_int), never bools, text or fractions. ValueError naming
    `name` and the limit."""
    try:
        arr = np.asarray(values)
    except (TypeError, ValueError) as e:  # ragged lists; device arrays refuse to convert
        raise ValueError(f"{name} must be a 1-D list of at least one integer: {e}") from None
    if arr.ndim != 1 or arr.size == 0:
        got = repr(values) if arr.ndim == 0 else f"shape {arr.shape}"
        raise ValueError(f"{name} must be a 1-D list of at least one integer, got {got}")
    if isinstance(values, (list, tuple)):  # NumPy would take [True, 0] as the ints [1, 0]
        flag = next((v for v in values if isinstance(v, (bool, np.bool_))), None)
        if flag is not None:
            raise ValueError(f"{name} must hold integers, got {flag!r} (a bool)")
    if arr.dtype.kind not in "iu":
        if arr.dtype.kind not in "fO":  # bools, text, complex numbers
            raise ValueError(f"{name} must hold integers, got {arr[0].item()!r} (an array "
                             f"of {arr.dtype})")
        # one by one: the first fraction or non-number is named; Python ints keep their size
        arr = np.array([check_int(name, v, low) for v in arr.tolist()], dtype=object)
    for extreme in (arr.min(), arr.max()):
        _check_int(name, int(extreme), low, high, why)
    return arr.astype(np.int64, copy=False)


def check_real(name: str, value) -> float:
    """`value` as a finite float: a real number (NumPy's too), never a bool or text.
    TypeError naming `name` for what is not a real number, ValueError for inf and NaN."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r} (not a bool or text)")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


# The kernels take the softmax scale as scale x log2(e) in float32 (exp2 of the scores).
F32_MAX = float(np.finfo(np.float32).max)
LOG2E = math.log2(math.e)
MAX_SCALE = F32_MAX / LOG2E

__all__ += ["LOG2E", "MAX_SCALE", "check_scale"]


def check_scale(value) -> float:
    """`value` as the softmax scale: a finite real (check_real) whose magnitude stays within
    MAX_SCALE, so that scale x log2(e), the kernels' float32 argument, is finite."""
    value = check_real("scale", value)
    if abs(value) > MAX_SCALE:
        raise ValueError(f"scale must be at most {MAX_SCALE:.6g} in magnitude (the kernels take "
                         f"scale x log2(e) as a float32), got {value:g}")
    return value


def check_bool(name: str, value) -> bool:
    """`value` as a bool: True or False (NumPy's too), never a number or text. TypeError
    naming `name`."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return bool(value)


__all__ += ["check_flags"]


def check_flags(optional=(), **flags) -> None:
    """check_bool of each flag by its name; those named in `optional` may also be None (the
    caller's "choose for me"). A bare bool() would take "no" as True."""
    for name, value in flags.items():
        if value is None and name in optional:
            continue
        check_bool(name, value)


# ---- a paged step's query rows: s_q tokens a request, each read by every head.
#
# * the kernels take n_rows = s_q x heads as int32 and index rows a row block past it (row
#   head0 + j, head0 = blockIdx.x x rows a block), the n_head limit's reason;
# * the output projection's grid is (heads, wv_b row blocks, ceil(B x s_q / tile))
#   (registry.project_grid), and CUDA's grid z dimension holds at most 65535 blocks on every
#   architecture; the narrower tile (PROJECT_M_ROWS) bounds it whichever tile is picked.

GRID_Z_MAX = 65535
MAX_QUERY_TOKENS = GRID_Z_MAX * min(PROJECT_M_ROWS, PROJECT_WIDE_M_ROWS)

__all__ += ["GRID_Z_MAX", "MAX_QUERY_TOKENS", "check_s_q"]


def check_s_q(s_q, n_head: int, batch: int | None = None, name: str = "s_q") -> int:
    """`s_q` (query tokens a request) as an int the kernels can run with `n_head` heads and,
    where given, `batch` requests: ValueError naming `name` and the tighter limit."""
    s_q = check_int(name, s_q, 1)
    n_head = check_int("n_head", n_head, 1)
    high, why = MAX_HEADS // n_head, f"the kernels index s_q x {n_head} heads query rows as int32"
    if batch is not None and MAX_QUERY_TOKENS // check_int("batch", batch, 1) < high:
        high = MAX_QUERY_TOKENS // batch
        why = (f"the output projection's grid z dimension holds ceil(batch {batch} x s_q / "
               f"{MAX_QUERY_TOKENS // GRID_Z_MAX}) blocks, at most {GRID_Z_MAX}")
    return _check_int(name, s_q, 1, high, why)


# ---- files a command reads by path: `--lengths @FILE`, `bench --vs`, `stalls --from`.
# Each is read only if it is a regular file, and at most `limit` bytes of it: st_size says 0
# for /dev/zero, a FIFO's read waits for a writer, and a file may grow while it is read.

MAX_INPUT_FILE_BYTES = 64 << 20

__all__ += ["MAX_INPUT_FILE_BYTES", "read_input_bytes", "read_input_text", "input_text",
            "size_text"]

_NOT_REGULAR = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                (stat.S_ISSOCK, "a socket"))


def _refuse_irregular(label: str, mode: int) -> None:
    if not stat.S_ISREG(mode):
        kind = next((words for test, words in _NOT_REGULAR if test(mode)), "of another kind")
        raise ValueError(f"{label} is {kind}, not a regular file")


def size_text(n: int) -> str:
    """A byte count as a limit is said: whole MiB where it is one, else bytes."""
    return f"{n >> 20} MiB" if n >= 1 << 20 and not n % (1 << 20) else f"{n:,} bytes"


def read_input_bytes(path, what: str, limit: int = MAX_INPUT_FILE_BYTES) -> bytes:
    """The bytes of the regular file `path`, at most `limit` of them. ValueError naming
    `what` and the path for a file that cannot be read, is not a regular file (a directory,
    a FIFO, a device) or holds more than `limit` bytes, before any more is read."""
    label = f"{what} {os.fspath(path)!r}"
    if "\0" in str(os.fspath(path)):   # os.stat raises ValueError, naming no file
        raise ValueError(f"cannot read {label}: a path holds no NUL byte")
    try:
        _refuse_irregular(label, os.stat(path).st_mode)  # never opens a FIFO or a device
        # O_NONBLOCK: a path swapped for a FIFO after the stat opens at once instead of
        # waiting for a writer, and fstat refuses it
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
        fd = os.open(path, flags)
        with os.fdopen(fd, "rb") as f:
            _refuse_irregular(label, os.fstat(fd).st_mode)
            data = f.read(limit + 1)
    except OSError as exc:
        raise ValueError(f"cannot read {label}: {exc.strerror or exc}") from None
    if len(data) > limit:
        raise ValueError(f"{label} is larger than {size_text(limit)}")
    return data


def read_input_text(path, what: str, limit: int = MAX_INPUT_FILE_BYTES) -> str:
    """read_input_bytes' bytes as UTF-8 text (input_text)."""
    return input_text(read_input_bytes(path, what, limit), path, what)


def input_text(data: bytes, path, what: str) -> str:
    """`data`, read from `path`, as UTF-8 text (a leading byte-order mark dropped);
    ValueError naming `what` and the path where it is not UTF-8."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{what} {os.fspath(path)!r} is not UTF-8 text (byte {exc.start} is "
                         f"{data[exc.start:exc.start + 1]!r})") from None
