"""solver="native" for soft_topk_mag (implicit_topk/kernels/cpu/native_magnitude.py).

Values are checked against two references that share no code with the library: the
outputs against ``tests/references.py`` (``soft_topk_mag``: the threshold equation of
``proofs/magnitude_threshold.md`` by bisection in float64 with compensated sums, and its
``mag_tolerance``: a few units of roundoff of the threshold and of each entry), the
thresholds against :func:`reference_lambda` below (bisection of the same equation over the
floats' bit patterns, written here from the proof's formula). Gradients against central
differences in float64. The kernel compiles at ``import implicit_topk`` into numba's disk
cache (``tests/conftest.py``: the default run checks the default solvers), so these tests
pay no compilation beyond XLA's; the long sweeps are in the slow group.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

import implicit_topk as itk
import references as R
import test_extremes as E
from implicit_topk import problems
from implicit_topk.kernels.cpu import native_calls, registry
from test_fuzz import FAST, SLOW, U32, U64, assert_close, k_rows, log_uniform, unit_rows
from test_native_solver import export_in_one_process_and_call_in_another
from gradcheck import check_grads

jax.config.update("jax_enable_x64", True)

slow = pytest.mark.slow
PS = (1.1, 4.0 / 3.0, 1.5, 2.0, 3.0, 5.0)  # a = 10, 3, 2, 1, 1/2, 1/4: every branch of g
PS_WIDE = (1.01, 1.1, 1.25, 4.0 / 3.0, 1.5, 2.0, 2.5, 3.0, 5.0, 10.0)


def mag(x, k, l, p=4.0 / 3.0, solver="native", **kw):
  return itk.soft_topk_mag(x, k, regularization_strength=l, p=p, solver=solver, **kw)


def kernel(x, k, l, p=4.0 / 3.0):
  """(lam, passes, residual) of the kernel, as NumPy arrays."""
  return tuple(np.asarray(v) for v in native_calls.magnitude_kernel(jnp.asarray(x), k, l, p))


def check_mag(x, k, l, p, *, dtype=np.float64, eps=U64, what="native"):
  """soft_topk_mag(solver="native") on x rounded to ``dtype`` against the reference on the
  same rounded inputs, to the reference's tolerance with ``eps``."""
  x = np.asarray(np.asarray(x, dtype), np.float64)
  k = np.broadcast_to(np.asarray(np.asarray(k, dtype), np.float64), x.shape[:-1])
  l = np.broadcast_to(np.asarray(np.asarray(l, dtype), np.float64), x.shape[:-1])
  y = np.asarray(mag(jnp.asarray(x, dtype), jnp.asarray(k, dtype), jnp.asarray(l, dtype), p))
  assert y.dtype == dtype
  tol = np.stack([_row_tolerance(x[i], k[i], l[i], p, eps) for i in range(x.shape[0])])
  assert_close(y, R.soft_topk_mag(x, k, l, p), tol, f"{what} p={p} {np.dtype(dtype).name}")
  return y


def _row_tolerance(x, k, l, p, eps):
  """R.mag_tolerance of one row; where the reference's threshold is subnormal (its slope
  estimate divides by 2e-7 lam = 0) no normal float threshold exists, the kernel returns
  0 and the output is x up to rounding."""
  try:
    return R.mag_tolerance(x[None], np.array([k]), np.array([l]), p, eps=eps)[0]
  except ZeroDivisionError:
    return 16 * eps * np.abs(np.nan_to_num(x, posinf=0.0, neginf=0.0))


# -- an independent threshold: bisection of phi over the floats' bit patterns ------------


def _phi(s, lam, k, l, a):
  """sum_i min(1, g((s_i - lam)_+ / l) / lam) - k (proofs/magnitude_threshold.md item 2)."""
  t = np.maximum(s - lam, 0.0)
  with np.errstate(over="ignore", under="ignore"):
    return float(np.sum(np.minimum(1.0, (t / l) ** a / lam)) - k)


