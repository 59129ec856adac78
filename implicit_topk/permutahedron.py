r"""Regularized linear programs over the permutahedron: soft sort, rank, quantile, top-k values.

The permutahedron of :math:`w \in \mathbb{R}^n`, :math:`P(w) = \mathrm{conv}\{w_\sigma\}`,
holds every permutation of ``w``. For a separable regularizer
:math:`\Omega(y) = \sum_i \omega(y_i)`,

.. math::

    y^\star(x; w) = \arg\max_{y \in P(w)}\ \langle x, y\rangle - l\,\Omega(y)

is computed through its isotonic dual (Blondel et al., 2020; ``proofs/isotonic_dual.md``):
with :math:`s = x` sorted descending (permutation :math:`\sigma`) and :math:`w` sorted
descending,

.. math::

    v^\star = \arg\min_{v_1 \ge \dots \ge v_n} \sum_i l\,\omega^*\big((s_i - v_i)/l\big)
              + w_i v_i, \qquad y^\star_{\sigma(i)} = g\big((s_i - v^\star_i)/l\big),

solved exactly by PAV (numba, on the host). The solution is constant on blocks
:math:`B` of consecutive indices, with block value :math:`u_B` the root of
:math:`F_B(u) = \sum_{i \in B} g((s_i - u)/l) - \sum_{i \in B} w_i`.
One host call per batch sorts the rows (radix sort: XLA's sort is ~10x slower on
CPU), runs PAV and returns the block values, the block ids and the permutations;
the ranks (``w`` of soft ranks, ``x`` of soft sorting) are never sorted.

Derivatives: the implicit function theorem on :math:`F(u) = 0` with the block partition
held fixed (``jax.lax.custom_root``). :math:`F_B` depends on :math:`u_B` alone, so the
Jacobian is diagonal and the linear solve is one division per block; :math:`F` is
evaluated with segment sums, so nothing is n x n, forward or backward. Gradients flow
to ``x`` (through the sort), to ``w`` and to ``l``.

The capped simplex is :math:`P((1, \dots, 1, 0, \dots, 0))`; soft ranks use
:math:`w = (n, \dots, 1)`, soft sorting swaps the roles: :math:`x = (n, \dots, 1)` and
:math:`w` = the values.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from implicit_topk import _implicit
from implicit_topk import _validation
from implicit_topk import regularizers
from implicit_topk.solvers import host
from implicit_topk.solvers import pav


def _host_blocks(p, sort_x, sort_w, dtype, kernels, *args):
  """Host side of :func:`_lp`: sorts (numpy), gathers, PAV and block ids (numba).

  ``args`` = (x if sort_x, w if sort_w, l); a missing x or w is the ranks
  (n, ..., 1). Returns (values, ids[, x_order, x_inverse][, w_order]), x's shape.
  """
  l = args[-1]
  shape = args[0].shape if sort_x or sort_w else None
  n = shape[-1]
  ranks = np.arange(n, 0, -1, dtype=dtype)[None]
  rows = list(args[:-1])
  x = rows.pop(0).reshape(-1, n) if sort_x else ranks
  w = rows.pop(0).reshape(-1, n) if sort_w else ranks
  values, ids, x_order, x_inverse, w_order = kernels.permutahedron_blocks(
      x, w, l.reshape(-1), p, sort_x=sort_x, sort_w=sort_w, dtype=dtype)
  out = [values.reshape(shape), ids.reshape(shape)]
  if sort_x:
    out += [x_order.reshape(shape), x_inverse.reshape(shape)]
  if sort_w:
    out.append(w_order.reshape(shape))
  return tuple(out)


def _take_rows(a, index, *, sorted_index=False):
  """``a[r, index[r, i]]`` for (R, n) arrays: one flat gather (XLA's batched gather
  is slower on CPU). Its transpose is one flat scatter-add."""
  rows, n = a.shape
  flat = (index + (jnp.arange(rows, dtype=index.dtype) * n)[:, None]).reshape(-1)
  return a.reshape(-1).at[flat].get(mode="promise_in_bounds",
                                    indices_are_sorted=sorted_index).reshape(a.shape)


def _block_sums(values, ids):
  """Sums of ``values`` over the blocks ``ids`` (nondecreasing, in [0, n)) of each row
  of an (R, n) array, at the block's index: (R, n). Blocks are runs of consecutive
  positions, so the flat segment ids are sorted (a faster scatter on CPU)."""
  rows, n = values.shape
  flat = (ids + (jnp.arange(rows, dtype=ids.dtype) * n)[:, None]).reshape(-1)
  total = jax.ops.segment_sum(values.reshape(-1), flat, num_segments=values.size,
                              indices_are_sorted=True)
  return total.reshape(values.shape)


def _kernel_spec(regularizer):
  """The PAV kernel for a regularizer on a general permutahedron: p-norms and entropy."""
  spec = pav.kernel_spec(regularizer)
  if spec in ("sigmoid", "laplace") or not hasattr(regularizer, "link"):
    raise ValueError(
        "permutahedron operators support the p-norm (any p > 1) and entropy regularizers: "
        f"their links cover the values a permutahedron needs; got {regularizer!r}.")
  return spec


def _lp(x, w, l, regularizer, dtype):
  """The LP along the last axis of (R, n) arrays ``x``, ``w`` (None: the ranks
  (n, ..., 1), already sorted), ``l`` of shape (R,); ``y`` in ``x``'s order.

  The host sorts, solves and returns the block structure and the permutations; the
  gathers by those permutations and the block conditions are JAX (differentiable).
  """
  p = _kernel_spec(regularizer)
  shape = (x if x is not None else w).shape
  n = shape[-1]
  ranks = jnp.broadcast_to(_ranks_vector(n, dtype), shape)
  given = [a for a in (x, w) if a is not None]
  int_shape = jax.ShapeDtypeStruct(shape, jnp.int32)
  out = ((jax.ShapeDtypeStruct(shape, dtype), int_shape)
         + (int_shape, int_shape) * (x is not None) + (int_shape,) * (w is not None))
  solved = host.call(functools.partial(_host_blocks, p, x is not None, w is not None,
                                       np.dtype(dtype)),
                     out, *jax.lax.stop_gradient((*given, l)))
  values, ids, rest = solved[0], solved[1], list(solved[2:])
  if x is not None:
    order, inverse = rest.pop(0), rest.pop(0)
    s = _take_rows(x, order)
  else:
    s = ranks
  w_sorted = _take_rows(w, rest.pop(0)) if w is not None else ranks
  y_sorted = _sorted_argmax(values, ids, s, w_sorted, l, regularizer)
  return _take_rows(y_sorted, inverse) if x is not None else y_sorted


def _sorted_argmax(values, ids, s, w, l, regularizer):
  """y in the order of ``s`` (sorted descending), for w sorted descending: (R, n).

  ``values``/``ids``: the PAV solution's block values and block ids (from the host).
  """
  l_col = l[:, None]
  used = jnp.arange(s.shape[-1]) < ids[:, -1:] + 1  # ids are nondecreasing
  at_blocks = lambda u: _take_rows(u, ids, sorted_index=True)

  def optimality(u, s_, w_, l_):
    z = (s_ - at_blocks(u)) / l_
    return jnp.where(used, _block_sums(regularizer.link(z) - w_, ids), u)

  def solver(init, s_, w_, l_):
    del init, s_, w_, l_  # solved once above (PAV is direct); never differentiated
    return values, jnp.zeros((), values.dtype)

  u, _ = _implicit.implicit_root(solver, optimality, jnp.zeros_like(s), (s, w, l_col),
                                 backend="lax")
  return regularizer.link((s - at_blocks(u)) / l_col)


def _permutahedron(x, w, *, l, p, regularizer, axis, like):
  """The LP along ``axis`` for ``x``, ``w`` of ``like``'s shape (None: the ranks)."""
  axis = _validation.canonicalize_axis(axis, like.ndim)
  _validation.check_positive(l, "l")
  regularizer = regularizers.resolve(regularizer, p)
  dtype = _validation.compute_dtype(like.dtype)
  moved_shape = jnp.moveaxis(like, axis, -1).shape
  if like.size == 0:
    return jnp.zeros(like.shape, like.dtype)
  n = moved_shape[-1]
  rows = lambda a: None if a is None else jnp.moveaxis(a, axis, -1).astype(dtype).reshape(-1, n)
  l_rows = jnp.broadcast_to(jnp.asarray(l, dtype), moved_shape[:-1]).reshape(-1)
  y = _lp(rows(x), rows(w), l_rows, regularizer, dtype).reshape(moved_shape)
  return jnp.moveaxis(y, -1, axis).astype(like.dtype)


