"""The paged decode step on the device, against the float64 reference (reference.decode_paged).

Inputs come from paged_inputs.make_paged_inputs: the block table is a random permutation of
the pages, unused pages and the tail of each request's last page are NaN, and the table
entries past a request's pages hold INVALID_PAGE, so a read of anything a request must not
see poisons the result (or faults under the sanitizer). Outputs and partials are NaN-filled
before every run, so an element a kernel failed to write fails the check too.

Tolerances: compare.py's defaults (relL2 1e-4 for out and latent, 1e-4 absolute for lse),
derived there from the f32 arithmetic of one row. A paged row is the same arithmetic on the
same kinds of sums: its request's positions, at most 40000 here, cut into chunks that the
combine merges, which keeps the sums shorter than the batch-1 contexts that derivation
covers. Rows that see nothing must be exactly latent 0, lse -inf, out 0 (compare_paged). The
cuBLAS engine rounds q, p and latent to the cache dtype, so it gets test_gpu_kernels'
CUBLAS_TOL, the same as at batch 1.
"""
from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass

import numpy as np
import pytest

import mlasandbox as mla
from gpu_support import fresh_seed, gpu, poison
from mlasandbox import reference
from mlasandbox.chunks import CHUNK_CAP
from mlasandbox.compare import Tolerance, compare, rel_l2
from mlasandbox.compare_paged import compare_paged
from mlasandbox.dims import Dims
from mlasandbox.paged import INVALID_PAGE, PagedResult, pages_needed
from mlasandbox.paged_inputs import make_paged_inputs
from test_gpu_kernels import CUBLAS_TOL
from tolerances import f32_error_scale

PAGED_CUDA = ("split", "batched4", "batched16", "mma16", "mma32")
PAGED_VARIANTS = PAGED_CUDA + ("cublas",)


def tolerance(variant, cache_dtype):
    return CUBLAS_TOL[cache_dtype] if variant == "cublas" else Tolerance()


def on_device(inp):
    """The same inputs with every array copied to the device."""
    import cupy

    return dataclasses.replace(inp, **{f.name: cupy.asarray(getattr(inp, f.name))
                                       for f in dataclasses.fields(inp)
                                       if hasattr(getattr(inp, f.name), "shape")})


def check_step(step, ref, tol, label):
    poison(step)
    res = step.run()
    cmp = compare_paged(res, ref, tol)
    assert cmp.ok, f"{label} plan={step.plan}\n{cmp.summary()}"
    return cmp


# ---- the case grid -----------------------------------------------------------------------
@dataclass(frozen=True)
class InputSet:
    batch: int
    s_q: int
    length: int       # the batch's lengths are drawn from N(length, length / 2)
    heads: int
    page_size: int
    causal: bool
    cache: str
    q: str

    def __str__(self):
        return (f"B{self.batch}-sq{self.s_q}-len{self.length}-H{self.heads}-p{self.page_size}"
                f"-{'causal' if self.causal else 'full'}-{self.cache}-q{self.q}")

    def lengths(self, rng) -> np.ndarray:
        """Drawn from N(s, s/2), clipped to [0, 2s]; request 0 has exactly s and the last
        request of a batch of three or more is empty, so every value of the grid is hit
        exactly and the batches mix lengths."""
        s = self.length
        draw = np.clip(np.rint(rng.normal(s, s / 2, self.batch)), 0, 2 * s).astype(np.int64)
        draw[0] = s
        if self.batch > 2:
            draw[-1] = 0
        return draw

    @property
    def work(self) -> int:
        """Rows x positions the float64 reference walks, at most (its cost)."""
        return self.batch * 2 * self.length * self.s_q * self.heads


