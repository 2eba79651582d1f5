"""The wgmma family (sm_90a) on the paged contract, against the float64 reference (GPU).

The same launch as the other paged kernels (test_gpu_paged_kernels.run_paged: a permuted
block table, NaN in unused pages and past each length, INVALID_PAGE past each request's
pages, NaN-filled partials and outputs) on the paged case grid: batches with empty requests,
lengths 1 and at tile and page edges (4095, 4096, 4097), page sizes 1, 16 and 64, s_q 1, 2 and
4 with causal, heads 16, 64 and 128 and counts that are not multiples of the 64-row tile (3,
63, 96). Skipped without a GPU, or on a GPU that is not sm_90 (the kernel is sm_90a code).

Tolerance (derived here, for `p` rounded to the cache dtype): the family rounds each weight
p_j = 2^(s_j - m) to the cache dtype once before the value product, p_j (1 + d_j) with
|d_j| <= u (u = 2^-11 for f16, 2^-8 for bf16: 11 and 8 significand bits), and sums the running
l from the unrounded f32 p. The latent of a row then errs by sum_j d_j w_j v_j (w_j = p_j / l,
v_j the first 512 columns of cache row j): with the d_j independent and at worst uniform on
[-u, u], its expected square is u^2 / 3 * sum_j w_j^2 |v_j|^2. The relL2 over every live row is
the norm of many nearly independent errors and concentrates at its rms,
    rms = u / sqrt(3) * sqrt(sum_rows sum_j w_j^2 |v_j|^2) / ||latent||,
computed below in float64 from the very inputs of the case. The bound is MARGIN (4, as
tests/tolerances.py) times that rms, plus the f32 tolerance of the exact kernels (1e-4, for
the f32 arithmetic of the scores and sums). `out` = wv_b latent per head: a random 128 x 512
projection keeps a random error's relative size, so the same bound. lse is computed from the
f32 p and f32 scores of exact 16-bit q and cache: the f32 tolerance (1e-4 absolute).
Each request is also held alone to the bound of its own rows (check_each_request), and scores
that climb along every request (RISING) drive the lazy max's rescale. Negative controls (the
combine without its rescale, a max that never moves, a bulk copy one row off) fail these
bounds.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from gpu_support import HAVE_GPU, fresh_seed, gpu, poison
from mlasandbox import registry, tensor_map
from mlasandbox.bf16 import as_f32, as_f64, to_storage
from mlasandbox.chunks import MIN_TILES_PER_CHUNK, chunk_bounds, request_chunks
from mlasandbox.compare import Tolerance
from mlasandbox.compare_paged import compare_paged
from mlasandbox.dims import Dims
from mlasandbox.inputs import rising_q, rising_ramp
from mlasandbox.paged import PagedResult
from mlasandbox.paged_inputs import make_paged_inputs
from mlasandbox.reference import decode_paged, to_host
from test_gpu_paged_kernels import (Case, _inputs, check_mixed_chunks, run_paged,
                                    check_a_merge_that_skips_unwritten_requests_fails)
from tolerances import MARGIN, U32

U16 = {"f16": 2.0 ** -11, "bf16": 2.0 ** -8}   # unit roundoff of the 16-bit dtypes
F32_TOL = 1e-4                                 # the exact kernels' tolerance (compare.py)


def _sm90_reason() -> str | None:
    if not HAVE_GPU:
        return None
    from mlasandbox.kernels import device_info

    arch = device_info().arch
    return None if arch == "sm_90" else f"wgmma64 is sm_90a code; this device is {arch}"


SM90_SKIP = _sm90_reason()
sm90 = pytest.mark.skipif(SM90_SKIP is not None, reason=SM90_SKIP or "")

CASES = [
    Case("wgmma64", 128, (4097, 0, 1, 140), page_size=64, max_chunks=6, cache="bf16", q="bf16"),
    Case("wgmma64", 16, (4096, 20, 1026), s_q=4, causal=True, page_size=16, max_chunks=4,
         cache="f16", q="f16"),
    Case("wgmma64", 64, (4095, 300), s_q=2, causal=True, page_size=64, max_chunks=3,
         cache="f16", q="f16", wv_b=False),
    Case("wgmma64", 3, (1, 2, 700), page_size=1, max_chunks=3, cache="bf16", q="bf16"),
    Case("wgmma64", 63, (2000,), s_q=2, page_size=16, max_chunks=2, cache="bf16", q="bf16"),
    Case("wgmma64", 96, (4097, 65), page_size=64, max_chunks=8, cache="f16", q="f16"),
    # a last chunk of 2 positions: early causal rows see nothing of it but earlier chunks
    Case("wgmma64", 128, (1026,), s_q=2, causal=True, page_size=64, max_chunks=16,
         cache="bf16", q="bf16"),
    Case("wgmma64", 16, (20000,), page_size=64, max_chunks=16, cache="f16", q="f16"),
    Case("wgmma64", 128, (0, 4096, 4097, 1, 64, 65), page_size=64, max_chunks=4,
         cache="bf16", q="bf16"),
]


def _chunk_tiles(case) -> list[int]:
    """The tile count of every chunk of the case's plan (chunks.py: the kernels' rule)."""
    tile = registry.WGMMA_TILE
    n, chunk_len = request_chunks(list(case.lengths), case.max_chunks, tile,
                                  MIN_TILES_PER_CHUNK * tile, case.target)
    spans = (chunk_bounds(length, cl, c)
             for length, count, cl in zip(case.lengths, n, chunk_len) for c in range(count))
    return [-(-(end - start) // tile) for start, end in spans]


def test_the_case_grid_reaches_one_tile_odd_and_even_chunks():
    """A chunk of an odd tile count ends on a pair whose second tile lies past the chunk:
    warpgroup 1 runs it on a tile cp.async zero-fills (p = 0), whatever the page size; a chunk
    of one tile is that pair alone. The grid must hold both, chunks of an odd count above one,
    and chunks whose every pair is whole (CPU: the plan, not the kernel)."""
    tiles = [t for case in CASES if not case.causal for t in _chunk_tiles(case)]
    assert 1 in tiles
    assert any(t % 2 == 1 and t > 1 for t in tiles)
    assert any(t % 2 == 0 for t in tiles)


def rounding_bound(inp, ref, cache: str, request: int | None = None) -> float:
    """MARGIN x the rms relL2 that rounding p to `cache` predicts (module docstring), + 1e-4;
    of the whole batch, or with `request` of that request's rows alone (its own sum over
    them and its own ||latent||)."""
    q64 = as_f64(to_host(inp.q))
    table, lengths = to_host(inp.block_table), to_host(inp.cache_seqlens)
    pages = as_f64(to_host(inp.kv_cache))
    batch, s_q, n_head, key = q64.shape
    page_size = pages.shape[1]
    total = 0.0
    for b in range(batch) if request is None else (request,):
        n = int(lengths[b])
        if n == 0:
            continue
        ids = np.asarray(table[b, :-(-n // page_size)], dtype=np.int64)
        rows = pages[ids].reshape(-1, key)[:n]
        s = np.einsum("ihk,tk->iht", q64[b], rows) * inp.scale
        visible = n - (s_q - 1 - np.arange(s_q)) if inp.causal else np.full(s_q, n)
        seen = np.arange(n)[None, :] < visible[:, None]
        s = np.where(seen[:, None, :], s, -np.inf)
        m = s.max(axis=2, keepdims=True)
        w = np.where(np.isfinite(m), np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
        l = w.sum(axis=2, keepdims=True)
        w = np.divide(w, l, out=np.zeros_like(w), where=l > 0)
        v2 = np.square(rows[:, :registry.KV_LORA]).sum(axis=1)      # |v_j|^2
        total += float(np.einsum("iht,t->", np.square(w), v2))
    norm = float(np.linalg.norm(ref.latent if request is None else ref.latent[request]))
    rms = U16[cache] / math.sqrt(3.0) * math.sqrt(total) / norm if norm > 0 else 0.0
    return MARGIN * rms + F32_TOL


def rounding_tolerance(inp, ref, cache: str, request: int | None = None) -> Tolerance:
    bound = rounding_bound(inp, ref, cache, request)
    return Tolerance(out=bound, latent=bound, lse_abs=F32_TOL)


def check_each_request(res, ref, inp, cache: str, label: str,
                       lse_abs: float = F32_TOL) -> None:
    """Every request that sees a position, compared alone at its own bound (rounding_bound
    of its rows). The whole batch's relL2 weighs a request by its ||latent||, and a short
    request's latent (an average of a few rows) is far larger than a long one's. The float64
    reference with the last position of the 4097-position request cut (a kernel that drops
    it), seeds 0-39 on the CPU: in f16 that request's latent errs by 1.5x its own bound and
    more (64 heads, (4097, 1, 700)) and 3.2x (96 heads, (4097, 65)), while the batch's latent
    relL2 stays under the batch's bound on 36 and 13 of the 40 seeds. (That defect also
    moves lse, whose 1e-4 caught it on every seed; a defect of the value product alone, which
    leaves lse as it is, has only the latent's check. In bf16 the rounding's own bound is
    8x wider, 0.44x .. 0.9x of the cut's error.) A correct kernel's rounding of p, simulated
    the same way (to nearest, the lazy max of each chunk), reaches at most 0.24 of its
    request's bound on every case of this module (seeds 0-4)."""
    lengths = to_host(inp.cache_seqlens)
    for b in np.flatnonzero(lengths > 0):
        b = int(b)
        got = PagedResult(*(None if a is None else a[b:b + 1]
                            for a in (res.latent, res.lse, res.out)))
        want = PagedResult(*(None if a is None else a[b:b + 1]
                             for a in (ref.latent, ref.lse, ref.out)))
        tol = dataclasses.replace(rounding_tolerance(inp, ref, cache, request=b),
                                  lse_abs=lse_abs)
        cmp = compare_paged(got, want, tol)
        assert cmp.ok, (f"{label}: request {b} (length {int(lengths[b])}) alone, tolerance "
                        f"{tol}\n{cmp.summary()}")


