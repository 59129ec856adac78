"""sparse_softmax (seed 002 done right): brute force over supports, the seed's formula and
its counterexamples, properties, limits, derivatives, errors.

Independent references (no code shared with the library):
  * the projection onto {simplex, <= k non-zeros} by brute force: for every support S
    with |S| <= k, the Euclidean projection of z_S onto the simplex on S (exact, by
    locating the threshold between the breakpoints of a piecewise-linear function), and
    the best of them; on a few rows also scipy SLSQP for each support;
  * seed 002's documented formula, reimplemented below.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import optimize

from implicit_topk.sparse_softmax import sparse_softmax
from gradcheck import check_grads

jax.config.update("jax_enable_x64", True)

_SETTINGS = settings(max_examples=30, deadline=None, print_blob=True,
                     suppress_health_check=[HealthCheck.too_slow])
_B, _N = 4, 7


def _rows(seed, shape, scale=1.0):
  return scale * np.random.default_rng(seed).normal(size=shape)


def simplex_projection(v):
  """argmin_{p >= 0, sum p = 1} ||p - v||: p = max(v - tau, 0), tau found exactly.

  phi(tau) = sum max(v - tau, 0) - 1 is continuous, piecewise linear and decreasing,
  with kinks at the entries of v: bracket its root between two kinks and interpolate.
  """
  phi = lambda tau: np.maximum(v - tau, 0).sum() - 1  # noqa: E731
  kinks = np.sort(np.unique(np.r_[v, v.max() - 1]))
  values = np.array([phi(t) for t in kinks])
  j = np.flatnonzero(values <= 0)[0]
  if values[j] == 0 or j == 0:
    tau = kinks[j]
  else:
    t0, t1, f0, f1 = kinks[j - 1], kinks[j], values[j - 1], values[j]
    tau = t0 + f0 * (t1 - t0) / (f0 - f1)
  return np.maximum(v - tau, 0)


def brute_force(z, k, project=simplex_projection):
  """Best projection over every support of size <= k."""
  best, best_p = np.inf, None
  for size in range(1, k + 1):
    for support in itertools.combinations(range(z.size), size):
      s = list(support)
      p = np.zeros(z.size)
      p[s] = project(z[s])
      dist = np.sum((p - z) ** 2)
      if dist < best - 1e-13:
        best, best_p = dist, p
  return best_p


def slsqp_projection(v):
  res = optimize.minimize(
      lambda p: np.sum((p - v) ** 2), np.full(v.size, 1.0 / v.size), jac=lambda p: 2 * (p - v),
      method="SLSQP", bounds=[(0, None)] * v.size,
      constraints=[{"type": "eq", "fun": lambda p: p.sum() - 1, "jac": lambda p: np.ones(v.size)}],
      options={"ftol": 1e-15, "maxiter": 500})
  assert res.success, res.message
  return res.x


def seed_sparse_softmax(z, k):
  """Seed 002's documented formula: tau = (sum of the k largest - 1) / k; max(0, z - tau)."""
  z_sorted = np.sort(z)[::-1]
  tau = (z_sorted[:k].sum() - 1) / k
  return np.maximum(0, z - tau)


# -- exactness --------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [0.1, 1.0, 5.0])
def test_equals_brute_force_over_all_supports(scale):
  z = _rows(int(10 * scale), (_B, _N), scale)
  for k in range(1, _N + 1):
    p = np.asarray(sparse_softmax(jnp.asarray(z), k))
    for zr, pr in zip(z, p):
      np.testing.assert_allclose(pr, brute_force(zr, k), atol=1e-14, err_msg=f"k={k}")


def test_equals_brute_force_with_an_slsqp_qp_per_support():
  z = _rows(1, (2, 5))
  for k in (1, 2, 4):
    p = np.asarray(sparse_softmax(jnp.asarray(z), k))
    for zr, pr in zip(z, p):
      np.testing.assert_allclose(pr, brute_force(zr, k, slsqp_projection), atol=1e-7)


def test_k_equal_n_is_sparsemax_and_k1_is_the_argmax():
  z = _rows(2, (_B, _N), 0.5)
  np.testing.assert_allclose(sparse_softmax(jnp.asarray(z), _N),
                             np.stack([simplex_projection(r) for r in z]), atol=1e-14)
  one_hot = np.eye(_N)[np.argmax(z, -1)]
  assert np.array_equal(np.asarray(sparse_softmax(jnp.asarray(z), 1)), one_hot)


