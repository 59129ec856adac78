r"""Reduction layouts: which entries form one "row" of a threshold problem.

A threshold problem (:mod:`implicit_topk.problems`) only ever needs, per row, sums,
maxima, minima and counts of elementwise quantities of its input, and a way to send a
per-row value (the threshold :math:`\lambda`, ``k``, ``l``) back to the row's entries.
A layout provides exactly that, so one problem (the mask, the magnitude operator) and
one solver (the sort-free Newton iteration, its implicit derivatives) serve every
shape of "row":

* :class:`LastAxis` (the default): rows are the last axis of an array ``(..., n)``; with
  ``axis_name`` the last axis is split over that mesh axis (inside
  :func:`jax.shard_map`) and every reduction adds one ``psum``/``pmax``/``pmin``
  across devices: a Newton step costs an all-reduce of a few scalars per row.
* :class:`Segments`: rows are the segments of the last axis given by integer
  ``segment_ids`` (ragged rows of a flat array): :func:`jax.ops.segment_sum` and
  friends reduce, a gather by ``segment_ids`` broadcasts back. O(n), no padding.
* :class:`Tree`: one row made of every entry of every leaf of a pytree (one global
  threshold): each leaf is reduced on its own and the results are combined, and
  elementwise maps are ``jax.tree.map``. Leaves are never concatenated, so they may be
  sharded differently.

The interface (``x`` is what the problem reads: an array, or a pytree for ``Tree``;
per-row values have the layout's row shape):

* ``map(f, *entries)``: ``f`` applied elementwise (per leaf for a pytree); per-row
  arguments must first go through ``expand``.
* ``expand(r, x)``: per-row values ``r`` in a form that broadcasts against ``x``'s
  entries.
* ``sum(v)``, ``max(v)``, ``min(v)``, ``any(v)``, ``count(v, dtype)``: per-row
  reductions of elementwise values (``max`` of an empty row is ``-inf``, ``min``
  ``+inf``).
* ``row_shape(x)``, ``dtype(x)``, ``zeros(x)`` (per-row zeros that keep the varying
  mesh axes of ``x`` under ``shard_map``), ``asarray(x)``.
* ``sortable``: whether the row is a contiguous last axis on one device (the solvers
  that sort, ``"pav"`` and ``"dykstra"``, need that).

Layouts that sit in a ``jax.jit`` cache (inside a problem, inside a solver) are frozen,
hashable dataclasses. :class:`Segments` holds its ``segment_ids`` array only once
*bound* (:meth:`Segments.bind`, done inside the traced function), so the cached,
static part is only ``num_segments``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Hashable

import jax
import jax.numpy as jnp
import numpy as np


def _bound_axis_names() -> tuple:
  """The mesh axis names bound where this is traced (best effort, for messages)."""
  try:
    from jax._src import core  # pylint: disable=g-import-not-at-top
    return tuple(core.unsafe_get_axis_names())
  except Exception:  # pylint: disable=broad-except
    return ()


def check_axis_name(axis_name, x=None, name: str = "axis_name") -> None:
  """Raises ``ValueError`` naming ``axis_name`` when it is not a bound mesh axis.

  Inside :func:`jax.shard_map` (or ``pmap``) the axis must be one of the mesh axes the
  function is mapped over. When ``x`` is given and JAX tracks which mesh axes a value
  varies over (``shard_map(..., check_vma=True)``, the default), ``x`` must vary over
  ``axis_name``: otherwise the reduced axis is not split over it and the per-device
  sums would count the same entries several times.
  """
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  for one in names:
    try:
      jax.lax.axis_size(one)
    except (NameError, ValueError, KeyError, TypeError):
      bound = _bound_axis_names()
      where = (f"the mesh axes bound here are {list(bound)}" if bound else
               "no mesh axis is bound here: call the operator inside jax.shard_map over a "
               "mesh with that axis (under jax.jit with NamedSharding, leave axis_name=None)")
      raise ValueError(f"`{name}`={axis_name!r} is not a mesh axis of the enclosing "
                       f"shard_map; {where}.") from None
  if x is None:
    return
  try:
    from jax._src import config  # pylint: disable=g-import-not-at-top
    if not config._check_vma.value:  # pylint: disable=protected-access
      return  # shard_map(check_vma=False): JAX does not track it, nothing to check
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is None:  # newer JAX: the varying axes live in the manual axis type
      vma = aval.manual_axis_type.varying
  except Exception:  # pylint: disable=broad-except
    return
  if not set(names) <= set(vma):
    raise ValueError(
        f"`{name}`={axis_name!r}: the input does not vary over that mesh axis (it varies "
        f"over {sorted(vma)}), so its reduced axis is not split over it; pass the mesh "
        "axis that splits the reduced axis, or axis_name=None.")


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def _pextreme(value, axis_name, largest: bool):
  """``pmax``/``pmin`` across devices, with the derivative of the device(s) holding the
  extreme (ties share it equally, as ``jnp.max`` does); lax.pmax has no JVP rule."""
  return (jax.lax.pmax if largest else jax.lax.pmin)(value, axis_name)


@_pextreme.defjvp
def _pextreme_jvp(axis_name, largest, primals, tangents):
  (value,), (tangent,) = primals, tangents
  out = _pextreme(value, axis_name, largest)
  at = (value == out).astype(tangent.dtype)
  count = jax.lax.psum(at, axis_name)
  return out, jax.lax.psum(at * tangent, axis_name) / jnp.maximum(count, 1)


@dataclasses.dataclass(frozen=True)
class LastAxis:
  """Rows are the last axis of an array ``(..., n)``; leading axes are batch axes.

  The default layout of every problem. Per-row values have shape ``x.shape[:-1]``.

  Attributes:
    axis_name: ``None`` (default), or the mesh axis (or tuple of axes) over which the
      last axis is split inside :func:`jax.shard_map`: every reduction then adds a
      ``psum``/``pmax``/``pmin`` across devices.
  """

  axis_name: Hashable | None = None

  @property
  def sortable(self) -> bool:
    return self.axis_name is None

  def asarray(self, x):
    return jnp.asarray(x)

  def dtype(self, x):
    return x.dtype

  def row_shape(self, x) -> tuple:
    return x.shape[:-1]

  def zeros(self, x):
    # zeros_like of a per-row reduction of x: keeps x's varying mesh axes under
    # shard_map and its sharding on an Explicit mesh (a slice of a sharded axis would
    # not), and the reduction itself is dead code. With axis_name, reduced like every
    # other per-row value (invariant over that mesh axis).
    if self.axis_name is None:
      return jnp.zeros_like(jnp.sum(x, axis=-1))
    return self.sum(jnp.zeros_like(x[..., :1]))

  def map(self, f: Callable, *entries):
    return f(*entries)

  def expand(self, r, x):
    return jnp.broadcast_to(jnp.asarray(r, x.dtype), x.shape[:-1])[..., None]

  def _all(self, value, collective):
    return value if self.axis_name is None else collective(value, self.axis_name)

  def sum(self, v):
    return self._all(jnp.sum(v, axis=-1), jax.lax.psum)

  def max(self, v):
    return self._all(jnp.max(v, axis=-1, initial=-jnp.inf),
                     lambda value, name: _pextreme(value, name, True))

  def min(self, v):
    return self._all(jnp.min(v, axis=-1, initial=jnp.inf),
                     lambda value, name: _pextreme(value, name, False))

  def count(self, v, dtype):
    return self.sum(v.astype(dtype))

  def any(self, v):
    if self.axis_name is None:
      return jnp.any(v, axis=-1)
    return self.count(v, jnp.int32) > 0


@dataclasses.dataclass(frozen=True)
class Segments:
  """Rows are the segments of the last axis (ragged rows of a flat array).

  Entry ``i`` belongs to row ``segment_ids[i]`` in ``[0, num_segments)``; leading
  axes are batch axes. ``segment_ids`` is data: it is bound inside the traced
  computation (:meth:`bind`); the unbound layout (``segment_ids=None``) is the
  hashable part that jit caches key on. Per-row values have shape
  ``batch + (num_segments,)``. An id outside ``[0, num_segments)`` (traced ids are not
  checked) reads its segment's values as NaN.

  Attributes:
    num_segments: the number of rows, an int >= 1.
    indices_are_sorted: whether ``segment_ids`` is nondecreasing (default
      ``False``), passed to :func:`jax.ops.segment_sum` and friends.
    segment_ids: integer array of shape ``(n,)``, or ``None`` (default) until bound.
  """

  num_segments: int
  indices_are_sorted: bool = False
  segment_ids: Any = None

  sortable = False

  def bind(self, segment_ids) -> "Segments":
    """This layout with ``segment_ids`` (an integer array of shape ``(n,)``) bound."""
    return dataclasses.replace(self, segment_ids=segment_ids)

  def _ids(self):
    if self.segment_ids is None:
      raise ValueError("Segments layout used before its segment_ids were bound "
                       "(Segments(num_segments).bind(segment_ids)).")
    return self.segment_ids

  def asarray(self, x):
    return jnp.asarray(x)

  def dtype(self, x):
    return x.dtype

  def row_shape(self, x) -> tuple:
    return x.shape[:-1] + (self.num_segments,)

  def zeros(self, x):
    return jnp.zeros(self.row_shape(x), x.dtype)

  def map(self, f: Callable, *entries):
    return f(*entries)

  def expand(self, r, x):
    r = jnp.broadcast_to(jnp.asarray(r, x.dtype), self.row_shape(x))
    ids = self._ids()
    taken = jnp.take(r, ids, axis=-1, mode="fill", fill_value=jnp.nan)
    # NaN at every out-of-range id: jnp.take wraps ids in [-num_segments, 0) (as NumPy
    # indexes), where the reductions (segment_sum, ...) drop them
    return jnp.where(ids < 0, jnp.nan, taken)

  def _reduce(self, op, v):
    moved = jnp.moveaxis(v, -1, 0)
    out = op(moved, self._ids(), num_segments=self.num_segments,
             indices_are_sorted=self.indices_are_sorted)
    return jnp.moveaxis(out, 0, -1)

  def sum(self, v):
    return self._reduce(jax.ops.segment_sum, v)

  def max(self, v):
    return self._reduce(jax.ops.segment_max, v)

  def min(self, v):
    return self._reduce(jax.ops.segment_min, v)

  def count(self, v, dtype):
    return self.sum(v.astype(dtype))

  def any(self, v):
    return self.count(v, jnp.int32) > 0


@dataclasses.dataclass(frozen=True)
class Tree:
  """One row made of every entry of every leaf of a pytree (one global threshold).

  Each leaf is reduced on its own (over all its axes) and the per-leaf results are
  combined; per-row values are scalars. Leaves are never concatenated, so each keeps
  its own sharding. No fields.
  """

  sortable = False

  def asarray(self, x):
    return jax.tree.map(jnp.asarray, x)

  def dtype(self, x):
    return jnp.result_type(*jax.tree.leaves(x))

  def row_shape(self, x) -> tuple:
    return ()

  def zeros(self, x):
    return jnp.zeros((), self.dtype(x))

  def map(self, f: Callable, *entries):
    return jax.tree.map(f, *entries)

  def expand(self, r, x):
    r = jnp.asarray(r, self.dtype(x))
    return jax.tree.map(lambda _: r, x)

  def _combine(self, per_leaf: Callable, combine: Callable, v):
    values = [per_leaf(leaf) for leaf in jax.tree.leaves(v)]
    out = values[0]
    for value in values[1:]:
      out = combine(out, value)
    return out

  def sum(self, v):
    return self._combine(jnp.sum, jnp.add, v)

  def max(self, v):
    return self._combine(lambda a: jnp.max(a, initial=-jnp.inf), jnp.maximum, v)

  def min(self, v):
    return self._combine(lambda a: jnp.min(a, initial=jnp.inf), jnp.minimum, v)

  def count(self, v, dtype):
    return self._combine(lambda a: jnp.sum(a.astype(dtype)), jnp.add, v)

  def any(self, v):
    return self._combine(jnp.any, jnp.logical_or, v)


DEFAULT = LastAxis()

__all__ = ["LastAxis", "Segments", "Tree", "DEFAULT", "check_axis_name"]
