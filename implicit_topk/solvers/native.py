r"""Exact threshold solver on CPU: a compiled per-row kernel called through the XLA FFI.

The kernel (:mod:`implicit_topk.kernels.cpu.native_threshold`) finds each row's threshold
without a sort: the :math:`\lceil k\rceil + 1` largest entries by selection, then the
safeguarded Newton iteration on the few entries that can be nonzero at the root; the
top-k in magnitude has its own kernel, :mod:`implicit_topk.kernels.cpu.native_magnitude`
(the same iteration on its own equation). It is
a typed XLA custom call (:mod:`implicit_topk.kernels.cpu.ffi`): no host callback, so it
exports with ``jax.export`` (``disabled_checks=implicit_topk.export_safety_checks()``)
and runs on each shard of a batch-sharded input. The derivatives come from the
implicit function theorem on :math:`\phi(\lambda) = 0` as for every solver here.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from implicit_topk.kernels.cpu.native_calls import (capped_simplex_kernel, derivative_call,
                                                    derivative_rule, kernel_attributes)
from implicit_topk.solvers import float_range, mask_tangent
from implicit_topk.solvers.base import RootState, ThresholdRootSolver

_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def _mask_operator(attributes):
  """``(x, k, l) -> (mask, lam, passes, residual, shift)`` by the kernel, with the
  derivatives of the implicit function theorem by the derivative kernels
  (:mod:`implicit_topk.kernels.cpu.native_derivatives`): forward mode calls the tangent
  kernel, reverse mode its transpose, the cotangent kernel; higher orders
  differentiate :func:`implicit_topk.solvers.mask_tangent.tangent`, the same map in
  JAX."""
  kind, a = int(attributes["kind"]), float(attributes["a"])
  reference = functools.partial(mask_tangent.tangent, kind, a)
  rule = derivative_rule(kind, a)

  @jax.custom_jvp
  def operator(x, k, l):
    y, lam, passes, residual, shift = capped_simplex_kernel(x, k, l, attributes)
    return y, lam, passes.astype(x.dtype), residual, shift

  @operator.defjvp
  def operator_jvp(primals, tangents):
    x, k, l = primals
    outs = operator(x, k, l)
    _, lam, _, _, shift = outs
    y_dot, lam_dot = derivative_call("capped_simplex", rule, (x, lam, shift, l), tangents,
                                     reference, 2, attributes)
    zeros = [jnp.zeros_like(out) for out in outs[2:]]
    return outs, (y_dot, lam_dot, *zeros)

  return operator


@dataclasses.dataclass(frozen=True)
class NativeSolver(ThresholdRootSolver):
  r"""Exact threshold solver: a compiled CPU kernel per row, called through the XLA FFI.

  The top-k mask (Sander et al. 2023, "Fast, differentiable and sparse top-k: a
  convex analysis perspective", ICML)

  .. math::

      y^\star = \arg\max_{y \in [0,1]^n,\ \sum_i y_i = k}\
                 \langle x, y\rangle - l\,\Omega(y), \qquad
      y_i = \mathrm{mask}\big((x_i - \lambda) / l\big),

  with the threshold :math:`\lambda` found by a numba kernel without a sort: for the
  p-norms only the entries above :math:`x_{(\lceil k\rceil)} - l` can be nonzero, so
  a selection pass finds them and Newton runs on those alone; the dense regularizers
  (entropy, sigmoid, Laplace) iterate over the whole row. Exact to floating-point
  precision, on CPU, for every built-in regularizer on whole rows of the last axis.
  The top-k in magnitude (:class:`~implicit_topk.problems.Magnitude`, every ``p``)
  has its own kernel (:mod:`implicit_topk.kernels.cpu.native_magnitude`): only the
  magnitudes above :math:`h^{-1}(|x|_{(\lceil k\rceil)})`, :math:`h(y) = y + l
  y^{p-1}`, can be nonzero, and the same Newton iteration runs on those; its output
  map and derivatives are the problem's JAX code.
  The kernel is an XLA custom call, not a host callback: it exports with
  ``jax.export`` and runs per shard of a batch-sharded input; under ``jit`` with the
  reduced axis split over devices each device runs the threshold iteration on its block
  with ``psum`` over the split (:mod:`implicit_topk.kernels.cpu.partitioning`), so the
  axis is never gathered. Derivatives come from
  the implicit function theorem (Blondel et al. 2022, "Efficient and modular implicit
  differentiation", NeurIPS). ``iter_num`` reports the kernel's Newton passes (0 for
  rows answered in closed form).

  Example:
    >>> import jax.numpy as jnp
    >>> import implicit_topk as itk
    >>> from implicit_topk.solvers import NativeSolver
    >>> solver = NativeSolver(regularizer=itk.PNorm(2.0))
    >>> solver.apply(jnp.array([3.0, 1.0, 2.0, -1.0]), 2.0, 2.0)
    Array([1.  , 0.25, 0.75, 0.  ], dtype=float32)
  """

  name = "native"

  def _check_dtype(self, x):
    if np.dtype(x.dtype) not in _DTYPES:
      raise TypeError(f"solver='native' computes in float32 or float64; got {x.dtype}.")

  def _solve(self, init, x, k, l):
    del init  # a direct method
    self._check_dtype(x)
    native_threshold = getattr(self.problem, "native_threshold", None)
    if native_threshold is not None:  # a problem with its own kernel (Magnitude)
      return native_threshold(x, k, l)
    _, lam, passes, _, shift = capped_simplex_kernel(
        x, k, l, kernel_attributes(self.problem.regularizer))
    threshold = lam + shift
    if np.dtype(x.dtype) == np.float64:
      # Rows at the ends of the float range were solved scaled by 2^-E: back to x's
      # coordinates (E = 0, a no-op, for every other row).
      threshold = float_range.unscale(
          threshold, float_range.scale_exponent(self.layout, x, l))
    return threshold, passes

  def solve_and_map(self, x, k, l):
    """The mask and the thresholds from one kernel call, which also normalizes the rows
    (as ``problem.normalize``); derivatives by the implicit function theorem in the
    derivative kernels (:func:`_mask_operator`). Problems with their own threshold
    kernel (the top-k in magnitude) take the base class's path: the kernel's threshold,
    the problem's output map, derivatives by ``jax.lax.custom_root``."""
    if not self.implicit_diff or hasattr(self.problem, "native_threshold"):
      return super().solve_and_map(x, k, l)  # run() refuses unrolled with a clear error
    self._check_dtype(x)
    x, k, l = self._per_row(x, k, l)
    y, _, passes, residual, _ = _mask_operator(
        kernel_attributes(self.problem.regularizer))(x, k, l)
    state = RootState(iter_num=jax.lax.stop_gradient(passes).astype(jnp.int32),
                      residual=jax.lax.stop_gradient(residual))
    return y, state
