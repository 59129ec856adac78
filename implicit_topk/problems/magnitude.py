r"""The top-k in magnitude (Sander et al., 2023) as a threshold problem.

With :math:`s = |x|`, :math:`t_i = (s_i - \lambda)_+` and :math:`g(u) = u^{1/(p-1)}`
(the p-norm link), the output is

.. math::

    \mathrm{out}_i = \mathrm{sign}(x_i)\,\min\big(s_i,\ t_i + g(t_i / l)\big)

with :math:`\lambda \ge 0` the root of the nonincreasing (in sign) function

.. math::

    F(\lambda) = \sum_i \min\big(\lambda, g(t_i / l)\big) - k\lambda

(``proofs/magnitude_threshold.md``). The roots can sit many decades below
:math:`\max_i s_i`, so the Newton solver bisects geometrically and measures steps
relative to :math:`\lambda`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from implicit_topk import regularizers as _regularizers
from implicit_topk.kernels import isotonic_dykstra as _dykstra
from implicit_topk.problems import layout as _layout
from implicit_topk.problems.base import (Bracket, entry_above, midpoint, snap_to_entry,
                                         top_order_statistics, upper_quantile_of_normal)
from implicit_topk.problems.capped_simplex import _check_sortable

_BISECT_STEPS = 64  # scalar bisection steps for h^{-1} when snapping binary rows


def _scale(lam):
  """The factor of :meth:`Magnitude.optimality`: ``2^-b`` (``b`` the bits of the dtype)
  where ``lam >= max_float 2^-b``, else 1. Then ``(n + k) lam`` times it stays finite for
  any ``n + k < 2^b``, and below the switch no factor is needed."""
  bits = 8 * jnp.dtype(lam.dtype).itemsize
  factor = jnp.asarray(2.0**-bits, lam.dtype)
  return jnp.where(lam >= jnp.finfo(lam.dtype).max * factor, factor, jnp.ones_like(lam))


def _excess(lam, s):
  """t = (s - lam)_+, with derivative 0 at the kink."""
  return jnp.where(s > lam, s - lam, jnp.zeros_like(s))


@dataclasses.dataclass(frozen=True)
class Magnitude:
  r"""The soft top-k in magnitude as a threshold problem, along the rows of ``layout``.

  Keeps the (soft) top-k entries of ``x`` in absolute value with the p-norm
  regularizer ``PNorm(p)`` (Sander et al. 2023, "Fast, differentiable and sparse
  top-k: a convex analysis perspective", ICML): the problem that
  :func:`~implicit_topk.soft_topk_mag` solves. See the module
  :mod:`implicit_topk.problems.magnitude` for the output map and :math:`\phi`.

  Attributes:
    p: the p-norm exponent, > 1 (default ``4/3``); stored as a float.
    layout: which entries form a row (default :class:`LastAxis`: the last axis).

  Example:
    >>> import jax.numpy as jnp
    >>> import implicit_topk as itk
    >>> solver = itk.ThresholdSolver(problem=itk.problems.Magnitude(p=2.0))
    >>> solver.apply(jnp.array([2.0, -4.0, 1.0]), 1.0, 2.0)  # k = 1, strength 2
    Array([ 0.75, -3.75,  0.  ], dtype=float32)
  """

  p: float = 4.0 / 3.0
  layout: Any = _layout.DEFAULT
  geometric = True
  # An entry outside `where=` becomes 0: never selected, output exactly 0.
  excluded_value = 0.0
  # mag(c x, l c^(2 - p)) = c mag(x, l) (c > 0): degree 1 in x.
  output_degree = 1

  def __post_init__(self):
    object.__setattr__(self, "p", float(_regularizers.PNorm(self.p).p))

  def with_layout(self, layout) -> "Magnitude":
    return dataclasses.replace(self, layout=layout)

  @property
  def regularizer(self) -> _regularizers.PNorm:
    return _regularizers.PNorm(self.p)

  @property
  def piece_degree(self):
    """The degree of the polynomial that F is between two kinks (``3`` for p = 4/3),
    or ``None``: F is linear in ``lam`` plus a sum of ``g((s_i - lam) / l)``."""
    return _regularizers.piece_degree(self.regularizer)

  def _link(self, t, l):
    """g(t / l) for 0 < t < inf, 0 for t = 0, inf for t = inf; finite derivatives.

    For ``p > 2`` as ``t^a / l^a`` (:meth:`PNorm.link_of_ratio`): ``t / l`` can leave the
    float range where ``g`` of it does not.
    """
    inside = (t > 0) & (t < jnp.inf)
    # l where t is not inside: g(1) = 1, no overflow whose derivative (0 * inf) would
    # make the masked-out cotangents NaN (t = 1 with l = 1e-20 gives 1e60 at p = 4/3)
    # (where broadcasts l: t's sharding, which broadcast_to would drop on an explicit mesh)
    safe = jnp.where(inside, t, jnp.asarray(l, t.dtype))
    value = self.regularizer.link_of_ratio(safe, l)
    return jnp.where(inside, value, jnp.where(t > 0, t, jnp.zeros_like(t)))

  def _h(self, u, l):
    """``h(u) = u + l u^(p-1)`` for ``u >= 0``: ``h(abs(y*_i))`` is the output of a kept
    entry; for ``p > 2`` as ``u + (u l^a)^(p-1)`` (``u^(p-1)`` alone can underflow while
    ``l u^(p-1)`` is of the order of ``u``)."""
    pm1 = jnp.asarray(self.p - 1.0, u.dtype)
    a = self.regularizer.exponent
    if a < 1:
      return u + jnp.power(u * jnp.power(l, jnp.asarray(a, u.dtype)), pm1)
    return u + l * jnp.power(u, pm1)

  # -- the problem ----------------------------------------------------------------
  def normalize(self, x, l):
    """``x`` as is: the operator is not shift invariant and its threshold is relative
    to ``|x|`` already (geometric bisection, relative steps)."""
    return x

  def _out_entries(self, x, lam, l):
    s = jnp.abs(x)
    t = _excess(lam, s)
    out = jnp.sign(x) * jnp.minimum(s, t + self._link(t, l))
    return jnp.where(jnp.isnan(lam) | jnp.isnan(x), jnp.nan, out)

  def primal(self, lam, x, l):
    """``sign(x_i) min(abs(x_i), t_i + g(t_i / l))``, ``t_i = (abs(x_i) - lam)_+``; NaN
    propagates."""
    L = self.layout
    return L.map(self._out_entries, x, L.expand(lam, x), L.expand(l, x))

  def optimality(self, lam, x, k, l):
    r"""F(lam) = sum_i min(lam, g(t_i / l)) - k lam, one entry per row.

    Written as ``lam * (#saturated - k) + sum_unsaturated g`` so that it is exactly 0
    on the flat root interval of a binary solution. Every unsaturated ``g`` is at most
    ``lam``, so ``|F| <= (n + k) lam``, which overflows for ``lam`` near the float
    maximum: there ``F`` is returned times :func:`_scale` (a power of 2, exact, the
    same roots and Newton steps; :meth:`residual_scale` carries the same factor).
    """
    L = self.layout
    G = L.map(lambda v, lam_, l_: self._link(_excess(lam_, jnp.abs(v)), l_),
              x, L.expand(lam, x), L.expand(l, x))
    saturated = L.map(lambda g, lam_: g > lam_, G, L.expand(lam, x))
    count = L.count(saturated, L.dtype(x))
    c = _scale(lam)
    unsaturated = L.map(lambda g, sat, c_: jnp.where(sat, jnp.zeros_like(g), g * c_),
                        G, saturated, L.expand(c, x))
    return (c * lam) * (count - k) + L.sum(unsaturated)

  def step_scale(self, lam, l):
    return lam

  def residual_scale(self, lam, k):
    return (k + 1) * (_scale(lam) * lam)

  def bracket(self, x, k, l) -> Bracket:
    """Rows answered without iterating, and a bracket [lo, hi] of the others' root.

    ``|x_i| = inf`` entries are kept and use up ``k``; with ``k_f = k - #inf``:
    NaN in the row, ``k_f < 0`` or ``k`` above the row's length: NaN; ``k_f = 0``: every
    finite entry is 0 (``lam = max_finite + l``); at most ``k_f`` finite nonzero
    entries: ``lam = 0`` (output = x). ``hi = max_finite s`` (F(hi) = -k_f hi < 0) and
    ``lo = min(m / 2, g(m / (2 l)))``, ``m`` the smallest nonzero finite ``s``:
    ``h(lo) <= m``, so every nonzero entry is saturated at ``lo`` and F(lo) > 0
    (``lo`` can underflow to 0; the iteration then bisects arithmetically).
    """
    L = self.layout
    dtype = L.dtype(x)
    s = L.map(jnp.abs, x)
    nonzero = L.map(lambda v: jnp.isfinite(v) & (v > 0), s)
    m = L.min(L.map(lambda v, nz: jnp.where(nz, v, jnp.inf), s, nonzero))
    m = jnp.where(jnp.isfinite(m), m, 1)
    lo = jnp.minimum(0.5 * m, self._link(0.5 * m, l))
    s_max = jnp.maximum(L.max(L.map(lambda v: jnp.where(jnp.isfinite(v), v, 0), s)), 0)
    n_inf = L.count(L.map(lambda v: v == jnp.inf, s), dtype)
    nnz = L.count(nonzero, dtype)
    k_f = k - n_inf
    length = L.count(L.map(lambda v: jnp.ones(v.shape, bool), s), dtype)
    infeasible = L.any(L.map(jnp.isnan, s)) | (k_f < 0) | (k > length)
    all_zero = k_f == 0
    all_kept = nnz <= k_f
    known = infeasible | all_zero | all_kept
    value = jnp.where(infeasible, jnp.nan, jnp.where(all_zero, s_max + l, 0)).astype(dtype)
    lo, hi = jnp.minimum(lo, 0.5 * s_max), s_max
    # Tightened by the row's top magnitudes (``proofs/native_magnitude_bracket.md``,
    # statement 1): phi(lam) >= 0 for h(lam) <= s_(m), phi(s_(j+1)) <= 0. A lower end
    # with h(lo) <= s_(m): min(s_(m) / 2, g(s_(m) / (2 l))), as above for the smallest s.
    top_m, next_j = top_order_statistics(L, s, (jnp.ceil(k), jnp.floor(k) + 1))
    usable = (n_inf == 0) & (k >= 1)
    tight_lo = jnp.minimum(0.5 * top_m, self._link(0.5 * top_m, l))
    lo = jnp.where(usable & (tight_lo > lo) & (tight_lo < hi), tight_lo, lo)
    hi = jnp.where(usable & (next_j > lo) & (next_j < hi), next_j, hi)
    return Bracket(lo, hi, known, value)

  def initial_guess(self, x, k, l, bracket: Bracket):
    r"""The (k+1)-th largest :math:`|x_i|` as a half-normal sample would put it.

    :math:`\sigma\,\Phi^{-1}(1 - k / (2n))` with :math:`\sigma` the row's finite root
    mean square: one reduction, no sort; used when strictly inside the bracket.
    """
    L = self.layout
    dtype = L.dtype(x)
    finite = L.map(jnp.isfinite, x)
    count = jnp.maximum(L.count(finite, dtype), 1)
    rms = jnp.sqrt(L.sum(L.map(lambda v, f: jnp.where(f, v * v, 0), x, finite)) / count)
    guess = rms * upper_quantile_of_normal(0.5 * k / count, dtype)
    inside = (guess > bracket.lo) & (guess < bracket.hi)
    return jnp.where(inside, guess, midpoint(bracket.lo, bracket.hi))

  def snap(self, lam, x, k, l, known):
    r"""Moves ``lam`` onto a magnitude sitting at the root, then into the interior of
    the flat root interval of a binary solution.

    A magnitude :math:`s_j = \lambda^\star` has the exact output 0, but an iteration
    that stops a few ulps below leaves it about :math:`s_j - \hat\lambda`: the smallest
    magnitude above :math:`\hat\lambda` replaces it where it lies within 4 ulps of it
    and sums as closely (:func:`~implicit_topk.problems.base.snap_to_entry`).

    With integer ``k``, the top set ``S`` (here: entries more than half saturated),
    :math:`A = \max_{i \notin S} s_i` and :math:`h(A) < \min_{i \in S} s_i`, every
    :math:`\lambda \in [A, B]`, :math:`h(B) = \min_S s_i`, is a root and the output is
    exactly the hard top-k in magnitude. An iteration can stop a few ulps outside
    (leaving 1e-17 for an exact 0): return :math:`(A + B)/2` instead, with ``B`` from a
    scalar bisection on the increasing ``h``. Other rows keep ``lam``.
    """
    lam = snap_to_entry(self, lam, self.layout.map(jnp.abs, x), x, k, l, known, step_scale=lam,
                        unit=_scale(lam) * lam)
    binary, A, top_min = self._binary_rows(lam, x, k, l, known)

    def bisect(_, bounds):
      lo, hi = bounds
      mid = midpoint(lo, hi)
      below = self._h(mid, l) <= top_min
      return jnp.where(below, mid, lo), jnp.where(below, hi, mid)

    B, _ = jax.lax.fori_loop(0, _BISECT_STEPS, bisect, (A, top_min))
    return jnp.where(binary, midpoint(A, B), lam)  # A + B can overflow

  def _binary_rows(self, lam, x, k, l, known):
    """``(binary, A, min_S s)`` of :meth:`snap` (``A`` and ``min_S s`` set to 1 and 2
    where they are not finite and positive): one fused reduction over the row."""
    L = self.layout
    s = L.map(jnp.abs, x)
    top = L.map(lambda v, lam_, l_: self._link(_excess(lam_, v), l_) > 0.5 * lam_,
                s, L.expand(lam, x), L.expand(l, x))
    count = L.count(top, L.dtype(x))
    A = L.max(L.map(lambda v, t: jnp.where(t, -jnp.inf, v), s, top))
    top_min = L.min(L.map(lambda v, t: jnp.where(t, v, jnp.inf), s, top))
    ok = jnp.isfinite(A) & jnp.isfinite(top_min) & (A > 0)
    A = jnp.where(ok, A, 1)
    top_min = jnp.where(ok, top_min, 2)
    return ok & (count == k) & (self._h(A, l) < top_min) & ~known, A, top_min

  def _snap_moves_a_row(self, lam, x, k, l, known):
    r"""Whether :meth:`snap` can move any row's ``lam``: a magnitude within the step
    tolerance above it, or a binary row whose ``lam`` is not strictly inside its flat
    root interval (:math:`A < \lambda` and :math:`h(\lambda) < \min_S s`). Two fused
    reductions, no bisection."""
    near, _, _ = entry_above(self.layout, lam, self.layout.map(jnp.abs, x), x, known, lam)
    binary, A, top_min = self._binary_rows(lam, x, k, l, known)
    inside = (A < lam) & (self._h(lam, l) < top_min)
    return jnp.any(near | (binary & ~inside))

  # -- solver-specific pieces ------------------------------------------------------
  def supports(self, solver_name: str) -> None:
    """``ValueError`` naming the solver where it cannot solve this problem: the sorting
    solvers and the kernels need whole rows of the last axis, ``"dykstra"`` ``p = 2``.
    ``"native"`` takes every ``p > 1``: its kernel
    (:mod:`~implicit_topk.kernels.cpu.native_magnitude`) was checked against an
    independent reference from ``p = 1 + 1e-12`` to ``1e12``."""
    _check_sortable(self.layout, solver_name)
    if solver_name == "dykstra" and self.p != 2.0:
      raise ValueError(f"solver='dykstra' supports p=2 only; got p={self.p}. "
                       "Use solver='pav' or 'threshold' for other p.")

  def native_threshold(self, x, k, l):
    """Exact thresholds and Newton passes by the native CPU kernel (an XLA custom call;
    :mod:`implicit_topk.kernels.cpu.native_magnitude`), one per row of the last axis."""
    from implicit_topk.kernels.cpu import native_calls
    lam, passes, _ = native_calls.magnitude_kernel(x, k, l, self.p)
    # As the PAV and Newton solvers: a binary row's threshold moves into its flat root
    # interval. Near the float maximum F is flat to rounding on either side of the
    # interval's end (1e264 against 1e307), so the iteration can stop an ulp outside it;
    # a magnitude at the threshold gets it. The kernel already returns binary rows'
    # thresholds inside their interval, so the snap (its scalar bisection: 18-43% of the
    # operator) runs only where it can move a row. A CPU-only path: the cond costs no
    # host round trip as on XLA:GPU (under vmap it becomes a select, the snap as before).
    bracket = self.bracket(x, k, l)
    known = bracket.known
    # rows without a solution (a traced k above the row's length, ...): NaN, as the
    # bracket answers them for the other solvers
    lam = jnp.where(known & jnp.isnan(bracket.value), jnp.nan, lam)
    lam = jax.lax.cond(self._snap_moves_a_row(lam, x, k, l, known),
                       lambda lam: self.snap(lam, x, k, l, known), lambda lam: lam, lam)
    return lam, passes

  def pav_threshold(self, x, k, l):
    """Exact thresholds by the PAV kernel on the magnitude dual (an XLA custom call)."""
    from implicit_topk.kernels.cpu import pav_calls
    return pav_calls.magnitude_threshold(x, k, l, self.p)

  def dykstra_threshold(self, x, k, l, *, tol, maxiter, unrolled):
    r"""``p = 2``: Dykstra on the weighted isotonic regression of the magnitude dual.

    With :math:`s` = ``abs(x)`` sorted descending and :math:`w = (1,\dots,1,k-\lfloor
    k\rfloor,0,\dots)`, the dual is
    :math:`\min_{v \downarrow} \sum_i (1 + l w_i)(v_i - s_i / (1 + l w_i))^2`; the
    threshold is its value at index :math:`\lfloor k\rfloor` (0-based). Approximate:
    it stops once a sweep changes the dual by at most ``tol``, or after ``maxiter``.
    """
    bracket = self.bracket(x, k, l)
    # p = 2: mag(c x, l) = c mag(x, l). A power of 2 c brings the largest finite magnitude
    # to 2^(max exponent - 16) or below, so that Dykstra's pair means (and the surrogate
    # of an inf) stay finite near the float maximum; exact, and lam / c is the threshold.
    # Only rows that need it are scaled: an entry it sends below the normal floats is
    # then below lam's resolution.
    s = jnp.abs(x)
    top = jnp.max(jnp.where(jnp.isfinite(s), s, 0), axis=-1)
    shift = jnp.maximum(jnp.frexp(top)[1] - (jnp.finfo(x.dtype).maxexp - 16), 0)
    s = jnp.ldexp(s, -shift[..., None])
    # inf -> a magnitude that is kept whenever the row has a threshold; NaN rows are known.
    big = ((jnp.ldexp(top, -shift) + 1) * (2 + l))[..., None]
    surrogate = jnp.where(s == jnp.inf, big, jnp.where(jnp.isnan(s), 0, s))
    sorted_s = -jnp.sort(-surrogate, axis=-1)
    n = x.shape[-1]
    w = jnp.clip(k[..., None] - jnp.arange(n, dtype=x.dtype), 0, 1)
    rho = 1 + l[..., None] * w
    if unrolled:
      v = _dykstra.isotonic_dykstra_unrolled(sorted_s / rho, rho, num_sweeps=maxiter)
      sweeps = jnp.full(x.shape[:-1], maxiter, jnp.int32)
    else:
      result = _dykstra.isotonic_dykstra(sorted_s / rho, rho, tol=tol, max_iter=maxiter)
      v, sweeps = result.v, result.iter_num
    index = jnp.clip(jnp.floor(k).astype(jnp.int32), 0, n - 1)
    lam = jnp.ldexp(jnp.take_along_axis(v, index[..., None], axis=-1)[..., 0], shift)
    lam = self.snap(lam, x, k, l, bracket.known)
    return jnp.where(bracket.known, bracket.value, lam), sweeps
