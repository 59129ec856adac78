"""Issue 33, items 1, 2 and 4: ``where=`` with every regularizer and solver (the native
sigmoid kernel counted the excluded entries in its bracket), near-binary rows of the
smooth regularizers (the complement form of phi, ``proofs/complement_form.md``), and
p = 4/3 rows near the float maximum. Every solver that finds a threshold is checked:
``native``, ``threshold``, ``pav`` and ``pallas`` (the fused GPU kernel, run here in Pallas
interpret mode: the kernel body evaluates phi through the problem's own complement form,
so near-binary rows are resolved inside the kernel too; its long-row path, read in
chunks, is checked separately).

Every value is checked against the independent references of ``tests/references.py``:
the rational/bisection mask reference for ``where=``, and for near-binary rows a
decimal reference with enough digits to resolve every tail (``dense_mask_row_hp``:
plain ``sum y - k`` in brute precision, no complement form). Tolerances come from the
conditioning of the problem: an entry's tail ``min(y, 1 - y)`` and its derivative
``g'(z)`` move by a relative ``dz`` when ``z = (x - lam) / l`` moves by ``dz``, and an
exact solver in a precision ``eps`` has ``lam`` to a few ulps and ``x - lam`` to
``eps (|x| + |lam|)``.
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import implicit_topk as itk
from implicit_topk import solvers as itk_solvers
from implicit_topk.kernels.gpu import pallas_threshold
from implicit_topk.solvers.pallas import PallasSolver

sys.path.insert(0, os.path.dirname(__file__))
import references as ref  # noqa: E402

jax.config.update("jax_enable_x64", True)

SMOOTH = ("sigmoid", "laplace")
# "pallas": the fused GPU kernel, here in Pallas interpret mode (the same kernel body as
# XLA operations on the CPU; tests/test_gpu_lowering.py lowers it for CUDA).
SOLVERS = ("native", "threshold", "pav", "pallas")
_SOLVER_CLASSES = {"native": itk_solvers.NativeSolver, "threshold": itk_solvers.ThresholdSolver,
                   "pav": itk_solvers.PAVSolver, "pallas": PallasSolver}


def _default_native():
  """The solvers, with all but the native kernel (the CPU default) in the slow group."""
  return [pytest.param(s, marks=() if s == "native" else pytest.mark.slow) for s in SOLVERS]


# -- item 1: where= ------------------------------------------------------------------------


@pytest.mark.parametrize("solver", _default_native())
def test_issue_example_sigmoid_where(solver):
  x = jnp.array([-1.3243589, 0.0, 0.0], jnp.float32)
  y = itk.soft_topk_mask(x, 0.93164, regularization_strength=0.016042, regularizer="sigmoid",
                         where=jnp.array([True, False, False]), solver=solver)
  # one valid entry: it takes all of k
  np.testing.assert_allclose(np.asarray(y), [0.93164, 0.0, 0.0], rtol=2e-6, atol=0)


# (name, p) of every regularizer; "dykstra" solves p = 2 only
_REGULARIZERS = [("pnorm", 4.0 / 3.0), ("pnorm", 2.0), ("pnorm", 1.5), ("entropy", None),
                 ("sigmoid", None), ("laplace", None)]


def _where_rows(dtype):
  """4 x 10 rows with 7, 6, 4 and 3 valid entries (50%; the issue's 60% rows drew such
  counts, and the fewer valid entries a row has, the farther the broken bracket was
  from the root); the excluded entries hold, over the batch, every kind of value:
  finite above and below every valid entry, +-inf and NaN."""
  rng = np.random.default_rng(33)
  x = rng.normal(size=(4, 10))
  where = np.zeros((4, 10), bool)
  for r, count in enumerate((7, 6, 4, 3)):
    where[r, rng.permutation(10)[:count]] = True
  fills = np.array([10.0, -10.0, np.inf, -np.inf, np.nan])
  excluded = np.argwhere(~where)
  for i, (r, c) in enumerate(excluded):
    x[r, c] = fills[i % fills.size]
  return x.astype(dtype), where


def _reference_where(x, where, k, l, name, p):
  y = np.zeros(x.shape)
  for r in range(x.shape[0]):
    y[r, where[r]] = ref.soft_topk_mask(x[r, where[r]].astype(np.float64), k, l, p=p or 4 / 3,
                                        regularizer_name=None if name == "pnorm" else name)
  return y


def _where_reference_grad(x, where, k, l, name, p, w, h=1e-6):
  """d/dx sum(w y) by central differences of the reference (float64), valid entries only."""
  grad = np.zeros(x.shape)
  for r in range(x.shape[0]):
    idx = np.flatnonzero(where[r])
    base = x[r, idx].astype(np.float64)
    for j in range(idx.size):
      ys = []
      for sign in (1, -1):
        moved = base.copy()
        moved[j] += sign * h
        ys.append(ref.soft_topk_mask(moved, k, l, p=p or 4 / 3,
                                     regularizer_name=None if name == "pnorm" else name))
      grad[r, idx[j]] = np.dot(w[r, idx], ys[0] - ys[1]) / (2 * h)
  return grad


def _where_cases():
  """Every regularizer and solver in both dtypes; the default run keeps the native
  kernel (the CPU default) with the dense masks, the rest is in the slow group."""
  for dtype in (np.float64, np.float32):
    for name, p in _REGULARIZERS:
      for solver in SOLVERS + ("dykstra",):
        if solver == "dykstra" and p != 2.0:
          continue
        default = solver == "native" and p is None and (dtype == np.float64 or name == "sigmoid")
        yield pytest.param(name, p, solver, dtype, marks=() if default else pytest.mark.slow,
                           id=f"{np.dtype(dtype).name}-{name}{'' if p is None else f'{p:.3g}'}"
                              f"-{solver}")


@pytest.mark.parametrize("name,p,solver,dtype", list(_where_cases()))
def test_where_every_regularizer_and_solver(name, p, solver, dtype):
  x, where = _where_rows(dtype)
  k, l = 2.0, 0.5
  kwargs = dict(regularization_strength=l, regularizer=name, solver=solver)
  if p is not None:
    kwargs["p"] = p
  fun = lambda v: itk.soft_topk_mask(v, k, where=jnp.asarray(where), **kwargs)
  y = np.asarray(fun(jnp.asarray(x)), np.float64)
  expected = _reference_where(x, where, k, l, name, p)
  atol = 1e-10 if dtype == np.float64 else 2e-6
  if solver == "dykstra":  # stops on a certified L1 error (its default tol, 1e-6)
    atol = max(atol, 1e-6)
  np.testing.assert_allclose(y, expected, rtol=0, atol=atol)
  assert np.all(y[~where] == 0)
  np.testing.assert_allclose(y.sum(-1), k, rtol=0, atol=10 * atol)
  if dtype == np.float64 and solver != "dykstra":
    w = np.random.default_rng(1).normal(size=x.shape)
    grad = np.asarray(jax.grad(lambda v: jnp.sum(jnp.asarray(w) * fun(v)))(jnp.asarray(x)))
    assert np.all(grad[~where] == 0)
    np.testing.assert_allclose(grad, _where_reference_grad(x, where, k, l, name, p, w),
                               rtol=0, atol=1e-6)


# -- item 2: near-binary rows of the smooth regularizers -----------------------------------

_EXAMPLE = np.array([2.57, 2.11, 2.02, 1.79, 1.79, 1.58])


@pytest.mark.parametrize("name", SMOOTH)
@pytest.mark.parametrize("solver", _default_native())
def test_issue_example_derivative_in_k(solver, name):
  """d/dk sum(w y) on the issue's row: the limit 2.75 (dy/dk = 1/2, 1/4, 1/4 on the
  entries 2.02, 1.79, 1.79) at l = 1e-3, and the reference's value at 0.01 and 0.05
  (sigmoid: 2.7499409864..., 2.6877069826...)."""
  w = jnp.arange(6.0)
  for l in (1e-3, 1e-2, 5e-2):
    f = lambda k: jnp.sum(w * itk.soft_topk_mask(jnp.asarray(_EXAMPLE), k, regularization_strength=l,
                                                 regularizer=name, solver=solver))
    got = float(jax.grad(f)(3.0))
    expected = float(np.dot(np.arange(6.0), ref.dense_mask_row_hp(_EXAMPLE, 3.0, l, name)["dk"]))
    assert got == pytest.approx(expected, rel=2e-11, abs=0), (l, got, expected)
    if l == 1e-3:
      assert got == pytest.approx(2.75, rel=2e-11)
  if name == "sigmoid":
    assert expected == pytest.approx(2.687706982649, rel=1e-12)


def near_binary_rows(rng, rows, n, gaps, dtype, *, k=None):
  """Rows whose k-th and (k+1)-th largest entries are ``gap`` strengths apart (``gap``
  drawn from ``gaps``), the other entries spread by 0 to 3 strengths (ties included)
  on either side; entries near 2 (unshifted rows). Returns (x, k, l) per row."""
  xs, ks, ls = [], [], []
  for _ in range(rows):
    kk = int(rng.integers(1, n)) if k is None else k
    gap = float(rng.choice(gaps)) * rng.uniform(0.9, 1.0)
    l = float(rng.uniform(0.002, 0.02))
    top = 2.0 + l * np.cumsum(np.round(rng.uniform(0, 3, kk), 1))
    bottom = 2.0 - l * gap - l * np.cumsum(np.round(rng.uniform(0, 3, n - kk), 1))
    x = rng.permutation(np.concatenate([top, bottom])).astype(dtype)
    xs.append(x)
    ks.append(float(kk))
    ls.append(float(np.asarray(l, dtype)))
  return np.array(xs), np.array(ks, dtype), np.array(ls, dtype)


def _everything(solver, name, x, k, l, w):
  """(lam, y, dy/dk, d/dx sum(w y)) in one jitted call."""
  cls = _SOLVER_CLASSES[solver]
  regularizer = itk.BinaryEntropy() if name == "sigmoid" else itk.Laplace()

  @jax.jit
  def run(x, k, l, w):
    op = lambda v, kk: itk.soft_topk_mask(v, kk, regularization_strength=l,
                                          regularizer=name, solver=solver)
    y, dk = jax.jvp(lambda kk: op(x, kk), (k,), (jnp.ones_like(k),))
    grad = jax.grad(lambda v: jnp.sum(w * op(v, k)))(x)
    return cls(regularizer=regularizer).run(None, x, k, l).params, y, dk, grad

  return (np.asarray(a, np.float64) for a in run(*map(jnp.asarray, (x, k, l, w))))


def _check_lam_and_mask(hp, x, l, lam, y, r):
  """lam and y of one row against the decimal reference ``hp``; returns the relative
  error bound ``rel`` of its tails and slopes."""
  dtype = x.dtype
  eps = float(np.finfo(dtype).eps)
  lam_ref = float(hp["lam"])
  ulp = float(np.spacing(np.asarray(abs(lam_ref), dtype)))
  # lam to a few ulps of itself and of the distances x_i - lam that set it (those
  # rounded once: phi is known to a relative eps |x_i - lam| / l per entry); each z_i
  # then to delta_i
  relevant = hp["dk"] >= 1e-6 * hp["dk"].max()
  spread = np.abs(x.astype(np.float64) - lam_ref)[relevant].max()
  assert abs(lam - lam_ref) <= 4 * ulp + 4 * eps * spread, (r, lam, lam_ref)
  delta = 8 * (4 * ulp + eps * (np.abs(x.astype(np.float64)) + abs(lam_ref))) / l
  rel = np.expm1(2 * delta.max())
  tail = np.minimum(hp["y"], 1 - hp["y"])
  np.testing.assert_array_less(np.abs(y - hp["y"]), tail * rel + 2 * eps + float(np.finfo(dtype).tiny))
  return rel


def check_near_binary(solver, name, x, k, l):
  """lam, y, dy/dk (a jvp in k) and d/dx sum(w y) (a vjp) of every row against the
  decimal reference."""
  dtype = x.dtype
  eps = float(np.finfo(dtype).eps)
  tiny = float(np.finfo(dtype).tiny)
  w = np.random.default_rng(7).normal(size=x.shape).astype(dtype)
  lam, y, dk, grad = _everything(solver, name, x, k, l, w)
  for r in range(x.shape[0]):
    hp = ref.dense_mask_row_hp(x[r], k[r], l[r], name)
    rel = _check_lam_and_mask(hp, x[r], l[r], lam[r], y[r], r)
    np.testing.assert_array_less(np.abs(dk[r] - hp["dk"]), 2 * rel * hp["dk"] + 4 * tiny)
    vjp, scale = ref.dense_mask_vjp_hp(hp, w[r], l[r])
    np.testing.assert_array_less(np.abs(grad[r] - vjp), (2 * rel + 16 * eps) * scale + 4 * tiny / l[r])
    # O(1) derivatives in k: a near-binary row is not binary
    assert abs(dk[r].sum() - 1) <= 16 * rel + 64 * eps


def _near_binary_cases():
  """The native kernel (the CPU default) and the fused GPU kernel in interpret mode on
  float32 sigmoid rows in the default run, the rest in the slow group."""
  for dtype, gaps in [(np.float64, (60, 250, 700)), (np.float32, (30, 60, 85))]:
    for solver in SOLVERS:
      for name in SMOOTH:
        default = solver == "native" or (solver == "pallas" and name == "sigmoid"
                                         and dtype == np.float32)
        yield pytest.param(solver, name, dtype, gaps, marks=() if default else pytest.mark.slow,
                           id=f"{np.dtype(dtype).name}-{name}-{solver}")


@pytest.mark.parametrize("solver,name,dtype,gaps", list(_near_binary_cases()))
def test_near_binary_rows_match_the_decimal_reference(solver, name, dtype, gaps):
  x, k, l = near_binary_rows(np.random.default_rng(2), 3, 7, gaps, dtype)
  check_near_binary(solver, name, x, k, l)


@pytest.mark.slow
@pytest.mark.parametrize("name", SMOOTH)
@pytest.mark.parametrize("dtype,gaps", [(np.float64, (60, 250, 700)), (np.float32, (30, 60, 85))])
def test_near_binary_rows_in_the_chunked_kernel(name, dtype, gaps):
  """The fused kernel's long-row path (one row per program, read in chunks: here chunks
  of 2 entries, interpret mode) gives the decimal reference's threshold and mask."""
  x, k, l = near_binary_rows(np.random.default_rng(3), 3, 8, gaps, dtype)
  problem = itk.problems.CappedSimplex(itk.BinaryEntropy() if name == "sigmoid" else itk.Laplace())
  y, lam, origin, _, certified, _, scale, _ = pallas_threshold.fused_rows(
      problem, jnp.asarray(x), jnp.asarray(k), jnp.asarray(l), interpret=True, chunk=2)
  assert np.all(np.asarray(certified))
  lam = np.asarray((lam + origin) / scale, np.float64)
  y = np.asarray(y, np.float64)
  for r in range(x.shape[0]):
    _check_lam_and_mask(ref.dense_mask_row_hp(x[r], k[r], l[r], name), x[r], l[r], lam[r], y[r], r)


