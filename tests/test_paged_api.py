"""The paged API on the CPU: what it checks before anything launches, how it reads the
caller's framework (with fake torch and CuPy objects), the chunk plan it sizes the grid by,
the kernels' argument lists, and how the index validator's report becomes an error."""
from __future__ import annotations

import subprocess
import sys
import types
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pytest

import mlasandbox as mla
from mlasandbox import interop, paged_api, registry, user_kernel
from mlasandbox.bench_paged import make_paged_config, plan_report
from mlasandbox.bf16 import as_f64
from mlasandbox.chunks import CHUNK_CAP
from mlasandbox.dims import Dims
from mlasandbox.paged import check_paged_inputs, pages_needed, visible_lengths
from mlasandbox.paged_api import (PagedDecodeStep, check_capturable, check_page_size,
                                  paged_variant, plan_for, raise_for_index_report)
from mlasandbox.paged_inputs import make_paged_inputs
from mlasandbox.repro import make_paged_case
from mlasandbox.sweep_paged import _plan_row
from mlasandbox.user_repro import make_user_case


class FakeArray:
    """Only what the host checks read: .shape, .dtype, .ndim."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype, self.ndim = tuple(shape), np.dtype(dtype), len(shape)


def fake_inputs(batch=2, s_q=1, heads=16, num_pages=8, page_size=64, max_pages=4,
                key_dim=576):
    return dict(q=FakeArray((batch, s_q, heads, key_dim), np.float32),
                kv_cache=FakeArray((num_pages, page_size, key_dim), np.float16),
                block_table=FakeArray((batch, max_pages), np.int32),
                cache_seqlens=FakeArray((batch,), np.int32),
                wv_b=FakeArray((heads, 128, 512), np.float16))


# ---- variants, page sizes, dims: refused before the inputs are touched -------------------
@pytest.mark.parametrize("s_q, heads, want", [(1, 1, "mma16"), (1, 16, "mma16"),
                                              (4, 4, "mma16"), (1, 17, "mma32"),
                                              (2, 9, "mma32"), (4, 128, "mma32")])
def test_auto_is_mma16_while_the_query_rows_fit_sixteen(s_q, heads, want):
    assert paged_variant("auto", s_q, heads).name == want


def test_named_variants_resolve_and_batched_means_the_default_hpb():
    for name in ("split", "batched4", "batched16", "mma16", "mma32", "cublas"):
        assert paged_variant(name, 2, 16).name == name
    assert paged_variant("batched", 1, 16).name == f"batched{paged_api.DEFAULT_BATCHED_HPB}"


@pytest.mark.parametrize("name", ["per_head", "tiled16"])
def test_batch_one_variants_refuse_the_paged_contract(name):
    with pytest.raises(ValueError, match=f"variant {name} serves batch 1.*mla.decode"):
        paged_variant(name, 1, 16)
    with pytest.raises(ValueError, match=f"variant {name} serves batch 1"):
        PagedDecodeStep(**fake_inputs(), variant=name)


def test_unknown_variants_are_refused_with_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown paged variant 'mma64'.*auto, split"):
        paged_variant("mma64", 1, 16)
    with pytest.raises(TypeError, match="variant must be a name"):
        paged_variant(16, 1, 16)


@pytest.mark.parametrize("size, shift", [(1, 0), (16, 4), (64, 6)])
def test_page_sizes_the_kernels_take(size, shift):
    assert check_page_size(size) == shift


@pytest.mark.parametrize("size", [2, 8, 32, 128, 3])
def test_other_page_sizes_are_refused_for_the_cuda_variants(size):
    with pytest.raises(ValueError, match=f"page_size {size} .*one of 1, 16, 64"):
        check_page_size(size)
    with pytest.raises(ValueError, match=f"page_size {size} "):
        PagedDecodeStep(**fake_inputs(page_size=size), variant="mma16")


def test_the_cublas_engine_takes_any_page_size_and_then_wants_device_arrays():
    # page size 8 passes the engine's checks; the NumPy arrays are refused next, by interop
    inp = make_paged_inputs(Dims(n_head=2), [3, 9], page_size=8, seed=1)
    with pytest.raises(TypeError, match="torch tensors or CuPy arrays.*cupy.asarray"):
        PagedDecodeStep(**inp.decode_args(), variant="cublas")


def test_the_cublas_engine_does_not_split():
    with pytest.raises(ValueError, match="cublas engine does not split"):
        PagedDecodeStep(**fake_inputs(), variant="cublas", splits=4)


def test_the_cuda_variants_need_the_compiled_dims():
    with pytest.raises(ValueError, match="kv_lora=512, rope=64; got kv_lora=512, rope=32"):
        PagedDecodeStep(**fake_inputs(key_dim=544), variant="split")


def test_a_batch_past_the_grid_z_limit_is_refused():
    with pytest.raises(ValueError, match="batch 65536 exceeds the grid's z limit 65535"):
        PagedDecodeStep(**fake_inputs(batch=65536, heads=1), variant="mma16")


def test_host_checks_come_first_and_name_the_parameter():
    bad = fake_inputs()
    bad["block_table"] = FakeArray((3, 4), np.int32)
    with pytest.raises(ValueError, match=r"block_table must be \[2, max_pages\]"):
        mla.decode_paged(**bad)
    bad = fake_inputs()
    bad["cache_seqlens"] = FakeArray((2,), np.int64)
    with pytest.raises(TypeError, match="cache_seqlens must be int32"):
        mla.decode_paged(**bad)


def test_check_capturable_refuses_only_the_cublas_engine():
    check_capturable(registry.variant("mma16"))
    with pytest.raises(ValueError, match="cublas cannot be captured.*reads the lengths"):
        check_capturable(registry.variant("cublas"))


# ---- the plan -------------------------------------------------------------------------
class FakeInstance:
    def __init__(self, heads, tile_rows):
        self.heads, self.tile_rows = heads, tile_rows


def _shape(**kw):
    return check_paged_inputs(**fake_inputs(**kw))[0]


def test_the_plan_budgets_batch_by_row_blocks_by_chunks_on_the_slots():
    shape = _shape(batch=8, s_q=2, heads=16)         # 32 query rows a request
    plan = plan_for(shape, FakeInstance(16, 64), num_sms=132, blocks_per_sm=2)
    assert plan.head_blocks == 2 and plan.tile == 64 and plan.min_chunk == 64
    assert plan.target == (132 * 2) // 2              # 132 chunk programs a row block
    assert plan.max_chunks == -(-2 * 132 // 8)        # 33: twice the mean request's need
    assert plan.grid == (2, 132, 1)                   # a row block's 132 chunk programs
    # a partial last row block still gets a block: 33 rows at 16 a block are 3 blocks
    plan = plan_for(_shape(batch=1, s_q=3, heads=11), FakeInstance(16, 64), num_sms=132,
                    blocks_per_sm=2)
    assert plan.head_blocks == 3


def test_splits_caps_every_request_and_auto_is_the_budget():
    shape = _shape(batch=4, heads=16)
    inst = FakeInstance(1, 32)
    auto = plan_for(shape, inst, num_sms=132, blocks_per_sm=3)
    assert plan_for(shape, inst, num_sms=132, blocks_per_sm=3, splits="auto") == auto
    for n in (1, 2, 7, CHUNK_CAP):
        assert plan_for(shape, inst, num_sms=132, blocks_per_sm=3, splits=n).max_chunks == n
    with pytest.raises(ValueError, match=r"splits must be None, 'auto' or an integer 1\.\.256"):
        plan_for(shape, inst, num_sms=132, blocks_per_sm=3, splits=CHUNK_CAP + 1)
    # every bad value names splits, the caller's parameter (not the rule's `chunks`)
    for bad in ("many", 2.5, True, 0, -1, np.int64(0)):
        with pytest.raises(ValueError, match="splits must be None, 'auto' or an integer"):
            plan_for(shape, inst, num_sms=132, blocks_per_sm=3, splits=bad)
    # an occupancy query that says 0 blocks still plans (the launch guard reports it later)
    assert plan_for(shape, inst, num_sms=132, blocks_per_sm=0).slots == 132


# ---- the kernels' argument lists ---------------------------------------------------------
def _bare_step(causal=True, wv_b=True, family="mma"):
    """A step with sentinels where the device buffers go: what attn_args/combine_args read."""
    step = object.__new__(PagedDecodeStep)
    step.variant = types.SimpleNamespace(family=family)
    kw = fake_inputs(batch=3, s_q=2, heads=5, page_size=16, max_pages=7, num_pages=20)
    if not wv_b:
        kw["wv_b"] = None
    step.shape, step.scale = check_paged_inputs(**kw, causal=causal)
    step.causal, step.page_shift = causal, 4
    step.plan = plan_for(step.shape, FakeInstance(16, 64), num_sms=132, blocks_per_sm=2,
                         splits=5)
    for name in ("q", "kv_cache", "block_table", "cache_seqlens", "part_acc", "part_m",
                 "part_l", "latent", "lse", "chunk_counts"):
        setattr(step, name, name)
    step.col_blocks = registry.combine_col_blocks(3 * 10, 132)
    step.merge = registry.MergeForm("combine", step.col_blocks, registry.COMBINE_PREFETCH)
    step.wv_b = "wv_b" if wv_b else None
    step.out = "out" if wv_b else None
    step.project_inst = registry.project_instance("f16") if wv_b else None
    step.fused_combine = False  # the merge only: combine_args passes null projection pointers
    step.merges_in_attn, step.attn_tickets, step.merge_rescale = False, None, True
    return step


def test_attn_args_follow_the_kernels_order_and_types():
    step = _bare_step()
    args = step.attn_args()
    assert args[:4] == ("q", "kv_cache", "block_table", "cache_seqlens")
    ints = [int(a) for a in args[4:12]]
    # n_rows, n_head, s_q, causal, max_pages, page_shift, max_chunks, min_chunk
    assert ints == [10, 5, 2, 1, 7, 4, 5, 64]
    assert all(isinstance(a, np.int32) for a in args[4:12])
    assert isinstance(args[12], np.float32)
    assert float(args[12]) == pytest.approx(step.scale * np.log2(np.e), rel=1e-7)
    assert args[13:16] == ("part_acc", "part_m", "part_l")
    assert isinstance(args[16], np.int32) and int(args[16]) == step.plan.target == 264
    assert isinstance(args[17], np.int32) and int(args[17]) == 3   # batch
    assert args[18:] == ("chunk_counts", "latent", "lse")
    assert step.attn_grid == (1, 264, 1)
    # 30 rows: 16 column blocks (480 blocks) where 8 would give 240 < 2 x 132 SMs
    assert step.col_blocks == 16 and step.combine_grid == (10, 16, 3)
    assert step.project_grid == (5, 4, 1)  # 5 heads, 128 / 32 wv_b rows, 6 <= 32 latent rows
    assert int(_bare_step(causal=False).attn_args()[7]) == 0


def test_the_wgmma_launch_takes_the_cache_map_and_mma_its_merge_last():
    step = _bare_step()
    step.kv_map = "kv_map"
    *contract, tickets, rescale = step.attn_launch_args()  # mma: the contract, then its merge's
    assert tuple(contract) == step.attn_args()
    assert isinstance(tickets, np.uint64) and int(tickets) == 0 and int(rescale) == 1
    step.merges_in_attn, step.attn_tickets, step.merge_rescale = True, "attn_tickets", False
    assert step.attn_launch_args()[-2:] == ("attn_tickets", 0)
    for family in ("split", "batched", "user"):              # the contract as it is
        assert _bare_step(family=family).attn_launch_args() == step.attn_args()
    wg = _bare_step(family="wgmma")
    wg.kv_map = "kv_map"
    assert wg.attn_launch_args() == wg.attn_args() + ("kv_map",) and wg.uses_tma
    wg.kv_map = None                                     # cp.async: a null pointer
    last = wg.attn_launch_args()[-1]
    assert isinstance(last, np.uint64) and int(last) == 0 and not wg.uses_tma


def test_the_merge_takes_null_pointers_for_wv_b_and_the_projection_applies_it():
    for wv_b in (True, False):
        args = _bare_step(wv_b=wv_b).combine_args()
        assert len(args) == 16
        assert args[:4] == ("part_acc", "part_m", "part_l", "cache_seqlens")
        # n_rows, n_head, max_chunks, attn_writes_single (mma writes a one-chunk request)
        assert [int(a) for a in args[4:8]] == [10, 5, 5, 1]
        assert all(isinstance(a, np.int32) for a in args[4:8])
        assert int(args[9]) == 128 and args[11:13] == ("latent", "lse")
        for i in (8, 10, 13, 14):  # wv_b, out, out_part, tickets: the merge-only launch
            assert args[i] == np.uint64(0) and args[i].dtype == np.uint64  # pointer-sized
        assert args[15] == "chunk_counts"   # as the attention launch wrote them
    proj = _bare_step().project_args()
    assert proj[:2] == ("latent", "wv_b") and proj[-1] == "out"
    assert [int(a) for a in proj[2:5]] == [5, 6, 128]  # n_head, B * s_q rows, v_head


# ---- the index validator's report ---------------------------------------------------------
def _host_case(seed):
    inp = make_paged_inputs(Dims(n_head=2), [5, 40, 0, 17], page_size=16, seed=seed)
    shape = check_paged_inputs(**{k: v for k, v in inp.decode_args().items()
                                  if k not in ("causal", "scale")})[0]
    return inp, shape


def test_a_report_of_a_bad_entry_raises_in_the_host_checks_words(seeds):
    inp, shape = _host_case(seeds.one())
    table = inp.block_table.copy()
    table[1, 2] = shape.num_pages + 3
    with pytest.raises(ValueError, match=rf"block_table\[1, 2\] = {shape.num_pages + 3} is "
                                         r"not a page id.*request 1 \(length 40\) reads it"):
        raise_for_index_report([2, 1, 2, shape.num_pages + 3], table, inp.cache_seqlens,
                               shape)


def test_a_report_of_a_bad_length_names_the_request(seeds):
    inp, shape = _host_case(seeds.one())
    lengths = inp.cache_seqlens.copy()
    lengths[3] = shape.max_len + 1
    with pytest.raises(ValueError, match=rf"cache_seqlens\[3\] = {shape.max_len + 1} is "
                                         rf"outside 0..{shape.max_len}"):
        raise_for_index_report([1, 3, -1, shape.max_len + 1], inp.block_table, lengths, shape)


def test_a_clean_report_passes_and_an_unconfirmed_one_is_a_validator_bug(seeds):
    inp, shape = _host_case(seeds.one())
    raise_for_index_report([0, 0, 0, 0], inp.block_table, inp.cache_seqlens, shape)
    with pytest.raises(RuntimeError, match="validator and the host check disagree"):
        raise_for_index_report([2, 0, 0, 1], inp.block_table, inp.cache_seqlens, shape)


# ---- the caller's framework ---------------------------------------------------------------
def _fake_type(module, name="Tensor"):
    return type(name, (), {"__module__": module})


def test_framework_detection_reads_the_type_module():
    assert interop.framework_of(_fake_type("torch")()) == "torch"
    assert interop.framework_of(_fake_type("torch.nn.parameter", "Parameter")()) == "torch"
    assert interop.framework_of(_fake_type("cupy._core.core", "ndarray")()) == "cupy"
    assert interop.framework_of(np.zeros(1)) == "numpy"


def test_mixed_frameworks_are_refused_naming_each_input():
    t, c = _fake_type("torch")(), _fake_type("cupy")()
    with pytest.raises(TypeError, match="mix frameworks.*q is torch, kv_cache is cupy"):
        interop.common_framework({"q": t, "kv_cache": c, "wv_b": None})
    assert interop.common_framework({"q": t, "wv_b": None}) == "torch"
    with pytest.raises(TypeError, match="must be torch tensors or CuPy arrays.*got jax"):
        interop.common_framework({"q": _fake_type("jax")()})


def test_detection_never_imports_torch():
    code = ("import sys, numpy as np; from mlasandbox import interop\n"
            "try:\n    interop.common_framework({'q': np.zeros(1)})\n"
            "except TypeError:\n    pass\n"
            "assert interop.framework_of(np.zeros(1)) == 'numpy'\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


class _FakeTorchTensor:
    def __init__(self, dtype, device_index=0, is_cuda=True, tag="t"):
        self.dtype, self.is_cuda, self.tag = dtype, is_cuda, tag
        self.device = types.SimpleNamespace(index=device_index if is_cuda else None)

    def view(self, dtype):
        return _FakeTorchTensor(dtype, self.device.index, self.is_cuda, f"{self.tag}.view")

    def detach(self):
        return self


_FakeTorchTensor.__module__ = "torch"


class _FakeCupyArray:
    def __init__(self, src, dtype="float16"):
        self.src, self.viewed = src, None
        self.dtype = types.SimpleNamespace(name=dtype)

    def view(self, dtype):
        self.viewed = dtype
        return self


@pytest.fixture
def fake_torch(monkeypatch):
    """A torch module just big enough for interop, and CuPy's entry points recorded."""
    import cupy

    torch = types.ModuleType("torch")
    torch.bfloat16, torch.int16, torch.float16 = "bf16", "int16", "f16"
    streams = []
    torch.cuda = types.SimpleNamespace(
        current_device=lambda: 0,
        current_stream=lambda dev: streams.append(dev) or types.SimpleNamespace(cuda_stream=77))
    torch.from_dlpack = lambda arr: ("torch view of", arr)
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setattr(cupy, "from_dlpack", lambda t: _FakeCupyArray(t))
    monkeypatch.setattr(cupy.cuda.Stream, "from_external",
                        lambda obj: ("external", obj.__cuda_stream__()))
    monkeypatch.setattr(interop.Caller, "on", lambda self, stream=None: nullcontext())
    return types.SimpleNamespace(torch=torch, streams=streams)


