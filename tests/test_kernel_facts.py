"""One source for every kernel fact: the registry's launch values meet each kernel's own.

The registry computes each kernel's block size, tile and dynamic shared memory and passes
them to every NVRTC compile (registry.compile_defines); each kernel static_asserts them
against its constants and layout struct. These tests show the check has power: a value one
byte off fails the compile of the instance it describes, with the kernel's message. The
compiles that `regs` and test_ptxas.py run for every instance show the right values pass.
A compile stops at the front end when a static_assert fails, so the failing cases are cheap.
"""
from __future__ import annotations

import pytest

from mlasandbox import ptxas, registry, toolkit
from mlasandbox.sources import read_source


def _with(monkeypatch, macro: str, value: str) -> None:
    """Compile with the registry's launch values, but `macro` set to `value`."""
    real = registry.compile_defines()
    assert any(d.startswith(f"-D{macro}=") for d in real), macro
    patched = tuple(f"-D{macro}={value}" if d.startswith(f"-D{macro}=") else d for d in real)
    monkeypatch.setattr(registry, "compile_defines", lambda: patched)


def _compile(inst) -> None:
    ptxas.compile_log(read_source(inst.source), [inst.expression], arch="sm_90",
                      filename=inst.source)


def _smem_pairs(inst, delta: int) -> str:
    f = inst.family
    return ",".join(f"{h},{f.smem(h) + (delta if h == inst.heads else 0)}" for h in f.heads)


def test_every_compile_carries_the_launch_values():
    opts = toolkit.compile_options("sm_90")
    assert "-DMLA_REGISTRY_FACTS" in opts
    for f in registry.FAMILIES.values():
        assert f"-DMLA_{f.macro}_THREADS={f.threads}" in opts, f.kind
        if f.smem is not None:
            pairs = ",".join(f"{h},{f.smem(h)}" for h in f.heads)
            assert f"-DMLA_{f.macro}_SMEM={pairs}" in opts, f.kind


def test_every_kernel_checks_the_values_it_is_launched_with():
    # each source that defines a family's kernel reads that family's launch values
    for f in registry.FAMILIES.values():
        text = read_source(f.source)
        assert "#ifdef MLA_REGISTRY_FACTS" in text, f.source
        assert f"MLA_{f.macro}_THREADS" in text, f.source
        if f.tile_rows:
            assert f"MLA_{f.macro}_TILE" in text, f.source
        if f.smem is not None:
            assert f"registry_fact(" in text and f"MLA_{f.macro}_SMEM" in text, f.source


@pytest.mark.parametrize("inst", [
    registry.rows_instance(), registry.attn_instance(12), registry.tiled_instance(16),
    registry.mma_instance(32)], ids=str)
def test_a_wrong_smem_value_fails_the_compile(monkeypatch, inst):
    _with(monkeypatch, f"MLA_{inst.family.macro}_SMEM", _smem_pairs(inst, 16))
    with pytest.raises(ptxas.NvrtcCompileError, match="smem_bytes.*differs from"):
        _compile(inst)


def test_the_right_smem_value_passes_and_a_wrong_one_for_another_instance_does_not_matter(
        monkeypatch):
    # attn<2>'s entry is off by 16 bytes: attn<12> still compiles, attn<2> does not
    a12, a2 = registry.attn_instance(12), registry.attn_instance(2)
    _with(monkeypatch, "MLA_ATTN_SMEM", _smem_pairs(a2, 16))
    _compile(a12)
    with pytest.raises(ptxas.NvrtcCompileError, match="attn_smem_bytes"):
        _compile(a2)