# -- seed 002's formula ------------------------------------------------------------------


def test_seed_formula_counterexamples():
  # more than k non-zeros, and the sum is not 1
  z = np.array([1.0, 0.9, 0.8, 0.7])
  seed = seed_sparse_softmax(z, 2)
  np.testing.assert_allclose(seed, [0.55, 0.45, 0.35, 0.25])
  assert np.count_nonzero(seed) == 4 and np.isclose(seed.sum(), 1.6)
  ours = np.asarray(sparse_softmax(jnp.asarray(z), 2))
  np.testing.assert_allclose(ours, [0.55, 0.45, 0.0, 0.0], atol=1e-15)
  np.testing.assert_allclose(ours, brute_force(z, 2), atol=1e-15)
  # the seed's own first example (k = 3): its formula sums to 1.4
  z = np.array([2.0, 1.5, 0.1, -1.0, 3.2, 0.7])
  seed = seed_sparse_softmax(z, 3)
  np.testing.assert_allclose(seed, [0.1, 0.0, 0.0, 0.0, 1.3, 0.0], atol=1e-15)
  assert np.isclose(seed.sum(), 1.4)
  ours = np.asarray(sparse_softmax(jnp.asarray(z), 3))
  np.testing.assert_allclose(ours, [0.0, 0.0, 0.0, 0.0, 1.0, 0.0], atol=1e-15)
  np.testing.assert_allclose(ours, brute_force(z, 3), atol=1e-15)


@_SETTINGS
@given(k=st.integers(1, _N), scale=st.sampled_from([0.05, 0.3, 1.0, 3.0]), seed=st.integers(0, 2**31))
def test_seed_formula_sums_to_at_least_one_and_agrees_only_when_feasible(k, scale, seed):
  z = _rows(seed, (_B, _N), scale)
  ours = np.asarray(sparse_softmax(jnp.asarray(z), k))
  for zr, pr in zip(z, ours):
    s = seed_sparse_softmax(zr, k)
    assert s.sum() >= 1 - 1e-12
    feasible = np.count_nonzero(s) <= k and abs(s.sum() - 1) < 1e-12
    assert feasible == np.allclose(s, pr, atol=1e-12)


# -- properties -------------------------------------------------------------------------


@_SETTINGS
@given(k=st.integers(1, _N), scale=st.sampled_from([0.05, 0.3, 1.0, 3.0]), seed=st.integers(0, 2**31),
       ties=st.booleans())
def test_properties(k, scale, seed, ties):
  z = _rows(seed, (_B, _N), scale)
  if ties:
    z = np.round(z / scale) * scale + 0.0  # + 0.0: no -0.0 (lax.top_k orders it below 0.0)
  p = np.asarray(sparse_softmax(jnp.asarray(z), k))
  np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-14)                 # sums to 1
  assert np.all((p >= 0) & (p <= 1))                                    # in [0, 1]
  assert np.all(np.count_nonzero(p, -1) <= k)                          # at most k non-zeros
  shifted = np.asarray(sparse_softmax(jnp.asarray(z + 12.5), k))
  np.testing.assert_allclose(shifted, p, atol=1e-13)                    # shift invariant
  for zr, pr in zip(z, p):                                              # monotone (weakly)
    i, j = np.nonzero(zr[:, None] > zr[None, :])
    assert np.all(pr[i] >= pr[j])
    dist = np.sum((pr - zr) ** 2)                                       # a projection
    assert dist <= np.sum((brute_force(zr, k) - zr) ** 2) + 1e-12


