"""Issue 15's reproducers, the k rule, traced-argument behaviour, errors that name the
argument, and every operator under shard_map / jax.export (``transforms_check.py``).

Expected values are exact solutions derived by hand in the comments (the mask is
``clip(((x - lam) / l) ** (1 / (p - 1)), 0, 1)`` with ``sum = k``), never the library's
output.
"""

import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import device_checks
import implicit_topk as itk

INF = float("inf")
SCRIPT = pathlib.Path(__file__).with_name("transforms_check.py")
MASK_SOLVERS = ["auto", "threshold", "pav"]


# -- F2: p = 10, tiny k: the root sits 1e-27 below the top entry ----------------------
@pytest.mark.parametrize("solver", MASK_SOLVERS)
def test_large_p_with_tiny_k_is_exact(solver):
  # One entry active: y_0 = (0 - lam)^(1/9) = 1e-3  =>  lam = -1e-27; y_1 = 0.
  y, info = itk.soft_topk_mask(jnp.array([0.0, -1.0], jnp.float64), 1e-3, regularization_strength=1.0, p=10.0,
                               solver=solver, return_info=True)
  np.testing.assert_allclose(np.asarray(y), [1e-3, 0.0], rtol=1e-12, atol=0)
  assert float(info.residual) <= 1e-15


# -- F3: shift invariance far beyond l / eps --------------------------------------------
@pytest.mark.parametrize("solver", ["auto", "threshold", pytest.param("pav", marks=pytest.mark.slow), "dykstra"])
def test_mask_is_shift_invariant_at_huge_offsets(solver):
  p = 2.0 if solver == "dykstra" else 4.0 / 3.0
  # x - 1e20 = (0, 0, -1e20, -1e20 + 1): two tied entries share k = 1.5 -> 0.75 each.
  y = itk.soft_topk_mask(jnp.array([1e20, 1e20, 0.0, 1.0], jnp.float64), 1.5, regularization_strength=1.0, p=p,
                         solver=solver)
  np.testing.assert_allclose(np.asarray(y), [0.75, 0.75, 0.0, 0.0], rtol=1e-12, atol=0)


@pytest.mark.parametrize("solver", MASK_SOLVERS)
@pytest.mark.parametrize("top", [1e30, -1e30, 1e300, 3e38])
def test_single_huge_entry_gets_k(solver, top):
  y = itk.soft_topk_mask(jnp.array([top], jnp.float64), 0.5, regularization_strength=1.0, solver=solver)
  np.testing.assert_allclose(np.asarray(y), [0.5], rtol=1e-12)


def test_shift_keeps_small_offsets_exact_in_float32():
  # Top entry 5 far from the threshold (-l / 2^(1/3) for the two zeros sharing k - 1):
  # the unshifted coordinates resolve it to a few ulps.
  x = jnp.array([0.0, 0.0, -5.0, 5.0], jnp.float32)
  y = itk.soft_topk_mask(x, 2, regularization_strength=1e-2)
  np.testing.assert_allclose(np.asarray(y), [0.5, 0.5, 0.0, 1.0], rtol=0, atol=4 * 2.0**-24)


def test_beyond_float_resolution_is_reported_by_return_info():
  # The fractional entry is 2e308 below the top: no float threshold resolves it at l = 1.
  y, info = itk.soft_topk_mask(jnp.array([1e308, -1e308], jnp.float64), 1.5, regularization_strength=1.0,
                               return_info=True)
  assert float(info.residual) > 0.1
  assert np.all(np.isfinite(np.asarray(y)))


# -- F4: non-saturating regularizers at the "exactly k" non-finite boundary -------------
@pytest.mark.parametrize("regularizer, x, k, expected", [
    ("entropy", [INF, INF, 1.0, 2.0], 2.0, [1, 1, 0, 0]),
    ("sigmoid", [INF, -INF, 0.0], 1.0, [1, 0, 0]),
    ("laplace", [-INF, -INF, 1.0, 2.0], 2.0, [0, 0, 1, 1]),
    ("sigmoid", [-INF, 3.0, 4.0], 2.0, [0, 1, 1]),
    ("entropy", [INF, 3.0, 4.0], 1.0, [1, 0, 0]),
])
def test_non_saturating_regularizers_take_their_limit(regularizer, x, k, expected):
  x = jnp.array(x, jnp.float64)
  y = itk.soft_topk_mask(x, k, regularization_strength=0.5, regularizer=regularizer)
  np.testing.assert_array_equal(np.asarray(y), expected)
  g = jax.grad(lambda z: jnp.sum(itk.soft_topk_mask(z, k, regularization_strength=0.5, regularizer=regularizer)
                                 * jnp.arange(z.size)))(x)
  assert np.all(np.isfinite(np.asarray(g)))
  finite = np.isfinite(np.asarray(x))
  np.testing.assert_array_equal(np.asarray(g)[finite], 0.0)  # locally constant


