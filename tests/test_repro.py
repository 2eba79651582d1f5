"""`mlasandbox repro` scripts, on the CPU: generated for every variant, valid Python, their
embedded CUDA compiles with NVRTC, their launches match api.DecodeStep's, and their reference,
bf16 and comparison code agree with the library's. Running them is test_gpu_lab.py's job."""
from __future__ import annotations

import ast
import inspect
import json
import os
import re
import runpy
import sys
import textwrap
import types

import numpy as np
import pytest
from click.testing import CliRunner

from mlasandbox import (api, bench_gpu, bf16, cublas_engine, elf, paged_api, reference, registry,
                        repro, toolkit)
from mlasandbox.cli.main import main
from mlasandbox.dims import Dims
from mlasandbox.inputs import make_inputs
from mlasandbox.paged_inputs import make_paged_inputs
from mlasandbox.reference import decode_paged
from mlasandbox.sources import read_source
from ptx_watch import FTZ_ENTRY, FTZ_SOURCE, flush_forms, watch_ptx
from tolerances import assert_within, f64_bounds

HAVE_GPU, GPU_REASON = toolkit.device_available()
VARIANTS = registry.variant_names()
# what a script may import: the standard library's few, CuPy and NumPy (tempfile holds the
# cubin of an sm_90a kernel between NVRTC and cupy.RawModule(path=...))
# cuda: cuda.pathfinder, which CuPy 14 installs and loads NVRTC with
SCRIPT_IMPORTS = {"argparse", "contextlib", "os", "platform", "sys", "tempfile", "numpy",
                  "cupy", "cupy_backends", "ctypes", "dataclasses", "cuda"}


def top_imports(text: str) -> set:
    tree = ast.parse(text)
    return ({n.names[0].name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)}
            | {n.module.split(".")[0] for n in ast.walk(tree)
               if isinstance(n, ast.ImportFrom) and n.module})


def script_ns(tmp_path, case, name="r.py"):
    path = repro.write_script(case, str(tmp_path / name))
    text = open(path).read()
    compile(text, path, "exec")  # valid Python
    return runpy.run_path(path, run_name="not_main"), text, path


@pytest.fixture(scope="module")
def scripts(tmp_path_factory):
    """One script per variant (blocks/SM given, so no compile is needed to plan splits)."""
    d = tmp_path_factory.mktemp("repro")
    out = {}
    for v in VARIANTS:
        case = repro.make_case(v, heads=16, contexts=(4095, 20000), blocks_per_sm=2,
                               seed=5)
        out[v] = (case, *script_ns(d, case, f"{v}.py"))
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_script_per_variant_pins_the_case(scripts, variant, tmp_path):
    case, ns, text, path = scripts[variant]
    assert os.access(path, os.X_OK)
    assert ns["VARIANT"] == variant and ns["N_HEAD"] == 16 and ns["SEED"] == 5
    assert ns["CONTEXTS"] == (4095, 20000) and ns["SPLITS"] == case.splits
    assert ns["SCALE"] == Dims(n_head=16).default_scale
    assert ns["EXPECT"] == "PASS" and not ns["NEGATIVE_CONTROL"]
    assert "import mlasandbox" not in text and "from mlasandbox" not in text
    imports = top_imports(text)
    assert imports <= SCRIPT_IMPORTS, imports
    if registry.variant(variant).is_cuda:
        inst = case.attn_instance
        assert ns["ATTN"]["expression"] == inst.expression
        assert ns["ATTN"]["smem_bytes"] == inst.smem_bytes
        assert ns["ATTN"]["threads"] == inst.threads
        assert ns["ATTN_SOURCE"] == read_source(inst.source)
        assert ns["COMBINE_SOURCE"] == read_source("mla_combine.cu")
        assert ns["COMBINE"]["expression"] == registry.combine_instance("f16").expression
        assert ns["COMBINE"]["threads"] == registry.COMBINE_THREADS
        assert ns["COMBINE"]["col_blocks"] == registry.COMBINE_COL_BLOCKS
        assert ns["NVRTC_OPTIONS"] == ("-std=c++17", "-DMLA_KV_LORA=512", "-DMLA_ROPE=64",
                                       *registry.compile_defines())
        # the f32 bound, or p's rounding to the cache dtype (mma16r, mma32r)
        t = (registry.ROUND_P_RELL2_BOUND["f16"] if registry.variant(variant).round_p
             else 1e-4)
        assert ns["TOLERANCE"] == {"out": t, "latent": t, "lse": 1e-4}
        assert ("rounds p to f16" in text) == registry.variant(variant).round_p
    else:
        assert ns["CUDA_PROGRAMS"] == [] and callable(ns["cublas_attention"])
        assert ns["TOLERANCE"]["out"] == 3e-3
        for cache in ("f16", "bf16"):   # the bench's bound, every field
            t = bench_gpu.CUBLAS_TOLERANCE[cache]
            sc = repro.make_case("cublas", cache=cache, blocks_per_sm=2)
            ns_c, _, _ = script_ns(tmp_path, sc, name=f"c_{cache}.py")
            assert ns_c["TOLERANCE"] == {"out": t, "latent": t, "lse": t}, cache


def test_splits_are_the_launchers_rule():
    from mlasandbox.splits import plan_splits

    case = repro.make_case("batched12", contexts=(4095, 4096, 131072), blocks_per_sm=2)
    assert case.splits[4095] == plan_splits(4095, 96, 12, num_sms=132, blocks_per_sm=2).splits > 1
    assert "no split gate" in case.splits_from
    below = repro.make_case("split", contexts=(4095, 4096), blocks_per_sm=5)
    assert below.splits[4095] == 1 and below.splits[4096] > 1  # the split gate
    assert "split gate 4096" in below.splits_from
    assert case.splits[131072] == plan_splits(131072, 96, 12, num_sms=132,
                                              blocks_per_sm=2).splits
    assert repro.make_case("per_head", contexts=(131072,)).splits == {131072: 1}
    assert repro.make_case("split", splits=7, contexts=(64,)).splits == {64: 7}
    auto = repro.make_case("batched16", contexts=(20000,))  # occupancy model: a real compile
    assert "occupancy model of sm_90" in auto.splits_from or "driver" in auto.splits_from


