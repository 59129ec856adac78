r"""A budget on the support of the p-norm top-k mask: at most ``m`` nonzero entries per row.

The p-norm mask (Sander et al. 2023, "Fast, differentiable and sparse top-k: a convex
analysis perspective", ICML) is :math:`y_i = \min(1, ((x_i - \lambda)_+ / l)^a)`,
:math:`a = 1/(p-1)`, with :math:`\sum_i y_i = k`. Its support is
:math:`\{i : x_i > \lambda\}`, and :math:`\lambda` decreases as the strength :math:`l`
grows, so the support has at most :math:`m` entries iff :math:`\lambda \ge c` with
:math:`c = x_{(m+1)}` (the (m+1)-th largest entry), i.e. iff :math:`S(l) \ge k` where

.. math:: S(l) = \sum_i \min\big(1, ((x_i - c)_+ / l)^a\big)

(nonincreasing in :math:`l`). Where the plain mask would exceed the budget the operator
uses the largest strength that meets it, :math:`l^\star = \sup\{l' : S(l') \ge k\}`
(then :math:`\lambda = c` exactly); elsewhere the plain mask. That is, the mask at the
strength :math:`l' = \min(l, l^\star)`, whose threshold is at least the cut
(``proofs/support_budget.md``).

So the whole answer depends on the entries above the cut only, the ``m`` largest: the
``m + 1`` largest values of each row, then two small problems on those values
(:mod:`implicit_topk._budget_pieces`: :math:`l^\star` and the plain threshold, each in
closed form on its piece, O(m^2) per row), then the mask of the whole row at
:math:`(\lambda', l')`, elementwise. On CPU (float32, float64; p = 2, 3/2, 4/3) the
three steps are one compiled kernel (:mod:`implicit_topk.kernels.cpu.budget_kernel`:
one pass over each row, the closed forms in float64, a second pass that writes the
mask), and the derivatives run in the plain mask's derivative kernels with the rule
``PINNED`` (:mod:`implicit_topk.kernels.cpu.native_derivatives`: two passes over each
row); elsewhere they are JAX (one ``lax.top_k``, or over short rows ``m + 2`` passes of
a masked maximum that also count each value), chosen when the program is lowered. No solver runs (``solver=`` only
decides whether the CPU kernel is used: for the compiled solvers), and no n x n or
n x m intermediate. Under ``jit`` with the reduced axis split
over devices, each device runs the JAX passes on its block with ``pmax``/``psum``.

Segments (``segment_soft_topk_mask``): each segment is its own row of the same rule.
XLA has no segmented top-k, so the values come from the ``m + 2`` masked maxima, here
:func:`jax.ops.segment_max` with a :func:`jax.ops.segment_sum` counting each value; the
same code serves the three cases through the reduction layout
(:mod:`implicit_topk.problems.layout`: the last axis, the last axis split over mesh
axes, segments), which also sums the derivatives per segment and sends per-segment
values back to the entries. A segment of at most ``m`` entries (empty included) gets
no cut: its plain mask, from the same closed forms.

Ties: a symmetric operator cannot split a tie. Where fewer than ``k`` entries lie
strictly above :math:`c`, the cut moves to the next distinct value below :math:`c`
and the entries tied at :math:`c` enter together (weight :math:`w` = their count): the
support then exceeds ``m`` by the tied entries, as the hard top-k's does at a tie.

Derivatives: the implicit function theorem (``proofs/support_budget.md``, statement 7).
With :math:`z_i = (x_i - \lambda')/l'`, :math:`d_i = g'(z_i)/l'`: where the budget does
not bind, :math:`\dot\lambda = (\sum_i d_i (\dot x_i - z_i \dot l) - \dot k)/\sum_i d_i`
(the plain mask's); where it binds, :math:`\lambda' = c` (so :math:`\dot\lambda =
\dot x_c`, the mean over the entries at the cut) and :math:`\dot l' = (\sum_i
d_i(\dot x_i - \dot x_c) - \dot k)/\sum_i d_i z_i`; then :math:`\dot y_i = d_i(\dot x_i -
\dot\lambda) - d_i z_i \dot l'`. Every term is an elementwise map or a row sum (no
gather or scatter of length n); higher orders differentiate these formulas (:func:`_moves`,
:func:`_tangent`; on CPU the kernels compute the same map and its transpose,
:func:`_cotangent`)."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from implicit_topk import _budget_pieces, _deferred, _quotient
from implicit_topk.kernels.cpu.kinds import PNORM
from implicit_topk.problems import layout as _layout
from implicit_topk.solvers import mask_tangent


def check_max_support(max_support, k_value, regularizer) -> int:
  """``max_support`` as a Python int ``m >= 1``, for a p-norm regularizer; ``ValueError``
  naming the argument otherwise (``k < m`` is checked where ``k`` is concrete)."""
  from implicit_topk import regularizers
  if isinstance(max_support, bool) or not isinstance(max_support, int):
    raise TypeError(f"`max_support` must be a Python int >= 1 (a static count of entries); "
                    f"got {max_support!r}.")
  if max_support < 1:
    raise ValueError(f"`max_support` must be an int >= 1; got {max_support}.")
  if not isinstance(regularizer, regularizers.PNorm):
    raise ValueError(
        "`max_support` needs a p-norm regularizer (PNorm, the default): only the p-norms give "
        f"exact zeros, whose count it bounds; got {regularizer!r}.")
  if k_value is not None and not bool((k_value < max_support).all()):
    raise ValueError(f"`max_support` must be larger than k (a support of m entries holds a "
                     f"mask summing to k < m); got max_support={max_support} and k={k_value}.")
  return max_support


#: Rows of ``n`` entries find their m+1 largest values by ``m + 2`` passes of a masked
#: maximum (each also counting the entries at the previous value) where ``(m + 2) * n``
#: is at most this, else by one ``lax.top_k`` (XLA:CPU, 16384 rows, interleaved: 0.5
#: against 1.8 ms at n = 8, m = 3; 6.5 against 11.8 ms at n = 64, m = 4; 153 against 57
#: ms at n = 256, m = 12).
_PASSES_UP_TO = 512


def budget_mask(rows, k, l, m: int, regularizer, *, kernel: bool | None = None, layout=None):
  r"""The p-norm mask of ``rows`` (..., n), ``n > m``, with at most ``m`` nonzero
  entries per row (the tie rule aside): the mask at strength :math:`\min(l, l^\star)`.

  ``k`` and ``l`` have the rows' shape. A row with NaN (or NaN ``k``, ``l``, or no
  threshold: more ``+inf`` entries than ``k``, fewer entries above ``-inf`` than
  ``k``) gives NaN; ``+inf`` entries get 1, ``-inf`` entries 0, like the plain mask.

  ``layout``: which entries form a row (:mod:`implicit_topk.problems.layout`; default
  the last axis). A bound :class:`~implicit_topk.problems.layout.Segments` layout makes
  each segment a row (``k`` and ``l`` of shape ``batch + (num_segments,)``): the same
  steps with segment maxima and sums, where a segment of at most ``m`` entries gets the
  plain mask.

  ``kernel``: whether a program lowered for the CPU runs the compiled kernels
  (:mod:`implicit_topk.kernels.cpu.budget_kernel`: the threshold, strength and mask in
  one call, the derivatives by the mask derivative kernels; default: where it can, see
  :func:`kernel_applies`; never for segments); elsewhere, and on other platforms, the
  pure-JAX path. Both give the same values to a few ulps."""
  a = regularizer.exponent
  layout = _layout.DEFAULT if layout is None else layout
  jax_path = functools.partial(_jax_mask, m=m, regularizer=regularizer, layout=layout)
  if not (_is_last_axis(layout) and kernel_applies(rows.dtype, a) and kernel is not False):
    return jax_path(rows, k, l)
  from implicit_topk.solvers import _lower_cpu_calls_on_every_platform, target_platform
  _lower_cpu_calls_on_every_platform()  # (the kernel's calls in a multi-platform export)
  # the branch of the platform calls run on is traced now, the other when lowered for it
  return _deferred.platform_dependent(rows, k, l, here=target_platform(),
                                      cpu=functools.partial(_kernel_mask, m=m, a=a),
                                      default=jax_path)


def _jax_mask(rows, k, l, m, regularizer, layout):
  """:func:`budget_mask` in JAX: the threshold and strength (:func:`_threshold`), then the
  mask entry by entry."""
  ids = getattr(layout, "segment_ids", None)
  solution = _threshold(rows, k, l, ids, m, regularizer.exponent, _unbound(layout))
  return _mask(rows, *solution, regularizer.mask, lambda r: layout.expand(r, rows))


def _mask(rows, shift, offset, strength, cut, mask, each):
  """The mask of ``rows`` at the threshold ``shift + offset * strength`` and strength
  ``strength`` (per row, ``each`` puts them at the entries), 0 at or below ``cut``;
  NaN rows where ``strength`` is NaN."""
  cut = lax.stop_gradient(cut)
  # (x - shift) / l' - offset: no difference of order l' is formed, which could be
  # subnormal (flushed to 0 by XLA:CPU) for rows of scale 1e-300. Infinite entries (1
  # above the cut, 0 at -inf) stay out of it: their z would make the strength's
  # derivative 0 * inf.
  finite = jnp.isfinite(rows)
  z = _quotient.quotient(jnp.where(finite, rows, each(shift)) - each(shift),
                         each(strength)) - each(offset)
  # lambda' >= cut: the entries at or below the cut are 0 exactly (z may round to a
  # tiny positive value there: XLA divides through the reciprocal)
  y = jnp.where(rows > each(cut), jnp.where(finite, mask(z), 1.0), 0.0)
  return jnp.where(jnp.isnan(each(strength)), jnp.nan, y)


def _is_last_axis(layout) -> bool:
  """Whether ``layout`` is whole rows along the last axis on one device."""
  return isinstance(layout, _layout.LastAxis) and layout.axis_name is None


def _unbound(layout):
  """``layout`` without its data (the hashable part, a static argument)."""
  return layout.bind(None) if isinstance(layout, _layout.Segments) else layout


def _bound(layout, ids):
  return layout if ids is None else layout.bind(ids)


def kernel_applies(dtype, a) -> bool:
  """Whether the CPU kernel serves rows of ``dtype`` with the p-norm exponent ``a``:
  float32 and float64 rows, p = 2, 3/2, 4/3 (``a`` = 1, 2, 3, the closed forms), where
  numba imports. Other p, dtypes or hosts without numba take the pure-JAX path."""
  from implicit_topk.kernels.cpu import registry
  return (jnp.dtype(dtype) in registry.DTYPES and float(a) in (1.0, 2.0, 3.0)
          and registry.available())


def _jax_solution(rows, k, l, m, a, layout=_layout.DEFAULT):
  """``(shift, offset, strength, cut)`` per row in JAX (:func:`_entries`, :func:`_solve`)."""
  values, weights, cut = _entries(rows, k, m, layout)
  return (*_solve(k, l, values, weights, cut, a), cut)


def _kernel_call(rows, k, l, m, a):
  """``(mask, shift, offset, strength, cut)`` by the CPU kernel, one XLA FFI call."""
  from implicit_topk.kernels.cpu import ffi, registry
  _register_split_forms()
  row = jax.ShapeDtypeStruct(rows.shape[:-1], rows.dtype)
  return ffi.call(registry.target("budget", rows.dtype),
                  (jax.ShapeDtypeStruct(rows.shape, rows.dtype),) + (row,) * 4, rows, k, l,
                  a=np.float64(a), m=np.int32(m))


def _kernel_solution(rows, k, l, m, a):
  """``(shift, offset, strength, cut)`` per row by the CPU kernel."""
  return _kernel_call(rows, k, l, m, a)[1:]


@functools.lru_cache(maxsize=None)
def _kernel_operator(m: int, a: float):
  r"""``(x, k, l) -> (mask, lam, shift, strength, pin)`` by the kernel (:math:`\lambda' =`
  ``shift + lam``; ``pin``: the cut where the budget binds, else NaN), differentiated by
  the mask derivative kernels with the rule ``PINNED``
  (:mod:`~implicit_topk.kernels.cpu.native_derivatives`): forward mode by the tangent
  kernel, reverse mode by its transpose; higher orders differentiate :func:`_tangent`,
  the same map in JAX."""
  from implicit_topk.kernels.cpu.native_calls import derivative_call, derivative_rule
  rule = derivative_rule(PNORM, a)
  attributes = {"a": np.float64(a), "kind": np.int32(PNORM)}
  reference = functools.partial(_tangent, a, _layout.DEFAULT)

  @jax.custom_jvp
  def operator(x, k, l):
    y, shift, offset, strength, cut = _kernel_call(x, k, l, m, a)
    return y, offset * strength, shift, strength, jnp.where(strength < l, cut, jnp.nan)

  @operator.defjvp
  def operator_jvp(primals, tangents):
    x, k, l = primals
    outs = operator(x, k, l)
    _, lam, shift, strength, pin = outs
    y_dot, lam_dot, strength_dot = derivative_call(
        "budget", rule, (x, lam, shift, strength, pin), tangents, reference, 3, attributes)
    zero = jnp.zeros_like(lam)
    return outs, (y_dot, lam_dot, zero, strength_dot, zero)

  return operator


def _kernel_mask(rows, k, l, m, a):
  """:func:`budget_mask` by the CPU kernels (:func:`_kernel_operator`)."""
  return _kernel_operator(m, float(a))(rows, k, l)[0]


def _split_attributes(attributes):
  a = float(attributes["a"])
  return int(a) if a.is_integer() else a


def _split_solution(axis, attributes, rows, k, l):
  """The kernel's results where the reduced axis is split over the mesh axes ``axis``
  under ``jit`` (each device holds a block of every row): the JAX path with its row
  maxima and counts ``pmax``'d and ``psum``'d over ``axis`` (no entry leaves its
  device), as :mod:`implicit_topk.kernels.cpu.partitioning` runs each kernel with a
  sharded form; the mask of the block from them."""
  a = _split_attributes(attributes)
  solution = _jax_solution(rows, k, l, int(attributes["m"]), a, _layout.LastAxis(axis))
  y = _mask(rows, *solution, lambda z: _budget_pieces._mask(z, a), lambda r: r[..., None])
  return (y, *solution)


def _split_tangent(axis, attributes, *operands):
  """The tangent kernel's results on a split reduced axis: :func:`_tangent`, its row sums
  ``psum``'d over ``axis``."""
  return _tangent(_split_attributes(attributes), _layout.LastAxis(axis), *operands)


