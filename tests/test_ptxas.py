"""ptxas: the -Xptxas -v report through NVRTC, parsed strictly, for an explicit arch (no GPU)."""
from __future__ import annotations

from pathlib import Path

import pytest

from mlasandbox import elf, ptxas, registry, sources, toolkit
from ptx_watch import FTZ_ENTRY, FTZ_SOURCE, flush_forms, watch_ptx

TOY = (Path(__file__).parent / "data" / "toy_attn.cu").read_text()
TOY_EXPR = {
    "toy<1,f16,f32>": "mla::toy<1, __half, float>",
    "toy<4,bf16,bf16>": "mla::toy<4, __nv_bfloat16, __nv_bfloat16>",
    "toy<64,f16,f32>": "mla::toy<64, __half, float>",
}

# A real log (NVRTC 13.5, sm_80: it prints cmem[0]) with a non-inlined device function.
REAL_LOG = """\
ptxas info    : 512 bytes gmem, 256 bytes cmem[3], 8 bytes cmem[4]
ptxas info    : Function properties for _Z6helperf
ptxas         .     16 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Compiling entry function '_Z5heavyILi64EEvPKfPfi' for 'sm_80'
ptxas info    : Function properties for _Z5heavyILi64EEvPKfPfi
ptxas         .     2840 bytes stack frame, 4328 bytes spill stores, 6712 bytes spill loads
ptxas info    : Used 32 registers, used 0 barriers, 2840 bytes cumulative stack size, 372 bytes cmem[0]
ptxas info    : Compile time = 234.065 ms
ptxas info    : Compiling entry function 'plain' for 'sm_80'
ptxas info    : Function properties for plain
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 10 registers, used 1 barriers, 8192 bytes smem, 360 bytes cmem[0], 8 bytes cmem[2]
ptxas info    : Compile time = 0.730 ms
\x00"""


def test_parse_real_log():
    got = ptxas.parse_ptxas_log(REAL_LOG)
    assert list(got) == ["_Z5heavyILi64EEvPKfPfi", "plain"]
    heavy, plain = got["_Z5heavyILi64EEvPKfPfi"], got["plain"]
    assert heavy == dict(arch="sm_80", registers=32, barriers=0, smem_bytes=0, cmem0_bytes=372,
                         stack_bytes=2840, spill_stores=4328, spill_loads=6712)
    assert plain == dict(arch="sm_80", registers=10, barriers=1, smem_bytes=8192,
                         cmem0_bytes=360, stack_bytes=0, spill_stores=0, spill_loads=0)


def test_sm90_log_has_no_cmem0_and_says_none_not_zero():
    log = ("ptxas info    : Compiling entry function 'k' for 'sm_90'\n"
           "ptxas info    : Function properties for k\n"
           "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
           "ptxas info    : Used 77 registers, used 1 barriers, 8192 bytes smem\n")
    k = ptxas.parse_ptxas_log(log)["k"]
    assert k["registers"] == 77 and k["smem_bytes"] == 8192 and k["cmem0_bytes"] is None


@pytest.mark.parametrize("garble, where", [
    # registers written as a word
    (lambda s: s.replace("Used 10 registers", "Used ten registers"), "plain"),
    # an item ptxas never printed
    (lambda s: s.replace("8192 bytes smem", "8192 bytes smem, 3 frobs"), "3 frobs"),
    # the spill line cut short
    (lambda s: s.replace(", 4328 bytes spill stores, 6712 bytes spill loads", ""), "spill"),
    # the resource line lost
    (lambda s: s.replace("ptxas info    : Used 10 registers, used 1 barriers, 8192 bytes smem, "
                         "360 bytes cmem[0], 8 bytes cmem[2]\n", ""), "plain"),
    # the properties line lost
    (lambda s: s.replace("ptxas         .     0 bytes stack frame, 0 bytes spill stores, "
                         "0 bytes spill loads\nptxas info    : Used 10", "ptxas info    : Used 10"),
     "plain"),
])
def test_garbled_log_raises_naming_function_or_line(garble, where):
    bad = garble(REAL_LOG)
    assert bad != REAL_LOG
    with pytest.raises(ptxas.PtxasParseError) as err:
        ptxas.parse_ptxas_log(bad)
    assert where in str(err.value)


def test_report_of_a_templated_source():
    rep = ptxas.ptxas_report_source(TOY, TOY_EXPR, arch="sm_90", filename="toy_attn.cu")
    assert list(rep) == list(TOY_EXPR)
    for name, r in rep.items():
        assert isinstance(r, ptxas.KernelResources)
        assert r.name == name and r.arch == "sm_90" and r.mangled.startswith("_ZN3mla3toy")
        assert r.registers > 0
        assert r.smem_bytes == 128 * 4      # __shared__ float tile[128]
        assert r.barriers == 1              # __syncthreads
        assert r.code_bytes > 0 and r.code_bytes % 16 == 0   # 16 bytes an instruction
        assert r.as_dict()["registers"] == r.registers
        assert r.as_dict()["code_bytes"] == r.code_bytes
    assert rep["toy<64,f16,f32>"].registers > rep["toy<1,f16,f32>"].registers
    with pytest.raises(Exception):
        rep["toy<1,f16,f32>"].registers = 1   # frozen


