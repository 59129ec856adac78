"""Exact at the extremes of floating point (issue 25).

Rows whose spread, entries or thresholds reach the float maximum, checked against
independent references that share no code path with the library: the mask by
``tests/references.py`` (the threshold located with exact rational arithmetic, then
bisected in a frame re-centred on it) and held to its ``mask_tolerance`` (a few units
of roundoff of the threshold), the top-k in magnitude by :func:`mag_reference` below
(``proofs/magnitude_threshold.md`` item 2 in exact rational arithmetic: ``g`` is a
polynomial for ``p = 2`` and ``p = 4/3``). Derivatives against central differences of
those references.

Causes (issue 25): 1. dense regularizers stalled when the row maximum lies far above
the rest of the row (bisection of a bracket spanning hundreds of binades); 2. entries
whose distance from the threshold overflows came back exactly 0; 3. ``soft_topk_mag``
near the float maximum (its optimality sum and its snap overflowed).
"""

from __future__ import annotations

import math
import os
import sys
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(__file__))
import references as R  # noqa: E402

import implicit_topk as itk  # noqa: E402

jax.config.update("jax_enable_x64", True)

DENSE = ("entropy", "sigmoid", "laplace")
# solver="native" is a CPU kernel: on another default backend it is refused (ValueError).
ON_CPU = jax.default_backend() == "cpu"
NATIVE = pytest.param("native", marks=pytest.mark.skipif(
    not ON_CPU, reason="solver='native' runs on the CPU only; the default backend here is "
    f"{jax.default_backend()!r}"))
EPS = {np.float32: 2.0**-24, np.float64: 2.0**-53}


def _mask(x, k, l, reg, solver, dtype=np.float64, info=False):
  return itk.soft_topk_mask(jnp.asarray(x, dtype), k, regularization_strength=l,
                            regularizer=reg, solver=solver, return_info=info)


def _check_mask(y, x, k, l, reg, dtype=np.float64, p=4.0 / 3.0):
  """y against the reference on the dtype-rounded inputs, to its rounding tolerance."""
  x64 = np.asarray(np.asarray(x, dtype), np.float64)
  l64 = float(np.asarray(l, dtype))
  name = None if reg in ("pnorm", None) else reg
  expected = R.soft_topk_mask(x64, k, l64, p, name)
  tol = R.mask_tolerance(x64, k, l64, p, name, eps=EPS[dtype], unshifted_rows=True)
  np.testing.assert_array_less(np.abs(np.asarray(y, np.float64) - expected), tol + 1e-300,
                               err_msg=f"expected {expected}, got {y}")


# -- an exact reference of soft_topk_mag --------------------------------------------------


def _ordered_bits(v: float) -> int:
  return int(np.float64(v).view(np.int64))


def _from_bits(b: int) -> float:
  return float(np.int64(b).view(np.float64))


def mag_reference(x, k, l, p, lam_change=0.0):
  """soft_topk_mag of one row of finite floats, exactly (then rounded), p in {2, 4/3}.

  With s = |x|, g(u) = u^a (a = 1/(p-1) an integer), the threshold lam > 0 is a root of
  phi(lam) = sum_i min(1, g((s_i - lam)_+ / l) / lam) - k (nonincreasing;
  ``proofs/magnitude_threshold.md`` item 2), evaluated in Fractions: bisection over the
  bit patterns of the positive floats (adjacent floats around the root), then rational
  halvings until the output at both ends agrees to 2^-64 of its largest entry;
  out_i = sign(x_i) min(s_i, t_i + g(t_i / l)), t_i = (s_i - lam)_+. With
  ``lam_change``: the largest change of each out_i when lam moves by that fraction of
  itself (the error that rounding lam to a few ulps causes), instead of out.
  """
  a = {2.0: 1, 4.0 / 3.0: 3}[float(p)]
  s = [Fraction(abs(float(v))) for v in x]
  K, L = Fraction(float(k)), Fraction(float(l))
  if sum(v > 0 for v in s) <= K:
    return np.asarray(x, np.float64) * (0.0 if lam_change else 1.0)

  def phi(lam):
    total = -K
    for v in s:
      if v > lam:
        g = ((v - lam) / L)**a
        total += 1 if g >= lam else g / lam
    return total

  lo, hi = 0, _ordered_bits(float(max(s)))  # phi(0+) = nnz - k > 0, phi(max s) = -k
  while hi - lo > 1:
    mid = (lo + hi) // 2
    if phi(Fraction(_from_bits(mid))) >= 0:
      lo = mid
    else:
      hi = mid
  lo, hi = Fraction(_from_bits(lo)), Fraction(_from_bits(hi))

  def out(lam):
    return [min(v, max(v - lam, 0) + (max(v - lam, 0) / L)**a) for v in s]

  scale = max(s) / 2**64
  for _ in range(4000):  # a fractional entry can sit far below ulp(lam) from lam
    if max(abs(u - w) for u, w in zip(out(lo), out(hi))) <= scale:
      break
    mid = (lo + hi) / 2
    if phi(mid) >= 0:
      lo = mid
    else:
      hi = mid
  if lam_change:
    delta = Fraction(lam_change) * lo
    exact = out(lo)
    return np.array([float(max(abs(u - e), abs(w - e)))
                     for u, w, e in zip(out(lo - delta), out(lo + delta), exact)])
  return np.array([math.copysign(float(v), float(xi)) for v, xi in zip(out(lo), x)])


