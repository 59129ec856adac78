"""``soft_topk_mask(..., max_support=m)``: at most m nonzero entries per row, against an
independent reference: the exact reference mask of tests/references.py (rational
breakpoints, float64 bisection) at the strength found by float64 bisection on the
budget's equation with the documented tie rule (not the library's closed forms). Also:
the plain mask where the bound does not bind, ties, non-finite rows, every dtype,
continuity, gradients against float64 central differences, the JAX transformations and
the argument checks."""

from __future__ import annotations

import functools
import itertools

import jax
from jax.test_util import check_grads as jax_check_grads
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import implicit_topk as itk
import references as R
from gradcheck import check_grads

slow = pytest.mark.slow


def _cut(row, k, m):
  """The cut of the documented tie rule, or None where the budget can never bind."""
  order = np.sort(row)[::-1]
  c = order[m]
  if np.sum(row > c) < k:
    lower = row[row < c]
    c = lower.max() if lower.size else -np.inf
  return c if np.isfinite(c) else None


def _budget_strength(row, k, l, m, p):
  """The strength the budget asks for, by bisection (float64, in log space) on
  sum_i mask((x_i - c) / l') = k, with the cut c of the documented tie rule."""
  c = None if row.size <= m or np.isnan(row).any() else _cut(row, k, m)
  if c is None:
    return l
  reg = R.regularizer("pnorm", p)
  total = lambda strength: float(np.sum(reg.mask((row - c) / strength)))
  if total(l) >= k:
    return l  # the plain mask meets the budget
  lo, hi = np.log(l) - 80.0, np.log(l)  # total(exp(lo)) >= k > total(exp(hi))
  for _ in range(200):
    mid = 0.5 * (lo + hi)
    lo, hi = (mid, hi) if total(np.exp(mid)) >= k else (lo, mid)
  return float(np.exp(lo))


def reference(x, k, l, m, p=4.0 / 3.0):
  x = np.asarray(x, np.float64)
  rows = x.reshape(-1, x.shape[-1])
  ks = np.broadcast_to(np.asarray(k, np.float64), x.shape[:-1]).reshape(-1)
  out = np.empty_like(rows)
  for i, row in enumerate(rows):
    strength = _budget_strength(row, ks[i], l, m, p)
    out[i] = R.soft_topk_mask(row, ks[i], strength, p)
  return out.reshape(x.shape)


def allowed_support(row, k, m):
  """m, or the entries at or above the (m+1)-th largest where the tie rule applies."""
  c = np.sort(row)[::-1][m]
  return m if np.sum(row > c) >= k else int(np.sum(row >= c))


def _rows(seed, shape, ties=False):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=shape)
  if ties:
    x = np.round(x * 2) / 2  # many ties
  return x


def budget(x, k, l, m, **kw):
  return np.asarray(itk.soft_topk_mask(jnp.asarray(x), k, regularization_strength=l,
                                       max_support=m, **kw))


# -- the bound, the sum and the reference -------------------------------------------------


@pytest.mark.parametrize("p", [4.0 / 3.0, 2.0, pytest.param(1.5, marks=slow),
                               pytest.param(2.5, marks=slow)])
@pytest.mark.parametrize("scales", [(1e-30, 1.0, 1e30),
                                    pytest.param((1e-3, 1e3, 1e-300, 1e300), marks=slow)])
def test_bound_sum_and_reference_over_scales_and_strengths(p, scales):
  for scale, l_factor, (k, m) in itertools.product(
      scales, (0.05, 0.5, 5.0, 500.0), ((1.0, 3), (2.0, 3), (2.5, 3), (1e-9, 3), (2.999, 3))):
    x = _rows(0, (6, 9)) * scale
    l = l_factor * scale
    y = budget(x, k, l, m, p=p)
    assert np.all(np.sum(y > 0, axis=-1) <= m)
    np.testing.assert_allclose(y.sum(-1), k, rtol=0, atol=1e-12 * max(1.0, k))
    np.testing.assert_allclose(y, reference(x, k, l, m, p), rtol=0, atol=1e-11)


@slow
@pytest.mark.parametrize("p", [4.0 / 3.0, 2.0])
def test_k_near_zero_and_near_m(p):
  x = _rows(10, (8, 12))
  for k, m in ((1e-9, 2), (1e-3, 1), (2.999999, 3), (4.5, 5), (0.0, 2)):
    for l in (0.3, 30.0):
      y = budget(x, k, l, m, p=p)
      assert np.all(np.sum(y > 0, axis=-1) <= m)
      np.testing.assert_allclose(y.sum(-1), k, rtol=0, atol=1e-12)
      np.testing.assert_allclose(y, reference(x, k, l, m, p), rtol=0, atol=1e-11)


def test_the_plain_mask_where_the_bound_does_not_bind():
  x = _rows(2, (20, 16))
  for l in (0.01, 1.0):
    plain = np.asarray(itk.soft_topk_mask(jnp.asarray(x), 2.0, regularization_strength=l,
                                          solver="threshold"))
    default = np.asarray(itk.soft_topk_mask(jnp.asarray(x), 2.0, regularization_strength=l))
    capped = budget(x, 2.0, l, 6)
    fits = np.sum(plain > 0, axis=-1) <= 6
    assert fits.any() and (l < 1.0 or not fits.all())  # at l = 1 some rows bind
    # the plain mask of the reference (within the rounding bound every float64 mask is
    # held to), and the library's: the default solver's (whose threshold the kernel's
    # lanes compute) to an ulp or two, the threshold solver's to a few ulps
    eps = np.finfo(np.float64).eps
    assert np.all(np.abs(capped[fits] - R.soft_topk_mask(x[fits], 2.0, l))
                  <= R.mask_tolerance(x[fits], 2.0, l, eps=eps))
    np.testing.assert_allclose(capped[fits], default[fits], rtol=0, atol=2e-15)
    np.testing.assert_allclose(capped[fits], plain[fits], rtol=0, atol=2e-14)
    np.testing.assert_array_equal(capped[fits] > 0, plain[fits] > 0)


