"""``segment_soft_topk_mask(..., max_support=m)``: at most m nonzero entries per segment.

The reference works on each segment separately in NumPy float64, from the rule proven
for one row (proofs/support_budget.md, statements 1, 2 and 4), not from the library: the
exact reference mask of tests/references.py at the given strength where its threshold
is at least the cut of the tie rule (no entry at or below the cut is nonzero); else the
threshold is the cut and the strength l' solves sum_i g((x_i - cut) / l') = k, found by
bisection in log space. Also: the plain segment mask where the bound does not bind,
ties at the cut, short, empty and non-finite segments, every dtype, gradients against
float64 central differences, jit / vmap / batch axes, the argument checks, and no
intermediate of n x m entries."""

from __future__ import annotations

import itertools

import jax
from jax.test_util import check_grads as jax_check_grads
import jax.numpy as jnp
import numpy as np
import pytest

import implicit_topk as itk
import references as R
from gradcheck import check_grads

slow = pytest.mark.slow

M = 3
# sizes: one entry, at most m, more than m, empty (k = 0)
SIZES = (1, 7, 0, 12, 3, 9, 4, 2)
K = np.array([0.5, 2.5, 0.0, 2.0, 2.9, 1.25, 2.999, 1.5])


def budget_segment(row, k, l, m, p):
  """``(y, l')`` of one segment by the rule of the row operator (module docstring)."""
  reg = R.regularizer("pnorm", p)
  plain = R.soft_topk_mask(row, k, l, p)
  if row.size <= m or np.isnan(row).any():
    return plain, l
  c = np.sort(row)[::-1][m]
  if np.count_nonzero(row > c) < k:  # the tie rule: the group at c enters together
    below = row[row < c]
    c = below.max() if below.size else -np.inf
  if not np.isfinite(c) or np.all(plain[row <= c] == 0):
    return plain, l  # the threshold is at least the cut: the plain mask meets the budget
  total = lambda strength: float(np.sum(reg.mask((row - c) / strength)))
  lo, hi = np.log(l) - 100.0, np.log(l)  # total(exp(lo)) >= k > total(exp(hi))
  for _ in range(300):
    mid = 0.5 * (lo + hi)
    lo, hi = (mid, hi) if total(np.exp(mid)) >= k else (lo, mid)
  strength = float(np.exp(0.5 * (lo + hi)))
  return reg.mask((row - c) / strength), strength


def reference(x, ids, k, l, m, p=4.0 / 3.0, num_segments=len(SIZES)):
  """The budgeted mask of every segment of ``x`` (..., n), and whether each binds."""
  x = np.asarray(x, np.float64)
  out, binds = np.zeros_like(x), np.zeros(x.shape[:-1] + (num_segments,), bool)
  k = np.broadcast_to(k, binds.shape)
  l = np.broadcast_to(l, binds.shape)
  for index in np.ndindex(x.shape[:-1]):
    for s in range(num_segments):
      members = ids == s
      if members.any():
        out[index][members], strength = budget_segment(x[index][members], k[index][s],
                                                       l[index][s], m, p)
        binds[index][s] = strength < l[index][s]
  return out, binds


def allowed_support(row, k, m):
  """m (or the whole segment when shorter), or the entries at or above the (m+1)-th
  largest where the tie rule applies."""
  if row.size <= m:
    return row.size
  c = np.sort(row)[::-1][m]
  return m if np.sum(row > c) >= k else int(np.sum(row >= c))


def segments(seed=0, shuffle=True, ties=False):
  rng = np.random.default_rng(seed)
  ids = np.repeat(np.arange(len(SIZES)), SIZES)
  if shuffle:
    ids = rng.permutation(ids)
  x = rng.normal(size=ids.size)
  if ties:
    x = np.round(x * 2) / 2
  return x, ids


def budget(x, ids, k, l, m=M, **kw):
  return np.asarray(itk.segment_soft_topk_mask(
      jnp.asarray(x), jnp.asarray(ids), jnp.asarray(k), num_segments=len(SIZES),
      regularization_strength=l, max_support=m, **kw))


def per_segment(v, ids):
  return np.stack([np.sum(v[..., ids == s], axis=-1) for s in range(len(SIZES))], axis=-1)


def check_against_reference(x, ids, k, l, p, m=M, atol=1e-11):
  y = budget(x, ids, k, l, m, p=p)
  want, binds = reference(x, ids, k, l, m, p)
  for s in range(len(SIZES)):
    members = ids == s
    assert np.count_nonzero(y[members]) <= allowed_support(x[members], k[s], m), s
  np.testing.assert_allclose(per_segment(y, ids), k, rtol=0, atol=1e-12)
  np.testing.assert_allclose(y, want, rtol=0, atol=atol)
  return binds