# Pages of 64 hold whole tiles: run_paged's default copies them by bulk tensor copy (TMA),
# tiles with rows past a slice's end by cp.async. Each such case also runs with a null map,
# every tile by cp.async, so that both copy paths meet the reference.
COPY_PATHS = [pytest.param(c, True, id=f"{c}-tma") for c in CASES if c.page_size >= 64]
COPY_PATHS += [pytest.param(c, False, id=f"{c}-cp.async") for c in CASES]


@gpu
@sm90
@pytest.mark.parametrize("case,tma", COPY_PATHS)
def test_wgmma_matches_the_float64_reference(case, tma):
    seed = fresh_seed()
    inp = _inputs(case, seed)
    res, part_l = run_paged(inp, case.variant, case.max_chunks, target=case.target, tma=tma)
    ref = decode_paged(**inp.decode_args())
    tol = rounding_tolerance(inp, ref, case.cache)
    cmp = compare_paged(res, ref, tol)
    assert cmp.ok, f"{case} seed={seed} tolerance={tol}\n{cmp.summary()}"
    check_each_request(res, ref, inp, case.cache, f"{case} seed={seed}")
    # the programs past a request's last chunk wrote nothing (l still NaN), the others all rows
    tile = registry.WGMMA_TILE
    n, _ = request_chunks(list(case.lengths), case.max_chunks, tile, MIN_TILES_PER_CHUNK * tile,
                          case.target)
    written = ~np.isnan(part_l.get())
    want = np.arange(case.max_chunks)[None, :] < n[:, None]
    assert (written == want[:, :, None]).all(), f"{case} seed={seed}: chunks written"


