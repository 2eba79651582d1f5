"""Explicit byte and FLOP formulas per phase and variant, and the rates derived from a time.

Every figure is a sum of named terms, each with its formula written out, so `mlasandbox bench
--explain` can print exactly what a GB/s or TFLOP/s in the table was divided by.

Bytes are counted two ways:

* **ideal**: what the phase must move at least: one read of every input it needs, one write
  of every output (for attn: ONE read of the cache, q, and the split partials). This is the
  DRAM figure of a perfect kernel, the one to compare with the copy ceiling.
* **as issued**: what the kernels ask the memory system for. Every head block of
  per_head / split / batched<HPB> streams its slice of the cache itself, so the cache is
  issued `head_blocks` times (96 times for per_head at 96 heads: each head's block re-reads it).
  How much of it reaches DRAM depends on L2 (blocks in lockstep share lines), so GB/s "as
  issued" may exceed the copy ceiling: that is L2 serving the reuse, not a faster DRAM.

FLOPs count multiply-adds as 2; exponentials, max and conversions are not counted.

    attn       2 H n_ctx (576 + 512)            q.k over the 576-wide key, p.v over 512
    combine    2 S H 512 + 2 H 128 512          the weighted merge, then wv_b
    q_absorb   2 H 128 512                      q_nope[h] @ wk_b[h]
    paged step sum_b 2 rows_b(visible) (576 + 512) + 2 B s_q H 128 512
                                                one batch of requests (paged_step_cost)

The cuBLAS engine runs its own combine (wv_b) inside its attn phase (api.DecodeStep.run_attn),
so its attn cost includes wv_b and it has no separate combine phase.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from . import registry
from .dims import Dims

__all__ = ["DTYPE_BYTES", "Term", "PhaseCost", "attn_cost", "combine_cost", "q_absorb_cost",
           "step_cost", "phase_cost", "rates", "explain_lines", "head_blocks_of",
           "CUBLAS_SCORE_BYTES", "paged_step_cost"]

DTYPE_BYTES = {"f16": 2, "bf16": 2, "f32": 4}

# Bytes the cuBLAS engine moves per element of its [H, n_ctx] score matrix, pass by pass
# (cublas_engine.cublas_attention): the GEMM writes the scaled scores (4); the max reads them
# (4); exp(s - m) in place reads and writes them (8); the sum reads them (4); p = e / l reads
# them and writes p in 16 bits (6); the second GEMM reads p16 (2).
CUBLAS_SCORE_PASSES = (("GEMM writes scores", 4), ("max (r)", 4), ("exp in place (r+w)", 8),
                       ("sum (r)", 4), ("p to 16 bits (r 4 + w 2)", 6), ("GEMM reads p16", 2))
CUBLAS_SCORE_BYTES = sum(b for _, b in CUBLAS_SCORE_PASSES)  # 28


@dataclass(frozen=True)
class Term:
    """One line of a byte count: its name, its formula, and what it adds to each total."""

    name: str
    formula: str
    ideal: int
    issued: int


@dataclass(frozen=True)
class PhaseCost:
    phase: str
    variant: str
    flops: int
    flops_formula: str
    terms: tuple = field(default_factory=tuple)
    note: str = ""

    @property
    def ideal_bytes(self) -> int:
        return sum(t.ideal for t in self.terms)

    @property
    def issued_bytes(self) -> int:
        return sum(t.issued for t in self.terms)

    def as_dict(self) -> dict:
        return {"phase": self.phase, "variant": self.variant, "flops": self.flops,
                "flops_formula": self.flops_formula, "ideal_bytes": self.ideal_bytes,
                "issued_bytes": self.issued_bytes, "note": self.note,
                "terms": [{"name": t.name, "formula": t.formula, "ideal": t.ideal,
                           "issued": t.issued} for t in self.terms]}


def _b(dt: str) -> int:
    try:
        return DTYPE_BYTES[dt]
    except KeyError:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {dt!r}") from None


def _q_bytes(q_dtype: str, cache_dtype: str) -> int:
    return _b(cache_dtype if q_dtype == "cache" else q_dtype)


def head_blocks_of(variant_family: str, n_head: int, hpb: int | None) -> int:
    """Blocks that each stream the cache: H for per_head/split, ceil(H/HPB) for batched."""
    if variant_family == "cublas":
        return 1
    return -(-n_head // (hpb or 1))


def _family(variant: str) -> tuple[str, int | None]:
    v = registry.variant(variant)
    return v.family, v.hpb


def attn_cost(variant: str, dims: Dims, n_ctx: int, cache_dtype: str = "f16",
              q_dtype: str = "f32", splits: int = 1) -> PhaseCost:
    """The attention phase of `variant` at `n_ctx` with `splits` slices."""
    family, hpb = _family(variant)
    H, n, K, L = dims.n_head, int(n_ctx), dims.key_dim, dims.kv_lora
    cb, qb = _b(cache_dtype), _q_bytes(q_dtype, cache_dtype)
    if n < 1 or splits < 1:
        raise ValueError(f"n_ctx and splits must be >= 1, got {n_ctx}, {splits}")
    flops = 2 * H * n * (K + L)
    flops_formula = f"2 x H {H} x n_ctx {n} x ({K} + {L})"
    if family == "cublas":
        return _cublas_attn_cost(variant, dims, n, cache_dtype, q_dtype, flops, flops_formula)
    hb = head_blocks_of(family, H, hpb)
    S = int(splits)
    cache_once = n * K * cb
    terms = (
        Term("cache rows", f"n_ctx {n} x {K} x {cb} B, once (ideal); x head_blocks {hb} "
                           f"(as issued: every head block streams it)", cache_once,
             cache_once * hb),
        Term("q", f"H {H} x {K} x {qb} B; x splits {S} as issued (every slice loads its "
                  f"heads' q)", H * K * qb, H * K * qb * S),
        Term("partials written", f"splits {S} x H {H} x ({L} + 2) x 4 B (acc, m, l)",
             S * H * (L + 2) * 4, S * H * (L + 2) * 4),
    )
    return PhaseCost("attn", variant, flops, flops_formula, terms)


def _cublas_attn_cost(variant, dims, n, cache_dtype, q_dtype, flops, flops_formula):
    H, K, L = dims.n_head, dims.key_dim, dims.kv_lora
    cb, qb = _b(cache_dtype), _q_bytes(q_dtype, cache_dtype)
    q_cast = H * K * (qb + cb) if qb != cb else 0
    passes = ", ".join(f"{name} {b}" for name, b in CUBLAS_SCORE_PASSES)
    terms = (
        Term("cache rows", f"n_ctx {n} x {K} x {cb} B once (ideal); GEMM 1 reads {K} "
                           f"columns and GEMM 2 reads {L} (as issued)", n * K * cb,
             n * (K + L) * cb),
        Term("q", f"H {H} x {K} x {qb} B" + (f"; cast to {cache_dtype} (r {qb} + w {cb} B)"
                                            if q_cast else ""), H * K * qb, H * K * qb + q_cast),
        Term("score matrix passes", f"H {H} x n_ctx {n} x {CUBLAS_SCORE_BYTES} B "
                                    f"({passes}); 0 ideal", 0, H * n * CUBLAS_SCORE_BYTES),
        Term("outputs", f"latent H x {L} x 4 + lse H x 4", H * (L + 1) * 4, H * (L + 1) * 4),
    )
    return PhaseCost("attn", variant, flops, flops_formula, terms,
                     note="the cuBLAS engine's wv_b projection is its combine phase")


def combine_cost(variant: str, dims: Dims, cache_dtype: str = "f16",
                 splits: int = 1) -> PhaseCost:
    """The merge + wv_b phase (for the cuBLAS engine: the wv_b projection alone)."""
    family, _ = _family(variant)
    if family == "cublas":
        H, L, V = dims.n_head, dims.kv_lora, dims.v_head
        cb = _b(cache_dtype)
        terms = (
            Term("latent", f"H {H} x {L} x 4 B read, cast to {cache_dtype} (w + r {cb} B "
                           f"each; 0 ideal)", H * L * 4, H * L * (4 + 2 * cb)),
            Term("wv_b", f"H {H} x {V} x {L} x {cb} B", H * V * L * cb, H * V * L * cb),
            Term("out", f"H x {V} x 4 B", H * V * 4, H * V * 4),
        )
        return PhaseCost("combine", variant, 2 * H * V * L, f"2 x H {H} x {V} x {L}", terms)
    H, L, V, S = dims.n_head, dims.kv_lora, dims.v_head, int(splits)
    cb = _b(cache_dtype)
    flops = 2 * S * H * L + 2 * H * V * L
    terms = (
        Term("partials read", f"splits {S} x H {H} x ({L} + 2) x 4 B", S * H * (L + 2) * 4,
             S * H * (L + 2) * 4),
        Term("wv_b", f"H {H} x {V} x {L} x {cb} B", H * V * L * cb, H * V * L * cb),
        Term("outputs", f"out H x {V} x 4 + latent H x {L} x 4 + lse H x 4",
             H * (V + L + 1) * 4, H * (V + L + 1) * 4),
    )
    return PhaseCost("combine", variant, flops,
                     f"2 x splits {S} x H {H} x {L} + 2 x H {H} x {V} x {L}", terms)


def q_absorb_cost(dims: Dims, cache_dtype: str = "f16", q_dtype: str = "f32") -> PhaseCost:
    """The control phase: q[h] = q_nope[h] @ wk_b[h] || q_rope[h]."""
    H, N, L, R, K = dims.n_head, dims.nope, dims.kv_lora, dims.rope, dims.key_dim
    cb, qb = _b(cache_dtype), _q_bytes(q_dtype, cache_dtype)
    terms = (
        Term("wk_b", f"H {H} x {N} x {L} x {cb} B", H * N * L * cb, H * N * L * cb),
        Term("q_nope, q_rope", f"H {H} x ({N} + {R}) x {cb} B", H * (N + R) * cb,
             H * (N + R) * cb),
        Term("q written", f"H {H} x {K} x {qb} B", H * K * qb, H * K * qb),
    )
    return PhaseCost("q_absorb", "-", 2 * H * N * L, f"2 x H {H} x {N} x {L}", terms)


def step_cost(variant: str, dims: Dims, n_ctx: int, cache_dtype: str = "f16",
              q_dtype: str = "f32", splits: int = 1) -> PhaseCost:
    """q_absorb + attn + combine: the whole decode step of one layer."""
    parts = [q_absorb_cost(dims, cache_dtype, q_dtype),
             attn_cost(variant, dims, n_ctx, cache_dtype, q_dtype, splits),
             combine_cost(variant, dims, cache_dtype, splits)]
    parts = [p for p in parts if p is not None]
    terms = tuple(Term(f"{p.phase}: {t.name}", t.formula, t.ideal, t.issued)
                  for p in parts for t in p.terms)
    return PhaseCost("step", variant, sum(p.flops for p in parts),
                     " + ".join(f"{p.phase} {p.flops:,}" for p in parts), terms)


def _visible_sum(n: int, s_q: int, causal: bool) -> int:
    """Positions the s_q queries of a request of length n see in all: s_q x n, or under
    `causal` n + (n - 1) + ... over the min(n, s_q) queries that see any, in closed form
    (the cost of a step must not grow with s_q)."""
    if not causal:
        return s_q * n
    m = min(n, s_q)
    return m * n - m * (m - 1) // 2


def paged_step_cost(variant: str, dims: Dims, lengths, s_q: int = 1, causal: bool = False,
                    cache_dtype: str = "f16", q_dtype: str = "f32", n_chunks=None,
                    head_blocks: int = 1, with_wv_b: bool = True) -> PhaseCost:
    """One paged decode step of a batch (attn + combine), request by request.

    lengths [B]: the requests' lengths; n_chunks [B]: the chunks each request runs
    (chunks.request_chunks), None for a kernel that writes no partials (a peer);
    head_blocks: the row blocks of a request, each of which streams its rows (as issued).
    Rows: n_rows = s_q x H per request; row r of query i sees visible(b, i) positions
    (len_b, or len_b - (s_q - 1 - i) under `causal`, at least 0), and the FLOPs count those.

        cache rows   sum_b len_b x 576 x cb           ideal; x head_blocks as issued
        q            B x n_rows x 576 x qb            ideal; x n_chunks_b as issued
        wv_b         H x 128 x 512 x cb               ideal; B x n_rows x 128 x 512 x cb issued
        partials     sum_b n_chunks_b x n_rows x (512 + 2) x 4 B, written once, read once
        outputs      B x n_rows x (128 + 512 + 1) x 4 B (out, latent, lse)
        FLOPs        2 x sum_(b,r) visible x (576 + 512) + 2 x B x n_rows x 128 x 512
    """
    lengths = [int(n) for n in lengths]
    if not lengths or min(lengths) < 0:
        raise ValueError(f"lengths must be one or more integers >= 0, got {lengths}")
    if s_q < 1 or head_blocks < 1:
        raise ValueError(f"s_q and head_blocks must be >= 1, got {s_q}, {head_blocks}")
    H, K, L, V = dims.n_head, dims.key_dim, dims.kv_lora, dims.v_head
    cb, qb = _b(cache_dtype), _q_bytes(q_dtype, cache_dtype)
    B, rows = len(lengths), s_q * H
    chunks = [0] * B if n_chunks is None else [int(c) for c in n_chunks]
    if len(chunks) != B:
        raise ValueError(f"n_chunks must have one entry per request ({B}), got {len(chunks)}")
    tokens = sum(lengths)
    seen = H * sum(_visible_sum(n, s_q, causal) for n in lengths)
    wv_flops = 2 * B * rows * V * L if with_wv_b else 0
    flops = 2 * seen * (K + L) + wv_flops
    flops_formula = (f"2 x visible row-positions {seen:,} x ({K} + {L})"
                     + (f" + 2 x B {B} x n_rows {rows} x {V} x {L}" if with_wv_b else ""))
    cache_once = tokens * K * cb
    part = sum(chunks) * rows * (L + 2) * 4
    out_w = (V + L + 1) if with_wv_b else (L + 1)
    terms = [
        Term("cache rows", f"sum of lengths {tokens:,} x {K} x {cb} B, once (ideal); x "
                           f"head_blocks {head_blocks} (as issued)", cache_once,
             cache_once * head_blocks),
        Term("q", f"B {B} x n_rows {rows} x {K} x {qb} B; x each request's chunks as issued",
             B * rows * K * qb, max(sum(chunks), B) * rows * K * qb),
    ]
    if with_wv_b:
        terms.append(Term("wv_b", f"H {H} x {V} x {L} x {cb} B once (ideal); once per row "
                                  f"B {B} x n_rows {rows} (as issued)", H * V * L * cb,
                          B * rows * V * L * cb))
    if part:
        terms.append(Term("partials", f"chunks run {sum(chunks)} x n_rows {rows} x ({L} + 2) "
                                      "x 4 B, written then read", 2 * part, 2 * part))
    terms.append(Term("outputs", f"B {B} x n_rows {rows} x {out_w} x 4 B"
                                 + (" (out, latent, lse)" if with_wv_b else " (latent, lse)"),
                      B * rows * out_w * 4, B * rows * out_w * 4))
    return PhaseCost("step", variant, flops, flops_formula, tuple(terms),
                     note="" if with_wv_b else "no wv_b projection")


def phase_cost(phase: str, variant: str, dims: Dims, n_ctx: int, cache_dtype: str = "f16",
               q_dtype: str = "f32", splits: int = 1) -> PhaseCost | None:
    if phase == "attn":
        return attn_cost(variant, dims, n_ctx, cache_dtype, q_dtype, splits)
    if phase == "combine":
        return combine_cost(variant, dims, cache_dtype, splits)
    if phase == "q_absorb":
        return q_absorb_cost(dims, cache_dtype, q_dtype)
    if phase == "step":
        return step_cost(variant, dims, n_ctx, cache_dtype, q_dtype, splits)
    raise ValueError(f"unknown phase {phase!r} (q_absorb, attn, combine, step)")


def rates(cost: PhaseCost, median_us: float, ceilings: dict | None = None) -> dict:
    """GB/s (ideal and as issued) and TFLOP/s at `median_us`, and their fractions of the
    measured ceilings ({'copy_GBps', 'gemm_TFLOPs', 'fma_TFLOPs'}; absent keys give None).
    `frac_fma` is the roof of the CUDA-core variants (their arithmetic is FFMA), `frac_gemm`
    that of the tensor-core ones; `roof` names the phase's own ('GEMM' or 'FMA', roof_of)
    and `frac_roof` is the fraction of it."""
    roof = roof_of(cost.variant, cost.phase)
    if median_us is None or not median_us > 0:
        return {"GBps_ideal": None, "GBps_issued": None, "TFLOPs": None,
                "frac_copy_ideal": None, "frac_copy_issued": None, "frac_gemm": None,
                "frac_fma": None, "roof": roof, "frac_roof": None}
    s = median_us * 1e-6
    out = {"GBps_ideal": cost.ideal_bytes / s / 1e9, "GBps_issued": cost.issued_bytes / s / 1e9,
           "TFLOPs": cost.flops / s / 1e12}
    copy = (ceilings or {}).get("copy_GBps")
    gemm = (ceilings or {}).get("gemm_TFLOPs")
    out["frac_copy_ideal"] = out["GBps_ideal"] / copy if copy else None
    out["frac_copy_issued"] = out["GBps_issued"] / copy if copy else None
    out["frac_gemm"] = out["TFLOPs"] / gemm if gemm else None
    fma = (ceilings or {}).get("fma_TFLOPs")
    out["frac_fma"] = out["TFLOPs"] / fma if fma else None
    out["roof"] = roof
    out["frac_roof"] = out["frac_gemm"] if roof == "GEMM" else out["frac_fma"]
    return out


# Families whose attention arithmetic runs on the tensor cores: their roof is the GEMM
# ceiling; every other kernel's arithmetic is FFMA on the CUDA cores.
TENSOR_CORE_FAMILIES = ("mma", "wgmma", "cublas")


def roof_of(variant: str, phase: str = "attn") -> str:
    """'GEMM' where the phase's arithmetic is tensor-core MMA (the attention of the mma and
    wgmma kernels, every phase of the cuBLAS engine), else 'FMA'."""
    try:
        family = registry.variant(variant).family
    except ValueError:  # q_absorb's control row and other non-variant costs
        return "FMA"
    if family == "cublas" or (family in TENSOR_CORE_FAMILIES and phase in ("attn", "step")):
        return "GEMM"
    return "FMA"


def _fmt_bytes(n: int) -> str:
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"


def explain_lines(cost: PhaseCost) -> list[str]:
    """The formulas of one phase, one line per term, with their values."""
    lines = [f"{cost.phase} [{cost.variant}]: FLOPs = {cost.flops_formula} = {cost.flops:,}"]
    for t in cost.terms:
        same = t.ideal == t.issued
        val = _fmt_bytes(t.ideal) if same else (f"ideal {_fmt_bytes(t.ideal)}, "
                                                f"as issued {_fmt_bytes(t.issued)}")
        lines.append(f"    {t.name}: {t.formula} -> {val}")
    lines.append(f"    total: ideal {_fmt_bytes(cost.ideal_bytes)}, as issued "
                 f"{_fmt_bytes(cost.issued_bytes)}")
    if cost.note:
        lines.append(f"    note: {cost.note}")
    return lines