def permutahedron_argmax(x, w, *, l=1.0, p: float = 2.0, regularizer=None, axis: int = -1):
  r"""The regularized LP over the permutahedron of ``w``, along ``axis``.

  .. math::

      y^\star = \arg\max_{y \in P(w)} \langle x, y\rangle - l \sum_i \omega(y_i)

  Args:
    x: float array.
    w: the permutahedron's generator, broadcastable to ``x`` (any order).
    l: regularization strength > 0 (scalar or per row).
    p: p-norm exponent > 1 (``regularizer`` overrides it).
    regularizer: ``"entropy"`` or an :class:`~implicit_topk.regularizers.Entropy` (then
      :math:`y = e^{(s - v)/l} > 0`, so ``w`` must be positive: soft ranks; soft sorting
      of positive values), or a p-norm object.
    axis: the axis of the vectors.

  Returns:
    ``y`` with the shape and dtype of ``x``. O(n log n) (one sort, PAV), O(n) memory,
    forward and backward.
  """
  x = _validation.as_float_input(x)
  w = jnp.broadcast_to(jnp.asarray(w, _validation.compute_dtype(x.dtype)), x.shape)
  return _permutahedron(x, w, l=l, p=p, regularizer=regularizer, axis=axis, like=x)


def _ranks_vector(n, dtype):
  return jnp.arange(n, 0, -1, dtype=dtype)  # (n, ..., 1)


