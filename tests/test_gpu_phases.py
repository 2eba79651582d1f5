"""The small phases on the device: q_absorb split over column blocks, the merge at every
column-block count (the paged one in every form: both prefetch depths, the warp merge), the
batched projection, programmatic dependent launch (plain, inside a captured graph, with the
negative control; the attention behind q_absorb) and the launch floor.

Tolerances: the projection is a 512-term f32 sum per output (`project`: four chains of 128
on the tensor cores, added in order; `project_wide`: one chain of 512) of products exact in
f32, so its own rounding is a relL2 of at most ~u32 sqrt(512) ~ 1.3e-6, and a wrong column or row costs O(1). It takes the latent as
hi + lo 16-bit parts of wv_b's type (wv_b is exact in 16 bits): x - (hi + lo) is lo's
rounding, at most half an ulp of lo, |lo| <= 2^-p |x| (p = 11 significant bits for f16, 8
for bf16), so at most 2^-2p |x|: 2.4e-7 (f16), 1.5e-5 (bf16) relative. Those errors are
independent over the 512 columns, so out's relL2 is their rms, 2.5e-6 for bf16 and 5e-8 for
f16 on the normal latents drawn here (the split evaluated in float64 with ml_dtypes); with
the f32 accumulation's ~1e-6 that stays under PROJECT_TOL = 1e-5 by 3x. A bf16 latent
rounded to one 16-bit part (no lo) errs by ~2^-9 / sqrt(3) ~ 1e-3: the negative control
shows 1e-5 catches it. q_absorb's 128-term dot products are ~5e-7 (test_gpu_kernels.py
derives the same 1e-5). The whole step keeps compare's defaults (tests/test_gpu_kernels.py,
docs/numerics.md).
"""
from __future__ import annotations

import numpy as np
import pytest

from gpu_support import compile_with, device_inputs, fresh_seed, gpu, poison, run_poisoned
from mlasandbox import reference, registry
from mlasandbox.compare import compare, rel_l2
from mlasandbox.dims import Dims
from test_gpu_kernels import tolerance

PROJECT_TOL = 1e-5


@gpu
@pytest.mark.parametrize("heads", [1, 16, 128])
def test_q_absorb_at_every_head_count_is_exact_to_f32_and_deterministic(heads):
    import cupy

    from mlasandbox.api import QAbsorb

    inp, seed = device_inputs(Dims(n_head=heads), 5, "f16", "f32")
    qa = QAbsorb(inp.q_nope, inp.q_rope, inp.wk_b)
    assert qa.grid == (heads, registry.Q_ABSORB_COL_BLOCKS, 1)
    qa.q.fill(cupy.nan)
    first = cupy.asnumpy(qa.run()).copy()
    want = reference.q_absorb(inp.q_nope, inp.q_rope, inp.wk_b)
    assert not np.isnan(first).any(), f"an element was not written (seed={seed})"
    assert rel_l2(first, want) < 1e-5, f"seed={seed}"
    qa.q.fill(cupy.nan)
    assert np.array_equal(cupy.asnumpy(qa.run()), first), "q_absorb is not deterministic"


@gpu
@pytest.mark.parametrize("fused", [True, False], ids=["one kernel", "merge + projection"])
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("col_blocks", [1, 2, 4, 8, 16])
def test_the_merge_at_every_column_block_count_matches_one_reference(col_blocks, pdl, fused):
    import cupy

    from mlasandbox.api import DecodeStep

    from mlasandbox.pdl import supported

    inp, seed = device_inputs(Dims(n_head=16), 20000, "f16", "f32")
    cupy.cuda.get_current_stream().synchronize()
    ref = reference.decode(**inp.decode_args())
    # a stream of its own: programmatic launches are never made on a default stream
    with cupy.cuda.Stream(non_blocking=True) as stream:
        step = DecodeStep(**inp.decode_args(), variant="mma16", splits=33, pdl=pdl,
                          sync_check=True, fused_combine=fused)
        step.col_blocks = col_blocks
        res = run_poisoned(step)
        stream.synchronize()
        cmp = compare(res, ref)
        assert cmp.ok, f"col_blocks={col_blocks} pdl={pdl} seed={seed}\n{cmp.summary()}"
        assert step.guard.programmatic == ((1 if fused else 2) if pdl and supported() else 0)
        first = [cupy.asnumpy(a).copy() for a in (res.out, res.latent, res.lse)]
        again = run_poisoned(step)
        stream.synchronize()
        for a, b in zip(first, (again.out, again.latent, again.lse)):
            assert np.array_equal(a, cupy.asnumpy(b)), "the merge is not deterministic"