# -- one k rule: 0 <= k <= n ------------------------------------------------------------
X = jnp.array([[0.3, -1.0, 2.0, 0.5], [1.0, 1.0, 1.0, 1.0]], jnp.float64)


_SLOW = pytest.mark.slow


@pytest.mark.parametrize("solver, regularizer", [
    ("threshold", None), ("pav", "entropy"), pytest.param("pav", None, marks=_SLOW),
    pytest.param("dykstra", "p2", marks=_SLOW), pytest.param("threshold", "entropy", marks=_SLOW),
    pytest.param("threshold", "sigmoid", marks=_SLOW), pytest.param("threshold", "laplace", marks=_SLOW)])
@pytest.mark.parametrize("k", [0, 4.0])
def test_mask_k_rule(solver, regularizer, k):
  kwargs = dict(p=2.0) if regularizer == "p2" else dict(regularizer=regularizer)
  y = itk.soft_topk_mask(X, k, regularization_strength=0.5, solver=solver, **kwargs)
  np.testing.assert_array_equal(np.asarray(y), np.full(X.shape, 1.0 if k else 0.0))
  g = jax.grad(lambda z: jnp.sum(itk.soft_topk_mask(z, k, regularization_strength=0.5, solver=solver, **kwargs)
                                 * jnp.arange(4.0)))(X)
  np.testing.assert_array_equal(np.asarray(g), 0.0)


@pytest.mark.parametrize("solver", ["threshold", "pav"])
def test_magnitude_k_rule(solver):
  np.testing.assert_array_equal(np.asarray(itk.soft_topk_mag(X, 4, regularization_strength=0.5, solver=solver)), X)
  np.testing.assert_array_equal(np.abs(np.asarray(itk.soft_topk_mag(X, 0, regularization_strength=0.5, solver=solver))), 0)
  g = jax.grad(lambda z: jnp.sum(itk.soft_topk_mag(z, 4, regularization_strength=0.5, solver=solver) * jnp.arange(4.0)))(X)
  np.testing.assert_array_equal(np.asarray(g), np.broadcast_to(np.arange(4.0), X.shape))


def test_other_operators_follow_the_k_rule():
  ones, zeros = np.ones(X.shape), np.zeros(X.shape)
  for op in (itk.hard_topk_mask, lambda x, k: itk.grad_topk(x, k, regularization_strength=0.5)):
    np.testing.assert_array_equal(np.asarray(op(X, 4)), ones)
    np.testing.assert_array_equal(np.asarray(op(X, 0)), zeros)
  np.testing.assert_array_equal(np.asarray(itk.hard_topk_mag(X, 4)), X)
  # sparse_softmax is a distribution: k = n is plain sparsemax, k = 0 is refused.
  np.testing.assert_allclose(np.asarray(itk.sparse_softmax(X, 4)).sum(-1), 1.0)
  with pytest.raises(ValueError, match="0 < k <= n"):
    itk.sparse_softmax(X, 0)


# -- traced arguments are not checked: documented NaN, never a wrong mask ---------------
def test_traced_bad_l_or_k_give_nan():
  x = jnp.linspace(-1.0, 1.0, 7)
  for l in (-1.0, 0.0):
    assert np.all(np.isnan(np.asarray(jax.jit(lambda l: itk.soft_topk_mask(x, 2.5, regularization_strength=l))(l))))
  for k in (-0.5, 7.5):
    assert np.all(np.isnan(np.asarray(jax.jit(lambda k: itk.soft_topk_mask(x, k, regularization_strength=0.1))(k))))


TRACED_K_OPERATORS = {
    "mask": lambda x, k, s: itk.soft_topk_mask(x, k, solver=s),
    "magnitude": lambda x, k, s: itk.soft_topk_mag(x, k, solver=s),
    "magnitude_p2": lambda x, k, s: itk.soft_topk_mag(x, k, solver=s, p=2.0),
    "tree_magnitude": lambda x, k, s: itk.tree_soft_topk_mag({"a": x}, k)["a"],
}


