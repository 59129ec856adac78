r"""Calls traced when they are lowered, not when the caller is traced; one per platform.

``deferred_call(args, out_avals, default, per_platform)`` stands for
``per_platform.get(platform, default)(*args)`` in a jaxpr without tracing any of those
functions: the output types are given, and a function is traced only when the call is
lowered for its platform (``mlir.lower_fun`` under ``lower_per_platform``: a program
lowered for one platform holds that platform's function alone; one lowered for several,
as ``jax.export(..., platforms=("cpu", "cuda"))``, a case on the platform index that jax
resolves before compiling).

Its users go through :func:`platform_dependent` (``jax.lax.platform_dependent`` that traces
now only the branches of the platform calls run on): ``solver="auto"``
(:class:`implicit_topk.solvers.PlatformSolver`) and ``max_support``'s CPU-kernel and
pure-JAX paths (:mod:`implicit_topk.support_budget`). Tracing the fused GPU kernel and
the pure-JAX solver took 1-2 s of each new default call on a CPU, and a program lowered
for the CPU never uses them. (The fused GPU kernel's own choice between its compiled and
interpreted forms, :mod:`implicit_topk.kernels.gpu.platform_select`, is forward only and
keeps its own primitive.)

Transformations are exact, each one a deferred call again:

* JVP: the primal call, and a call of :math:`(x, \dot x) \mapsto \partial f(x)\,\dot x`
  (``jax.jvp`` of each function, with its own derivative rules), linear in
  :math:`\dot x`;
* transpose (reverse mode): a call of each function's transposed linear map
  (``jax.linear_transpose``). So a gradient recomputes the forward pass inside its
  backward pass: the price of not tracing it when the caller was traced (paid by
  the deferred platforms only);
* vmap: a call of each function under ``jax.vmap``.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core
from jax.interpreters import ad, batching, mlir

from jax._src import core as _core  # pylint: disable=g-bad-import-order
from jax._src import dispatch as _dispatch
# `lower_per_platform` is not re-exported by jax.interpreters.mlir (jax 0.10, 0.11).
from jax._src.interpreters import mlir as _mlir_src

deferred_p = core.Primitive("implicit_topk_deferred")
deferred_p.multiple_results = True

#: ``num_residuals`` of a call that is not linear in any of its arguments.
NOT_LINEAR = -1


class _Fn:
  """A traced-later function as a primitive parameter (hashed by identity, printed by
  name)."""

  __slots__ = ("fn", "name")

  def __init__(self, fn: Callable, name: str):
    self.fn, self.name = fn, name

  def __repr__(self):
    return self.name

  def map(self, transform: Callable, label: str) -> "_Fn":
    return _Fn(transform(self.fn), f"{label}({self.name})")


def deferred_call(args: Any, out_avals: Any, default: Callable,
                  per_platform: dict[str, Callable] | None = None, name: str = "deferred") -> Any:
  """``per_platform.get(platform, default)(*args)`` on the platform the program is
  lowered for (names as in ``jax.lax.platform_dependent``: ``"cpu"``, ``"cuda"``,
  ``"rocm"``, ``"tpu"``), each function traced only then. ``args``: a tuple of pytrees of
  arrays; ``out_avals``: a pytree of ``jax.core.ShapedArray`` (or ``ShapeDtypeStruct``),
  the types every function returns (one that returns others raises ``ValueError`` when
  lowered). Returns that pytree."""
  per_platform = dict(per_platform or {})
  flat_args, in_tree = jax.tree.flatten(tuple(args))
  leaves, out_tree = jax.tree.flatten(out_avals)
  flat_avals = tuple(a if isinstance(a, _core.ShapedArray) else _core.ShapedArray(a.shape, a.dtype)
                     for a in leaves)

  def flat(fn, label):
    def call(*values):
      outs = fn(*jax.tree.unflatten(in_tree, values))
      leaves = jax.tree.leaves(outs)
      got = [(tuple(v.shape), v.dtype) for v in leaves]
      want = [(tuple(a.shape), a.dtype) for a in flat_avals]
      if jax.tree.structure(outs) != out_tree or got != want:
        raise ValueError(f"{name}: the {label} branch returns {got}, the call's declared "
                         f"outputs are {want}; every branch must return the same structure, "
                         "shapes and dtypes.")
      return tuple(leaves)
    return _Fn(call, f"{name}[{label}]")

  funs = tuple(flat(fn, p) for p, fn in per_platform.items()) + (flat(default, "default"),)
  outs = deferred_p.bind(*flat_args, funs=funs, platforms=tuple(per_platform),
                         out_avals=flat_avals, num_residuals=NOT_LINEAR)
  return jax.tree.unflatten(out_tree, outs)


def platform_dependent(*args, here: str, default: Callable, **per_platform: Callable) -> Any:
  """``jax.lax.platform_dependent(*args, default=default, **per_platform)`` that traces
  now only the branches of the platform ``here`` (a backend name: ``"cpu"``, ``"gpu"``
  for both ``"cuda"`` and ``"rocm"``, ``"tpu"``, ...; the platform calls run on); every
  other branch is one :func:`deferred_call`, traced only when the function is lowered
  for its platform. Its output types are those of the branches traced here."""
  # (jax.lax.platform_dependent names a GPU "cuda" or "rocm", never "gpu")
  eager_names = ("cuda", "rocm") if here == "gpu" else (here,)
  # (where this platform takes the default branch, the default is traced now under its
  # names: both of a GPU's, one traced branch, which jax joins)
  eager = ({p: per_platform[p] for p in eager_names if p in per_platform}
           or {p: default for p in eager_names})
  others = {p: f for p, f in per_platform.items() if p not in eager}
  out_avals: list = []
  wrapped: dict[int, Callable] = {}

  def traced(branch):
    def call(*values):
      out = branch(*values)
      out_avals.append(jax.tree.map(jax.typeof, out))
      return out
    return wrapped.setdefault(id(branch), call)

  def deferred(*values):
    if not out_avals:  # (jax traced the branches in another order)
      out_avals.append(jax.eval_shape(next(iter(eager.values())), *values))
    return deferred_call(values, out_avals[0], default, others,
                         name=f"platform_dependent[{', '.join(others) or 'default'}]")

  # jax.lax.platform_dependent traces its named branches first, in order, then the default
  return jax.lax.platform_dependent(*args, **{p: traced(f) for p, f in eager.items()},
                                    default=deferred)


def _bind_each(args, funs, transform, label, **params):
  return deferred_p.bind(*args, funs=tuple(f.map(transform, label) for f in funs), **params)


def _is_float(aval) -> bool:
  return jnp.issubdtype(aval.dtype, jnp.inexact)


def _abstract_eval(*avals, funs, platforms, out_avals, num_residuals):
  del avals, funs, platforms, num_residuals
  return out_avals


deferred_p.def_abstract_eval(_abstract_eval)
deferred_p.def_impl(lambda *args, **params: _dispatch.apply_primitive(deferred_p, *args, **params))


def _lowering(ctx, *args, funs, platforms, out_avals, num_residuals):
  del out_avals, num_residuals
  rule = lambda fun: mlir.lower_fun(fun.fn, multiple_results=True)
  if not platforms:
    return rule(funs[-1])(ctx, *args)
  return _mlir_src.lower_per_platform(ctx, "implicit_topk_deferred",
                                      {p: rule(f) for p, f in zip(platforms, funs)},
                                      rule(funs[-1]), set(), *args)


mlir.register_lowering(deferred_p, _lowering)


def _zero_tangent(aval):
  if _is_float(aval):
    return jnp.zeros(aval.shape, aval.dtype)
  return np.zeros(aval.shape, jax.dtypes.float0)


def _jvp(primals, tangents, *, funs, platforms, out_avals, num_residuals):
  outs = deferred_p.bind(*primals, funs=funs, platforms=platforms, out_avals=out_avals,
                         num_residuals=num_residuals)
  nonzero = [type(t) is not ad.Zero for t in tangents]
  float_outs = [i for i, aval in enumerate(out_avals) if _is_float(aval)]
  out_dots = [ad.Zero(aval.to_tangent_aval()) for aval in out_avals]
  if not any(nonzero) or not float_outs:
    return outs, out_dots
  in_avals = [jax.typeof(p) for p in primals]
  n = len(primals)

  def tangent_map(fn):
    def tangent(*values):
      given = iter(values[n:])
      full = [next(given) if nz else _zero_tangent(a) for nz, a in zip(nonzero, in_avals)]
      _, dots = jax.jvp(fn, tuple(values[:n]), tuple(full))
      return tuple(dots[i] for i in float_outs)
    return tangent

  dots = _bind_each((*primals, *[t for t, nz in zip(tangents, nonzero) if nz]), funs,
                    tangent_map, "jvp", platforms=platforms,
                    out_avals=tuple(out_avals[i].to_tangent_aval() for i in float_outs),
                    num_residuals=n)
  for i, value in zip(float_outs, dots):
    out_dots[i] = value
  return outs, out_dots


ad.primitive_jvps[deferred_p] = _jvp


def _transpose(cotangents, *args, funs, platforms, out_avals, num_residuals):
  del out_avals
  if num_residuals == NOT_LINEAR or any(ad.is_undefined_primal(a) for a in args[:num_residuals]):
    raise NotImplementedError(f"{funs[-1].name} is not linear in the arguments transposed.")
  residuals, linear = args[:num_residuals], args[num_residuals:]
  linear_avals = tuple(a.aval for a in linear)
  structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in linear_avals]
  cotangents = [ad.instantiate_zeros(ct) if type(ct) is ad.Zero else ct for ct in cotangents]
  r = len(residuals)

  def transposed_map(fn):
    def transposed(*values):
      res, ct = values[:r], values[r:]
      return tuple(jax.linear_transpose(lambda *lin: fn(*res, *lin), *structs)(tuple(ct)))
    return transposed

  out = _bind_each((*residuals, *cotangents), funs, transposed_map, "transpose",
                   platforms=platforms, out_avals=linear_avals, num_residuals=r)
  return [None] * r + list(out)


ad.primitive_transposes[deferred_p] = _transpose


def _batch(args, dims, *, funs, platforms, out_avals, num_residuals):
  size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
  mapped = lambda fn: jax.vmap(fn, in_axes=tuple(dims), out_axes=0)
  out = _bind_each(args, funs, mapped, "vmap", platforms=platforms,
                   out_avals=tuple(_core.unmapped_aval(size, 0, a) for a in out_avals),
                   num_residuals=num_residuals)
  return out, [0] * len(out)


batching.primitive_batchers[deferred_p] = _batch