def _check_mag(out, x, k, l, p, dtype=np.float64, c=16):
  """out against the reference to c units of roundoff of each entry and of the
  threshold (its effect on each entry)."""
  x64 = np.asarray(np.asarray(x, dtype), np.float64)
  l64 = float(np.asarray(l, dtype))
  expected = mag_reference(x64, k, l64, p)
  tol = c * EPS[dtype] * np.abs(x64) + mag_reference(x64, k, l64, p, c * EPS[dtype])
  np.testing.assert_array_less(np.abs(np.asarray(out, np.float64) - expected), tol + 1e-300,
                               err_msg=f"expected {expected}, got {out}")


def test_mag_reference_against_known_values():
  """The reference itself, on rows solved by hand: p = 2, k = 1 (lam = (s1 + s2) / 3
  for l = 1 when both are fractional) and a binary row."""
  x = np.array([3.0, -2.0, 0.5])
  np.testing.assert_allclose(mag_reference(x, 1.0, 1.0, 2.0), [8 / 3, -2 / 3, 0.0], rtol=1e-15)
  np.testing.assert_array_equal(mag_reference(np.array([10.0, 1.0]), 1.0, 1e-3, 4 / 3),
                                [10.0, 0.0])


# -- cause 1: dense regularizers, row maximum far above the rest ---------------------------


@pytest.mark.parametrize("solver", ["threshold", NATIVE])
@pytest.mark.parametrize("reg", DENSE)
@pytest.mark.parametrize("x, k", [
    ([1e40, 0.0], 0.5), ([1e300, 0.0], 0.5), ([1e300, 1e300, 0.0], 1.5),
    ([0.5, -1.0, 2.5, -1e300], 1.25),
    ([1e300, 0.0, -1e300], 1.0), ([1e300, 0.0, -1e300], 0.25), ([1e35, 3.0, -2.0, 0.5], 1.25),
])
def test_dense_far_top_float64(x, k, reg, solver):
  y, state = _mask(x, k, 1.0, reg, solver, info=True)
  _check_mask(y, x, k, 1.0, reg)
  assert int(state.iter_num) < 100


@pytest.mark.parametrize("solver", ["threshold", NATIVE])
@pytest.mark.parametrize("reg", DENSE)
@pytest.mark.parametrize("x", [[1e30, 0.0], [1e37, 0.0], [3e38, -3e38, 1.0]])
def test_dense_far_top_float32(x, reg, solver):
  y = _mask(x, 0.5, 1.0, reg, solver, dtype=np.float32)
  _check_mask(y, x, 0.5, 1.0, reg, dtype=np.float32)


@pytest.mark.parametrize("reg", DENSE)
def test_dense_far_top_segments_and_tree(reg):
  x = jnp.array([1e300, 2.5, -1.0, 7.0, 1e200])
  ids = jnp.array([0, 0, 1, 1, 1])
  y = itk.segment_soft_topk_mask(x, ids, jnp.array([0.5, 1.5]), num_segments=2,
                                 regularizer=reg)
  _check_mask(y[:2], [1e300, 2.5], 0.5, 1.0, reg)
  _check_mask(y[2:], [-1.0, 7.0, 1e200], 1.5, 1.0, reg)
  tree = {"a": jnp.array([1e300, 2.5]), "b": jnp.array([[-1e300, 0.0]])}
  out = itk.tree_soft_topk_mask(tree, 0.75, regularizer=reg)
  _check_mask(np.concatenate([out["a"], out["b"].ravel()]), [1e300, 2.5, -1e300, 0.0], 0.75,
              1.0, reg)


