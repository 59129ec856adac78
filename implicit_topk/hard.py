"""Hard (non-differentiable) top-k operators, the limits of the soft ones as l -> 0.

Both use ``jax.lax.top_k`` and a scatter: O(n log k) time, O(n) memory, no one-hot
matrices. Ties are broken by index: among equal values the lower index is selected
(``lax.top_k``'s order). NaN compares larger than every number in ``lax.top_k``, so a
NaN entry is selected first.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from implicit_topk import _validation


def _topk_indicator(scores, k: int, axis: int, dtype):
  moved = jnp.moveaxis(scores, axis, -1)
  # -0.0 and +0.0 are equal: one zero, so that the tie goes to the lower index
  moved = jnp.where(moved == 0, jnp.zeros_like(moved), moved)
  _, indices = jax.lax.top_k(jax.lax.stop_gradient(moved), k)
  mask = jnp.put_along_axis(jnp.zeros(moved.shape, dtype), indices, jnp.ones((), dtype),
                            axis=-1, inplace=False)
  return jnp.moveaxis(mask, -1, axis)


def hard_topk_mask(x, k: int, axis: int = -1):
  """1 at the k largest entries of ``x`` along ``axis``, 0 elsewhere (zero gradient).

  Args:
    x: float array.
    k: int, 0 <= k <= n.
    axis: the axis to select along.
  """
  x = _validation.as_float_input(x)
  axis = _validation.canonicalize_axis(axis, x.ndim)
  _validation.check_k(k, x.shape[axis], integer=True)
  return _topk_indicator(x, k, axis, x.dtype)


def hard_topk_mag(x, k: int, axis: int = -1):
  """``x`` at the k entries of largest ``|x|`` along ``axis``, 0 elsewhere.

  Its gradient w.r.t. ``x`` is the (constant) mask. Unselected entries are exactly 0,
  also where they are +-inf or NaN.
  """
  x = _validation.as_float_input(x)
  axis = _validation.canonicalize_axis(axis, x.ndim)
  _validation.check_k(k, x.shape[axis], integer=True)
  selected = _topk_indicator(jnp.abs(x), k, axis, x.dtype) > 0
  return jnp.where(selected, x, jnp.zeros_like(x))
