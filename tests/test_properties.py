"""Hypothesis property tests of ``soft_topk_mask`` and the two exact solvers (float64).

Every example is a small batch of ``_B`` rows whose length is drawn from ``_NS``, and
every operator is called through a cached ``jax.jit`` with ``k`` and ``l`` passed as
per-row arrays, so each (solver, p, n) compiles once for the whole file.

Tolerances: results computed along two different rounding paths are compared to
1e-10 plus the change of ``y`` that a perturbation of a few ulps of the threshold can
cause (:func:`_cond_atol`). For ``p <= 2`` the mask is Lipschitz (slope at most
``a / l``, ``a = 1/(p-1) <= 3``), so that extra term is negligible. For ``p = 3``
(``y = sqrt(z)``) the slope is unbounded at ``z = 0``: no double ``lam`` may give
``sum y = k`` to better than ~1e-8 when a small ``y_i`` sits on a large ``|x_i|`` (e.g.
``x = [0, 0, -8, -8, -8]``, ``k = 2.00001``, ``l = 0.1``), and the tolerance says so.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, example, given, note, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import implicit_topk as itk

# One worker runs this module (pyproject: --dist loadgroup): its tests share compiled
# functions, which a second worker would compile again.
pytestmark = pytest.mark.xdist_group("test_properties")

jax.config.update("jax_enable_x64", True)  # also done in conftest.py; harmless twice

SOLVERS = ("threshold", "pav")
PS = (4.0 / 3.0, 1.5, 2.0, 3.0)
P_IDS = ("p4/3", "p1.5", "p2", "p3")
_B = 3  # rows per example
_NS = (2, 5, 16)  # row lengths (one compilation per length)
_L_MIN = 0.05

_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow],
                 print_blob=True)
_FEW = settings(max_examples=20, **_SETTINGS)
_SOME = settings(max_examples=40, **_SETTINGS)
_MANY = settings(max_examples=100, **_SETTINGS)

parametrize_solver = pytest.mark.parametrize("solver", SOLVERS)
parametrize_p = pytest.mark.parametrize("p", PS, ids=P_IDS)


@pytest.fixture(scope="module", autouse=True)
def _x64():
  """float64 for this module (conftest.py enables it globally as well)."""
  previous = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", True)
  yield
  jax.config.update("jax_enable_x64", previous)


def _delta(x, l, extra=0.0, ulps=16):
  """A few ulps of the threshold (|lam| <= max|x| + l), one value per row."""
  return ulps * np.spacing(np.abs(x).max(-1) + l + extra)


def _cond_atol(y1, y2, l, p, delta, floor=1e-10):
  """floor + the largest change of y_i = min(1, z_i^a), z_i = (x_i - lam) / l, that a
  change of lam (or x_i) by ``delta`` can cause, given the two compared values."""
  a = 1.0 / (p - 1.0)
  d = (np.asarray(delta) / np.asarray(l))[..., None] * np.ones_like(y1)
  if a >= 1.0:  # slope a z^(a-1) <= a on [0, 1]
    return floor + a * d
  y = np.clip(np.minimum(y1, y2), 0.0, 1.0)
  z = y ** (1.0 / a)
  with np.errstate(divide="ignore"):
    slope_bound = np.where(z > 0, a * z ** (a - 1.0) * d, np.inf)  # concave: slope at z
  return floor + np.minimum(d**a, slope_bound)


def assert_close_cond(actual, desired, l, p, delta, floor=1e-10):
  atol = _cond_atol(actual, desired, l, p, delta, floor)
  bad = ~(np.abs(actual - desired) <= atol)
  assert not np.any(bad), (
      f"mismatch at {np.argwhere(bad).tolist()}:\nactual={actual[bad]}\n"
      f"desired={desired[bad]}\natol={atol[bad]}\nfull actual=\n{actual}\n"
      f"full desired=\n{desired}")


# ---------------------------------------------------------------------------------
# cached jitted operators
# ---------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _mask_fn(solver, p):
  return jax.jit(lambda x, k, l: itk.soft_topk_mask(x, k, regularization_strength=l, p=p, solver=solver))


def _solver_obj(solver, p):
  cls = {"threshold": itk.ThresholdSolver, "pav": itk.PAVSolver}[solver]
  return cls(regularizer=itk.PNorm(p))


@functools.lru_cache(maxsize=None)
def _run_fn(solver, p):
  obj = _solver_obj(solver, p)

  def run(x, k, l):
    step = obj.run(None, x, k, l)
    return step.params, step.state.residual, obj.primal(step.params, x, l)

  return jax.jit(run)


def soft(x, k, l, *, p, solver):
  x = np.asarray(x, np.float64)
  batch = x.shape[:-1]
  k = np.broadcast_to(np.asarray(k, np.float64), batch)
  l = np.broadcast_to(np.asarray(l, np.float64), batch)
  y = np.asarray(_mask_fn(solver, p)(jnp.asarray(x), jnp.asarray(k), jnp.asarray(l)))
  assert y.dtype == np.float64 and y.shape == x.shape
  return y


def run_solver(x, k, l, *, p, solver):
  x = np.asarray(x, np.float64)
  batch = x.shape[:-1]
  k = np.broadcast_to(np.asarray(k, np.float64), batch)
  l = np.broadcast_to(np.asarray(l, np.float64), batch)
  lam, residual, y = _run_fn(solver, p)(jnp.asarray(x), jnp.asarray(k), jnp.asarray(l))
  return np.asarray(lam), np.asarray(residual), np.asarray(y)


# ---------------------------------------------------------------------------------
# strategies
# ---------------------------------------------------------------------------------

_X_ELEMENTS = st.floats(-10.0, 10.0, allow_nan=False, allow_infinity=False,
                        allow_subnormal=False)


def _k_strategy(n):
  """Real k in (0, n): integers, half-integers and arbitrary reals."""
  return st.one_of(
      st.integers(1, n - 1).map(float),
      st.floats(0.01, n - 0.01),
      st.integers(1, 2 * n - 1).map(lambda m: m / 2.0),
  )


_L_STRATEGY = st.one_of(st.sampled_from([0.1, 0.5, 1.0, 2.0]), st.floats(_L_MIN, 5.0))


@st.composite
def problems(draw, x_elements=_X_ELEMENTS):
  """(x, k, l): x of shape (_B, n), per-row k and l."""
  n = draw(st.sampled_from(_NS))
  x = draw(hnp.arrays(np.float64, (_B, n), elements=x_elements))
  k = np.array([draw(_k_strategy(n)) for _ in range(_B)])
  l = np.array([draw(_L_STRATEGY) for _ in range(_B)])
  return x, k, l


def integer_problems():
  """Small integers cast to float: many ties and duplicates."""
  return problems(x_elements=st.integers(-4, 4).map(float))


# ---------------------------------------------------------------------------------
# an independent reference: bisection on phi(lam) in numpy
# ---------------------------------------------------------------------------------

def _np_primal(lam, x, l, p):
  z = (x - lam) / l
  a = 1.0 / (p - 1.0)
  return np.where(z >= 1.0, 1.0, np.where(z > 0.0, np.abs(z) ** a, 0.0))


def reference_mask(x, k, l, p):
  """Row-wise bisection on the nonincreasing phi(lam) = sum y(lam) - k (numpy)."""
  out = np.empty_like(x)
  for b in range(x.shape[0]):
    row, kb, lb = x[b], k[b], l[b]
    lo, hi = row.min() - lb, row.max()  # phi(lo) = n - k > 0, phi(hi) = -k < 0
    for _ in range(200):
      mid = 0.5 * (lo + hi)
      if mid <= lo or mid >= hi:
        break
      if _np_primal(mid, row, lb, p).sum() > kb:
        lo = mid
      else:
        hi = mid
    out[b] = _np_primal(0.5 * (lo + hi), row, lb, p)
  return out


# ---------------------------------------------------------------------------------
# properties
# ---------------------------------------------------------------------------------

@pytest.mark.slow
@parametrize_solver
@parametrize_p
@_SOME
@given(problems())
def test_in_unit_box(solver, p, prob):
  x, k, l = prob
  y = soft(x, k, l, p=p, solver=solver)
  assert np.all(np.isfinite(y)), y
  assert np.all(y >= 0.0), y
  assert np.all(y <= 1.0), y


@pytest.mark.slow
@parametrize_solver
@parametrize_p
@_SOME
@given(problems())
@example((np.array([[0.0, 0.0, -8.0, -8.0, -8.0]] * 3), np.array([2.00001] * 3),
          np.array([0.1] * 3)))  # p = 3: ill-conditioned, see the module docstring
def test_sums_to_k(solver, p, prob):
  x, k, l = prob
  y = soft(x, k, l, p=p, solver=solver)
  ref = reference_mask(x, k, l, p)
  atol = _cond_atol(y, ref, l, p, _delta(x, l), floor=1e-12).sum(-1)
  assert np.all(np.abs(y.sum(-1) - k) <= atol), (y.sum(-1) - k, atol)


@pytest.mark.slow
@parametrize_solver
@parametrize_p
@_SOME
@given(problems())
# Found by hypothesis: the p = 3 PAV kernel returned [0.7071, 1.2e-48] (sum 0.707).
@example((np.array([[0.25, 3.433963e-192], [0.25, 1e-40], [0.3, 1e-100]]),
          np.array([1.0, 1.0, 1.0]), np.array([0.5, 0.5, 0.5])))
# l equal to the gap: p = 3 is ill-conditioned at the exact binary solution
@example((np.array([[0.0, 0.0546875, 0.0546875, 0.0546875, 0.0546875]] * 3),
          np.array([4.0, 4.0, 1.0]), np.array([0.0546875, 0.0546875, 0.1])))
def test_matches_bisection_reference(solver, p, prob):
  x, k, l = prob
  y = soft(x, k, l, p=p, solver=solver)
  assert_close_cond(y, reference_mask(x, k, l, p), l, p, _delta(x, l))


@pytest.mark.slow
@parametrize_solver
@parametrize_p
@_SOME
@given(problems(), st.data())
def test_permutation_equivariant(solver, p, prob, data):
  x, k, l = prob
  n = x.shape[-1]
  perms = np.array([data.draw(st.permutations(range(n))) for _ in range(_B)])
  y = soft(x, k, l, p=p, solver=solver)
  y_perm = soft(np.take_along_axis(x, perms, -1), k, l, p=p, solver=solver)
  assert_close_cond(y_perm, np.take_along_axis(y, perms, -1), l, p, _delta(x, l))


@pytest.mark.slow
@parametrize_solver
@parametrize_p
@_SOME
@given(problems(), st.data())
def test_monotone_in_x(solver, p, prob, data):
  """Raising x_i does not lower y_i and does not raise any other y_j."""
  x, k, l = prob
  n = x.shape[-1]
  idx = np.array([data.draw(st.integers(0, n - 1)) for _ in range(_B)])
  delta = np.array([data.draw(st.floats(1e-3, 5.0)) for _ in range(_B)])
  x_up = x.copy()
  x_up[np.arange(_B), idx] += delta
  y = soft(x, k, l, p=p, solver=solver)
  y_up = soft(x_up, k, l, p=p, solver=solver)
  tol = _cond_atol(y, y_up, l, p, _delta(x_up, l))
  rows = np.arange(_B)
  assert np.all(y_up[rows, idx] >= y[rows, idx] - tol[rows, idx]), (y, y_up, idx)
  others = np.ones_like(y, dtype=bool)
  others[rows, idx] = False
  assert np.all(y_up[others] <= y[others] + tol[others]), (y, y_up, idx)


@pytest.mark.slow
@parametrize_solver
@parametrize_p
@_SOME
@given(problems(), st.floats(-100.0, 100.0))
def test_invariant_to_shift(solver, p, prob, c):
  x, k, l = prob
  y = soft(x, k, l, p=p, solver=solver)
  y_shift = soft(x + c, k, l, p=p, solver=solver)
  assert_close_cond(y_shift, y, l, p, _delta(x, l, extra=abs(c)))


@pytest.mark.slow
@parametrize_solver
@parametrize_p
@_SOME
@given(problems())
@example((np.array([[0.0, 0.0546875, 0.0546875, 0.0546875, 0.0546875]] * 3),
          np.array([4.0, 4.0, 1.0]), np.array([0.0546875, 0.0546875, 0.1])))
def test_exact_zeros_and_ones_at_threshold(solver, p, prob):
  """y_i == 0 exactly where x_i <= lam and y_i == 1 exactly where x_i >= lam + l."""
  x, k, l = prob
  lam, residual, y_run = run_solver(x, k, l, p=p, solver=solver)
  y = soft(x, k, l, p=p, solver=solver)
  assert np.all(np.isfinite(lam)), lam
  res_tol = _cond_atol(y_run, y_run, l, p, _delta(x, l), floor=1e-12).sum(-1)
  assert np.all(residual <= res_tol), (residual, res_tol)
  # the functional API uses the same threshold as the solver object
  np.testing.assert_array_equal(y, y_run)
  below = x <= lam[:, None]
  above = (x - lam[:, None]) >= l[:, None] * (1.0 + 1e-12)
  assert np.all(y[below] == 0.0), (x, lam, y)
  assert np.all(y[above] == 1.0), (x, lam, y)
  # lam is a valid threshold: entries strictly between lam and lam + l are fractional
  # (z >= 1e-30 keeps z^a clear of underflow)
  inside = ((x - lam[:, None] >= 1e-30 * l[:, None])
            & (x - lam[:, None] < l[:, None] * (1.0 - 1e-9)))
  assert np.all((y[inside] > 0.0) & (y[inside] < 1.0)), (x, lam, y)


def _count_at_least(x, shift):
  """c[b, i] = #{j : x[b, j] >= x[b, i] + shift[b]}."""
  return np.sum(x[:, None, :] >= x[:, :, None] + shift[:, None, None], axis=-1)