@pytest.mark.parametrize("p", [4.0 / 3.0, 2.0, 2.5, 3.0])
def test_an_entry_exactly_at_the_threshold_gets_exactly_zero(p):
  """Integer data whose plain threshold is an entry (x = 0 here: the two 1s saturate at
  l = 1 and fill k = 2 exactly), at scales where x / l is exact (1) and where it rounds
  (3, 1e-30, 1e30). The budget (m = 3) does not bind, so the output is the plain mask:
  exact 0s and 1s. For p > 2 (the general-p path) the entry at the threshold used to get
  sqrt(eps)-sized mass (7e-9 at p = 3): the iteration's tolerance through the mask's
  infinite slope at 0."""
  row = np.array([-1.0, 1.0, -2.0, -2.0, 1.0, -0.0, -1.0, -1.0])
  want = (row > 0).astype(np.float64)
  np.testing.assert_allclose(R.soft_topk_mask(row, 2.0, 1.0, p), want, rtol=0, atol=4e-16)
  for scale in (1.0, 3.0, 1e-30, 1e30):
    y = budget(row * scale, 2.0, scale, 3, p=p)
    np.testing.assert_allclose(y, want, rtol=0, atol=4e-16, err_msg=f"scale {scale}")
    assert y[5] == 0.0, (scale, y)


def test_rows_of_at_most_m_entries_never_bind():
  for n in (1, 3):
    x = _rows(n, (6, n))
    k = 0.5 * n
    for l in (0.1, 100.0):
      y = budget(x, k, l, 5, solver="threshold")
      np.testing.assert_allclose(y, R.soft_topk_mask(x, k, l), rtol=0, atol=1e-14)


# -- ties ---------------------------------------------------------------------------------


def test_ties_enter_together_by_the_documented_rule():
  # k = 1.5, m = 2: one entry above the (m+1)-th largest (3.0), tied with the 2nd and 4th.
  x = np.array([[5.0, 3.0, 3.0, 3.0, 1.0, 0.0]])
  y = budget(x, 1.5, 10.0, 2)
  assert y[0, 1] == y[0, 2] == y[0, 3] > 0 and y[0, 4] == y[0, 5] == 0
  np.testing.assert_allclose(y.sum(), 1.5, atol=1e-12)
  np.testing.assert_allclose(y, reference(x, 1.5, 10.0, 2), atol=1e-12)
  # Enough entries strictly above the cut: the bound holds at a tie below it.
  x = np.array([[5.0, 4.0, 3.0, 3.0, 1.0]])
  y = budget(x, 1.5, 10.0, 2)
  assert np.sum(y > 0) == 2
  np.testing.assert_allclose(y, reference(x, 1.5, 10.0, 2), atol=1e-12)
  # A tie straddling the m-th place with enough entries above it: those at the cut are 0.
  x = np.array([[5.0, 4.0, 4.0, 4.0, 4.0, 1.0]])
  y = budget(x, 0.5, 10.0, 2)
  assert np.sum(y > 0) == 1
  np.testing.assert_allclose(y[0, 0], 0.5, rtol=0, atol=1e-15)
  # Every other entry tied at the cut: no value below it, so the cut cannot move.
  x = np.array([[5.0, 3.0, 3.0, 3.0]])
  np.testing.assert_allclose(budget(x, 1.5, 10.0, 2), R.soft_topk_mask(x, 1.5, 10.0),
                             atol=1e-14)


def test_integer_k_with_k_entries_above_the_cut_is_the_hard_mask():
  x = jnp.array([[4.0, 3.0, 1.0, 1.0, 1.0, 0.0]])  # x_(4) = 1 tied; 2 entries above it
  y = itk.soft_topk_mask(x, 2.0, regularization_strength=50.0, max_support=3)
  np.testing.assert_array_equal(np.asarray(y), [[1.0, 1.0, 0.0, 0.0, 0.0, 0.0]])
  weights = jnp.cos(x)
  g = jax.grad(lambda z: jnp.sum(weights * itk.soft_topk_mask(
      z, 2.0, regularization_strength=50.0, max_support=3)))(x)
  np.testing.assert_array_equal(np.asarray(g), 0.0)  # locally constant


@settings(max_examples=4, deadline=None)
@given(st.integers(0, 10_000), st.floats(0.01, 100.0), st.sampled_from([4.0 / 3.0, 2.0]),
       st.integers(2, 6), st.floats(0.05, 0.95))
def test_property_ties_bound_sum_and_reference(seed, l, p, m, frac):
  x = _rows(seed, (3, 9), ties=True) * 10.0 ** ((seed % 7) - 3)
  k = (m - 1) + frac
  y = budget(x, k, l * 10.0 ** ((seed % 7) - 3), m, p=p)
  np.testing.assert_allclose(y.sum(-1), k, atol=1e-11)
  for row, out in zip(x, y):
    assert np.sum(out > 0) <= allowed_support(row, k, m)
  np.testing.assert_allclose(y, reference(x, k, l * 10.0 ** ((seed % 7) - 3), m, p),
                             atol=1e-10)


@slow
@settings(max_examples=200, deadline=None)
@given(st.integers(0, 100_000), st.floats(-30, 30), st.floats(-2, 2),
       st.sampled_from([4.0 / 3.0, 2.0, 1.5, 3.0]), st.integers(1, 7), st.floats(0.0, 1.0),
       st.integers(2, 14), st.booleans())
