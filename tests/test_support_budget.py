"""``soft_topk_mask(..., max_support=m)``: at most m nonzero entries per row, against an
independent reference (the reference mask of tests/references.py at a strength found by
bisection on the budget's equation, not the library's closed form), the plain mask where
the bound does not bind, the tie rule, continuity, gradients against central differences
and the argument checks."""

from __future__ import annotations

import jax
from jax.test_util import check_grads
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import implicit_topk as itk
import references as R


def _budget_strength(row, k, l, m, p):
  """The strength the budget asks for, by bisection (float64, in log space) on
  sum_i mask((x_i - c) / l') = k, with the cut c of the documented tie rule."""
  reg = R.regularizer("pnorm", p)
  order = np.sort(row)[::-1]
  c = order[m]
  if np.sum(row > c) < k:
    lower = row[row < c]
    if lower.size == 0:
      return l
    c = lower.max()
  total = lambda strength: float(np.sum(reg.mask((row - c) / strength)))
  if total(l) >= k:
    return l  # the plain mask meets the budget
  lo, hi = np.log(l) - 200.0, np.log(l)  # total(exp(lo)) >= k > total(exp(hi))
  for _ in range(200):
    mid = 0.5 * (lo + hi)
    lo, hi = (mid, hi) if total(np.exp(mid)) >= k else (lo, mid)
  return float(np.exp(lo))


def reference(x, k, l, m, p):
  x = np.asarray(x, np.float64)
  out = np.empty_like(x)
  for i, row in enumerate(x.reshape(-1, x.shape[-1])):
    strength = _budget_strength(row, k, l, m, p)
    out.reshape(-1, x.shape[-1])[i] = R.soft_topk_mask(row, k, strength, p)
  return out


def _rows(seed, shape, ties=False):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=shape)
  if ties:
    x = np.round(x * 2) / 2  # many ties
  return x


slow = pytest.mark.slow


@pytest.mark.parametrize("p", [4.0 / 3.0, 2.0, pytest.param(1.5, marks=slow)])
@pytest.mark.parametrize("scale", [pytest.param(1e-20, marks=slow), 1e-3,
                                   pytest.param(1.0, marks=slow), pytest.param(1e3, marks=slow),
                                   1e20])
def test_bound_sum_and_reference_over_scales_and_strengths(p, scale):
  x = _rows(0, (12, 9)) * scale
  for l in (0.05 * scale, 0.5 * scale, 5.0 * scale, 500.0 * scale):
    for k, m in ((1.0, 2), (2.0, 3), (2.5, 4)):
      y = np.asarray(itk.soft_topk_mask(jnp.asarray(x), k, regularization_strength=l, p=p,
                                        max_support=m))
      assert np.all(np.sum(y > 0, axis=-1) <= m)
      np.testing.assert_allclose(y.sum(-1), k, rtol=0, atol=1e-12 * max(1.0, k))
      np.testing.assert_allclose(y, reference(x, k, l, m, p), rtol=0, atol=1e-9)


@pytest.mark.parametrize("solver", ["native", "threshold",
                                    pytest.param("pallas", marks=pytest.mark.slow)])
def test_every_solver_and_dtype(solver):
  x = _rows(1, (7, 10))
  want = reference(x, 2.0, 1.0, 3, 4.0 / 3.0)
  for dtype, tol in ((jnp.float64, 1e-9), (jnp.float32, 2e-5)):
    y = itk.soft_topk_mask(jnp.asarray(x, dtype), 2.0, regularization_strength=1.0,
                           max_support=3, solver=solver)
    assert y.dtype == dtype
    assert np.all(np.sum(np.asarray(y) > 0, axis=-1) <= 3)
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=0, atol=tol)
  half = itk.soft_topk_mask(jnp.asarray(x, jnp.bfloat16), 2.0, max_support=3, solver=solver)
  assert half.dtype == jnp.bfloat16 and np.all(np.sum(np.asarray(half) > 0, axis=-1) <= 3)


