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


def row_spread(layout: Any, rows: Any, valid: Any = None) -> Any:
  r"""The standard deviation :math:`s` of each row's finite (and ``valid``) entries,
  with the layout's row shape; 1 where it is 0 or undefined.

  Computed on the entries divided by the row's largest finite :math:`|x_i|`, so that
  no square overflows for entries up to the float maximum: :math:`s = a \sqrt{\tfrac1m \sum_i (x_i / a - \mu)^2}` with
  :math:`a = \max_i |x_i|`, :math:`\mu = \tfrac1m \sum_i x_i / a`, two passes.

  Derivatives, exact at every order, with a reverse pass that is elementwise per row (no
  reduction through the scale or the mean): :math:`s` is the same for every scale :math:`a > 0`, so
  :math:`a` is held constant (``stop_gradient``); and the variance is formed as
  :math:`\tfrac1m \sum_i (z_i - \bar\mu)^2 - (\mu - \bar\mu)^2`, an identity for any
  constant :math:`\bar\mu`, taken as :math:`\mu` held constant: the same value, and the
  derivative through :math:`\mu` of the first term, zero at :math:`\bar\mu = \mu`, is
  never formed (autodiff of the plain formula spent more than the soft top-k itself on
  it, at 16384 rows of 8).
  """
  dtype = layout.dtype(rows)
  keep = layout.map(lambda v: jnp.isfinite(v), rows)
  if valid is not None:
    keep = layout.map(jnp.logical_and, keep, valid)
  finite = layout.map(lambda v, f: jnp.where(f, v, 0).astype(dtype), rows, keep)
  count = jnp.maximum(layout.count(keep, dtype), 1)
  largest = layout.max(layout.map(jnp.abs, finite))
  largest = jax.lax.stop_gradient(jnp.where(largest > 0, largest, 1))
  scaled = layout.map(lambda v, a: v / a, finite, layout.expand(largest, rows))
  mean = layout.sum(scaled) / count
  frozen = jax.lax.stop_gradient(mean)
  centered = layout.map(lambda z, m, f: jnp.where(f, z - m, 0), scaled,
                        layout.expand(frozen, rows), keep)
  variance = layout.sum(layout.map(jnp.square, centered)) / count - jnp.square(mean - frozen)
  spread_ok = variance > 0
  # sqrt at 0 has an infinite derivative: take it only where it is used (no NaN leaks
  # into the gradient of an all-equal row through the discarded branch).
  spread = largest * jnp.sqrt(jnp.where(spread_ok, variance, 1))
  return jnp.where(spread_ok & jnp.isfinite(spread), spread, 1)
