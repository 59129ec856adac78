"""grad_topk and iterative_softmax_topk (seed 001): exact references, the seed's failing
recursion, properties, limits, derivatives, errors.

Independent references (no code shared with the library):
  * brute-force enumeration of all k-subsets (n <= 10), each term exp(sum_S u - max) in
    float64 and the sums by math.fsum: no subtraction, so exact to rounding;
  * for n = 40, the elementary symmetric polynomials in 80-digit ``decimal`` arithmetic
    (stdlib; exp of the float64 inputs to 80 digits), y_i = w_i e_{k-1}(w without i) / e_k(w);
  * seed 001's own numpy reference recursion, reimplemented below as printed in the seed.
"""

import decimal
import fractions
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from implicit_topk import smooth_topk
from implicit_topk.smooth_topk import grad_topk, iterative_softmax_topk
from gradcheck import check_grads

jax.config.update("jax_enable_x64", True)

_SETTINGS = settings(max_examples=25, deadline=None, print_blob=True,
                     suppress_health_check=[HealthCheck.too_slow])


# The operators jit their core per (k, shape of x / l, dtype); the tests reuse a few
# shapes and values of k (rows of length _N, batches of _B) so that they compile rarely.
_B, _N = 4, 10
_KS = (1, 2, 5, 9)


def _rows(seed, shape, scale=1.0):
  return scale * np.random.default_rng(seed).normal(size=shape)


# -- references -----------------------------------------------------------------------


def brute_force(x, k, l=1.0):
  """(y, log e_k) by enumerating every k-subset; float64 with a max shift and fsum."""
  u = np.asarray(x, np.float64) / l
  subsets = list(itertools.combinations(range(u.size), k))
  s = np.array([math.fsum(u[list(S)]) for S in subsets])
  m = s.max()
  w = np.exp(s - m)
  z = math.fsum(w)
  y = np.array([math.fsum(w[t] for t, S in enumerate(subsets) if i in S) for i in range(u.size)])
  return y / z, m + math.log(z)


def decimal_reference(x, k, digits=80):
  """y by the non-log DP in ``digits``-digit decimal arithmetic (O(n^2 k))."""
  with decimal.localcontext() as ctx:
    ctx.prec = digits
    w = [decimal.Decimal(float(v)).exp() for v in x]

    def e(ws, j):
      table = [decimal.Decimal(1)] + [decimal.Decimal(0)] * j
      for wi in ws:
        for m in range(j, 0, -1):
          table[m] += wi * table[m - 1]
      return table[j]

    total = e(w, k)
    return np.array([float(w[i] * e(w[:i] + w[i + 1:], k - 1) / total) for i in range(len(w))])


def seed_grad_topk(x, k):
  """Seed 001's reference implementation of GradTopK, verbatim."""
  for i in range(1, k + 1):
    logZs = x if i == 1 else x + logZ + np.log(1 - np.exp(logZs - logZ))  # noqa: F821
    logZ = np.logaddexp.reduce(logZs) - np.log(i)
  return np.exp(logZs - logZ)


def hard_mask(x, k):
  out = np.zeros(x.shape)
  np.put_along_axis(out, np.argsort(-x, axis=-1, kind="stable")[..., :k], 1.0, axis=-1)
  return out


# -- grad_topk: exactness ---------------------------------------------------------------


@pytest.mark.parametrize("n, ks", [(2, (1,)), (5, (1, 2, 3, 4)), pytest.param(_N, _KS, marks=pytest.mark.slow)])
def test_grad_topk_equals_brute_force_enumeration(n, ks):
  x = _rows(n, (_B, n))
  ls = np.array([0.2, 0.7, 1.0, 5.0])
  for k in ks:
    y = np.asarray(grad_topk(jnp.asarray(x), k, regularization_strength=ls))
    for row, l, yr in zip(x, ls, y):
      expected, _ = brute_force(row, k, l)
      np.testing.assert_allclose(yr, expected, rtol=1e-13, atol=1e-15, err_msg=f"k={k} l={l}")


def test_log_elementary_symmetric_polynomial_equals_enumeration():
  x = _rows(0, (3, 9), scale=30.0)
  for k in (1, 4, 8):
    log_ek = np.asarray(jax.jit(smooth_topk._log_esp, static_argnums=1)(jnp.asarray(x), k))
    for row, value in zip(x, log_ek):
      np.testing.assert_allclose(value, brute_force(row, k)[1], rtol=1e-14)


