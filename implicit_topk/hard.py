"""Hard (non-differentiable) top-k operators, the limits of the soft ones as l -> 0.

Both use ``jax.lax.top_k`` and a scatter: O(n log k) time, O(n) memory, no one-hot
matrices. Ties are broken by index: among equal values the lower index is selected
(``lax.top_k``'s order). In ``lax.top_k``'s total order a NaN with its sign bit clear
(``jnp.nan``, ``0 / 0`` in Python) is larger than every number and is selected first;
one with its sign bit set (what ``inf - inf`` and ``0 * inf`` give on x86 CPUs) is
smaller than every number and is selected last. ``hard_topk_mag`` ranks ``|x|``, so
every NaN is selected first there.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from implicit_topk import _apply
from implicit_topk import _validation


def _topk_indicator(scores: jax.Array, k: int, axis: int, dtype: Any) -> jax.Array:
  moved = jnp.moveaxis(scores, axis, -1)
  # -0.0 and +0.0 are equal: one zero, so that the tie goes to the lower index
  moved = jnp.where(moved == 0, jnp.zeros_like(moved), moved)
  _, indices = jax.lax.top_k(jax.lax.stop_gradient(moved), k)
  mask = jnp.put_along_axis(jnp.zeros(moved.shape, dtype), indices, jnp.ones((), dtype),
                            axis=-1, inplace=False)
  return jnp.moveaxis(mask, -1, axis)


@_apply.explicit_axes_as_auto
def hard_topk_mask(x: ArrayLike, k: int, axis: int = -1) -> jax.Array:
  r"""1 at the k largest entries of ``x`` along ``axis``, 0 elsewhere (zero gradient).

  .. math::

      \mathrm{topkmask}(x) = \arg\max_{y \in [0,1]^n,\ \sum_i y_i = k}
      \langle x, y\rangle,

  the unregularized linear program whose regularized version is
  :func:`soft_topk_mask` (its limit as ``regularization_strength -> 0``). Ties are
  broken by index (the lower index is selected first).

  Args:
    x: float array (float16/bfloat16 kept as is), at least one dimension.
    k: static Python int, 0 <= k <= n (``n = x.shape[axis]``).
    axis: the axis to select along (default -1).

  Returns:
    An array of 0s and 1s with the shape and dtype of ``x``, ``k`` ones per row.
    Its gradient w.r.t. ``x`` is 0.

  Raises:
    TypeError: ``x`` is not a float array or ``k`` not a Python int.
    ValueError: ``k`` outside ``[0, n]`` or ``axis`` out of range.

  Example:
    >>> import jax.numpy as jnp
    >>> import implicit_topk as itk
    >>> itk.hard_topk_mask(jnp.array([-5., -2., 3., 1.]), 2)
    Array([0., 0., 1., 1.], dtype=float32)
  """
  x = _validation.as_float_input(x)
  axis = _validation.canonicalize_axis(axis, x.ndim)
  _validation.check_k(k, x.shape[axis], integer=True)
  return _topk_indicator(x, k, axis, x.dtype)


@_apply.explicit_axes_as_auto
def hard_topk_mag(x: ArrayLike, k: int, axis: int = -1) -> jax.Array:
  r"""``x`` at the k entries of largest ``|x|`` along ``axis``, 0 elsewhere.

  .. math::

      \mathrm{topkmag}(x)_i = x_i\,\mathrm{topkmask}(|x|)_i
      = \nabla_x \tfrac12 \sum_{j \le k} |x|_{[j]}^2,

  the limit of :func:`soft_topk_mag` as ``regularization_strength -> 0`` (hard
  magnitude pruning). Ties in ``|x|`` are broken by index (lower index first).

  Args:
    x: float array, at least one dimension.
    k: static Python int, 0 <= k <= n (``n = x.shape[axis]``).
    axis: the axis to select along (default -1).

  Returns:
    An array with the shape and dtype of ``x``: ``x`` on the selected entries and
    exactly 0 elsewhere (also where the unselected entries are +-inf or NaN). Its
    gradient w.r.t. ``x`` is the (constant) mask.

  Raises:
    TypeError: ``x`` is not a float array or ``k`` not a Python int.
    ValueError: ``k`` outside ``[0, n]`` or ``axis`` out of range.

  Example:
    >>> import jax.numpy as jnp
    >>> import implicit_topk as itk
    >>> itk.hard_topk_mag(jnp.array([-5., -2., 3., 1.]), 2)
    Array([-5.,  0.,  3.,  0.], dtype=float32)
  """
  x = _validation.as_float_input(x)
  axis = _validation.canonicalize_axis(axis, x.ndim)
  _validation.check_k(k, x.shape[axis], integer=True)
  selected = _topk_indicator(jnp.abs(x), k, axis, x.dtype) > 0
  return jnp.where(selected, x, jnp.zeros_like(x))