def _count_at_most(x, shift):
  """c[b, i] = #{j : x[b, j] <= x[b, i] - shift[b]}."""
  return np.sum(x[:, None, :] <= x[:, :, None] - shift[:, None, None], axis=-1)


# Found by hypothesis (threshold solver): a row whose two entries are 10 l apart (and,
# second, 1 and 1e-175 for p = 2) must give exactly [0, 1].
_SEPARATED_PAIRS = (np.array([[0.0, 1.0], [1.0, 1.0], [1.0, 1.0]]),
                    np.array([1.0, 1.0, 1.0]), np.array([0.1, 0.1, 0.1]))
_TINY_PAIRS = (np.array([[1.0, 1e-175], [1e-175, 1e-175], [1e-175, 1e-175]]),
               np.array([1.0, 1.0, 1.0]), np.array([0.1, 0.1, 0.1]))


@pytest.mark.slow
@parametrize_solver
@parametrize_p
@_SOME
@given(problems())
@example(_SEPARATED_PAIRS)
@example(_TINY_PAIRS)
def test_exact_zeros_and_ones_without_threshold(solver, p, prob):
  """Sufficient conditions that do not use lam.

  If #{j : x_j >= x_i + l} >= k then y_i == 0: otherwise lam < x_i, every such j has
  x_j - lam > l, so y_j = 1 and sum y >= k + y_i > k. Symmetrically, if
  #{j : x_j <= x_i - l} >= n - k then y_i == 1.
  """
  x, k, l = prob
  n = x.shape[-1]
  # a margin of a few ulps keeps the conditions sound under rounding of x_i +- l
  margin = l * (1.0 + 1e-12) + 1e-12
  zero = _count_at_least(x, margin) >= k[:, None]
  one = _count_at_most(x, margin) >= (n - k)[:, None]
  y = soft(x, k, l, p=p, solver=solver)
  note(f"forced zeros: {zero.sum()}, forced ones: {one.sum()}")
  assert np.all(y[zero] == 0.0), (x, k, l, y)
  assert np.all(y[one] == 1.0), (x, k, l, y)


