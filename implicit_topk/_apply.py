"""The plumbing every public operator shares: validate, move the axis, compute, restore.

:func:`apply_on_axis` runs a last-axis function along any ``axis`` of a float input, in
float32 for half types (cast back after), and :func:`threshold_operator` runs a solver
of :mod:`implicit_topk.solvers` that way behind one cached ``jax.jit``, so that eager
calls with the same shapes and options do not trace or compile again.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from implicit_topk import _validation


def apply_on_axis(fn: Callable, x, axis: int, *, name: str = "x"):
  """``fn(moved)`` with ``axis`` of ``x`` moved last, in the compute dtype.

  ``x`` must be a float array with at least one dimension (``TypeError`` /
  ``ValueError`` naming ``name`` otherwise). ``fn`` returns an array of the moved
  shape, or a tuple whose first element is one (the rest, e.g. diagnostics, is
  returned as is); the array is moved back and cast to the dtype of ``x``.
  """
  x = _validation.as_float_input(x, name)
  axis = _validation.canonicalize_axis(axis, x.ndim)
  moved = jnp.moveaxis(x, axis, -1).astype(_validation.compute_dtype(x.dtype))
  out = fn(moved)
  restore = lambda y: jnp.moveaxis(y, -1, axis).astype(x.dtype)
  if isinstance(out, tuple):
    return (restore(out[0]),) + tuple(out[1:])
  return restore(out)


def input_size(x) -> int:
  """The number of entries of ``x`` (an array, tracer or nested list)."""
  return int(np.size(x))


def _solve_rows(x, k, l, *, solver, axis, return_info):
  def on_rows(rows):
    dtype = rows.dtype
    batch_shape = rows.shape[:-1]
    k_rows = jnp.broadcast_to(jnp.asarray(k, dtype), batch_shape)
    l_rows = jnp.broadcast_to(jnp.asarray(l, dtype), batch_shape)
    rows = solver.problem.normalize(rows, l_rows)
    step = solver.run(None, rows, k_rows, l_rows)
    y = solver.primal(step.params, rows, l_rows)
    # A traced l is not checked: l <= 0 (or NaN) gives NaN rows, never a wrong mask.
    return jnp.where((l_rows > 0)[..., None], y, jnp.nan), step.state

  y, state = apply_on_axis(on_rows, x, axis)
  return (y, state) if return_info else y


_solve_rows_jit = jax.jit(_solve_rows, static_argnames=("solver", "axis", "return_info"))


def _hashable(value) -> bool:
  try:
    hash(value)
  except TypeError:
    return False
  return True


def threshold_operator(solver, x, k, l, *, axis: int, return_info: bool = False):
  """Validates ``x``, ``axis``, ``k`` (0 <= k <= n) and ``l`` (> 0), then solves along ``axis``.

  Returns the operator's output with the shape and dtype of ``x`` (and the solver's
  ``RootState`` with ``return_info``). The computation is one ``jax.jit`` keyed on the
  solver object, ``axis`` and ``return_info`` (a solver holding an unhashable
  user-defined regularizer runs without it).
  """
  x = _validation.as_float_input(x)
  axis = _validation.canonicalize_axis(axis, x.ndim)
  batch_shape = x.shape[:axis] + x.shape[axis + 1:]
  _validation.check_k(k, x.shape[axis])
  _validation.check_positive(l, "l")
  _validation.check_broadcast(k, batch_shape, "k")
  _validation.check_broadcast(l, batch_shape, "l")
  run = _solve_rows_jit if _hashable(solver) else _solve_rows
  return run(x, k, l, solver=solver, axis=axis, return_info=return_info)