# ---- the paged merge in every form, on partials made here --------------------------------
# Chunk counts on both sides of what a thread prefetches (the block merge: groups x prefetch,
# groups = 2 x column blocks, 16 .. 512; the warp merge: 8 chunks, then 32 (m, l) a pass) and
# of the 256 weights of one step (kSplitTile), an empty request (latent 0, lse -inf) and one
# of a single chunk (merged: attn_writes_single is 0 here).
MERGE_COUNTS = (0, 1, 2, 17, 33, 64, 65, 129, 257)
MERGE_ROWS = 5   # the warp merge: 10 warps, a last block of two
# Tolerance: each latent element is sum_i w_i acc_i / l over n <= 257 chunks in f32 (FMAs in a
# thread, then the split groups added in order), w_i = exp2f(m_i - m) to ~2 ulp. acc_i = l_i
# v_i with v_i ~ N(1, 0.25) here, so the terms are positive and a relative error of at most
# n u32 = 257 x 2^-24 = 1.5e-5 bounds every element (the rms is ~sqrt(n) u32 ~ 1e-6); lse =
# (m + log2 l) ln 2 with |m| <= 20 errs by a few ulp of 30. The merge without its rescale
# (w_i = 1 where m_i spans +-20) is off by O(1).
MERGE_TOL = 2e-5


def _paged_merge(form, rescale, seed):
    """The merge of `form` (registry.MergeForm) over MERGE_COUNTS on its grid
    (registry.merge_grid), its partials past each request's count NaN (never read) and its
    outputs NaN-poisoned: (latent, lse, the float64 reference's latent and lse)."""
    import cupy

    from mlasandbox.kernels import get_kernel

    rng = np.random.default_rng(seed)
    B, C, R = len(MERGE_COUNTS), max(MERGE_COUNTS), MERGE_ROWS
    m = rng.uniform(-20, 20, (B, C, R))
    l = rng.uniform(0.5, 100, (B, C, R))
    acc = l[..., None] * rng.normal(1, 0.25, (B, C, R, 512))
    empty = rng.random((B, C, R)) < 0.1   # a chunk a row does not see: l 0, m -inf, acc 0
    m[empty], l[empty], acc[empty] = -np.inf, 0.0, 0.0
    want_lat, want_lse = np.zeros((B, R, 512)), np.full((B, R), -np.inf)
    for b, n in enumerate(MERGE_COUNTS):
        m[b, n:], l[b, n:], acc[b, n:] = np.nan, np.nan, np.nan
        for r in range(R):
            seen = l[b, :n, r] > 0
            if not seen.any():
                continue
            top = m[b, :n, r][seen].max()
            w = np.exp2(m[b, :n, r][seen] - top)
            tot = (w * l[b, :n, r][seen]).sum()
            want_lat[b, r] = (w[:, None] * acc[b, :n, r][seen]).sum(0) / tot
            want_lse[b, r] = (top + np.log2(tot)) * np.log(2)
    inst = registry.paged_merge_instance(form, "f16", rescale)
    f32 = lambda a: cupy.asarray(a, cupy.float32)   # noqa: E731
    counts = cupy.asarray(MERGE_COUNTS, cupy.int32)
    latent = cupy.full((B, R, 512), cupy.nan, cupy.float32)
    lse = cupy.full((B, R), cupy.nan, cupy.float32)
    i32, null = np.int32, np.uint64(0)
    get_kernel(inst)(registry.merge_grid(form, R, B), (inst.threads,), (
        f32(acc), f32(m), f32(l), counts, i32(R), i32(R), i32(C), i32(0), null, i32(128),
        null, latent, lse, null, null, counts))
    return cupy.asnumpy(latent), cupy.asnumpy(lse), want_lat, want_lse


