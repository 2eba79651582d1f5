"""The latent cache's TMA tensor maps, for the wgmma family's bulk tensor copies.

wgmma_attn_paged (cuda_src/mla_wgmma.cu) copies a whole cache tile that lies in one page with
`cp.async.bulk.tensor`: one thread of a warpgroup issues a box per copy group where cp.async
needs 72 16-byte copies per thread and the 64-bit address of each. The copy engine reads two
maps of the same cache, encoded here, one after the other in a 256-byte device buffer:

* **the blocks map** (first): a 3-D view of 16-bit words (UINT16: the copy moves bits, so f16
  and bf16 caches share it): dimension 0 the 64 elements of a column block, dimension 1 the
  num_pages * page_size rows of the cache (1152 bytes apart), dimension 2 the 9 column blocks
  of a row (128 bytes apart). Box 64 x 64 x 4: four column blocks of 64 rows, a copy group's
  latent half, which lands as four 64 x 128-byte blocks one after the other, the layout of a
  stage. One box issues in about 90 cycles of the issuing thread, four 2-D boxes in about
  350 (measured: docs/wgmma-deep-dive.md);
* **the rope map** (second): the 2-D view, dimension 0 the 576 elements of a row, dimension 1
  the rows; box 64 x 64, one column block (the rope block, elements 512-575).

Both: SWIZZLE_128B (16-byte chunk c of box row r lands at chunk c ^ (r & 7), which is
`sw_offset` in the kernel; the destinations are 1024-byte aligned); L2 promotion of 256
bytes; out-of-bounds elements zero-filled (the kernel sends only boxes inside the cache: tiles
with rows past a slice's end go by cp.async, which zero-fills them).

CuPy has no binding for cuTensorMapEncodeTiled, so `encode` calls libcuda (CUDA 12.0 and
later) through ctypes, as sandbox/pdl.py does for cuLaunchKernelEx. The maps go into a device
buffer (`device_map`), the kernel's last argument: a kernel parameter of a struct type cannot
be passed through CuPy's launcher. The kernel reads them after
`fence.proxy.tensormap::generic.acquire`, as the CUDA programming guide prescribes for a map in
global memory.

The kernel takes the copy path per launch: a null pointer is the cp.async path (pages under 64
positions, no libcuda entry point, or MLASANDBOX_WGMMA_TMA=0 for an A/B run of the two copies).
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import numpy as np

__all__ = ["MapParams", "cache_map_params", "blocks_map_params", "encode", "device_map",
           "step_map", "supported", "tma_enabled", "MAP_BYTES", "MAPS_BYTES", "BOX_ROWS",
           "BOX_COLS", "BOX_BLOCKS", "ENV_SWITCH"]

MAP_BYTES = 128          # sizeof(CUtensorMap), 128-byte aligned: kMapBytes in mla_wgmma.cu
MAPS_BYTES = 2 * MAP_BYTES  # the blocks map, then the rope map
BOX_ROWS = 64            # cache positions of a box: kWgTile in mla_wgmma.cu
BOX_COLS = 64            # 16-bit elements of a box row: kColBlock (128 bytes, the swizzle's)
BOX_BLOCKS = 4           # column blocks of a blocks-map box: kGroupBlocks
ENV_SWITCH = "MLASANDBOX_WGMMA_TMA"
# cuda.h's enums (tests/test_tensor_map.py reads them from the header where it is found)
DATA_TYPE_UINT16 = 1     # CU_TENSOR_MAP_DATA_TYPE_UINT16
INTERLEAVE_NONE = 0      # CU_TENSOR_MAP_INTERLEAVE_NONE
SWIZZLE_128B = 3         # CU_TENSOR_MAP_SWIZZLE_128B
L2_PROMOTION_256B = 3    # CU_TENSOR_MAP_L2_PROMOTION_L2_256B
OOB_FILL_NONE = 0        # CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE: zeros
_MAX_DIM = 2 ** 32       # globalDim[i] <= 2^32
_MAX_STRIDE = 2 ** 40    # globalStrides[i] < 2^40


@dataclass(frozen=True)
class MapParams:
    """The arguments of cuTensorMapEncodeTiled, but the address (dimension 0 innermost)."""

    data_type: int
    dims: tuple[int, ...]        # elements, innermost first
    strides: tuple[int, ...]     # bytes between steps of dimensions 1, 2, ...
    box: tuple[int, ...]
    element_strides: tuple[int, ...]
    interleave: int
    swizzle: int
    l2_promotion: int
    oob_fill: int


def cache_map_params(rows: int, key_dim: int = 576, itemsize: int = 2) -> MapParams:
    """The rope map (2-D, a box one column block) of a cache of `rows` rows of `key_dim`
    16-bit elements (num_pages * page_size rows of 576). ValueError naming the limit where
    the encoder would refuse."""
    if itemsize != 2:
        raise ValueError(f"the tensor map copies 16-bit cache elements, got {itemsize} bytes")
    if not 1 <= rows <= _MAX_DIM:
        raise ValueError(f"the tensor map takes 1 to 2^32 cache rows, got {rows}")
    row_bytes = key_dim * itemsize
    if key_dim % BOX_COLS or row_bytes % 16 or row_bytes >= _MAX_STRIDE:
        raise ValueError(f"cache rows of {key_dim} elements are not whole {BOX_COLS}-element "
                         "boxes 16-byte aligned")
    if rows < BOX_ROWS:
        raise ValueError(f"a cache of {rows} rows holds no {BOX_ROWS}-row box")
    return MapParams(DATA_TYPE_UINT16, (key_dim, rows), (row_bytes,), (BOX_COLS, BOX_ROWS),
                     (1, 1), INTERLEAVE_NONE, SWIZZLE_128B, L2_PROMOTION_256B, OOB_FILL_NONE)


def blocks_map_params(rows: int, key_dim: int = 576, itemsize: int = 2) -> MapParams:
    """The blocks map (3-D: elements of a column block, rows, column blocks; a box
    BOX_BLOCKS blocks of BOX_ROWS rows) of the same cache, checked as cache_map_params."""
    rope = cache_map_params(rows, key_dim, itemsize)
    blocks = key_dim // BOX_COLS
    if blocks < BOX_BLOCKS:
        raise ValueError(f"cache rows of {key_dim} elements hold fewer than {BOX_BLOCKS} "
                         f"{BOX_COLS}-element blocks")
    # the blocks' stride (128 bytes) is below the rows' (1152): the encoder takes strides in
    # any order, and the box's layout in shared memory follows the dimensions' order
    return MapParams(DATA_TYPE_UINT16, (BOX_COLS, rows, blocks),
                     (rope.strides[0], BOX_COLS * itemsize), (BOX_COLS, BOX_ROWS, BOX_BLOCKS),
                     (1, 1, 1), INTERLEAVE_NONE, SWIZZLE_128B, L2_PROMOTION_256B, OOB_FILL_NONE)


_encoder = None


def _libcuda_encoder():
    """libcuda's cuTensorMapEncodeTiled, or None where there is none."""
    global _encoder
    if _encoder is None:
        try:
            fn = ctypes.CDLL("libcuda.so.1").cuTensorMapEncodeTiled
            u32, u64 = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                           u64, u64, u32, u32, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                           ctypes.c_int]
            _encoder = fn
        except (OSError, AttributeError):
            _encoder = False
    return _encoder or None


