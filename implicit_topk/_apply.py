"""The plumbing every public operator shares: validate, move the axis, compute, restore.

:func:`apply_on_axis` runs a last-axis function along any ``axis`` of a float input, in
float32 for half types (cast back after), and :func:`threshold_operator` runs a solver
of :mod:`implicit_topk.solvers` that way behind one cached ``jax.jit``, so that eager
calls with the same shapes and options do not trace or compile again.
"""

from __future__ import annotations

import numbers
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import export
import numpy as np
from jax.typing import ArrayLike

from implicit_topk import _standardize
from implicit_topk import _validation
from implicit_topk import support_budget
from implicit_topk.solvers import base as _solvers_base
from implicit_topk.problems import layout as _layout

#: The public name of the regularization strength ``l``, used in error messages.
STRENGTH = "regularization_strength"


def apply_on_axis(fn: Callable, x: ArrayLike, axis: int, *, name: str = "x") -> Any:
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


def _static(dim: Any) -> int | None:
  """``dim`` as an int, or None where it is symbolic (``jax.export`` shape polymorphism)."""
  return None if export.is_symbolic_dim(dim) else int(dim)


def input_size(x: Any) -> int | None:
  """The number of entries of ``x`` (an array, tracer or nested list), or None where a
  dimension is symbolic."""
  shape = np.shape(x)
  return None if any(export.is_symbolic_dim(d) for d in shape) else int(np.prod(shape, dtype=np.int64))


def row_length(x: Any, axis: int) -> int | None:
  """The length of ``axis`` of ``x`` (an array, tracer or nested list), or None where
  there is none or it is symbolic."""
  shape = np.shape(x)
  try:
    return _static(shape[axis])
  except (IndexError, TypeError):
    return None


def reduced_axis_is_sharded(x: Any, axis: int) -> bool:
  """Whether ``axis`` of ``x`` is split over devices, as far as can be seen here: a
  concrete array with a ``NamedSharding`` along it, or a traced value whose type
  carries such a sharding (explicit mesh axes). A sharding XLA picks later, under
  ``jit`` with automatic axes, is not visible and counts as not split. A bad ``axis``
  counts as not split (the operator's own check names it)."""
  if not isinstance(axis, numbers.Integral):
    return False
  try:
    ndim = np.ndim(x)
    axis = axis % ndim if ndim else 0
    sharding = getattr(x, "sharding", None) if not isinstance(x, jax.core.Tracer) else None
    spec = getattr(sharding, "spec", None)
    if spec is None:
      spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
  except Exception:  # not an array (a list, a scalar): not sharded
    return False
  return spec is not None and axis < len(spec) and spec[axis] is not None


def _explicit_mesh(leaves):
  """The mesh of the first array among ``leaves`` whose type is split over an Explicit
  mesh axis, or None."""
  for leaf in leaves:
    if not isinstance(leaf, jax.Array):
      continue
    sharding = getattr(jax.typeof(leaf), "sharding", None)
    mesh, spec = getattr(sharding, "mesh", None), getattr(sharding, "spec", None)
    if mesh is None or spec is None or not getattr(mesh, "explicit_axes", ()):
      continue
    if any(entry is not None for entry in spec):
      return mesh
  return None


def _axes_auto(mesh):
  """A context in which ``mesh``'s Explicit axes are Auto (as in
  :func:`jax.sharding.auto_axes`)."""
  return jax.sharding.use_abstract_mesh(mesh.update_axis_types(
      {name: jax.sharding.AxisType.Auto for name in mesh.explicit_axes}))


def _spec_of(x) -> tuple:
  spec = tuple(jax.typeof(x).sharding.spec) if isinstance(x, jax.Array) else ()
  return spec + (None,) * (np.ndim(x) - len(spec))