# Any finite scale is valid input (paged.check_paged_inputs): the row max must be taken of the
# scaled scores, on tiles every row sees whole (the softmax's unmasked path) and on cut ones
# (4097, causal rows). A max of the raw scores is the min under a negative scale, and the p of
# that tile overflow the 16-bit dtype: a build that did so gave NaN latents on this case and
# at 4 times the scale (H200, 2026-12-04, scratch A/B), so the negative case has power.
SCALE_CASE = Case("wgmma64", 64, (4097, 300), s_q=2, causal=True, page_size=64, max_chunks=3,
                  cache="f16", q="f16")


@gpu
@sm90
@pytest.mark.parametrize("factor", [1.0, -1.0, 0.0], ids=["positive", "negative", "zero"])
def test_wgmma_takes_a_scale_of_either_sign_or_zero(factor):
    seed = fresh_seed()
    inp = _inputs(SCALE_CASE, seed)
    inp = dataclasses.replace(inp, scale=inp.scale * factor)
    res, _ = run_paged(inp, SCALE_CASE.variant, SCALE_CASE.max_chunks)
    ref = decode_paged(**inp.decode_args())
    cmp = compare_paged(res, ref, rounding_tolerance(inp, ref, SCALE_CASE.cache))
    assert cmp.ok, f"scale x {factor} seed={seed}\n{cmp.summary()}"


