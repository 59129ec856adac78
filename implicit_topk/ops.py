r"""The public soft top-k operators (functional API over the solver objects).

Every operator here solves the regularized linear program of Sander et al. 2023,
"Fast, differentiable and sparse top-k: a convex analysis perspective" (ICML), over the
capped simplex, and is differentiated implicitly (Blondel et al. 2022, "Efficient and
modular implicit differentiation", NeurIPS).

``regularization_strength`` (the :math:`l` of the formulas, default 1.0) has the name
and the meaning it has in fast-soft-sort (Blondel et al. 2020, "Fast differentiable
sorting and ranking", ICML) and torchsort (for ``p = 2``: the regularizer is
:math:`\frac{l}{2}\|y\|^2`); in ott-jax the same role is played by ``epsilon``, the
scale of the entropic (or quadratic) regularizer. Before 0.2.0 it was called ``l``
(default 0.1); ``l=`` still works until 0.3.0 with a DeprecationWarning.
"""

from __future__ import annotations

from typing import Any, Union

import jax
from jax.typing import ArrayLike

from implicit_topk import _apply
from implicit_topk import _deprecation
from implicit_topk import problems
from implicit_topk import regularizers
from implicit_topk import solvers

#: A pytree of arrays (nested tuples, lists, dicts, ... with array leaves).
PyTree = Any


# standardize=True: the strength is l times the row's standard deviation to this power
# (the mask depends on (x - lambda) / l only, so l must scale like x).
_MASK_SCALE_POWER = 1.0