def reference_lambda(s, k, l, p):
  """The root of phi for finite magnitudes s with 0 < k < #(s > 0), to adjacent floats:
  phi(0+) = #(s > 0) - k > 0 and phi(max s) = -k < 0, and phi is nonincreasing. A flat
  root interval (a binary row) gives a point of it."""
  s = np.abs(np.asarray(s, np.float64))
  a = 1.0 / (p - 1.0)
  lo, hi = 0, int(np.float64(np.max(s)).view(np.int64))
  while hi - lo > 1:
    mid = (lo + hi) // 2
    if _phi(s, float(np.int64(mid).view(np.float64)), k, l, a) >= 0:
      lo = mid
    else:
      hi = mid
  return float(np.int64(lo).view(np.float64)), float(np.int64(hi).view(np.float64))


def lam_tolerance(s, k, l, p, lam, c=16.0):
  """How far a threshold computed in float64 may be from the root: c units of roundoff of
  lam, plus what c units of roundoff in each of the n terms of phi move it (through
  |phi'(lam)|, by a central difference): R.mag_tolerance's rule for lam."""
  s = np.abs(np.asarray(s, np.float64))
  a, r = 1.0 / (p - 1.0), 1e-7
  slope = abs(_phi(s, lam * (1 + r), k, l, a) - _phi(s, lam * (1 - r), k, l, a)) / (2 * r * lam)
  return c * U64 * lam + (c * s.size * U64 * (k + s.size) / slope if slope > 0 else lam)


def _binary(s, k, l, p):
  """Whether the row's solution is binary: integer k and h(s_(k+1)) < s_(k)."""
  if k != int(k) or not 0 < k < s.size:
    return False
  srt = np.sort(np.abs(s))[::-1]
  return srt[int(k)] + l * srt[int(k)] ** (p - 1.0) < srt[int(k) - 1]


# -- selection ---------------------------------------------------------------------------


def test_auto_picks_native_for_the_magnitude_on_cpu():
  auto = itk.solvers.auto_solver_name
  for p in PS_WIDE:
    assert auto(problems.Magnitude(p), backend="cpu", row_length=8) == "native"
    assert auto(problems.Magnitude(p), backend="cpu", row_length=8, sharded=True) == "threshold"
  solver = itk.solvers.make_solver("auto", problems.Magnitude(), row_length=8)
  assert isinstance(solver.for_platform("cpu"), itk.NativeSolver)  # chosen per platform
  # options that only the iterative solver takes keep "auto" on it everywhere
  assert isinstance(itk.solvers.make_solver("auto", problems.Magnitude(), maxiter=5),
                    itk.ThresholdSolver)
  _, info = mag(jnp.ones((2, 5)).at[:, 0].set(3.0), 1.5, 0.5, solver="auto", return_info=True)
  assert info.iter_num.dtype == jnp.int32


def test_rows_that_cannot_be_native_are_refused_by_name():
  with pytest.raises(ValueError, match="solver='native'"):
    itk.NativeSolver(problem=problems.Magnitude()).with_layout(problems.layout.Segments(2))
  with pytest.raises(ValueError, match="diff='unrolled' needs an iterative solver"):
    mag(jnp.ones(3), 1.0, 1.0, diff="unrolled")


def test_the_tree_form_stays_on_threshold_and_agrees():
  rng = np.random.default_rng(0)
  tree = {"w": jnp.asarray(rng.normal(size=(3, 4))), "b": jnp.asarray(rng.normal(size=5))}
  out = itk.tree_soft_topk_mag(tree, 6.5, regularization_strength=0.3)
  flat = np.concatenate([np.ravel(tree["b"]), np.ravel(tree["w"])])
  want = np.asarray(mag(jnp.asarray(flat), 6.5, 0.3))
  got = np.concatenate([np.ravel(out["b"]), np.ravel(out["w"])])
  np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)


# -- values ------------------------------------------------------------------------------


@pytest.mark.parametrize("p", PS)
@given(data=st.data())
@FAST
def test_matches_the_reference(p, data):
  n = data.draw(st.sampled_from((1, 2, 5, 40)), label="n")
  x = data.draw(unit_rows(n), label="x")  # ties, zeros, all-equal rows
  k = data.draw(k_rows(n), label="k")  # 0, n, near 0, near n, fractional
  l = data.draw(st.lists(log_uniform(-2, 1), min_size=3, max_size=3).map(np.array), label="l")
  check_mag(x, k, l, p)