def test_limits_in_the_temperature():
  """sparse_softmax(z / l): one-hot argmax as l -> 0; k * p -> hard top-k as l -> inf,
  exactly 1/k + (z - mean_T z) / l on the top-k set T once l > sum_T (z_i - z_(k))."""
  z = _rows(3, (_B, _N))
  k = 3
  assert np.array_equal(np.asarray(sparse_softmax(jnp.asarray(z / 1e-3), k)), np.eye(_N)[np.argmax(z, -1)])
  top = np.argsort(-z, -1)[:, :k]
  zt = np.take_along_axis(z, top, -1)
  l_star = np.sum(zt - zt[:, -1:], -1)
  for factor in (1.01, 10.0, 1e6):
    l = (factor * l_star)[:, None]
    p = np.asarray(sparse_softmax(jnp.asarray(z / l), k))
    expected = np.zeros_like(z)
    np.put_along_axis(expected, top, 1 / k + (zt - zt.mean(-1, keepdims=True)) / l, -1)
    np.testing.assert_allclose(p, expected, atol=1e-13)
  hard = np.zeros_like(z)
  np.put_along_axis(hard, top, 1.0, -1)
  np.testing.assert_allclose(k * p, hard, atol=1e-5)


# -- derivatives and transformations ----------------------------------------------------------


def test_check_grads_fwd_and_rev_and_the_jacobian():
  z = jnp.asarray(_rows(4, (_B, _N)))
  w = jnp.asarray(_rows(5, (_B, _N)))
  f = jax.jit(lambda z: sparse_softmax(z, 3) * w)
  check_grads(f, (z,), modes=("fwd", "rev"), atol=1e-7, rtol=1e-7, eps=1e-6)
  row = z[0] * 0.3
  jac = np.asarray(jax.jacrev(lambda z: sparse_softmax(z, 3))(row))
  s = (np.asarray(sparse_softmax(row, 3)) > 0).astype(float)
  np.testing.assert_allclose(jac, np.diag(s) - np.outer(s, s) / s.sum(), atol=1e-15)
  np.testing.assert_allclose(jax.jacfwd(lambda z: sparse_softmax(z, 3))(row), jac, atol=1e-15)


def test_axis_jit_vmap_and_dtypes():
  z = jnp.asarray(_rows(6, (3, _N, 2)))
  p = sparse_softmax(z, 3, axis=1)
  assert p.shape == z.shape
  np.testing.assert_allclose(p, jnp.moveaxis(sparse_softmax(jnp.moveaxis(z, 1, -1), 3), -1, 1))
  np.testing.assert_allclose(jax.jit(sparse_softmax, static_argnames=("k", "axis"))(z, k=3, axis=1), p)
  np.testing.assert_allclose(jax.vmap(lambda r: sparse_softmax(r, 3, axis=1), in_axes=2, out_axes=2)(z), p)
  for dtype, atol in ((jnp.float32, 1e-6), (jnp.float16, 2e-3), (jnp.bfloat16, 2e-2)):
    q = sparse_softmax(z.astype(dtype), 3, axis=1)
    assert q.dtype == dtype
    np.testing.assert_allclose(np.asarray(q, np.float64), p, atol=atol)


def test_non_finite_inputs():
  assert np.array_equal(np.asarray(sparse_softmax(jnp.array([-jnp.inf, 1.0, 2.0]), 2)), [0.0, 0.0, 1.0])
  assert np.array_equal(np.asarray(sparse_softmax(jnp.array([-jnp.inf, -jnp.inf, 2.0]), 3)), [0.0, 0.0, 1.0])
  assert np.all(np.isnan(sparse_softmax(jnp.array([jnp.nan, 1.0, 2.0]), 2)))
  assert np.all(np.isnan(sparse_softmax(jnp.array([jnp.inf, 1.0, 2.0]), 2)))


@pytest.mark.parametrize(
    "k, kwargs, error, match",
    [
        (0, {}, ValueError, "0 < k <= n"),
        (5, {}, ValueError, "0 < k <= n with n=4"),
        (2.0, {}, TypeError, "`k` must be a static Python int"),
        (2, dict(axis=-2), ValueError, "-1 <= axis < 1"),
    ],
)
def test_bad_arguments_raise_clear_errors(k, kwargs, error, match):
  with pytest.raises(error, match=match):
    sparse_softmax(jnp.array([1.0, 2.0, 3.0, 4.0]), k, **kwargs)


def test_bad_inputs():
  with pytest.raises(TypeError, match="`z` must have a floating dtype"):
    sparse_softmax(jnp.array([1, 2, 3]), 1)
  with pytest.raises(TypeError, match="static Python int"):
    jax.jit(sparse_softmax)(jnp.array([1.0, 2.0, 3.0]), 1)