def _split_cotangent(axis, attributes, *operands):
  """The cotangent kernel's results on a split reduced axis: :func:`_cotangent`, its row
  sums ``psum``'d over ``axis``."""
  return _cotangent(_split_attributes(attributes), _layout.LastAxis(axis), *operands)


def _register_split_forms() -> None:
  from implicit_topk.kernels.cpu import partitioning
  partitioning.SHARDED_FORMS.setdefault("budget", _split_solution)
  for rule in ("cubic", "linear", "general"):
    partitioning.SHARDED_FORMS.setdefault(f"budget_tangent_{rule}", _split_tangent)
    partitioning.SHARDED_FORMS.setdefault(f"budget_cotangent_{rule}", _split_cotangent)


def _solution(rows, k, l, m, a, layout=_layout.DEFAULT):
  """The JAX path's ``(shift, offset, strength, cut)`` (no derivatives)."""
  rows, k, l = (lax.stop_gradient(v) for v in (rows, k, l))
  return _jax_solution(rows, k, l, m, a, layout)


def _entries(rows, k, m, layout=_layout.DEFAULT):
  """``(values, weights, cut)``: the values above the cut of the tie rule, descending
  (NaN first where the row has NaN), with their weights (0: not used), and the cut."""
  if not _is_last_axis(layout) or (m + 2) * rows.shape[-1] <= _PASSES_UP_TO:
    # the barrier keeps XLA from fusing the passes over the row into the (many) small
    # computations that use their results, each of which would then repeat them
    return lax.optimization_barrier(_entries_by_passes(rows, k, m, layout))
  return _entries_by_top_k(rows, k, m)