@given(data=st.data())
@FAST
def test_float32_matches_the_reference(data):
  n = data.draw(st.sampled_from((3, 17)), label="n")
  p = data.draw(st.sampled_from((4.0 / 3.0, 2.0)), label="p")
  x = data.draw(unit_rows(n), label="x") * data.draw(log_uniform(-6, 6), label="scale")
  k = data.draw(k_rows(n), label="k")
  l = np.max(np.abs(x), axis=-1) ** (2 - p) * 10.0 ** np.array(
      data.draw(st.lists(st.floats(-2, 1), min_size=3, max_size=3), label="u"))
  check_mag(x, k, np.where(l > 0, l, 1.0), p, dtype=np.float32, eps=U32)


@pytest.mark.parametrize("p", PS)
def test_thresholds_match_the_bisection(p):
  # Rows with fractional entries (a unique root), ties and zeros, k integer and not.
  rng = np.random.default_rng(1)
  x = rng.normal(size=(8, 12))
  x[1] = np.round(x[1], 1)
  x[2, :4] = 0.0
  x[3] = np.abs(x[3])  # signs do not matter
  k = np.array([1.5, 2.0, 3.0, 0.3, 11.7, 6.0, 4.25, 1.0])
  l = np.array([0.5, 1.0, 0.2, 2.0, 0.05, 0.7, 3.0, 0.1])
  lam, passes, residual = kernel(x, k, l, p)
  for i in range(8):
    if _binary(np.abs(x[i]), k[i], l[i], p):
      continue
    lo, hi = reference_lambda(x[i], k[i], l[i], p)
    tol = lam_tolerance(x[i], k[i], l[i], p, lo)
    assert lo - tol <= lam[i] <= hi + tol, (i, lam[i], lo, hi, tol)
    # the stopping rule: |phi| <= sqrt(4 eps) (k + 1), phi = F / lam the mask equation
    assert passes[i] >= 1 and residual[i] <= math.sqrt(8 * U64) * (k[i] + 1)


def test_binary_rows_are_exactly_the_hard_top_k_with_zero_passes():
  # proofs/magnitude_threshold.md item 4: binary where h(s_(k+1)) < s_(k)
  x = np.array([[3.0, -1.0, 2.5, -0.5, 0.25], [-4.0, 0.0, 1.0, 3.9, 0.5]])
  k, l = np.array([2.0, 1.0]), 1e-4
  for p in PS:
    assert _binary(x[0], 2.0, l, p) and _binary(x[1], 1.0, l, p)
    lam, passes, residual = kernel(x, k, l, p)
    np.testing.assert_array_equal(passes, [0, 0])
    np.testing.assert_array_equal(residual, [0.0, 0.0])
    y = np.asarray(mag(x, jnp.asarray(k), l, p))
    np.testing.assert_array_equal(y, [[3.0, 0, 2.5, 0, 0], [-4.0, 0, 0, 0, 0]])
    # lam inside [s_(k+1), h^-1(s_(k))]: at least s_(k+1), and h(lam) <= s_(k)
    assert 1.0 < lam[0] and lam[0] + l * lam[0] ** (p - 1) < 2.5
    assert 3.9 < lam[1] and lam[1] + l * lam[1] ** (p - 1) < 4.0


@pytest.mark.parametrize("p", (4.0 / 3.0, 2.0, 3.0))
def test_special_rows_follow_the_problems_bracket(p):
  inf, nan = np.inf, np.nan
  x = np.array([
      [nan, 1.0, 2.0, 3.0],  # NaN anywhere: NaN
      [inf, -inf, 1.0, 2.0],  # more infinite entries than k: NaN
      [inf, 0.5, -2.0, 1.0],  # k = #inf: the finite entries 0, lam = max finite + l
      [-inf, 0.5, -2.0, 1.0],  # -inf is kept as +inf is (|x| = inf)
      [0.0, 3.0, 0.0, -1.0],  # at most k nonzero entries: x itself, lam = 0
      [0.0, 0.0, 0.0, 0.0],  # all zero
      [2.0, -2.0, 2.0, 2.0],  # all tied
      [5.0, 1.0, -1.0, 0.5],  # k = 0: zeros
      [5.0, 1.0, -1.0, 0.5],  # k = n: x
  ])
  k = np.array([1.5, 1.0, 1.0, 2.5, 2.0, 1.0, 1.5, 0.0, 4.0])
  l = 0.3
  lam, passes, residual = kernel(x, k, l, p)
  assert np.isnan(lam[0]) and np.isnan(lam[1])
  assert lam[2] == 2.0 + l and lam[4] == 0.0 and lam[5] == 0.0 and lam[7] == 5.0 + l
  assert lam[8] == 0.0
  np.testing.assert_array_equal(passes[[0, 1, 2, 4, 5, 7, 8]], 0)
  assert passes[3] >= 1 and 0.5 < lam[3] < 2.0  # -inf takes one of k = 2.5; 1.5 left
  y = np.asarray(mag(x, jnp.asarray(k), l, p))
  assert_close(y, R.soft_topk_mag(x, k, l, p), R.mag_tolerance(x, k, l, p, eps=U64), "special")
  np.testing.assert_array_equal(y[2], [inf, 0.0, 0.0, 0.0])
  assert y[3, 0] == -inf and y[3, 2] < 0
  np.testing.assert_array_equal(y[4], x[4])
  np.testing.assert_array_equal(y[7], np.zeros(4))
  np.testing.assert_array_equal(y[8], x[8])
  threshold = np.asarray(mag(x, jnp.asarray(k), l, p, solver="threshold"))
  np.testing.assert_allclose(y, threshold, rtol=1e-12, atol=1e-15)