def test_torch_inputs_cross_by_dlpack_with_bf16_as_words(fake_torch):
    import cupy

    q = _FakeTorchTensor("f16", tag="q")
    cache = _FakeTorchTensor("bf16", tag="cache")
    caller, arrs = interop.from_caller({"q": q, "kv_cache": cache, "wv_b": None})
    assert caller == interop.Caller("torch", 0)
    assert arrs["q"].src is q and arrs["q"].viewed is None
    # bf16 crosses as int16 (a dtype DLPack carries everywhere) and is read as uint16 words
    assert arrs["kv_cache"].src.tag == "cache.view" and arrs["kv_cache"].src.dtype == "int16"
    assert arrs["kv_cache"].viewed is cupy.uint16
    assert arrs["wv_b"] is None


def test_torch_results_and_streams_are_torch_s(fake_torch):
    caller = interop.Caller("torch", 0)
    assert caller.current_stream() == ("external", (0, 77))
    assert fake_torch.streams == [0]
    assert caller.to_caller("latent") == ("torch view of", "latent")
    assert caller.to_caller(None) is None
    assert interop.Caller("cupy", 0).to_caller("latent") == "latent"


def test_torch_inputs_off_the_current_device_are_refused(fake_torch):
    with pytest.raises(ValueError, match="kv_cache is on device 1, the current torch device "
                                         "is 0"):
        interop.from_caller({"q": _FakeTorchTensor("f16"),
                             "kv_cache": _FakeTorchTensor("f16", device_index=1)})
    with pytest.raises(ValueError, match="q is on the host"):
        interop.from_caller({"q": _FakeTorchTensor("f16", is_cuda=False)})