def soft_rank(x, *, l=1.0, p: float = 2.0, regularizer=None, axis: int = -1,
              descending: bool = False):
  r"""Soft ranks along ``axis``: :math:`\arg\max_{y \in P((n, \dots, 1))} \langle x, y\rangle - l\,\Omega(y)`.

  Ascending by default (the largest entry gets rank ``n``; ``descending=True``: rank 1).
  As ``l -> 0`` these are the ranks (1-based; ties get their average); as ``l`` grows
  they tend to the mean rank ``(n + 1) / 2``. ``p = 2`` is fast-soft-sort's ``"l2"``
  with ``regularization_strength = l``. Monotone in ``x``. O(n log n).
  """
  x = _validation.as_float_input(x)
  return _permutahedron(-x if descending else x, None, l=l, p=p, regularizer=regularizer,
                        axis=axis, like=x)


def soft_sort(x, *, l=1.0, p: float = 2.0, regularizer=None, axis: int = -1,
              descending: bool = False, topk: int | None = None):
  r"""Soft sort along ``axis``: :math:`\arg\max_{y \in P(x)} \langle (n, \dots, 1), y\rangle - l\,\Omega(y)`.

  The output lies in the permutahedron of ``x`` (a convex combination of its
  permutations, so it has the same sum), ascending by default. As ``l -> 0`` it is
  ``jnp.sort(x)``; as ``l`` grows every entry tends to the mean. ``p = 2`` is
  fast-soft-sort's ``"l2"`` with ``regularization_strength = l``. With ``topk=k``
  only the ``k`` largest soft-sorted values are returned (ascending, as
  ``ott.tools.soft_sort.sort(..., topk=k)``). O(n log n).
  """
  x = _validation.as_float_input(x)
  axis = _validation.canonicalize_axis(axis, x.ndim)
  n = x.shape[axis]
  if topk is not None:
    _validation.check_k(topk, n, integer=True, allow_n=True, name="topk")
  moved = jnp.moveaxis(x, axis, -1)
  sign = 1.0 if descending else -1.0
  y = sign * _permutahedron(None, sign * moved, l=l, p=p, regularizer=regularizer, axis=-1,
                            like=moved)
  if topk is not None:
    y = y[..., :topk] if descending else y[..., n - topk:]
  return jnp.moveaxis(y, -1, axis)


def soft_topk_values(x, k: int, *, l=1.0, p: float = 2.0, regularizer=None, axis: int = -1):
  """The ``k`` largest soft-sorted values along ``axis``, in descending order."""
  return soft_sort(x, l=l, p=p, regularizer=regularizer, axis=axis, descending=True, topk=k)


def soft_quantile(x, q, *, l=1.0, p: float = 2.0, regularizer=None, axis: int = -1):
  r"""Soft quantiles: linear interpolation of the ascending soft sort at ``q (n - 1)``.

  As ``l -> 0`` this is ``jnp.quantile(x, q, axis=axis)`` (its default linear method).
  ``q`` is a scalar or an array of levels in [0, 1]; the result has the batch shape of
  ``x`` (without ``axis``) followed by ``q``'s shape.
  """
  x = _validation.as_float_input(x)
  axis = _validation.canonicalize_axis(axis, x.ndim)
  q = jnp.asarray(q, x.dtype)
  concrete = _validation._concrete(q)  # pylint: disable=protected-access
  if concrete is not None and not np.all((concrete >= 0) & (concrete <= 1)):
    raise ValueError(f"`q` must lie in [0, 1]; got {q!r}.")
  sorted_x = jnp.moveaxis(soft_sort(x, l=l, p=p, regularizer=regularizer, axis=axis), axis, -1)
  n = sorted_x.shape[-1]
  position = q * (n - 1)
  lower = jnp.clip(jnp.floor(position).astype(jnp.int32), 0, n - 1)
  upper = jnp.clip(lower + 1, 0, n - 1)
  frac = position - lower
  pick = lambda i: jnp.take(sorted_x, i.ravel(), axis=-1).reshape(sorted_x.shape[:-1] + q.shape)
  return pick(lower) * (1 - frac) + pick(upper) * frac
