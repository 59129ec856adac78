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


def capped_strength(rows, k, l, m: int, a: float):
  r"""``(strength, cut)`` per row of ``rows`` (..., n): :math:`\min(l, l^\star)`, whose
  mask has at most ``m`` nonzero entries (ties aside), and the cut :math:`c` (or the
  next value below it at a tie) at or below which the mask is 0 (the caller zeroes
  those entries: a threshold found to the ulp may land an ulp below :math:`c`);
  ``k`` and ``l`` have the rows' shape, ``a = 1/(p-1)``. Rows of at most ``m`` entries,
  and rows whose budget cannot bind, keep ``l``."""
  n = rows.shape[-1]
  if m >= n:
    return l, jnp.full_like(l, -jnp.inf)
  top = lax.top_k(rows, m + 1)[0]  # descending
  c = top[..., m]
  above = top[..., :m] > c[..., None]
  strictly_above = jnp.sum(above, axis=-1).astype(rows.dtype)
  # The tie rule: fewer than k entries above c -> the cut moves below c, where the
  # entries tied at c enter with their count as weight.
  tied = strictly_above < k
  count_c = jnp.sum(rows == c[..., None], axis=-1).astype(rows.dtype)
  below = jnp.max(jnp.where(rows < c[..., None], rows, -jnp.inf), axis=-1)
  cut = jnp.where(tied, below, c)
  position = jnp.arange(m + 1)
  ones = jnp.ones_like(top)
  weight = jnp.where(tied[..., None],
                     jnp.where(position < strictly_above[..., None], ones,
                               jnp.where(position == strictly_above[..., None],
                                         count_c[..., None], 0.0)),
                     jnp.where(position < m, ones, 0.0))
  t_star = _saturating_root(top, cut, weight, k, a)
  binds = (t_star > 0) & jnp.isfinite(cut) & jnp.all(jnp.isfinite(top), axis=-1)
  l_star = jnp.where(binds, 1.0 / jnp.where(binds, t_star, 1.0), jnp.inf)
  cut = jnp.where(jnp.isfinite(cut), cut, -jnp.inf)
  return jnp.minimum(l, l_star.astype(l.dtype)), lax.stop_gradient(cut).astype(l.dtype)


def _saturating_root(values, cut, weight, k, a):
  r"""The smallest :math:`t \ge 0` with :math:`\sum_i w_i \min(1, (v_i - c)_+ t)^a \ge k`
  for descending ``values`` :math:`v` (..., m+1), per row; 0 where no finite ``t``
  reaches ``k``.

  Breakpoints :math:`t_j = 1/d_j` (:math:`d_j = v_j - c`): there the sum is
  :math:`B_j = W_j + R_j / d_j^a` with :math:`W_j = \sum_{i \le j} w_i` and
  :math:`R_j = \sum_{i > j} w_i d_i^a`, nondecreasing in :math:`j`. With :math:`J` the
  number of breakpoints at which :math:`B_j \le k`, the root lies on piece :math:`J`:
  :math:`t = ((k - W_J) / R_J)^{1/a}`, kept inside :math:`[1/d_J, 1/d_{J+1}]` against
  rounding."""
  safe_cut = jnp.where(jnp.isfinite(cut), cut, 0.0)
  d = jnp.maximum(values - safe_cut[..., None], 0.0)
  positive = (d > 0) & (weight > 0)
  safe_d = jnp.where(positive, d, 1.0)  # no 0 ** a (an infinite slope for a < 1)
  d = jnp.where(positive, d, 0.0)
  w = jnp.where(positive, weight, 0.0)
  terms = jnp.where(positive, w * safe_d ** a, 0.0)
  saturated = jnp.cumsum(w, axis=-1)  # W_j, j = 1..m+1
  # R_j = sum_{i > j}: a suffix sum (a difference of prefix sums would cancel).
  suffix = jnp.flip(jnp.cumsum(jnp.flip(terms, axis=-1), axis=-1), axis=-1)
  rest = jnp.concatenate([suffix[..., 1:], jnp.zeros_like(suffix[..., :1])], axis=-1)
  at_break = jnp.where(positive, saturated + rest / safe_d ** a, jnp.inf)  # B_j
  big_j = jnp.sum(lax.stop_gradient(at_break) <= k[..., None], axis=-1)  # J, 0..m+1
  pick = lambda table, j: jnp.take_along_axis(table, jnp.maximum(j - 1, 0)[..., None],
                                              axis=-1)[..., 0]
  total_terms = suffix[..., 0]
  w_j = jnp.where(big_j > 0, pick(saturated, big_j), 0.0)
  r_j = jnp.where(big_j > 0, pick(rest, big_j), total_terms)
  d_j = jnp.where(big_j > 0, pick(d, big_j), jnp.inf)  # 1/d_J: the piece's left end
  d_next = jnp.take_along_axis(jnp.concatenate([d, jnp.zeros_like(d[..., :1])], axis=-1),
                               jnp.minimum(big_j, d.shape[-1])[..., None], axis=-1)[..., 0]
  reachable = (r_j > 0) & (k > w_j)
  t = (jnp.where(reachable, k - w_j, 1.0) / jnp.where(reachable, r_j, 1.0)) ** (1.0 / a)
  low = jnp.where(jnp.isfinite(d_j), 1.0 / jnp.where(jnp.isfinite(d_j), d_j, 1.0), 0.0)
  high = jnp.where(d_next > 0, 1.0 / jnp.where(d_next > 0, d_next, 1.0), jnp.inf)
  t = jnp.clip(t, low, high)
  exact_break = (big_j > 0) & (w_j == k)  # the sum reaches k at a breakpoint: t = 1/d_J
  return jnp.where(exact_break, low, jnp.where(reachable, t, 0.0))
