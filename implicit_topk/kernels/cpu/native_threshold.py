r"""The exact threshold of the soft top-k mask, one row at a time (numba, CPU).

For a row :math:`x` (after the problem's ``normalize``), target :math:`k` and strength
:math:`l`, the mask is :math:`y_i = \mathrm{mask}((x_i - \lambda) / l)` and
:math:`\lambda` is the root of the nonincreasing

.. math::

    \phi(\lambda) = \sum_i \mathrm{mask}\big((x_i - \lambda) / l\big) - k

(Sander et al. 2023, "Fast, differentiable and sparse top-k: a convex analysis
perspective", ICML). No sort (``proofs/native_bracket.md``):

* sparse regularizers (the p-norms, mask 0 below :math:`z = 0` and 1 above
  :math:`z = 1`): with :math:`m = \lceil k \rceil` and :math:`j = \lfloor k\rfloor`
  (over the finite entries, after the ``+inf`` entries took their ones),

  .. math:: x_{(m)} - l \;\le\; \lambda \;\le\; x_{(j+1)},

  so only the entries above :math:`x_{(m)} - l` can be nonzero at the root. One
  branch-free pass gathers the entries above a cut guessed from the previous rows
  (checked: at least :math:`m + 1` entries at or above it), the :math:`m + 1` largest
  candidates are selected (a branch-free insertion buffer for small :math:`m`, a
  quickselect otherwise), and the safeguarded Newton iteration runs on the candidates
  above :math:`x_{(m)} - l` alone, which sit in L1. A row with no previous row to guess
  from (the first of a block) and :math:`m < 16` keeps its :math:`m + 1` largest
  entries and gathers a superset of the candidates in the same one pass
  (:func:`_first_row_attempt`). With integer
  :math:`k` and :math:`x_{(k)} - l \ge x_{(k+1)}` the solution is the hard mask and
  :math:`\lambda` is the middle of the flat root interval, as the other solvers
  return it.
* dense regularizers (entropy, sigmoid, Laplace): the same iteration over the whole
  row, from the bracket :math:`[\min x - l\,\omega'(k/n), \max x - l\,\omega'(k/n)]`.

The iteration is the one of the pure-JAX solver
(:func:`implicit_topk.solvers.threshold.safeguarded_newton_step`), in float64 whatever
the input dtype: the Newton or Schroeder step when it stays inside the bracket and at
most halves the last step, else bisection (for p = 4/3 the step is refined to the
root of the cubic phi is on at the current piece, :func:`refined_step`, so that a row
whose root lies on the piece of its first point takes two passes); it stops at
:math:`\phi = 0`, a step below 4 ulps (of the output dtype) of the smaller of
:math:`|\lambda|` and :math:`l` with :math:`|\phi|` at rounding level, or a collapsed
bracket, never below 4 float64 ulps of :math:`\lambda` (so float32 rows with
:math:`l \ll |\lambda|` are solved as exactly as in float64). Rows with NaN, with no
finite threshold, or with
``k`` at 0 or at the count of entries are left to the caller (the problem's
``bracket`` answers them).

Float64 rows at the ends of the float range are solved on an exact rescaling (as the
pure-JAX solvers do, :func:`implicit_topk.solvers.float_range.scale_exponent` and
``proofs/float_range.md``): the row and its strength times :math:`2^{-E}`,
:math:`E = \max(E_{lo}, \min(0, E_{hi}))` with :math:`E_{lo} = \lfloor\log_2 \max_i
|x_i|\rfloor + 2 - 1023` (finite entries: every difference of two scaled entries is
finite) and :math:`E_{hi} = \lfloor\log_2 l\rfloor + 1022 - 53` (the scaled
strength's ulps are normal floats: XLA runs the kernel with subnormals flushed to
zero). The mask depends on :math:`(x_i - \lambda)/l` only, so it is unchanged; the
threshold and origin are returned in the scaled coordinates. :math:`E = 0`, and
nothing is scaled, for every row with :math:`|x_i| < 2^{1022}` and :math:`l \ge
2^{-969}`, which the passes the kernel makes anyway check (:func:`_all_below`,
:data:`_ENTRY_LIMIT` in the one-pass paths). Float32 rows never reach these ranges
(the kernel computes in float64) and are never scaled.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import carray, njit, types
from numba.extending import overload

from implicit_topk.kernels.cpu import abi
from implicit_topk.kernels.cpu.kinds import ENTROPY, KINDS, LAPLACE, PNORM, SIGMOID  # noqa: F401
from implicit_topk.kernels.cpu.ordered_bits import block_largest, largest, smallest_above
from implicit_topk.kernels.cpu.ordered_bits import bisection_point as _bisection_point
from implicit_topk.kernels.cpu.ordered_bits import midpoint as _midpoint

_SORT_LIMIT = 16  # below this many top entries: an insertion buffer, else quickselect
_MAXITER = 200
_SAMPLED_ROW = 4096  # from this row length the first row's guess comes from a sample
_ONE_PASS_ROW = 512  # up to this row length, k <= 2: one pass finds the bracket (no guess)
_IN_PLACE_ROW = 16  # up to this row length, k <= 2: Newton runs on the row itself (no gather)
_SKIP_BLOCK = 16  # the first row's pass (_first_row_pass) skips blocks of this many entries
_GATHER_BLOCK = 64  # _gather_near_top skips blocks of this many entries
_LOWEST = -np.finfo(np.float64).max
_EPS64 = float(np.finfo(np.float64).eps)
#: Float64 entries below this in magnitude keep every difference of two finite (4 times
#: one overflows exactly from here): scale exponent E_lo <= 0.
_ENTRY_LIMIT = 2.0 ** 1022
#: Float64 strengths from this one up keep their ulps normal (times 2^-53): E_hi >= 0.
_STRENGTH_FLOOR = 2.0 ** -969
_OPTIONS: dict[str, Any] = dict(cache=True, error_model="numpy", fastmath=False)


@njit(inline="always", **_OPTIONS)
def _mask_terms(z, kind, a):
  """(y, dy/dz, d2y/dz2) of the mask at z."""
  if kind == PNORM:
    if z <= 0.0:
      return 0.0, 0.0, 0.0
    if z >= 1.0:
      return 1.0, 0.0, 0.0
    if a == 1.0:
      return z, 1.0, 0.0
    if a == 3.0:
      return z * z * z, 3.0 * z * z, 6.0 * z
    y = math.pow(z, a)
    return y, a * y / z, a * (a - 1.0) * y / (z * z)
  if kind == ENTROPY:
    if z >= 0.0:
      return 1.0, 0.0, 0.0
    y = math.exp(z)
    return y, y, y
  if kind == SIGMOID:
    e = math.exp(-abs(z))
    s = 1.0 / (1.0 + e)  # sigmoid(|z|)
    t = e * s  # sigmoid(-|z|), the tail: not 1 - s, which is 0 once s rounds to 1
    y = s if z >= 0.0 else t
    d = s * t
    return y, d, d * (1.0 - 2.0 * y)
  # LAPLACE: the Laplace CDF
  e = 0.5 * math.exp(-abs(z))
  if z >= 0.0:
    return 1.0 - e, e, -e
  return e, e, e


@njit(inline="always", **_OPTIONS)
def _tail(z, kind):
  """The sigmoid or Laplace mask's tail at z: ``mask(z)`` for ``z <= 0``, ``1 - mask(z)
  = mask(-z)`` for ``z > 0`` (both masks are symmetric), to its own relative
  precision."""
  e = math.exp(-abs(z))
  if kind == SIGMOID:
    return e / (1.0 + e)
  return 0.5 * e


@njit(**_OPTIONS)
def _omega_prime(t, kind, a):
  """omega'(t) on (0, 1): the z at which the mask equals t."""
  if kind == PNORM:
    return math.pow(t, 1.0 / a)
  if kind == ENTROPY:
    return math.log(t)
  if kind == SIGMOID:
    return math.log(t) - math.log(1.0 - t)
  if t < 0.5:
    return math.log(2.0 * t)
  return -math.log(2.0 * (1.0 - t))


