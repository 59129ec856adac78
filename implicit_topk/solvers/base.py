r"""Solver objects for the row-wise threshold problems, in the style of jaxopt.

Every solver finds the threshold :math:`\lambda` (one per row) of a problem from
:mod:`implicit_topk.problems` (the top-k mask by default) as the root of its optimality
function :math:`\phi(\lambda; x, k, l)` along the last axis. ``run`` returns
``OptStep(params=lam, state)`` like a jaxopt solver; ``primal`` maps ``lam`` to the
operator's output; ``apply`` (alias ``mask``) does both. With ``implicit_diff=True``
the derivatives of ``lam`` w.r.t. ``x``, ``k`` and ``l`` come from the implicit function
theorem on ``optimality_fun`` (see :mod:`implicit_topk._implicit`); subclasses only
say how to find the root.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from implicit_topk import _implicit
from implicit_topk import _validation
from implicit_topk.problems import layout as _layout


class OptStep(NamedTuple):
  """What ``run`` returns: the solution and the solver's final state."""

  params: jax.Array
  state: Any


class RootState(NamedTuple):
  """Diagnostics, one entry per row.

  Attributes:
    iter_num: passes over the data the solver made (0 for direct solvers).
    residual: :math:`|\\phi(\\lambda)|` at the returned threshold (for the mask,
      :math:`|\\sum_i y_i - k|`).
  """

  iter_num: jax.Array
  residual: jax.Array


@dataclasses.dataclass(frozen=True)
class ThresholdRootSolver:
  """Base class: subclasses implement ``_solve(init, x, k, l) -> (lam, iter_num)``.

  Attributes:
    regularizer: the separable regularizer of the top-k mask (default ``PNorm(4/3)``);
      shorthand for ``problem=CappedSimplex(regularizer)``.
    problem: the threshold problem (:mod:`implicit_topk.problems`); give this or
      ``regularizer``, not both.
    implicit_diff: differentiate by the implicit function theorem (default). When
      False, subclasses that support it differentiate through their iterations.
    implicit_diff_backend: ``"lax"`` (forward and reverse mode) or ``"jaxopt"``
      (reverse mode only), see :mod:`implicit_topk._implicit`.
  """

  regularizer: Any = None
  problem: Any = None
  implicit_diff: bool = True
  implicit_diff_backend: str = "lax"

  name = "base"

  def __post_init__(self):
    from implicit_topk import problems, regularizers
    _validation.check_choice(self.implicit_diff_backend, "implicit_diff_backend", _implicit.BACKENDS)
    if self.problem is None:
      regularizer = regularizers.PNorm() if self.regularizer is None else self.regularizer
      object.__setattr__(self, "problem", problems.CappedSimplex(regularizer))
    elif self.regularizer is not None:
      raise ValueError("Give `problem` or `regularizer`, not both.")
    object.__setattr__(self, "regularizer", getattr(self.problem, "regularizer", None))
    self.problem.supports(self.name)

  # -- the problem ------------------------------------------------------------
  def primal(self, lam, x, l):
    """The operator's output for thresholds ``lam`` (one per row of ``x``)."""
    return self.problem.primal(lam, x, l)

  @property
  def layout(self):
    """The problem's reduction layout (:mod:`implicit_topk.problems.layout`)."""
    return getattr(self.problem, "layout", _layout.DEFAULT)

  def with_layout(self, layout) -> "ThresholdRootSolver":
    """This solver on the same problem laid out by ``layout`` (e.g. a bound
    :class:`~implicit_topk.problems.layout.Segments`)."""
    new = copy.copy(self)
    object.__setattr__(new, "problem", self.problem.with_layout(layout))
    new.problem.supports(self.name)
    return new

  def _per_row(self, x, k, l):
    layout = self.layout
    x = layout.asarray(x)
    dtype, rows = layout.dtype(x), layout.row_shape(x)
    k = jnp.broadcast_to(jnp.asarray(k, dtype), rows)
    l = jnp.broadcast_to(jnp.asarray(l, dtype), rows)
    return x, k, l

  def optimality_fun(self, lam, x, k, l):
    """phi(lam; x, k, l), one entry per row; zero at the solution."""
    return self.problem.optimality(lam, *self._per_row(x, k, l))

  # -- solving ----------------------------------------------------------------
  def _solve(self, init, x, k, l):
    raise NotImplementedError

  def _solve_unrolled(self, init, x, k, l):
    raise ValueError(
        f"{type(self).__name__} cannot be differentiated through its iterations; "
        "use implicit_diff=True.")

  def run(self, init_params, x, k, l) -> OptStep:
    """Solves for the thresholds.

    Args:
      init_params: initial thresholds, shape ``x.shape[:-1]``, or None.
      x: scores, float array ``(..., n)``; the problem is along the last axis (or
        along the rows of the problem's ``layout``: segments, a pytree).
      k: target sums, shape broadcastable to the row shape (``x.shape[:-1]``), in
        [0, n].
      l: regularization strengths, broadcastable to the row shape, > 0.

    Returns:
      ``OptStep(params=lam, state=RootState(iter_num, residual))``.
    """
    x, k, l = self._per_row(x, k, l)
    layout = self.layout
    dtype = layout.dtype(x)
    warm = init_params is not None
    # layout.zeros: the initial guess has x's varying axes under shard_map.
    init = layout.zeros(x) if not warm else jnp.broadcast_to(
        jnp.asarray(init_params, dtype), layout.row_shape(x))

    def solver_fun(guess, x_, k_, l_):
      lam, iter_num = self._solve(guess if warm else None, x_, k_, l_)
      # Auxiliary outputs of custom_root must be float (their tangents are zeros).
      return lam, iter_num.astype(dtype)

    if self.implicit_diff:
      lam, iter_num = _implicit.implicit_root(
          solver_fun, self.problem.optimality, init, (x, k, l),
          backend=self.implicit_diff_backend)
    else:
      lam, iter_num = self._solve_unrolled(init if warm else None, x, k, l)
    iter_num = jnp.asarray(jax.lax.stop_gradient(iter_num), jnp.int32)
    residual = jnp.abs(self.problem.optimality(
        jax.lax.stop_gradient(lam), *jax.lax.stop_gradient((x, k, l))))
    return OptStep(params=lam, state=RootState(iter_num=iter_num, residual=residual))

  def apply(self, x, k, l, init_params=None):
    """The operator along the last axis: ``primal(run(...).params, x, l)``, solved on
    ``problem.normalize(x)`` (so ``init_params`` is relative to that input)."""
    x, _, l_rows = self._per_row(x, k, l)
    x = self.problem.normalize(x, l_rows)
    return self.primal(self.run(init_params, x, k, l).params, x, l_rows)

  mask = apply  # the top-k mask, for the default problem


CappedSimplexSolver = ThresholdRootSolver  # the name of the first release