def rising_paged(host):
    """make_rising_inputs' climb (sandbox/inputs.py) for every request of a paged batch, through
    its block table: every (query token, head) row of q gets rising_q's component along u =
    ones / sqrt(key_dim), and the n positions of each request rising_ramp(n), so the
    request's scores climb by ~RISING_SPAN (natural log) from its first position to its last.
    Rows past each length and unused pages keep their NaN. Host arrays in (make_paged_inputs
    with xp=numpy), a new PagedInputs of host arrays out."""
    key = host.q.shape[-1]
    cache_dt = "bf16" if host.kv_cache.dtype == np.uint16 else "f16"
    q_dt = "f32" if host.q.dtype == np.float32 else cache_dt
    q = rising_q(as_f32(host.q, np), key)
    cache = host.kv_cache.copy()
    page = cache.shape[1]
    for b, n in enumerate(np.asarray(host.cache_seqlens)):
        n = int(n)
        if n == 0:
            continue
        ids = np.asarray(host.block_table[b, :-(-n // page)], dtype=np.int64)
        rows = cache[ids].reshape(-1, key)
        rows[:n] = to_storage(as_f32(rows[:n], np) + rising_ramp(n, host.scale, key), cache_dt,
                              np)
        cache[ids] = rows.reshape(len(ids), page, key)
    return dataclasses.replace(host, q=to_storage(q, q_dt, np), kv_cache=cache)


def rising_inputs(case, seed):
    """rising_paged of case's inputs, on the device."""
    import cupy as cp

    host = make_paged_inputs(Dims(n_head=case.heads), list(case.lengths), s_q=case.s_q,
                             page_size=case.page_size, cache_dtype=case.cache, q_dtype=case.q,
                             causal=case.causal, seed=seed, with_wv_b=case.wv_b)
    host = rising_paged(host)
    return dataclasses.replace(host, **{f: None if getattr(host, f) is None else
                                        cp.asarray(getattr(host, f)) for f in (
        "q", "kv_cache", "block_table", "cache_seqlens", "wv_b")})


# Scores that climb by ~110 (natural log, 159 log2 units) along every request: the lazy max
# (kLazyLog2 = 8 log2 units, mla_common.cuh) moves again and again inside a chunk, and the
# rescale of O and l by 2^(m_old - m_new) that random inputs barely reach after the first
# tiles runs on every row. f16 over 4 chunk slots (chunks of 2304, 1088 and 192 positions:
# the merge also weighs chunks whose maxima differ by ~40 log2 units); bf16 with the wave
# target at the 4 live requests, so each runs one chunk of its whole climb.
# On the CPU (the float64 scores of rising_paged's inputs, seeds 0-19; per row the lazy max
# over each chunk's tiles of 64 positions, m moving where a tile's max exceeds it by more
# than 8, counted after a chunk's first tile and summed over the request's chunks): every
# row's max moved at least
#   f16: 14 times (request of 9000), 13 (4097), 6 (700);  bf16: 16, 14, 9
# (the request of one position has nothing to move). An online softmax that does not rescale
# O where the max moves (l rescaled) errs by a latent relL2 of at least 19.6 (f16) and 1.3e3
# (bf16) on those inputs, against bounds of 1.2e-3 and 9.1e-3: over 10^4 times.
RISING = [
    Case("wgmma64", 64, (9000, 0, 4097, 1, 700), page_size=64, max_chunks=4, cache="f16",
         q="f16"),
    Case("wgmma64", 128, (9000, 0, 4097, 1, 700), page_size=64, max_chunks=4, target=4,
         cache="bf16", q="bf16"),
]


def rising_tolerance(inp, ref, cache: str) -> Tolerance:
    """rounding_tolerance with lse's bound grown with the scores. A rising row's score
    s = scale sum_i q_i k_i sums 576 products mostly of one sign (the climb lies along the
    same direction in q and k), so its f32 accumulation error grows with |s|: about
    sqrt(576) u32 |s| for rounding errors of random sign, 1.6e-4 at the |lse| of ~115 these
    inputs reach, over the 1e-4 that random inputs' lse is held to (the H200 measured
    1.78e-4, seed 674095496). lse gets 1e-4 + MARGIN x sqrt(576) u32 max |lse|."""
    tol = rounding_tolerance(inp, ref, cache)
    lse = to_host(ref.lse)
    top = float(np.abs(lse[np.isfinite(lse)]).max(initial=0.0))
    lse_abs = F32_TOL + MARGIN * math.sqrt(registry.KEY_DIM) * U32 * top
    return dataclasses.replace(tol, lse_abs=lse_abs)


@gpu
@sm90
@pytest.mark.parametrize("case", RISING, ids=str)
def test_wgmma_rescales_a_running_max_that_keeps_rising(case):
    seed = fresh_seed()
    inp = rising_inputs(case, seed)
    res, _ = run_paged(inp, case.variant, case.max_chunks, target=case.target)
    ref = decode_paged(**inp.decode_args())
    tol = rising_tolerance(inp, ref, case.cache)
    cmp = compare_paged(res, ref, tol)
    assert cmp.ok, f"{case} rising seed={seed} tolerance={tol}\n{cmp.summary()}"
    check_each_request(res, ref, inp, case.cache, f"{case} rising seed={seed}",
                       tol.lse_abs)


@gpu
@sm90
@pytest.mark.parametrize("case", RISING, ids=str)
def test_negative_control_a_wgmma_max_that_never_moves_fails_the_rising_check(case):
    """The kernel built with -DMLA_LAZY_LOG2=1e30f (mla_common.cuh; mla_wgmma.cu takes it
    through mla_walk.cuh): the max set by a chunk's first tile never moves, so p = 2^(s - m)
    climbs with the scores. The answer stays exact until p overflows, which it does on these
    inputs (the CPU, seeds 0-19 above, every row of the requests of 9000, 4097 and 700
    positions): in f16 some chunk of each such row climbs past 2^16 above its first tile's
    max, where p rounds to inf in f16; in bf16 each request runs one chunk, which climbs by
    at least 146.7 log2 units (700) and 161 (4097, 9000) above its first tile's, past 2^128,
    where the f32 p itself is inf. Either way the latent is inf or NaN, which never passes;
    the same inputs on the real build pass (the test above)."""
    seed = fresh_seed()
    inp = rising_inputs(case, seed)
    res, _ = run_paged(inp, case.variant, case.max_chunks, target=case.target,
                       defines=("MLA_LAZY_LOG2=1e30f",))
    ref = decode_paged(**inp.decode_args())
    cmp = compare_paged(res, ref, rounding_tolerance(inp, ref, case.cache))
    assert not cmp.ok, f"{case} seed={seed}: a max that never moves passed the rising check"
    assert not np.isfinite(to_host(res.latent)).all(), f"{case} seed={seed}: no overflow"


@gpu
@sm90
def test_negative_control_a_bulk_copy_one_row_off_fails_and_only_on_the_tma_path():
    case = Case("wgmma64", 64, (4097, 700), page_size=64, max_chunks=4, cache="f16", q="f16")
    plant = ("MLA_WGMMA_TMA_ROW_SHIFT=1",)
    seed = fresh_seed()
    inp = _inputs(case, seed)
    ref = decode_paged(**inp.decode_args())
    tol = rounding_tolerance(inp, ref, case.cache)
    res, _ = run_paged(inp, case.variant, case.max_chunks, defines=plant)
    assert not compare_paged(res, ref, tol).ok, f"seed={seed}: a shifted box passed"
    res, _ = run_paged(inp, case.variant, case.max_chunks, defines=plant, tma=False)
    cmp = compare_paged(res, ref, tol)
    assert cmp.ok, f"seed={seed}: the plant reached the cp.async path\n{cmp.summary()}"


@gpu
@sm90
def test_a_wgmma_step_on_pages_of_64_copies_by_tma_unless_switched_off(monkeypatch):
    import mlasandbox as mla

    case = Case("wgmma64", 64, (4097, 130), page_size=64, cache="f16", q="f16")
    inp = _inputs(case, fresh_seed())
    assert mla.PagedDecodeStep(**inp.decode_args(), variant="wgmma64").uses_tma
    monkeypatch.setenv(tensor_map.ENV_SWITCH, "0")
    assert not mla.PagedDecodeStep(**inp.decode_args(), variant="wgmma64").uses_tma
    monkeypatch.delenv(tensor_map.ENV_SWITCH)
    small = _inputs(Case("wgmma64", 64, (4097,), page_size=16, cache="f16", q="f16"),
                    fresh_seed())
    assert not mla.PagedDecodeStep(**small.decode_args(), variant="wgmma64").uses_tma


@gpu
@sm90
def test_negative_control_the_combine_without_rescale_fails_the_wgmma_bound():
    case = Case("wgmma64", 16, (4097, 3000), s_q=2, causal=True, page_size=16, max_chunks=8,
                cache="bf16", q="bf16")
    seed = fresh_seed()
    inp = _inputs(case, seed)
    res, _ = run_paged(inp, case.variant, case.max_chunks, rescale=False)
    ref = decode_paged(**inp.decode_args())
    cmp = compare_paged(res, ref, rounding_tolerance(inp, ref, case.cache))
    assert not cmp.ok, f"seed={seed}: the wgmma bound passed a combine without rescale"


# The instance of a single-pass plan (partials=False): one chunk a request, the latent and
# lse written, the partials left as they were (NaN: run_paged fills them), which the same
# launch with the default instance writes (the check's power). Under a plan of several chunk
# slots the same instance writes them after all, and the merge gives the reference.
SINGLE_PASS = Case("wgmma64", 128, (4097, 0, 1, 140), page_size=64, max_chunks=1,
                   cache="bf16", q="bf16")


@gpu
@sm90
@pytest.mark.parametrize("partials", [False, True])
def test_the_single_pass_instance_writes_latent_and_lse_and_no_partials(partials):
    case = SINGLE_PASS
    seed = fresh_seed()
    inp = _inputs(case, seed)
    res, part_l = run_paged(inp, case.variant, 1, merge=False, partials=partials)
    ref = decode_paged(**{**inp.decode_args(), "wv_b": None})
    cmp = compare_paged(res, ref, rounding_tolerance(inp, ref, case.cache))
    assert cmp.ok, f"partials={partials} seed={seed}\n{cmp.summary()}"
    live = np.asarray(case.lengths) > 0
    written = ~np.isnan(part_l.get()[:, 0, :])          # [B, n_rows]
    assert (written[live] == partials).all(), f"seed={seed}: partials written {partials}"


@gpu
@sm90
def test_the_single_pass_instance_keeps_the_partials_of_a_plan_of_several_chunks():
    case = Case("wgmma64", 64, (4097, 1, 700), page_size=64, max_chunks=4, target=6,
                cache="f16", q="f16")
    seed = fresh_seed()
    inp = _inputs(case, seed)
    res, _ = run_paged(inp, case.variant, case.max_chunks, target=case.target, partials=False)
    ref = decode_paged(**inp.decode_args())
    cmp = compare_paged(res, ref, rounding_tolerance(inp, ref, case.cache))
    assert cmp.ok, f"seed={seed}\n{cmp.summary()}"
    # the request of length 1 (latent = its one row, |latent| ~ 22) outweighs the 4097 one
    # in the batch's relL2: each request at its own bound
    check_each_request(res, ref, inp, case.cache, f"seed={seed}")


@gpu
@sm90
def test_a_single_pass_wgmma_step_matches_the_reference():
    import mlasandbox as mla

    case = SINGLE_PASS
    seed = fresh_seed()
    inp = _inputs(case, seed)
    step = mla.PagedDecodeStep(**inp.decode_args(), variant="wgmma64", splits=1)
    assert step.single_pass and step.attn_inst.partials is False
    poison(step)
    step.run()
    ref = decode_paged(**inp.decode_args())
    got = mla.PagedResult(step.latent, step.lse, step.out)
    cmp = compare_paged(got, ref, rounding_tolerance(inp, ref, case.cache))
    assert cmp.ok, f"seed={seed}\n{cmp.summary()}"


# Requests of 0, 1 and several chunks in one batch (test_gpu_paged_kernels.MIXED): wgmma64
# writes the latent and lse of a request of one chunk itself, and the merge skips it. 128
# heads (two row blocks); 64 heads x s_q 2 causal, where row block 0 (query token 0) of the
# request of length 1 sees nothing and takes the walk's early exit.
MIXED = [
    Case("wgmma64", 128, (4097, 1, 0, 140, 9000, 65), page_size=64, max_chunks=4, target=8,
         cache="bf16", q="bf16"),
    Case("wgmma64", 64, (4097, 1, 0, 300, 9000), s_q=2, causal=True, page_size=16,
         max_chunks=4, target=8, cache="f16", q="f16", wv_b=False),
]


@gpu
@sm90
@pytest.mark.parametrize("case", MIXED, ids=str)
def test_wgmma_writes_one_chunk_requests_and_the_merge_skips_them(case):
    check_mixed_chunks(case, lambda inp, ref: rounding_tolerance(inp, ref, case.cache))


@gpu
@sm90
def test_negative_control_a_wgmma_merge_that_skips_requests_nobody_wrote_fails():
    case = MIXED[0]
    check_a_merge_that_skips_unwritten_requests_fails(
        case, lambda inp, ref: rounding_tolerance(inp, ref, case.cache))


@gpu
@sm90
def test_decode_paged_runs_wgmma64_and_a_captured_graph_replays_new_lengths():
    import cupy as cp

    import mlasandbox as mla

    # pages for 4097 positions in both requests; the replays use prefixes of them
    case = Case("wgmma64", 128, (4097, 4097), s_q=1, page_size=64, cache="bf16", q="bf16")
    seed = fresh_seed()
    inp = _inputs(case, seed)
    res = mla.decode_paged(**inp.decode_args(), variant="wgmma64")
    ref = decode_paged(**inp.decode_args())
    cmp = compare_paged(res, ref, rounding_tolerance(inp, ref, "bf16"))
    assert cmp.ok, f"seed={seed}\n{cmp.summary()}"
    step = mla.PagedDecodeStep(**inp.decode_args(), variant="wgmma64")
    graph = step.capture()
    for lens in ((0, 0), (1, 64), (65, 4000), (4097, 4097)):
        inp.cache_seqlens[...] = cp.asarray(lens, dtype=cp.int32)
        poison(step)   # the last replay's outputs and the scratch it left
        cp.cuda.Device().synchronize()  # the writes (default stream) land before the replay
        graph.launch(step.graph_stream)
        step.graph_stream.synchronize()
        ref = decode_paged(**inp.decode_args())
        got = mla.PagedResult(step.latent, step.lse, step.out)
        cmp = compare_paged(got, ref, rounding_tolerance(inp, ref, "bf16"))
        assert cmp.ok, f"lengths {lens} seed={seed}\n{cmp.summary()}"


@gpu
@sm90
def test_wgmma64_refuses_an_f32_q():
    import mlasandbox as mla

    inp = _inputs(Case("wgmma64", 16, (10,), cache="bf16", q="f32"), fresh_seed())
    with pytest.raises(ValueError, match="q in the cache dtype"):
        mla.decode_paged(**inp.decode_args(), variant="wgmma64")


@gpu
@sm90
@pytest.mark.parametrize("lengths, q, want", [
    ((16384,), "bf16", "wgmma64"),      # 128 rows x 16384 of room: 2^21 row-positions
    ((8192,), "bf16", "mma16"),         # 2^20: a small step
    ((500,) * 32, "bf16", "mma32"),     # 128 x 512 x 32 = 2^21, requests too short for wgmma64
    ((16384,), "f32", "mma32"),         # wgmma64 takes q in the cache dtype only
])
def test_auto_runs_the_kernel_its_rule_names_on_this_device(lengths, q, want):
    # the same words as the named variant's step: auto runs that kernel, not another one
    # that also passes the reference
    import cupy as cp

    import mlasandbox as mla

    inp = _inputs(Case("wgmma64", 128, lengths, page_size=64, cache="bf16", q=q),
                  fresh_seed())
    auto = mla.PagedDecodeStep(**inp.decode_args())
    named = mla.PagedDecodeStep(**inp.decode_args(), variant=want)
    assert auto.variant.name == want and auto.attn_inst == named.attn_inst
    poison(auto)
    res = auto.run()
    got = [cp.asnumpy(res.latent), cp.asnumpy(res.lse)]
    assert np.isfinite(got[0]).all() and np.isfinite(got[1]).all(), "auto wrote every row"
    poison(named)   # the scratch auto's run left: the named step must write its own
    res = named.run()
    assert np.array_equal(got[0], cp.asnumpy(res.latent))
    assert np.array_equal(got[1], cp.asnumpy(res.lse))
