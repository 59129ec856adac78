r"""Fused Pallas solver: the threshold of every row in one kernel, certified, with a fallback.

:mod:`implicit_topk.kernels.gpu.pallas_threshold` runs the safeguarded Newton/bisection of
:class:`~implicit_topk.solvers.ThresholdSolver` inside one Pallas program per block of
rows, up to a cap of passes, and certifies each row by that iteration's own stopping
rules. Rows it does not certify are solved again by the pure-JAX Newton iteration,
warm-started from the kernel's last iterate, so no row is returned approximate
(``proofs/pallas_certificate.md``). Derivatives come from the implicit function
theorem, as for every solver here: one O(n) pass in plain XLA.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from implicit_topk import _validation
from implicit_topk.kernels.gpu import pallas_threshold
from implicit_topk.solvers.base import ThresholdRootSolver
from implicit_topk.solvers.threshold import ThresholdSolver


@dataclasses.dataclass(frozen=True)
class PallasSolver(ThresholdRootSolver):
  r"""Threshold solver fused into one Pallas kernel (Triton on GPU), exact by certificate.

  For the top-k mask of Sander et al. 2023 ("Fast, differentiable and sparse top-k: a
  convex analysis perspective", ICML)

  .. math::

      y^\star = \arg\max_{y \in [0,1]^n,\ \sum_i y_i = k}\
                 \langle x, y\rangle - l\,\Omega(y), \qquad
      y_i = \mathrm{mask}\big((x_i - \lambda) / l\big),

  and for the top-k in magnitude, the threshold :math:`\lambda` of each row is the
  root of a continuous, nonincreasing :math:`\phi(\lambda)` (for the mask
  :math:`\sum_i y_i(\lambda) - k`). One Pallas program per block of rows keeps the
  rows on chip and runs the safeguarded Newton/bisection iteration of
  :class:`ThresholdSolver` from the problem's sort-free bracket and starting guess, at
  most ``maxiter`` passes, reading each row from memory once. A row is *certified*
  when the iteration stopped by its own rules: :math:`\phi = 0`, a bracket collapsed
  to a few ulps of :math:`\lambda`, or a Newton step of a few ulps with
  :math:`|\phi|` at rounding level. Then :math:`\lambda` is the threshold to
  floating-point precision. Rows that are not certified within ``maxiter`` passes are
  solved by :class:`ThresholdSolver` (pure JAX, up to ``fallback_maxiter`` passes),
  warm-started from the kernel's last iterate; that branch runs only when some row
  needs it (``lax.cond``; under ``jax.vmap`` both branches run). The derivatives come
  from the implicit function theorem (Blondel et al. 2022, "Efficient and modular
  implicit differentiation", NeurIPS): one O(n) pass in plain XLA.

  Lowering: on CUDA and ROCm through Pallas' Triton backend (jax 0.10 and 0.11; jax
  0.11 warns that this backend is deprecated); on any other backend (CPU, TPU) the
  same kernel runs in Pallas interpret mode, as ordinary XLA operations: correct and
  slow, meant for tests. Rows longer than
  :data:`~implicit_topk.kernels.gpu.pallas_threshold.MAX_ROW_LENGTH` (4096) entries are
  solved by :class:`ThresholdSolver` alone. Accumulates in float32 for float32,
  bfloat16 and float16 input, float64 for float64.

  Attributes:
    maxiter: cap on the kernel's passes per row, an int >= 1 (default 48; rows of
      normal scores need 5 to 25 in float32).
    fallback_maxiter: cap on the passes of the fallback :class:`ThresholdSolver`, an
      int >= 1 (default 100).
    interpret: ``None`` (default): the Triton kernel where lowered for CUDA or ROCm,
      interpret mode elsewhere; ``True`` forces interpret mode, ``False`` the compiled
      kernel (which fails to lower on CPU).
    num_warps: Triton warps per program (default ``None``: Triton's default).
    regularizer, problem, implicit_diff, implicit_diff_backend: as in
      :class:`ThresholdRootSolver`. The problem must be a
      :class:`~implicit_topk.problems.CappedSimplex` (any regularizer whose ``mask``
      is ``jax.numpy`` code) or :class:`~implicit_topk.problems.Magnitude` on whole
      rows of the last axis (not segments, pytrees or an axis split over devices:
      ``ValueError``); ``implicit_diff`` must stay ``True``.

  ``run(init_params, x, k, l)`` returns ``OptStep(params=lam, state=RootState(...))``.
  ``state.iter_num`` is the kernel's passes for a certified row, and ``maxiter`` plus
  the fallback's passes for a row the fallback solved (or a row too long for the
  kernel): ``iter_num > maxiter`` says the row left the kernel.

  Example:
    >>> import jax.numpy as jnp
    >>> import implicit_topk as itk
    >>> from implicit_topk.solvers.pallas import PallasSolver
    >>> x = jnp.array([3.0, 1.0, 2.0, -1.0])
    >>> solver = PallasSolver(regularizer=itk.PNorm(2.0))  # interpret mode on CPU
    >>> solver.apply(x, 2.0, 2.0)  # k = 2, regularization strength 2
    Array([1.  , 0.25, 0.75, 0.  ], dtype=float32)
  """

  maxiter: int = 48
  fallback_maxiter: int = 100
  interpret: bool | None = None
  num_warps: int | None = None
  name = "pallas"

  def __post_init__(self):
    super().__post_init__()
    _validation.check_maxiter(self.maxiter)
    _validation.check_maxiter(self.fallback_maxiter)
    pallas_threshold.check_available()

  def _fallback(self) -> ThresholdSolver:
    return ThresholdSolver(problem=self.problem, maxiter=self.fallback_maxiter)

  def _solve(self, init, x, k, l):
    dtype, batch, n = x.dtype, x.shape[:-1], x.shape[-1]
    acc = pallas_threshold.accumulation_dtype(dtype)
    xa, ka, la = x.astype(acc), k.astype(acc), l.astype(acc)
    init_a = None if init is None else init.astype(acc)
    fallback = self._fallback()
    if not pallas_threshold.fits(n) or x.size == 0:
      lam, iter_num = fallback._solve(init_a, xa, ka, la)  # pylint: disable=protected-access
      return lam.astype(dtype), iter_num + self.maxiter
    flat = lambda v: None if v is None else v.reshape(-1)
    lam, iter_num, certified = pallas_threshold.threshold_rows(
        self.problem, x.reshape(-1, n), flat(ka), flat(la), flat(init_a),
        maxiter=self.maxiter, interpret=self.interpret, num_warps=self.num_warps)
    lam, iter_num, certified = (v.reshape(batch) for v in (lam, iter_num, certified))

    def solve_again(start):
      again, passes = fallback._solve(start, xa, ka, la)  # pylint: disable=protected-access
      return again, passes

    def keep(start):
      return start, jnp.zeros_like(iter_num)

    # The kernel's last iterate lies in the bracket (finite); the fallback clips it there.
    again, passes = jax.lax.cond(jnp.any(~certified), solve_again, keep, lam)
    lam = jnp.where(certified, lam, again)
    iter_num = jnp.where(certified, iter_num, self.maxiter + passes)
    return lam.astype(dtype), iter_num