def test_a_cupy_bf16_array_is_read_as_words(monkeypatch):
    import cupy

    arr = _FakeCupyArray(None, "bfloat16")
    assert interop.Caller("cupy", 0).to_device("q", arr).viewed is cupy.uint16
    plain = _FakeCupyArray(None, "uint16")
    assert interop.Caller("cupy", 0).to_device("q", plain).viewed is None


# ---- the cuBLAS engine's paged gathering -------------------------------------------------
def _attention_f64(q, cache, n_ctx, scale, cache_dtype, latent, lse):
    """cublas_attention's contract in float64 NumPy: what the gathering is tested through."""
    q64, rows = as_f64(q), as_f64(cache[:n_ctx])
    s = q64 @ rows.T * scale
    m = s.max(axis=1, keepdims=True)
    w = np.exp(s - m)
    l = w.sum(axis=1, keepdims=True)
    latent[...] = (w @ rows[:, :latent.shape[1]]) / l
    lse[...] = (m + np.log(l)).ravel()


@pytest.mark.parametrize("causal", [False, True])
def test_the_engine_gathers_each_requests_pages_and_visible_rows(monkeypatch, seeds, causal):
    """The engine's paged path (page gathering through the table, the cut at the length,
    causal queries grouped by what they see, empty rows) on the host, with its GEMM
    attention swapped for float64 NumPy: it must equal the reference to float64 rounding
    (1e-12: the same sums in another order). NaN tails and unused pages poison any wrong
    gather."""
    import cupy

    from mlasandbox import cublas_engine

    monkeypatch.setattr(cupy, "asarray", np.asarray)
    monkeypatch.setattr(cublas_engine, "cublas_attention", _attention_f64)
    inp = make_paged_inputs(Dims(n_head=3), [0, 1, 40, 17, 2], s_q=3, page_size=16,
                            causal=causal, seed=seeds.one(), with_wv_b=False)
    lengths = inp.cache_seqlens
    latent = np.full((*inp.q.shape[:3], 512), np.nan)
    lse = np.full(inp.q.shape[:3], np.nan)
    cublas_engine.cublas_paged_attention(inp.q, inp.kv_cache, inp.block_table,
                                         pages_needed(lengths, 16),
                                         visible_lengths(lengths, 3, causal), inp.scale, "f16",
                                         latent, lse)
    ref = mla.reference.decode_paged(**inp.decode_args())
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref.lse)), seeds
    # 9 rows a request (3 tokens x 3 heads): request 0 is empty; under causal, tokens 0, 1
    # of the length-1 request and token 0 of the length-2 one see nothing too
    assert np.isneginf(lse).sum() == (9 + 6 + 3 if causal else 9)
    live = np.isfinite(ref.lse)
    np.testing.assert_allclose(latent[live], ref.latent[live], rtol=0, atol=1e-12)
    np.testing.assert_allclose(lse[live], ref.lse[live], rtol=0, atol=1e-12)
    assert not latent[~live].any()