@njit(inline="always", **_OPTIONS)
def _phi(values, count, lam, l, target, kind, a):
  """(phi, phi', phi'', phi''') at lam over values[:count]; phi''' for p = 4/3 only (0
  otherwise): ``-6 m / l^3`` with ``m`` the count of fractional entries (0 < z < 1),
  so that phi and these derivatives make the cubic phi is on the current piece
  (:func:`newton_step`).

  The p-norm loops are branch-free (the clipped z and an indicator of the fractional
  entries), so that mixed rows of zeros, fractions and ones cost no mispredictions.
  """
  inv = 1.0 / l
  total, slope, curve, fractional = -target, 0.0, 0.0, 0.0
  if kind == PNORM and a == 3.0:  # p = 4/3
    for i in range(count):
      z = min(max((values[i] - lam) * inv, 0.0), 1.0)
      inside = 1.0 if z < 1.0 else 0.0
      total += z * z * z
      slope -= 3.0 * z * z * inside
      curve += 6.0 * z * inside
      fractional += inside if z > 0.0 else 0.0
  elif kind == PNORM and a == 1.0:  # p = 2
    for i in range(count):
      z = (values[i] - lam) * inv
      total += min(max(z, 0.0), 1.0)
      slope -= 1.0 if (z > 0.0) & (z < 1.0) else 0.0
  elif kind == SIGMOID or kind == LAPLACE:
    # The complement form (proofs/complement_form.md): phi = (#{z > 0} - k)
    # + sum_{z <= 0} mask(z) - sum_{z > 0} (1 - mask(z)), every term a tail to its own
    # relative precision, so phi is not flat where the deficits 1 - y are far below
    # the rounding of sum y ~ k (near-binary rows) and lam is found to the ulp.
    upper, tails = 0, 0.0
    for i in range(count):
      z = _scaled(values[i], lam, inv)
      y, dy, d2y = _mask_terms(z, kind, a)
      tail = _tail(z, kind)
      if z > 0.0:
        upper += 1
        tails -= tail
      else:
        tails += tail
      slope -= dy
      curve += d2y
    total = (upper - target) + tails
  else:
    # entropy: the entries at z >= 0 are exactly 1; counted apart from the tails
    ones, tails = 0, 0.0
    for i in range(count):
      y, dy, d2y = _mask_terms(_scaled(values[i], lam, inv), kind, a)
      if y == 1.0:
        ones += 1
      else:
        tails += y
      slope -= dy
      curve += d2y
    total = (ones - target) + tails
  return total, slope * inv, curve * inv * inv, third_derivative(fractional, inv)


@njit(inline="always", **_OPTIONS)
def third_derivative(fractional, inv):
  """phi''' of a p = 4/3 row with ``fractional`` entries strictly between 0 and 1
  (``inv = 1 / l``): ``-6 m / l^3``; 0 where there are none or ``l^-3`` overflows (the
  step is then Schroeder's, :func:`newton_step`)."""
  third = -6.0 * fractional * inv * inv * inv
  return third if abs(third) < np.inf else 0.0


@njit(inline="always", **_OPTIONS)
def _scaled(v, lam, inv):
  """(v - lam) * inv for finite v, lam; where the difference overflows (opposite signs
  near the float maximum) v * inv - lam * inv, as accurate (|v| + |lam| = |v - lam|)."""
  d = v - lam
  if abs(d) < np.inf:
    return d * inv
  return v * inv - lam * inv


@njit(inline="always", **_OPTIONS)
def _scaled_div(v, lam, l):
  """(v - lam) / l, as :func:`_scaled` where the difference overflows."""
  d = v - lam
  if abs(d) < np.inf:
    return d / l
  return v / l - lam / l


@njit(inline="always", **_OPTIONS)
def newton_step(phi, dphi, d2phi, d3phi):
  """The step ``lam - next lam`` the iteration proposes from phi and its derivatives
  at ``lam`` (used where ``phi' < 0``; :func:`_safeguarded_step` decides whether to
  take it): :func:`plain_step`, and for p = 4/3 (``d3phi`` not 0) :func:`refined_step`
  from it."""
  step = plain_step(phi, dphi, d2phi)
  if d3phi == 0.0:
    return step
  return refined_step(step, phi, dphi, d2phi, d3phi)


@njit(inline="always", **_OPTIONS)
def plain_step(phi, dphi, d2phi):
  """Schroeder's step ``phi phi' / (phi'^2 - phi phi'')`` where it is the longer one
  (``phi phi'' > 0`` and a positive denominator), else Newton's ``phi / phi'``: one
  division either way, branch-free (selects), so that the lanes
  (:mod:`~implicit_topk.kernels.cpu.native_lanes`) take it for a block of rows in one
  vectorized loop, with the same values to the bit."""
  curve = phi * d2phi
  denominator = dphi * dphi - curve
  longer = (curve > 0.0) & (denominator > 0.0)
  return (phi * dphi if longer else phi) / (denominator if longer else dphi)


@njit(inline="always", **_OPTIONS)
def refined_step(step, phi, dphi, d2phi, d3phi):
  """For p = 4/3: ``step`` refined to the root of the cubic phi is on at the current
  piece by three branch-free Newton steps on that cubic (:func:`_piece_refinement`),
  which take no pass over the entries; ``step`` itself where ``d3phi`` is 0 or the
  refinement is not finite. A row whose root lies on the piece of a point is so done
  one pass later (which confirms it), as Newton is for p = 2, where phi is linear on
  a piece: 1.1 passes a row on average at 16384 x 8, k = 1 (Newton/Schroeder alone:
  2.1, with a tail of 9-15). Only the step changes: the stopping rule and the
  safeguards are :func:`_safeguarded_step`'s."""
  s, sixth = -step, d3phi / 6.0
  s = _piece_refinement(s, phi, dphi, d2phi, sixth)
  s = _piece_refinement(s, phi, dphi, d2phi, sixth)
  s = _piece_refinement(s, phi, dphi, d2phi, sixth)
  return -s if (abs(s) < np.inf) & (d3phi != 0.0) else step


@njit(inline="always", **_OPTIONS)
def _piece_refinement(s, phi, dphi, d2phi, sixth):
  """One Newton step (branch-free) on the cubic phi is on at the current piece, for
  p = 4/3: ``phi(lam + s) = phi + phi' s + phi'' s^2 / 2 + phi''' s^3 / 6`` exactly
  while no entry enters or leaves the fractional range, a decreasing cubic
  (``sixth = phi''' / 6``); ``s`` unchanged where its slope is not negative (then at
  every later step too)."""
  slope = dphi + s * (d2phi + 3.0 * s * sixth)
  moved = s - (phi + s * (dphi + s * (0.5 * d2phi + s * sixth))) / slope
  return moved if slope < 0.0 else s


@njit(inline="always", **_OPTIONS)
def _safeguarded_step(phi, dphi, step, lam, lo, hi, prev_step, it, tol, phi_tol, reach):
  """One step of :func:`_newton` at ``lam`` (pass ``it``) from phi, phi' and the
  proposed ``step`` (:func:`newton_step`) there: (done, the next lam, the bracket, the
  last step).

  Steps and brackets count as converged below ``tol`` times the smaller of ``|lam|``
  and ``reach`` (the distance in lam over which the output moves by O(1): the strength
  for the mask, whose entries depend on ``(x_i - lam) / l``), but never below 4 ulps of
  ``lam`` in float64. For float32 rows with ``l`` far below ``|lam|`` (nearly hard) the
  threshold so ends within a few float64 ulps instead of a few float32 ulps of
  ``|lam|``, each of which moved a fractional entry by ``ulp / l``: float32, ``l =
  1e-6``, entries of order 1 stopped three such steps from the root (a mask summing to
  2.08 for ``k = 2.5``)."""
  if phi == 0.0:
    return True, lam, lo, hi, prev_step
  if phi > 0.0:
    lo = lam
  else:
    hi = lam
  scale = max(tol * min(abs(lam), reach), 4.0 * _EPS64 * abs(lam)) + tol * 1e-300
  if dphi < 0.0:
    if abs(step) <= scale and abs(phi) <= phi_tol:
      return True, lam - step, lo, hi, prev_step
    candidate = lam - step
    if (candidate > lo and candidate < hi and abs(step) > scale
        and abs(step) <= 0.5 * abs(prev_step)):
      return False, candidate, lo, hi, step
  if hi - lo <= scale:
    return True, lam, lo, hi, prev_step
  middle = _bisection_point(lo, hi, it)
  return False, middle, lo, hi, lam - middle


