"""Tolerances derived from the arithmetic: one source for every bound the CPU suite uses.

The model (the probabilistic rounding model of Higham & Mary, "A new approach to
probabilistic rounding error analysis", SIAM J. Sci. Comput. 41(5), 2019): every f32
operation returns x(1 + d) with d independent, mean zero, |d| <= u = 2^-24, so uniform on
[-u, u] at worst, with variance u^2 / 3. To first order the error of a result is then a sum
of independent terms, one per rounding, each the rounding's d times the value it rounded
(times how that value reaches the result). Its variance is computed here in float64 from
the very inputs a test draws, for the very accumulation lengths its schedule uses:

* a sequential sum x_1 + ... + x_n rounds every partial sum P_k = x_1 + ... + x_k, so
  Var = u^2/3 * sum_k P_k^2. For terms of random sign P_k grows like sqrt(k): the error
  grows like sqrt(n) * u * |x|, where the worst case (n * u * sum|x|) is far too loose to
  keep a check's power (at n = 131072 it exceeds 1e-2);
* the score s_j = scale * q . k_j is a 576-term dot product, so its error has the variance
  of that chain (BLAS and the GPU block or pair the terms, which only shortens the partial
  sums); exp(s_j - m) adds the subtraction's rounding (|s_j - m| * d) and the exponential's
  own error (at most EXP_ULPS ulp: 2 u per ulp). An error e_j in s_j is a relative error
  e_j in the weight w_j, which moves latent by sum_j w_j e_j (v_j - latent);
* the latent of a split schedule is the sum, per slice, of its rows in order, then the
  combine's sum over slices in slice order: two chains, whose partial sums are computed
  from `splits.slice_bounds`, the kernel's own partition;
* l = sum_j w_j is a chain of positive terms (partial sums up to l): it enters latent as a
  relative error of l times latent, and lse additively.

A relL2 over 512 latent columns is the norm of 512 nearly independent errors: it
concentrates at its rms, sqrt(sum of the variances) / ||latent||, within a few per cent.
Measured errors lie at 0.2 .. 0.5 of that rms (tests/test_tolerances.py; the model takes
every rounding at the uniform worst case and the score's chain in sequential order, which
BLAS shortens). MARGIN = 4
covers what the model leaves out (the tile rescales' one rounding per 32 rows, about 1/32 of
the chain's variance; the combine weights' rounding, common to a slice) with room. A
single value (lse of one head) is a Gaussian tail: LAMBDA = 6 standard deviations
(probability 2e-9 each).

Negative controls are orders of magnitude above these bounds (each test shows it): a
combine without its exp(m_i - m) factors errs by 0.2 .. 0.5, a skipped 32-row tile by
1e-3 .. 1e-2, another head's or a padded zero-query head's result by O(1).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from mlasandbox.bf16 import as_f64
from mlasandbox.splits import slice_bounds

U32 = 2.0 ** -24        # unit roundoff of float32, round to nearest
VAR_D = U32 ** 2 / 3    # variance of one rounding's relative error d, uniform on [-u, u]
EXP_ULPS = 4            # exp's error: NumPy's f32 exp < 1 ulp, CUDA's ex2.approx 2 ulp
MARGIN = 4.0            # a relL2 over >= 128 columns stays within this of its estimate
LAMBDA = 6.0            # standard deviations for one scalar (lse of one head)

# Float64 against float64 (the reference against another float64 evaluation): the worst-case
# bounds of f64_bounds, tight enough at u = 2^-53 that no probabilistic argument is needed.
U64 = 2.0 ** -53


def _chain_sq(x: np.ndarray, axis: int = 0) -> np.ndarray:
    """sum_k P_k^2 over the partial sums P_k of a sequential sum of x along `axis` (in f32:
    a variance needs two digits, not sixteen)."""
    return np.square(np.cumsum(x, axis=axis, dtype=np.float32)).sum(axis=axis,
                                                                     dtype=np.float64)


def _sliced_chain_sq(x: np.ndarray, bounds) -> np.ndarray:
    """_chain_sq of each slice x[a:b] (along axis 0), summed over the slices: one cumsum,
    each slice's partial sums are the running total less its value before the slice."""
    run = np.cumsum(x, axis=0, dtype=np.float32)
    total = np.zeros(x.shape[1:], dtype=np.float64)
    for a, b in bounds:
        part = run[a:b] if a == 0 else run[a:b] - run[a - 1]
        total += np.square(part).sum(axis=0, dtype=np.float64)
    return total


