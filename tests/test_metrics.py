"""The byte and FLOP formulas, term by term (CPU)."""
from __future__ import annotations

import pytest

from mlasandbox import metrics
from mlasandbox.dims import PRESETS, Dims

LECTURE = PRESETS["h96"]  # 96 heads
N = 131072


def test_attn_per_head_streams_the_cache_once_per_head():
    c = metrics.attn_cost("per_head", LECTURE, N, "f16", "f32", splits=1)
    cache_once = N * 576 * 2
    assert cache_once == 150_994_944            # "302 MB" is 2 layers' worth
    terms = {t.name: t for t in c.terms}
    assert terms["cache rows"].ideal == cache_once
    assert terms["cache rows"].issued == 96 * cache_once   # once per head: 96 times
    assert terms["q"].ideal == 96 * 576 * 4
    assert terms["partials written"].ideal == 96 * 514 * 4
    assert c.ideal_bytes == cache_once + 96 * 576 * 4 + 96 * 514 * 4
    assert c.flops == 2 * 96 * N * (576 + 512)


def test_attn_batched_divides_the_issued_cache_by_heads_per_block():
    c = metrics.attn_cost("batched12", LECTURE, N, "f16", "f32", splits=33)
    terms = {t.name: t for t in c.terms}
    assert terms["cache rows"].issued == 8 * N * 576 * 2   # ceil(96 / 12) head blocks
    assert terms["q"].issued == 33 * 96 * 576 * 4
    assert terms["partials written"].ideal == 33 * 96 * 514 * 4
    # a partial head group still streams the whole cache
    c13 = metrics.attn_cost("batched12", Dims(n_head=13), 100, "f16", "f16", splits=1)
    assert {t.name: t for t in c13.terms}["cache rows"].issued == 2 * 100 * 576 * 2
    assert {t.name: t for t in c13.terms}["q"].ideal == 13 * 576 * 2


def test_combine_and_q_absorb():
    c = metrics.combine_cost("split", LECTURE, "bf16", splits=4)
    assert c.flops == 2 * 4 * 96 * 512 + 2 * 96 * 128 * 512
    assert c.ideal_bytes == 4 * 96 * 514 * 4 + 96 * 128 * 512 * 2 + 96 * (128 + 512 + 1) * 4
    cc = metrics.combine_cost("cublas", LECTURE, "f16")
    assert cc.flops == 2 * 96 * 128 * 512 and cc.ideal_bytes == 96 * 512 * 4 + 96 * 128 * 512 * 2 + 96 * 128 * 4
    qa = metrics.q_absorb_cost(LECTURE, "f16", "f32")
    assert qa.flops == 2 * 96 * 128 * 512
    assert qa.ideal_bytes == 96 * 128 * 512 * 2 + 96 * 192 * 2 + 96 * 576 * 4


def test_cublas_attn_counts_its_score_passes_and_leaves_wv_b_to_its_combine():
    c = metrics.attn_cost("cublas", LECTURE, 1000, "f16", "f32")
    assert c.flops == 2 * 96 * 1000 * 1088
    terms = {t.name: t for t in c.terms}
    assert terms["cache rows"].issued == 1000 * (576 + 512) * 2
    assert terms["score matrix passes"].issued == 96 * 1000 * metrics.CUBLAS_SCORE_BYTES
    assert terms["score matrix passes"].ideal == 0
    assert metrics.CUBLAS_SCORE_BYTES == 28
    assert "wv_b" in c.note and "wv_b" not in {t.name for t in c.terms}


def test_step_is_the_sum_of_its_phases():
    s = metrics.step_cost("split", LECTURE, 8192, "f16", "f32", splits=16)
    parts = [metrics.q_absorb_cost(LECTURE), metrics.attn_cost("split", LECTURE, 8192, splits=16),
             metrics.combine_cost("split", LECTURE, splits=16)]
    assert s.flops == sum(p.flops for p in parts)
    assert s.ideal_bytes == sum(p.ideal_bytes for p in parts)
    assert s.issued_bytes == sum(p.issued_bytes for p in parts)
    assert metrics.phase_cost("step", "split", LECTURE, 8192, splits=16).flops == s.flops
    with pytest.raises(ValueError):
        metrics.phase_cost("nope", "split", LECTURE, 1)
    with pytest.raises(ValueError):
        metrics.attn_cost("split", LECTURE, 0)
    with pytest.raises(ValueError):
        metrics.attn_cost("split", LECTURE, 1, cache_dtype="f8")