@njit(**_OPTIONS)
def _newton(values, count, target, l, kind, a, lo, hi, lam, tol, prev_step=np.nan, first=0,
            reach=np.inf):
  """Safeguarded Newton/Schroeder on phi over values[:count] in [lo, hi] from lam.

  ``tol`` is the relative step tolerance (4 ulps of the output dtype), relative to the
  smaller of ``|lam|`` and ``reach`` (:func:`_safeguarded_step`; the mask passes its
  strength, the top-k in magnitude none). Returns
  (lam, passes). ``prev_step`` and ``first`` resume an iteration at its pass ``first``
  (:mod:`~implicit_topk.kernels.cpu.native_lanes` hands over its slowest rows so);
  a fresh one starts at pass 0 with the last step taken as twice the bracket.

  The scalars are passed on as float64 and int64 (the iteration computes in float64
  anyway), so that numba compiles the iteration once per dtype of ``values`` rather
  than once per call site's argument types (a constant ``kind``, float32 strengths and
  targets, omitted arguments: nine copies of the iteration in one forward kernel, a
  third of its build time)."""
  return _newton_iteration(values, np.int64(count), np.float64(target), np.float64(l),
                           np.int64(kind), np.float64(a), np.float64(lo), np.float64(hi),
                           np.float64(lam), np.float64(tol), np.float64(prev_step),
                           np.int64(first), np.float64(reach))


@njit(**_OPTIONS)
def _newton_iteration(values, count, target, l, kind, a, lo, hi, lam, tol, prev_step, first,
                      reach):
  """:func:`_newton` with every scalar float64 or int64."""
  if prev_step != prev_step:
    prev_step = 2.0 * (hi - lo)
  phi_tol = math.sqrt(tol) * (target + 1.0)
  for it in range(first, _MAXITER):
    terms = _phi(values, count, lam, l, target, kind, a)
    phi, dphi = terms[0], terms[1]
    step = newton_step(phi, dphi, terms[2], third_term(terms))
    done, lam, lo, hi, prev_step = _safeguarded_step(phi, dphi, step, lam, lo, hi,
                                                     prev_step, it, tol, phi_tol, reach)
    if done:
      return lam, it + 1
  return lam, _MAXITER


@njit(**_OPTIONS)
def _select_descending(values, count, rank):
  """Reorders values[:count] so that values[rank] is the (rank+1)-th largest, with
  larger-or-equal entries before it and smaller-or-equal after (Hoare's quickselect
  with a median-of-three pivot)."""
  lo, hi = 0, count - 1
  while hi > lo:
    mid = lo + (hi - lo) // 2
    a, b, c = values[lo], values[mid], values[hi]
    pivot = max(min(a, b), min(max(a, b), c))
    i, j = lo, hi
    while i <= j:
      while values[i] > pivot:
        i += 1
      while values[j] < pivot:
        j -= 1
      if i <= j:
        values[i], values[j] = values[j], values[i]
        i += 1
        j -= 1
    if rank <= j:
      hi = j
    elif rank >= i:
      lo = i
    else:
      return


@njit(cache=True, error_model="numpy", fastmath={"reassoc"})
def _all_finite(row, n):
  """Whether every entry of the row is finite (one vectorized pass)."""
  non_finite = 0.0
  for i in range(n):
    non_finite += row[i] - row[i]  # NaN once an entry is +-inf or NaN
  return non_finite == 0.0


@njit(cache=True, error_model="numpy")
def _max_of_finite(row, n):
  """The maximum of a row of finite entries, on their integer keys (vectorized:
  :func:`~implicit_topk.kernels.cpu.ordered_bits.largest`)."""
  return largest(row, 0, n)


def float64_entries(values):
  """Whether ``values`` (an array or a scalar) holds float64: in numba a compile-time
  constant, so that the float32 kernels compile without the rescaling of the float64
  rows at the ends of the float range."""
  return np.asarray(values).dtype == np.float64


@overload(float64_entries, inline="always")
def _float64_entries(values):
  wide = getattr(values, "dtype", values) == types.float64
  return lambda values: wide


def third_term(terms):
  """phi''' from what a ``_phi`` returns: its fourth term, or 0 from a ``_phi`` of
  three (the magnitude kernel's, which shares :func:`_newton`); in numba a compile-time
  choice."""
  return terms[3] if len(terms) > 3 else 0.0


@overload(third_term, inline="always")
def _third_term(terms):
  if len(terms) > 3:
    return lambda terms: terms[3]
  return lambda terms: 0.0


@njit(cache=True, error_model="numpy", fastmath={"reassoc"})
def _all_below(row, n):
  """Whether every entry of the row is finite and below :data:`_ENTRY_LIMIT` in
  magnitude (one vectorized pass, as :func:`_all_finite`: ``4 v`` is exact, and
  infinite from ``|v| = 2^1022`` up)."""
  overflow = 0.0
  for i in range(n):
    t = 4.0 * row[i]
    overflow += t - t  # NaN once 4 v overflows, or v is +-inf or NaN
  return overflow == 0.0


@njit(inline="always", **_OPTIONS)
def scale_exponent(row, n, l):
  """``(E, every entry finite)`` of a float64 row and its strength ``l``: the exponent of
  the exact rescaling ``x 2^-E``, ``l 2^-E`` of
  :func:`implicit_topk.solvers.float_range.scale_exponent`, from the exponent bits
  (``floor(log2 v)`` is the biased exponent minus 1023, and -1023 for 0 and
  subnormals, as there): ``E = max(E_lo, min(0, E_hi))`` with ``E_lo = floor(log2
  max|x_i|) + 2 - 1023`` over the finite entries and ``E_hi = floor(log2 l) + 1022 -
  53``, clipped to ``[-1021, 1021]``. One pass; only for rows that
  :func:`_all_below` or the strength's test flags."""
  top, finite = 0, True
  for i in range(n):
    field = (np.float64(row[i]).view(np.int64) >> 52) & 2047
    finite &= field < 2047
    top = max(top, field if field < 2047 else 0)
  e_lo = top - 1023 + 2 - 1023
  e_hi = ((np.float64(l).view(np.int64) >> 52) & 2047) - 1023 + 1022 - 53
  return min(max(max(e_lo, min(0, e_hi)), -1021), 1021), finite


@njit(inline="always", **_OPTIONS)
def power_of_two(e):
  """``2.0 ** e`` for an integer ``e`` in ``[-1022, 1023]``, from its bits (exact)."""
  return np.int64((e + 1023) << 52).view(np.float64)


@njit(**_OPTIONS)
def _gather_above(row, n, cut, origin, out):
  """Copies the entries ``v - origin`` of ``row`` that lie above ``cut`` (finite
  entries only) into ``out`` (branch-free); returns their count. A finite difference beyond
  the float range is clamped to the most negative float, as the problems'
  ``normalize`` does."""
  count = 0
  for i in range(n):
    v = max(row[i] - origin, _LOWEST)
    out[count] = v
    # -inf entries (those outside `where=`) are no candidates: the clamp would make
    # them the most negative float, counted in the dense rows' bracket k / count.
    count += (v > cut) & (v < np.inf) & (row[i] > -np.inf)
  return count


