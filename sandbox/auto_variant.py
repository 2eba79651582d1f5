"""What `variant="auto"` runs for a paged step: the rule and the measurements behind it.

    auto_name(s_q, n_head)                                   # no device facts: mma16 / mma32
    auto_name(s_q, n_head, AutoFacts.of(shape, "sm_90"))     # what PagedDecodeStep passes
    auto_choice(s_q, n_head, facts)                          # (that name, the reason)

* At most 16 query rows (s_q x heads): `mma16`. It beats wgmma64, whose 64-row tile would be
  three quarters padding, at every measured context (docs/wgmma-deep-dive.md).
* A small step, rows x each request's room in the table (max_pages x page_size) x batch
  below LARGE_STEP, with q in the cache dtype: `mma16` too, its 16-row blocks several to a
  head group. There every block is a few tiles of latency, and more, smaller blocks finish
  first.
* A large step: `wgmma64` where it can run and pays for its start: an sm_90 device
  (wgmma.mma_async is sm_90a only), q in the cache dtype (the kernel's only q) and a room of
  at least WGMMA_MIN_LENGTH positions. Else `mma32`, which reads each tile for 32 rows
  where mma16 reads it for 16.

The thresholds are the crossovers measured on the H200, kernel against kernel on the same
steps: docs/wgmma-deep-dive.md, "The batch-1 depth curve beside FlashMLA, and what `auto`
runs". An f32 q was not measured: it keeps mma32. The room in the table stands for the
lengths: they live on the device and change between replays of one graph, and the step is
planned for that room.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AutoFacts", "auto_name", "auto_choice", "LARGE_STEP", "WGMMA_MIN_LENGTH", "WGMMA_ARCH"]

WGMMA_ARCH = "sm_90"          # the devices wgmma64 runs on (built for sm_90a)
LARGE_STEP = 1 << 21          # query rows x positions of room x batch: a large step from here
WGMMA_MIN_LENGTH = 4096       # positions of room a request, at least, for wgmma64


@dataclass(frozen=True)
class AutoFacts:
    """What the rule needs beyond the rows: the device's arch, whether q is in the cache
    dtype, the batch, and each request's room in the table."""

    arch: str
    q_in_cache_dtype: bool
    batch: int
    max_len: int

    @classmethod
    def of(cls, shape, arch: str) -> "AutoFacts":
        """From a validated PagedShape (sandbox/paged.py) on a device of `arch`."""
        return cls(arch, shape.q_dtype == shape.cache_dtype, shape.batch, shape.max_len)

    @classmethod
    def of_lengths(cls, lengths, page_size: int, q_dtype: str, cache_dtype: str,
                   arch: str = WGMMA_ARCH) -> "AutoFacts":
        """For a batch known on the host, with the table make_paged_inputs builds for it
        (room for the longest request, at least one page): the bench's and the repro's."""
        pages = max(1, -(-max(int(n) for n in lengths) // int(page_size)))
        return cls(arch, q_dtype == cache_dtype, len(lengths), pages * int(page_size))


def auto_name(s_q: int, n_head: int, facts: AutoFacts | None = None) -> str:
    """The registry name `auto` resolves to (module docstring); without facts, the rule of a
    device wgmma64 cannot run on."""
    return auto_choice(s_q, n_head, facts)[0]


def auto_choice(s_q: int, n_head: int, facts: AutoFacts | None = None) -> tuple[str, str]:
    """(auto_name's choice, the rule's reason for it in a line), for the front ends that say
    what `auto` ran."""
    rows = s_q * n_head
    if rows <= 16:
        return "mma16", f"{rows} query rows, at most 16 (a 64-row wgmma64 tile: most padding)"
    if facts is None:
        return "mma32", f"{rows} query rows and no device facts"
    if not facts.q_in_cache_dtype:
        return "mma32", (f"{rows} query rows, q not in the cache dtype (wgmma64 takes only "
                         "that q; an f32 q was not measured)")
    step = rows * facts.max_len * facts.batch
    size = f"{rows} rows x {facts.max_len} positions of room x batch {facts.batch} = {step:,}"
    if step < LARGE_STEP:
        return "mma16", f"a small step: {size} < {LARGE_STEP:,}"
    large = f"a large step ({size} >= {LARGE_STEP:,})"
    if facts.arch != WGMMA_ARCH:
        return "mma32", f"{large} on {facts.arch}, where wgmma64 cannot run"
    if facts.max_len < WGMMA_MIN_LENGTH:
        return "mma32", f"{large}, but under {WGMMA_MIN_LENGTH} positions of room a request"
    return "wgmma64", f"{large}, at least {WGMMA_MIN_LENGTH} positions of room a request"
