"""The cache's tensor maps on the CPU: the encoder's arguments against cuda.h's enums and the
kernel's layout, and the call into libcuda through a stand-in (the real encode runs in the
wgmma GPU tests, where the bulk copy meets the float64 reference)."""
from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest

from mlasandbox import tensor_map
from mlasandbox.toolkit import cuda_include_dirs


def _cuda_h() -> str | None:
    try:
        dirs = cuda_include_dirs()
    except Exception:
        return None
    for d in list(dirs) + ["/usr/local/cuda/include"]:
        path = Path(d) / "cuda.h"
        if path.is_file():
            return path.read_text()
    return None


def _enum(text: str, name: str) -> dict[str, int]:
    body = re.search(r"typedef enum %s_enum \{(.*?)\}" % name, text, re.S).group(1)
    out, value = {}, -1
    for item in re.sub(r"/\*.*?\*/|//[^\n]*", "", body, flags=re.S).split(","):
        item = item.strip()
        if not item:
            continue
        key, _, val = item.partition("=")
        value = int(val, 0) if val.strip() else value + 1
        out[key.strip()] = value
    return out


def test_the_enum_values_are_cuda_h_s():
    text = _cuda_h()
    if text is None:
        pytest.skip("no cuda.h among the CUDA headers found (mlasandbox.toolkit)")
    assert _enum(text, "CUtensorMapDataType")["CU_TENSOR_MAP_DATA_TYPE_UINT16"] == \
        tensor_map.DATA_TYPE_UINT16
    assert _enum(text, "CUtensorMapInterleave")["CU_TENSOR_MAP_INTERLEAVE_NONE"] == \
        tensor_map.INTERLEAVE_NONE
    assert _enum(text, "CUtensorMapSwizzle")["CU_TENSOR_MAP_SWIZZLE_128B"] == \
        tensor_map.SWIZZLE_128B
    assert _enum(text, "CUtensorMapL2promotion")["CU_TENSOR_MAP_L2_PROMOTION_L2_256B"] == \
        tensor_map.L2_PROMOTION_256B
    assert _enum(text, "CUtensorMapFloatOOBfill")["CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE"] == \
        tensor_map.OOB_FILL_NONE
    assert "#define CU_TENSOR_MAP_NUM_QWORDS 16" in text  # 128 bytes


def test_the_map_is_the_kernel_s_tile_layout():
    p = tensor_map.cache_map_params(rows=64 * 1000)
    assert p.dims == (576, 64000) and p.strides == (1152,)
    # one box is one column block of a tile: 64 elements (128 bytes, the swizzle's width)
    # of the 64 positions of kWgTile (mla_wgmma.cu)
    assert p.box == (64, 64) and p.box[0] * 2 == 128
    assert p.swizzle == tensor_map.SWIZZLE_128B and p.element_strides == (1, 1)
    src = Path(__file__).resolve().parents[1].joinpath("cuda_src", "mla_wgmma.cu").read_text()
    assert re.search(r"constexpr int kWgTile = %d;" % tensor_map.BOX_ROWS, src)
    assert re.search(r"constexpr int kColBlock = %d;" % tensor_map.BOX_COLS, src)


def test_the_blocks_map_is_a_copy_group_of_the_kernel_s_stage():
    """One box of the 3-D map is a copy group's four latent blocks, landing block after block
    (dimension 2 outermost) as the stage holds them; the kernel finds the rope map
    MAP_BYTES after it."""
    p = tensor_map.blocks_map_params(rows=64 * 1000)
    assert p.dims == (64, 64000, 9) and p.strides == (1152, 128)
    assert p.box == (64, 64, 4) and p.element_strides == (1, 1, 1)
    assert p.swizzle == tensor_map.SWIZZLE_128B and p.data_type == tensor_map.DATA_TYPE_UINT16
    # the box's bytes are the four blocks' a stage lays out back to back
    assert p.box[0] * 2 * p.box[1] * p.box[2] == 4 * 64 * 128
    assert tensor_map.MAPS_BYTES == 2 * tensor_map.MAP_BYTES == 256
    src = Path(__file__).resolve().parents[1].joinpath("cuda_src", "mla_wgmma.cu").read_text()
    assert re.search(r"constexpr int kGroupBlocks = %d;" % tensor_map.BOX_BLOCKS, src)
    assert re.search(r"constexpr int kMapBytes = %d;" % tensor_map.MAP_BYTES, src)
    with pytest.raises(ValueError, match="no 64-row box"):
        tensor_map.blocks_map_params(rows=63)
    with pytest.raises(ValueError, match="fewer than 4"):
        tensor_map.blocks_map_params(rows=640, key_dim=192)


