r"""The public soft top-k operators (functional API over the solver objects)."""

from __future__ import annotations

from implicit_topk import _apply
from implicit_topk import problems
from implicit_topk import regularizers
from implicit_topk import solvers


def soft_topk_mask(
    x,
    k,
    *,
    l=0.1,
    p: float = 4.0 / 3.0,
    regularizer=None,
    axis: int = -1,
    solver: str = "auto",
    diff: str = "implicit",
    tol: float | None = None,
    maxiter: int | None = None,
    implicit_diff_backend: str = "lax",
    return_info: bool = False,
):
  r"""Sparse, differentiable top-k mask along ``axis``.

  .. math::

      y^\star(x) = \arg\max_{y \in [0,1]^n,\ \sum_i y_i = k}\ \langle x, y\rangle
                   - \frac{l}{p} \sum_i |y_i|^p
      \;=\; \min\Big(1, \big(\tfrac{(x_i - \lambda)_+}{l}\big)^{1/(p-1)}\Big)

  with the threshold :math:`\lambda` chosen so that :math:`\sum_i y_i = k`. Entries
  below the threshold are exactly 0, clearly-kept entries exactly 1. ``p = 2`` is the
  Euclidean projection of ``x / l`` onto the capped simplex (kinks); ``p = 4/3``
  (default) is continuously differentiable. As ``l -> 0`` the mask tends to
  :func:`hard_topk_mask`; as ``l -> inf`` to ``k / n``.

  Derivatives w.r.t. ``x``, ``k`` and ``l`` come from the implicit function theorem on
  :math:`\sum_i y_i(\lambda) - k = 0` (one division per row): forward and reverse
  mode with ``implicit_diff_backend="lax"``, reverse only with ``"jaxopt"``.

  Where the solution is binary (every :math:`y_i \in \{0, 1\}`, which needs an
  integer ``k`` and a gap wider than ``l`` between the k-th and (k+1)-th largest
  entries), ``y`` is locally constant in ``x`` and ``l`` (derivative 0, exact) but not
  differentiable in ``k``: raising ``k`` lifts the (k+1)-th largest entry, lowering it
  lowers the k-th. There the derivative w.r.t. ``k`` is returned as 0. To learn ``k``
  by gradient, keep it fractional or ``l`` large enough that some entry is fractional.

  Args:
    x: float array (float16/bfloat16 are computed in float32 and cast back).
    k: real number or array broadcastable to the batch shape (``x`` without
      ``axis``), with 0 <= k <= n. Need not be an integer. ``k = n`` gives a mask of
      ones and ``k = 0`` a mask of zeros (derivatives 0), the rule of every operator.
    l: regularization strength > 0, scalar or broadcastable to the batch shape.
    p: p-norm exponent, a static float > 1 (ignored if ``regularizer`` is given).
    regularizer: a regularizer object (see :mod:`implicit_topk.regularizers`).
    axis: the axis along which to select.
    solver: ``"auto"`` (default) = ``"threshold"``: pure JAX, sort-free Newton, exact;
      works under ``jax.export``, ``shard_map`` and on sharded inputs, any backend.
      ``"pav"``: numba PAV on the host, exact, faster on CPU for large batches (see
      ``benchmarks/results/cpu_matrix.md``), but a host callback: it cannot be
      exported with ``jax.export`` and pulls a sharded input to one device.
      ``"dykstra"``: pure JAX, ``p = 2`` only, approximate (stops at ``tol``).
    diff: ``"implicit"`` (default: implicit function theorem at the solver's output)
      or ``"unrolled"`` (autodiff through exactly ``maxiter`` iterations of
      ``"threshold"`` or ``"dykstra"``; memory grows with ``maxiter``).
    tol: Dykstra's tolerance (default 1e-6): it stops once
      :math:`|\sum_i y_i - k| \le` ``tol``, which bounds the L1 error of the mask.
    maxiter: iteration cap of ``"threshold"`` (default 100) or ``"dykstra"`` (default
      10000 sweeps; check ``return_info`` to see whether it was reached).
    implicit_diff_backend: ``"lax"`` or ``"jaxopt"``.
    return_info: also return the solver's :class:`RootState` (``iter_num``: passes
      or sweeps made, ``residual``: :math:`|\sum_i y_i - k|`), one entry per row of
      the batch shape (``x`` without ``axis``).

  Returns:
    An array with the shape and dtype of ``x``; with ``return_info``, the pair
    ``(mask, RootState)``.

  Limits of floating point: the mask is computed on ``x`` minus its row's largest
  finite entry (shift invariance), so ``|x| / l`` may be as large as the format
  allows. An entry that shares the fractional mass is resolved to the ulp of its
  distance from that maximum: when that distance exceeds ``l / eps`` (e.g. ``x =
  (1e308, -1e308)``, ``k = 1.5``, ``l = 1``) no float threshold gives ``sum y = k``;
  ``return_info`` then reports the residual ``|sum_i y_i - k|`` (> 0). Under ``jit``
  with traced ``k`` or ``l``, values are not checked: ``l <= 0`` or ``k`` outside
  ``[0, n]`` give NaN.

  Non-finite inputs: a row containing NaN gives a row of NaN. ``+inf`` entries get
  1 and ``-inf`` entries 0, the finite entries share the rest of ``k``; a row whose
  ``+inf`` count exceeds ``k``, or whose count of entries > ``-inf`` is below ``k``,
  has no threshold and gives NaN.

  Example:
    >>> import jax.numpy as jnp
    >>> soft_topk_mask(jnp.array([-5., -2., 3., 1.]), k=2, l=1e-2)
    Array([0., 0., 1., 1.], dtype=float32)
  """
  problem = problems.CappedSimplex(regularizers.resolve(regularizer, p))
  solver_obj = solvers.make_solver(
      solver, problem, implicit_diff_backend=implicit_diff_backend, diff=diff,
      tol=tol, maxiter=maxiter, size=_apply.input_size(x))
  return _apply.threshold_operator(solver_obj, x, k, l, axis=axis, return_info=return_info)