@pytest.mark.parametrize("macro, inst, message", [
    ("MLA_ROWS_THREADS", registry.rows_instance(), "ROWS_THREADS"),
    ("MLA_MMA_TILE", registry.mma_instance(16), "MMA_TILE"),
    ("MLA_COMBINE_COL_BLOCKS", registry.combine_instance(), "COMBINE_COL_BLOCKS"),
    ("MLA_Q_ABSORB_THREADS", registry.q_absorb_instance(), "Q_ABSORB_THREADS"),
    ("MLA_Q_ABSORB_COL_BLOCKS", registry.q_absorb_instance(), "Q_ABSORB_COL_BLOCKS"),
    ("MLA_PROJECT_THREADS", registry.project_instance(), "PROJECT_THREADS"),
    ("MLA_PROJECT_V_ROWS", registry.project_instance(), "PROJECT_V_ROWS"),
    ("MLA_PROJECT_M_ROWS", registry.project_instance("bf16"), "PROJECT_M_ROWS"),
    ("MLA_PROJECT_WIDE_THREADS", registry.project_instance("f16", "project_wide"), "PROJECT_THREADS"),
    ("MLA_PROJECT_WIDE_V_ROWS", registry.project_instance("f16", "project_wide"), "PROJECT_WIDE_V_ROWS"),
    ("MLA_PROJECT_WIDE_M_ROWS", registry.project_instance("bf16", "project_wide"), "PROJECT_WIDE_M_ROWS"),
], ids=lambda x: x if isinstance(x, str) else str(x))
def test_a_wrong_block_or_tile_fails_the_compile(monkeypatch, macro, inst, message):
    real = next(d for d in registry.compile_defines() if d.startswith(f"-D{macro}="))
    _with(monkeypatch, macro, str(int(real.split("=", 1)[1]) * 2))
    with pytest.raises(ptxas.NvrtcCompileError, match=message):
        _compile(inst)


# ---------------------------------------------------------------------------- instances

def test_names_and_expressions_follow_from_the_fields():
    inst = registry.attn_instance(12, "bf16", "f32")
    assert (inst.kind, inst.heads, inst.cache, inst.q) == ("attn", 12, "bf16", "f32")
    assert inst.name == "attn<heads=12,cache=bf16,q=f32>"
    assert inst.expression == "mla::attn<12, __nv_bfloat16, float>"
    mma = registry.mma_instance(32, "f16", "f16")
    assert mma.expression == "mla::mma_attn<32, __half, __half, false>"  # heads, like every family
    assert mma.name == "mma_attn<heads=32,cache=f16,q=f16,round_p=false>"
    mma_r = registry.attention_instance(registry.variant("mma32r"), "f16", "f16")
    assert mma_r.expression == "mla::mma_attn<32, __half, __half, true>"
    assert mma_r.name == "mma_attn<heads=32,cache=f16,q=f16,round_p=true>" and mma_r.round_p
    rows = registry.rows_instance("f16", "f32")
    assert rows.heads == 1 and rows.name == "attn_rows<cache=f16,q=f32>"
    c = registry.combine_instance("bf16", rescale=False)
    assert c.name == "combine<cache=bf16,rescale=false,prefetch=8>" and c.q is None
    assert c.expression == "mla::combine<__nv_bfloat16, false, 8>"
    assert registry.q_absorb_instance("f16", "f16").name == "q_absorb<cache=f16,q=f16>"
    p = registry.project_instance("bf16")
    assert p.name == "project<cache=bf16>" and p.expression == "mla::project<__nv_bfloat16>"
    w = registry.project_instance("f16", "project_wide")
    assert w.name == "project_wide<cache=f16>" and w.expression == "mla::project_wide<__half>"


def test_every_instance_has_a_distinct_name_and_its_familys_values():
    insts = registry.all_instances()
    assert len({i.name for i in insts}) == len(insts) == len(set(insts))
    for i in insts:
        f = registry.FAMILIES[i.kind]
        assert (i.source, i.threads, i.tile_rows, i.min_arch) == (
            f.source, f.threads, f.tile_rows, f.min_arch)
        assert i.smem_bytes == (f.smem(i.heads) if f.smem else 0)
    arch = {i.kind: i.min_arch for i in insts}
    assert arch["attn_tiled"] == "sm_90"  # mbarrier.try_wait.parity
    assert arch["attn"] == arch["attn_rows"] == arch["mma_attn"] == "sm_80"  # cp.async


@pytest.mark.parametrize("make, args", [
    (registry.mma_instance, (24,)), (registry.tiled_instance, (8,)),
    (registry.attn_instance, (3,)), (registry.attn_instance, (12, "f32")),
])
def test_instances_that_are_not_built_are_refused(make, args):
    with pytest.raises(ValueError, match="heads per block|heads_per_block|dtype"):
        make(*args)


