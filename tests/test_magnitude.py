"""soft_topk_mag: seed README values, independent solvers, solver agreement, derivatives,
properties (hypothesis), errors and transformations.

Independent references (no code shared with the library):
  * scipy SLSQP on the reference's isotonic dual
    min_{v_1 >= ... >= v_n} sum_i |s_i - v_i|^q / (q l^(q-1)) + w_i v_i^2 / 2,
    mapped to the output sign(x) (y + l y^(p-1)), y = ((s - v) / l)^(q-1) as the
    reference does;
  * for p = 2, a plain numpy weighted PAV of the same dual (exact);
  * a numpy/scipy Brent root of the threshold equation sum min(1, g(t/l)/lam) = k.
"""

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import optimize

import implicit_topk as itk
from implicit_topk import compat
from implicit_topk import problems
from gradcheck import check_grads

# One worker runs this module (pyproject: --dist loadgroup): its tests share compiled
# functions, which a second worker would compile again.
pytestmark = pytest.mark.xdist_group("test_magnitude")

jax.config.update("jax_enable_x64", True)

SOLVERS = ("pav", "threshold")
PS = (4 / 3, 1.5, 2.0, 3.0)
# the fast suite keeps the default p = 4/3 (one numba kernel), the slow group the others
PS_FAST = PS[:1] + tuple(pytest.param(p, marks=pytest.mark.slow) for p in PS[1:])
_SETTINGS = settings(max_examples=15, deadline=None, print_blob=True,
                     suppress_health_check=[HealthCheck.too_slow])


@functools.lru_cache(maxsize=None)
def _fn(solver, p, **options):
  """jit of soft_topk_mag with k and l traced (one compilation per solver, p, shape)."""
  return jax.jit(lambda x, k, l: itk.soft_topk_mag(x, k, regularization_strength=l, p=p, solver=solver, **options))


def mag(x, k, l, *, p, solver, **options):
  x = jnp.asarray(x, jnp.float64)
  fn = _fn(solver, p, **options)
  return np.asarray(fn(x, jnp.asarray(k, jnp.float64), jnp.asarray(l, jnp.float64)))


@functools.lru_cache(maxsize=None)
def _lam_fn(p):
  obj = itk.PAVSolver(problem=problems.Magnitude(p))
  return jax.jit(lambda x, k, l: obj.run(None, x, k, l).params)


def _rows(seed, shape, ties=False):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=shape) * 2
  return np.round(2 * x) / 2 if ties else x


# -- independent references -----------------------------------------------------------


def _weights(k, n):
  return np.clip(k - np.arange(n), 0, 1)


def _from_dual(x, v_sorted, order, l, p):
  """The reference's output map from the dual solution (in sorted order)."""
  s = np.abs(x)[order]
  y = (np.maximum(s - v_sorted, 0) / l) ** (1 / (p - 1))
  out = np.empty_like(x)
  out[order] = y + l * y ** (p - 1)
  return np.sign(x) * out


def _dual_objective(v, s, w, l, p):
  q = p / (p - 1)
  return np.sum(np.abs(s - v) ** q) / (q * l ** (q - 1)) + 0.5 * np.sum(w * v * v)


def _slsqp_dual(x, k, l, p):
  """(output, dual objective at the SLSQP point, the dual objective function in sorted order)."""
  q = p / (p - 1)
  order = np.argsort(-np.abs(x), kind="stable")
  s = np.abs(x)[order]
  n = s.size
  w = _weights(k, n)
  obj = lambda v: _dual_objective(v, s, w, l, p)
  jac = lambda v: -np.sign(s - v) * np.abs(s - v) ** (q - 1) / l ** (q - 1) + w * v
  cons = [{"type": "ineq", "fun": lambda v: v[:-1] - v[1:],
           "jac": lambda v: np.eye(n)[:-1] - np.eye(n)[1:]}]
  res = optimize.minimize(obj, s / (1 + l * w), jac=jac, method="SLSQP", constraints=cons,
                          options={"ftol": 1e-15, "maxiter": 2000})
  assert res.success, res.message
  return _from_dual(x, res.x, order, l, p), res.fun, obj, order


