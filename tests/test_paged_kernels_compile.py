"""The paged kernels compile under NVRTC for sm_90, fit in registers, and check their facts.

No GPU: NVRTC and ptxas run on the host. Every paged launch (split, batched<HPB>, mma16/32,
the paged combine and its negative control, the index validator) is compiled once with the
registry's launch values; a value off by one byte or doubled fails the paged compile as it
fails the batch-1 one, since both launches run the same body with the same static_asserts.
"""
from __future__ import annotations

import pytest

from mlasandbox import ptxas, registry
from mlasandbox.sources import read_source

PAGED = [i for i in registry.all_instances() if i.paged]


@pytest.fixture(scope="module")
def report():
    return ptxas.ptxas_report(PAGED, arch="sm_90")


def test_every_paged_family_has_instances():
    assert {i.kind for i in PAGED} == set(registry.PAGED_KINDS) == {
        "attn_rows", "attn", "mma_attn", "wgmma_attn", "combine", "combine_warp", "check_paged"}
    for var in ("split", "batched2", "batched24", "mma16", "mma32"):
        for cache, q in (("f16", "f32"), ("bf16", "bf16")):
            assert registry.paged_attention_instance(var, cache, q) in PAGED


def test_every_paged_instance_compiles_without_spills(report):
    assert list(report) == [i.name for i in PAGED]
    for inst in PAGED:
        r = report[inst.name]
        assert 0 < r.registers <= 255, inst.name
        assert r.smem_bytes + inst.smem_bytes <= 227 * 1024, inst.name
        # the combine without its rescale is a negative control, as in test_ptxas.py
        if "rescale=false" not in inst.name:
            assert r.spill_stores == 0 and r.spill_loads == 0, f"{inst.name} spills"


def test_paged_mma_stays_within_the_batch_1_register_budget():
    # The paged path adds the chunk rule, the table lookups and the causal limits; the
    # tensor-core kernels hold q in registers for a whole slice, so their paged launches
    # must stay close to the batch-1 counts (a few registers), not merely under 255. The
    # budget of a (heads, cache) pair is its batch-1 kernel with an f32 q, which holds q's hi
    # and lo fragments (72 registers): the register wall. A 16-bit q holds only hi (36), so
    # its kernels sit well under that wall, and their paged launches are held to it too.
    budget, paged = {}, []
    for h in registry.MMA_HEADS:
        for c in ("f16", "bf16"):
            budget[h, c] = registry.mma_instance(h, c, "f32")
            paged += [registry.paged_attention_instance(f"mma{h}", c, q) for q in ("f32", c)]
    rep = ptxas.ptxas_report([*budget.values(), *paged], arch="sm_90")
    for inst in paged:
        limit = rep[budget[inst.heads, inst.cache].name].registers + 8
        assert rep[inst.name].registers <= limit, (inst.name, rep[inst.name].registers, limit)


def _compile_with(monkeypatch, inst, macro, value):
    real = registry.compile_defines()
    assert any(d.startswith(f"-D{macro}=") for d in real), macro
    patched = tuple(f"-D{macro}={value}" if d.startswith(f"-D{macro}=") else d for d in real)
    monkeypatch.setattr(registry, "compile_defines", lambda: patched)
    ptxas.compile_log(read_source(inst.source), [inst.expression], arch="sm_90",
                      filename=inst.source)


def _smem_pairs(inst, delta):
    f = inst.family
    return ",".join(f"{h},{f.smem(h) + (delta if h == inst.heads else 0)}" for h in f.heads)


@pytest.mark.parametrize("inst, macro, value, message", [
    (registry.paged_attention_instance("mma16"), "MLA_MMA_SMEM",
     _smem_pairs(registry.mma_instance(16), 16), "mma_smem_bytes"),
    (registry.paged_attention_instance("batched12"), "MLA_ATTN_SMEM",
     _smem_pairs(registry.attn_instance(12), 16), "attn_smem_bytes"),
    (registry.paged_attention_instance("split"), "MLA_ROWS_THREADS", "256", "ROWS_THREADS"),
    (registry.paged_attention_instance("mma32"), "MLA_MMA_TILE", "128", "MMA_TILE"),
    (registry.paged_combine_instance(), "MLA_COMBINE_COL_BLOCKS", "8", "COMBINE_COL_BLOCKS"),
    (registry.paged_check_instance(), "MLA_CHECK_THREADS", "256", "CHECK_THREADS"),
], ids=lambda x: x if isinstance(x, str) and x.startswith("MLA_") else None)
def test_a_wrong_fact_fails_the_paged_compile(monkeypatch, inst, macro, value, message):
    with pytest.raises(ptxas.NvrtcCompileError, match=message):
        _compile_with(monkeypatch, inst, macro, value)


def test_the_validator_compiles_and_reads_its_launch_value(report):
    check = registry.paged_check_instance()
    assert check.name == "check_paged" and check.expression == "mla::check_paged"
    assert check.threads == registry.CHECK_THREADS and check.smem_bytes == 0
    assert report[check.name].registers > 0
    assert "MLA_CHECK_THREADS" in read_source(check.source)


def test_paged_names_expressions_and_facts():
    mma = registry.paged_attention_instance("mma16", "f16", "f32")
    assert mma.name == "mma_attn<heads=16,cache=f16,q=f32,round_p=false,paged=true>"
    assert mma.expression == "mla::mma_attn_paged<16, __half, float, false>"
    rounded = registry.paged_attention_instance("mma16r", "f16", "f32")
    assert rounded.name == "mma_attn<heads=16,cache=f16,q=f32,round_p=true,paged=true>"
    assert rounded.expression == "mla::mma_attn_paged<16, __half, float, true>"
    assert rounded.round_p and not mma.round_p
    flat = registry.mma_instance(16, "f16", "f32")
    assert (mma.threads, mma.tile_rows, mma.smem_bytes, mma.min_arch) == (
        flat.threads, flat.tile_rows, flat.smem_bytes, flat.min_arch)
    assert mma != flat and flat.name == "mma_attn<heads=16,cache=f16,q=f32,round_p=false>"
    rows = registry.paged_attention_instance(registry.variant("split"), "bf16", "bf16")
    assert rows.expression == "mla::attn_rows_paged<__nv_bfloat16, __nv_bfloat16>"
    assert registry.paged_attention_instance("batched8").expression == \
        "mla::attn_paged<8, __half, float>"
    comb = registry.paged_combine_instance("bf16", rescale=False)
    assert comb.name == "combine<cache=bf16,rescale=false,prefetch=8,paged=true>"
    assert comb.expression == "mla::combine_paged<__nv_bfloat16, false, 8>"
    deep = registry.paged_combine_instance("f16", True, registry.COMBINE_DEEP_PREFETCH)
    assert deep.name == "combine<cache=f16,rescale=true,prefetch=16,paged=true>"
    assert deep.expression == "mla::combine_paged<__half, true, 16>"
    assert comb.min_arch == "sm_75" and registry.paged_check_instance().min_arch == "sm_75"


@pytest.mark.parametrize("name, why", [
    ("per_head", "batch 1"), ("tiled16", "batch 1"), ("cublas", "no attention kernel")])
def test_batch_1_only_variants_have_no_paged_instance(name, why):
    with pytest.raises(ValueError, match=f"{name} .*{why}.*paged kernels: split"):
        registry.paged_attention_instance(name)


def test_a_paged_instance_of_a_batch_1_family_is_refused():
    with pytest.raises(ValueError, match="q_absorb has no paged launch"):
        registry.KernelInstance("q_absorb", "f16", "f32", paged=True)