def test_n_equal_one_and_k_near_its_ends():
  for k in (1e-9, 0.37, 1.0 - 1e-9, 1.0):
    check_mag(np.array([[-1.7]]), np.array([k]), np.array([0.2]), 4.0 / 3.0)
  for k in (1e-9, 1e-3, 4.999, 5.0 - 1e-9):
    check_mag(np.array([[3.0, -1.0, 2.0, 0.5, -4.0]]), np.array([k]), np.array([0.4]), 2.0)


@pytest.mark.parametrize("dtype, x, k, l, p", [
    (np.float64, [1.7e308, 1.53e308, 1.36e308], 2.0, 1.0, 2.0),
    (np.float64, [1.7e308, -1.6e308, 1.0], 1.0, 1.0, 4 / 3),
    (np.float64, [-1.7e308, 1.53e308, 1.36e308, 1e300, -3.0], 1.5, 1e200, 4 / 3),
    (np.float64, [-1.7e308, 1.53e308, 1.36e308, 1e300, -3.0], 2.5, 0.5, 2.0),
    (np.float64, [1e308, 1e-300, 5e307, 1.0, -1e-30], 2.5, 1e154, 2.0),
    (np.float64, [3e-30, -1e-30, 2e-30, 2.5e-30], 1.5, 1e-30, 2.0),
    (np.float64, [3e-30, -1e-30, 2e-30, 2.5e-30], 2.5, 1e10, 4 / 3),
    (np.float64, [1e-300, -3e-300, 2e-300], 1.5, 1e-300, 2.0),
    (np.float32, [3e38, 2.9e38, 1.0], 1.0, 1.0, 4 / 3),
    (np.float32, [3.3e38, -3.0e38, 2.5e38], 1.5, 1.0, 2.0),
    (np.float32, [3.3e38, -3.0e38, 2.5e38, 1e30], 1.5, 1e20, 4 / 3),
    (np.float32, [1e-30, -3e-30, 2e-30, 5e-31], 2.5, 1e-30, 2.0),
])
def test_magnitudes_from_tiny_to_the_float_maximum(dtype, x, k, l, p):
  # test_extremes.mag_reference: exact rational arithmetic (tests/references.py works in
  # float64 logs, which do not reach the float maximum)
  out = mag(jnp.asarray(x, dtype), k, l, p)
  assert out.dtype == dtype
  E._check_mag(np.asarray(out), x, k, l, p, dtype=dtype)


def test_a_root_below_the_normal_floats_is_returned_as_zero():
  # |x| ~ 1e-200, l = 1e300: h^-1(s) ~ 1e-1500 and the root lies below the smallest normal
  # float (XLA flushes subnormals to 0): lam = 0, the output is x (as the exact root's,
  # up to rounding), and the rows after it (their cut guessed from this one) are right.
  rng = np.random.default_rng(7)
  x = np.zeros((3, 4096))
  x[0] = rng.normal(size=4096) * 1e-200  # long: the first row's cut from a sample
  x[1, :3] = [1.0, 2.0, 3.0]  # at most k nonzero entries: x
  x[2] = rng.normal(size=4096)
  k, l = np.array([10.0, 5.0, 3.5]), np.array([1e300, 1e300, 0.3])
  lam = kernel(x, k, l)[0]
  assert lam[0] == 0.0 and lam[1] == 0.0
  y = np.asarray(mag(x, jnp.asarray(k), jnp.asarray(l)))
  np.testing.assert_array_equal(y[:2], x[:2])
  lo, hi = reference_lambda(x[2], 3.5, 0.3, 4.0 / 3.0)
  assert lo - lam_tolerance(x[2], 3.5, 0.3, 4.0 / 3.0, lo) <= lam[2] <= hi * (1 + 1e-14)


