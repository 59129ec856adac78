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
the block length), so it stops at a tolerance and reports how far it got. With a
certified residual, the blocks read off its multipliers are pooled exactly and tested
every 32 sweeps (:func:`_snap`, ``proofs/dykstra_snap.md``), which ends a row as soon
as Dykstra has found its blocks.

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


_SNAP_EVERY = 32  # sweeps between two reads of the blocks off the multipliers


def _snap(u, rho, p, q):
  r"""The blocks that Dykstra's multipliers mark, their weighted means, and whether
  those pass the optimality test (KKT), per row.

  Constraint :math:`v_i \ge v_{i+1}` is active when its multiplier is positive: ``p``
  at ``i + 1`` for even ``i``, ``q`` at ``i + 1`` for odd ``i``. On a partition into
  runs :math:`B`, :math:`\hat v = ` the weighted mean :math:`m_B` of ``u`` on each run
  is the isotonic regression iff it is nonincreasing and every proper prefix
  :math:`P` of a run has :math:`\mu_P = \sum_{i \in P} \rho_i (m_B - u_i) \ge 0`
  (these are the multipliers, nonnegative; de Leeuw, Hornik and Mair 2009,
  "Isotone optimization in R: pool-adjacent-violators algorithm (PAVA) and active
  set methods"; ``proofs/dykstra_snap.md``). Both are tested to rounding
  (``8 eps`` of the sums involved). Sums within runs are segmented scans.
  """
  from implicit_topk.solvers import isotonic  # pylint: disable=g-import-not-at-top
  shape, n = u.shape, u.shape[-1]
  u2, rho2 = u.reshape(-1, n), rho.reshape(-1, n)
  p2, q2 = p.reshape(-1, p.shape[-1]), q.reshape(-1, q.shape[-1])
  index = jnp.arange(n - 1)
  join = jnp.where(index % 2 == 0, p2[:, 1:n], q2[:, 1:n]) > 0  # (R, n - 1)
  first = jnp.concatenate([jnp.ones_like(join[:, :1]), ~join], axis=1)
  last = jnp.concatenate([~join, jnp.ones_like(join[:, :1])], axis=1)
  from_first, to_last = isotonic.run_reach(first)
  rows = u2.shape[0]
  stats = jnp.concatenate([rho2 * u2, rho2, jnp.abs(rho2 * u2)], axis=0)  # (3R, n): row-wise
  prefix = isotonic.segmented_scan(stats, jnp.tile(from_first, (3, 1)))  # over [start, i]
  prefix = jnp.moveaxis(prefix.reshape(3, rows, n), 0, -1)
  end = jax.lax.broadcasted_iota(jnp.int32, u2.shape, 1) + to_last
  totals = jnp.take_along_axis(prefix, end[..., None], axis=1)  # the run's sums, read
  weight = totals[..., 1]
  mean = jnp.where(weight > 0, totals[..., 0] / jnp.where(weight > 0, weight, 1), u2)
  eps = float(np.finfo(np.dtype(u.dtype)).eps)
  mu = prefix[..., 1] * mean - prefix[..., 0]
  mu_ok = last | (mu >= -8 * eps * (prefix[..., 2] + prefix[..., 1] * jnp.abs(mean)))
  drop = mean[:, :-1] - mean[:, 1:]
  order_ok = drop >= -8 * eps * (jnp.abs(mean[:, :-1]) + jnp.abs(mean[:, 1:]))
  ok = jnp.all(mu_ok, axis=1) & jnp.all(order_ok, axis=1)
  return mean.reshape(shape), ok.reshape(shape[:-1])


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
  rule: a row stops once its residual is ``<= tol``. With ``residual_fun`` and
  ``tol > 0``, every 32 sweeps the blocks marked by the positive multipliers are read
  off the iterate and pooled exactly (:func:`_snap`): a row also stops, with those
  block means, once they pass the optimality (KKT) test, or once their residual is
  ``<= tol``. Dykstra finds the active constraints long before its values converge
  (the multipliers spread one pair per sweep; the values within a block of length
  ``m`` settle in about ``m**2`` sweeps), and the test keeps the result exact up to
  rounding, which also ends rows where rounding keeps the residual above ``tol``
  (float32). ``tol = 0`` runs the plain sweeps (the unrolled study's fixed budgets).

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

  snap = residual_fun is not None and isinstance(tol, (int, float)) and tol > 0

  def snapped(state, done, iter_num):
    """Rows whose marked blocks pass the test (or the residual) stop with their means."""
    v_hat, ok = _snap(u, rho, state[1], state[2])
    ok = ~done & (ok | (residual_fun(v_hat) <= tol_array))
    v = state[0].at[..., :n].set(jnp.where(ok[..., None], v_hat, state[0][..., :n]))
    return (v,) + tuple(state[1:]), done | ok

  def body(carry):
    state, done, iter_num, change = carry
    new_state = _sweep(rho_even, state)
    new_change = jnp.max(jnp.abs(new_state[0] - state[0]), axis=-1)
    keep = done[..., None]
    state = tuple(jnp.where(keep, old, new) for old, new in zip(state, new_state))
    change = jnp.where(done, change, new_change)
    iter_num = iter_num + jnp.where(done, 0, 1)
    done = done | converged(state[0], new_change)
    if snap:
      state, done = jax.lax.cond(
          jnp.max(iter_num) % _SNAP_EVERY == 0, snapped,
          lambda state, done, iter_num: (state, done), state, done, iter_num)
    return state, done, iter_num, change

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
