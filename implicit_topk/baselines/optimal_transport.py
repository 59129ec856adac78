r"""Entropic optimal-transport top-k (Xie et al., NeurIPS 2020; OTT's ``soft_sort.topk_mask``).

The scores are squashed to :math:`u_i \in [0, 1]` (default, as OTT:
:math:`u = \mathrm{sigmoid}((x - \bar x)/\mathrm{std}(x))`) and transported, with cost
:math:`C_{ij} = (u_i - t_j)^2`, from :math:`a = \mathbf{1}/n` to two targets :math:`t = (0, 1)`
with masses :math:`b = (1 - k/n,\ k/n)`:

.. math::

    \Gamma^\star = \arg\min_{\Gamma \mathbf{1} = a,\ \Gamma^\top \mathbf{1} = b}
                   \langle C, \Gamma\rangle - \varepsilon H(\Gamma), \qquad
    \mathrm{mask} = n\, \Gamma^\star_{:, 1}.

Solved by log-domain Sinkhorn iterations until the target marginal error
:math:`\|\Gamma^\top \mathbf{1} - b\|_1 \le` ``tol`` or ``max_iter``. Sinkhorn is slow
here for small :math:`\varepsilon` (at ``epsilon=1e-2``, 1e4 iterations still leave a
marginal error near 2e-4), so by default Newton steps on the scalar dual below finish
the job (``polish=True``: the same fixed point, reached to ``tol`` by a safeguarded
Newton iteration that keeps a bracket of the root; ``polish=False`` is plain Sinkhorn).
With two targets the potentials reduce to one scalar: eliminating the source potential gives
:math:`\mathrm{mask}_i = \mathrm{sigmoid}((2 u_i - 1 + g)/\varepsilon)` with :math:`g`
(the difference of the target potentials) the root of :math:`\sum_i \mathrm{mask}_i = k`.
The gradient is the implicit one at that root (Xie et al. differentiate the KKT system),
by ``jax.lax.custom_root``: :math:`O(n)` per row. Sinkhorn costs :math:`O(n)` per
iteration (an :math:`n \times 2` plan), not quadratic; the number of iterations grows as
:math:`\varepsilon` shrinks.

Observation: the mask is exactly the sigmoid (binary-entropy) regularized top-k of the
squashed scores, ``soft_topk_mask(u, k, l=epsilon/2, regularizer=BinaryEntropy())``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from implicit_topk import _validation


def _default_squash(s):
  mean = jnp.mean(s, axis=-1, keepdims=True)
  std = jnp.std(s, axis=-1, keepdims=True)
  return jax.nn.sigmoid((s - mean) / (std + 1e-10))


def _sinkhorn_root(u, kf, eps, tol, max_iter):
  """Log-domain Sinkhorn on the n x 2 problem; returns g = g_1 - g_0 per row (..., 1)."""
  n = u.shape[-1]
  cost = jnp.stack([u ** 2, (u - 1.0) ** 2], axis=-1)  # (..., n, 2)
  log_a = -jnp.log(jnp.asarray(n, u.dtype))
  log_b = jnp.log(jnp.stack([1.0 - kf / n, kf / n], axis=-1))  # (..., 2)

  def f_from_g(g):
    return eps * log_a - eps * jax.nn.logsumexp((g[..., None, :] - cost) / eps, axis=-1)

  def target_marginal_log(f, g):
    return jax.nn.logsumexp((f[..., :, None] + g[..., None, :] - cost) / eps, axis=-2)

  def body(state):
    g, _, it = state
    f = f_from_g(g)
    g = eps * log_b - eps * jax.nn.logsumexp((f[..., :, None] - cost) / eps, axis=-2)
    f = f_from_g(g)
    err = jnp.max(jnp.sum(jnp.abs(jnp.exp(target_marginal_log(f, g)) - jnp.exp(log_b)), axis=-1))
    return g, err, it + 1

  def cond(state):
    _, err, it = state
    return (err > tol) & (it < max_iter)

  g0 = jnp.zeros(u.shape[:-1] + (2,), u.dtype)
  g, _, _ = jax.lax.while_loop(cond, body, (g0, jnp.asarray(jnp.inf, u.dtype), 0))
  return g[..., 1:] - g[..., :1]


def _newton_polish(u, kf, eps, g, tol, steps):
  r"""Safeguarded Newton on the increasing :math:`r(g) = \sum_i
  \mathrm{sigmoid}((2u_i - 1 + g)/\varepsilon) - k`, per row, from Sinkhorn's ``g``.

  The root lies in :math:`[-\max_i c_i - 40\varepsilon,\ -\min_i c_i + 40\varepsilon]`,
  :math:`c = 2u - 1` (there every sigmoid is below :math:`e^{-40}`, resp. above
  :math:`1 - e^{-40}`, so :math:`r < 0`, resp. :math:`> 0`, for :math:`0 < k < n`). Each
  step keeps that bracket and takes the Newton step where it falls strictly inside,
  else bisects: at small :math:`\varepsilon` the slope of a saturated row is ~0, and a
  bare (clipped) Newton step oscillated there without converging (masks summing to 4
  or 1 for ``k = 3`` at ``epsilon=3e-4``). Stops at :math:`|r| \le` ``tol``, a bracket a
  few ulps wide, or ``steps``.
  """
  c = 2.0 * u - 1.0
  margin = 40.0 * eps
  lo = -jnp.max(c, axis=-1, keepdims=True) - margin
  hi = -jnp.min(c, axis=-1, keepdims=True) + margin
  ulps = 4.0 * jnp.finfo(u.dtype).eps

  def terms(g):
    sig = jax.nn.sigmoid((c + g) / eps)
    r = jnp.sum(sig, axis=-1, keepdims=True) - kf[..., None]
    return r, jnp.sum(sig * (1.0 - sig), axis=-1, keepdims=True) / eps

  def open_rows(r, lo, hi):
    return (jnp.abs(r) > tol) & (hi - lo > ulps * (jnp.abs(lo) + jnp.abs(hi)))

  # The state carries r and r' at g: one pass over the row per step (cond reads them).
  def body(state):
    g, r, slope, lo, hi, it = state
    lo = jnp.where(r < 0, g, lo)
    hi = jnp.where(r > 0, g, hi)
    newton = g - r / jnp.where(slope > 0, slope, 1.0)
    inside = (slope > 0) & (newton > lo) & (newton < hi)
    step = jnp.where(inside, newton, 0.5 * (lo + hi))
    g = jnp.where(open_rows(r, lo, hi), step, g)
    return (g, *terms(g), lo, hi, it + 1)

  def cond(state):
    _, r, _, lo, hi, it = state
    return jnp.any(open_rows(r, lo, hi)) & (it < steps)

  g = jnp.clip(g, lo, hi)
  g, *_ = jax.lax.while_loop(cond, body, (g, *terms(g), lo, hi, 0))
  return g


def ot_topk_mask(x: ArrayLike, k: ArrayLike, *, epsilon: ArrayLike = 1e-2, squash: bool = True,
                 tol: float = 1e-10, max_iter: int = 1000, polish: bool = True,
                 axis: int = -1) -> jax.Array:
  r"""Entropic optimal-transport soft top-k mask, as OTT's ``soft_sort.topk_mask``.

  Xie et al. (2020, "Differentiable top-k with optimal transport", NeurIPS) transport
  the (squashed) scores, with entropic regularization ``epsilon``, onto two targets 0
  and 1 with masses ``1 - k/n`` and ``k/n``; the mask is the mass sent to 1. The module
  docstring of ``implicit_topk.baselines.optimal_transport`` details the problem, the
  solver (log-domain Sinkhorn, then Newton on a scalar dual) and the implicit gradient.

  Args:
    x: float array (float16, bfloat16, float32 or float64).
    k: number of entries to select, 0 < k < n; any real (it is the target mass
      ``k/n``): a scalar, or one value per row (an array broadcastable to the shape of
      ``x`` without ``axis``).
    epsilon: entropic regularization, > 0 (default 1e-2, OTT's). Smaller is closer to
      the hard top-k mask and needs more Sinkhorn iterations.
    squash: ``True`` (default; OTT's sigmoid of the whitened scores), or ``False`` to
      transport ``x`` as is (then ``x`` should lie in [0, 1]).
    tol: Sinkhorn stops once the L1 error of the target marginal is ``<= tol``
      (default 1e-10).
    max_iter: Sinkhorn iteration cap, >= 0 (default 1000).
    polish: ``True`` (default) finishes with at most 200 safeguarded Newton steps on the
      scalar dual (bisection where Newton leaves the bracket of the root) until
      :math:`|\sum_i \mathrm{mask}_i - k| \le` ``tol`` or the bracket is a few ulps
      wide (then the rows sum to ``k`` to rounding, at any ``epsilon``); ``False`` is
      plain Sinkhorn, which can stop far from the root at small ``epsilon``.
    axis: the axis to select along (default -1, the last).

  Returns:
    The mask, a float array of the shape and (float) dtype of ``x``: entries in
    (0, 1), each row along ``axis`` summing to ``k``; never exactly sparse.

  Example:
    >>> import jax.numpy as jnp
    >>> from implicit_topk import baselines
    >>> x = jnp.array([0.3, 2.0, 1.0, -1.0])
    >>> jnp.round(baselines.ot_topk_mask(x, 2, epsilon=0.1), 3)
    Array([0.171     , 0.99600005, 0.832     , 0.001     ], dtype=float32)
  """
  x = _validation.as_float_input(x)
  axis = _validation.canonicalize_axis(axis, x.ndim)
  n = x.shape[axis]
  _validation.check_k(k, n, allow_zero=False, allow_n=False)
  _validation.check_positive(epsilon, "epsilon")
  s = jnp.moveaxis(x, axis, -1)
  u = _default_squash(s) if squash else s
  eps = jnp.asarray(epsilon, s.dtype)
  kf = jnp.broadcast_to(jnp.asarray(k, s.dtype), s.shape[:-1])

  def residual(g):
    return jnp.sum(jax.nn.sigmoid((2.0 * u - 1.0 + g) / eps), axis=-1, keepdims=True) - kf[..., None]

  def solve(_, g_init):
    del g_init
    stop = jax.lax.stop_gradient
    g = _sinkhorn_root(stop(u), stop(kf), stop(eps), tol, max_iter)
    return _newton_polish(stop(u), stop(kf), stop(eps), g, tol, 200) if polish else g

  def tangent_solve(g_fn, y):
    # residual is elementwise in its per-row scalar g: one division per row.
    return y / g_fn(jnp.ones_like(y))

  g = jax.lax.custom_root(residual, jnp.zeros(s.shape[:-1] + (1,), s.dtype), solve, tangent_solve)
  mask = jax.nn.sigmoid((2.0 * u - 1.0 + g) / eps)
  return jnp.moveaxis(mask, -1, axis)