@dataclass(frozen=True)
class ErrorScale:
    """Per head: the rms the model predicts for an f32 schedule's error against float64."""

    latent_rel: np.ndarray   # [H] relL2 of latent
    out_rel: np.ndarray      # [H] relL2 of out = wv_b @ latent
    lse_abs: np.ndarray      # [H] absolute error of lse

    def latent_bound(self, h=None) -> float:
        """MARGIN x the rms: the relL2(latent) a correct f32 schedule stays below."""
        v = self.latent_rel if h is None else self.latent_rel[h]
        return float(MARGIN * np.max(v))

    def out_bound(self) -> float:
        return float(MARGIN * np.max(self.out_rel))

    def lse_bound(self) -> float:
        return float(LAMBDA * np.max(self.lse_abs))


def f32_error_scale(q, cache, wv_b, n_ctx: int, scale: float, splits: int = 1,
                    heads=None) -> ErrorScale:
    """The model's error rms of a float32 online softmax over `splits` contiguous slices
    (the kernels' schedule; splits = 1 is one chain over all of n_ctx), per head."""
    qf = as_f64(q)
    cache64 = as_f64(cache[:n_ctx])
    wv = as_f64(wv_b)
    kv_lora = wv.shape[-1]
    v = cache64[:, :kv_lora]
    # the variances need two digits: their chains run in f32, on the inputs' own values
    cache32 = cache64.astype(np.float32)
    v32 = cache32[:, :kv_lora]
    v_sq = np.square(v)
    bounds = [slice_bounds(n_ctx, splits, s) for s in range(splits)]
    bounds = [(a, b) for a, b in bounds if b > a]
    heads = range(qf.shape[0]) if heads is None else heads
    lat_rel, out_rel, lse_abs = [], [], []
    for h in heads:
        s = scale * (cache64 @ qf[h])                      # [n]
        m = s.max()
        w = np.exp(s - m)
        l_sum = w.sum()
        w /= l_sum                                          # normalized weights, sum 1
        lat = w @ v
        # weights: the score's 576-term chain, the subtraction s - m, the exponential
        terms = cache32 * np.float32(scale) * qf[h].astype(np.float32)   # [n, key_dim]
        var_s = VAR_D * _chain_sq(terms.T)
        var_w = var_s + VAR_D * ((s - m) ** 2 + (2 * EXP_ULPS) ** 2)
        # sum_j a_j (v_j - lat)^2 with a = w^2 var_w, expanded into two products with v
        a = np.square(w) * var_w
        var_lat = a @ v_sq - 2 * lat * (a @ v) + np.square(lat) * a.sum()
        # the accumulation: per slice a chain of its rows, then the combine's chain over
        # slices; every product w_j * v_j rounds once too
        x = w.astype(np.float32)[:, None] * v32
        totals = np.array([x[a:b].sum(axis=0) for a, b in bounds])
        var_lat += VAR_D * (_sliced_chain_sq(x, bounds) + np.square(w) @ v_sq
                            + _chain_sq(totals) + np.square(totals).sum(axis=0))
        # l: the same two chains on the weights; relative, as lat = acc / l
        l_tot = np.array([w[a:b].sum() for a, b in bounds])
        var_l = VAR_D * (_sliced_chain_sq(w, bounds) + _chain_sq(l_tot) + 1.0)
        var_lat += np.square(lat) * (var_l + VAR_D)        # + the division
        lat_norm = float(np.linalg.norm(lat))
        lat_rel.append(math.sqrt(var_lat.sum()) / lat_norm)
        # out = wv_b @ latent: the latent's error carried through, plus a 512-term chain
        o = wv[h] @ lat
        var_o = np.square(wv[h]) @ var_lat + VAR_D * _chain_sq(wv[h] * lat, axis=1)
        out_rel.append(math.sqrt(var_o.sum()) / float(np.linalg.norm(o)))
        # lse = m + log(l): the weights' error averaged by w, l's chain, and the rounding
        # of the sum m + log l (|lse| * d) and of log
        lse = m + math.log(l_sum)
        var_lse = float(np.square(w) @ var_w) + var_l + VAR_D * (lse ** 2 + 4.0)
        lse_abs.append(math.sqrt(var_lse))
    return ErrorScale(np.array(lat_rel), np.array(out_rel), np.array(lse_abs))


