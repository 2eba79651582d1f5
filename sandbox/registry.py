"""The one registry: every variant and every kernel instance, named from all its parameters.

Two levels:

* `Variant` is what a user picks (`per_head`, `split`, `batched12`, `tiled16`, `mma16`,
  `cublas`). `per_head` and `split` serve one head per block with `cuda_src/mla_attn_rows.cu`
  (`attn_rows`): `per_head` over one slice, `split` over S contiguous slices; below the split
  gate `split` runs exactly the kernel `per_head` runs (the A/A test). `batched<HPB>`
  (`cuda_src/mla_attn.cu`, `attn<HPB>`) serves HPB >= 2 heads per pass over the cache, also
  split over context. HPB 1 of the heads-per-block ladder (`attn_instance(1)`, the sweep) is
  attn_rows. `tiled16` (`cuda_src/mla_attn_tiled.cu`) is the same contract on CUDA cores
  with GEMM-style register tiles in two warp-specialized pipelines (scores; softmax and
  values) at one block per SM; `mma<16|32>` (`cuda_src/mla_mma.cu`)
  puts the heads on the tensor cores.
* `KernelInstance` is one template instantiation, held as its kind and template values
  (`heads`, `cache`, `q`, `rescale`); everything else follows from them through its
  `Family`: the source file, the C++ name expression handed to NVRTC (`name_expressions`),
  the readable name, the block size, the tile, the dynamic shared memory and the oldest
  architecture it compiles for.

The launch values below are the registry's own; `compile_defines()` passes them to every
compile, and each kernel static_asserts them against its own constants and layout struct
(mla_common.cuh), so a formula that drifts from its kernel fails the NVRTC compile.
"""
from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import Callable

import numpy as np

__all__ = [
    "HPB_VALUES", "ATTN_THREADS", "ATTN_TILE", "COMBINE_THREADS", "Q_ABSORB_THREADS",
    "COMBINE_COL_BLOCKS", "KV_LORA", "ROPE", "Variant", "KernelInstance", "VARIANTS", "variant",
    "variant_names", "attn_instance", "mma_instance", "attention_instance", "combine_instance",
    "MMA_HEADS", "MMA_M_TILES", "q_absorb_instance", "all_instances",
    "attn_smem_bytes", "CXX_TYPES", "TILED_HEADS", "tiled_instance", "tiled_smem_bytes",
    "ROWS_THREADS", "ROWS_TILE", "rows_instance", "rows_smem_bytes", "variant_for_hpb",
    "Family", "FAMILIES", "KINDS", "compile_defines", "resolve_variant", "check_cuda_dims",
    "mma_smem_bytes", "CHECK_THREADS", "paged_attention_instance", "paged_combine_instance",
    "instance_for_plan",
    "paged_check_instance", "PAGED_KINDS", "PAGED_ONLY_VARIANTS", "wgmma_instance",
    "wgmma_smem_bytes", "WGMMA_THREADS", "WGMMA_TILE", "WGMMA_ROWS", "ROUND_P_RELL2_BOUND",
    "UNIT_ROUNDOFF",
    "Q_ABSORB_COL_BLOCKS", "PROJECT_THREADS",
    "PROJECT_V_ROWS", "PROJECT_M_ROWS", "PROJECT_WIDE_V_ROWS", "PROJECT_WIDE_M_ROWS",
    "project_kind", "project_instance", "combine_col_blocks", "merge_form", "MergeForm",
    "merge_grid", "paged_merge_instance", "WARP_MERGE", "COMBINE_PREFETCH",
    "COMBINE_DEEP_PREFETCH",
    "COMBINE_WARP_COL_BLOCKS", "COMBINE_WARP_PREFETCH", "COMBINE_WARP_MAX_CHUNKS",
    "project_grid", "q_absorb_grid", "combine_in_one_kernel",
]

# The heads-per-block ladder of the CUDA-core variants: 1 is attn_rows (per_head, split), the
# others are attn<HPB> (batched<HPB>).
HPB_VALUES = (1, 2, 4, 8, 12, 16, 24)

