"""Regularizer plugins: built-ins against independent references, and user-defined ones."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import optimize, special

import implicit_topk as itk
from implicit_topk import regularizers
from gradcheck import check_grads

# One worker runs this module (pyproject: --dist loadgroup): its tests share compiled
# functions, which a second worker would compile again.
pytestmark = pytest.mark.xdist_group("test_regularizers")

# Independent numpy links y = clip(g(z), 0, 1), written from the formulas, not the library.
NUMPY_MASKS = {
    "entropy": lambda z: np.minimum(1.0, np.exp(np.minimum(z, 0.0))),
    "sigmoid": special.expit,
    "laplace": lambda z: np.where(z < 0, 0.5 * np.exp(np.minimum(z, 0)),
                                  1 - 0.5 * np.exp(-np.maximum(z, 0))),
}
# omega(y) from the formulas, for the primal objective <x, y> - l sum omega(y_i).
NUMPY_OMEGAS = {
    "entropy": lambda y: special.xlogy(y, y) - y,
    "sigmoid": lambda y: special.xlogy(y, y) + special.xlogy(1 - y, 1 - y),
    "laplace": lambda y: np.where(y < 0.5, special.xlogy(y, 2 * y) - y,
                                  special.xlogy(1 - y, 2 * (1 - y)) - (1 - y)),
}
NAMES = sorted(NUMPY_MASKS)
SOLVERS = ["threshold", "pav"]


def _rows(seed, shape, scale=1.0):
  return jnp.asarray(scale * np.random.default_rng(seed).normal(size=shape), jnp.float64)


def _brent_mask(x, k, l, name):
  mask = NUMPY_MASKS[name]
  phi = lambda lam: mask((x - lam) / l).sum() - k
  lo, hi = x.min() - 50 * l - 1, x.max() + 50 * l + 1
  lam = optimize.brentq(phi, lo, hi, xtol=1e-300, rtol=1e-15, maxiter=500)
  return mask((x - lam) / l)


def _slsqp_mask(x, k, l, name):
  n, omega = x.size, NUMPY_OMEGAS[name]
  res = optimize.minimize(
      lambda y: -(x @ y) + l * np.sum(omega(y)), np.full(n, k / n), method="SLSQP",
      bounds=[(1e-12, 1 - 1e-12)] * n,
      constraints=[{"type": "eq", "fun": lambda y: y.sum() - k}],
      options={"ftol": 1e-15, "maxiter": 2000})
  assert res.success, res.message
  return res.x


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("solver", ["threshold", pytest.param("pav", marks=pytest.mark.slow)])
@pytest.mark.parametrize("k", [1.0, 2.0, 3.7])
def test_matches_an_independent_root_and_the_primal_problem(name, solver, k):
  x = _rows(0, (4, 9))
  y = np.asarray(itk.soft_topk_mask(x, k, regularization_strength=0.7, regularizer=name, solver=solver))
  for row, x_row in zip(y, np.asarray(x)):
    np.testing.assert_allclose(row, _brent_mask(x_row, k, 0.7, name), atol=1e-12)
    np.testing.assert_allclose(row, _slsqp_mask(x_row, k, 0.7, name), atol=2e-5)


@pytest.mark.parametrize("solver", ["threshold", pytest.param("pav", marks=pytest.mark.slow)])
def test_k1_entropy_is_softmax(solver):
  x = _rows(1, (3, 11), scale=3.0)
  for l in (0.1, 1.0, 10.0):
    y = itk.soft_topk_mask(x, 1, regularization_strength=l, regularizer="entropy", solver=solver)
    np.testing.assert_allclose(y, jax.nn.softmax(x / l, axis=-1), atol=1e-12, rtol=1e-12)


def _numpy_sparsemax(z):
  s = np.sort(z)[::-1]
  cumsum = np.cumsum(s) - 1
  support = np.flatnonzero(s - cumsum / np.arange(1, z.size + 1) > 0)[-1] + 1
  return np.maximum(z - cumsum[support - 1] / support, 0)


@pytest.mark.parametrize("solver", ["threshold", pytest.param("pav", marks=pytest.mark.slow)])
def test_k1_p2_is_sparsemax(solver):
  x = _rows(2, (4, 13))
  y = itk.soft_topk_mask(x, 1, regularization_strength=0.5, p=2.0, solver=solver)
  for row, x_row in zip(np.asarray(y), np.asarray(x)):
    np.testing.assert_allclose(row, _numpy_sparsemax(x_row / 0.5), atol=1e-12)


@pytest.mark.parametrize(
    "name", [n if n == "sigmoid" else pytest.param(n, marks=pytest.mark.slow) for n in NAMES])
def test_gradients_pass_check_grads(name):
  x, w = _rows(3, (2, 8)), _rows(4, (2, 8))
  f = lambda x: jnp.sum(w * itk.soft_topk_mask(x, 2.5, regularization_strength=0.6, regularizer=name, solver="threshold"))
  check_grads(f, (x,), modes=("fwd", "rev"), atol=1e-6, rtol=1e-6, eps=1e-6)
  g = lambda k, l: jnp.sum(w * itk.soft_topk_mask(x, k, regularization_strength=l, regularizer=name, solver="threshold"))
  check_grads(g, (2.5, 0.6), modes=("fwd", "rev"), atol=1e-6, rtol=1e-6, eps=1e-6)


@pytest.mark.slow
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(NAMES), st.integers(0, 2**31 - 1), st.sampled_from([0.01, 0.3, 5.0]))
def test_pav_and_threshold_agree(name, seed, l):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(np.round(rng.normal(size=(3, 12)) * 2, 1))  # ties and duplicates
  k = jnp.asarray([1.0, float(rng.integers(2, 11)), float(rng.uniform(0.2, 11.8))])
  y_pav = itk.soft_topk_mask(x, k, regularization_strength=l, regularizer=name, solver="pav")
  y_thr = itk.soft_topk_mask(x, k, regularization_strength=l, regularizer=name, solver="threshold")
  np.testing.assert_allclose(y_pav, y_thr, atol=1e-10, rtol=0)


def test_pav_rejects_a_user_regularizer_with_a_clear_message():
  with pytest.raises(ValueError, match="solver='threshold'"):
    itk.soft_topk_mask(_rows(11, (6,)), 2.0, regularizer=Arctan(), solver="pav")


@pytest.mark.slow
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(NAMES), st.integers(0, 2**31 - 1), st.floats(0.05, 5.0),
       st.floats(-100, 100))
def test_feasible_monotone_and_shift_invariant(name, seed, l, shift):
  rng = np.random.default_rng(seed)
  n = int(rng.integers(2, 12))
  x = jnp.asarray(np.round(rng.normal(size=n) * 3, 1))  # ties included
  k = float(rng.uniform(0.1, n - 0.1))
  f = lambda x: itk.soft_topk_mask(x, k, regularization_strength=l, regularizer=name, solver="threshold")
  y = np.asarray(f(x))
  assert np.all((y >= 0) & (y <= 1)) and abs(y.sum() - k) <= 1e-9 * n
  order = np.argsort(np.asarray(x))
  assert np.all(np.diff(y[order]) >= -1e-12)  # larger x, larger y
  np.testing.assert_allclose(f(x + shift), y, atol=1e-9)


@pytest.mark.parametrize("name", NAMES)
def test_limits_small_and_large_l(name):
  x = jnp.asarray([3.0, -1.0, 2.0, 0.5, -2.0])
  hard = np.asarray(itk.hard_topk_mask(x, 2))
  np.testing.assert_allclose(itk.soft_topk_mask(x, 2, regularization_strength=1e-3, regularizer=name, solver="threshold"),
                             hard, atol=1e-12)
  np.testing.assert_allclose(itk.soft_topk_mask(x, 2, regularization_strength=1e6, regularizer=name, solver="threshold"),
                             np.full(5, 0.4), atol=1e-5)


@pytest.mark.parametrize(
    "name", [n if n == "entropy" else pytest.param(n, marks=pytest.mark.slow) for n in NAMES])
def test_float32_and_batch_axis(name):
  x = _rows(5, (3, 10, 2))
  y64 = itk.soft_topk_mask(x, 3.0, regularization_strength=0.5, regularizer=name, axis=1)
  y32 = itk.soft_topk_mask(x.astype(jnp.float32), 3.0, regularization_strength=0.5, regularizer=name, axis=1)
  assert y32.dtype == jnp.float32 and y32.shape == x.shape
  np.testing.assert_allclose(y32, y64, atol=2e-6)
  np.testing.assert_allclose(jnp.sum(y64, axis=1), 3.0, atol=1e-12)


def test_non_finite_inputs_with_dense_regularizers():
  inf = jnp.inf
  x = jnp.array([[inf, 1.0, 0.0, -inf], [inf, inf, 0.0, 1.0], [1.0, jnp.nan, 0.0, 2.0]])
  y = itk.soft_topk_mask(x, 2.0, regularization_strength=0.5, regularizer="sigmoid")
  assert y[0, 0] == 1.0 and y[0, 3] == 0.0
  np.testing.assert_allclose(y[0].sum(), 2.0, atol=1e-12)
  # k equals the +inf count: the finite entries are exactly 0, the sigmoid's limit as
  # the threshold goes to +inf (as a p-norm gives); a NaN entry still makes a NaN row.
  np.testing.assert_array_equal(y[1], [1, 1, 0, 0])
  assert np.all(np.isnan(y[2]))
  np.testing.assert_allclose(itk.soft_topk_mask(x[1], 2.0, regularization_strength=0.5, p=2.0), [1, 1, 0, 0])


# -- user-defined regularizers -----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HandWrittenPNorm:
  """omega(y) = |y|^p / p written from scratch (finite saturation [0, 1])."""

  p: float = 1.5
  saturation = (0.0, 1.0)

  def mask(self, z):
    inside = (z > 0) & (z < 1)
    safe = jnp.where(inside, z, 0.5)
    return jnp.where(z >= 1, 1.0, jnp.where(inside, safe ** (1 / (self.p - 1)), 0.0))

  def omega_prime(self, t):
    return t ** (self.p - 1)

  def omega(self, y):
    return jnp.abs(y) ** self.p / self.p


@dataclasses.dataclass(frozen=True)
class Arctan:
  """y = 1/2 + arctan(z)/pi: dense, heavy-tailed, infinite saturation."""

  saturation = (-float("inf"), float("inf"))

  def mask(self, z):
    return 0.5 + jnp.arctan(z) / jnp.pi

  def omega_prime(self, t):
    return jnp.tan(jnp.pi * (t - 0.5))

  def omega(self, y):  # integral of tan(pi (t - 1/2))
    return -jnp.log(jnp.sin(jnp.pi * y)) / jnp.pi


@pytest.mark.slow
def test_user_defined_pnorm_equals_the_builtin():
  x, w = _rows(6, (3, 12)), _rows(7, (3, 12))
  mine = lambda x: itk.soft_topk_mask(x, 4.2, regularization_strength=0.3, regularizer=HandWrittenPNorm(1.5), solver="threshold")
  builtin = lambda x: itk.soft_topk_mask(x, 4.2, regularization_strength=0.3, p=1.5, solver="pav")
  np.testing.assert_allclose(mine(x), builtin(x), atol=1e-12)
  np.testing.assert_allclose(jax.grad(lambda x: jnp.sum(w * mine(x)))(x),
                             jax.grad(lambda x: jnp.sum(w * builtin(x)))(x), atol=1e-10)


def test_user_defined_dense_regularizer_is_solved_and_differentiated():
  x, w = _rows(8, (2, 7)), _rows(9, (2, 7))
  reg = Arctan()
  y = np.asarray(itk.soft_topk_mask(x, 2.5, regularization_strength=0.4, regularizer=reg))
  for row, x_row in zip(y, np.asarray(x)):
    phi = lambda lam: (0.5 + np.arctan((x_row - lam) / 0.4) / np.pi).sum() - 2.5
    lam = optimize.brentq(phi, -1e6, 1e6, xtol=1e-300, rtol=1e-15)
    np.testing.assert_allclose(row, 0.5 + np.arctan((x_row - lam) / 0.4) / np.pi, atol=1e-12)
  f = lambda x: jnp.sum(w * itk.soft_topk_mask(x, 2.5, regularization_strength=0.4, regularizer=reg))
  check_grads(f, (x,), modes=("fwd", "rev"), atol=1e-6, rtol=1e-6, eps=1e-6)


def test_bad_regularizers_are_rejected_with_a_clear_message():
  x = _rows(10, (5,))
  with pytest.raises(ValueError, match="`regularizer` must be one of"):
    itk.soft_topk_mask(x, 2, regularizer="tsallis")
  with pytest.raises(TypeError, match="must provide `mask"):
    itk.soft_topk_mask(x, 2, regularizer=object())

  @dataclasses.dataclass(frozen=True)
  class NoOmegaPrime:
    saturation = (-float("inf"), float("inf"))

    def mask(self, z):
      return jax.nn.sigmoid(z)

  with pytest.raises(TypeError, match="omega_prime"):
    itk.soft_topk_mask(x, 2, regularizer=NoOmegaPrime())


def test_builtin_objects_satisfy_the_protocol():
  for reg in (regularizers.PNorm(2.0), regularizers.Entropy(), regularizers.BinaryEntropy(),
              regularizers.Laplace()):
    assert isinstance(reg, regularizers.Regularizer)
    t = jnp.asarray([0.1, 0.5, 0.9])
    # omega' inverts the unclipped link where the mask is strictly inside (0, 1)
    np.testing.assert_allclose(reg.mask(reg.omega_prime(t)), t, atol=1e-6)