def test_every_embedded_cuda_source_compiles_with_nvrtc(scripts):
    """One NVRTC program per distinct embedded source, every script's name expressions in
    it, with the scripts' own options (PTX for compute_90: no GPU needed)."""
    from cupy.cuda import nvrtc

    programs: dict[str, set] = {}
    options = None
    for _, ns, _, _ in scripts.values():
        for _, src, exprs in ns["CUDA_PROGRAMS"]:
            programs.setdefault(src, set()).update(exprs)
        options = options or ns["NVRTC_OPTIONS"]
    assert len(programs) >= 2
    inc = [f"-I{d}" for d in toolkit.cuda_include_dirs()]
    for src, exprs in programs.items():
        prog = nvrtc.createProgram(src, "repro.cu", [], [])
        try:
            for e in sorted(exprs):
                nvrtc.addNameExpression(prog, e)
            try:
                nvrtc.compileProgram(prog, list(options) + inc + ["--gpu-architecture=compute_90"])
            except Exception as exc:
                pytest.fail(f"{exc}\n{nvrtc.getProgramLog(prog)}")
            for e in exprs:
                assert nvrtc.getLoweredName(prog, e).startswith("_Z")
        finally:
            nvrtc.destroyProgram(prog)


def _launch_arg_names(method) -> list[str]:
    """The kernel arguments of the guard.launch call in an api.DecodeStep method, by name."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(method)))
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call)
                and isinstance(n.func, ast.Attribute) and n.func.attr == "launch")
    skip = {"np", "int32", "float32", "self", "dims", "p", "plan", "_LOG2E"}
    names = []
    for elt in call.args[4].elts:
        tokens = [t for t in re.findall(r"[A-Za-z_]\w*", ast.unparse(elt)) if t not in skip]
        names.append(tokens[0])
    return names


def test_the_scripts_launch_arguments_are_decodesteps():
    assert tuple(_launch_arg_names(api.DecodeStep.run_attn)) == repro.ATTN_ARGS
    # the step's combine is the script's one launch that merges and projects (its merge-only
    # form passes null pointers in the same places)
    assert tuple(_launch_arg_names(api.DecodeStep.run_merge)) == repro.COMBINE_ARGS
    grid = inspect.getsource(api.DecodeStep.combine_grid.fget)
    assert "n_head" in grid and "col_blocks" in grid


def test_the_negative_control():
    case = repro.make_case("split", contexts=(20000,), blocks_per_sm=2, negative_control=True)
    text = repro.render_script(case)
    assert "mla::combine<__half, false, 8>" in text and "EXPECT = 'FAIL'" in text
    assert "NEGATIVE CONTROL" in text
    assert repro.default_filename(case).endswith("_negctl.py")
    for variant, kw in (("per_head", {}), ("split", {"contexts": (4095, 20000)}),
                        ("cublas", {})):
        with pytest.raises(ValueError, match="negative control"):
            repro.make_case(variant, blocks_per_sm=2, negative_control=True, **kw)


@pytest.mark.parametrize("kw,words", [({"preset": "x"}, "unknown preset"),
                                      ({"contexts": (0,)}, ">= 1"),
                                      ({"cache": "f32"}, "cache dtype"),
                                      ({"q": "bf16"}, "q dtype"),
                                      ({"splits": 0}, "splits")])
def test_bad_cases(kw, words):
    with pytest.raises(ValueError, match=words):
        repro.make_case("split", blocks_per_sm=2, **kw)
    with pytest.raises(ValueError, match="does not split"):
        repro.make_case("per_head", splits=4)
    with pytest.raises(ValueError, match="unknown variant"):
        repro.make_case("warp")


def test_the_cublas_engine_is_embedded_verbatim(scripts):
    _, _, text, _ = scripts["cublas"]
    src = inspect.getsource(cublas_engine)
    # everything from the first function on is pasted unchanged (only imports differ)
    assert src[src.index("def _gemm("):] in text


@pytest.mark.parametrize("cache", ["f16", "bf16"])
def test_the_scripts_reference_and_compare_agree_with_the_library(tmp_path, cache, seeds):
    case = repro.make_case("split", heads=3, contexts=(300,), cache=cache, blocks_per_sm=2)
    ns, _, _ = script_ns(tmp_path, case)
    inp = make_inputs(Dims(n_head=3), 307, 300, cache, "f32", seed=seeds.one(), nan_fill=True)
    want = reference.decode(**inp.decode_args())
    got = ns["reference"](inp.q, inp.cache, inp.wv_b, 300)
    # the script's float64 reference against the library's: two f64 evaluations of one
    # formula, within f64_bounds (tests/tolerances.py, ~1e-13 here) entry by entry
    bound = f64_bounds(**inp.decode_args())
    for f in ("out", "latent", "lse"):
        assert_within(got[f], getattr(want, f), getattr(bound, f), err_msg=f"{f} {seeds}")
    ok, lines = ns["compare"](got, got)
    assert ok and all(ln.strip().startswith("ok") for ln in lines)
    broken = dict(got, latent=got["latent"] * 1.01)
    broken["lse"] = got["lse"].copy()
    broken["lse"][1] = np.nan
    ok, lines = ns["compare"](broken, got)
    assert not ok
    assert "FAIL latent" in lines[1] and "worst at" in lines[1] and "NaN/inf" in lines[2]
    # each field is checked on its own: a wrong one alone fails, on its own line
    tol = ns["TOLERANCE"]
    for i, (f, wrong) in enumerate((("out", got["out"] * (1 + 10 * tol["out"])),
                                    ("latent", got["latent"] * (1 + 10 * tol["latent"])),
                                    ("lse", got["lse"] + 10 * tol["lse"]))):
        ok, lines = ns["compare"](dict(got, **{f: wrong}), got)
        assert not ok and lines[i].strip().startswith(f"FAIL {f}"), (f, lines)
        assert sum(ln.strip().startswith("FAIL") for ln in lines) == 1, (f, lines)


def test_the_scripts_bf16_helpers_are_the_librarys(tmp_path, seeds):
    ns, _, _ = script_ns(tmp_path, repro.make_case("split", blocks_per_sm=2))
    x = np.random.default_rng(seeds.one()).standard_normal(1000).astype(np.float32) * 100
    x[:4] = [np.nan, np.inf, -np.inf, -0.0]
    np.testing.assert_array_equal(ns["f32_to_bf16_bits"](x), bf16.f32_to_bf16_bits(x))
    bits = bf16.f32_to_bf16_bits(x)
    np.testing.assert_array_equal(ns["bf16_bits_to_f32"](bits), bf16.bf16_bits_to_f32(bits))
    np.testing.assert_array_equal(ns["as_f64"](bits), bf16.as_f64(bits))


@pytest.mark.skipif(HAVE_GPU, reason="this machine has a GPU")
@pytest.mark.parametrize("control", [False, True])
def test_without_a_gpu_the_script_says_not_run_and_exits_3(tmp_path, capsys, control):
    """'Could not run' is neither a pass nor the negative control's expected FAIL."""
    case = repro.make_case("split", blocks_per_sm=2, contexts=(20000,), negative_control=control)
    ns, _, _ = script_ns(tmp_path, case)
    assert ns["main"]([]) == 3
    out = capsys.readouterr().out
    assert "NOT RUN: no usable CUDA device" in out and "variant split" in out
    assert "FAIL:" not in out and "PASS:" not in out


