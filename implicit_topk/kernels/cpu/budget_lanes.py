r"""The budgeted mask of router rows, a block of rows at a time in lanes (numba, CPU).

The per-row budget kernel (:mod:`~implicit_topk.kernels.cpu.budget_kernel`) spends most
of a row of 8 entries in branches on data (its piece walks, the tie rule). Here a block
of :data:`~implicit_topk.kernels.cpu.native_lanes.BLOCK` rows goes through loops over
the rows, as the plain mask's lanes do (:mod:`~implicit_topk.kernels.cpu.native_lanes`),
rows of at most :data:`~implicit_topk.kernels.cpu.native_lanes.LANE_ROW` entries whole
(:func:`block_budget`), longer ones by the candidates the plain kernel gathers, every
entry that can lie above the plain threshold (:func:`gathered_budget`):

* each lane's bracket (the plain mask's lanes), its m+1 largest entries (min/max pairs
  over the lanes), its cut :math:`c = x_{(m+1)}` and
  :math:`S(l) = \sum_{j<m} g((x_{(j+1)} - c)/l)`, summed in the per-row kernel's order;
* where :math:`S(l) < k` (the plain mask would exceed the budget), the crossing strength
  :math:`l^\star` of the per-row kernel's ``_crossing_strength``, the same arithmetic:
  its piece found for every lane at once (:func:`_crossing_lanes`, loops over the
  lanes; per lane in the per-row kernel's branches it cost 40 ns a bound row), its root
  per lane;
* the plain threshold :math:`\lambda` of the lanes where the budget does not bind
  (:math:`l \le l^\star`) only, by the plain mask's Newton passes on those lanes alone
  (moved to the front) and on their m largest entries alone: there
  :math:`\lambda \ge c`, so every entry above :math:`\lambda` is among them and the
  others add exact zeros at the root (the iterates, and so the last bits, may differ
  from the plain kernel's). At 16384 x 8, ``k = 2``, ``m = 3``, strength 1 (75% of the
  rows bound) skipping the bound lanes' passes took the kernel from 91-93 to 65-68 ns a
  row (the plain kernel: 48-55), iterating on the m largest entries the passes from 16
  to 11 ns a row (18 to 15 at strength 0.5, 65% of the rows unbound);
* the mask: at :math:`(c, l^\star)` where :math:`l > l^\star` (the budget binds),
  else the plain mask at :math:`\max(\lambda, c)` (``shift`` the threshold, ``offset``
  0; :math:`\lambda` snapped to an entry as the plain kernel does,
  :func:`~implicit_topk.kernels.cpu.native_threshold.snap_to_entry`), 0 at or below the
  cut.

A lane is taken where the plain mask's lanes take its row (finite entries, ``k`` in
``(0, 2]``, p = 4/3 or 2, at most 16 candidates), ``m`` is at most :data:`LARGEST_M`,
the strength is positive and the m+1 largest entries are distinct: no tie rule, no
merged weights, so that every sum is the per-row kernel's (or, for a longer row, it has
at most ``m`` candidates: the plain mask, see :func:`gathered_budget`). Other rows are
left to the per-row kernel. At 16384 x 64, ``k = 2``, ``m = 4``, strength 0.3 (21% of
the rows bound), the longer rows' lanes took the kernel from 244-254 to 202-213 ns a row
(the plain kernel: 165-181); blocks whose first two rows both bind stay with the per-row
kernel (at strength 1, 92% bound, it is the faster: 204-213 ns a row against 239-241 in
the lanes). Where the budget does not bind, the threshold is the plain mask's Newton
iteration's rather than the per-row kernel's closed form: the same value to rounding.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from implicit_topk.kernels.cpu import native_lanes
from implicit_topk.kernels.cpu.budget_row import _mask
from implicit_topk.kernels.cpu.kinds import PNORM
from implicit_topk.kernels.cpu.native_threshold import _OPTIONS, snap_to_entry, within_snap

#: The largest budget the lanes take.
LARGEST_M = 8
_INF = np.inf
# the rows of the lanes' scratch: a carry, S(l), the crossing piece of each lane
# (found, its gap d_J, the clip d_(J-1), M_J / (k - W_J)), 1 / d_j and l*
_CARRY, _TOTAL, _FOUND, _GAP, _LEFT, _RATIO, _INV, _STAR = range(8)
_PIECE_ROWS = 8


@njit(**_OPTIONS)
def takes(a, n, m):
  """How rows of ``n`` entries with budget ``m`` and exponent ``a`` go through lanes: 0
  not at all, 1 whole (:func:`block_budget`), 2 by their candidates
  (:func:`gathered_budget`)."""
  return native_lanes.takes(PNORM, a, n) if m <= LARGEST_M else 0


@njit(**_OPTIONS)
def workspace(n, m):
  """The plain lanes' arrays (:func:`native_lanes.workspace`), then the lanes' m+1
  largest entries, the rows of :func:`_crossing_lanes` (a carry, each lane's S(l), its
  crossing piece, its l*) and the lanes whose plain threshold is needed."""
  values, state, iterating = native_lanes.workspace(n)
  return (values, state, iterating, np.empty((min(m, LARGEST_M) + 1, native_lanes.BLOCK)),
          np.empty((_PIECE_ROWS, native_lanes.BLOCK)), np.empty(native_lanes.BLOCK, np.int64))


@njit(**_OPTIONS)
def block_budget(x, b0, width, k, l, m, a, tol, root_eps, work, lanes, shift, offset,
                 strength, cut):
  """Rows ``b0 .. b0 + width - 1`` of ``x`` (at most
  :data:`~implicit_topk.kernels.cpu.native_lanes.LANE_ROW` entries) that the lanes
  take: ``(shift, offset, strength, cut)`` as the per-row kernel defines them (the mask
  is written from them by the caller). Returns the bit mask of those rows (bit ``r``
  for row ``b0 + r``). ``lanes``: :func:`workspace`; ``work``: a row of scratch."""
  values, state = lanes[0], lanes[1]
  plain = native_lanes.block_brackets(x, b0, width, k, l, a, root_eps, values, state)
  return _budget_in_lanes(x, b0, width, x.shape[1], False, plain, k, l, m, a, tol, work,
                          lanes, shift, offset, strength, cut)


@njit(**_OPTIONS)
def gathered_budget(x, b0, width, k, l, m, a, tol, root_eps, work, lanes, shift, offset,
                    strength, cut):
  r""":func:`block_budget` for longer router rows (up to the plain kernel's one-pass
  length), from each row's candidates, the entries above
  :math:`x_{(\lceil k\rceil)} - l` that the plain kernel gathers into its lanes
  (:func:`~implicit_topk.kernels.cpu.native_lanes.gather_block`): every entry above
  the plain threshold is one. A row with at least m+1 candidates has its m+1 largest
  entries among them; a row with at most ``m`` has at most ``m`` entries above its
  plain threshold, so its plain mask is the budgeted one (``proofs/support_budget.md``,
  "In the CPU kernel" (v)), and its cut is reported as ``-inf``."""
  values, state = lanes[0], lanes[1]
  plain, span = native_lanes.gather_block(x, b0, width, k, l, a, root_eps, values, state,
                                          work)
  return _budget_in_lanes(x, b0, width, span, True, plain, k, l, m, a, tol, work, lanes,
                          shift, offset, strength, cut)


@njit(**_OPTIONS)
def _budget_in_lanes(x, b0, width, span, gathered, plain, k, l, m, a, tol, work, lanes,
                     shift, offset, strength, cut):
  """The budget of the lanes ``plain`` (filled: ``values[:span]``, each row's entries or
  its candidates padded with ``-inf``; ``gathered``: candidates, whose count is in the
  state): the steps of the module's docstring. Returns the bit mask of the rows done."""
  values, state, iterating, tops, piece, unbound = lanes
  for j in range(m + 1):
    for r in range(width):
      tops[j, r] = -_INF
  carry = piece[0]
  for i in range(span):  # the m+1 largest entries of each lane, descending
    for r in range(width):
      carry[r] = values[i, r]
    for j in range(m + 1):
      for r in range(width):
        t, v = tops[j, r], carry[r]
        tops[j, r], carry[r] = max(t, v), min(t, v)
  taken, few = 0, 0
  for r in range(width):
    distinct = True
    for j in range(m):
      distinct &= tops[j, r] > tops[j + 1, r]
    lr = np.float64(l[b0 + r])
    # (at most m candidates: the plain mask; their cut tops[m] is the padding, -inf)
    at_most_m = gathered and state[native_lanes.COUNT, r] <= m
    if (plain >> r) & 1 and (distinct or at_most_m) and lr > 0.0 and np.float64(k[b0 + r]) < m:
      taken |= 1 << r
      few |= (1 << r) if at_most_m else 0
  # S(l) per lane, as the per-row kernel's _mask_sum sums it (every weight 1)
  total = piece[_TOTAL]
  for r in range(width):
    total[r] = 0.0
  for j in range(m):
    for r in range(width):
      total[r] += _mask((tops[j, r] - tops[m, r]) / np.float64(l[b0 + r]), a)
  over = 0  # the lanes where S(l) < k (the plain mask would exceed m): l* is needed
  for r in range(width):
    over |= (1 << r) if total[r] < np.float64(k[b0 + r]) and not (few >> r) & 1 else 0
  over &= taken
  if over != 0:  # (a block where the budget seldom binds skips the crossing pieces)
    _crossing_lanes(tops, m, k, b0, width, a, piece)
  # l* of each lane (inf where S(l) >= k); the plain threshold only where the budget
  # does not bind, those lanes iterated alone (a bound lane's threshold is its cut)
  star, count = piece[_STAR], 0
  for r in range(width):
    star[r] = _crossing_from(piece, r, a) if (over >> r) & 1 else _INF
    unbound[count] = r
    count += 1 if (taken >> r) & 1 and not np.float64(l[b0 + r]) > star[r] else 0
  # (an unbound lane's threshold is at least its cut: the entries above it are among its
  # m largest, and the others add 0 there)
  native_lanes.compact(tops, m, values, state, unbound, count)
  native_lanes.iterate(values, m, count, a, tol, state, iterating, work)
  n = x.shape[1]
  position = 0  # the lane of the next unbound row, after compact
  for r in range(width):
    if not (taken >> r) & 1:
      continue
    c, kr, lr = tops[m, r], np.float64(k[b0 + r]), np.float64(l[b0 + r])
    b = b0 + r
    cut[b] = c
    if lr > star[r]:  # the budget binds: lambda' = c at the strength l*
      shift[b], offset[b], strength[b] = c, 0.0, star[r]
    else:  # the plain mask (its threshold, snapped as the plain kernel does; at least the cut)
      value = state[native_lanes.LAM, position]
      nearest = state[native_lanes.NEAREST, position]
      position += 1
      if within_snap(value, nearest, lr, tol):
        value, _ = snap_to_entry(x[b], n, value, nearest, lr, kr, PNORM, a, 0.0, tol)
      shift[b], offset[b], strength[b] = max(value, c), 0.0, lr
  return taken