def test_sweep_against_the_reference(seed, log_scale, log_l, p, m, frac, n, ties):
  x = _rows(seed, (2, n), ties=ties) * 10.0 ** log_scale
  k = min(m - 1 + frac, m - 1e-3, 0.9 * n) if m > 1 else 0.5 * frac
  l = 10.0 ** (log_scale + log_l)
  y = budget(x, k, l, m, p=p)
  np.testing.assert_allclose(y.sum(-1), k, atol=1e-11)
  if n > m:
    for row, out in zip(x, y):
      assert np.sum(out > 0) <= allowed_support(row, k, m)
  np.testing.assert_allclose(y, reference(x, k, l, m, p), atol=1e-10)


# -- non-finite inputs, where=, standardize= -----------------------------------------------


def test_non_finite_rows_follow_the_plain_masks_rules():
  nan = np.nan
  inf = np.inf
  x = np.array([[3.0, nan, 1.0, 0.0, -1.0],      # NaN -> a row of NaN
                [inf, 2.0, 1.0, 0.0, -1.0],      # +inf -> 1, the rest share k - 1
                [inf, inf, inf, 0.0, -1.0],      # more +inf than k: no threshold, NaN
                [3.0, 2.0, -inf, -inf, -inf],    # fewer entries above -inf than m
                [3.0, -inf, -inf, -inf, -inf]])  # fewer above -inf than k: NaN
  y = budget(x, 1.5, 5.0, 3)
  assert np.all(np.isnan(y[0])) and np.all(np.isnan(y[2])) and np.all(np.isnan(y[4]))
  assert y[1, 0] == 1.0 and np.sum(y[1] > 0) <= 3
  np.testing.assert_allclose(y[1], reference(x[1:2], 1.5, 5.0, 3)[0], atol=1e-12)
  np.testing.assert_allclose(y[3], R.soft_topk_mask(x[3], 1.5, 5.0), atol=1e-14)
  np.testing.assert_array_equal(y[3, 2:], 0.0)


def test_where_excludes_entries_and_standardize_is_scale_free():
  x = _rows(7, (6, 9))
  valid = np.arange(9) < 6
  y = budget(x, 2.0, 2.0, 3, where=jnp.broadcast_to(valid, x.shape))
  np.testing.assert_allclose(y[..., :6], reference(x[..., :6], 2.0, 2.0, 3), atol=1e-12)
  assert np.all(y[..., 6:] == 0)
  base = budget(x, 2.5, 0.5, 3, standardize=True)
  np.testing.assert_allclose(budget(1e6 * x - 3.0, 2.5, 0.5, 3, standardize=True), base,
                             atol=1e-9)
  assert np.all(np.sum(base > 0, axis=-1) <= 3)


@pytest.mark.parametrize("dtype,tol", [pytest.param(jnp.float64, 1e-12, marks=slow),
                                       (jnp.float32, 2e-6), (jnp.bfloat16, 2e-2),
                                       pytest.param(jnp.float16, 2e-3, marks=slow)])
def test_every_dtype(dtype, tol):
  x = np.asarray(jnp.asarray(_rows(1, (7, 10)), dtype), np.float64)  # representable
  for k, m, l in ((2.0, 3, 1.0), (1.5, 4, 0.05)):
    y = itk.soft_topk_mask(jnp.asarray(x, dtype), k, regularization_strength=l, max_support=m)
    assert y.dtype == dtype
    out = np.asarray(y, np.float64)
    assert np.all(np.sum(out > 0, axis=-1) <= m)
    np.testing.assert_allclose(out, reference(x, k, l, m), rtol=0, atol=tol)
    np.testing.assert_allclose(out.sum(-1), k, rtol=0, atol=10 * m * tol)


@slow
def test_near_ties_in_float32_keep_the_sum_and_finite_derivatives():
  # The m-th and (m+1)-th entries 1.7e-7 (23 float32 ulps) apart: l* is of that size.
  x = jnp.array([-0.05046099, -0.02986698, 0.2721215, 0.11211337, -0.23936808, 0.11211354,
                 0.06787282, -0.16315442], jnp.float32)
  for k, m in ((1.5, 2), (1.3, 3), (2.2, 3)):
    f = lambda z: itk.soft_topk_mask(z, k, regularization_strength=0.5, max_support=m)
    y = np.asarray(f(x))
    np.testing.assert_allclose(y.sum(), k, rtol=1e-6)
    assert np.sum(y > 0) <= m
    np.testing.assert_allclose(y, reference(np.asarray(x, np.float64), k, 0.5, m), atol=1e-5)
    assert np.all(np.isfinite(np.asarray(jax.jacrev(f)(x))))


@slow
def test_every_solver_name_gives_the_same_budgeted_mask():
  # The compiled solvers (auto on CPU, native, pav) take the budget kernel, the pure-JAX
  # ones (threshold, pallas in interpret mode) the JAX path: the same closed forms, equal
  # to the bit within each group and to a few ulps across them.
  x = jnp.asarray(_rows(1, (7, 10)))
  want = budget(x, 2.0, 1.0, 3)
  for solver in ("native", "pav"):
    np.testing.assert_array_equal(budget(x, 2.0, 1.0, 3, solver=solver), want)
  jax_path = budget(x, 2.0, 1.0, 3, solver="threshold")
  np.testing.assert_array_equal(budget(x, 2.0, 1.0, 3, solver="pallas"), jax_path)
  np.testing.assert_allclose(jax_path, want, rtol=0, atol=16 * np.finfo(np.float64).eps)


# -- continuity and derivatives -------------------------------------------------------------


