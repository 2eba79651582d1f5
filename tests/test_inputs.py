"""bf16 conversion is bit-exact, and make_inputs draws what the contract says it draws."""
from __future__ import annotations

import sys
import types

import ml_dtypes
import numpy as np
import pytest

from mlasandbox import bf16, limits
from mlasandbox.dims import Dims, check_inputs, preset
from mlasandbox.inputs import make_inputs, make_rising_inputs
from mlasandbox.reference import q_absorb

BF16 = ml_dtypes.bfloat16


def ml_bits(x32: np.ndarray) -> np.ndarray:
    return x32.astype(BF16).view(np.uint16)


# ---- bf16 ----------------------------------------------------------------------------------

def test_f32_to_bf16_matches_ml_dtypes_on_random_bit_patterns(seeds):
    # Uniform random words cover every exponent, subnormals, infs and NaN payloads.
    rng = np.random.default_rng(seeds.one())
    words = rng.integers(0, 2**32, size=1_000_000, dtype=np.uint64).astype(np.uint32)
    x = words.view(np.float32)
    with np.errstate(invalid="ignore"):
        want = ml_bits(x)
    got = bf16.f32_to_bf16_bits(x)
    assert got.dtype == np.uint16
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, (f"{bad.size} mismatches, first f32 bits {words[bad[:5]]}: "
                           f"got {got[bad[:5]]} want {want[bad[:5]]} {seeds}")


def test_f32_to_bf16_matches_ml_dtypes_on_normal_values(seeds):
    rng = np.random.default_rng(seeds.one())
    x = (rng.standard_normal(200_000) * 10.0 ** rng.uniform(-30, 30, 200_000)).astype(np.float32)
    np.testing.assert_array_equal(bf16.f32_to_bf16_bits(x), ml_bits(x), err_msg=str(seeds))


@pytest.mark.parametrize("value, bits", [
    (0.0, 0x0000), (-0.0, 0x8000), (1.0, 0x3F80), (-2.0, 0xC000),
    (np.inf, 0x7F80), (-np.inf, 0xFF80), (np.nan, 0x7FC0), (-np.nan, 0xFFC0),
    (1.0 + 2.0**-8, 0x3F80),            # exactly halfway, even neighbour below: down
    (1.0 + 3 * 2.0**-8, 0x3F82),        # exactly halfway, even neighbour above: up
    (1.0 + 2.0**-8 + 2.0**-20, 0x3F81),  # just past halfway: up
    (np.finfo(np.float32).max, 0x7F80),  # rounds past the largest bf16: inf
    (2.0**-149, 0x0000),                 # smallest f32 subnormal: below half a bf16 ulp
    (2.0**-133, 0x0001),                 # smallest bf16 subnormal, exactly
])
def test_f32_to_bf16_edge_values(value, bits):
    x = np.array([value], dtype=np.float32)
    assert int(bf16.f32_to_bf16_bits(x)[0]) == bits
    assert int(ml_bits(x)[0]) == bits  # the table itself agrees with ml_dtypes


def test_bf16_to_f32_is_exact_for_all_65536_patterns():
    words = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    got = bf16.bf16_bits_to_f32(words)
    want = words.view(BF16).astype(np.float32)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    # and back: every non-NaN pattern survives the round trip bit for bit
    finite_or_inf = ~np.isnan(got)
    np.testing.assert_array_equal(bf16.f32_to_bf16_bits(got)[finite_or_inf], words[finite_or_inf])


def test_as_f32_accepts_ml_dtypes_and_uint16_bits_alike(seeds):
    rng = np.random.default_rng(seeds.one())
    x = rng.standard_normal(1000).astype(np.float32)
    as_ml = x.astype(BF16)
    as_bits = as_ml.view(np.uint16)
    np.testing.assert_array_equal(bf16.as_f32(as_ml), bf16.as_f32(as_bits))
    np.testing.assert_array_equal(bf16.as_f32(as_ml), as_ml.astype(np.float32))
    assert bf16.as_f64(as_bits).dtype == np.float64
    np.testing.assert_array_equal(bf16.as_f64(as_bits), as_ml.astype(np.float64))
    np.testing.assert_array_equal(bf16.as_f64(x.astype(np.float16)),
                                  x.astype(np.float16).astype(np.float64))
    with pytest.raises(TypeError, match="int32"):
        bf16.as_f32(np.zeros(3, dtype=np.int32))