def soft_topk_mask(
    x: ArrayLike,
    k: ArrayLike,
    *,
    regularization_strength: ArrayLike = _deprecation.DEFAULT_STRENGTH,
    p: float = 4.0 / 3.0,
    regularizer: Any = None,
    axis: int = -1,
    solver: str = "auto",
    diff: str = "implicit",
    tol: float | None = None,
    maxiter: int | None = None,
    implicit_diff_backend: str = "lax",
    return_info: bool = False,
    where: ArrayLike | None = None,
    axis_name: Any = None,
    standardize: bool = False,
    max_support: int | None = None,
    l: ArrayLike | None = None,
) -> Union[jax.Array, tuple[jax.Array, solvers.RootState]]:
  r"""Sparse, differentiable top-k mask along ``axis``.

  .. math::

      y^\star(x) = \arg\max_{y \in [0,1]^n,\ \sum_i y_i = k}\ \langle x, y\rangle
                   - \frac{l}{p} \sum_i |y_i|^p
      \;=\; \min\Big(1, \big(\tfrac{(x_i - \lambda)_+}{l}\big)^{1/(p-1)}\Big)

  with :math:`l` = ``regularization_strength`` and the threshold :math:`\lambda`
  chosen so that :math:`\sum_i y_i = k` (Sander et al. 2023, "Fast, differentiable and
  sparse top-k: a convex analysis perspective", ICML). Entries below the threshold are
  exactly 0, clearly-kept entries exactly 1. ``p = 2`` is the Euclidean projection of
  ``x / l`` onto the capped simplex (kinks); ``p = 4/3`` (default) is continuously
  differentiable. As ``l -> 0`` the mask tends to :func:`hard_topk_mask` (it is exactly
  the hard mask once ``l`` is at most the gap between the k-th and (k+1)-th largest
  entries); as ``l -> inf`` it tends to ``k / n``.

  Derivatives w.r.t. ``x``, ``k`` and ``l`` come from the implicit function theorem on
  :math:`\sum_i y_i(\lambda) - k = 0` (one division per row; Blondel et al. 2022,
  "Efficient and modular implicit differentiation", NeurIPS): forward and reverse
  mode with ``implicit_diff_backend="lax"``, reverse only with ``"jaxopt"``.

  Where the solution is binary (every :math:`y_i \in \{0, 1\}`, which needs an
  integer ``k`` and a gap wider than ``l`` between the k-th and (k+1)-th largest
  entries), ``y`` is locally constant in ``x`` and ``l`` (derivative 0, exact) but not
  differentiable in ``k``: raising ``k`` lifts the (k+1)-th largest entry, lowering it
  lowers the k-th. There the derivative w.r.t. ``k`` is returned as 0. To learn ``k``
  by gradient, keep it fractional or ``l`` large enough that some entry is fractional.

  Args:
    x: float array (float16/bfloat16 are computed in float32 and cast back).
    k: real number or array broadcastable to the batch shape (``x`` without
      ``axis``), with 0 <= k <= n. Need not be an integer. ``k = n`` gives a mask of
      ones and ``k = 0`` a mask of zeros (derivatives 0), the rule of every operator.
    regularization_strength: :math:`l`, keyword-only, finite and > 0 (default 1.0),
      a scalar or an array broadcastable to the batch shape. Small values give the
      hard mask, large ones spread the mass towards ``k / n``. The same name and
      meaning as fast-soft-sort's and torchsort's ``regularization_strength`` (for
      ``p = 2`` the regularizer is :math:`\frac{l}{2}\|y\|^2`); ott-jax calls the
      scale of its entropic or quadratic regularizer ``epsilon``.
    p: p-norm exponent, a static float > 1 (default 4/3; ignored if ``regularizer``
      is given).
    regularizer: None (default: ``PNorm(p)``), a name (``"entropy"``, ``"sigmoid"``,
      ``"laplace"``, ``"pnorm"``) or a regularizer object (see
      :mod:`implicit_topk.regularizers`).
    axis: the axis along which to select (default -1).
    solver: ``"auto"`` (default): ``"native"`` on CPU, ``"pallas"`` on GPU for rows
      of at most 65536 entries, ``"threshold"`` elsewhere and where ``axis`` is split
      over devices (``axis_name=``, or a sharding along ``axis`` visible when the call
      is made: a concrete array or an explicit mesh axis; under ``jit`` with automatic
      sharding the CPU kernel's call is custom-partitioned, and a split reduced axis
      runs the threshold iteration with ``psum`` on each device's block).
      ``"native"``: a compiled CPU kernel per row (selection, then Newton on the few
      entries that can be nonzero; the derivatives in two more kernels), an XLA
      custom call: exact, exportable (``disabled_checks=export_safety_checks()``),
      per shard on a batch-sharded input; built-in regularizers.
      ``"pallas"``: one fused GPU kernel per block of rows, certified per row.
      ``"threshold"``: pure JAX, sort-free Newton, exact, any backend and regularizer.
      ``"pav"``: numba PAV after a sort, exact. ``"dykstra"``: pure JAX, ``p = 2``
      only, approximate (stops at ``tol``).
    diff: ``"implicit"`` (default: implicit function theorem at the solver's output)
      or ``"unrolled"`` (autodiff through exactly ``maxiter`` iterations of
      ``"threshold"`` or ``"dykstra"``; memory grows with ``maxiter``).
    tol: Dykstra's tolerance (default 1e-6): it stops once
      :math:`|\sum_i y_i - k| \le` ``tol``, which bounds the L1 error of the mask.
    maxiter: iteration cap of ``"threshold"`` (default 100) or ``"dykstra"`` (default
      10000 sweeps; check ``return_info`` to see whether it was reached).
    implicit_diff_backend: ``"lax"`` or ``"jaxopt"``.
    return_info: also return the solver's :class:`RootState` (``iter_num``: passes
      or sweeps made, ``residual``: :math:`|\sum_i y_i - k|`), one entry per row of
      the batch shape (``x`` without ``axis``).
    where: optional boolean array of the shape of ``x`` (e.g. the valid, non-padding
      entries of padded rows). Entries where it is False are excluded: their output
      is exactly 0, its derivatives are exactly 0, they are never selected, and ``k``
      counts only the valid entries: ``0 <= k <=`` the row's number of valid entries
      (checked when ``where`` and ``k`` are concrete; under ``jit`` a larger ``k``
      gives NaN at the row's valid entries). Equal to the operator on the row with
      its invalid entries removed.
    axis_name: inside :func:`jax.shard_map`, the mesh axis name (or tuple of names)
      over which ``axis`` of ``x`` is split: every row's sums become one
      ``jax.lax.psum`` of a few scalars per Newton step; nothing is gathered. ``k``
      counts the entries of the whole (global) row. Not needed under ``jax.jit`` with
      a ``NamedSharding`` input (XLA inserts the all-reduce itself). A name that is
      not a mesh axis of the enclosing ``shard_map``, or an input that does not vary
      over it, raises ``ValueError``. Needs ``solver="threshold"`` (or ``"auto"``).
    standardize: if True, the strength is relative to the spread of the data: the
      operator solves with ``regularization_strength`` times the standard deviation
      of each row's finite entries, over ``where`` (SoftJAX's ``standardize``), so
      that the result does not depend on the scale of ``x``: ``soft_topk_mask(c * x
      + b)`` equals ``soft_topk_mask(x)`` for every ``c > 0`` and ``b`` while the
      strength times the standard deviation stays in the range of strengths
      (``[2^-126, 2^126)`` in float32 and the half types, ``[2^-1022, 2^1022)`` in
      float64); beyond it the row is NaN (float32 rows of scale ``3e38``, or ``1e-37``
      at strength 0.01). Gradients flow through the standard deviation
      (``proofs/standardized_strength.md``).
      Default False: the strength is absolute.
    max_support: ``None`` (default) or an int ``m > k``: at most ``m`` nonzero
      entries per row, for any scale of ``x`` and any strength (a compute budget, e.g.
      the experts a token may be routed to). Where the plain mask would have more,
      the row is solved with the largest strength ``l* <= l`` whose mask has ``m``:
      its threshold is then the (m+1)-th largest entry. Elsewhere the output is the
      plain mask, exactly. Ties: where fewer than ``k`` entries lie strictly above
      the (m+1)-th largest, the cut moves to the next distinct value below it and the
      tied entries enter together (a symmetric operator cannot split a tie; the
      support then exceeds ``m`` by those entries). Continuous in ``x`` except where
      such a tie straddles the cut; gradients through both the mask's and the
      strength's equations (``proofs/support_budget.md``). p-norm regularizers only
      (the others have no exact zeros: ``ValueError``), whole rows (not with
      ``axis_name``: ``ValueError``). Cost: the ``m + 1`` largest entries of each row,
      the threshold and ``l*`` in closed form on those values (on CPU one compiled
      kernel, one pass over each row, for float32/float64 and p = 2, 3/2, 4/3; else
      JAX: ``lax.top_k`` or ``m + 2`` masked maxima), and the mask of the row
      elementwise; no solver runs, so ``diff``, ``tol``, ``maxiter`` and
      ``implicit_diff_backend`` do not apply, and ``solver`` only decides whether the
      CPU kernel is used (the compiled solvers, ``auto``, ``native``, ``pav``) or the
      JAX path (``threshold``, ``dykstra``: nothing compiled by numba); rows of at most
      ``m`` entries, which never bind, use the solver. ``where``, ``standardize``, NaN and infinite
      entries, every dtype, ``jit`` (a reduced axis split over devices stays split),
      ``vmap``, forward and reverse mode (higher orders too) and ``jax.export`` (with
      :func:`implicit_topk.export_safety_checks`, like the default solver) work as
      without it.
    l: deprecated name of ``regularization_strength`` (removed in 0.3.0): warns with
      a ``DeprecationWarning``; passing both is a ``TypeError``.

  Returns:
    An array with the shape and dtype of ``x``, entries in [0, 1] summing to ``k``
    along ``axis``; with ``return_info``, the pair ``(mask, RootState)``.

  Raises:
    TypeError: ``x`` is not a float array, or both ``regularization_strength`` and
      ``l`` are given.
    ValueError: concrete ``k`` outside ``[0, n]``, ``regularization_strength`` not
      finite and > 0, shapes that do not broadcast, an unknown ``solver``.

  Limits of floating point: the mask is computed on ``x`` minus its row's largest
  finite entry (shift invariance), so ``|x| / l`` may be as large as the format
  allows. An entry that shares the fractional mass is resolved to the ulp of its
  distance from that maximum: when that distance exceeds ``l / eps`` the mask need
  not sum to ``k`` (``x = (1e308, -1e308)``, ``k = 1.5``, ``l = 1``: no float threshold
  does; ``x = (2, 1e308, -1.1, 0.9)``, ``k = 2.5``, ``l = 1.3``: the threshold 0.4
  does, but relative to 1e308 the row gives ``(0, 1, 0, 0)``); ``return_info`` then
  reports the residual ``|sum_i y_i - k|`` (> 0). Under ``jit``
  with traced ``k`` or ``l``, values are not checked: ``l <= 0``, ``k`` outside
  ``[0, n]`` or, with ``max_support``, ``k >= max_support`` give NaN rows.

  Non-finite inputs: a row containing NaN gives a row of NaN. ``+inf`` entries get
  1 and ``-inf`` entries 0, the finite entries share the rest of ``k``; a row whose
  ``+inf`` count exceeds ``k``, or whose count of entries > ``-inf`` is below ``k``,
  has no threshold and gives NaN.

  Example:
    >>> import jax.numpy as jnp
    >>> import implicit_topk as itk
    >>> x = jnp.array([-5., -2., 3., 1.])
    >>> itk.soft_topk_mask(x, 2, regularization_strength=1e-2)
    Array([0., 0., 1., 1.], dtype=float32)
    >>> jnp.round(itk.soft_topk_mask(x, 1.5, p=2.0), 3)  # default strength 1.0
    Array([0. , 0. , 1. , 0.5], dtype=float32)
  """
  l = _deprecation.strength(regularization_strength, l, "soft_topk_mask")
  problem = problems.CappedSimplex(regularizers.resolve(regularizer, p))
  solver_obj = solvers.make_solver(
      solver, problem, implicit_diff_backend=implicit_diff_backend, diff=diff,
      tol=tol, maxiter=maxiter, size=_apply.input_size(x), row_length=_apply.row_length(x, axis),
      sharded=axis_name is not None or _apply.reduced_axis_is_sharded(x, axis))
  return _apply.threshold_operator(solver_obj, x, k, l, axis=axis, return_info=return_info,
                                   where=where, axis_name=axis_name,
                                   standardize=_MASK_SCALE_POWER if standardize else None,
                                   max_support=max_support)