def test_seed_recursion_fails_where_the_log_space_dp_is_exact():
  """x = 100 * randn, k = n / 2: the seed's recursion takes log(1 - exp(~0)) = log(0)."""
  x = _rows(0, (10,), scale=100.0)
  with np.errstate(all="ignore"):
    seed = seed_grad_topk(x, 5)
  assert not np.all(np.isfinite(seed)), seed
  expected, _ = brute_force(x, 5)
  y = np.asarray(grad_topk(jnp.asarray(x), 5))
  assert np.all(np.isfinite(y))
  np.testing.assert_allclose(y, expected, rtol=1e-12, atol=1e-15)
  np.testing.assert_allclose(y.sum(), 5.0, rtol=1e-15)
  # float32: absolute error ~1e-7 on the same input
  y32 = np.asarray(grad_topk(jnp.asarray(x, jnp.float32), 5))
  assert y32.dtype == np.float32 and np.all(np.isfinite(y32))
  np.testing.assert_allclose(y32, expected, atol=2e-6)
  # on a mild input both agree, so the reimplementation of the seed is faithful
  mild = _rows(1, (10,))
  np.testing.assert_allclose(seed_grad_topk(mild, 5), brute_force(mild, 5)[0], atol=1e-12)


def test_seed_recursion_fails_at_n40_while_ours_matches_80_digit_arithmetic():
  x = _rows(2, (40,), scale=100.0)
  with np.errstate(all="ignore"):
    assert not np.all(np.isfinite(seed_grad_topk(x, 20)))
  expected = decimal_reference(x, 20)
  y = np.asarray(grad_topk(jnp.asarray(x), 20))
  np.testing.assert_allclose(y, expected, atol=1e-14)
  big = expected > 1e-300  # relative accuracy wherever the exact value is a normal double
  np.testing.assert_allclose(y[big], expected[big], rtol=1e-11)
  y32 = np.asarray(grad_topk(jnp.asarray(x, jnp.float32), 20))
  np.testing.assert_allclose(y32, expected, atol=1e-5)


# -- grad_topk: properties --------------------------------------------------------------


@_SETTINGS
@given(k=st.sampled_from(_KS), scale=st.sampled_from([0.1, 1.0, 10.0]),
       seed=st.integers(0, 2**31))
def test_grad_topk_properties(k, scale, seed):
  x = _rows(seed, (_B, _N), scale)
  l = np.array([0.3, 2.0, 1.0, 0.05])
  y = np.asarray(grad_topk(jnp.asarray(x), k, regularization_strength=l))
  np.testing.assert_allclose(y.sum(-1), k, rtol=1e-13)          # sums to k
  assert np.all((y >= 0) & (y <= 1 + 4e-16))                    # in [0, 1] (to rounding)
  for xr, yr in zip(x, y):                                      # monotone
    order = np.argsort(xr)
    assert np.all(np.diff(yr[order]) >= -1e-15)
  shifted = np.asarray(grad_topk(jnp.asarray(x + 7.5), k, regularization_strength=l))  # shift invariant
  np.testing.assert_allclose(shifted, y, atol=1e-13)
  np.testing.assert_allclose(y, [brute_force(r, k, lr)[0] for r, lr in zip(x, l)], atol=1e-13)


def test_grad_topk_k1_is_softmax():
  x = _rows(3, (_B, _N), scale=3.0)
  for l in (0.1, 1.0, 4.0):
    np.testing.assert_allclose(grad_topk(jnp.asarray(x), 1, regularization_strength=l), jax.nn.softmax(x / l, -1),
                               rtol=1e-13, atol=1e-300)


def test_grad_topk_tends_to_the_hard_mask_with_the_exponential_bound():
  """||y - hard||_inf <= max(k, n - k) exp(-(x_(k) - x_(k+1)) / l) (proofs/grad_topk.md)."""
  x = _rows(4, (_B, _N))
  for k in _KS:
    s = -np.sort(-x, -1)
    gap = s[:, k - 1] - s[:, k]
    for l in (1.0, 0.1, 0.01, 1e-3):
      y = np.asarray(grad_topk(jnp.asarray(x), k, regularization_strength=l))
      err = np.max(np.abs(y - hard_mask(x, k)), -1)
      bound = max(k, _N - k) * np.exp(-gap / l)
      assert np.all(err <= bound * (1 + 1e-9) + 1e-15), (k, l, err, bound)
  y = np.asarray(grad_topk(jnp.asarray(x), 2, regularization_strength=1e-4))
  np.testing.assert_allclose(y, hard_mask(x, 2), atol=1e-12)