@njit(**_OPTIONS)
def _finite_counts(row, n, origin):
  """(#(+inf), #entries > -inf, any NaN, min and max of the finite entries minus
  ``origin``) of a row."""
  n_pos_inf, n_above, nan = 0, 0, False
  x_min, x_max = np.inf, -np.inf
  for i in range(n):
    v = row[i]
    if v == np.inf:
      n_pos_inf += 1
      n_above += 1
    elif v > -np.inf:
      n_above += 1
      x_min = min(x_min, max(v - origin, _LOWEST))
      x_max = max(x_max, v - origin)
    elif v != v:
      nan = True
  return n_pos_inf, n_above, nan, x_min, x_max


@njit(**_OPTIONS)
def _order_statistics(values, count, m, j, scratch):
  """(x_(m), x_(j+1)) of values[:count]: see :func:`_order_statistics_after`."""
  x_m, x_next, _ = _order_statistics_after(values, count, m, j, scratch)
  return x_m, x_next


@njit(**_OPTIONS)
def _order_statistics_after(values, count, m, j, scratch):
  """(x_(m), x_(j+1), x_(m+1)) of values[:count] (1-based, largest first; -inf past
  the count), j in {m - 1, m}.

  Small ``m``: one pass keeping the m + 1 largest in ``scratch``, sorted, by a
  branch-free insertion (each entry is carried down the buffer by min/max pairs: no
  mispredicted branch however the row is ordered); large ``m``: a quickselect on a
  copy in ``scratch``. ``values`` keeps its order either way."""
  if m < _SORT_LIMIT:
    for p in range(m + 1):
      scratch[p] = -np.inf
    if count > 8 * (m + 1):
      # many more entries than the buffer: only those above its last one can change it
      # (a few dozen in a random order), so skip the others (the same buffer)
      for i in range(count):
        v = values[i]
        if v > scratch[m]:
          for p in range(m + 1):
            kept = scratch[p]
            scratch[p] = max(kept, v)
            v = min(kept, v)
      return scratch[m - 1], scratch[j], scratch[m]
    for i in range(count):
      v = values[i]
      for p in range(m + 1):
        kept = scratch[p]
        scratch[p] = max(kept, v)
        v = min(kept, v)
    return scratch[m - 1], scratch[j], scratch[m]
  for i in range(count):
    scratch[i] = values[i]
  _select_descending(scratch, count, m - 1)
  x_after = -np.inf
  for i in range(m, count):
    x_after = max(x_after, scratch[i])
  return scratch[m - 1], scratch[m - 1] if j < m else x_after, x_after


@njit(**_OPTIONS)
def _sample_cut(row, n, k, scratch):
  """A guess of a cut with a few more than ``k + 1`` entries above it, from a strided
  sample of 1024 entries (its order statistic at 1.5 times the matching rank, plus 4):
  the first row's guess, where there is no previous row. Checked by the caller."""
  size = 1024
  step = n // size
  for i in range(size):
    scratch[i] = row[i * step]
  rank = min(size - 1, int(math.ceil(1.5 * (k + 1.0) * size / n)) + 4)
  _select_descending(scratch, size, rank)
  return scratch[rank]


@njit(**_OPTIONS)
def _gather_near_top(row, n, origin, cut, low, work):
  """Copies the entries ``v - origin`` above ``low`` into ``work`` (branch-free) of a
  row of finite entries; returns their count and how many of them are at least
  ``cut``. By blocks of :data:`_GATHER_BLOCK` entries: a block with no entry above
  ``low`` (a vectorized count; ``v - origin > low`` is the clamped test for a finite
  ``low``) is skipped, so where few entries lie above ``low`` only the blocks near the
  top are gathered entry by entry (a data-dependent store: 0.5 ns an entry)."""
  count = 0
  full = n // _GATHER_BLOCK
  for b in range(full):
    base = np.uint64(b * _GATHER_BLOCK)  # (unsigned: the count's loop is vectorized)
    hits = 0
    for j in range(_GATHER_BLOCK):
      hits += row[base + np.uint64(j)] - origin > low
    if hits == 0:
      continue
    for j in range(_GATHER_BLOCK):
      v = max(row[base + np.uint64(j)] - origin, _LOWEST)
      work[count] = v
      count += v > low
  for i in range(full * _GATHER_BLOCK, n):
    v = max(row[i] - origin, _LOWEST)
    work[count] = v
    count += v > low
  above = 0
  for i in range(count):
    above += work[i] >= cut
  return count, above


@njit(**_OPTIONS)
def _sparse_bracket(row, n, k, l, a, origin, finite, top, work, scratch, guess):
  """The bracket of a p-norm row's threshold, relative to ``origin``; see the module
  docstring. ``finite``: every entry is finite; ``top``: then the row's maximum.
  Returns (solved, lam, lo, hi, start, k_f, count): ``lam`` where ``solved`` (rows the
  bracket answers: binary, NaN, ``k`` at its ends), else Newton is to run on
  ``work[:count]`` for the target ``k_f`` in [lo, hi] from ``start``.

  The candidates: with ``t`` = the row maximum minus ``guess[0]`` (a running mean of
  the previous rows' distances from their maximum to their ``ceil(k) + 1``-th largest
  entry plus 3 running mean deviations, :func:`_update_guess`) and at least
  ``ceil(k) + 1`` entries at or above ``t``, the ``ceil(k) + 1`` largest are at or
  above ``t`` and every entry above ``x_(m) - l >= t - l`` is above ``t - l``: one pass
  gathers the entries above ``t - l`` (a second with twice the distance if the first
  finds too few). Otherwise (the first row, non-finite entries) every finite entry is
  a candidate. Either way the bracket ``[x_(m) - l, x_(j+1)]`` is taken from the
  candidates (selected on a copy) and Newton runs on the candidates above
  ``x_(m) - l`` in row order, from a point inside the bracket: the result does not
  depend on the guess, nor on the other
  rows.
  """
  top = top - origin if finite and n > 0 else np.nan
  k_f, count = k, -1
  interior = finite and k > 0.0 and k < n - 1
  if interior and k <= 2.0 and n <= _ONE_PASS_ROW:
    m, j = int(math.ceil(k)), int(math.floor(k))
    count, x_m, x_next, x_after = _one_pass_bracket(row, n, origin, m, j, l, work)
    return _bracket_from(work, count, x_m, x_next, k, l, a, m, j)
  if interior and guess[0] == np.inf and n >= _SAMPLED_ROW:
    guess[0] = top - (_sample_cut(row, n, k, scratch) - origin)
  if interior and guess[0] < np.inf:
    distance = guess[0]
    for _ in range(2):
      cut = top - distance
      count, above = _gather_near_top(row, n, origin, cut, cut - l, work)
      if above >= math.ceil(k) + 1:
        break
      count, distance = -1, 2.0 * distance + l
  if count < 0:
    n_pos_inf, n_above, nan, x_min, x_max = _finite_counts(row, n, origin)
    known, value = _known_row(n_pos_inf, n_above, nan, x_min, x_max, k, l, 0.0, 2.0 * l)
    if known:
      return True, value, 0.0, 0.0, 0.0, k, 0
    k_f = k - n_pos_inf
    count = _gather_above(row, n, -np.inf, origin, work)
  m, j = int(math.ceil(k_f)), int(math.floor(k_f))
  x_m, x_next, x_after = _order_statistics_after(work, count, m, j, scratch)
  if interior and x_after > -np.inf:
    _update_guess(guess, top - x_after)
  return _bracket_from(work, count, x_m, x_next, k_f, l, a, m, j)


@njit(inline="always", **_OPTIONS)
def _bracket_from(work, count, x_m, x_next, k_f, l, a, m, j):
  """:func:`_sparse_bracket`'s result from the order statistics of the candidates
  ``work[:count]``: the binary rows' threshold, or the candidates above ``x_(m) - l``
  moved to the front, the bracket and the start."""
  lo, hi = x_m - l, x_next
  if j == m and lo >= hi:  # binary: the middle of the flat root interval
    return True, _midpoint(hi, lo), lo, hi, lo, k_f, 0
  count = _count_above(work, count, lo)
  # Start a fraction 2^-a of the way up the bracket: measured on normal rows, it saves
  # one or two passes against the middle for p = 4/3 (a = 3) and is the middle for p = 2.
  start = lo + min(max(0.5 ** a, 0.1), 0.9) * (hi - lo)
  return False, np.nan, lo, hi, start, k_f, count