def test_continuous_in_x_and_across_the_binding_strength():
  x = _rows(3, (6, 9))
  rng = np.random.default_rng(4)
  base = budget(x, 2.5, 2.0, 3)
  for eps in (1e-4, 1e-7):
    step = rng.normal(size=x.shape) * eps
    assert np.max(np.abs(budget(x + step, 2.5, 2.0, 3) - base)) < 50 * eps
  # Along the strength, through l* (where the budget starts to bind), in one batch: the
  # steps shrink with the steps of l, and both sides of l* are crossed.
  ls = np.geomspace(0.01, 20.0, 600)
  rows = np.broadcast_to(x[:1], (600, 9))
  path = np.asarray(itk.soft_topk_mask(jnp.asarray(rows), 2.5, max_support=3,
                                       regularization_strength=jnp.asarray(ls)))
  plain = np.asarray(itk.soft_topk_mask(jnp.asarray(rows), 2.5, solver="threshold",
                                        regularization_strength=jnp.asarray(ls)))
  assert np.any(np.sum(plain > 0, axis=-1) > 3) and np.any(np.sum(plain > 0, axis=-1) <= 3)
  assert np.max(np.abs(np.diff(path, axis=0))) < 0.02


@pytest.mark.parametrize("p,modes", [(4.0 / 3.0, ("rev",)),
                                     pytest.param(4.0 / 3.0, ("fwd",), marks=slow),
                                     pytest.param(2.0, ("rev", "fwd"), marks=slow)])
def test_gradients_match_central_differences(p, modes):
  # rows 0-2 bind at l = 4 (the strength is l*), row 3 and every row at l = 0.3 do not
  x = jnp.asarray(_rows(5, (4, 7)))
  weights = jnp.asarray(np.random.default_rng(6).normal(size=(4, 7)))
  f = lambda z, s, k: jnp.sum(weights * itk.soft_topk_mask(z, k, regularization_strength=s,
                                                           p=p, max_support=3))
  for l in (0.3, 4.0):
    check_grads(lambda z: f(z, l, 2.5), (x,), modes=modes, eps=1e-6, atol=1e-6,
                rtol=1e-6)
    check_grads(lambda s: f(x, s, 2.5), (jnp.asarray(l),), modes=modes, eps=1e-6,
                atol=1e-6, rtol=1e-6)
    check_grads(lambda k: f(x, l, k), (jnp.asarray(2.5),), modes=modes, eps=1e-6,
                atol=1e-6, rtol=1e-6)


@slow
def test_second_derivatives_match_central_differences():
  x = jnp.asarray(_rows(8, (2, 7)))
  weights = jnp.asarray(np.random.default_rng(9).normal(size=(2, 7)))
  for l in (0.3, 4.0):
    f = lambda z: jnp.sum(weights * itk.soft_topk_mask(z, 2.5, regularization_strength=l,
                                                       max_support=3))
    jax_check_grads(f, (x,), order=2, modes=("rev",), eps=1e-5, atol=1e-5, rtol=1e-5)


@slow
def test_standardized_gradients_match_central_differences():
  x = jnp.asarray(_rows(11, (3, 8)))
  weights = jnp.asarray(np.random.default_rng(12).normal(size=(3, 8)))
  f = lambda z: jnp.sum(weights * itk.soft_topk_mask(
      z, 2.5, regularization_strength=2.0, max_support=3, standardize=True))
  check_grads(f, (x,), modes=("rev",), eps=1e-6, atol=1e-6, rtol=1e-6)


@slow
def test_the_budget_moves_the_gradient_to_the_cut_entry():
  # Capped: the threshold is the (m+1)-th largest entry, so that entry gets a gradient
  # although its own output is 0 (the strength depends on it).
  x = jnp.array([3.0, 2.5, 1.0, 0.5, 0.0])
  g = jax.grad(lambda z: itk.soft_topk_mask(z, 1.2, regularization_strength=5.0,
                                            max_support=2)[0])(x)
  assert g[2] != 0 and g[3] == 0 and g[4] == 0


# -- the two JAX ways to find the m+1 largest values -------------------------------------------


@pytest.mark.parametrize("passes", [0, 10**9])  # lax.top_k / masked maxima
def test_top_k_and_masked_maxima_give_the_reference(passes, monkeypatch):
  from implicit_topk import regularizers, support_budget
  monkeypatch.setattr(support_budget, "_PASSES_UP_TO", passes)
  x = np.concatenate([_rows(14, (4, 11)), _rows(15, (4, 11), ties=True),
                      [[np.inf, 2.0, 1.0, 0.5, 0.0, -1.0, -2.0, -3.0, 1.0, 1.0, 1.0],
                       [np.nan] + [1.0] * 10,
                       [3.0, 2.0, -np.inf] + [-np.inf] * 8]])
  k = jnp.full(x.shape[:1], 2.5)
  for l in (0.2, 5.0):
    f = jax.jit(lambda z, s: support_budget.budget_mask(z, k, jnp.full_like(k, s), 3,
                                                        regularizers.PNorm(4.0 / 3.0),
                                                        kernel=False))
    y = np.asarray(f(jnp.asarray(x), l))
    np.testing.assert_allclose(y[:-2], reference(x[:-2], 2.5, l, 3), rtol=0, atol=1e-11)
    assert np.all(np.isnan(y[-2])) and np.all(np.isnan(y[-1]))  # NaN; k above the count
  weights = jnp.asarray(_rows(16, (4, 11)))  # the rows without ties (differentiable)
  g = lambda z: jnp.sum(weights * support_budget.budget_mask(
      z, k[:4], jnp.full_like(k[:4], 5.0), 3, regularizers.PNorm(4.0 / 3.0), kernel=False))
  check_grads(g, (jnp.asarray(x[:4]),), modes=("rev",), eps=1e-6, atol=1e-6,
              rtol=1e-6)


# -- the CPU kernel ---------------------------------------------------------------------