@pytest.mark.parametrize("n, k", [(256, 8), (1000, 10.5), (2000, 300), (5000, 2.0), (5000, 40.25)])
def test_long_rows_and_many_rows(n, k):
  # Many similar rows (each row's cut guessed from the previous one: right, too low or too
  # high, where the scale jumps), ties, long rows (k >= 16: quickselect).
  rng = np.random.default_rng(n)
  x = rng.normal(size=(6, n)) * np.array([[1.0], [1.0], [100.0], [0.01], [1.0], [3.0]])
  x[4] = np.round(x[4], 1)
  l = np.array([0.5, 0.1, 1.0, 1e-3, 0.05, 2.0])
  lam, passes, _ = kernel(x, k, l, 4.0 / 3.0)
  for i in range(6):
    if _binary(np.abs(x[i]), k, l[i], 4.0 / 3.0):
      continue
    lo, hi = reference_lambda(x[i], k, l[i], 4.0 / 3.0)
    assert lo * (1 - 16 * U64) <= lam[i] <= hi * (1 + 16 * U64), (i, lam[i], lo, hi)
  assert np.max(passes) <= 20


def test_first_rows_of_long_rows_guess_from_a_sample():
  # Rows of 4096 entries or more: the first row's cut comes from a strided sample of
  # 1024 magnitudes. A sample that sees only the large entries guesses too high (the
  # check fails, every magnitude is gathered); one that misses them too low; an infinite
  # or NaN entry fails the check too. The answer never depends on it.
  n, k, l = 8192, 20.5, 0.05
  rng = np.random.default_rng(6)
  x = rng.normal(size=(1, n)) * 0.01
  high, low, special = x.copy(), x.copy(), x.copy()
  high[0, ::8] = rng.normal(size=n // 8)  # the sampled positions (step 8) are the large ones
  low[0, 3::8] = rng.normal(size=n // 8)  # none of the large ones is sampled
  for i, row in enumerate((x, high, low)):
    lam = kernel(row, k, l)[0][0]
    lo, hi = reference_lambda(row[0], k, l, 4.0 / 3.0)
    tol = lam_tolerance(row[0], k, l, 4.0 / 3.0, lo)
    assert lo - tol <= lam <= hi + tol, (i, lam, lo, hi)
  special[0, 100] = np.inf  # kept; the other entries share k - 1
  assert np.asarray(mag(special, k, l))[0, 100] == np.inf
  lam = kernel(special, k, l)[0][0]
  lo, hi = reference_lambda(np.delete(special[0], 100), k - 1, l, 4.0 / 3.0)
  tol = lam_tolerance(np.delete(special[0], 100), k - 1, l, 4.0 / 3.0, lo)
  assert lo - tol <= lam <= hi + tol, (lam, lo, hi)
  special[0, 200] = np.nan
  assert np.all(np.isnan(np.asarray(mag(special, k, l))))


def test_where_excludes_entries_as_removing_them():
  x = np.array([[3.0, -1.0, 2.0, 0.5, -4.0, 1.5]])
  where = np.array([[True, True, False, True, True, False]])
  y = np.asarray(mag(x, 2.5, 0.4, where=where))
  kept = np.asarray(mag(x[:, where[0]], 2.5, 0.4))
  np.testing.assert_array_equal(y[where], kept[0])
  np.testing.assert_array_equal(y[~where], 0.0)


# -- transforms --------------------------------------------------------------------------


def test_batch_shapes_axis_jit_vmap_and_eager_agree():
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.normal(size=(4, 3, 11)))
  k = jnp.asarray(rng.uniform(0.5, 10.5, size=(4, 3)))
  eager = mag(x, k, 0.3)
  jitted = jax.jit(lambda z: mag(z, k, 0.3))(x)
  mapped = jax.vmap(lambda z, kk: mag(z, kk, 0.3))(x, k)
  looped = jnp.stack([jnp.stack([mag(x[i, j], k[i, j], 0.3) for j in range(3)]) for i in range(4)])
  for value in (jitted, mapped, looped):
    np.testing.assert_array_equal(np.asarray(value), np.asarray(eager))
  along = mag(jnp.moveaxis(x, -1, 1), k, 0.3, axis=1)
  np.testing.assert_array_equal(np.asarray(jnp.moveaxis(along, 1, -1)), np.asarray(eager))
  assert_close(np.asarray(eager).reshape(12, 11), R.soft_topk_mag(
      np.asarray(x).reshape(12, 11), np.asarray(k).ravel(), 0.3),
      R.mag_tolerance(np.asarray(x).reshape(12, 11), np.asarray(k).ravel(), 0.3, 4.0 / 3.0,
                      eps=U64), "batch")


@pytest.mark.parametrize("p", (4.0 / 3.0, pytest.param(2.0, marks=slow), pytest.param(3.0, marks=slow)))
def test_gradients_match_central_differences(p):
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.normal(size=(3, 6)))
  k, l = jnp.array([1.5, 2.5, 3.3]), jnp.array([0.7, 1.1, 0.9])
  f = lambda x, k, l: mag(x, k, l, p)
  check_grads(f, (x, k, l), modes=("fwd", "rev"), atol=1e-6, rtol=1e-6)
  # the same derivatives as the threshold solver's (both implicit, on the same F)
  w = jnp.asarray(rng.normal(size=x.shape))
  grads = [jax.grad(lambda *a, s=s: jnp.sum(mag(*a, p, solver=s) * w), argnums=(0, 1, 2))(x, k, l)
           for s in ("native", "threshold")]
  for got, want in zip(*grads):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-9, atol=1e-12)