def test_grad_topk_tends_to_k_over_n_as_l_grows():
  x = jnp.asarray(_rows(5, (_B, _N)))
  np.testing.assert_allclose(grad_topk(x, 5, regularization_strength=1e6), np.full((_B, _N), 0.5), atol=1e-5)


# -- grad_topk: API ---------------------------------------------------------------------


def test_grad_topk_axis_batch_per_row_l_and_transformations():
  x = jnp.asarray(_rows(6, (3, 8, 2)))
  l = jnp.array([[0.5, 1.0], [2.0, 0.3], [1.0, 1.0]])  # the batch shape (3, 2)
  y = grad_topk(x, 3, regularization_strength=l, axis=1)
  assert y.shape == x.shape
  for a in range(3):
    for b in range(2):
      np.testing.assert_allclose(y[a, :, b], brute_force(np.asarray(x[a, :, b]), 3, float(l[a, b]))[0],
                                 atol=1e-13)
  np.testing.assert_allclose(jax.jit(grad_topk, static_argnames=("k", "axis"))(x, k=3, regularization_strength=l, axis=1), y,
                             atol=1e-15)
  vm = jax.vmap(lambda r: grad_topk(r, 3, regularization_strength=0.7, axis=1), in_axes=2, out_axes=2)(x)
  np.testing.assert_allclose(vm, grad_topk(x, 3, regularization_strength=0.7, axis=1), atol=1e-15)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_grad_topk_dtypes(dtype):
  x = _rows(7, (_B, _N))
  y = grad_topk(jnp.asarray(x, dtype), 5, regularization_strength=0.5)
  assert y.dtype == dtype
  expected = np.stack([brute_force(np.asarray(jnp.asarray(r, dtype), np.float64), 5, 0.5)[0] for r in x])
  atol = {jnp.float32: 1e-6, jnp.float16: 2e-3, jnp.bfloat16: 1e-2}[dtype]
  np.testing.assert_allclose(np.asarray(y, np.float64), expected, atol=atol)


def test_grad_topk_check_grads_fwd_and_rev():
  x = jnp.asarray(_rows(8, (_B, _N)))
  w = jnp.asarray(_rows(9, (_B, _N)))
  f = jax.jit(lambda x, l: grad_topk(x, 5, regularization_strength=l) * w)
  check_grads(f, (x, 0.7), modes=("fwd", "rev"), atol=1e-6, rtol=1e-6, eps=1e-6)


def test_grad_topk_jacobian_is_the_covariance_of_the_subset_indicator():
  """dy/dx = Cov_q(1_S) / l: symmetric, rows sum to 0, diagonal y(1-y)/l, off-diagonal <= 0."""
  x = _rows(10, (6,))
  k, l = 2, 0.8
  jac = np.asarray(jax.jacrev(lambda x: grad_topk(x, k, regularization_strength=l))(jnp.asarray(x)))
  u = x / l
  subsets = list(itertools.combinations(range(6), k))
  q = np.exp([u[list(S)].sum() for S in subsets])
  q /= q.sum()
  ind = np.array([[1.0 if i in S else 0.0 for i in range(6)] for S in subsets])
  mean = q @ ind
  cov = (ind - mean).T @ np.diag(q) @ (ind - mean)
  np.testing.assert_allclose(jac, cov / l, atol=1e-13)
  np.testing.assert_allclose(jac.sum(1), 0, atol=1e-14)
  assert np.all(jac[~np.eye(6, dtype=bool)] <= 1e-15)


