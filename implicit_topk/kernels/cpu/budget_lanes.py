r"""The budgeted mask of short router rows, a block of rows at a time in lanes (numba, CPU).

The per-row budget kernel (:mod:`~implicit_topk.kernels.cpu.budget_kernel`) spends most
of a row of 8 entries in branches on data (its piece walks, the tie rule). Here a block
of :data:`~implicit_topk.kernels.cpu.native_lanes.BLOCK` rows goes through loops over
the rows, as the plain mask's lanes do (:mod:`~implicit_topk.kernels.cpu.native_lanes`):

* the plain threshold :math:`\lambda` of every lane, by those lanes (the plain mask's
  own Newton passes, to the bit);
* each lane's m+1 largest entries (min/max pairs over the lanes), its cut
  :math:`c = x_{(m+1)}` and :math:`S(l) = \sum_{j<m} g((x_{(j+1)} - c)/l)`, summed in
  the per-row kernel's order;
* where :math:`S(l) < k` (the plain mask would exceed the budget), the crossing strength
  :math:`l^\star` of the per-row kernel's ``_crossing_strength``, the same arithmetic:
  per lane, by the per-row kernel's own code;
* the mask: at :math:`(c, l^\star)` where :math:`l > l^\star` (the budget binds),
  else the plain mask at :math:`\max(\lambda, c)` (``shift`` the threshold, ``offset``
  0; :math:`\lambda` snapped to an entry as the plain kernel does,
  :func:`~implicit_topk.kernels.cpu.native_threshold.snap_to_entry`), 0 at or below the
  cut.

A lane is taken where the plain mask's lanes take its row (finite entries, ``k`` in
``(0, 2]``, p = 4/3 or 2, rows of at most
:data:`~implicit_topk.kernels.cpu.native_lanes.LANE_ROW` entries), ``m`` is at most
:data:`LARGEST_M`, the strength is positive and the m+1 largest entries are distinct:
no tie rule, no merged weights, so that every sum is the per-row kernel's. Other rows
are left to the per-row kernel. Where the budget does not bind, the threshold is the
plain mask's rather than the per-row kernel's closed form: the same value to rounding.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from implicit_topk.kernels.cpu import native_lanes
from implicit_topk.kernels.cpu.budget_row import _crossing_strength, _mask
from implicit_topk.kernels.cpu.kinds import PNORM
from implicit_topk.kernels.cpu.native_threshold import _OPTIONS, snap_to_entry, within_snap

#: The largest budget the lanes take.
LARGEST_M = 4
_INF = np.inf


@njit(**_OPTIONS)
def takes(a, n, m):
  """Whether rows of ``n`` entries with budget ``m`` and exponent ``a`` go through lanes."""
  return m <= LARGEST_M and native_lanes.takes(PNORM, a, n) == 1


@njit(**_OPTIONS)
def workspace(n, m):
  """The plain lanes' arrays (:func:`native_lanes.workspace`), then the lanes' m+1
  largest entries and three rows: a carry, each lane's S(l), ones (the weights)."""
  values, state, iterating = native_lanes.workspace(n)
  return (values, state, iterating, np.empty((min(m, LARGEST_M) + 1, native_lanes.BLOCK)),
          np.empty((3, native_lanes.BLOCK)))


@njit(**_OPTIONS)
def block_budget(x, b0, width, k, l, m, a, tol, root_eps, work, lanes, shift, offset,
                 strength, cut):
  """Rows ``b0 .. b0 + width - 1`` of ``x`` that the lanes take: ``(shift, offset,
  strength, cut)`` as the per-row kernel defines them (the mask is written from them
  by the caller). Returns the bit mask of those rows (bit ``r`` for row ``b0 + r``).
  ``lanes``: :func:`workspace`; ``work``: a row of scratch."""
  values, state, iterating, tops, piece = lanes
  ones = piece[2, :m + 1]
  ones[:] = 1.0
  plain = native_lanes.block_thresholds(x, b0, width, k, l, a, tol, root_eps, values, state,
                                        iterating, work)
  n = x.shape[1]
  for j in range(m + 1):
    for r in range(width):
      tops[j, r] = -_INF
  carry = piece[0]
  for i in range(n):  # the m+1 largest entries of each lane, descending
    for r in range(width):
      carry[r] = values[i, r]
    for j in range(m + 1):
      for r in range(width):
        t, v = tops[j, r], carry[r]
        tops[j, r], carry[r] = max(t, v), min(t, v)
  taken = 0
  for r in range(width):
    distinct = True
    for j in range(m):
      distinct &= tops[j, r] > tops[j + 1, r]
    lr = float(l[b0 + r])
    if (plain >> r) & 1 and distinct and lr > 0.0 and float(k[b0 + r]) < m:
      taken |= 1 << r
  # S(l) per lane, as the per-row kernel's _mask_sum sums it (every weight 1)
  total = piece[1]
  for r in range(width):
    total[r] = 0.0
  for j in range(m):
    for r in range(width):
      total[r] += _mask((tops[j, r] - tops[m, r]) / float(l[b0 + r]), a)
  for r in range(width):
    if not (taken >> r) & 1:
      continue
    c, kr, lr = tops[m, r], float(k[b0 + r]), float(l[b0 + r])
    # (the per-row kernel's own l*, on the lane's m+1 largest entries, each of weight 1:
    # the cut itself adds nothing, its gap being 0)
    l_star = _crossing_strength(tops[:, r], ones, c, kr, a) if total[r] < kr else _INF
    b = b0 + r
    cut[b] = c
    if lr > l_star:  # the budget binds: lambda' = c at the strength l*
      shift[b], offset[b], strength[b] = c, 0.0, l_star
    else:  # the plain mask (its threshold, snapped as the plain kernel does; at least the cut)
      value, nearest = state[native_lanes.LAM, r], state[native_lanes.NEAREST, r]
      if within_snap(value, nearest, lr, tol):
        value, _ = snap_to_entry(x[b], n, value, nearest, lr, kr, PNORM, a, 0.0, tol)
      shift[b], offset[b], strength[b] = max(value, c), 0.0, lr
  return taken