def test_the_plain_mask_where_the_bound_does_not_bind():
  x = jnp.asarray(_rows(2, (20, 16)))
  for l in (0.01, 0.2):
    plain = itk.soft_topk_mask(x, 2.0, regularization_strength=l)
    capped = itk.soft_topk_mask(x, 2.0, regularization_strength=l, max_support=6)
    fits = np.sum(np.asarray(plain) > 0, axis=-1) <= 6
    assert fits.any()
    np.testing.assert_array_equal(np.asarray(capped)[fits], np.asarray(plain)[fits])
  big = itk.soft_topk_mask(x, 2.0, regularization_strength=3.0, max_support=16)  # m = n
  np.testing.assert_array_equal(np.asarray(big), np.asarray(
      itk.soft_topk_mask(x, 2.0, regularization_strength=3.0)))


def test_ties_enter_together_by_the_documented_rule():
  # k = 1.5, m = 2: one entry above the (m+1)-th largest (3.0), tied with the 2nd and 4th.
  x = jnp.array([[5.0, 3.0, 3.0, 3.0, 1.0, 0.0]])
  y = np.asarray(itk.soft_topk_mask(x, 1.5, regularization_strength=10.0, max_support=2))
  assert y[0, 1] == y[0, 2] == y[0, 3] > 0 and y[0, 4] == y[0, 5] == 0
  np.testing.assert_allclose(y.sum(), 1.5, atol=1e-12)
  np.testing.assert_allclose(y, reference(np.asarray(x), 1.5, 10.0, 2, 4.0 / 3.0), atol=1e-9)
  # Enough entries strictly above the cut: the bound holds at a tie below it.
  x = jnp.array([[5.0, 4.0, 3.0, 3.0, 1.0]])
  y = np.asarray(itk.soft_topk_mask(x, 1.5, regularization_strength=10.0, max_support=2))
  assert np.sum(y > 0) == 2
  np.testing.assert_allclose(y, reference(np.asarray(x), 1.5, 10.0, 2, 4.0 / 3.0), atol=1e-9)


def test_integer_k_with_k_entries_above_the_cut_is_the_hard_mask():
  x = jnp.array([[4.0, 3.0, 1.0, 1.0, 1.0, 0.0]])  # x_(4) = 1 tied; 2 entries above it
  y = itk.soft_topk_mask(x, 2.0, regularization_strength=50.0, max_support=3)
  np.testing.assert_array_equal(np.asarray(y), [[1.0, 1.0, 0.0, 0.0, 0.0, 0.0]])


def test_near_ties_in_float32_keep_the_sum_and_finite_derivatives():
  # The m-th and (m+1)-th entries 1.7e-7 (23 float32 ulps) apart: l* is of that size, so
  # solving the mask again at l* in float32 lost 15% of k and gave infinite derivatives.
  x = jnp.array([-0.05046099, -0.02986698, 0.2721215, 0.11211337, -0.23936808, 0.11211354,
                 0.06787282, -0.16315442], jnp.float32)
  for k, m in ((1.5, 2), (1.3, 3), (2.2, 3)):
    f = lambda z: itk.soft_topk_mask(z, k, regularization_strength=0.5, max_support=m)
    y = np.asarray(f(x))
    np.testing.assert_allclose(y.sum(), k, rtol=1e-6)
    assert np.sum(y > 0) <= m
    np.testing.assert_allclose(y, reference(np.asarray(x, np.float64), k, 0.5, m, 4.0 / 3.0),
                               atol=1e-5)
    assert np.all(np.isfinite(np.asarray(jax.jacrev(f)(x))))


def test_continuous_in_x():
  x = _rows(3, (30, 8))
  rng = np.random.default_rng(4)
  f = lambda z: np.asarray(itk.soft_topk_mask(jnp.asarray(z), 2.5, regularization_strength=2.0,
                                              max_support=4))
  base = f(x)
  for eps in (1e-4, 1e-6):
    step = rng.normal(size=x.shape) * eps
    assert np.max(np.abs(f(x + step) - base)) < 200 * eps


