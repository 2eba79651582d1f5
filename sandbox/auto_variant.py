"""What `variant="auto"` runs for a paged step: the rule and the measurements behind it.

    auto_name(s_q, n_head)                                   # no device facts: mma16 / mma32
    auto_name(s_q, n_head, AutoFacts.of(shape, "sm_90"))     # what PagedDecodeStep passes

* At most 16 query rows (s_q x heads): `mma16`. It beats wgmma64, whose 64-row tile would be
  three quarters padding, at every measured context (docs/wgmma-deep-dive.md).
* Otherwise `wgmma64` where it can run and the step is large enough to pay for its start:
  an sm_90 device (wgmma.mma_async is sm_90a only), q in the cache dtype (the kernel's only
  q), every request's room in the table (max_pages x page_size) at least
  WGMMA_MIN_LENGTH positions, and rows x that room x batch at least WGMMA_MIN_WORK.
  Else `mma32`.

The thresholds are the crossover measured on the H200 (2026-12-04,
results/h200-2026-12-04-ef6b5c5, `cross_*` and `depth_*`; latent graphs, us, mma32 /
wgmma64, B x context x heads): at 2^20 row-positions the two tie or mma32 leads (1 x 8192 x
128: 29.9 / 30.5; 2 x 4096 x 128: 31.5 / 31.1; 1 x 16384 x 64: 31.7 / 33.7; 1 x 32768 x 32:
34.4 / 36.4), at 2^21 wgmma64 leads (1 x 16384 x 128: 42.2 / 36.2; 4 x 4096 x 128: 43.5 /
35.6; 1 x 131072 x 32: 71.7 / 64.4), and far above it by up to 3x (128 x 4096 x 128: 807 at
3b79d36 / 255 at bec552f, docs/results.md); short requests keep mma32 ahead whatever the
batch (32 x 512 x 128: 41.2 / 54.1). The room in the table stands for the lengths: they live
on the device and change between replays of one graph, and the step is planned for that
room.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AutoFacts", "auto_name", "WGMMA_MIN_LENGTH", "WGMMA_MIN_WORK", "WGMMA_ARCH"]

WGMMA_ARCH = "sm_90"          # the devices wgmma64 runs on (built for sm_90a)
WGMMA_MIN_LENGTH = 4096       # positions of room a request, at least
WGMMA_MIN_WORK = 1 << 21      # query rows x positions of room x batch, at least


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
    rows = s_q * n_head
    if rows <= 16:
        return "mma16"
    if (facts is not None and facts.arch == WGMMA_ARCH and facts.q_in_cache_dtype
            and facts.max_len >= WGMMA_MIN_LENGTH
            and rows * facts.max_len * facts.batch >= WGMMA_MIN_WORK):
        return "wgmma64"
    return "mma32"