# ---- exports -------------------------------------------------------------------------------
def test_the_package_exports_the_paged_api_and_its_reference(seeds):
    from mlasandbox import reference

    assert mla.decode_paged is paged_api.decode_paged
    assert mla.PagedDecodeStep is PagedDecodeStep
    inp = make_paged_inputs(Dims(n_head=3), [0, 7, 33], s_q=2, page_size=16, causal=True,
                            seed=seeds.one())
    got = mla.reference.decode_paged(**inp.decode_args())
    want = reference.decode_paged(**inp.decode_args())
    for f in ("latent", "lse", "out"):
        assert np.array_equal(getattr(got, f), getattr(want, f)), f


# ---- the whole step on a fake device ------------------------------------------------------
class HostArray(np.ndarray):
    """A NumPy array with CuPy's .get(), standing in for device buffers."""

    def get(self):
        return np.asarray(self).copy()


class FakeStream:
    def __init__(self, name, capturing=False):
        self.name, self.capturing, self.ptr, self.done = name, capturing, id(self), True

    def is_capturing(self):
        return self.capturing

    def synchronize(self):
        pass


class FakeKernel:
    def __init__(self, name, log, report=None):
        self.name, self.log, self.report = name, log, report

    def __call__(self, grid, block, args, shared_mem=0):
        self.log.append((self.name, grid, block, args, shared_mem))
        if self.report is not None:
            args[-1][...] = self.report


