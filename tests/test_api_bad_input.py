"""Bad input to the library's planning and reference functions: ValueError (TypeError for a
wrong type) naming the parameter and the limit, never an arithmetic error or a quiet answer;
the valid edge cases beside each (NumPy integers, empty requests) keep their answers."""
from __future__ import annotations

import numpy as np
import pytest

from mlasandbox import reference
from mlasandbox.chunks import (batch_chunk_unit, chunk_bounds, plan_chunks, request_chunks,
                               single_request_unit, two_waves)
from mlasandbox.dims import Dims
from mlasandbox.inputs import make_inputs
from mlasandbox.limits import INT32_MAX, check_int_array
from mlasandbox.paged_inputs import make_paged_inputs
from mlasandbox.splits import plan_splits, slice_bounds

INT32 = f"{INT32_MAX:,}"

# ---------------------------------------------------------------- slices and chunks (C15)


@pytest.mark.parametrize("args, match", [
    ((100, 4, -1), "s must be an integer >= 0, got -1"),
    ((100, 4, 1.5), "s must be an integer >= 0, got 1.5"),
    ((-5, 4, 0), "n_ctx must be an integer >= 1, got -5"),
    ((0, 4, 0), "n_ctx must be an integer >= 1, got 0"),
    (("100", 4, 0), "n_ctx must be an integer >= 1, got '100'"),
    ((100, 0, 0), "splits must be an integer >= 1, got 0"),
    ((2**31, 1, 0), "n_ctx must be <= 2,147,418,113 .*int32"),
    ((2_147_418_114, 1, 0), "n_ctx must be <= 2,147,418,113 .*int32"),   # MAX_CTX + 1
    ((100, 65536, 0), "splits must be <= 65,535 .*grid"),
])
def test_slice_bounds_names_the_bad_argument(args, match):
    with pytest.raises(ValueError, match=match):
        slice_bounds(*args)


def test_slice_bounds_takes_numpy_integers_and_empty_slices():
    assert slice_bounds(np.int64(100), np.int32(4), np.int64(3)) == (75, 100)
    assert slice_bounds(100, 4.0, 1) == (25, 50)        # a whole float, as before
    assert slice_bounds(100, 4, 10) == (100, 100)        # past the last slice: empty
    assert slice_bounds(10, 16, 12) == (10, 10)          # S > n_ctx: empty slices


@pytest.mark.parametrize("call, match", [
    (lambda: chunk_bounds(-5, 32, 0), "length must be an integer >= 0, got -5"),
    (lambda: chunk_bounds(2**31, 32, 0), f"length must be <= {INT32} .*int32"),
    (lambda: chunk_bounds(100, 32, 1.5), "c must be an integer >= 0, got 1.5"),
    (lambda: chunk_bounds(100, 0, 0), "chunk_len must be an integer >= 1, got 0"),
    (lambda: single_request_unit(-5, 32, 32, 8), "length must be an integer >= 0, got -5"),
    (lambda: single_request_unit(1.5, 32, 32, 8), "length must be an integer >= 0, got 1.5"),
    (lambda: single_request_unit(100, 32, 0, 8), "min_chunk must be an integer >= 32, got 0"),
    (lambda: single_request_unit(100, 32, 32, 0), "target must be an integer >= 1, got 0"),
])
def test_chunk_bounds_and_the_closed_form_name_the_bad_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_chunk_bounds_and_the_closed_form_take_numpy_integers_and_empty_requests():
    assert chunk_bounds(np.int64(100), np.int32(32), np.int64(3)) == (96, 100)
    assert chunk_bounds(0, 32, 0) == (0, 0)
    assert chunk_bounds(100, 32, 7) == (100, 100)        # past the last chunk: empty
    assert single_request_unit(np.int64(0), np.int32(64), 64, 132) == 1
    assert single_request_unit(np.int32(4097), 64, 128, np.int64(132)) == 2


# ------------------------------------------------------------ the chunk rule's lengths (C16)

