"""Dykstra's isotonic regression and the "dykstra" top-k solver; implicit vs unrolled."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, HealthCheck
from hypothesis import strategies as st
from scipy.optimize import isotonic_regression

import implicit_topk as itk
from implicit_topk import compat
from implicit_topk.solvers.dykstra import isotonic_dykstra, isotonic_dykstra_unrolled
from gradcheck import check_grads

# One worker runs this module (pyproject: --dist loadgroup): its tests share compiled
# functions, which a second worker would compile again.
pytestmark = pytest.mark.xdist_group("test_dykstra")


def _rows(seed, shape, ties=False):
  x = np.random.default_rng(seed).normal(size=shape)
  return jnp.asarray(np.round(3 * x) if ties else x, jnp.float64)


def _scipy_decreasing(u, weights=None):
  return np.stack([isotonic_regression(row, weights=None if weights is None else w,
                                       increasing=False).x
                   for row, w in zip(np.asarray(u), np.asarray(weights) if weights is not None
                                     else [None] * len(u))])


# -- isotonic regression --------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 7, 40])
def test_isotonic_dykstra_matches_scipy(n):
  u = _rows(0, (5, n), ties=True)
  result = isotonic_dykstra(u, tol=0.0, max_iter=20000)
  np.testing.assert_allclose(result.v, _scipy_decreasing(u), atol=1e-9)
  assert result.v.shape == u.shape and result.iter_num.shape == (5,)


def test_weighted_isotonic_dykstra_matches_scipy():
  u = _rows(1, (4, 23))
  weights = jnp.asarray(np.random.default_rng(2).uniform(0.2, 3.0, size=(4, 23)))
  result = isotonic_dykstra(u, weights, tol=0.0, max_iter=20000)
  np.testing.assert_allclose(result.v, _scipy_decreasing(u, weights), atol=1e-9)


@pytest.mark.slow
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.floats(-10, 10), min_size=1, max_size=12))
def test_isotonic_dykstra_is_monotone_and_matches_scipy_property(values):
  u = jnp.asarray([values], jnp.float64)
  v = isotonic_dykstra(u, tol=0.0, max_iter=5000).v
  assert np.all(np.diff(np.asarray(v)) <= 1e-9)
  np.testing.assert_allclose(v, _scipy_decreasing(u), atol=1e-7)


@pytest.mark.slow
def test_isotonic_dykstra_stops_at_tol_and_reports_it():
  u = _rows(3, (3, 200))  # pure noise: blocks span most of the row, convergence is slow
  loose = isotonic_dykstra(u, tol=1e-2, max_iter=100000)
  tight = isotonic_dykstra(u, tol=1e-5, max_iter=100000)
  assert np.all(loose.change <= 1e-2) and np.all(tight.change <= 1e-5)
  assert np.all(loose.iter_num < tight.iter_num) and np.all(tight.iter_num < 100000)
  capped = isotonic_dykstra(u, tol=0.0, max_iter=3)
  assert np.all(capped.iter_num == 3)


@pytest.mark.slow
def test_unrolled_sweeps_equal_the_while_loop_iterates():
  u = _rows(4, (2, 31))
  for sweeps in (1, 5, 40):
    np.testing.assert_allclose(isotonic_dykstra_unrolled(u, num_sweeps=sweeps),
                               isotonic_dykstra(u, tol=0.0, max_iter=sweeps).v, atol=1e-14)


# -- the top-k solver ------------------------------------------------------------------


@pytest.mark.parametrize("n", [10, pytest.param(100, marks=pytest.mark.slow),
                               pytest.param(1000, marks=pytest.mark.slow)])
@pytest.mark.parametrize("ties", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_dykstra_matches_pav_at_tol(n, ties):
  x = _rows(5 + n, (4, n), ties=ties)
  for k in (max(1.0, n / 10), n / 10 + 0.37):
    y, info = itk.soft_topk_mask(x, k, regularization_strength=0.3, p=2.0, solver="dykstra", tol=1e-6, return_info=True)
    assert np.all(info.iter_num < 10000) and np.all(info.residual <= 1e-6)
    exact = itk.soft_topk_mask(x, k, regularization_strength=0.3, p=2.0, solver="pav")
    np.testing.assert_allclose(y, exact, atol=1e-5)


@pytest.mark.slow  # solver="pav" as the reference: its kernels compile on first use
def test_dykstra_reads_the_blocks_off_its_multipliers_float32():
  """Issue 27: in float32 the residual of 1 x 1000, k = 10 stayed above 1e-6 (rounding),
  so every call ran maxiter = 10000 sweeps; the blocks read off the multipliers and
  tested (proofs/dykstra_snap.md) end those rows with the exact mask."""
  x = jax.random.normal(jax.random.PRNGKey(0), (3, 1000), jnp.float32)
  y, info = itk.soft_topk_mask(x, 10, p=2.0, solver="dykstra", return_info=True)
  exact = itk.soft_topk_mask(x, 10, p=2.0, solver="pav")
  assert np.all(info.iter_num < 1000), info.iter_num
  np.testing.assert_allclose(y, exact, atol=1e-6)
  l1 = jnp.sum(jnp.abs(y - exact), axis=-1)
  np.testing.assert_allclose(info.residual, l1, atol=2e-5)  # rounding of both masks


def test_dykstra_snap_keeps_fixed_budgets_at_tol_zero():
  """tol = 0 (the unrolled study's budgets): plain sweeps, exactly maxiter of them."""
  x = _rows(11, (2, 200))
  _, info = itk.soft_topk_mask(x, 20.0, regularization_strength=0.3, p=2.0,
                               solver="dykstra", tol=0.0, maxiter=100, return_info=True)
  assert np.all(info.iter_num == 100)


@pytest.mark.slow
def test_dykstra_implicit_gradient_matches_the_exact_one():
  x, w = _rows(6, (3, 300)), _rows(7, (3, 300))
  f = lambda x, solver: jnp.sum(w * itk.soft_topk_mask(x, 30.4, regularization_strength=0.5, p=2.0, solver=solver))
  np.testing.assert_allclose(jax.grad(f)(x, "dykstra"), jax.grad(f)(x, "pav"), atol=1e-5)


@pytest.mark.parametrize("diff", ["implicit", pytest.param("unrolled", marks=pytest.mark.slow)])
def test_dykstra_gradients_pass_check_grads(diff):
  x, w = _rows(8, (2, 9)), _rows(9, (2, 9))
  opts = dict(maxiter=400) if diff == "unrolled" else dict(tol=1e-12)
  f = lambda x: jnp.sum(w * itk.soft_topk_mask(x, 3.5, regularization_strength=0.7, p=2.0, solver="dykstra",
                                               diff=diff, **opts))
  check_grads(f, (x,), modes=("fwd", "rev"), atol=1e-6, rtol=1e-6, eps=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("solver", ["dykstra", "threshold"])
def test_unrolled_gradient_converges_to_the_implicit_one(solver):
  x, w = _rows(10, (2, 40)), _rows(11, (2, 40))
  f = lambda x, **kw: jnp.sum(w * itk.soft_topk_mask(x, 6.5, regularization_strength=0.5, p=2.0, solver=solver, **kw))
  exact = jax.grad(f)(x)
  budgets = (3, 2000) if solver == "dykstra" else (1, 40)
  errors = [float(jnp.max(jnp.abs(jax.grad(functools.partial(f, diff="unrolled", maxiter=t))(x)
                                  - exact))) for t in budgets]
  assert errors[1] < 1e-6 < errors[0], errors


@pytest.mark.slow
def test_gradients_wrt_k_and_l_match_finite_differences():
  x, w = _rows(12, (2, 30)), _rows(13, (2, 30))

  def f(k, l):
    return jnp.sum(w * itk.soft_topk_mask(x, k, regularization_strength=l, p=2.0, solver="dykstra", tol=1e-12))

  h = 1e-6
  np.testing.assert_allclose(jax.grad(f, 0)(5.3, 0.8), (f(5.3 + h, 0.8) - f(5.3 - h, 0.8)) / (2 * h),
                             rtol=1e-5)
  np.testing.assert_allclose(jax.grad(f, 1)(5.3, 0.8), (f(5.3, 0.8 + h) - f(5.3, 0.8 - h)) / (2 * h),
                             rtol=1e-5)


@pytest.mark.slow
def test_dykstra_batch_axis_jit_vmap_and_float32():
  x = _rows(14, (3, 17, 5))
  y = itk.soft_topk_mask(x, 4.0, regularization_strength=0.4, p=2.0, solver="dykstra", axis=1)
  np.testing.assert_allclose(y, itk.soft_topk_mask(x, 4.0, regularization_strength=0.4, p=2.0, solver="pav", axis=1),
                             atol=1e-5)
  fn = jax.jit(functools.partial(itk.soft_topk_mask, k=4.0, regularization_strength=0.4, p=2.0, solver="dykstra"))
  rows = jnp.moveaxis(x, 1, -1)
  np.testing.assert_allclose(jax.vmap(fn)(rows), fn(rows), atol=1e-12)
  y32 = itk.soft_topk_mask(rows.astype(jnp.float32), 4.0, regularization_strength=0.4, p=2.0, solver="dykstra")
  assert y32.dtype == jnp.float32
  np.testing.assert_allclose(y32, fn(rows), atol=1e-4)


def test_dykstra_non_finite_inputs_follow_the_documented_rules():
  inf, nan = jnp.inf, jnp.nan
  x = jnp.array([[inf, 1.0, 0.5, -inf, 0.2],
                 [nan, 1.0, 0.5, 0.3, 0.2],
                 [inf, inf, inf, 0.5, 0.2],   # three at +inf, k = 2: no threshold
                 [-inf, -inf, -inf, -inf, 0.2]])
  y = itk.soft_topk_mask(x, 2.0, regularization_strength=0.3, p=2.0, solver="dykstra")
  exact = itk.soft_topk_mask(x, 2.0, regularization_strength=0.3, p=2.0, solver="pav")
  np.testing.assert_allclose(y[0], exact[0], atol=1e-6)
  assert y[0, 0] == 1.0 and y[0, 3] == 0.0
  assert np.all(np.isnan(y[1:]))


def test_dykstra_errors_name_the_argument():
  x = _rows(15, (5,))
  with pytest.raises(ValueError, match="p=2"):
    itk.soft_topk_mask(x, 2, p=4 / 3, solver="dykstra")
  with pytest.raises(ValueError, match="`tol`"):
    itk.soft_topk_mask(x, 2, p=2.0, solver="dykstra", tol=-1.0)
  with pytest.raises(ValueError, match="`maxiter`"):
    itk.soft_topk_mask(x, 2, p=2.0, solver="dykstra", maxiter=0)
  with pytest.raises(ValueError, match="`tol` does not apply"):
    itk.soft_topk_mask(x, 2, solver="pav", tol=1e-3)
  with pytest.raises(ValueError, match="unrolled"):
    itk.soft_topk_mask(x, 2, solver="pav", diff="unrolled")
  with pytest.raises(ValueError, match="`diff`"):
    itk.soft_topk_mask(x, 2, diff="backprop")


# -- the seed README, through compat ---------------------------------------------------


@pytest.mark.slow
def test_seed_readme_dykstra_examples():
  values = jnp.array([-5.0, -2.0, 3.0, 1.0])
  np.testing.assert_array_equal(compat.sparse_soft_topk_mask_dykstra(values, k=2, l=1e-2),
                                [0.0, 0.0, 1.0, 1.0])
  batch = jnp.array([[[-11, 1, 4, -7], [5, 1, 4, 1], [-10, -3, 4, -6]],
                     [[7, -6, -8, -4], [-1, 9, 8, 4], [0, 0, -5, 5]]], jnp.int32)
  fn = functools.partial(compat.sparse_soft_topk_mask_dykstra, k=2, num_iter=100, l=1e-2)
  expected = [[[0, 1, 1, 0], [1, 0, 1, 0], [0, 1, 1, 0]],
              [[1, 0, 0, 1], [0, 1, 1, 0], [0.5, 0.5, 0, 1]]]
  # the reference prints 0.99999905 / 1.0000229 (float32 Dykstra noise): ours is exact
  np.testing.assert_allclose(jax.vmap(jax.vmap(fn), in_axes=1, out_axes=1)(batch), expected,
                             atol=1e-6)
  np.testing.assert_allclose(fn(batch), expected, atol=1e-6)