def test_forced_zeros_condition_is_not_vacuous():
  """The conditions of the previous test do fire on typical inputs."""
  x = np.array([[5.0, 4.0, 0.0, -1.0, 3.0]])
  l = np.array([0.5])
  k = np.array([2.0])
  zero = _count_at_least(x, l * (1.0 + 1e-12) + 1e-12) >= k[:, None]
  one = _count_at_most(x, l * (1.0 + 1e-12) + 1e-12) >= (5 - k)[:, None]
  np.testing.assert_array_equal(zero, [[False, False, True, True, True]])
  np.testing.assert_array_equal(one, [[True, True, False, False, False]])
  for solver in SOLVERS:
    y = soft(x, k, l, p=4.0 / 3.0, solver=solver)
    np.testing.assert_array_equal(y, [[1.0, 1.0, 0.0, 0.0, 0.0]])


@st.composite
def separated_problems(draw):
  """Distinct x with a known minimum gap, and one integer k for the whole batch."""
  n = draw(st.sampled_from(_NS))
  rows = []
  for _ in range(_B):
    gaps = np.array([draw(st.floats(0.01, 3.0)) for _ in range(n - 1)])
    offset = draw(st.floats(-10.0, 10.0))
    perm = np.array(draw(st.permutations(range(n))))
    rows.append((offset + np.concatenate([[0.0], np.cumsum(gaps)]))[perm])
  x = np.stack(rows)
  k = draw(st.integers(1, n - 1))
  return x, k