def _output_spec(out_shape, x_shape, x_spec, axis):
  """The sharding of an output of shape ``out_shape`` computed along ``axis`` of an input
  of shape ``x_shape`` sharded by ``x_spec``: that of the input where the shapes agree
  (the reduced axis only when the whole shape does; batch axes otherwise), else replicated."""
  out_shape = tuple(out_shape)
  if out_shape == tuple(x_shape):
    return jax.sharding.PartitionSpec(*x_spec)
  ndim = len(x_shape)
  axis = axis % ndim if ndim else 0
  if len(out_shape) == ndim:  # the reduced axis replaced (e.g. top-k values, per-segment values)
    return jax.sharding.PartitionSpec(*(s if i != axis and out_shape[i] == x_shape[i] else None
                                        for i, s in enumerate(x_spec)))
  batch_shape = x_shape[:axis] + x_shape[axis + 1:]
  if out_shape[:len(batch_shape)] == batch_shape:  # the reduced axis dropped (per-row values)
    return jax.sharding.PartitionSpec(*(x_spec[:axis] + x_spec[axis + 1:]))
  return jax.sharding.PartitionSpec()


def explicit_axes_as_auto(fn: Callable) -> Callable:
  """Runs the operator ``fn(x, ...)`` on inputs split over Explicit mesh axes with those
  axes turned Auto, as :func:`jax.sharding.auto_axes` does: XLA then partitions its
  sorts, gathers and scatters as on an Auto mesh (where the sharding types of an
  Explicit mesh refuse them). Outputs keep the sharding of ``x`` along the axes they
  share with it (see :func:`_output_spec`); ``axis`` is read from the keyword
  arguments (default -1). Other calls go to ``fn`` unchanged.
  """

  @functools.wraps(fn)
  def wrapper(x, *args, **kwargs):
    return call_with_auto_axes(fn, x, *args, reduced_axis=kwargs.get("axis", -1), **kwargs)

  return wrapper


def call_with_auto_axes(fn: Callable, x: Any, *args: Any, reduced_axis: int,
                        **kwargs: Any) -> Any:
  """``fn(x, *args, **kwargs)``, with the Explicit mesh axes of its array arguments
  turned Auto (see :func:`explicit_axes_as_auto`; ``reduced_axis`` is the axis of ``x``
  that ``fn`` reduces)."""
  leaves, treedef = jax.tree.flatten((x, args, kwargs))
  mesh = _explicit_mesh(leaves)
  if mesh is None:
    return fn(x, *args, **kwargs)
  is_array = [isinstance(leaf, jax.Array) for leaf in leaves]
  with _axes_auto(mesh):
    leaves = [jax.sharding.reshard(leaf, jax.sharding.PartitionSpec()) if array else leaf
              for leaf, array in zip(leaves, is_array)]
    x_, args_, kwargs_ = jax.tree.unflatten(treedef, leaves)
    out = fn(x_, *args_, **kwargs_)
  x_spec, x_shape = _spec_of(x), np.shape(x)
  return jax.tree.map(
      lambda y: jax.sharding.reshard(y, jax.sharding.NamedSharding(
          mesh, _output_spec(np.shape(y), x_shape, x_spec, reduced_axis))), out)