def supported() -> bool:
    """Whether this machine's libcuda encodes tensor maps (CUDA 12.0 and later)."""
    return _libcuda_encoder() is not None


def encode(address: int, params: MapParams, encoder=None) -> bytes:
    """The 128 bytes of the tensor map of `params` over the device memory at `address`.
    RuntimeError with the driver's code when it refuses; `encoder` stands in for libcuda's
    function (the tests pass one)."""
    fn = encoder or _libcuda_encoder()
    if fn is None:
        raise RuntimeError("libcuda has no cuTensorMapEncodeTiled (CUDA 12.0 or later needed)")
    if address % 16:
        raise ValueError(f"the tensor map's base address must be 16-byte aligned, got "
                         f"{address:#x}")
    buf = ctypes.create_string_buffer(MAP_BYTES + 128)
    base = (ctypes.addressof(buf) + 127) & ~127      # CUtensorMap is 128-byte aligned
    rank = len(params.dims)
    arr = lambda t, v: (t * len(v))(*v)                # noqa: E731
    rc = fn(ctypes.c_void_p(base), params.data_type, rank, ctypes.c_void_p(address),
            arr(ctypes.c_uint64, params.dims), arr(ctypes.c_uint64, params.strides),
            arr(ctypes.c_uint32, params.box), arr(ctypes.c_uint32, params.element_strides),
            params.interleave, params.swizzle, params.l2_promotion, params.oob_fill)
    if rc != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled refused the cache's map (CUresult {rc}): "
                           f"{params}")
    return ctypes.string_at(base, MAP_BYTES)


def tma_enabled() -> bool:
    """Whether the bulk tensor copy may be used: unless MLASANDBOX_WGMMA_TMA=0."""
    return os.environ.get(ENV_SWITCH, "1").strip() != "0"


def device_map(rows):
    """The blocks map then the rope map of the cache rows `rows` (a C-contiguous [rows, 576]
    array of 16-bit elements on the current device) in a new MAPS_BYTES device buffer, or
    None where the driver cannot encode maps."""
    import cupy

    if not supported():
        return None
    shape = (rows.shape[0], rows.shape[1], rows.dtype.itemsize)
    raw = b"".join(encode(int(rows.data.ptr), params(*shape))
                   for params in (blocks_map_params, cache_map_params))
    buf = cupy.empty(MAPS_BYTES, cupy.uint8)            # CuPy allocations are 256-byte aligned
    buf.set(np.frombuffer(raw, np.uint8))
    return buf


def step_map(kv_cache):
    """The maps argument of the wgmma launch for the paged cache `kv_cache` ([num_pages,
    page_size, 576]): its device maps where a page holds whole tiles (page_size >= BOX_ROWS)
    and the switch is on; None otherwise, or where the driver encodes no map (the kernel
    then copies every tile by cp.async)."""
    if kv_cache.shape[1] < BOX_ROWS or not tma_enabled():
        return None
    return device_map(kv_cache.reshape(-1, kv_cache.shape[-1]))
