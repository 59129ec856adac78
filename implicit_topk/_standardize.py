r"""The scale of a row for ``standardize=True``: its standard deviation.

With ``standardize=True`` the mask family solves with the strength
:math:`l\,s(x)` instead of :math:`l`, where :math:`s(x)` is the standard deviation of the
row's finite entries (of each segment's for the segment operators, of all the leaves
together for the pytree operators). Since :math:`s(c x + b) = c\,s(x)` for :math:`c > 0`,
the mask is then invariant under :math:`x \mapsto c x + b` and the top-k in magnitude
equivariant, :math:`\mathrm{mag}(c x) = c\,\mathrm{mag}(x)`
(``proofs/standardized_strength.md``). The scale is differentiated like any other
input: the gradient is that of the function computed, so it satisfies the identities
the invariance implies (:math:`J x = 0` and :math:`J \mathbf{1} = 0` for the mask).

Rows whose spread is 0 (all equal, one entry) or not finite use :math:`s = 1`: the mask
of an all-equal row is :math:`k / n` at any strength.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from implicit_topk import _quotient


def row_spread(layout: Any, rows: Any, valid: Any = None) -> Any:
  r"""The standard deviation :math:`s` of each row's finite (and ``valid``) entries,
  with the layout's row shape; 1 where it is 0 or undefined.

  A row is constant (:math:`s = 1`) exactly when its largest and smallest such entries
  are equal: a test on the computed variance is not exact, as the mean of equal entries
  rounds and XLA contracts the centring into fused multiply-adds (``[3, 3, 3, 3]`` had
  a variance of 1e-33 under ``jit``, hence a spread of 1e-16 and derivatives of 1e15).

  Computed on the entries times :math:`c = 2^{-e}`, :math:`2^{e-1} \le \max_i |x_i| <
  2^e` (exact, so no square overflows for entries up to the float maximum), with
  :math:`e` at most the largest exponent whose :math:`2^{-e}` is a normal float (a
  division by the largest entry itself became a product with its reciprocal, subnormal
  and flushed to 0 from :math:`2^{126}` in float32, making every such row constant):
  :math:`s = 2^{e} \sqrt{	frac1m \sum_i (c x_i - \mu)^2}`, :math:`\mu = 	frac1m \sum_i
  c x_i`, two passes.

  Derivatives, exact at every order, with a reverse pass that is elementwise per row (no
  reduction through the scale or the mean): :math:`c` is a constant; and the variance
  is formed as :math:`	frac1m \sum_i (z_i - ar\mu)^2 - (\mu - ar\mu)^2`, an identity
  for any constant :math:`ar\mu`, taken as :math:`\mu` held constant: the same value,
  and the derivative through :math:`\mu` of the first term, zero at :math:`ar\mu =
  \mu`, is never formed (autodiff of the plain formula spent more than the soft top-k
  itself on it, at 16384 rows of 8).
  """
  dtype = layout.dtype(rows)
  keep = layout.map(lambda v: jnp.isfinite(v), rows)
  if valid is not None:
    keep = layout.map(jnp.logical_and, keep, valid)
  finite = layout.map(lambda v, f: jnp.where(f, v, 0).astype(dtype), rows, keep)
  count = jnp.maximum(layout.count(keep, dtype), 1)
  highest = layout.max(layout.map(lambda v, f: jnp.where(f, v, -jnp.inf), rows, keep))
  lowest = layout.min(layout.map(lambda v, f: jnp.where(f, v, jnp.inf), rows, keep))
  varies = jax.lax.stop_gradient(highest > lowest)  # (False without two distinct entries)
  largest = jax.lax.stop_gradient(jnp.where(varies, jnp.maximum(jnp.abs(highest),
                                                                jnp.abs(lowest)), 1))
  info = jnp.finfo(dtype)
  exponent = jnp.clip(jnp.frexp(largest)[1], -(info.maxexp - 1), info.maxexp - 2)
  scale, unscale = jnp.ldexp(jnp.ones_like(largest), -exponent), jnp.ldexp(
      jnp.ones_like(largest), exponent)
  scaled = layout.map(lambda v, c: v * c, finite, layout.expand(scale, rows))
  mean = layout.sum(scaled) / count
  frozen = jax.lax.stop_gradient(mean)
  centered = layout.map(lambda z, m, f: jnp.where(f, z - m, 0), scaled,
                        layout.expand(frozen, rows), keep)
  variance = layout.sum(layout.map(jnp.square, centered)) / count - jnp.square(mean - frozen)
  spread_ok = varies & (variance > 0)
  # sqrt at 0 has an infinite derivative: take it only where it is used (no NaN leaks
  # into the gradient of an all-equal row through the discarded branch).
  spread = jnp.sqrt(jnp.where(spread_ok, variance, 1)) * unscale
  return jnp.where(spread_ok & jnp.isfinite(spread), spread, 1)


def divide(v: Any, spread: Any) -> Any:
  """``v / spread`` for a spread up to the float maximum: XLA divides through the
  reciprocal, which is subnormal, and flushed to 0, beyond ``2^(maxexp - 2)``
  (``2^1022`` in float64, ``2^126`` in float32): there both are scaled by 1/4 first
  (exact), so ``[1e308, -1e308, 0]`` is not divided to zeros."""
  info = jnp.finfo(jnp.result_type(v))
  quarter = jax.lax.stop_gradient(jnp.where(spread >= 2.0 ** (info.maxexp - 2), 0.25, 1.0))
  # +-inf and NaN entries pass as they are, with no derivative in the spread (inf / s is
  # inf for every s > 0; through the quotient it would be inf * 0 = NaN at every entry)
  finite = jnp.isfinite(v)
  quotient = _quotient.quotient(jnp.where(finite, v, 0) * quarter, spread * quarter)
  return jnp.where(finite, quotient, v)


def rescale(y: Any, spread: Any, degree: float) -> Any:
  """``y * spread ** degree``, the output map of :func:`divide`d rows; +-inf and NaN
  entries pass as they are, with no derivative in the spread."""
  finite = jnp.isfinite(y)
  return jnp.where(finite, jnp.where(finite, y, 0) * spread ** degree, y)
