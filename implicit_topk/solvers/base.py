r"""Solver objects for the row-wise threshold problems, in the style of jaxopt.

Every solver finds the threshold :math:`\lambda` (one per row) of a problem from
:mod:`implicit_topk.problems` (the top-k mask by default) as the root of its optimality
function :math:`\phi(\lambda; x, k, l)` along the last axis, with :math:`l` the
regularization strength (``regularization_strength`` in the operators). ``run``
returns ``OptStep(params=lam, state)`` like a jaxopt solver; ``primal`` maps ``lam``
to the operator's output; ``apply`` (alias ``mask``) does both. With
``implicit_diff=True`` the derivatives of ``lam`` w.r.t. ``x``, ``k`` and ``l`` come
from the implicit function theorem on ``optimality_fun`` (Blondel et al. 2022,
"Efficient and modular implicit differentiation", NeurIPS; see
:mod:`implicit_topk._implicit`); subclasses only say how to find the root.
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
  r"""What a solver's ``run`` returns: the thresholds and the solver's final state.

  The return type of :meth:`ThresholdSolver.run`, :meth:`PAVSolver.run` and
  :meth:`DykstraSolver.run`, named as in jaxopt (Blondel et al. 2022, "Efficient and
  modular implicit differentiation", NeurIPS): ``params`` is the solution and
  ``state`` the solver's diagnostics. Pass ``params`` to the solver's ``primal`` to
  get the operator's output. ``run`` solves the row as given: where the threshold is
  not representable at the scale of the entries (a row whose entries are more than
  ``l / eps`` from it, e.g. ``(1e20, 1e20, 0, 1)`` at ``l = 1``), ``primal`` of it is the
  best the float threshold gives and ``state.residual`` says how far it is from ``k``;
  ``apply`` (and the operators) solve a shifted row and give the exact output there.

  Attributes:
    params: the thresholds :math:`\lambda`, one per row: shape ``x.shape[:-1]`` (the
      row shape of the problem's layout), dtype of ``x``. Differentiable w.r.t. the
      inputs of ``run``.
    state: a :class:`RootState` (iterations and residual per row).

  Example:
    >>> import jax.numpy as jnp
    >>> import implicit_topk as itk
    >>> step = itk.ThresholdSolver().run(None, jnp.array([3.0, 1.0, 2.0]), 1.0, 1.0)
    >>> step.params
    Array(2., dtype=float32)
    >>> params, state = step  # a NamedTuple
    >>> state.residual
    Array(0., dtype=float32)
  """

  params: jax.Array
  state: Any


class RootState(NamedTuple):
  r"""Diagnostics of a threshold solve, one entry per row.

  The ``state`` of the :class:`OptStep` a solver's ``run`` returns, and the second
  output of the operators called with ``return_info=True`` (e.g.
  :func:`~implicit_topk.soft_topk_mask`, :func:`~implicit_topk.soft_topk_mag`). Both
  fields are held constant under differentiation.

  Attributes:
    iter_num: int32, shape of the rows (``x.shape[:-1]`` for a last-axis operator):
      the passes over the data the solver made: Newton iterations for
      :class:`ThresholdSolver` (at most its ``maxiter``), sweeps for
      :class:`DykstraSolver`, 0 for the direct :class:`PAVSolver`.
    residual: float, same shape: :math:`|\phi(\lambda)| \ge 0` at the returned
      threshold; for the top-k mask :math:`|\sum_i y_i - k|`, so 0 up to rounding for
      the exact solvers and at most ``tol`` for a converged float64 Dykstra row (in
      float32 a row can stop on its sweep's change above ``tol``: see
      :class:`DykstraSolver`).

  Example:
    >>> import jax.numpy as jnp
    >>> import implicit_topk as itk
    >>> x = jnp.array([[3.0, 1.0, 2.0, -1.0], [0.0, 1.0, 2.0, 3.0]])
    >>> y, info = itk.soft_topk_mask(x, 2.0, regularization_strength=2.0, p=2.0,
    ...                              solver="threshold", return_info=True)
    >>> y
    Array([[1.  , 0.25, 0.75, 0.  ],
           [0.  , 0.25, 0.75, 1.  ]], dtype=float32)
    >>> info
    RootState(iter_num=Array([2, 1], dtype=int32), residual=Array([0., 0.], dtype=float32))
  """

  iter_num: jax.Array
  residual: jax.Array


@dataclasses.dataclass(frozen=True)
class ThresholdRootSolver:
  r"""Base class of the threshold solvers (:class:`ThresholdSolver`, :class:`PAVSolver`,
  :class:`DykstraSolver`).

  A frozen, hashable dataclass (so ``jax.jit`` caches can key on it) holding the
  problem; subclasses implement ``_solve(init, x, k, l) -> (lam, iter_num)``, and
  this class adds the implicit derivatives, the diagnostics and the output map.

  Attributes:
    regularizer: the separable regularizer of the top-k mask, an
      :class:`implicit_topk.Regularizer` (default ``None``: ``PNorm(4/3)``);
      shorthand for ``problem=CappedSimplex(regularizer)``. After construction it
      holds the problem's regularizer.
    problem: the threshold problem, a :class:`~implicit_topk.problems.CappedSimplex`
      (the top-k mask) or :class:`~implicit_topk.problems.Magnitude` (the top-k in
      magnitude) (default ``None``: the mask with ``regularizer``). Give this or
      ``regularizer``, not both (``ValueError``); a problem the solver cannot solve
      raises ``ValueError`` too.
    implicit_diff: ``True`` (default): differentiate ``lam`` by the implicit function
      theorem on the optimality function. ``False``: differentiate through the
      iterations (unrolled; :class:`ThresholdSolver` and :class:`DykstraSolver`
      only, others raise ``ValueError`` in ``run``).
    implicit_diff_backend: ``"lax"`` (default; forward and reverse mode) or
      ``"jaxopt"`` (reverse mode only, needs jaxopt).
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
  def primal(self, lam, x, l) -> Any:
    """The operator's output for thresholds ``lam``.

    Args:
      lam: thresholds, one per row of ``x`` (``run(...).params``).
      x: the scores the thresholds were solved on.
      l: regularization strength, broadcastable to the row shape, > 0.

    Returns:
      The output (the top-k mask for the default problem), shaped like ``x``.
    """
    return self.problem.primal(lam, x, l)

  @property
  def layout(self) -> Any:
    """The problem's reduction layout (:mod:`implicit_topk.problems.layout`)."""
    return getattr(self.problem, "layout", _layout.DEFAULT)

  def with_layout(self, layout: Any) -> "ThresholdRootSolver":
    """This solver on the same problem laid out by ``layout`` (e.g. a bound
    :class:`~implicit_topk.problems.Segments`)."""
    new = copy.copy(self)
    object.__setattr__(new, "problem", self.problem.with_layout(layout))
    new.problem.supports(self.name)
    return new

  def _per_row(self, x, k, l):
    layout = self.layout
    x = layout.asarray(x)
    dtype, rows = layout.dtype(x), layout.row_shape(x)
    _validation.check_strength(l, dtype, "l")  # a concrete l (a traced one: NaN rows)
    k = jnp.broadcast_to(jnp.asarray(k, dtype), rows)
    l = jnp.broadcast_to(jnp.asarray(l, dtype), rows)
    return x, k, l

  def optimality_fun(self, lam, x, k, l) -> jax.Array:
    r"""The optimality function :math:`\phi(\lambda; x, k, l)`, one entry per row.

    Continuous and nonincreasing in :math:`\lambda`, zero at the solution: for the
    top-k mask :math:`\sum_i y_i(\lambda) - k`. The implicit derivatives are taken
    on it. Arguments as in :meth:`run`.
    """
    return self.problem.optimality(lam, *self._per_row(x, k, l))

  # -- solving ----------------------------------------------------------------
  def _solve(self, init, x, k, l):
    raise NotImplementedError

  def _solve_unrolled(self, init, x, k, l):
    raise ValueError(
        f"{type(self).__name__} cannot be differentiated through its iterations; "
        "use implicit_diff=True.")

  def run(self, init_params, x, k, l) -> OptStep:
    """Solves for the thresholds, one per row.

    Args:
      init_params: initial thresholds, shape ``x.shape[:-1]``, or ``None`` (the
        problem's own starting guess). Only :class:`ThresholdSolver` uses it; the
        direct solvers ignore it.
      x: scores, float array ``(..., n)``; the problem is along the last axis (or
        along the rows of the problem's ``layout``: segments, a pytree).
      k: target sums, shape broadcastable to the row shape (``x.shape[:-1]``), in
        ``[0, n]`` (fractional values allowed).
      l: regularization strength (``regularization_strength`` in the operators),
        broadcastable to the row shape, > 0: a concrete ``l`` outside the compute
        dtype's range (``l`` and ``1 / l`` normal numbers) raises ``ValueError``, a
        traced one gives NaN thresholds (NaN rows from :meth:`apply`).

    Returns:
      ``OptStep(params=lam, state=RootState(iter_num, residual))``: ``lam`` has the
      row shape and the dtype of ``x``, and is differentiable w.r.t. ``x``, ``k``
      and ``l``.
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
    lam = jnp.where(_validation.strength_in_range(l), lam, jnp.nan)
    residual = jnp.abs(self.problem.optimality(
        jax.lax.stop_gradient(lam), *jax.lax.stop_gradient((x, k, l))))
    return OptStep(params=lam, state=RootState(iter_num=iter_num, residual=residual))

  def solve_and_map(self, x, k, l) -> tuple[Any, RootState]:
    """The operator's output and the diagnostics: ``primal(lam, x', l)`` with
    ``lam, state = run(None, x', k, l)`` on the normalized rows
    ``x' = problem.normalize(x, l)`` (``k`` and ``l`` with the row shape). Solvers
    whose kernels normalize and write the output themselves override it."""
    x = self.problem.normalize(x, l)
    step = self.run(None, x, k, l)
    return self.primal(step.params, x, l), step.state

  def apply(self, x, k, l, init_params=None) -> Any:
    """The operator along the last axis: ``primal(run(...).params, x, l)``.

    Solved on ``problem.normalize(x)`` (an equivalent, better-conditioned input), so
    ``init_params`` is relative to that input. Arguments as in :meth:`run`; returns
    the output shaped like ``x`` (the top-k mask for the default problem). Also
    available as ``mask``.
    """
    x, k_rows, l_rows = self._per_row(x, k, l)
    if init_params is None:  # the operators' own path (exact rescaling, fused kernels)
      return self.nan_where_strength_out_of_range(self.solve_and_map(x, k_rows, l_rows)[0],
                                                  l_rows)
    x = self.problem.normalize(x, l_rows)
    return self.primal(self.run(init_params, x, k, l).params, x, l_rows)

  def nan_where_strength_out_of_range(self, y, l_rows) -> Any:
    """``y`` (laid out as the problem's rows) with NaN rows where the per-row strength
    ``l_rows`` is outside the compute dtype's range (<= 0, NaN, subnormal once cast: a
    float64 1e-40 beside float32 rows): a traced ``l`` is not checked, and gives NaN
    rows, never a wrong output."""
    layout = self.layout
    return layout.map(lambda v, l_: jnp.where(_validation.strength_in_range(l_), v, jnp.nan),
                      y, layout.expand(l_rows, y))

  mask = apply  # the top-k mask, for the default problem


CappedSimplexSolver = ThresholdRootSolver  # the name of the first release