def test_rates_and_fractions_of_the_ceilings():
    c = metrics.attn_cost("per_head", LECTURE, N, splits=1)
    r = metrics.rates(c, 6000.0, {"copy_GBps": 4000.0, "gemm_TFLOPs": 700.0, "fma_TFLOPs": 65.0})
    assert r["GBps_ideal"] == pytest.approx(c.ideal_bytes / 6e-3 / 1e9)
    assert r["GBps_issued"] == pytest.approx(c.issued_bytes / 6e-3 / 1e9)
    assert r["TFLOPs"] == pytest.approx(c.flops / 6e-3 / 1e12)
    assert r["frac_copy_ideal"] == pytest.approx(r["GBps_ideal"] / 4000.0)
    assert r["frac_gemm"] == pytest.approx(r["TFLOPs"] / 700.0)
    assert r["frac_fma"] == pytest.approx(r["TFLOPs"] / 65.0)
    # as issued beyond the copy ceiling: L2 served the reuse
    assert r["frac_copy_issued"] > 0.5
    assert metrics.rates(c, 6000.0)["frac_copy_ideal"] is None
    assert metrics.rates(c, 6000.0)["frac_fma"] is None
    assert metrics.rates(c, None)["GBps_ideal"] is None


def test_explain_lines_spell_out_every_term():
    lines = metrics.explain_lines(metrics.attn_cost("batched12", LECTURE, N, splits=33))
    text = "\n".join(lines)
    assert "FLOPs = 2 x H 96 x n_ctx 131072 x (576 + 512)" in text
    assert "x head_blocks 8" in text and "as issued" in text and "total: ideal" in text
    assert metrics.explain_lines(metrics.attn_cost("cublas", LECTURE, 64))[-1].startswith(
        "    note:")


def test_the_paged_wgmma_step_is_measured_against_the_gemm_roof():
    # wgmma64 serves the paged step only; its products are tensor-core MMA like mma16's
    from mlasandbox.dims import Dims

    ceil = {"copy_GBps": 4000.0, "gemm_TFLOPs": 700.0, "fma_TFLOPs": 65.0}
    for v in ("wgmma64", "mma16"):
        c = metrics.paged_step_cost(v, Dims(n_head=128), [4096] * 4, 1, False, "f16", "f16",
                                    [1] * 4, 2)
        r = metrics.rates(c, 100.0, ceil)
        assert r["roof"] == "GEMM" and r["frac_roof"] == pytest.approx(r["TFLOPs"] / 700.0)


@pytest.mark.parametrize("variant, phase, roof", [
    ("mma16", "attn", "GEMM"), ("mma32", "step", "GEMM"), ("cublas", "attn", "GEMM"),
    ("mma16", "combine", "FMA"), ("tiled16", "attn", "FMA"), ("batched12", "attn", "FMA"),
    ("split", "step", "FMA"),
])
def test_each_phase_is_measured_against_its_own_roof(variant, phase, roof):
    c = metrics.phase_cost(phase, variant, LECTURE, 131072, splits=8)
    ceil = {"copy_GBps": 4000.0, "gemm_TFLOPs": 700.0, "fma_TFLOPs": 65.0}
    r = metrics.rates(c, 100.0, ceil)
    assert r["roof"] == roof == metrics.roof_of(variant, phase)
    assert r["frac_roof"] == (r["frac_gemm"] if roof == "GEMM" else r["frac_fma"])
    assert r["frac_roof"] == pytest.approx(r["TFLOPs"] / (700.0 if roof == "GEMM" else 65.0))


def test_a_paged_step_and_a_peer_step_counted_by_hand():
    """paged_step_cost term by term on a causal batch small enough to count: lengths 0, 5 and
    70, s_q 2, 4 heads (8 rows a request), f16 cache and q, chunks 0, 2, 3, two head blocks."""
    from mlasandbox.dims import Dims

    d = Dims(n_head=4)
    c = metrics.paged_step_cost("mma16", d, [0, 5, 70], 2, True, "f16", "f16", [0, 2, 3], 2)
    # visible positions: 0 + (4 + 5) + (69 + 70) = 148 a head
    assert c.flops == 2 * 4 * 148 * (576 + 512) + 2 * 3 * 8 * 128 * 512
    terms = {t.name: (t.ideal, t.issued) for t in c.terms}
    assert terms == {"cache rows": (75 * 576 * 2, 2 * 75 * 576 * 2),
                     "q": (3 * 8 * 576 * 2, 5 * 8 * 576 * 2),        # once a chunk run
                     "wv_b": (4 * 128 * 512 * 2, 3 * 8 * 128 * 512 * 2),
                     "partials": (2 * 5 * 8 * 514 * 4,) * 2,
                     "outputs": (3 * 8 * 641 * 4,) * 2}
    # a peer: no partials, q read once a request, no wv_b
    p = metrics.paged_step_cost("flashmla", d, [0, 5, 70], 2, True, "f16", "f16", None, 1,
                                with_wv_b=False)
    assert p.flops == 2 * 4 * 148 * (576 + 512)
    assert {t.name: (t.ideal, t.issued) for t in p.terms} == {
        "cache rows": (75 * 576 * 2,) * 2, "q": (3 * 8 * 576 * 2,) * 2,
        "outputs": (3 * 8 * 513 * 4,) * 2}