def test_grad_topk_non_finite_inputs():
  y = grad_topk(jnp.array([-jnp.inf, 1.0, 2.0, 0.0]), 2)
  np.testing.assert_allclose(y, np.r_[0.0, brute_force(np.array([1.0, 2.0, 0.0]), 2)[0]], atol=1e-15)
  assert np.array_equal(grad_topk(jnp.array([-jnp.inf, 1.0, 2.0, 0.0]), 3), [0.0, 1.0, 1.0, 1.0])
  assert np.all(np.isnan(grad_topk(jnp.array([-jnp.inf, -jnp.inf, 2.0, 0.0]), 3)))
  assert np.all(np.isnan(grad_topk(jnp.array([jnp.nan, 1.0, 2.0, 0.0]), 2)))
  assert np.all(np.isnan(grad_topk(jnp.array([jnp.inf, 1.0, 2.0, 0.0]), 2)))
  g = jax.grad(lambda x: grad_topk(x, 2)[1])(jnp.array([-jnp.inf, 1.0, 2.0, 0.0]))
  assert np.all(np.isfinite(g))


# -- errors -----------------------------------------------------------------------------


@pytest.mark.parametrize("op", [grad_topk, iterative_softmax_topk])
@pytest.mark.parametrize(
    "k, kwargs, error, match",
    [
        (-1, {}, ValueError, "0 <= k <= n"),
        (5, {}, ValueError, "0 <= k <= n with n=4"),
        (2.0, {}, TypeError, "`k` must be a static Python int"),
        (True, {}, TypeError, "`k` must be a static Python int"),
        (2, dict(regularization_strength=0.0), ValueError,
         "`regularization_strength` must be finite and > 0"),
        (2, dict(regularization_strength=-1.0), ValueError, "`regularization_strength`"),
        (2, dict(axis=1), ValueError, "-1 <= axis < 1"),
    ],
)
def test_bad_arguments_raise_clear_errors(op, k, kwargs, error, match):
  with pytest.raises(error, match=match):
    op(jnp.array([1.0, 2.0, 3.0, 4.0]), k, **kwargs)


def test_more_bad_arguments():
  with pytest.raises(TypeError, match="floating dtype"):
    grad_topk(jnp.array([1, 2, 3]), 1)
  with pytest.raises(ValueError, match="at least one dimension"):
    grad_topk(jnp.array(1.0), 1)
  with pytest.raises(ValueError, match="`variant` must be one of"):
    iterative_softmax_topk(jnp.array([1.0, 2.0, 3.0]), 1, variant="bogus")
  with pytest.raises(TypeError, match="static Python int"):
    jax.jit(grad_topk)(jnp.array([1.0, 2.0, 3.0]), 1)


# -- iterative_softmax_topk ---------------------------------------------------------------


@pytest.mark.parametrize("variant", ["logits", "weighted"])
def test_iterative_sums_to_k_is_shift_invariant_and_k1_is_softmax(variant):
  x = _rows(11, (_B, _N))
  for k in _KS:
    p = np.asarray(iterative_softmax_topk(jnp.asarray(x), k, regularization_strength=0.7, variant=variant))
    np.testing.assert_allclose(p.sum(-1), k, rtol=1e-13)
    shifted = iterative_softmax_topk(jnp.asarray(x - 3.25), k, regularization_strength=0.7, variant=variant)
    np.testing.assert_allclose(shifted, p, atol=1e-13)
  np.testing.assert_allclose(iterative_softmax_topk(jnp.asarray(x), 1, regularization_strength=0.7, variant=variant),
                             jax.nn.softmax(x / 0.7, -1), atol=1e-15)


def test_iterative_logits_is_not_in_the_capped_simplex_nor_monotone():
  """The seed could not prove p in [0,1] or monotonicity; both fail on tiny inputs."""
  # the two minima always get logit 0, so the largest entry is picked again
  p = np.asarray(iterative_softmax_topk(jnp.array([0.0, 6.0, 0.0]), 2, regularization_strength=1.0))
  np.testing.assert_allclose(p, [0.33249510, 1.33500981, 0.33249510], atol=1e-8)
  assert p.max() > 1.3
  # 5 gets more than 6
  p = np.asarray(iterative_softmax_topk(jnp.array([0.0, 5.0, 6.0]), 2, regularization_strength=1.0))
  np.testing.assert_allclose(p, [0.02411327, 1.13326568, 0.84262105], atol=1e-8)
  assert p[1] > p[2] and p[1] > 1