@njit(**_OPTIONS)
def _one_pass_bracket(row, n, origin, m, j, l, work):
  """For ``m = ceil(k) <= 2`` on a finite row: one branch-free pass keeps the three
  largest entries (min/max pairs) and gathers into ``work`` every entry above the
  ``m``-th largest of the entries before it minus ``l``, a superset of the candidates
  (that running ``m``-th largest never exceeds the final ``x_(m)``). Returns (count, x_(m), x_(j+1),
  x_(m+1))."""
  s0, s1, s2 = -np.inf, -np.inf, -np.inf
  count = 0
  for i in range(n):
    v = max(row[i] - origin, _LOWEST)
    work[count] = v
    # the cut of the entries before this one: no dependency of count on this entry's
    # insertion (a shorter chain from one entry to the next)
    count += v > (s0 if m == 1 else s1) - l
    carried = min(s0, v)
    s0 = max(s0, v)
    s2 = max(s2, min(s1, carried))
    s1 = max(s1, carried)
  tops = (s0, s1, s2)
  return count, tops[m - 1], tops[j], tops[m]


@njit(**_OPTIONS)
def _sparse_row(row, n, k, l, a, tol, origin, finite, top, work, scratch, guess):
  """The threshold of a p-norm row, relative to ``origin``: :func:`_sparse_bracket`,
  then Newton on the candidates. Returns (lam, passes, whether the shift may have
  hidden a binary row: :func:`_shift_may_hide_binary`)."""
  solved, lam, lo, hi, start, k_f, count = _sparse_bracket(
      row, n, k, l, a, origin, finite, top, work, scratch, guess)
  if solved:
    return lam, 0, _shift_may_hide_binary(lo, hi, k_f, origin)
  lam, passes = _newton(work, count, k_f, l, PNORM, a, lo, hi, start, tol, reach=l)
  return lam, passes, _shift_may_hide_binary(lo, hi, k_f, origin)


@njit(**_OPTIONS)
def _shift_may_hide_binary(lo, hi, k_f, origin):
  """Whether the binary test of a row solved relative to ``origin != 0`` with integer
  ``k_f`` may have been decided wrongly by the shift: the shifted entries ``x - origin``
  are each rounded (or clamped to the float range near its maximum), which can close a
  binary row's flat root interval ``[x_(j+1), x_(m) - l]`` by a few of their ulps, or
  open one where entries tie after rounding (issue 33 item 4: ``[1.7e308, -1e308,
  -1e308 - 2 ulps]``, ``k = 2``, ``l = 1.5 ulps``: both lower entries clamp to the same
  value). Suspect: the interval's ends within a few ulps of each other, or not finite."""
  if origin == 0.0 or k_f != math.floor(k_f):
    return False
  if not (abs(lo) < np.inf and abs(hi) < np.inf):
    return True
  return abs(hi - lo) <= 8.0 * _EPS64 * (abs(lo) + abs(hi))


@njit(**_OPTIONS)
def _binary_in_original(row, n, k_f, l):
  """``(binary, lam)`` of a finite-k row decided in the row's own coordinates: with
  ``m = k_f`` and the m-th and (m+1)-th largest finite entries ``a > b``, the row is
  binary iff ``a - b >= l`` (one rounding, monotone: the exact decision; an overflow
  means a gap beyond the float range). ``lam`` is the middle of ``[b, a - l]`` where
  the write then gives exact ones and zeros, else ``b`` (an interval a few ulps wide:
  ``a - b >= l`` and ``b - b = 0`` hold exactly)."""
  m = int(k_f)
  values = np.empty(max(n, 1))
  count = 0
  for i in range(n):
    v = row[i]
    values[count] = v
    count += (v > -np.inf) & (v < np.inf)
  if m < 1 or m >= count:
    return False, 0.0
  scratch = np.empty(max(count, m + 1))
  x_a, _, x_b = _order_statistics_after(values, count, m, m, scratch)
  if not (x_a - x_b >= l):
    return False, 0.0
  lam = _midpoint(x_b, x_a - l)
  if not (lam >= x_b and x_a - lam >= l):
    lam = x_b
  return True, lam


@njit(inline="always", **_OPTIONS)
def _update_guess(guess, gap):
  """Running mean ``guess[1]`` and mean deviation ``guess[2]`` (weight 1/8 for the new
  row) of the rows' gaps from their maximum to their ``ceil(k) + 1``-th largest entry;
  the next row's distance ``guess[0]`` = mean + 3 deviations."""
  if guess[1] == np.inf:
    guess[1], guess[2] = gap, 0.25 * gap
  else:
    guess[2] += 0.125 * (abs(gap - guess[1]) - guess[2])
    guess[1] += 0.125 * (gap - guess[1])
  guess[0] = guess[1] + 3.0 * guess[2]


@njit(**_OPTIONS)
def _count_above(values, count, cut):
  """Moves the entries of values[:count] above ``cut`` to the front; returns how many."""
  kept = 0
  for i in range(count):
    v = values[i]
    values[kept] = v
    kept += v > cut
  return kept


@njit(**_OPTIONS)
def _known_row(n_pos_inf, n_above, nan, x_min, x_max, k, l, below_max, below_min):
  """(known, lam) for the rows the problem's bracket answers without iterating: NaN
  without a threshold (a NaN entry, more +inf entries than k, fewer entries above
  -inf than k); every finite entry at 0 (``k`` = #(+inf)): ``max - below_max``; every
  finite entry at 1 (``k`` = #entries above -inf): ``min - below_min``. ``max`` and
  ``min`` are those of the finite entries (0 when there are none)."""
  if nan or n_pos_inf > k or n_above < k:
    return True, np.nan
  any_finite = n_above > n_pos_inf
  if k == n_pos_inf:
    return True, (x_max if any_finite else 0.0) - below_max
  if k == n_above:
    return True, (x_min if any_finite else 0.0) - below_min
  return False, 0.0


@njit(**_OPTIONS)
def _dense_row(row, n, k, l, kind, a, tol, origin, work):
  """The threshold, relative to ``origin``, of a row under a regularizer that never
  reaches 0 (entropy, sigmoid, Laplace): Newton over every finite entry. Returns
  (lam, passes)."""
  n_pos_inf, n_above, nan, x_min, x_max = _finite_counts(row, n, origin)
  known, value = _known_row(n_pos_inf, n_above, nan, x_min, x_max, k, l, -np.inf, np.inf)
  if known:
    return value, 0
  count = _gather_above(row, n, -np.inf, origin, work)
  k_f = k - n_pos_inf
  shift = l * _omega_prime(k_f / count, kind, a)
  # An end beyond the float range (x near the float maximum, l on its scale) is
  # clamped to it, as the pure-JAX solver does: bisection never leaves an infinite end.
  lo = max(x_min - (0.0 if kind == ENTROPY else shift), _LOWEST)
  hi = min(x_max - shift, -_LOWEST)
  return _newton(work, count, k_f, l, kind, a, lo, hi, _midpoint(lo, hi), tol, reach=l)


@njit(inline="always", **_OPTIONS)
def _mask_value(v, lam, l, kind, a):
  """The mask at entry v for threshold lam (the problem's ``primal``): +inf -> 1,
  -inf -> 0, an infinite lam -> its limit, NaN propagates; saturated where the
  distance v - lam is at least l z1 (or at most l z0)."""
  if v != v or lam != lam:
    return np.nan
  if abs(v) == np.inf:
    return 1.0 if v > 0 else 0.0
  if abs(lam) == np.inf:
    return 0.0 if lam > 0 else 1.0
  d = v - lam
  if kind == PNORM:
    if d <= 0.0:
      return 0.0
    if d >= l:
      return 1.0
  elif kind == ENTROPY and d >= 0.0:
    return 1.0
  return _mask_terms(d / l if abs(d) < np.inf else v / l - lam / l, kind, a)[0]