BAD_LENGTHS = [
    ([1.7], "lengths must be an integer >= 0, got 1.7"),
    ([[1, 2], [3, 4]], r"lengths must be a 1-D list .*shape \(2, 2\)"),
    ([], r"lengths must be a 1-D list of at least one integer, got shape \(0,\)"),
    (["x"], "lengths must hold integers, got 'x'"),
    ([True, False], "lengths must hold integers, got True"),
    ([2**70], f"lengths must be <= {INT32} .*int32"),
    ([2**40], f"lengths must be <= {INT32} .*int32"),
    ([5, -1], "lengths must be >= 0, got -1"),
    (np.array([2**63], dtype=np.uint64), f"lengths must be <= {INT32}"),
    ([[1], [1, 2]], "lengths must be a 1-D list of at least one integer: "),
]
RULES = {
    "request_chunks": lambda lengths, **kw: request_chunks(lengths, 4, 32, 32, 8, **kw),
    "batch_chunk_unit": lambda lengths, **kw: batch_chunk_unit(lengths, 4, 32, 32, 8, **kw),
    "two_waves": lambda lengths, **kw: two_waves(lengths, 4, 32, 32, 8, **{"programs": 16,
                                                                           **kw}),
}


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("lengths, match", BAD_LENGTHS, ids=lambda v: repr(v)[:20])
def test_the_rule_names_bad_lengths(rule, lengths, match):
    with pytest.raises(ValueError, match=match):
        RULES[rule](lengths)


@pytest.mark.parametrize("lengths, match", [
    ([1.7, 2, 3, 4], "lengths must be an integer >= 0, got 1.7"),
    ([[1, 2], [3, 4]], r"lengths must be a 1-D list .*shape \(2, 2\)"),
    ([2**70, 2, 3, 4], f"lengths must be <= {INT32}"),
    (["x", 2, 3, 4], "lengths must hold integers, got 'x'"),
    ([1, 2, 3], "the plan is for a batch of 4, got 3 lengths"),
])
def test_a_plan_names_bad_lengths(lengths, match):
    plan = plan_chunks(4, 8, num_sms=132, blocks_per_sm=2, tile=32)
    for call in (plan.for_lengths, plan.waves_taken, plan.program_chunks):
        with pytest.raises(ValueError, match=match):
            call(lengths)


@pytest.mark.parametrize("args, kw, match", [
    # min_chunk below one tile made the unit 0 tiles: a division by zero on empty requests
    (([0, 0], 4, 32, 0, 8), {}, "min_chunk must be an integer >= 32, got 0"),
    (([100], 4, 32, -32, 8), {}, "min_chunk must be an integer >= 32, got -32"),
    (([100], 4, 32, 16, 8), {}, "min_chunk must be an integer >= 32, got 16"),
    (([100], 0, 32, 32, 8), {}, "max_chunks must be an integer >= 1, got 0"),
    (([100], 2**70, 32, 32, 8), {}, f"max_chunks must be <= {INT32} .*int32"),
    (([100], 4, 0, 32, 8), {}, "tile must be an integer >= 1, got 0"),
    (([100], 4, 32, 32, 0), {}, "target must be an integer >= 1, got 0"),
    (([100], 4, 32, 32, 2**40), {}, f"target must be <= {INT32}"),
    (([100], 4, 32, 32, 8), {"programs": -1}, "programs must be an integer >= 0, got -1"),
])
def test_the_rule_names_bad_sizes(args, kw, match):
    with pytest.raises(ValueError, match=match):
        request_chunks(*args, **kw)
    if not kw:
        with pytest.raises(ValueError, match=match):
            batch_chunk_unit(*args)
    with pytest.raises(ValueError, match=match):
        two_waves(*args, programs=kw.get("programs", 16))


def test_the_rule_takes_numpy_integers_whole_floats_and_empty_requests():
    want_n, want_len = request_chunks([0, 100, 5000, 0], 4, 32, 32, 8)
    for lengths in (np.array([0, 100, 5000, 0], np.int32), np.array([0, 100, 5000, 0], np.uint64),
                    [np.int64(0), np.int32(100), 5000, 0], [0.0, 100.0, 5000.0, 0.0]):
        n, clen = request_chunks(lengths, np.int64(4), np.int32(32), np.int64(32), np.int32(8))
        assert n.tolist() == want_n.tolist() and clen.tolist() == want_len.tolist()
    n, clen = request_chunks([0, 0], 4, 32, 32, 8)        # every request empty
    assert n.tolist() == [0, 0] and clen.tolist() == [32, 32]
    assert batch_chunk_unit([0, 0], 4, 32, 32, 8) == 1
    plan = plan_chunks(4, 8, num_sms=132, blocks_per_sm=2, tile=32)
    n, _ = plan.for_lengths(np.array([0, 100, 5000, 0], np.int32))
    assert n[0] == n[3] == 0 and n[1] >= 1 and n[2] >= 1