@pytest.mark.parametrize("kwargs,match", [
    (dict(rows=0), "1 to 2\\^32 cache rows"),
    (dict(rows=2 ** 32 + 1), "1 to 2\\^32 cache rows"),
    (dict(rows=63), "no 64-row box"),
    (dict(rows=640, itemsize=4), "16-bit"),
    (dict(rows=640, key_dim=100), "whole 64-element boxes"),
    (dict(rows=640, key_dim=72), "whole 64-element boxes"),  # 144 B: 16-byte rows, not boxes
])
def test_bad_maps_are_refused_naming_the_limit(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tensor_map.cache_map_params(**kwargs)


def test_encode_passes_the_parameters_and_returns_the_driver_s_128_bytes():
    seen = {}

    def fake(dst, dtype, rank, addr, dims, strides, box, estr, inter, swz, l2, oob):
        seen.update(dtype=dtype, rank=rank, addr=addr.value, dims=list(dims[:rank]),
                    strides=list(strides[:rank - 1]), box=list(box[:rank]),
                    estr=list(estr[:rank]), rest=(inter, swz, l2, oob))
        assert dst.value % 128 == 0, "CUtensorMap is 128-byte aligned"
        ctypes.memmove(dst.value, bytes(range(128)), 128)
        return 0

    params = tensor_map.cache_map_params(rows=128)
    raw = tensor_map.encode(0x7000_0000_0100, params, encoder=fake)
    assert raw == bytes(range(128))
    assert seen == dict(dtype=1, rank=2, addr=0x7000_0000_0100, dims=[576, 128],
                        strides=[1152], box=[64, 64], estr=[1, 1], rest=(0, 3, 3, 0))
    raw = tensor_map.encode(0x7000_0000_0100, tensor_map.blocks_map_params(rows=128),
                            encoder=fake)
    assert seen == dict(dtype=1, rank=3, addr=0x7000_0000_0100, dims=[64, 128, 9],
                        strides=[1152, 128], box=[64, 64, 4], estr=[1, 1, 1],
                        rest=(0, 3, 3, 0))


def test_encode_reports_the_driver_s_refusal_and_a_misaligned_base():
    params = tensor_map.cache_map_params(rows=128)
    with pytest.raises(RuntimeError, match="CUresult 1"):
        tensor_map.encode(0x1000, params, encoder=lambda *a: 1)
    with pytest.raises(ValueError, match="16-byte aligned"):
        tensor_map.encode(0x1008, params, encoder=lambda *a: 0)


def test_the_switch_turns_the_bulk_copy_off(monkeypatch):
    monkeypatch.delenv(tensor_map.ENV_SWITCH, raising=False)
    assert tensor_map.tma_enabled()
    monkeypatch.setenv(tensor_map.ENV_SWITCH, "0")
    assert not tensor_map.tma_enabled()


def test_step_map_maps_pages_of_whole_tiles_unless_switched_off(monkeypatch):
    """The one rule PagedDecodeStep, run_paged and the repro script use: a map (here the
    stand-in's) for pages of 64 or more, over the cache's rows; None for smaller pages and
    under MLASANDBOX_WGMMA_TMA=0, without asking the driver."""
    import numpy as np

    calls = []
    monkeypatch.setattr(tensor_map, "device_map", lambda rows: calls.append(rows.shape) or "MAP")
    monkeypatch.delenv(tensor_map.ENV_SWITCH, raising=False)
    assert tensor_map.step_map(np.zeros((3, 64, 576), np.uint16)) == "MAP"
    assert tensor_map.step_map(np.zeros((2, 128, 576), np.uint16)) == "MAP"
    assert calls == [(192, 576), (256, 576)]
    assert tensor_map.step_map(np.zeros((9, 16, 576), np.uint16)) is None
    monkeypatch.setenv(tensor_map.ENV_SWITCH, "0")
    assert tensor_map.step_map(np.zeros((3, 64, 576), np.uint16)) is None
    assert len(calls) == 2