def test_to_storage_rounds_to_the_named_dtype():
    x = np.array([1.0 + 2.0**-9, -3.25], dtype=np.float32)
    assert bf16.to_storage(x, "f16").dtype == np.float16
    np.testing.assert_array_equal(bf16.to_storage(x, "bf16"), ml_bits(x))
    assert bf16.to_storage(x, "f32").dtype == np.float32
    with pytest.raises(ValueError, match="f64"):
        bf16.to_storage(x, "f64")


def test_bf16_conversion_runs_on_the_device_bit_for_bit(cupy_device, seeds):
    cp = cupy_device
    rng = np.random.default_rng(seeds.one())
    words = rng.integers(0, 2**32, size=100_000, dtype=np.uint64).astype(np.uint32)
    x = words.view(np.float32)
    got = bf16.f32_to_bf16_bits(cp.asarray(x))
    assert isinstance(got, cp.ndarray)
    np.testing.assert_array_equal(cp.asnumpy(got), bf16.f32_to_bf16_bits(x))
    back = bf16.bf16_bits_to_f32(got)
    np.testing.assert_array_equal(cp.asnumpy(back).view(np.uint32),
                                  bf16.bf16_bits_to_f32(cp.asnumpy(got)).view(np.uint32))


# ---- make_inputs ---------------------------------------------------------------------------

SMALL = Dims(n_head=5)  # the real 576/512/128 widths, few heads


@pytest.mark.parametrize("cache_dtype, q_dtype", [("f16", "f32"), ("f16", "f16"),
                                                  ("bf16", "f32"), ("bf16", "bf16")])
def test_make_inputs_shapes_dtypes_and_contract(cache_dtype, q_dtype, seeds):
    inp = make_inputs(SMALL, n_alloc=300, n_ctx=257, cache_dtype=cache_dtype,
                      q_dtype=q_dtype, seed=seeds.one())
    storage = {"f16": np.float16, "bf16": np.uint16, "f32": np.float32}
    H = SMALL.n_head
    for name, shape, dt in (("q", (H, 576), q_dtype), ("cache", (300, 576), cache_dtype),
                            ("wv_b", (H, 128, 512), cache_dtype),
                            ("q_nope", (H, 128), cache_dtype), ("q_rope", (H, 64), cache_dtype),
                            ("wk_b", (H, 128, 512), cache_dtype)):
        arr = getattr(inp, name)
        assert arr.shape == shape, name
        assert arr.dtype == storage[dt], name
    assert inp.n_ctx == 257 and inp.scale == pytest.approx(1 / np.sqrt(192))
    dims, n_ctx, scale, dtypes = check_inputs(**inp.decode_args())
    assert (n_ctx, dtypes) == (257, {"q": q_dtype, "cache": cache_dtype})


@pytest.mark.parametrize("cache_dtype", ["f16", "bf16"])
def test_rows_past_n_ctx_are_nan_and_rows_before_are_finite(cache_dtype, seeds):
    for n_ctx in (60, 1, 99, 100):   # the edges: one live row, one dead row, none dead
        inp = make_inputs(SMALL, n_alloc=100, n_ctx=n_ctx, cache_dtype=cache_dtype,
                          seed=seeds.one())
        rows = bf16.as_f32(inp.cache)
        assert np.isfinite(rows[:n_ctx]).all(), n_ctx
        assert np.isnan(rows[n_ctx:]).all() and len(rows) == 100, n_ctx
        if cache_dtype == "bf16":
            assert (inp.cache[n_ctx:] == bf16.BF16_NAN_BITS).all()
    clean = make_inputs(SMALL, n_alloc=100, n_ctx=60, cache_dtype=cache_dtype,
                        seed=seeds.one(), nan_fill=False)
    assert np.isfinite(bf16.as_f32(clean.cache)).all()