def test_int_array_check_keeps_python_integers_exact():
    # past int64 a NumPy conversion would raise OverflowError: the limit is named instead
    with pytest.raises(ValueError, match=r"sizes must be <= 10 \(why\), got 1,180,"):
        check_int_array("sizes", [1, 2**70], 0, 10, "why")
    assert check_int_array("sizes", (3, 4.0), 0, 10, "why").dtype == np.int64


# ------------------------------------------------------------ the split plan's options (C17)

PLAN = dict(num_sms=132, blocks_per_sm=2)


@pytest.mark.parametrize("kw, exc, match", [
    ({"min_ctx": "x"}, ValueError, "min_ctx must be an integer >= 0, got 'x'"),
    ({"min_ctx": 1.5}, ValueError, "min_ctx must be an integer >= 0, got 1.5"),
    ({"min_ctx": -5}, ValueError, "min_ctx must be an integer >= 0, got -5"),
    ({"split": "no"}, TypeError, "split must be True or False, got 'no'"),
    ({"split": 0}, TypeError, "split must be True or False, got 0"),
])
def test_plan_splits_names_a_bad_gate_or_flag(kw, exc, match):
    with pytest.raises(exc, match=match):
        plan_splits(8192, 16, 1, **PLAN, **kw)


def test_plan_splits_takes_numpy_gates_and_flags():
    assert plan_splits(4095, 96, 16, **PLAN, min_ctx=np.int64(4096)).splits == 1
    assert plan_splits(8192, 16, 1, **PLAN, min_ctx=0).splits > 1
    assert plan_splits(8192, 16, 1, **PLAN, split=np.bool_(False)).splits == 1


# ----------------------------------------------------------------- the references (C17)

@pytest.fixture
def paged():
    return make_paged_inputs(Dims(n_head=2), [20, 0], page_size=16, seed=1).decode_args()


@pytest.mark.parametrize("scale", ["0.1", True, np.array([0.1, 0.2]), 1j])
def test_decode_paged_takes_scale_as_decode_does(paged, scale):
    with pytest.raises(TypeError, match=r"scale must be a real number, got .* \(not a bool or text\)"):
        reference.decode_paged(**{**paged, "scale": scale})
    args = make_inputs(Dims(n_head=2), 20, seed=1).decode_args()
    with pytest.raises(TypeError, match="scale must be a real number"):
        reference.decode(**{**args, "scale": scale})


def test_decode_paged_takes_a_numpy_scale(paged):
    got = reference.decode_paged(**{**paged, "scale": np.float64(0.25)})
    want = reference.decode_paged(**{**paged, "scale": 0.25})
    np.testing.assert_array_equal(got.lse, want.lse)


def test_the_references_refuse_a_wv_b_of_no_columns(paged):
    with pytest.raises(ValueError, match=r"wv_b must be \[n_head, v_head >= 1, kv_lora\], "
                                         r"got \(2, 0, 512\)"):
        reference.decode_paged(**{**paged, "wv_b": paged["wv_b"][:, :0]})
    assert reference.decode_paged(**{**paged, "wv_b": None}).out is None
    args = make_inputs(Dims(n_head=2), 20, seed=1).decode_args()
    with pytest.raises(ValueError, match=r"v_head >= 1"):
        reference.decode(**{**args, "wv_b": args["wv_b"][:, :0]})


# ---------------------------------------------------------------- the public API's arguments

def _paged_args(**kw):
    return make_paged_inputs(Dims(n_head=2), [5, 70], page_size=16, seed=1, **kw).decode_args()


@pytest.mark.parametrize("hpb", [16.0, np.float64(8), True, np.bool_(True)])
def test_heads_per_block_is_a_whole_number(hpb):
    # 16.0 == 16 passes a test against the ladder, then names the registry key batched16.0
    from mlasandbox import registry

    with pytest.raises(TypeError, match=r"heads_per_block must be an integer, one of 1, 2, "):
        registry.resolve_variant("batched", hpb)
    assert registry.resolve_variant("batched", np.int64(8)).name == "batched8"


