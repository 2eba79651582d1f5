"""Compare one decode result against the float64 reference, and say where it is worst.

Metrics: relative L2 error for `out` and `latent` (whole-tensor, so a few large entries cannot
hide among many small ones, and a uniform scale error shows up at full size), max absolute
error for `lse` (a log: an absolute error in it is a relative error in the normalizer).
A NaN or inf anywhere in a result fails its field, whatever the metric says: NaN never passes.

Why the default tolerances are 1e-4 (relL2) and 1e-4 (lse, absolute):

* The inputs are exactly representable in float64 (every accepted dtype is a subset of f32),
  so the reference has no input rounding to forgive: all error comes from the engine's f32
  arithmetic. That is rounding in the 576-term score dot products, in exp/exp2 (the fast
  hardware approximations are good to about 2 ulp), and above all in accumulating up to
  131072 terms of l and of the 512-wide latent in f32 (unit roundoff 6e-8).
* A sequential f32 sum of n terms has relative error growing like sqrt(n)*u for random
  rounding and n*u in the worst case. The schedule model (schedule.py), which sums exactly
  like a kernel thread, measures relL2(latent) of about 2e-6 at n_ctx = 20000 unsplit (an
  independent measurement found 1.6e-6) and 5e-6 at 131072; split over context, about
  3e-7 at both.
  So 1e-4 leaves more than an order of magnitude of headroom for a correct f32 kernel at
  the deepest context, while a real bug costs far more: one skipped 32-row tile (a wrong
  slice bound) measures relL2 1.4e-2 at n_ctx = 20000 and 2.3e-3 at 131072, and a combine
  without its exp(m_i - m) factors 0.2 .. 0.5 (the negative control in
  tests/test_schedule.py).
* `out` = wv_b @ latent is one more 512-term f32 dot product: the same 1e-4.
* lse = m + log(l) ~ 5 .. 20: an f32 ulp there is 0.5e-6 .. 2e-6 and the relative error of
  l (a few e-6 at depth) enters additively; the model measures 1e-6 .. 2e-6. So 1e-4
  absolute is again ample, and still below what one skipped tile does to it: 3.2e-3 at
  n_ctx = 20000, 6.4e-4 at 131072 (log of the share of the weight it held).

An engine that accumulates in f16/bf16 (not a contract of this sandbox) would need about
1e-2; pass a looser Tolerance explicitly, never widen the defaults.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from .reference import DecodeResult, to_host

__all__ = ["Tolerance", "DEFAULT_TOLERANCE", "rel_l2", "Mismatch", "FieldReport",
           "Comparison", "compare"]


@dataclass(frozen=True)
class Tolerance:
    """Pass limits: relL2 for out and latent, max absolute error for lse."""

    out: float = 1e-4
    latent: float = 1e-4
    lse_abs: float = 1e-4


DEFAULT_TOLERANCE = Tolerance()


def rel_l2(a, b) -> float:
    """||a - b|| / ||b|| in float64 (NaN if either holds a NaN; inf if b is all zero and a
    is not)."""
    a = np.asarray(to_host(a), dtype=np.float64)
    b = np.asarray(to_host(b), dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"rel_l2: shapes differ, {a.shape} vs {b.shape}")
    num = float(np.linalg.norm((a - b).ravel()))
    den = float(np.linalg.norm(b.ravel()))
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


@dataclass(frozen=True)
class Mismatch:
    """One of the worst entries: its position ((head, column) or (head,)), values, error."""

    position: tuple
    got: float
    want: float

    @property
    def abs_err(self) -> float:
        return abs(self.got - self.want) if math.isfinite(self.got) else math.inf


@dataclass
class FieldReport:
    name: str
    metric: str          # "relL2" | "max abs"
    value: float
    limit: float
    nonfinite: int       # NaN/inf entries in the result
    worst: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        # `value <= limit` is False for NaN, and any non-finite entry fails on its own.
        return self.nonfinite == 0 and self.value <= self.limit

    def line(self) -> str:
        verdict = "ok  " if self.ok else "FAIL"
        text = f"{verdict} {self.name:<6} {self.metric} {self.value:.3e} (limit {self.limit:.1e})"
        if self.nonfinite:
            text += f", {self.nonfinite} NaN/inf"
        if not self.ok and self.worst:
            where = "; ".join(f"{m.position}: {m.got:.6g} vs {m.want:.6g}" for m in self.worst)
            text += f"; worst at {where}"
        return text


@dataclass
class Comparison:
    out: FieldReport
    latent: FieldReport
    lse: FieldReport
    tolerance: Tolerance

    @property
    def fields(self) -> tuple:
        return (self.out, self.latent, self.lse)

    @property
    def ok(self) -> bool:
        return all(f.ok for f in self.fields)

    def summary(self) -> str:
        return "\n".join(f.line() for f in self.fields)

    def as_dict(self) -> dict:
        out = {"ok": self.ok, "tolerance": asdict(self.tolerance)}
        for f in self.fields:
            out[f.name] = {
                "metric": f.metric, "value": f.value, "limit": f.limit, "ok": f.ok,
                "nonfinite": f.nonfinite,
                "worst": [{"position": list(m.position), "got": m.got, "want": m.want}
                          for m in f.worst],
            }
        return out

    def __str__(self) -> str:
        return self.summary()


def _worst(got: np.ndarray, want: np.ndarray, k: int) -> list:
    """The k entries with the largest error; non-finite results rank first."""
    err = np.abs(got - want)
    err = np.where(np.isfinite(err), err, np.inf).ravel()
    k = min(k, err.size)
    idx = np.argpartition(-err, k - 1)[:k] if k else []
    idx = sorted(idx, key=lambda i: -err[i])
    return [Mismatch(tuple(int(x) for x in np.unravel_index(i, got.shape)),
                     float(got.ravel()[i]), float(want.ravel()[i])) for i in idx]


def _field(name: str, got, want, limit: float, metric: str, worst_k: int) -> FieldReport:
    got = np.asarray(to_host(got), dtype=np.float64)
    want = np.asarray(to_host(want), dtype=np.float64)
    if got.shape != want.shape:
        raise ValueError(f"{name}: result shape {got.shape} differs from reference {want.shape}")
    nonfinite = int(np.count_nonzero(~np.isfinite(got)))
    if metric == "relL2":
        value = rel_l2(got, want)
    else:
        value = float(np.max(np.abs(got - want))) if got.size else 0.0
    if nonfinite:
        value = math.nan
    return FieldReport(name, metric, value, float(limit), nonfinite,
                       _worst(got, want, worst_k))


def compare(result: DecodeResult, ref: DecodeResult, tol: Tolerance | None = None,
            *, worst_k: int = 3) -> Comparison:
    """Compare `result` (NumPy or CuPy, any float dtype) with the reference `ref`."""
    tol = DEFAULT_TOLERANCE if tol is None else tol
    return Comparison(
        out=_field("out", result.out, ref.out, tol.out, "relL2", worst_k),
        latent=_field("latent", result.latent, ref.latent, tol.latent, "relL2", worst_k),
        lse=_field("lse", result.lse, ref.lse, tol.lse_abs, "max abs", worst_k),
        tolerance=tol,
    )