@pytest.mark.parametrize("solver", ["auto", "threshold", "pav"])
@pytest.mark.parametrize("name", sorted(TRACED_K_OPERATORS))
def test_traced_k_above_the_row_length_gives_nan(name, solver):
  # (the magnitude operators returned x, the answer for k = n, with the CPU kernel)
  x = jnp.array([[3.0, 1.0, 2.0, -1.0], [0.5, 0.2, -0.3, 1.0]])
  n = x.size if name.startswith("tree") else x.shape[-1]
  f = jax.jit(lambda k: TRACED_K_OPERATORS[name](x, k, solver))
  for k in (n + 0.5, -0.5):
    assert np.all(np.isnan(np.asarray(f(k)))), (name, solver, k)
  np.testing.assert_allclose(np.asarray(f(float(n))), np.asarray(TRACED_K_OPERATORS[name](x, float(n), solver)))


TRACED_STRENGTH_OPERATORS = {
    "mask": lambda x, l, s: itk.soft_topk_mask(x, 2.5, regularization_strength=l, solver=s),
    "mask_entropy": lambda x, l, s: itk.soft_topk_mask(x, 2.5, regularization_strength=l, solver=s,
                                                       regularizer="entropy"),
    "mask_budget": lambda x, l, s: itk.soft_topk_mask(x, 2.5, regularization_strength=l, solver=s,
                                                      max_support=4),
    "magnitude": lambda x, l, s: itk.soft_topk_mag(x, 2.5, regularization_strength=l, solver=s),
}


@pytest.mark.parametrize("solver", ["auto", "threshold", "pav"])
@pytest.mark.parametrize("name", sorted(TRACED_STRENGTH_OPERATORS))
def test_traced_strength_beyond_the_compute_dtype_gives_nan(name, solver):
  """A float64 strength beside float32 rows is valid as float64 but subnormal (1e-40,
  1e-45) or beyond max_strength (1e39) once cast: NaN, not the hard mask (which the
  solvers gave for 1e-40 and 1e-45, summing to 2 or 3 instead of 2.5)."""
  x = jnp.asarray([0.3, -1.2, 2.0, 0.1, 0.7, -0.4], jnp.float32)
  op = jax.jit(lambda l: TRACED_STRENGTH_OPERATORS[name](x, l, solver))
  for l in (1e-45, 1e-40, 1e39):
    assert np.all(np.isnan(np.asarray(op(jnp.float64(l))))), (l, op(jnp.float64(l)))
  assert np.all(np.isfinite(np.asarray(op(jnp.float64(0.3)))))


# -- errors name the argument -----------------------------------------------------------
@pytest.mark.parametrize("call, error, match", [
    (lambda: itk.soft_topk_mask(jnp.ones((3, 5)), jnp.ones((3, 1))), ValueError, "`k` must be a scalar or broadcast"),
    (lambda: itk.soft_topk_mag(jnp.ones((3, 5)), 2, regularization_strength=jnp.ones((3, 1))), ValueError, "`regularization_strength` must be a scalar or broadcast"),
    (lambda: itk.grad_topk(jnp.ones((3, 5)), 2, regularization_strength=jnp.ones((3, 1))), ValueError, "`regularization_strength` must be a scalar or broadcast"),
    (lambda: itk.soft_topk_values(jnp.ones(5), 2.5), TypeError, "`k` must be a Python int"),
    (lambda: itk.soft_topk_mask(jnp.ones(5), 5.5), ValueError, "0 <= k <= n with n=5"),
    (lambda: itk.hard_topk_mask(jnp.ones(5), -1), ValueError, "0 <= k <= n"),
])
def test_errors_name_the_argument(call, error, match):
  with pytest.raises(error, match=match):
    call()


# -- shard_map (default check_vma) and jax.export for every operator --------------------
def _run_transforms(*names):
  env = device_checks.env_with_devices(2)
  result = subprocess.run([sys.executable, str(SCRIPT), *names], env=env, capture_output=True,
                          text=True, timeout=1500)
  report = "\n".join(l for l in result.stdout.splitlines() if l.startswith(("OK  ", "FAIL ")))
  assert result.returncode == 0, report + "\n" + result.stderr[-2000:]
  return report


_HOST_DEVICES = pytest.mark.skipif(
    jax.default_backend() != "cpu",
    reason="transforms_check.py meshes 2 host devices (XLA_FLAGS); the default backend here "
           f"is {jax.default_backend()!r} with its own device count")


@_HOST_DEVICES
def test_default_mask_under_shard_map_and_export():
  report = _run_transforms("soft_topk_mask")
  assert report.count("OK") == 4, report


@pytest.mark.slow
@_HOST_DEVICES
def test_every_operator_under_shard_map_and_export():
  # soft_topk_mask's four checks are the default run's (the test above)
  report = _run_transforms("-soft_topk_mask")
  # the other 17 operators x (forward, grad) x (shard_map, export)
  assert "FAIL " not in report and report.count("OK  ") == 68, report
