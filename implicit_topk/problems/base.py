r"""The interface every threshold problem provides, and the pieces they share.

A problem is a frozen dataclass (hashable, so solvers and jit caches can key on it)
with these members; all arrays are batched along leading axes and the problem is
along the last axis of ``x``; ``k``, ``l`` and ``lam`` have the batch shape.

* ``optimality(lam, x, k, l)``: :math:`\phi`, nonincreasing in ``lam``, zero at the
  solution. Implicit derivatives are taken on it, and the Newton solver takes
  :math:`\phi'` and :math:`\phi''` from it by ``jax.jvp``.
* ``primal(lam, x, l)``: the operator's output for thresholds ``lam``.
* ``normalize(x, l)``: an equivalent input that is better conditioned (the mask
  subtracts a far-off row maximum: it is shift invariant); the operators solve on it.
* ``bracket(x, k, l) -> Bracket``: ``lo <= root <= hi`` and the rows whose answer is
  known without iterating (non-finite entries, saturated rows, no solution: NaN).
* ``initial_guess(x, k, l, bracket)``: a start inside the bracket, without any sort.
* ``snap(lam, x, k, l, known)``: moves ``lam`` into the interior of the flat root
  interval where the solution is binary (else returns it unchanged).
* ``step_scale(lam, l)``, ``residual_scale(lam, k)``, ``geometric``: the Newton
  solver's stopping scales, and whether to bisect geometrically.
* ``host_threshold(kernels, x, k, l)`` (optional): the exact threshold from the numba
  PAV kernels, NumPy in and out (``solver="pav"``).
* ``dykstra_threshold(x, k, l, *, tol, maxiter, unrolled)`` (optional):
  ``(lam, sweeps)`` by Dykstra's algorithm (``solver="dykstra"``).
* ``supports(solver_name)``: raises ``ValueError`` naming the option when the problem
  cannot be solved by that solver.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp


class Bracket(NamedTuple):
  """Per row: ``lo <= lam* <= hi``; ``known`` rows take ``value`` without iterating."""

  lo: jax.Array
  hi: jax.Array
  known: jax.Array
  value: jax.Array


@runtime_checkable
class ThresholdProblem(Protocol):
  """What the solvers read from a problem (see the module docstring)."""

  geometric: bool

  def optimality(self, lam, x, k, l) -> jax.Array: ...

  def primal(self, lam, x, l) -> jax.Array: ...

  def normalize(self, x, l) -> jax.Array: ...

  def bracket(self, x, k, l) -> Bracket: ...

  def initial_guess(self, x, k, l, bracket: Bracket) -> jax.Array: ...

  def snap(self, lam, x, k, l, known) -> jax.Array: ...

  def step_scale(self, lam, l) -> jax.Array: ...

  def residual_scale(self, lam, k) -> jax.Array: ...

  def supports(self, solver_name: str) -> None: ...


def per_row(value, x) -> jax.Array:
  """Broadcasts a per-row quantity to ``x.shape[:-1] + (1,)`` in the dtype of ``x``."""
  return jnp.broadcast_to(jnp.asarray(value, x.dtype), x.shape[:-1])[..., None]


def finite_moments(values, where):
  """Mean and standard deviation of ``values`` over ``where`` along the last axis."""
  count = jnp.maximum(jnp.sum(where, axis=-1), 1).astype(values.dtype)
  safe = jnp.where(where, values, 0)
  mean = jnp.sum(safe, axis=-1) / count
  centered = jnp.where(where, values - mean[..., None], 0)
  return mean, jnp.sqrt(jnp.sum(centered * centered, axis=-1) / count)


def upper_quantile_of_normal(fraction, dtype) -> Any:
  """z with P(N(0, 1) > z) = fraction (fraction clipped to [1e-6, 1 - 1e-6])."""
  fraction = jnp.clip(jnp.asarray(fraction, dtype), 1e-6, 1 - 1e-6)
  return -jax.scipy.special.ndtri(fraction)