MERGE_FORMS = [registry.MergeForm("combine", cb, p) for p in (registry.COMBINE_PREFETCH,
                                                               registry.COMBINE_DEEP_PREFETCH)
               for cb in (1, 2, 4, 8, 16)] + [registry.WARP_MERGE]


@gpu
@pytest.mark.parametrize("form", MERGE_FORMS, ids=str)
def test_the_paged_merge_in_every_form_matches_float64_at_every_chunk_count(form):
    seed = fresh_seed()
    lat, lse, want_lat, want_lse = _paged_merge(form, True, seed)
    assert not np.isnan(lat).any() and not np.isnan(lse).any(), f"not written (seed={seed})"
    for b, n in enumerate(MERGE_COUNTS):
        if not np.isfinite(want_lse[b]).any():
            assert (lat[b] == 0).all() and (lse[b] == -np.inf).all(), f"n={n} seed={seed}"
            continue
        assert rel_l2(lat[b], want_lat[b]) < MERGE_TOL, f"n={n} seed={seed}"
        np.testing.assert_allclose(lse[b], want_lse[b], rtol=MERGE_TOL, err_msg=f"n={n}")
    again = _paged_merge(form, True, seed)
    assert np.array_equal(again[0], lat), "the merge is not deterministic"


@gpu
@pytest.mark.parametrize("form", [registry.MergeForm("combine", 2, registry.COMBINE_PREFETCH),
                                  registry.MergeForm("combine", 2, registry.COMBINE_DEEP_PREFETCH),
                                  registry.WARP_MERGE], ids=str)
def test_negative_control_the_paged_merge_without_rescale_misses_the_tolerance(form):
    seed = fresh_seed()
    lat, _, want, _ = _paged_merge(form, False, seed)
    many = [b for b, n in enumerate(MERGE_COUNTS) if n > 1]
    assert rel_l2(lat[many], want[many]) > 100 * MERGE_TOL, f"seed={seed}"


@gpu
@pytest.mark.parametrize("form, per_sm", [
    (registry.MergeForm("combine", 1, registry.COMBINE_PREFETCH), 3),
    (registry.MergeForm("combine", 1, registry.COMBINE_DEEP_PREFETCH), 2),
    (registry.WARP_MERGE, 2)], ids=str)
def test_each_merge_keeps_the_blocks_an_sm_its_launch_bounds_ask_for(form, per_sm):
    """registry.merge_form counts waves with the driver's occupancy; the launch bounds
    (kMinBlocks, kDeepMinBlocks) hold the block merges at three and two blocks an SM, and the
    warp merge at two (256 rows a wave on 132 SMs)."""
    from mlasandbox.kernels import blocks_per_sm

    for cache in ("f16", "bf16"):
        assert blocks_per_sm(registry.paged_merge_instance(form, cache)) >= per_sm


KINDS = ["project", "project_wide"]