@pytest.mark.slow
@pytest.mark.parametrize("name", SMOOTH)
@pytest.mark.parametrize("solver", SOLVERS)
@pytest.mark.parametrize("dtype,gaps", [(np.float64, (5, 20, 40, 100, 200, 350, 500, 600, 700)),
                                        (np.float32, (5, 10, 20, 40, 60, 75, 85))])
@pytest.mark.parametrize("seed", range(4))
def test_near_binary_sweep(solver, name, dtype, gaps, seed):
  rng = np.random.default_rng(100 + seed)
  x, k, l = near_binary_rows(rng, 6, int(rng.integers(2, 17)), gaps, dtype)
  check_near_binary(solver, name, x, k, l)


@pytest.mark.parametrize("solver", _default_native())
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_saturating_masks_keep_a_small_fractional_mass(solver, dtype):
  # Masks that are exactly 1 from a finite z1 on (entropy z1 = 0, p-norms z1 = 1) on rows
  # where two entries are exactly 1 and the rest share k - 2, far below the rounding of
  # sum(y) ~ k (found by an independent audit: the threshold solver lost 4% of it). The
  # saturated form of phi (proofs/complement_form.md) keeps it. References in closed
  # form: entropy's fractional entries are (k - 2) softmax(x_F / l) over them; a p-norm
  # row with one fractional entry gives it exactly k - 2 (Sterbenz: k - 2 is exact).
  eps = float(np.finfo(dtype).eps)
  k = dtype(2.0) + dtype(2.0 ** -20 if dtype == np.float32 else 1e-14)
  x = np.array([40.7411945, 0.71332791, 0.18981484, 40.3322775, 0.42526749, 0.38628525,
                0.68214185, 0.78835343], dtype)
  frac = np.array([1, 2, 4, 5, 6, 7])
  l = 0.2
  y = np.asarray(itk.soft_topk_mask(jnp.asarray(x), k, regularization_strength=l,
                                    regularizer="entropy", solver=solver), np.float64)
  xf = x[frac].astype(np.float64)
  want = (float(k) - 2.0) * np.exp((xf - xf.max()) / l) / np.sum(np.exp((xf - xf.max()) / l))
  assert np.all(y[[0, 3]] == 1.0)
  # the fractional entries' z is resolved to ulps of x (~1) over l: relative 8 eps / l
  np.testing.assert_allclose(y[frac], want, rtol=8 * eps / l)
  for p in (4.0 / 3.0, 1.5):
    row = jnp.asarray(np.array([5.0, 4.0, 1.0, 0.3, 0.2], dtype))
    y = np.asarray(itk.soft_topk_mask(row, k, regularization_strength=0.5, p=p, solver=solver),
                   np.float64)
    np.testing.assert_array_equal(y[[0, 1, 3, 4]], [1.0, 1.0, 0.0, 0.0])
    # y = z^a, a = 1 / (p - 1): z is resolved to ulps of max|x| / l (absolute), so y to
    # a relative a (8 eps max|x| / l) / z, z = y^(1/a) (1e-10 here; the plain sum gave 1e-3)
    a, want = 1.0 / (p - 1.0), float(k) - 2.0
    np.testing.assert_allclose(y[2], want, rtol=a * 8 * eps * 5.0 / 0.5 / want ** (1 / a))


