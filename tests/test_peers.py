"""The peers on the CPU: a peer that cannot load is skipped with its reason (never a
traceback), the 16-bit tolerance of FlashMLA has the power to fail, peers run on q rounded to
the cache dtype. Their arithmetic is checked on the device (the bench's check)."""
from __future__ import annotations

import sys
import types

import ml_dtypes
import numpy as np
import pytest

from mlasandbox import peers
from mlasandbox.compare import DEFAULT_TOLERANCE
from mlasandbox.compare_paged import compare_paged
from mlasandbox.dims import PRESETS
from mlasandbox.paged import PagedResult
from mlasandbox.paged_inputs import make_paged_inputs
from mlasandbox.reference import decode_paged


def _fake_torch(cuda=True):
    t = types.ModuleType("torch")
    t.cuda = types.SimpleNamespace(is_available=lambda: cuda)
    return t


def test_without_torch_every_peer_is_skipped_with_the_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)   # import torch raises ImportError
    loaded, skipped = peers.load_peers(("torch", "flashmla", "flashinfer"))
    assert loaded == {}
    assert [s["name"] for s in skipped] == ["torch", "flashmla", "flashinfer"]
    for s in skipped:
        assert "torch is not installed (ModuleNotFoundError" in s["reason"]
        assert "pip install -e '.[peers]'" in s["reason"]


def test_without_flash_mla_the_reason_names_the_wheel(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", _fake_torch())
    monkeypatch.setitem(sys.modules, "flash_mla", None)
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    monkeypatch.setitem(sys.modules, "flashinfer.mla", None)
    loaded, skipped = peers.load_peers(("flashmla", "flashinfer", "torch"))
    assert list(loaded) == ["torch"]
    reasons = {s["name"]: s["reason"] for s in skipped}
    assert reasons["flashmla"].startswith("ModuleNotFoundError") and "sgl-flash-mla" in \
        reasons["flashmla"]
    assert reasons["flashinfer"].startswith("ModuleNotFoundError")


def test_no_cuda_device_and_a_broken_install_are_skips_too(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", _fake_torch(cuda=False))
    _, skipped = peers.load_peers(("torch",))
    assert skipped == [{"name": "torch", "reason": "torch sees no CUDA device"}]

    broken = types.ModuleType("flash_mla")

    def getattr_(name):
        raise OSError("libcudart.so.13: cannot open shared object file")
    broken.__getattr__ = getattr_
    monkeypatch.setitem(sys.modules, "torch", _fake_torch())
    monkeypatch.setitem(sys.modules, "flash_mla", broken)
    _, skipped = peers.load_peers(("flashmla",))
    assert skipped[0]["reason"].startswith("OSError: libcudart")


def test_an_unknown_peer_is_a_value_error():
    with pytest.raises(ValueError, match="unknown peer 'vllm'; known: flashmla, torch"):
        peers.load_peers(("vllm",))


def test_the_16_bit_tolerance_forgives_one_rounding_and_not_more():
    inp = make_paged_inputs(PRESETS["dsv3"].with_heads(4), [0, 70, 300], s_q=2, page_size=16,
                            cache_dtype="bf16", q_dtype="bf16", causal=True, seed=5)
    ref = decode_paged(**{**inp.decode_args(), "wv_b": None})
    ref = PagedResult(ref.latent, ref.lse)
    tol = peers.tolerance_of("flashmla", "bf16")
    assert (tol.latent, tol.out) == (2.0 ** -8, 2.0 ** -8)
    assert peers.tolerance_of("flashmla", "f16").latent == 2.0 ** -11
    assert peers.tolerance_of("torch", "bf16").latent == 1e-4
    for name in ("flashmla", "flashinfer"):   # both round p and out to 16 bits; lse is f32
        for dt in ("bf16", "f16"):
            t = peers.tolerance_of(name, dt)
            assert t == peers.FLASHMLA_TOLERANCE[dt]
            assert t.lse_abs == DEFAULT_TOLERANCE.lse_abs
    # FlashMLA's output rounded to bf16 (and to f16): within the limits
    for dt, name in ((ml_dtypes.bfloat16, "bf16"), (np.float16, "f16")):
        got = PagedResult(ref.latent.astype(dt).astype(np.float64), ref.lse)
        assert compare_paged(got, ref, peers.tolerance_of("flashmla", name)).ok
    # three bf16 ulps off is past it: the limit has power
    off = PagedResult(ref.latent * (1 + 3 * 2.0 ** -8), ref.lse)
    cmp = compare_paged(off, ref, tol)
    assert not cmp.ok and cmp.live.latent.value == pytest.approx(3 * 2.0 ** -8)


def test_peers_run_on_q_rounded_to_the_cache_dtype():
    q = np.array([1.0 + 2.0 ** -10, 3.0, 1.0 + 3 * 2.0 ** -9], np.float32)
    r = peers.peer_q(q, "bf16")
    # rounded to nearest: 1 + 3 x 2^-9 goes up to 1 + 2^-7 (0x3F81), where truncating the
    # low half would give 1.0
    assert r.dtype == np.uint16 and r.tolist() == [0x3F80, 0x4040, 0x3F81]
    assert peers.peer_q(q, "f16").dtype == np.float16