@njit(**_OPTIONS)
def _write_mask(row, n, lam, l, kind, a, origin, finite, out):
  """out[i] = the mask of row[i] - origin at threshold lam; returns the sum of out as
  stored. Finite rows and thresholds (nearly all) take the vectorized
  :func:`_write_finite_mask`; other rows the entry-by-entry rules of
  :func:`_mask_value`. The scalars go on as float64, int64 and bool (every use of
  ``l`` meets a float64 first: the same values), so that numba compiles one copy per
  dtype of the row, not one per call site's constants."""
  return _write_mask_of(row, n, np.float64(lam), np.float64(l), np.int64(kind), np.float64(a),
                        np.float64(origin), finite == True, out)  # noqa: E712 (a plain bool)


@njit(**_OPTIONS)
def _write_mask_of(row, n, lam, l, kind, a, origin, finite, out):
  """:func:`_write_mask` with its scalars float64, int64 and bool."""
  if abs(lam) < np.inf and finite:
    return _write_finite_mask(row, n, lam, l, kind, a, origin, out)
  total = 0.0
  for i in range(n):
    v = max(row[i] - origin, _LOWEST) if abs(row[i]) < np.inf else row[i]
    out[i] = _mask_value(v, lam, l, kind, a)
    total += out[i]
  return total


@njit(inline="always", **_OPTIONS)
def store_threshold(lam, shift, b, value, origin):
  """Stores row ``b``'s threshold ``origin + value`` (float64) as the pair
  ``shift[b] + lam[b]`` of the output dtype: ``shift`` the nearest float of that dtype to
  the threshold, ``lam`` the rest. The derivative kernels read ``lam + shift`` in float64,
  so they see the threshold to about twice the dtype's precision: a float32 row of
  entries near 1e38 whose flat root interval (a binary mask) is narrower than an ulp of
  the threshold keeps its threshold inside it, and its derivatives 0."""
  shift[b] = origin + value
  if abs(np.float64(shift[b])) < np.inf:
    lam[b] = (origin - np.float64(shift[b])) + value
  else:  # not finite in the output dtype (+-inf rows, NaN, beyond float32): as computed
    lam[b], shift[b] = value, origin


@njit(**_OPTIONS)
def snap_candidate(row, n, lam, l, kind, origin, tol):
  r"""The entry a threshold ``lam`` (relative to ``origin``) may snap to, or NaN: one
  vectorized pass a row, then :func:`snap_to_entry` where it is not NaN.

  Where an entry :math:`x_j` sits exactly at the threshold (integer data), the
  iteration can stop a few ulps below it and leave :math:`x_j` a mass of
  :math:`((x_j - \lambda)/l)^a` (7e-17 at p = 2) instead of the exact 0, one entry too
  many in the support. The candidate is the smallest entry :math:`v` above ``lam``
  where :math:`v - \lambda \le` ``tol`` :math:`\max(|\lambda|, l)` (the iteration's
  own tolerance), for finite p-norm thresholds only (the others have no exact zeros;
  a row with NaN has a NaN threshold). Rows solved in their own coordinates (``origin
  = 0``, nearly all) take the integer-key pass of
  :func:`~implicit_topk.kernels.cpu.ordered_bits.smallest_above` (0.06 against 0.6
  ns an entry); rows solved relative to their largest entry compare ``x - origin``
  (rare; numba's float ``min`` stays scalar whatever the fast-math flags, so none are
  set: a NaN threshold must read as NaN). (Two calls rather than one: an inlined
  function with early returns and a row of scratch cost 22 against 3.6 ns a row of 8.)"""
  if kind != PNORM or not abs(lam) < np.inf:
    return np.nan
  if origin == 0.0:
    nearest = smallest_above(row, n, lam)
  else:
    nearest = np.inf
    for i in range(n):
      v = max(row[i] - origin, _LOWEST)
      nearest = min(nearest, v if v > lam else np.inf)
  return nearest if within_snap(lam, nearest, l, tol) else np.nan


@njit(inline="always", **_OPTIONS)
def within_snap(lam, nearest, l, tol):
  """Whether the entry ``nearest`` above the threshold ``lam`` lies within the
  iteration's tolerance of it (False for a NaN ``lam`` or ``nearest``, and for
  ``nearest = +inf``; the callers pass finite thresholds)."""
  return nearest - lam <= tol * max(abs(lam), l)


@njit(**_OPTIONS)
def snap_to_entry(row, n, lam, nearest, l, k, kind, a, origin, tol):
  """``(threshold, moved)``: the candidate ``nearest`` of :func:`snap_candidate` where
  the mask there sums to ``k`` at least as closely as the mask at ``lam``, or to the
  rounding of an exact root's sum, ``(tol + n eps64) max(k, 1)`` (both written by
  :func:`_write_mask` in the row's dtype, each entry rounded by at most ``tol / 8`` of
  itself, and summed in float64), else ``lam`` (``proofs/snap_to_entry.md``). (``n tol
  max(k, 1)``, a float32 sum's bound, took entries 7 float32 ulps away on long float32
  rows: a row of 1e4 entries 1000 + N(0, 1), k = 5000, summed to k - 1.66.)
  Not float64 rows at the ends of the float range (solved rescaled: ``lam`` is not in
  the row's units)."""
  largest, finite = 0.0, True
  for i in range(n):
    largest = max(largest, abs(row[i]))
    finite &= abs(row[i]) < np.inf
  if float64_entries(row) and not (largest < _ENTRY_LIMIT and l >= _STRENGTH_FLOOR):
    return lam, False
  spare = np.empty(n, row.dtype)  # (rare: only where an entry lies that close)
  here = abs(_write_mask(row, n, lam, l, kind, a, origin, finite, spare) - k)
  there = abs(_write_mask(row, n, nearest, l, kind, a, origin, finite, spare) - k)
  # (an exact root sums to k only to the rounding of its entries and of their float64 sum:
  # 1/3 + 2/3 + 1 = 2 - 2^-52)
  return (nearest, True) if there <= max(here, (tol + n * _EPS64) * max(k, 1.0)) else (lam, False)


@njit(cache=True, error_model="numpy", fastmath={"reassoc"})
def _write_finite_mask(row, n, lam, l, kind, a, origin, out):
  """The mask of a finite row at a finite threshold, branch-free (vectorized; only the
  sum is reassociated). ``z = (x - lam) / l`` is taken as ``(x - lam) * (1 / l)``,
  clipped to [0, 1] and set to exactly 1 where the distance ``x - lam`` is at least
  ``l``, so saturated entries are exactly 0 and 1 as with a correctly rounded
  division; in between the two differ by at most one rounding."""
  total = 0.0
  inv = 1.0 / l
  if kind == PNORM and a == 3.0:
    for i in range(n):
      d = max(row[i] - origin, _LOWEST) - lam
      z = 1.0 if d >= l else min(max(d * inv, 0.0), 1.0)
      w = out.dtype.type(z * z * z)
      out[i] = w
      total += w
  elif kind == PNORM and a == 1.0:
    for i in range(n):
      d = max(row[i] - origin, _LOWEST) - lam
      w = out.dtype.type(1.0 if d >= l else min(max(d * inv, 0.0), 1.0))
      out[i] = w
      total += w
  elif kind == PNORM:
    for i in range(n):
      d = max(row[i] - origin, _LOWEST) - lam
      w = out.dtype.type(math.pow(1.0 if d >= l else min(max(d * inv, 0.0), 1.0), a))
      out[i] = w
      total += w
  elif kind == ENTROPY:
    for i in range(n):
      w = out.dtype.type(math.exp(min(_scaled_div(max(row[i] - origin, _LOWEST), lam, l), 0.0)))
      out[i] = w
      total += w
  else:
    for i in range(n):
      w = out.dtype.type(_mask_terms(_scaled_div(max(row[i] - origin, _LOWEST), lam, l), kind, a)[0])
      out[i] = w
      total += w
  return total