def test_iterative_logits_tends_to_the_hard_mask_for_distinct_entries():
  rng = np.random.default_rng(12)
  x = np.stack([rng.permutation(_N) * 0.1 + rng.uniform(0, 0.01) for _ in range(_B)])  # gaps >= 0.1
  for k in (2, 5):
    p = np.asarray(iterative_softmax_topk(jnp.asarray(x), k, regularization_strength=1e-3))
    np.testing.assert_allclose(p, hard_mask(x, k), atol=1e-9)


def test_iterative_weighted_does_not_converge_its_limit_is_1_5_and_0_5():
  """Seed 001: for k = 2 and l -> 0 the weighted-softmax iteration gives 1.5 and 0.5."""
  x = jnp.array([3.0, 0.0, 2.0, 1.0, -0.5])
  for l in (0.1, 0.01, 2e-3):
    p = np.asarray(iterative_softmax_topk(x, 2, regularization_strength=l, variant="weighted"))
    np.testing.assert_allclose(p, [1.5, 0.0, 0.5, 0.0, 0.0], atol=1e-4 if l == 0.1 else 1e-12)
  # the logits variant on the same input converges to the hard mask
  np.testing.assert_allclose(iterative_softmax_topk(x, 2, regularization_strength=1e-3), [1.0, 0.0, 1.0, 0.0, 0.0],
                             atol=1e-12)
  # rounding 1 - p to 0 would hide the limit: forming 1 - p directly gives the hard mask
  naive = np.zeros(5)
  for _ in range(2):
    naive = naive + np.asarray(jax.nn.softmax(x / 1e-3 + jnp.log(1 - naive)))
  np.testing.assert_allclose(naive, [1.0, 0.0, 1.0, 0.0, 0.0], atol=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["logits", "weighted"])
def test_iterative_check_grads_and_dtypes(variant):
  x = jnp.asarray(_rows(13, (_B, _N)))
  w = jnp.asarray(_rows(14, (_B, _N)))
  f = jax.jit(lambda x, l: iterative_softmax_topk(x, 3, regularization_strength=l, variant=variant) * w)
  check_grads(f, (x, 0.9), modes=("fwd", "rev"), atol=1e-6, rtol=1e-6, eps=1e-6)
  y = iterative_softmax_topk(x.T.astype(jnp.float16), 3, regularization_strength=0.9, variant=variant, axis=0)
  assert y.dtype == jnp.float16 and y.shape == x.T.shape
  np.testing.assert_allclose(np.asarray(y, np.float64).T,
                             iterative_softmax_topk(x, 3, regularization_strength=0.9, variant=variant), atol=3e-3)
  vm = jax.vmap(lambda r: iterative_softmax_topk(r, 3, regularization_strength=0.9, variant=variant))(x)
  np.testing.assert_allclose(vm, iterative_softmax_topk(x, 3, regularization_strength=0.9, variant=variant), atol=1e-15)


# -- strength range, overflowing gaps, -inf entries (audit F2, F3, F9) -------------------


def exact_brute_force(x, k, l, digits=60):
  """y by enumerating k-subsets: subset sums of u = x / l as exact fractions (no overflow,
  no rounding: ties stay ties), then exp of their differences in ``digits``-digit decimal."""
  u = [fractions.Fraction(float(v)) / fractions.Fraction(float(l)) for v in x]
  subsets = list(itertools.combinations(range(len(u)), k))
  s = [sum((u[i] for i in S), fractions.Fraction(0)) for S in subsets]
  m = max(s)
  with decimal.localcontext() as ctx:
    ctx.prec = digits
    w = [(decimal.Decimal(d.numerator) / decimal.Decimal(d.denominator)).exp()
         for d in (v - m for v in s)]  # exp of a huge negative number underflows to 0
    z = sum(w)
    return np.array([float(sum(wt for wt, S in zip(w, subsets) if i in S) / z)
                     for i in range(len(u))])


def _strength_edges(dtype):
  """(smallest, largest) in-range strengths, and the nearest out-of-range ones."""
  tiny = np.finfo(dtype).tiny
  top = dtype(1) / tiny
  return ((float(tiny), float(np.nextafter(top, dtype(0)))),
          (float(np.nextafter(tiny, dtype(0))), float(top)))


