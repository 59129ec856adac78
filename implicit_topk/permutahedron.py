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

solved exactly by pool-adjacent-violators (PAV). The solution is constant on blocks
:math:`B` of consecutive indices, with block value :math:`u_B` the root of
:math:`F_B(u) = \sum_{i \in B} g((s_i - u)/l) - \sum_{i \in B} w_i`.
The ranks (``w`` of soft ranks, ``x`` of soft sorting) are never sorted.

Two solvers give the same blocks (``solver=``):

* ``"pav_jax"`` (what ``"auto"``, the default, picks): pure JAX
  (:mod:`implicit_topk.solvers.isotonic`): XLA sorts, then parallel PAV rounds that
  merge every violating pair of adjacent blocks at once. Works under ``jit``,
  ``vmap``, ``shard_map`` (each shard solves its own rows) and ``jax.export``, on any
  backend.
* ``"pav"``: one host call per batch (numba, :mod:`implicit_topk.solvers.pav_kernels`)
  sorts the rows (radix sort), runs sequential PAV and returns the block values, the
  block ids and the permutations. The fastest on CPU for long rows, but a host
  callback: ``jax.export`` cannot serialize it, and it gathers a sharded input to one
  host.

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

from implicit_topk import _apply
from implicit_topk import _implicit
from implicit_topk import _validation
from implicit_topk import regularizers
from implicit_topk.solvers import host
from implicit_topk.solvers import isotonic
from implicit_topk.solvers import pav

# "auto" is the pure-JAX solver on every backend: the default call must export and shard.
SOLVERS = ("auto", "pav_jax", "pav")


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


def _lp(x, w, l, regularizer, dtype, solver):
  """The LP along the last axis of (R, n) arrays ``x``, ``w`` (None: the ranks
  (n, ..., 1), already sorted), ``l`` of shape (R,); ``y`` in ``x``'s order.

  The solver sorts and returns the block structure and the permutations (``"pav"``:
  on the host; ``"pav_jax"``: in JAX); the gathers by those permutations and the
  block conditions are JAX (differentiable).
  """
  p = _kernel_spec(regularizer)
  shape = (x if x is not None else w).shape
  n = shape[-1]
  ranks = jnp.broadcast_to(_ranks_vector(n, dtype), shape)
  if solver == "pav":
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
    w_order = rest.pop(0) if w is not None else None
  else:
    order = isotonic.descending_order(jax.lax.stop_gradient(x)) if x is not None else None
    w_order = isotonic.descending_order(jax.lax.stop_gradient(w)) if w is not None else None
    if x is not None:
      inverse = _inverse_permutation(order)
  s = _take_rows(x, order) if x is not None else ranks
  w_sorted = _take_rows(w, w_order) if w is not None else ranks
  if solver != "pav":
    values, ids = _jax_blocks(*jax.lax.stop_gradient((s, w_sorted, l)), kind=p)
  y_sorted = _sorted_argmax(values, ids, s, w_sorted, l, regularizer)
  return _take_rows(y_sorted, inverse) if x is not None else y_sorted


@functools.partial(jax.jit, static_argnames=("kind",))
def _jax_blocks(s, w, l, *, kind):
  """The pure-JAX blocks for the kernel spec ``kind`` (a p, or ``"exp"``); one jit,
  so that eager calls with the same shapes do not trace the rounds again."""
  regularizer = regularizers.Entropy() if kind == "exp" else regularizers.PNorm(kind)
  values, ids, _ = isotonic.isotonic_blocks(s, w, l, regularizer)
  return values, ids


def _inverse_permutation(order):
  """``inverse[r, order[r, i]] = i`` for (R, n) permutations: one flat scatter."""
  rows, n = order.shape
  flat = (order + (jnp.arange(rows, dtype=order.dtype) * n)[:, None]).reshape(-1)
  iota = jnp.broadcast_to(jnp.arange(n, dtype=order.dtype), order.shape).reshape(-1)
  return jnp.zeros_like(order).reshape(-1).at[flat].set(
      iota, mode="promise_in_bounds", unique_indices=True).reshape(order.shape)