def _dual_from_threshold(x, lam, l, p, order):
  """The dual point the threshold form predicts: v = h^{-1}(s) (kept), lam (fractional),
  s (zero), with y = min(g((s - lam)_+ / l), h^{-1}(s)) and v = s - l y^(p-1)."""
  s = np.abs(x)[order]
  h = lambda y, target: y + l * y ** (p - 1) - target
  hinv = np.array([optimize.brentq(h, 0, si, args=(si,), xtol=1e-300, rtol=1e-15) if si > 0 else 0.0
                   for si in s])
  y = np.minimum((np.maximum(s - lam, 0) / l) ** (1 / (p - 1)), hinv)
  return s - l * y ** (p - 1)


def _numpy_pav_p2(x, k, l):
  """p = 2: the dual is the weighted isotonic regression of s/(1+lw), weights 1+lw."""
  order = np.argsort(-np.abs(x), kind="stable")
  s = np.abs(x)[order]
  rho = 1 + l * _weights(k, s.size)
  blocks = []  # [value, weight, count]
  for target, weight in zip(s / rho, rho):
    blocks.append([target, weight, 1])
    while len(blocks) > 1 and blocks[-2][0] < blocks[-1][0]:
      v2, w2, c2 = blocks.pop()
      v1, w1, c1 = blocks.pop()
      blocks.append([(w1 * v1 + w2 * v2) / (w1 + w2), w1 + w2, c1 + c2])
  v = np.concatenate([np.full(c, val) for val, _, c in blocks])
  return _from_dual(x, v, order, l, 2.0)


def _brent_threshold(x, k, l, p):
  s = np.abs(x)
  if np.sum(s > 0) <= k:
    return 0.0
  phi = lambda lam: np.sum(np.minimum(1, (np.maximum(s - lam, 0) / l) ** (1 / (p - 1)) / lam)) - k
  with np.errstate(over="ignore", divide="ignore"):
    return optimize.brentq(phi, 1e-300, s.max(), xtol=1e-300, rtol=1e-15, maxiter=1000)


def _threshold_output(x, lam, l, p):
  s = np.abs(x)
  t = np.maximum(s - lam, 0)
  return np.sign(x) * np.minimum(s, t + (t / l) ** (1 / (p - 1)))


# -- the seed README ------------------------------------------------------------------

_SEED_VALUES = np.array([[[-11, 1, 4, -7], [5, 1, 4, 1], [-10, -3, 4, -6]],
                         [[7, -6, -8, -4], [-1, 9, 8, 4], [0, 0, -5, 5]]], np.int32)
_SEED_PAV = [[[-10.999428, 0., 0., -7.0002456], [5.000036, 0., 3.9999368, 0.],
              [-10.000449, -0., 0., -5.999853]],
             [[7.0002456, -0., -7.99995, -0.], [-0., 8.999435, 7.99995, 0.],
              [0., 0., -5.000036, 5.000036]]]
_SEED_DYKSTRA = [[[-10.999967, 0., 0., -6.999992], [4.9999804, 0., 3.9999988, 0.],
                  [-9.999961, -0., 0., -5.999986]],
                 [[6.999992, -0., -7.9999976, -0.], [-0., 8.999955, 7.9999976, 0.],
                  [0., 0., -4.9999804, 4.9999804]]]
_SEED_NOISE = dict(rtol=1e-4, atol=0)  # the reference's float32 PAV/Dykstra noise (<= 6.3e-5)


@pytest.mark.slow
def test_seed_readme_1d():
  values = jnp.array([-5.0, -2.0, 3.0, 1.0], jnp.float32)
  pav = compat.sparse_soft_topk_mag_pav(values, k=2, l=1e-2)
  dykstra = compat.sparse_soft_topk_mag_dykstra(values, k=2, l=1e-2)
  assert pav.dtype == dykstra.dtype == jnp.float32
  np.testing.assert_allclose(pav, [-5.000036, -0., 2.9999416, 0.], **_SEED_NOISE)
  np.testing.assert_allclose(dykstra, [-4.9999804, -0., 2.999993, 0.], **_SEED_NOISE)
  # exact values: the hard top-k in magnitude (float32 and float64)
  for dtype in (jnp.float32, jnp.float64):
    np.testing.assert_array_equal(compat.sparse_soft_topk_mag_pav(values.astype(dtype), k=2, l=1e-2),
                                  [-5, 0, 3, 0])
    np.testing.assert_array_equal(compat.sparse_soft_topk_mag_dykstra(values.astype(dtype), k=2, l=1e-2),
                                  [-5, 0, 3, 0])
  np.testing.assert_array_equal(compat.hard_topk_mag(values, k=2), [-5, 0, 3, 0])