@pytest.fixture
def fake_device(monkeypatch):
    """Everything PagedDecodeStep touches on a device, on the host: kernels that record
    their launches, streams that say whether they capture, NumPy scratch."""
    import cupy

    from mlasandbox.kernels import DeviceInfo

    state = types.SimpleNamespace(log=[], report=[0, 0, 0, 0], current=FakeStream("caller"))

    def on(self, stream=None):
        class Ctx:
            def __enter__(self_):
                self_.prev, state.current = state.current, stream or state.current

            def __exit__(self_, *exc):
                state.current = self_.prev
        return Ctx()

    def instance(kind, heads=None, tile=0, threads=256, smem=0):
        name = f"{kind}<paged=true>"
        return types.SimpleNamespace(kind=kind, name=name, heads=heads, tile_rows=tile,
                                     threads=threads, smem_bytes=smem)

    monkeypatch.setattr(interop, "from_caller",
                        lambda arrs: (interop.Caller("cupy", 0), arrs))
    monkeypatch.setattr(interop.Caller, "on", on)
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda *a: state.current)
    monkeypatch.setattr(cupy.cuda, "Device", lambda *a: nullcontext())
    monkeypatch.setattr(cupy.cuda, "Stream", lambda **kw: FakeStream("capture"))
    monkeypatch.setattr(cupy, "empty", lambda shape, dtype: np.empty(shape, dtype))
    monkeypatch.setattr(cupy, "zeros", lambda n, dtype: np.zeros(n, dtype).view(HostArray))
    monkeypatch.setattr(paged_api, "check_device_array", lambda name, arr: None)
    monkeypatch.setattr(paged_api, "device_info", lambda dev: DeviceInfo(
        0, "Fake H200", "sm_90", 132, 50 << 20, 227 << 10, 228 << 10, 65535))
    monkeypatch.setattr(paged_api, "blocks_per_sm", lambda inst: 2)
    monkeypatch.setattr(paged_api, "scratch_for_device",
                        lambda dev, name, size, dtype="float32": np.zeros(size, dtype))
    monkeypatch.setattr(paged_api, "get_kernel", lambda inst: FakeKernel(
        inst.name, state.log, state.report if inst.name.startswith("check") else None))
    monkeypatch.setattr(registry, "paged_attention_instance", raising=False,
                        value=lambda var, cache, q: instance("attn", var.hpb, 64, 256, 1000))
    monkeypatch.setattr(registry, "paged_combine_instance", raising=False,
                        value=lambda cache, rescale, prefetch=8:
                        instance(f"combine{rescale}p{prefetch}"))
    monkeypatch.setattr(registry, "paged_check_instance", raising=False,
                        value=lambda: instance("check", threads=128))
    monkeypatch.setattr(registry, "project_instance", raising=False,
                        value=lambda cache, kind="project": instance(kind))
    monkeypatch.setattr(paged_api, "pdl_supported", lambda dev: False)

    def fake_capture(fn, stream):
        stream.capturing = True
        with interop.Caller("cupy", 0).on(stream):
            fn()
        stream.capturing = False
        return "graph"

    monkeypatch.setattr(paged_api, "capture_graph", fake_capture)
    return state


@pytest.mark.parametrize("family,writes", [("split", 1), ("batched", 1), ("mma", 1),
                                            ("wgmma", 1), ("user", 0)])
def test_the_merge_skips_one_chunk_requests_only_for_families_that_write_them(family, writes):
    # the built-in families write a one-chunk request's latent themselves; a user kernel may
    # write partials only, so its merge runs for every request, and never skips a launch
    step = _bare_step(family=family)
    assert int(step.combine_args()[7]) == writes and step.attn_writes_single == bool(writes)
    step.plan = types.SimpleNamespace(single_pass=True)
    assert step.single_pass == bool(writes)


