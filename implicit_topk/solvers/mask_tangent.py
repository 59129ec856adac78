r"""The derivatives of the soft top-k mask at the native kernel's threshold, in JAX.

With :math:`z_i = (x_i - \lambda) / l` and :math:`d_i = \mathrm{mask}'(z_i) / l \ge 0`
(0 for saturated and infinite entries), the mask :math:`y_i = \mathrm{mask}(z_i)` and
its constraint :math:`\sum_i y_i = k` give by the implicit function theorem
(``proofs/implicit_gradient.md``)

.. math::

    \dot\lambda = \frac{\sum_i d_i(\dot x_i - z_i \dot l) - \dot k}{\sum_i d_i},\qquad
    \dot y_i = d_i\,(\dot x_i - \dot\lambda) - d_i z_i\,\dot l .

The derivative kernels (:mod:`implicit_topk.kernels.cpu.native_derivatives`) compute this
map and its transpose for the first order; this JAX form is what higher orders
differentiate (through :math:`d_i` and the threshold's own derivative), and what the
tests compare the kernels with. Where
:math:`\sum_i d_i = 0` (a binary mask) :math:`\lambda` is locally constant in ``x``
and ``l`` and the derivative w.r.t. ``k`` is 0, the convention of every solver here;
a row without a threshold (NaN) has NaN derivatives.

Float64 rows at the ends of the float range are solved by the kernel on the exact
rescaling :math:`x 2^{-E}`, :math:`l 2^{-E}`
(:func:`implicit_topk.solvers.float_range.scale_exponent`), and their ``lam`` and
``shift`` are those of the scaled row: :func:`tangent` works in the same coordinates
(:func:`row_scale`; ``E = 0`` for every other row and every float32 row).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from implicit_topk.kernels.cpu.kinds import ENTROPY, LAPLACE, PNORM, SIGMOID


def slopes(kind: int, a: float, x, lam, shift, l):
  """``(d, d z)`` per entry for rows ``x`` (..., n) at thresholds ``lam + shift`` (...):
  ``d = mask'(z) / l`` (0 where the mask is constant, at infinite entries and where
  ``lam`` is not finite), ``z = (x - shift - lam) / l``."""
  lowest = jnp.finfo(x.dtype).min
  lam, shift, l = lam[..., None], shift[..., None], l[..., None]
  inv = 1 / l
  v = jnp.maximum(x - shift, lowest)
  gap = v - lam
  if kind == PNORM:
    # 0 < gap < l holds for the fractional entries only: never at an infinite entry
    # (gap = +inf, or finite and negative after the clamp) nor at a non-finite lam.
    live = (gap > 0) & (gap < l)
    z = gap * inv
    if a == 1.0:  # p = 2
      d = jnp.ones_like(z)
    elif a == 3.0:  # p = 4/3
      d = 3 * z * z
    else:
      d = a * jnp.clip(z, 0, 1) ** (a - 1.0)
  else:
    # z where x - lam overflows (far opposite signs near the float maximum): x/l - lam/l.
    z = jnp.where(jnp.isfinite(gap), gap * inv, v * inv - lam * inv)
    live = jnp.isfinite(x) & jnp.isfinite(lam)
    if kind == ENTROPY:
      live = live & (z < 0)
      d = jnp.exp(jnp.minimum(z, 0))
    elif kind == SIGMOID:
      # sigmoid(|z|) sigmoid(-|z|): keeps the tail e^-|z| (s (1 - s) is 0 once s
      # rounds to 1, which near-binary rows need; proofs/complement_form.md)
      d = jax.nn.sigmoid(jnp.abs(z)) * jax.nn.sigmoid(-jnp.abs(z))
    elif kind == LAPLACE:
      d = 0.5 * jnp.exp(-jnp.abs(z))
    else:
      raise ValueError(f"unknown mask kind {kind}")
  d = jnp.where(live, d * inv, 0)
  return d, jnp.where(live, d * z, 0)


def row_scale(x, l, layout=None):
  """``f = 2^-E`` per row (``x`` (..., n), ``l`` (...)): the exact rescaling the native
  kernel solves a float64 row in (:func:`implicit_topk.solvers.float_range.scale_exponent`
  on the rows laid out by ``layout``, default the last axis; a constant for
  derivatives); ``None`` for other dtypes (never scaled)."""
  if x.dtype != jnp.float64:
    return None
  from implicit_topk.problems.layout import LastAxis
  from implicit_topk.solvers import float_range
  x, l = jax.lax.stop_gradient((x, l))
  e = float_range.scale_exponent(layout or LastAxis(), x, l)
  return float_range.unscale(jnp.ones_like(l), -e)


def tangent(kind: int, a: float, x, lam, shift, l, x_dot, k_dot, l_dot):
  """``(y_dot, lam_dot)`` from the tangents of ``x`` (..., n), ``k`` and ``l`` (...), at
  the kernel's ``lam`` and ``shift`` (in the coordinates of :func:`row_scale`: ``x``,
  ``l`` and their tangents are scaled by ``f``, ``k``'s and ``lam``'s are not)."""
  f = row_scale(x, l)
  if f is not None:
    x, x_dot = x * f[..., None], x_dot * f[..., None]
    l, l_dot = l * f, l_dot * f
  d, dz = slopes(kind, a, x, lam, shift, l)
  total = d.sum(-1)
  moved = (d * x_dot).sum(-1) - (dz.sum(-1) * l_dot) - k_dot
  lam_dot = jnp.where(total > 0, moved / jnp.where(total > 0, total, 1), 0)
  lam_dot = jnp.where(jnp.isnan(lam), jnp.nan, lam_dot)
  y_dot = d * (x_dot - lam_dot[..., None]) - dz * l_dot[..., None]
  return y_dot, lam_dot