# The launch values of cuda_src/mla_attn.cu (kThreads, kTile) and the dims it is built for.
ATTN_THREADS = 256
ATTN_TILE = 32
KV_LORA = 512
ROPE = 64
KEY_DIM = KV_LORA + ROPE
# cuda_src/mla_attn_rows.cu: one head per block, a warp owns whole rows (kThreads, kTile).
ROWS_THREADS = 128
ROWS_TILE = 32
assert ROWS_TILE == ATTN_TILE, "splits.py sizes slices in tiles of ATTN_TILE rows for both"
MMA_HEADS = (16, 32)  # heads per block of mla_mma.cu, as 1 or 2 m tiles of 16 heads
MMA_M_TILES = tuple(h // 16 for h in MMA_HEADS)
MMA_THREADS = 256
MMA_TILE = 64
# cuda_src/mla_attn_tiled.cu: register-tiled CUDA-core kernel, sized for 16 heads per block
# (kThreads, kTile, kStages).
TILED_HEADS = (16,)
TILED_THREADS = 256
TILED_TILE = 32
TILED_STAGES = 3
COMBINE_THREADS = 256
# ---- the small phases: q_absorb, the combine (merge) and the output projection ----------
# The combine's column blocks per row are a launch choice (combine_col_blocks), a power of two
# up to COMBINE_COL_BLOCKS (kMaxColBlocks in mla_combine.cu: 32 columns, 8 float4 threads).
COMBINE_COL_BLOCKS = 16
# float4s of partials a merge thread loads before the max is known (kPrefetch, kDeepPrefetch,
# the combine's PREFETCH template value): the deep merge holds twice as many at a 128-register
# budget (two blocks an SM), so half the column blocks load a row's chunks in one round trip
# (merge_form picks it).
COMBINE_PREFETCH = 8
COMBINE_DEEP_PREFETCH = 16
# The warp merge (combine_warp_paged): one warp a (row, column block), kWarpColBlocks a row,
# each lane loading kWarpPrefetch chunks' partials before the max (merge_form picks it).
COMBINE_WARP_COL_BLOCKS = 2
COMBINE_WARP_PREFETCH = 8
COMBINE_WARP_MAX_CHUNKS = 24   # chunk slots a request, at most, where merge_form takes it
# A paged plan of at most this many chunk slots a request, with q in the cache dtype, is merged
# by the mma family's own kernel (the request's last program, mla_walk.cuh PagedWalk::finish;
# kAttnMergeMaxChunks) and the step launches no merge: paged_api.PagedDecodeStep.merges_in_attn.
ATTN_MERGE_MAX_CHUNKS = 16
ATTN_MERGE_FAMILIES = ("mma",)


def attn_merges(family: str, max_chunks: int, q: str, cache: str) -> bool:
    """Whether a paged step of `family` under a plan of `max_chunks` chunk slots a request
    merges the chunks in its attention kernel (no merge launch): a family of
    ATTN_MERGE_FAMILIES, 2 to ATTN_MERGE_MAX_CHUNKS slots, q in the cache dtype (the kernels
    built with the merge, mla_mma.cu)."""
    return (family in ATTN_MERGE_FAMILIES and 1 < max_chunks <= ATTN_MERGE_MAX_CHUNKS
            and q == cache)
Q_ABSORB_THREADS = 256
Q_ABSORB_COL_BLOCKS = 8   # blocks per head of q_absorb (kAbsorbColBlocks), 64 columns each
PROJECT_THREADS = 256     # cuda_src/mla_project.cu: out = wv_b[h] @ latent, tensor cores
PROJECT_V_ROWS = 32       # wv_b rows of a block's output tile (kPmV)
PROJECT_M_ROWS = 32       # latent rows of a block's output tile (kPmM): wv_b is read once
PROJECT_WIDE_V_ROWS = 128  # project_wide's output tile (kPwV x kPwM): a whole 128-row wv_b,
PROJECT_WIDE_M_ROWS = 64   # so the latent is read once and wv_b once per 64 rows
                          # per 32 rows
CHECK_THREADS = 128  # cuda_src/mla_paged_check.cu, the paged step's index validator

CXX_TYPES = {"f16": "__half", "bf16": "__nv_bfloat16", "f32": "float"}


@dataclass(frozen=True)
class Variant:
    """A user-facing variant. `hpb` is None for the cuBLAS engine."""

    name: str
    family: str  # "per_head" | "split" | "batched" | "tiled" | "mma" | "cublas"
    hpb: int | None
    splits: bool  # whether it splits over context above the gate
    about: str
    round_p: bool = False  # p rounded to the cache dtype for the value product (16 bits)

    @property
    def is_cuda(self) -> bool:
        return self.family != "cublas"


def _make_variants() -> dict[str, Variant]:
    out = {
        "per_head": Variant("per_head", "per_head", 1, False,
                            "one block per head walks all n_ctx positions"),
        "split": Variant("split", "split", 1, True,
                         "heads x S contiguous slices, partials merged by the combine"),
    }
    for hpb in HPB_VALUES:
        if hpb == 1:
            continue  # batched1 would be `split` under another name
        out[f"batched{hpb}"] = Variant(
            f"batched{hpb}", "batched", hpb, True,
            f"one pass over the cache serves {hpb} heads, split over context")
    for heads in TILED_HEADS:
        out[f"tiled{heads}"] = Variant(
            f"tiled{heads}", "tiled", heads, True,
            f"CUDA cores, GEMM-style register tiles in a score and a value pipeline: {heads} "
            "heads per block, one block per SM, split over context")
    for heads in MMA_HEADS:
        out[f"mma{heads}"] = Variant(
            f"mma{heads}", "mma", heads, True,
            f"tensor cores: {heads} heads as {heads // 16} M tile(s) of mma.m16n8k16, split "
            "over context")
    for heads in MMA_HEADS:
        out[f"mma{heads}r"] = Variant(
            f"mma{heads}r", "mma", heads, True,
            f"mma{heads} with p rounded to the cache dtype for the value product (one product "
            "instead of hi + lo: FlashMLA's exactness, ROUND_P_RELL2_BOUND)", round_p=True)
    out["cublas"] = Variant("cublas", "cublas", None, False,
                            "CuPy matmuls (cuBLAS) + softmax: the reference engine")
    return out


VARIANTS: dict[str, Variant] = _make_variants()


def variant_names() -> list[str]:
    return list(VARIANTS)


def variant_for_hpb(hpb: int) -> str:
    """The variant name of `hpb` heads per block on the CUDA-core ladder: one head per block
    is `split`, more are batched<hpb>."""
    if hpb not in HPB_VALUES:
        raise ValueError(f"heads_per_block must be one of {', '.join(map(str, HPB_VALUES))} "
                         f"(the instantiated heads per block; 1 is split), got {hpb}")
    return "split" if hpb == 1 else f"batched{hpb}"


def variant(name: str) -> Variant:
    """The Variant of `name`: a batch-1 one (VARIANTS) or a paged-only one
    (PAGED_ONLY_VARIANTS, the wgmma family)."""
    if not isinstance(name, str):
        raise TypeError(f"variant must be a name (str), got {name!r}")
    found = VARIANTS.get(name) or PAGED_ONLY_VARIANTS.get(name)
    if found is None:
        raise ValueError(f"unknown variant {name!r}; known: {', '.join(VARIANTS)}; paged "
                         f"only: {', '.join(PAGED_ONLY_VARIANTS)}")
    return found


def resolve_variant(name: str, heads_per_block: int | None = None, *,
                    default_hpb: int | None = None, option: str = "heads_per_block") -> Variant:
    """The Variant that `name` and a heads-per-block value pick: the one resolver of both.

    'batched' is the generic spelling: heads_per_block (or `default_hpb` when it is None)
    picks batched<hpb>, and 1 is `split`. A named variant serves its own heads per block
    (one for per_head, split and the cuBLAS engine); a heads_per_block that contradicts it
    raises. `option` is how the caller's user spells the parameter, for the messages.
    """
    hpb = heads_per_block
    if hpb is not None:  # 16.0 == 16 would pass the ladder's test and name batched16.0
        if isinstance(hpb, (bool, np.bool_)) or not isinstance(hpb, numbers.Integral):
            raise TypeError(f"{option} must be an integer, one of "
                            f"{', '.join(map(str, HPB_VALUES))}, got {hpb!r}")
        hpb = int(hpb)
    if name == "batched":
        hpb = default_hpb if hpb is None else hpb
        if hpb is None:
            raise ValueError(f"variant 'batched' needs {option} (one of "
                             f"{', '.join(map(str, HPB_VALUES))}; 1 is split)")
        return VARIANTS[variant_for_hpb(hpb)]
    v = variant(name)
    if v.name in PAGED_ONLY_VARIANTS:
        raise ValueError(f"variant {v.name} serves the paged step only (mla.decode_paged, "
                         "mlasandbox bench --batch B); the batch-1 variants: "
                         f"{', '.join(VARIANTS)}")
    if hpb is not None and hpb != (v.hpb or 1):
        raise ValueError(f"variant {v.name} serves {v.hpb or 1} head(s) per block; "
                         f"{option}={hpb} contradicts it (use variant batched with "
                         f"{option}={hpb})")
    return v


def check_cuda_dims(kv_lora: int, rope: int) -> None:
    """The CUDA variants are compiled for one latent and rope width (MLA_KV_LORA, MLA_ROPE)."""
    if (kv_lora, rope) != (KV_LORA, ROPE):
        raise ValueError(f"the CUDA variants are built for kv_lora={KV_LORA}, rope={ROPE}; "
                         f"got kv_lora={kv_lora}, rope={rope} (the NumPy reference takes any "
                         "dims)")


def attn_smem_bytes(hpb: int) -> int:
    """Dynamic shared memory of attn<HPB> (HPB >= 2), AttnSmem<HPB>::bytes in mla_attn.cu.

    two cache tiles (the cross-warp score partials borrow the spare one) + q in f32 + p +
    (m, l, alpha). One head per block is attn_rows: rows_smem_bytes().
    """
    if hpb < 2:
        raise ValueError(f"attn<HPB> serves 2 or more heads per block, got {hpb}; one head "
                         "per block is attn_rows (rows_smem_bytes())")
    tiles = 2 * ATTN_TILE * KEY_DIM * 2
    q = KEY_DIM * hpb * 4
    p = hpb * ATTN_TILE * 4
    stats = 3 * ((hpb + 3) // 4 * 4) * 4
    return tiles + q + p + stats


def rows_smem_bytes(heads: int = 1) -> int:
    """Dynamic shared memory of attn_rows, RowsSmem::bytes in mla_attn_rows.cu (one tile of
    unswizzled rows; the merge of the warps borrows it after the slice)."""
    return ROWS_TILE * KEY_DIM * 2


MMA_SCORE_KGROUPS = 4  # kScoreKGroups: the score phase's k-groups, one per warp of a quad


def mma_smem_bytes(heads: int) -> int:
    """Dynamic shared memory of mma_attn<heads>, MmaSmem<heads / 16>::bytes in mla_mma.cu (two
    64-row tiles; q as hi/lo 16-bit halves, whose buffer the score partials of the four
    k-groups, [4][heads][64 + 8] f32, reuse once q is in registers; p as hi/lo halves; m, l,
    alpha)."""
    tiles = 2 * MMA_TILE * KEY_DIM * 2
    q = 2 * heads * KEY_DIM * 2
    red = MMA_SCORE_KGROUPS * heads * (MMA_TILE + 8) * 4
    p = 2 * heads * MMA_TILE * 2
    stats = 3 * heads * 4
    return tiles + max(q, red) + p + stats


def tiled_smem_bytes(heads: int = 16) -> int:
    """Dynamic shared memory of attn_tiled<16>, tiled::Smem::bytes in mla_attn_tiled.cu (three
    32-row tile buffers; q as 16 k-slices of [36][16] f32 plus an 8-float pad; the score
    partials, [16 k-slices][32 rows][16 + 4] f32; p as [32][16 + 4] f32; alpha; one 8-byte
    mbarrier per tile buffer and two for the partials' handoff)."""
    tiles = TILED_STAGES * TILED_TILE * KEY_DIM * 2
    q = 16 * (36 * heads + 8) * 4
    red = 16 * TILED_TILE * (heads + 4) * 4
    p = TILED_TILE * (heads + 4) * 4
    return tiles + q + red + p + heads * 4 + (TILED_STAGES + 2) * 8


# ---- the wgmma family (cuda_src/mla_wgmma.cu): paged only, sm_90a -----------------------------
# Two warpgroups serve 64 query rows (s_q x heads) of one request per block over tiles of 64
# positions, two stages; the scores and the values on wgmma.mma_async (needs the sm_90a
# target, which toolkit.compile_options passes for it), p rounded to the cache dtype.
WGMMA_THREADS = 256
WGMMA_TILE = 64
WGMMA_ROWS = (64,)      # query rows per block: one wgmma M
WGMMA_KEY_BLOCKS = KEY_DIM // 64  # 128-byte column blocks of a 576-wide row (9)
WGMMA_BARRIERS = 9  # mbarriers of the seesaw (kWgBars in mla_wgmma.cu)


def wgmma_smem_bytes(rows: int = 64) -> int:
    """Dynamic shared memory of wgmma_attn_paged, WgmmaSmem::bytes in mla_wgmma.cu: q and two
    tiles as 9 column blocks of [64 rows][128 B] each, p as one such block, the row maxima and
    the row sums of the two warpgroups ([2][64] f32 each), its WGMMA_BARRIERS mbarriers, and
    1024 B of slack to align the base to the 1024-byte swizzle period."""
    if rows != 64:
        raise ValueError(f"wgmma_attn serves 64 query rows per block, got {rows}")
    block = 64 * 128
    return 3 * WGMMA_KEY_BLOCKS * block + block + (2 * 64 + 2 * 64) * 4 + WGMMA_BARRIERS * 8 + 1024


# The paged-only variants: the paged step (decode_paged, bench --batch) takes them, the
# batch-1 commands do not list them (variant_names()).
PAGED_ONLY_VARIANTS: dict[str, Variant] = {
    "wgmma64": Variant("wgmma64", "wgmma", 64, True,
                       "Hopper wgmma (sm_90a): 64 query rows (s_q x heads) per block, two "
                       "warpgroups, p rounded to the cache dtype; paged only", round_p=True),
}


# What rounding p to the cache dtype costs (a Variant's round_p: wgmma64, mma16r, mma32r;
# tests/test_gpu_wgmma.py derives it): relL2 of
# latent and out with rms u / sqrt(3) x sqrt(sum_j w_j^2 |v_j|^2) / |sum_j w_j v_j|, u the
# dtype's unit roundoff (2^-11 f16, 2^-8 bf16); the ratio is about 1 on random inputs, so the
# bench's spot check takes MARGIN 4 times u / sqrt(3), plus the f32 bound 1e-4. lse stays f32.
UNIT_ROUNDOFF = {"f16": 2.0 ** -11, "bf16": 2.0 ** -8}
ROUND_P_RELL2_BOUND = {k: 4 * u / 3 ** 0.5 + 1e-4 for k, u in UNIT_ROUNDOFF.items()}


def wgmma_instance(cache: str = "f16", q: str = "f32", partials: bool = True) -> KernelInstance:
    """The paged wgmma kernel (it has no batch-1 launch). q comes in the cache dtype, as
    FlashMLA takes it: an f32 q would be rounded to 16 bits for the tensor cores, an error
    the family does not take on silently.

    partials=False is the instance of a single-pass plan (ChunkPlan.single_pass: one chunk a
    request, no merge launched): it writes each request's latent and lse and skips the
    partials (m, l, acc[512]) nobody reads, 128 KB a 64-row block. Launched under a plan of
    several chunk slots it writes them anyway, at the cost of a branch the partials=True
    instance does not have (a run-time branch there slowed batch 1 by 7%,
    docs/wgmma-deep-dive.md)."""
    _check_attention_dtypes(cache, q)
    if q != cache:
        raise ValueError(f"wgmma64 takes q in the cache dtype ({cache}), got q={q}: convert q "
                         "to the cache dtype, or use mma16/mma32 for an f32 q")
    return KernelInstance("wgmma_attn", cache, q, heads=WGMMA_ROWS[0], partials=bool(partials),
                          round_p=True,
                          paged=True)


@dataclass(frozen=True)
class Family:
    """One kernel template of cuda_src/: what every instance of it shares.

    `template_args` are the template values of the C++ name, in order, among "heads",
    "cache", "q", "rescale", "prefetch", "partials", "round_p". `heads` are the heads-per-block
    values instantiated (attn_rows: 1, not a template value). `macro` names its launch values in compile_defines()
    (MLA_<macro>_THREADS, ...). `min_arch` is the oldest architecture NVRTC compiles it for
    (sm_75, the oldest NVRTC 13 targets, for plain CUDA; sm_80: cp.async, ldmatrix and
    mma.sync; sm_90: mbarrier.try_wait.parity), found by compiling for each.
    `paged_function` is the family's paged launch (the same body on the paged walk,
    cuda_src/mla_walk.cuh), None where the family serves batch 1 only.
    """

    kind: str
    source: str
    function: str
    template_args: tuple[str, ...]
    macro: str
    threads: int
    tile_rows: int = 0            # cache rows per step (attention kernels only)
    heads: tuple[int, ...] = ()
    smem: Callable[[int], int] | None = None  # dynamic shared memory of `heads` heads
    min_arch: str = "sm_80"
    paged_function: str | None = None


FAMILIES: dict[str, Family] = {f.kind: f for f in (
    Family("attn_rows", "mla_attn_rows.cu", "mla::attn_rows", ("cache", "q"), "ROWS",
           ROWS_THREADS, ROWS_TILE, (1,), rows_smem_bytes,
           paged_function="mla::attn_rows_paged"),
    Family("attn", "mla_attn.cu", "mla::attn", ("heads", "cache", "q"), "ATTN", ATTN_THREADS,
           ATTN_TILE, tuple(h for h in HPB_VALUES if h > 1), attn_smem_bytes,
           paged_function="mla::attn_paged"),
    Family("attn_tiled", "mla_attn_tiled.cu", "mla::attn_tiled", ("heads", "cache", "q"),
           "TILED", TILED_THREADS, TILED_TILE, TILED_HEADS, tiled_smem_bytes, "sm_90"),
    Family("mma_attn", "mla_mma.cu", "mla::mma_attn", ("heads", "cache", "q", "round_p"), "MMA",
           MMA_THREADS, MMA_TILE, MMA_HEADS, mma_smem_bytes,
           paged_function="mla::mma_attn_paged"),
    Family("q_absorb", "mla_q_absorb.cu", "mla::q_absorb", ("cache", "q"), "Q_ABSORB",
           Q_ABSORB_THREADS, min_arch="sm_75"),
    Family("combine", "mla_combine.cu", "mla::combine", ("cache", "rescale", "prefetch"),
           "COMBINE", COMBINE_THREADS, min_arch="sm_75", paged_function="mla::combine_paged"),
    # paged only: the warp merge of many rows (merge_form)
    Family("combine_warp", "mla_combine.cu", "mla::combine_warp_paged", ("rescale",),
           "COMBINE_WARP", COMBINE_THREADS, min_arch="sm_75",
           paged_function="mla::combine_warp_paged"),
    # paged only: the sm_90a tensor-core kernel (wgmma section below)
    Family("wgmma_attn", "mla_wgmma.cu", "mla::wgmma_attn_paged", ("cache", "q", "partials"),
           "WGMMA", WGMMA_THREADS, WGMMA_TILE, WGMMA_ROWS, wgmma_smem_bytes, "sm_90a",
           paged_function="mla::wgmma_attn_paged"),
    # one launch for batch 1 and paged batches alike: rows m * H + h of the latent
    Family("project", "mla_project.cu", "mla::project", ("cache",), "PROJECT",
           PROJECT_THREADS, min_arch="sm_80"),
    Family("project_wide", "mla_project.cu", "mla::project_wide", ("cache",), "PROJECT_WIDE",
           PROJECT_THREADS, min_arch="sm_80"),
    # paged only: the index validator of the paged step (no template, no batch-1 launch)
    Family("check_paged", "mla_paged_check.cu", "mla::check_paged", (), "CHECK",
           CHECK_THREADS, min_arch="sm_75", paged_function="mla::check_paged"),
)}
KINDS = tuple(FAMILIES)
PAGED_KINDS = tuple(k for k, f in FAMILIES.items() if f.paged_function)


def compile_defines() -> tuple[str, ...]:
    """The registry's launch values as NVRTC -D options, for every compile of cuda_src/.

    Each kernel static_asserts them (mla_common.cuh, "the registry's launch values"):
    MLA_<F>_THREADS, MLA_<F>_TILE and MLA_<F>_SMEM, a list of (heads, bytes) pairs, per family,
    and the small phases' geometry: MLA_COMBINE_COL_BLOCKS, MLA_COMBINE_PREFETCH,
    MLA_COMBINE_DEEP_PREFETCH, MLA_COMBINE_WARP_COL_BLOCKS, MLA_COMBINE_WARP_PREFETCH,
    MLA_ATTN_MERGE_MAX_CHUNKS,
    MLA_Q_ABSORB_COL_BLOCKS, MLA_PROJECT_V_ROWS, MLA_PROJECT_M_ROWS and their
    MLA_PROJECT_WIDE_ pair. They only feed
    static_asserts, so they change no code.
    """
    out = ["MLA_REGISTRY_FACTS", f"MLA_COMBINE_COL_BLOCKS={COMBINE_COL_BLOCKS}",
           f"MLA_COMBINE_PREFETCH={COMBINE_PREFETCH}",
           f"MLA_COMBINE_DEEP_PREFETCH={COMBINE_DEEP_PREFETCH}",
           f"MLA_COMBINE_WARP_COL_BLOCKS={COMBINE_WARP_COL_BLOCKS}",
           f"MLA_COMBINE_WARP_PREFETCH={COMBINE_WARP_PREFETCH}",
           f"MLA_ATTN_MERGE_MAX_CHUNKS={ATTN_MERGE_MAX_CHUNKS}",
           f"MLA_Q_ABSORB_COL_BLOCKS={Q_ABSORB_COL_BLOCKS}",
           f"MLA_PROJECT_V_ROWS={PROJECT_V_ROWS}", f"MLA_PROJECT_M_ROWS={PROJECT_M_ROWS}",
           f"MLA_PROJECT_WIDE_V_ROWS={PROJECT_WIDE_V_ROWS}",
           f"MLA_PROJECT_WIDE_M_ROWS={PROJECT_WIDE_M_ROWS}"]
    for f in FAMILIES.values():
        out.append(f"MLA_{f.macro}_THREADS={f.threads}")
        if f.tile_rows:
            out.append(f"MLA_{f.macro}_TILE={f.tile_rows}")
        if f.smem is not None:
            pairs = ",".join(f"{h},{f.smem(h)}" for h in f.heads)
            out.append(f"MLA_{f.macro}_SMEM={pairs}")
    return tuple(f"-D{d}" for d in out)


@dataclass(frozen=True)
class KernelInstance:
    """One template instantiation: its kind and template values; the rest is derived.

    `heads` is the heads served per block (1 for attn_rows; None for q_absorb and combine),
    `cache` the 16-bit element of the cache (q_absorb: of its inputs; combine: of wv_b), `q`
    the query element (None for combine), `rescale` the combine's merge (False is the
    negative control; None for the other kinds), `partials` whether the wgmma kernel writes
    the partials of a single-pass plan (None for the other kinds), `round_p` whether the
    kernel rounds p to the cache dtype for its value product, so that its relL2 bound is
    ROUND_P_RELL2_BOUND (mma_attn: a template value; wgmma_attn: always True, no template
    value; None for the other kinds), `prefetch` the combine's float4s of partials a thread
    loads before the max (COMBINE_PREFETCH or COMBINE_DEEP_PREFETCH; None for the other
    kinds). `paged`: the family's paged
    launch (Family.paged_function: a batch of requests in a paged cache), not its batch-1 one.
    """

    kind: str
    cache: str | None
    q: str | None = None
    heads: int | None = None
    rescale: bool | None = None
    partials: bool | None = None
    round_p: bool | None = None
    prefetch: int | None = None
    paged: bool = False

    def __post_init__(self):
        if self.paged and not FAMILIES[self.kind].paged_function:
            raise ValueError(f"{self.kind} has no paged launch")

    @property
    def family(self) -> Family:
        return FAMILIES[self.kind]

    @property
    def params(self) -> dict:
        """The template values, as the readable name spells them, in template order."""
        flag = {k: None if v is None else str(v).lower()
                for k, v in (("rescale", self.rescale), ("partials", self.partials),
                             ("round_p", self.round_p))}
        vals = {"heads": self.heads, "cache": self.cache, "q": self.q,
                "prefetch": self.prefetch, **flag}
        return {k: vals[k] for k in self.family.template_args}

    @property
    def name(self) -> str:
        """Readable, every template value spelled out: attn<heads=12,cache=f16,q=f32>, and
        paged=true for a paged launch: mma_attn<heads=16,cache=f16,q=f32,round_p=false,paged=true>."""
        items = [f"{k}={v}" for k, v in self.params.items()]
        if self.paged and self.family.template_args:
            items.append("paged=true")
        return f"{self.kind}<{','.join(items)}>" if items else self.kind

    @property
    def expression(self) -> str:
        """The C++ name expression handed to NVRTC."""
        f = self.family
        function = f.paged_function if self.paged else f.function
        if not f.template_args:
            return function
        cxx = {"heads": str(self.heads), "cache": CXX_TYPES.get(self.cache),
               "q": CXX_TYPES.get(self.q), "rescale": str(self.rescale).lower(),
               "partials": str(self.partials).lower(), "round_p": str(self.round_p).lower(),
               "prefetch": str(self.prefetch)}
        return f"{function}<{', '.join(cxx[k] for k in f.template_args)}>"

    @property
    def source(self) -> str:
        return self.family.source

    @property
    def threads(self) -> int:
        return self.family.threads

    @property
    def tile_rows(self) -> int:
        return self.family.tile_rows

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory per block."""
        f = self.family
        return 0 if f.smem is None else f.smem(self.heads)

    @property
    def min_arch(self) -> str:
        return self.family.min_arch

    def __str__(self) -> str:
        return self.name


def _check_attention_dtypes(cache: str, q: str) -> None:
    """The dtype pairs every attention family is instantiated for."""
    _check_dtype("cache", cache, ("f16", "bf16"))
    _check_dtype("q", q, ("f32", cache))


def _check_dtype(kind: str, dt: str, allowed) -> None:
    if dt not in allowed:
        raise ValueError(f"{kind} dtype must be one of {', '.join(allowed)}, got {dt!r}")


def _check_heads(kind: str, heads: int) -> None:
    allowed = FAMILIES[kind].heads
    if heads not in allowed:
        raise ValueError(f"{kind} serves {', '.join(map(str, allowed))} heads per block "
                         f"(the instantiated values), got {heads}")


def rows_instance(cache: str = "f16", q: str = "f32") -> KernelInstance:
    """attn_rows: one head per block (per_head, split)."""
    _check_attention_dtypes(cache, q)
    return KernelInstance("attn_rows", cache, q, heads=1)


def attn_instance(hpb: int, cache: str = "f16", q: str = "f32") -> KernelInstance:
    """The CUDA-core kernel that serves `hpb` heads per pass over the cache, the ladder of
    the heads-per-block sweep: attn_rows for 1 (per_head, split), attn<HPB> above."""
    if hpb not in HPB_VALUES:
        raise ValueError(
            f"heads_per_block must be one of {HPB_VALUES} (the instantiated values), got {hpb}")
    if hpb == 1:
        return rows_instance(cache, q)
    _check_attention_dtypes(cache, q)
    return KernelInstance("attn", cache, q, heads=hpb)


def mma_instance(heads: int = 16, cache: str = "f16", q: str = "f32",
                 round_p: bool = False) -> KernelInstance:
    """mma_attn: round_p=False is mma16 / mma32 (p as hi + lo), True mma16r / mma32r."""
    _check_heads("mma_attn", heads)
    _check_attention_dtypes(cache, q)
    return KernelInstance("mma_attn", cache, q, heads=heads, round_p=bool(round_p))


def tiled_instance(heads: int = 16, cache: str = "f16", q: str = "f32") -> KernelInstance:
    _check_heads("attn_tiled", heads)
    _check_attention_dtypes(cache, q)
    return KernelInstance("attn_tiled", cache, q, heads=heads)


def attention_instance(var: Variant, cache: str = "f16", q: str = "f32") -> KernelInstance:
    """The attention kernel a CUDA variant launches (a paged-only variant: its paged one)."""
    if var.family == "wgmma":
        return wgmma_instance(cache, q)
    if var.family == "mma":
        return mma_instance(var.hpb, cache, q, var.round_p)
    if var.family == "tiled":
        return tiled_instance(var.hpb, cache, q)
    if not var.is_cuda:
        raise ValueError(f"variant {var.name} launches no attention kernel of its own")
    return attn_instance(var.hpb, cache, q)


def combine_instance(cache: str = "f16", rescale: bool = True,
                     prefetch: int = COMBINE_PREFETCH) -> KernelInstance:
    """The merge + wv_b kernel. rescale=False is the negative control: a combine that
    drops the exp(m_i - m) rescale, which every correctness check must reject. prefetch:
    COMBINE_PREFETCH, or COMBINE_DEEP_PREFETCH for the deep merge (merge_form)."""
    _check_dtype("wv_b", cache, ("f16", "bf16"))
    if prefetch not in (COMBINE_PREFETCH, COMBINE_DEEP_PREFETCH):
        raise ValueError(f"prefetch must be {COMBINE_PREFETCH} or {COMBINE_DEEP_PREFETCH} "
                         f"float4s a thread, got {prefetch!r}")
    return KernelInstance("combine", cache, rescale=bool(rescale), prefetch=int(prefetch))


def paged_attention_instance(var: Variant | str, cache: str = "f16",
                             q: str = "f32") -> KernelInstance:
    """The paged launch of the attention kernel a variant runs: split (attn_rows),
    batched<HPB> (attn<HPB>), mma16 / mma32 (mma_attn). per_head and tiled16 serve batch 1
    only, and the cuBLAS engine launches no attention kernel."""
    var = variant(var) if isinstance(var, str) else var
    if var.family in ("per_head", "tiled") or not var.is_cuda:
        takes = ", ".join(n for n, v in VARIANTS.items()
                          if v.is_cuda and v.family not in ("per_head", "tiled"))
        why = ("launches no attention kernel" if not var.is_cuda
               else "serves batch 1 (one contiguous cache) only")
        raise ValueError(f"variant {var.name} {why}; the paged kernels: {takes}")
    inst = attention_instance(var, cache, q)
    if inst.paged:
        return inst
    return dataclasses.replace(inst, paged=True)


def instance_for_plan(inst: KernelInstance, single_pass: bool) -> KernelInstance:
    """The instance a paged step launches for its plan: under a single-pass plan (one chunk a
    request, no merge) the wgmma kernel that skips the partials (partials=False, same launch
    values); every other instance, and every other plan, as given."""
    if single_pass and getattr(inst, "kind", None) == "wgmma_attn":
        return dataclasses.replace(inst, partials=False)
    return inst


def paged_combine_instance(cache: str = "f16", rescale: bool = True,
                           prefetch: int = COMBINE_PREFETCH) -> KernelInstance:
    """The paged merge + wv_b kernel (combine_paged); rescale=False is its negative control,
    prefetch as combine_instance's."""
    return dataclasses.replace(combine_instance(cache, rescale, prefetch), paged=True)


def paged_check_instance() -> KernelInstance:
    """The index validator of the paged step (check_paged): table entries and lengths."""
    return KernelInstance("check_paged", None, paged=True)


def q_absorb_instance(cache: str = "f16", q: str = "f32") -> KernelInstance:
    _check_dtype("weights", cache, ("f16", "bf16"))
    _check_dtype("q", q, ("f32", cache))
    return KernelInstance("q_absorb", cache, q)


def combine_in_one_kernel(col_blocks: int, choice: bool | None = None) -> bool:
    """Whether a step that merges runs the combine's one-kernel form (merge, then each block
    projects its columns; mla_combine.cu) rather than the merge then the projection. `choice`
    True / False forces a form; None picks the one kernel at the narrowest column blocks
    (COMBINE_COL_BLOCKS: up to 32 heads at batch 1, a paged batch of at most 16 rows), where
    it won; with wider blocks its last block's sum of the parts costs more than a second
    launch. H200, combine alone, cold L2, graph (us), one kernel vs two: 16 heads 9.3 vs 9.5
    (1024 tokens) .. 10.2 vs 10.4 (131072); 128 heads 18.5 vs 16.4 (1024)."""
    return col_blocks == COMBINE_COL_BLOCKS if choice is None else bool(choice)


def project_kind(m_rows: int, n_head: int, num_sms: int) -> str:
    """Which projection runs over m_rows latent rows a head: "project_wide" (64 x 128 tiles,
    each latent row read once) where `project` would read wv_b more than once (m_rows >=
    PROJECT_M_ROWS) and its own grid, n_head x ceil(m_rows / 64) blocks, fills at least half
    the SMs; else "project" (32 x 32 tiles, warps splitting k: eight warps of wv_b loads in
    flight for one row). Measured on the H200 (bench timer, cold L2, graph, us, project vs
    project_wide; docs/combine-and-q-absorb-deep-dive.md): 128 heads x 32 rows 16.8 vs 15.4,
    x 128 rows 43.9 vs 26.7, x 16 rows 13.9 vs 15.1; 16 heads x 128 rows 10.7 vs 16.0 (32
    blocks), x 256 15.7 vs 16.2 (64 blocks), x 512 24.9 vs 18.2 (128 blocks)."""
    for name, v in (("m_rows", m_rows), ("n_head", n_head), ("num_sms", num_sms)):
        if isinstance(v, bool) or int(v) != v or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    wide_blocks = n_head * -(-m_rows // PROJECT_WIDE_M_ROWS)
    return ("project_wide" if m_rows >= PROJECT_M_ROWS and 2 * wide_blocks >= num_sms
            else "project")


def project_instance(cache: str = "f16", kind: str = "project") -> KernelInstance:
    """The batched output projection out = wv_b[h] @ latent (mla_project.cu): `kind`
    "project" or "project_wide" (project_kind picks)."""
    _check_dtype("wv_b", cache, ("f16", "bf16"))
    if kind not in ("project", "project_wide"):
        raise ValueError(f"kind must be 'project' or 'project_wide', got {kind!r}")
    return KernelInstance(kind, cache)


def q_absorb_grid(n_head: int) -> tuple:
    return (n_head, Q_ABSORB_COL_BLOCKS, 1)


def combine_col_blocks(rows: int, num_sms: int) -> int:
    """Column blocks per row of a merge-only combine launch: the fewest (a power of two, at
    most COMBINE_COL_BLOCKS) that give at least two blocks per SM over `rows` rows, so a
    few heads at batch 1 still fill the GPU (16 rows: 16 blocks a row) and a large batch
    keeps one block a row, whose 256 threads then cover the 512 columns twice over."""
    if rows < 1 or num_sms < 1:
        raise ValueError(f"rows and num_sms must be >= 1, got {rows}, {num_sms}")
    cb = 1
    while cb < COMBINE_COL_BLOCKS and rows * cb < 2 * num_sms:
        cb *= 2
    return cb


@dataclass(frozen=True)
class MergeForm:
    """How a merge-only paged launch merges: `kind` "combine" (a block of 256 threads a
    row's column block; prefetch COMBINE_PREFETCH or COMBINE_DEEP_PREFETCH) or
    "combine_warp" (a warp a row's column block, COMBINE_WARP_COL_BLOCKS a row)."""

    kind: str
    col_blocks: int
    prefetch: int


WARP_MERGE = MergeForm("combine_warp", COMBINE_WARP_COL_BLOCKS, COMBINE_WARP_PREFETCH)


def merge_form(rows: int, num_sms: int, blocks_per_sm: int, deep_blocks_per_sm: int,
               max_chunks: int) -> MergeForm:
    """The form of a merge-only paged launch over `rows` rows of at most `max_chunks` chunk
    slots a request, given the resident blocks an SM of the block merge (COMBINE_PREFETCH)
    and of the deep merge (COMBINE_DEEP_PREFETCH; its launch bounds ask for two). Where the
    block merge at combine_col_blocks takes more than one wave:
    * the deep merge at half of those column blocks, where the half grid gives every SM one
      or two blocks: one wave, and each thread still loads as many chunks' partials before
      the max (half the column blocks have half the split groups, each loading twice as
      many). Batch 1 x 64 / 128 heads (64 / 128 rows, wgmma64's 128 / 64 chunks) on 132
      SMs: 512 blocks at three an SM (80 registers), 1.29 waves, against 256 at two.
      Measured on an H100 (attn + merge, graph, cold L2, us;
      docs/combine-and-q-absorb-deep-dive.md): 1 x 131072 x 128 84.2 against 87.0, x 64
      74.3 against 75.6.
    * the warp merge (WARP_MERGE) where there is one column block a row (nothing to halve)
      and at most COMBINE_WARP_MAX_CHUNKS slots: past its 8 prefetched chunks a lane loads
      the partials a chunk at a time. Measured on an H100 against the block merge (us):
      B = 128 x N(4096, 2048) x 16 heads, q f32 (2,048 rows, 5 slots) 254.9 against 261.6;
      B = 8 x N(32768, 16384) x 128 (1,024 rows, 17 slots) 170.5 against 174.3; B = 8 x
      N(16384, 8192) x 64, s_q 2 (1,024 rows, 17 slots) 101.5 against 104.0; B = 32 x
      N(8192, 4096) x 16, q f32 (512 rows, 9 slots) 112.9 against 114.5; but B = 4 x
      N(32768, 16384) x 128 (512 rows, 33 slots) 96.9 against 95.7. At batch 1 (64 and 128
      rows of 64-132 chunks) every warp form of its probe was 1.6-5 us slower than the deep
      merge.
    Else the block merge at combine_col_blocks with COMBINE_PREFETCH."""
    cb = combine_col_blocks(rows, num_sms)
    half = cb // 2
    if rows * cb > blocks_per_sm * num_sms:
        if half >= 1 and num_sms <= rows * half <= deep_blocks_per_sm * num_sms:
            return MergeForm("combine", half, COMBINE_DEEP_PREFETCH)
        if cb == 1 and max_chunks <= COMBINE_WARP_MAX_CHUNKS:
            return WARP_MERGE
    return MergeForm("combine", cb, COMBINE_PREFETCH)


def merge_grid(form: MergeForm, n_rows: int, batch: int) -> tuple:
    """The grid of a paged merge of `form` over n_rows rows a request: the block merge
    (n_rows, column blocks, B); the warp merge (ceil(n_rows x column blocks / 8), 1, B), its
    eight warps a block."""
    if form.kind == "combine_warp":
        warps = COMBINE_THREADS // 32
        return (-(-n_rows * form.col_blocks // warps), 1, batch)
    return (n_rows, form.col_blocks, batch)


def paged_merge_instance(form: MergeForm, cache: str = "f16",
                         rescale: bool = True) -> KernelInstance:
    """The kernel of a paged merge of `form`: combine_paged at its prefetch, or
    combine_warp_paged (no cache type: it reads only f32 partials); rescale=False is the
    negative control of either."""
    if form.kind == "combine_warp":
        return KernelInstance("combine_warp", None, rescale=bool(rescale), paged=True)
    if form.kind != "combine":
        raise ValueError(f"merge kind must be 'combine' or 'combine_warp', got {form.kind!r}")
    return paged_combine_instance(cache, rescale, form.prefetch)


def project_grid(n_head: int, v_head: int, m_rows: int, kind: str = "project") -> tuple:
    """The grid of the projection `kind` ("project" or "project_wide"): (heads, blocks of its
    tile's wv_b rows, blocks of its latent rows); m_rows latent rows per head (batch 1: 1;
    paged: B * s_q)."""
    if kind not in ("project", "project_wide"):
        raise ValueError(f"kind must be 'project' or 'project_wide', got {kind!r}")
    v_rows, m_tile = ((PROJECT_WIDE_V_ROWS, PROJECT_WIDE_M_ROWS) if kind == "project_wide"
                      else (PROJECT_V_ROWS, PROJECT_M_ROWS))
    return (n_head, -(-v_head // v_rows), -(-m_rows // m_tile))


def all_instances(cache_dtypes=("f16", "bf16"), q_dtypes=("f32", "cache"),
                  negative_controls: bool = True) -> list[KernelInstance]:
    """Every instance the registry compiles, for reports (`mlasandbox regs`): the batch-1
    launches, then each dtype's paged ones, and the paged step's index validator."""
    out: list[KernelInstance] = []
    for cache in cache_dtypes:
        for qd in q_dtypes:
            q = cache if qd == "cache" else qd
            for hpb in HPB_VALUES:
                out.append(attn_instance(hpb, cache, q))
            for heads in TILED_HEADS:
                out.append(tiled_instance(heads, cache, q))
            for heads in MMA_HEADS:
                out.append(mma_instance(heads, cache, q))
                out.append(mma_instance(heads, cache, q, round_p=True))
            out.append(q_absorb_instance(cache, q))
            for var in VARIANTS.values():
                if var.is_cuda and var.family not in ("per_head", "tiled"):
                    out.append(paged_attention_instance(var, cache, q))
            if q == cache:
                out.append(wgmma_instance(cache, q))
                out.append(wgmma_instance(cache, q, partials=False))
        for rescale in (True, False) if negative_controls else (True,):
            out.append(combine_instance(cache, rescale))
            out.append(paged_combine_instance(cache, rescale))
            out.append(paged_combine_instance(cache, rescale, COMBINE_DEEP_PREFETCH))
            # the warp merge has no cache type (f32 partials): one instance a rescale
            out.append(paged_merge_instance(WARP_MERGE, cache, rescale))
        out.append(project_instance(cache))
        out.append(project_instance(cache, "project_wide"))
    out.append(paged_check_instance())
    # one instance may be reached twice (q=cache listed via both spellings); keep the first
    return list(dict.fromkeys(out))
