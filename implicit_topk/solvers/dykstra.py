r"""The top-k threshold by Dykstra's algorithm on the isotonic dual (pure JAX).

:class:`DykstraSolver` solves the capped-simplex top-k with ``p = 2`` this way:
with :math:`s` = ``x`` sorted descending and :math:`w = (1, \dots, 1, k - \lfloor k
\rfloor, 0, \dots)`, the mask is :math:`y = \mathrm{clip}((x - \lambda)/l, 0, 1)` where
:math:`\lambda / l` is the value of the isotonic regression of :math:`s/l - w` on the
block that straddles ``k`` (``proofs/isotonic_dual.md``). Its derivatives come from the
same optimality condition :math:`\sum_i y_i - k = 0` as every other solver (implicit),
or from autodiff through a fixed number of sweeps (``implicit_diff=False``, unrolled).

The isotonic regression itself is :mod:`implicit_topk.kernels.isotonic_dykstra`.
"""

from __future__ import annotations

import dataclasses

from implicit_topk import _validation
from implicit_topk.kernels.isotonic_dykstra import (  # noqa: F401  (public names)
    DykstraResult, isotonic_dykstra, isotonic_dykstra_unrolled)
from implicit_topk.solvers.base import ThresholdRootSolver


# -- the solver: each problem reads its threshold off its own isotonic dual --------


@dataclasses.dataclass(frozen=True)
class DykstraSolver(ThresholdRootSolver):
  r"""Approximate threshold solver for ``p = 2``: Dykstra's algorithm on the isotonic dual.

  For the Euclidean top-k mask (Sander et al. 2023, "Fast, differentiable and sparse
  top-k: a convex analysis perspective", ICML),
  :math:`y = \mathrm{clip}((x - \lambda) / l, 0, 1)` with :math:`\sum_i y_i = k`,
  :math:`\lambda / l` is a value of the isotonic regression of
  :math:`s / l - w` (:math:`s` the sorted scores, :math:`w` the capped-simplex
  weights), the dual that PAV solves exactly (Blondel et al. 2020, "Fast
  differentiable sorting and ranking", ICML). Here it is solved by Dykstra's
  alternating projections onto the even and odd pair constraints (Boyle and Dykstra
  1986, "A method for finding projections onto the intersection of convex sets in
  Hilbert spaces"): one sort per row, then sweeps of O(n) fully parallel pure-JAX
  work, the accelerator-friendly counterpart of PAV. Convergence is linear, slower
  on long pooled blocks, so it stops at a tolerance.

  For the mask a row stops once :math:`|\sum_i y_i(\lambda) - k| \le` ``tol``,
  which certifies :math:`\|y - y^\star\|_1 \le` ``tol``, or after ``maxiter``
  sweeps (a tolerance on the change between sweeps, the usual rule, certifies
  nothing). With ``tol > 0``, every 32 sweeps the blocks that Dykstra's positive
  multipliers mark are pooled exactly and tested (KKT: ordered block means,
  nonnegative prefix multipliers; de Leeuw, Hornik and Mair 2009,
  ``proofs/dykstra_snap.md``); a row whose blocks pass stops with the exact solution
  (to rounding): Dykstra finds the blocks in about as many sweeps as the longest
  block is long, its values need about its square (1 x 1000, k = 10, float32: ~200
  sweeps instead of 10000, where float32 rounding kept the residual above 1e-6).
  ``RootState.residual`` is the exact L1 error either way. The derivatives come from the implicit function theorem on
  :math:`\sum_i y_i - k = 0` (Blondel et al. 2022, "Efficient and modular implicit
  differentiation", NeurIPS), or with ``implicit_diff=False`` from autodiff through
  exactly ``maxiter`` sweeps (unrolled). The interface follows jaxopt.

  Attributes:
    tol: the stopping tolerance, a float >= 0 (default ``1e-6``); 0 runs
      ``maxiter`` sweeps.
    maxiter: maximum number of sweeps, an int >= 1 (default 10000).
    regularizer: must be ``PNorm(2.0)`` (``p = 2``), else ``ValueError``; the
      default ``None`` means ``PNorm(4/3)`` and is refused, so pass it (or
      ``problem``). See :class:`ThresholdRootSolver` for the inherited fields
      ``problem`` (a ``p = 2`` :class:`~implicit_topk.problems.CappedSimplex` or
      :class:`~implicit_topk.problems.Magnitude` on whole rows of the last axis),
      ``implicit_diff`` (default ``True``) and ``implicit_diff_backend`` (default
      ``"lax"``).

  ``run(init_params, x, k, l)`` ignores ``init_params`` and returns
  ``OptStep(params=lam, state=RootState(iter_num, residual))`` with the sweeps made
  and the final residual per row.

  Example:
    >>> import jax.numpy as jnp
    >>> import implicit_topk as itk
    >>> x = jnp.array([3.0, 1.0, 2.0, -1.0])
    >>> solver = itk.DykstraSolver(regularizer=itk.PNorm(2.0), tol=1e-6)
    >>> step = solver.run(None, x, 2.0, 2.0)  # k = 2, regularization strength 2
    >>> step
    OptStep(params=Array(0.5, dtype=float32), state=RootState(iter_num=Array(1, dtype=int32), residual=Array(0., dtype=float32)))
    >>> solver.primal(step.params, x, 2.0)
    Array([1.  , 0.25, 0.75, 0.  ], dtype=float32)
  """

  tol: float = 1e-6
  maxiter: int = 10000
  name = "dykstra"

  def __post_init__(self):
    super().__post_init__()
    _validation.check_maxiter(self.maxiter)
    _validation.check_tol(self.tol)

  def _solve(self, init, x, k, l):
    del init  # Dykstra starts from the dual target itself.
    return self.problem.dykstra_threshold(x, k, l, tol=self.tol, maxiter=self.maxiter,
                                          unrolled=False)

  def _solve_unrolled(self, init, x, k, l):
    del init
    return self.problem.dykstra_threshold(x, k, l, tol=self.tol, maxiter=self.maxiter,
                                          unrolled=True)