# A covering design, not the product: every value of each axis of FlashMLA's dense-decoding
# grid appears; large batches only with short lengths, the long lengths at small batches and
# head counts, so the reference stays a few seconds per set. Every variant runs every set
# (one reference per set), so every variant meets every page size, both causal modes, both
# dtypes and every s_q.
INPUT_SETS = (
    InputSet(1, 1, 20000, 16, 64, False, "f16", "f32"),
    InputSet(2, 4, 4097, 9, 16, True, "bf16", "f32"),
    InputSet(6, 2, 4096, 3, 1, True, "f16", "f16"),
    InputSet(64, 1, 140, 16, 16, False, "bf16", "bf16"),
    InputSet(128, 2, 20, 63, 64, True, "f16", "f32"),
    InputSet(2, 1, 4095, 63, 64, False, "bf16", "f32"),
    InputSet(128, 4, 1, 1, 1, True, "f16", "f32"),
    InputSet(2, 2, 140, 128, 16, True, "bf16", "f32"),
    InputSet(1, 1, 4096, 128, 64, False, "f16", "f32"),
    InputSet(6, 4, 20, 16, 1, True, "f16", "f32"),
)
GRID = {"batch": (1, 2, 6, 64, 128), "s_q": (1, 2, 4),
        "length": (1, 20, 140, 4095, 4096, 4097, 20000), "heads": (1, 3, 9, 16, 63, 128),
        "page_size": (1, 16, 64), "causal": (False, True), "cache": ("f16", "bf16")}
CASES = [(s, v) for s in INPUT_SETS for v in PAGED_VARIANTS]


def test_the_case_grid_covers_every_value_and_stays_cheap():
    for axis, values in GRID.items():
        assert {getattr(s, axis) for s in INPUT_SETS} == set(values), axis
    assert {s.q for s in INPUT_SETS} >= {"f32", "f16", "bf16"}
    rng = np.random.default_rng(0)
    drawn = [s.lengths(rng) for s in INPUT_SETS]
    assert set(np.concatenate(drawn)) >= {0, *GRID["length"]}
    assert sum(len(set(d)) > 2 for d in drawn) >= 4, "batches must mix lengths"
    assert all(s.length <= 140 for s in INPUT_SETS if s.batch >= 64)
    assert sum(s.work for s in INPUT_SETS) <= 6_000_000   # ~ 10 s of float64 reference
    assert 40 <= len(CASES) <= 60


@pytest.fixture(scope="module")
def grid_data(module_seeds):
    """One input set's device inputs and reference, built on first use and shared by
    every variant that runs it."""
    cache = {}

    def get(input_set):
        if input_set not in cache:
            key = [module_seeds.entropy, zlib.crc32(str(input_set).encode())]
            seed = int(np.random.SeedSequence(key).generate_state(1)[0])
            rng = np.random.default_rng(seed)
            host = make_paged_inputs(Dims(n_head=input_set.heads), input_set.lengths(rng),
                                     s_q=input_set.s_q, page_size=input_set.page_size,
                                     cache_dtype=input_set.cache, q_dtype=input_set.q,
                                     causal=input_set.causal, seed=seed)
            cache[input_set] = (on_device(host), reference.decode_paged(**host.decode_args()),
                                f"seed={seed} {module_seeds}")
        return cache[input_set]

    return get


@gpu
@pytest.mark.parametrize("input_set, variant", CASES, ids=lambda x: str(x))
def test_paged_variant_matches_the_float64_reference(grid_data, input_set, variant):
    from mlasandbox.paged_api import PagedDecodeStep

    dev, ref, seed = grid_data(input_set)
    step = PagedDecodeStep(**dev.decode_args(), variant=variant, sync_check=True)
    step.check_indices()
    check_step(step, ref, tolerance(variant, input_set.cache), f"{input_set} {variant} {seed}")