@pytest.mark.slow
@parametrize_solver
@parametrize_p
@_SOME
@given(separated_problems())
@example((np.array([[2.0, 3.8671875], [0.0, 1.0], [0.0, 1.0]]), 1))  # l == gap: ill-conditioned at p = 3
def test_hard_limit_small_l(solver, p, prob):
  """Soft -> hard as l -> 0; once l is below the gap they are equal.

  Along the way <x, y(l)> does not decrease as l decreases (compare the optimality of
  y(l1) and y(l2) for each other's problem) and never exceeds the hard top-k sum.
  """
  x, k = prob
  hard = np.asarray(itk.hard_topk_mask(jnp.asarray(x), k))
  assert np.all(hard.sum(-1) == k)
  top_sum = np.sum(x * hard, -1)
  np.testing.assert_allclose(top_sum, np.sum(np.sort(x, -1)[:, -k:], -1), rtol=1e-12)
  gap = np.min(np.diff(np.sort(x, -1), axis=-1), axis=-1)
  scales = (100.0, 10.0, 3.0, 1.0, 0.999, 0.3, 1e-3)
  values, errors, slacks = [], [], []
  for scale in scales:
    l = scale * gap
    y = soft(x, np.full(_B, float(k)), l, p=p, solver=solver)
    values.append(np.sum(x * y, -1))
    errors.append(np.abs(y - hard).max(-1))
    # rounding of lam moves <x, y> by at most sum_i |x_i| |dy_i| (see _cond_atol)
    slacks.append(np.sum(np.abs(x) * _cond_atol(y, y, l, p, _delta(x, l), 1e-12), -1))
  values, errors, slacks = np.stack(values), np.stack(errors), np.stack(slacks)
  note(f"<x, y>: {values}\nerrors: {errors}")
  # below the gap the problem has the hard mask as its (binary) solution
  np.testing.assert_allclose(errors[scales.index(0.999):], 0.0, rtol=0, atol=1e-12)
  slack = 1e-9 + slacks[1:] + slacks[:-1]
  assert np.all(np.diff(values, axis=0) >= -slack), values
  assert np.all(values <= top_sum + 1e-9 + slacks), (values, top_sum)