def _project(m_rows, heads, cache, seed, kind, v_head=128, latent_fn=None):
    """The projection kernel `kind` on random inputs, out NaN-poisoned with one guard row past the last: (out on the host, the
    float64 reference). latent_fn, if given, changes the latent the kernel gets (not the
    reference's)."""
    import cupy

    from mlasandbox.bf16 import as_f64, to_storage
    from mlasandbox.kernels import get_kernel

    rng = np.random.default_rng(seed)
    latent = rng.standard_normal((m_rows, heads, 512)).astype(np.float32)
    wv = to_storage(rng.standard_normal((heads, v_head, 512)).astype(np.float32) * 0.05, cache)
    want = np.einsum("mhc,hvc->mhv", latent.astype(np.float64), as_f64(wv))
    inst = registry.project_instance(cache, kind)
    out = cupy.full((m_rows + 1, heads, v_head), cupy.nan, cupy.float32)
    given = latent if latent_fn is None else latent_fn(latent)
    get_kernel(inst)(registry.project_grid(heads, v_head, m_rows, inst.kind), (inst.threads,),
                     (cupy.asarray(given), cupy.asarray(wv), np.int32(heads),
                      np.int32(m_rows), np.int32(v_head), out))
    return cupy.asnumpy(out), want


@gpu
@pytest.mark.parametrize("m_rows,heads", [(1, 16), (5, 3), (16, 1), (17, 16), (40, 9),
                                          (63, 2), (64, 16), (65, 3), (128, 16), (33, 128),
                                          (200, 5)])
@pytest.mark.parametrize("cache", ["f16", "bf16"])
@pytest.mark.parametrize("kind", KINDS)
def test_the_projection_matches_float64_and_writes_only_its_rows(m_rows, heads, cache, kind):
    """Both kernels at row counts on both sides of their tiles (32, 64), so either may run
    wherever registry.project_kind sends a step."""
    seed = fresh_seed()
    got, want = _project(m_rows, heads, cache, seed, kind)
    assert not np.isnan(got[:m_rows]).any(), f"an output was not written (seed={seed})"
    assert np.isnan(got[m_rows:]).all(), f"the projection wrote past its last row (seed={seed})"
    assert rel_l2(got[:m_rows], want) < PROJECT_TOL, f"seed={seed}"


@gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("v_head", [80, 200])  # 80 = 2 x 32 + 16; 200 = 128 + 72
def test_the_projection_masks_a_partial_block_of_wv_b_rows(kind, v_head):
    seed = fresh_seed()
    got, want = _project(3 if kind == "project" else 70, 2, "f16", seed, kind, v_head=v_head)
    m = want.shape[0]
    assert rel_l2(got[:m], want) < PROJECT_TOL and np.isnan(got[m:]).all(), f"seed={seed}"


@gpu
@pytest.mark.parametrize("kind", KINDS)
def test_the_projection_tolerance_rejects_a_latent_rounded_to_one_bf16_part(kind):
    """The negative control of PROJECT_TOL: the latent rounded to bf16 (what the tensor
    cores would see without the lo part) misses it by ~100x."""
    from mlasandbox.bf16 import as_f64, to_storage

    seed = fresh_seed()
    got, want = _project(64, 4, "bf16", seed, kind,
                         latent_fn=lambda x: as_f64(to_storage(x, "bf16")).astype(np.float32))
    assert rel_l2(got[:64], want) > 10 * PROJECT_TOL, f"seed={seed}"


@gpu
@pytest.mark.parametrize("variant", ["split", "mma16"])
def test_programmatic_steps_replay_in_a_graph_and_the_control_still_fails(variant):
    """The step (PDL where the device has it) captured in a CUDA graph and replayed matches
    the reference; the same with the combine that drops its rescale must fail."""
    import cupy

    from mlasandbox.api import DecodeStep
    from mlasandbox.pdl import supported
    from mlasandbox.timing import capture_graph

    inp, seed = device_inputs(Dims(n_head=16), 20000, "f16", "f32")
    cupy.cuda.get_current_stream().synchronize()
    ref = reference.decode(**inp.decode_args())
    verdicts = {}
    for rescale in (True, False):
        step = DecodeStep(**inp.decode_args(), variant=variant, splits=33, rescale=rescale)
        assert step.pdl == supported()
        assert [ln.pdl for ln in step.launches] == [False, step.pdl]  # attn, the combine
        stream = cupy.cuda.Stream(non_blocking=True)
        graph = capture_graph(step.run, stream)
        assert step.guard.programmatic == (1 if step.pdl else 0)
        # what the replay must write, poisoned right before it (the scratch partials are
        # shared with every step on the device); the fills are on the current stream
        poison(step)
        cupy.cuda.get_current_stream().synchronize()
        graph.launch(stream)
        stream.synchronize()
        verdicts[rescale] = compare(reference.DecodeResult(step.out, step.latent, step.lse),
                                    ref)
    assert verdicts[True].ok, f"seed={seed}\n{verdicts[True].summary()}"
    assert not verdicts[False].ok, f"the control passed under PDL (seed={seed})"


