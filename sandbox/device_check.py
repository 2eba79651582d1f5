"""`mlasandbox check` on a device: every variant against the float64 reference, and the
negative control shown failing there too.

Each variant runs once on fresh inputs (NaN rows past n_ctx, NaN-poisoned outputs and
partials) through CupyBackend.check, with the tolerances of the GPU suite (compare's 1e-4
for the CUDA variants, the cast rounding for the cuBLAS engine). The negative control is the
same check with the combine that drops the exp(m_i - m) rescale, forced to CONTROL_SPLITS
slices so that there is something to merge: it must fail the check, or the check has no power.
"""
from __future__ import annotations

from . import bench_gpu, registry
from .dims import Dims

__all__ = ["CHECK_CTX", "CHECK_HEADS", "CONTROL_SPLITS", "device_checks"]

CHECK_CTX = 20000      # above the split gate: every splitting variant merges partials
CHECK_HEADS = 12       # a tensor-parallel shard: a partial head block for 16 and 32 per block
CONTROL_SPLITS = 16


def _rows(results, label):
    for r in results:
        yield {"name": f"{r['variant']} {label}", "variant": r["variant"],
               "n_ctx": r["n_ctx"], "heads": r["heads"], "splits": r.get("splits"),
               "latent_relL2": r.get("latent_relL2"), "tolerance": r.get("tolerance"),
               "ran": "latent_relL2" in r, "passed": bool(r["ok"]),
               "detail": r.get("detail", "")}


def device_checks(variants=None, n_ctx: int = CHECK_CTX, n_head: int = CHECK_HEADS,
                  cache: str = "f16", q: str = "f32", seed: int = 0, backend=None) -> list[dict]:
    """Rows {"name", "ok", "detail", ...}: one per variant against the reference (ok when it
    matches), then one per splitting CUDA variant with the broken combine (ok when the check
    rejects it; a run that could not launch is not a rejection)."""
    if backend is None:
        backend = bench_gpu.CupyBackend(flush=False, preroll=False)
    names = list(variants) if variants is not None else registry.variant_names()
    dims = Dims(n_head=n_head)
    qd = cache if q == "cache" else q
    out = []
    for row in _rows(backend.check(names, dims, n_ctx, cache, qd, seed, "auto"),
                     "vs float64 reference"):
        row["ok"] = row["passed"]
        out.append(row)
    controls = [n for n in names if registry.variant(n).is_cuda and registry.variant(n).splits]
    if controls:
        for row in _rows(backend.check(controls, dims, n_ctx, cache, qd, seed, CONTROL_SPLITS,
                                       rescale=False),
                         "negative control (combine without rescale, must fail)"):
            row["ok"] = row["ran"] and not row["passed"]
            if row["passed"]:
                row["detail"] = ("the broken combine passed the check: the check has no power "
                                 f"(latent relL2 {row['latent_relL2']:.2e})")
            elif row["ran"]:
                row["detail"] = (f"rejected as it must: latent relL2 {row['latent_relL2']:.2e} "
                                 f"> {row['tolerance']:.0e}")
            out.append(row)
    return out
