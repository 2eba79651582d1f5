"""The one registry: every variant and every kernel instance, named from all its parameters.

Two levels:

* `Variant` is what a user picks (`per_head`, `split`, `batched12`, `tiled16`, `mma16`,
  `cublas`). `per_head` and `split` serve one head per block with `cuda_src/mla_attn_rows.cu`
  (`attn_rows`): `per_head` over one slice, `split` over S contiguous slices; below the split
  gate `split` runs exactly the kernel `per_head` runs (the lecture's A/A). `batched<HPB>`
  (`cuda_src/mla_attn.cu`, `attn<HPB>`) serves HPB >= 2 heads per pass over the cache, also
  split over context. HPB 1 of the heads-per-block ladder (`attn_instance(1)`, the sweep) is
  attn_rows. `tiled16` (`cuda_src/mla_attn_tiled.cu`) is the same contract on CUDA cores
  with GEMM-style register tiles in two warp-specialized pipelines (scores; softmax and
  values) at one block per SM; `mma<16|32>` (`cuda_src/mla_mma.cu`)
  puts the heads on the tensor cores.
* `KernelInstance` is one template instantiation: its source file, the C++ name expression
  handed to NVRTC (`name_expressions`), a readable name built from every template value,
  the block size and the dynamic shared memory it needs.

The geometry constants mirror the tops of the .cu files; a GPU test checks that each kernel
agrees (it traps when launched with less shared memory than it needs).
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "HPB_VALUES", "ATTN_THREADS", "ATTN_TILE", "COMBINE_THREADS", "Q_ABSORB_THREADS",
    "COMBINE_COL_BLOCKS", "KV_LORA", "ROPE", "Variant", "KernelInstance", "VARIANTS", "variant", "variant_names",
    "attn_instance", "mma_instance", "attention_instance", "combine_instance", "MMA_M_TILES", "q_absorb_instance", "all_instances",
    "attn_smem_bytes", "CXX_TYPES", "TILED_HEADS", "tiled_instance", "tiled_smem_bytes",
    "ROWS_THREADS", "ROWS_TILE", "rows_instance", "rows_smem_bytes", "variant_for_hpb",
]

# The heads-per-block ladder of the CUDA-core variants: 1 is attn_rows (per_head, split), the
# others are attn<HPB> (batched<HPB>).
HPB_VALUES = (1, 2, 4, 8, 12, 16, 24)

# Fixed geometry of cuda_src/mla_attn.cu (kThreads, kTile) and the dims it is built for.
ATTN_THREADS = 256
ATTN_TILE = 32
KV_LORA = 512
ROPE = 64
KEY_DIM = KV_LORA + ROPE
# cuda_src/mla_attn_rows.cu: one head per block, a warp owns whole rows (kThreads, kTile).
ROWS_THREADS = 128
ROWS_TILE = 32
assert ROWS_TILE == ATTN_TILE, "splits.py sizes slices in tiles of ATTN_TILE rows for both"
MMA_M_TILES = (1, 2)  # HM of mla_mma.cu: 16 or 32 heads per block
MMA_THREADS = 256
MMA_TILE = 64
# cuda_src/mla_attn_tiled.cu: register-tiled CUDA-core kernel, sized for 16 heads per block
# (kThreads, kTile, kStages).
TILED_HEADS = (16,)
TILED_THREADS = 256
TILED_TILE = 32
TILED_STAGES = 3
COMBINE_THREADS = 256
COMBINE_COL_BLOCKS = 4  # blocks per head in the combine (kColBlocks in mla_combine.cu)
Q_ABSORB_THREADS = 128

CXX_TYPES = {"f16": "__half", "bf16": "__nv_bfloat16", "f32": "float"}


@dataclass(frozen=True)
class Variant:
    """A user-facing variant. `hpb` is None for the cuBLAS engine."""

    name: str
    family: str  # "per_head" | "split" | "batched" | "tiled" | "mma" | "cublas"
    hpb: int | None
    splits: bool  # whether it splits over context above the gate
    about: str

    @property
    def is_cuda(self) -> bool:
        return self.family != "cublas"


def _make_variants() -> dict[str, Variant]:
    out = {
        "per_head": Variant("per_head", "per_head", 1, False,
                            "one block per head walks all n_ctx positions (lecture section 1)"),
        "split": Variant("split", "split", 1, True,
                         "heads x S contiguous slices, partials merged by combine (section 2)"),
    }
    for hpb in HPB_VALUES:
        if hpb == 1:
            continue  # batched1 would be `split` under another name
        out[f"batched{hpb}"] = Variant(
            f"batched{hpb}", "batched", hpb, True,
            f"one pass over the cache serves {hpb} heads, split over context (section 4)")
    for heads in TILED_HEADS:
        out[f"tiled{heads}"] = Variant(
            f"tiled{heads}", "tiled", heads, True,
            f"CUDA cores, GEMM-style register tiles in a score and a value pipeline: {heads} "
            "heads per block, one block per SM, split over context")
    for hm in MMA_M_TILES:
        out[f"mma{16 * hm}"] = Variant(
            f"mma{16 * hm}", "mma", 16 * hm, True,
            f"tensor cores: {16 * hm} heads as {hm} M tile(s) of mma.m16n8k16, split over context")
    out["cublas"] = Variant("cublas", "cublas", None, False,
                            "CuPy matmuls (cuBLAS) + softmax: the reference engine")
    return out


VARIANTS: dict[str, Variant] = _make_variants()


def variant_names() -> list[str]:
    return list(VARIANTS)


def variant_for_hpb(hpb: int) -> str:
    """The variant name of `hpb` heads per block: one head per block is `split`."""
    return "split" if hpb == 1 else f"batched{hpb}"


def variant(name: str) -> Variant:
    try:
        return VARIANTS[name]
    except KeyError:
        raise ValueError(
            f"unknown variant {name!r}; known: {', '.join(VARIANTS)}") from None


@dataclass(frozen=True)
class KernelInstance:
    source: str       # file in cuda_src/
    expression: str   # C++ name expression for NVRTC
    name: str         # readable, every template value spelled out
    threads: int
    smem_bytes: int   # dynamic shared memory per block
    tile_rows: int = 0  # cache rows per step (attention kernels only)

    def __str__(self) -> str:
        return self.name


def attn_smem_bytes(hpb: int) -> int:
    """Dynamic shared memory of attn<HPB> (HPB >= 2): mirrors AttnSmem in mla_attn.cu.

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