def test_per_row_k_and_strength_under_vmap_of_grad():
  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.normal(size=(4, 7)))
  ks, ls = jnp.array([1.0, 2.5, 3.0, 6.5]), jnp.array([0.1, 1.0, 3.0, 0.5])
  grad = lambda row, k, l: jax.grad(lambda z: jnp.sum(mag(z, k, l) * jnp.cos(z)))(row)
  mapped = jax.vmap(grad)(x, ks, ls)
  for i in range(4):
    np.testing.assert_allclose(mapped[i], grad(x[i], ks[i], ls[i]), rtol=0, atol=1e-14)


def test_export_serialize_deserialize_and_call():
  from jax import export
  f = jax.jit(jax.grad(lambda x: jnp.sum(mag(x, 2.5, 0.4) * jnp.cos(x))))
  x = jnp.linspace(-1.0, 2.0, 24).reshape(3, 8)
  exported = export.export(f, disabled_checks=itk.export_safety_checks())(x)
  assert "implicit_topk_magnitude_float64" in exported.mlir_module()
  again = export.deserialize(exported.serialize())
  np.testing.assert_array_equal(np.asarray(again.call(x)), np.asarray(f(x)))


@slow
def test_export_and_call_in_a_fresh_process(tmp_path):
  export_in_one_process_and_call_in_another(tmp_path, "soft_topk_mag",
                                            "implicit_topk_magnitude_float32")


# -- dtypes and the bridge ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_half_precision_is_computed_in_float32_as_the_mask(dtype):
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.normal(size=(4, 9)), dtype)
  y = mag(x, 2.5, 0.3)
  assert y.dtype == dtype
  wide = mag(x.astype(jnp.float32), 2.5, 0.3)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(wide.astype(dtype)))


def test_the_solver_refuses_other_dtypes_by_name():
  solver = itk.NativeSolver(problem=problems.Magnitude())
  with pytest.raises(TypeError, match="float32 or float64"):
    solver.run(None, jnp.ones((2, 3), jnp.float16), 1.0, 1.0)