# -- the bound, the sums and the reference ------------------------------------------------


@pytest.mark.parametrize("p", [4.0 / 3.0, 2.0, pytest.param(1.5, marks=slow),
                               pytest.param(3.0, marks=slow)])
@pytest.mark.parametrize("scales", [(1e-20, 1.0, 1e20),
                                    pytest.param((1e-300, 1e-3, 1e3, 1e300), marks=slow)])
def test_bound_sums_and_reference_over_scales_and_strengths(p, scales):
  x, ids = segments(0)
  binding = []
  for scale, factor in itertools.product(scales, (0.05, 0.5, 5.0, 500.0)):
    binding.append(check_against_reference(x * scale, ids, K, factor * scale, p))
  binding = np.array(binding)
  assert binding.any() and not binding.all()  # both regimes were checked


@slow
@pytest.mark.parametrize("seed", range(6))
def test_sweep_with_ties_against_the_reference(seed):
  rng = np.random.default_rng(100 + seed)
  x, ids = segments(seed, ties=bool(seed % 2))
  for m in (3, 5):
    k = np.minimum(rng.uniform(0.0, m - 0.01, len(SIZES)), SIZES)
    for p, factor in itertools.product((4.0 / 3.0, 2.0, 1.5), (0.1, 1.0, 10.0)):
      check_against_reference(x, ids, k, factor, p, m)


def test_ties_at_the_cut_enter_together():
  # segment 0: fewer than k entries above the (m+1)-th largest: the four 1s enter
  # together; segment 1: a tie at the cut with k entries above it: the budget holds
  rows = [np.array([3.0, 1.0, 1.0, 1.0, 1.0, 0.0]), np.array([3.0, 2.0, 1.0, 1.0, 1.0, 0.0]),
          np.random.default_rng(3).normal(size=6)]
  ids = np.random.default_rng(4).permutation(np.repeat(np.arange(3), 6))
  x = np.zeros(ids.size)
  for s, row in enumerate(rows):
    x[ids == s] = row
  k = np.array([1.5, 1.5, 2.0])
  for l in (0.5, 50.0):
    y = np.asarray(itk.segment_soft_topk_mask(x, ids, k, num_segments=3,
                                              regularization_strength=l, max_support=M))
    for s, row in enumerate(rows):
      got = y[ids == s]
      want, _ = budget_segment(row, k[s], l, M, 4.0 / 3.0)
      np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
      np.testing.assert_allclose(got.sum(), k[s], rtol=0, atol=1e-12)
    tied = y[(ids == 0) & (x == 1.0)]
    assert np.all(tied == tied[0]) and tied[0] > 0  # all four tied entries, equally
    assert np.count_nonzero(y[ids == 0]) == 5
    assert np.count_nonzero(y[ids == 1]) <= 2 and np.all(y[(ids == 1) & (x == 1.0)] == 0)
    assert np.count_nonzero(y[ids == 2]) <= M


def test_the_plain_segment_mask_where_the_bound_does_not_bind():
  x, ids = segments(1)
  plain = lambda l: np.asarray(itk.segment_soft_topk_mask(
      x, ids, K, num_segments=len(SIZES), regularization_strength=l))
  # every segment at most m = 12 entries: the budget never binds
  np.testing.assert_allclose(budget(x, ids, K, 3.0, m=12), plain(3.0), rtol=0, atol=1e-12)
  # m = 3: the segments whose plain mask has at most 3 nonzero entries are unchanged
  for l in (0.05, 3.0):
    want = plain(l)
    got = budget(x, ids, K, l)
    fits = [s for s in range(len(SIZES)) if np.count_nonzero(want[ids == s]) <= M]
    assert 0 < len(fits)
    for s in fits:
      np.testing.assert_allclose(got[ids == s], want[ids == s], rtol=0, atol=1e-12)
    if l == 3.0:
      assert len(fits) < len(SIZES)  # and some segments do bind


def test_return_info_and_standardize():
  x, ids = segments(2)
  y, info = itk.segment_soft_topk_mask(x, ids, K, num_segments=len(SIZES),
                                       regularization_strength=2.0, max_support=M,
                                       return_info=True)
  assert info.iter_num.shape == (len(SIZES),) and np.all(np.asarray(info.iter_num) == 0)
  assert np.all(np.asarray(info.residual) < 1e-12)
  np.testing.assert_allclose(np.asarray(info.residual),
                             np.abs(per_segment(np.asarray(y), ids) - K), atol=1e-15)
  std = lambda z: np.asarray(itk.segment_soft_topk_mask(
      z, ids, K, num_segments=len(SIZES), regularization_strength=0.7, standardize=True,
      max_support=M))
  np.testing.assert_allclose(std(x), std(1e6 * x - 3.0), rtol=0, atol=1e-9)


