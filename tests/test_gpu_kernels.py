"""The CUDA variants against the float64 reference, on the device.

Tolerances (mlasandbox.compare): the inputs are exactly representable in float64, so the
only error is the kernels' f32 arithmetic (576-term dot products, exp2, sums of up to 131072
terms). The rounding model of tests/tolerances.py puts a correct f32 kernel's relL2 below
4.3e-5 (4 x its rms) at 131072 unsplit, and lse's error below 4.4e-5 (6 sigma); relL2 1e-4
for out/latent and 1e-4 absolute for lse sit above that (tests/test_tolerances.py), and a
real bug costs 1e-3 or more: the negative control below shows the check rejects a combine
without its rescale. The cuBLAS engine rounds q, p and latent to the cache dtype for its
tensor-core GEMMs, so its tolerance is a few units of that rounding (CUBLAS_TOL).
docs/numerics.md derives each bound.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from gpu_support import compile_with, device_inputs, gpu, run_poisoned
from mlasandbox import reference, registry
from mlasandbox.bench_gpu import tolerance_for
from mlasandbox.compare import Tolerance, compare, rel_l2
from mlasandbox.dims import Dims

# unit roundoff of the 16-bit cache dtypes (10 and 7 stored mantissa bits)
U16 = {"f16": 2.0 ** -11, "bf16": 2.0 ** -8}
# The cuBLAS engine rounds q, p and latent to 16 bits: q's rounding moves each score by
# ~u16 * scale * ||q * k||_2 ~ 1.7 u16 (a relative error of its weight), p's rounding is
# u16 per weight and latent's u16 per entry; the three add to a few u16 of relL2, and the
# limits are ~6 u16 (f16: 2.9e-3) and ~5 u16 (bf16: 2.0e-2). Scores of |s| ~ 100 (the
# rising inputs) make q's term 100x larger: that test leaves the engine out.
CUBLAS_TOL = {"f16": Tolerance(3e-3, 3e-3, 3e-3), "bf16": Tolerance(2e-2, 2e-2, 2e-2)}
CUDA_VARIANTS = [n for n in registry.variant_names() if registry.variant(n).is_cuda]


def tolerance(variant, cache_dtype):
    """The engine's rounding (above); for a kernel, the bench's spot-check bound
    (bench_gpu.tolerance_for: 1e-4, or registry.ROUND_P_RELL2_BOUND where the variant rounds p,
    derived in test_gpu_wgmma.py)."""
    return CUBLAS_TOL[cache_dtype] if variant == "cublas" else tolerance_for(variant, cache_dtype)


def check_step(step, inp, seed, tol, label=""):
    res = run_poisoned(step)
    ref = reference.decode(**inp.decode_args())
    cmp = compare(res, ref, tol)
    assert cmp.ok, f"{label} seed={seed} plan={step.plan}\n{cmp.summary()}"
    return cmp


@dataclass(frozen=True)
class Case:
    variant: str
    heads: int
    n_ctx: int
    cache: str = "f16"
    q: str = "f32"

    def __str__(self):
        return f"{self.variant}-H{self.heads}-n{self.n_ctx}-{self.cache}-q{self.q}"


# Each value of the grid is covered by some case, not the full product: heads
# {1, 3, 12, 16, 96, 128}, contexts {1, 17, 4095, 4096, 4097, 12288, 12289, 20000}, every
# variant, both cache dtypes, q in f32 and in the cache dtype.
HEADS = (1, 3, 12, 16, 96, 128)
CONTEXTS = (1, 17, 4095, 4096, 4097, 12288, 12289, 20000)
VARIANTS = registry.variant_names()


def _cases():
    cases = []
    for i, variant in enumerate(VARIANTS):
        for j, n_ctx in enumerate(CONTEXTS):
            heads = HEADS[(i + j) % len(HEADS)]
            cache = ("f16", "bf16")[(i + j) % 2]
            q = "f32" if (i + 2 * j) % 3 else cache
            cases.append(Case(variant, heads, n_ctx, cache, q))
    return cases


CASES = _cases()


def test_the_case_grid_covers_every_value():
    assert {c.heads for c in CASES} == set(HEADS)
    assert {c.n_ctx for c in CASES} == set(CONTEXTS)
    assert {c.variant for c in CASES} == set(VARIANTS)
    assert {c.cache for c in CASES} == {"f16", "bf16"}
    assert {c.q for c in CASES} >= {"f32", "f16", "bf16"}


@gpu
@pytest.mark.parametrize("case", CASES, ids=str)
def test_variant_matches_the_float64_reference(case):
    from mlasandbox.api import DecodeStep

    inp, seed = device_inputs(Dims(n_head=case.heads), case.n_ctx, case.cache, case.q)
    step = DecodeStep(**inp.decode_args(), variant=case.variant, sync_check=True)
    check_step(step, inp, seed, tolerance(case.variant, case.cache), str(case))


@gpu
@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_at_131072(variant):
    from mlasandbox.api import DecodeStep

    inp, seed = device_inputs(Dims(n_head=16), 131072, "f16", "f32", extra_rows=64)
    step = DecodeStep(**inp.decode_args(), variant=variant, sync_check=True)
    cmp = check_step(step, inp, seed, tolerance(variant, "f16"), variant)
    print(f"{variant} @131072: {cmp.summary()}")


@gpu
@pytest.mark.parametrize("variant", ["per_head", "split", "batched16", "mma16", "mma32"])
def test_one_slice_writes_latent_and_lse_without_the_merge(variant):
    """A single pass (S = 1, SplitPlan.single_pass): the attention kernel writes latent =
    acc / l and lse itself, so with the merge not run they match the reference; with two
    slices it writes neither (they stay NaN: the check has power). Tolerance: the default
    (relL2 1e-4, lse 1e-4 absolute), f32 over 129 positions."""
    import cupy as cp

    from mlasandbox.api import DecodeStep

    inp, seed = device_inputs(Dims(n_head=13), 129, "f16", "f32")
    ref = reference.decode(**inp.decode_args())
    for splits in (1, 2) if variant != "per_head" else (None,):
        step = DecodeStep(**inp.decode_args(), variant=variant, splits=splits,
                          sync_check=True)
        assert step.plan.single_pass == (splits != 2)
        step.latent.fill(cp.nan)
        step.lse.fill(cp.nan)
        step.run_attn()
        cp.cuda.Device().synchronize()
        if splits == 2:
            assert np.isnan(step.latent.get()).all() and np.isnan(step.lse.get()).all()
            continue
        assert rel_l2(step.latent, ref.latent) < 1e-4, f"{variant} seed={seed}"
        assert np.abs(step.lse.get() - ref.lse).max() < 1e-4, f"{variant} seed={seed}"


# 29 = 16 + 13 heads: a full block and a partial one for the 16-head blocks (batched16,
# tiled16, mma16), 12 + 12 + 5 for batched12, one partial block of 32 for mma32
SPLIT_HEADS = 29


@gpu
@pytest.mark.parametrize("splits", [1, 2, 3, 7, 16, 33, 64, 129, 200])
@pytest.mark.parametrize("variant", ["split", "batched12", "batched16", "tiled16", "mma16",
                                     "mma32"])
def test_every_split_count_matches_one_reference(variant, splits):
    """One reference, every S, including S > n_ctx (empty slices must be neutral: 1 of 16,
    21 of 64, 71 of 200 at 129 positions)."""
    from mlasandbox.api import DecodeStep
    from mlasandbox.splits import slice_bounds

    n_ctx, h = 129, SPLIT_HEADS
    inp, seed = device_inputs(Dims(n_head=h), n_ctx, "f16", "f32")
    step = DecodeStep(**inp.decode_args(), variant=variant, splits=splits, sync_check=True)
    assert step.plan.splits == splits
    check_step(step, inp, seed, Tolerance(), f"{variant} S={splits}")
    empty = [s for s in range(splits) if slice_bounds(n_ctx, splits, s)[0] >= n_ctx]
    # counted apart from slice_bounds: slices of ceil(n_ctx / S) positions, of which the
    # first ceil(n_ctx / that) hold one
    n_empty = splits - -(-n_ctx // -(-n_ctx // splits))
    assert len(empty) == n_empty == step.plan.empty_slices, (empty, n_empty)
    if not step.single_pass:   # (a single pass writes latent and lse, no partial)
        # the partials were NaN-poisoned before the run: every slice writes its (m, l), an
        # empty one the neutral (-inf, 0, acc 0) that the combine weighs by 0
        m = step.part_m.get()[:splits * h].reshape(splits, h)
        l = step.part_l.get()[:splits * h].reshape(splits, h)
        assert not np.isnan(m).any() and not np.isnan(l).any(), \
            f"every partial is written, seed={seed}"
        assert np.all(np.isneginf(m[empty])) and np.all(l[empty] == 0), \
            f"empty partials must be neutral, seed={seed}"
        live = np.setdiff1d(np.arange(splits), empty)
        assert np.all(l[live] > 0) and np.isfinite(m[live]).all(), \
            f"every slice with a position carries weight, seed={seed}"


# The combine reads a row's split weights a tile of kSplitTile = 256 at a time
# (mla_combine.cu); its prefetch path, which loads the partials ahead in one step, takes
# only splits <= 256 (and <= 16 x the column blocks).
COMBINE_SPLIT_TILE = 256


@gpu
@pytest.mark.parametrize("splits", [257, 600])
@pytest.mark.parametrize("variant", ["split", "mma16"])
def test_more_splits_than_one_combine_tile_match_the_reference(variant, splits):
    """Past 256 partials a row the combine takes its tile loop: the max over the partials
    past the first 256, then the weights 256 at a time (257: a second tile of one partial;
    600: three tiles, the last of 88). 96 heads on 132 SMs: 4 column blocks a row
    (registry.combine_col_blocks), the merge then the projection. n_ctx 21000: every slice
    holds positions at both counts (ceil(21000 / S) (S - 1) < 21000; 8 positions in the last
    of 257, 35 in each of 600). Power (the float64 reference on the CPU, seeds 0-2, 96
    heads): a merge that stopped after the first tile would drop the last 8 positions at 257,
    latent relL2 4.6e-3 .. 1.2e-2, or the 12040 past slice 256 at 600, 0.44 .. 0.47: 46x and
    4400x the default 1e-4."""
    from mlasandbox.api import DecodeStep

    n_ctx = 21000
    inp, seed = device_inputs(Dims(n_head=96), n_ctx, "f16", "f32")
    step = DecodeStep(**inp.decode_args(), variant=variant, splits=splits, sync_check=True)
    assert step.plan.splits == splits > COMBINE_SPLIT_TILE and step.plan.empty_slices == 0
    assert not step.single_pass
    check_step(step, inp, seed, Tolerance(), f"{variant} S={splits}")


@gpu
def test_split_is_at_least_as_accurate_as_unsplit_at_20000():
    """Lecture 2.1: per-slice partials are effectively pairwise summation.

    per_head's four warps each add a latent column over a quarter of the positions (a 5000-
    term f32 chain) and merge; split(64)'s chains are 78 terms, then the four warps' merge and
    the 64-term combine. An f32 chain's rms error grows like the square root of its length,
    so the accumulation error alone would fall ~sqrt(5000 / 146) = 5.9x (mla_attn_rows.cu);
    the scores' rounding, the same in both, dilutes that. Measured on the H200 (2026-12-04,
    8a5b0f4, seeds 70000-70119 of this test's inputs): the gain unsplit / split had median
    4.03, 2.5% of seeds below 3.16 and the lowest 2.83 (relL2 medians 7.5e-7 against 1.9e-7).
    So every seed must be at least as accurate (a gain >= 1: the lecture's claim) and the
    median of five must reach 2.5, which a split no better than unsplit (gain ~1) cannot: with
    none of 120 seeds below 2.8, at most ~2.5% of seeds fall below 2.5 (the 95% bound from
    0 of 120), and three of five do so at most 10 x 0.025^3 = 1.6e-4 of runs."""
    from mlasandbox.api import DecodeStep

    ratios = []
    for _ in range(5):
        inp, seed = device_inputs(Dims(n_head=16), 20000, "f16", "f32")
        ref = reference.decode(**inp.decode_args())
        errs = {}
        for name, kw in (("unsplit", dict(variant="per_head")),
                         ("split", dict(variant="split", splits=64))):
            res = run_poisoned(DecodeStep(**inp.decode_args(), sync_check=True, **kw))
            errs[name] = rel_l2(res.latent, ref.latent)
        print(f"seed {seed}: relL2(latent) unsplit {errs['unsplit']:.3e}, "
              f"split(64) {errs['split']:.3e}")
        ratios.append(errs["unsplit"] / errs["split"])
    assert min(ratios) >= 1.0, f"split less accurate than unsplit on a seed: ratios {ratios}"
    assert np.median(ratios) >= 2.5, f"no pairwise-summation gain: ratios {ratios}"


@gpu
@pytest.mark.parametrize("variant", ["split", "batched12", "tiled16", "mma16", "mma32",
                                     "mma16r"])
def test_negative_control_combine_without_rescale_fails_the_check(variant):
    """The same check, with a combine that drops exp(m_i - m), must fail: it has power (also
    at mma16r's wider bound)."""
    from mlasandbox.api import DecodeStep

    tol = tolerance(variant, "f16")
    inp, seed = device_inputs(Dims(n_head=12), 20000, "f16", "f32")
    ref = reference.decode(**inp.decode_args())
    good = run_poisoned(DecodeStep(**inp.decode_args(), variant=variant, splits=16))
    assert compare(good, ref, tol).ok, f"seed={seed}"
    broken = DecodeStep(**inp.decode_args(), variant=variant, splits=16, rescale=False)
    assert "rescale=false," in broken.combine_inst.name
    cmp = compare(run_poisoned(broken), ref, tol)
    assert not cmp.ok, f"the check did not reject the broken combine (seed={seed})"
    print(f"negative control ({variant}): {cmp.summary()}")


@gpu
@pytest.mark.parametrize("n_ctx", [4095, 20000])
@pytest.mark.parametrize("variant", CUDA_VARIANTS)
def test_a_running_max_that_keeps_rising_is_rescaled_exactly(variant, n_ctx):
    """Scores that climb by ~110 (natural log) over the context move the running max on many
    tiles, a path random inputs barely take after the first tiles: every kernel's rescale of
    its accumulators, and the lazy max of tiled16 and mma. At 4095, on one slice (split's gate
    of 4096 set for every variant), one block sees the whole climb; at 20000, split by the
    auto rule, the slices' maxima differ by up to ~110 in the combine. Not the
    cuBLAS engine: it rounds q to the cache dtype, an error that grows with |score| (~100
    here) past its tolerance."""
    from mlasandbox.api import DecodeStep

    inp, seed = device_inputs(Dims(n_head=16), n_ctx, "f16", "f32", rising=True)
    step = DecodeStep(**inp.decode_args(), variant=variant, sync_check=True, min_ctx=4096)
    if registry.variant(variant).splits:  # per_head never splits
        assert (step.plan.splits == 1) == (n_ctx < 4096)
    check_step(step, inp, seed, tolerance(variant, "f16"), f"{variant} rising n_ctx={n_ctx}")


@gpu
@pytest.mark.parametrize("variant", ["split", "tiled16", "mma16"])
def test_negative_control_a_lazy_max_that_never_moves_fails_the_rising_check(variant):
    """The kernel built so that its reference max never moves after the first tile (in
    attn_rows, a warp's first step; -DMLA_LAZY_LOG2=1e30f): right on random inputs (their max
    settles near the first tile's), overflowing on rising ones (2^(s - m) past 2^128 within
    one slice, the gate of 4096 set). So the rising check above is what gives the lazy max's
    threshold its test."""
    from mlasandbox.api import DecodeStep

    broken = compile_with(registry.attention_instance(registry.variant(variant)),
                          "MLA_LAZY_LOG2=1e30f")
    for rising, want_ok in ((False, True), (True, False)):
        inp, seed = device_inputs(Dims(n_head=16), 4095, "f16", "f32", rising=rising)
        step = DecodeStep(**inp.decode_args(), variant=variant, min_ctx=4096)
        assert step.plan.splits == 1
        step.attn_kernel = broken
        cmp = compare(run_poisoned(step), reference.decode(**inp.decode_args()))
        assert cmp.ok == want_ok, f"rising={rising} seed={seed}\n{cmp.summary()}"
        print(f"{variant}, a max that never moves, rising={rising}: {cmp.summary()}")


@gpu
@pytest.mark.parametrize("n_ctx", [1, 64, 4095])
def test_below_the_gate_split_and_per_head_are_bit_identical(n_ctx):
    """The A/A case: below the split gate both run the same kernel with one slice."""
    from mlasandbox.api import DecodeStep

    inp, seed = device_inputs(Dims(n_head=96), n_ctx, "f16", "f32")
    a = DecodeStep(**inp.decode_args(), variant="per_head")
    b = DecodeStep(**inp.decode_args(), variant="split")
    assert a.plan.splits == b.plan.splits == 1
    assert a.attn_inst == b.attn_inst
    ra, rb = run_poisoned(a), run_poisoned(b)
    for f in ("out", "latent", "lse"):
        x, y = getattr(ra, f).get(), getattr(rb, f).get()
        # written (the NaN poison, the same words in both, would be equal too)
        assert np.isfinite(x).all() and np.isfinite(y).all(), f"{f} not written, seed={seed}"
        assert np.array_equal(x.view(np.uint32), y.view(np.uint32)), f"{f} differs, seed={seed}"


@gpu
def test_q_absorb_matches_the_reference():
    import cupy

    from mlasandbox.api import QAbsorb
    from mlasandbox.bf16 import as_f64

    for cache, q_dtype in (("f16", "f32"), ("bf16", "f32"), ("f16", "cache"), ("bf16", "cache")):
        inp, seed = device_inputs(Dims(n_head=13), 5, cache, "f32")
        qa = QAbsorb(inp.q_nope, inp.q_rope, inp.wk_b, q_dtype=q_dtype)
        qa.q.fill(0xFFFF if qa.q.dtype == cupy.uint16 else cupy.nan)  # poison: NaN in any dtype
        got = as_f64(cupy.asnumpy(qa.run()))
        want = reference.q_absorb(inp.q_nope, inp.q_rope, inp.wk_b)
        # f32: one 128-term f32 dot product per entry, relL2 ~ u32 sqrt(128 / 2) ~ 5e-7
        # (1e-5 leaves 20x). Rounded to the cache dtype: the float64 q of these very inputs
        # (13 heads; 512 absorbed columns ~ N(0, 1), 64 rope columns exact in 16 bits),
        # rounded on the CPU over seeds 0-1999, gives relL2 / u16 of 0.401 +- 0.005 to
        # nearest (the largest 0.418 f16, 0.419 bf16) and 0.80 +- 0.009 by truncation (the
        # smallest 0.773 f16, 0.763 bf16), in f16 and bf16 alike. 0.6 u16 lies 40 standard
        # deviations above the one and 20 below the other; the f32 sum's 5e-7 is 1e-3 u16.
        limit = 1e-5 if q_dtype == "f32" else 0.6 * U16[cache]
        err = rel_l2(got, want)
        assert err < limit, f"{cache}/{q_dtype} relL2 {err:.3g} >= {limit:.3g} seed={seed}"


@gpu
def test_a_torch_bf16_tensor_is_used_without_a_host_copy():
    torch = pytest.importorskip("torch")
    import cupy

    from mlasandbox.api import DecodeStep

    inp, seed = device_inputs(Dims(n_head=16), 300, "bf16", "f32")
    # the caller's side: torch bf16 tensors on the GPU
    cache_t = torch.from_dlpack(inp.cache).view(torch.bfloat16)
    wv_t = torch.from_dlpack(inp.wv_b).view(torch.bfloat16)
    # the documented route: a zero-copy view of the same device memory as uint16 words
    cache_words = cupy.from_dlpack(cache_t.view(torch.uint16))
    wv_words = cupy.from_dlpack(wv_t.view(torch.uint16))
    assert cache_words.data.ptr == cache_t.data_ptr(), "DLPack made a copy"
    step = DecodeStep(inp.q, cache_words, wv_words, inp.n_ctx, variant="batched16")
    check_step(step, inp, seed, Tolerance(), "torch bf16")


@gpu
@pytest.mark.parametrize("cache_dtype", ["f16", "bf16"])
def test_the_engines_softmax_kernels_round_p_like_the_cast_helpers(cache_dtype):
    """The cuBLAS engine's own softmax passes: exp(s - m) in place is CuPy's exp to an f32
    ulp, and p = e / l in 16 bits is the cast the project's helpers do (astype for f16,
    f32_to_bf16_bits for bf16: nearest even), a NaN row staying NaN. The two exps may differ
    by an ulp, which can move a rounding boundary, so a handful of elements may differ by one
    16-bit ulp; rounding by truncation would miss on about half of them."""
    import cupy

    from gpu_support import fresh_seed
    from mlasandbox.bf16 import f32_to_bf16_bits
    from mlasandbox.cublas_engine import _softmax_kernels

    kernels = _softmax_kernels()
    rng = cupy.random.default_rng(fresh_seed())
    s = rng.standard_normal((6, 5003), dtype=cupy.float32) * 6
    s[4, 11] = cupy.nan
    m = s.max(axis=1, keepdims=True)
    e = s.copy()
    kernels["exp_shift"](m, e)
    want_e = cupy.exp(s - m)
    # two f32 exps of one argument, each within ~2 ulp (ulp <= 2 u32 = 1.2e-7 relative)
    np.testing.assert_allclose(e.get(), want_e.get(), rtol=3e-7, atol=0, equal_nan=True)
    assert bool(cupy.isnan(e[4]).all()) and not bool(cupy.isnan(e[:4]).any())

    l = e.sum(axis=1, keepdims=True)
    p16 = kernels[cache_dtype](e, l)
    p32 = e / l
    want = p32.astype(cupy.float16).view(cupy.uint16) if cache_dtype == "f16" else f32_to_bf16_bits(p32)
    got = p16.view(cupy.uint16) if cache_dtype == "f16" else p16
    assert got.shape == s.shape and got.dtype == cupy.uint16
    finite = ~cupy.isnan(p32)
    assert bool((got == want)[finite].all()), "p = e / l must round exactly like the cast helpers"
    got_nan = (got & 0x7FFF) > (0x7C00 if cache_dtype == "f16" else 0x7F80)
    assert bool(got_nan[4].all()) and not bool(got_nan[:4].any())