def _solve(solver, rows, k, l, *, where=None, return_info=False, standardize=None,
           max_support=None):
  """The operator on ``rows`` laid out by ``solver.layout``: normalize, solve, map back.

  ``where`` (same shape as ``rows``): entries outside it take the problem's
  ``excluded_value`` (never selected) and are returned as exactly 0. ``standardize``
  (None or a power ``a``): the strength is ``l`` times each row's standard deviation
  ``s`` to the power ``a`` (:func:`implicit_topk._standardize.row_spread`); for a problem
  with an ``output_degree`` (the top-k in magnitude, ``a = 2 - p``) solved as the row
  ``x / s`` at ``l`` with the output times ``s`` to that degree (the same operator: ``a``
  is the power that makes it so), so that the strength never leaves the float range
  however small or large the spread (``l s^(2-p)`` at p = 5 and a spread of 1e-10 is
  1e30 times ``l``). ``max_support``
  (None or an int ``m``; whole rows or segments, p-norms): the mask at the largest strength
  at most ``l`` whose mask has at most ``m`` nonzero entries, from the row's ``m + 1`` largest
  values without the solver (:mod:`implicit_topk.support_budget`; ``return_info`` then
  reports 0 passes).
  """
  layout = solver.layout
  spread = None
  if where is not None:  # (first: a NaN or inf excluded entry has no derivative to give)
    rows = jnp.where(where, rows, jnp.asarray(solver.problem.excluded_value, rows.dtype))
  if standardize is not None and solver.problem.output_degree:
    spread = _standardize.row_spread(layout, rows, where)
    rows = layout.map(_standardize.divide, rows, layout.expand(spread, rows))
  elif standardize is not None:
    # the mask (degree 0): l s, NaN rows where it leaves the strengths' range (documented;
    # dividing the row instead would cost its backward a reduction through s: +12% in
    # graph at 16384 x 8, forward+backward)
    l = l * _standardize.row_spread(layout, rows, where) ** standardize
  dtype, row_shape = layout.dtype(rows), layout.row_shape(rows)
  k_rows = jnp.broadcast_to(jnp.asarray(k, dtype), row_shape)
  l_rows = jnp.broadcast_to(jnp.asarray(l, dtype), row_shape)
  if max_support is not None and _budget_applies(max_support, rows):
    # the m+1 largest values of each row and two small problems on them, by the budget
    # kernel on CPU where the solver is a compiled one (native, pav), else in JAX
    # (segments: m + 2 segment maxima, in JAX)
    # (a traced k >= max_support, refused where k is concrete, gives NaN rows: a support
    # of m entries cannot hold k >= m, and the mask would exceed the budget)
    k_budget = jnp.where(k_rows < max_support, k_rows, jnp.nan)
    y = support_budget.budget_mask(rows, k_budget, l_rows, max_support,
                                   solver.problem.regularizer,
                                   kernel=_compiled_on_cpu(solver), layout=layout)
    state = _solvers_base.RootState(iter_num=jnp.zeros(row_shape, jnp.int32),
                                    residual=jax.lax.stop_gradient(jnp.abs(layout.sum(y) - k_rows)))
  else:  # without a budget, or rows of at most max_support entries (it never binds)
    y, state = solver.solve_and_map(rows, k_rows, l_rows)
  y = solver.nan_where_strength_out_of_range(y, l_rows)
  if spread is not None and solver.problem.output_degree:
    y = layout.map(lambda v, s: _standardize.rescale(v, s, solver.problem.output_degree), y,
                   layout.expand(spread, y))
  if where is not None:
    y = jnp.where(where, y, jnp.zeros_like(y))
  return (y, state) if return_info else y


def _budget_applies(max_support: int, rows: Any) -> bool:
  """Whether rows of ``rows`` can exceed ``max_support`` entries (a symbolic length is
  taken to be longer; a segment is at most the whole axis)."""
  n = _static(rows.shape[-1])
  return n is None or max_support < n


def _solve_rows(x, k, l, where, segment_ids, *, solver, axis, return_info, standardize=None,
                max_support=None):
  if segment_ids is not None:
    solver = solver.with_layout(solver.layout.bind(segment_ids))
  if where is not None:
    where = jnp.moveaxis(where, axis, -1)
  out = apply_on_axis(
      lambda rows: _solve(solver, rows, k, l, where=where, return_info=True,
                          standardize=standardize, max_support=max_support), x, axis)
  return out if return_info else out[0]


_solve_rows_jit = jax.jit(_solve_rows, static_argnames=("solver", "axis", "return_info",
                                                        "standardize", "max_support"))


def _power(standardize: float | None) -> float | None:
  """The power of the row's spread in the standardized strength (a static float), or None."""
  return None if standardize is None else float(standardize)


def _hashable(value) -> bool:
  try:
    hash(value)
  except TypeError:
    return False
  return True


def as_parameter(value: ArrayLike, dtype: Any) -> ArrayLike:
  """``k`` or ``l`` given as a Python or NumPy number or a NumPy array, as a NumPy array of
  the compute dtype of ``dtype`` (the solvers cast to it anyway); JAX arrays and traced
  values pass unchanged. The cached ``jax.jit`` then sees one signature for ``k = 2`` and
  ``k = 2.5``: a Python int and a Python float are different weak types, and an eager
  call with each would compile the operator twice."""
  if isinstance(value, (numbers.Number, np.ndarray, np.generic)) and not isinstance(value, bool):
    return np.asarray(value, _validation.compute_dtype(dtype))
  return value


