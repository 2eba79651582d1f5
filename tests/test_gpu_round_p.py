"""The rounded-p tensor-core variants, mma16r and mma32r, against the float64 reference (GPU).

mma16r / mma32r are mma16 / mma32 with p rounded to the cache dtype once for the value product
(kRoundP in cuda_src/mla_mma.cu), the exactness FlashMLA and wgmma64 have. Their batch-1
cases are in test_gpu_kernels.py's grid, which takes every variant; here: the paged contract
(page sizes, s_q with causal, empty requests, both dtypes, f32 and 16-bit q), a single pass,
and a check that the rounding is really there and that the bound can tell it from the exact
kernel.

Tolerance: test_gpu_wgmma.rounding_bound, derived there for this very rounding (each weight
p_j rounded once to the cache dtype, the running sum l from the f32 p): MARGIN times the rms
relL2 the rounding gives on the case's own inputs, plus the f32 tolerance 1e-4. lse is
computed from the f32 scores and p: 1e-4 absolute, as for the exact kernels.
"""
from __future__ import annotations

import pytest

from gpu_support import fresh_seed, gpu
from mlasandbox.compare import rel_l2
from mlasandbox.compare_paged import compare_paged
from mlasandbox.reference import decode_paged
from test_gpu_paged_kernels import Case, _inputs, run_paged
from test_gpu_wgmma import F32_TOL, SM90_SKIP, rounding_bound, rounding_tolerance
from tolerances import MARGIN

CASES = [
    Case("mma16r", 16, (4097, 0, 1, 140), page_size=64, max_chunks=4, cache="f16", q="f16"),
    Case("mma16r", 4, (20, 2000, 1025), s_q=4, causal=True, page_size=16, max_chunks=8,
         cache="bf16", q="bf16"),
    Case("mma32r", 63, (700, 4096), s_q=2, causal=True, page_size=1, max_chunks=3),
    Case("mma32r", 16, (9000, 65, 0), page_size=64, max_chunks=12, cache="bf16", q="f32"),
]


@gpu
@pytest.mark.parametrize("case", CASES, ids=str)
def test_paged_rounded_p_matches_the_float64_reference(case):
    seed = fresh_seed()
    inp = _inputs(case, seed)
    res, _ = run_paged(inp, case.variant, case.max_chunks, target=case.target)
    ref = decode_paged(**inp.decode_args())
    cmp = compare_paged(res, ref, rounding_tolerance(inp, ref, case.cache))
    assert cmp.ok, f"{case} seed={seed}\n{cmp.summary()}"


@gpu
def test_a_rounded_single_pass_writes_latent_and_lse_without_the_merge():
    case = Case("mma16r", 16, (4097, 0, 1, 140), page_size=64, max_chunks=1, cache="bf16",
                q="bf16")
    seed = fresh_seed()
    inp = _inputs(case, seed)
    res, _ = run_paged(inp, case.variant, 1, target=case.target, merge=False)
    ref = decode_paged(**{**inp.decode_args(), "wv_b": None})
    cmp = compare_paged(res, ref, rounding_tolerance(inp, ref, case.cache))
    assert cmp.ok, f"{case} seed={seed}\n{cmp.summary()}"


# The window the rounded kernels' latent relL2 must fall in, in units of the model's rms
# (rounding_bound's, u16 / sqrt(3) per weight). On the CPU, p = 2^(s - m) of this test's
# inputs in f32 (s the float64 scores in log2 units, m the lazy max of each chunk's tiles of
# 64 positions, chunks by the rule at 4 slots and a wave target of 132), rounded to the
# cache dtype, weighs the rows as the kernels do (l from the f32 p):
#   f16  (seeds 1000-1299): to nearest 0.707 +- 0.030 (0.630 .. 0.864),
#                           truncated  1.850 +- 0.055 (1.598 .. 2.030)
#   bf16 (seeds 1000-1299, 2000-2599): to nearest 0.707 +- 0.030 (0.627 .. 0.985),
#                           truncated  1.845 +- 0.058 (1.510 .. 2.141)
# Nearest sits at 1/sqrt(2) (E d^2 = u^2 / 6 for significands spread over [1, 2)); truncation
# makes every d <= 0 (mean about -0.7 u), which also moves latent along itself. [0.4, 1.2]
# keeps nearest 10 standard deviations inside either end (its largest of 1200 seeds 1.22x
# under 1.2) and truncation 11 outside (its smallest 1.26x over); the f32 arithmetic adds
# ~1e-6 (0.005 rms in f16) and the exact kernel's hi + lo residual stays under 0.01 rms.
# 128 heads (256 rows): at 16 heads the two distributions touched (nearest up to 1.00,
# truncation down to 1.05 over 400 seeds), a row whose weight sits on a few positions
# carrying the whole relL2.
NEAREST_WINDOW = (0.4, 1.2)
ROUNDED = ("mma16r",) + (("wgmma64",) if SM90_SKIP is None else ())


@gpu
@pytest.mark.parametrize("cache", ["f16", "bf16"])
def test_the_rounding_is_there_and_the_bound_tells_it_apart(cache):
    """On one set of inputs the rounded kernels' latent (mma16r, and wgmma64 on sm_90) errs
    by the rounding to nearest of p (NEAREST_WINDOW x the model's rms: not the exact p, not
    p truncated), and mma16's by less than a twentieth of the rms: the rounded instance is
    the one launched, and the exact one is not held to the wider bound alone."""
    case = Case("mma16", 128, (4096, 3000), page_size=64, max_chunks=4, cache=cache, q=cache)
    seed = fresh_seed()
    inp = _inputs(case, seed)
    ref = decode_paged(**{**inp.decode_args(), "wv_b": None})
    rms = (rounding_bound(inp, ref, cache) - F32_TOL) / MARGIN
    errs = {}
    for variant in ("mma16",) + ROUNDED:
        res, _ = run_paged(inp, variant, case.max_chunks, target=case.target)
        errs[variant] = rel_l2(res.latent, ref.latent)
    label = f"{cache} seed={seed} rms={rms:.3g} relL2/rms={ {v: e / rms for v, e in errs.items()} }"
    lo, hi = NEAREST_WINDOW
    for variant in ROUNDED:
        assert lo * rms < errs[variant] < hi * rms, f"{variant}: {label}"
    assert errs["mma16"] < 0.05 * rms, label