@njit(**_OPTIONS)
def _crossing_lanes(tops, m, k, b0, width, a, piece):
  r"""The crossing piece of :func:`~implicit_topk.kernels.cpu.budget_row._crossing_strength`
  on every lane at once (distinct values, every weight 1; loops over the lanes that
  LLVM vectorizes): with the gaps :math:`d_j = x_{(j+1)} - c`, the first :math:`J` with
  :math:`J + M_J > k`, :math:`M_J = \sum_{J \le i < m} (d_i/d_J)^a` summed in the same
  order, into ``piece``: its gap :math:`d_J`, the clip :math:`d_{J-1}` (``inf`` at
  :math:`J = 0`) and :math:`M_J / (k - J)`. Such a :math:`J < m` exists for ``k < m``
  (:math:`J = m - 1` gives :math:`m - 1 + 1`). :func:`_crossing_from` finishes a lane."""
  found, gap, left, ratio, carry, inv = (piece[_FOUND], piece[_GAP], piece[_LEFT],
                                         piece[_RATIO], piece[_CARRY], piece[_INV])
  for r in range(width):
    found[r], gap[r], left[r], ratio[r] = 0.0, 0.0, _INF, 0.0
  for j in range(m):
    for r in range(width):
      carry[r] = 0.0  # M_j
      inv[r] = 1.0 / (tops[j, r] - tops[m, r])
    for i in range(j, m):
      for r in range(width):
        q = (tops[i, r] - tops[m, r]) * inv[r]
        carry[r] += q if a == 1.0 else (q * q if a == 2.0 else q * q * q)
    for r in range(width):
      dj, room = tops[j, r] - tops[m, r], np.float64(k[b0 + r]) - j
      first = found[r] == 0.0 and j + carry[r] > np.float64(k[b0 + r])
      gap[r] = dj if first else gap[r]
      # (-1 where k - J <= 0: no room; M_J >= 1 otherwise)
      ratio[r] = (carry[r] / room if room > 0.0 else -1.0) if first else ratio[r]
      found[r] = 1.0 if first else found[r]
      left[r] = left[r] if found[r] == 1.0 else dj  # d_(J-1) once found


@njit(inline="always", **_OPTIONS)
def _crossing_from(piece, r, a):
  r""":math:`l^\star` of lane ``r`` from its piece (:func:`_crossing_lanes`), as
  ``_crossing_strength`` ends: :math:`\min(\max(d_J (M_J/(k - J))^{1/a}, d_J), d_{J-1})`,
  or :math:`d_{J-1}` where :math:`k - J \le 0`."""
  dj, left, ratio = piece[_GAP, r], piece[_LEFT, r], piece[_RATIO, r]
  if not ratio > 0.0:  # (k - J <= 0: no room)
    return left
  root = ratio if a == 1.0 else (math.sqrt(ratio) if a == 2.0 else np.cbrt(ratio))
  return min(max(dj * root, dj), left)