def test_short_empty_and_non_finite_segments():
  inf, nan = np.inf, np.nan
  rows = [np.array([]), np.array([0.3]), np.array([-inf, -inf, -inf, -inf, -inf]),
          np.array([1.0, nan, 0.0, 2.0, -1.0]), np.array([inf, 0.5, 2.0, -inf, 1.0, 0.0, 3.0]),
          np.array([2.0, 1.0]), np.array([0.2, -0.4, 1.1, 0.7, -2.0, 0.9])]
  k = np.array([0.0, 1.0, 0.0, 1.5, 2.5, 1.5, 2.5])
  ids = np.concatenate([np.full(row.size, s) for s, row in enumerate(rows)])
  x = np.concatenate(rows)
  f = lambda z: itk.segment_soft_topk_mask(z, ids, k, num_segments=len(rows),
                                           regularization_strength=4.0, max_support=M)
  y = np.asarray(f(jnp.asarray(x)))
  for s, row in enumerate(rows):
    if row.size:
      want, _ = budget_segment(row, k[s], 4.0, M, 4.0 / 3.0)
      np.testing.assert_array_equal(np.isnan(y[ids == s]), np.isnan(want))
      np.testing.assert_allclose(y[ids == s], want, rtol=0, atol=1e-12)
  assert np.all(np.isnan(y[ids == 3])) and not np.isnan(y[ids != 3]).any()
  assert np.all(y[ids == 2] == 0) and y[ids == 1][0] == 1.0
  assert y[x == inf][0] == 1.0 and np.all(y[(ids == 4) & (x == -inf)] == 0)
  assert np.count_nonzero(y[ids == 4]) <= M
  weights = jnp.asarray(np.cos(np.where(np.isfinite(x), x, 0.0)))
  grad = np.asarray(jax.grad(lambda z: jnp.sum(jnp.where(ids == 3, 0.0, weights * f(z))))(
      jnp.asarray(x)))
  assert np.all(np.isfinite(grad[ids != 3]))  # infinite entries and the -inf segment too
  assert np.all(grad[~np.isfinite(x) & (ids != 3)] == 0) and np.any(grad[ids == 4] != 0)


def test_every_dtype():
  x, ids = segments(5)
  want, _ = reference(x, ids, K, 2.0, M)
  for dtype, tol in ((jnp.float32, 2e-5), (jnp.float16, 5e-3), (jnp.bfloat16, 3e-2)):
    y = itk.segment_soft_topk_mask(jnp.asarray(x, dtype), ids, K, num_segments=len(SIZES),
                                   regularization_strength=2.0, max_support=M)
    assert y.dtype == dtype
    y = np.asarray(y, np.float64)
    np.testing.assert_allclose(y, want, rtol=0, atol=tol)
    for s in range(len(SIZES)):
      assert np.count_nonzero(y[ids == s]) <= M


# -- derivatives --------------------------------------------------------------------------


@pytest.mark.parametrize("p", [4.0 / 3.0, 2.0])
def test_gradients_match_central_differences(p):
  x, ids = segments(6)
  weights = jnp.asarray(np.random.default_rng(7).normal(size=x.size))
  k = jnp.asarray(np.minimum(K, 2.4))
  empty = jnp.asarray(np.array(SIZES) == 0)  # its k stays 0
  for l in (0.3, 5.0):  # mostly plain, mostly binding
    f = lambda z, k_, l_: jnp.sum(weights * itk.segment_soft_topk_mask(
        z, ids, jnp.where(empty, 0.0, k_), num_segments=len(SIZES), regularization_strength=l_,
        p=p, max_support=M))
    check_grads(f, (jnp.asarray(x), k, jnp.full(len(SIZES), l)), modes=("fwd", "rev"), eps=1e-6, atol=1e-6, rtol=1e-6)


@slow
def test_second_derivatives_match_central_differences():
  x, ids = segments(8)
  weights = jnp.asarray(np.random.default_rng(9).normal(size=x.size))
  f = lambda z: jnp.sum(weights * itk.segment_soft_topk_mask(
      z, ids, K, num_segments=len(SIZES), regularization_strength=5.0, max_support=M))
  jax_check_grads(f, (jnp.asarray(x),), order=2, modes=("fwd", "rev"), eps=1e-5, atol=1e-5,
                  rtol=1e-5)