BATCH_1_KERNELS = [n for n, v in registry.VARIANTS.items() if v.is_cuda]


def _behind_q_absorb_case(variant):
    """(tolerance, inputs, seed, float64 step) of the attention-behind-q_absorb tests: 16
    heads, 2000 positions (several slices for the splitting variants), an f16 cache and an
    f32 q, which inputs.make_inputs stores as q_absorb(q_nope, q_rope, wk_b) in float64."""
    import cupy

    tol = tolerance(variant, "f16")   # 1e-4, or p's rounding (mma16r, mma32r)
    inp, seed = device_inputs(Dims(n_head=16), 2000, "f16", "f32")
    ref = reference.decode(**inp.decode_args())
    # The inputs were written on the null stream, which a non-blocking stream does not wait
    # for: without this the step may read them half written (a GPU shared by other processes
    # made that visible).
    cupy.cuda.get_current_stream().synchronize()
    return tol, inp, seed, ref


@gpu
@pytest.mark.parametrize("variant", BATCH_1_KERNELS)
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_the_attention_behind_q_absorb_reads_the_q_it_wrote(variant, graph):
    """q_absorb, then the attention as its programmatic dependent (its blocks start while
    q_absorb runs, DecodeStep.run_attn(after_q_absorb=True)), then the combine, eager and
    replayed from one graph, against the float64 step from q_nope, q_rope and wk_b. q is
    NaN-filled on the stream right before q_absorb, so an attention block that read q before
    q_absorb's grid completed reads NaN words and fails the compare; everything the step writes
    is poisoned too. 2000 positions: several slices for the splitting variants."""
    import cupy

    from mlasandbox.api import DecodeStep, QAbsorb
    from mlasandbox.pdl import supported
    from mlasandbox.timing import capture_graph

    tol, inp, seed, ref = _behind_q_absorb_case(variant)
    with cupy.cuda.Stream(non_blocking=True) as stream:
        qa = QAbsorb(inp.q_nope, inp.q_rope, inp.wk_b)
        step = DecodeStep(**dict(inp.decode_args(), q=qa.q), variant=variant)
        assert step.pdl == supported()

        def run():
            qa.q.fill(cupy.nan)
            qa.run()
            before = step.guard.programmatic
            step.run_attn(after_q_absorb=True)
            assert step.guard.programmatic == before + (1 if step.pdl else 0)
            step.run_combine()

        for _ in range(3):
            poison(step)
            if graph:
                g = capture_graph(run, stream)
                g.launch(stream)
            else:
                run()
            stream.synchronize()
            cmp = compare(reference.DecodeResult(step.out, step.latent, step.lse), ref, tol)
            assert cmp.ok, f"{variant} seed={seed}\n{cmp.summary()}"


# A stand-in for q_absorb that writes q late: it lets its dependents start at once, sleeps
# LATE_Q_NS on the global timer, then copies q. The attention blocks launched behind it start
# within a few microseconds and reach q after their first cache tile, so a kernel that does not
# wait reads the NaN words and one that waits reads q.
_LATE_Q_SOURCE = r"""
extern "C" __global__ void late_q(const float* src, float* dst, int n, unsigned long long ns) {
    asm volatile("griddepcontrol.launch_dependents;");
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        __nanosleep(1000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
    for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}
"""
LATE_Q_NS = 200_000
CONTROL_RUNS = 40  # runs of the negative control until one fails (it stops at the first)