def _sorted_argmax(values, ids, s, w, l, regularizer):
  """y in the order of ``s`` (sorted descending), for w sorted descending: (R, n).

  ``values``/``ids``: the PAV solution's block values and block ids (from either solver).
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

  # init like the values (not s): under shard_map, s = the ranks is not varying.
  u, _ = _implicit.implicit_root(solver, optimality, jnp.zeros_like(values), (s, w, l_col),
                                 backend="lax")
  y = regularizer.link((s - at_blocks(u)) / l_col)
  # A singleton block's condition is link(z_i) = w_i, so y_i = w_i, derivatives included;
  # through the link they would be 0 / 0 where w_i = 0 (link'(0) = 0 for p < 2, inf for p > 2).
  before = jnp.pad(ids[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
  after = jnp.pad(ids[:, 1:], ((0, 0), (0, 1)), constant_values=-1)
  singleton = (ids != before) & (ids != after) & ~jnp.isnan(y)  # NaN rows stay NaN
  return jnp.where(singleton, w, y)


def _permutahedron(x, w, *, l, p, regularizer, axis, solver):
  """The LP along ``axis`` for ``x``, ``w`` (None: the ranks; an array given for both
  has one shape): the shape and dtype of the given array."""
  data = x if x is not None else w
  axis = _validation.canonicalize_axis(axis, data.ndim)
  _validation.check_positive(l, "l")
  _validation.check_choice(solver, "solver", SOLVERS)
  solver = "pav_jax" if solver == "auto" else solver
  regularizer = regularizers.resolve(regularizer, p)

  def on_rows(moved):
    if moved.size == 0:
      return jnp.zeros(moved.shape, moved.dtype)
    dtype, n = moved.dtype, moved.shape[-1]
    rows = lambda a: a.reshape(-1, n)
    other = None
    if x is not None and w is not None:  # w travels with x
      other = rows(jnp.moveaxis(w, axis, -1).astype(dtype))
    l_rows = jnp.broadcast_to(jnp.asarray(l, dtype), moved.shape[:-1]).reshape(-1)
    x_rows = rows(moved) if x is not None else None
    w_rows = other if x is not None else rows(moved)
    return _lp(x_rows, w_rows, l_rows, regularizer, dtype, solver).reshape(moved.shape)

  return _apply.apply_on_axis(on_rows, data, axis)


def permutahedron_argmax(x, w, *, l=1.0, p: float = 2.0, regularizer=None, axis: int = -1,
                         solver: str = "auto"):
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
    solver: ``"auto"`` (the default: ``"pav_jax"`` on every backend), ``"pav_jax"``
      (pure JAX: works with ``jax.export`` and ``shard_map``, where each shard solves
      its own rows) or ``"pav"`` (numba on the host: the fastest on CPU for long rows,
      but a host callback, which ``jax.export`` cannot serialize and which gathers a
      sharded input to one host). Both give the same blocks (to rounding).

  Returns:
    ``y`` with the shape and dtype of ``x``. One sort per row, O(n) memory, forward
    and backward; ``"pav"`` solves in O(n) after the sort, ``"pav_jax"`` in parallel
    rounds of O(n) work each (typically a few; at most n).
  """
  x = _validation.as_float_input(x)
  w = jnp.broadcast_to(jnp.asarray(w, _validation.compute_dtype(x.dtype)), x.shape)
  return _permutahedron(x, w, l=l, p=p, regularizer=regularizer, axis=axis, solver=solver)


def _ranks_vector(n, dtype):
  return jnp.arange(n, 0, -1, dtype=dtype)  # (n, ..., 1)


def soft_rank(x, *, l=1.0, p: float = 2.0, regularizer=None, axis: int = -1,
              descending: bool = False, solver: str = "auto"):
  r"""Soft ranks along ``axis``: :math:`\arg\max_{y \in P((n, \dots, 1))} \langle x, y\rangle - l\,\Omega(y)`.

  Ascending by default (the largest entry gets rank ``n``; ``descending=True``: rank 1).
  As ``l -> 0`` these are the ranks (1-based; ties get their average); as ``l`` grows
  they tend to the mean rank ``(n + 1) / 2``. ``p = 2`` is fast-soft-sort's ``"l2"``
  with ``regularization_strength = l``. Monotone in ``x``. O(n log n).

  ``solver``: ``"auto"`` (default) = ``"pav_jax"``, pure JAX (``jax.export``,
  ``shard_map``); ``"pav"`` = numba on the host, the fastest on CPU for long rows but
  not exportable with ``jax.export`` and gathering a sharded input to one host (see
  :func:`permutahedron_argmax`).
  """
  x = _validation.as_float_input(x)
  return _permutahedron(-x if descending else x, None, l=l, p=p, regularizer=regularizer,
                        axis=axis, solver=solver)


