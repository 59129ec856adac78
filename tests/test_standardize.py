"""standardize=True: the strength relative to the spread of the data (issue: a strength
that does not depend on scale). The math and its checks against Brent's method are in
proofs/standardized_strength.{md,py} (run by tests/test_proofs.py); here the operators'
behaviour: invariance/equivariance for every operator of the family, per-row, per-segment
and whole-tree spreads, where=, non-finite entries, zero spread, dtypes, jit and grad."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import implicit_topk as itk
import references as R

RNG = np.random.default_rng(26)
X = jnp.asarray(RNG.normal(size=(3, 9)))


def close(a, b, tol=1e-10):
  np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), atol=tol, rtol=0)


@pytest.mark.parametrize("p", [4.0 / 3.0, 2.0])
def test_mask_is_the_mask_at_strength_times_the_row_std(p):
  # Independent of the library's spread: NumPy's std per row, passed as the strength.
  std = np.std(np.asarray(X), axis=-1)
  close(itk.soft_topk_mask(X, 2.5, regularization_strength=0.7, p=p, standardize=True),
        itk.soft_topk_mask(X, 2.5, regularization_strength=0.7 * jnp.asarray(std), p=p))


@pytest.mark.parametrize("c, b", [(1e-3, 0.0), (250.0, -3.0), (1e6, 1e3)])
def test_every_mask_operator_is_invariant_under_scale_and_shift(c, b):
  y = itk.soft_topk_mask(X, 2.5, standardize=True)
  assert not np.allclose(y, itk.soft_topk_mask(c * X + b, 2.5))  # without: it changes
  tol = 1e-12 * (abs(b) + c * 3) / c + 1e-12  # the rounding of c x + b, relative to c
  close(itk.soft_topk_mask(c * X + b, 2.5, standardize=True), y, tol)
  ids = jnp.array([0, 0, 0, 0, 1, 1, 1, 1, 1])
  seg = itk.segment_soft_topk_mask(X, ids, jnp.array([1.5, 2.0]), standardize=True)
  close(itk.segment_soft_topk_mask(c * X + b, ids, jnp.array([1.5, 2.0]), standardize=True), seg, tol)
  tree = {"a": X[0], "b": X[1:]}
  out = itk.tree_soft_topk_mask(tree, 4.0, standardize=True)
  moved = itk.tree_soft_topk_mask(jax.tree.map(lambda v: c * v + b, tree), 4.0, standardize=True)
  for key in tree:
    close(moved[key], out[key], tol)


@pytest.mark.parametrize("p", [4.0 / 3.0, pytest.param(1.5, marks=pytest.mark.slow),
                               pytest.param(2.0, marks=pytest.mark.slow)])
def test_magnitude_operators_are_equivariant(p):
  for c in (1e-4, 37.0):
    m = itk.soft_topk_mag(X, 3, p=p, standardize=True)
    close(itk.soft_topk_mag(c * X, 3, p=p, standardize=True), c * m, 1e-12 * c)
    tree = {"w": X[0], "v": X[1:]}
    t = itk.tree_soft_topk_mag(tree, 5, p=p, standardize=True)
    scaled = itk.tree_soft_topk_mag(jax.tree.map(lambda v: c * v, tree), 5, p=p, standardize=True)
    for key in tree:
      close(scaled[key], c * t[key], 1e-12 * c)
  if p != 2.0:  # p = 2 is equivariant already; the others are not without standardize
    assert not np.allclose(itk.soft_topk_mag(1e-4 * X, 3, p=p), 1e-4 * itk.soft_topk_mag(X, 3, p=p))


@pytest.mark.parametrize("solver", ["native", "threshold", "pav"])
@pytest.mark.parametrize("p", [3.0, 5.0])
def test_magnitude_at_p_above_2_over_extreme_spreads(solver, p):
  # Found by an independent audit: the standardized strength l s^(2 - p) left the float
  # range for p > 2 (p = 5, spread 1e-10: 1e30 l), and (|x| - lam) / l underflowed: wrong
  # values on every solver, unflagged. Now the row is divided by its spread instead.
  # Reference: the independent magnitude reference on the unscaled float32 row at
  # l std(x)^(2 - p), times c.
  x0 = np.array([0.3, -1.2, 2.0, 0.7, -0.05], np.float32)
  spread = float(np.std(x0.astype(np.float64)))
  want, _ = R.mag_row(x0.astype(np.float64), 2.3, spread ** (2.0 - p), p)
  for c in (1e-20, 1e-10, 1e10, 1e20):
    got = np.asarray(itk.soft_topk_mag(jnp.asarray(x0 * np.float32(c)), 2.3, p=p,
                                       standardize=True, solver=solver), np.float64)
    np.testing.assert_allclose(got / c, want, rtol=2e-5, atol=2e-6, err_msg=f"c={c}")


def test_spreads_are_per_row_per_segment_and_whole_tree():
  # Scaling one row (one segment) changes nothing; scaling one leaf of a tree changes the
  # tree's single spread, so the other leaf's mask changes too.
  scaled_row = X.at[1].multiply(40.0)
  close(itk.soft_topk_mask(scaled_row, 2.5, standardize=True), itk.soft_topk_mask(X, 2.5, standardize=True))
  ids = jnp.array([0, 0, 0, 0, 1, 1, 1, 1, 1])
  one_segment = X.at[:, :4].multiply(40.0)
  k = jnp.array([1.5, 2.0])
  close(itk.segment_soft_topk_mask(one_segment, ids, k, standardize=True)[:, 4:],
        itk.segment_soft_topk_mask(X, ids, k, standardize=True)[:, 4:])
  tree = {"a": X[0], "b": X[1:]}
  before = itk.tree_soft_topk_mask(tree, 4.0, standardize=True)["b"]
  after = itk.tree_soft_topk_mask({"a": 40.0 * X[0], "b": X[1:]}, 4.0, standardize=True)["b"]
  assert not np.allclose(before, after)


def test_where_and_non_finite_entries_do_not_enter_the_spread():
  x = jnp.array([[0.3, -1.2, 2.0, 0.7, 99.0], [0.3, -1.2, 2.0, 0.7, jnp.inf]])
  where = jnp.array([[True, True, True, True, False]] * 2)
  std = float(np.std([0.3, -1.2, 2.0, 0.7]))
  padded = itk.soft_topk_mask(x[:1], 1.5, standardize=True, where=where[:1])
  close(padded[0, :4], itk.soft_topk_mask(x[0, :4], 1.5, regularization_strength=std))
  # +inf gets 1; the finite entries share 0.5 at the strength of their own spread
  with_inf = itk.soft_topk_mask(x[1], 1.5, standardize=True)
  close(with_inf[:4], itk.soft_topk_mask(x[1, :4], 0.5, regularization_strength=std))
  assert with_inf[4] == 1.0


@pytest.mark.parametrize("solver", ["auto", "threshold", "pav"])
@pytest.mark.parametrize("excluded", [np.nan, np.inf])
def test_magnitude_gradients_with_non_finite_entries(solver, excluded):
  # (the division by the spread sent inf * 0 = NaN into every entry's derivative)
  w = jnp.array([True, False, True, True])
  x = jnp.array([1.0, excluded, 0.0, -2.0])
  op = lambda v, k, **kw: itk.soft_topk_mag(v, k, standardize=True, solver=solver, **kw)
  loss = lambda v, k, **kw: jnp.sum(jnp.where(w, op(v, k, **kw), 0.0) ** 2)
  removed = jax.grad(lambda v: jnp.sum(op(v, 1.5) ** 2))(x[w])
  # an excluded entry: the operator on the row without it, derivative 0 there
  grad = jax.grad(lambda v: loss(v, 1.5, where=w))(x)
  close(grad[w], removed)
  assert grad[1] == 0.0
  # a kept +inf entry takes one unit of k: the others as the row without it at k - 1
  grad = jax.grad(lambda v: loss(v, 2.5))(x.at[1].set(jnp.inf))
  close(grad[w], removed)


@pytest.mark.parametrize("value", [7.0, 3.0, 0.3, -1e300])
@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32])
def test_zero_spread_rows_use_spread_one_with_its_derivative(value, dtype):
  """All-equal rows take s = 1 and the derivative of the mask at strength l
  (proofs/standardized_strength.md item 5), also under jit: there the variance of
  [3, 3, 3, 3] came out 1e-33 (the mean rounds, the centring is fused), a spread of
  1e-16 and derivatives of 1e15 (7.0 and 0.3 in float32 too)."""
  if dtype == jnp.float32 and abs(value) > 1e30:
    pytest.skip("beyond float32")
  x = jnp.full(4, value, dtype)
  for op in (lambda v: itk.soft_topk_mask(v, 1.5, standardize=True),
             jax.jit(lambda v: itk.soft_topk_mask(v, 1.5, standardize=True))):
    close(op(x), 1.5 / 4, tol=1e-6)
    plain = jax.jacobian(lambda v: itk.soft_topk_mask(v, 1.5))(x)
    close(jax.jacobian(op)(x), plain, tol=1e-6 * float(np.max(np.abs(plain))))
  mag = jax.jit(lambda v: itk.soft_topk_mag(v, 1.5, p=3.0, standardize=True))
  close(mag(x), itk.soft_topk_mag(x, 1.5, p=3.0), tol=1e-6 * abs(value))
  close(itk.soft_topk_mag(jnp.zeros(5, dtype), 2, standardize=True), 0.0)


def test_spreads_up_to_the_float_maximum():
  """The spread divided by the row's largest entry, as XLA does it (a product with the
  reciprocal), was 0 from 2^126 in float32 and 2^1022 in float64 (the reciprocal
  flushed): such rows were standardized with s = 1, and the magnitude's row divided
  by its spread gave zeros. Both operators are scale invariant / equivariant."""
  b = np.array([0.3, -1.2, 2.0, 0.7, 1.1, -0.4])
  unit32 = itk.soft_topk_mask(jnp.asarray(b, jnp.float32), 2.5, regularization_strength=0.5,
                              standardize=True)
  for c in (1e37, 1e38):
    close(itk.soft_topk_mask(jnp.asarray(b * c, jnp.float32), 2.5, regularization_strength=0.5,
                             standardize=True), unit32, tol=1e-5)
  row = jnp.array([1.0, -1.0, 0.0])
  for scale in (1e300, 1e308):
    close(itk.soft_topk_mask(row * scale, 1.5, regularization_strength=1e-3, standardize=True),
          itk.soft_topk_mask(row, 1.5, regularization_strength=1e-3, standardize=True))
    for solver in ("native", "threshold", "pav"):
      close(np.asarray(itk.soft_topk_mag(row * scale, 1.5, standardize=True, solver=solver)) / scale,
            itk.soft_topk_mag(row, 1.5, standardize=True, solver=solver))


def test_gradients_match_finite_differences_and_respect_the_invariance():
  x = np.asarray(X[0])
  f = lambda v: itk.soft_topk_mask(v, 2.5, regularization_strength=0.5, standardize=True)[jnp.array([1, 4])].sum()
  g = np.asarray(jax.grad(f)(jnp.asarray(x)))
  h = 1e-6
  fd = np.array([(f(jnp.asarray(x + h * e)) - f(jnp.asarray(x - h * e))) / (2 * h) for e in np.eye(9)])
  close(g, fd, 1e-7)
  assert abs(g @ x) < 1e-10 and abs(g.sum()) < 1e-10  # J x = 0, J 1 = 0
  assert np.max(np.abs(g)) > 1e-3  # not a vacuous check: the mask is fractional here


@pytest.mark.slow  # second order: 15 s of compiling; the default run checks first order above
def test_first_and_second_derivatives_equal_those_through_jax_std():
  # The spread holds its scale and mean constant in autodiff (identities that make those
  # derivatives zero); the result must still be every derivative of the plain formula.
  # Reference: the mask at strength l * jnp.std(row), differentiated by JAX through its
  # own std, for the rows and for a tree whose leaves share one spread.
  w = jnp.asarray(RNG.normal(size=X.shape))
  v = jnp.asarray(RNG.normal(size=X.shape))
  ours = lambda z: jnp.sum(w * itk.soft_topk_mask(z, 2.5, regularization_strength=0.5,
                                                  standardize=True))
  theirs = lambda z: jnp.sum(w * itk.soft_topk_mask(
      z, 2.5, regularization_strength=0.5 * jnp.std(z, axis=-1)))
  assert np.max(np.abs(jax.grad(theirs)(X))) > 1e-3  # not vacuous: fractional masks
  close(jax.grad(ours)(X), jax.grad(theirs)(X), 1e-10)
  hvp = lambda f: jax.jvp(jax.grad(f), (X,), (v,))[1]
  close(hvp(ours), hvp(theirs), 1e-9)
  weigh = lambda out: jnp.sum(w[0] * out["a"]) + jnp.sum(w[1:] * out["b"])
  tree_ours = lambda z: weigh(itk.tree_soft_topk_mask(
      {"a": z[0], "b": z[1:]}, 4.0, regularization_strength=0.5, standardize=True))
  tree_theirs = lambda z: weigh(itk.tree_soft_topk_mask(
      {"a": z[0], "b": z[1:]}, 4.0, regularization_strength=0.5 * jnp.std(z)))
  close(hvp(tree_ours), hvp(tree_theirs), 1e-9)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_low_precision_and_jit(dtype):
  x = X.astype(dtype)
  f = jax.jit(lambda v: itk.soft_topk_mask(v, 2.5, standardize=True))
  y = f(x)
  assert y.dtype == dtype
  ref = itk.soft_topk_mask(X, 2.5, standardize=True)
  close(y, ref, {jnp.float32: 1e-5, jnp.bfloat16: 3e-2, jnp.float16: 5e-3}[dtype])
  close(f(64.0 * x), y, {jnp.float32: 1e-5, jnp.bfloat16: 3e-2, jnp.float16: 5e-3}[dtype])


def test_mask_strength_times_spread_beyond_the_strengths_range_gives_nan():
  # documented: invariant under x -> c x while l * s stays in [2^-126, 2^126) (float32)
  row = np.array([1.0, -1.0, 0.5, 0.2], np.float32)
  unit = itk.soft_topk_mask(jnp.asarray(row), 1.5, standardize=True)
  close(itk.soft_topk_mask(jnp.asarray(row * np.float32(1e30)), 1.5, standardize=True), unit, 1e-6)
  for c, l in ((3e38, 1.0), (1e-37, 0.01)):
    out = itk.soft_topk_mask(jnp.asarray(row * np.float32(c)), 1.5, regularization_strength=l,
                             standardize=True)
    assert np.all(np.isnan(np.asarray(out))), (c, l)