def _entries_by_passes(rows, k, m, layout=_layout.DEFAULT):
  """The m+2 largest distinct values of each row and their counts, one masked maximum
  per value; the group of the (m+1)-th largest entry and the next value below it.
  ``layout`` reduces: the last axis, the last axis split over mesh axes (each device
  holds a block of every row; the maxima and counts are ``pmax``'d and ``psum``'d), or
  segments (``jax.ops.segment_max`` and ``segment_sum``; an empty segment's maximum is
  ``-inf``). A row of at most ``m`` entries gets the cut ``-inf`` (no budget)."""
  each = lambda r: layout.expand(r, rows)
  value = layout.max(rows)
  if not _is_last_axis(layout):  # NaN where the row has NaN (a scatter's maximum may drop it)
    value = jnp.where(layout.any(jnp.isnan(rows)), jnp.nan, value)
  values, counts = [value], []
  # (a float count: XLA:CPU sums an int count by a separate, slower reduce-window)
  for _ in range(m + 1):
    counts.append(layout.count(rows == each(value), rows.dtype))
    value = layout.max(jnp.where(rows < each(value), rows, -jnp.inf))
    values.append(value)
  counts.append(layout.count(rows == each(value), rows.dtype))
  values, counts = jnp.stack(values, axis=-1), jnp.stack(counts, axis=-1)
  total = jnp.cumsum(counts, axis=-1)
  group = jnp.sum(total < m + 1, axis=-1)  # the group of the (m+1)-th largest entry
  position = jnp.arange(m + 2)
  at = lambda table, index: jnp.sum(jnp.where(position == index[..., None], table, 0), axis=-1)
  strictly_above = at(total - counts, group)
  # The tie rule: fewer than k entries above c -> the cut moves below c, where the
  # entries tied at c enter together.
  tied = strictly_above < k
  weights = jnp.where(position < group[..., None], counts,
                      jnp.where((position == group[..., None]) & tied[..., None], counts, 0.0))
  cut = jnp.where(tied, at(values, group + 1), at(values, group))
  # fewer than m+1 entries (a short segment; the -inf entries, repeated, reach m+1 first):
  # no cut, the plain mask
  cut = jnp.where(group > m, -jnp.inf, cut)
  # the group of the (m+1)-th largest is among the first m+1: the last value is the cut's
  return values[..., :m + 1], weights[..., :m + 1], cut


