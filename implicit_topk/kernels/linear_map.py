r"""A linear map computed by a kernel, transposed by another kernel: one JAX primitive.

A kernel that computes a Jacobian-vector product :math:`t \mapsto J(p)\,t` at the
primals :math:`p` (the implicit derivative of a threshold operator) is linear in its
tangents :math:`t`, and its transpose :math:`c \mapsto J(p)^\top c` is a kernel of its
own. :func:`make_primitive` builds the primitive that binds such a pair, for any
backend: the CPU's numba kernels (:mod:`implicit_topk.kernels.cpu.ffi`) and the GPU's
Pallas kernels (:mod:`implicit_topk.kernels.gpu.pallas_derivatives`) each make one,
with their own lowering. Its parameters:

* ``target``, ``transpose_target``: the map and its transpose (hashable; what the
  lowering runs: a custom call's name, a kernel object);
* ``results``, ``transposed``: the avals of the map's outputs and of the transpose's
  outputs (one per tangent);
* ``num_primals``: the leading operands that are primals, the rest are tangents;
* ``reference``: ``reference(*primals, *tangents)``, the same map in ``jax.numpy``;
* any other parameter (e.g. a kernel's attributes) goes to the lowering unchanged.

The rules: transposition swaps the pair (reverse mode runs the transpose kernel, whose
transpose is the map kernel again); the derivatives *of* the map (second order) are
those of ``reference``, by autodiff; ``vmap`` adds a leading batch axis to every operand
and result (the kernels take any leading axes); inside ``shard_map`` the results vary
over the mesh axes the operands vary over.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.extend
import jax.numpy as jnp
from jax.interpreters import ad, batching, mlir


def varying_results(args, results):
  """``results`` (avals) typed, inside ``shard_map``, as varying over the mesh axes that
  the most varying of ``args`` (avals) varies over: one value per shard, as a kernel
  computes them (a cast after the call would transpose to a sum over devices)."""
  base = max(args, key=lambda a: len(_aval_axes(a)), default=None)
  if base is None or not _aval_axes(base):
    return results
  return tuple(base.update(shape=r.shape, dtype=r.dtype, weak_type=False) for r in results)


def _aval_axes(aval) -> frozenset:
  mat = getattr(aval, "mat", None)
  return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def batched(primitive, *avals_params):
  """The vmap rule of ``primitive``: the mapped axis becomes a leading batch axis of
  every operand (broadcast where an operand is not mapped) and of every result (the
  parameters named in ``avals_params`` hold result avals and get it too; a
  ``reference`` map is vmapped over that axis)."""

  def rule(args, dims, **params):
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    moved = [jnp.broadcast_to(a, (size,) + a.shape) if d is None
             else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims)]
    for name in avals_params:
      params[name] = tuple(jax.core.ShapedArray((size,) + r.shape, r.dtype)
                           for r in params[name])
    if "reference" in params:  # e.g. a Transposed map holds the unbatched shapes
      params["reference"] = _Vmapped(params["reference"])
    outs = primitive.bind(*moved, **params)
    return outs, [0] * len(outs)

  return rule


def shaped(shapes) -> tuple:
  """Avals (``ShapedArray``) of objects with a shape and a dtype."""
  return tuple(jax.core.ShapedArray(r.shape, r.dtype) for r in shapes)


class _Vmapped:
  """``reference`` mapped over a leading axis of every operand and result."""

  def __init__(self, reference: Callable):
    self.reference = reference

  def __call__(self, *args):
    return tuple(jax.vmap(lambda *a: tuple(self.reference(*a)))(*args))


class Transposed:
  r"""The transpose of a JAX linear map ``reference(*primals, *tangents)`` in its
  tangents, as ``(*primals, *cotangents) -> cotangents of the tangents`` (one per
  tangent, shapes and dtypes ``tangents``): :math:`c \mapsto J(p)^\top c` by
  ``jax.vjp`` at zero tangents."""

  def __init__(self, reference: Callable, num_primals: int, tangents):
    self.reference, self.num_primals, self.tangents = reference, num_primals, tangents

  def __call__(self, *args):
    primals, cotangents = args[:self.num_primals], args[self.num_primals:]
    zeros = [jnp.zeros(t.shape, t.dtype) for t in self.tangents]
    outs, transpose = jax.vjp(lambda *t: self.reference(*primals, *t), *zeros)
    # Inside shard_map a cotangent (e.g. an instantiated zero) may vary over fewer mesh
    # axes than its output does: cast it to the output's type, as vjp asks.
    return tuple(transpose(tuple(_vary_as(c, o) for c, o in zip(cotangents, outs))))


def _vary_as(value, like):
  """``value`` marked as varying over the mesh axes ``like`` varies over and it lacks."""
  missing = _aval_axes(jax.typeof(like)) - _aval_axes(jax.typeof(value))
  return jax.lax.pcast(value, tuple(sorted(missing)), to="varying") if missing else value


def bind(primitive, target, transpose_target, results, transposed, primals, tangents,
         reference: Callable, **params) -> tuple:
  """``target`` on ``(*primals, *tangents)`` through ``primitive`` (a
  :func:`make_primitive`): outputs of shapes and dtypes ``results``; its transpose
  ``transpose_target`` on ``(*primals, *cotangents)`` returns one cotangent per tangent
  (shapes and dtypes ``transposed``). ``reference`` is the map in ``jax.numpy``;
  ``params`` go to the lowering."""
  return tuple(primitive.bind(
      *primals, *tangents, target=target, transpose_target=transpose_target,
      results=shaped(results), transposed=shaped(transposed), num_primals=len(primals),
      reference=reference, **params))


def _transpose(primitive, cotangents, *args, target, transpose_target, results, transposed,
               num_primals, reference, **params):
  primals, tangents = args[:num_primals], args[num_primals:]
  cotangents = [jnp.zeros(r.shape, r.dtype) if type(c) is ad.Zero else c
                for c, r in zip(cotangents, results)]
  outs = primitive.bind(*primals, *cotangents, target=transpose_target,
                        transpose_target=target, results=transposed, transposed=results,
                        num_primals=num_primals,
                        reference=Transposed(reference, num_primals, transposed), **params)
  return [None] * num_primals + [out if ad.is_undefined_primal(t) else None
                                 for out, t in zip(outs, tangents)]


def _jvp(primals, tangents, *, reference, **_):
  """Derivatives of the kernels' linear map: those of its JAX reference."""
  tangents = [jnp.zeros(p.shape, p.dtype) if type(t) is ad.Zero else t
              for p, t in zip(primals, tangents)]
  outs, outs_dot = jax.jvp(lambda *a: tuple(reference(*a)), tuple(primals), tuple(tangents))
  return list(outs), list(outs_dot)


def make_primitive(name: str, lowering, platform: str | None = None):
  """A linear-map primitive named ``name`` (see the module docstring), lowered by
  ``lowering(ctx, *operands, **params)`` (for ``platform`` only, or every platform)."""
  primitive = jax.extend.core.Primitive(name)
  primitive.multiple_results = True
  primitive.def_abstract_eval(lambda *args, results, **_: varying_results(args, results))
  primitive.def_impl(lambda *args, **params: jax.jit(
      functools.partial(primitive.bind, **params))(*args))
  mlir.register_lowering(primitive, lowering, platform=platform)
  batching.primitive_batchers[primitive] = batched(primitive, "results", "transposed")
  ad.primitive_transposes[primitive] = functools.partial(_transpose, primitive)
  ad.primitive_jvps[primitive] = _jvp
  return primitive