def test_the_gradient_moves_to_the_cut_entry_where_the_budget_binds():
  # one segment, binding: y = g((x - c) / l'), so moving the cut entry moves the mask
  x = np.array([2.0, 1.5, 1.0, 0.2, -1.0, 3.0, 0.0])
  ids = np.array([0, 0, 0, 0, 0, 1, 1])
  k = np.array([1.5, 1.0])
  weights = jnp.array([0.3, 1.0, -0.7, 0.4, 0.9, 0.5, 0.2])
  f = lambda z: jnp.sum(weights * itk.segment_soft_topk_mask(
      z, ids, k, num_segments=2, regularization_strength=50.0, max_support=M))
  g = np.asarray(jax.grad(f)(jnp.asarray(x)))
  assert g[3] != 0.0 and g[4] == 0.0  # the cut entry (0.2), not the one below it


# -- transformations ----------------------------------------------------------------------


def test_jit_vmap_and_batch_axes():
  rng = np.random.default_rng(10)
  _, ids = segments(11)
  x = rng.normal(size=(3, ids.size))
  k = np.minimum(rng.uniform(0.2, 2.9, (3, len(SIZES))), SIZES)
  l = rng.uniform(0.5, 5.0, (3, len(SIZES)))
  want, _ = reference(x, ids, k, l, M)
  op = lambda z, i, k_, l_, axis=-1: itk.segment_soft_topk_mask(
      z, i, k_, num_segments=len(SIZES), regularization_strength=l_, max_support=M, axis=axis)
  np.testing.assert_allclose(jax.jit(op)(x, ids, k, l), want, rtol=0, atol=1e-11)
  np.testing.assert_allclose(jax.vmap(op, (0, None, 0, 0))(x, ids, k, l), want, rtol=0,
                             atol=1e-11)
  np.testing.assert_allclose(jax.jit(lambda *a: op(*a, axis=0))(x.T, ids, k, l), want.T,
                             rtol=0, atol=1e-11)
  tangent = rng.normal(size=x.shape)
  _, jvp = jax.jvp(lambda z: op(z, ids, k, l), (x,), (tangent,))
  _, jvp_t = jax.jvp(lambda z: op(z, ids, k, l, axis=0), (x.T,), (tangent.T,))
  np.testing.assert_allclose(jvp_t, jvp.T, rtol=1e-12, atol=1e-12)


def _largest_intermediate(jaxpr) -> int:
  """The most entries of any value in ``jaxpr`` and the jaxprs inside it."""
  largest = 0
  for eqn in jaxpr.eqns:
    for var in eqn.outvars:
      largest = max(largest, int(np.prod(getattr(var.aval, "shape", ()), dtype=np.int64)))
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          largest = max(largest, _largest_intermediate(inner))
  return largest


def test_no_intermediate_of_n_by_m_entries():
  n, num_segments, m = 4000, 4, 8
  rng = np.random.default_rng(12)
  ids = jnp.asarray(rng.integers(0, num_segments, n))
  x = jnp.asarray(rng.normal(size=n))
  k = jnp.full(num_segments, 2.5)
  f = lambda z: jnp.sum(jnp.cos(z) * itk.segment_soft_topk_mask(
      z, ids, k, num_segments=num_segments, regularization_strength=5.0, max_support=m))
  for program in (f, jax.grad(f)):
    assert _largest_intermediate(jax.make_jaxpr(program)(x).jaxpr) <= n


# -- arguments ----------------------------------------------------------------------------


def test_arguments_are_checked_by_name():
  x, ids = segments(13)
  call = lambda **kw: itk.segment_soft_topk_mask(x, ids, kw.pop("k", K), num_segments=len(SIZES),
                                                 **kw)
  for bad, error in ((0, ValueError), (-2, ValueError), (2.5, TypeError), (True, TypeError),
                     (np.int64(3), TypeError), ("3", TypeError)):
    with pytest.raises(error, match="max_support"):
      call(max_support=bad)
  with pytest.raises(ValueError, match="max_support.*larger than k"):
    call(max_support=2)  # k = 2.5 in a segment
  with pytest.raises(ValueError, match="max_support"):
    call(max_support=M, regularizer="entropy")
  # traced k is not checked (k >= m: NaN, never a wrong mask)
  y = jax.jit(lambda k_: itk.segment_soft_topk_mask(x, ids, k_, num_segments=len(SIZES),
                                                    max_support=M))(jnp.asarray(K))
  assert np.all(np.isfinite(np.asarray(y)))