def _entries_by_top_k(rows, k, m):
  """The m+1 largest entries (``lax.top_k``), weight 1 each above the cut; where the tie
  rule applies, the group at the (m+1)-th largest with weight its count (one more pass
  over the row, made for every row: see :func:`_solve` on ``lax.cond``)."""
  # The barrier keeps XLA:CPU's top-k kernel: slicing its output inside a fusion made
  # XLA rewrite it as a full sort of every row (10x slower at 16384 x 64).
  top = lax.optimization_barrier(lax.top_k(rows, m + 1)[0])
  c = top[..., m]
  strictly_above = jnp.sum(top[..., :m] > c[..., None], axis=-1).astype(rows.dtype)
  tied = strictly_above < k
  count_c = jnp.sum(rows == c[..., None], axis=-1).astype(rows.dtype)
  below = jnp.max(jnp.where(rows < c[..., None], rows, -jnp.inf), axis=-1)
  position = jnp.arange(m + 1)
  weights = jnp.where(tied[..., None],
                      jnp.where(position < strictly_above[..., None], 1.0,
                                jnp.where(position == strictly_above[..., None],
                                          count_c[..., None], 0.0)),
                      jnp.where(position < m, 1.0, 0.0)).astype(rows.dtype)
  nan_row = jnp.any(jnp.isnan(rows), axis=-1)
  top = jnp.where(nan_row[..., None] & (position == 0), jnp.nan, top)
  return top, weights, jnp.where(tied, below, c)


