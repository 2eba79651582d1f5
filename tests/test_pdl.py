"""Programmatic dependent launch on the CPU: the hand-laid cuda.h structures, the argument
marshalling, and the small phases' launch rules (registry.combine_col_blocks, project_grid,
q_absorb_grid). On the device: tests/test_gpu_phases.py."""
from __future__ import annotations

import ctypes
import re
from pathlib import Path

import numpy as np
import pytest

from mlasandbox import pdl, registry
from mlasandbox.toolkit import cuda_include_dirs


def _cuda_h() -> str | None:
    """cuda.h from the include directories the compiles use, where one has it (the runtime
    wheel carries only the runtime headers)."""
    try:
        dirs = cuda_include_dirs()
    except Exception:
        return None
    for d in dirs:
        path = Path(d) / "cuda.h"
        if path.is_file():
            return path.read_text()
    return None


def test_the_structures_have_cuda_h_layout():
    # CUlaunchAttribute: int id, 4 pad bytes, a 64-byte union (8-aligned): 72 bytes
    assert ctypes.sizeof(pdl.LaunchAttribute) == 72
    assert pdl.LaunchAttribute.value.offset == 8
    # CUlaunchConfig: 7 uints, the stream at 32 (8-aligned), attrs at 40, numAttrs at 48
    assert ctypes.sizeof(pdl.LaunchConfig) == 56
    assert pdl.LaunchConfig.hStream.offset == 32
    assert pdl.LaunchConfig.attrs.offset == 40 and pdl.LaunchConfig.numAttrs.offset == 48


def test_the_attribute_id_is_cuda_h_s():
    text = _cuda_h()
    if text is None:
        pytest.skip("no cuda.h among the CUDA headers found (mlasandbox.toolkit)")
    m = re.search(r"CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION\s*=\s*(\d+)", text)
    assert m and int(m.group(1)) == pdl.PROGRAMMATIC_STREAM_SERIALIZATION
    fields = re.search(r"typedef struct CUlaunchConfig_st \{(.*?)\} CUlaunchConfig;", text,
                       re.S).group(1)
    names = re.findall(r"(\w+);", re.sub(r"/\*.*?\*/", "", fields, flags=re.S))
    assert names == [f[0] for f in pdl.LaunchConfig._fields_]


class _Arr:
    """A stand-in device array: what kernel_params reads of a CuPy array."""

    def __init__(self, ptr):
        self.data = type("Mem", (), {"ptr": ptr})()


def test_kernel_params_point_at_each_argument_at_its_width():
    args = (_Arr(0x7F0000001000), np.int32(-3), np.float32(1.5), np.uint64(0), np.uint32(7))
    params, keep = pdl.kernel_params(args)
    read = [ctypes.c_uint64, ctypes.c_int32, ctypes.c_float, ctypes.c_uint64, ctypes.c_uint32]
    got = [ctypes.cast(params[i], ctypes.POINTER(t)).contents.value for i, t in enumerate(read)]
    assert got == [0x7F0000001000, -3, 1.5, 0, 7]
    assert len(keep) == len(args)


@pytest.mark.parametrize("bad", [3, 2.0, "x", np.float16(1)])
def test_kernel_params_refuse_what_the_kernels_do_not_take(bad):
    with pytest.raises(TypeError, match="kernel argument 1"):
        pdl.kernel_params((np.int32(1), bad))


def test_a_launch_config_carries_the_attribute_only_when_asked():
    cfg, attrs = pdl.launch_config((3, 4, 5), (256, 1, 1), 1024, 0x1234, True)
    assert (cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ, cfg.blockDimX) == (3, 4, 5, 256)
    assert cfg.sharedMemBytes == 1024 and cfg.hStream == 0x1234 and cfg.numAttrs == 1
    assert attrs[0].id == 6 and attrs[0].value.as_int == 1
    plain, _ = pdl.launch_config((7,), (32,), 0, 0, False)
    assert plain.numAttrs == 0 and plain.hStream is None  # the legacy stream is NULL
    assert (plain.gridDimX, plain.gridDimY, plain.gridDimZ, plain.blockDimZ) == (7, 1, 1, 1)


@pytest.mark.parametrize("rows,sms,want", [(16, 132, 16), (128, 132, 4), (2048, 132, 1),
                                           (96, 132, 4), (1, 132, 16), (264, 132, 1)])