# ---------------------------------------------------------------------------- host draws

@pytest.mark.parametrize("cache,q", [("f16", "f32"), ("bf16", "f32"), ("bf16", "cache")])
def test_the_scripts_inputs_are_make_inputs_drawn_on_the_host(tmp_path, cache, q, seeds):
    """No cupy.random (it needs libcurand): the script draws with NumPy's default_rng in
    make_inputs' order, so its arrays equal make_inputs(..., xp=cupy)'s bit for bit."""
    seed = seeds.one()
    case = repro.make_case("split", heads=3, contexts=(50,), cache=cache, q=q, seed=seed,
                           blocks_per_sm=2)
    ns, text, _ = script_ns(tmp_path, case)
    assert "cupy.random" not in text
    want = make_inputs(Dims(n_head=3), 57, 50, cache, case.q_dtype, seed=seed, nan_fill=True)
    for got, ref in zip(ns["host_inputs"](50), (want.q, want.cache, want.wv_b)):
        assert got.dtype == ref.dtype
        np.testing.assert_array_equal(got, ref)
    other = ns["host_inputs"].__globals__
    other["SEED"] = seed + 1   # a different seed draws different values: the check has power
    assert not np.array_equal(ns["host_inputs"](50)[0], want.q)


# ---------------------------------------------------------------------------- paged

@pytest.fixture
def paged_registry(monkeypatch):
    """The paged instances stand in as the batch-1 ones (same sources, heads and tiles): the
    script's text and its CPU half do not depend on the kernels' template flag."""
    monkeypatch.setattr(registry, "paged_attention_instance", raising=False,
                        value=lambda v, c, q: registry.attention_instance(v, c, q))
    monkeypatch.setattr(registry, "paged_combine_instance", raising=False,
                        value=lambda c, rescale: registry.combine_instance(c, rescale))


def paged_ns(tmp_path, case, name="p.py"):
    path = repro.write_paged_script(case, str(tmp_path / name))
    text = open(path).read()
    compile(text, path, "exec")
    return runpy.run_path(path, run_name="not_main"), text


PAGED = dict(batch=6, lengths="0,1,20,140,63,300", s_q=2, causal=True, page_size=16, heads=3,
             blocks_per_sm=2, num_sms=132)


@pytest.mark.parametrize("cache,q,causal", [("f16", "f32", True), ("bf16", "cache", True),
                                            ("f16", "f32", False)])
def test_the_paged_scripts_inputs_and_reference_are_the_librarys(tmp_path, paged_registry,
                                                                  cache, q, causal, seeds):
    seed = seeds.one()
    case = repro.make_paged_case("mma16", cache=cache, q=q, seed=seed,
                                 **dict(PAGED, causal=causal))
    ns, text = paged_ns(tmp_path, case)
    assert "cupy.random" not in text and repr(case.lengths) in text and ns["CAUSAL"] is causal
    host = ns["host_inputs"]()
    inp = make_paged_inputs(case.dims, case.lengths, s_q=2, page_size=16, cache_dtype=cache,
                            q_dtype=case.q_dtype, causal=causal, seed=seed)
    want = (inp.q, inp.kv_cache, inp.block_table, inp.cache_seqlens, inp.wv_b)
    for got, ref in zip(host, want):
        np.testing.assert_array_equal(got, ref)
    got = ns["reference"](*host)
    ref = decode_paged(**inp.decode_args())
    # one formula, two float64 evaluations in the same order: equal, -inf rows included
    for f in ("out", "latent", "lse"):
        np.testing.assert_array_equal(got[f], getattr(ref, f), err_msg=f)
    assert np.isneginf(got["lse"][0]).all()             # the empty request
    ok, lines = ns["compare"](got, got)
    assert ok and all(ln.strip().startswith("ok") for ln in lines)
    # negative controls: a wrong live row, and an empty row that is not exactly empty
    bad = dict(got, latent=got["latent"] * 1.001)
    assert not ns["compare"](bad, got)[0]
    bad = dict(got, out=got["out"].copy())
    bad["out"][0, 0, 0, 0] = 1e-30
    ok, lines = ns["compare"](bad, got)
    assert not ok and lines[-1].strip().startswith("FAIL empty")
    bad = dict(got, latent=got["latent"].copy())          # the empty row's latent, alone
    bad["latent"][0, 0, 0, 0] = 1e-30
    ok, lines = ns["compare"](bad, got)
    assert not ok and lines[-1].strip().startswith("FAIL empty")
    # lse on the live rows, alone: its own line fails
    tol = ns["TOLERANCE"]
    live_lse = np.where(np.isneginf(got["lse"]), got["lse"], got["lse"] + 10 * tol["lse"])
    ok, lines = ns["compare"](dict(got, lse=live_lse), got)
    assert not ok and [ln.split()[:2] for ln in lines if "FAIL" in ln] == [["FAIL", "lse"]]


def test_the_paged_script_pins_the_plan_and_the_launch(tmp_path, paged_registry):
    case = repro.make_paged_case("batched16", splits=3, **PAGED)
    ns, _ = paged_ns(tmp_path, case)
    assert ns["PLAN"] == {"max_chunks": 3, "min_chunk": case.plan["min_chunk"],
                          "tile": registry.attention_instance(
                              registry.variant("batched16")).tile_rows, "rows_per_block": 16,
                          "target": case.plan["target"],
                          "programs": case.plan["programs"]}
    assert case.plan["programs"] == 264           # one wave: max(target, B), B = 6
    assert ns["ATTN"]["args"] == repro.PAGED_ATTN_ARGS
    assert ns["COMBINE"]["args"] == repro.PAGED_COMBINE_ARGS
    # batched writes a one-chunk request's latent itself: the merge skips it, as in the step
    assert ns["COMBINE"]["attn_writes_single"] == 1
    assert (ns["S_Q"], ns["CAUSAL"], ns["PAGE_SIZE"]) == (2, True, 16)