@pytest.mark.parametrize("op", [grad_topk, iterative_softmax_topk])
@pytest.mark.parametrize("dtype, named", [(np.float32, (1e-38,)), (np.float64, (1e-310, 5e-324))])
def test_strength_outside_the_float_range_raises(op, dtype, named):
  """2^-126 <= l < 2^126 (float32), 2^-1022 <= l < 2^1022 (float64), docs/operators.md."""
  x = jnp.asarray([0.3, -1.2, 2.0, 0.7], dtype)
  _, outside = _strength_edges(dtype)
  for l in outside + named:
    with pytest.raises(ValueError, match=r"regularization_strength` must satisfy .* <= "
                                         r"regularization_strength <"):
      op(x, 2, regularization_strength=l)
    with pytest.raises(ValueError, match="regularization_strength` must satisfy"):
      op(x[None], 2, regularization_strength=np.full(1, l))  # per row
  # a traced strength is not checked: NaN
  for l in outside + (-1.0, 0.0):
    y = jax.jit(lambda x, l: op(x, 2, regularization_strength=l))(x, jnp.asarray(l, dtype))
    assert np.all(np.isnan(y)), (l, y)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_strength_at_the_edges_of_the_range(dtype):
  """l = tiny: the hard top-k (x / l overflows); the largest l: k / n to O(x / l)."""
  x = np.array([0.3, -1.2, 2.0, 0.7], dtype) / 4  # the logits variant needs (x - min) / l finite
  (low, high), _ = _strength_edges(dtype)
  for k in (1, 2, 3):
    hard = hard_mask(x, k)
    y = np.asarray(grad_topk(jnp.asarray(x), k, regularization_strength=low), np.float64)
    np.testing.assert_array_equal(y, exact_brute_force(x, k, low))
    np.testing.assert_array_equal(y, hard)
    y = np.asarray(grad_topk(jnp.asarray(x), k, regularization_strength=high), np.float64)
    np.testing.assert_allclose(y, exact_brute_force(x, k, high), rtol=1e-6)
    np.testing.assert_allclose(y, k / 4, rtol=1e-6)
    for variant in ("logits", "weighted"):
      p = iterative_softmax_topk(jnp.asarray(x), k, regularization_strength=high, variant=variant)
      np.testing.assert_allclose(p, k / 4, rtol=1e-6)
    p = iterative_softmax_topk(jnp.asarray(x), k, regularization_strength=low)
    np.testing.assert_array_equal(p, hard)