@njit(inline="always", **_OPTIONS)
def _insert3(s0, s1, s2, v):
  """The three largest of ``s0 >= s1 >= s2`` and ``v``, in order (min/max pairs)."""
  carried = min(s0, v)
  return max(s0, v), max(s1, carried), max(s2, min(s1, carried))


@njit(inline="always", **_OPTIONS)
def _gather_two_halves(row, n, m, l, work, limit=np.inf):
  """One pass over a finite-or-not row keeping its three largest entries and gathering
  every entry above the ``m``-th largest of the entries before it in its half minus
  ``l`` (a superset of the candidates: that running ``m``-th largest never exceeds the
  row's ``x_(m)``), the two halves as two independent chains interleaved, the gathered
  entries in row order in ``work``. Returns (finite, s0, s1, s2, count), ``finite``:
  every entry below ``limit`` in magnitude (:data:`_ENTRY_LIMIT` for float64 rows)."""
  half = n // 2
  finite = True
  a0, a1, a2, b0, b1, b2 = -np.inf, -np.inf, -np.inf, -np.inf, -np.inf, -np.inf
  count_a, count_b = 0, half
  for i in range(half):
    u, v = float(row[i]), float(row[half + i])
    finite &= (abs(u) < limit) & (abs(v) < limit)
    work[count_a] = u
    work[count_b] = v
    count_a += u > (a0 if m == 1 else a1) - l
    count_b += v > (b0 if m == 1 else b1) - l
    a0, a1, a2 = _insert3(a0, a1, a2, u)
    b0, b1, b2 = _insert3(b0, b1, b2, v)
  for i in range(2 * half, n):  # the last entry of an odd row
    v = float(row[i])
    finite &= abs(v) < limit
    work[count_b] = v
    count_b += v > (b0 if m == 1 else b1) - l
    b0, b1, b2 = _insert3(b0, b1, b2, v)
  for i in range(half, count_b):
    work[count_a + i - half] = work[i]
  a0, a1, a2 = _insert3(a0, a1, a2, b0)
  a0, a1, a2 = _insert3(a0, a1, a2, b1)
  a0, a1, a2 = _insert3(a0, a1, a2, b2)
  return finite, a0, a1, a2, count_a + count_b - half


@njit(inline="always", **_OPTIONS)
def _small_k_row(row, n, k, l, a, tol, root_eps, work, limit=np.inf):
  """The threshold of a p-norm row with ``0 < k <= 2`` and ``k < n - 1`` (the router
  rows), in one pass over the row: the pass checks that every entry is finite, keeps
  the three largest entries (min/max pairs) and, for rows longer than
  :data:`_IN_PLACE_ROW`, gathers the candidates as :func:`_one_pass_bracket` does;
  shorter rows are iterated on in place (the entries at or below the bracket's lower
  end add exact zeros to phi and its derivatives, so the sums are those over the
  candidates in row order: the same threshold to the bit as the general path).
  Returns (ok, lam, passes, the gap from the row's maximum to its ``ceil(k) + 1``-th
  largest entry); not ``ok`` (an entry not below ``limit`` in magnitude: non-finite,
  or at the float64 maximum's binade, to be rescaled; or a row far from 0 relative to
  ``l``, to be solved relative to its maximum) leaves the row to the general path."""
  m, j = int(math.ceil(k)), int(math.floor(k))
  if n > _IN_PLACE_ROW:
    finite, s0, s1, s2, count = _gather_two_halves(row, n, m, l, work, limit)
  else:
    finite, s0, s1, s2, count = True, -np.inf, -np.inf, -np.inf, 0
    for i in range(n):
      v = float(row[i])
      finite &= abs(v) < limit  # False at +-inf and NaN (a one-cycle chain: no sum)
      s0, s1, s2 = _insert3(s0, s1, s2, v)
  gather = n > _IN_PLACE_ROW
  if not finite or abs(s0) * root_eps > l:
    return False, 0.0, 0, np.inf
  gap = s0 - (s1 if m == 1 else s2)
  x_m = s0 if m == 1 else s1
  x_next = s0 if j == 0 else (s1 if j == 1 else s2)
  lo, hi = x_m - l, x_next
  if j == m and lo >= hi:  # binary: the middle of the flat root interval
    return True, _midpoint(hi, lo), 0, gap
  start = lo + min(max(0.5 ** a, 0.1), 0.9) * (hi - lo)
  if not gather:
    lam, passes = _newton(row, n, k, l, PNORM, a, lo, hi, start, tol, reach=l)
    return True, lam, passes, gap
  count = _count_above(work, count, lo)
  lam, passes = _newton(work, count, k, l, PNORM, a, lo, hi, start, tol, reach=l)
  return True, lam, passes, gap


@njit(inline="always", **_OPTIONS)
def _small_k_attempt(row, n, kb, lb, kind, a, tol, root_eps, work, guess, out, limit):
  """The router rows' path of :func:`_solve_row` (p-norm, ``0 < k <= 2``): ``(solved,
  threshold, passes, |sum(out) - k|)``, the mask written where ``solved``."""
  if (kind == PNORM and kb > 0.0 and kb <= 2.0 and kb < n - 1
      and (n <= _ONE_PASS_ROW or (guess[0] == np.inf and n < _SAMPLED_ROW))):
    # rows of more than _ONE_PASS_ROW entries take this path only while there is no
    # previous row nor a sample to guess their cut from; they leave the guess behind
    solved, value, it, gap = _small_k_row(row, n, kb, lb, a, tol, root_eps, work, limit)
    if solved and n > _ONE_PASS_ROW and gap < np.inf:
      _update_guess(guess, gap)
    if solved:
      total = _write_finite_mask(row, n, value, lb, kind, a, 0.0, out)
      return True, value, it, abs(total - kb)
  return False, 0.0, 0, 0.0


@njit(cache=True, error_model="numpy")
def _block_maxima(row, n, out):
  """``out[b]`` = the maximum of the entries ``b B .. b B + B - 1`` of a row of finite
  entries (``B`` = :data:`_SKIP_BLOCK`, the last block shorter), vectorized as
  :func:`_max_of_finite`."""
  block_largest(row, n, _SKIP_BLOCK, out)


@njit(inline="always", **_OPTIONS)
def _insert_descending(buffer, m, v):
  """``v`` into ``buffer[:m + 1]`` (sorted, largest first), the last entry dropped."""
  for p in range(m + 1):
    kept = buffer[p]
    buffer[p] = max(kept, v)
    v = min(kept, v)


@njit(**_OPTIONS)
def _first_row_pass(row, n, m, l, work, scratch, limit):
  """The pass of :func:`_first_row_attempt`: whether every entry is below ``limit`` in
  magnitude (a vectorized test, :func:`_all_finite` or :func:`_all_below`) and, for such
  a row, its ``m + 1`` largest entries sorted in ``scratch[:m + 1]`` and, gathered into
  ``work`` in row order, a superset of the candidates (every entry above ``x_(m) - l``).
  Returns (finite, count).

  By blocks of :data:`_SKIP_BLOCK` entries (``scratch[m + 1:]`` holds their maxima,
  :func:`_block_maxima`): with ``t`` the ``m + 1``-th largest block maximum, ``m + 1``
  blocks have an entry at or above ``t``, so ``x_(m+1) >= t`` and ``x_(m) - l >= t -
  l``. A block whose maximum is below ``t - l`` holds neither one of the ``m + 1``
  largest entries nor a candidate; the other blocks (a few more than ``m + 1`` in a
  random row) are gathered entry by entry above ``t - l``, in row order, and their
  entries from ``t`` up go through the insertion buffer. Rows of at most ``m + 1``
  blocks are gathered whole."""
  if not (_all_finite(row, n) if limit == np.inf else _all_below(row, n)):
    return False, 0
  for p in range(m + 1):
    scratch[p] = -np.inf
  blocks = (n + _SKIP_BLOCK - 1) // _SKIP_BLOCK
  least, floor = -np.inf, -np.inf
  maxima = scratch[m + 1:]
  if blocks > m + 1:
    _block_maxima(row, n, maxima)
    for b in range(blocks):
      if maxima[b] > scratch[m]:
        _insert_descending(scratch, m, float(maxima[b]))
    least = scratch[m]
    floor = least - l
    for p in range(m + 1):
      scratch[p] = -np.inf
  count = 0
  for b in range(blocks):
    if blocks > m + 1 and maxima[b] < floor:
      continue
    for i in range(b * _SKIP_BLOCK, min((b + 1) * _SKIP_BLOCK, n)):
      v = float(row[i])
      work[count] = v
      count += v > floor
      if v >= least and v > scratch[m]:
        _insert_descending(scratch, m, v)
  return True, count


