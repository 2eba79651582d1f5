"""The paged kernels, launched directly, against the float64 paged reference (GPU).

Kernel level: no API between the test and the launch (sandbox/paged_api.py has its own
tests). Each case builds inputs with make_paged_inputs (a permuted block table, NaN in unused
pages and in each last page's tail, INVALID_PAGE in every table entry past a request's pages),
NaN-fills the partials and the outputs, runs the paged attention launch and the paged combine
with the argument lists of the kernel contract, and compares with reference.decode_paged
through compare_paged. A partial the combine reads but no program wrote (a chunk past the
request's last, a row the walk forgot) is NaN and fails the comparison; a table entry read past
a request's pages faults (run under compute-sanitizer to see where).

Tolerances: compare.Tolerance's defaults (relL2 1e-4 for out and latent, 1e-4 absolute for
lse), as for the batch-1 kernels (tests/test_gpu_kernels.py): the inputs are exact in float64,
so the only error is the kernels' f32 arithmetic. The rounding model of tests/tolerances.py
bounds it at 131072 positions in one chain, the deepest context checked, by 4.3e-5 for
latent, 4.1e-5 for out (MARGIN x the rms) and 4.4e-5 for lse (LAMBDA x the rms)
(docs/numerics.md, "Why the defaults are 1e-4"; tests/test_tolerances.py); the requests here
reach 20000 positions, cut into chunks, whose chains are shorter still. Rows that see nothing
must be exactly latent 0, out 0, lse -inf (compare_paged).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import pytest

from gpu_support import fresh_seed, gpu
from mlasandbox import registry, tensor_map
from mlasandbox.api import SINGLE_PASS_FAMILIES
from mlasandbox.chunks import MIN_TILES_PER_CHUNK, offers_two_waves, request_chunks, two_waves
from mlasandbox.compare_paged import compare_paged
from mlasandbox.dims import Dims
from mlasandbox.paged import PagedResult
from mlasandbox.paged_inputs import make_paged_inputs
from mlasandbox.reference import decode_paged, to_host

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class Case:
    variant: str
    heads: int
    lengths: tuple
    s_q: int = 1
    causal: bool = False
    page_size: int = 64
    max_chunks: int = 4
    target: int = 132    # chunk programs of one wave per row block (the balance, chunks.py)
    programs: int = 0    # chunk programs a row block: 0 one wave, max(target, B); 2 target
                         # offers the second wave (chunks.two_waves)
    cache: str = "f16"
    q: str = "f32"
    wv_b: bool = True

    def __str__(self):
        lens = ("-".join(map(str, self.lengths)) if len(self.lengths) <= 8 else
                f"{len(self.lengths)}req-sum{sum(self.lengths)}")
        return (f"{self.variant}-H{self.heads}-sq{self.s_q}{'c' if self.causal else ''}-"
                f"p{self.page_size}-k{self.max_chunks}-t{self.target}"
                f"{f'-P{self.programs}' if self.programs else ''}-{self.cache}-q{self.q}-"
                f"L{lens}"
                f"{'' if self.wv_b else '-nowv'}")


# 150 requests of 0 to 699 positions, every 50th of 5000 (so the search has a range to cover)
PAST_HELD = tuple(5000 if i % 50 == 7 else (37 * i) % 700 for i in range(150))


# Each variant meets each page size, causal and not, s_q 1, 2 and 4, empty requests, lengths
# at and across page and tile edges, more chunks than a short request can take, and a grid of
# one chunk per request; not the full product.
CASES = [
    Case("split", 3, (0, 1, 20, 140), s_q=2, causal=True, page_size=16, max_chunks=3),
    Case("split", 1, (4097, 65), page_size=1, max_chunks=8, cache="bf16", q="bf16"),
    Case("batched4", 9, (140, 0, 4096), s_q=4, causal=True, page_size=64, max_chunks=5),
    Case("batched16", 16, (20, 4095), page_size=16, max_chunks=2, cache="bf16", wv_b=False),
    Case("batched2", 3, (1, 2, 3), s_q=4, causal=True, page_size=1, max_chunks=1),
    Case("mma16", 16, (4097, 0, 1, 140), page_size=64, max_chunks=6),
    Case("mma16", 4, (20, 300, 2000), s_q=4, causal=True, page_size=16, max_chunks=4,
         cache="bf16"),
    Case("mma16", 16, (4096,), s_q=1, page_size=1, max_chunks=16, q="f16"),
    Case("mma32", 16, (141, 4000), s_q=2, causal=True, page_size=64, max_chunks=3),
    Case("mma32", 63, (2, 700), s_q=1, page_size=16, max_chunks=2, cache="bf16", q="bf16",
         wv_b=False),
    # A last chunk of 1 or 2 positions (1026 = 8 x 128 + 2 at the mma tile of 64, 514 =
    # 8 x 64 + 2 at the tile of 32): the early causal rows see nothing of it but see earlier
    # chunks, so a block mixes rows with a neutral partial and rows with a live one.
    Case("mma16", 4, (1026, 1025), s_q=4, causal=True, page_size=16, max_chunks=16),
    Case("mma32", 8, (1026,), s_q=4, causal=True, page_size=64, max_chunks=16, cache="bf16"),
    Case("batched8", 2, (514,), s_q=4, causal=True, page_size=64, max_chunks=16),
    Case("split", 2, (514,), s_q=3, causal=True, page_size=16, max_chunks=16),
    # the balance: a small wave target, so long requests take the chunks and short ones one,
    # and requests past max_chunks x the balanced length (their chunks grow instead)
    Case("mma16", 16, (20000, 1, 0, 300, 4097, 64), page_size=64, max_chunks=5, target=7),
    Case("batched8", 3, (9000, 65, 4096, 0), s_q=2, causal=True, page_size=16, max_chunks=3,
         target=4),
    Case("split", 5, (3000, 20, 1), page_size=1, max_chunks=6, target=2),
    Case("mma32", 16, (140, 8193, 2), s_q=2, page_size=64, max_chunks=12, target=9),
    # more requests than the chunk rule holds in registers (mla_walk.cuh, kHeldTiles: 4 a
    # lane, B <= 128): requests 128.. are read from memory on every step of the search
    Case("mma16", 16, PAST_HELD, page_size=64, max_chunks=4, target=300, q="f16"),
    Case("split", 3, PAST_HELD, s_q=2, causal=True, page_size=16, max_chunks=3, target=260),
]
# Batch 1, pages of a tile or more, chunks of 10 to 157 tiles (the first page's lookup tried
# ahead of the length in docs/schedule.md, "What did not work"): (case, the chunk's tiles).
BATCH_ONE = [
    (Case("mma16", 16, (8192,), page_size=64, max_chunks=4), 32),
    (Case("mma16", 16, (8256,), page_size=64, max_chunks=4, q="f16"), 33),
    (Case("mma32", 16, (20000,), s_q=2, causal=True, page_size=64, max_chunks=16), 20),
    (Case("batched8", 9, (20000,), page_size=64, max_chunks=64, cache="bf16"), 10),
    (Case("split", 3, (8192,), page_size=64, max_chunks=4), 64),
    (Case("mma16", 16, (20000,), page_size=64, max_chunks=2, cache="bf16", q="bf16"), 157),
]
CASES += [c for c, _ in BATCH_ONE]
# A grid that offers a second wave (programs = 2 target), with lengths that take it (one
# request would set one wave) and lengths that do not (even requests): (case, takes it).
TWO_WAVES = [
    (Case("mma16", 16, (20000, 64, 0, 140), page_size=64, max_chunks=6, target=5,
          programs=10), True),
    (Case("mma16", 16, (4096, 4000), page_size=16, max_chunks=6, target=7, programs=14,
          q="f16"), False),
    (Case("split", 3, (9000, 20, 1), s_q=2, causal=True, page_size=16, max_chunks=6, target=4,
          programs=8), True),
    (Case("batched8", 9, (300, 7000, 1), page_size=64, max_chunks=6, target=5, programs=10,
          cache="bf16"), True),
    (Case("mma32", 16, (10000, 1, 700), s_q=2, page_size=64, max_chunks=6, target=4,
          programs=8), True),
]
CASES += [c for c, _ in TWO_WAVES]


def run_paged(inp, variant: str, max_chunks: int, *, target: int = 132, programs: int = 0,
              rescale: bool = True,
              merge: bool = True, writes_single: bool | None = None,
              forget_latent: bool = False, tma: bool = True, defines: tuple = (),
              partials: bool = True, attn_merge: bool = False):
    """The paged attention launch and the paged combine on `inp`: (PagedResult, part_l).
    merge=False: the attention launch alone, its latent and lse (those of the requests that
    run one chunk). writes_single: the combine's attn_writes_single flag (None: as
    PagedDecodeStep passes it, whether the family writes a one-chunk request's latent).
    forget_latent: latent and lse are NaN-filled again between the two launches, as if the
    attention kernel had written partials only. tma: the wgmma family's whole tiles by bulk
    tensor copy, through the cache's map, where pages hold whole tiles (else, or False:
    cp.async, a null map). defines: -D for the attention kernel (a planted defect).
    partials=False: the wgmma instance of a single-pass plan (registry.wgmma_instance).
    attn_merge: the mma family merges in its own kernel (its tickets; rescale as given) and
    no combine runs: latent and lse only. programs: the grid's chunk programs a row block
    (0: max(target, B); 2 target offers a second wave)."""
    import cupy as cp

    from mlasandbox.kernels import get_kernel

    q, cache, table, seqlens = inp.q, inp.kv_cache, inp.block_table, inp.cache_seqlens
    batch, s_q, n_head, _ = q.shape
    page_size = cache.shape[1]
    n_rows, max_pages = s_q * n_head, table.shape[1]
    cache_dt = "bf16" if cache.dtype == cp.uint16 else "f16"
    q_dt = "f32" if q.dtype == cp.float32 else cache_dt
    att = registry.paged_attention_instance(variant, cache_dt, q_dt)
    if not partials:  # whatever the plan: a multi-chunk launch must write them after all
        att = registry.instance_for_plan(att, single_pass=True)
        assert att.partials is False, f"{variant} has no instance without partials"
    comb = registry.paged_combine_instance(cache_dt, rescale)
    if writes_single is None:
        writes_single = registry.variant(variant).family in SINGLE_PASS_FAMILIES
    min_chunk = MIN_TILES_PER_CHUNK * att.tile_rows
    latent_dim, v_head = registry.KV_LORA, 128

    i32 = np.int32
    part_acc = cp.full((batch, max_chunks, n_rows, latent_dim), cp.nan, cp.float32)
    part_m = cp.full((batch, max_chunks, n_rows), cp.nan, cp.float32)
    part_l = cp.full((batch, max_chunks, n_rows), cp.nan, cp.float32)
    latent = cp.full((batch, n_rows, latent_dim), cp.nan, cp.float32)
    lse = cp.full((batch, n_rows), cp.nan, cp.float32)
    counts = cp.full(batch, -7, cp.int32)   # every entry must be written
    programs = batch if max_chunks == 1 else (programs or max(target, batch))
    grid = (-(-n_rows // att.heads), programs, 1)
    args = (q, cache, table, seqlens, i32(n_rows), i32(n_head), i32(s_q), i32(inp.causal),
            i32(max_pages), i32(int(math.log2(page_size))), i32(max_chunks), i32(min_chunk),
            np.float32(inp.scale * LOG2E), part_acc, part_m, part_l, i32(target), i32(batch),
            counts, latent, lse)
    if registry.variant(variant).family == "wgmma":
        kv_map = tensor_map.step_map(cache) if tma else None
        if tma and page_size >= tensor_map.BOX_ROWS:
            assert kv_map is not None, "the driver encodes no tensor map"
        args += (kv_map if kv_map is not None else np.uint64(0),)
    attn_tickets = None
    if registry.variant(variant).family == "mma":  # the kernel's own merge, or a null pointer
        if attn_merge:
            attn_tickets = cp.zeros((batch, grid[0]), cp.uint32)
        args += (attn_tickets if attn_merge else np.uint64(0), i32(rescale))
    assert not attn_merge or attn_tickets is not None, f"{variant} does not merge itself"
    get_kernel(att, defines)(grid, (att.threads,), args, shared_mem=att.smem_bytes)
    want = request_chunks(seqlens.get(), max_chunks, att.tile_rows, min_chunk, target,
                          programs=programs)[0]
    assert (counts.get() == want).all(), "the published chunk counts are the rule's"
    shape = (batch, s_q, n_head)
    if attn_merge:
        cp.cuda.Device().synchronize()
        assert int(attn_tickets.sum()) == 0, "the kernel's merge leaves its tickets at 0"
        return PagedResult(latent.reshape(*shape, latent_dim), lse.reshape(shape), None), part_l
    if not merge:
        cp.cuda.Device().synchronize()
        return PagedResult(latent.reshape(*shape, latent_dim), lse.reshape(shape), None), part_l

    if forget_latent:
        latent.fill(cp.nan)
        lse.fill(cp.nan)
    has_wv = inp.wv_b is not None
    out = cp.full((batch, n_rows, v_head), cp.nan, cp.float32)
    out_part = cp.full((batch, n_rows, registry.COMBINE_COL_BLOCKS, v_head), cp.nan,
                       cp.float32)
    tickets = cp.zeros((batch, n_rows), cp.uint32)
    wv_b = inp.wv_b if has_wv else np.uint64(0)  # a null pointer: no out
    get_kernel(comb)((n_rows, registry.COMBINE_COL_BLOCKS, batch), (comb.threads,), (
        part_acc, part_m, part_l, seqlens, i32(n_rows), i32(n_head), i32(max_chunks),
        i32(writes_single), wv_b, i32(v_head), out, latent, lse, out_part, tickets, counts))
    cp.cuda.Device().synchronize()
    assert int(tickets.sum()) == 0, "the combine leaves its tickets at 0 for the next launch"
    return PagedResult(latent.reshape(*shape, latent_dim), lse.reshape(shape),
                       out.reshape(*shape, v_head) if has_wv else None), part_l


def _inputs(case, seed):
    import cupy as cp

    return make_paged_inputs(Dims(n_head=case.heads), list(case.lengths), s_q=case.s_q,
                             page_size=case.page_size, cache_dtype=case.cache,
                             q_dtype=case.q, causal=case.causal, seed=seed,
                             with_wv_b=case.wv_b, xp=cp)


def test_the_two_wave_cases_take_the_wave_they_are_meant_to():
    # so the kernels meet both sides of the device's choice: where a case takes the second
    # wave its chunks differ from one wave's (on the grid of max(target, B), which never
    # offers it), where it does not they are one wave's
    for c, takes in TWO_WAVES:
        tile = registry.paged_attention_instance(c.variant).tile_rows
        args = (list(c.lengths), c.max_chunks, tile, MIN_TILES_PER_CHUNK * tile, c.target)
        assert c.programs == 2 * c.target and offers_two_waves(len(c.lengths), c.target), c
        assert two_waves(*args, programs=c.programs) == takes, c
        one = request_chunks(*args)[0]
        offered = request_chunks(*args, programs=c.programs)[0]
        assert (one != offered).any() == takes, c
        assert not two_waves(*args, programs=max(c.target, len(c.lengths))), c


@gpu
@pytest.mark.parametrize("case", CASES, ids=str)
def test_paged_kernels_match_the_float64_reference(case):
    seed = fresh_seed()
    inp = _inputs(case, seed)
    res, part_l = run_paged(inp, case.variant, case.max_chunks, target=case.target,
                            programs=case.programs)
    ref = decode_paged(**inp.decode_args())
    cmp = compare_paged(res, ref)
    assert cmp.ok, f"{case} seed={seed}\n{cmp.summary()}"
    # the programs past a request's last chunk wrote nothing (their l is still NaN), and the
    # ones before it wrote every row
    tile = registry.paged_attention_instance(case.variant).tile_rows
    n, _ = request_chunks(list(case.lengths), case.max_chunks, tile, MIN_TILES_PER_CHUNK * tile,
                          case.target, programs=case.programs)
    written = ~np.isnan(part_l.get())                      # [B, max_chunks, n_rows]
    want = np.arange(case.max_chunks)[None, :] < n[:, None]  # [B, max_chunks]
    assert (written == want[:, :, None]).all(), f"{case} seed={seed}: chunks written"


# One chunk per request (max_chunks 1): the attention launch writes latent and lse itself,
# with the merge not run, for every family; empty requests and a causal row that sees
# nothing get latent 0, lse -inf.
SINGLE_PASS = [
    Case("split", 3, (0, 1, 140, 4097), s_q=2, causal=True, page_size=16, max_chunks=1),
    Case("batched16", 16, (20, 0, 4095), page_size=64, max_chunks=1, cache="bf16", q="bf16"),
    Case("mma16", 16, (4097, 0, 1, 140), page_size=64, max_chunks=1),
    Case("mma32", 8, (1, 700, 2000), s_q=4, causal=True, page_size=1, max_chunks=1),
    # batch 1 with pages of a tile: the request's first page is its table's first entry
    Case("batched4", 9, (3000,), s_q=2, causal=True, page_size=64, max_chunks=1),
]


@gpu
@pytest.mark.parametrize("case", SINGLE_PASS, ids=str)
def test_a_single_pass_writes_latent_and_lse_without_the_merge(case):
    seed = fresh_seed()
    inp = _inputs(case, seed)
    res, _ = run_paged(inp, case.variant, 1, target=case.target, merge=False)
    cmp = compare_paged(res, decode_paged(**{**inp.decode_args(), "wv_b": None}))
    assert cmp.ok, f"{case} seed={seed}\n{cmp.summary()}"


def test_the_batch_one_cases_have_the_chunks_they_say():
    for c, tiles in BATCH_ONE:
        tile = registry.paged_attention_instance(c.variant).tile_rows
        n, chunk_len = request_chunks(list(c.lengths), c.max_chunks, tile,
                                      MIN_TILES_PER_CHUNK * tile, c.target)
        assert len(c.lengths) == 1 and c.page_size >= tile, c
        assert chunk_len[0] == tiles * tile and n[0] > 1, (c, n, chunk_len)


@gpu
def test_the_single_pass_check_has_power():
    # a request of two chunks gets no latent from the attention launch (only one of one chunk
    # does, PagedWalk::single()): it stays NaN, the comparison must fail
    case = Case("mma16", 16, (4097,), max_chunks=2)
    assert list(request_chunks([4097], 2, 64, MIN_TILES_PER_CHUNK * 64, 132)[0]) == [2]
    seed = fresh_seed()
    inp = _inputs(case, seed)
    res, _ = run_paged(inp, case.variant, 2, merge=False)
    assert np.isnan(res.latent.get()).all()
    assert not compare_paged(res, decode_paged(**{**inp.decode_args(), "wv_b": None})).ok


# Requests of 0, 1 and several chunks in one batch (a small wave target): the attention kernel
# writes the latent and lse of each request of one chunk itself (PagedWalk::single()), the rows
# of a block that sees nothing included (causal lengths 1 and 2 at s_q 4: query tokens 0-2 of
# length 1 see no position, whole 16-row blocks of mma16), and the merge skips those requests
# (combine_paged's attn_writes_single) and merges the others and the empty one. Outputs and
# partials start as NaN (run_paged). The tolerances are the module's (or the family's).
MIXED = [
    Case("mma16", 16, (4097, 1, 0, 140, 9000, 65), page_size=64, max_chunks=4, target=8),
    Case("mma16", 16, (3000, 1, 2, 700, 0), s_q=4, causal=True, page_size=16, max_chunks=6,
         target=6, cache="bf16", wv_b=False),
]


def _requests(res, ref, picked):
    """(res, ref) cut to the requests `picked` (a mask over B), latent and lse only."""
    got = PagedResult(to_host(res.latent)[picked], to_host(res.lse)[picked], None)
    return got, PagedResult(ref.latent[picked], ref.lse[picked], None)


def one_chunk_requests(case):
    """The mask of case's requests that run one chunk (chunks.py's model of the rule); the
    case must mix them with requests of several chunks."""
    tile = registry.paged_attention_instance(case.variant, case.cache, case.q).tile_rows
    n, _ = request_chunks(list(case.lengths), case.max_chunks, tile, MIN_TILES_PER_CHUNK * tile,
                          case.target)
    assert (n == 1).any() and (n >= 2).any(), f"{case}: chunk counts {n} do not mix 1 and more"
    return n == 1


def check_mixed_chunks(case, tolerance=lambda inp, ref: None):
    """MIXED's checks of `case`, compare_paged's tolerance from tolerance(inp, ref)."""
    one = one_chunk_requests(case)
    seed = fresh_seed()
    inp = _inputs(case, seed)
    ref = decode_paged(**inp.decode_args())
    tol = tolerance(inp, ref)
    # the attention launch alone: the one-chunk requests' rows are written, the others not
    alone, _ = run_paged(inp, case.variant, case.max_chunks, target=case.target, merge=False)
    lat, lse = to_host(alone.latent), to_host(alone.lse)
    assert not np.isnan(lat[one]).any() and not np.isnan(lse[one]).any(), f"{case} seed={seed}"
    assert np.isnan(lat[~one]).all() and np.isnan(lse[~one]).all(), f"{case} seed={seed}"
    cmp = compare_paged(*_requests(alone, ref, one), tol)
    assert cmp.ok, f"{case} seed={seed}: the attention launch's own latent\n{cmp.summary()}"
    # the step: the merge leaves those to the attention kernel and merges the rest
    res, _ = run_paged(inp, case.variant, case.max_chunks, target=case.target)
    cmp = compare_paged(res, ref, tol)
    assert cmp.ok, f"{case} seed={seed}\n{cmp.summary()}"


def check_a_merge_that_skips_unwritten_requests_fails(case, tolerance=lambda inp, ref: None):
    """The negative control of check_mixed_chunks: latent and lse NaN-filled again between the
    launches (an attention kernel that writes partials only) and the merge still skipping the
    one-chunk requests leaves exactly those NaN, and the comparison fails; the same launches
    with the flag off (the merge of every request) pass."""
    one = one_chunk_requests(case)
    seed = fresh_seed()
    inp = _inputs(case, seed)
    ref = decode_paged(**inp.decode_args())
    tol = tolerance(inp, ref)
    kw = {"target": case.target, "forget_latent": True}
    bad, _ = run_paged(inp, case.variant, case.max_chunks, writes_single=True, **kw)
    lat = to_host(bad.latent)
    assert np.isnan(lat[one]).all() and not np.isnan(lat[~one]).any(), f"{case} seed={seed}"
    assert not compare_paged(bad, ref, tol).ok, f"{case} seed={seed}: NaN rows passed"
    good, _ = run_paged(inp, case.variant, case.max_chunks, writes_single=False, **kw)
    cmp = compare_paged(good, ref, tol)
    assert cmp.ok, f"{case} seed={seed}: the merge of every request\n{cmp.summary()}"


@gpu
@pytest.mark.parametrize("case", MIXED, ids=str)
def test_requests_of_one_chunk_are_written_by_the_attention_and_skipped_by_the_merge(case):
    check_mixed_chunks(case)


@gpu
def test_negative_control_a_merge_that_skips_requests_nobody_wrote_fails():
    check_a_merge_that_skips_unwritten_requests_fails(MIXED[0])


@gpu
@pytest.mark.parametrize("variant", ["split", "batched16", "mma16", "mma32"])
def test_negative_control_the_combine_without_rescale_fails(variant):
    # several chunks per request with different maxima: dropping the rescale is far off
    case = Case(variant, 16, (4097, 3000), s_q=2, causal=True, page_size=16, max_chunks=8)
    seed = fresh_seed()
    inp = _inputs(case, seed)
    res, _ = run_paged(inp, variant, case.max_chunks, rescale=False)
    cmp = compare_paged(res, decode_paged(**inp.decode_args()))
    assert not cmp.ok, f"{variant} seed={seed}: the check passed a combine without rescale"


# The mma family's own merge (PagedDecodeStep.merges_in_attn): each multi-chunk mma case above
# with the request's last program merging and no combine; a row block none of whose rows sees
# the last chunk (query token 0 of a 1025-position request under s_q 2, its last chunk one
# position) still takes its ticket; an empty request gets latent 0, lse -inf from program b.
# The merge is built for q in the cache dtype only (mla_mma.cu), so the cases take that q.
ATTN_MERGE = [dataclasses.replace(c, q=c.cache) for c in CASES if c.variant.startswith("mma")
              and 1 < c.max_chunks <= registry.ATTN_MERGE_MAX_CHUNKS] + [
    Case("mma16", 16, (1025, 0, 3000), s_q=2, causal=True, page_size=64, max_chunks=16,
         q="f16"),
    Case("mma32", 16, (0,), page_size=16, max_chunks=3, cache="bf16", q="bf16")]


@gpu
@pytest.mark.parametrize("case", ATTN_MERGE, ids=str)
def test_the_mma_kernel_merges_its_own_chunks(case):
    seed = fresh_seed()
    inp = _inputs(case, seed)
    res, part_l = run_paged(inp, case.variant, case.max_chunks, target=case.target,
                            programs=case.programs, attn_merge=True)
    cmp = compare_paged(res, decode_paged(**{**inp.decode_args(), "wv_b": None}))
    assert cmp.ok, f"{case} seed={seed}\n{cmp.summary()}"
    tile = registry.paged_attention_instance(case.variant).tile_rows
    n, _ = request_chunks(list(case.lengths), case.max_chunks, tile, MIN_TILES_PER_CHUNK * tile,
                          case.target, programs=case.programs)
    assert (n > 1).any() or not np.asarray(case.lengths).any(), f"{case}: nothing merged"


@gpu
def test_negative_control_the_kernels_merge_without_rescale_fails():
    case = Case("mma16", 16, (4097, 3000), s_q=2, causal=True, page_size=16, max_chunks=8,
                q="f16")
    seed = fresh_seed()
    inp = _inputs(case, seed)
    ref = decode_paged(**{**inp.decode_args(), "wv_b": None})
    good, _ = run_paged(inp, case.variant, case.max_chunks, attn_merge=True)
    assert compare_paged(good, ref).ok, f"seed={seed}"
    inp = _inputs(case, seed)
    bad, _ = run_paged(inp, case.variant, case.max_chunks, rescale=False, attn_merge=True)
    assert not compare_paged(bad, ref).ok, f"seed={seed}: the check passed a merge without rescale"


def _check(table, seqlens, page_size, num_pages):
    import cupy as cp

    from mlasandbox.kernels import get_kernel

    inst = registry.paged_check_instance()
    error = cp.zeros(4, cp.int32)
    batch, max_pages = table.shape
    get_kernel(inst)((batch,), (inst.threads,), (
        table, seqlens, np.int32(batch), np.int32(max_pages), np.int32(page_size),
        np.int32(num_pages), error))
    return error.get().tolist()


@gpu
def test_the_validator_passes_good_tables_and_names_the_first_bad_entry():
    import cupy as cp

    inp = make_paged_inputs(Dims(n_head=1), [0, 17, 64, 130], page_size=16, xp=cp,
                            seed=fresh_seed())
    num_pages = inp.kv_cache.shape[0]
    # entries past each request's pages hold INVALID_PAGE and are not read
    assert _check(inp.block_table, inp.cache_seqlens, 16, num_pages) == [0, 0, 0, 0]
    bad = inp.block_table.copy()
    bad[3, 8] = num_pages                              # request 3 reads entries 0..8
    assert _check(bad, inp.cache_seqlens, 16, num_pages) == [2, 3, 8, num_pages]
    bad[3, 8] = -1
    assert _check(bad, inp.cache_seqlens, 16, num_pages) == [2, 3, 8, -1]
    lens = inp.cache_seqlens.copy()
    lens[1] = bad.shape[1] * 16 + 1                    # longer than the table describes
    assert _check(inp.block_table, lens, 16, num_pages) == [1, 1, -1, int(lens[1])]
