"""The wgmma family without a GPU: NVRTC builds it for sm_90a, and only for sm_90a.

NVRTC and ptxas run on the host. The kernel compiles for sm_90a with the registry's launch
values (ptxas report: registers, no spills, shared memory within an SM), the cubin the loader
hands to CuPy comes out of the same compile, a plain sm_90 compile stops at the source's
#error, a registry fact one byte off fails the compile, and the arch checks refuse every
device but sm_90.
"""
from __future__ import annotations

import re

import pytest

from mlasandbox import arch_specific, archs, elf, paged_api, ptxas, registry
from mlasandbox.sources import read_source
from ptx_watch import FTZ_ENTRY, FTZ_SOURCE, flush_forms, watch_ptx

INSTANCES = [registry.wgmma_instance(c, c) for c in ("f16", "bf16")]
# the instance of a single-pass plan, which skips the partials (registry.wgmma_instance)
NO_PARTIALS = [registry.wgmma_instance(c, c, partials=False) for c in ("f16", "bf16")]


@pytest.fixture(scope="module")
def report():
    return ptxas.ptxas_report(INSTANCES + NO_PARTIALS, arch="sm_90")


def test_the_registry_holds_the_paged_only_family():
    inst = registry.paged_attention_instance("wgmma64", "bf16", "bf16")
    assert inst == INSTANCES[1] and inst.paged and inst.heads == 64
    assert inst.name == "wgmma_attn<cache=bf16,q=bf16,partials=true,paged=true>"
    assert inst.expression == "mla::wgmma_attn_paged<__nv_bfloat16, __nv_bfloat16, true>"
    single = NO_PARTIALS[1]
    assert single.name == "wgmma_attn<cache=bf16,q=bf16,partials=false,paged=true>"
    assert single.expression == "mla::wgmma_attn_paged<__nv_bfloat16, __nv_bfloat16, false>"
    assert single != inst and (single.threads, single.smem_bytes) == (256, inst.smem_bytes)
    assert (inst.threads, inst.tile_rows, inst.min_arch) == (256, 64, "sm_90a")
    assert inst.smem_bytes == registry.wgmma_smem_bytes(64) <= 227 * 1024
    assert set(INSTANCES + NO_PARTIALS) <= set(registry.all_instances())
    assert "wgmma64" in paged_api.paged_variant_names()
    assert "wgmma64" not in registry.variant_names()  # the batch-1 commands do not offer it


def test_an_f32_q_is_refused_by_name():
    with pytest.raises(ValueError, match="q in the cache dtype"):
        registry.wgmma_instance("f16", "f32")


def test_ptxas_reports_it_for_sm_90a_without_spills(report):
    for inst in INSTANCES + NO_PARTIALS:
        r = report[inst.name]
        assert r.arch == "sm_90a", inst.name
        assert 0 < r.registers <= 255 and not r.spills, (inst.name, r)
        assert r.stack_bytes == 0 and r.smem_bytes + inst.smem_bytes <= 227 * 1024


def test_the_loader_gets_a_cubin_and_the_lowered_name():
    inst = INSTANCES[0]
    cubin, lowered = arch_specific.compile_cubin(read_source(inst.source), inst.expression,
                                                 "sm_90a", filename=inst.source)
    assert cubin[:4] == b"\x7fELF" and len(cubin) > 10_000
    elf.text_sizes(cubin)  # whole: a cubin cut short raises ElfError
    assert lowered.startswith("_ZN3mla16wgmma_attn_paged")


def test_the_loader_compiles_with_ftz_as_cupy_does(monkeypatch):
    """compile_cubin's -ftz=true reaches NVRTC: an sm_90a kernel flushes denormals like
    every kernel cupy.RawModule builds (and like the code `regs` reports on)."""
    ptx = watch_ptx(monkeypatch)
    cubin, lowered = arch_specific.compile_cubin(FTZ_SOURCE, FTZ_ENTRY, "sm_90a")
    assert cubin[:4] == b"\x7fELF" and lowered == FTZ_ENTRY and len(ptx) == 1
    assert flush_forms(ptx[0]) == {"mul": [True], "ex2": [True]}, (
        f"compile_cubin compiled without -ftz=true:\n{ptx[0]}")


def test_a_plain_sm_90_compile_stops_at_the_guard():
    inst = INSTANCES[0]
    with pytest.raises(ptxas.NvrtcCompileError, match="compile it for sm_90a"):
        ptxas.compile_log(read_source(inst.source), [inst.expression], arch="sm_90")


