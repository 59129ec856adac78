r"""Dykstra's alternating projections for isotonic regression.

Weighted isotonic regression along the last axis,

.. math::

    v^\star(u) = \arg\min_{v_1 \ge v_2 \ge \dots \ge v_n}\
                 \tfrac12 \sum_i \rho_i (v_i - u_i)^2,

is the projection (in the :math:`\rho`-weighted norm) of :math:`u` onto the
intersection of two sets of *disjoint* pair constraints,
:math:`E = \{v_1 \ge v_2,\ v_3 \ge v_4, \dots\}` and
:math:`O = \{v_2 \ge v_3,\ v_4 \ge v_5, \dots\}`. Projecting onto either set is one
closed-form step per pair: a violating pair :math:`(a, b)`, :math:`a < b`, becomes its
weighted mean. Dykstra's algorithm

.. math::

    y = P_E(v + p),\ p \leftarrow v + p - y, \qquad
    v \leftarrow P_O(y + q),\ q \leftarrow y + q - v

(one *sweep*) converges to :math:`v^\star` (Boyle and Dykstra, 1986). Each sweep is
O(n) elementwise work, fully parallel, batched along leading axes: the
accelerator-friendly counterpart of PAV. It is approximate: convergence is linear with
a rate that approaches 1 as pooled blocks grow (sweeps grow roughly with the square of
the block length), so it stops at a tolerance and reports how far it got.

Pure JAX (``jit``, ``vmap``, any backend); :class:`implicit_topk.solvers.DykstraSolver`
solves the top-k threshold on it.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class DykstraResult(NamedTuple):
  """Output of :func:`isotonic_dykstra`, per row where applicable.

  Attributes:
    v: the isotonic regression (shape of ``u``).
    iter_num: sweeps made (int32, per row).
    change: ``max(abs(v_new - v_old))`` over the last sweep (per row): the stopping statistic.
  """

  v: jax.Array
  iter_num: jax.Array
  change: jax.Array


def _project_pairs(v, rho):
  """Projects consecutive pairs (v_0, v_1), (v_2, v_3), ... onto {a >= b}, rho-weighted."""
  shape = v.shape
  pairs = v.reshape(shape[:-1] + (shape[-1] // 2, 2))
  weights = rho.reshape(pairs.shape)
  a, b = pairs[..., 0], pairs[..., 1]
  wa, wb = weights[..., 0], weights[..., 1]
  mean = (wa * a + wb * b) / (wa + wb)
  violated = a < b
  a = jnp.where(violated, mean, a)
  b = jnp.where(violated, mean, b)
  return jnp.stack([a, b], axis=-1).reshape(shape)


def _project_even(v, rho):
  """Onto E = {v_0 >= v_1, v_2 >= v_3, ...} (the length is even)."""
  return _project_pairs(v, rho)


def _project_odd(v, rho):
  """Onto O = {v_1 >= v_2, v_3 >= v_4, ...}; v_0 and v_{m-1} are free."""
  inner = _project_pairs(v[..., 1:-1], rho[..., 1:-1])
  return jnp.concatenate([v[..., :1], inner, v[..., -1:]], axis=-1)


def _sweep(rho, state):
  """One Dykstra sweep: returns the new (v, p, q)."""
  v, p, q = state
  y = _project_even(v + p, rho)
  p = v + p - y
  v_new = _project_odd(y + q, rho)
  q = y + q - v_new
  return v_new, p, q


def _pad_to_even(u, rho):
  """Appends one zero-weight entry if n is odd: a zero weight never moves its partner."""
  n = u.shape[-1]
  if n % 2 == 0:
    return u, rho
  pad = [(0, 0)] * (u.ndim - 1) + [(0, 1)]
  return jnp.pad(u, pad, mode="edge"), jnp.pad(rho, pad)


def _rounding_floor(u):
  """The change below which a sweep only moves rounding errors: ``8 eps max(abs(u))`` per row."""
  eps = float(np.finfo(np.dtype(u.dtype)).eps)
  return 8 * eps * jnp.max(jnp.abs(u), axis=-1)


def isotonic_dykstra(
    u,
    weights=None,
    *,
    tol: float = 1e-6,
    max_iter: int = 1000,
    residual_fun: Callable[[jax.Array], jax.Array] | None = None,
) -> DykstraResult:
  r"""Isotonic regression :math:`\min_{v_1 \ge \dots \ge v_n} \frac12\sum_i \rho_i (v_i - u_i)^2`.

  Along the last axis, any leading batch shape. Rows stop independently, all rows stop
  at ``max_iter`` sweeps. By default a row stops once a sweep changes no entry by more
  than ``tol`` (or than rounding, ``8 eps max(abs(u))``). This is *not* a bound on the
  distance to the solution: Dykstra converges linearly with a rate close to 1 on long
  blocks, and the error can be orders of magnitude above the last change. When the
  caller can certify accuracy, ``residual_fun(v)`` (one value per row) replaces the
  rule: a row stops once its residual is ``<= tol``.

  Args:
    u: float array ``(..., n)``.
    weights: positive weights :math:`\rho`, broadcastable to ``u`` (default 1).
    tol: tolerance, >= 0.
    max_iter: maximum number of sweeps, >= 1.
    residual_fun: optional stopping residual ``v -> (...,)``.

  Returns:
    :class:`DykstraResult` ``(v, iter_num, change)``.
  """
  u = jnp.asarray(u)
  n = u.shape[-1]
  rho = jnp.ones_like(u) if weights is None else jnp.broadcast_to(
      jnp.asarray(weights, u.dtype), u.shape)
  batch_shape = u.shape[:-1]
  if n == 1:
    return DykstraResult(u, jnp.zeros(batch_shape, jnp.int32), jnp.zeros(batch_shape, u.dtype))
  u_even, rho_even = _pad_to_even(u, rho)
  tol_array = jnp.asarray(tol, u.dtype)
  floor = jnp.maximum(tol_array, _rounding_floor(u))

  def converged(v, change):
    if residual_fun is None:
      return change <= floor
    return residual_fun(v[..., :n]) <= tol_array

  def cond(carry):
    _, done, iter_num, _ = carry
    return jnp.any(~done & (iter_num < max_iter))

  def body(carry):
    state, done, iter_num, change = carry
    new_state = _sweep(rho_even, state)
    new_change = jnp.max(jnp.abs(new_state[0] - state[0]), axis=-1)
    keep = done[..., None]
    state = tuple(jnp.where(keep, old, new) for old, new in zip(state, new_state))
    change = jnp.where(done, change, new_change)
    iter_num = iter_num + jnp.where(done, 0, 1)
    return state, done | converged(state[0], new_change), iter_num, change

  zeros = jnp.zeros_like(u_even)
  # *_like of a row quantity: the carry keeps shard_map's varying axes (check_vma).
  row = u_even[..., 0]
  carry = ((u_even, zeros, zeros), jnp.zeros_like(row, bool),
           jnp.zeros_like(row, jnp.int32), jnp.full_like(row, jnp.inf))
  (v, _, _), _, iter_num, change = jax.lax.while_loop(cond, body, carry)
  return DykstraResult(v[..., :n], iter_num, change)


def isotonic_dykstra_unrolled(u, weights=None, *, num_sweeps: int) -> jax.Array:
  """Exactly ``num_sweeps`` Dykstra sweeps in ``lax.scan``: differentiable by autodiff.

  Reverse mode stores every sweep's state, so its memory grows with ``num_sweeps``
  (this is what the implicit-vs-unrolled study measures).
  """
  u = jnp.asarray(u)
  n = u.shape[-1]
  if n == 1:
    return u
  rho = jnp.ones_like(u) if weights is None else jnp.broadcast_to(
      jnp.asarray(weights, u.dtype), u.shape)
  u_even, rho_even = _pad_to_even(u, rho)
  zeros = jnp.zeros_like(u_even)
  (v, _, _), _ = jax.lax.scan(
      lambda state, _: (_sweep(rho_even, state), None), (u_even, zeros, zeros),
      None, length=num_sweeps)
  return v[..., :n]