def _host_step_inputs(seed, q_dtype="f32"):
    inp = make_paged_inputs(Dims(n_head=16), [0, 300, 1000], s_q=2, page_size=16, seed=seed,
                            q_dtype=q_dtype)
    args = inp.decode_args()
    for k in ("q", "kv_cache", "block_table", "cache_seqlens", "wv_b"):
        args[k] = args[k].view(HostArray)
    return inp, args


@pytest.mark.parametrize("fused,launches", [(None, 2), (True, 2), (False, 3)])
def test_a_small_batch_merges_and_projects_in_one_kernel(fake_device, seeds, fused, launches):
    # one request of 16 heads: 16 rows, the narrowest column blocks, where the one-kernel
    # combine is the default (None); True / False force a form
    inp = make_paged_inputs(Dims(n_head=16), [3000], page_size=16, seed=seeds.one())
    args = inp.decode_args()
    for k in ("q", "kv_cache", "block_table", "cache_seqlens", "wv_b"):
        args[k] = args[k].view(HostArray)
    step = PagedDecodeStep(**args, variant="mma16", splits=4, fused_combine=fused,
                           merge_in_attn=False)
    assert step.col_blocks == registry.COMBINE_COL_BLOCKS and not step.single_pass
    step.run()
    assert len(fake_device.log) == launches == len(step.launches())
    c_args = fake_device.log[1][3]
    projection = (c_args[8], c_args[10], c_args[13], c_args[14])  # wv_b, out, out_part, tickets
    if launches == 2:
        assert projection[0] is step.wv_b and projection[1] is step.out
        assert projection[2] is step.out_part and projection[3] is step.tickets
    else:
        assert all(int(a) == 0 for a in projection)  # null pointers: the projection's own launch
        assert fake_device.log[2][0] == "project<paged=true>"


def test_a_step_launches_attn_then_combine_with_its_plan(fake_device, seeds):
    inp, args = _host_step_inputs(seeds.one())
    step = PagedDecodeStep(**args, variant="mma16", splits=4, merge_in_attn=False)
    assert step.plan.grid[::2] == (2, 1) and step.plan.min_chunk == 64
    res = step.run()
    (a_name, a_grid, a_block, a_args, a_smem), (c_name, c_grid, c_block, c_args, _), \
        (p_name, p_grid, p_block, p_args, _) = fake_device.log
    assert (a_name, a_grid, a_block, a_smem) == ("attn<paged=true>", step.plan.grid, (256, 1, 1),
                                                 1000)
    assert len(a_args) == 23 and int(a_args[21]) == 0 and int(a_args[22]) == 1
    assert all(x is y or x == y for x, y in zip(a_args, step.attn_args()))
    # 96 rows, merge only: combine_col_blocks gives 4 (384 blocks >= 2 x 132 SMs), 1.45 waves
    # at the fake device's two blocks an SM, so the deep merge runs at 2 (192 blocks)
    assert c_name == "combineTruep16<paged=true>" and c_grid == (32, 2, 3)
    assert all(x is y or x == y for x, y in zip(c_args, step.combine_args()))
    assert p_name == "project<paged=true>" and p_grid == (16, 4, 1)  # 6 latent rows a head
    assert p_args[0] is step.latent and p_args[1] is step.wv_b and p_args[-1] is step.out
    assert res.latent.shape == (3, 2, 16, 512) and res.out.shape == (3, 2, 16, 128)
    assert [launch.grid for launch in step.launches()] == [step.plan.grid, c_grid, p_grid]
    assert not any(launch.pdl for launch in step.launches())  # the fake device has no PDL
    assert step.guard.polls == 3 and step.guard.captured == 0


