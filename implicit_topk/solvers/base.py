r"""Solver objects for the capped-simplex top-k problem, in the style of jaxopt.

Every solver finds the threshold :math:`\lambda` (one per row) of

.. math::

    y^\star = \arg\max_{y \in [0,1]^n,\ \sum y = k} \langle x, y\rangle - l\,\Omega(y),
    \qquad y_i = \mathrm{mask}((x_i - \lambda) / l),

as the root of the optimality condition
:math:`\phi(\lambda; x, k, l) = \sum_i y_i - k` along the last axis. ``run`` returns
``OptStep(params=lam, state)`` like a jaxopt solver; ``primal`` maps ``lam`` to the
mask; ``mask`` does both. With ``implicit_diff=True`` the derivatives of ``lam``
w.r.t. ``x``, ``k`` and ``l`` come from the implicit function theorem on
``optimality_fun`` (see :mod:`implicit_topk._implicit`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from implicit_topk import _implicit
from implicit_topk import _validation
from implicit_topk.regularizers import PNorm


class OptStep(NamedTuple):
  """What ``run`` returns: the solution and the solver's final state."""

  params: jax.Array
  state: Any


class RootState(NamedTuple):
  """Diagnostics, one entry per row.

  Attributes:
    iter_num: passes over the data the solver made (0 for direct solvers).
    residual: :math:`|\\phi(\\lambda)| = |\\sum_i y_i - k|` at the returned threshold.
  """

  iter_num: jax.Array
  residual: jax.Array


def _per_row(value, x):
  """Broadcasts a per-row quantity to ``x.shape[:-1] + (1,)``."""
  return jnp.broadcast_to(jnp.asarray(value, x.dtype), x.shape[:-1])[..., None]


@dataclasses.dataclass(frozen=True)
class CappedSimplexSolver:
  """Base class: subclasses implement ``_solve(init, x, k, l) -> (lam, iter_num)``.

  Attributes:
    regularizer: the separable regularizer (default ``PNorm(4/3)``).
    implicit_diff: differentiate by the implicit function theorem (default). When
      False, subclasses that support it differentiate through their iterations.
    implicit_diff_backend: ``"lax"`` (forward and reverse mode) or ``"jaxopt"``
      (reverse mode only), see :mod:`implicit_topk._implicit`.
  """

  regularizer: Any = dataclasses.field(default_factory=PNorm)
  implicit_diff: bool = True
  implicit_diff_backend: str = "lax"

  def __post_init__(self):
    _validation.check_choice(self.implicit_diff_backend, "implicit_diff_backend", _implicit.BACKENDS)

  # -- the problem ------------------------------------------------------------
  def primal(self, lam, x, l):
    """The mask y_i = mask((x_i - lam) / l) along the last axis of ``x``.

    NaN propagates (a row without a threshold has ``lam = nan`` and gives NaN).
    """
    z = (x - _per_row(lam, x)) / _per_row(l, x)
    return jnp.where(jnp.isnan(z), z, self.regularizer.mask(z))

  def optimality_fun(self, lam, x, k, l):
    """phi(lam) = sum_i y_i(lam) - k, one entry per row; zero at the solution."""
    return jnp.sum(self.primal(lam, x, l), axis=-1) - k

  # -- solving ----------------------------------------------------------------
  def _solve(self, init, x, k, l):
    raise NotImplementedError

  def _solve_unrolled(self, init, x, k, l):
    raise ValueError(
        f"{type(self).__name__} cannot be differentiated through its iterations; "
        "use implicit_diff=True."
    )

  def run(self, init_params, x, k, l) -> OptStep:
    """Solves for the thresholds.

    Args:
      init_params: initial thresholds, shape ``x.shape[:-1]``, or None.
      x: scores, float array ``(..., n)``; the problem is along the last axis.
      k: target sums, shape broadcastable to ``x.shape[:-1]``, in (0, n).
      l: regularization strengths, broadcastable to ``x.shape[:-1]``, > 0.

    Returns:
      ``OptStep(params=lam, state=RootState(iter_num, residual))``.
    """
    x = jnp.asarray(x)
    batch_shape = x.shape[:-1]
    k = jnp.broadcast_to(jnp.asarray(k, x.dtype), batch_shape)
    l = jnp.broadcast_to(jnp.asarray(l, x.dtype), batch_shape)
    warm = init_params is not None
    init = jnp.zeros(batch_shape, x.dtype) if not warm else jnp.broadcast_to(
        jnp.asarray(init_params, x.dtype), batch_shape)

    def solver_fun(guess, x_, k_, l_):
      lam, iter_num = self._solve(guess if warm else None, x_, k_, l_)
      # Auxiliary outputs of custom_root must be float (their tangents are zeros).
      return lam, iter_num.astype(x_.dtype)

    if self.implicit_diff:
      lam, iter_num = _implicit.implicit_root(
          solver_fun, self.optimality_fun, init, (x, k, l), backend=self.implicit_diff_backend)
    else:
      lam, iter_num = self._solve_unrolled(init if warm else None, x, k, l)
    iter_num = jnp.asarray(jax.lax.stop_gradient(iter_num), jnp.int32)
    residual = jnp.abs(self.optimality_fun(jax.lax.stop_gradient(lam), *jax.lax.stop_gradient((x, k, l))))
    return OptStep(params=lam, state=RootState(iter_num=iter_num, residual=residual))

  def mask(self, x, k, l, init_params=None):
    """The soft top-k mask along the last axis: ``primal(run(...).params, x, l)``."""
    x = jnp.asarray(x)
    return self.primal(self.run(init_params, x, k, l).params, x, l)