@pytest.mark.slow
@parametrize_solver
@parametrize_p
@_FEW
@given(problems())
@example((np.array([[6.0] + [0.0] * 15] + [[0.0] * 16] * 2), np.array([0.0625, 0.01, 15.99]),
          np.array([0.1, 0.1, 0.1])))  # p = 3 with a small k / n: slow convergence
def test_uniform_limit_large_l(solver, p, prob):
  """As l -> inf every entry tends to k / n."""
  x, k, _ = prob
  n = x.shape[-1]
  a = 1.0 / (p - 1.0)
  z = (k / n) ** (1.0 / a)  # the common z_i = (x_i - lam) / l in the limit
  l = 1e6 * (np.ptp(x, axis=-1) + 1.0) / np.minimum(1.0, z)
  y = soft(x, k, l, p=p, solver=solver)
  # the z_i spread over an interval of width ptp(x) / l <= 1e-6 z, so y_i = z_i^a is
  # within about a * 1e-6 * (k / n) of k / n
  err = np.abs(y - (k / n)[:, None]).max(-1)
  atol = 4e-6 * a * (k / n) + 1e-12
  assert np.all(err <= atol), (err, atol)


@pytest.mark.slow
@parametrize_p
@_MANY
@given(integer_problems())
def test_pav_and_threshold_agree_with_ties(p, prob):
  x, k, l = prob
  y_pav = soft(x, k, l, p=p, solver="pav")
  y_thr = soft(x, k, l, p=p, solver="threshold")
  assert_close_cond(y_pav, y_thr, l, p, _delta(x, l), floor=1e-10)