def check_where(where: ArrayLike | None, x: jax.Array, name: str = "where") -> jax.Array | None:
  """``where`` as a boolean array of the shape of ``x`` (ValueError / TypeError otherwise)."""
  if where is None:
    return None
  where = jnp.asarray(where)
  if where.shape != x.shape:
    raise ValueError(f"`{name}` must be a boolean array of the shape of `x` {x.shape}; "
                     f"got shape {where.shape}.")
  if where.dtype != jnp.bool_:
    raise TypeError(f"`{name}` must be a boolean array (True = a valid entry); got dtype "
                    f"{where.dtype}.")
  return where


def threshold_operator(solver: Any, x: ArrayLike, k: ArrayLike, l: ArrayLike, *, axis: int,
                       return_info: bool = False, where: ArrayLike | None = None,
                       axis_name: Any = None, standardize: float | None = None,
                       max_support: int | None = None) -> Any:
  """Validates ``x``, ``axis``, ``k`` (0 <= k <= n) and ``l`` (> 0), then solves along ``axis``.

  ``l`` is the public ``regularization_strength``; errors about it use that name.

  ``where`` (boolean, the shape of ``x``): entries outside it are excluded (exactly 0,
  never selected) and, when ``where`` is concrete, ``k`` is checked against each row's
  count of valid entries. ``axis_name``: the reduced axis is split over that mesh axis
  (inside ``shard_map``); ``n`` is then the local size times the axis size.
  ``max_support``: at most that many nonzero entries per row (p-norm mask problems on
  whole rows; :mod:`implicit_topk.support_budget`).

  Returns the operator's output with the shape and dtype of ``x`` (and the solver's
  ``RootState`` with ``return_info``). The computation is one ``jax.jit`` keyed on the
  solver object, ``axis`` and ``return_info`` (a solver holding an unhashable
  user-defined regularizer runs without it).
  """
  x = _validation.as_float_input(x)
  axis = _validation.canonicalize_axis(axis, x.ndim)
  batch_shape = x.shape[:axis] + x.shape[axis + 1:]
  n = x.shape[axis]
  if max_support is not None and axis_name is not None:
    raise ValueError("`max_support` needs whole rows on each device; it does not combine "
                     "with `axis_name` (under jax.jit, a NamedSharding along the row works).")
  if axis_name is not None:
    _layout.check_axis_name(axis_name, x)
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    for one in names:
      n *= jax.lax.axis_size(one)
    solver = solver.with_layout(_layout.LastAxis(axis_name))
  where = check_where(where, x)
  _validation.check_k(k, n)
  if max_support is not None:
    support_budget.check_max_support(max_support, _validation.concrete(k),
                                     solver.problem.regularizer)
  concrete_where = None if where is None else _validation.concrete(where)
  if concrete_where is not None and axis_name is None:
    _validation.check_k_per_row(k, np.sum(concrete_where, axis=axis), "the number of "
                                "valid entries (`where`) of the row")
  _validation.check_strength(l, x.dtype, STRENGTH)
  _validation.check_broadcast(k, batch_shape, "k")
  _validation.check_broadcast(l, batch_shape, STRENGTH)
  k, l = as_parameter(k, x.dtype), as_parameter(l, x.dtype)
  run = _solve_rows_jit if _hashable(solver) else _solve_rows
  # On an Explicit mesh the compiled kernels' outputs would be typed replicated (a
  # batch-sharded input gathered after the kernel): run with the mesh axes Auto.
  return call_with_auto_axes(
      lambda x_, k_, l_, where_: run(x_, k_, l_, where_, None, solver=solver, axis=axis,
                                     return_info=return_info, standardize=_power(standardize),
                                     max_support=max_support),
      x, k, l, where, reduced_axis=axis)