def soft_sort(x, *, l=1.0, p: float = 2.0, regularizer=None, axis: int = -1,
              descending: bool = False, topk: int | None = None, solver: str = "auto"):
  r"""Soft sort along ``axis``: :math:`\arg\max_{y \in P(x)} \langle (n, \dots, 1), y\rangle - l\,\Omega(y)`.

  The output lies in the permutahedron of ``x`` (a convex combination of its
  permutations, so it has the same sum), ascending by default. As ``l -> 0`` it is
  ``jnp.sort(x)``; as ``l`` grows every entry tends to the mean. ``p = 2`` is
  fast-soft-sort's ``"l2"`` with ``regularization_strength = l``. With ``topk=k``
  only the ``k`` largest soft-sorted values are returned (ascending, as
  ``ott.tools.soft_sort.sort(..., topk=k)``). O(n log n).

  ``solver``: ``"auto"`` (default) = ``"pav_jax"``, pure JAX (``jax.export``,
  ``shard_map``); ``"pav"`` = numba on the host, the fastest on CPU for long rows but
  not exportable with ``jax.export`` and gathering a sharded input to one host (see
  :func:`permutahedron_argmax`).
  """
  x = _validation.as_float_input(x)
  axis = _validation.canonicalize_axis(axis, x.ndim)
  n = x.shape[axis]
  if topk is not None:
    _validation.check_k(topk, n, integer=True, allow_n=True, name="topk")
  moved = jnp.moveaxis(x, axis, -1)
  sign = 1.0 if descending else -1.0
  y = sign * _permutahedron(None, sign * moved, l=l, p=p, regularizer=regularizer, axis=-1,
                            solver=solver)
  if topk is not None:
    y = y[..., :topk] if descending else y[..., n - topk:]
  return jnp.moveaxis(y, -1, axis)


def soft_topk_values(x, k: int, *, l=1.0, p: float = 2.0, regularizer=None, axis: int = -1,
                     solver: str = "auto"):
  """The ``k`` largest soft-sorted values along ``axis``, in descending order.

  ``solver``: as :func:`soft_sort` (``"auto"`` = ``"pav_jax"``, pure JAX; ``"pav"``,
  numba on the host, is not exportable with ``jax.export``).
  """
  return soft_sort(x, l=l, p=p, regularizer=regularizer, axis=axis, descending=True, topk=k,
                   solver=solver)


def soft_quantile(x, q, *, l=1.0, p: float = 2.0, regularizer=None, axis: int = -1,
                  solver: str = "auto"):
  r"""Soft quantiles: linear interpolation of the ascending soft sort at ``q (n - 1)``.

  As ``l -> 0`` this is ``jnp.quantile(x, q, axis=axis)`` (its default linear method).
  ``q`` is a scalar or an array of levels in [0, 1]; the result has the batch shape of
  ``x`` (without ``axis``) followed by ``q``'s shape. ``solver``: as :func:`soft_sort`
  (``"auto"`` = ``"pav_jax"``, pure JAX; ``"pav"``, numba on the host, is not
  exportable with ``jax.export``).
  """
  x = _validation.as_float_input(x)
  axis = _validation.canonicalize_axis(axis, x.ndim)
  q = jnp.asarray(q, x.dtype)
  concrete = _validation._concrete(q)  # pylint: disable=protected-access
  if concrete is not None and not np.all((concrete >= 0) & (concrete <= 1)):
    raise ValueError(f"`q` must lie in [0, 1]; got {q!r}.")
  sorted_x = jnp.moveaxis(soft_sort(x, l=l, p=p, regularizer=regularizer, axis=axis,
                                    solver=solver), axis, -1)
  n = sorted_x.shape[-1]
  position = q * (n - 1)
  lower = jnp.clip(jnp.floor(position).astype(jnp.int32), 0, n - 1)
  upper = jnp.clip(lower + 1, 0, n - 1)
  frac = position - lower
  pick = lambda i: jnp.take(sorted_x, i.ravel(), axis=-1).reshape(sorted_x.shape[:-1] + q.shape)
  return pick(lower) * (1 - frac) + pick(upper) * frac
