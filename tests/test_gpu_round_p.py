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
from test_gpu_wgmma import F32_TOL, rounding_bound, rounding_tolerance
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


@gpu
@pytest.mark.parametrize("cache", ["f16", "bf16"])
def test_the_rounding_is_there_and_the_bound_tells_it_apart(cache):
    """On one set of inputs mma16r's latent errs by about the rounding model's rms (more than
    a tenth of it, under the bound), and mma16's by less than a twentieth of it: the rounded
    instance is the one launched, and the exact one is not held to the wider bound alone.
    (Rounding to nearest with significands spread over [1, 2) gives E d^2 = u^2 / 6, so the
    measured relL2 sits near 0.7 rms; the exact kernel's hi + lo residual is u^2 relative,
    1e-6 (f16) to 3e-5 (bf16) of relL2, against an rms of 2.8e-4 and 2.3e-3.)"""
    case = Case("mma16", 16, (4096, 3000), page_size=64, max_chunks=4, cache=cache, q=cache)
    seed = fresh_seed()
    inp = _inputs(case, seed)
    ref = decode_paged(**{**inp.decode_args(), "wv_b": None})
    rms = (rounding_bound(inp, ref, cache) - F32_TOL) / MARGIN
    errs = {}
    for variant in ("mma16", "mma16r"):
        res, _ = run_paged(inp, variant, case.max_chunks, target=case.target)
        errs[variant] = rel_l2(res.latent, ref.latent)
    label = f"{cache} seed={seed} rms={rms:.3g} relL2={errs}"
    assert 0.1 * rms < errs["mma16r"] < MARGIN * rms + F32_TOL, label
    assert errs["mma16"] < 0.05 * rms, label