CODE = (Path(__file__).parent / "data" / "toy_code.cu").read_text()
CODE_EXPR = {f"sleeps<{k}>": f"toy::sleeps<{k}>" for k in (0, 64)}
CODE_EXPR.update({f"chain<{u}>": f"toy::chain<{u}>" for u in (1, 4, 16)})


def check_code_sizes(size: dict[str, int]) -> None:
    """What the code sizes of toy_code.cu's kernels must be, {name: bytes}."""
    for name, n in size.items():
        assert n > 0 and n % 16 == 0, f"{name}: {n} bytes is not whole 16-byte instructions"
    # sleeps<64> holds 64 NANOSLEEPs more than sleeps<0>: 1,024 bytes more, plus a little
    # setup and the padding to the section's 128-byte alignment (nvdisasm: 1,152 in all)
    grow = size["sleeps<64>"] - size["sleeps<0>"]
    assert 64 * 16 <= grow <= 64 * 16 + 256, f"sleeps<64> - sleeps<0> = {grow} bytes"
    # the same loop unrolled more: more copies of its body
    assert size["chain<1>"] < size["chain<4>"] < size["chain<16>"], size


def test_code_size_moves_with_the_code():
    rep = ptxas.ptxas_report_source(CODE, CODE_EXPR, arch="sm_90", filename="toy_code.cu")
    check_code_sizes({name: r.code_bytes for name, r in rep.items()})


_text_sizes = elf.text_sizes   # the real reader, for the wrong ones to start from


def _sizes_of(prefix):
    """A wrong reader: each function's size taken from the section `<prefix><function>`."""
    return lambda cubin: {s.name[len(prefix):]: s.size for s in elf.sections(cubin)
                          if s.name.startswith(prefix)}


def _next_kernels(cubin):
    """A wrong reader: each function gets the .text size of the one after it."""
    real = _text_sizes(cubin)
    fns = list(real)
    return {fn: real[fns[(i + 1) % len(fns)]] for i, fn in enumerate(fns)}


@pytest.mark.parametrize("wrong_reader", [
    lambda cubin: {fn: len(cubin) for fn in _text_sizes(cubin)},
    _sizes_of(".nv.info."), _sizes_of(".nv.constant0."), _next_kernels,
], ids=["whole cubin", "nv.info", "nv.constant0", "next kernel's text"])
def test_code_size_check_catches_a_reader_of_the_wrong_thing(monkeypatch, wrong_reader):
    """Negative control of test_code_size_moves_with_the_code: the report built on a reader
    that returns the cubin's size, another section of the kernel's or another kernel's text
    fails check_code_sizes."""
    monkeypatch.setattr(elf, "text_sizes", wrong_reader)
    rep = ptxas.ptxas_report_source(CODE, CODE_EXPR, arch="sm_90", filename="toy_code.cu")
    with pytest.raises(AssertionError):
        check_code_sizes({name: r.code_bytes for name, r in rep.items()})


def test_maxrregcount_makes_it_spill():
    rep = ptxas.ptxas_report_source(TOY, TOY_EXPR, arch="sm_90",
                                    extra_options=["-maxrregcount=32"])
    heavy = rep["toy<64,f16,f32>"]
    assert heavy.registers <= 32
    assert heavy.spill_stores > 0 and heavy.spill_loads > 0 and heavy.stack_bytes > 0
    assert heavy.spills
    assert not rep["toy<1,f16,f32>"].spills


def test_the_report_compiles_with_ftz_as_cupy_runs_the_kernels(monkeypatch):
    """compile_log's -ftz=true reaches NVRTC: the code it reports on flushes denormals, as
    the code cupy.RawModule builds does (its multiply and exp2f in their .ftz forms)."""
    ptx = watch_ptx(monkeypatch)
    log, lowered = ptxas.compile_log(FTZ_SOURCE, [FTZ_ENTRY], arch="sm_90")
    assert lowered == {FTZ_ENTRY: FTZ_ENTRY} and FTZ_ENTRY in ptxas.parse_ptxas_log(log)
    assert len(ptx) == 1
    assert flush_forms(ptx[0]) == {"mul": [True], "ex2": [True]}, (
        f"compile_log compiled without -ftz=true:\n{ptx[0]}")


