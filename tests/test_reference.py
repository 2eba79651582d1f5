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
from tolerances import U32, assert_within, dot_bound64, f64_bounds

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
    # two float64 evaluations in different orders: within f64_bounds (tests/tolerances.py,
    # 1e-15 .. 1e-14 here); a wrong formula (a missing scale, the max not subtracted back)
    # misses by O(1)
    bound = f64_bounds(**inp.decode_args())
    for name in ("out", "latent", "lse"):
        assert_within(getattr(got, name), getattr(want, name), getattr(bound, name),
                      err_msg=f"{name} {seeds}")
        assert getattr(got, name).dtype == np.float64


def test_reference_does_not_depend_on_its_chunking(seeds):
    inp = make_inputs(preset("h96-tp8"), n_alloc=1000, seed=seeds.one())
    a = decode(**inp.decode_args())
    b = decode(**inp.decode_args(), chunk_rows=7)
    bound = f64_bounds(**inp.decode_args())  # chunking reorders the sums, nothing else
    for name in ("out", "latent", "lse"):
        assert_within(getattr(a, name), getattr(b, name), getattr(bound, name),
                      err_msg=f"{name} {seeds}")


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
    # lse is the one score, out one 512-term dot product per entry: each computed twice in
    # float64 (BLAS orders may differ), so within 2 gamma_n of the sum of |terms|; a
    # relative bound would not hold where the score or an out entry cancels to near 0
    q0, wv0 = bf16.as_f64(inp.q[0]), bf16.as_f64(inp.wv_b[0])
    lse_tol = inp.scale * float(dot_bound64(np.abs(q0), np.abs(row), row.size))
    assert r.lse[0] == pytest.approx(inp.scale * float(q0 @ row), rel=0, abs=lse_tol)
    assert_within(r.out[0], wv0 @ row[:512], dot_bound64(np.abs(wv0), np.abs(row[:512]), 512),
                  err_msg=str(seeds))


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
    # f64_bounds scales with the scores: at scale 1000 an ulp of s is ~1e-13, which is a
    # relative error of every weight (the bound is ~1e-11 relative here), while an overflow
    # gives inf or NaN and a wrong max shift an O(1) error
    bound = f64_bounds(inp.q, inp.cache, inp.wv_b, inp.n_ctx, 1000.0)
    assert_within(r.lse, lse, bound.lse, err_msg=str(seeds))
    assert_within(r.latent, np.exp(s - lse[:, None]) @ cache[:, :8], bound.latent,
                  err_msg=str(seeds))


@pytest.mark.parametrize("change, match", [
    (dict(n_ctx=0), "n_ctx"),
    (dict(n_ctx=41), "n_ctx must be in 1..N_alloc=40"),
    (dict(n_ctx=2.5), "n_ctx must be an integer"),
    (dict(n_ctx=float("nan")), "n_ctx must be an integer, got nan"),
    (dict(n_ctx=float("inf")), "n_ctx must be an integer, got inf"),
    (dict(n_ctx=np.float32("nan")), "n_ctx must be an integer"),
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
        qn, wk = bf16.as_f64(inp.q_nope[h]), bf16.as_f64(inp.wk_b[h])
        # one 6-term float64 dot product per entry, maybe in another order
        assert_within(q[h, :8], qn @ wk, dot_bound64(np.abs(qn), np.abs(wk), qn.size))
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
    # rounding each entry to f32 moves it by at most u32 |x|, so relL2 <= u32 exactly
    assert c.as_dict()["ok"] is True and c.as_dict()["latent"]["value"] <= U32


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