@pytest.mark.parametrize("cache_dtype, q_dtype", [("f16", "f32"), ("bf16", "bf16")])
def test_q_is_the_absorbed_query_of_the_q_absorb_inputs(cache_dtype, q_dtype, seeds):
    inp = make_inputs(SMALL, n_alloc=8, cache_dtype=cache_dtype, q_dtype=q_dtype,
                      seed=seeds.one())
    exact = q_absorb(inp.q_nope, inp.q_rope, inp.wk_b)
    np.testing.assert_array_equal(inp.q, bf16.to_storage(exact, q_dtype))
    # the rope part is copied, not computed: it is exact in any q dtype that holds the cache's
    np.testing.assert_array_equal(bf16.as_f64(inp.q)[:, 512:], bf16.as_f64(inp.q_rope))


def test_values_have_the_documented_scales(seeds):
    inp = make_inputs(preset("dsv3-tp8"), n_alloc=2048, seed=seeds.one())
    checks = {"q": (inp.q, 1.0), "cache": (inp.cache, 1.0),
              "wv_b": (inp.wv_b, 512 ** -0.5), "wk_b": (inp.wk_b, 128 ** -0.5),
              "q_nope": (inp.q_nope, 1.0), "q_rope": (inp.q_rope, 1.0),
              "q's latent part": (inp.q[:, :512], 1.0), "q's rope part": (inp.q[:, 512:], 1.0)}
    for name, (arr, std) in checks.items():
        x = bf16.as_f64(arr)
        # n draws of N(0, std^2): the sample mean is within 6 std / sqrt(n) and the sample
        # std within 6 / sqrt(2 n) of std but for about 2e-9 of runs (q_rope is only 16 x 64
        # draws); at least 10% either way, for q's latent part, whose entries in one head
        # share that head's q_nope (the per-head scale varies as chi2(128) / 128)
        n = x.size
        mean_tol = max(0.1, 6 / np.sqrt(n)) * std
        std_tol = max(0.1, 6 / np.sqrt(2 * n))
        assert abs(x.mean()) < mean_tol, f"{name} mean {x.mean()} {seeds}"
        assert x.std() == pytest.approx(std, rel=std_tol), f"{name} std {x.std()} {seeds}"