def test_the_paged_script_launches_the_grid_that_offers_a_second_wave(paged_registry):
    # B = 40 on 132 slots: the step's grid has 2 x 132 programs a row block (the kernel takes
    # the second wave from the lengths); the script's grid is the plan's, not max(target, B)
    case = repro.make_paged_case("batched16", **{**PAGED, "batch": 40, "lengths": "300",
                                                 "blocks_per_sm": 1})
    assert case.plan["target"] == 132 and case.plan["programs"] == 264


def test_the_paged_args_are_the_steps():
    """The names match PagedDecodeStep.attn_args / combine_args one to one (by their count
    and by the tail names the step passes as attributes)."""
    src = inspect.getsource(paged_api.PagedDecodeStep.attn_args)
    tail = re.findall(r"self\.(\w+)", src.split("scale * _LOG2E")[1])
    assert [a for a in repro.PAGED_ATTN_ARGS[-8:] if a not in ("target", "batch")] == tail
    assert src.count("np.int32(") + 1 + 4 + 6 == len(repro.PAGED_ATTN_ARGS)
    src = inspect.getsource(paged_api.PagedDecodeStep.combine_args)
    body = src[src.index("return ("):]
    assert body.count(",") + 1 == len(repro.PAGED_COMBINE_ARGS)


def test_the_paged_negative_control_needs_a_split_request(paged_registry):
    # a chunk is at least one tile of 64 positions: no request of these runs two chunks
    with pytest.raises(ValueError, match="at least 2 chunks"):
        repro.make_paged_case("mma16", negative_control=True,
                              **{**PAGED, "lengths": "0,1,20,63,64"})
    case = repro.make_paged_case("mma16", negative_control=True, splits=4,
                                 **{**PAGED, "lengths": "5000"})
    assert case.negative_control and case.plan["max_chunks"] == 4


def test_a_paged_repro_of_auto_pins_what_decode_paged_runs_on_its_target(paged_registry):
    # the target: --arch, else this GPU, else the H200 the plan models; the table is the one
    # the script builds (room for the longest request)
    big = dict(batch=4, lengths="4096", heads=128, q="cache")
    here = toolkit.arch_of_device() if HAVE_GPU else "sm_90"
    want = "wgmma64" if here == "sm_90" else "mma32"
    assert repro.make_paged_case("auto", **big).variant == want
    assert repro.make_paged_case("auto", arch="sm_90", **big).variant == "wgmma64"
    assert repro.make_paged_case("auto", arch="sm_80", **big).variant == "mma32"
    assert repro.make_paged_case("auto", **{**big, "q": "f32"}).variant == "mma32"
    assert repro.make_paged_case("auto", **{**big, "lengths": "2048"}).variant == "mma16"
    assert repro.make_paged_case("auto", **{**big, "batch": 32, "lengths": "512"}).variant \
        == "mma32"


@pytest.mark.parametrize("kw,words", [
    ({"variant": "per_head"}, "batch 1"), ({"page_size": 32}, "page_size"),
    ({"lengths": "-3"}, "outside 0.."), ({"variant": "cublas"}, "cublas"), ({"s_q": 0}, "s_q"),
    ({"q": "bf16"}, "q dtype"),
    ({"lengths": "1,2,3,4,5,6,7"}, "lengths: 7 given for a batch of 6"),
    # B x s_q latent rows a head: 6 x 349,520 = 2,097,120, 65535 projection blocks of 32
    ({"s_q": 2**31}, r"s_q must be <= 349,520 \(the output projection's grid z dimension"),
    ({"s_q": 349_521}, "s_q must be <= 349,520"), ({"s_q": 1.5}, "s_q must be an integer"),
    ({"seed": -1}, "seed must be an integer >= 0")])
def test_bad_paged_cases(paged_registry, kw, words):
    args = {**PAGED, "variant": "mma16", **kw}
    with pytest.raises(ValueError, match=words):
        repro.make_paged_case(args.pop("variant"), **args)


@pytest.mark.skipif(HAVE_GPU, reason="this machine has a GPU")
def test_the_paged_script_without_a_gpu_is_not_run(tmp_path, paged_registry, capsys):
    ns, _ = paged_ns(tmp_path, repro.make_paged_case("mma32", **PAGED))
    assert ns["main"]([]) == 3
    assert "NOT RUN: no usable CUDA device" in capsys.readouterr().out


def test_repro_cli_batch(tmp_path, paged_registry):
    out = tmp_path / "x.py"
    r = CliRunner().invoke(main, ["repro", "--variant", "mma16", "--batch", "3", "--lengths",
                                  "7,0,300", "--page-size", "16", "--s-q", "2", "--causal",
                                  "--heads", "4", "--blocks-per-sm", "2", "-o", str(out),
                                  "--json"])
    assert r.exit_code == 0, r.output
    info = json.loads(r.output)
    assert info["lengths"] == [7, 0, 300] and info["causal"] and info["page_size"] == 16
    assert out.exists()
    for args, words in ((["--lengths", "5"], "--batch"),
                        (["--batch", "2", "--ctx", "64"], "--ctx belongs"),
                        (["--batch", "2", "--variant", "per_head"], "batch 1")):
        argv = ["repro", "--variant", "mma16", *args]
        if "--variant" in args:
            argv = ["repro", *args]
        r = CliRunner().invoke(main, argv)
        assert r.exit_code == 2 and words in r.output, r.output