@pytest.mark.slow
def test_seed_readme_batched():
  pav = compat.sparse_soft_topk_mag_pav(_SEED_VALUES, k=2, l=1e-2)
  assert pav.dtype == jnp.float32
  np.testing.assert_allclose(pav, _SEED_PAV, **_SEED_NOISE)
  fn = functools.partial(compat.sparse_soft_topk_mag_dykstra, k=2, num_iter=100, l=1e-2)
  dykstra = jax.vmap(jax.vmap(fn), in_axes=1, out_axes=1)(jnp.asarray(_SEED_VALUES, jnp.float32))
  np.testing.assert_allclose(dykstra, _SEED_DYKSTRA, **_SEED_NOISE)
  np.testing.assert_array_equal(fn(_SEED_VALUES), dykstra)  # batched without vmap
  # float64: the exact values, the hard top-k in magnitude (threshold: see the agreement tests)
  exact = np.asarray(itk.hard_topk_mag(jnp.asarray(_SEED_VALUES, jnp.float64), 2))
  values64 = jnp.asarray(_SEED_VALUES, jnp.float64)
  np.testing.assert_array_equal(compat.sparse_soft_topk_mag_pav(values64, k=2, l=1e-2), exact)
  np.testing.assert_array_equal(fn(values64), exact)


# -- against independent solvers --------------------------------------------------------


@pytest.mark.parametrize("p", PS_FAST)
def test_matches_slsqp_on_the_reference_isotonic_dual(p):
  """The library's threshold gives a feasible dual point at least as good as SLSQP's
  (so it is the optimum; SLSQP itself is only accurate to ~1e-3 in y for p < 2, where
  the dual is flat: |s - v|^q with q up to 4)."""
  x = _rows(1, (7,))
  for k in (2.0, 3.5):
    for l in (0.3, 2.0):
      expected, best, objective, order = _slsqp_dual(x, k, l, p)
      lam = float(_lam_fn(p)(jnp.asarray(x), jnp.asarray(k), jnp.asarray(l)))
      v = _dual_from_threshold(x, lam, l, p, order)
      assert np.all(np.diff(v) <= 1e-15 * np.max(v)), v
      assert objective(v) <= best + 1e-12 * (1 + abs(best)), (objective(v), best)
      for solver in SOLVERS:
        out = mag(x, k, l, p=p, solver=solver)
        np.testing.assert_allclose(out, expected, atol=2e-3, err_msg=f"{solver} k={k} l={l}")
        np.testing.assert_allclose(out, _from_dual(x, v, order, l, p), atol=1e-12)


@pytest.mark.slow
def test_p2_matches_numpy_weighted_pav_and_dykstra_agrees_at_tol():
  x = _rows(2, (6, 20))
  for k in (1.0, 4.0, 7.5):
    for l in (0.05, 0.5, 5.0):
      expected = np.stack([_numpy_pav_p2(row, k, l) for row in x])
      for solver in SOLVERS:
        np.testing.assert_allclose(mag(x, k, l, p=2.0, solver=solver), expected, atol=1e-12)
      dykstra = mag(x, k, l, p=2.0, solver="dykstra", tol=1e-9)
      np.testing.assert_allclose(dykstra, expected, atol=1e-5)


@pytest.mark.parametrize("p", PS_FAST)
def test_matches_brent_on_the_threshold_equation(p):
  x = _rows(3, (4, 12), ties=True)
  for k in (1.0, 3.0, 5.5):
    for l in (0.01, 0.4, 3.0):
      expected = np.stack([_threshold_output(r, _brent_threshold(r, k, l, p), l, p) for r in x])
      for solver in SOLVERS:
        np.testing.assert_allclose(mag(x, k, l, p=p, solver=solver), expected, atol=1e-9)