def test_same_seed_same_arrays_and_a_new_seed_new_arrays(seeds):
    s1, s2 = seeds.take(2)
    a, b = (make_inputs(SMALL, 64, seed=s1) for _ in range(2))
    c = make_inputs(SMALL, 64, seed=s2)
    for name in ("q", "cache", "wv_b", "wk_b"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert not np.array_equal(a.cache, c.cache)
    # the weights are drawn before the cache, so they do not depend on n_alloc
    d = make_inputs(SMALL, 500, seed=s1)
    np.testing.assert_array_equal(a.wv_b, d.wv_b)
    np.testing.assert_array_equal(a.q, d.q)


def test_make_inputs_rejects_bad_arguments_by_name(monkeypatch):
    with pytest.raises(ValueError, match="n_ctx"):
        make_inputs(SMALL, n_alloc=10, n_ctx=11)
    # refused before anything is drawn: a size that could never be allocated
    monkeypatch.setattr(np.random, "default_rng", lambda *a: pytest.fail("drew inputs"))
    with pytest.raises(ValueError, match="n_alloc must be <= 2,147,418,113"):
        make_inputs(SMALL, n_alloc=10**12)
    with pytest.raises(ValueError, match="n_ctx"):
        make_inputs(SMALL, n_alloc=10**9, n_ctx=10**9 + 1)
    monkeypatch.setattr(limits, "host_memory_bytes", lambda: 1 << 30)
    # 10**8 rows of 576 values drawn in float32 and stored: 8 B a value, 429 GiB
    with pytest.raises(ValueError, match=r"the inputs of n_alloc 100,000,000 and 5 heads "
                                         r"needs about 429\.2 GiB of host memory"):
        make_inputs(SMALL, n_alloc=10**8)
    monkeypatch.undo()
    for bad, name in ((2.7, "n_alloc"), (True, "n_alloc"), ("10", "n_alloc")):
        with pytest.raises(ValueError, match=f"{name} must be an integer >= 1"):
            make_inputs(SMALL, n_alloc=bad)
    with pytest.raises(ValueError, match="n_ctx must be an integer >= 1, got 5.5"):
        make_inputs(SMALL, n_alloc=10, n_ctx=5.5)
    with pytest.raises(ValueError, match="seed must be an integer >= 0"):
        make_inputs(SMALL, n_alloc=10, seed=-1)
    # a whole-number seed is the integer it names (numpy's generator refuses 2.0 itself)
    np.testing.assert_array_equal(make_inputs(SMALL, n_alloc=10, seed=2.0).cache,
                                  make_inputs(SMALL, n_alloc=10, seed=2).cache)
    with pytest.raises(ValueError, match="n_ctx"):
        make_inputs(SMALL, n_alloc=10, n_ctx=0)
    with pytest.raises(ValueError, match="cache_dtype"):
        make_inputs(SMALL, n_alloc=10, cache_dtype="f32")
    with pytest.raises(ValueError, match="q_dtype"):
        make_inputs(SMALL, n_alloc=10, cache_dtype="f16", q_dtype="bf16")
    with pytest.raises(ValueError, match="preset"):
        make_inputs("no-such-preset", n_alloc=10)


class _DeviceArray(np.ndarray):
    """What the fake CuPy below hands out: a NumPy array marked as copied to the "device"."""


class _CupyWithoutCurand(types.ModuleType):
    """A stand-in for CuPy on a machine without libcurand: `asarray` copies (marking the
    result), everything else is NumPy's, and any use of `random` fails as the real one does
    there (cupy.random loads libcurand, which no dependency ships)."""

    def __init__(self):
        super().__init__("cupy")

    def asarray(self, a, dtype=None):
        return np.array(a, dtype=dtype).view(_DeviceArray)

    def __getattr__(self, name):
        if name == "random":
            raise AssertionError("cupy.random used: it needs libcurand")
        return getattr(np, name)


@pytest.mark.parametrize("make", [make_inputs, make_rising_inputs])
@pytest.mark.parametrize("cache_dtype, q_dtype", [("f16", "f32"), ("bf16", "bf16")])
def test_device_inputs_need_no_curand_and_equal_the_host_ones(make, cache_dtype, q_dtype,
                                                               monkeypatch, seeds):
    fake = _CupyWithoutCurand()
    with pytest.raises(AssertionError, match="libcurand"):  # the fake has the power to fail
        fake.random.RandomState(0)
    monkeypatch.setitem(sys.modules, "cupy", fake)  # a stray `import cupy` gets it too
    seed = seeds.one()
    dev = make(SMALL, 300, 290, cache_dtype, q_dtype, seed=seed, xp=fake)
    host = make(SMALL, 300, 290, cache_dtype, q_dtype, seed=seed)
    for name in ("q", "cache", "wv_b", "q_nope", "q_rope", "wk_b"):
        want = getattr(host, name)
        got = getattr(dev, name)
        if want is None:  # make_rising_inputs has no q_absorb inputs
            assert got is None, name
            continue
        assert isinstance(got, _DeviceArray), f"{name} was not copied with xp.asarray"
        assert got.dtype == want.dtype, name
        # bit for bit, NaN rows included: the same seed gives the same values on either side
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8),
                                      want.view(np.uint8), err_msg=f"{name} {seeds}")


def test_make_inputs_on_the_device_generates_device_arrays(cupy_device, seeds):
    cp = cupy_device
    seed = seeds.one()
    inp = make_inputs(preset("dsv3"), n_alloc=131072, n_ctx=131000, cache_dtype="bf16",
                      seed=seed, xp=cp)
    assert isinstance(inp.cache, cp.ndarray) and inp.cache.dtype == cp.uint16
    assert isinstance(inp.q, cp.ndarray) and inp.q.dtype == cp.float32
    tail = bf16.as_f32(inp.cache[131000:])
    assert bool(cp.isnan(tail).all())
    assert bool(cp.isfinite(bf16.as_f32(inp.cache[:131000])).all())
    host = make_inputs(preset("dsv3"), n_alloc=131072, n_ctx=131000, cache_dtype="bf16",
                       seed=seed)
    for name in ("q", "cache", "wv_b"):
        np.testing.assert_array_equal(cp.asnumpy(getattr(inp, name)), getattr(host, name),
                                      err_msg=f"{name} {seeds}")