def gamma(n: int, u: float = U64) -> float:
    """gamma_n = n u / (1 - n u): the worst-case relative error of an n-term sum or dot
    product in any order (Higham, Accuracy and Stability of Numerical Algorithms, 2002,
    Lemma 3.1 and eq. (3.5)). Used where it is tight enough: float64 against float64."""
    return n * u / (1 - n * u)


def dot_bound64(a_abs, b_abs, n: int):
    """|x - y| for two float64 evaluations (any orders) of the dot products a @ b:
    each is within gamma_n * (|a| @ |b|) of the exact value."""
    return 2 * gamma(n) * (np.asarray(a_abs) @ np.asarray(b_abs))


@dataclass(frozen=True)
class Bounds64:
    """Per-entry worst-case |difference| of two float64 evaluations of one decode step."""

    out: np.ndarray
    latent: np.ndarray
    lse: np.ndarray


def f64_bounds(q, cache, wv_b, n_ctx: int, scale: float) -> Bounds64:
    """Worst case (to first order in u = 2^-53) between two float64 evaluations of the
    decode formula in any summation order, chunking or max subtraction. Each evaluation:

    * s_t = scale * q . k_t is off by at most e_t = gamma_{d+1} scale |q| . |k_t|;
    * lse = m + log sum_t exp(s_t - m) by at most max_t e_t + gamma_{n+3} (1 + |lse|)
      (the positive sum of n terms, exp, log and the add);
    * latent_c = sum_t p_t v_tc with p_t = exp(s_t - lse) by at most
      sum_t p_t |v_tc| (e_t + e_lse + gamma_{n+3}), componentwise: no cancellation can
      make it larger, and where latent_c is near zero this absolute form still holds;
    * out = wv_b @ latent by |wv_b| @ e_latent + gamma_kv |wv_b| @ |latent|.

    Two evaluations differ by at most twice that. A wrong formula misses by O(1).
    """
    qf, k = as_f64(q), as_f64(cache[:n_ctx])
    wv = as_f64(wv_b)
    kv = wv.shape[-1]
    n, d = k.shape
    s = scale * qf @ k.T
    e_s = gamma(d + 1) * abs(scale) * np.abs(qf) @ np.abs(k).T        # [H, n]
    lse = np.logaddexp.reduce(s, axis=1)
    e_lse = e_s.max(axis=1) + gamma(n + 3) * (1 + np.abs(lse))
    p = np.exp(s - lse[:, None])
    e_w = p * (e_s + e_lse[:, None] + gamma(n + 3))                       # [H, n]
    e_lat = e_w @ np.abs(k[:, :kv])
    lat_abs = p @ np.abs(k[:, :kv])
    e_out = (np.abs(wv) @ (e_lat + gamma(kv) * lat_abs)[:, :, None])[:, :, 0]
    return Bounds64(out=2 * e_out, latent=2 * e_lat, lse=2 * e_lse)


def assert_within(got, want, bound, err_msg: str = "") -> None:
    """|got - want| <= bound entry by entry (bound an array or a scalar); NaN never passes.
    The message names the worst entry and how far past its bound it is."""
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    bound = np.broadcast_to(np.asarray(bound, dtype=np.float64), want.shape)
    err = np.abs(got - want)
    ok = err <= bound
    if not ok.all():
        ratio = np.where(ok, 0.0, np.where(np.isfinite(err), err / bound, np.inf))
        i = np.unravel_index(int(np.argmax(ratio)), want.shape)
        raise AssertionError(f"{np.count_nonzero(~ok)} of {want.size} entries past their "
                             f"bound; worst at {i}: {got[i]!r} vs {want[i]!r}, error "
                             f"{err[i]:.3e} > bound {bound[i]:.3e} {err_msg}")
