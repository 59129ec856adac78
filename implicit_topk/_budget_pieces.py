r"""The two small problems behind ``max_support``, solved exactly on a row's m+1 largest values.

Both take values sorted in descending order with weights :math:`w_i \ge 0` (an entry of
weight 0 is ignored: ``max_support``'s tie rule gives the group tied at the cut one
entry of weight its count) and the p-norm mask :math:`g(u) = \min(1, u_+^a)`,
:math:`a = 1/(p-1)` (Sander et al. 2023, "Fast, differentiable and sparse top-k: a
convex analysis perspective", ICML). Both sums are piecewise in closed form between
the breakpoints of :math:`g` (an entry entering the support, an entry saturating), and
both find their piece by evaluating the sum at every breakpoint: O(m^2) work per row,
no sort (the values come sorted from ``lax.top_k``), every ratio or difference of
order 1 whatever the scale of the row (``proofs/support_budget.md``, statement 3).

* :func:`crossing_strength`: the largest strength :math:`l^\star` at which
  :math:`\sum_i w_i\,g(d_i / l) \ge K` (gaps :math:`d_i \ge 0` to a cut);
* :func:`threshold`: the threshold :math:`\lambda \ge c` with
  :math:`\sum_i w_i\,g((v_i - \lambda)/l) = K`.

All inputs are per row (``(..., m+1)`` and ``(...)``) and carry no derivatives (the
caller differentiates through the implicit function theorem). Inside, the entries run
along the first axis and the rows along the last ones: XLA:CPU then vectorizes over the
rows (the entry axis is short), which made the pairwise sums 1.6x faster at m = 12.
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp

from implicit_topk.solvers import threshold as _threshold_solver

#: Newton iterations of the general p (not 2, 1.5 or 4/3) on one piece: the
#: safeguarded iteration halves its bracket at least every other pass, so 3 x 64
#: passes reach any float64 bracket's end (float32: fewer).
_PIECE_MAXITER = 200


def _power(u, a):
  """``u ** a`` for ``u >= 0`` (an integer power where ``a`` is one: no log/exp)."""
  return u ** a if isinstance(a, int) else jnp.power(u, jnp.asarray(a, u.dtype))


def _mask(u, a):
  """:math:`g(u) = \\min(1, u_+^a)` (no derivatives are taken through it)."""
  return _power(jnp.clip(u, 0.0, 1.0), a)


def _first(v):
  """The entries of ``v`` (..., m+1) along the first axis: (m+1, ...)."""
  return jnp.moveaxis(v, -1, 0)


def _index(size, batch_ndim, axis=0, ndim=1):
  """``arange(size)`` along ``axis`` of ``ndim`` entry axes, before ``batch_ndim`` row axes."""
  shape = [1] * (ndim + batch_ndim)
  shape[axis] = size
  return jnp.arange(size).reshape(shape)


def _pick(table, index):
  """``table[index]`` per row (a one-hot sum over the m+1 entries of ``table``)."""
  return jnp.sum(jnp.where(_index(table.shape[0], index.ndim) == index, table, 0), axis=0)


def mask_sum(gaps, weights, l, a):
  r""":math:`S(l) = \sum_i w_i\,g(d_i / l)` per row (gaps :math:`d_i`; weight-0 entries
  and :math:`d_i \le 0` count 0)."""
  use = (weights > 0) & (gaps > 0)
  return jnp.sum(jnp.where(use, weights * _mask(jnp.where(use, gaps, 0.0) / l[..., None], a), 0.0),
                 axis=-1)


def crossing_strength(gaps, weights, target, a):
  r"""The largest strength :math:`l^\star` with :math:`S(l^\star) = \sum_i w_i\,
  \min(1, (d_i / l^\star)^a) \ge K` (``target``), per row; ``inf`` where
  :math:`K \le 0`, NaN where even :math:`l \to 0` falls short (:math:`\sum_i w_i < K`).

  ``gaps`` :math:`d_0 \ge d_1 \ge \dots` (finite; entries with :math:`d_i \le 0` or
  :math:`w_i = 0` are ignored). At the breakpoint :math:`l = d_j` the first ``j``
  entries are saturated and :math:`S(d_j) = W_j + M_j` with :math:`W_j =
  \sum_{i<j} w_i` and :math:`M_j = \sum_{i \ge j} w_i (d_i / d_j)^a` (ratios at most
  1: no overflow or underflow at any scale). :math:`S(d_j)` grows with :math:`j`;
  with :math:`J` the first breakpoint where it exceeds :math:`K`, the entries
  before :math:`J` are saturated at :math:`l^\star \in [d_J, d_{J-1}]` and
  :math:`(l^\star)^a = \sum_{i \ge J} w_i d_i^a / (K - W_J)`, i.e.
  :math:`l^\star = d_J (M_J / (K - W_J))^{1/a}`; the same formula clipped to a later
  piece gives less, so :math:`l^\star` is the largest over the pieces past :math:`K`
  (``proofs/support_budget.md``, statement 3). Where no breakpoint passes :math:`K`
  the mask is binary at :math:`l^\star =` the smallest gap (:math:`\sum_i w_i = K`)."""
  valid = _first((weights > 0) & (gaps > 0) & jnp.isfinite(gaps))
  d = jnp.where(valid, _first(gaps), 0.0)
  w = jnp.where(valid, _first(weights), 0.0)
  size, rows = d.shape[0], target.ndim
  later = _index(size, rows, 1, 2) >= _index(size, rows, 0, 2)  # [j, i]: i >= j
  ratio = d[None] / jnp.where(valid, d, 1.0)[:, None]
  incl = jnp.sum(jnp.where(later & valid[None], w[None] * _power(ratio, a), 0.0), axis=1)  # M_j
  before = jnp.cumsum(w, axis=0) - w  # W_j
  past = valid & (before + incl > target)  # S(d_j) > K: l* >= d_j
  left = jnp.concatenate([jnp.full_like(d[:1], jnp.inf),
                          jnp.where(valid[:-1], d[:-1], jnp.inf)], axis=0)
  room = target - before
  fits = past & (room > 0)
  ratio_j = jnp.where(fits, incl, 1.0) / jnp.where(fits, room, 1.0)
  piece = jnp.where(fits, jnp.clip(d * _power(ratio_j, 1.0 / a), d, left), left)
  on_piece_ = jnp.max(jnp.where(past, piece, -jnp.inf), axis=0)
  # No piece past K: the mask is binary at the smallest gap (if the weights reach K).
  smallest = jnp.min(jnp.where(valid, d, jnp.inf), axis=0)
  binary = jnp.where(jnp.sum(w, axis=0) >= target, smallest, jnp.nan)
  strength = jnp.where(jnp.any(past, axis=0), on_piece_, binary)
  return jnp.where(target <= 0, jnp.inf, strength)


def threshold(top, weights, cut, l, target, a):
  r"""The threshold :math:`\lambda \ge c` (``cut``, may be ``-inf``) of
  :math:`F(\lambda) = \sum_i w_i\,g((v_i - \lambda)/l) = K` (``target``), per row, as
  ``(anchor, offset)`` with :math:`\lambda` = ``anchor + l * offset``: ``anchor`` one of
  the values (or the cut) next to :math:`\lambda` and ``offset`` of order 1, so that the
  mask's arguments :math:`((x_i - \text{anchor}) - l\,\text{offset}) / l` keep their
  precision at any ratio of the row's scale to ``l``. ``offset`` is NaN where there is
  no threshold (:math:`K < 0`, or :math:`\sum_i w_i < K` without a cut).

  ``top`` :math:`v` descending (entries that are not finite or have :math:`w_i = 0` are
  ignored). :math:`F` is nonincreasing, with breakpoints :math:`v_j` (entry ``j``
  leaves the support) and :math:`v_j - l` (it saturates); :math:`F` at each of them (and
  at the cut) brackets the root in ``[lo, hi]`` with no breakpoint inside, where the
  saturated entries :math:`v_i - l \ge hi` and the active ones (:math:`v_i > lo`, not
  saturated) are fixed: :func:`on_piece` solves :math:`\sum_{active} w_i ((v_i -
  lo)/l - \delta)^a = K - W` for :math:`\delta \in [0, (hi - lo)/l]`. ``K = 0`` gives
  :math:`\lambda = \max_i v_i` (an empty mask)."""
  top, weights = _first(top), _first(weights)
  valid = (weights > 0) & jnp.isfinite(top)
  w = jnp.where(valid, weights, 0.0)
  size, rows = top.shape[0], target.ndim
  # The piece, in units of l from the largest value (its choice only).
  largest = jnp.max(jnp.where(valid, top, -jnp.inf), axis=0)
  origin = jnp.where(jnp.isfinite(largest), largest, 0.0)
  q = jnp.where(valid, (top - origin) / l, 0.0)
  finite_cut = jnp.isfinite(cut)
  q_cut = jnp.where(finite_cut, (cut - origin) / l, 0.0)
  # F at v_j counts the entries above it, at v_j - l those below it (the others are 1):
  # one mask per pair (j, i).
  before = _index(size, rows, 1, 2) < _index(size, rows, 0, 2)  # [j, i]: i < j
  after = _index(size, rows, 1, 2) > _index(size, rows, 0, 2)
  pairs = q[None] - q[:, None]
  terms = w[None] * _mask(jnp.where(before, pairs, pairs + 1.0), a)
  at_enter = jnp.sum(jnp.where(before, terms, 0.0), axis=1)
  at_saturate = jnp.cumsum(w, axis=0) + jnp.sum(jnp.where(after, terms, 0.0), axis=1)
  at_cut = jnp.sum(w * _mask(q - q_cut, a), axis=0)
  breaks = jnp.concatenate([q, q - 1.0, q_cut[None]], axis=0)
  usable = jnp.concatenate([valid, valid, finite_cut[None]], axis=0)
  at_break = jnp.concatenate([at_enter, at_saturate, at_cut[None]], axis=0)
  reached = usable & (at_break >= target)
  lowest = jnp.where(reached, breaks, -jnp.inf)
  found = jnp.any(reached, axis=0)
  which = jnp.argmax(lowest, axis=0)  # the lower end's breakpoint
  lo = jnp.max(lowest, axis=0)
  hi = jnp.min(jnp.where(usable & ~reached, breaks, jnp.inf), axis=0)
  saturated = valid & (q - 1.0 >= hi)
  active = valid & (q > lo) & ~saturated
  rest = target - jnp.sum(jnp.where(saturated, w, 0.0), axis=0)
  width = jnp.where(found & jnp.isfinite(hi), hi - lo, 0.0)
  lo_anchor, lo_base = _breakpoint_value(which, top, valid, cut, size)
  active_w = jnp.where(active, w, 0.0)
  offsets = lambda anchor, base: jnp.where(
      active, jnp.maximum((top - anchor) / l - base, 0.0), 0.0)
  if isinstance(a, int) or a >= 1:
    anchor, offset = lo_anchor, lo_base + on_piece(offsets(lo_anchor, lo_base), active_w, rest,
                                                   width, a)
  else:
    # a < 1 (p > 2): an entry's mask (u)^a resolves small masses only through small u,
    # which lie at the upper end (the entry about to leave): solved from there.
    which_hi = jnp.argmin(jnp.where(usable & ~reached, breaks, jnp.inf), axis=0)
    hi_anchor, hi_base = _breakpoint_value(which_hi, top, valid, cut, size)
    anchor = jnp.where(jnp.isfinite(hi), hi_anchor, lo_anchor)
    base = jnp.where(jnp.isfinite(hi), hi_base, lo_base)
    offset = base - _newton_on_piece(offsets(anchor, base), active_w, rest, width, a,
                                     rising=True)
  # A root at the lower breakpoint itself (F(lo) = K: an entry sitting exactly at the
  # threshold, e.g. ties in integer data) is taken exactly there. The iteration above
  # reaches it only to its tolerance, and for a < 1 the mask's infinite slope at 0
  # turned that rounding into a mass of sqrt(eps) on the entry (p = 3: 7e-9 in float64).
  at_lo = found & (_pick(at_break, which) == target)
  anchor, offset = jnp.where(at_lo, lo_anchor, anchor), jnp.where(at_lo, lo_base, offset)
  anchor = jnp.where(found, anchor, 0.0)
  return anchor, jnp.where(found & (target >= 0), offset, jnp.nan)


def _breakpoint_value(which, top, valid, cut, size):
  """The breakpoint ``which`` of :func:`threshold` (``v_j``, ``v_j - l`` or the cut) as
  ``(anchor, base)``: ``anchor + l * base``."""
  entry = jnp.where(which < size, which, which - size)
  anchor = jnp.where(which == 2 * size, jnp.where(jnp.isfinite(cut), cut, 0.0),
                     _pick(jnp.where(valid, top, 0.0), jnp.minimum(entry, size - 1)))
  return anchor, jnp.where((which >= size) & (which < 2 * size), -1.0, 0.0)


def on_piece(e, w, target, width, a):
  r""":math:`\delta \in [0, \text{width}]` with :math:`h(\delta) = \sum_i w_i (e_i -
  \delta)^a = K` (``target``), per row (entries along the first axis), for the active entries (:math:`w_i > 0`,
  :math:`e_i - \delta > 0` on the whole piece); 0 where there are none.

  With :math:`N = \sum w_i`, the mean :math:`\bar e` and the centred moments
  :math:`V = \sum w_i (e_i - \bar e)^2`, :math:`M = \sum w_i (e_i - \bar e)^3`, and
  :math:`y = \bar e - \delta > 0`: ``a = 1`` (p = 2) gives :math:`\delta = \bar e - K/N`;
  ``a = 2`` (p = 3/2) :math:`N y^2 + V = K`; ``a = 3`` (p = 4/3) the cubic
  :math:`y^3 + P y + Q = 0`, :math:`P = 3V/N \ge 0`, :math:`Q = (M - K)/N`, increasing
  in :math:`y` (one real root), solved by Cardano's formula in the form without
  cancellation, :math:`y = A - P / (3A)`, :math:`A = -\mathrm{sign}(Q)\,
  (|Q|/2 + \sqrt{Q^2/4 + P^3/27})^{1/3}`. Other ``a``: the library's safeguarded
  Newton iteration (:func:`implicit_topk.solvers.threshold.safeguarded_newton_step`)
  on :math:`h - K` over the bracket ``[0, width]``."""
  total = jnp.sum(w, axis=0)
  some = total > 0
  n = jnp.where(some, total, 1.0)
  mean = jnp.sum(w * e, axis=0) / n
  if a == 1:
    delta = mean - target / n
  elif a in (2, 3):
    centred = jnp.where(w > 0, e - mean, 0.0)
    spread = jnp.sum(w * centred * centred, axis=0)
    if a == 2:
      y = jnp.sqrt(jnp.maximum(target - spread, 0.0) / n)
    else:
      p_ = 3.0 * spread / n
      q_ = (jnp.sum(w * centred ** 3, axis=0) - target) / n
      root = jnp.cbrt(0.5 * jnp.abs(q_) + jnp.sqrt(0.25 * q_ * q_ + p_ ** 3 / 27.0))
      big_a = jnp.where(q_ > 0, -root, root)
      y = jnp.where(big_a != 0, big_a - p_ / (3.0 * jnp.where(big_a != 0, big_a, 1.0)), 0.0)
    delta = mean - y
  else:
    delta = _newton_on_piece(e, w, target, width, a)
  return jnp.where(some, jnp.clip(delta, 0.0, width), 0.0)


def _newton_on_piece(e, w, target, width, a, rising=False):
  r""":func:`on_piece` for a general ``a``: the safeguarded Newton iteration on ``[0,
  width]``. With ``rising``, the root :math:`t` of :math:`\sum_i w_i (e_i + t)^a = K`
  instead (offsets :math:`e_i \ge 0` from the piece's upper end)."""
  a = float(a)

  def derivatives(t):
    u = e + t if rising else e - t
    live = (w > 0) & (u > 0)
    safe = jnp.where(live, u, 1.0)
    power = lambda b: jnp.sum(jnp.where(live, w * safe ** b, 0.0), axis=0)
    sign = -1.0 if rising else 1.0  # the value decreases in t either way
    return (sign * (power(a) - target), -a * power(a - 1.0),
            sign * a * (a - 1.0) * power(a - 2.0))

  tols = _threshold_solver.tolerances(e.dtype)
  # Relative tolerances: a tiny mass (k near 0) sits at a tiny t, resolved to its ulps.
  tiny = float(jnp.finfo(e.dtype).tiny)
  step = lambda carry: _threshold_solver.safeguarded_newton_step(
      derivatives, carry, tols=tols, step_scale=lambda t: jnp.maximum(jnp.abs(t), tiny),
      residual_scale=lambda t: jnp.maximum(target, tiny), geometric=True)
  zero = jnp.zeros_like(width)
  start = (0.5 * width, zero, width, _threshold_solver.initial_memory(width + 1.0), width <= 0,
           jnp.zeros(width.shape, jnp.int32))
  carry = lax.while_loop(lambda c: jnp.any(~c[4]) & jnp.all(c[5] < _PIECE_MAXITER), step, start)
  return carry[0]