@_apply.explicit_axes_as_auto
def segment_soft_topk_mask(
    x: ArrayLike,
    segment_ids: ArrayLike,
    k: ArrayLike,
    *,
    num_segments: int | None = None,
    regularization_strength: ArrayLike = _deprecation.DEFAULT_STRENGTH,
    p: float = 4.0 / 3.0,
    regularizer: Any = None,
    axis: int = -1,
    indices_are_sorted: bool = False,
    diff: str = "implicit",
    maxiter: int | None = None,
    implicit_diff_backend: str = "lax",
    return_info: bool = False,
    standardize: bool = False,
    max_support: int | None = None,
    l: ArrayLike | None = None,
) -> Union[jax.Array, tuple[jax.Array, solvers.RootState]]:
  r"""Soft top-k mask within each segment of ``axis`` (ragged rows, no padding).

  Entry :math:`i` of ``axis`` belongs to segment :math:`s(i) =` ``segment_ids[i]``;
  each segment :math:`S` is its own row of :func:`soft_topk_mask`, with its own
  :math:`k_S` and threshold :math:`\lambda_S`:

  .. math::

      y_i = \mathrm{mask}\big((x_i - \lambda_{s(i)}) / l_{s(i)}\big), \qquad
      \sum_{i \in S} y_i = k_S \ \text{ for every segment } S,

  with :math:`l` = ``regularization_strength``: the same result as calling
  :func:`soft_topk_mask` on every segment separately. The
  sort-free Newton iteration runs on all segments at once: each pass is one
  :func:`jax.ops.segment_sum` over the whole array and one gather of the per-segment
  thresholds by ``segment_ids``, so time and memory are O(n) however ragged the
  segments are (nothing is padded to the longest segment). Derivatives w.r.t.
  ``x``, ``k`` and ``l`` come from the implicit function theorem on the per-segment
  equations (one division per segment), forward and reverse mode.

  Typical uses: top-k within each sequence of a packed batch (expert-choice routing
  over variable-length sequences), top-k per graph of a batched graph, per-group
  selection. ``segment_ids`` need not be sorted (``indices_are_sorted=True`` lets
  XLA use a faster path when they are).

  ``max_support=m`` bounds the nonzero entries of each segment by ``m``, as
  :func:`soft_topk_mask`'s ``max_support`` does for each row: every segment is its own
  row of that rule, with its own cut (the (m+1)-th largest entry of the segment) and
  its own largest strength ``l* <= l`` that meets the budget.

  Args:
    x: float array; the segments run along ``axis``, other axes are batch axes.
    segment_ids: integer array of shape ``(x.shape[axis],)``, values in
      ``[0, num_segments)``. Concrete ids are checked (``ValueError`` naming
      ``segment_ids``); under ``jit`` an out-of-range id gives NaN at that entry.
    k: real number or array broadcastable to ``batch + (num_segments,)``: the mass
      of each segment, ``0 <= k <=`` the segment's size (checked when ``k`` and
      ``segment_ids`` are concrete; under ``jit`` a larger ``k`` gives a segment of
      NaN). An empty segment needs ``k = 0``.
    num_segments: the number of segments, a Python int (it fixes the shape of the
      per-segment values). Optional when ``segment_ids`` is concrete (then
      ``max(segment_ids) + 1``); required under ``jit``.
    regularization_strength: :math:`l`, keyword-only, finite and > 0 (default 1.0),
      a scalar or an array broadcastable to ``batch + (num_segments,)``; the meaning
      of fast-soft-sort's and torchsort's ``regularization_strength`` (ott-jax's
      ``epsilon``), as in :func:`soft_topk_mask`.
    p: p-norm exponent, a static float > 1 (default 4/3; ignored if ``regularizer``
      is given).
    regularizer: None (default: ``PNorm(p)``), a name or a regularizer object (see
      :mod:`implicit_topk.regularizers`).
    axis: the axis holding the segments (default -1).
    indices_are_sorted: whether ``segment_ids`` is sorted (a hint to XLA; default
      False).
    diff: ``"implicit"`` (default) or ``"unrolled"`` (autodiff through ``maxiter``
      Newton iterations).
    maxiter: iteration cap of the Newton iteration (default 100).
    implicit_diff_backend: ``"lax"`` (forward and reverse mode) or ``"jaxopt"``.
    return_info: also return the solver's :class:`RootState`, one entry per segment
      (shape ``batch + (num_segments,)``; default False).
    standardize: if True, the strength is relative to the spread of the data: the
      operator solves with ``regularization_strength`` times the standard deviation
      of the finite entries of each segment (SoftJAX's ``standardize``),
      so that the result does not depend on the scale of ``x``: the mask is
      invariant under ``x -> c * x + b`` for ``c > 0`` while the strength times the
      standard deviation stays in the range of strengths (as in
      :func:`soft_topk_mask`; beyond it the segment is NaN). Gradients flow through
      the standard deviation (``proofs/standardized_strength.md``). Default False: the
      strength is absolute.
    max_support: ``None`` (default) or an int ``m > k_S`` (for every segment): at
      most ``m`` nonzero entries per segment, for any scale of ``x`` and any strength.
      Where a segment's plain mask would have more, that segment is solved with the
      largest strength ``l* <= l`` whose mask has ``m``: its threshold is then the
      (m+1)-th largest entry of the segment. Elsewhere, and in every segment of at
      most ``m`` entries, the output is the plain mask (to a few ulps: computed in
      closed form, not by the Newton iteration). Ties: where fewer than ``k_S``
      entries of a segment lie strictly above its (m+1)-th largest, the cut moves to
      the next distinct value below it and the tied entries enter together (a
      symmetric operator cannot split a tie; the support then exceeds ``m`` by those
      entries), the rule of :func:`soft_topk_mask`. Gradients through both the mask's
      and the strength's equations (``proofs/support_budget.md``), per segment.
      A traced ``k_S >= m`` (under ``jit``, not checked) gives that segment NaN.
      p-norm regularizers only (``ValueError`` otherwise). Cost: ``m + 2`` passes of
      :func:`jax.ops.segment_max` over the axis, each with a
      :func:`jax.ops.segment_sum` counting the entries at the value found (the ``m +
      1`` largest values of every segment with their counts, without sorting the
      axis), the threshold and ``l*`` in closed form on those values (O(m^2) per
      segment), and the mask elementwise: time O((m + 2) n + num_segments m^2),
      memory O(n + num_segments m), nothing of size n x m. No iteration runs, so
      ``diff``, ``maxiter`` and ``implicit_diff_backend`` do not apply, and
      ``return_info`` reports 0 iterations and the residual. ``standardize``, NaN and
      infinite entries (as without it), every dtype, ``jit``, ``vmap``, batch axes
      and forward and reverse mode work as without it.
    l: deprecated name of ``regularization_strength`` (removed in 0.3.0): warns with
      a ``DeprecationWarning``; passing both is a ``TypeError``.

  Returns:
    An array with the shape and dtype of ``x``, summing to ``k_S`` over each segment
    (and the ``RootState`` with ``return_info``).

  Raises:
    TypeError: non-integer ``segment_ids``, non-float ``x``, both
      ``regularization_strength`` and ``l``, or a ``max_support`` that is not a
      Python int.
    ValueError: out-of-range concrete ``segment_ids`` or ``k``,
      ``regularization_strength`` not finite and > 0, shapes that do not broadcast,
      ``max_support`` below 1 or not above a concrete ``k``, or with a regularizer
      that is not a p-norm.

  Example:
    >>> import jax.numpy as jnp
    >>> import implicit_topk as itk
    >>> x = jnp.array([3., 1., 2., 0., 5., 4.])
    >>> ids = jnp.array([0, 0, 0, 1, 1, 1])
    >>> itk.segment_soft_topk_mask(x, ids, jnp.array([1., 2.]), num_segments=2,
    ...                            regularization_strength=1e-2)
    Array([1., 0., 0., 0., 1., 1.], dtype=float32)
  """
  l = _deprecation.strength(regularization_strength, l, "segment_soft_topk_mask")
  problem = problems.CappedSimplex(regularizers.resolve(regularizer, p))
  solver_obj = solvers.make_solver(
      "threshold", problem, implicit_diff_backend=implicit_diff_backend, diff=diff,
      maxiter=maxiter)
  return _apply.segment_operator(solver_obj, x, segment_ids, k, l, num_segments=num_segments,
                                 axis=axis, indices_are_sorted=indices_are_sorted,
                                 return_info=return_info,
                                 standardize=_MASK_SCALE_POWER if standardize else None,
                                 max_support=max_support)