# An accumulator read between a wgmma and its wait: ptxas makes the products synchronous and
# says so in a (C75xx) line, the kind of line the seesaw's branches and its own wgmma.fence
# exist to avoid. The wording differs by version: "wgmma.wait_group is injected" (NVRTC 13.5),
# "warpgroup.wait is injected ... registers defined by GMMA" (13.0, the H200 image's). The
# planted product reads real shared-memory descriptors: 13.0's ptxas crashes (SIGSEGV) on one
# built from zero descriptors.
_PLANTED_SERIALIZED = r"""
extern "C" __global__ void __launch_bounds__(128, 1) planted_serialized(float* out) {
    __shared__ __align__(1024) unsigned char ab[2 * 8192];  // A and B, 64 x 64 each
    for (int i = threadIdx.x; i < 2 * 8192 / 16; i += 128)
        reinterpret_cast<uint4*>(ab)[i] = make_uint4(0u, 0u, 0u, 0u);
    mla::fence_proxy_async();
    __syncthreads();
    const unsigned a = mla::smem_u32(ab);
    float d[32];
    for (int i = 0; i < 32; ++i) d[i] = 0.f;
    mla::wgmma_fence();
    const mla::Sw128Desc ad(a, 16, 1024);
    mla::WgmmaF16::m64n64(d, ad.at(0), ad.at(8192));
    mla::wgmma_commit();
    out[threadIdx.x] = d[0];
    mla::wgmma_wait<0>();
    for (int i = 1; i < 32; ++i) out[threadIdx.x + 128 * i] = d[i];
}
"""


def _wgmma_sync_lines(log: str) -> list[str]:
    return [line for line in log.splitlines()
            if "(C75" in line and re.search(r"gmma|warpgroup", line, re.IGNORECASE)]


def test_the_check_reads_both_ptxas_wordings():
    local = ("ptxas info    : (C7517) wgmma.wait_group is injected in around line 102 by "
             "compiler to allow use of registers defined by GMMA in function 'k'")
    device = ("ptxas info    : (C7517) warpgroup.wait is injected in around line 170 by "
              "compiler to allow use of registers defined by GMMA in function 'k'")
    other = "ptxas info    : Used 229 registers, used 1 barriers"
    assert _wgmma_sync_lines("\n".join((local, other, device))) == [local, device]


def test_ptxas_keeps_every_wgmma_asynchronous():
    source = read_source(INSTANCES[0].source)
    log, _ = ptxas.compile_log(source, [i.expression for i in INSTANCES + NO_PARTIALS],
                               arch="sm_90a", filename=INSTANCES[0].source)
    assert "Used" in log and not _wgmma_sync_lines(log), log
    # negative control: the same check reports a planted synchronous read
    planted, _ = ptxas.compile_log(source + _PLANTED_SERIALIZED, ["planted_serialized"],
                                   arch="sm_90a", filename=INSTANCES[0].source)
    assert _wgmma_sync_lines(planted), planted


def test_a_wrong_smem_fact_fails_the_compile(monkeypatch):
    inst = INSTANCES[1]
    real = registry.compile_defines()
    patched = tuple(f"-DMLA_WGMMA_SMEM=64,{inst.smem_bytes + 16}"
                    if d.startswith("-DMLA_WGMMA_SMEM=") else d for d in real)
    assert patched != real
    monkeypatch.setattr(registry, "compile_defines", lambda: patched)
    with pytest.raises(ptxas.NvrtcCompileError, match="wgmma_smem_bytes"):
        ptxas.compile_log(read_source(inst.source), [inst.expression], arch="sm_90a")


@pytest.mark.parametrize("arch, ok", [("sm_90", True), ("sm_80", False), ("sm_89", False),
                                      ("sm_100", False)])
def test_only_sm_90_devices_run_it(arch, ok):
    inst = INSTANCES[0]
    assert (archs.instance_needs(arch, inst) is None) == ok
    if ok:
        arch_specific.check_device_arch(inst.name, inst.min_arch, arch, "a GPU")
    else:
        with pytest.raises(ValueError, match=f"runs on sm_90 devices only.*is {arch}"):
            arch_specific.check_device_arch(inst.name, inst.min_arch, arch, "a GPU")


def test_the_batch_1_paths_refuse_it_by_name():
    from mlasandbox.bench_config import make_config

    with pytest.raises(ValueError, match="wgmma64 serves the paged step only"):
        registry.resolve_variant("wgmma64")       # mla.decode, DecodeStep, grid
    with pytest.raises(ValueError, match="wgmma64 serves the paged step only"):
        make_config(variants=("wgmma64",))        # bench without --batch
    assert paged_api.paged_variant("wgmma64", 1, 128) is registry.PAGED_ONLY_VARIANTS["wgmma64"]


def test_a_single_pass_plan_picks_the_instance_without_partials_for_wgmma_only():
    inst, mma = INSTANCES[0], registry.paged_attention_instance("mma16", "f16", "f32")
    assert registry.instance_for_plan(inst, True) == NO_PARTIALS[0]
    assert registry.instance_for_plan(inst, False) is inst
    assert registry.instance_for_plan(mma, True) is mma and mma.partials is None