def test_the_merge_takes_the_fewest_column_blocks_that_give_two_per_sm(rows, sms, want):
    cb = registry.combine_col_blocks(rows, sms)
    assert cb == want
    assert cb == registry.COMBINE_COL_BLOCKS or rows * cb >= 2 * sms
    assert cb == 1 or rows * (cb // 2) < 2 * sms  # one fewer halving would not do


DEEP, PLAIN = registry.COMBINE_DEEP_PREFETCH, registry.COMBINE_PREFETCH


@pytest.mark.parametrize("rows, per_sm, deep_per_sm, want", [
    (128, 3, 2, (2, DEEP)),    # batch 1 x 128 heads: 512 blocks at three an SM, 1.29 waves
    (64, 3, 2, (4, DEEP)),     # x 64 heads: the same
    (256, 3, 2, (1, DEEP)),    # B = 2 x 128 heads: 2 column blocks -> 1
    (96, 3, 2, (4, PLAIN)),    # 384 blocks: one wave at three an SM already
    (16, 3, 2, (16, PLAIN)),   # half would leave SMs without a block (128 < 132)
    (396, 3, 2, (1, PLAIN)),   # one column block, one wave
    (128, 4, 2, (4, PLAIN)),   # a merge of four blocks an SM: 512 is one wave
    (128, 3, 1, (4, PLAIN)),   # a deep merge of one block an SM: 256 would be two waves
])
def test_the_deep_merge_runs_where_half_the_column_blocks_make_one_wave(rows, per_sm,
                                                                         deep_per_sm, want):
    assert registry.merge_form(rows, 132, per_sm, deep_per_sm, 66) == registry.MergeForm(
        "combine", *want)


@pytest.mark.parametrize("rows", [397, 512, 1024, 2048, 16384])
def test_the_warp_merge_runs_where_one_column_block_a_row_is_more_than_a_wave(rows):
    most = registry.COMBINE_WARP_MAX_CHUNKS
    assert registry.merge_form(rows, 132, 3, 2, most) == registry.WARP_MERGE
    assert registry.merge_form(rows, 132, 3, 2, 1) == registry.WARP_MERGE
    # more chunk slots than it loads well (B = 4 x 128 heads: 33), or one wave after all
    assert registry.merge_form(rows, 132, 3, 2, most + 1) == registry.MergeForm(
        "combine", 1, PLAIN)
    assert registry.merge_form(rows, 132, 200, 2, most).kind == "combine"
    grid = registry.merge_grid(registry.WARP_MERGE, 128, 8)   # 128 rows x 2 warps, 8 a block
    assert grid == (32, 1, 8)
    assert registry.merge_grid(registry.WARP_MERGE, 13, 3) == (4, 1, 3)  # 26 warps: 4 blocks
    assert registry.merge_grid(registry.MergeForm("combine", 4, DEEP), 13, 3) == (13, 4, 3)


def test_the_merge_form_is_one_wave_where_it_is_deep_and_keeps_the_prefetch_reach():
    for rows in range(1, 1200):
        cb0 = registry.combine_col_blocks(rows, 132)
        form = registry.merge_form(rows, 132, 3, 2, 17)
        if form.kind == "combine_warp":
            assert cb0 == 1 and rows > 3 * 132, rows
        elif form.prefetch == DEEP:
            cb = form.col_blocks
            assert 132 <= rows * cb <= 2 * 132 < rows * cb0 and cb0 == 2 * cb, rows
            # split groups x prefetch: 2 cb x 16 = 2 cb0 x 8, what each thread loads ahead
            assert 2 * cb * DEEP == 2 * cb0 * PLAIN
        else:
            assert form == registry.MergeForm("combine", cb0, PLAIN), rows


def test_a_merge_form_names_its_kernel():
    warp = registry.paged_merge_instance(registry.WARP_MERGE, "bf16", False)
    assert warp.name == "combine_warp<rescale=false,paged=true>"
    assert warp.expression == "mla::combine_warp_paged<false>"
    deep = registry.paged_merge_instance(registry.MergeForm("combine", 2, DEEP), "bf16")
    assert deep == registry.paged_combine_instance("bf16", True, DEEP)
    with pytest.raises(ValueError, match="merge kind"):
        registry.paged_merge_instance(registry.MergeForm("merge", 1, 8))


def test_the_rules_refuse_an_empty_launch():
    with pytest.raises(ValueError, match="rows and num_sms"):
        registry.combine_col_blocks(0, 132)


def test_the_combine_runs_in_one_kernel_at_the_narrowest_column_blocks_unless_forced():
    narrowest = registry.COMBINE_COL_BLOCKS
    assert registry.combine_in_one_kernel(registry.combine_col_blocks(16, 132))  # 16 heads
    assert not registry.combine_in_one_kernel(registry.combine_col_blocks(128, 132))
    assert not registry.combine_in_one_kernel(narrowest // 2)
    assert registry.combine_in_one_kernel(1, True) and not registry.combine_in_one_kernel(
        narrowest, False)


def test_the_projection_grids():
    assert registry.project_grid(16, 128, 1) == (16, 4, 1)
    assert registry.project_grid(3, 80, 33) == (3, 3, 2)       # 32 x 32 output tiles
    assert registry.project_grid(16, 128, 128, "project") == (16, 4, 4)
    assert registry.project_grid(16, 128, 128, "project_wide") == (16, 1, 2)  # 64 x 128
    assert registry.project_grid(3, 200, 65, "project_wide") == (3, 2, 2)
    with pytest.raises(ValueError, match="kind must be"):
        registry.project_grid(16, 128, 1, "proj")
    with pytest.raises(ValueError, match="kind must be"):
        registry.project_instance("f16", "proj")


@pytest.mark.parametrize("m_rows, n_head, kind", [
    (1, 128, "project"), (16, 128, "project"),      # one 32-row block: wv_b read once
    (32, 128, "project_wide"), (128, 128, "project_wide"),
    (128, 16, "project"), (256, 16, "project"),     # 32, 64 wide blocks: under half of 132
    (512, 16, "project_wide"), (65 * 64, 1, "project"), (66 * 64, 1, "project_wide")])
def test_the_projection_kind_follows_rows_and_the_wide_grid(m_rows, n_head, kind):
    assert registry.project_kind(m_rows, n_head, 132) == kind


def test_the_projection_kind_names_a_bad_argument():
    with pytest.raises(ValueError, match="num_sms must be an integer >= 1"):
        registry.project_kind(1, 16, 0)
    with pytest.raises(ValueError, match="m_rows must be an integer >= 1"):
        registry.project_kind(0, 16, 132)


def test_the_q_absorb_grid():
    assert registry.q_absorb_grid(128) == (128, registry.Q_ABSORB_COL_BLOCKS, 1)


# ---------------------------------------------------------------- when a launch is programmatic

class _Kernel:
    """A RawKernel stand-in: records plain launches; `.kernel.ptr` is its CUfunction."""
    def __init__(self):
        self.plain = []
        self.kernel = type("F", (), {"ptr": 0xF00})()

    def __call__(self, grid, block, args, shared_mem=0):
        self.plain.append((grid, block, shared_mem))


@pytest.fixture
def fake_launch(monkeypatch):
    """pdl.launch on the host: a current stream of a chosen handle, a device of a chosen
    compute capability, and a cuLaunchKernelEx that records its configs."""
    import cupy

    state = type("S", (), {"stream": 0x1234, "cc": "90", "ex": []})()

    class Dev:
        def __init__(self, i=None):
            self.id, self.compute_capability = 0, state.cc

    def ex(cfg, func, params, extra):
        c = ctypes.cast(cfg, ctypes.POINTER(pdl.LaunchConfig)).contents
        state.ex.append((c.hStream or 0, c.numAttrs))
        return 0

    monkeypatch.setattr(cupy.cuda, "get_current_stream",
                        lambda: type("St", (), {"ptr": state.stream})())
    monkeypatch.setattr(cupy.cuda, "Device", Dev)
    monkeypatch.setattr(pdl, "_cuda", lambda: ex)
    monkeypatch.setattr(pdl, "_supported", {})
    return state


ARGS = (np.int32(3), np.float32(0.5))


@pytest.mark.parametrize("stream", pdl.DEFAULT_STREAMS)
def test_a_default_stream_never_gets_a_programmatic_launch(fake_launch, stream):
    # the legacy, per-thread and NULL streams: callers rely on their implicit synchronization
    assert set(pdl.DEFAULT_STREAMS) == {0, 1, 2}
    fake_launch.stream = stream
    k = _Kernel()
    assert pdl.launch(k, (4,), (256,), ARGS, 128) is False
    assert k.plain == [((4,), (256,), 128)] and fake_launch.ex == []


def test_a_stream_of_its_own_on_sm_90_gets_one_and_asked_not_to_does_not(fake_launch):
    k = _Kernel()
    assert pdl.launch(k, (4, 2), (256,), ARGS) is True
    assert k.plain == [] and fake_launch.ex == [(0x1234, 1)]  # one attribute, on that stream
    assert pdl.launch(k, (4, 2), (256,), ARGS, pdl=False) is False
    assert len(k.plain) == 1 and len(fake_launch.ex) == 1


@pytest.mark.parametrize("cc, programmatic", [("80", False), ("89", False), ("90", True),
                                              ("100", True)])
def test_only_sm_90_and_later_get_a_programmatic_launch(fake_launch, cc, programmatic):
    fake_launch.cc = cc
    assert pdl.supported() is programmatic
    assert pdl.launch(_Kernel(), (1,), (32,), ARGS) is programmatic