def test_repro_cli_auto_says_what_it_resolved_to_and_pins_it(tmp_path):
    out = tmp_path / "a.py"
    base = ["repro", "--variant", "auto", "--batch", "4", "--lengths", "4096", "--heads",
            "128", "--blocks-per-sm", "1"]
    # 128 rows x 4096 x 4, q in the cache dtype (auto's default, as bench --batch's): wgmma64
    r = CliRunner().invoke(main, [*base, "--arch", "sm_90", "-o", str(out), "--json"])
    assert r.exit_code == 0, r.output
    info = json.loads(r.output)
    assert (info["asked"], info["variant"], info["q"]) == ("auto", "wgmma64", "f16")
    assert info["chosen"].startswith("auto -> wgmma64 on sm_90: a large step")
    text = out.read_text()
    assert "VARIANT = 'wgmma64'" in text and "VARIANT = 'auto'" not in text
    assert "auto -> wgmma64 on sm_90" in text and "this script pins it" in text
    # the same case for an sm_80 target: mma32 (no wgmma there), said the same way
    r = CliRunner().invoke(main, [*base, "--arch", "sm_80", "-o", str(tmp_path / "b.py")])
    assert r.exit_code == 0, r.output
    said = " ".join(r.output.split())
    assert "auto -> mma32 on sm_80" in said and "(pinned in the script)" in said
    assert "VARIANT = 'mma32'" in (tmp_path / "b.py").read_text()
    # a named variant says nothing of auto
    r = CliRunner().invoke(main, ["repro", "--variant", "mma16", "--batch", "2", "--heads",
                                  "4", "--blocks-per-sm", "1", "-o", str(tmp_path / "c.py"),
                                  "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["chosen"] is None, r.output


def test_repro_cli_auto_without_batch_is_bad_input_naming_batch(tmp_path):
    r = CliRunner().invoke(main, ["repro", "--variant", "auto", "--ctx", "4096", "-o",
                                  str(tmp_path / "no.py")])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert "'--variant'" in r.output and "--batch" in r.output
    assert not (tmp_path / "no.py").exists()


# ---------------------------------------------------------------------------- wgmma64 (sm_90a)

WGMMA = dict(batch=4, lengths="4097,0,1,300", s_q=2, causal=True, heads=16, blocks_per_sm=1,
             num_sms=132)


def wgmma_ns(tmp_path, page_size=16, cache="f16", **kw):
    case = repro.make_paged_case("wgmma64", page_size=page_size, cache=cache, q=cache,
                                 **{**WGMMA, **kw})
    return (case, *paged_ns(tmp_path, case, f"w{page_size}{cache}.py"))


@pytest.mark.parametrize("page_size,cache", [(16, "f16"), (64, "bf16")])
def test_the_wgmma_script_pins_its_kernel_target_and_launch(tmp_path, page_size, cache):
    case, ns, text = wgmma_ns(tmp_path, page_size, cache)
    inst = registry.wgmma_instance(cache, cache)
    assert ns["VARIANT"] == "wgmma64" and ns["PAGE_SIZE"] == page_size
    assert "import mlasandbox" not in text and "from mlasandbox" not in text
    assert top_imports(text) <= SCRIPT_IMPORTS
    # grid, block and shared memory are the registry's, as for mma16
    assert ns["ATTN"]["expression"] == inst.expression and ns["ATTN"]["arch"] == "sm_90a"
    assert (ns["ATTN"]["threads"], ns["ATTN"]["smem_bytes"]) == (256, inst.smem_bytes)
    assert ns["PLAN"]["rows_per_block"] == 64 and ns["PLAN"]["tile"] == registry.WGMMA_TILE
    assert ns["ATTN"]["args"] == repro.PAGED_WGMMA_ARGS
    assert ns["COMBINE"]["attn_writes_single"] == 1    # a single-pass family, as in the step
    assert ns["ATTN_SOURCE"] == read_source("mla_wgmma.cu")
    # built by the script's own NVRTC call for sm_90a, loaded from the cubin's file
    assert "compile_for_arch(ATTN_SOURCE" in text and "cupy.RawModule(path=path)" in text
    assert "--gpu-architecture={arch}" in text and "whole_cubin(prog)" in text
    assert "NOT RUN: {VARIANT} needs {target}, this device is {have}" in text


@pytest.mark.parametrize("cache,u", [("f16", 2.0 ** -11), ("bf16", 2.0 ** -8)],
                         ids=["f16", "bf16"])
def test_the_wgmma_script_checks_the_wgmma_bound(tmp_path, cache, u):
    _, ns, text = wgmma_ns(tmp_path, cache=cache)
    bound = registry.ROUND_P_RELL2_BOUND[cache]
    assert bound == pytest.approx(4 * u / 3 ** 0.5 + 1e-4, rel=1e-12)   # the comment's formula
    assert ns["TOLERANCE"] == {"out": bound, "latent": bound, "lse": 1e-4}
    assert f"registry.ROUND_P_RELL2_BOUND['{cache}']" in text
    assert "tests/test_gpu_wgmma.py" in text
    # the exact kernels keep compare.py's 1e-4
    mma = repro.make_paged_case("mma16", cache=cache, q=cache, page_size=16, **WGMMA)
    assert paged_ns(tmp_path, mma, "m.py")[0]["TOLERANCE"]["latent"] == 1e-4
    # the bound has power: a latent off by half of it passes, twice it fails
    host = ns["host_inputs"]()
    want = ns["reference"](*host)
    assert ns["compare"](dict(want, latent=want["latent"] * (1 + bound / 2)), want)[0]
    assert not ns["compare"](dict(want, latent=want["latent"] * (1 + 2 * bound)), want)[0]


def test_the_wgmma_scripts_kernel_compiles_for_sm_90a_and_nothing_else(tmp_path):
    """The script's cubin_for_arch on the host (NVRTC needs no GPU): a cubin and the lowered
    name for sm_90a; the same call for sm_90 stops at the source's #error, so the script's
    compile really goes to the arch it names."""
    _, ns, _ = wgmma_ns(tmp_path)
    attn = ns["ATTN"]
    opts = tuple(ns["NVRTC_OPTIONS"]) + tuple(f"-I{d}" for d in toolkit.cuda_include_dirs())
    cubin, lowered = ns["cubin_for_arch"](ns["ATTN_SOURCE"], attn["expression"], attn["arch"],
                                          opts, attn["source"])
    assert cubin[:4] == b"\x7fELF" and len(cubin) > 10_000
    elf.text_sizes(cubin)  # whole: a cubin cut short raises ElfError
    assert lowered.startswith("_ZN3mla16wgmma_attn_paged")
    with pytest.raises(RuntimeError, match="compile it for sm_90a"):
        ns["cubin_for_arch"](ns["ATTN_SOURCE"], attn["expression"], "sm_90", opts,
                             attn["source"])


def test_the_wgmma_scripts_compile_flushes_denormals_as_cupy_does(tmp_path, monkeypatch):
    """The script's cubin_for_arch passes its own -ftz=true (CuPy adds it to the kernels it
    compiles itself, not to these): run with the script's options on a probe kernel, its
    NVRTC compile writes the multiply and exp2f in their .ftz forms."""
    _, ns, _ = wgmma_ns(tmp_path)
    opts = tuple(ns["NVRTC_OPTIONS"]) + tuple(f"-I{d}" for d in toolkit.cuda_include_dirs())
    ptx = watch_ptx(monkeypatch)
    cubin, lowered = ns["cubin_for_arch"](FTZ_SOURCE, FTZ_ENTRY, ns["ATTN"]["arch"], opts)
    assert cubin[:4] == b"\x7fELF" and lowered == FTZ_ENTRY and len(ptx) == 1
    assert flush_forms(ptx[0]) == {"mul": [True], "ex2": [True]}, (
        f"the script's cubin_for_arch compiled without -ftz=true:\n{ptx[0]}")


@pytest.mark.parametrize("device,verdict", [("sm_80", "NOT RUN"), ("sm_100", "NOT RUN"),
                                            ("sm_90", "ERROR")])
def test_the_wgmma_script_is_not_run_on_a_device_that_is_not_sm_90(tmp_path, monkeypatch,
                                                                   capsys, device, verdict):
    """A device of another arch gets the NOT RUN line and exit 3 before any compile; on sm_90
    the script goes on to compile (here a stand-in compile that fails: exit 2, ERROR)."""
    _, ns, _ = wgmma_ns(tmp_path)
    g = ns["main"].__globals__
    monkeypatch.setitem(g, "versions", lambda: [("GPU", f"Fake ({device})")])
    monkeypatch.setitem(g, "device_arch", lambda: device)

    def compile_kernels(inc):
        raise RuntimeError("the stand-in compile")

    monkeypatch.setitem(g, "compile_kernels", compile_kernels)
    rc = ns["main"]([])
    out = capsys.readouterr().out
    assert "PASS:" not in out and "FAIL:" not in out
    if verdict == "NOT RUN":
        assert rc == 3, out
        assert (f"NOT RUN: wgmma64 needs sm_90a, this device is {device}; nothing was "
                "checked") in out and "the stand-in compile" not in out
    else:
        assert rc == 2 and "ERROR: compile error" in out and "NOT RUN" not in out, out


def test_only_an_arch_specific_kernel_is_refused_by_arch(tmp_path):
    _, ns, _ = wgmma_ns(tmp_path)
    mma = repro.make_paged_case("mma16", page_size=16, **WGMMA)
    mns, _ = paged_ns(tmp_path, mma, "m.py")
    assert mns["ATTN"]["arch"] is None
    for have in ("sm_80", "sm_90", "sm_100"):
        assert mns["arch_refusal"](have) is None
        assert (ns["arch_refusal"](have) is None) == (have == "sm_90")


def kernel_params(source: str, name: str) -> tuple:
    """The parameter names of kernel `name` in cuda_src/`source`, in order."""
    m = re.search(rf"\n{name}\((.*?)\)\s*\{{", read_source(source), re.S)
    assert m, f"{name} not found in {source}"
    return tuple(re.findall(r"(\w+)\s*$", p.strip())[0] for p in m.group(1).split(","))


def test_the_paged_kernels_take_the_scripts_arguments():
    """Every paged attention kernel's parameters, read from its source, are PAGED_ATTN_ARGS
    by name and in order, the wgmma family's PAGED_WGMMA_ARGS (the tensor maps last) and the
    mma family's PAGED_MMA_ARGS (its merge's tickets and rescale flag last): the script
    launches each with the tuple its ATTN["args"] names."""
    kinds = [k for k in registry.PAGED_KINDS
             if k not in ("combine", "combine_warp", "check_paged")]
    assert "wgmma_attn" in kinds and "mma_attn" in kinds
    for merge in ("combine", "combine_warp"):  # the step launches either with combine_args
        fam = registry.FAMILIES[merge]
        assert kernel_params(fam.source, fam.paged_function.split("::")[-1]) == \
            repro.PAGED_COMBINE_ARGS, merge
    for kind in kinds:
        fam = registry.FAMILIES[kind]
        params = kernel_params(fam.source, fam.paged_function.split("::")[-1])
        want = {"wgmma_attn": repro.PAGED_WGMMA_ARGS,
                "mma_attn": repro.PAGED_MMA_ARGS}.get(kind, repro.PAGED_ATTN_ARGS)
        assert params == want, (kind, params)


def test_the_wgmma_script_builds_the_library_s_tensor_map(tmp_path, monkeypatch):
    """The script's map code is tensor_map.py's text; its cache_map passes the map where pages
    hold whole tiles (and the switch is on), a null pointer else; mma16's script has none."""
    from mlasandbox import tensor_map

    src = inspect.getsource(tensor_map).replace("from __future__ import annotations\n", "")
    for page, want_map in ((64, True), (16, False)):
        _, ns, text = wgmma_ns(tmp_path, page, "bf16")
        assert src in text
        assert vars(ns["cache_map_params"](640)) == vars(tensor_map.cache_map_params(640))
        calls = []
        ns["cache_map"].__globals__["device_map"] = lambda rows: calls.append(rows.shape) or "MAP"
        cache = np.zeros((10, page, 576), np.uint16)
        got = ns["cache_map"](cache)
        assert (got == "MAP" and calls == [(10 * page, 576)]) if want_map else \
            (isinstance(got, np.uint64) and int(got) == 0 and not calls)
        if want_map:
            monkeypatch.setenv(tensor_map.ENV_SWITCH, "0")
            assert int(ns["cache_map"](cache)) == 0
            monkeypatch.delenv(tensor_map.ENV_SWITCH)
    case = repro.make_paged_case("mma16", **PAGED)
    ns, text = paged_ns(tmp_path, case, "m.py")
    assert "cache_map" not in ns and "kv_map" not in ns["ATTN"]["args"]


def test_repro_cli_wgmma64(tmp_path):
    out = tmp_path / "w.py"
    base = ["repro", "--variant", "wgmma64", "--heads", "16", "--blocks-per-sm", "1"]
    r = CliRunner().invoke(main, [*base, "--batch", "3", "--lengths", "4097,0,300",
                                  "--page-size", "16", "-o", str(out), "--json"])
    assert r.exit_code == 0, r.output
    info = json.loads(r.output)
    assert info["variant"] == "wgmma64" and info["q"] == "f16" and info["page_size"] == 16
    text = out.read_text()
    compile(text, str(out), "exec")
    assert "'arch': 'sm_90a'" in text and "EXPECT = 'PASS'" in text
    r = CliRunner().invoke(main, [*base, "--batch", "3", "-o", str(tmp_path / "t.py")])
    assert r.exit_code == 0 and "run it on an sm_90 GPU" in " ".join(r.output.split())
    for args, words in (([], "--batch"), (["--ctx", "4096"], "--batch"),
                        (["--batch", "2", "--q", "f32"], "q in the cache dtype"),
                        (["--batch", "2", "--arch", "sm_80"], "needs sm_90a")):
        r = CliRunner().invoke(main, [*base, *args, "-o", str(tmp_path / "no.py")])
        assert r.exit_code == 2 and words in r.output, (args, r.output)
        assert not (tmp_path / "no.py").exists()


# ---------------------------------------------------------------------------- who merges

# 20 requests of 16 heads x 2 query tokens (two mma16 row blocks), some cut into several
# chunks: the shape where the step lets the mma kernel merge (registry.attn_merges)
MERGE = dict(batch=20, lengths="4097,0,1,300", s_q=2, causal=True, page_size=64, heads=16,
             blocks_per_sm=1, num_sms=132)


def merge_case(variant="mma16", q="f16", splits=8, **kw):
    return repro.make_paged_case(variant, q=q, splits=splits, **{**MERGE, **kw})


@pytest.mark.parametrize("variant,cache,q,splits,merges", [
    ("mma16", "f16", "f16", 2, True), ("mma16", "f16", "f16", 16, True),
    ("mma32r", "bf16", "bf16", 8, True), ("mma16", "f16", "f16", "auto", True),
    ("mma16", "f16", "f32", 8, False),        # q f32: the kernels built without the merge
    ("batched16", "f16", "f16", 8, False),    # a family without its own merge
    ("mma16", "f16", "f16", 1, False),        # single pass: nothing to merge
    ("mma16", "f16", "f16", 17, False)])      # past ATTN_MERGE_MAX_CHUNKS slots a request
def test_the_paged_script_embeds_who_merges(tmp_path, variant, cache, q, splits, merges):
    """The step's rule decides at generation (on the auto plan too: 2 to 16 slots a request
    at B=20 on 132 SMs); the script embeds the decision, names its form, and carries the
    kernel that follows the attention: the projection alone where the attention kernel merges,
    else the combine."""
    case = merge_case(variant, q=q, cache=cache, splits=splits)
    mc = case.plan["max_chunks"]
    assert case.attn_merges == merges == registry.attn_merges(
        registry.variant(variant).family, mc, case.q_dtype, cache)
    ns, text = paged_ns(tmp_path, case)
    assert ns["ATTN_MERGES"] is merges
    form = "the attention kernel merges (tickets)" if merges else "the merge kernel merges"
    assert ns["MERGE_FORM"] == form and f"Merge: {form}" in ns["__doc__"]
    if merges:
        kind = registry.project_kind(20 * 2, 16, 132)
        inst = registry.project_instance(cache, kind)
        assert case.project_kind == kind and ns["COMBINE"] is None and ns["COMBINE_SOURCE"] == ""
        assert ns["PROJECT"] == {"source": "mla_project.cu", "expression": inst.expression,
                                 "name": inst.name, "threads": registry.PROJECT_THREADS,
                                 "grid": registry.project_grid(16, 128, 40, kind),
                                 "args": repro.PAGED_PROJECT_ARGS}
        assert ns["PROJECT_SOURCE"] == read_source("mla_project.cu")
        assert f"{mc} chunk slots a request" in ns["__doc__"]
    else:
        assert case.project_kind is None and ns["PROJECT"] is None and ns["PROJECT_SOURCE"] == ""
        assert ns["COMBINE"]["args"] == repro.PAGED_COMBINE_ARGS
        assert ns["COMBINE_SOURCE"] == read_source("mla_combine.cu")


def test_the_merge_decision_is_the_registrys(monkeypatch):
    """The case asks registry.attn_merges, the step's rule, with the plan's slots: a rule
    that said otherwise would be followed, not re-derived."""
    asked = []
    monkeypatch.setattr(registry, "attn_merges", lambda *a: asked.append(a) or True)
    case = merge_case(q="f32", splits=5)
    assert asked == [("mma", 5, "f32", "f16")] and case.attn_merges


def fake_cupy():
    """CuPy as the script uses it, on NumPy: host arrays, a stream that syncs at once."""
    stream = types.SimpleNamespace(synchronize=lambda: None)
    return types.SimpleNamespace(
        full=np.full, zeros=np.zeros, asnumpy=np.asarray, int32=np.int32,
        float32=np.float32, uint32=np.uint32,
        cuda=types.SimpleNamespace(get_current_stream=lambda: stream))


def launches(ns, monkeypatch) -> list:
    """The script's run_cuda on the host, CuPy stood in by NumPy and each kernel by a
    recorder: [(ATTN / COMBINE / PROJECT, grid, {argument name: value})] in launch order."""
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy())
    calls = []

    def recorder(which):
        def kernel(grid, block, args, shared_mem=0):
            assert block == (ns[which]["threads"], 1, 1)
            calls.append((which, grid, dict(zip(ns[which]["args"], args, strict=True))))
        return kernel

    ns["run_cuda"](tuple(recorder(w) for w in ("ATTN", "COMBINE", "PROJECT")),
                   *ns["host_inputs"]())
    return calls


@pytest.mark.parametrize("control", [False, True], ids=["check", "negative_control"])
def test_where_the_attention_kernel_merges_the_script_launches_as_the_step(
        tmp_path, monkeypatch, control):
    """mma16, q f16, 8 slots a request: zeroed tickets [B][row blocks] (the step's
    B * head_blocks), merge_rescale 1 (0: the negative control), no merge launch, then the
    projection with project_args over project_grid (PagedDecodeStep.run_combine)."""
    case = merge_case(negative_control=control)
    ns, _ = paged_ns(tmp_path, case)
    calls = launches(ns, monkeypatch)
    assert [c[0] for c in calls] == ["ATTN", "PROJECT"]
    (_, _, attn), (_, grid, proj) = calls
    tickets = attn["attn_tickets"]
    assert tickets.dtype == np.uint32 and tickets.shape == (20, 2) and not tickets.any()
    assert attn["merge_rescale"] == np.int32(0 if control else 1)
    assert grid == registry.project_grid(16, 128, 40, case.project_kind)
    assert proj["latent"] is attn["latent"] and proj["out"].shape == (20, 2, 16, 128)
    assert (proj["n_head"], proj["m_rows"], proj["v_head"]) == (16, 40, 128)
    assert proj["wv_b"].shape == (16, 128, 512)


@pytest.mark.parametrize("causal, page_size", [(True, 64), (False, 16), (False, 1)])
def test_the_paged_scripts_launch_scalars_follow_the_case(tmp_path, monkeypatch, causal,
                                                           page_size):
    """What the kernel is told: causal as 0/1, the page as its shift, and the scale in the
    log2 domain (the kernels take exp2), as PagedDecodeStep.attn_args passes them."""
    case = merge_case(causal=causal, page_size=page_size)
    ns, _ = paged_ns(tmp_path, case)
    attn = launches(ns, monkeypatch)[0][2]
    assert attn["causal"] == np.int32(causal) and attn["causal"].dtype == np.int32
    assert attn["page_shift"] == np.int32(page_size.bit_length() - 1)
    assert 1 << int(attn["page_shift"]) == page_size
    scale = Dims(n_head=16).default_scale             # 1 / sqrt(128 + 64)
    assert ns["SCALE"] == pytest.approx(scale, rel=1e-12)
    assert attn["scale_log2"].dtype == np.float32
    assert float(attn["scale_log2"]) == pytest.approx(scale * np.log2(np.e), rel=1e-7)
    assert (attn["s_q"], attn["n_head"], attn["n_rows"]) == (2, 16, 32)


@pytest.mark.parametrize("control", [False, True], ids=["check", "negative_control"])
def test_where_the_merge_kernel_merges_the_script_launches_as_before(tmp_path, monkeypatch,
                                                                     control):
    """q f32: a null attn_tickets with merge_rescale 1, and the combine merges (the rescale-less
    combine in the negative control) and projects; no projection launch of its own."""
    case = merge_case(q="f32", negative_control=control)
    ns, _ = paged_ns(tmp_path, case)
    assert ns["COMBINE"]["expression"] == registry.paged_combine_instance(
        "f16", not control).expression
    calls = launches(ns, monkeypatch)
    assert [c[0] for c in calls] == ["ATTN", "COMBINE"]
    (_, _, attn), (_, grid, comb) = calls
    assert isinstance(attn["attn_tickets"], np.uint64) and int(attn["attn_tickets"]) == 0
    assert attn["merge_rescale"] == 1
    assert grid == (32, registry.COMBINE_COL_BLOCKS, 20) and comb["attn_writes_single"] == 1
    assert comb["latent"] is attn["latent"] and comb["tickets"].shape == (20 * 32,)


def test_the_projection_takes_the_scripts_arguments():
    """PAGED_PROJECT_ARGS are PagedDecodeStep.project_args one to one and both projection
    kernels' parameters, by name and in order."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(paged_api.PagedDecodeStep.project_args)))
    ret = next(n for n in ast.walk(tree) if isinstance(n, ast.Return))
    step = [ast.unparse(e) for e in ret.value.elts]
    assert len(step) == len(repro.PAGED_PROJECT_ARGS)
    for name, expr in zip(repro.PAGED_PROJECT_ARGS, step):
        assert ("sh.batch * sh.s_q" if name == "m_rows" else name) in expr, (name, expr)
    for kind in ("project", "project_wide"):
        assert kernel_params("mla_project.cu", kind) == repro.PAGED_PROJECT_ARGS


def test_the_scripts_projection_compiles_with_nvrtc(tmp_path):
    """The embedded mla_project.cu and the script's options, through its own NVRTC call (no
    GPU needed), give the projection's cubin."""
    case = merge_case()
    ns, _ = paged_ns(tmp_path, case)
    spec = ns["PROJECT"]
    opts = tuple(ns["NVRTC_OPTIONS"]) + tuple(f"-I{d}" for d in toolkit.cuda_include_dirs())
    cubin, lowered = ns["cubin_for_arch"](ns["PROJECT_SOURCE"], spec["expression"], "sm_90",
                                          opts, spec["source"])
    assert cubin[:4] == b"\x7fELF" and lowered.startswith(f"_ZN3mla{len(case.project_kind)}")