class _Solution(NamedTuple):
  shift: jax.Array     # the origin of the threshold (no derivatives)
  offset: jax.Array    # (lambda' - shift) / l'
  strength: jax.Array  # l' = min(l, l*): below l where the budget binds; NaN: no mask


def _solve(k, l, values, weights, cut, a) -> _Solution:
  """Threshold and strength per row from the values above the cut (:func:`_entries`).

  Both small problems are solved for every row, and each row keeps the one it needs: no
  ``lax.cond``. Skipping them where no row of the batch needs one saved nothing
  measurable on the CPU (16384 x {8, 64, 256} and 64 x 1000, forward and
  forward+backward, interleaved), and on a GPU a ``cond`` copies its predicate to the
  host and waits, 15-30 us a call."""
  k, l, values, weights, cut = (lax.stop_gradient(v) for v in (k, l, values, weights, cut))
  infinite = values == jnp.inf
  target = k - jnp.sum(jnp.where(infinite, weights, 0.0), axis=-1)  # +inf entries are 1
  weights = jnp.where(jnp.isfinite(values), weights, 0.0)
  finite_cut = jnp.isfinite(cut)
  gaps = jnp.where(finite_cut[..., None],
                   values - jnp.where(finite_cut, cut, 0.0)[..., None], 0.0)
  # S(l) < k: the plain mask would exceed the budget (proofs/support_budget.md, 1)
  over = finite_cut & (_budget_pieces.mask_sum(gaps, weights, l, a) < target)
  l_star = jnp.where(over, _budget_pieces.crossing_strength(gaps, weights, target, a), jnp.inf)
  binds = finite_cut & (l > l_star)
  anchor, offset = _budget_pieces.threshold(values, weights, cut, l, target, a)
  # Nothing finite above the cut and no mass to place (an empty segment; a row of -inf
  # entries, or of as many +inf entries as k): any threshold is one; the origin.
  offset = jnp.where((target == 0) & ~finite_cut & ~jnp.any(weights > 0, axis=-1), 0.0, offset)
  # The origin of the threshold: the cut where the budget binds (then lambda' = c
  # exactly), else a value next to the plain threshold (lambda - anchor is of order l).
  shift = jnp.where(binds, cut, anchor)
  offset = jnp.where(binds, 0.0, jnp.maximum(offset, jnp.where(finite_cut, (cut - anchor) / l,
                                                                       -jnp.inf)))
  strength = jnp.where(binds, l_star, l)
  bad = (jnp.isnan(values[..., 0]) | jnp.isnan(k) | jnp.isnan(l) | (target < 0)
         | (~binds & jnp.isnan(offset)))
  return _Solution(jnp.where(bad, 0.0, shift), offset, jnp.where(bad, jnp.nan, strength))


