r"""The implicit derivatives of the fused kernel's operator as Pallas kernels, one each way.

At the thresholds :math:`\lambda` the fused kernel found
(:mod:`~implicit_topk.kernels.gpu.pallas_threshold`), the derivative of the operator is
the linear map :func:`implicit_tangent` of the tangents :math:`(\dot x, \dot k, \dot l)`,
on the rows the kernel rescaled by the exact power of two ``scale`` and zero on the
binary rows it decided exactly (:class:`ScaledTangent`). Two Pallas kernels compute it,
over the same blocks of rows and the same padding as the forward kernel
(:func:`~implicit_topk.kernels.gpu.pallas_threshold.blocked_call`):

* the *tangent* kernel: ``(x, lam, origin, scale, binary, k, l; x_dot, k_dot, l_dot) ->
  (y_dot, lam_dot)`` (forward mode);
* the *cotangent* kernel, its transpose: ``(...; y_bar, lam_bar) -> (x_bar, k_bar,
  l_bar)`` (reverse mode). For the mask, with :math:`z_i = (x_i - \lambda)/l` and
  :math:`d_i = \mathrm{mask}'(z_i)/l`, :math:`\bar x = d \odot (\bar y - c)` with
  :math:`c = (\sum_i d_i \bar y_i - \bar\lambda) / \sum_i d_i` (0 where
  :math:`\sum_i d_i = 0`): one read of ``x`` and ``y_bar``, one write of ``x_bar``.

Both bodies are generic: :class:`ScaledTangent`, the problem's own ``jax.numpy`` code
differentiated by ``jax.jvp``, evaluated on the block of rows, and its ``jax.vjp``
(:class:`implicit_topk.kernels.linear_map.Transposed`) for the cotangent kernel, so
every regularizer of the mask and the magnitude operator get them. They form one linear
map primitive (:mod:`implicit_topk.kernels.linear_map`): reverse mode transposes the
tangent kernel into the cotangent kernel (one ``pallas_call`` per backward pass),
second-order derivatives differentiate :class:`ScaledTangent` in JAX, ``vmap`` adds rows.

Rows longer than ``MAX_ROW_LENGTH`` (4096) keep the derivative as XLA operations
(:func:`implicit_derivative`): the chunked kernel's rows
(:mod:`~implicit_topk.kernels.gpu.pallas_long_rows`) are lazy functions of the chunk
index, not arrays, so ``jax.jvp`` and ``jax.vjp`` of the problem's code cannot be
evaluated on them, and a per-problem chunked derivative would no longer be the
problem's own code.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.interpreters import mlir

from implicit_topk import _implicit
from implicit_topk.kernels import linear_map
from implicit_topk.kernels.gpu import pallas_threshold


def implicit_tangent(problem, x, lam, origin, k, l, x_dot, k_dot, l_dot):
  r"""``(y_dot, lam_dot)``: the derivative of the operator at the thresholds ``lam``.

  With :math:`x' = ` ``problem.shift(x, origin)`` (the normalized rows; the origin is
  held constant, as in ``problem.normalize``), the implicit function theorem on
  :math:`\phi(\lambda; x', k, l) = 0` gives per row

  .. math::

      \dot\lambda = -\frac{\partial_{x'}\phi\,\dot x' + \partial_k\phi\,\dot k
                           + \partial_l\phi\,\dot l}{\partial_\lambda\phi},\qquad
      \dot y = \partial_\lambda y\,\dot\lambda + \partial_{x'} y\,\dot x'
               + \partial_l y\,\dot l ,

  each partial derivative by ``jax.jvp`` of the problem's own ``optimality`` and
  ``primal``. For the mask, with :math:`z_i = (x'_i - \lambda)/l` and
  :math:`d_i = \mathrm{mask}'(z_i)/l`, the gradient of :math:`\langle v, y\rangle` in
  ``x`` is :math:`d \odot (v - \sum_i d_i v_i / \sum_i d_i)`. Where
  :math:`\partial_\lambda\phi = 0` (a binary row) :math:`\dot\lambda = 0`, the
  convention of :func:`implicit_topk._implicit.diagonal_solve`; on rows whose output
  is NaN (a NaN entry, no threshold) :math:`\dot y = 0` (the problems' ``primal`` masks
  NaN by a double ``where``) and :math:`\dot\lambda` is NaN.
  Linear in the tangents: elementwise maps and row sums, which the kernels of this
  module evaluate on blocks of rows, forward and transposed.
  """
  shift = lambda v: pallas_threshold.normalized(problem, v, origin)
  xn, xn_dot = jax.jvp(shift, (x,), (x_dot,))
  _, diagonal = jax.jvp(lambda t: problem.optimality(t, xn, k, l), (lam,), (jnp.ones_like(lam),))
  _, phi_dot = jax.jvp(lambda a, b, c: problem.optimality(lam, a, b, c), (xn, k, l),
                       (xn_dot, k_dot, l_dot))
  lam_dot = _implicit._safe_divide(-phi_dot, diagonal)  # pylint: disable=protected-access
  _, y_dot = jax.jvp(problem.primal, (lam, xn, l), (lam_dot, xn_dot, l_dot))
  return y_dot, lam_dot


@dataclasses.dataclass(frozen=True)
class ScaledTangent:
  r"""The derivative of the fused kernel's operator, linear in ``(x_dot, k_dot, l_dot)``:
  ``(x, lam, origin, scale, binary, k, l, x_dot, k_dot, l_dot) -> (y_dot, lam_dot)``.

  The kernel solved the rows :math:`x\,s` with strength :math:`l\,s` (``scale``
  :math:`s`, an exact power of two per row, constant), so this is
  :func:`implicit_tangent` at :math:`(x s, \lambda, \text{origin}, k, l s)` on the
  tangents :math:`(\dot x s, \dot k, \dot l s)`, set to 0 on the rows where ``binary``
  is positive (binary rows decided exactly: locally constant). Rows are the last axis;
  any leading axes."""

  problem: Any

  def __call__(self, x, lam, origin, scale, binary, k, l, x_dot, k_dot, l_dot):
    per_entry = scale[..., None]
    y_dot, lam_dot = implicit_tangent(self.problem, x * per_entry, lam, origin, k, l * scale,
                                      x_dot * per_entry, k_dot, l_dot * scale)
    exact = binary > 0
    return (jnp.where(exact[..., None], jnp.zeros_like(y_dot), y_dot),
            jnp.where(exact, jnp.zeros_like(lam_dot), lam_dot))


#: The primals of :class:`ScaledTangent` (the rest of its arguments are tangents).
NUM_PRIMALS = 7


def _map_kernel(problem, transpose: bool, *refs):
  """The program of one block of rows: load the operands (``x`` and the tangents or
  cotangents of full rows, the rest one value per row), evaluate :class:`ScaledTangent`
  (``transpose``: its transpose) on the block, store the results."""
  num_inputs = NUM_PRIMALS + (2 if transpose else 3)
  in_refs, out_refs = refs[:num_inputs], refs[num_inputs:]
  dtype = pallas_threshold.accumulation_dtype(out_refs[0].dtype)
  # blocked_call's order: the full rows (x, then x_dot or y_bar), then the per-row values
  # (lam, origin, scale, binary, k, l, then k_dot and l_dot, or lam_bar).
  x_ref, wide_ref, *row_refs = in_refs
  row_primals, row_tangents = row_refs[:NUM_PRIMALS - 1], row_refs[NUM_PRIMALS - 1:]
  ordered = [x_ref, *row_primals, wide_ref, *row_tangents]  # ScaledTangent's order
  values = [ref[...].astype(dtype) for ref in ordered]
  block = ScaledTangent(problem.with_layout(pallas_threshold._BLOCK_ROWS))  # pylint: disable=protected-access
  if transpose:
    x, k, l = values[0], values[5], values[6]
    outs = linear_map.Transposed(block, NUM_PRIMALS, (x, k, l))(*values)
  else:
    outs = block(*values)
  for ref, value in zip(out_refs, outs):
    ref[...] = value.astype(ref.dtype)


@dataclasses.dataclass(frozen=True)
class RowDerivative:
  """The tangent kernel (``transpose=False``) or the cotangent kernel (``True``) of
  :class:`ScaledTangent` on rows of at most ``MAX_ROW_LENGTH`` entries, any leading
  axes: ``(x, lam, origin, scale, binary, k, l, *tangents) -> outputs`` with tangents
  ``(x_dot, k_dot, l_dot)`` and outputs ``(y_dot, lam_dot)``, or tangents ``(y_bar,
  lam_bar)`` and outputs ``(x_bar, k_bar, l_bar)``; every output in the dtype of the
  operand it belongs to. ``interpret``, ``num_warps`` and ``block_elements`` as in
  :func:`~implicit_topk.kernels.gpu.pallas_threshold.fused_rows`."""

  problem: Any
  transpose: bool
  interpret: bool | None = None
  num_warps: int | None = pallas_threshold.DEFAULT_NUM_WARPS
  block_elements: int | None = None

  def __call__(self, *args):
    x = args[0]
    lead, n = x.shape[:-1], x.shape[-1]
    flat = tuple(a.reshape(-1, n) if a.ndim == x.ndim else a.reshape(-1) for a in args)
    outs = pallas_threshold.per_platform(self._call, flat, self.interpret, like=self._like)
    return tuple(out.reshape(lead + out.shape[1:]) for out in outs)

  def _outputs_of(self, args):
    """The operands whose types the outputs take: ``(x, k, l)`` for the cotangent
    kernel, ``(x, lam)`` (for ``y_dot``, ``lam_dot``) for the tangent kernel."""
    return (args[0], args[5], args[6]) if self.transpose else (args[0], args[1])

  def _like(self, *args):
    """Zeros of the types :meth:`_call` returns."""
    return tuple(jnp.zeros_like(v) for v in self._outputs_of(args))

  def _call(self, *args, interpret: bool):
    x = args[0]
    primals, tangents = args[:NUM_PRIMALS], args[NUM_PRIMALS:]
    like = self._outputs_of(args)
    if interpret and pallas_threshold._varying_axes(x):  # pylint: disable=protected-access
      # Inside shard_map (as the forward kernel): the map itself, on the whole batch.
      tangent = ScaledTangent(self.problem)
      outs = (linear_map.Transposed(tangent, NUM_PRIMALS, like)(*args) if self.transpose
              else tangent(*args))
      return pallas_threshold._vary_like(tuple(outs), x)  # pylint: disable=protected-access
    full_args = [x, tangents[0]]
    row_args = list(primals[1:]) + list(tangents[1:])
    # Padding: x with the excluded value (never selected, derivative 0), the (co)tangents
    # with 0; padded rows are all excluded with k = 0 and l = scale = 1.
    row_fills = [0, 0, 1, 0, 0, 1] + [0] * len(tangents[1:])
    outs = pallas_threshold.blocked_call(
        functools.partial(_map_kernel, self.problem, self.transpose), full_args, row_args,
        [like[0].dtype], [v.dtype for v in like[1:]],
        full_fills=[self.problem.excluded_value, 0], row_fills=row_fills,
        interpret=interpret, num_warps=self.num_warps, block_elements=self.block_elements,
        name="implicit_topk_cotangent" if self.transpose else "implicit_topk_tangent")
    return tuple(outs)


def _lowering(ctx, *operands, target, **_):
  """The kernel ``target`` (a :class:`RowDerivative`), lowered as JAX code."""
  return mlir.lower_fun(lambda *args: target(*args), multiple_results=True)(ctx, *operands)


_pallas_linear_call = linear_map.make_primitive("implicit_topk_pallas_linear_call", _lowering)


def implicit_derivative(problem, primals, tangents, *, interpret: bool | None = None,
                        num_warps: int | None = pallas_threshold.DEFAULT_NUM_WARPS,
                        block_elements: int | None = None):
  """``(y_dot, lam_dot)`` of :class:`ScaledTangent` at ``primals = (x, lam, origin,
  scale, binary, k, l)`` (``x`` of shape ``(..., n)``, the rest per row) on ``tangents =
  (x_dot, k_dot, l_dot)``, all in the accumulation dtype.

  Rows of at most ``MAX_ROW_LENGTH`` entries: the tangent kernel, transposed in reverse
  mode into the cotangent kernel (one ``pallas_call`` each way). Longer rows: the map
  as XLA operations under ``jax.checkpoint`` (reverse mode keeps only ``x`` and the
  per-row values, and recomputes the slopes in the backward pass)."""
  x = primals[0]
  reference = ScaledTangent(problem)
  if pallas_threshold.padded_length(x.shape[-1]) > pallas_threshold.MAX_ROW_LENGTH:
    return jax.checkpoint(reference, policy=jax.checkpoint_policies.nothing_saveable)(
        *primals, *tangents)
  kernel = functools.partial(RowDerivative, problem, interpret=interpret,
                             num_warps=num_warps, block_elements=block_elements)
  return linear_map.bind(_pallas_linear_call, kernel(transpose=False),
                         kernel(transpose=True), (x, primals[1]), tangents, primals,
                         tangents, reference)
