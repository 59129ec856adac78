r"""The top-k mask at the ends of the float range: an exact rescaling, and binary rows
decided exactly where the shift by the row maximum rounds.

The mask of Sander et al. 2023 ("Fast, differentiable and sparse top-k: a convex analysis
perspective", ICML) depends on ``x`` and the strength ``l`` only through
:math:`(x_i - \lambda)/l`: multiplying a row and its strength by the same power of two
changes no answer, and is exact. The threshold solvers (``threshold``, ``pav``,
``pallas``) use both facts (``proofs/float_range.md``):

1. **Rescaling** (:func:`scale_exponent`). Each row is multiplied by :math:`2^{-E}`,
   :math:`E` the smallest shift that keeps every entry below :math:`2^{e_{max}-2}` in
   magnitude (so no difference of two entries overflows: near the float maximum the
   shift by the row maximum used to clamp ``-1e308 - 1.7e308`` to the float range and
   merge distinct entries), and otherwise the largest shift up to 0 that keeps ``l``
   times the precision a normal float (XLA flushes subnormal results to zero on CPU and
   GPU: a row near the float minimum with a strength near it had thresholds and bracket
   halvings flushed to zero, and rows that did not sum to ``k``).
2. **Binary rows hidden by the shift** (:func:`hidden_binary_rows`). Rows far from 0
   relative to ``l`` are solved relative to their largest entry, and ``x_i - x_max`` is
   rounded. A row that is binary in exact arithmetic (integer ``k``, a gap of at least
   ``l (z_1 - z_0)`` between the k-th and (k+1)-th largest entries, ``[z_0, z_1]`` the
   regularizer's saturation interval, both ends finite: the p-norms) can look
   fractional after that rounding (two entries a few ulps apart round together), and a
   fractional one binary. Where an entry near the saturation band around the threshold
   was shifted inexactly (its exact error, by Knuth's TwoSum, is not 0) or lies where
   the float grid is coarser than ``l``, the binary test is decided again on the
   unshifted row: the k-th largest
   entry by bisection of the floats' ordered bit patterns (at most 64 counting passes in
   float64, 32 in float32, only while such a row is pending), then ``a - b >= l (z_1 -
   z_0)`` in one rounding (exact for the p-norms: ``l`` is a float and rounding is
   monotone). Such rows get the exact 0/1 mask and zero derivatives (a binary row's
   threshold is locally constant).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from implicit_topk.solvers import threshold as _threshold


def _float_layout(dtype):
  """(int type, mantissa bits, exponent bias) of a float dtype."""
  dtype = np.dtype(dtype)
  if dtype == np.float64:
    return jnp.int64, 52, 1023
  if dtype == np.float32:
    return jnp.int32, 23, 127
  raise TypeError(f"the threshold kernels accumulate in float32 or float64; got {dtype}.")


def _floor_log2(v):
  """``floor(log2(v))`` for finite ``v > 0`` from its exponent bits; ``-bias`` for 0 and
  subnormals (read as 0 by XLA)."""
  itype, mant, bias = _float_layout(v.dtype)
  bits = jax.lax.bitcast_convert_type(v, itype)
  return ((bits >> mant) & (2 * bias + 1)) - bias


def _power_of_two(e, dtype):
  """``2.0 ** e`` for integers ``e`` in ``[1 - bias, bias]``, built from its bits."""
  itype, mant, bias = _float_layout(dtype)
  return jax.lax.bitcast_convert_type((e.astype(itype) + bias) << mant, dtype)


def scale_exponent(layout, x, l):
  r"""Per row, the integer :math:`E` (in ``x``'s float dtype's integer type) of the
  exact rescaling :math:`x 2^{-E}`, :math:`l 2^{-E}`.

  With :math:`e_x = \lfloor\log_2\max_i |x_i|\rfloor` (finite entries) and
  :math:`e_l = \lfloor\log_2 l\rfloor`: :math:`E_{lo} = e_x + 3 - e_{max}` keeps every
  entry below :math:`2^{e_{max} - 2}` (differences stay finite), :math:`E_{hi} = e_l -
  e_{min} - m` keeps :math:`l 2^{-E}` at least :math:`2^{e_{min} + m}` (its ulps normal;
  ``m`` the mantissa digits), and :math:`E = \max(E_{lo}, \min(0, E_{hi}))`: 0 for every
  row away from both ends of the range.
  """
  dtype = layout.dtype(x)
  _, mant, bias = _float_layout(dtype)
  top = layout.max(layout.map(lambda v: jnp.where(jnp.isfinite(v), jnp.abs(v), 0), x))
  e_x, e_l = _floor_log2(top), _floor_log2(l)
  e_lo = e_x + 2 - bias  # e_max = bias + 1
  e_hi = e_l + (bias - 1) - (mant + 1)  # e_min = 1 - bias, m = mant + 1 digits
  e = jnp.maximum(e_lo, jnp.minimum(0, e_hi))
  return jnp.clip(e, 2 - bias, bias - 2)


def rescale(layout, x, l, e):
  """``(x 2^-e, l 2^-e)`` per row (exact: powers of two; the factor is built from the
  integers ``e``, so it is constant for derivatives)."""
  factor = _power_of_two(-e, layout.dtype(x))
  return layout.map(lambda v, f: v * f, x, layout.expand(factor, x)), l * factor


def unscale(value, e):
  """``value 2^e`` (a threshold back in the coordinates of the unscaled row)."""
  return value * _power_of_two(e, value.dtype)


def _two_sum_error(a, b):
  """The exact rounding error of ``a + b`` (Knuth's TwoSum; no overflow assumed)."""
  s = a + b
  b_virtual = s - a
  a_virtual = s - b_virtual
  return (a - a_virtual) + (b - b_virtual)


def hidden_binary_rows(problem, layout, x, shifted, origin, lam, k, l):
  r"""``(fix, top)`` per row: whether the row is binary in exact arithmetic although its
  shift by ``origin`` was inexact near the threshold, and its k-th largest finite entry.

  ``x`` are the (rescaled) rows, ``shifted = problem.shift(x, origin)`` the rows the
  threshold ``lam`` was solved on. Only for regularizers whose saturation interval
  ``[z0, z1]`` is finite (else ``fix`` is all false). A row is suspect when ``k`` minus
  its ``+inf`` entries is an integer strictly between 0 and its finite count, it has no
  NaN, and an entry within ``w = 8 eps |s|`` of the band ``[lam + l z0, lam + l z1]``
  (``s`` its shifted value) was shifted inexactly (Knuth's TwoSum error is not 0) or
  sits where the float grid is coarse (``w >= l (z1 - z0)``): only then can the shift
  have changed the binary test (``proofs/float_range.md``, item 5). Suspect rows find their k-th largest finite entry ``a`` by bisection of
  the ordered bit patterns (:func:`implicit_topk.solvers.threshold.ordered_midpoint`),
  then the largest entry below it ``b``; ``fix`` where ``a`` is not tied and ``a - b >=
  l (z1 - z0)``. The exact mask of a fixed row is :func:`hard_mask`.
  """
  z0, z1 = problem.regularizer.saturation
  L = layout
  dtype = L.dtype(x)
  if not (np.isfinite(z0) and np.isfinite(z1)):
    false = L.count(L.map(lambda v: v != v, x), jnp.int32) < 0
    return false, jnp.zeros_like(lam)
  lam_e, l_e, o_e = L.expand(lam, x), L.expand(l, x), L.expand(origin, x)

  def score(v, s, lam_, l_, o):
    """2 for NaN, 1 for an entry whose shift may have changed the binary test, else 0."""
    error = _two_sum_error(v, -o)
    ulps = 8 * np.finfo(dtype).eps * jnp.abs(s)  # 4 to 8 ulps of s
    near = (s >= lam_ + l_ * z0 - ulps) & (s <= lam_ + l_ * z1 + ulps)
    coarse = ulps >= l_ * (z1 - z0)
    flagged = jnp.isfinite(v) & ((error != 0) | coarse) & near
    return jnp.where(jnp.isnan(v), 2, jnp.where(flagged, 1, 0)).astype(dtype)

  # One pass for every row; the bisection below runs only while a suspect row is pending.
  suspect = (L.max(L.map(score, x, shifted, lam_e, l_e, o_e)) == 1) & (k == jnp.floor(k))

  # Every reduction in the loop depends on the carry (none is loop-invariant, so XLA
  # hoists no full-size array out of the loop: a row that is not suspect costs nothing).
  def body(carry):
    lo, hi, pending, a, tied, below, present = carry
    mid = _threshold.ordered_midpoint(lo, hi)
    lo_e, mid_e = L.expand(lo, x), L.expand(mid, x)
    at_least = L.count(L.map(lambda v, m: v >= m, x, mid_e), dtype)
    at_lo = L.count(L.map(lambda v, m: v >= m, x, lo_e), dtype)
    at_lo_exactly = L.count(L.map(lambda v, m: v == m, x, lo_e), dtype)
    under = L.max(L.map(lambda v, m: jnp.where(v < m, v, -jnp.inf), x, lo_e))
    exhausted = (mid == lo) | (mid == hi)
    finished = pending & exhausted
    a = jnp.where(finished, lo, a)
    tied = jnp.where(finished, at_lo > k, tied)
    below = jnp.where(finished, under, below)
    present = jnp.where(finished, at_lo_exactly > 0, present)
    go_up = pending & ~exhausted & (at_least >= k)
    go_down = pending & ~exhausted & (at_least < k)
    return (jnp.where(go_up, mid, lo), jnp.where(go_down, mid, hi), pending & ~exhausted,
            a, tied, below, present)

  def cond(carry):
    return jnp.sum(jnp.where(carry[2], 1, 0)) > 0  # no boolean `any` reduction (Triton)

  # P(c) = #{x_i >= c} >= k (+inf entries counted, NaN rows excluded) from [lowest, inf):
  # lo ends at the k-th largest entry when it is finite; where it is +inf (k at most the
  # row's +inf entries) lo ends at the largest float, which is no entry or a tied one.
  lowest = jnp.full_like(lam, jnp.finfo(dtype).min)
  false = suspect & ~suspect
  carry = (lowest, jnp.full_like(lam, jnp.inf), suspect, lowest, false, lowest, false)
  _, _, _, a, tied, b, present = jax.lax.while_loop(cond, body, carry)
  fix = (suspect & present & ~tied & (b > -jnp.inf) & (a - b >= l * (z1 - z0)))
  return fix, a


def hard_mask(x, top):
  """The exact 0/1 mask of a binary row with k-th largest finite entry ``top`` (one
  entry; ``+inf`` is 1, ``-inf`` 0)."""
  return jnp.where((x == jnp.inf) | (jnp.isfinite(x) & (x >= top)), 1, 0).astype(x.dtype)


def solve_and_map(solver, x, k, l):
  """``solver.solve_and_map`` for the threshold solvers that normalize in XLA
  (``threshold``, ``pav``): the rows rescaled (:func:`scale_exponent`), normalized,
  solved and mapped, then binary rows hidden by the shift replaced by their exact mask
  (:func:`hidden_binary_rows`). Problems without a shift (the magnitude operator) take
  the solver's plain path."""
  from implicit_topk.solvers.base import ThresholdRootSolver  # pylint: disable=g-import-not-at-top
  problem, L = solver.problem, solver.layout
  if not hasattr(problem, "shift"):
    return ThresholdRootSolver.solve_and_map(solver, x, k, l)
  e = scale_exponent(L, x, l)
  x, l = rescale(L, x, l, e)
  origin = jax.lax.stop_gradient(normalization_origin(problem, x, l, L))
  shifted = problem.shift(x, origin)
  step = solver.run(None, shifted, k, l)
  y = solver.primal(step.params, shifted, l)
  fix, top = hidden_binary_rows(problem, L, *jax.lax.stop_gradient(
      (x, shifted, origin, step.params, k, l)))
  y = L.map(lambda v, out, f, t: jnp.where(f > 0, hard_mask(v, t), out),
            jax.lax.stop_gradient(x), y, L.expand(fix, x), L.expand(top, x))
  return y, step.state


def normalization_origin(problem, x, l, layout=None):
  """The per-row origin that ``problem.normalize`` subtracts (0 for problems without
  a shift, e.g. the magnitude operator), so that ``problem.shift(x, origin)`` is
  ``problem.normalize(x, l)`` (:meth:`CappedSimplex.origin`, rows laid out by
  ``layout``, default the problem's)."""
  if not hasattr(problem, "shift"):
    return jnp.zeros_like(l)
  return problem.origin(x, l, layout)