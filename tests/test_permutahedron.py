"""Soft sort, rank, quantile and top-k values over the permutahedron."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import optimize, stats

import implicit_topk as itk
from implicit_topk import permutahedron as perm
from gradcheck import check_grads

# One worker runs this module (pyproject: --dist loadgroup): its tests share compiled
# functions, which a second worker would compile again.
pytestmark = pytest.mark.xdist_group("test_permutahedron")

REGULARIZERS = [("p2", dict(p=2.0)), ("p4/3", dict(p=4 / 3)), ("p3", dict(p=3.0)),
                ("entropy", dict(regularizer="entropy"))]
# p2 in the fast suite, the others in the slow group
REGULARIZERS_P2_FAST = REGULARIZERS[:1] + [pytest.param(*r, marks=pytest.mark.slow)
                                            for r in REGULARIZERS[1:]]


def _rows(seed, shape, ties=False):
  x = np.random.default_rng(seed).normal(size=shape)
  return jnp.asarray(np.round(2 * x) if ties else x, jnp.float64)


# -- fast-soft-sort's printed examples (regularization_strength == l, "l2" == p=2) --


def test_fast_soft_sort_readme_examples():
  x = jnp.array([5.0, 1.0, 2.0])
  np.testing.assert_allclose(perm.soft_sort(x, regularization_strength=1.0), [5 / 3, 8 / 3, 11 / 3], atol=1e-12)
  np.testing.assert_allclose(perm.soft_sort(x, regularization_strength=0.1), [1.0, 2.0, 5.0], atol=1e-12)
  np.testing.assert_allclose(perm.soft_rank(x, regularization_strength=2.0), [3.0, 1.25, 1.75], atol=1e-12)
  np.testing.assert_allclose(perm.soft_rank(x, regularization_strength=1.0), [3.0, 1.0, 2.0], atol=1e-12)


# -- against an independent solver -----------------------------------------------------


def _permutahedron_constraints(w):
  """y in P(w) iff sum_S y <= (sum of the |S| largest w) for all S, equality for S = all."""
  n, w_desc = len(w), np.sort(w)[::-1]
  cons = [{"type": "eq", "fun": lambda y: y.sum() - w.sum()}]
  for size in range(1, n):
    bound = w_desc[:size].sum()
    for subset in itertools.combinations(range(n), size):
      idx = list(subset)
      cons.append({"type": "ineq", "fun": lambda y, idx=idx, b=bound: b - y[idx].sum()})
  return cons


def _slsqp_argmax(x, w, l, omega):
  res = optimize.minimize(lambda y: -(x @ y) + l * np.sum(omega(y)), np.full(len(x), w.mean()),
                          method="SLSQP", constraints=_permutahedron_constraints(w),
                          bounds=[(1e-9, None)] * len(x) if omega is _entropy else None,
                          options={"ftol": 1e-14, "maxiter": 1000})
  assert res.success, res.message
  return res.x


def _entropy(y):
  return y * np.log(y) - y


OMEGAS = {"p2": lambda y: y ** 2 / 2, "p4/3": lambda y: np.abs(y) ** (4 / 3) / (4 / 3),
          "p3": lambda y: np.abs(y) ** 3 / 3, "entropy": _entropy}


@pytest.mark.parametrize("name,options", REGULARIZERS_P2_FAST)
def test_permutahedron_argmax_matches_a_primal_qp_over_all_subsets(name, options):
  rng = np.random.default_rng(0)
  for _ in range(3):
    x = rng.normal(size=5)
    w = rng.uniform(0.5, 3.0, size=5)
    l = float(rng.choice([0.3, 1.0]))
    y = perm.permutahedron_argmax(jnp.asarray(x), jnp.asarray(w), regularization_strength=l, **options)
    np.testing.assert_allclose(y, _slsqp_argmax(x, w, l, OMEGAS[name]), atol=2e-5)


# -- limits and properties -----------------------------------------------------------


def test_small_l_limits_are_sort_rank_and_quantile():
  x = _rows(1, (3, 9))
  np.testing.assert_allclose(perm.soft_sort(x, regularization_strength=1e-6), jnp.sort(x, axis=-1), atol=1e-12)
  np.testing.assert_allclose(perm.soft_sort(x, regularization_strength=1e-6, descending=True),
                             -jnp.sort(-x, axis=-1), atol=1e-12)
  np.testing.assert_allclose(perm.soft_rank(x, regularization_strength=1e-6), stats.rankdata(x, axis=-1), atol=1e-12)
  np.testing.assert_allclose(perm.soft_rank(x, regularization_strength=1e-6, descending=True),
                             stats.rankdata(-x, axis=-1), atol=1e-12)
  q = jnp.array([0.0, 0.1, 0.5, 0.77, 1.0])
  np.testing.assert_allclose(perm.soft_quantile(x, q, regularization_strength=1e-6), jnp.quantile(x, q, axis=-1),
                             atol=1e-12)
  np.testing.assert_allclose(perm.soft_topk_values(x, 3, regularization_strength=1e-6), -jnp.sort(-x, axis=-1)[:, :3],
                             atol=1e-12)
  np.testing.assert_allclose(perm.soft_sort(x, regularization_strength=1e-6, k=3), jnp.sort(x, axis=-1)[:, -3:],
                             atol=1e-12)


def test_ties_get_average_ranks_and_large_l_gives_the_mean():
  x = jnp.array([1.0, 3.0, 3.0, 0.0])
  np.testing.assert_allclose(perm.soft_rank(x, regularization_strength=1e-9), [2.0, 3.5, 3.5, 1.0], atol=1e-12)
  np.testing.assert_allclose(perm.soft_rank(x, regularization_strength=1e9), np.full(4, 2.5), atol=1e-6)
  np.testing.assert_allclose(perm.soft_sort(x, regularization_strength=1e9), np.full(4, 1.75), atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("name,options", REGULARIZERS)
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), l=st.sampled_from([0.05, 0.5, 5.0]))
def test_ranks_monotone_sorted_values_nondecreasing(name, options, seed, l):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(np.round(rng.normal(size=8) * 2, 1))
  ranks = np.asarray(perm.soft_rank(x, regularization_strength=l, **options))
  order = np.argsort(np.asarray(x), kind="stable")
  assert np.all(np.diff(ranks[order]) >= -1e-9), ranks
  np.testing.assert_allclose(ranks.sum(), 8 * 9 / 2, rtol=1e-10)
  if name != "entropy":  # entropy needs positive values to sort
    values = np.asarray(perm.soft_sort(x, regularization_strength=l, **options))
    assert np.all(np.diff(values) >= -1e-9), values
    np.testing.assert_allclose(values.sum(), float(x.sum()), atol=1e-9)
    if name == "p2":  # only the Euclidean regularizer is shift equivariant
      shifted = perm.soft_sort(x + 3.0, regularization_strength=l, **options)
      np.testing.assert_allclose(shifted, values + 3.0, atol=1e-9)


# -- derivatives -----------------------------------------------------------------------


@pytest.mark.slow  # 15 s; the default run checks these gradients in test_permutahedron_solvers
@pytest.mark.parametrize("name,options", REGULARIZERS)
def test_gradients_pass_check_grads(name, options):
  x, w = _rows(2, (2, 7)), _rows(3, (2, 7))
  positive = jnp.abs(x) + 0.5
  ops = [lambda x: perm.soft_rank(x, regularization_strength=0.4, **options)]
  ops.append(lambda x: perm.soft_sort(x if name != "entropy" else positive + x * 0.1, regularization_strength=0.4,
                                      **options))
  ops.append(lambda x: perm.soft_quantile(x if name != "entropy" else positive + x * 0.1,
                                          jnp.array([0.3, 0.5]), regularization_strength=0.4, **options))
  for op in ops:
    f = lambda x, op=op: jnp.sum(w[..., : op(x).shape[-1]] * op(x))
    check_grads(f, (x,), modes=("fwd", "rev"), atol=1e-6, rtol=1e-6, eps=1e-6)
  g = lambda l: jnp.sum(w * perm.soft_rank(x, regularization_strength=l, **options))
  check_grads(g, (0.4,), modes=("fwd", "rev"), atol=1e-6, rtol=1e-6, eps=1e-6)


def _kernels():
  import types
  from implicit_topk.kernels.cpu import isotonic_pav, pav_permutahedron
  return types.SimpleNamespace(permutahedron_blocks=pav_permutahedron.permutahedron_blocks,
                               isotonic_pav=isotonic_pav.isotonic_pav)


@pytest.mark.slow
@pytest.mark.parametrize("p", [2.0, 4 / 3, 3.0, "exp"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_block_structure_matches_isotonic_pav_on_the_sorted_rows(p, dtype):
  # The host's sort + PAV + block ids against the plain PAV kernel (tested on its own)
  # run on rows sorted by numpy, with blocks = runs of equal values.
  kernels = _kernels()
  rng = np.random.default_rng(11)
  x = np.round(rng.normal(size=(6, 40)), 1).astype(dtype)  # ties
  w = (np.abs(np.round(rng.normal(size=(6, 40)), 1)) + 0.1).astype(dtype)
  x[4, 7] = np.nan
  l = np.array([0.05, 0.3, 1.0, 3.0, 1.0, 30.0])
  values, ids, x_order, x_inverse, w_order = kernels.permutahedron_blocks(x, w, l, p)
  s = np.take_along_axis(x, x_order, -1)
  w_sorted = np.take_along_axis(w, w_order, -1)
  np.testing.assert_array_equal(s[[0, 1, 2, 3, 5]], -np.sort(-x[[0, 1, 2, 3, 5]], axis=-1))
  np.testing.assert_array_equal(w_sorted, -np.sort(-w, axis=-1))
  np.testing.assert_array_equal(np.take_along_axis(x_order, x_inverse, -1),
                                np.broadcast_to(np.arange(40), x.shape))
  v = kernels.isotonic_pav(s, w_sorted, l, p)
  new_block = np.concatenate([np.ones((6, 1), bool), v[:, 1:] != v[:, :-1]], axis=1)
  new_block |= np.isnan(v)
  np.testing.assert_array_equal(ids, np.cumsum(new_block, axis=1) - 1)
  np.testing.assert_array_equal(np.take_along_axis(values, ids, -1), v.astype(dtype))
  assert np.all(values[np.arange(40) > ids[:, -1:]] == 0)
  # already-sorted inputs (soft sort: x = the ranks, shared by every row)
  ranks = np.arange(40, 0, -1, dtype=dtype)
  values2, ids2, no_order, no_inverse, w_order2 = kernels.permutahedron_blocks(
      ranks, w, l, p, sort_x=False)
  assert no_order is None and no_inverse is None
  v2 = kernels.isotonic_pav(np.broadcast_to(ranks, w.shape), w_sorted, l, p)
  np.testing.assert_array_equal(np.take_along_axis(values2, ids2, -1), v2.astype(dtype))


@pytest.mark.slow
@pytest.mark.parametrize("name,options", REGULARIZERS)
def test_gradients_with_ties_match_finite_differences(name, options):
  # Where tied entries share a PAV block (asserted) the LP is smooth: the implicit
  # derivatives through the block conditions must match finite differences (float64).
  # (Soft sort: tied values in separate blocks are order statistics, with a kink; the
  # test takes the first strength in a list at which they share blocks.)
  kernels = _kernels()
  x = jnp.asarray(np.round(2 * np.random.default_rng(12).normal(size=(3, 12))) / 2)
  w = _rows(13, (3, 12))
  p = "exp" if name == "entropy" else options["p"]
  ranks = np.arange(12, 0, -1, dtype=np.float64)
  generator = np.linspace(3.0, 0.5, 12)

  def blocks(kind, point, l):
    if kind == "sort":  # x = the ranks, w = the values
      _, ids, _, _, order = kernels.permutahedron_blocks(ranks, point, np.full(3, l), p,
                                                         sort_x=False)
    else:
      _, ids, order, _, _ = kernels.permutahedron_blocks(
          point, ranks if kind == "rank" else generator, np.full(3, l), p, sort_w=False)
    tied = np.take_along_axis(point, order, -1)
    same = tied[:, 1:] == tied[:, :-1]
    return same.any() and bool(np.all(ids[:, 1:][same] == ids[:, :-1][same]))

  positive = np.asarray(x) + 3.0  # > 0: the entropy's soft sort needs positive values
  l_sort = next(l for l in (2.0, 8.0, 32.0, 128.0) if blocks("sort", positive, l))
  cases = [(lambda x: perm.soft_rank(x, regularization_strength=0.7, **options), np.asarray(x), "rank", 0.7),
           (lambda x: perm.soft_sort(x, regularization_strength=l_sort, **options), positive, "sort", l_sort),
           (lambda x: perm.permutahedron_argmax(x, jnp.asarray(generator), regularization_strength=0.7, **options),
            np.asarray(x), "argmax", 0.7)]
  for op, point, kind, l in cases:
    assert blocks(kind, point, l), kind
    f = lambda x, op=op: jnp.sum(w * op(x))
    check_grads(f, (jnp.asarray(point),), modes=("fwd", "rev"), atol=1e-6,
                rtol=1e-6, eps=1e-6)


def test_backward_has_no_quadratic_intermediate():
  n = 512
  x, w = _rows(4, (n,)), _rows(5, (n,))
  jaxpr = jax.make_jaxpr(jax.grad(lambda x: jnp.sum(w * perm.soft_rank(x, regularization_strength=0.5))))(x)
  sizes = [np.prod(v.aval.shape) for eqn in jaxpr.jaxpr.eqns for v in eqn.outvars
           if hasattr(v.aval, "shape")]
  assert max(sizes) < 4 * n, max(sizes)


# -- shapes, dtypes, errors --------------------------------------------------------------


@pytest.mark.slow
def test_batch_axis_jit_vmap_float32():
  x = _rows(6, (3, 8, 2))
  y = perm.soft_rank(x, regularization_strength=0.3, axis=1)
  rows = jnp.moveaxis(x, 1, -1)
  np.testing.assert_allclose(jnp.moveaxis(y, 1, -1), perm.soft_rank(rows, regularization_strength=0.3), atol=1e-12)
  fn = jax.jit(functools.partial(perm.soft_sort, regularization_strength=0.3))
  np.testing.assert_allclose(jax.vmap(fn)(rows), fn(rows), atol=1e-12)
  y32 = perm.soft_rank(rows.astype(jnp.float32), regularization_strength=0.3)
  assert y32.dtype == jnp.float32
  np.testing.assert_allclose(y32, perm.soft_rank(rows, regularization_strength=0.3), atol=1e-4)


def test_errors_name_the_argument():
  x = _rows(7, (5,))
  with pytest.raises(ValueError, match="`q`"):
    perm.soft_quantile(x, 1.5)
  with pytest.raises(ValueError, match="`k`"):
    perm.soft_sort(x, k=9)
  with pytest.raises(ValueError, match="`regularization_strength`"):
    perm.soft_rank(x, regularization_strength=0.0)
  with pytest.raises(ValueError, match="p-norm"):
    perm.soft_rank(x, regularizer="sigmoid")
  with pytest.raises(TypeError, match="floating"):
    perm.soft_rank(jnp.arange(5))
  # shapes that do not broadcast, an empty axis (raw jax errors before)
  batch = jnp.ones((2, 3))
  with pytest.raises(ValueError, match="`regularization_strength` must be a scalar or broadcast"):
    perm.soft_sort(batch, regularization_strength=jnp.ones(3))
  with pytest.raises(ValueError, match="`w` must be a scalar or broadcast"):
    perm.permutahedron_argmax(jnp.ones(3), jnp.ones(2))
  with pytest.raises(ValueError, match="`x` has no entries along `axis`"):
    perm.soft_quantile(jnp.ones((2, 0)), 0.5)
  with pytest.raises(TypeError, match="`axis` must be an int"):
    itk.soft_topk_mask(batch, 1.0, axis=1.0)


def test_nan_rows_give_nan():
  y = perm.soft_rank(jnp.array([[1.0, jnp.nan, 0.0], [1.0, 2.0, 0.0]]), regularization_strength=0.5)
  assert np.all(np.isnan(y[0])) and np.all(np.isfinite(y[1]))


# -- side by side with ott-jax ---------------------------------------------------------


@pytest.mark.slow
def test_same_limits_and_monotonicity_as_ott():
  soft_sort = pytest.importorskip("ott.tools.soft_sort")
  x = 5 * _rows(8, (6,))  # float64: ott mixes dtypes under x64 with float32 inputs
  ours_rank = perm.soft_rank(x, regularization_strength=1e-4)
  ott_rank = soft_sort.ranks(x, epsilon=1e-4) + 1  # OTT's ranks are 0-based
  np.testing.assert_allclose(ours_rank, stats.rankdata(x), atol=1e-5)
  np.testing.assert_allclose(ott_rank, stats.rankdata(x), atol=0.1)
  ours_sort = perm.soft_sort(x, regularization_strength=1e-4)
  np.testing.assert_allclose(ours_sort, jnp.sort(x), atol=1e-5)
  np.testing.assert_allclose(soft_sort.sort(x, epsilon=1e-4), jnp.sort(x), atol=0.1)
  for l, eps in ((0.5, 0.1), (2.0, 1.0)):  # both monotone at any strength
    order = np.argsort(np.asarray(x))
    assert np.all(np.diff(np.asarray(perm.soft_rank(x, regularization_strength=l))[order]) >= 0)
    assert np.all(np.diff(np.asarray(soft_sort.ranks(x, epsilon=eps))[order]) >= -1e-5)


# -- ties at small strengths, the strength's range, large strengths, entropy sorting ----


TIE_REGULARIZERS = [dict(p=2.0), dict(p=4 / 3), dict(p=3.0), dict(regularizer="entropy")]
TIE_ROWS = np.array([[0.3, 1.1, 1.1, -2.0, 0.0, 0.0],
                     [0.7, -1.5, 0.7, 0.7, 2.5, -1.5]])  # distinct values >= 0.4 apart


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("options", TIE_REGULARIZERS,
                         ids=["p2", "p4/3", "p3", "entropy"])
@pytest.mark.parametrize("solver", ["auto", "pav"])
def test_ties_get_exactly_averaged_ranks_at_small_strengths(dtype, options, solver):
  # Below l ~ 0.1 (gaps >= 0.4 between distinct values, rank steps of 1) the soft ranks
  # are the hard ranks with ties averaged (scipy's rankdata): to a few ulps at every
  # strength down to 1e-30, also for large |x| (a block's value u carries a rounding of
  # the ulp of x, which divided by l once swamped the ranks: 3.457 for 3.5 at 1e-6,
  # rank 0 at 1e-8 in float32).
  eps = np.finfo(dtype).eps
  n = TIE_ROWS.shape[1]
  for magnitude in (1.0, 1e6 if dtype == np.float32 else 1e10):
    x = jnp.asarray(TIE_ROWS * magnitude, dtype)
    expected = stats.rankdata(TIE_ROWS, axis=-1)
    for l in (1e-2, 1e-5, 1e-8, 1e-12, 1e-20, 1e-30):
      r = np.asarray(perm.soft_rank(x, regularization_strength=l, solver=solver, **options),
                     np.float64)
      np.testing.assert_allclose(r, expected, rtol=8 * eps, atol=0, err_msg=f"l={l}")
      np.testing.assert_allclose(r.sum(-1), n * (n + 1) / 2, rtol=8 * eps)
    # permutahedron_argmax: the mass of w = e_1 split evenly over the tied maximizers
    y = perm.permutahedron_argmax(x[:1], jnp.asarray([1.0, 0, 0, 0, 0, 0], dtype),
                                  regularization_strength=1e-20, solver=solver, **options)
    if "regularizer" not in options:  # the entropy needs w > 0
      np.testing.assert_allclose(y[0], [0, 0.5, 0.5, 0, 0, 0], atol=8 * eps)


def test_tied_blocks_derivatives_at_small_strength_match_finite_differences():
  # At l = 1e-8 the tied pairs form blocks (y = w_mean + (x_i - x_first)/l on them): the
  # derivative is of order 1/l, and central differences with steps far below l read it.
  x = jnp.asarray(TIE_ROWS[1])
  w = jnp.asarray([0.3, -1.2, 0.8, 2.0, -0.4, 1.1])
  for options in TIE_REGULARIZERS:
    f = lambda x, options=options: float(jnp.sum(w * perm.soft_rank(
        x, regularization_strength=1e-8, **options)))
    grad = jax.grad(lambda x, options=options: jnp.sum(w * perm.soft_rank(
        x, regularization_strength=1e-8, **options)))(x)
    h = 2.0 ** -43  # ~1e-13, a multiple of the entries' ulps: x +- h exact
    fd = [(f(x.at[i].add(h)) - f(x.at[i].add(-h))) / (2 * h) for i in range(6)]
    np.testing.assert_allclose(grad, fd, rtol=1e-5, atol=0.1)  # |grad| ~ 1e8 on the blocks
  # untied entries at a small strength: the hard ranks, locally constant
  x = _rows(14, (7,))
  for options in TIE_REGULARIZERS:
    grad = jax.grad(lambda x, options=options: jnp.sum(w[:1] * perm.soft_rank(
        x, regularization_strength=1e-9, **options)))(x)
    np.testing.assert_array_equal(grad, np.zeros(7))


def test_tie_free_gradients_match_float64_central_differences():
  x, w = _rows(15, (7,)), _rows(16, (7,))
  positive = jnp.abs(x) + 0.5
  for options in TIE_REGULARIZERS:
    for op, point in ((lambda x, o=options: perm.soft_rank(x, regularization_strength=0.3, **o), x),
                      (lambda x, o=options: perm.soft_sort(x, regularization_strength=0.3, **o),
                       positive)):
      f = lambda x, op=op: jnp.sum(w * op(x))
      grad = jax.grad(f)(point)
      h = 1e-6
      fd = [(f(point.at[i].add(h)) - f(point.at[i].add(-h))) / (2 * h) for i in range(7)]
      np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-7)


STRENGTH_OPERATORS = {
    "soft_rank": lambda x, l: perm.soft_rank(x, regularization_strength=l),
    "soft_sort": lambda x, l: perm.soft_sort(x, regularization_strength=l),
    "soft_quantile": lambda x, l: perm.soft_quantile(x, 0.5, regularization_strength=l),
    "soft_topk_values": lambda x, l: perm.soft_topk_values(x, 2, regularization_strength=l),
    "permutahedron_argmax": lambda x, l: perm.permutahedron_argmax(
        x, jnp.arange(4.0), regularization_strength=l),
}


@pytest.mark.parametrize("name", sorted(STRENGTH_OPERATORS))
def test_strength_outside_the_documented_range_raises(name):
  # docs/operators.md: 2^-1022 <= l < 2^1022 (float64), 2^-126 <= l < 2^126 (float32);
  # float32 l = 1e-38 gave NaN, soft_sort at 8.6e37 zeros.
  op = STRENGTH_OPERATORS[name]
  x32 = jnp.asarray([0.3, -1.2, 2.0, 0.7], jnp.float32)
  for x, bad, good in ((x32, (1e-38, 8.6e37, 2.0 ** 126), (2.0 ** -126, 8.4e37)),
                       (x32.astype(jnp.float64), (1e-308, 2.0 ** 1022),
                        (2.0 ** -1022, 4e307))):
    for l in bad:
      with pytest.raises(ValueError, match="`regularization_strength`"):
        op(x, l)
    for l in good:
      assert np.all(np.isfinite(op(x, l))), (name, x.dtype, l)


def _isotonic_decreasing(z):
  """Least-squares fit of a nonincreasing sequence (pool adjacent violators, numpy)."""
  blocks = []  # [sum, count]
  for value in z:
    blocks.append([value, 1])
    while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] <= blocks[-1][0] / blocks[-1][1]:
      total, count = blocks.pop()
      blocks[-1][0] += total
      blocks[-1][1] += count
  return np.concatenate([np.full(c, t / c) for t, c in blocks])


def _soft_rank_p2_reference(x_over_l):
  """p = 2 soft ranks of x at strength l from x / l alone: y = s/l - v with v the
  nonincreasing fit of s/l - (n, ..., 1) (the isotonic dual, in units of l)."""
  order = np.argsort(-x_over_l, kind="stable")
  s = x_over_l[order]
  ranks = np.arange(len(s), 0, -1.0)
  y = np.empty_like(s)
  y[order] = s - _isotonic_decreasing(s - ranks)
  return y


@pytest.mark.parametrize("solver", ["auto", "pav"])
def test_large_strengths_stay_finite_and_right(solver):
  # l * n(n+1)/2 (ranks) or l * |x| (sorting) beyond the float range overflowed: inf or NaN.
  x = _rows(17, (100,))
  r = perm.soft_rank(x.astype(jnp.float32), regularization_strength=1e35, solver=solver)
  np.testing.assert_allclose(r, np.full(100, 50.5), rtol=1e-6)
  r = perm.soft_rank(x[:4], regularization_strength=4e307, solver=solver)
  np.testing.assert_allclose(r, np.full(4, 2.5), rtol=1e-15)
  big = x[:8].astype(jnp.float32) * 1e15
  s = perm.soft_sort(big, regularization_strength=1e25, solver=solver)
  np.testing.assert_allclose(s, np.full(8, np.mean(np.asarray(big, np.float64))), rtol=1e-6)
  # not the mean: x and l both near the float64 limit (l * 5050 overflows)
  for scale in (1e305, 1e-300):
    r = perm.soft_rank(x * scale, regularization_strength=10 * scale, solver=solver)
    np.testing.assert_allclose(r, _soft_rank_p2_reference(np.asarray(x) / 10), rtol=1e-12)


@pytest.mark.parametrize("solver", ["auto", "pav"])
def test_entropy_sorts_ascending_and_gives_quantiles(solver):
  # soft_sort(regularizer="entropy") ascending returned zeros and soft_quantile -0.0:
  # ascending is the descending LP's solution reversed (SLSQP on the LP, scipy).
  x = np.array([3.0, 1.0, 2.0, 0.5])
  for l in (0.1, 1.0):
    descending = _slsqp_argmax(np.arange(4, 0, -1.0), x, l, _entropy)
    ascending = perm.soft_sort(jnp.asarray(x), regularization_strength=l,
                               regularizer="entropy", solver=solver)
    np.testing.assert_allclose(ascending, descending[::-1], atol=2e-5)
    q = np.array([0.0, 0.5, 1.0])
    position = q * 3
    lower = np.floor(position).astype(int)
    upper = np.minimum(lower + 1, 3)
    expected = (descending[::-1][lower] * (1 - (position - lower))
                + descending[::-1][upper] * (position - lower))
    np.testing.assert_allclose(
        perm.soft_quantile(jnp.asarray(x), jnp.asarray(q), regularization_strength=l,
                           regularizer="entropy", solver=solver), expected, atol=2e-5)


def test_soft_sort_strength_scales_like_x_to_the_one_minus_p():
  # soft_sort(c x, l) = c soft_sort(x, l c^(p - 1)) (the docstring's units sentence)
  x = _rows(18, (2, 9))
  for p in (2.0, 4 / 3, 3.0):
    for c in (0.1, 7.0):
      np.testing.assert_allclose(perm.soft_sort(c * x, regularization_strength=0.3, p=p),
                                 c * perm.soft_sort(x, regularization_strength=0.3 * c ** (p - 1),
                                                    p=p), rtol=1e-10, atol=1e-12)


def test_non_finite_entries_make_their_row_nan():
  # documented: a row with an infinite entry is NaN (the other rows are unaffected)
  x = jnp.asarray([[1.0, jnp.inf, 0.0, 2.0], [1.0, -jnp.inf, 0.0, 2.0], [1.0, 3.0, 0.0, 2.0]])
  for y in (perm.soft_rank(x), perm.soft_sort(x), perm.soft_topk_values(x, 2),
            perm.soft_quantile(x, jnp.array([0.2, 0.5]), axis=-1).T,
            perm.permutahedron_argmax(x, jnp.arange(4.0))):
    assert np.all(np.isnan(y[:2])) and np.all(np.isfinite(y[2])), y


@pytest.mark.parametrize("solver", ["auto", "pav"])
def test_entropy_needs_a_nonnegative_generator(solver):
  """The entropy's ``y log y`` needs ``y >= 0``, which the permutahedron of ``w`` allows
  only for ``w >= 0``: ``soft_sort([-1, 1, 2], regularizer="entropy")`` returned positive
  values summing to 2 (or NaN), with nothing said. Concrete: a ValueError naming the
  argument; traced: NaN rows (the others unaffected); zeros are allowed."""
  kw = dict(regularizer="entropy", solver=solver)
  negative = jnp.array([-1.0, 1.0, 2.0])
  calls = {"x": [lambda: perm.soft_sort(negative, **kw),
                 lambda: perm.soft_quantile(negative, 0.5, **kw),
                 lambda: perm.soft_topk_values(negative, 2, **kw)],
           "w": [lambda: perm.permutahedron_argmax(jnp.ones(3), negative, **kw)]}
  for name, fns in calls.items():
    for fn in fns:
      with pytest.raises(ValueError, match=f"`{name}` must be >= 0 with regularizer='entropy'"):
        fn()
  rows = jnp.array([[-1.0, 1.0, 2.0], [0.0, 1.0, 2.0], [3.0, 1.0, 2.0]])
  y = np.asarray(jax.jit(lambda v: perm.soft_sort(v, **kw))(rows))
  assert np.all(np.isnan(y[0])) and np.all(np.isfinite(y[1:])), y
  # the zero row: the LP over P((0, 1, 2)) (SLSQP, scipy), ascending
  expected = _slsqp_argmax(np.arange(3, 0, -1.0), np.array([0.0, 1.0, 2.0]), 1.0, _entropy)
  np.testing.assert_allclose(y[1], expected[::-1], atol=2e-5)
  # soft_rank's generator is the ranks: any x
  assert np.all(np.isfinite(perm.soft_rank(negative, **kw)))


# (op, options, offset, strength): float32 long rows against float64 on the same rounded
# entries. Summing a block's ranks (up to n (n + 1) / 2) in float32 shifted every rank by up
# to 0.4 at n = 1e4; entropic merges compared block values at the level of the entries.
LONG_FLOAT32_ROWS = [
    ("soft_rank", {}, 0.0, 1000.0),
    ("soft_rank", {}, 0.0, 1.0),
    ("soft_rank", {"regularizer": "entropy"}, 0.0, 1000.0),
    ("soft_rank", {"regularizer": "entropy"}, 1000.0, 1.0),
    ("soft_rank", {"p": 3.0}, 0.0, 1.0),
    ("soft_sort", {}, 1000.0, 1000.0),
    ("soft_sort", {"p": 3.0}, 0.0, 1000.0),
]


@pytest.mark.slow  # rows of 1e4 entries, 14 cases: 50 s on 2 cores
@pytest.mark.parametrize("solver", ["auto", "pav"])
@pytest.mark.parametrize("name,options,offset,strength", LONG_FLOAT32_ROWS)
def test_long_float32_rows_are_as_exact_as_their_values(name, options, offset, strength, solver):
  n = 10_000
  x = jnp.asarray(offset + np.random.default_rng(0).normal(size=n), jnp.float32)
  op = getattr(itk, name)
  got = np.asarray(op(x, regularization_strength=strength, solver=solver, **options), np.float64)
  exact = np.asarray(op(x.astype(jnp.float64), regularization_strength=strength, solver=solver,
                        **options))
  ulp = np.spacing(np.float32(np.abs(exact).max()))
  assert np.abs(got - exact).max() <= 24 * ulp, (np.abs(got - exact).max() / ulp)
  if name == "soft_rank":  # each row sums to n (n + 1) / 2
    assert abs(got.mean() - (n + 1) / 2) <= 2 * ulp


@pytest.mark.slow  # rows of 1e4 and 1e5 entries, 5 cases: 28 s on 2 cores for the four at 1e4
@pytest.mark.parametrize("name, solver, n", [
    ("soft_rank", "auto", 10_000), ("soft_rank", "pav", 10_000), ("soft_sort", "auto", 10_000),
    ("soft_sort", "pav", 10_000), ("soft_rank", "auto", 100_000)])
def test_long_float32_rows_of_few_distinct_values_are_as_exact_as_their_values(name, solver, n):
  # (integers |x| <= 12 in blocks of thousands, strength 10 std / n: the block means of
  # d_i = (s_i - s_first) / l, up to 8e3, were one float32 sum, 790 ulps off at n = 1e4;
  # then its second pass, over the deviations, summed in one sequence on CPU: 91 ulps of
  # 1e5, 0.7 of a rank, at n = 1e5)
  x = np.round(3 * np.random.default_rng(0).normal(size=n)).astype(np.float32)
  strength = float(np.float32(10 * x.std() / n))
  op = getattr(itk, name)
  got = np.asarray(op(jnp.asarray(x), regularization_strength=strength, solver=solver),
                   np.float64)
  exact = np.asarray(op(jnp.asarray(x, jnp.float64), regularization_strength=strength,
                        solver=solver))
  ulp = np.spacing(np.float32(np.abs(exact).max()))
  assert np.abs(got - exact).max() <= 24 * ulp, (np.abs(got - exact).max() / ulp)