@njit(inline="always", **_OPTIONS)
def _first_row_attempt(row, n, kb, lb, a, tol, root_eps, work, scratch, guess, out, limit):
  """A p-norm row with ``0 < k < n - 1`` and ``ceil(k) < _SORT_LIMIT`` that has no guess
  of its cut (the first row of a block) in one pass (:func:`_first_row_pass`) instead
  of :func:`_general_row`'s five (maximum, counts, gathering every entry, selection,
  candidates): the same order statistics, bracket and candidates in row order, so the
  same threshold, passes and mask to the bit. ``(solved, threshold, passes, |sum(out)
  - k|)``; not solved (nothing written) for a row with an entry not below ``limit`` in
  magnitude or far from 0 relative to ``l`` (solved relative to its maximum), which
  :func:`_general_row` takes."""
  m, j = int(math.ceil(kb)), int(math.floor(kb))
  finite, count = _first_row_pass(row, n, m, lb, work, scratch, limit)
  top = scratch[0]
  if not finite or abs(top) * root_eps > lb:
    return False, 0.0, 0, 0.0
  x_m, x_next, x_after = scratch[m - 1], scratch[j], scratch[m]
  _update_guess(guess, top - x_after)
  solved, lam, lo, hi, start, k_f, count = _bracket_from(work, count, x_m, x_next, kb, lb,
                                                         a, m, j)
  passes = 0
  if not solved:
    lam, passes = _newton(work, count, k_f, lb, PNORM, a, lo, hi, start, tol, reach=lb)
  total = _write_mask(row, n, lam, lb, PNORM, a, 0.0, True, out)
  return True, lam, passes, abs(total - kb)


@njit(**_OPTIONS)
def _solve_row(row, n, kb, lb, kind, a, tol, root_eps, work, scratch, guess, out):
  """One row's (threshold, passes, origin), its mask written into ``out``; returns
  also ``|sum(out) - k|``. A float64 row at the ends of the float range (scale exponent
  ``E != 0``, :func:`scale_exponent`) is solved as ``x 2^-E`` with strength ``l
  2^-E`` (:func:`_scaled_row`): its threshold and origin are those of the scaled row.
  Ordinary rows pay nothing for the test: the one-pass paths check their entries
  against :data:`_ENTRY_LIMIT` instead of infinity, the others' finiteness pass
  becomes :func:`_all_below`."""
  wide = float64_entries(row)
  plain = not wide or lb >= _STRENGTH_FLOOR  # E_hi >= 0
  if plain:
    solved, value, it, residual = _small_k_attempt(
        row, n, kb, lb, kind, a, tol, root_eps, work, guess, out,
        _ENTRY_LIMIT if wide else np.inf)
    if solved:
      return value, it, 0.0, residual
    # k <= 2 is _small_k_attempt's (these rows too)
    if (kind == PNORM and kb > 2.0 and kb < n - 1 and math.ceil(kb) < _SORT_LIMIT
        and guess[0] == np.inf and n < _SAMPLED_ROW):
      solved, value, it, residual = _first_row_attempt(
          row, n, kb, lb, a, tol, root_eps, work, scratch, guess, out,
          _ENTRY_LIMIT if wide else np.inf)
      if solved:
        return value, it, 0.0, residual
  if not wide:
    return _general_row(row, n, kb, lb, kind, a, tol, root_eps, work, scratch, guess, out,
                        _all_finite(row, n))
  return _float64_row(row, n, kb, lb, kind, a, tol, root_eps, work, scratch, guess, out, plain)


def _float64_row(row, n, kb, lb, kind, a, tol, root_eps, work, scratch, guess, out, plain):
  """:func:`_solve_row`'s end for a float64 row: :func:`_general_row`, on the row
  rescaled by :func:`_scaled_row` where its scale exponent is not 0. In numba an
  overload chosen by the row's dtype, so that the float32 kernels (whose rows never
  need the rescaling) compile none of it: a branch on a compile-time constant would
  still be typed, and each function it calls compiled once more."""
  raise NotImplementedError("numba only")


@overload(_float64_row)
def _float64_row_for(row, n, kb, lb, kind, a, tol, root_eps, work, scratch, guess, out, plain):
  if row.dtype != types.float64:
    return lambda row, n, kb, lb, kind, a, tol, root_eps, work, scratch, guess, out, plain: (
        np.nan, 0, 0.0, np.nan)  # never called: _solve_row takes float32 rows before

  def float64_row(row, n, kb, lb, kind, a, tol, root_eps, work, scratch, guess, out, plain):
    if plain:
      below = _all_below(row, n)
      if below:  # E_lo <= 0 <= E_hi: E = 0
        return _general_row(row, n, kb, lb, kind, a, tol, root_eps, work, scratch, guess, out,
                            below)
    e, finite = scale_exponent(row, n, lb)
    if e == 0:  # a non-finite entry, or both ends at once
      return _general_row(row, n, kb, lb, kind, a, tol, root_eps, work, scratch, guess, out,
                          finite)
    return _scaled_row(row, n, kb, lb, e, kind, a, tol, root_eps, work, scratch, out)
  return float64_row


@njit(**_OPTIONS)
def _scaled_row(row, n, kb, lb, e, kind, a, tol, root_eps, work, scratch, out):
  """:func:`_solve_row` on the row ``x 2^-e`` with strength ``l 2^-e`` (exact: a power
  of two; entries that underflow move their ``z`` by less than the precision,
  ``proofs/float_range.md``), with a guess of its own (the rows around it keep
  theirs): the threshold and origin of the scaled row, the mask of both."""
  factor = power_of_two(-e)
  scaled = np.empty(max(n, 1))
  for i in range(n):
    scaled[i] = row[i] * factor
  lb = lb * factor
  guess = np.full(3, np.inf)
  solved, value, it, residual = _small_k_attempt(
      scaled, n, kb, lb, kind, a, tol, root_eps, work, guess, out, np.inf)
  if solved:
    return value, it, 0.0, residual
  return _general_row(scaled, n, kb, lb, kind, a, tol, root_eps, work, scratch, guess, out,
                      _all_finite(scaled, n))


@njit(**_OPTIONS)
def _general_row(row, n, kb, lb, kind, a, tol, root_eps, work, scratch, guess, out, finite):
  """:func:`_solve_row` past the router rows' path; ``finite``: every entry is
  finite."""
  top = _max_of_finite(row, n) if n > 0 and finite else _finite_counts(row, n, 0.0)[4]
  # As the problems' normalize: rows far from 0 relative to l are solved relative to
  # their largest finite entry (shift invariance), so that x - lam keeps its digits.
  far = abs(top) < np.inf and abs(top) * root_eps > lb
  origin = top if far else 0.0
  if kind == PNORM:
    value, it, suspect = _sparse_row(row, n, kb, lb, a, tol, origin, finite, top, work,
                                     scratch, guess)
    if suspect:
      # The shift's rounding can decide the binary test wrongly: decide it in the
      # row's own coordinates, where the decision is exact (rows with NaN stay NaN).
      n_pos_inf, _, nan, _, _ = _finite_counts(row, n, 0.0)
      binary, root = _binary_in_original(row, n, kb - n_pos_inf, lb)
      if binary and not nan:
        value, it, origin = root, 0, 0.0
  else:
    value, it = _dense_row(row, n, kb, lb, kind, a, tol, origin, work)
  total = _write_mask(row, n, value, lb, kind, a, origin, finite, out)
  return value, it, origin, abs(total - kb)