@pytest.mark.parametrize("name", [["split"], {}, None, 3])
def test_a_variant_is_named_by_a_string(name):
    from mlasandbox import registry

    with pytest.raises(TypeError, match="variant must be a name"):
        registry.resolve_variant(name)


def test_a_scale_past_float32_is_refused_where_the_kernels_would_take_inf():
    # the kernels take scale x log2(e) in float32: 1e39 is finite in float64, inf there
    from mlasandbox.limits import MAX_SCALE

    args = make_inputs(Dims(n_head=2), 20, seed=1).decode_args()
    for decode, a in ((reference.decode, args), (reference.decode_paged, _paged_args())):
        for bad in (1e39, -1e39, MAX_SCALE * 1.0001):
            with pytest.raises(ValueError, match=r"scale must be at most 2\.35\d+e\+38 in "
                                                 r"magnitude .*float32"):
                decode(**{**a, "scale": bad})
        decode(**{**a, "scale": MAX_SCALE / 1e30})   # large but representable
    assert np.isfinite(np.float32(MAX_SCALE * 1.4426950408889634))


@pytest.mark.parametrize("flag", ["check_indices", "causal"])
@pytest.mark.parametrize("bad", ["no", 2, None])
def test_decode_paged_flags_are_bools(flag, bad):
    # bool("no") is True: a flag given as text or a number is refused, before any device
    import mlasandbox as mla

    with pytest.raises(TypeError, match=f"{flag} must be True or False"):
        mla.decode_paged(**{**_paged_args(), flag: bad})


@pytest.mark.parametrize("flag", ["sync_check", "rescale", "pdl", "fused_combine",
                                  "merge_in_attn"])
def test_step_flags_are_bools(flag):
    import mlasandbox as mla

    with pytest.raises(TypeError, match=f"{flag} must be True or False, got 'no'"):
        mla.PagedDecodeStep(**_paged_args(), **{flag: "no"})
    if flag != "merge_in_attn":
        args = make_inputs(Dims(n_head=2), 20, seed=1).decode_args()
        with pytest.raises(TypeError, match=f"{flag} must be True or False, got 'no'"):
            mla.api.DecodeStep(**args, **{flag: "no"})


def test_the_paged_reference_is_refused_past_host_memory(monkeypatch):
    from mlasandbox import limits

    args = _paged_args()
    monkeypatch.setattr(limits, "host_memory_bytes", lambda: 1 << 20)
    # 70 rows x (12 x 576 + 24 x 2) B plus 2 x 2 x (576 + 512 + 128) x 8 B: 526 KB, fits
    reference.decode_paged(**args)
    monkeypatch.setattr(limits, "host_memory_bytes", lambda: 1 << 18)
    with pytest.raises(ValueError, match=r"the float64 paged reference of cache_seqlens up to "
                                         r"70 with s_q 1 x 2 heads and batch 2 needs about "
                                         r"0\.0 GiB of host memory; this machine has 0\.0 GiB"):
        reference.decode_paged(**args)


def test_the_schedule_models_check_their_arguments(monkeypatch):
    from mlasandbox import limits
    from mlasandbox.schedule import run_schedule
    from mlasandbox.schedule_paged import run_paged_schedule

    args = make_inputs(Dims(n_head=3), 100, seed=1).decode_args()
    for kw, exc, match in (
            (dict(splits="a", schedule="split"), ValueError, "splits must be an integer >= 1"),
            (dict(splits=float("nan"), schedule="split"), ValueError, "splits must be"),
            (dict(splits=70000, schedule="split"), ValueError, "splits must be <= 65,535"),
            (dict(schedule="batched", heads_per_block=10**9), ValueError,
             "heads_per_block must be <= 64"),
            (dict(lazy="a"), TypeError, "lazy must be a real number"),
            (dict(rescale="no"), TypeError, "rescale must be True or False")):
        with pytest.raises(exc, match=match):
            run_schedule(**args, **kw)
    assert run_schedule(**args, schedule="split", splits=2.0).latent.shape == (3, 512)
    monkeypatch.setattr(limits, "host_memory_bytes", lambda: 1 << 10)
    with pytest.raises(ValueError, match="needs about .* for the schedule model"):
        run_schedule(**args)
    monkeypatch.undo()
    paged = _paged_args()
    with pytest.raises(TypeError, match="plan must be a ChunkPlan"):
        run_paged_schedule(**paged, plan=None)
    plan = plan_chunks(2, 1, num_sms=132, blocks_per_sm=2, tile=64)
    with pytest.raises(TypeError, match="rescale must be True or False"):
        run_paged_schedule(**paged, plan=plan, rescale=2)
    monkeypatch.setattr(limits, "host_memory_bytes", lambda: 1 << 10)
    with pytest.raises(ValueError, match="the paged schedule model of .* needs about"):
        run_paged_schedule(**paged, plan=plan)