def segment_operator(solver: Any, x: ArrayLike, segment_ids: ArrayLike, k: ArrayLike,
                     l: ArrayLike, *, num_segments: int | None, axis: int = -1,
                     indices_are_sorted: bool = False, return_info: bool = False,
                     standardize: float | None = None, max_support: int | None = None) -> Any:
  """Validates a segmented input and solves one threshold per segment along ``axis``.

  ``segment_ids``: integers of shape ``(x.shape[axis],)`` in ``[0, num_segments)``;
  ``k`` and ``l`` broadcast to ``batch + (num_segments,)``; concrete ``k`` is checked
  against each segment's size. ``max_support``: at most that many nonzero entries per
  segment (p-norm masks; :mod:`implicit_topk.support_budget` on each segment). Returns
  what :func:`threshold_operator` returns.
  """
  x = _validation.as_float_input(x)
  axis = _validation.canonicalize_axis(axis, x.ndim)
  n = x.shape[axis]
  segment_ids = jnp.asarray(segment_ids)
  if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
    raise TypeError(f"`segment_ids` must be an integer array; got dtype {segment_ids.dtype}.")
  if segment_ids.shape != (n,):
    raise ValueError(f"`segment_ids` must have shape ({n},) (one id per entry of the reduced "
                     f"axis of `x`); got shape {segment_ids.shape}.")
  ids = _validation.concrete(segment_ids)
  if num_segments is None:
    if ids is None:
      raise ValueError("`num_segments` must be given (a Python int) when `segment_ids` is "
                       "traced (e.g. under jax.jit).")
    num_segments = int(ids.max()) + 1 if ids.size else 1
  num_segments = _validation.check_count(num_segments, "num_segments")
  if ids is not None and ids.size and (ids.min() < 0 or ids.max() >= num_segments):
    bad = ids[(ids < 0) | (ids >= num_segments)]
    raise ValueError(f"`segment_ids` must lie in [0, num_segments) = [0, {num_segments}); "
                     f"got ids {sorted(set(bad.tolist()))[:8]}.")
  row_shape = x.shape[:axis] + x.shape[axis + 1:] + (num_segments,)
  _validation.check_broadcast(k, row_shape, "k", what="batch + (num_segments,)")
  _validation.check_broadcast(l, row_shape, STRENGTH, what="batch + (num_segments,)")
  _validation.check_k(k, n)
  if ids is not None:
    sizes = np.bincount(ids, minlength=num_segments)
    _validation.check_k_per_row(k, sizes, "the size of its segment")
  if max_support is not None:
    support_budget.check_max_support(max_support, _validation.concrete(k),
                                     solver.problem.regularizer)
  _validation.check_strength(l, x.dtype, STRENGTH)
  layout = _layout.Segments(num_segments, indices_are_sorted=bool(indices_are_sorted))
  solver = solver.with_layout(layout)
  k, l = as_parameter(k, x.dtype), as_parameter(l, x.dtype)
  run = _solve_rows_jit if _hashable(solver) else _solve_rows
  return run(x, k, l, None, segment_ids, solver=solver, axis=axis, return_info=return_info,
             standardize=_power(standardize), max_support=max_support)


def _compiled_on_cpu(solver) -> bool:
  """Whether ``solver`` runs a compiled (numba) kernel on CPU: then ``max_support`` takes
  the budget kernel there too; a pure-JAX solver (threshold, dykstra) compiles none."""
  for_platform = getattr(solver, "for_platform", None)
  cpu = for_platform("cpu") if for_platform is not None else solver
  return cpu.name in ("native", "pav")


def _solve_tree(tree, k, l, *, solver, return_info, standardize=None, max_support=None):
  leaves, treedef = jax.tree.flatten(tree)
  dtype = _validation.compute_dtype(jnp.result_type(*leaves))
  if max_support is not None:  # one row of all the entries: one selection over them
    y, state = _solve_tree_row(leaves, treedef, dtype, k, l, solver=solver,
                               standardize=standardize, max_support=max_support)
  else:
    rows = treedef.unflatten([leaf.astype(dtype) for leaf in leaves])
    y, state = _solve(solver, rows, k, l, return_info=True, standardize=standardize)
  y = treedef.unflatten([out.astype(leaf.dtype)
                         for out, leaf in zip(treedef.flatten_up_to(y), leaves)])
  return (y, state) if return_info else y


