r"""A budget on the support of the p-norm top-k mask: at most ``m`` nonzero entries per row.

The p-norm mask (Sander et al. 2023, "Fast, differentiable and sparse top-k: a convex
analysis perspective", ICML) is :math:`y_i = \min(1, ((x_i - \lambda)_+ / l)^a)`,
:math:`a = 1/(p-1)`, with :math:`\sum_i y_i = k`. Its support is
:math:`\{i : x_i > \lambda\}`, and :math:`\lambda` decreases as the strength :math:`l`
grows, so the support has at most :math:`m` entries iff :math:`\lambda \ge c` with
:math:`c = x_{(m+1)}` (the (m+1)-th largest entry), i.e. iff :math:`S(l) \ge k` where

.. math:: S(l) = \sum_i \min\big(1, ((x_i - c)_+ / l)^a\big)

(nonincreasing in :math:`l`). Where the plain mask would exceed the budget the operator
uses the largest strength that meets it, :math:`l^\star = \sup\{l' : S(l') \ge k\}`
(then :math:`\lambda = c` exactly); elsewhere the plain mask, unchanged. That is, the
mask at the strength :math:`\min(l, l^\star)` (``proofs/support_budget.md``).

:math:`S` depends on the entries above :math:`c` only, the ``m`` largest: with
:math:`d_i = x_{(i)} - c` and :math:`t = 1/l'`, :math:`S = \sum_i w_i \min(1, d_i
t)^a` is piecewise :math:`W_J + t^a R_J` (:math:`J` saturated entries), so
:math:`t^\star = ((k - W_J) / R_J)^{1/a}` in closed form, differentiable in ``x`` by
autodiff on the piece that holds it (the implicit derivative of :math:`S = k` there).

Ties: a symmetric operator cannot split a tie. Where fewer than ``k`` entries lie
strictly above :math:`c`, the cut moves to the next distinct value below :math:`c`
and the entries tied at :math:`c` enter together (weight :math:`w` = their count): the
support then exceeds ``m`` by the tied entries, as the hard top-k's does at a tie.
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp


def check_max_support(max_support, k_value, regularizer) -> int:
  """``max_support`` as a Python int ``m >= 1``, for a p-norm regularizer; ``ValueError``
  naming the argument otherwise (``k < m`` is checked where ``k`` is concrete)."""
  from implicit_topk import regularizers
  if isinstance(max_support, bool) or not isinstance(max_support, int):
    raise TypeError(f"`max_support` must be a Python int >= 1 (a static count of entries); "
                    f"got {max_support!r}.")
  if max_support < 1:
    raise ValueError(f"`max_support` must be an int >= 1; got {max_support}.")
  if not isinstance(regularizer, regularizers.PNorm):
    raise ValueError(
        "`max_support` needs a p-norm regularizer (PNorm, the default): only the p-norms give "
        f"exact zeros, whose count it bounds; got {regularizer!r}.")
  if k_value is not None and not bool((k_value < max_support).all()):
    raise ValueError(f"`max_support` must be larger than k (a support of m entries holds a "
                     f"mask summing to k < m); got max_support={max_support} and k={k_value}.")
  return max_support


def capped_mask(rows, k, l, m: int, a: float):
  r"""``(binds, mask, live)`` per row of ``rows`` (..., n): where the plain mask at
  strength ``l`` would have more than ``m`` nonzero entries (``binds``), the mask at
  :math:`l^\star` in closed form (elsewhere ``mask`` is not used); ``live``: the entries
  above the cut, outside which every row's mask is 0 (the caller zeroes them in the
  plain mask too: near :math:`l^\star` its threshold, found to the ulp, may land an ulp
  below the cut).

  At :math:`l^\star` the threshold is the cut :math:`c` exactly, so the mask is
  :math:`y_i = \min(1, ((x_i - c)\,t^\star)^a)` with :math:`(t^\star)^a = (k - W_J) /
  R_J`: the saturated entries are 1 and the others :math:`(d_i/s)^a (k - W_J) /
  \sum_j (d_j/s)^a` over the unsaturated ones (:math:`s` the largest of their gaps:
  every factor of order 1, whatever the gaps' scale). The discrete choices (the cut's
  rank, the piece :math:`J`, which entries saturate) come from one ``lax.top_k`` of
  ``m + 1`` entries without derivatives; the values are elementwise maps and row
  reductions of the whole row (no gather or scatter in the derivatives). ``k`` and ``l``
  have the rows' shape, ``a = 1/(p-1)``; rows with NaN and rows of at most ``m``
  entries never bind."""
  n = rows.shape[-1]
  if m >= n:
    return jnp.zeros(rows.shape[:-1], bool), jnp.zeros_like(rows), jnp.ones(rows.shape, bool)
  # descending; the barrier keeps XLA:CPU's top-k kernel (slicing its output inside a
  # fusion made XLA rewrite it as a full sort of every row: 10x slower at 16384 x 64)
  top = lax.optimization_barrier(lax.stop_gradient(lax.top_k(rows, m + 1)[0]))
  c_value = top[..., m]
  strictly_above = jnp.sum(top[..., :m] > c_value[..., None], axis=-1).astype(rows.dtype)
  # The tie rule: fewer than k entries above c -> the cut moves below c, where the
  # entries tied at c enter together.
  tied = strictly_above < k
  at_c = rows == c_value[..., None]
  count_c = jnp.sum(at_c, axis=-1).astype(rows.dtype)
  below = jnp.max(jnp.where(rows < c_value[..., None], rows, -jnp.inf), axis=-1)
  c = jnp.sum(jnp.where(at_c, rows, 0.0), axis=-1) / jnp.maximum(count_c, 1.0)  # = c_value
  cut = jnp.where(tied, below, c)
  position = jnp.arange(m + 1)
  ones = jnp.ones_like(top)
  weight = jnp.where(tied[..., None],
                     jnp.where(position < strictly_above[..., None], ones,
                               jnp.where(position == strictly_above[..., None],
                                         count_c[..., None], 0.0)),
                     jnp.where(position < m, ones, 0.0))
  finite_cut = jnp.isfinite(cut)
  cut_value = lax.stop_gradient(jnp.where(finite_cut, cut, 0.0))
  t_star, gap_saturated = _crossing_piece(top - cut_value[..., None], weight, k, a)
  binds = (finite_cut & (t_star * l > 1) & ~jnp.any(jnp.isnan(top), axis=-1)
           & ~jnp.isnan(k) & ~jnp.isnan(l))
  # The whole row: entries above the cut; those at or above the J-th largest gap saturate.
  d = rows - jnp.where(finite_cut, cut, 0.0)[..., None]
  live = rows > jnp.where(finite_cut, cut_value, jnp.inf)[..., None]
  saturated = live & ((lax.stop_gradient(d) >= gap_saturated[..., None]) | ~jnp.isfinite(d))
  unsaturated = live & ~saturated
  scale = jnp.max(jnp.where(unsaturated, d, 0.0), axis=-1)
  scale = jnp.where(scale > 0, scale, 1.0)
  relative = jnp.where(unsaturated, d / scale[..., None], 1.0) ** a
  relative = jnp.where(unsaturated, relative, 0.0)
  total = jnp.sum(relative, axis=-1)
  remaining = k - jnp.sum(saturated, axis=-1).astype(rows.dtype)
  ratio = jnp.where((total > 0) & (remaining > 0), remaining, 0.0) / jnp.where(total > 0, total, 1.0)
  mask = jnp.where(saturated, 1.0, jnp.minimum(relative * ratio[..., None], 1.0))
  return binds, mask.astype(rows.dtype), live


def _crossing_piece(gaps, weight, k, a):
  r"""On the piece where :math:`S(t) = \sum_i w_i \min(1, d_i t)^a` crosses ``k``, per
  row (no derivatives: the choice of the piece): ``(t, top)`` with ``t`` the smallest
  :math:`t` with :math:`S(t) \ge k` (0 where none is finite) and ``top`` the J-th
  largest gap (entries at or above it saturate: ``+inf`` where :math:`J = 0`). ``gaps``
  :math:`d` (..., m+1) are descending, ``+inf`` for infinite entries (always saturated).

  Breakpoints :math:`t_j = 1/d_j`: there :math:`S = B_j = W_j + R_j / d_j^a` with
  :math:`W_j = \sum_{i \le j} w_i` and :math:`R_j = \sum_{i > j} w_i d_i^a`,
  nondecreasing in :math:`j`; :math:`J` counts the breakpoints with
  :math:`B_j \le k`; on piece :math:`J`, :math:`t^a = (k - W_J) / R_J`."""
  gaps, weight, k = (lax.stop_gradient(v) for v in (gaps, weight, k))
  positive = (gaps > 0) & (weight > 0)
  finite = positive & jnp.isfinite(gaps)
  safe = jnp.where(finite, gaps, 1.0)  # no 0 ** a (an infinite slope for a < 1), no inf
  w = jnp.where(positive, weight, 0.0)
  terms = jnp.where(finite, w * safe ** a, 0.0)
  saturated = jnp.cumsum(w, axis=-1)  # W_j, j = 1..m+1
  # R_j = sum_{i > j}: a suffix sum (a difference of prefix sums would cancel).
  suffix = jnp.flip(jnp.cumsum(jnp.flip(terms, axis=-1), axis=-1), axis=-1)
  rest = jnp.concatenate([suffix[..., 1:], jnp.zeros_like(suffix[..., :1])], axis=-1)
  at_break = jnp.where(positive, saturated + jnp.where(finite, rest / safe ** a, 0.0), jnp.inf)
  big_j = jnp.sum(at_break <= k[..., None], axis=-1)  # J, 0..m+1
  pick = lambda table: jnp.take_along_axis(table, jnp.maximum(big_j - 1, 0)[..., None],
                                           axis=-1)[..., 0]
  w_j = jnp.where(big_j > 0, pick(saturated), 0.0)
  r_j = jnp.where(big_j > 0, pick(rest), suffix[..., 0])
  d_j = jnp.where(big_j > 0, pick(gaps), jnp.inf)
  reachable = (r_j > 0) & (k > w_j)
  # k reached at the breakpoint 1/d_J itself (then R_J = 0, or rounds to next to nothing).
  exact_break = (big_j > 0) & (w_j >= k)
  safe_d_j = jnp.where(jnp.isfinite(d_j) & (d_j > 0), d_j, 1.0)
  t_power = jnp.where(reachable, k - w_j, 1.0) / jnp.where(reachable, r_j, 1.0)
  t = jnp.where(exact_break, 1.0 / safe_d_j, jnp.where(reachable, t_power ** (1.0 / a), 0.0))
  return t, jnp.where(big_j > 0, d_j, jnp.inf)
