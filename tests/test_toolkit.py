"""toolkit: NVRTC and the CUDA headers are found explicitly; the device probe never raises."""
from __future__ import annotations

import os

import pytest
from pathlib import Path

from mlasandbox import elf, toolkit
from mlasandbox.registry import KV_LORA, ROPE


def test_nvrtc_version_is_a_pair():
    major, minor = toolkit.nvrtc_version()
    assert major >= 11 and minor >= 0


def test_include_dirs_hold_both_headers():
    dirs = toolkit.cuda_include_dirs()
    assert dirs
    for header in toolkit.REQUIRED_HEADERS:
        assert any(os.path.isfile(os.path.join(d, header)) for d in dirs), header


def test_env_override_wins(tmp_path, monkeypatch):
    for h in toolkit.REQUIRED_HEADERS:
        (tmp_path / h).write_text("// stub\n")
    monkeypatch.setenv(toolkit.ENV_INCLUDE, str(tmp_path))
    assert toolkit.cuda_include_dirs() == [str(tmp_path.resolve())]


def test_env_override_may_list_several_dirs(tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    (a / "cuda_fp16.h").write_text("")
    (b / "cuda_bf16.h").write_text("")
    monkeypatch.setenv(toolkit.ENV_INCLUDE, os.pathsep.join([str(a), str(b)]))
    assert toolkit.cuda_include_dirs() == [str(a.resolve()), str(b.resolve())]


def test_env_override_without_headers_names_what_is_missing(tmp_path, monkeypatch):
    (tmp_path / "cuda_fp16.h").write_text("")
    monkeypatch.setenv(toolkit.ENV_INCLUDE, str(tmp_path))
    with pytest.raises(toolkit.ToolkitError) as err:
        toolkit.cuda_include_dirs()
    msg = str(err.value)
    assert "cuda_bf16.h" in msg and toolkit.ENV_INCLUDE in msg
    assert "cuda_fp16.h" not in msg.split("does not hold")[1].split(";")[0]


def test_nothing_found_says_where_it_looked_and_how_to_fix(tmp_path, monkeypatch):
    monkeypatch.delenv(toolkit.ENV_INCLUDE, raising=False)
    monkeypatch.setenv("CUDA_PATH", str(tmp_path / "nowhere"))
    monkeypatch.setattr(toolkit, "include_candidates",
                        lambda: [("$CUDA_PATH/include", tmp_path / "nowhere" / "include")])
    with pytest.raises(toolkit.ToolkitError) as err:
        toolkit.cuda_include_dirs()
    msg = str(err.value)
    assert "cuda_fp16.h and cuda_bf16.h" in msg
    assert "pip install nvidia-cuda-runtime nvidia-cuda-nvrtc" in msg
    assert toolkit.ENV_INCLUDE in msg
    assert "no such directory" in msg


def test_search_order(tmp_path, monkeypatch):
    monkeypatch.delenv(toolkit.ENV_INCLUDE, raising=False)
    cuda_path = tmp_path / "cuda"
    (cuda_path / "include").mkdir(parents=True)
    for h in toolkit.REQUIRED_HEADERS:
        (cuda_path / "include" / h).write_text("")
    major, minor = toolkit.nvrtc_version()
    _version_header(cuda_path / "include", major)
    monkeypatch.setenv("CUDA_PATH", str(cuda_path))
    labels = [label for label, _ in toolkit.include_candidates()]
    dirs = [d for _, d in toolkit.include_candidates()]
    assert labels[0] == "$CUDA_PATH/include"
    # /usr/local/cuda is always looked at (last, or earlier under a wheel's label when a
    # wheel directory is the same path, as on the H200 image)
    assert Path("/usr/local/cuda/include") in dirs
    wheel = [i for i, lab in enumerate(labels) if lab.startswith("pip wheel")]
    assert all(i > 0 for i in wheel)
    assert toolkit.cuda_include_dirs() == [str((cuda_path / "include").resolve())]
    # both variables: $CUDA_PATH, then $CUDA_HOME, then the wheels, /usr/local/cuda last
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "home"))
    labels = [label for label, _ in toolkit.include_candidates()]
    assert labels[:2] == ["$CUDA_PATH/include", "$CUDA_HOME/include"]
    local = labels.index("/usr/local/cuda/include") if "/usr/local/cuda/include" in labels \
        else len(labels)
    assert all(i < local for i, lab in enumerate(labels) if lab.startswith("pip wheel"))


def _version_header(d, major, minor=0):
    (d / "cuda_runtime_api.h").write_text(
        f"#define CUDART_VERSION {major * 1000 + minor * 10}\n")


def test_headers_matching_nvrtc_are_preferred(tmp_path, monkeypatch):
    monkeypatch.delenv(toolkit.ENV_INCLUDE, raising=False)
    old, new = tmp_path / "cuda12", tmp_path / "cuda13"
    for d, major in ((old, 12), (new, 13)):
        d.mkdir()
        for h in toolkit.REQUIRED_HEADERS:
            (d / h).write_text("")
        _version_header(d, major, 8)
    monkeypatch.setattr(toolkit, "include_candidates", lambda: [("a", old), ("b", new)])
    monkeypatch.setattr(toolkit, "nvrtc_version", lambda: (13, 0))
    assert toolkit.cuda_include_dirs() == [str(new.resolve())]
    assert toolkit.headers_version(str(new)) == (13, 8)
    monkeypatch.setattr(toolkit, "nvrtc_version", lambda: (12, 4))
    assert toolkit.cuda_include_dirs() == [str(old.resolve())]
    monkeypatch.setattr(toolkit, "nvrtc_version", lambda: (11, 8))  # none match: the first
    assert toolkit.cuda_include_dirs() == [str(old.resolve())]


