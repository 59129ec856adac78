r"""Fused Pallas solver: the threshold and the output of every row in one kernel.

:mod:`implicit_topk.kernels.gpu.pallas_threshold` runs a bounded safeguarded
Newton/bisection iteration (:mod:`implicit_topk.kernels.gpu.bounded_newton`) inside one
Pallas program per block of rows and writes the operator's output itself. Every row
stops by a certified rule within a proven number of passes
(``proofs/pallas_bounded_iteration.md``, Proposition 17), so there is no fallback, no
``lax.cond`` and no XLA-level ``while_loop`` around the kernel: on a GPU nothing waits
for the host. The derivatives come from the implicit function theorem, one Pallas kernel
each way (:mod:`implicit_topk.kernels.gpu.pallas_derivatives`: the tangent kernel in
forward mode, its transpose in reverse mode), recomputed from ``x`` and the thresholds.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from implicit_topk.kernels.gpu import bounded_newton, pallas_derivatives, pallas_threshold
from implicit_topk.solvers.base import RootState, ThresholdRootSolver
from implicit_topk.solvers.threshold import ThresholdSolver


#: The derivative map of the operator (kept here, its documented home before the kernels).
implicit_tangent = pallas_derivatives.implicit_tangent


def _fused_operator(solver):
  """``(x, k, l) -> (y, lam, origin, passes, residual, scale, binary)`` on ``(batch, n)``
  rows by one kernel call (:func:`~implicit_topk.kernels.gpu.pallas_threshold.fused_rows`),
  with the derivatives of :func:`implicit_tangent` on the rescaled rows (zero on the
  binary rows the kernel decided exactly) by the derivative kernels
  (:func:`~implicit_topk.kernels.gpu.pallas_derivatives.implicit_derivative`): forward
  mode runs the tangent kernel, reverse mode its transpose, one ``pallas_call`` that
  reads ``x``, the per-row values and the cotangent and writes ``x``'s cotangent (no
  ``(batch, n)`` residual written by the forward)."""
  problem = solver.problem
  kernel = functools.partial(
      pallas_threshold.fused_rows, problem, free_passes=solver.free_passes,
      interpret=solver.interpret, num_warps=solver.num_warps,
      block_elements=solver.block_elements)
  derivative = functools.partial(
      pallas_derivatives.implicit_derivative, problem, interpret=solver.interpret,
      num_warps=solver.num_warps, block_elements=solver.block_elements)

  @jax.custom_jvp
  def operator(x, k, l):
    y, lam, origin, passes, _, residual, scale, binary = kernel(x, k, l)
    return y, lam, origin, passes.astype(lam.dtype), residual, scale, binary.astype(lam.dtype)

  @operator.defjvp
  def operator_jvp(primals, tangents):
    x, k, l = primals
    outs = operator(x, k, l)
    _, lam, origin, _, _, scale, binary = outs
    y_dot, lam_dot = derivative((x, lam, origin, scale, binary, k, l), tuple(tangents))
    zeros = [jnp.zeros_like(out) for out in outs[2:]]
    return outs, (y_dot, lam_dot, *zeros)

  return operator


@dataclasses.dataclass(frozen=True)
class PallasSolver(ThresholdRootSolver):
  r"""Threshold solver fused into one Pallas kernel (Triton on GPU), exact by construction.

  For the top-k mask of Sander et al. 2023 ("Fast, differentiable and sparse top-k: a
  convex analysis perspective", ICML)

  .. math::

      y^\star = \arg\max_{y \in [0,1]^n,\ \sum_i y_i = k}\
                 \langle x, y\rangle - l\,\Omega(y), \qquad
      y_i = \mathrm{mask}\big((x_i - \lambda) / l\big),

  and for the top-k in magnitude, the threshold :math:`\lambda` of each row is the
  root of a continuous, nonincreasing :math:`\phi(\lambda)` (for the mask
  :math:`\sum_i y_i(\lambda) - k`). One Pallas program per block of rows reads the
  rows once, keeps them on chip, runs the safeguarded Newton/bisection iteration of
  :class:`ThresholdSolver` from the problem's sort-free bracket and starting guess for
  ``free_passes`` passes, then alternates it with bisections of the bracket's ordered
  bit patterns, and writes the output. Every row stops by a certified rule
  (:math:`\phi = 0`, a bracket of a few ulps or with no float inside, or a Newton step
  of a few ulps with :math:`|\phi|` at rounding level) within ``free_passes + 64``
  passes in float32 (``+ 128`` in float64): Proposition 17,
  ``proofs/pallas_bounded_iteration.md``. No row leaves the kernel, so there is no
  fallback and nothing at the XLA level depends on the data (on XLA:GPU a ``cond`` or
  ``while_loop`` copies its predicate to the host). The derivatives come from the
  implicit function theorem (Blondel et al. 2022, "Efficient and modular implicit
  differentiation", NeurIPS): for the mask, with :math:`d_i = \mathrm{mask}'(z_i)/l`,
  the gradient of :math:`\langle v, y\rangle` is
  :math:`d \odot (v - \sum_i d_i v_i / \sum_i d_i)` (:func:`implicit_tangent`), one
  ``pallas_call`` over the same blocks of rows in reverse mode (the cotangent kernel) and
  one in forward mode (the tangent kernel), whose bodies are the problem's own code
  differentiated by ``jax.jvp`` and ``jax.vjp``
  (:mod:`~implicit_topk.kernels.gpu.pallas_derivatives`; rows longer than 4096 entries:
  the same map as XLA operations).

  Lowering: on CUDA and ROCm through Pallas' Triton backend (jax 0.10 and 0.11; jax
  0.11 warns that this backend is deprecated; its custom call must be named in
  ``jax.export``'s ``disabled_checks``, which
  :func:`implicit_topk.export_safety_checks` does); on any other backend (CPU, TPU)
  the same kernel runs in Pallas interpret mode, as ordinary XLA operations: correct
  and slow, meant for tests. Rows of at most
  :data:`~implicit_topk.kernels.gpu.pallas_threshold.MAX_ROW_LENGTH` (4096) entries are
  held in registers, a block of rows per program; rows of up to 65536 entries get one
  program each and are read in chunks of 2048 on every pass
  (:mod:`~implicit_topk.kernels.gpu.pallas_long_rows`); longer rows, and symbolic
  shapes, are solved by :class:`ThresholdSolver` (its ``while_loop`` at the XLA level).
  Accumulates in float32 for float32, bfloat16 and float16 input, float64 for float64.
  The kernel first multiplies each row of the mask and its strength by an exact power of
  two (rows near the float maximum or minimum), and writes the exact 0/1 mask, with zero
  derivatives, for p-norm rows that are binary in exact arithmetic although the shift by
  the row maximum rounded the entries around the threshold
  (:mod:`implicit_topk.solvers.float_range`, ``proofs/float_range.md``).

  Attributes:
    free_passes: unconstrained Newton passes before the ordered bisections start, an
      int >= 0 (default 16; rows of normal scores stop after 2 to 6 on average).
    interpret: ``None`` (default): the Triton kernel where lowered for CUDA or ROCm,
      interpret mode elsewhere; ``True`` forces interpret mode, ``False`` the compiled
      kernel (which fails to lower on CPU).
    num_warps: Triton warps per program, a power of two (default 4, the best measured
      on an H100; ``None``: Triton's default).
    block_elements: target entries per program on a GPU, a power of two (default
      ``None``: 1024, the best measured on an H100).
    regularizer, problem, implicit_diff, implicit_diff_backend: as in
      :class:`ThresholdRootSolver`. The problem must be a
      :class:`~implicit_topk.problems.CappedSimplex` (any regularizer whose ``mask``
      is ``jax.numpy`` code) or :class:`~implicit_topk.problems.Magnitude` on whole
      rows of the last axis (not segments, pytrees or an axis split over devices:
      ``ValueError``); ``implicit_diff`` must stay ``True``.

  ``run(init_params, x, k, l)`` returns ``OptStep(params=lam, state=RootState(...))``;
  ``state.iter_num`` is the kernel's passes (0 for rows answered by the bracket).

  Example:
    >>> import jax.numpy as jnp
    >>> import implicit_topk as itk
    >>> from implicit_topk.solvers.pallas import PallasSolver
    >>> x = jnp.array([3.0, 1.0, 2.0, -1.0])
    >>> solver = PallasSolver(regularizer=itk.PNorm(2.0))  # interpret mode on CPU
    >>> solver.apply(x, 2.0, 2.0)  # k = 2, regularization strength 2
    Array([1.  , 0.25, 0.75, 0.  ], dtype=float32)
  """

  free_passes: int = bounded_newton.FREE_PASSES
  interpret: bool | None = None
  num_warps: int | None = pallas_threshold.DEFAULT_NUM_WARPS
  block_elements: int | None = None
  name = "pallas"

  def __post_init__(self):
    super().__post_init__()
    if (isinstance(self.free_passes, bool) or not isinstance(self.free_passes, int)
        or self.free_passes < 0):
      raise ValueError(f"`free_passes` must be an int >= 0; got {self.free_passes!r}.")
    for field in ("num_warps", "block_elements"):
      value = getattr(self, field)
      if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                or value < 1 or value & (value - 1)):
        raise ValueError(f"`{field}` must be None or a power of two >= 1; got {value!r}.")
    if self.interpret not in (None, True, False):
      raise ValueError(f"`interpret` must be None, True or False; got {self.interpret!r}.")
    pallas_threshold.check_available()

  def _fits(self, x) -> bool:
    """Rows the kernel takes: concrete shapes (the block size is static), no empty
    batch, rows of at most ``MAX_ROW_LENGTH`` entries. Decided by the shape only."""
    concrete = all(isinstance(d, int) for d in x.shape)
    return concrete and pallas_threshold.fits(x.shape[-1]) and x.size > 0

  def _solve(self, init, x, k, l):
    dtype, batch, n = x.dtype, x.shape[:-1], x.shape[-1]
    acc = pallas_threshold.accumulation_dtype(dtype)
    xa, ka, la = x.astype(acc), k.astype(acc), l.astype(acc)
    init_a = None if init is None else init.astype(acc)
    if not self._fits(x):  # decided by the shape, never by the data (symbolic: threshold)
      lam, iter_num = ThresholdSolver(problem=self.problem)._solve(init_a, xa, ka, la)  # pylint: disable=protected-access
      return lam.astype(dtype), iter_num
    flat = lambda v: None if v is None else v.reshape(-1)
    lam, iter_num, _ = pallas_threshold.threshold_rows(
        self.problem, x.reshape(-1, n), flat(ka), flat(la), flat(init_a),
        free_passes=self.free_passes, interpret=self.interpret, num_warps=self.num_warps)
    return lam.reshape(batch).astype(dtype), iter_num.reshape(batch)

  def solve_and_map(self, x, k, l):
    """The output and the diagnostics from one kernel call, which also normalizes the
    rows (as ``problem.normalize``) and writes the output; derivatives by
    :func:`implicit_tangent`. Rows too long for the kernel, ``implicit_diff=False``
    and ``implicit_diff_backend="jaxopt"`` take the base class's path."""
    if not self.implicit_diff or self.implicit_diff_backend != "lax" or not self._fits(x):
      return super().solve_and_map(x, k, l)
    x, k, l = self._per_row(x, k, l)
    dtype, batch, n = x.dtype, x.shape[:-1], x.shape[-1]
    acc = pallas_threshold.accumulation_dtype(dtype)
    y, _, _, passes, residual, _, _ = _fused_operator(self)(
        x.reshape(-1, n).astype(acc), k.reshape(-1).astype(acc), l.reshape(-1).astype(acc))
    state = RootState(
        iter_num=jax.lax.stop_gradient(passes).astype(jnp.int32).reshape(batch),
        residual=jax.lax.stop_gradient(residual).astype(dtype).reshape(batch))
    return y.reshape(x.shape).astype(dtype), state