def test_the_ftz_probe_tells_a_compile_without_ftz(monkeypatch):
    """The control of the -ftz tests (ptx_watch.py): the probe through NVRTC with the
    kernels' options and no -ftz has the plain multiply and ex2, so the .ftz forms those
    tests see come from the option, not from NVRTC's default."""
    ptx = watch_ptx(monkeypatch)
    nvrtc = toolkit._nvrtc()
    prog = nvrtc.createProgram(FTZ_SOURCE, "probe.cu", [], [])
    try:
        nvrtc.compileProgram(prog, list(toolkit.compile_options("sm_90")))
    finally:
        nvrtc.destroyProgram(prog)
    assert flush_forms(ptx[0]) == {"mul": [False], "ex2": [False]}, ptx[0]


def test_other_arch_is_reported_for_that_arch():
    rep = ptxas.ptxas_report_source(TOY, {"a": TOY_EXPR["toy<1,f16,f32>"]}, arch="sm_80")
    assert rep["a"].arch == "sm_80"
    assert rep["a"].cmem0_bytes is not None and rep["a"].cmem0_bytes > 0


def test_every_call_is_a_real_compile():
    # a cached module prints no log: the second report must carry the same numbers
    a = ptxas.ptxas_report_source(TOY, TOY_EXPR)
    b = ptxas.ptxas_report_source(TOY, TOY_EXPR)
    assert a == b


def test_compile_error_raises_with_the_nvrtc_log():
    with pytest.raises(ptxas.NvrtcCompileError) as err:
        ptxas.ptxas_report_source(TOY + "\n__global__ void broken() { undeclared_thing(); }\n",
                                  {"a": TOY_EXPR["toy<1,f16,f32>"]}, filename="broken.cu")
    msg = str(err.value)
    assert "broken.cu" in msg and "undeclared_thing" in msg


def test_unknown_name_expression_is_an_error():
    with pytest.raises(ptxas.NvrtcCompileError):
        ptxas.ptxas_report_source(TOY, {"x": "mla::no_such_kernel<1>"})


def test_virtual_arch_is_rejected():
    with pytest.raises(ValueError, match="real GPU architecture"):
        ptxas.ptxas_report_source(TOY, TOY_EXPR, arch="compute_90")


def test_report_covers_every_registry_instance():
    # the real sources: one NVRTC program per .cu, every template value of the registry
    assert {"mla_attn.cu", "mla_combine.cu", "mla_q_absorb.cu"} <= set(sources.source_names())
    insts = registry.all_instances()
    rep = ptxas.ptxas_report(insts, arch="sm_90")
    assert list(rep) == [i.name for i in insts]
    for inst in insts:
        r = rep[inst.name]
        assert r.registers > 0, inst.name
        assert r.registers <= 255
        assert r.spill_stores >= 0 and r.spill_loads >= 0 and r.stack_bytes >= 0
        assert r.barriers is not None
        assert r.code_bytes > 0 and r.code_bytes % 16 == 0, (inst.name, r.code_bytes)
        # shared memory is O(head dims + tile), never O(n_ctx): static + dynamic fits an SM
        assert r.smem_bytes + inst.smem_bytes <= 227 * 1024, inst.name
        # Registers, not local memory: the kernels that hold operands in registers for a
        # whole slice (mma's q fragments, 230 registers for mma32) must still fit without
        # spilling under the compiler CI has. The combine without its rescale is a negative
        # control, not a kernel anyone times (it spills 4 bytes under NVRTC 13.5).
        if "rescale=false" not in inst.name:
            assert r.spill_stores == 0 and r.spill_loads == 0, f"{inst.name} spills"


def _front_end_warnings(log: str) -> list[str]:
    # NVRTC's front end writes "file(line): warning #N-D: ..."; ptxas's own lines say "ptxas"
    return [ln for ln in log.splitlines() if ": warning #" in ln]


def test_the_warning_check_sees_an_unused_namespace_constant():
    # negative control: a namespace constant that the compiled kernel never reads, as a shared
    # header holds for the sources that include it without using it
    src = "namespace mla { constexpr int kUnused = 5; }\n" + TOY
    log = ptxas.compile_program(src, [TOY_EXPR["toy<1,f16,f32>"]]).log
    assert any("kUnused" in w for w in _front_end_warnings(log)), log


@pytest.mark.parametrize("src", sorted({i.source for i in registry.all_instances()}))
def test_every_source_compiles_without_front_end_warnings(src):
    # A warning printed on every compile is noise that hides the one that matters; one
    # instance of a source reaches every namespace-scope declaration of it and its headers.
    inst = next(i for i in registry.all_instances() if i.source == src)
    log = ptxas.compile_program(sources.read_source(src), [inst.expression],
                                arch=ptxas.target_arch(inst, "sm_90"), filename=src).log
    assert _front_end_warnings(log) == [], log