def _hard_rows(m, scale=1.0):
  """Rows of 2m+3 entries: random, ties at the cut (below it: the tie rule, and not),
  +inf and -inf entries, a NaN, and the m+1 largest all tied."""
  n = 2 * m + 3
  rng = np.random.default_rng(m)
  rows = [rng.normal(size=n), np.round(rng.normal(size=n) * 2) / 2]
  tie = np.linspace(3.0, -3.0, n)
  tie[1:m + 3] = 1.0  # the (m+1)-th largest tied with entries above and below it
  rows.append(tie)
  tie = tie.copy()
  tie[m:m + 3] = tie[m - 1]  # ties straddling the m-th place
  rows.append(tie)
  inf = rng.normal(size=n)
  inf[0], inf[-1], inf[-2] = np.inf, -np.inf, -np.inf
  rows.append(inf)
  nan = rng.normal(size=n)
  nan[n // 2] = np.nan
  rows.append(nan)
  rows.append(np.full(n, 2.0))
  return np.stack(rows) * scale


@functools.partial(jax.jit, static_argnums=(3, 4, 5))
def _solution(x, k, l, m, a, kernel):
  from implicit_topk import support_budget
  solve = support_budget._kernel_solution if kernel else support_budget._jax_solution
  return solve(x, k, l, m, a)


def _kernel_and_jax(x, k, l, m, a, solve_dtype=None):
  """``(shift, offset, strength, cut)`` of the kernel on ``x`` and of the JAX path on
  ``x`` cast to ``solve_dtype`` (default: ``x``'s)."""
  rows = x.shape[:-1]
  k, l = float(x.dtype.type(k)), float(x.dtype.type(l))  # the same values for both
  args = lambda dtype: (jnp.asarray(x, dtype), jnp.full(rows, k, dtype), jnp.full(rows, l, dtype))
  kernel = _solution(*args(x.dtype), m, a, True)
  jax_path = _solution(*args(solve_dtype or x.dtype), m, a, False)
  return ([np.asarray(v, np.float64) for v in kernel],
          [np.asarray(v, np.float64) for v in jax_path])


def _assert_same_solution(kernel, jax_path, ulps, eps):
  """Same cut and NaN rows; strengths and thresholds (in units of the strength) equal to
  ``ulps`` units of ``eps``. A row the kernel solved as the plain mask (longer router
  rows where the budget does not bind) reports the cut ``-inf``: there the JAX path's
  strength must be the plain one too."""
  (s1, o1, t1, c1), (s2, o2, t2, c2) = kernel, jax_path
  np.testing.assert_array_equal(np.isnan(t1), np.isnan(t2))
  ok = ~np.isnan(t2)
  plain = ok & np.isneginf(c1) & ~np.isneginf(c2)
  np.testing.assert_array_equal(t2[plain], t1[plain])
  np.testing.assert_array_equal(c1[ok & ~plain], c2[ok & ~plain])
  np.testing.assert_allclose(t1[ok], t2[ok], rtol=ulps * eps, atol=0)
  # lambda' = shift + l' offset, in units of l': (shift1 - shift2) / l' + offset1 - offset2
  with np.errstate(invalid="ignore"):
    gap = (s1[ok] - s2[ok]) / t2[ok] + o1[ok] - o2[ok]
  scale = 1.0 + np.abs(o2[ok]) + np.abs(s2[ok]) / t2[ok]
  assert np.all(np.abs(gap) <= ulps * eps * scale), np.max(np.abs(gap) / scale / eps)


@pytest.mark.parametrize("a", [3, 1, 2])
def test_kernel_matches_the_jax_path_float64(a):
  for m, scale in itertools.product((1, 3, 12), (1e-300, 1e-30, 1.0, 1e30, 1e300)):
    x = _hard_rows(m, scale)
    for frac, l_factor in itertools.product((1e-9, 0.5, 1 - 1e-9), (0.01, 1.0, 100.0)):
      k = max(m - 1 + frac, 1e-9) if m > 1 else frac
      kernel, jax_path = _kernel_and_jax(x, k, l_factor * scale, m, a)
      _assert_same_solution(kernel, jax_path, 64, np.finfo(np.float64).eps)


@pytest.mark.parametrize("a", [3, 1])
def test_kernel_matches_the_jax_path_float32(a):
  # float32 rows: the kernel solves in float64, so it matches the JAX path run in
  # float64 on the same values, to the rounding of its float32 results
  for m, scale in itertools.product((1, 3, 12), (1e-30, 1.0, 1e30)):
    x = _hard_rows(m, scale).astype(np.float32)
    for frac, l_factor in itertools.product((1e-6, 0.5, 1 - 1e-6), (0.01, 1.0, 100.0)):
      k = max(m - 1 + frac, 1e-6) if m > 1 else frac
      l = float(np.float32(l_factor * scale))
      kernel, jax_path = _kernel_and_jax(x, k, l, m, a, solve_dtype=np.float64)
      jax_path = [np.asarray(np.asarray(v, np.float32), np.float64) for v in jax_path]
      _assert_same_solution(kernel, jax_path, 8, np.finfo(np.float32).eps)


@pytest.mark.parametrize("dtype", [np.float64, pytest.param(np.float32, marks=slow)])
def test_kernel_against_the_reference(dtype):
  """The kernel's mask (default on the CPU for float32 and float64) against the
  independent reference, on rows with ties at the cut, infinities, n = m + 1, k near 0
  and near m."""
  from implicit_topk import regularizers, support_budget
  reg = regularizers.PNorm(4.0 / 3.0)
  tol = 1e-11 if dtype == np.float64 else 3e-6
  for m, short in itertools.product((1, 3, 5), (False, True)):
    x = (_rows(m, (3, m + 1)) if short else _hard_rows(m)[:5]).astype(dtype)  # n = m + 1
    rows = jnp.asarray(x)
    f = jax.jit(lambda z, k, l: support_budget.budget_mask(
        z, jnp.full(z.shape[:-1], k, z.dtype), jnp.full(z.shape[:-1], l, z.dtype), m, reg,
        kernel=True))
    assert "implicit_topk_budget" in f.lower(rows, 1.0, 1.0).as_text()
    for k, l in itertools.product((1e-6, 0.5 * m, m - 1e-6 if m > 1 else 0.7), (0.05, 3.0)):
      y = np.asarray(f(rows, k, l), np.float64)
      want = reference(np.asarray(x, np.float64), k, l, m)
      np.testing.assert_allclose(y, want, rtol=0, atol=tol)
      assert np.all(np.sum(y > 0, axis=-1)[:1] <= m)


def _router_rows(n, m, seed, rows=150):
  """(x, k, l) float64: router rows the kernel's lanes take (finite, ``k <= 2``, the m+1
  largest distinct; binding and not; binary) and rows they leave to the per-row kernel
  (ties among the m+1 largest, +-inf, NaN, far from 0 relative to ``l``, ``k`` above 2
  or at 0); 150 rows: two full blocks of 64 and a short one."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(rows, n))
  k = np.minimum(rng.choice([0.25, 0.5, 1.0, 1.5, 2.0], size=rows), m - 0.5)
  l = 10.0 ** rng.uniform(-1.5, 0.7, size=rows)
  x[1::9] = np.round(x[1::9])  # ties
  for r in range(2, rows, 9):  # binary at integer k: the top k entries far above the rest
    k[r] = min(1.0 + r % 2, m - 1.0) if m > 1 else 0.5
    x[r] = np.where(np.arange(n) < k[r], 5.0, 0.0) - 0.01 * np.arange(n)
  x[4::18, 0] = np.inf
  x[13::18, -1] = -np.inf
  x[5::27, -1] = np.nan
  x[6::18] += 1e7
  k[7::18] = np.where(m > 3, 2.5, 0.0)
  l[:2] = 0.05  # (longer rows: few candidates, the plain mask kept)
  return x, k, l


@pytest.mark.parametrize("a", [3, 1])
@pytest.mark.parametrize("n,m", [(8, 3), (16, 4), (5, 1), (64, 4), (40, 6),
                                 pytest.param(8, 2, marks=slow), pytest.param(3, 2, marks=slow),
                                 pytest.param(512, 3, marks=slow)])
def test_router_rows_through_the_kernels_lanes(n, m, a):
  """Router rows with ``m <= 8`` go through the budget kernel's lanes
  (``kernels/cpu/budget_lanes.py``) where they can: whole up to 16 entries, longer ones
  by their candidates (those with at most ``m`` keep the plain mask, cut ``-inf``).
  Against the independent reference (the mask, with the bound where no tie applies) and
  the JAX path: the same cut (where the kernel reports one) and strength, and the same
  threshold where the mask is not binary (a binary mask's threshold is any point of a
  flat interval: the lanes take its middle, as the plain mask does)."""
  from implicit_topk import regularizers, support_budget
  p = 1.0 + 1.0 / a
  x, k, l = _router_rows(n, m, seed=10 * n + m)
  for dtype, ulps, tol in ((np.float64, 64, 1e-11), (np.float32, 8, 3e-6)):
    xd, kd, ld = (np.asarray(v, dtype) for v in (x, k, l))
    x64 = np.asarray(xd, np.float64)
    want = np.stack([reference(x64[r:r + 1], float(kd[r]), float(ld[r]), m, p)[0]
                     for r in range(x.shape[0])])
    y = np.asarray(support_budget.budget_mask(jnp.asarray(xd), jnp.asarray(kd), jnp.asarray(ld),
                                              m, regularizers.PNorm(p), kernel=True), np.float64)
    # (rows far from 0 relative to l: the mask moves by eps |x| / l as x rounds)
    finite = np.where(np.isfinite(x64), np.abs(x64), 0.0).max(axis=-1)
    atol = tol + 8 * np.finfo(dtype).eps * finite / np.asarray(ld, np.float64)
    np.testing.assert_array_less(np.abs(y - want), atol[:, None] + 0 * y, err_msg=str(dtype))
    for r in range(x.shape[0]):
      if np.all(np.isfinite(x64[r])) and len(set(np.sort(x64[r])[::-1][:m + 1])) == m + 1:
        assert np.sum(y[r] > 0) <= m, (r, y[r])
    kernel = [np.asarray(v, np.float64) for v in _solution(xd, kd, ld, m, a, True)]
    jax_path = [np.asarray(np.asarray(v, dtype), np.float64)
                for v in _solution(x64, *(np.asarray(v, np.float64) for v in (kd, ld)), m, a, False)]
    fractional = np.any((want > 1e-6) & (want < 1 - 1e-6), axis=-1)
    _assert_same_solution([np.where(fractional, v, w) for v, w in zip(kernel, jax_path)],
                          jax_path, ulps, np.finfo(dtype).eps)
    plain = np.isneginf(kernel[3]) & ~np.isneginf(jax_path[3])  # solved as the plain mask
    assert np.any(plain) == (n > 16), np.sum(plain)
    np.testing.assert_array_equal(kernel[3][fractional & ~plain], jax_path[3][fractional & ~plain])
    np.testing.assert_allclose(kernel[2], jax_path[2], rtol=ulps * np.finfo(dtype).eps)


def test_the_lanes_bind_rows_as_the_per_row_kernel_does():
  """Where the budget binds, the lanes' crossing strength (its piece found across the
  lanes, ``budget_lanes._crossing_lanes``) is the per-row kernel's to the bit: the same
  sums in the same order (``proofs/support_budget.md``, "In the CPU kernel" (iv)).
  float32, the routers' dtype (the lanes compute in float64 for both; each dtype's
  direct call compiles the kernel once more, 25 s)."""
  from implicit_topk.kernels.cpu import budget_kernel
  dtype = np.float32
  rng = np.random.default_rng(7)
  for (n, m), a in itertools.product(((8, 3), (16, 4), (5, 1), (12, 2), (16, 8), (64, 4),
                                     (40, 6)), (3.0, 1.0)):
    x = rng.standard_normal((300, n)).astype(dtype)
    k = np.minimum(rng.choice([0.25, 0.5, 1.0, 1.5, 2.0], 300), m - 0.5).astype(dtype)
    l = (10.0 ** rng.uniform(-1.5, 1.0, 300) * max(1.0, m / 3.0)).astype(dtype)
    results = []
    for lanes in (True, False):
      y, solution = np.empty_like(x), [np.empty(300, dtype) for _ in range(4)]
      budget_kernel.budget_rows(x, k, l, m, a, y, *solution, lanes)
      results.append(solution)
    (s1, _, t1, c1), (s2, _, t2, c2) = results
    bound = t2 < l
    assert 0.1 < np.mean(bound) < 0.9
    for lanes_value, row_value in ((s1, s2), (t1, t2), (c1, c2)):
      np.testing.assert_array_equal(lanes_value[bound], row_value[bound], err_msg=str((n, m, a)))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_kernel_rows_with_nothing_finite_to_place(dtype):
  # k = 0 on a row of -inf entries, and as many +inf entries as k: nothing finite lies
  # above the cut and no mass is left to place, so any threshold is one. Expected by hand:
  # 1 at +inf, 0 elsewhere (the plain mask's rules), on the kernel (native) and JAX paths.
  inf = np.inf
  cases = ((np.full(6, -inf), 0.0, np.zeros(6)),
           (np.array([inf, -inf, -inf, -inf, -inf, -inf]), 1.0, np.eye(6)[0]),
           (np.array([-inf, inf, -inf, inf, -inf, -inf]), 2.0, np.array([0, 1, 0, 1, 0, 0.0])))
  for row, k, want in cases:
    for solver in ("native", "threshold"):
      y = itk.soft_topk_mask(jnp.asarray(row, dtype), k, regularization_strength=1.0,
                             max_support=3, solver=solver)
      np.testing.assert_array_equal(np.asarray(y, np.float64), want, err_msg=solver)


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-12), pytest.param(np.float32, 2e-4,
                                                                         marks=slow)])
def test_kernel_derivatives_match_the_jax_path(dtype, tol):
  """The derivative kernels (rule PINNED; binding rows move the strength, the others the
  threshold) against the JAX path's implicit derivatives, forward and reverse, in x, k
  and l, on rows with ties at the cut and an infinite entry."""
  x = np.concatenate([_rows(21, (5, 9)), _rows(22, (5, 9), ties=True),
                      [[np.inf, 2.0, 1.0, 0.5, 0.0, -1.0, -2.0, 1.0, 1.0]]]).astype(dtype)
  rng = np.random.default_rng(23)
  w, t = (jnp.asarray(rng.normal(size=x.shape), dtype) for _ in range(2))
  for p, l in itertools.product((4.0 / 3.0, 2.0, 1.5), (0.2, 4.0)):
    def f(z, k, s, solver):
      return jnp.sum(w * itk.soft_topk_mask(z, k, regularization_strength=s, p=p,
                                            max_support=4, solver=solver))
    args = (jnp.asarray(x), jnp.asarray(2.5, dtype), jnp.asarray(l, dtype))
    grads = [jax.grad(f, argnums=(0, 1, 2))(*args, solver) for solver in ("native", "threshold")]
    for got, want in zip(*grads):
      np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    jvps = [jax.jvp(lambda z: f(z, args[1], args[2], solver), (args[0],), (t,))[1]
            for solver in ("native", "threshold")]
    np.testing.assert_allclose(*jvps, rtol=tol, atol=tol)


def test_the_kernel_serves_the_default_on_cpu_only_where_it_applies():
  from implicit_topk import support_budget
  x = jnp.asarray(_rows(0, (3, 9)))
  text = lambda **kw: jax.jit(lambda z: itk.soft_topk_mask(
      z, 1.5, max_support=3, **kw)).lower(x).as_text()
  assert "implicit_topk_budget" in text()
  assert "implicit_topk_budget" not in text(p=2.5)  # a = 2/3: the JAX path
  assert not support_budget.kernel_applies(jnp.bfloat16, 3)


_SPLIT_SCRIPT = """
import re, sys
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
sys.path.insert(0, {tests!r})
import implicit_topk as itk
from device_checks import report, run_named_groups
mesh = Mesh(np.array(jax.devices()), ("d",))
rows = np.round(np.random.default_rng(1).normal(size=(16, 64)) * 2) / 2  # ties
rows[3, 5], rows[4, 0] = np.nan, np.inf
x = jnp.asarray(rows, jnp.float32)
mask = lambda z: itk.soft_topk_mask(z, 2.5, regularization_strength=1.0, max_support=3)
grad = jax.grad(lambda z: jnp.nansum(jnp.cos(z) * mask(z)))