def tree_soft_topk_mask(
    scores: PyTree,
    k: ArrayLike,
    *,
    regularization_strength: ArrayLike = _deprecation.DEFAULT_STRENGTH,
    p: float = 4.0 / 3.0,
    regularizer: Any = None,
    diff: str = "implicit",
    maxiter: int | None = None,
    implicit_diff_backend: str = "lax",
    return_info: bool = False,
    standardize: bool = False,
    max_support: int | None = None,
    l: ArrayLike | None = None,
) -> Union[PyTree, tuple[PyTree, solvers.RootState]]:
  r"""One soft top-k mask over every entry of a pytree of arrays (one global threshold).

  With :math:`x` all entries of all leaves of ``scores`` (:math:`n` in total),

  .. math::

      y^\star = \arg\max_{y \in [0,1]^n,\ \sum_i y_i = k}\ \langle x, y\rangle
                - l\,\Omega(y), \qquad y_i = \mathrm{mask}\big((x_i - \lambda) / l\big),

  with :math:`l` = ``regularization_strength`` and a single threshold
  :math:`\lambda` for the whole tree: the result equals
  :func:`soft_topk_mask` on the concatenation of the flattened leaves, returned with
  the structure, shapes and dtypes of ``scores``. Nothing is concatenated: every
  Newton step reduces each leaf on its own and adds the per-leaf sums, so leaves may
  have different shapes, dtypes and shardings (under ``jax.jit`` each leaf's sum is
  an all-reduce of a scalar over its own devices). Derivatives (w.r.t. every leaf,
  ``k`` and ``l``) come from the implicit function theorem on the one scalar
  equation :math:`\sum_i y_i(\lambda) = k`.

  Use it to select the top ``k`` scores of a whole model (e.g. global pruning scores,
  one budget for all layers).

  Args:
    scores: a pytree of float arrays (at least one leaf). Leaves are computed in
      their common floating dtype (half types in float32) and cast back.
    k: a scalar, ``0 <= k <= n`` (the total number of entries); need not be an
      integer.
    regularization_strength: :math:`l`, keyword-only, a finite scalar > 0 (default
      1.0); the meaning of fast-soft-sort's and torchsort's
      ``regularization_strength`` (ott-jax's ``epsilon``), as in
      :func:`soft_topk_mask`.
    p: p-norm exponent, a static float > 1 (default 4/3; ignored if ``regularizer``
      is given).
    regularizer: None (default: ``PNorm(p)``), a name or a regularizer object (see
      :mod:`implicit_topk.regularizers`).
    diff: ``"implicit"`` (default) or ``"unrolled"``.
    maxiter: iteration cap of the Newton iteration (default 100).
    implicit_diff_backend: ``"lax"`` (default; forward and reverse mode) or
      ``"jaxopt"``.
    return_info: also return the solver's :class:`RootState` (scalars; default
      False).
    standardize: if True, the strength is relative to the spread of the data: the
      operator solves with ``regularization_strength`` times the standard deviation
      of the finite entries of all the leaves together (SoftJAX's
      ``standardize``), so that the result does not depend on the scale of ``x``:
      the mask is invariant under ``x -> c * x + b`` for ``c > 0`` while the strength
      times the standard deviation stays in the range of strengths (as in
      :func:`soft_topk_mask`; beyond it the mask is NaN). Gradients flow through the
      standard deviation (``proofs/standardized_strength.md``). Default False: the
      strength is absolute.
    max_support: ``None`` (default) or an int ``m > k``: at most ``m`` nonzero entries
      in the whole pytree, as :func:`soft_topk_mask`'s ``max_support`` on the
      concatenation of the flattened leaves (which it then builds: one copy of the
      entries; the Newton iteration does not run). A traced ``k >= m`` (under
      ``jit``, not checked) gives NaN leaves.
    l: deprecated name of ``regularization_strength`` (removed in 0.3.0): warns with
      a ``DeprecationWarning``; passing both is a ``TypeError``.

  Returns:
    A pytree with the structure of ``scores``, each leaf with its shape and dtype,
    all entries in [0, 1] and summing to ``k`` (and the ``RootState`` with
    ``return_info``).

  Raises:
    TypeError: a leaf without a floating dtype, or both ``regularization_strength``
      and ``l``.
    ValueError: an empty pytree, a non-scalar ``k`` or strength, ``k`` outside
      ``[0, n]``, ``regularization_strength`` not finite and > 0.

  Example:
    >>> import jax.numpy as jnp
    >>> import implicit_topk as itk
    >>> tree = {"w": jnp.array([[3., -1.], [0.5, 2.]]), "b": jnp.array([4., 1.])}
    >>> itk.tree_soft_topk_mask(tree, 2, regularization_strength=1e-2)["w"]
    Array([[1., 0.],
           [0., 0.]], dtype=float32)
  """
  l = _deprecation.strength(regularization_strength, l, "tree_soft_topk_mask")
  problem = problems.CappedSimplex(regularizers.resolve(regularizer, p))
  solver_obj = solvers.make_solver(
      "threshold", problem, implicit_diff_backend=implicit_diff_backend, diff=diff,
      maxiter=maxiter)
  return _apply.tree_operator(solver_obj, scores, k, l, name="scores", return_info=return_info,
                              standardize=_MASK_SCALE_POWER if standardize else None,
                              max_support=max_support)
