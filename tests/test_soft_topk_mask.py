"""soft_topk_mask against independent solvers, its derivatives, errors and non-finite inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxopt import Bisection
from jaxopt.projection import projection_box_section
from scipy import optimize

import implicit_topk as itk
from gradcheck import check_grads

# One worker runs this module (pyproject: --dist loadgroup): its tests share compiled
# functions, which a second worker would compile again.
pytestmark = pytest.mark.xdist_group("test_soft_topk_mask")

SOLVERS = ["pav", "threshold"]
PS = [4 / 3, 1.5, 2.0, 3.0]


def _slow(*values):
  """Parameter values that run in the slow group (`pytest -m slow`) only."""
  return [pytest.param(v, marks=pytest.mark.slow) for v in values]


def _random_rows(seed, shape, ties=False):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=shape)
  if ties:  # integers: many exact ties and duplicates
    x = np.round(3 * x)
  return jnp.asarray(x, jnp.float64)


def _slsqp_mask(x, k, l, p):
  """Independent primal solve: maximize <x,y> - (l/p) sum y^p on the capped simplex."""
  n = x.shape[0]
  obj = lambda y: -(x @ y) + l / p * np.sum(np.abs(y) ** p)
  jac = lambda y: -x + l * np.sign(y) * np.abs(y) ** (p - 1)
  res = optimize.minimize(
      obj, np.full(n, k / n), jac=jac, method="SLSQP", bounds=[(0, 1)] * n,
      constraints=[{"type": "eq", "fun": lambda y: y.sum() - k, "jac": lambda y: np.ones(n)}],
      options={"ftol": 1e-14, "maxiter": 1000})
  assert res.success, res.message
  return res.x


def _exact_capped_simplex_projection(v, k):
  """Euclidean projection of v onto {0 <= y <= 1, sum y = k} by enumerating breakpoints.

  y = clip(v - tau, 0, 1) and phi(tau) = sum y - k is piecewise linear with kinks at
  v_i and v_i - 1: find the bracketing pair of kinks and interpolate (exact).
  """
  phi = lambda tau: np.clip(v - tau, 0, 1).sum() - k
  kinks = np.unique(np.concatenate([v, v - 1]))
  values = np.array([phi(t) for t in kinks])
  j = np.flatnonzero(values <= 0)[0]
  if values[j] == 0:
    tau = kinks[j]
  else:
    t0, t1, f0, f1 = kinks[j - 1], kinks[j], values[j - 1], values[j]
    tau = t0 + f0 * (t1 - t0) / (f0 - f1)
  return np.clip(v - tau, 0, 1)


@pytest.mark.parametrize("solver", [*_slow("pav"), "threshold"])
@pytest.mark.parametrize("k", [1.0, 3.0, 2.5])
def test_p2_is_the_euclidean_projection_of_x_over_l(solver, k):
  x = _random_rows(0, (5, 12))
  n = x.shape[-1]
  for l in (0.05, 1.0):
    y = itk.soft_topk_mask(x, k, regularization_strength=l, p=2.0, solver=solver)
    exact = np.stack([_exact_capped_simplex_projection(np.asarray(r) / l, k) for r in x])
    np.testing.assert_allclose(y, exact, atol=1e-12)
  # jaxopt's projection_box_section finds its threshold by jaxopt.Bisection with the
  # default tol (1e-5 on the residual), which it does not expose: it is a reference to
  # ~5e-6 only (measured 3.4e-6 here). The same jaxopt bisection run to tol=1e-12 is a
  # reference to 1e-10.
  l = 1.0
  y = itk.soft_topk_mask(x, k, regularization_strength=l, p=2.0, solver=solver)
  hyper = (jnp.zeros(n), jnp.ones(n), jnp.ones(n), jnp.asarray(k, jnp.float64))
  default = jax.vmap(lambda r: projection_box_section(r / l, hyper))(x)
  np.testing.assert_allclose(y, default, atol=1e-5)
  residual = lambda tau, v: jnp.sum(jnp.clip(v - tau, 0, 1)) - k
  def tight(v):
    bisection = Bisection(residual, lower=jnp.min(v) - 1, upper=jnp.max(v), tol=1e-12,
                          maxiter=200, check_bracket=False)
    return jnp.clip(v - bisection.run(v=v).params, 0, 1)
  np.testing.assert_allclose(y, jax.vmap(tight)(x / l), atol=1e-10)


@pytest.mark.parametrize("p", [4 / 3, *_slow(1.5, 3.0)])
@pytest.mark.parametrize("k", [2.0, 3.7])
def test_matches_scipy_slsqp_on_small_problems(p, k):
  x = np.asarray(_random_rows(1, (8,)))
  for l in (0.3, 2.0):
    expected = _slsqp_mask(x, k, l, p)
    for solver in SOLVERS:
      y = itk.soft_topk_mask(jnp.asarray(x), k, regularization_strength=l, p=p, solver=solver)
      np.testing.assert_allclose(y, expected, atol=2e-5)


@pytest.mark.parametrize("p", PS[:1] + _slow(*PS[1:]))
@pytest.mark.parametrize("ties", [False, True])
def test_pav_and_threshold_agree_to_1e_10(p, ties):
  x = _random_rows(2, (16, 50), ties=ties)
  mask = jax.jit(itk.soft_topk_mask, static_argnames=("p", "solver"))
  for k in (1.0, 5.0, 12.5, 49.0):
    for l in (1e-3, 0.1, 10.0):
      y_pav = mask(x, k, regularization_strength=l, p=p, solver="pav")
      y_thr = mask(x, k, regularization_strength=l, p=p, solver="threshold")
      np.testing.assert_allclose(y_pav, y_thr, atol=1e-10, err_msg=f"k={k} l={l}")
      np.testing.assert_allclose(jnp.sum(y_pav, -1), k, atol=1e-10)


def test_solution_is_exactly_sparse_and_exactly_one_at_the_top():
  x = jnp.array([-5.0, -2.0, 3.0, 1.0], jnp.float64)
  for solver in SOLVERS:
    y = itk.soft_topk_mask(x, 2, regularization_strength=1e-2, solver=solver)
    assert np.array_equal(np.asarray(y), [0.0, 0.0, 1.0, 1.0])


# Integer rows whose threshold is one of their entries (proofs/snap_to_entry.md), exact
# rational arithmetic by hand: (row, k, l, p, threshold). [1,-4,2,0,0,1,2,-3], lam = 0,
# p = 2: 1/4 + 2/4 + 1/4 + 2/4 = 3/2. [0,1,-4,0,0,0,-2,-1], lam = -1, p = 4/3 (a = 3):
# four zeros at (1/2)^3, the 1 at 1: 3/2. [3,-2,-2,-2,0,1,3,0,-4,-2,4,2,-2,-1,0,-4],
# lam = 1, p = 3/2 (a = 2): 2 (2/3)^2 + 1 + (1/3)^2 = 2. Before the snap, `threshold`
# (and the fused GPU kernel, the same iteration) left 1e-17..1e-8 at the entries at lam.
ENTRY_AT_THRESHOLD = [
    ([1, -4, 2, 0, 0, 1, 2, -3], 1.5, 4.0, 2.0, 0),
    ([0, 1, -4, 0, 0, 0, -2, -1], 1.5, 2.0, 4.0 / 3.0, -1),
    ([3, -2, -2, -2, 0, 1, 3, 0, -4, -2, 4, 2, -2, -1, 0, -4], 2.0, 3.0, 1.5, 1),
]


@pytest.mark.parametrize("solver", ["threshold", "pallas", *_slow("pav")])
@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32])
def test_an_entry_at_the_threshold_gets_exactly_zero(solver, dtype):
  from fractions import Fraction
  for row, k, l, p, lam in ENTRY_AT_THRESHOLD:
    a = round(1 / (p - 1))
    exact = [min(max(Fraction(v - lam) / Fraction(l), 0), 1) ** a for v in row]
    assert sum(exact) == Fraction(k)  # the threshold is the entry lam
    want = np.array([float(v) for v in exact])
    y = np.asarray(itk.soft_topk_mask(jnp.asarray([row], dtype), k, regularization_strength=l,
                                      p=p, solver=solver), np.float64)[0]
    np.testing.assert_array_equal(y == 0, want == 0, err_msg=f"{row} {solver}")
    np.testing.assert_allclose(y, want, rtol=0, atol=1e-6 if dtype == jnp.float32 else 1e-14)
  # the first row twice, as two segments of one flat axis (the segments' layout)
  flat = np.concatenate([np.asarray(r, float) for r, *_ in ENTRY_AT_THRESHOLD[:1] * 2])
  ids = np.repeat([0, 1], 8)
  y = itk.segment_soft_topk_mask(jnp.asarray(flat, dtype), jnp.asarray(ids), 1.5,
                                 num_segments=2, regularization_strength=4.0, p=2.0)
  assert np.array_equal(np.asarray(y) > 0, np.tile(np.asarray(ENTRY_AT_THRESHOLD[0][0]) > 0, 2))


# -- derivatives ------------------------------------------------------------------


@pytest.mark.parametrize("solver", SOLVERS)
@pytest.mark.parametrize("p", [4 / 3, *_slow(2.0, 3.0)])
def test_check_grads_fwd_and_rev(solver, p):
  x = _random_rows(3, (3, 9))
  w = _random_rows(4, (3, 9))
  f = lambda x: itk.soft_topk_mask(x, 3.5, regularization_strength=0.7, p=p, solver=solver) * w
  check_grads(f, (x,), modes=("fwd", "rev"), atol=1e-6, rtol=1e-6, eps=1e-6)


@pytest.mark.slow
def test_jaxopt_backend_reverse_mode_matches_lax_backend():
  x = _random_rows(5, (4, 20))
  w = _random_rows(6, (4, 20))
  grads = []
  for backend in ("lax", "jaxopt"):
    f = lambda x: jnp.sum(w * itk.soft_topk_mask(x, 4.0, regularization_strength=0.5, implicit_diff_backend=backend))
    check_grads(f, (x,), modes=("rev",), atol=1e-6, rtol=1e-6, eps=1e-6)
    grads.append(jax.grad(f)(x))
  np.testing.assert_allclose(grads[0], grads[1], atol=1e-12)


@pytest.mark.parametrize("solver", [*_slow("pav"), "threshold"])
@pytest.mark.parametrize("argument", ["k", "l"])
def test_gradients_wrt_k_and_l_match_finite_differences(solver, argument):
  x = _random_rows(7, (2, 15))
  w = _random_rows(8, (2, 15))
  base = {"k": 4.3, "l": 0.6}

  def f(value):
    kwargs = dict(base, **{argument: value})
    return jnp.sum(w * itk.soft_topk_mask(x, kwargs["k"], regularization_strength=kwargs["l"], solver=solver))

  value, h = base[argument], 1e-6
  fd = (f(value + h) - f(value - h)) / (2 * h)
  np.testing.assert_allclose(jax.grad(f)(value), fd, rtol=1e-6, atol=1e-9)
  np.testing.assert_allclose(jax.jvp(f, (value,), (1.0,))[1], fd, rtol=1e-6, atol=1e-9)


def test_gradient_is_zero_where_every_coordinate_is_saturated():
  x = jnp.array([5.0, 4.0, 0.0, -1.0], jnp.float64)
  g = jax.jacrev(lambda x: itk.soft_topk_mask(x, 2, regularization_strength=0.1))(x)
  assert np.array_equal(np.asarray(g), np.zeros((4, 4)))


@pytest.mark.parametrize("solver", [*_slow("pav"), "threshold"])
def test_k_derivative_at_a_binary_solution_is_the_documented_zero(solver):
  """Binary solution (integer k, gap > l): y is not differentiable in k there.

  The one-sided derivatives are e_(k+1) (raising k lifts the (k+1)-th largest entry)
  and e_(k) (lowering k lowers the k-th largest); we document and return 0.
  """
  x = jnp.array([3.0, -1.0, 1.0, -3.0], jnp.float64)
  f = lambda k: itk.soft_topk_mask(x, k, regularization_strength=0.1, solver=solver)
  h = 1e-4
  right = (f(2.0 + h) - f(2.0)) / h
  left = (f(2.0) - f(2.0 - h)) / h
  np.testing.assert_allclose(right, [0.0, 1.0, 0.0, 0.0], atol=1e-6)  # -1 is 3rd largest
  np.testing.assert_allclose(left, [0.0, 0.0, 1.0, 0.0], atol=1e-6)   # 1 is 2nd largest
  assert np.array_equal(np.asarray(jax.jacfwd(f)(2.0)), np.zeros(4))
  assert np.array_equal(np.asarray(jax.jacrev(f)(2.0)), np.zeros(4))


@pytest.mark.slow
def test_unrolled_threshold_gradient_converges_to_the_implicit_one():
  x = _random_rows(9, (2, 12))
  w = _random_rows(10, (2, 12))
  implicit = itk.ThresholdSolver()
  unrolled = itk.ThresholdSolver(implicit_diff=False, maxiter=60)
  g = [jax.grad(lambda x: jnp.sum(w * s.mask(x, 3.0, 0.5)))(x) for s in (implicit, unrolled)]
  np.testing.assert_allclose(g[0], g[1], atol=1e-8)


# -- solver objects ------------------------------------------------------------------


@pytest.mark.slow
def test_solver_objects_report_state_and_optimality():
  x = _random_rows(11, (6, 40))
  for solver in (itk.ThresholdSolver(), itk.PAVSolver()):
    step = solver.run(None, x, 7.0, 0.2)
    assert step.params.shape == (6,)
    assert step.state.iter_num.shape == (6,) and step.state.residual.shape == (6,)
    assert float(jnp.max(step.state.residual)) < 1e-10
    np.testing.assert_allclose(solver.optimality_fun(step.params, x, 7.0, 0.2), 0, atol=1e-10)
  assert int(jnp.max(itk.ThresholdSolver().run(None, x, 7.0, 0.2).state.iter_num)) > 0


@pytest.mark.slow
def test_threshold_solver_accepts_a_warm_start():
  x = _random_rows(12, (3, 30))
  solver = itk.ThresholdSolver()
  cold = solver.run(None, x, 5.0, 0.3)
  warm = solver.run(cold.params, x, 5.0, 0.3)
  np.testing.assert_allclose(warm.params, cold.params, atol=1e-12)
  assert int(jnp.max(warm.state.iter_num)) <= 2


# -- errors ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(k=4.5), ValueError, "0 <= k <= n with n=4"),
        (dict(k=5), ValueError, "0 <= k <= n"),
        (dict(k=-1.5), ValueError, "0 <= k <= n"),
        (dict(k=2, regularization_strength=0.0), ValueError,
         "`regularization_strength` must be finite and > 0"),
        (dict(k=2, regularization_strength=-1.0), ValueError, "`regularization_strength`"),
        (dict(k=2, p=1.0), ValueError, "1 < p"),
        (dict(k=2, p=0.5), ValueError, "1 < p"),
        (dict(k=2, axis=1), ValueError, "-1 <= axis < 1"),
        (dict(k=2, solver="bogus"), ValueError, "`solver` must be one of"),
        (dict(k=2, implicit_diff_backend="bogus"), ValueError, "implicit_diff_backend"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs, error, match):
  x = jnp.array([1.0, 2.0, 3.0, 4.0])
  k = kwargs.pop("k")
  with pytest.raises(error, match=match):
    itk.soft_topk_mask(x, k, **kwargs)


def test_integer_input_is_rejected_with_a_hint():
  with pytest.raises(TypeError, match="floating dtype"):
    itk.soft_topk_mask(jnp.array([1, 2, 3]), 1)


def test_scalar_input_is_rejected():
  with pytest.raises(ValueError, match="at least one dimension"):
    itk.soft_topk_mask(jnp.array(1.0), 1)


# -- non-finite inputs -------------------------------------------------------------------


@pytest.mark.parametrize("solver", SOLVERS)
def test_nan_gives_a_nan_row_and_leaves_other_rows_alone(solver):
  x = jnp.array([[1.0, jnp.nan, 3.0, 0.0], [1.0, 2.0, 3.0, 0.0]], jnp.float64)
  y = itk.soft_topk_mask(x, 2, regularization_strength=0.1, solver=solver)
  assert np.all(np.isnan(y[0]))
  np.testing.assert_allclose(y[1], itk.soft_topk_mask(x[1], 2, regularization_strength=0.1, solver=solver))


@pytest.mark.parametrize("solver", SOLVERS)
def test_infinities(solver):
  inf = jnp.inf
  x = jnp.array([
      [inf, 0.3, 0.2, -inf, 0.1],   # +inf takes 1, finite share k - 1
      [inf, inf, 0.0, 1.0, -inf],   # k == #(+inf): finite all 0
      [inf, inf, inf, 0.0, 1.0],    # #(+inf) > k: no threshold
      [-inf, -inf, -inf, -inf, 1.0],  # only one entry > -inf < k: no threshold
  ], jnp.float64)
  y = np.asarray(itk.soft_topk_mask(x, 2, regularization_strength=1.0, p=2.0, solver=solver))
  # finite part of row 0: y = clip(x - lam, 0, 1) over {0.3, 0.2, 0.1} summing to 1
  np.testing.assert_allclose(y[0, [0, 3]], [1.0, 0.0])
  np.testing.assert_allclose(y[0].sum(), 2.0, atol=1e-12)
  assert np.all(y[0, 1:3] > 0) and y[0, 1] > y[0, 2]
  np.testing.assert_array_equal(y[1], [1.0, 1.0, 0.0, 0.0, 0.0])
  assert np.all(np.isnan(y[2])) and np.all(np.isnan(y[3]))


def test_gradient_is_finite_with_infinite_entries():
  x = jnp.array([jnp.inf, 0.3, 0.2, -jnp.inf, 0.1], jnp.float64)
  g = jax.grad(lambda x: jnp.sum(itk.soft_topk_mask(x, 2, regularization_strength=1.0, p=2.0) * jnp.arange(5.0)))(x)
  assert np.all(np.isfinite(g))
  assert g[0] == 0 and g[3] == 0


def test_bfloat16_k_and_strength_arrays_are_taken():
  """A concrete bfloat16 ``k`` or strength was a TypeError ("must be a real number"): NumPy
  does not count bfloat16 as a number. Same result as the float32 values."""
  x = jnp.asarray([0.3, -1.0, 2.0, 0.5], jnp.bfloat16)
  expected = itk.soft_topk_mask(x, 1.5, regularization_strength=1.0)
  np.testing.assert_array_equal(itk.soft_topk_mask(x, jnp.asarray(1.5, jnp.bfloat16)), expected)
  np.testing.assert_array_equal(
      itk.soft_topk_mask(x, 1.5, regularization_strength=jnp.asarray(1.0, jnp.bfloat16)), expected)
  np.testing.assert_array_equal(
      itk.soft_sort(x, regularization_strength=jnp.asarray(1.0, jnp.bfloat16)),
      itk.soft_sort(x, regularization_strength=1.0))
  with pytest.raises(TypeError, match="`k` must be a real number"):
    itk.soft_topk_mask(x, jnp.asarray(1 + 2j))


SOLVER_OBJECTS = {"threshold": itk.ThresholdSolver, "native": itk.NativeSolver,
                  "pav": itk.PAVSolver,
                  "dykstra": lambda: itk.DykstraSolver(regularizer=itk.PNorm(2.0))}


@pytest.mark.parametrize("name", sorted(SOLVER_OBJECTS))
def test_solver_objects_check_the_strength(name):
  # (a strength of -1 gave a mask of ones, summing to n, and 0 the hard mask)
  solver = SOLVER_OBJECTS[name]()
  x = jnp.array([3.0, 1.0, 2.0, -1.0])
  for l in (-1.0, 0.0, np.inf):
    with pytest.raises(ValueError, match="`l` must"):
      solver.apply(x, 2.0, l)
    with pytest.raises(ValueError, match="`l` must"):
      solver.run(None, x, 2.0, l)
  for l in (-1.0, 0.0, 1e-320):  # traced: NaN rows
    assert np.all(np.isnan(np.asarray(jax.jit(lambda l_: solver.apply(x, 2.0, l_))(l))))
    assert np.isnan(float(jax.jit(lambda l_: solver.run(None, x, 2.0, l_).params)(l)))
  np.testing.assert_allclose(np.asarray(jax.jit(lambda l_: solver.apply(x, 2.0, l_))(0.5)),
                             [1.0, 0.0, 1.0, 0.0], atol=1e-6)