@pytest.mark.slow
@parametrize_p
@_SOME
@given(problems())
def test_pav_and_threshold_agree_real_inputs(p, prob):
  x, k, l = prob
  y_pav = soft(x, k, l, p=p, solver="pav")
  y_thr = soft(x, k, l, p=p, solver="threshold")
  assert_close_cond(y_pav, y_thr, l, p, _delta(x, l), floor=1e-10)


@pytest.mark.slow
@parametrize_solver
@parametrize_p
@_FEW
@given(integer_problems())
def test_ties_get_equal_values(solver, p, prob):
  """Equal scores get exactly equal mask values (ties are never broken)."""
  x, k, l = prob
  y = soft(x, k, l, p=p, solver=solver)
  for b in range(_B):
    for value in np.unique(x[b]):
      group = y[b][x[b] == value]
      assert np.all(group == group[0]), (x[b], y[b])


@pytest.mark.slow
@parametrize_solver
@_FEW
@given(problems())
def test_nonfinite_rows(solver, prob):
  """NaN row -> NaN row; +inf -> 1, -inf -> 0, finite entries share the rest of k."""
  x, k, l = prob
  n = x.shape[-1]
  assume(n >= 5)
  x = x.copy()
  k = np.floor(k).clip(1, n - 3) + 0.5  # 1.5 <= k <= n - 2.5: feasible below
  x[0, 1] = np.nan
  x[1, 0], x[1, 2] = np.inf, -np.inf
  x[2, 0], x[2, 1] = np.inf, np.inf  # infeasible if k < 2
  y = soft(x, k, l, p=4.0 / 3.0, solver=solver)
  assert np.all(np.isnan(y[0])), y[0]
  assert y[1, 0] == 1.0 and y[1, 2] == 0.0, y[1]
  finite = np.isfinite(x[1])
  np.testing.assert_allclose(y[1, finite].sum(), k[1] - 1.0, rtol=0, atol=1e-9)
  ref = reference_mask(x[1:2, finite], np.array([k[1] - 1.0]), l[1:2], 4.0 / 3.0)[0]
  np.testing.assert_allclose(y[1, finite], ref, rtol=0, atol=1e-9)
  if k[2] < 2.0:
    assert np.all(np.isnan(y[2])), y[2]
  else:
    assert y[2, 0] == 1.0 and y[2, 1] == 1.0, y[2]
    np.testing.assert_allclose(y[2].sum(), k[2], rtol=0, atol=1e-9)