@pytest.mark.parametrize("solver", ["threshold", NATIVE])
@pytest.mark.parametrize("reg", DENSE)
def test_dense_far_top_derivatives(reg, solver):
  """dy/dx and dy/dk of a row whose smallest entry lies 1e300 below the rest, against
  central differences of the reference, forward and reverse mode."""
  x, k = np.array([0.5, -1.0, 2.5, -1e300]), 1.25
  ref = lambda x_, k_: R.soft_topk_mask(x_, k_, 1.0, regularizer_name=reg)
  h = 1e-6
  dk = (ref(x, k + h) - ref(x, k - h)) / (2 * h)
  dx = np.zeros((4, 3))
  for j in range(3):
    up, down = x.copy(), x.copy()
    up[j] += h
    down[j] -= h
    dx[:, j] = (ref(up, k) - ref(down, k)) / (2 * h)
  f = lambda x_, k_: _mask(x_, k_, 1.0, reg, solver)
  for jac in (jax.jacfwd, jax.jacrev):
    jx, jk = jac(f, argnums=(0, 1))(jnp.asarray(x), jnp.float64(k))
    np.testing.assert_allclose(jk, dk, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(np.asarray(jx)[:, :3], dx, rtol=1e-6, atol=1e-9)


# -- cause 2: distances from the threshold beyond the float range --------------------------


@pytest.mark.parametrize("solver", ["threshold", NATIVE])
@pytest.mark.parametrize("reg", DENSE)
@pytest.mark.parametrize("dtype, x, l", [
    (np.float64, [1.7e308, 1.53e308, -8.5e307], 1.7e307),
    (np.float64, [-1.7e308, 1.7e308, 0.0], 4e307),
    (np.float32, [3.0e38, 2.7e38, -1.5e38], 3e37),
])
def test_overflowing_distances(dtype, x, l, reg, solver):
  y = _mask(x, 1.5, l, reg, solver, dtype=dtype)
  _check_mask(y, x, 1.5, l, reg, dtype=dtype)


# -- cause 3: soft_topk_mag near the float maximum ----------------------------------------


@pytest.mark.parametrize("dtype, x, k, l, p", [
    (np.float64, [1.7e308, 1.6e308], 1.0, 1.0, 4 / 3),
    (np.float32, [3e38, 2.9e38, 1.0], 1.0, 1.0, 4 / 3),
    (np.float64, [1.7e308, 1.53e308, 1.36e308], 2.0, 1.0, 2.0),
    (np.float64, [-1.7e308, 1.53e308, 1.36e308, 1e300, -3.0], 1.5, 1e200, 4 / 3),
    (np.float64, [-1.7e308, 1.53e308, 1.36e308, 1e300, -3.0], 2.5, 0.5, 2.0),
    (np.float32, [3.3e38, -3.0e38, 2.5e38], 1.5, 1.0, 2.0),
    (np.float32, [3.3e38, -3.0e38, 2.5e38, 1e30], 1.5, 1e20, 4 / 3),
])
def test_mag_near_float_max(dtype, x, k, l, p):
  out, state = itk.soft_topk_mag(jnp.asarray(x, dtype), k, regularization_strength=l, p=p,
                                 return_info=True)
  _check_mag(out, x, k, l, p, dtype=dtype)
  assert np.isfinite(state.residual)


def test_mag_near_float_max_hard_limit():
  """proofs/magnitude_threshold.md item 4: l s_(k+1)^(p-1) <= s_(k) - s_(k+1) gives the
  hard top-k in magnitude exactly, near the float maximum too."""
  for dtype, x in ((np.float64, [1.7e308, -1.6e308, 1e308]), (np.float32, [-3e38, 2.9e38, 1.0])):
    out = itk.soft_topk_mag(jnp.asarray(x, dtype), 1.0)
    np.testing.assert_array_equal(out, np.asarray([x[0], 0.0, 0.0], dtype))


def test_mag_near_float_max_derivatives():
  """d out / dx (O(1)) against central differences of the exact reference, p = 2."""
  x, k = np.array([1.7e308, 1.53e308, 1.36e308]), 2.0
  jac = np.asarray(jax.jacfwd(lambda v: itk.soft_topk_mag(v, k, p=2.0))(jnp.asarray(x)))
  jac_rev = np.asarray(jax.jacrev(lambda v: itk.soft_topk_mag(v, k, p=2.0))(jnp.asarray(x)))
  for j in range(3):
    h = 1e-6 * x[j]
    up, down = x.copy(), x.copy()
    up[j] += h
    down[j] -= h
    fd = (mag_reference(up, k, 1.0, 2.0) - mag_reference(down, k, 1.0, 2.0)) / (2 * h)
    np.testing.assert_allclose(jac[:, j], fd, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(jac_rev[:, j], fd, rtol=1e-6, atol=1e-9)


# -- a sweep over magnitudes up to the float maximum --------------------------------------

REGULARIZERS = ("pnorm4/3", "pnorm2", "entropy", "sigmoid", "laplace")
OPERATORS = ("mask", "mask_native", "segment", "tree", "mag", "tree_mag")
if not ON_CPU:  # solver="native" runs on the CPU only
  OPERATORS = tuple(o for o in OPERATORS if o != "mask_native")


def _draw_row(data, n, dtype, label):
  """n entries: a row scale anywhere from 1e-30 up to the float maximum, entries on it,
  and some entries at unrelated magnitudes (up to the float maximum, either sign)."""
  top = float(np.finfo(dtype).max)
  log_top = math.log10(top)
  scale = 10.0**data.draw(st.floats(-30, log_top), label=f"{label} log10 scale")
  if data.draw(st.booleans(), label=f"{label} near max"):
    scale = top * data.draw(st.floats(0.25, 1.0), label=f"{label} fraction of max")
  x = np.array(data.draw(st.lists(st.floats(-1, 1), min_size=n, max_size=n), label=label))
  x = x * scale
  for i in range(n):
    if data.draw(st.integers(0, 3), label=f"{label} outlier {i}") == 0:
      x[i] = data.draw(st.sampled_from((-1.0, 1.0))) * 10.0**data.draw(st.floats(-30, log_top - 1e-9))
  return np.asarray(np.clip(x, -top, top), dtype), scale


def _mask_solution(x64, k, l, reg):
  """(reference mask, threshold) of one row; p from the regularizer's name."""
  p = 2.0 if reg == "pnorm2" else 4.0 / 3.0
  name = None if reg.startswith("pnorm") else reg
  y, info = R.soft_topk_mask(x64, k, l, p, name, with_info=True)
  return y, info[0]["lam"], p, name


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_sweep_magnitudes_to_the_float_maximum(data):
  dtype = data.draw(st.sampled_from((np.float32, np.float64)), label="dtype")
  operator = data.draw(st.sampled_from(OPERATORS), label="operator")
  top = float(np.finfo(dtype).max)
  n = 5
  x, scale = _draw_row(data, n, dtype, "x")
  x64 = x.astype(np.float64)
  k = float(np.asarray(data.draw(st.floats(0.05, n - 0.05), label="k"), dtype))
  bound = 2.0**(1020 if dtype == np.float64 else 124)  # below the strength's bound
  l = scale * 10.0**data.draw(st.floats(-3, 1), label="log10 l / scale")
  # The mask's reference works with x / l as floats: |x| / l within the float64 range.
  lower = max(1e-30, 8 * float(np.max(np.abs(x64))) / np.finfo(np.float64).max)
  l = float(np.asarray(min(max(l, lower), bound), dtype))
  if operator in ("mag", "tree_mag"):
    p = data.draw(st.sampled_from((2.0, 4.0 / 3.0)), label="p")
    if operator == "mag":
      out = itk.soft_topk_mag(jnp.asarray(x), k, regularization_strength=l, p=p)
    else:
      tree = {"a": jnp.asarray(x[:2]), "b": jnp.asarray(x[2:])}
      leaves = itk.tree_soft_topk_mag(tree, k, regularization_strength=l, p=p)
      out = np.concatenate([leaves["a"], leaves["b"]])
    _check_mag(out, x64, k, l, p, dtype=dtype)
    return
  reg = data.draw(st.sampled_from(REGULARIZERS), label="regularizer")
  _, lam, p, name = _mask_solution(x64, k, l, reg)
  # README: no float threshold exists beyond the float range (documented limit).
  assume(math.isfinite(lam) and abs(lam) < top)
  regularizer = itk.PNorm(p) if name is None else name
  if operator in ("mask", "mask_native"):
    solver = "native" if operator == "mask_native" else "threshold"
    y = itk.soft_topk_mask(jnp.asarray(x), k, regularization_strength=l, regularizer=regularizer,
                           solver=solver)
  elif operator == "segment":
    both = np.concatenate([x, x[::-1]])
    out = itk.segment_soft_topk_mask(jnp.asarray(both), jnp.array([0] * n + [1] * n),
                                     jnp.asarray([k, k], dtype), num_segments=2,
                                     regularization_strength=l, regularizer=regularizer)
    _check_mask(np.asarray(out[n:])[::-1], x64, k, l, "pnorm" if name is None else name,
                dtype=dtype, p=p)  # the same row, reversed
    y = out[:n]
  else:
    tree = {"a": jnp.asarray(x[:2]), "b": jnp.asarray(x[2:])}
    leaves = itk.tree_soft_topk_mask(tree, k, regularization_strength=l, regularizer=regularizer)
    y = np.concatenate([leaves["a"], leaves["b"]])
  _check_mask(y, x64, k, l, "pnorm" if name is None else name, dtype=dtype, p=p)
