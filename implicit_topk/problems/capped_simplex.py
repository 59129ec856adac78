r"""The top-k mask: a regularized linear program over the capped simplex.

.. math::

    y^\star = \arg\max_{y \in [0,1]^n,\ \sum_i y_i = k}\ \langle x, y\rangle - l\,\Omega(y),
    \qquad y_i = \mathrm{mask}\big((x_i - \lambda) / l\big),

for a separable regularizer with saturation interval :math:`[z_0, z_1]` (the mask is 0
below :math:`z_0` and 1 above :math:`z_1`), and :math:`\lambda` the root of

.. math::

    \phi(\lambda) = \sum_i \mathrm{mask}\big((x_i - \lambda) / l\big) - k,

which is continuous and nonincreasing (``proofs/threshold_form.md``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from implicit_topk import _quotient
from implicit_topk import regularizers as _regularizers
from implicit_topk.kernels import isotonic_dykstra as _dykstra
from implicit_topk.problems import layout as _layout
from implicit_topk.problems.base import (Bracket, finite_moments, midpoint, snap_to_entry,
                                         top_order_statistics, upper_quantile_of_normal)


@dataclasses.dataclass(frozen=True)
class CappedSimplex:
  r"""The soft top-k mask as a threshold problem, along the rows of ``layout``.

  :math:`y^\star = \arg\max_{y \in [0,1]^n,\ \sum_i y_i = k} \langle x, y\rangle
  - l\,\Omega(y)` with :math:`y_i = \mathrm{mask}((x_i - \lambda) / l)` and
  :math:`\phi(\lambda) = \sum_i y_i(\lambda) - k` (Sander et al. 2023, "Fast,
  differentiable and sparse top-k: a convex analysis perspective", ICML). The
  problem that :func:`~implicit_topk.soft_topk_mask` and the solvers solve by
  default.

  Attributes:
    regularizer: the separable regularizer :math:`\Omega`, an
      :class:`implicit_topk.Regularizer` (default ``PNorm(4/3)``).
    layout: which entries form a row (default :class:`LastAxis`: the last axis).

  Example:
    >>> import jax.numpy as jnp
    >>> import implicit_topk as itk
    >>> problem = itk.problems.CappedSimplex(itk.PNorm(2.0))
    >>> solver = itk.ThresholdSolver(problem=problem)
    >>> solver.apply(jnp.array([3.0, 1.0, 2.0, -1.0]), 2.0, 2.0)
    Array([1.  , 0.25, 0.75, 0.  ], dtype=float32)
  """

  regularizer: Any = dataclasses.field(default_factory=_regularizers.PNorm)
  layout: Any = _layout.DEFAULT
  # After `normalize` the row's top entry is 0, and for a small k the root can sit many
  # decades closer to it than the bracket is wide (p > 2): bisect geometrically too.
  geometric = True
  # An entry outside `where=` becomes -inf: never selected, mask exactly 0, derivative 0.
  excluded_value = -np.inf
  # The mask is invariant under x -> c x, l -> c l (c > 0): degree 0 in x.
  output_degree = 0

  def __post_init__(self):
    _regularizers.check_protocol(self.regularizer)

  def with_layout(self, layout) -> "CappedSimplex":
    return dataclasses.replace(self, layout=layout)

  @property
  def piece_degree(self):
    """The degree of the polynomial that phi is between two kinks (p-norm ``a = 1/(p-1)``
    an int <= 3: ``3`` for p = 4/3, ``1`` for p = 2), else ``None``."""
    return _regularizers.piece_degree(self.regularizer)

  # -- the problem ----------------------------------------------------------------
  def normalize(self, x, l):
    """``x`` minus its row's largest finite entry where that entry exceeds
    ``l / sqrt(eps)`` in magnitude (held constant for derivatives); else ``x``.

    The mask is shift invariant, so this changes no answer. Beyond that scale the
    threshold and ``x_i - lam`` could not be resolved in unshifted coordinates (e.g.
    ``x = (1e20, 1e20, 0, 1)``, ``l = 1``); below it the unshifted coordinates resolve
    a threshold near 0 best, so rows are left as they are. Finite entries stay finite
    (a difference beyond the float range is clamped to the most negative finite
    value); +-inf and NaN stay as they are.
    """
    return self.shift(x, jax.lax.stop_gradient(self.origin(x, l)))

  def origin(self, x, l, layout=None):
    """The per-row origin :meth:`normalize` subtracts: the row's largest finite entry
    where it exceeds ``l / sqrt(eps)`` in magnitude, else 0 (rows laid out by
    ``layout``, default the problem's)."""
    L = self.layout if layout is None else layout
    top = L.max(L.map(lambda v: jnp.where(jnp.isfinite(v), v, -jnp.inf), x))
    far = jnp.abs(top) * np.sqrt(np.finfo(L.dtype(x)).eps) > l
    return jnp.where(jnp.isfinite(top) & far, top, jnp.zeros_like(top))

  def shift(self, x, origin):
    """``x`` minus the per-row ``origin``: finite entries stay finite (a difference
    beyond the float range is clamped to the most negative finite value); +-inf and
    NaN stay as they are."""
    L = self.layout
    lowest = jnp.finfo(L.dtype(x)).min
    return L.map(lambda v, t: jnp.where(jnp.isfinite(v), jnp.maximum(v - t, lowest), v),
                 x, L.expand(origin, x))

  def _scaled_entries(self, x, lam, l):
    """(z, nan): ``z = (x - lam) / l`` with the limits of the infinite entries and
    thresholds and the saturation rules of :meth:`primal`; ``nan`` where the mask is NaN."""
    limit = jnp.isinf(x) | jnp.isinf(lam)
    z_limit = jnp.where(jnp.isinf(x), x, -lam)
    x_f, lam_f = jnp.where(limit, 0, x), jnp.where(limit, 0, lam)
    d = x_f - lam_f
    z = _quotient.quotient(d, l)
    z0, z1 = self.regularizer.saturation
    if not (np.isfinite(z0) and np.isfinite(z1)):
      # A dense mask is not yet 0 or 1 where x - lam overflows (opposite signs near the
      # float maximum, l on their scale): there z = x / l - lam / l, as accurate since
      # |x| + |lam| = |x - lam|. (Not 0.5 x - 0.5 lam: XLA factors out a constant 2^k.)
      over = jnp.isinf(d)
      z = jnp.where(over, _quotient.quotient(jnp.where(over, x_f, 0), l)
                    - _quotient.quotient(jnp.where(over, lam_f, 0), l), z)
    # XLA may divide by `l` as a product with 1/l, which can leave z an ulp inside the
    # saturation interval although d = l z1 exactly (x = (2.671875, 1), l = 1.671875:
    # z = 0.9999999999999999, a mask of 1 - 1e-16 in the hard limit). Saturate from the
    # comparison in unscaled units, the one `snap` certifies. (An end at 0 needs no
    # test: the sign of d / l is exact.)
    if np.isfinite(z1) and z1 != 0:
      z = jnp.where(d >= l * z1, jnp.maximum(z, z1), z)
    if np.isfinite(z0) and z0 != 0:
      z = jnp.where(d <= l * z0, jnp.minimum(z, z0), z)
    z = jnp.where(limit, z_limit, z)
    nan = jnp.isnan(x) | jnp.isnan(lam)
    return jnp.where(nan, 0, z), nan

  def _mask_entries(self, x, lam, l):
    z, nan = self._scaled_entries(x, lam, l)
    return jnp.where(nan, jnp.nan, self.regularizer.mask(z))

  def _signed_entries(self, x, lam, l):
    """The terms of phi in complement form: ``mask(z)`` where ``z <= 0``,
    ``-complement(z) = mask(z) - 1`` where ``z > 0`` (NaN where the mask is)."""
    z, nan = self._scaled_entries(x, lam, l)
    reg = self.regularizer
    value = jnp.where(z > 0, -reg.complement(z), reg.mask(z))
    return jnp.where(nan, jnp.nan, value)

  def _upper_entries(self, x, lam, l):
    return self._scaled_entries(x, lam, l)[0] > 0

  def _unsaturated_entries(self, x, lam, l):
    """``mask(z)`` below the upper saturation end ``z1``, 0 from it on (NaN where the
    mask is): the terms of phi in saturated form."""
    z, nan = self._scaled_entries(x, lam, l)
    value = jnp.where(z >= self.regularizer.saturation[1], 0, self.regularizer.mask(z))
    return jnp.where(nan, jnp.nan, value)

  def _saturated_entries(self, x, lam, l):
    return self._scaled_entries(x, lam, l)[0] >= self.regularizer.saturation[1]

  def primal(self, lam, x, l):
    """The mask ``y_i = mask((x_i - lam) / l)``.

    ``+inf`` entries are 1 and ``-inf`` entries 0 whatever the threshold, an infinite
    ``lam`` (rows whose finite entries are all 0 or all 1 under a regularizer that
    never saturates) gives its limit, and NaN (in ``x`` or ``lam``: a row without a
    threshold) propagates. Derivatives stay finite in every case (double ``where``).
    """
    L = self.layout
    return L.map(self._mask_entries, x, L.expand(lam, x), L.expand(l, x))

  def optimality(self, lam, x, k, l):
    r"""phi(lam) = sum_i y_i(lam) - k, one entry per row.

    For a regularizer with a ``complement`` (sigmoid, Laplace) in complement form
    (``proofs/complement_form.md``):

    .. math::

        \phi(\lambda) = (\#\{z_i > 0\} - k) + \sum_{z_i \le 0} \mathrm{mask}(z_i)
                       - \sum_{z_i > 0} (1 - \mathrm{mask}(z_i)),

    the same function, but every term is a tail computed to its own relative precision:
    on near-binary rows (gaps of hundreds of strengths, the deficits ``1 - y_i`` far
    below the rounding of ``sum_i y_i ~ k``) the plain sum is flat in floating point and
    leaves the threshold, and with it every derivative, undetermined; this form
    determines it to the ulp.

    For a regularizer whose mask is exactly 1 from a finite :math:`z_1` on (the
    p-norms, :math:`z_1 = 1`; entropy, :math:`z_1 = 0`) in saturated form,

    .. math::

        \phi(\lambda) = (\#\{z_i \ge z_1\} - k) + \sum_{z_i < z_1} \mathrm{mask}(z_i),

    again the same function: where most entries are exactly 1 and a few share a small
    mass ``k - floor(k)``, the count minus ``k`` is exact and the small masses keep
    their own precision, instead of being rounded at the scale of ``k`` in the sum.
    """
    L = self.layout
    lam_, l_ = L.expand(lam, x), L.expand(l, x)
    if not hasattr(self.regularizer, "complement"):
      if not np.isfinite(self.regularizer.saturation[1]):
        return L.sum(self.primal(lam, x, l)) - k
      saturated = L.count(L.map(self._saturated_entries, x, lam_, l_), L.dtype(x))
      return (saturated - k) + L.sum(L.map(self._unsaturated_entries, x, lam_, l_))
    upper = L.count(L.map(self._upper_entries, x, lam_, l_), L.dtype(x))
    return (upper - k) + L.sum(L.map(self._signed_entries, x, lam_, l_))

  def step_scale(self, lam, l):
    # Relative to lam (the floor avoids 0); `step_floor` raises it to the row's scale.
    return jnp.abs(lam) + jnp.finfo(lam.dtype).tiny

  def step_floor(self, x):
    """``|max_i x_i|`` over the finite entries (0 for a row without one): the entries
    that can be fractional lie in ``[lam, max x]``, so ``x_i - lam`` is resolved to
    ulps of ``max(|lam|, |max x|)`` and no finer step is meaningful (a threshold near 0
    among entries of order 1 would otherwise be bisected down to its own ulps through
    rounding noise). After ``normalize`` the top entry is 0 and the floor is 0: ``lam``
    near 0 is resolved to its own ulps there, where ``x_i - lam`` is exact."""
    L = self.layout
    top = L.max(L.map(lambda v: jnp.where(jnp.isfinite(v), v, -jnp.inf), x))
    return jnp.where(jnp.isfinite(top), jnp.abs(top), jnp.zeros_like(top))

  def step_ceiling(self, lam, l):
    """``|lam| + l z1`` where both saturation ends are finite (the p-norms), else None:
    the fractional entries then lie in ``(lam + l z0, lam + l z1)``, so ``x_i - lam`` is
    resolved to ulps of at most that, however large the saturated entries (a row
    ``(1e6, 0.5, 0.3)`` at p = 3 stopped 2e-10 below the entry 0.5 under the floor
    ``|max x| = 1e6``, leaving it a mass of 1.5e-5 where it has 0)."""
    z0, z1 = self.regularizer.saturation
    if not (np.isfinite(z0) and np.isfinite(z1)):
      return None
    return jnp.abs(lam) + l * max(abs(z0), abs(z1))

  def residual_scale(self, lam, k):
    return k + 1

  def bracket(self, x, k, l) -> Bracket:
    """Bracket [lo, hi] of the root, and rows whose answer is known without iterating.

    With ``n_f`` finite entries sharing ``k_f = k - #(+inf)``, a finite saturation end
    gives the bracket end ``min x - l z1`` / ``max x - l z0``; an infinite one uses
    ``omega'``: at ``min x - l omega'(k_f/n_f)`` every finite y is >= k_f/n_f, at
    ``max x - l omega'(k_f/n_f)`` every finite y is <= k_f/n_f. Rows where the finite
    entries must all be 0 (or all 1) are known: the saturation end where it is finite,
    NaN (no finite threshold) where it is not.
    """
    L = self.layout
    dtype = L.dtype(x)
    z0, z1 = self.regularizer.saturation
    x_max = L.max(L.map(lambda v: jnp.where(jnp.isfinite(v), v, -jnp.inf), x))
    x_min = L.min(L.map(lambda v: jnp.where(jnp.isfinite(v), v, jnp.inf), x))
    any_finite = jnp.isfinite(x_max)
    x_max = jnp.where(any_finite, x_max, 0)
    x_min = jnp.where(any_finite, x_min, 0)
    n_pos_inf = L.count(L.map(lambda v: v == jnp.inf, x), dtype)
    n_not_neg_inf = L.count(L.map(lambda v: v > -jnp.inf, x), dtype)
    if np.isfinite(z0) and np.isfinite(z1):
      lo, hi = x_min - l * z1, x_max - l * z0
    else:
      share = (k - n_pos_inf) / jnp.maximum(n_not_neg_inf - n_pos_inf, 1)
      level = jnp.where((k > n_pos_inf) & (k < n_not_neg_inf), share, 0.5)
      shift = l * jnp.asarray(self.regularizer.omega_prime(level), dtype)
      lo = x_min - l * z1 if np.isfinite(z1) else x_min - shift
      hi = x_max - l * z0 if np.isfinite(z0) else x_max - shift
    if np.isfinite(z0) and np.isfinite(z1):
      lo, hi = _top_rank_bracket(L, x, k, l, z0, z1, lo, hi, n_pos_inf)
    has_nan = L.any(L.map(jnp.isnan, x))
    at_hi = k == n_pos_inf  # all finite coordinates at 0
    at_lo = k == n_not_neg_inf  # all finite coordinates at 1
    infeasible = has_nan | (n_pos_inf > k) | (n_not_neg_inf < k)
    known = infeasible | at_hi | at_lo
    # A regularizer that never saturates puts the finite entries at exactly 0 (1) only
    # in the limit lam -> +inf (-inf); `primal` evaluates that limit.
    # At `lo` itself the smallest entry sits at z1 only up to rounding ((x - lo) / l can
    # come out an ulp below z1): go one saturation width further, so that every finite
    # entry is exactly 1 (k = n gives exact ones).
    value_hi = hi if np.isfinite(z0) else jnp.full_like(hi, jnp.inf)
    value_lo = lo - l * (z1 - z0) if np.isfinite(z1) else jnp.full_like(lo, -jnp.inf)
    value = jnp.where(infeasible, jnp.nan, jnp.where(at_hi, value_hi, value_lo))
    return Bracket(lo, hi, known, value)

  def initial_guess(self, x, k, l, bracket: Bracket):
    r"""The k-th largest entry as a normal sample would put it, moved into the bracket.

    :math:`\mu + \sigma\,\Phi^{-1}(1 - k/n)` from the row's finite mean and standard
    deviation, shifted by the middle of the saturation interval (capped at 1 in
    magnitude): two reductions, no sort. The Newton iteration corrects it; a good
    guess only saves passes.
    """
    L = self.layout
    dtype = L.dtype(x)
    mean, std, n_finite = finite_moments(L, x)
    n_pos_inf = L.count(L.map(lambda v: v == jnp.inf, x), dtype)
    quantile = mean + std * upper_quantile_of_normal((k - n_pos_inf) / n_finite, dtype)
    z0, z1 = self.regularizer.saturation
    guess = quantile - 0.5 * l * (min(z1, 1.0) + max(z0, -1.0))
    middle = midpoint(bracket.lo, bracket.hi)
    return jnp.clip(jnp.where(jnp.isfinite(guess), guess, middle), bracket.lo, bracket.hi)

  def snap(self, lam, x, k, l, known):
    r"""Moves ``lam`` onto an entry sitting at it, then to the middle of the flat root
    interval when the solution is binary.

    *An entry at the threshold* (integer data; ``proofs/snap_to_entry.md``): with a
    finite lower saturation end :math:`z_0` (the p-norms: :math:`z_0 = 0`) an entry
    :math:`x_j` with :math:`x_j - l z_0 = \lambda^\star` has the exact mass 0, but an
    iteration that stops a few ulps below :math:`\lambda^\star` leaves it
    :math:`((x_j - \hat\lambda)/l)^a` (1e-16 at p = 2, 1e-21 in float32 at p = 4/3):
    one entry too many in the support. The candidate :math:`v - l z_0`, :math:`v` the
    smallest entry with :math:`v - l z_0 > \hat\lambda`, replaces :math:`\hat\lambda`
    where it lies within the iteration's step tolerance (4 ulps of
    :math:`\max(|\hat\lambda|, l)`) and :math:`|\phi|` there is at most
    :math:`|\phi(\hat\lambda)|` or the rounding of the sum (:math:`n\,\mathrm{tol}
    \max(k, 1)`, :math:`n` the entries above :math:`\hat\lambda`;
    :func:`~implicit_topk.problems.base.snap_to_entry`: one fused reduction and two
    evaluations of :math:`\phi`).

    *Binary rows*: with integer ``k`` and a gap wider than the saturation interval
    between the k-th and (k+1)-th largest entries, :math:`\phi` is zero on a whole interval
    :math:`[A, B]`, :math:`A = \max_{i \notin S} x_i - l z_0`,
    :math:`B = \min_{i \in S} x_i - l z_1` (``S`` the top-k set), and the solution is
    the exact 0/1 mask. An iteration that stops where ``phi`` rounds to 0 can land a
    few ulps outside ``[A, B]``, leaving values like 1e-47 for an exact 0. One extra
    pass certifies the binary solution (``|S| = k`` and ``A <= B``, which by uniqueness
    of the solution means it *is* the solution) and returns ``(A + B) / 2``; other
    rows keep ``lam``. Regularizers with an infinite saturation interval never give
    binary solutions and are returned unchanged.
    """
    z0, z1 = self.regularizer.saturation
    if not np.isfinite(z0):
      return lam
    L = self.layout
    lam = snap_to_entry(self, lam, L.map(lambda v, s: v - s * z0, x, L.expand(l, x)), x, k, l,
                        known, step_scale=jnp.maximum(jnp.abs(lam), l))
    if not np.isfinite(z1):
      return lam
    dtype = L.dtype(x)
    top = L.map(lambda v, lam_, l_: v - lam_ > 0.5 * (z0 + z1) * l_,
                x, L.expand(lam, x), L.expand(l, x))
    count = L.count(top, dtype)
    a = L.max(L.map(lambda v, t: jnp.where(t, -jnp.inf, v), x, top)) - l * z0
    b = L.min(L.map(lambda v, t: jnp.where(t, v, jnp.inf), x, top)) - l * z1
    binary = (count == k) & (a <= b) & jnp.isfinite(a) & jnp.isfinite(b) & ~known
    return jnp.where(binary, midpoint(a, b), lam)

  # -- solver-specific pieces ------------------------------------------------------
  def supports(self, solver_name: str) -> None:
    _check_sortable(self.layout, solver_name)
    if solver_name == "pav":
      _regularizers.pav_kernel_spec(self.regularizer)
    if solver_name == "native":
      _regularizers.native_kernel_spec(self.regularizer)
    if solver_name == "dykstra" and _regularizers.pnorm_exponent(self.regularizer) != 1:
      raise ValueError(
          "solver='dykstra' supports the Euclidean regularizer only (p=2); got "
          f"{self.regularizer!r}. Use solver='pav' or 'threshold' for other p.")

  def pav_threshold(self, x, k, l):
    """Exact thresholds by the PAV kernel (an XLA custom call; rows of the last axis)."""
    from implicit_topk.kernels.cpu import pav_calls
    return pav_calls.capped_simplex_threshold(x, k, l, _regularizers.pav_kernel_spec(self.regularizer))

  def dykstra_threshold(self, x, k, l, *, tol, maxiter, unrolled):
    r"""``p = 2`` by Dykstra's algorithm on the isotonic dual (``proofs/isotonic_dual.md``).

    With :math:`s` = ``x`` sorted descending and :math:`w_i = \mathrm{clip}(k - i, 0, 1)`
    (0-based), :math:`\lambda / l` is the isotonic regression of :math:`s / l - w` at
    the block straddling ``k``. A row stops once :math:`|\phi(\lambda)| \le` ``tol``,
    which is exactly :math:`\|y - y^\star\|_1` (every :math:`y_i(\lambda) - y^\star_i`
    has one sign; ``proofs/dykstra_stopping.md``).
    """
    x_finite = _finite_surrogate(x, l)
    s = -jnp.sort(-x_finite, axis=-1)
    n = x.shape[-1]
    u = s / l[..., None] - jnp.clip(k[..., None] - jnp.arange(n, dtype=x.dtype), 0, 1)
    if unrolled:
      v = _dykstra.isotonic_dykstra_unrolled(u, num_sweeps=maxiter)
      sweeps = jnp.full(x.shape[:-1], maxiter, jnp.int32)
    else:
      residual = lambda v: jnp.abs(self.optimality(_threshold_from_dual(v, k, l), x_finite, k, l))
      result = _dykstra.isotonic_dykstra(u, tol=tol, max_iter=maxiter, residual_fun=residual)
      v, sweeps = result.v, result.iter_num
    bracket = self.bracket(x, k, l)
    return jnp.where(bracket.known, bracket.value, _threshold_from_dual(v, k, l)), sweeps


def _top_rank_bracket(L, x, k, l, z0, z1, lo, hi, n_pos_inf):
  r"""``[lo, hi]`` tightened to :math:`[x_{(m)} - l z_1,\ x_{(j+1)} - l z_0]`,
  :math:`m = \lceil k \rceil`, :math:`j = \lfloor k \rfloor` (order statistics with
  multiplicity), where those ranks lie among the row's largest distinct values
  (:func:`~implicit_topk.problems.base.top_order_statistics`) and the row has no
  ``+inf`` entry; elsewhere ``[lo, hi]`` unchanged.

  Valid for a saturating regularizer (``proofs/native_bracket.md``, statement 1): below
  :math:`x_{(m)} - l z_1` the top m entries are 1, so :math:`\phi \ge m - k \ge 0`;
  above :math:`x_{(j+1)} - l z_0` at most j entries are nonzero, each at most 1, so
  :math:`\phi \le j - k \le 0`. For the router's k of 1 or 2 the bracket then spans
  one gap of the row's top entries instead of the whole row (fewer passes, and no
  pass far from the root).
  """
  top_m, next_j = top_order_statistics(L, x, (jnp.ceil(k), jnp.floor(k) + 1))
  usable = n_pos_inf == 0
  # An end that rounds back onto its entry (l below the entry's ulps, as after a shift
  # by a far row maximum) is not a bracket end in floating point: keep the wide one.
  tight_lo, tight_hi = top_m - l * z1, next_j - l * z0
  lo = jnp.where(usable & (k >= 1) & (tight_lo < top_m), jnp.maximum(lo, tight_lo), lo)
  hi = jnp.where(usable & (tight_hi > next_j - l * z1), jnp.minimum(hi, tight_hi), hi)
  return lo, hi


def _finite_surrogate(x, l):
  """Replaces +-inf by finite values with the same mask, and NaN by 0 (NaN rows are
  answered by the bracket): ``+inf -> max_finite + 2 l`` is 1 and
  ``-inf -> min_finite - 2 l`` is 0 whenever the row has a threshold."""
  finite = jnp.isfinite(x)
  any_finite = jnp.any(finite, axis=-1, keepdims=True)
  hi = jnp.where(any_finite, jnp.max(jnp.where(finite, x, -jnp.inf), -1, keepdims=True), 0)
  lo = jnp.where(any_finite, jnp.min(jnp.where(finite, x, jnp.inf), -1, keepdims=True), 0)
  l = l[..., None]
  x = jnp.where(x == jnp.inf, hi + 2 * l, x)
  x = jnp.where(x == -jnp.inf, lo - 2 * l, x)
  return jnp.where(jnp.isnan(x), 0, x)


def _threshold_from_dual(v, k, l):
  """lam = l * (v[ceil(k) - 1] + v[floor(k)]) / 2 (0-based).

  For fractional k both indices are ceil(k) - 1, a fractional entry, whose dual value
  is lam / l. For integer k they are the k-th and (k+1)-th largest: both fractional
  (same value lam / l), or the solution is binary and their values s_k/l - 1 and
  s_(k+1)/l are the ends of the flat root interval, whose midpoint we return.
  """
  n = v.shape[-1]
  upper = jnp.clip(jnp.ceil(k).astype(jnp.int32) - 1, 0, n - 1)
  lower = jnp.clip(jnp.floor(k).astype(jnp.int32), 0, n - 1)
  pick = lambda i: jnp.take_along_axis(v, i[..., None], axis=-1)[..., 0]
  return 0.5 * l * (pick(upper) + pick(lower))


def _check_sortable(layout, solver_name: str) -> None:
  """The sorting solvers and the Pallas kernel need whole rows along one contiguous,
  unsplit last axis."""
  if solver_name in ("pav", "dykstra", "native", "pallas") and not layout.sortable:
    what = "holds each whole row in one kernel program" if solver_name == "pallas" else (
        "sorts whole rows")
    raise ValueError(
        f"solver={solver_name!r} {what} on one device; it cannot solve a row "
        f"laid out as {layout!r} (segments, a pytree, or an axis split over a mesh axis). "
        "Use solver='threshold' (or 'auto').")
