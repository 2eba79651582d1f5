"""Compare a paged decode result with the float64 reference.

Rows that see at least one position are compared as `compare.compare` does (relL2 for out and
latent, max abs for lse, with its tolerances and NaN never passing). Rows that see nothing
(an empty request, an early causal query of a short one) have no rounding to forgive: their
latent and out must be exactly 0 and their lse exactly -inf, and `empty_rows` counts those
that are not.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .compare import Comparison, Tolerance, compare
from .paged import PagedResult
from .reference import DecodeResult, to_host

__all__ = ["PagedComparison", "compare_paged"]


@dataclass
class PagedComparison:
    live: Comparison | None   # None when no row sees a position
    empty_rows: int           # rows that see nothing, of them
    empty_wrong: int          # ... whose latent/out is not 0 or whose lse is not -inf

    @property
    def ok(self) -> bool:
        return self.empty_wrong == 0 and (self.live is None or self.live.ok)

    def summary(self) -> str:
        lines = [] if self.live is None else [self.live.summary()]
        verdict = "ok  " if self.empty_wrong == 0 else "FAIL"
        lines.append(f"{verdict} empty  {self.empty_wrong} of {self.empty_rows} rows that see "
                     "nothing are not latent 0 / lse -inf")
        return "\n".join(lines)


def compare_paged(result: PagedResult, ref: PagedResult, tol: Tolerance | None = None,
                  *, worst_k: int = 3) -> PagedComparison:
    got_lat = np.asarray(to_host(result.latent), np.float64)
    got_lse = np.asarray(to_host(result.lse), np.float64)
    want_lat, want_lse = np.asarray(ref.latent), np.asarray(ref.lse)
    if got_lat.shape != want_lat.shape or got_lse.shape != want_lse.shape:
        raise ValueError(f"result shapes {got_lat.shape}, {got_lse.shape} differ from the "
                         f"reference's {want_lat.shape}, {want_lse.shape}")
    has_out = ref.out is not None
    got_out = np.asarray(to_host(result.out), np.float64) if has_out else None
    empty = np.isneginf(want_lse)
    bad = ~(np.isneginf(got_lse) & np.all(got_lat == 0, axis=-1))
    if has_out:
        bad |= ~np.all(got_out == 0, axis=-1)
    live = ~empty
    comparison = None
    if live.any():
        def pick(a):
            return a[live] if a is not None else np.zeros((int(live.sum()), 1))
        comparison = compare(DecodeResult(pick(got_out), got_lat[live], got_lse[live]),
                             DecodeResult(pick(ref.out if has_out else None),
                                          want_lat[live], want_lse[live]),
                             tol, worst_k=worst_k)
    return PagedComparison(comparison, int(empty.sum()), int((bad & empty).sum()))