@gpu
@pytest.mark.parametrize("fused", [True, False], ids=["one kernel", "merge + projection"])
@pytest.mark.parametrize("lengths, s_q", [([20000], 1), ([0, 5000], 1), ([4097], 2)])
def test_both_combine_forms_match_the_float64_reference(lengths, s_q, fused):
    """A batch of at most 16 rows defaults to the one-kernel combine; both forms, forced, on
    chunks of several requests (an empty one too) and causal MTP rows, NaN-poisoned
    (out_part included), against the float64 reference."""
    from mlasandbox.paged_api import PagedDecodeStep

    seed = fresh_seed()
    host = make_paged_inputs(Dims(n_head=16 // (s_q * len(lengths))), lengths, s_q=s_q,
                             page_size=64, causal=s_q > 1, seed=seed)
    dev, ref = on_device(host), reference.decode_paged(**host.decode_args())
    step = PagedDecodeStep(**dev.decode_args(), variant="mma16", sync_check=True,
                           fused_combine=fused)
    assert step.fused_combine == fused and not step.single_pass
    check_step(step, ref, tolerance("mma16", "f16"), f"{lengths} s_q={s_q} seed={seed}")
    assert len(step.launches()) == (2 if fused else 3)


@gpu
@pytest.mark.parametrize("s_q, heads, want", [(1, 16, "mma16"), (4, 4, "mma16"),
                                              (2, 9, "mma32")])
def test_auto_runs_the_mma_instance_of_its_rows(seeds, s_q, heads, want):
    from mlasandbox.paged_api import PagedDecodeStep

    host = make_paged_inputs(Dims(n_head=heads), [300, 0, 77], s_q=s_q, page_size=16,
                             seed=seeds.one())
    dev = on_device(host)
    auto = PagedDecodeStep(**dev.decode_args(), sync_check=True)
    named = PagedDecodeStep(**dev.decode_args(), variant=want)
    assert auto.variant.name == want and auto.attn_inst == named.attn_inst
    check_step(auto, reference.decode_paged(**host.decode_args()), Tolerance(), str(seeds))


# ---- every split count against one reference -----------------------------------------------
@pytest.fixture(scope="module")
def split_data(module_seeds):
    seed = module_seeds.take()[0]
    host = make_paged_inputs(Dims(n_head=16), [0, 700, 3000, 129], s_q=2, page_size=16,
                             causal=True, seed=seed)
    return on_device(host), reference.decode_paged(**host.decode_args()), seed, host


@gpu
@pytest.mark.parametrize("splits", [1, 2, 7, 64, CHUNK_CAP])
@pytest.mark.parametrize("variant", PAGED_CUDA)
def test_every_split_count_matches_one_reference(split_data, variant, splits):
    """splits=N caps every request at N chunks; the balance gives each request whole
    chunks of at least one tile, so past its need a request's extra chunk programs exit at
    once and write nothing the combine reads. splits=1 is a single pass: the attention
    kernel writes latent and lse (the merge of one partial gives the same words)."""
    from mlasandbox.paged_api import PagedDecodeStep

    dev, ref, seed, host = split_data
    step = PagedDecodeStep(**dev.decode_args(), variant=variant, splits=splits,
                           sync_check=True)
    assert step.plan.max_chunks == splits
    n_chunks, _ = step.plan.for_lengths(host.cache_seqlens)
    assert n_chunks[0] == 0 and n_chunks.max() <= splits
    assert (n_chunks[2] > 1) == (splits > 1), "the long request must be merged from chunks"
    assert step.plan.single_pass == (splits == 1)
    check_step(step, ref, Tolerance(), f"{variant} splits={splits} seed={seed}")


@gpu
@pytest.mark.parametrize("variant", ["split", "batched16", "mma16", "mma32"])
def test_negative_control_combine_without_rescale_fails_the_check(seeds, variant):
    """The same check, with a paged combine that drops exp(m_i - m), must fail: it has power."""
    from mlasandbox.paged_api import PagedDecodeStep

    seed = seeds.one()
    host = make_paged_inputs(Dims(n_head=16), [20000, 9000, 0, 3000], page_size=64, seed=seed)
    dev, ref = on_device(host), reference.decode_paged(**host.decode_args())
    good = PagedDecodeStep(**dev.decode_args(), variant=variant, splits=16)
    check_step(good, ref, Tolerance(), f"{variant} seed={seed}")
    broken = PagedDecodeStep(**dev.decode_args(), variant=variant, splits=16, rescale=False)
    assert "rescale=false" in broken.combine_inst.name
    poison(broken)
    cmp = compare_paged(broken.run(), ref)
    assert not cmp.ok, f"the check did not reject the broken combine (seed={seed})"
    print(f"negative control ({variant}): {cmp.summary()}")


# ---- one graph, every length ----------------------------------------------------------------
GRAPH_B, GRAPH_PAGE, GRAPH_PAGES, GRAPH_HEADS, GRAPH_SQ = 8, 64, 16, 16, 2
GRAPH_MAX = GRAPH_PAGE * GRAPH_PAGES


def _graph_length_sets(rng) -> dict:
    one = np.zeros(GRAPH_B, np.int64)
    one[5] = 777
    at_max = rng.integers(0, 200, GRAPH_B)
    at_max[2] = GRAPH_MAX
    return {"all zero": np.zeros(GRAPH_B, np.int64), "one nonzero": one,
            "page boundaries": np.array([63, 64, 65, 127, 128, 129, 1, 191]),
            "one at the maximum": at_max,
            "random": rng.integers(0, GRAPH_MAX + 1, GRAPH_B)}


def refill(lengths, num_pages, seed, *, heads=GRAPH_HEADS, s_q=GRAPH_SQ, pages=GRAPH_PAGES,
           **kw):
    """New inputs for `lengths` laid out in exactly num_pages pages and `pages` table
    columns (the captured shapes), INVALID_PAGE in the columns past each request's pages."""
    need = int(pages_needed(lengths, GRAPH_PAGE).sum())
    host = make_paged_inputs(Dims(n_head=heads), lengths, s_q=s_q, page_size=GRAPH_PAGE,
                             seed=seed, spare_pages=num_pages - need - 1, **kw)
    table = np.full((len(lengths), pages), INVALID_PAGE, np.int32)
    table[:, :host.block_table.shape[1]] = host.block_table
    return dataclasses.replace(host, block_table=table)


def write_into(dev, host, stream=None) -> None:
    """Copy `host`'s arrays into the device buffers of `dev` (the same buffers a captured
    graph reads)."""
    for f in ("q", "kv_cache", "block_table", "cache_seqlens", "wv_b"):
        getattr(dev, f).set(np.ascontiguousarray(getattr(host, f)), stream=stream)


def replay_and_check(step, graph, dev, host, what: str) -> None:
    """`host`'s inputs written into the buffers `graph` reads, its outputs, partials and
    chunk counts poisoned (gpu_support.poison), one replay on the step's graph stream,
    compared with the float64 reference; the kernel's own merge (where it runs) leaves its
    tickets at 0 for the next replay."""
    stream = step.graph_stream
    write_into(dev, host, stream)
    with stream:
        poison(step)
    graph.launch(stream)
    stream.synchronize()
    cmp = compare_paged(step.result, reference.decode_paged(**host.decode_args()))
    assert cmp.ok, f"{what}\n{cmp.summary()}"
    if step.merges_in_attn:
        assert int(step.attn_tickets.sum()) == 0, f"{what}: tickets left for the next replay"


@gpu
@pytest.mark.parametrize("variant,splits,q", [("split", None, "f32"), ("batched16", None, "f32"),
                                              ("mma16", None, "f32"), ("mma32", None, "f32"),
                                              ("mma16", 8, "f16")])
def test_one_graph_serves_five_length_sets(seeds, variant, splits, q):
    """Captured once at B = 8 with every request at the maximum, replayed with five length
    sets (new lengths, table, cache, q and wv_b written into the same buffers): every replay
    matches the reference and the step's phases never run again (no recapture). mma16 under
    8 chunk slots with a 16-bit q merges in its own kernel (its tickets back at 0 after every
    replay)."""
    from mlasandbox.paged_api import PagedDecodeStep

    seed = seeds.one()
    full = make_paged_inputs(Dims(n_head=GRAPH_HEADS), [GRAPH_MAX] * GRAPH_B, s_q=GRAPH_SQ,
                             page_size=GRAPH_PAGE, causal=True, seed=seed, q_dtype=q)
    num_pages = full.kv_cache.shape[0]
    dev = on_device(full)
    step = PagedDecodeStep(**dev.decode_args(), variant=variant, splits=splits,
                           sync_check=True)
    assert step.merges_in_attn == (splits is not None)
    grid = step.launches()
    graph = step.capture()
    assert step.guard.captured == len(step.launches()) and step.launches() == grid
    rng = np.random.default_rng(seed)
    for k, (name, lengths) in enumerate(_graph_length_sets(rng).items()):
        host = refill(lengths, num_pages, seed + k + 1, causal=True, q_dtype=q)
        replay_and_check(step, graph, dev, host,
                         f"{variant}, replay with {name} {lengths.tolist()}: seed={seed}")
    assert step.guard.captured == len(step.launches()), \
        "a replay ran the step's Python phases again"


@gpu
@pytest.mark.parametrize("variant", ["mma16", "split"])
def test_a_graph_replays_right_after_its_step_is_dropped(seeds, variant):
    """Only the graph is kept: the step goes out of scope and is collected, and arrays of the
    step's buffer sizes are allocated (where a freed step's memory would be handed out again)
    and NaN-filled before the replay. The replay still matches the reference, in the buffers
    the graph holds (capture returns a StepGraph that keeps its step)."""
    import gc

    import cupy

    from mlasandbox.paged_api import PagedDecodeStep

    seed = seeds.one()
    full = make_paged_inputs(Dims(n_head=GRAPH_HEADS), [GRAPH_MAX] * GRAPH_B, s_q=GRAPH_SQ,
                             page_size=GRAPH_PAGE, causal=True, seed=seed, q_dtype="f16")
    dev = on_device(full)
    graph = PagedDecodeStep(**dev.decode_args(), variant=variant).capture()
    sizes = [a.size for a in (graph.step.latent, graph.step.lse, graph.step.out)]
    gc.collect()
    decoys = [cupy.full(n, cupy.nan, dtype=cupy.float32) for n in sizes for _ in range(4)]
    lengths = np.random.default_rng(seed).integers(0, GRAPH_MAX + 1, GRAPH_B)
    host = refill(lengths, full.kv_cache.shape[0], seed + 1, causal=True, q_dtype="f16")
    replay_and_check(graph.step, graph, dev, host,
                     f"{variant}, replay after the step was dropped: seed={seed}")
    assert all(bool(cupy.isnan(d).all()) for d in decoys), "the replay wrote into other arrays"


WAVE_SETS = {"even (one wave)": [3000] * 8, "one long (two waves)": [3000] * 7 + [9000],
             "all zero": [0] * 8, "one at the maximum": [0] * 7 + [9216]}


@gpu
@pytest.mark.parametrize("q", ["f16", "f32"])
def test_one_graph_takes_one_wave_or_two_as_the_lengths_ask(seeds, q):
    """128 heads under mma16 at B = 8: 8 row blocks, a wave target of 16 programs on 132
    SMs, so the grid offers a second wave (32 programs). One graph, replayed with lengths
    that take it and lengths that do not (chunks.two_waves says which): every replay
    matches the reference. With a 16-bit q the kernel merges the chunks itself."""
    from mlasandbox.chunks import two_waves
    from mlasandbox.paged_api import PagedDecodeStep

    seed, pages = seeds.one(), 9216 // GRAPH_PAGE
    full = make_paged_inputs(Dims(n_head=128), [9216] * 8, page_size=GRAPH_PAGE, seed=seed,
                             q_dtype=q)
    num_pages = full.kv_cache.shape[0]
    dev = on_device(full)
    step = PagedDecodeStep(**dev.decode_args(), variant="mma16", sync_check=True)
    plan = step.plan
    if plan.target != 16:
        pytest.skip(f"the case is built for 132 SMs and one mma16 block an SM (target "
                    f"{plan.target})")
    assert plan.waves == 2 and plan.grid == (8, 32, 1) and step.merges_in_attn == (q == "f16")
    graph = step.capture()
    taken = {}
    for k, (name, lengths) in enumerate(WAVE_SETS.items()):
        host = refill(lengths, num_pages, seed + k + 1, heads=128, s_q=1, pages=pages,
                      q_dtype=q)
        taken[name] = two_waves(lengths, plan.max_chunks, plan.tile, plan.min_chunk,
                                plan.target, programs=plan.programs_per_block)
        replay_and_check(step, graph, dev, host, f"q {q}, replay with {name}: seed={seed}")
        assert (step.chunk_counts.get() == plan.for_lengths(lengths)[0]).all(), name
    assert taken == {"even (one wave)": False, "one long (two waves)": True, "all zero": False,
                     "one at the maximum": False}


def test_graph_length_sets_are_what_they_say():
    sets = _graph_length_sets(np.random.default_rng(0))
    assert not sets["all zero"].any() and np.count_nonzero(sets["one nonzero"]) == 1
    crossing = sets["page boundaries"]
    assert {x % GRAPH_PAGE for x in crossing} >= {GRAPH_PAGE - 1, 0, 1}
    assert sets["one at the maximum"].max() == GRAPH_MAX
    assert all(len(v) == GRAPH_B and v.max() <= GRAPH_MAX for v in sets.values())


@gpu
def test_the_cublas_engine_refuses_capture(seeds):
    from mlasandbox.paged_api import PagedDecodeStep

    dev = on_device(make_paged_inputs(Dims(n_head=4), [10, 0], page_size=16, seed=seeds.one()))
    with pytest.raises(ValueError, match="cublas cannot be captured"):
        PagedDecodeStep(**dev.decode_args(), variant="cublas").capture()


# ---- the index validator --------------------------------------------------------------------
@gpu
def test_the_validator_names_the_request_and_the_entry(seeds):
    from mlasandbox.paged_api import PagedDecodeStep

    host = make_paged_inputs(Dims(n_head=4), [100, 0, 300, 64], page_size=16, seed=seeds.one())
    dev = on_device(host)
    num_pages, max_len = host.kv_cache.shape[0], host.block_table.shape[1] * 16
    step = PagedDecodeStep(**dev.decode_args(), variant="split", sync_check=True)
    # INVALID_PAGE past each request's pages is never read, so it is no error
    assert step.index_report().tolist() == [0, 0, 0, 0]
    for b, j, value in ((2, 7, num_pages + 11), (0, 6, -1), (3, 3, INVALID_PAGE)):
        table = host.block_table.copy()
        table[b, j] = value
        dev.block_table.set(table)
        assert step.index_report().tolist() == [2, b, j, value]
        with pytest.raises(ValueError, match=rf"block_table\[{b}, {j}\] = {value} .*request {b} "
                                             rf"\(length {host.cache_seqlens[b]}\) reads it"):
            mla.decode_paged(**dev.decode_args())
    dev.block_table.set(host.block_table)
    for b, value in ((3, max_len + 1), (1, -5)):
        lengths = host.cache_seqlens.copy()
        lengths[b] = value
        dev.cache_seqlens.set(lengths)
        assert step.index_report().tolist() == [1, b, -1, value]
        with pytest.raises(ValueError, match=rf"cache_seqlens\[{b}\] = {value} is outside"):
            mla.decode_paged(**dev.decode_args())
    dev.cache_seqlens.set(host.cache_seqlens)
    assert step.index_report().tolist() == [0, 0, 0, 0]


# ---- batch 1, the layouts, no wv_b ----------------------------------------------------------
@gpu
@pytest.mark.parametrize("variant", ["split", "batched16", "mma16", "mma32"])
def test_batch_one_paged_matches_contiguous_decode(seeds, variant):
    """The same rows through the table and as one contiguous cache: each within the default
    tolerance of the float64 reference, and within the rounding model's bound of each other.
    tests/tolerances.py bounds the relL2 of a correct f32 schedule on these very inputs by
    MARGIN x its rms (f32_error_scale, per head, the largest taken: the whole tensor's relL2
    is a weighted mean of the heads'); the unsplit chain over all 5000 positions is the
    longest either path runs (chunks and slices only shorten it), so its bound holds for
    both, and by the triangle inequality they differ by at most twice it: 2.3e-5 .. 3.3e-5
    for latent and out (seeds 0-4 on the CPU), where the two checks above allow 2e-4."""
    import cupy

    n, seed = 5000, seeds.one()
    host = make_paged_inputs(Dims(n_head=16), [n], page_size=64, seed=seed)
    pages = host.block_table[0, :-(-n // 64)]
    rows = host.kv_cache[pages].reshape(-1, host.kv_cache.shape[-1])[:n]
    paged = mla.decode_paged(**on_device(host).decode_args(), variant=variant)
    dense = mla.decode(cupy.asarray(host.q[0, 0]), cupy.asarray(rows), cupy.asarray(host.wv_b),
                       n, variant=variant)
    ref = reference.decode_paged(**host.decode_args())
    assert compare_paged(paged, ref).ok, f"seed={seed}"
    ref1 = reference.decode(host.q[0, 0], rows, host.wv_b, n)
    assert compare(dense, ref1).ok, f"seed={seed}"
    model = f32_error_scale(host.q[0, 0], rows, host.wv_b, n, host.scale)
    for f, bound in (("out", model.out_bound()), ("latent", model.latent_bound())):
        err = rel_l2(getattr(paged, f)[0, 0], getattr(dense, f))
        assert err <= 2 * bound, \
            f"{f}: paged vs contiguous relL2 {err:.2e} > {2 * bound:.2e}, seed={seed}"


@gpu
@pytest.mark.parametrize("variant", ["mma32", "cublas"])
def test_flashmla_cache_layout_without_wv_b(seeds, variant):
    """kv_cache as FlashMLA's [num_pages, page_size, 1, 576], no wv_b (no out), empty
    requests and causal queries that see nothing."""
    seed = seeds.one()
    host = make_paged_inputs(Dims(n_head=9), [0, 2, 33], s_q=4, page_size=16, causal=True,
                             with_wv_b=False, seed=seed)
    dev = on_device(host)
    cache4 = dev.kv_cache.reshape(dev.kv_cache.shape[0], 16, 1, dev.kv_cache.shape[-1])
    res = mla.decode_paged(dev.q, cache4, dev.block_table, dev.cache_seqlens, causal=True,
                           variant=variant)
    assert res.out is None
    cmp = compare_paged(res, reference.decode_paged(**host.decode_args()),
                        tolerance(variant, "f16"))
    assert cmp.ok and cmp.empty_rows > 9, f"seed={seed}\n{cmp.summary()}"


# ---- torch tensors ---------------------------------------------------------------------------
def _torch_inputs(torch, dev):
    """torch views of the device inputs (bf16 words as torch.bfloat16), zero copy."""
    import cupy

    out = {}
    for name, arr in dev.decode_args().items():
        if hasattr(arr, "shape"):
            if arr.dtype == cupy.uint16:
                arr = torch.from_dlpack(arr.view(cupy.int16)).view(torch.bfloat16)
            else:
                arr = torch.from_dlpack(arr)
        out[name] = arr
    return out


def _as_cupy(res):
    import cupy

    return PagedResult(*(None if t is None else cupy.from_dlpack(t)
                         for t in (res.latent, res.lse, res.out)))


@gpu
@pytest.mark.parametrize("cache_dtype", ["f16", "bf16"])
def test_torch_tensors_in_torch_tensors_out_on_torch_s_stream(seeds, cache_dtype):
    torch = pytest.importorskip("torch", reason="torch is an optional dependency")
    import cupy

    from mlasandbox.paged_api import PagedDecodeStep

    seed = seeds.one()
    host = make_paged_inputs(Dims(n_head=16), [900, 0, 4097], s_q=2, page_size=64,
                             cache_dtype=cache_dtype, causal=True, seed=seed)
    dev = on_device(host)
    args = _torch_inputs(torch, dev)
    assert args["kv_cache"].data_ptr() == dev.kv_cache.data.ptr
    ref = reference.decode_paged(**host.decode_args())
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        step = PagedDecodeStep(**args, variant="mma32", sync_check=True)
        assert step.launch_stream().ptr == stream.cuda_stream
        assert step.kv_cache.data.ptr == args["kv_cache"].data_ptr(), "DLPack made a copy"
    poison(step)   # on CuPy's current stream, which torch's stream does not wait for
    cupy.cuda.Device().synchronize()
    with torch.cuda.stream(stream):
        res = step.run()
    stream.synchronize()
    assert all(isinstance(t, torch.Tensor) and t.is_cuda for t in (res.latent, res.lse, res.out))
    cmp = compare_paged(_as_cupy(res), ref)
    assert cmp.ok, f"step.run, seed={seed}\n{cmp.summary()}"
    assert res.latent.data_ptr() == step.latent.data.ptr
    # decode_paged allocates its own outputs but shares the per-device scratch, where the run
    # above left this batch's partials and chunk counts: poisoned again, so that a
    # decode_paged whose attention did not run cannot pass by merging them
    poison(step)
    cupy.cuda.Device().synchronize()
    with torch.cuda.stream(stream):
        res2 = mla.decode_paged(**args)
    stream.synchronize()
    assert all(isinstance(t, torch.Tensor) and t.is_cuda for t in (res2.latent, res2.lse, res2.out))
    cmp = compare_paged(_as_cupy(res2), ref)
    assert cmp.ok, f"decode_paged, seed={seed}\n{cmp.summary()}"


@gpu
def test_a_capture_under_torch_cuda_graph_replays_new_lengths(seeds):
    torch = pytest.importorskip("torch", reason="torch is an optional dependency")
    import cupy

    from mlasandbox.paged_api import PagedDecodeStep

    seed = seeds.one()
    full = make_paged_inputs(Dims(n_head=GRAPH_HEADS), [GRAPH_MAX] * GRAPH_B, s_q=GRAPH_SQ,
                             page_size=GRAPH_PAGE, cache_dtype="bf16", seed=seed)
    dev = on_device(full)
    step = PagedDecodeStep(**_torch_inputs(torch, dev), variant="mma16")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):   # torch's recipe: a warm-up run off the default stream
        step.run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res = step.run()
    assert step.guard.captured == len(step.launches())
    rng = np.random.default_rng(seed)
    for k, lengths in enumerate((rng.integers(0, GRAPH_MAX + 1, GRAPH_B),
                                 np.array([0, 1, 64, 65, 1024, 3, 0, 500]))):
        host = refill(lengths, full.kv_cache.shape[0], seed + k + 1, cache_dtype="bf16")
        write_into(dev, host)
        poison(step)
        cupy.cuda.Device().synchronize()
        graph.replay()
        torch.cuda.synchronize()
        cmp = compare_paged(_as_cupy(res), reference.decode_paged(**host.decode_args()))
        assert cmp.ok, f"replay {k} {lengths.tolist()} seed={seed}\n{cmp.summary()}"