@pytest.mark.parametrize("p", PS_FAST)
@pytest.mark.parametrize("ties", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_pav_and_threshold_agree_to_1e_10(p, ties):
  x = _rows(4, (16, 40), ties=ties)
  for k in (1.0, 5.0, 12.5, 39.0):
    for l in (1e-3, 0.1, 10.0):
      np.testing.assert_allclose(mag(x, k, l, p=p, solver="pav"), mag(x, k, l, p=p, solver="threshold"),
                                 atol=1e-10, rtol=0, err_msg=f"k={k} l={l}")


# -- derivatives ------------------------------------------------------------------------


# Both solvers differentiate the same optimality function; they differ only in lam.
@pytest.mark.parametrize("solver,p", [("pav", 4 / 3)] + [
    pytest.param(*case, marks=pytest.mark.slow)
    for case in (("pav", 1.5), ("pav", 2.0), ("pav", 3.0), ("threshold", 4 / 3))])
def test_check_grads_fwd_and_rev(solver, p):
  x = jnp.asarray(_rows(5, (3, 9)))
  f = _fn(solver, p)
  for k, l in ((3.0, 0.5), (2.5, 0.3))[solver == "threshold":]:
    k, l = jnp.asarray(k), jnp.asarray(l)
    check_grads(lambda x: f(x, k, l), (x,), modes=("fwd", "rev"), eps=1e-6)
    check_grads(lambda l: f(x, k, l), (l,), modes=("fwd", "rev"), eps=1e-6)
  # k: only where the solution is not binary (there it is not differentiable in k)
  check_grads(lambda k: f(x, k, jnp.asarray(0.3)), (jnp.asarray(2.5),), modes=("fwd", "rev"), eps=1e-6)


@pytest.mark.slow
def test_dykstra_gradient_matches_exact():
  x = jnp.asarray(_rows(6, (3, 9)))
  f = lambda x, solver, **kw: jnp.sum(jnp.sin(itk.soft_topk_mag(x, 2.5, regularization_strength=0.3, p=2.0, solver=solver, **kw)))
  np.testing.assert_allclose(jax.grad(f)(x, "dykstra", tol=1e-10), jax.grad(f)(x, "pav"), atol=1e-6)


def test_kept_entries_have_unit_derivative_and_dropped_zero():
  x = jnp.array([4.0, -0.1, 3.0, 0.2, -5.0])
  jac = jax.jacobian(lambda x: itk.soft_topk_mag(x, 3, regularization_strength=1e-2))(x)
  np.testing.assert_array_equal(jac, np.diag([1.0, 0, 1, 0, 1]))


# Integer rows whose threshold is one of their magnitudes (proofs/snap_to_entry.md),
# F(lam) = sum_i min(lam, g((s_i - lam)_+ / l)) - k lam = 0 by hand: (row, k, l, p, lam).
# [0,-3,5,-6,-1,-2,-2,4,-2,-6,4,-1], p = 2: 1/2 + 3/2 + 2 + 1 + 2 + 1 = 8 = 4 * 2.
# [4,-4,-1,-1,4,0,-2,5], p = 2: 3 * 4/3 + 2 = 6 = 3 * 2. [6,-5,-5,-5,3,2,3,-2,1,2,5,2],
# p = 4/3 (g(u) = u^3): 1 + 4 + 2 + 4/8 = 15/2. [3,-4,2,-2,-1,-4], p = 3/2 (g(u) = u^2):
# 1 + 2 + 2/4 = 7/2. Before the snap each left 1e-16..1e-7 at a magnitude at lam under one
# of threshold, pav, the GPU kernel or the default.
MAGNITUDE_AT_THRESHOLD = [
    ([0, -3, 5, -6, -1, -2, -2, 4, -2, -6, 4, -1], 4.0, 2.0, 2.0, 2),
    ([4, -4, -1, -1, 4, 0, -2, 5], 3.0, 1.5, 2.0, 2),
    ([6, -5, -5, -5, 3, 2, 3, -2, 1, 2, 5, 2], 7.5, 2.0, 4.0 / 3.0, 1),
    ([3, -4, 2, -2, -1, -4], 3.5, 2.0, 1.5, 1),
]


@pytest.mark.parametrize("solver", ["auto", "threshold", "pallas", pytest.param("pav", marks=pytest.mark.slow)])
@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32])
def test_a_magnitude_at_the_threshold_gets_exactly_zero(solver, dtype):
  from fractions import Fraction
  for row, k, l, p, lam in MAGNITUDE_AT_THRESHOLD:
    a = round(1 / (p - 1))
    t = [max(Fraction(abs(v) - lam), 0) for v in row]
    assert sum(min(Fraction(lam), (u / Fraction(l)) ** a) for u in t) == Fraction(k) * lam
    want = np.array([float(np.sign(v) * min(abs(v), u + (u / Fraction(l)) ** a))
                     for v, u in zip(row, t)])
    y = np.asarray(itk.soft_topk_mag(jnp.asarray([row], dtype), k, regularization_strength=l,
                                     p=p, solver=solver), np.float64)[0]
    np.testing.assert_array_equal(y == 0, want == 0, err_msg=f"{row} {solver}")
    np.testing.assert_allclose(y, want, rtol=0, atol=1e-5 if dtype == jnp.float32 else 1e-13)


