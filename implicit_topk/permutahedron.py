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


def _host_dual(p, pav_kernels, s, w, l):
  """PAV on the host: block values (padded with 0) and block ids, per row."""
  batch_shape, n = s.shape[:-1], s.shape[-1]
  s2 = s.reshape(-1, n)
  w2 = np.broadcast_to(np.asarray(w), s.shape).reshape(-1, n)
  l2 = np.broadcast_to(np.asarray(l, np.float64), batch_shape).reshape(-1)
  v = pav_kernels.isotonic_pav(s2, w2, l2, p)
  # Blocks are runs of equal values (adjacent PAV blocks with equal values satisfy the
  # merged block condition too). Rows with non-finite input give NaN: one block each.
  new_block = np.concatenate([np.ones((v.shape[0], 1), bool), v[:, 1:] != v[:, :-1]], axis=1)
  new_block |= np.isnan(v)
  ids = np.cumsum(new_block, axis=1) - 1
  values = np.zeros_like(v)
  rows = np.repeat(np.arange(v.shape[0])[:, None], n, axis=1)
  values[rows, ids] = v
  return (values.astype(s.dtype).reshape(s.shape),
          ids.astype(np.int32).reshape(s.shape))


def _segment_sum(values, ids):
  """Sums ``values`` over the segments ``ids`` (in [0, n)) of each row: shape of values."""
  n = values.shape[-1]
  flat_values = values.reshape(-1, n)
  offsets = (jnp.arange(flat_values.shape[0]) * n)[:, None]
  total = jax.ops.segment_sum(flat_values.ravel(), (ids.reshape(-1, n) + offsets).ravel(),
                              num_segments=flat_values.size)
  return total.reshape(values.shape)


def _kernel_spec(regularizer):
  """The PAV kernel for a regularizer on a general permutahedron: p-norms and entropy."""
  spec = pav.kernel_spec(regularizer)
  if spec in ("sigmoid", "laplace") or not hasattr(regularizer, "link"):
    raise ValueError(
        "permutahedron operators support the p-norm (any p > 1) and entropy regularizers: "
        f"their links cover the values a permutahedron needs; got {regularizer!r}.")
  return spec


def _sorted_argmax(s, w, l, regularizer):
  """y in the order of ``s`` (sorted descending), for w sorted descending (last axis)."""
  p = _kernel_spec(regularizer)
  l_row = jnp.broadcast_to(l, s.shape[:-1])[..., None]

  def solve_on_host(s_, w_, l_):
    out = (jax.ShapeDtypeStruct(s_.shape, s_.dtype), jax.ShapeDtypeStruct(s_.shape, jnp.int32))
    return host.call(functools.partial(_host_dual, p), out, s_, w_, l_)

  values, ids = solve_on_host(*jax.lax.stop_gradient((s, w, l_row[..., 0])))
  n_blocks = jnp.max(ids, axis=-1, keepdims=True) + 1
  used = jnp.arange(s.shape[-1]) < n_blocks

  def optimality(u, s_, w_, l_):
    z = (s_ - jnp.take_along_axis(u, ids, axis=-1)) / l_
    residual = _segment_sum(regularizer.link(z) - w_, ids)
    return jnp.where(used, residual, u)

  def solver(init, s_, w_, l_):
    del init, s_, w_, l_  # solved once above (PAV is direct); never differentiated
    return values, jnp.zeros((), values.dtype)

  u, _ = _implicit.implicit_root(solver, optimality, jnp.zeros_like(s), (s, w, l_row),
                                 backend="lax")
  return regularizer.link((s - jnp.take_along_axis(u, ids, axis=-1)) / l_row)


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
  axis = _validation.canonicalize_axis(axis, x.ndim)
  _validation.check_positive(l, "l")
  regularizer = regularizers.resolve(regularizer, p)
  dtype = _validation.compute_dtype(x.dtype)
  moved = jnp.moveaxis(x, axis, -1).astype(dtype)
  w = jnp.broadcast_to(jnp.moveaxis(jnp.broadcast_to(jnp.asarray(w, dtype), x.shape), axis, -1),
                       moved.shape)
  order = jax.lax.stop_gradient(jnp.argsort(-moved, axis=-1))
  s = jnp.take_along_axis(moved, order, axis=-1)
  w_sorted = -jnp.sort(-w, axis=-1)
  y_sorted = _sorted_argmax(s, w_sorted, jnp.asarray(l, dtype), regularizer)
  inverse = jnp.argsort(order, axis=-1)
  y = jnp.take_along_axis(y_sorted, inverse, axis=-1)
  return jnp.moveaxis(y, -1, axis).astype(x.dtype)


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
  axis = _validation.canonicalize_axis(axis, x.ndim)
  n = x.shape[axis]
  w = jnp.moveaxis(jnp.broadcast_to(_ranks_vector(n, x.dtype), jnp.moveaxis(x, axis, -1).shape),
                   -1, axis)
  return permutahedron_argmax(-x if descending else x, w, l=l, p=p, regularizer=regularizer,
                              axis=axis)


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
  ranks = jnp.broadcast_to(_ranks_vector(n, x.dtype), moved.shape)
  sign = 1.0 if descending else -1.0
  y = sign * permutahedron_argmax(ranks, sign * moved, l=l, p=p, regularizer=regularizer)
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
