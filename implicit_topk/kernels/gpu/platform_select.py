r"""One function per platform, chosen when lowered, each branch lowered for its platform only.

``jax.lax.platform_dependent`` lowers every branch for every platform of a
multi-platform export (jax 0.10: ``_cond_lowering`` keeps the module's platforms), so a
branch that holds a CPU-only custom call (the native kernels) or a GPU-only one (the
Triton kernel) cannot be exported for ``platforms=("cpu", "cuda")``. This primitive
lowers through ``jax.interpreters.mlir.lower_per_platform``, which lowers each branch
for its own platforms only: a single-platform lowering holds that branch alone, a
multi-platform one a case on the platform index that jax resolves before compiling.

Forward only: the branches are not differentiated (the callers wrap the selection in a
``jax.custom_jvp`` whose tangent is plain JAX); ``vmap`` maps every branch.
"""

from __future__ import annotations

import jax
from jax.extend import core as _core
from jax.interpreters import batching, mlir

from jax._src import dispatch as _dispatch  # pylint: disable=g-import-not-at-top
# `lower_per_platform` is not re-exported by jax.interpreters.mlir (jax 0.10, 0.11).
from jax._src.interpreters import mlir as _mlir_src  # pylint: disable=g-import-not-at-top

platform_select_p = _core.Primitive("implicit_topk_platform_select")
platform_select_p.multiple_results = True


def platform_select(args, branches: dict, default):
  """``branches[platform](*args)`` on each platform named in ``branches`` (``"cpu"``,
  ``"cuda"``, ``"rocm"``, ``"tpu"``), ``default(*args)`` elsewhere.

  ``args`` is a tuple of arrays; every branch returns the same pytree of arrays (same
  shapes and dtypes). Returns that pytree."""
  args = tuple(args)
  names = tuple(branches)
  funs = tuple(branches[name] for name in names) + (default,)
  closed, trees = [], []
  for fun in funs:
    jaxpr, shape = jax.make_jaxpr(fun, return_shape=True)(*args)
    closed.append(jaxpr)
    trees.append(jax.tree.structure(shape))
  avals = [tuple((a.shape, a.dtype) for a in j.out_avals) for j in closed]
  if any(str(tree) != str(trees[0]) for tree in trees) or any(a != avals[0] for a in avals):
    raise ValueError("platform_select: every branch must return the same structure, shapes "
                     f"and dtypes; got {list(zip(names + ('default',), avals))}.")
  outs = platform_select_p.bind(*args, jaxprs=tuple(closed), platforms=names)
  return jax.tree.unflatten(trees[0], outs)


def _abstract_eval(*_, jaxprs, platforms):
  del platforms
  return jaxprs[0].out_avals


platform_select_p.def_abstract_eval(_abstract_eval)
platform_select_p.def_impl(lambda *args, **params: _dispatch.apply_primitive(
    platform_select_p, *args, **params))


def _lowering(ctx, *args, jaxprs, platforms):
  rule = lambda jaxpr: mlir.lower_fun(_core.jaxpr_as_fun(jaxpr), multiple_results=True)
  return _mlir_src.lower_per_platform(
      ctx, "implicit_topk_platform_select",
      {name: rule(jaxpr) for name, jaxpr in zip(platforms, jaxprs)}, rule(jaxprs[-1]),
      set(), *args)


mlir.register_lowering(platform_select_p, _lowering)


def _batching(args, dims, *, jaxprs, platforms):
  mapped = [jax.vmap(_core.jaxpr_as_fun(jaxpr), in_axes=dims) for jaxpr in jaxprs]
  return (platform_select(args, dict(zip(platforms, mapped[:-1])), mapped[-1]),
          [0] * len(jaxprs[0].out_avals))


def _batching_flat(args, dims, **params):
  outs, out_dims = _batching(args, dims, **params)
  return list(jax.tree.leaves(outs)), out_dims


batching.primitive_batchers[platform_select_p] = _batching_flat