@gpu
@pytest.mark.parametrize("variant", BATCH_1_KERNELS)
def test_the_attention_waits_for_a_late_q_and_without_its_wait_reads_it_early(variant):
    """The attention behind a kernel that writes q 200 us after it starts (late_q above):
    with its pdl_wait every run matches the reference, eager and replayed from a graph; the
    same kernel built without the wait (-DMLA_NO_PDL_WAIT, the negative control) reads the
    NaN q and fails. The control is asked to fail in one run of up to CONTROL_RUNS, not in
    all: a time slice of another process on the GPU may fall inside the 200 us and let q land
    first. Under the suite's 16 processes the control read q right in all five runs it once
    had (mma16, H200, 2026-12-05), so it runs until one fails, up to CONTROL_RUNS."""
    import cupy

    from mlasandbox.api import DecodeStep
    from mlasandbox.pdl import supported
    from mlasandbox.timing import capture_graph

    if not supported():
        pytest.skip("this device has no programmatic dependent launch (sm_90 and later)")
    late_q = cupy.RawKernel(_LATE_Q_SOURCE, "late_q")
    tol, inp, seed, ref = _behind_q_absorb_case(variant)
    with cupy.cuda.Stream(non_blocking=True) as stream:
        q = cupy.empty_like(inp.q)
        step = DecodeStep(**dict(inp.decode_args(), q=q), variant=variant)

        def run():
            q.fill(cupy.nan)
            late_q((1,), (256,), (inp.q, q, np.int32(q.size), np.uint64(LATE_Q_NS)))
            before = step.guard.programmatic
            step.run_attn(after_q_absorb=True)
            assert step.guard.programmatic == before + 1, "the attention was launched plainly"
            step.run_combine()

        def verdict(fn):
            poison(step)
            fn()
            stream.synchronize()
            return compare(reference.DecodeResult(step.out, step.latent, step.lse), ref, tol)

        for _ in range(3):
            cmp = verdict(run)
            assert cmp.ok, f"{variant} eager seed={seed}\n{cmp.summary()}"
        graph = capture_graph(run, stream)
        for _ in range(3):
            cmp = verdict(lambda: graph.launch(stream))
            assert cmp.ok, f"{variant} graph seed={seed}\n{cmp.summary()}"

        step.attn_kernel = compile_with(step.attn_inst, "MLA_NO_PDL_WAIT")
        assert any(not verdict(run).ok for _ in range(CONTROL_RUNS)), \
            f"{variant}: the attention without its wait read q after it was written (seed={seed})"


@gpu
def test_a_refused_programmatic_launch_is_reported_by_its_phase():
    from mlasandbox.guard import PhaseError, PhaseGuard
    from mlasandbox.timing import LaunchFloor

    kernel = LaunchFloor().kernel
    with pytest.raises(PhaseError, match="phase 'combine'.*programmatic dependent launch"):
        PhaseGuard("x").launch("combine", kernel, (1, 1, 1), (4096, 1, 1), (), pdl=True)


@gpu
def test_the_launch_floor_is_a_graph_of_the_steps_launches():
    from mlasandbox.bench_gpu import CupyBackend

    backend = CupyBackend()
    backend.prepare(Dims(n_head=16), 4096, "f16", "f32", fresh_seed())
    kw = {"warmup": 1, "min_repeats": 3, "max_repeats": 3, "target_s": 0.001}
    t = backend.time_floor("mma16", 4096, "auto", kw)
    assert t.mode == "graph" and t.stats.n == 3 and t.median_us > 0
    assert backend.time_floor("cublas", 4096, "auto", kw) is None
    backend.release()