# ---------------------------------------------------------------------------- the resolver

def test_resolve_variant():
    rv = registry.resolve_variant
    assert rv("batched", 12).name == "batched12"
    assert rv("batched", 1).name == "split"
    assert rv("batched", default_hpb=16).name == "batched16"
    assert rv("mma32").hpb == 32 and rv("mma32", 32).name == "mma32"
    assert rv("split", 1).name == "split" and rv("cublas", 1).name == "cublas"
    with pytest.raises(ValueError, match="needs --hpb"):
        rv("batched", option="--hpb")
    with pytest.raises(ValueError, match="heads_per_block must be one of"):
        rv("batched", 3)
    with pytest.raises(ValueError, match="heads_per_block=8 contradicts"):
        rv("batched12", 8)
    with pytest.raises(ValueError, match="serves 1 head"):
        rv("per_head", 4)
    with pytest.raises(ValueError, match="unknown variant"):
        rv("batched7")


def test_the_cuda_dims_check():
    registry.check_cuda_dims(512, 64)
    with pytest.raises(ValueError, match="built for kv_lora=512, rope=64; got kv_lora=256"):
        registry.check_cuda_dims(256, 64)


# ------------------------------------------------------------ every launch value, with power

def _reader_of(macro: str):
    """An instance whose compile static_asserts `macro`: the family's own for
    MLA_<F>_THREADS / _TILE / _SMEM, else the kernel of that small-phase fact."""
    small = {
        "MLA_COMBINE_COL_BLOCKS": registry.combine_instance(),
        "MLA_COMBINE_PREFETCH": registry.combine_instance(),
        "MLA_COMBINE_DEEP_PREFETCH": registry.paged_combine_instance(
            "f16", True, registry.COMBINE_DEEP_PREFETCH),
        "MLA_COMBINE_WARP_COL_BLOCKS": registry.paged_merge_instance(registry.WARP_MERGE),
        "MLA_COMBINE_WARP_PREFETCH": registry.paged_merge_instance(registry.WARP_MERGE),
        # the paged walk (mla_walk.cuh) of a kernel that merges its own chunks
        "MLA_ATTN_MERGE_MAX_CHUNKS": registry.paged_attention_instance("mma16", "f16", "f16"),
        "MLA_Q_ABSORB_COL_BLOCKS": registry.q_absorb_instance(),
        "MLA_PROJECT_V_ROWS": registry.project_instance(),
        "MLA_PROJECT_M_ROWS": registry.project_instance(),
        "MLA_PROJECT_WIDE_V_ROWS": registry.project_instance("f16", "project_wide"),
        "MLA_PROJECT_WIDE_M_ROWS": registry.project_instance("f16", "project_wide"),
    }
    if macro in small:
        return small[macro]
    fam = macro[len("MLA_"):].rsplit("_", 1)[0]
    return next(i for i in registry.all_instances() if i.family.macro == fam)


LAUNCH_VALUES = [d[2:].split("=", 1)[0] for d in registry.compile_defines() if "=" in d]


@pytest.mark.parametrize("macro", LAUNCH_VALUES)
def test_every_launch_value_is_checked_by_a_compile(monkeypatch, macro):
    """Each -D the registry passes is static_asserted by a kernel that reads it: the value
    one step off (a smem entry 16 bytes more, any other value doubled) stops that compile at
    a static_assert, whatever the macro (a new one without a check fails here)."""
    inst = _reader_of(macro)
    if macro.endswith("_SMEM"):
        wrong = _smem_pairs(inst, 16)
    else:
        real = next(d for d in registry.compile_defines() if d.startswith(f"-D{macro}="))
        wrong = str(int(real.split("=", 1)[1]) * 2)
    _with(monkeypatch, macro, wrong)
    arch = inst.min_arch if inst.min_arch.endswith("a") else "sm_90"
    with pytest.raises(ptxas.NvrtcCompileError, match="static assertion failed"):
        ptxas.compile_log(read_source(inst.source), [inst.expression], arch=arch,
                          filename=inst.source)