@functools.partial(jax.custom_jvp, nondiff_argnums=(4, 5, 6))
def _threshold(rows, k, l, ids, m, a, layout):
  """``(shift, (lambda' - shift) / l', l', cut)`` per row in JAX; derivatives by the
  implicit function theorem (:func:`_moves`; none for ``shift``, a constant origin, nor
  for the cut's value, which enters through the entries at it). ``ids``: the segment
  ids of a :class:`~implicit_topk.problems.layout.Segments` ``layout`` (unbound here:
  the static part), else None."""
  return tuple(_solution(rows, k, l, m, a, _bound(layout, ids)))


@_threshold.defjvp
def _threshold_jvp(m, a, layout, primals, tangents):
  rows, k, l, ids = primals
  rows_dot, k_dot, l_dot, _ = tangents
  shift, offset, strength, cut = _threshold(rows, k, l, ids, m, a, layout)  # higher orders
  pin = jnp.where(strength < l, lax.stop_gradient(cut), jnp.nan)
  _, _, delta_dot, strength_dot = _moves(a, _bound(layout, ids), rows, offset * strength, shift,
                                         strength, pin, rows_dot, k_dot, l_dot)
  offset_dot = (delta_dot - offset * strength_dot) / strength  # of (lambda' - shift) / l'
  return ((shift, offset, strength, cut),
          (jnp.zeros_like(shift), offset_dot, strength_dot, jnp.zeros_like(cut)))


def _slopes(a, layout, rows, lam, shift, strength):
  """``(d, d z)`` per entry (:func:`implicit_topk.solvers.mask_tangent.slopes`) at the
  threshold ``shift + lam`` and strength ``strength`` (per row)."""
  each = lambda r: layout.expand(r, rows)
  # (the per-row values at each entry, with a trailing axis of 1 for the per-row
  # broadcast of `slopes`)
  return (v[..., 0] for v in mask_tangent.slopes(PNORM, float(a), rows[..., None], each(lam),
                                                  each(shift), each(strength)))


def _ratio(num, den):
  """``num / den``, 0 where ``den`` is 0 (a binary mask: the convention of every solver)."""
  return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)