@pytest.mark.parametrize("p", [4.0 / 3.0, pytest.param(2.0, marks=slow)])
def test_gradients_match_central_differences(p):
  x = jnp.asarray(_rows(5, (4, 7)))
  weights = jnp.asarray(np.random.default_rng(6).normal(size=(4, 7)))
  for l in (0.3, 4.0):  # mostly plain / mostly capped
    f = lambda z, s: jnp.sum(weights * itk.soft_topk_mask(z, 2.5, regularization_strength=s,
                                                          p=p, max_support=3))
    check_grads(lambda z: f(z, l), (x,), order=1, modes=("rev", "fwd"), eps=1e-6,
                atol=1e-5, rtol=1e-5)
    check_grads(lambda s: f(x, s), (l,), order=1, modes=("rev",), eps=1e-6, atol=1e-5,
                rtol=1e-5)


def test_the_budget_moves_the_gradient_to_the_cut_entry():
  # Capped: the threshold is the (m+1)-th largest entry, so that entry gets a gradient
  # although its own output is 0 (the strength depends on it).
  x = jnp.array([3.0, 2.5, 1.0, 0.5, 0.0])  # y_0 = 1.2 d_0^3 / (d_0^3 + d_1^3), d = x - x_2
  g = jax.grad(lambda z: itk.soft_topk_mask(z, 1.2, regularization_strength=5.0,
                                            max_support=2)[0])(x)
  assert g[2] != 0 and g[3] == 0 and g[4] == 0


def test_arguments_are_checked_by_name():
  x = jnp.ones((2, 5))
  with pytest.raises(ValueError, match="max_support.*p-norm"):
    itk.soft_topk_mask(x, 2.0, regularizer="sigmoid", max_support=3)
  with pytest.raises(ValueError, match="max_support.*larger than k"):
    itk.soft_topk_mask(x, 3.0, max_support=3)
  with pytest.raises(TypeError, match="max_support"):
    itk.soft_topk_mask(x, 1.0, max_support=2.5)
  with pytest.raises(ValueError, match="max_support"):
    itk.soft_topk_mask(x, 1.0, max_support=0)


def test_jit_vmap_and_where():
  x = jnp.asarray(_rows(7, (3, 5, 8)))
  f = lambda z: itk.soft_topk_mask(z, 2.0, regularization_strength=2.0, max_support=3)
  eager = f(x)
  np.testing.assert_allclose(jax.jit(f)(x), eager, atol=1e-14)
  np.testing.assert_allclose(jax.vmap(f)(x), eager, atol=1e-14)
  valid = jnp.arange(8) < 6
  y = itk.soft_topk_mask(x, 2.0, regularization_strength=2.0, max_support=3,
                         where=jnp.broadcast_to(valid, x.shape))
  np.testing.assert_allclose(y[..., :6], f(x[..., :6]), atol=1e-12)
  assert np.all(np.asarray(y[..., 6:]) == 0)


@settings(max_examples=6, deadline=None)
@given(st.integers(0, 10_000), st.floats(0.01, 100.0), st.sampled_from([4.0 / 3.0, 2.0]),
       st.integers(2, 6), st.booleans())
def test_property_bound_and_sum(seed, l, p, m, ties):
  x = _rows(seed, (3, 9), ties=ties) * 10.0 ** ((seed % 7) - 3)
  k = m - 0.5
  y = np.asarray(itk.soft_topk_mask(jnp.asarray(x), k, regularization_strength=l, p=p,
                                    max_support=m))
  np.testing.assert_allclose(y.sum(-1), k, atol=1e-10)
  for row, out in zip(x, y):
    c = np.sort(row)[::-1][m]
    allowed = m if np.sum(row > c) >= k else np.sum(row >= c)  # the tie rule
    assert np.sum(out > 0) <= allowed