def rows_smem_bytes() -> int:
    """Dynamic shared memory of attn_rows: mirrors RowsSmem in mla_attn_rows.cu (one tile of
    unswizzled rows; the merge of the warps borrows it after the slice)."""
    return ROWS_TILE * KEY_DIM * 2


def _check_attention_dtypes(cache: str, q: str) -> None:
    """The dtype pairs every attention family is instantiated for."""
    _check_dtype("cache", cache, ("f16", "bf16"))
    _check_dtype("q", q, ("f32", cache))


def _check_dtype(kind: str, dt: str, allowed) -> None:
    if dt not in allowed:
        raise ValueError(f"{kind} dtype must be one of {', '.join(allowed)}, got {dt!r}")


def rows_instance(cache: str = "f16", q: str = "f32") -> KernelInstance:
    """attn_rows: one head per block (per_head, split)."""
    _check_attention_dtypes(cache, q)
    return KernelInstance("mla_attn_rows.cu", f"mla::attn_rows<{CXX_TYPES[cache]}, {CXX_TYPES[q]}>",
                          f"attn_rows<cache={cache},q={q}>", ROWS_THREADS, rows_smem_bytes(),
                          ROWS_TILE)


def attn_instance(hpb: int, cache: str = "f16", q: str = "f32") -> KernelInstance:
    """The CUDA-core kernel that serves `hpb` heads per pass over the cache, the ladder of
    the heads-per-block sweep: attn_rows for 1 (per_head, split), attn<HPB> above."""
    if hpb not in HPB_VALUES:
        raise ValueError(
            f"heads_per_block must be one of {HPB_VALUES} (the instantiated values), got {hpb}")
    if hpb == 1:
        return rows_instance(cache, q)
    _check_attention_dtypes(cache, q)
    expr = f"mla::attn<{hpb}, {CXX_TYPES[cache]}, {CXX_TYPES[q]}>"
    return KernelInstance("mla_attn.cu", expr, f"attn<hpb={hpb},cache={cache},q={q}>",
                          ATTN_THREADS, attn_smem_bytes(hpb), ATTN_TILE)


MMA_SCORE_KGROUPS = 4  # kScoreKGroups: the score phase's k-groups, one per warp of a quad


def mma_smem_bytes(heads: int) -> int:
    """Dynamic shared memory of mma_attn<heads/16>: mirrors MmaSmem in mla_mma.cu (two 64-row
    tiles; q as hi/lo 16-bit halves, whose buffer the score partials of the four k-groups,
    [4][heads][64 + 8] f32, reuse once q is in registers; p as hi/lo halves; m, l, alpha)."""
    tiles = 2 * MMA_TILE * KEY_DIM * 2
    q = 2 * heads * KEY_DIM * 2
    red = MMA_SCORE_KGROUPS * heads * (MMA_TILE + 8) * 4
    p = 2 * heads * MMA_TILE * 2
    stats = 3 * heads * 4
    return tiles + max(q, red) + p + stats


