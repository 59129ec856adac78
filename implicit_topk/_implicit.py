r"""Implicit differentiation of a batch of scalar roots. The only module that imports jaxopt.

jaxopt is imported only when ``backend="jaxopt"`` is asked for, so ``import
implicit_topk`` neither loads it nor triggers its deprecation warning.

A solver finds, for every row ``b``, a root :math:`\lambda_b` of the optimality
condition :math:`F(\lambda, \theta)_b = 0` (e.g. :math:`\phi(\lambda) = \sum_i y_i - k`).
Rows are independent, so :math:`\partial F / \partial \lambda` is diagonal and the
implicit function theorem

.. math::

    \partial\lambda = -\big(\partial_\lambda F\big)^{-1} \partial_\theta F\, \partial\theta

needs one division per row: :func:`diagonal_solve` reads the diagonal off one
Jacobian-vector product with a vector of ones. JAX derives every other Jacobian from
``F``; nothing here is a hand-written derivative of a solver.

Two routes, chosen by ``backend``:

* ``"lax"`` (default): :func:`jax.lax.custom_root`. Its tangent solve is linear and
  transposes, so forward mode (``jvp``, ``jacfwd``, Hessian-vector products) and
  reverse mode both work.
* ``"jaxopt"``: :func:`jaxopt.implicit_diff.custom_root`, a ``custom_vjp``: reverse
  mode only (``jax.jvp`` raises). Kept for code that composes with jaxopt solvers.

Where :math:`\partial_\lambda F = 0` (every coordinate saturated at 0 or 1), the
primal is locally constant in :math:`\theta`; the solve returns 0 there, which gives
the correct zero derivative.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.extend
import jax.numpy as jnp

BACKENDS = ("lax", "jaxopt")


def _safe_divide(b, diag):
  nonzero = diag != 0
  return jnp.where(nonzero, b / jnp.where(nonzero, diag, jnp.ones_like(diag)), jnp.zeros_like(b))


def diagonal_solve(matvec: Callable, b):
  """Solves ``matvec(u) = b`` for a diagonal linear map (jaxopt's ``solve`` signature)."""
  return _safe_divide(b, matvec(jnp.ones_like(b)))


def _diagonal_tangent_solve(linear_fun: Callable, b):
  """Same as :func:`diagonal_solve` with ``jax.lax.custom_root``'s argument order."""
  return _safe_divide(b, linear_fun(jnp.ones_like(b)))


def _varying_like(init, optimality_fun, args):
  """``init`` made varying over the mesh axes (inside ``shard_map``) that the residual
  ``optimality_fun(init, *args)``, hence the root, varies over: ``custom_root`` traces its
  tangent solve with the type of ``init`` (an invariant guess for a varying root fails
  in the derivatives). A residual reduced over the axis (``psum``) leaves it invariant."""
  residual = jax.eval_shape(optimality_fun, init, *args)
  missing = tuple(sorted(_varying_axes(residual) - _varying_axes(jax.typeof(init))))
  return jax.lax.pcast(init, missing, to="varying") if missing else init


def _varying_axes(aval) -> frozenset:
  """The mesh axes an aval or ShapeDtypeStruct varies over (empty outside shard_map)."""
  mat = getattr(aval, "mat", None) or getattr(aval, "manual_axis_type", None)
  return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def _hoisted(fun: Callable, init, args: tuple):
  """``(f, operands)``: ``f(init, *operands)`` computes ``fun(init, *args)``, with ``args``
  and every array ``fun`` closes over (traced ones included) in ``operands``, so that ``f``
  closes over no array."""
  closed, out_shape = jax.make_jaxpr(fun, return_shape=True)(init, *args)
  flat_args = jax.tree.leaves(args)
  consts = list(closed.consts)
  n_args = len(flat_args)

  def f(root, *operands):
    flat = jax.extend.core.jaxpr_as_fun(jax.extend.core.ClosedJaxpr(
        closed.jaxpr, list(operands[n_args:])))(*jax.tree.leaves(root), *operands[:n_args])
    return jax.tree.unflatten(jax.tree.structure(out_shape), flat)

  return f, (*flat_args, *consts)


def implicit_root(
    solver_fun: Callable[..., tuple[jax.Array, Any]],
    optimality_fun: Callable[..., jax.Array],
    init: jax.Array,
    args: tuple,
    *,
    backend: str = "lax",
) -> tuple[jax.Array, Any]:
  """Runs ``solver_fun(init, *args) -> (root, aux)`` with implicit derivatives.

  Args:
    solver_fun: finds the roots; it is never differentiated.
    optimality_fun: ``optimality_fun(root, *args)``, same shape as ``root``, zero at
      the solution, with a diagonal Jacobian in ``root``.
    init: initial guess, shape of the root.
    args: the differentiable arguments (arrays).
    backend: ``"lax"`` (forward and reverse mode) or ``"jaxopt"`` (reverse only).

  Returns:
    ``(root, aux)``; ``aux`` (solver diagnostics) carries no derivative.
  """
  init = _varying_like(init, optimality_fun, args)
  if backend == "jaxopt":
    # Lazy: jaxopt is unmaintained and warns (DeprecationWarning) when imported.
    from jaxopt import implicit_diff as jaxopt_implicit_diff  # pylint: disable=g-import-not-at-top

    # jaxopt's custom_root is a custom_vjp, whose backward pass may not close over traced
    # arrays (a Segments layout's segment_ids, bound inside the traced computation): they
    # become explicit arguments of both functions.
    optimality, operands = _hoisted(optimality_fun, init, args)
    solver, solver_operands = _hoisted(solver_fun, init, args)
    count = len(operands)
    decorated = jaxopt_implicit_diff.custom_root(
        lambda root, *rest: optimality(root, *rest[:count]), has_aux=True,
        solve=diagonal_solve,
    )(lambda guess, *rest: solver(guess, *rest[count:]))
    root, aux = decorated(init, *operands, *solver_operands)
    return root, jax.lax.stop_gradient(aux)
  if backend == "lax":
    return jax.lax.custom_root(
        lambda root: optimality_fun(root, *args),
        init,
        lambda _, guess: solver_fun(guess, *args),
        _diagonal_tangent_solve,
        has_aux=True,
    )
  raise ValueError(f"`implicit_diff_backend` must be one of {BACKENDS}; got {backend!r}.")