def _moves(a, layout, rows, lam, shift, strength, pin, rows_dot, k_dot, l_dot):
  r"""``(d, d z, lam_dot, strength_dot)``: the slopes (:func:`_slopes`) and the tangents
  of the threshold (less its constant origin ``shift``) and of the strength, per row
  (``proofs/support_budget.md``, 7). ``pin``: the cut where the budget binds, else NaN.

  With :math:`z_i = (x_i - \lambda')/l'`, :math:`d_i = g'(z_i)/l'`: where the budget does
  not bind, :math:`\dot l' = \dot l` and :math:`\dot\lambda = (\sum_i d_i (\dot x_i -
  z_i \dot l) - \dot k)/\sum_i d_i` (the plain mask's); where it binds, :math:`\lambda' =
  c` (so :math:`\dot\lambda = \dot x_c`, the mean over the entries at the cut) and
  :math:`\dot l' = (\sum_i d_i(\dot x_i - \dot x_c) - \dot k)/\sum_i d_i z_i`. NaN
  where ``lam`` is."""
  d, dz = _slopes(a, layout, rows, lam, shift, strength)
  each = lambda r: layout.expand(r, rows)
  total, total_z = layout.sum(d), layout.sum(dz)
  moved = layout.sum(d * rows_dot)
  pinned = ~jnp.isnan(pin)
  at_pin = rows == each(pin)
  # (a float count: XLA:CPU sums an int count by a separate, slower reduce-window)
  pin_dot = (layout.sum(jnp.where(at_pin, rows_dot, 0.0))
             / jnp.maximum(layout.count(at_pin, rows.dtype), 1.0))
  lam_dot = jnp.where(pinned, pin_dot, _ratio(moved - total_z * l_dot - k_dot, total))
  strength_dot = jnp.where(pinned, _ratio(moved - total * pin_dot - k_dot, total_z), l_dot)
  undefined = jnp.isnan(lam)
  return (d, dz, jnp.where(undefined, jnp.nan, lam_dot),
          jnp.where(undefined, jnp.nan, strength_dot))


def _tangent(a, layout, rows, lam, shift, strength, pin, rows_dot, k_dot, l_dot):
  r"""``(y_dot, lam_dot, strength_dot)``: the tangent of the budgeted mask
  :math:`\dot y_i = d_i(\dot x_i - \dot\lambda) - d_i z_i \dot l'` with
  :func:`_moves`' per-row tangents, as the tangent kernel (rule ``PINNED``) computes it."""
  d, dz, lam_dot, strength_dot = _moves(a, layout, rows, lam, shift, strength, pin, rows_dot,
                                        k_dot, l_dot)
  each = lambda r: layout.expand(r, rows)
  return d * (rows_dot - each(lam_dot)) - dz * each(strength_dot), lam_dot, strength_dot


def _cotangent(a, layout, rows, lam, shift, strength, pin, y_bar, lam_bar, strength_bar):
  r"""``(x_bar, k_bar, l_bar)``: the transpose of :func:`_tangent`, as the cotangent kernel
  computes it: :math:`\bar x_i = d_i(\bar y_i + c)`, :math:`\bar k = -c`; where the budget
  does not bind :math:`c = (\bar\lambda - \sum_i d_i \bar y_i)/\sum_i d_i` and
  :math:`\bar l = \bar l' - \sum_i d_i z_i(\bar y_i + c)`; where it binds :math:`c =
  (\bar l' - \sum_i d_i z_i \bar y_i)/\sum_i d_i z_i`, :math:`\bar l = 0`, and the
  entries at the cut share :math:`\bar\lambda - \sum_i d_i(\bar y_i + c)`."""
  d, dz = _slopes(a, layout, rows, lam, shift, strength)
  each = lambda r: layout.expand(r, rows)
  y_bar = jnp.where(d != 0, y_bar, 0.0)  # as the kernel, which reads it where d != 0 only
  total, total_z = layout.sum(d), layout.sum(dz)
  weighted, weighted_z = layout.sum(d * y_bar), layout.sum(dz * y_bar)
  pinned = ~jnp.isnan(pin)
  at_pin = rows == each(pin)
  pins = jnp.maximum(layout.count(at_pin, rows.dtype), 1.0)
  c = jnp.where(pinned, _ratio(strength_bar - weighted_z, total_z),
                _ratio(lam_bar - weighted, total))
  share = jnp.where(pinned, (lam_bar - weighted - c * total) / pins, 0.0)
  x_bar = d * (y_bar + each(c)) + jnp.where(at_pin, each(share), 0.0)
  l_bar = jnp.where(pinned, 0.0, strength_bar - (weighted_z + c * total_z))
  undefined = jnp.isnan(lam)
  nan = lambda v: jnp.where(undefined, jnp.nan, v)
  return jnp.where(each(undefined), jnp.nan, x_bar), nan(-c), nan(l_bar)