def test_compile_options():
    opts = toolkit.compile_options("sm_80", extra=("-lineinfo",))
    assert opts[:4] == ("-std=c++17", "--gpu-architecture=sm_80",
                        f"-DMLA_KV_LORA={KV_LORA}", f"-DMLA_ROPE={ROPE}")
    assert [o for o in opts if o.startswith("-I")] == [f"-I{d}" for d in toolkit.cuda_include_dirs()]
    assert opts[-1] == "-lineinfo"
    assert isinstance(opts, tuple)


@pytest.mark.parametrize("arch", ["compute_90", "90", "sm90", "", None, "sm_90x", "sm_90ab"])
def test_compile_options_reject_virtual_or_bad_arch(arch):
    with pytest.raises(ValueError, match="real GPU architecture"):
        toolkit.compile_options(arch)


def test_headers_version_matches_nvrtc_major():
    hv = toolkit.headers_version()
    if hv is None:
        pytest.skip("the headers carry no CUDART_VERSION")
    assert hv[0] == toolkit.nvrtc_version()[0]


def test_device_available_never_raises():
    ok, why = toolkit.device_available()
    assert isinstance(ok, bool) and isinstance(why, str) and why


def test_no_device_errors_are_clear():
    ok, why = toolkit.device_available()
    if ok:
        assert toolkit.arch_of_device().startswith("sm_")
        info = toolkit.device_properties()
        assert info["sms"] > 0 and info["arch"].startswith("sm_")
    else:
        assert "no CUDA device" in why or "not" in why
        with pytest.raises(toolkit.NoDeviceError, match=why.split(":")[0]):
            toolkit.arch_of_device()
        with pytest.raises(toolkit.NoDeviceError):
            toolkit.device_properties()


def test_device_available_when_cupy_raises(monkeypatch):
    from cupy.cuda import runtime

    def boom():
        raise RuntimeError("planted failure")

    monkeypatch.setattr(runtime, "getDeviceCount", boom)
    ok, why = toolkit.device_available()
    assert ok is False and "planted failure" in why


def test_nvrtc_cubin_is_the_whole_elf():
    """nvrtc_cubin returns every byte the cubin's own headers place in the file. CuPy's
    getCUBIN returns the same bytes but the last; a cut image fails the same check (its
    power)."""
    from cupy.cuda import nvrtc

    src = 'extern "C" __global__ void twice(float* x) { x[threadIdx.x] *= 2.0f; }\n'
    prog = nvrtc.createProgram(src, "twice.cu", [], [])
    try:
        nvrtc.compileProgram(prog, ["--gpu-architecture=sm_90"])
        cubin = toolkit.nvrtc_cubin(prog)
        cupys = bytes(nvrtc.getCUBIN(prog))
    finally:
        nvrtc.destroyProgram(prog)
    assert cubin[:4] == b"\x7fELF"
    assert "twice" in elf.text_sizes(cubin)   # whole: a cut cubin raises ElfError
    assert cupys == cubin[:len(cupys)]  # the same image, as far as CuPy's goes
    with pytest.raises(elf.ElfError, match="program headers"):
        elf.text_sizes(cubin[:-1])


def test_nvrtc_cubin_without_pathfinder_takes_the_one_mapped_library(monkeypatch):
    """Without cuda.pathfinder the library is the one libnvrtc mapped into the process: the
    same cubin."""
    import builtins

    from cupy.cuda import nvrtc

    real_import = builtins.__import__

    def no_pathfinder(name, *args, **kw):
        if name == "cuda" or name.startswith("cuda."):
            raise ImportError("the test's: no cuda.pathfinder")
        return real_import(name, *args, **kw)

    src = 'extern "C" __global__ void twice(float* x) { x[threadIdx.x] *= 2.0f; }\n'
    prog = nvrtc.createProgram(src, "twice.cu", [], [])
    try:
        nvrtc.compileProgram(prog, ["--gpu-architecture=sm_90"])
        want = toolkit.nvrtc_cubin(prog)
        monkeypatch.setattr(builtins, "__import__", no_pathfinder)
        assert toolkit.nvrtc_cubin(prog) == want
    finally:
        monkeypatch.undo()
        nvrtc.destroyProgram(prog)


def test_nvrtc_cubin_of_a_ptx_only_program_is_a_clear_error():
    from cupy.cuda import nvrtc

    prog = nvrtc.createProgram('extern "C" __global__ void k() {}\n', "k.cu", [], [])
    try:
        nvrtc.compileProgram(prog, ["--gpu-architecture=compute_90"])
        with pytest.raises(toolkit.ToolkitError, match="no cubin"):
            toolkit.nvrtc_cubin(prog)
    finally:
        nvrtc.destroyProgram(prog)
