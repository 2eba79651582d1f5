"""The float64 reference computes the contract's formula, reads only t < n_ctx, and says what
is wrong with bad inputs. The comparison it feeds names failures and never passes a NaN."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from mlasandbox import bf16
from mlasandbox.compare import Tolerance, compare, rel_l2
from mlasandbox.dims import Dims, preset
from mlasandbox.inputs import make_inputs
from mlasandbox.reference import DecodeResult, decode, q_absorb

TINY = Dims(n_head=3, kv_lora=8, rope=4, v_head=5, nope=6)


def naive(q, cache, wv_b, n_ctx, scale):
    """The DESIGN.md formula, written the obvious way, one head and one position at a time."""
    q, cache, wv_b = (bf16.as_f64(a) for a in (q, cache, wv_b))
    kv = wv_b.shape[2]
    H = q.shape[0]
    out, latent, lse = np.zeros((H, wv_b.shape[1])), np.zeros((H, kv)), np.zeros(H)
    for h in range(H):
        s = [scale * float(np.dot(q[h], cache[t])) for t in range(n_ctx)]
        lse[h] = math.log(math.fsum(math.exp(x) for x in s))
        for t in range(n_ctx):
            latent[h] += math.exp(s[t] - lse[h]) * cache[t, :kv]
        out[h] = wv_b[h] @ latent[h]
    return DecodeResult(out, latent, lse)


def test_reference_is_the_contract_formula(seeds):
    inp = make_inputs(TINY, n_alloc=40, n_ctx=33, seed=seeds.one())
    got, want = decode(**inp.decode_args()), naive(**inp.decode_args())
    for name in ("out", "latent", "lse"):
        np.testing.assert_allclose(getattr(got, name), getattr(want, name), rtol=1e-12,
                                   atol=1e-13, err_msg=f"{name} {seeds}")
        assert getattr(got, name).dtype == np.float64


def test_reference_does_not_depend_on_its_chunking(seeds):
    inp = make_inputs(preset("h96-tp8"), n_alloc=1000, seed=seeds.one())
    a = decode(**inp.decode_args())
    b = decode(**inp.decode_args(), chunk_rows=7)
    for name in ("out", "latent", "lse"):
        np.testing.assert_allclose(getattr(a, name), getattr(b, name), rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("cache_dtype", ["f16", "bf16"])
def test_reference_never_reads_rows_past_n_ctx(cache_dtype, seeds):
    inp = make_inputs(preset("dsv3-tp8"), n_alloc=700, n_ctx=513, cache_dtype=cache_dtype,
                      seed=seeds.one())
    assert np.isnan(bf16.as_f32(inp.cache[513:])).all()  # the trap is set
    poisoned = decode(**inp.decode_args(), chunk_rows=100)
    clean = decode(inp.q, inp.cache[:513].copy(), inp.wv_b, chunk_rows=100)
    for name in ("out", "latent", "lse"):
        assert np.isfinite(getattr(poisoned, name)).all(), name
        np.testing.assert_array_equal(getattr(poisoned, name), getattr(clean, name))


def test_bf16_as_ml_dtypes_and_as_uint16_bits_give_the_same_answer(seeds):
    inp = make_inputs(TINY, n_alloc=50, cache_dtype="bf16", q_dtype="bf16", seed=seeds.one())
    as_ml = [a.view(ml_dtypes.bfloat16) for a in (inp.q, inp.cache, inp.wv_b)]
    a = decode(inp.q, inp.cache, inp.wv_b)
    b = decode(*as_ml)
    np.testing.assert_array_equal(a.out, b.out)
    np.testing.assert_array_equal(a.lse, b.lse)


def test_one_head_one_position_is_that_row_exactly(seeds):
    inp = make_inputs(Dims(n_head=1), n_alloc=4, n_ctx=1, seed=seeds.one())
    r = decode(**inp.decode_args())
    row = bf16.as_f64(inp.cache[0])
    np.testing.assert_array_equal(r.latent[0], row[:512])  # softmax over one term is 1
    assert r.lse[0] == pytest.approx(inp.scale * float(bf16.as_f64(inp.q[0]) @ row), rel=1e-14)
    np.testing.assert_allclose(r.out[0], bf16.as_f64(inp.wv_b[0]) @ row[:512], rtol=1e-13)


def test_two_pass_softmax_survives_scores_that_overflow_exp(seeds):
    # With scale 1000 the scores reach the thousands: exp(s) alone overflows past ~709.8
    # unless the max is subtracted first. The expected answer uses a different stable
    # algorithm (a running logaddexp), not the reference's own.
    inp = make_inputs(TINY, n_alloc=64, seed=seeds.one())
    r = decode(inp.q, inp.cache, inp.wv_b, scale=1000.0)
    cache = bf16.as_f64(inp.cache)
    s = 1000.0 * bf16.as_f64(inp.q) @ cache.T
    assert s.max() > 710, seeds
    lse = np.logaddexp.reduce(s, axis=1)
    assert np.isfinite(r.latent).all() and np.isfinite(r.lse).all()
    np.testing.assert_allclose(r.lse, lse, rtol=1e-13, err_msg=str(seeds))
    np.testing.assert_allclose(r.latent, np.exp(s - lse[:, None]) @ cache[:, :8],
                               rtol=1e-9, atol=1e-12, err_msg=str(seeds))


@pytest.mark.parametrize("change, match", [
    (dict(n_ctx=0), "n_ctx"),
    (dict(n_ctx=41), "n_ctx must be in 1..N_alloc=40"),
    (dict(n_ctx=2.5), "n_ctx must be an integer"),
    (dict(scale=float("inf")), "scale"),
    (dict(q=np.zeros(12, np.float32)), "q must be 2-D"),
    (dict(wv_b=np.zeros((3, 5, 8), np.float16)[:2]), "wv_b must be"),
    (dict(wv_b=np.zeros((3, 5, 8), np.float32)), "wv_b must have the cache dtype"),
    (dict(cache=np.zeros((40, 12), np.float32)), "cache must be float16 or bfloat16"),
    (dict(cache=np.zeros((40, 12), np.int16)), "int16"),
])
def test_reference_rejects_bad_inputs_naming_the_parameter(change, match, seeds):
    args = make_inputs(TINY, n_alloc=40, seed=seeds.one()).decode_args()
    args.update(change)
    with pytest.raises((ValueError, TypeError), match=match):
        decode(**args)


def test_q_absorb_is_the_per_head_product_and_concatenation(seeds):
    inp = make_inputs(TINY, n_alloc=2, seed=seeds.one())
    q = q_absorb(inp.q_nope, inp.q_rope, inp.wk_b)
    assert q.shape == (3, 12) and q.dtype == np.float64
    for h in range(3):
        np.testing.assert_allclose(q[h, :8], bf16.as_f64(inp.q_nope[h]) @ bf16.as_f64(inp.wk_b[h]),
                                   rtol=1e-14)
        np.testing.assert_array_equal(q[h, 8:], bf16.as_f64(inp.q_rope[h]))
    with pytest.raises(ValueError, match="wk_b"):
        q_absorb(inp.q_nope, inp.q_rope, inp.wk_b[:, :5])


def test_reference_takes_device_arrays(cupy_device, seeds):
    cp = cupy_device
    inp = make_inputs(preset("dsv3-tp8"), n_alloc=5000, n_ctx=4097, cache_dtype="bf16",
                      seed=seeds.one(), xp=cp)
    on_device = decode(**inp.decode_args())
    host = {k: (cp.asnumpy(v) if isinstance(v, cp.ndarray) else v)
            for k, v in inp.decode_args().items()}
    np.testing.assert_array_equal(on_device.out, decode(**host).out)


# ---- compare -------------------------------------------------------------------------------

def _ref(seed):
    inp = make_inputs(TINY, n_alloc=30, seed=seed)
    return decode(**inp.decode_args())


def test_compare_passes_an_f32_rounding_of_the_reference(seeds):
    ref = _ref(seeds.one())
    f32 = DecodeResult(*(a.astype(np.float32) for a in (ref.out, ref.latent, ref.lse)))
    c = compare(f32, ref)
    assert c.ok, c.summary()
    assert c.as_dict()["ok"] is True and c.as_dict()["latent"]["value"] < 1e-7


def test_a_nan_never_passes_however_small_the_rest_of_the_error(seeds):
    ref = _ref(seeds.one())
    bad = DecodeResult(ref.out.copy(), ref.latent.copy(), ref.lse.copy())
    bad.latent[2, 5] = np.nan
    c = compare(bad, ref, Tolerance(out=1e9, latent=1e9, lse_abs=1e9))
    assert not c.ok and not c.latent.ok and c.out.ok
    assert c.latent.nonfinite == 1
    assert c.latent.worst[0].position == (2, 5)  # the NaN is named first
    assert "NaN" in c.summary() and "(2, 5)" in c.summary()


def test_compare_names_the_worst_position(seeds):
    ref = _ref(seeds.one())
    bad = DecodeResult(ref.out.copy(), ref.latent.copy(), ref.lse.copy())
    bad.out[1, 3] += 1.0
    bad.lse[2] += 0.01
    c = compare(bad, ref)
    assert not c.out.ok and c.latent.ok and not c.lse.ok
    assert c.out.worst[0].position == (1, 3)
    assert c.lse.worst[0].position == (2,)
    assert c.lse.value == pytest.approx(0.01, rel=1e-6)
    d = c.as_dict()
    assert d["out"]["worst"][0]["position"] == [1, 3] and d["ok"] is False


def test_rel_l2_is_relative_to_the_reference():
    assert rel_l2(np.array([3.0, 4.0]), np.array([3.0, 4.0])) == 0.0
    assert rel_l2(np.array([3.0, 4.0]) * 1.001, np.array([3.0, 4.0])) == pytest.approx(1e-3)
    assert rel_l2(np.zeros(2), np.zeros(2)) == 0.0
    assert rel_l2(np.ones(2), np.zeros(2)) == math.inf
    assert math.isnan(rel_l2(np.array([np.nan, 1.0]), np.ones(2)))
    with pytest.raises(ValueError, match="shapes"):
        rel_l2(np.ones(2), np.ones(3))