def run():
  one = [np.asarray(jax.jit(f)(x)) for f in (mask, grad)]
  for spec in (P(None, "d"), P("d", None)):
    split = jax.device_put(x, NamedSharding(mesh, spec))
    for f, want in zip((mask, grad), one):
      got = np.asarray(jax.jit(f)(split))
      text = jax.jit(f).lower(split).compile().as_text()
      gathers = len(re.findall(r"all-gather[-a-z]*\\(", text))
      close = np.array_equal(np.isnan(got), np.isnan(want)) and np.nanmax(np.abs(got - want)) < 1e-6
      report(close and gathers == 0, f"{{spec}} {{'grad' if f is grad else 'fwd'}}",
             f"{{gathers}} all-gather")

sys.exit(run_named_groups({{"split": run}}, []))
"""


@slow
def test_a_split_reduced_axis_is_not_gathered(tmp_path):
  """Under jit with the reduced axis split over 8 host devices, the kernel's call runs
  the JAX path with pmax/psum on each device's block: no all-gather, the values of one
  device; with the batch split, the kernel per device."""
  import pathlib
  import device_checks
  script = tmp_path / "split_budget.py"
  script.write_text(_SPLIT_SCRIPT.format(tests=str(pathlib.Path(__file__).parent)))
  lines = device_checks.run_script(script, timeout=900)
  assert lines.count("OK  ") == 4, lines


# -- the pytree form --------------------------------------------------------------------


def test_tree_form_is_the_mask_of_the_concatenated_leaves():
  rng = np.random.default_rng(13)
  tree = {"w": jnp.asarray(rng.normal(size=(3, 4))), "b": jnp.asarray(rng.normal(size=(5,)))}
  flat = np.concatenate([np.asarray(tree["b"]).ravel(), np.asarray(tree["w"]).ravel()])
  for l in (0.1, 3.0):
    y = itk.tree_soft_topk_mask(tree, 2.5, regularization_strength=l, max_support=4)
    got = np.concatenate([np.asarray(y["b"]).ravel(), np.asarray(y["w"]).ravel()])
    np.testing.assert_allclose(got, reference(flat, 2.5, l, 4), rtol=0, atol=1e-12)
    assert np.sum(got > 0) <= 4 and y["w"].shape == (3, 4)
  weights = jnp.asarray(rng.normal(size=(3, 4)))
  f = lambda t: jnp.sum(weights * itk.tree_soft_topk_mask(t, 2.5, regularization_strength=3.0,
                                                          max_support=4)["w"])
  check_grads(f, (tree,), modes=("rev",), eps=1e-6, atol=1e-6, rtol=1e-6)
  with pytest.raises(ValueError, match="max_support.*larger than k"):
    itk.tree_soft_topk_mask(tree, 4.0, max_support=4)


# -- transformations, info, arguments ------------------------------------------------------


def test_jit_vmap_jvp_and_export():
  x = jnp.asarray(_rows(7, (2, 6, 9)))
  f = lambda z: itk.soft_topk_mask(z, 2.0, regularization_strength=2.0, max_support=3)
  eager = f(x)
  np.testing.assert_allclose(jax.jit(f)(x), eager, atol=1e-15)
  np.testing.assert_allclose(jax.vmap(f)(x), eager, atol=1e-15)
  tangent = jnp.asarray(_rows(8, x.shape))
  _, forward = jax.jvp(f, (x,), (tangent,))
  _, pullback = jax.vjp(f, x)
  cotangent = jnp.asarray(_rows(9, x.shape))
  np.testing.assert_allclose(jnp.vdot(forward, cotangent), jnp.vdot(pullback(cotangent)[0],
                                                                     tangent), rtol=1e-12)
  from jax import export
  # the CPU kernel's custom call: exported as the library's other kernels are
  exported = export.export(jax.jit(jax.grad(lambda z: jnp.sum(f(z) * tangent))),
                           disabled_checks=itk.export_safety_checks())(x)
  again = export.deserialize(exported.serialize())
  np.testing.assert_allclose(again.call(x), jax.grad(lambda z: jnp.sum(f(z) * tangent))(x),
                             atol=1e-15)


def test_inside_shard_map_over_the_batch():
  from jax.sharding import Mesh, PartitionSpec as P
  mesh = Mesh(np.array(jax.devices()[:1]), ("b",))
  x = jnp.asarray(_rows(7, (4, 9)))
  f = lambda z: itk.soft_topk_mask(z, 2.0, regularization_strength=2.0, max_support=3)
  g = jax.grad(lambda z: jnp.sum(jnp.cos(z) * f(z)))
  for fn in (f, g):
    mapped = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("b"), out_specs=P("b")))
    np.testing.assert_allclose(mapped(x), fn(x), rtol=0, atol=1e-14)


def test_return_info_reports_the_residual():
  x = jnp.asarray(_rows(7, (6, 9)))
  y, info = itk.soft_topk_mask(x, 2.5, max_support=3, return_info=True)
  assert info.residual.shape == (6,) and np.all(np.asarray(info.residual) < 1e-13)
  assert np.all(np.asarray(info.iter_num) == 0)


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
  with pytest.raises(ValueError, match="max_support.*axis_name"):
    itk.soft_topk_mask(x, 1.0, max_support=2, axis_name="i")


@pytest.mark.parametrize("solver", ["auto", "threshold"])  # the kernel, the JAX path
def test_a_traced_k_not_below_max_support_gives_nan_rows(solver):
  """Where ``k`` is concrete, ``k >= max_support`` is a ValueError (above). Under ``jit``
  it is not checked: those rows are NaN, forward and gradient (a support of m entries
  cannot hold a mask summing to k >= m), as for the other invalid traced values; the
  other rows are the budgeted mask. Before, k = 3.5 with m = 3 gave 4 nonzero entries."""
  x = jnp.asarray(_rows(7, (4, 8)))
  k = jnp.array([2.5, 3.0, 3.5, 1.0])
  op = lambda x, k: itk.soft_topk_mask(x, k, regularization_strength=0.5, max_support=3,
                                       solver=solver)
  y = np.asarray(jax.jit(op)(x, k))
  valid = np.array([True, False, False, True])
  assert np.isnan(y[~valid]).all()
  np.testing.assert_allclose(y[valid], budget(np.asarray(x)[valid], np.asarray(k)[valid], 0.5, 3),
                             rtol=0, atol=1e-15)
  g = np.asarray(jax.jit(jax.grad(lambda x, k: jnp.sum(jnp.sin(op(x, k)))))(x, k))
  assert np.isnan(g[~valid]).all() and np.isfinite(g[valid]).all()
  ids = jnp.arange(8) % 2  # segments: the rule per segment
  segments = jax.jit(lambda x, k: itk.segment_soft_topk_mask(
      x, ids, k, num_segments=2, regularization_strength=0.5, max_support=3))(
          x, jnp.array([2.5, 3.0]))
  assert np.isnan(np.asarray(segments)[:, 1::2]).all()
  assert np.isfinite(np.asarray(segments)[:, ::2]).all()