# -- properties (hypothesis, float64) ---------------------------------------------------

# magnitudes 0 or >= 1e-3: with |x_i| ~ 1e-277 the exact threshold (~|x_i|^3 for p = 4/3)
# is below the float64 range and "the" rounded answer is not well defined.
_ELEMENTS = st.one_of(st.just(0.0), st.floats(1e-3, 8), st.floats(-8, -1e-3), st.sampled_from([1.0, -1.0]))


@st.composite
def _problems(draw, n=6):
  x = np.asarray(draw(st.lists(_ELEMENTS, min_size=n, max_size=n)))
  k = draw(st.one_of(st.integers(1, n - 1).map(float), st.floats(0.05, n - 0.05)))
  l = draw(st.floats(0.01, 5.0))
  p = draw(st.sampled_from(PS))
  return x, k, l, p


@pytest.mark.slow
@_SETTINGS
@given(_problems())
def test_property_sign_symmetry_and_magnitude_bound(problem):
  x, k, l, p = problem
  out = mag(x, k, l, p=p, solver="pav")
  np.testing.assert_array_equal(mag(-x, k, l, p=p, solver="pav"), -out)
  assert np.all(np.abs(out) <= np.abs(x))
  assert np.all(out * x >= 0)
  # the support is an upper set of |x|
  support = out != 0
  if support.any():
    assert np.all(np.abs(x)[~support] <= np.abs(x)[support].min())


@pytest.mark.slow
@_SETTINGS
@given(_problems())
def test_property_exact_zeros_exact_kept_and_constraint(problem):
  x, k, l, p = problem
  lam = float(_lam_fn(p)(jnp.asarray(x), jnp.asarray(k), jnp.asarray(l)))
  out = mag(x, k, l, p=p, solver="threshold")
  s = np.abs(x)
  assert np.all(out[s <= lam] == 0)  # exact zeros outside the selected set
  assert np.all(out[s > lam] != 0)
  kept = s >= (lam + l * lam ** (p - 1)) * (1 + 1e-9)  # clearly kept: exactly x
  np.testing.assert_array_equal(out[kept], x[kept])
  if np.sum(s > 0) > k:
    g = (np.maximum(s - lam, 0) / l) ** (1 / (p - 1))
    np.testing.assert_allclose(np.sum(np.minimum(1, g / lam)), k, atol=1e-8)
  else:
    np.testing.assert_array_equal(out, x)


@pytest.mark.slow
@_SETTINGS
@given(st.lists(st.floats(0.1, 8), min_size=6, max_size=6, unique=True),
       st.integers(1, 5), st.sampled_from(PS), st.randoms())
def test_property_converges_to_hard_topk_mag_as_l_goes_to_0(mags, k, p, rnd):
  s = np.sort(np.asarray(mags))[::-1]
  signs = np.array([rnd.choice([-1.0, 1.0]) for _ in s])
  x = signs * np.asarray(mags)
  hard = np.asarray(itk.hard_topk_mag(jnp.asarray(x), k))
  gap = s[k - 1] - s[k]
  # exactly hard once l s_(k+1)^(p-1) < gap (h(s_(k+1)) < s_(k)): limits of the threshold form
  l_exact = 0.5 * gap / s[k] ** (p - 1)
  np.testing.assert_array_equal(mag(x, float(k), l_exact, p=p, solver="pav"), hard)
  np.testing.assert_array_equal(mag(x, float(k), l_exact, p=p, solver="threshold"), hard)


# -- special inputs, errors, dtypes, transformations ---------------------------------------