# -- item 4: binary rows near the float maximum that the shift hides ------------------------


def _exact_hard_mask(x, k, l):
  """The exact answer where the row is binary in exact arithmetic (the k-th and
  (k+1)-th largest finite entries at least l apart: Fraction arithmetic), else None."""
  from fractions import Fraction
  finite = np.sort(x[np.isfinite(x)])[::-1]
  k_f = int(k) - int(np.sum(x == np.inf))
  if not 0 < k_f < finite.size or Fraction(finite[k_f - 1]) - Fraction(finite[k_f]) < Fraction(l):
    return None
  return np.where(x == np.inf, 1.0, np.where(np.isfinite(x) & (x >= finite[k_f - 1]), 1.0, 0.0))


def _hidden_binary_rows(rng, rows, n):
  """Rows with the row maximum near +1.7e308 and the k-th / (k+1)-th largest entries far
  below it (both signs, some beyond the float range once shifted), a gap of a few of
  their ulps and l at most the gap: binary in exact arithmetic, while the entries
  shifted by the maximum round (or clamp) to within l of each other."""
  top = float(np.finfo(np.float64).max)
  xs, ks, ls = [], [], []
  for _ in range(rows):
    k = int(rng.integers(1, n - 1))
    a = rng.choice([-1.0, 1.0]) * top * rng.uniform(0.05, 0.95)
    ulp = float(np.spacing(abs(a)))
    gap = ulp * int(rng.integers(1, 5))
    b = a - gap
    l = float(rng.choice([gap, gap * rng.uniform(0.3, 1.0)]))
    above = a + np.abs(a) * rng.uniform(0.001, 0.04, k - 1) + ulp * 64
    below = b - np.abs(b) * rng.uniform(0.001, 0.04, n - k - 2) - ulp * 64
    x = np.concatenate([[top * rng.uniform(0.97, 1.0)], np.minimum(above, top), [a, b],
                        np.maximum(below, -top)])
    xs.append(rng.permutation(x))
    ks.append(float(k + 1))  # the row maximum is one of the top k + 1
    ls.append(l)
  return np.array(xs), np.array(ks), np.array(ls)