def test_grad_topk_gaps_that_overflow_x_over_l_give_the_exact_limit():
  """The audit's cases: x / l overflows for finite x; the answer is the hard top-k."""
  cases = [([3e38, 0.0, 1.0], np.float32, 1, 0.5, [1, 0, 0]),
           ([1e30, 0.0, -1e30], np.float32, 1, 1e-10, [1, 0, 0]),
           ([1e300, 0.0, 1.0], np.float64, 2, 1e-10, [1, 0, 1]),
           ([3e38, -3e38, -2e38, 0.0], np.float32, 3, 1.0, [1, 0, 1, 1]),  # x - t overflows
           ([1.7e308, -1.7e308, 1e308], np.float64, 2, 1e-300, [1, 0, 1])]
  for x, dtype, k, l, expected in cases:
    x = jnp.asarray(x, dtype)
    y = grad_topk(x, k, regularization_strength=l)
    assert y.dtype == dtype
    np.testing.assert_array_equal(y, expected)
    np.testing.assert_array_equal(y, exact_brute_force(np.asarray(x), k, l))
    w = jnp.arange(1.0, x.size + 1, dtype=dtype)
    gx, gl = jax.grad(lambda x, l: jnp.sum(w * grad_topk(x, k, regularization_strength=l)),
                      argnums=(0, 1))(x, jnp.asarray(l, dtype))
    assert np.all(np.isfinite(gx)) and np.isfinite(gl), (x, gx, gl)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_grad_topk_huge_scales_and_ties_equal_exact_enumeration(dtype):
  """Random rows (n <= 8) scaled so that x / l overflows or nearly does, with ties."""
  rng = np.random.default_rng(20)
  big = float(np.finfo(dtype).max) / 4
  for trial in range(12):
    n = (3, 5, 8)[trial % 3]
    x = np.clip(rng.normal(size=n), -3, 3) * rng.choice([1.0, 1e10, big])
    x[rng.integers(n)] = x[rng.integers(n)]          # a tie
    x[: n // 3] = rng.choice([-1, 1], n // 3) * big  # entries near the float maximum
    x = x.astype(dtype)
    k = int(rng.integers(1, n))
    for l in (2.0**-100, 1.0, 2.0**83):  # exact in float32
      y = np.asarray(grad_topk(jnp.asarray(x), k, regularization_strength=l), np.float64)
      expected = exact_brute_force(x, k, l)
      atol = 1e-6 if dtype == np.float32 else 1e-14
      np.testing.assert_allclose(y, expected, rtol=atol, atol=atol, err_msg=f"{x} k={k} l={l}")


def test_grad_topk_derivatives_next_to_entries_beyond_the_range():
  """Fractional entries next to clamped ones: derivatives vs float64 central differences."""
  x = jnp.array([[1e300, 0.3, 0.0, -0.2, -1e300], [1.0, 0.5, -1e308, 1e308, 0.9]])
  w = jnp.asarray(_rows(21, (2, 5)))
  np.testing.assert_allclose(grad_topk(x, 2, regularization_strength=0.5)[0],
                             exact_brute_force(np.asarray(x[0]), 2, 0.5), rtol=1e-14, atol=1e-300)
  f = jax.jit(lambda x, l: grad_topk(x, 2, regularization_strength=l) * w)
  check_grads(f, (x, 0.5), modes=("fwd", "rev"), atol=1e-6, rtol=1e-6, eps=1e-6)


def iterative_reference(x, k, l, variant):
  """The documented recursion in numpy; -inf entries take no part and get 0."""
  x = np.asarray(x, np.float64)
  keep = x > -np.inf
  u = x[keep] / l
  p = np.zeros(u.size)
  if variant == "logits":
    u = u - u.min()
    for _ in range(k):
      z = (1 - p) * u
      e = np.exp(z - z.max())
      p = p + e / e.sum()
  else:
    e = np.exp(u - u.max())
    for _ in range(k):
      v = (1 - p) * e
      p = p + v / v.sum()
  out = np.zeros(x.size)
  out[keep] = p
  return out


@pytest.mark.parametrize("variant", ["logits", "weighted"])
def test_iterative_neg_inf_entries_get_zero(variant):
  rows = [([0.0, -np.inf, 1.0], 1), ([0.0, -np.inf, 1.0], 2),
          ([-np.inf, 0.5, -2.0, -np.inf, 1.5, 0.2], 3),
          ([-np.inf, 0.5, -2.0, 0.3, 1.5, -np.inf], 1)]
  for x, k in rows:
    p = np.asarray(iterative_softmax_topk(jnp.asarray(x), k, regularization_strength=0.7,
                                          variant=variant))
    np.testing.assert_allclose(p, iterative_reference(x, k, 0.7, variant), rtol=1e-13, atol=1e-300)
    assert np.all(p[np.isneginf(x)] == 0)
    if k == 1:  # softmax(x / l), with 0 at -inf
      e = np.exp(np.asarray(x) / 0.7 - np.max(x) / 0.7)
      np.testing.assert_allclose(p, e / e.sum(), rtol=1e-13)
    gx, gl = jax.grad(
        lambda x, l: jnp.sum(jnp.arange(len(x)) * iterative_softmax_topk(
            x, k, regularization_strength=l, variant=variant)), argnums=(0, 1))(jnp.asarray(x), 0.7)
    assert np.all(np.isfinite(gx)) and np.isfinite(gl), (x, gx, gl)
    assert np.all(gx[np.isneginf(x)] == 0)
  for x in ([-np.inf, -np.inf], [0.0, np.nan, 1.0], [0.0, np.inf, 1.0]):
    assert np.all(np.isnan(iterative_softmax_topk(jnp.asarray(x), 1, variant=variant))), x


def test_iterative_beyond_the_float_range():
  """logits: (x - min x) / l overflows -> NaN; weighted: exp((x - max x) / l) -> 0."""
  x = jnp.array([3e38, 0.0, 1.0], jnp.float32)
  assert np.all(np.isnan(iterative_softmax_topk(x, 1, regularization_strength=0.5)))
  p = iterative_softmax_topk(x, 1, regularization_strength=0.5, variant="weighted")
  np.testing.assert_array_equal(p, [1.0, 0.0, 0.0])
