"""Exact PAV solver: a compiled numba kernel per row, called as an XLA FFI custom call.

The problem's kernel (:mod:`implicit_topk.kernels.cpu.pav_ffi`) sorts each row (radix
sort), runs Pool-Adjacent-Violators on the isotonic dual (``proofs/isotonic_dual.md``)
and returns the threshold ``lam``. Cost per row: one sort plus O(n) for p = 2 and
p = 4/3 (closed-form block values); other p solve each block value by safeguarded
Newton, O(n * block size) in the worst case.

The kernel is a custom call, not a host callback: it exports with ``jax.export``
(``disabled_checks=implicit_topk.export_safety_checks()``) and runs on each shard of
a batch-sharded input. It runs on CPU only; on GPU/TPU use the ``"threshold"`` solver.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from implicit_topk import regularizers
from implicit_topk.solvers import float_range
from implicit_topk.solvers.base import ThresholdRootSolver

kernel_spec = regularizers.pav_kernel_spec  # used by the permutahedron operators


@dataclasses.dataclass(frozen=True)
class PAVSolver(ThresholdRootSolver):
  r"""Exact threshold solver: Pool-Adjacent-Violators on the isotonic dual (numba, CPU).

  The top-k mask (Sander et al. 2023, "Fast, differentiable and sparse top-k: a
  convex analysis perspective", ICML),

  .. math::

      y^\star = \arg\max_{y \in [0,1]^n,\ \sum_i y_i = k}\
                 \langle x, y\rangle - l\,\Omega(y), \qquad
      y_i = \mathrm{mask}\big((x_i - \lambda) / l\big),

  has a dual that is an isotonic regression of the sorted scores. Its solution is
  found exactly in one pass by Pool-Adjacent-Violators after one sort per row, as for
  the soft sort and rank (Blondel et al. 2020, "Fast differentiable sorting and
  ranking", ICML); the threshold :math:`\lambda` is read off the pooled block that
  straddles ``k``. Cost per row: one sort plus O(n) for ``p = 2`` and ``p = 4/3``;
  other ``p`` solve each block value by a safeguarded Newton iteration. The kernel is
  an XLA custom call on CPU, not a host callback (no Python round trip): it exports
  with ``jax.export`` (``disabled_checks=implicit_topk.export_safety_checks()``) and
  a batch-sharded input stays sharded, each device solving its own rows. The
  derivatives come from
  the implicit function theorem on :math:`\sum_i y_i(\lambda) - k = 0` (Blondel et
  al. 2022, "Efficient and modular implicit differentiation", NeurIPS); the
  interface follows jaxopt.

  Attributes:
    regularizer: the regularizer of the top-k mask (default ``None``:
      ``PNorm(4/3)``); one with a PAV kernel (the p-norms and the built-in
      regularizers), else ``ValueError``.
    problem: the threshold problem (default ``None``: the mask with
      ``regularizer``); :class:`~implicit_topk.problems.CappedSimplex` or
      :class:`~implicit_topk.problems.Magnitude` on whole rows of the last axis
      (not segments, pytrees or an axis split over devices). Give this or
      ``regularizer``, not both.
    implicit_diff: must stay ``True`` (default): a direct method has no iterations
      to differentiate through.
    implicit_diff_backend: ``"lax"`` (default; forward and reverse mode) or
      ``"jaxopt"`` (reverse mode only).

  ``run(init_params, x, k, l)`` ignores ``init_params`` and returns
  ``OptStep(params=lam, state=RootState(iter_num=0, residual))``.

  Example:
    >>> import jax.numpy as jnp
    >>> import implicit_topk as itk
    >>> x = jnp.array([3.0, 1.0, 2.0, -1.0])
    >>> solver = itk.PAVSolver(regularizer=itk.PNorm(2.0))
    >>> step = solver.run(None, x, 2.0, 2.0)  # k = 2, regularization strength 2
    >>> step
    OptStep(params=Array(0.5, dtype=float32), state=RootState(iter_num=Array(0, dtype=int32), residual=Array(0., dtype=float32)))
    >>> solver.apply(x, 2.0, 2.0)
    Array([1.  , 0.25, 0.75, 0.  ], dtype=float32)
  """

  name = "pav"

  def solve_and_map(self, x, k, l):
    """The output on exactly rescaled rows, with binary rows that the shift by the row
    maximum hides decided exactly (:func:`implicit_topk.solvers.float_range.solve_and_map`:
    rows near the float maximum or minimum)."""
    return float_range.solve_and_map(self, x, k, l)

  def _solve(self, init, x, k, l):
    del init  # PAV is a direct method.
    lam = self.problem.pav_threshold(x, k, l)
    # Rows answered by the bracket (non-finite entries, k = 0 or n, the limits of
    # regularizers that never saturate) take its value, as in the other solvers.
    bracket = self.problem.bracket(x, k, l)
    lam = jnp.where(bracket.known, bracket.value, lam)
    # As the Newton solver: a binary solution whose flat root interval is a single point
    # (a gap of exactly l) gets that point, so the mask is exactly 0/1 (p near 1 turns
    # an ulp of lam into several ulps of y).
    lam = self.problem.snap(lam, x, k, l, bracket.known)
    return lam, jnp.zeros_like(x[..., 0], jnp.int32)
