r"""One function per platform, chosen when lowered, each branch traced and lowered for its
platform only.

``jax.lax.platform_dependent`` traces every branch when the function is traced and
lowers every branch for every platform of a multi-platform export (jax 0.10, 0.11:
``_cond_lowering`` keeps the module's platforms), so a branch that holds a CPU-only
custom call (the native kernels) or a GPU-only one (the Triton kernel) cannot be
exported for ``platforms=("cpu", "cuda")``, and every trace pays for tracing the
kernels of platforms it will never run on (tracing a Pallas kernel's body: about
0.5 s). This primitive holds the branches as functions: its output types come from a
cheap stand-in (``like``), and it lowers through
``jax.interpreters.mlir.lower_per_platform``, which calls the rule of each platform
being lowered only. So a branch is traced when, and only when, the program is lowered
for its platform: a single-platform lowering holds that branch alone, a multi-platform
one a case on the platform index that jax resolves before compiling.

Forward only: the branches are not differentiated (the callers wrap the selection in a
``jax.custom_jvp`` whose tangent is plain JAX); ``vmap`` maps every branch.
"""

from __future__ import annotations

from typing import Callable

import jax
from jax.extend import core as _core
from jax.interpreters import batching, mlir

from jax._src import dispatch as _dispatch  # pylint: disable=g-import-not-at-top
# `lower_per_platform` is not re-exported by jax.interpreters.mlir (jax 0.10, 0.11).
from jax._src.interpreters import mlir as _mlir_src  # pylint: disable=g-import-not-at-top

platform_select_p = _core.Primitive("implicit_topk_platform_select")
platform_select_p.multiple_results = True


def platform_select(args, branches: dict, default: Callable, like: Callable | None = None):
  """``branches[platform](*args)`` on each platform named in ``branches`` (``"cpu"``,
  ``"cuda"``, ``"rocm"``, ``"tpu"``), ``default(*args)`` elsewhere.

  ``args`` is a tuple of arrays; every branch returns the same pytree of arrays (same
  shapes and dtypes). ``like(*args)`` returns a pytree of arrays of those types, by
  cheap operations (``jnp.zeros_like`` of an argument, ...): it is traced now, the
  branches only when lowered (a branch that returns other types raises ``ValueError``
  then). ``like=None`` traces ``default`` now instead. Returns that pytree."""
  args = tuple(args)
  names = tuple(branches)
  stand_in = default if like is None else like
  closed, out_shape = jax.make_jaxpr(stand_in, return_shape=True)(*args)
  tree = jax.tree.structure(out_shape)
  funs = tuple(branches[name] for name in names) + (default,)
  outs = platform_select_p.bind(*args, funs=funs, platforms=names, like=stand_in,
                                out_avals=tuple(closed.out_avals), tree=tree)
  return jax.tree.unflatten(tree, outs)


def _abstract_eval(*_, out_avals, **__):
  return out_avals


platform_select_p.def_abstract_eval(_abstract_eval)
platform_select_p.def_impl(lambda *args, **params: _dispatch.apply_primitive(
    platform_select_p, *args, **params))


def _flat_branch(fun, platform, tree, out_avals):
  """``fun`` returning the list of its outputs' leaves, checked against the selection's
  output types."""
  def flat(*args):
    outs = fun(*args)
    leaves = jax.tree.leaves(outs)
    got = [(tuple(v.shape), v.dtype) for v in leaves]
    want = [(tuple(a.shape), a.dtype) for a in out_avals]
    if str(jax.tree.structure(outs)) != str(tree) or got != want:
      raise ValueError(f"platform_select: the {platform} branch returns {got}, the "
                       f"selection's declared outputs are {want}; every branch must return "
                       "the same structure, shapes and dtypes.")
    return leaves
  return flat


def _lowering(ctx, *args, funs, platforms, like, out_avals, tree):
  del like
  rule = lambda fun, platform: mlir.lower_fun(
      _flat_branch(fun, platform, tree, out_avals), multiple_results=True)
  return _mlir_src.lower_per_platform(
      ctx, "implicit_topk_platform_select",
      {name: rule(fun, name) for name, fun in zip(platforms, funs)},
      rule(funs[-1], "default"), set(), *args)


mlir.register_lowering(platform_select_p, _lowering)


def _batching(args, dims, *, funs, platforms, like, out_avals, tree):
  del out_avals
  mapped = lambda fun: jax.vmap(fun, in_axes=tuple(dims))
  outs = platform_select(args, dict(zip(platforms, map(mapped, funs[:-1]))), mapped(funs[-1]),
                         like=mapped(like))
  leaves = jax.tree.leaves(outs)
  assert jax.tree.structure(outs) == tree
  return leaves, [0] * len(leaves)


batching.primitive_batchers[platform_select_p] = _batching


def branch_jaxprs(eqn) -> dict:
  """The program of each branch of a ``platform_select`` equation, traced at its
  operands' types: ``{platform: Jaxpr}``, ``"default"`` for the default branch (for
  tools that read a program's primitives: nothing in the jaxpr holds them)."""
  params = eqn.params
  avals = [v.aval for v in eqn.invars]
  structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
  names = tuple(params["platforms"]) + ("default",)
  return {name: jax.make_jaxpr(fun)(*structs).jaxpr for name, fun in zip(names, params["funs"])}