def mma_instance(heads: int = 16, cache: str = "f16", q: str = "f32") -> KernelInstance:
    if heads % 16 or heads // 16 not in MMA_M_TILES:
        raise ValueError(f"the mma kernels serve {', '.join(str(16 * m) for m in MMA_M_TILES)} "
                         f"heads per block, got {heads}")
    _check_attention_dtypes(cache, q)
    return KernelInstance("mla_mma.cu",
                          f"mla::mma_attn<{heads // 16}, {CXX_TYPES[cache]}, {CXX_TYPES[q]}>",
                          f"mma_attn<heads={heads},cache={cache},q={q}>", MMA_THREADS,
                          mma_smem_bytes(heads), MMA_TILE)


def tiled_smem_bytes(heads: int = 16) -> int:
    """Dynamic shared memory of attn_tiled<16>: mirrors tiled::Smem in mla_attn_tiled.cu (three
    32-row tile buffers; q as 16 k-slices of [36][16] f32 plus an 8-float pad; the score
    partials, [16 k-slices][32 rows][16 + 4] f32; p as [32][16 + 4] f32; alpha; one 8-byte
    mbarrier per tile buffer and two for the partials' handoff)."""
    tiles = TILED_STAGES * TILED_TILE * KEY_DIM * 2
    q = 16 * (36 * heads + 8) * 4
    red = 16 * TILED_TILE * (heads + 4) * 4
    p = TILED_TILE * (heads + 4) * 4
    return tiles + q + red + p + heads * 4 + (TILED_STAGES + 2) * 8


def tiled_instance(heads: int = 16, cache: str = "f16", q: str = "f32") -> KernelInstance:
    if heads not in TILED_HEADS:
        raise ValueError(f"the tiled kernel serves {', '.join(map(str, TILED_HEADS))} heads per "
                         f"block, got {heads}")
    _check_attention_dtypes(cache, q)
    return KernelInstance("mla_attn_tiled.cu",
                          f"mla::attn_tiled<{heads}, {CXX_TYPES[cache]}, {CXX_TYPES[q]}>",
                          f"attn_tiled<hpb={heads},cache={cache},q={q}>", TILED_THREADS,
                          tiled_smem_bytes(heads), TILED_TILE)


def attention_instance(var: Variant, cache: str = "f16", q: str = "f32") -> KernelInstance:
    """The attention kernel a CUDA variant launches."""
    if var.family == "mma":
        return mma_instance(var.hpb, cache, q)
    if var.family == "tiled":
        return tiled_instance(var.hpb, cache, q)
    if not var.is_cuda:
        raise ValueError(f"variant {var.name} launches no attention kernel of its own")
    return attn_instance(var.hpb, cache, q)


def combine_instance(cache: str = "f16", rescale: bool = True) -> KernelInstance:
    """The merge + wv_b kernel. rescale=False is the negative control: a combine that
    drops the exp(m_i - m) rescale, which every correctness check must reject."""
    _check_dtype("wv_b", cache, ("f16", "bf16"))
    r = "true" if rescale else "false"
    return KernelInstance("mla_combine.cu", f"mla::combine<{CXX_TYPES[cache]}, {r}>",
                          f"combine<wv_b={cache},rescale={r}>", COMBINE_THREADS, 0)


def q_absorb_instance(cache: str = "f16", q: str = "f32") -> KernelInstance:
    _check_dtype("weights", cache, ("f16", "bf16"))
    _check_dtype("q", q, ("f32", cache))
    return KernelInstance("mla_q_absorb.cu",
                          f"mla::q_absorb<{CXX_TYPES[cache]}, {CXX_TYPES[q]}>",
                          f"q_absorb<in={cache},q={q}>", Q_ABSORB_THREADS, 0)


def all_instances(cache_dtypes=("f16", "bf16"), q_dtypes=("f32", "cache"),
                  negative_controls: bool = True) -> list[KernelInstance]:
    """Every instance the registry compiles, for reports (`mlasandbox regs`)."""
    out: list[KernelInstance] = []
    for cache in cache_dtypes:
        for qd in q_dtypes:
            q = cache if qd == "cache" else qd
            for hpb in HPB_VALUES:
                out.append(attn_instance(hpb, cache, q))
            for heads in TILED_HEADS:
                out.append(tiled_instance(heads, cache, q))
            for hm in MMA_M_TILES:
                out.append(mma_instance(16 * hm, cache, q))
            out.append(q_absorb_instance(cache, q))
        out.append(combine_instance(cache, True))
        if negative_controls:
            out.append(combine_instance(cache, False))
    # one instance may be reached twice (q=cache listed via both spellings); keep the first
    seen: dict[str, KernelInstance] = {}
    for inst in out:
        seen.setdefault(inst.name, inst)
    return list(seen.values())