@pytest.mark.parametrize("solver", _default_native())
def test_issue_examples_binary_rows_near_the_float_maximum(solver):
  u = float(np.spacing(1e308))
  rows = [([1.7e308, -1e308, -1e308 - 2 * u], 2.0, 1.5 * u),  # shifted: both clamp to -max
          ([1.0e308, 0.9e308, 0.9e308 - 2 * np.spacing(0.9e308), -1e300], 2.0,
           1.5 * np.spacing(0.9e308)),
          ([1.7e308, -1e308, -1e308 - 2 * u, 3.0, np.inf], 3.0, 1.5 * u)]
  for x, k, l in rows:
    x = np.array(x)
    expected = _exact_hard_mask(x, k, l)
    assert expected is not None
    f = lambda v: itk.soft_topk_mask(v, k, regularization_strength=l, solver=solver)
    np.testing.assert_array_equal(np.asarray(f(jnp.asarray(x))), expected)
    w = jnp.arange(float(x.size))
    grad = np.asarray(jax.grad(lambda v: jnp.sum(w * f(v)))(jnp.asarray(x)))
    np.testing.assert_array_equal(grad, 0.0)  # a binary row: lam locally constant


@pytest.mark.parametrize("n", [4, 9, pytest.param(40, marks=pytest.mark.slow)])
@pytest.mark.parametrize("solver", _default_native())
def test_hidden_binary_rows_near_the_float_maximum_are_exactly_binary(solver, n):
  x, k, l = _hidden_binary_rows(np.random.default_rng(n), 200, n)
  y = np.asarray(itk.soft_topk_mask(jnp.asarray(x), jnp.asarray(k),
                                    regularization_strength=jnp.asarray(l), solver=solver))
  checked = 0
  for r in range(x.shape[0]):
    expected = _exact_hard_mask(x[r], k[r], l[r])
    if expected is None:
      continue
    checked += 1
    np.testing.assert_array_equal(y[r], expected, err_msg=f"row {r}: {x[r]!r} k={k[r]} l={l[r]!r}")
  assert checked >= 150
