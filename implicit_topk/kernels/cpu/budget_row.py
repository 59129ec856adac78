r"""The ``max_support`` kernel's rows one at a time: threshold and strength of the budgeted mask.

One pass over each row keeps its m+1 largest entries in a small sorted buffer (for
m < 5 in registers, every entry a branch-free insertion; otherwise an entry at most the
buffer's smallest costs one comparison, the others a branch-free insertion); only a row
with fewer than k entries strictly above the (m+1)-th largest (the tie rule) reads the
row again. Then, on those m+1 values in float64, the steps of :func:`implicit_topk.support_budget._solve`: the tie rule, the
crossing strength :math:`l^\star` and the plain threshold in the closed forms of
:mod:`implicit_topk._budget_pieces` (p = 2, 3/2, 4/3: :math:`a = 1, 2, 3`; other p
stay in JAX): per row ``(shift, offset, strength, cut)`` as ``_solve`` defines them, and
the mask from them (:func:`_write_mask`, a second pass over the row). The threshold's piece search forms a
sum of F only where the weights, summed in the same order, do not bound it past K
(``proofs/support_budget.md``, "In the CPU kernel" (iii)), and the row's helpers are
inlined (a call with arrays cost more than its work at m = 3).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import njit

_OPTIONS: dict[str, Any] = dict(cache=True, error_model="numpy", fastmath=False)
_INF = np.inf


@njit(inline="always", **_OPTIONS)
def _mask(u, a):
  r""":math:`\min(1, u_+)^a` (``a`` = 1, 2, 3)."""
  u = min(max(u, 0.0), 1.0)
  return u if a == 1.0 else (u * u if a == 2.0 else u * u * u)


@njit(inline="always", **_OPTIONS)
def _largest(row, m, top):
  """The m+1 largest entries of ``row`` into ``top``, descending (``-inf`` past the
  row's length); False where the row has NaN. For m < 5 (the router budgets) five
  running maxima in registers take every entry without a branch (min/max pairs: 10 against
  51 ns per row of 8 entries, 89 against 248 at 64, m = 4); otherwise an entry above the
  buffer's smallest goes in without branches (``top[j] = max(top[j], min(top[j-1], v))``
  from the end: a shift of the smaller values by one) and the others cost one comparison."""
  if m < 5:
    return _largest5(row, m, top)
  for j in range(m + 1):
    top[j] = -_INF
  nan = False
  for i in range(row.shape[0]):
    v = float(row[i])
    nan |= v != v
    if v > top[m]:
      for j in range(m, 0, -1):
        top[j] = max(top[j], min(top[j - 1], v))
      top[0] = max(top[0], v)
  return not nan


@njit(inline="always", **_OPTIONS)
def _pair(s, v):
  """``(max(s, v), min(s, v))``: a slot keeps the larger, the smaller moves on."""
  return max(s, v), min(s, v)


@njit(inline="always", **_OPTIONS)
def _largest5(row, m, top):
  """:func:`_largest` for m < 5: the five largest entries in registers."""
  s0 = s1 = s2 = s3 = s4 = -_INF
  nan = False
  for i in range(row.shape[0]):
    v = float(row[i])
    nan |= v != v
    s0, v = _pair(s0, v)
    s1, v = _pair(s1, v)
    s2, v = _pair(s2, v)
    s3, v = _pair(s3, v)
    s4 = max(s4, v)
  largest = (s0, s1, s2, s3, s4)
  for j in range(m + 1):
    top[j] = largest[j]
  return not nan


@njit(inline="always", **_OPTIONS)
def _entries(row, top, m, k, values, weights):
  """``values`` (distinct, descending, ``-inf`` past them) and ``weights`` (their
  counts) above the cut of the tie rule (``support_budget._entries``); returns the cut.
  Where fewer than ``k`` entries lie strictly above the (m+1)-th largest ``c``, one more
  pass over the row counts the entries at ``c`` (which enter together) and finds the
  next value below it, the cut."""
  c = top[m]
  above = 0
  while above < m and top[above] > c:
    above += 1
  for j in range(m + 1):
    values[j], weights[j] = -_INF, 0.0
  size = 0
  for j in range(above):  # the distinct values above c with their counts
    if size > 0 and top[j] == values[size - 1]:
      weights[size - 1] += 1.0
    else:
      values[size], weights[size] = top[j], 1.0
      size += 1
  if not above < k:
    return c
  at, below = 0.0, -_INF
  for i in range(row.shape[0]):
    v = float(row[i])
    if v == c:
      at += 1.0
    elif v < c and v > below:
      below = v
  values[size], weights[size] = c, at
  return below


@njit(inline="always", **_OPTIONS)
def _mask_sum(values, weights, cut, l, a):
  r""":math:`S(l) = \sum_i w_i\,g((v_i - c) / l)` (``_budget_pieces.mask_sum``)."""
  total = 0.0
  for i in range(values.shape[0]):
    gap = values[i] - cut
    if weights[i] > 0.0 and gap > 0.0:
      total += weights[i] * _mask(gap / l, a)
  return total


@njit(inline="always", **_OPTIONS)
def _crossing_strength(values, weights, cut, target, a):
  r""":math:`l^\star` of ``_budget_pieces.crossing_strength`` on the gaps
  :math:`d_i = v_i - c` (finite, positive, weight > 0)."""
  if target <= 0.0:
    return _INF
  size = values.shape[0]
  before, left, smallest, weight_sum = 0.0, _INF, _INF, 0.0
  for j in range(size):
    dj = values[j] - cut
    if not (weights[j] > 0.0 and dj > 0.0 and dj < _INF):
      left = _INF
      continue
    incl, inv = 0.0, 1.0 / dj  # M_j
    for i in range(j, size):
      di = values[i] - cut
      if weights[i] > 0.0 and di > 0.0 and di < _INF:
        r = di * inv
        incl += weights[i] * (r if a == 1.0 else (r * r if a == 2.0 else r * r * r))
    if before + incl > target:
      # the first piece past K gives the largest value (the later ones are clipped below
      # d_J <= this one): the maximum of _budget_pieces.crossing_strength
      room = target - before
      if not room > 0.0:
        return left
      r = incl / room
      root = r if a == 1.0 else (math.sqrt(r) if a == 2.0 else np.cbrt(r))
      return min(max(dj * root, dj), left)
    before += weights[j]
    weight_sum += weights[j]
    smallest = min(smallest, dj)
    left = dj
  return smallest if weight_sum >= target else np.nan


@njit(inline="always", **_OPTIONS)
def _entered(q, w, t, a):
  r"""F at the breakpoint where entry ``t`` enters (:math:`\lambda = q_t`): the entries
  before it, :math:`\sum_{i<t} w_i\,g(q_i - q_t)`."""
  f = 0.0
  for i in range(t):
    f += w[i] * _mask(q[i] - q[t], a)
  return f


@njit(inline="always", **_OPTIONS)
def _saturating(q, w, count, t, prefix, a, descending):
  r"""F where entry ``t`` saturates (:math:`\lambda = q_t - 1`): ``prefix`` (the weights up
  to ``t``, summed in order) plus the entries after it. Where ``q`` is ``descending``
  (finite), the first entry at or below the point ends the sum (it and the rest add 0)."""
  f = prefix
  for i in range(t + 1, count):
    u = q[i] - q[t] + 1.0
    if descending and not u > 0.0:
      break
    f += w[i] * _mask(u, a)
  return f


@njit(inline="always", **_OPTIONS)
def _at_cut(q, w, count, q_cut, a):
  r"""F at the cut: :math:`\sum_i w_i\,g(q_i - q_c)`."""
  f = 0.0
  for i in range(count):
    f += w[i] * _mask(q[i] - q_cut, a)
  return f


@njit(inline="always", **_OPTIONS)
def _threshold(values, weights, cut, l, target, a, q, w, v, e):
  r"""``(anchor, offset)`` of ``_budget_pieces.threshold``: :math:`\lambda = ` anchor +
  l offset with :math:`F(\lambda) = \sum_i w_i\,g((v_i - \lambda)/l) = K`,
  :math:`\lambda \ge c`; ``q``, ``w``, ``v``, ``e`` are scratch (m+1).

  The used entries (weight > 0, finite) are packed in order into ``v``, ``w`` and
  :math:`q_i = (v_i - \max v)/l`. F is evaluated at the breakpoints from the largest
  down (entry ``t`` entering at :math:`q_t`, saturating at :math:`q_t - 1`, the cut;
  ties in that order): ``lo`` is the first with F >= K and ``hi`` the one before it, as
  ``_budget_pieces.threshold`` finds them among all. Each F is a sum in index order of
  terms :math:`0 \le w_i g \le w_i`, and rounding is monotone, so the weights summed in
  the same order bound it: at an entering point F is at most the weights before it, at
  a saturating one at least those up to it and at most all; where a bound decides the
  comparison with K the sum is not formed (the same decision as forming it)."""
  # (the values descend: the first used one is the largest, the origin)
  origin, found, count, total_weight, descending = 0.0, False, 0, 0.0, l > 0.0
  for i in range(values.shape[0]):
    if weights[i] > 0.0 and abs(values[i]) < _INF:
      origin = origin if found else values[i]
      found = True
      qi = (values[i] - origin) / l
      if qi == qi:  # (NaN only for a strength that is not positive and finite)
        q[count], w[count], v[count] = qi, weights[i], values[i]
        total_weight += weights[i]
        descending &= abs(qi) < _INF
        count += 1
  finite_cut = abs(cut) < _INF
  q_cut = (cut - origin) / l if finite_cut else 0.0
  # the walk: ``enter``/``saturate`` index the next entering/saturating entry
  lo, hi, which = -_INF, _INF, -1
  enter, saturate, cut_left = 0, 0, finite_cut
  before_enter, upto_saturate = 0.0, 0.0  # the weights before `enter`, up to `saturate`
  while True:
    point, b = -_INF, -1
    if enter < count:
      point, b = q[enter], 0
    if saturate < count and (b < 0 or q[saturate] - 1.0 > point):
      point, b = q[saturate] - 1.0, 1
    if cut_left and (b < 0 or q_cut > point):
      point, b = q_cut, 2
    if b < 0:
      return 0.0, np.nan  # no threshold
    # (the bounds only where q is finite and descending: l > 0; elsewhere every sum)
    if b == 0:
      reached = ((before_enter >= target or not descending)
                 and _entered(q, w, enter, a) >= target)
    elif b == 1:
      prefix = upto_saturate + w[saturate]
      if descending and (prefix >= target or not total_weight >= target):
        reached = prefix >= target
      else:
        reached = _saturating(q, w, count, saturate, prefix, a, descending) >= target
    else:
      reached = ((total_weight >= target or not descending)
                 and _at_cut(q, w, count, q_cut, a) >= target)
    if reached:
      lo, which = point, b
      break
    hi = point
    if b == 0:
      before_enter += w[enter]
      enter += 1
    elif b == 1:
      upto_saturate += w[saturate]
      saturate += 1
    else:
      cut_left = False
  # the breakpoint lo as anchor + l base (v_j, v_j - l or the cut)
  if which == 2:
    anchor, base = cut, 0.0
  elif which == 1:
    anchor, base = v[saturate], -1.0
  else:
    anchor, base = v[enter], 0.0
  saturated, total, mean = 0.0, 0.0, 0.0
  for i in range(count):
    if q[i] - 1.0 >= hi:
      saturated += w[i]
  rest = target - saturated
  active = 0
  for i in range(count):  # the active entries: e_i = (v_i - anchor)/l - base
    if q[i] > lo and not q[i] - 1.0 >= hi:
      e[active] = max((v[i] - anchor) / l - base, 0.0)
      total += w[i]
      mean += w[i] * e[active]
      q[active] = w[i]  # (q is free now: the active weights)
      active += 1
  width = hi - lo if hi < _INF else 0.0
  delta = 0.0
  if total > 0.0:
    mean /= total
    if a == 1.0:
      delta = mean - rest / total
    else:
      spread, third = 0.0, 0.0
      for i in range(active):
        c = e[i] - mean
        spread += q[i] * c * c
        third += q[i] * (c * c * c)
      if a == 2.0:
        y = math.sqrt(max(rest - spread, 0.0) / total)
      else:  # a == 3: Cardano, y = A - P / (3 A)
        p_ = 3.0 * spread / total
        q_ = (third - rest) / total
        root = np.cbrt(0.5 * abs(q_) + math.sqrt(0.25 * q_ * q_ + p_ * p_ * p_ / 27.0))
        big_a = -root if q_ > 0.0 else root
        y = big_a - p_ / (3.0 * big_a) if big_a != 0.0 else 0.0
      delta = mean - y
    delta = min(max(delta, 0.0), width)
  return anchor, (base + delta if target >= 0.0 else np.nan)


@njit(inline="always", **_OPTIONS)
def _solve(values, weights, cut, k, l, a, scratch):
  """``(shift, offset, strength)`` of ``support_budget._solve`` for one row; ``scratch``
  (4, m+1)."""
  target = k
  for i in range(values.shape[0]):
    if values[i] == _INF:
      target -= weights[i]
      weights[i] = 0.0
    elif not abs(values[i]) < _INF:
      weights[i] = 0.0
  finite_cut = abs(cut) < _INF
  binds = False
  l_star = _INF
  if finite_cut and _mask_sum(values, weights, cut, l, a) < target:
    l_star = _crossing_strength(values, weights, cut, target, a)
    binds = l > l_star
  if binds:
    shift, offset, strength = cut, 0.0, l_star
  else:
    shift, offset = _threshold(values, weights, cut, l, target, a, scratch[0], scratch[1],
                               scratch[2], scratch[3])
    if finite_cut and offset == offset:
      offset = max(offset, (cut - shift) / l)
    strength = l
    if target == 0.0 and not finite_cut and not _any_weight(weights):
      offset = 0.0  # nothing finite above the cut and no mass to place: any threshold is one
  if k != k or l != l or target < 0.0 or (not binds and offset != offset):
    return 0.0, offset, np.nan
  return shift, offset, strength


@njit(inline="always", **_OPTIONS)
def _any_weight(weights):
  for i in range(weights.shape[0]):
    if weights[i] > 0.0:
      return True
  return False


@njit(inline="always", **_OPTIONS)
def _write_mask(row, shift, offset, strength, cut, a, y):
  r"""The budgeted mask of ``row`` into ``y``: :math:`g((x_i - \text{shift}) / l' -
  \text{offset})` above the cut (1 at ``+inf``), 0 at or below it; NaN where the
  strength is."""
  # (selects, not branches, NaN included: an entry above or below the cut is data, and
  # with a branch per entry, or an early return for a NaN strength, LLVM did not
  # vectorize this loop: 22 against 3.5 ns per row of 8 entries, float32)
  inv, bad = 1.0 / strength, strength != strength
  for i in range(row.shape[0]):
    v = float(row[i])
    g = _mask((v - shift) * inv - offset, a)
    g = 1.0 if v == _INF else g
    g = g if v > cut else 0.0
    y[i] = np.nan if bad else g