@pytest.mark.parametrize("solver", SOLVERS)
def test_special_rows(solver):
  x = np.array([[0.0, 0.0, 3.0, -1.0],      # at most k nonzeros: unchanged
                [np.nan, 1.0, 2.0, 3.0],    # NaN row
                [np.inf, -2.0, 1.0, 0.5],   # an infinite magnitude is kept
                [np.inf, -np.inf, 1.0, 2.0]])  # k used up by infinities: the rest is 0
  out = mag(x, 2.0, 0.1, p=4 / 3, solver=solver)
  np.testing.assert_array_equal(out[0], x[0])
  assert np.all(np.isnan(out[1]))
  assert out[2, 0] == np.inf and out[2, 1] < 0 and out[2, 3] == 0
  np.testing.assert_array_equal(out[3], [np.inf, -np.inf, 0, 0])


def test_errors():
  x = jnp.ones(5)
  with pytest.raises(TypeError, match="floating"):
    itk.soft_topk_mag(jnp.arange(5), 2)
  with pytest.raises(ValueError, match="0 <= k <= n with n=5"):
    itk.soft_topk_mag(x, 5.5)
  with pytest.raises(ValueError, match="0 <= k <= n"):
    itk.soft_topk_mag(x, -1)
  with pytest.raises(ValueError, match="`regularization_strength`"):
    itk.soft_topk_mag(x, 2, regularization_strength=0.0)
  with pytest.raises(ValueError, match="`p`"):
    itk.soft_topk_mag(x, 2, p=1.0)
  with pytest.raises(ValueError, match="axis"):
    itk.soft_topk_mag(x, 2, axis=1)
  with pytest.raises(ValueError, match="solver"):
    itk.soft_topk_mag(x, 2, solver="sort")
  with pytest.raises(ValueError, match="p=2"):
    itk.soft_topk_mag(x, 2, solver="dykstra")
  with pytest.raises(ValueError, match="tol"):
    itk.soft_topk_mag(x, 2, solver="pav", tol=1e-3)
  with pytest.raises(ValueError, match="num_iter"):
    compat.sparse_soft_topk_mag_dykstra(x, 2, num_iter=1)


@pytest.mark.slow
@pytest.mark.parametrize("solver", SOLVERS)
def test_dtypes_axis_jit_vmap(solver):
  x = _rows(7, (3, 5, 8))
  ref = mag(x, 2.5, 0.2, p=4 / 3, solver=solver)
  for dtype, atol in ((jnp.float32, 1e-4), (jnp.bfloat16, 1e-1)):
    out = itk.soft_topk_mag(jnp.asarray(x, dtype), 2.5, regularization_strength=0.2, solver=solver)
    assert out.dtype == dtype
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, atol=atol)
  moved = itk.soft_topk_mag(jnp.asarray(np.moveaxis(x, -1, 1)), 2.5, regularization_strength=0.2, axis=1, solver=solver)
  np.testing.assert_allclose(np.moveaxis(np.asarray(moved), 1, -1), ref, atol=1e-12)
  # vmap, with per-row k
  k = jnp.asarray([[1.0], [2.5], [4.0]]) * jnp.ones((3, 5))
  f = lambda r, k: itk.soft_topk_mag(r, k, regularization_strength=0.2, solver=solver)
  out = jax.jit(jax.vmap(f))(jnp.asarray(x), k)
  np.testing.assert_allclose(out[1], ref[1], atol=1e-12)
  np.testing.assert_allclose(out, itk.soft_topk_mag(jnp.asarray(x), k, regularization_strength=0.2, solver=solver), atol=1e-12)


def test_no_n_by_n_intermediate():
  n = 257
  x = jnp.ones((2, n))

  def loss(x):
    return jnp.sum(itk.soft_topk_mag(x, 3.5, regularization_strength=0.1, solver="threshold") ** 2)

  for fn in (loss, jax.grad(loss)):
    jaxpr = jax.make_jaxpr(fn)(x)
    shapes = []

    def visit(jaxpr):
      for eqn in jaxpr.eqns:
        shapes.extend(tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape"))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
          visit(sub)

    visit(jaxpr.jaxpr)
    assert shapes and all(np.prod(shape) <= 2 * n for shape in shapes), max(shapes, key=np.prod)


@pytest.mark.slow
def test_jaxopt_backend_gives_the_same_gradient():
  x = jnp.asarray(_rows(8, (2, 7)))
  f = lambda x, backend: jnp.sum(jnp.sin(itk.soft_topk_mag(x, 2.5, regularization_strength=0.3, implicit_diff_backend=backend)))
  np.testing.assert_allclose(jax.grad(f)(x, "jaxopt"), jax.grad(f)(x, "lax"), atol=1e-14)