def _solve_tree_row(leaves, treedef, dtype, k, l, *, solver, standardize, max_support):
  """The tree's entries as one row (``max_support``: one selection over all of them).
  Where a leaf is split over an Explicit mesh axis, whose sharding types refuse the
  flattening and the selection, the row is built and solved with those axes Auto (as
  :func:`call_with_auto_axes`), and each output then takes its leaf's sharding."""

  def solve(leaves):
    row = jnp.concatenate([leaf.astype(dtype).ravel() for leaf in leaves])
    flat, state = _solve(solver.with_layout(_layout.LastAxis()), row, k, l, return_info=True,
                         standardize=standardize, max_support=max_support)
    ends = np.cumsum([int(np.size(leaf)) for leaf in leaves])[:-1]
    parts = [part.reshape(np.shape(leaf)) for part, leaf in zip(jnp.split(flat, ends), leaves)]
    return parts, state

  mesh = _explicit_mesh(leaves)
  if mesh is None:
    parts, state = solve(leaves)
  else:
    with _axes_auto(mesh):
      parts, state = solve([jax.sharding.reshard(leaf, jax.sharding.PartitionSpec())
                            for leaf in leaves])
    parts = [jax.sharding.reshard(part, jax.typeof(leaf).sharding)
             for part, leaf in zip(parts, leaves)]
  return treedef.unflatten(parts), state


_solve_tree_jit = jax.jit(_solve_tree, static_argnames=("solver", "return_info", "standardize",
                                                        "max_support"))


def tree_operator(solver: Any, tree: Any, k: ArrayLike, l: ArrayLike, *, name: str,
                  return_info: bool = False, standardize: float | None = None,
                  max_support: int | None = None) -> Any:
  """Validates a pytree of float arrays and solves one threshold over all its entries.

  ``k`` (``0 <= k <=`` the total number of entries) and ``l`` are scalars. Returns a
  pytree of the structure of ``tree``, each leaf with its own shape and dtype.
  ``max_support``: at most that many nonzero entries in the whole pytree (p-norm mask
  problems; the leaves are then concatenated into one row,
  :mod:`implicit_topk.support_budget`).
  """
  leaves, treedef = jax.tree.flatten(tree)
  if not leaves:
    raise ValueError(f"`{name}` must be a pytree with at least one array leaf; got {tree!r}.")
  checked = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    try:
      leaf = jnp.asarray(leaf)
    except TypeError:
      raise TypeError(
          f"every leaf of `{name}` must be a floating array; the leaf at "
          f"{jax.tree_util.keystr(path) or '(root)'} is a {type(leaf).__name__}. Pass only "
          "the arrays to select among, e.g. for an Equinox module "
          "`params, static = eqx.partition(model, eqx.is_inexact_array)`, then "
          "`eqx.combine(new_params, static)`.") from None
    if not jnp.issubdtype(leaf.dtype, jnp.floating):
      raise TypeError(f"every leaf of `{name}` must have a floating dtype; the leaf at "
                      f"{jax.tree_util.keystr(path) or '(root)'} has dtype {leaf.dtype}.")
    checked.append(leaf)
  n = sum(int(np.size(leaf)) for leaf in checked)
  for value, arg in ((k, "k"), (l, STRENGTH)):
    if np.ndim(value) != 0:
      raise ValueError(f"`{arg}` must be a scalar (one threshold for the whole pytree); got "
                       f"shape {np.shape(value)}.")
  _validation.check_k(k, n)
  if max_support is not None:
    support_budget.check_max_support(max_support, _validation.concrete(k),
                                     solver.problem.regularizer)
  _validation.check_strength(l, min((leaf.dtype for leaf in checked), key=_validation.max_strength),
                             STRENGTH)
  solver = solver.with_layout(_layout.Tree())
  widest = jnp.result_type(*(leaf.dtype for leaf in checked))
  k, l = as_parameter(k, widest), as_parameter(l, widest)
  run = _solve_tree_jit if _hashable(solver) else _solve_tree
  return run(jax.tree.unflatten(treedef, checked), k, l, solver=solver, return_info=return_info,
             standardize=_power(standardize), max_support=max_support)