@pytest.mark.parametrize("kw, exc, match", [
    (dict(nope=-64), ValueError, "Dims.nope must be >= 1, got -64"),
    (dict(kv_lora=0), ValueError, "Dims.kv_lora must be >= 1"),
    (dict(rope=-1), ValueError, "Dims.rope must be >= 0"),
    (dict(n_head=1.5), TypeError, "Dims.n_head must be an integer, got 1.5"),
    (dict(n_head=True), TypeError, "Dims.n_head must be an integer, got True"),
    (dict(n_head=2**31), ValueError, "Dims.n_head must be <= 2,147,483,583"),
])
def test_dims_are_whole_widths(kw, exc, match):
    with pytest.raises(exc, match=match):
        Dims(**kw)


def test_dims_and_presets_keep_their_valid_forms():
    from mlasandbox.dims import preset

    d = Dims(n_head=np.int64(4), rope=0)
    assert d.n_head == 4 and type(d.n_head) is int and d.key_dim == 512
    assert Dims(n_head=3).with_heads(np.int32(5)).n_head == 5
    with pytest.raises(TypeError, match="Dims.n_head must be an integer"):
        Dims(n_head=3).with_heads(2.5)
    with pytest.raises(TypeError, match="a preset is a name"):
        preset([])


def test_a_length_list_with_a_bool_is_refused():
    # NumPy takes [True, 0] as the integers [1, 0]
    plan = plan_chunks(4, 6, num_sms=132, blocks_per_sm=2, tile=64)
    with pytest.raises(ValueError, match=r"lengths must hold integers, got True \(a bool\)"):
        plan.for_lengths([True, 0, 0, 0])
    with pytest.raises(ValueError, match="must hold integers, got np.True_"):
        check_int_array("lengths", (np.bool_(True), 2), 0, 10, "")
    assert list(plan.for_lengths([1, 0, 0, 0])[0]) == [1, 0, 0, 0]


@pytest.mark.parametrize("kw, match", [
    (dict(cap=2**40), "cap must be <= 65,535"),
    (dict(num_sms=2**40), "num_sms must be <= 65,535"),
    (dict(n_head=2**40), "n_head must be <= 2,147,483,583"),
    (dict(heads_per_block=2**40), "heads_per_block must be <= 64"),
])
def test_the_split_rule_bounds_what_it_loops_over(kw, match):
    # cap=2**40 looped 2e9 times and built a dict of that size
    args = dict(n_ctx=10**8, n_head=16, heads_per_block=1, num_sms=132, blocks_per_sm=2)
    with pytest.raises(ValueError, match=match):
        plan_splits(**{**args, **kw})
    assert plan_splits(**args, cap=65535).splits >= 1


def test_paged_inputs_take_whole_numbers_and_one_length_a_request():
    from mlasandbox.paged_api import check_page_size
    from mlasandbox.paged_inputs import parse_lengths

    inp = make_paged_inputs(Dims(n_head=2), [5], page_size=16.0, s_q=2.0)
    assert inp.q.shape == (1, 2, 2, 576) and inp.kv_cache.shape[1] == 16
    with pytest.raises(ValueError, match=r"lengths must be a 1-D list .* shape \(2, 2\)"):
        make_paged_inputs(Dims(n_head=2), [[1, 2], [3, 4]])
    with pytest.raises(ValueError, match="batch must be <= 65,535"):
        parse_lengths(5, 10**12)
    for bad in (16.0, True):
        with pytest.raises(TypeError, match="page_size must be an integer, one of 1, 16, 64"):
            check_page_size(bad)
    assert check_page_size(np.int64(64)) == 6


def test_device_info_without_a_device_says_so():
    from gpu_support import HAVE_GPU

    from mlasandbox.kernels import device_info
    from mlasandbox.toolkit import NoDeviceError

    if HAVE_GPU:
        assert device_info().num_sms > 0
        return
    with pytest.raises(NoDeviceError, match="no CUDA device"):
        device_info()