def test_the_bridge_checks_buffers_and_raises_instead_of_crashing():
  x = jnp.ones((2, 3), jnp.float32)
  name = registry.target("magnitude", "float32")
  registry.ensure(name)  # a direct ffi_call: nothing here lowers the package's primitive
  row = jax.ShapeDtypeStruct((2,), jnp.float32)
  good = (row, jax.ShapeDtypeStruct((2,), jnp.int32), row)
  k = l = jnp.ones(2, jnp.float32)
  a = np.float64(3.0)
  call = lambda results, *args, **attrs: jax.block_until_ready(
      jax.ffi.ffi_call(name, results)(*args, **attrs))
  assert len(call(good, x, k, l, a=a)) == 3
  expected = "magnitude kernel: expected"
  with pytest.raises(Exception, match=expected):  # k of the wrong length
    call(good, x, jnp.ones(3, jnp.float32), l, a=a)
  with pytest.raises(Exception, match=expected):  # no attribute
    call(good, x, k, l)
  with pytest.raises(Exception, match=expected):  # an attribute of the wrong dtype
    call(good, x, k, l, a=np.float32(2.0))  # (2.0: a value jax has not cached a call for)
  with pytest.raises(Exception, match=expected):  # an exponent out of range
    call(good, x, k, l, a=np.float64(0.0))
  with pytest.raises(Exception, match=expected):  # a missing result
    call(good[:2], x, k, l, a=a)
  with pytest.raises(Exception, match=expected):  # float64 data to the float32 kernel
    call(good, x.astype(jnp.float64), k, l, a=a)


# -- properties --------------------------------------------------------------------------


@given(data=st.data())
@FAST
def test_properties(data):
  """Odd in x; |out| <= |x| with the sign of x; exactly 0 where |x_i| <= lam and exactly
  x_i where |x_i| >= h(lam) (proofs/magnitude_threshold.md item 5); scale equivariance
  out(c x, l c^(2-p)) = c out(x, l); the threshold solver's answer."""
  n = 6
  p = data.draw(st.sampled_from((4.0 / 3.0, 2.0, 3.0)), label="p")
  x = data.draw(unit_rows(n), label="x")
  k = data.draw(k_rows(n), label="k")
  l = data.draw(st.lists(log_uniform(-2, 1), min_size=3, max_size=3).map(np.array), label="l")
  y = np.asarray(mag(x, k, l, p))
  tol = R.mag_tolerance(x, k, l, p, eps=U64)
  np.testing.assert_array_equal(np.asarray(mag(-x, k, l, p)), -y)
  assert np.all(np.abs(y) <= np.abs(x)) and np.all(y * x >= 0)
  lam = kernel(x, k, l, p)[0]
  for i in range(3):
    if not 0 < lam[i] < np.inf:
      continue
    s = np.abs(x[i])
    assert np.all(y[i][s <= lam[i]] == 0.0), "entries at or below lam are exactly 0"
    kept = s >= (lam[i] + l[i] * lam[i] ** (p - 1)) * (1 + 1e-9)
    np.testing.assert_array_equal(y[i][kept], x[i][kept])
  c = 2.0 ** data.draw(st.integers(-20, 20), label="log2 c")
  assert_close(np.asarray(mag(c * x, k, l * c ** (2 - p), p)), c * y, c * 4 * tol + 1e-300,
               "scale equivariance")
  assert_close(np.asarray(mag(x, k, l, p, solver="threshold")), y, 2 * tol, "threshold")


@slow
@given(data=st.data())
@SLOW
def test_sweep(data):
  """p over 1.01..10, magnitudes 1e-30..1e30 with the scale-free strength
  l = |x|^(2-p) 10^u, rows up to 300 (quickselect past k = 16), +-inf and NaN entries,
  float32 and float64."""
  n = data.draw(st.sampled_from((1, 2, 5, 16, 60, 300)), label="n")
  p = data.draw(st.sampled_from(PS_WIDE), label="p")
  dtype = data.draw(st.sampled_from((np.float32, np.float64)), label="dtype")
  scale = data.draw(log_uniform(-30, 30) if dtype == np.float64 else log_uniform(-6, 6),
                    label="scale")
  x = data.draw(unit_rows(n), label="x") * scale
  if data.draw(st.booleans(), label="non-finite"):
    x[data.draw(st.integers(0, 2)), data.draw(st.integers(0, n - 1))] = data.draw(
        st.sampled_from((np.inf, -np.inf, np.nan)))
  k = data.draw(k_rows(n), label="k")
  u = np.array(data.draw(st.lists(st.floats(-6, 3), min_size=3, max_size=3), label="u"))
  l = scale ** (2 - p) * 10.0**u
  bound = 1e250 if dtype == np.float64 else 1e30
  assume(np.all((l > 1 / bound) & (l < bound)))
  check_mag(x, k, l, p, dtype=dtype, eps=U32 if dtype == np.float32 else U64)