@pytest.mark.parametrize("heads, s_q, kind, z", [
    # B = 20 requests: the projection's latent rows a head are B x s_q, never B alone
    (5, 2, "project", 2),          # 40 rows: 32-row tiles, two of them (B alone: one)
    (128, 4, "project_wide", 2),   # 80 rows: 64-row tiles over 128 heads fill the GPU
])
def test_the_projection_and_the_scratch_cover_every_query_row(fake_device, monkeypatch, seeds,
                                                              heads, s_q, kind, z):
    sizes = {}

    def scratch(dev, name, size, dtype="float32"):
        sizes[name] = size
        return np.zeros(size, dtype)

    monkeypatch.setattr(paged_api, "scratch_for_device", scratch)
    inp = make_paged_inputs(Dims(n_head=heads), [5] * 20, s_q=s_q, page_size=16,
                            seed=seeds.one())
    args = inp.decode_args()
    for k in ("q", "kv_cache", "block_table", "cache_seqlens", "wv_b"):
        args[k] = args[k].view(HostArray)
    step = PagedDecodeStep(**args, variant="mma16", splits=4, merge_in_attn=False)
    rows = 20 * s_q
    assert registry.project_kind(20, heads, 132) == "project"  # what B alone would pick
    assert step.project_inst.kind == kind
    assert step.project_grid == (heads, 128 // (128 if kind == "project_wide" else 32), z)
    assert step.project_grid == registry.project_grid(heads, 128, rows, kind)
    # a partial (m, l, acc) for every request, chunk slot and query row
    n = 20 * step.plan.max_chunks * s_q * heads
    assert step.plan.max_chunks >= 1 and sizes["part_m"] == sizes["part_l"] == n
    assert sizes["part_acc"] == n * 512 and sizes["chunk_counts"] == 20


def test_the_mma_kernel_merges_its_own_chunks_and_no_merge_is_launched(fake_device, seeds):
    inp, args = _host_step_inputs(seeds.one(), q_dtype="f16")
    step = PagedDecodeStep(**args, variant="mma16", splits=4)
    assert step.merges_in_attn and not step.launches_merge and step.projects_alone
    step.run()
    (a_name, _, _, a_args, _), (p_name, *_) = fake_device.log
    assert a_name == "attn<paged=true>" and p_name == "project<paged=true>"
    assert a_args[21] is step.attn_tickets and int(a_args[22]) == 1
    assert step.attn_tickets.size == 3 * step.plan.head_blocks  # a ticket a request, row block
    assert [ln.kernel for ln in step.launches()] == ["attn<paged=true>", "project<paged=true>"]
    broken = PagedDecodeStep(**args, variant="mma16", splits=4, rescale=False)
    assert int(broken.attn_launch_args()[22]) == 0  # the negative control's merge


@pytest.mark.parametrize("variant,splits,q,want", [
    ("mma16", 2, "f16", True), ("mma32", registry.ATTN_MERGE_MAX_CHUNKS, "f16", True),
    ("mma16", 4, "f32", False),                          # the f32-q kernels are built without
    ("mma16", 1, "f16", False),                          # a single pass: nothing to merge
    ("mma16", registry.ATTN_MERGE_MAX_CHUNKS + 1, "f16", False),  # one block would read too much
    ("split", 4, "f16", False), ("batched16", 4, "f16", False)])  # families that do not merge
def test_the_rule_for_the_kernels_own_merge(fake_device, seeds, variant, splits, q, want):
    _, args = _host_step_inputs(seeds.one(), q_dtype=q)
    assert PagedDecodeStep(**args, variant=variant, splits=splits).merges_in_attn == want
    assert not PagedDecodeStep(**args, variant=variant, splits=splits,
                               merge_in_attn=False).merges_in_attn
    if not want:
        with pytest.raises(ValueError, match="merge_in_attn=True needs"):
            PagedDecodeStep(**args, variant=variant, splits=splits, merge_in_attn=True)


def test_decode_paged_checks_indices_first_and_raises_in_the_host_words(fake_device, seeds):
    inp, args = _host_step_inputs(seeds.one())
    args["block_table"][2, 5] = 10_000
    fake_device.report = [2, 2, 5, 10_000]
    with pytest.raises(ValueError, match=r"block_table\[2, 5\] = 10000.*request 2"):
        mla.decode_paged(**args)
    assert [entry[0] for entry in fake_device.log] == ["check<paged=true>"]
    (_, grid, block, check_args, _), = fake_device.log
    assert grid == (3, 1, 1) and block == (128, 1, 1)
    assert [int(x) for x in check_args[2:6]] == [3, 63, 16, inp.kv_cache.shape[0]]


def test_capture_runs_the_phases_once_on_its_own_stream(fake_device, seeds):
    _, args = _host_step_inputs(seeds.one())
    step = PagedDecodeStep(**args, variant="split")
    captured = step.capture()
    assert captured.graph == "graph" and captured.step is step
    assert step.guard.captured == 3 and step.guard.polls == 0  # attn, merge, projection
    assert step.graph_stream.name == "capture" and step.launch_stream().name == "caller"
    with pytest.raises(RuntimeError, match="cannot run inside a CUDA-graph capture"):
        fake_device.current.capturing = True
        step.check_indices()


def test_a_captured_graph_keeps_its_step_alive(fake_device, seeds):
    """The graph's kernels write the step's own buffers (latent, lse, partials, tickets): a
    graph that outlived its step would replay into freed memory. The StepGraph holds the
    step until the graph itself goes; the negative control, the bare graph alone, does not."""
    import gc
    import weakref

    _, args = _host_step_inputs(seeds.one())
    step = PagedDecodeStep(**args, variant="split")
    captured = step.capture()
    bare = captured.graph
    alive = weakref.ref(step)
    del step
    gc.collect()
    assert alive() is not None, "the captured graph let its step be collected"
    del captured
    gc.collect()
    assert alive() is None, "the step outlived its graph: the check above cannot fail"
    assert bare == "graph"


def test_the_cublas_engine_refuses_to_run_inside_a_capture(fake_device, seeds):
    _, args = _host_step_inputs(seeds.one())
    step = PagedDecodeStep(**args, variant="cublas")
    assert step.launches() == [] and step.plan is None
    with pytest.raises(ValueError, match="cublas cannot be captured"):
        step.capture()
    fake_device.current.capturing = True
    with pytest.raises(ValueError, match="cublas cannot be captured"):
        step.run_attn()


class _SinglePass:
    """A chunk plan that says the attention kernel wrote the latent itself."""

    single_pass = True

    def __init__(self, plan):
        self._plan = plan

    def __getattr__(self, name):
        return getattr(self._plan, name)


@pytest.mark.parametrize("with_wv_b", [True, False])
def test_a_single_pass_plan_skips_the_merge_and_keeps_the_projection(fake_device, seeds,
                                                                    with_wv_b):
    _, args = _host_step_inputs(seeds.one())
    if not with_wv_b:
        args["wv_b"] = None
    step = PagedDecodeStep(**args, variant="mma16", splits=4)
    step.plan = _SinglePass(step.plan)
    step.run()
    names = [entry[0] for entry in fake_device.log]
    want = ["attn<paged=true>"] + (["project<paged=true>"] if with_wv_b else [])
    assert names == want and [ln.kernel for ln in step.launches()] == want


@pytest.mark.parametrize("splits,partials", [(1, False), (4, True)])
def test_a_single_pass_wgmma_step_runs_the_instance_that_skips_the_partials(
        fake_device, monkeypatch, seeds, splits, partials):
    # one chunk a request (splits=1): no merge reads the partials, so the step compiles the
    # wgmma instance that does not write them; a plan of several chunk slots keeps them
    monkeypatch.setattr(registry, "paged_attention_instance",
                        lambda var, cache, q: registry.wgmma_instance(cache, q))
    inp = make_paged_inputs(Dims(n_head=16), [0, 300, 1000], page_size=16, q_dtype="f16",
                            seed=seeds.one())
    args = inp.decode_args()
    for k in ("q", "kv_cache", "block_table", "cache_seqlens", "wv_b"):
        args[k] = args[k].view(HostArray)
    step = PagedDecodeStep(**args, variant="wgmma64", splits=splits)
    assert step.plan.single_pass == (not partials) == step.single_pass
    assert step.attn_inst == registry.wgmma_instance("f16", "f16", partials=partials)
    step.run()
    assert fake_device.log[0][0] == step.attn_inst.name
    assert ("partials=false" in fake_device.log[0][0]) == (not partials)


def test_a_plan_past_the_grids_y_limit_is_refused_naming_it(fake_device, monkeypatch, seeds):
    from mlasandbox.kernels import DeviceInfo

    inp, args = _host_step_inputs(seeds.one())
    step = PagedDecodeStep(**args, variant="mma16", splits=4, merge_in_attn=False)
    programs = step.plan.programs_per_block
    for limit, refused in ((programs, False), (programs - 1, True)):
        monkeypatch.setattr(paged_api, "device_info", lambda dev, lim=limit: DeviceInfo(
            0, "Fake H200", "sm_90", 132, 50 << 20, 227 << 10, 228 << 10, lim))
        if refused:
            with pytest.raises(ValueError, match=f"{programs} chunk programs a row block exceed "
                                                 f"the grid's y limit {limit} on Fake H200"):
                PagedDecodeStep(**args, variant="mma16", splits=4, merge_in_attn=False)
        else:
            PagedDecodeStep(**args, variant="mma16", splits=4, merge_in_attn=False)


# ---- the plans made without a step: each the plan of the step its run builds --------------
# The plan's facts a site reports (where it reports them: the sweep has no min_chunk); grid
# and head_blocks follow from the rest, max_chunks is what the one-pass rule moves.
PLAN_KEYS = ("max_chunks", "min_chunk", "tile", "target", "grid", "head_blocks")


def _step_plan(lengths, page_size, inst, heads=16, extra_pages=0):
    """plan_for over the table make_paged_inputs builds for `lengths` (one page wider with
    extra_pages=1: the negative control), at 132 SMs and one block an SM."""
    dims = mla.PRESETS["dsv3"].with_heads(heads)
    inp = make_paged_inputs(dims, lengths, page_size=page_size, cache_dtype="f16")
    table = np.zeros((len(lengths), inp.block_table.shape[1] + extra_pages), np.int32)
    shape = check_paged_inputs(inp.q, inp.kv_cache, table, inp.cache_seqlens)[0]
    return plan_for(shape, inst, num_sms=132, blocks_per_sm=1)


def _site_plans(lengths, page_size):
    """{site: (the plan it reports, the instance it planned for)} of the four places that
    plan a paged step from lengths and a page size: bench, sweep, repro, a user kernel's."""
    spec = ",".join(map(str, lengths))
    mma16 = registry.paged_attention_instance(paged_variant("mma16", 1, 16), "f16", "f32")
    cfg = make_paged_config(batch=len(lengths), lengths=spec, heads=16, page_size=page_size,
                            variants=["mma16"], q_dtype="f32")
    (bench,) = plan_report(cfg, num_sms=132, blocks_per_sm=1)["plans"]
    repro = make_paged_case("mma16", batch=len(lengths), lengths=spec, page_size=page_size,
                            heads=16, num_sms=132, blocks_per_sm=1).plan
    kernel = user_kernel.load_kernel(str(Path(__file__).parent / "data" / "byok_warp_rows.cu"))
    user = make_user_case(kernel, batch=len(lengths), lengths=spec, page_size=page_size,
                          heads=16, num_sms=132, blocks_per_sm=1).plan
    return {"bench": (bench, mma16), "sweep": (_plan_row(cfg, mma16, 1, 132), mma16),
            "repro": (repro, mma16), "user": (user, kernel.instance("f16", "f32"))}


def _agrees(site_plan: dict, plan) -> bool:
    keys = [k for k in PLAN_KEYS if k in site_plan]
    assert "max_chunks" in keys, site_plan
    return all(tuple(np.atleast_1d(site_plan[k])) == tuple(np.atleast_1d(getattr(plan, k)))
               for k in keys)


@pytest.mark.parametrize("lengths,page_size", [((64,), 64), ((64,), 16), ((65,), 64),
                                               ((0, 1, 63, 4097), 16), ((3000, 200, 0, 700), 64),
                                               ((20,), 1)])
def test_each_site_plans_the_step_its_run_builds(lengths, page_size):
    # bench, sweep, repro and the user repro each plan without a step in hand
    # (plan_for_lengths); the step make_paged_inputs' table feeds plans with plan_for. A
    # site planning for another table width drifts at one chunk (one pass or not).
    for site, (got, inst) in _site_plans(lengths, page_size).items():
        want = _step_plan(lengths, page_size, inst)
        assert _agrees(got, want), (site, got, want)
        # negative control: one page wider, a table of 64 positions holds two 64-row tiles
        # and leaves the one-pass plan; the comparison must tell that plan from the site's
        wider = _step_plan(lengths, page_size, inst, extra_pages=1)
        moved = any(getattr(wider, k) != getattr(want, k) for k in PLAN_KEYS)
        assert moved == (lengths == (64,) and inst.tile_rows == 64), (site, wider, want)
        assert not moved or not _agrees(got, wider), (site, got, wider)
