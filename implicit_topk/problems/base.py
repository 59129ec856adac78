r"""The interface every threshold problem provides, and the pieces they share.

A problem is a frozen dataclass (hashable, so solvers and jit caches can key on it)
with these members. Which entries of ``x`` form one row is the problem's ``layout``
(:mod:`implicit_topk.problems.layout`): by default the last axis of an array (batched
along leading axes), else the segments of a flat axis, or every leaf of a pytree; the
problem only reduces through it. ``k``, ``l`` and ``lam`` have the layout's row shape.

* ``optimality(lam, x, k, l)``: :math:`\phi`, nonincreasing in ``lam``, zero at the
  solution. Implicit derivatives are taken on it, and the Newton solver takes
  :math:`\phi'` and :math:`\phi''` from it by ``jax.jvp``.
* ``primal(lam, x, l)``: the operator's output for thresholds ``lam``.
* ``normalize(x, l)``: an equivalent input that is better conditioned (the mask
  subtracts a far-off row maximum: it is shift invariant); the operators solve on it.
* ``bracket(x, k, l) -> Bracket``: ``lo <= root <= hi`` and the rows whose answer is
  known without iterating (non-finite entries, saturated rows, no solution: NaN).
* ``initial_guess(x, k, l, bracket)``: a start inside the bracket, without any sort.
* ``snap(lam, x, k, l, known)``: moves ``lam`` onto an entry sitting at the root
  (:func:`snap_to_entry`) and into the interior of the flat root interval where the
  solution is binary (else returns it unchanged).
* ``step_scale(lam, l)``, ``residual_scale(lam, k)``, ``geometric``: the Newton
  solver's stopping scales, and whether to bisect geometrically.
* ``host_threshold(kernels, x, k, l)`` (optional): the exact threshold from the numba
  PAV kernels, NumPy in and out (``solver="pav"``).
* ``dykstra_threshold(x, k, l, *, tol, maxiter, unrolled)`` (optional):
  ``(lam, sweeps)`` by Dykstra's algorithm (``solver="dykstra"``).
* ``supports(solver_name)``: raises ``ValueError`` naming the option when the problem
  cannot be solved by that solver.
* ``layout``: the reduction layout; ``excluded_value``: the input value that an entry
  outside ``where=`` takes (one the operator never selects and maps to exactly 0).
* ``output_degree`` (with ``standardize=True``): ``d`` such that the operator at the
  strength ``l s^a`` (``a`` the operator's standardizing power) is ``s^d`` times the
  operator of ``x / s`` at ``l``: 0 for the mask, 1 for the top-k in magnitude.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np


class Bracket(NamedTuple):
  """A bracket of the root per row, and the rows answered without iterating.

  Returned by a problem's ``bracket(x, k, l)``; every field has the row shape.

  Attributes:
    lo: lower end, ``lo <= lam*``.
    hi: upper end, ``lam* <= hi``.
    known: bool; rows whose threshold is known without iterating (non-finite
      entries, saturated rows, rows without a solution).
    value: the threshold of the ``known`` rows (NaN where there is no solution);
      unused elsewhere.
  """

  lo: jax.Array
  hi: jax.Array
  known: jax.Array
  value: jax.Array


@runtime_checkable
class ThresholdProblem(Protocol):
  """What the solvers read from a problem (see :mod:`implicit_topk.problems.base`).

  Implemented by :class:`CappedSimplex` and :class:`Magnitude`; ``k``, ``l`` and
  ``lam`` have the row shape of the problem's layout.
  """

  geometric: bool

  def optimality(self, lam, x, k, l) -> jax.Array: ...

  def primal(self, lam, x, l) -> jax.Array: ...

  def normalize(self, x, l) -> jax.Array: ...

  def bracket(self, x, k, l) -> Bracket: ...

  def initial_guess(self, x, k, l, bracket: Bracket) -> jax.Array: ...

  def snap(self, lam, x, k, l, known) -> jax.Array: ...

  def step_scale(self, lam, l) -> jax.Array: ...

  def residual_scale(self, lam, k) -> jax.Array: ...

  def supports(self, solver_name: str) -> None: ...


def per_row(value, x) -> jax.Array:
  """Broadcasts a per-row quantity to ``x.shape[:-1] + (1,)`` in the dtype of ``x``."""
  return jnp.broadcast_to(jnp.asarray(value, x.dtype), x.shape[:-1])[..., None]


def finite_moments(layout, values):
  """Per-row mean and standard deviation of the finite entries of ``values``, and
  their count (at least 1), reduced through ``layout``."""
  dtype = layout.dtype(values)
  finite = layout.map(jnp.isfinite, values)
  count = jnp.maximum(layout.count(finite, dtype), 1)
  mean = layout.sum(layout.map(lambda v, f: jnp.where(f, v, 0), values, finite)) / count
  centered = layout.map(lambda v, f, m: jnp.where(f, v - m, 0), values, finite,
                        layout.expand(mean, values))
  return mean, jnp.sqrt(layout.sum(layout.map(jnp.square, centered)) / count), count


def upper_quantile_of_normal(fraction, dtype) -> Any:
  """z with P(N(0, 1) > z) = fraction (fraction clipped to [1e-6, 1 - 1e-6]).

  As ``sqrt(2) erfinv(1 - 2 fraction)``: ``lax.erf_inv`` is one primitive, so this also
  traces inside a Pallas kernel (``jax.scipy.special.ndtri`` evaluates polynomials
  stored in arrays, constants a kernel cannot capture). In float32 it is within 3e-3 of
  ``ndtri`` in the tails: a starting guess.
  """
  fraction = jnp.clip(jnp.asarray(fraction, dtype), 1e-6, 1 - 1e-6)
  return math.sqrt(2.0) * jax.lax.erf_inv(1 - 2 * fraction)


def midpoint(a, b):
  """``(a + b) / 2`` without overflow for any finite ``a``, ``b`` (both near the float
  maximum): halves the sum where the signs differ, else adds half the difference.
  (``0.5 * a + 0.5 * b`` is not enough: XLA refactors it into ``0.5 * (a + b)``.)"""
  same_sign = (a >= 0) == (b >= 0)
  return jnp.where(same_sign, a + 0.5 * (b - a), 0.5 * (a + b))


def entry_above(layout, lam, values, x, known, step_scale):
  r"""``(near, nearest, count)`` of :func:`snap_to_entry`: per row the smallest of
  ``values`` above ``lam``, whether it lies within the step tolerance (:math:`4\epsilon`
  ``step_scale``; not for rows in ``known`` or a non-finite ``lam``), and the count of
  ``values`` above ``lam``. One fused reduction over the row."""
  L = layout
  tol = 4 * float(np.finfo(L.dtype(x)).eps)
  above = L.map(lambda v, t: v > t, values, L.expand(lam, x))
  nearest = L.min(L.map(lambda v, a: jnp.where(a, v, jnp.inf), values, above))
  near = (nearest - lam <= tol * step_scale) & jnp.isfinite(lam) & ~known
  return near, nearest, L.count(above, L.dtype(x))


def snap_to_entry(problem, lam, values, x, k, l, known, *, step_scale, unit=1.0):
  r"""``lam`` moved onto the entry just above it where an entry sits at the root
  (``proofs/snap_to_entry.md``): a problem's ``snap`` calls it first.

  ``values`` are the entries in the threshold's units, zero output at ``values <= lam``
  (the mask's :math:`x_i - l z_0`, the magnitude's :math:`|x_i|`). With :math:`v` the
  smallest of them above ``lam`` and :math:`\mathrm{tol} = 4\epsilon` (the iteration's
  step tolerance), :math:`v` replaces ``lam`` where :math:`v - \lambda \le \mathrm{tol}`
  ``step_scale`` and :math:`|\phi(v)| \le \max(|\phi(\lambda)|,\ n\,\mathrm{tol}\max(k,
  1)` ``unit``:math:`)`, :math:`n` the entries above ``lam`` (the rounding of the sum;
  ``unit`` is :math:`\phi`'s unit). Rows in ``known`` and non-finite thresholds are
  kept. Two fused reductions over the row and two evaluations of :math:`\phi`."""
  near, nearest, count = entry_above(problem.layout, lam, values, x, known, step_scale)
  tol = 4 * float(np.finfo(problem.layout.dtype(x)).eps)
  candidate = jnp.where(near, nearest, lam)
  here = jnp.abs(problem.optimality(lam, x, k, l))
  there = jnp.abs(problem.optimality(candidate, x, k, l))
  closer = there <= jnp.maximum(here, count * tol * jnp.maximum(k, 1) * unit)
  return jnp.where(near & closer, candidate, lam)


#: Distinct top values :func:`top_order_statistics` reads (enough for k <= 2).
TOP_LEVELS = 3


def top_order_statistics(layout, values, ranks):
  r"""The order statistics :math:`v_{(r)}` (largest first, with multiplicity) of the
  finite ``values`` of each row, for each per-row rank ``r`` in ``ranks``, where ``r``
  falls among the row's :data:`TOP_LEVELS` largest distinct values; NaN elsewhere
  (unknown). :data:`TOP_LEVELS` maxima and counts of a row: no sort."""
  L = layout
  dtype = L.dtype(values)
  finite = L.map(lambda v: jnp.where(jnp.isfinite(v), v, -jnp.inf), values)
  upper = jnp.full(ranks[0].shape, jnp.inf, dtype)
  above = jnp.zeros(ranks[0].shape, dtype)
  levels = []  # (count of entries at or above the level, the level)
  for _ in range(TOP_LEVELS):
    level = L.max(L.map(lambda v, u: jnp.where(v < u, v, -jnp.inf), finite, L.expand(upper, values)))
    above = above + L.count(L.map(lambda v, t: v == t, finite, L.expand(level, values)), dtype)
    levels.append((above, level))
    upper = level
  out = []
  for rank in ranks:
    value = jnp.full(rank.shape, jnp.nan, dtype)
    for count, level in reversed(levels):
      value = jnp.where((rank <= count) & jnp.isfinite(level), level, value)
    out.append(value)
  return out