def test_paged_repro_refuses_a_chunk_cap_past_the_plans_as_bench_does(tmp_path):
    from click.testing import CliRunner

    from mlasandbox.cli.main import main

    r = CliRunner().invoke(main, ["repro", "--variant", "mma16", "--batch", "2", "--splits",
                                  "257", "-o", str(tmp_path / "r.py")])
    assert r.exit_code == 2, r.output
    assert "splits" in r.output and "at most 256" in r.output
    assert not (tmp_path / "r.py").exists()


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("kind", ["host", "device"])
def test_a_case_that_does_not_fit_is_an_error_line_not_a_traceback(tmp_path, monkeypatch,
                                                                   capsys, paged, kind):
    """An input draw that runs out of memory: the ERROR verdict naming the case and the
    memory (CuPy's OutOfMemoryError, a MemoryError, is the device's), exit 2. The device
    and the compile are stand-ins, so this runs without a GPU."""
    import cupy

    if paged:
        ns, _ = paged_ns(tmp_path, repro.make_paged_case("split", **PAGED))
        draw, case = "host_inputs", "B=6, lengths up to 300"
    else:
        case_ = repro.make_case("split", heads=16, contexts=(4095,), blocks_per_sm=2)
        ns, _, _ = script_ns(tmp_path, case_)
        draw, case = "make_inputs", "n_ctx=4095"
    g = ns["main"].__globals__
    monkeypatch.setitem(g, "device_versions", lambda say: True)
    monkeypatch.setitem(g, "compile_kernels", lambda inc: None)
    exc = (MemoryError("Unable to allocate 7.00 GiB") if kind == "host"
           else cupy.cuda.memory.OutOfMemoryError(7 << 30, 1 << 30))

    def no_room(*args):
        raise exc

    monkeypatch.setitem(g, draw, no_room)
    rc = ns["main"]([])
    out = capsys.readouterr().out
    assert rc == 2, out
    assert f"ERROR: {case} does not fit in this machine's {kind} memory" in out, out
    assert "PASS" not in out and "FAIL" not in out


def test_pinned_splits_refuse_the_options_that_only_plan_auto(tmp_path):
    # at batch 1, --sms, --blocks-per-sm and --arch feed the split rule; with --splits S the
    # script is the same without them, so giving them is a mistake to name, not to ignore
    out = tmp_path / "r.py"
    base = ["repro", "--variant", "split", "-o", str(out)]
    for extra in (["--sms", "66"], ["--blocks-per-sm", "2"], ["--arch", "sm_80"]):
        r = CliRunner().invoke(main, [*base, "--splits", "4", *extra])
        assert r.exit_code == 2 and f"{extra[0]} plan 'auto' splits" in r.output, r.output
        assert not out.exists()
        r = CliRunner().invoke(main, [*base, *extra])       # --splits auto: they plan it
        assert r.exit_code == 0, r.output
        out.unlink()
