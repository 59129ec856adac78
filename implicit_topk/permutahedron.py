r"""Regularized linear programs over the permutahedron: soft sort, rank, quantile, top-k values.

The permutahedron of :math:`w \in \mathbb{R}^n`, :math:`P(w) = \mathrm{conv}\{w_\sigma\}`,
holds every permutation of ``w``. For a separable regularizer
:math:`\Omega(y) = \sum_i \omega(y_i)`,

.. math::

    y^\star(x; w) = \arg\max_{y \in P(w)}\ \langle x, y\rangle - l\,\Omega(y)

with :math:`l` = ``regularization_strength`` (default 1.0), is computed through its
isotonic dual (Blondel, Teboul, Berthet and Djolonga 2020, "Fast differentiable sorting
and ranking", ICML; ``proofs/isotonic_dual.md``):
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
  backend. For ``p = 2`` and the entropy (block values in closed form) a round also
  merges whole runs of violators; for other ``p`` each round merges pairs only, so a
  long cascade takes many rounds: ``soft_rank`` at ``p = 4/3`` of 64 x 1000 standard
  normal float32 entries took 93 rounds, 0.34 s forward on 2 CPU cores against 29 ms
  with ``"pav"`` (64 x 10000: about 8 s forward and backward). On CPU use ``"pav"``
  for such ``p``.
* ``"pav"``: one compiled numba kernel per batch, an XLA custom call on CPU
  (:mod:`implicit_topk.kernels.cpu.pav_ffi`), sorts the rows (radix sort), runs sequential
  PAV and returns the block values, the block ids and the permutations. The fastest
  on CPU for long rows; it exports with ``jax.export``
  (``disabled_checks=implicit_topk.export_safety_checks()``) and a batch-sharded input
  stays sharded. CPU only.

The blocks come from the problem scaled by :math:`1 / \max(l, 1)` (the same blocks, with
:math:`l w` finite for any strength); ``y`` is then computed in each block's own
coordinates, :math:`y_i = g((s_i - s_{\mathrm{first}})/l + t_B)` with the dimensionless
:math:`t_B = (s_{\mathrm{first}} - u_B)/l` solved again from the block condition, so that
tied entries get exactly the same value at any strength (``u_B`` itself carries a rounding
of the order of the ulp of ``s``, which divided by a small ``l`` would swamp ``y``).

Derivatives: the implicit function theorem on :math:`F(t) = 0` with the block partition
held fixed (``jax.lax.custom_root``). :math:`F_B` depends on :math:`t_B` alone, so the
Jacobian is diagonal and the linear solve is one division per block; :math:`F` is
evaluated with segmented scans over the sorted positions (each block is a run of
them), so nothing is n x n, and no scatter adds two entries into one address (on a
GPU those adds serialize), forward or backward. Gradients flow
to ``x`` (through the sort), to ``w`` and to ``l``.

``regularization_strength`` is the ``regularization_strength`` of fast-soft-sort (the
authors' code) and torchsort (its PyTorch port), identical for ``p = 2`` (their
``"l2"``; for ranks ``regularizer="entropy"`` is their ``"kl"``, for sorting it is not:
fast-soft-sort's and torchsort's ``"kl"`` soft sort is another operator, the same program in
log space, which takes values of any sign: ``-log(soft_sort(exp(min(x) - x),
descending=True, regularizer="entropy")) + min(x)``, checked against torchsort 0.1.10 to
1e-15; the two agree as the strength goes to 0). SoftJAX's ``softness`` (with
``method="fast_soft_sort"``, ``mode="c0"``, ``standardize=False``) maps as
``regularization_strength = softness / (n - 1)`` for ranks and
``regularization_strength = (n - 1) * softness`` for sorting. ott-jax's ``epsilon``
(entropic optimal transport, Cuturi, Teboul and Vert 2019, "Differentiable ranks and
sorting using optimal transport", NeurIPS) regularizes another problem: no exact map,
but both reach the hard sort as they go to 0. Before 0.2.0 the argument was ``l``;
``l=`` still works until 0.3.0 with a DeprecationWarning.

The capped simplex is :math:`P((1, \dots, 1, 0, \dots, 0))`; soft ranks use
:math:`w = (n, \dots, 1)`, soft sorting swaps the roles: :math:`x = (n, \dots, 1)` and
:math:`w` = the values.
"""

from __future__ import annotations

import functools
from typing import Union

import jax
import jax.export
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from implicit_topk import _apply
from implicit_topk import _deprecation
from implicit_topk import _implicit
from implicit_topk import _quotient
from implicit_topk import _validation
from implicit_topk import regularizers
from implicit_topk.kernels.cpu import pav_calls
from implicit_topk.solvers import isotonic
from implicit_topk.solvers import pav

#: What ``regularizer=`` accepts: None (the p-norm), a name or a regularizer object.
RegularizerLike = Union[str, regularizers.Regularizer, None]

# "auto" is the pure-JAX solver on every backend: the default call must export and shard.
SOLVERS = ("auto", "pav_jax", "pav")


def _take_rows(a, index, *, sorted_index=False, permutation=False):
  """``a[r, index[r, i]]`` for (R, n) arrays: one flat gather (XLA's batched gather
  is slower on CPU). Its transpose is one flat scatter-add, to distinct addresses
  (no atomics) when ``index`` is a ``permutation`` of each row."""
  rows, n = a.shape
  flat = (index + (jnp.arange(rows, dtype=index.dtype) * n)[:, None]).reshape(-1)
  return a.reshape(-1).at[flat].get(mode="promise_in_bounds", indices_are_sorted=sorted_index,
                                    unique_indices=permutation).reshape(a.shape)


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
  the numba kernel; ``"pav_jax"``: in JAX); the gathers by those permutations and the
  block conditions are JAX (differentiable).
  """
  p = _kernel_spec(regularizer)
  shape = (x if x is not None else w).shape
  n = shape[-1]
  if jax.export.is_symbolic_dim(n):
    raise ValueError(
        "the permutahedron operators (soft_sort, soft_rank, soft_quantile, ...) need a "
        f"static length of the sorted axis; got the symbolic dimension {n!r}. "
        "jax.export takes a symbolic batch dimension with a static row length.")
  ranks = jnp.broadcast_to(_ranks_vector(n, dtype), shape)
  # The blocks of (s, w, l) are those of (s / c, w, l / c) for any c > 0 (the values
  # scale by 1 / c): c = max(l, 1) keeps l * w and s - l * w finite for large l.
  scale = jax.lax.stop_gradient(jnp.maximum(l, 1))
  if solver == "pav":
    x_, w_, l_ = jax.lax.stop_gradient((x, w, l))
    if x is not None:
      solved = pav_calls.permutahedron_blocks(x_ / scale[:, None], w_, l_ / scale, p, dtype)
    else:  # the ranks are sorted: the kernel sorts them only where it must scale them
      def scaled():
        out = pav_calls.permutahedron_blocks(ranks / scale[:, None], w_, l_ / scale, p, dtype)
        return out[:2] + out[4:]  # without the ranks' (identity) permutations
      solved = jax.lax.cond(jnp.all(l_ <= 1),
                            lambda: pav_calls.permutahedron_blocks(None, w_, l_, p, dtype),
                            scaled)
    values, ids, rest = solved[0], solved[1], list(solved[2:])
    if x is not None:
      order, inverse = rest.pop(0), rest.pop(0)
    w_order = rest.pop(0) if w is not None else None
  else:
    order = isotonic.descending_order(jax.lax.stop_gradient(x)) if x is not None else None
    w_order = isotonic.descending_order(jax.lax.stop_gradient(w)) if w is not None else None
    if x is not None:
      inverse = _inverse_permutation(order)
  s = _take_rows(x, order, permutation=True) if x is not None else ranks
  w_sorted = _take_rows(w, w_order, permutation=True) if w is not None else ranks
  if solver != "pav":
    s_, w_, l_ = jax.lax.stop_gradient((s, w_sorted, l))
    # The blocks of (s - c, w, l) are those of (s, w, l) (<s - c 1, y> = <s, y> - c sum(w)
    # on the permutahedron), the values less c: with c = max(s) the merges compare values
    # of the size of the row's spread, not of its level (float32 entropic ranks of
    # entries 1000 +- 3: blocks off by 0.4 of a rank), as the "pav" kernel's float64 does.
    top = s_[:, :1]
    values, ids = _jax_blocks((s_ - top) / scale[:, None], w_, l_ / scale, kind=p)
    values = values + top / scale[:, None]
  y_sorted = _sorted_argmax(values, ids, s, w_sorted, l, scale, regularizer,
                            w_is_ranks=w is None, s_is_ranks=x is None)
  if p == "exp" and w is not None:  # no entropic solution: w_i < 0 (_check_nonnegative_generator)
    y_sorted = jnp.where(jnp.any(w < 0, axis=-1, keepdims=True), jnp.nan, y_sorted)
  return _take_rows(y_sorted, inverse, permutation=True) if x is not None else y_sorted


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


def _two_level_block_sums(v, ids, first):
  r"""Each block's sum of ``v`` (R, n) at each of its entries, for the blocks of
  consecutive positions with ids ``ids`` (nondecreasing in each row, in ``[0, n)``) that
  begin where ``first`` is True: the CPU's O(n) segment sums, in two levels.

  XLA's CPU segment sum adds a block's terms one after the other, which rounds by up to
  :math:`|B|` ulps of the running sum (float32 ranks of rows of 1e5 entries with blocks of
  thousands were 0.7 off). Here chunks of :math:`c \approx \sqrt n` positions cut the
  blocks into runs; each run is summed, then each block's run sums: at most
  :math:`c + |B| / c + 1 \approx 2 \sqrt n` terms in any one sum."""
  rows, n = v.shape
  chunk = 1 << ((n - 1).bit_length() + 1) // 2  # a power of 2, sqrt(n) / 2 to 2 sqrt(n)

  def segment_sums(terms, segment):  # (R, n) sums at index segment[r, i]
    return jax.ops.segment_sum(terms.reshape(-1), isotonic._flat(segment, n),
                               num_segments=v.size, indices_are_sorted=True).reshape(v.shape)

  if chunk < 4:  # rows too short for the second level to shorten any sum
    return _take_rows(segment_sums(v, ids), ids, sorted_index=True)
  position = jax.lax.broadcasted_iota(ids.dtype, ids.shape, 1)
  starts = first | (position % chunk == 0)
  run = isotonic._cumsum(starts.astype(jnp.int32)).astype(ids.dtype) - 1
  partial = _take_rows(segment_sums(v, run), run, sorted_index=True)
  total = segment_sums(jnp.where(starts, partial, jnp.zeros_like(partial)), ids)
  return _take_rows(total, ids, sorted_index=True)


def _sorted_argmax(values, ids, s, w, l, scale, regularizer, *, w_is_ranks=False,
                   s_is_ranks=False):
  r"""y in the order of ``s`` (sorted descending), for w sorted descending: (R, n).

  ``values``/``ids``: the PAV solution's block values (of the problem scaled by
  ``1 / scale``) and block ids (from either solver). Each block is solved again in its
  own coordinates: :math:`y_i = g(d_i + t_B)` with :math:`d_i = (s_i - s_{f(i)}) / l`
  (:math:`f(i)` the block's first position) and :math:`t_B = (s_{f(i)} - u_B) / l` the
  root of :math:`\sum_{i \in B} g(d_i + t_B) = \sum_{i \in B} w_i`. Tied entries have
  :math:`d_i = 0` exactly: their ``y`` never reads the rounding of :math:`u_B` (about
  the ulp of ``s``) divided by ``l``. :math:`t_B` is a closed form for ``p = 2`` and the
  entropy, safeguarded Newton steps (:func:`_block_roots`) for other ``p``; its
  derivatives come from the implicit function theorem on the block conditions. A block's
  means of ``w`` and of :math:`e^{d}` are taken in two passes, the second over the
  deviations from the first (``w_is_ranks``: the ranks :math:`n, \dots, 1`, whose mean
  is in closed form, as is the mean of ``d`` for ``s_is_ranks``), and the roots'
  residuals about the mean of ``w``:
  summing :math:`w` itself would round by up to :math:`|B|` ulps of :math:`\sum_B w`
  (float32 ranks of a block of :math:`10^4` entries: 0.4 on every rank). For
  ``p > 2`` ``d`` and ``t`` are taken in the units of ``s`` (not divided by ``l``) and the
  link is :math:`g(v) / l^a`, ``a = 1/(p-1)``: :math:`v / l = y^{p-1}` can leave the float
  range where ``y`` does not.

  The root ``t`` holds each block's value at the block's first position (0 elsewhere);
  the blocks are runs of consecutive positions, so spreading ``t`` over its block and
  summing a block's condition are segmented scans
  (:func:`~implicit_topk.solvers.isotonic.segmented_scan`), and so are their transposes:
  no scatter-add into a block (a GPU serializes the atomic adds of one large block).
  On CPU (serial scatters, no atomics) gathers and segment sums do the same in O(n),
  several times faster than the O(n log n) scans there; the sums in two levels
  (:func:`_two_level_block_sums`), as a sequential sum of a block of 1e5 float32 terms
  rounds by up to 1e5 of their ulps.
  """
  l_col = l[:, None]
  before = jnp.pad(ids[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
  after = jnp.pad(ids[:, 1:], ((0, 0), (0, 1)), constant_values=-1)
  first, last = ids != before, ids != after
  from_first, to_last = isotonic.run_reach(first)
  to_first = jax.lax.broadcasted_iota(ids.dtype, ids.shape, 1) - from_first

  def spread(u):
    return jax.lax.platform_dependent(
        u, cpu=lambda u: _take_rows(u, to_first, sorted_index=True),
        default=lambda u: isotonic.segmented_scan(jnp.where(first, u, 0), from_first))

  def block_sums(v):  # at each entry (only the first of a block is read)
    return jax.lax.platform_dependent(
        v, cpu=lambda v: _two_level_block_sums(v, ids, first),
        default=lambda v: isotonic.segmented_scan(v, to_last, reverse=True))

  kind = _kernel_spec(regularizer)
  # p > 2 (a < 1): d, t and the link in the units of s, g_l(v) = g(v / l) = g(v) l^-a, as
  # (v / l) = y^(p-1) can leave the float range where y does not (float32 soft_sort of
  # entries 1e-18 at p = 3, l = 1e36); otherwise in units of 1 / l.
  in_units_of_s = kind != "exp" and regularizer.exponent < 1

  def offsets(s_, l_):  # d_i = (s_i - s_first) / l: exactly 0 for ties
    return s_ - spread(s_) if in_units_of_s else _quotient.quotient(s_ - spread(s_), l_)

  def link(z, l_):  # g(z / l) in the units of s, else g(z)
    return regularizer.link_of_ratio(z, l_) if in_units_of_s else regularizer.link(z)

  def link_inverse(r, l_):  # of `link`: sign(r) |r|^(p-1), times l in the units of s
    root = jnp.sign(r) * jnp.abs(r) ** (1 / jnp.asarray(regularizer.exponent, r.dtype))
    return root * l_ if in_units_of_s else root

  def optimality(t, s_, w_, l_):
    return jnp.where(first, block_sums(link(offsets(s_, l_) + spread(t), l_) - w_), t)

  # the PAV values at each block's first position, as t (a Newton start for other p)
  u = _take_rows(values, ids, sorted_index=True)
  unit = (1 / scale if in_units_of_s else l / scale)[:, None]
  guess = jax.lax.stop_gradient((s / scale[:, None] - u) / unit)

  def solver(init, s_, w_, l_):
    del init  # never differentiated (custom_root)
    d = offsets(s_, l_)
    count = block_sums(jnp.ones_like(d))  # exact (integers)

    def block_mean(v):  # then the mean of the deviations from that first estimate
      estimate = block_sums(v) / count
      return estimate + block_sums(v - spread(estimate)) / count

    # the ranks n - i at positions f, ..., f + |B| - 1: the mean w_f - (|B| - 1) / 2
    w_mean = w_ - (count - 1) / 2 if w_is_ranks else block_mean(w_)
    if kind == "exp":  # log(mean w) - log(mean exp(d)), d <= 0 with d_first = 0
      t = jnp.log(w_mean / block_mean(jnp.exp(d)))
    elif regularizer.exponent == 1:  # p = 2: mean(w) - mean(d)
      if s_is_ranks:  # d_i = -(i - f) / l: the mean -(|B| - 1) / (2 l)
        d_mean = -_quotient.quotient((count - 1) / 2, l_)
      else:
        d_mean = block_mean(d)
      t = w_mean - d_mean
    else:
      t = _block_roots(lambda z: link(z, l_), lambda r: link_inverse(r, l_), d, guess,
                       first, spread, block_sums, count, w_mean)
    return jnp.where(first, t, 0), jnp.zeros((), values.dtype)

  # init like the values (not s): under shard_map, s = the ranks is not varying.
  t, _ = _implicit.implicit_root(solver, optimality, jnp.zeros_like(values), (s, w, l_col),
                                 backend="lax")
  y = link(offsets(s, l_col) + spread(t), l_col)
  # A singleton block's condition is link(z_i) = w_i, so y_i = w_i, derivatives included;
  # through the link they would be 0 / 0 where w_i = 0 (link'(0) = 0 for p < 2, inf for p > 2).
  y = jnp.where(first & last, w, y)
  return jnp.where(jnp.isnan(values[:, :1]), jnp.nan, y)  # the solvers' NaN rows stay NaN


def _block_roots(link, link_inverse, d, guess, first, spread, block_sums, count, r):
  r"""Roots :math:`t_B` of :math:`h_B(t) = \sum_{i \in B} g(d_i + t) - W_B` for a p-norm
  link ``g`` (increasing, odd; ``link_inverse`` its inverse), every block at once, read at
  the blocks' first positions; ``count`` and ``r`` (at those positions): the block's size
  and its mean of ``w``, so that :math:`h_B(t) = \sum_B (g(d_i + t) - r)`, a sum of
  terms of the size of the block's spread (not of its level, whose sum rounds by up to
  :math:`|B|` of its ulps).

  With :math:`d_i \le 0`, :math:`t_B` lies in
  :math:`[g^{-1}(r), g^{-1}(r) - \sum_B d_i]` (each term lies between
  :math:`g(t + \sum_B d)` and :math:`g(t)`). Safeguarded Newton from ``guess`` (the PAV
  value, clipped to that bracket), bisecting where a step leaves the bracket or does not
  halve the residual."""
  dtype = d.dtype
  eps = jnp.finfo(dtype).eps
  total = count * jnp.abs(r)
  centre = spread(r)
  lo = link_inverse(r)
  hi = lo - block_sums(d)
  hi = jnp.maximum(hi, lo)
  t = jnp.clip(jnp.where(jnp.isfinite(guess), guess, lo), lo, hi)

  def residual(t):
    z = d + spread(t)
    g, dg = jax.jvp(link, (z,), (jnp.ones_like(z),))
    return block_sums(g - centre), block_sums(dg), block_sums(jnp.abs(g))

  def body(state):
    it, t, lo, hi, f_prev, active = state
    f, df, scale = residual(t)
    lo = jnp.where(active & (f < 0), t, lo)
    hi = jnp.where(active & (f > 0), t, hi)
    newton = t - f / jnp.where(df > 0, df, 1)
    use = (df > 0) & (jnp.abs(f) <= 0.5 * jnp.abs(f_prev)) & (lo < newton) & (newton < hi)
    step = jnp.where(use, newton, 0.5 * (lo + hi))
    tol = 4 * eps * jnp.maximum(jnp.abs(lo), jnp.abs(hi))
    done = ((f == 0) | (hi - lo <= tol)
            | ((jnp.abs(step - t) <= tol) & (jnp.abs(f) <= 16 * eps * (scale + jnp.abs(total)))))
    t = jnp.where(active & (f != 0), step, t)
    return it + 1, t, lo, hi, jnp.where(active, f, f_prev), active & ~done

  active = first & (lo < hi)
  state = (jnp.zeros((), jnp.int32), t, lo, hi, jnp.full_like(t, jnp.inf), active)
  state = jax.lax.while_loop(lambda st: (st[0] < 200) & jnp.any(st[-1]), body, state)
  return state[1]


def _permutahedron(x, w, *, l, p, regularizer, axis, solver, generator="w"):
  """The LP along ``axis`` for ``x``, ``w`` (None: the ranks; an array given for both
  has one shape): the shape and dtype of the given array. One cached ``jax.jit`` per
  regularizer, solver and axis (an unhashable user-defined regularizer runs without
  it), so that eager calls trace once per shape. ``generator``: the user's name of ``w``
  in errors."""
  data = x if x is not None else w
  axis = _validation.canonicalize_axis(axis, data.ndim)
  _validation.check_strength(l, data.dtype)
  _validation.check_broadcast(l, data.shape[:axis] + data.shape[axis + 1:],
                              "regularization_strength")
  _validation.check_choice(solver, "solver", SOLVERS)
  solver = "pav_jax" if solver == "auto" else solver
  regularizer = regularizers.resolve(regularizer, p)
  if w is not None and _kernel_spec(regularizer) == "exp":
    _check_nonnegative_generator(w, generator)
  run = _lp_on_axis_jit if _apply._hashable(regularizer) else _lp_on_axis  # pylint: disable=protected-access
  return run(x, w, _apply.as_parameter(l, data.dtype), regularizer=regularizer, axis=axis,
             solver=solver)


def _check_nonnegative_generator(w, name):
  """The entropy's ``y log y`` needs ``y >= 0``, and the permutahedron of ``w`` has
  points outside the positive orthant unless ``w >= 0``: a concrete negative entry is a
  ``ValueError`` naming the argument (a traced one gives NaN rows, :func:`_lp`)."""
  concrete = _validation.concrete(w)
  if concrete is not None and np.any(concrete < 0):
    raise ValueError(
        f"`{name}` must be >= 0 with regularizer='entropy' (its y log y needs y >= 0 on "
        f"the permutahedron of `{name}`); got a minimum of {float(np.min(concrete))!r}. "
        "Use a p-norm regularizer (p=2: fast-soft-sort's 'l2'), or shift the values.")


def _lp_on_axis(x, w, l, *, regularizer, axis, solver):
  data = x if x is not None else w

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


_lp_on_axis_jit = jax.jit(_lp_on_axis, static_argnames=("regularizer", "axis", "solver"))


@_apply.explicit_axes_as_auto
def permutahedron_argmax(x: ArrayLike, w: ArrayLike, *,
                         regularization_strength: ArrayLike = _deprecation.DEFAULT_STRENGTH,
                         p: float = 2.0, regularizer: RegularizerLike = None, axis: int = -1,
                         solver: str = "auto", l: ArrayLike | None = None) -> jax.Array:
  r"""Regularized linear program over the permutahedron of ``w``, along ``axis``.

  .. math::

      y^\star(x; w) = \arg\max_{y \in P(w)}\ \langle x, y\rangle - l \sum_i \omega(y_i),
      \qquad P(w) = \mathrm{conv}\{w_\sigma : \sigma \text{ a permutation}\},

  with :math:`l` = ``regularization_strength`` and :math:`\omega(y) = |y|^p / p` (or the
  entropy :math:`y \log y - y`). :func:`soft_rank` is ``w = (n, ..., 1)``,
  :func:`soft_sort` swaps the roles of ``x`` and ``w``, and the capped simplex of
  :func:`~implicit_topk.soft_topk_mask` is ``w = (1, ..., 1, 0, ..., 0)``.

  Args:
    x: float array of any shape (integer input is an error); the LP is solved along
      ``axis``, every other axis is a batch axis.
    w: the permutahedron's generator, broadcastable to ``x`` (any order).
    regularization_strength: :math:`l > 0`, a scalar or an array broadcastable to the
      batch shape (one strength per row). Default 1.0. Differentiable.
    p: the p-norm exponent, ``p > 1`` (default 2.0, fast-soft-sort's ``"l2"``);
      ignored when ``regularizer`` is given.
    regularizer: ``None`` (the p-norm), ``"entropy"`` or an
      :class:`~implicit_topk.regularizers.Entropy` (then :math:`y > 0`, so ``w`` must be
      positive; fast-soft-sort's ``"kl"`` for ranks, see :func:`soft_sort` for sorting), or a
      :class:`~implicit_topk.regularizers.PNorm`.
    axis: the axis of the vectors (default -1).
    solver: ``"auto"`` (default: ``"pav_jax"`` on every backend), ``"pav_jax"`` (pure
      JAX: works with ``jax.export`` and ``shard_map``, where each shard solves its own
      rows) or ``"pav"`` (a numba kernel called as an XLA custom call on CPU: the
      fastest on CPU for long rows; exportable, and a batch-sharded input stays
      sharded). Both give the same blocks (to rounding).
    l: deprecated name of ``regularization_strength`` (removed in 0.3.0).

  Returns:
    ``y``, a ``jax.Array`` with the shape and the (floating) dtype of ``x``. One sort per
    row, O(n) memory, forward and backward.

  Non-finite inputs: a row with a NaN or an infinite entry of ``x`` or ``w`` is NaN.

  Raises:
    ValueError: a concrete ``regularization_strength`` outside
      :math:`[2^{-1022}, 2^{1022})` (float64) or :math:`[2^{-126}, 2^{126})` (float32 and
      the half types), an unknown ``solver``,
      or a regularizer other than a p-norm or the entropy; with the entropy, a concrete
      ``w`` with a negative entry (traced: its row is NaN).
    TypeError: both ``regularization_strength`` and ``l`` given.

  Example:
    >>> import jax.numpy as jnp
    >>> import implicit_topk as itk
    >>> x = jnp.array([0.5, 2.0, 1.0])
    >>> itk.permutahedron_argmax(x, jnp.array([3.0, 2.0, 1.0]), regularization_strength=0.1)
    Array([1., 3., 2.], dtype=float32)
    >>> itk.permutahedron_argmax(x, jnp.array([1.0, 0.0, 0.0]), regularization_strength=2.0)
    Array([0.  , 0.75, 0.25], dtype=float32)
  """
  l = _deprecation.strength(regularization_strength, l, "permutahedron_argmax")
  x = _validation.as_float_input(x)
  _validation.check_broadcast(w, x.shape, "w", "the generator of each row of `x`",
                              target="the shape of `x`")
  w = jnp.broadcast_to(jnp.asarray(w, _validation.compute_dtype(x.dtype)), x.shape)
  return _permutahedron(x, w, l=l, p=p, regularizer=regularizer, axis=axis, solver=solver)


def _ranks_vector(n, dtype):
  return jnp.arange(n, 0, -1, dtype=dtype)  # (n, ..., 1)


@_apply.explicit_axes_as_auto
def soft_rank(x: ArrayLike, *, regularization_strength: ArrayLike = _deprecation.DEFAULT_STRENGTH,
              p: float = 2.0, regularizer: RegularizerLike = None, axis: int = -1,
              descending: bool = False, solver: str = "auto",
              l: ArrayLike | None = None) -> jax.Array:
  r"""Soft ranks along ``axis`` (Blondel et al. 2020, "Fast differentiable sorting and ranking").

  .. math::

      r(x) = \arg\max_{y \in P((n, \dots, 1))}\ \langle x, y\rangle - l\,\Omega(y),
      \qquad \Omega(y) = \tfrac1p \textstyle\sum_i |y_i|^p \ \text{(default } p = 2),

  with :math:`l` = ``regularization_strength``. Ascending by default: the largest entry
  gets rank ``n``, ranks are 1-based (``descending=True``: the largest gets rank 1). As
  :math:`l \to 0` these are the hard ranks (ties get their average); as :math:`l` grows
  they tend to the mean rank :math:`(n + 1)/2`. Monotone in ``x``; O(n log n) per row.

  Equivalences: ``regularization_strength`` is fast-soft-sort's and torchsort's
  ``regularization_strength`` (identical for ``p=2``, their ``"l2"``;
  ``regularizer="entropy"`` is their ``"kl"``). SoftJAX's ``rank(x, softness=s,
  method="fast_soft_sort", mode="c0", standardize=False)`` is
  ``soft_rank(x, regularization_strength=s / (n - 1))``. ott-jax's ``soft_sort.ranks``
  (entropic optimal transport, Cuturi et al. 2019) has no exact map; its ranks are
  0-based.

  Args:
    x: float array of any shape (integer input is an error).
    regularization_strength: :math:`l > 0`, a scalar or an array broadcastable to the
      batch shape. Default 1.0.
    p: p-norm exponent ``> 1`` (default 2.0); ignored when ``regularizer`` is given.
    regularizer: ``None`` (p-norm), ``"entropy"`` or a regularizer object (p-norm or
      entropy; see :func:`permutahedron_argmax`).
    axis: the axis to rank along (default -1).
    descending: rank the largest entry 1 instead of ``n`` (default False).
    solver: ``"auto"`` (default, = ``"pav_jax"``, pure JAX: ``jax.export``,
      ``shard_map``) or ``"pav"`` (a numba kernel on CPU; see :func:`permutahedron_argmax`).
    l: deprecated name of ``regularization_strength`` (removed in 0.3.0).

  Returns:
    A ``jax.Array`` with the shape and floating dtype of ``x``; each row sums to
    :math:`n(n+1)/2`.

  Non-finite inputs: a row with a NaN or an infinite entry is NaN (the whole row).

  Raises:
    ValueError: a concrete ``regularization_strength`` outside the range of
      :func:`permutahedron_argmax`, or an unknown ``solver``.
    TypeError: integer ``x``, or both ``regularization_strength`` and ``l`` given.

  Example:
    >>> import jax.numpy as jnp
    >>> import implicit_topk as itk
    >>> x = jnp.array([5.0, 1.0, 2.0])
    >>> itk.soft_rank(x, regularization_strength=2.0)
    Array([3.  , 1.25, 1.75], dtype=float32)
    >>> itk.soft_rank(x, regularization_strength=0.1)
    Array([3., 1., 2.], dtype=float32)
  """
  l = _deprecation.strength(regularization_strength, l, "soft_rank")
  x = _validation.as_float_input(x)
  return _permutahedron(-x if descending else x, None, l=l, p=p, regularizer=regularizer,
                        axis=axis, solver=solver)


@_apply.explicit_axes_as_auto
def soft_sort(x: ArrayLike, k: int | None = None, *,
              regularization_strength: ArrayLike = _deprecation.DEFAULT_STRENGTH,
              p: float = 2.0, regularizer: RegularizerLike = None, axis: int = -1,
              descending: bool = False, solver: str = "auto", topk: int | None = None,
              l: ArrayLike | None = None) -> jax.Array:
  r"""Soft sort along ``axis`` (Blondel et al. 2020, "Fast differentiable sorting and ranking").

  .. math::

      s(x) = \arg\max_{y \in P(x)}\ \langle (n, \dots, 1), y\rangle - l\,\Omega(y),
      \qquad \Omega(y) = \tfrac1p \textstyle\sum_i |y_i|^p \ \text{(default } p = 2),

  with :math:`l` = ``regularization_strength``, returned ascending by default. The output
  lies in the permutahedron of ``x`` (a convex combination of its permutations, so each
  row keeps its sum). As :math:`l \to 0` it is ``jnp.sort(x)``; as :math:`l` grows every
  entry tends to the row mean. O(n log n) per row.

  Equivalences: ``regularization_strength`` is fast-soft-sort's and torchsort's
  ``regularization_strength`` (identical for ``p=2``, their ``"l2"``).
  ``regularizer="entropy"`` (positive values only) is the negentropy-regularized program
  above; fast-soft-sort's and torchsort's ``"kl"`` soft sort is another operator, the same
  program in log space, which takes values of any sign: ``-log(soft_sort(exp(min(x) - x),
  descending=True, regularizer="entropy")) + min(x)``, checked against torchsort 0.1.10 to
  1e-15; the two agree as the strength goes to 0. SoftJAX's
  ``sort(x, softness=s, method="fast_soft_sort", mode="c0", standardize=False)`` is
  ``soft_sort(x, regularization_strength=(n - 1) * s)``. With ``k``, the ``k`` largest
  soft-sorted values, in the order of ott-jax's ``soft_sort.sort(x, topk=k)``
  (entropic optimal transport, Cuturi et al. 2019; no exact map between its
  ``epsilon`` and ``regularization_strength``).

  Args:
    x: float array of any shape (integer input is an error).
    k: ``None`` (default: the whole sorted row) or a Python int ``0 <= k <= n``: return
      only the ``k`` largest soft-sorted values (the last ``k`` ascending, the first
      ``k`` with ``descending=True``).
    regularization_strength: :math:`l > 0`, a scalar or an array broadcastable to the
      batch shape. Default 1.0. Note the units: ``soft_sort(c * x, l) =
      c * soft_sort(x, l * c ** (p - 1))`` for ``c > 0``, so :math:`l` scales like ``x``
      to the power ``1 - p`` (like ``1 / x`` for ``p=2``).
    p: p-norm exponent ``> 1`` (default 2.0); ignored when ``regularizer`` is given.
    regularizer: ``None`` (p-norm), ``"entropy"`` (then ``x`` must be positive; either
      order) or a regularizer object (see :func:`permutahedron_argmax`).
    axis: the axis to sort along (default -1).
    descending: sort in descending order (default False).
    solver: ``"auto"`` (default, = ``"pav_jax"``, pure JAX) or ``"pav"`` (a numba
      kernel on CPU; see :func:`permutahedron_argmax`).
    topk: deprecated name of ``k`` (removed in 0.3.0).
    l: deprecated name of ``regularization_strength`` (removed in 0.3.0).

  Returns:
    A ``jax.Array`` of ``x``'s floating dtype, with ``x``'s shape (``k``: size ``k``
    along ``axis``).

  Non-finite inputs: a row with a NaN or an infinite entry is NaN (the whole row).

  Raises:
    ValueError: a concrete ``regularization_strength`` outside the range of
      :func:`permutahedron_argmax`, ``k`` outside
      ``[0, n]``, an unknown ``solver``, or ``regularizer="entropy"`` with a concrete
      negative entry of ``x`` (traced: its row is NaN).
    TypeError: a non-integer ``k``, or both a new name and its deprecated one given.

  Example:
    >>> import jax.numpy as jnp
    >>> import implicit_topk as itk
    >>> x = jnp.array([5.0, 1.0, 2.0])
    >>> itk.soft_sort(x, regularization_strength=0.1)
    Array([1., 2., 5.], dtype=float32)
    >>> jnp.round(itk.soft_sort(x, regularization_strength=1.0), 4)
    Array([1.6667, 2.6667, 3.6667], dtype=float32)
    >>> itk.soft_sort(x, 2, regularization_strength=0.1, descending=True)
    Array([5., 2.], dtype=float32)
  """
  k = _deprecation.renamed_argument(k, topk, new="k", old="topk", function="soft_sort")
  l = _deprecation.strength(regularization_strength, l, "soft_sort")
  x = _validation.as_float_input(x)
  axis = _validation.canonicalize_axis(axis, x.ndim)
  n = x.shape[axis]
  if k is not None:
    _validation.check_k(k, n, integer=True, allow_n=True, name="k")
  moved = jnp.moveaxis(x, axis, -1)
  # ascending: the descending solution reversed (the LP over P(x) with the ranks reversed,
  # for any permutation-invariant regularizer; the entropy's needs x > 0, not -x > 0)
  y = _permutahedron(None, moved, l=l, p=p, regularizer=regularizer, axis=-1, solver=solver,
                     generator="x")
  if not descending:
    y = y[..., ::-1]
  if k is not None:
    y = y[..., :k] if descending else y[..., n - k:]
  return jnp.moveaxis(y, -1, axis)


@_apply.explicit_axes_as_auto
def soft_topk_values(x: ArrayLike, k: int, *,
                     regularization_strength: ArrayLike = _deprecation.DEFAULT_STRENGTH,
                     p: float = 2.0, regularizer: RegularizerLike = None, axis: int = -1,
                     solver: str = "auto", l: ArrayLike | None = None) -> jax.Array:
  r"""The ``k`` largest soft-sorted values along ``axis``, in descending order.

  .. math::

      v(x) = \big(s_1(x), \dots, s_k(x)\big), \qquad
      s(x) = \arg\max_{y \in P(x)}\ \langle (1, \dots, n), y\rangle - l\,\Omega(y),

  i.e. ``soft_sort(x, k, descending=True)`` (Blondel et al. 2020). SoftJAX's
  ``top_k(x, k, softness=s, method="fast_soft_sort", mode="c0", standardize=False)[0]``
  is ``soft_topk_values(x, k, regularization_strength=(n - 1) * s)``.

  Args:
    x: float array of any shape.
    k: a Python int, ``0 <= k <= n``.
    regularization_strength: :math:`l > 0` (default 1.0), scalar or per row.
    p: p-norm exponent ``> 1`` (default 2.0); ignored when ``regularizer`` is given.
    regularizer: ``None``, ``"entropy"`` (positive ``x`` only) or a regularizer object.
    axis: the axis to select along (default -1).
    solver: ``"auto"`` (default, = ``"pav_jax"``) or ``"pav"`` (see :func:`soft_sort`).
    l: deprecated name of ``regularization_strength`` (removed in 0.3.0).

  Returns:
    A ``jax.Array`` of ``x``'s floating dtype, ``x``'s shape with size ``k`` along ``axis``.

  Raises:
    TypeError: a non-integer ``k``.
    ValueError: ``k`` outside ``[0, n]`` or a concrete ``regularization_strength``
      outside the range of :func:`permutahedron_argmax`.

  Example:
    >>> import jax.numpy as jnp
    >>> import implicit_topk as itk
    >>> itk.soft_topk_values(jnp.array([5.0, 1.0, 2.0, 4.0]), 2, regularization_strength=0.1)
    Array([5., 4.], dtype=float32)
  """
  l = _deprecation.strength(regularization_strength, l, "soft_topk_values")
  return soft_sort(x, k, regularization_strength=l, p=p, regularizer=regularizer, axis=axis,
                   descending=True, solver=solver)


@_apply.explicit_axes_as_auto
def soft_quantile(x: ArrayLike, q: ArrayLike, *,
                  regularization_strength: ArrayLike = _deprecation.DEFAULT_STRENGTH,
                  p: float = 2.0, regularizer: RegularizerLike = None, axis: int = -1,
                  solver: str = "auto", l: ArrayLike | None = None) -> jax.Array:
  r"""Soft quantiles: the soft sort interpolated linearly at :math:`q (n - 1)`.

  .. math::

      Q_q(x) = (1 - f)\, s_{\lfloor q(n-1) \rfloor}(x) + f\, s_{\lfloor q(n-1) \rfloor + 1}(x),
      \qquad f = q(n-1) - \lfloor q(n-1) \rfloor,

  with :math:`s(x)` the ascending :func:`soft_sort` (0-based). As
  ``regularization_strength -> 0`` this is ``jnp.quantile(x, q, axis=axis)`` with its
  default ``method="linear"``, and the result has ``jnp.quantile``'s shape: ``q``'s
  shape first, then ``x``'s shape without ``axis``. Unlike ``jnp.quantile``, ``axis``
  defaults to -1 (``jnp.quantile``'s ``axis=None`` flattens ``x``; pass
  ``x.ravel()`` for that).

  Args:
    x: float array of any shape.
    q: the levels in ``[0, 1]`` (checked when concrete; a traced level outside it, or
      NaN, gives NaN): a scalar or an array of any shape (as ``numpy.quantile``;
      ``jnp.quantile`` takes rank <= 1).
    regularization_strength: :math:`l > 0` (default 1.0), scalar or per row (see
      :func:`soft_sort`).
    p: p-norm exponent ``> 1`` (default 2.0); ignored when ``regularizer`` is given.
    regularizer: ``None``, ``"entropy"`` or a regularizer object (see :func:`soft_sort`).
    axis: the axis to reduce (default -1).
    solver: ``"auto"`` (default, = ``"pav_jax"``) or ``"pav"`` (see :func:`soft_sort`).
    l: deprecated name of ``regularization_strength`` (removed in 0.3.0).

  Returns:
    A ``jax.Array`` of ``x``'s floating dtype and shape
    ``q.shape + x.shape[:axis] + x.shape[axis + 1:]``, as ``jnp.quantile``.

  Non-finite inputs: a row with a NaN or an infinite entry gives NaN at every level.

  Raises:
    ValueError: ``q`` outside ``[0, 1]`` (when concrete) or a concrete
      ``regularization_strength`` outside the range of :func:`permutahedron_argmax`.

  Example:
    >>> import jax.numpy as jnp
    >>> import implicit_topk as itk
    >>> x = jnp.array([[1.0, 5.0, 2.0, 4.0], [0.0, 3.0, 9.0, 6.0]])
    >>> itk.soft_quantile(x, 0.5, regularization_strength=0.01)
    Array([3. , 4.5], dtype=float32)
    >>> itk.soft_quantile(x, jnp.array([0.0, 0.5, 1.0]), regularization_strength=0.01).shape
    (3, 2)
  """
  l = _deprecation.strength(regularization_strength, l, "soft_quantile")
  x = _validation.as_float_input(x)
  axis = _validation.canonicalize_axis(axis, x.ndim)
  if x.shape[axis] == 0:
    raise ValueError(f"`x` has no entries along `axis`={axis} (shape {x.shape}): a quantile "
                     "needs at least one.")
  # the level, its position and the interpolation in the compute dtype: a level rounded
  # to bfloat16 (0.999 -> 1.0) or a position beyond 256 in it picks the wrong statistic
  dtype = _validation.compute_dtype(x.dtype)
  q = jnp.asarray(q, dtype)
  concrete = _validation._concrete(q)  # pylint: disable=protected-access
  if concrete is not None and not np.all((concrete >= 0) & (concrete <= 1)):
    raise ValueError(f"`q` must lie in [0, 1]; got {q!r}.")
  # the sorted axis first: (n, *batch), so that the levels' gathers give q.shape + batch
  sorted_x = jnp.moveaxis(soft_sort(x, regularization_strength=l, p=p, regularizer=regularizer,
                                    axis=axis, solver=solver), axis, 0).astype(dtype)
  n, batch = sorted_x.shape[0], sorted_x.shape[1:]
  position = q * (n - 1)
  lower = jnp.clip(jnp.floor(position).astype(jnp.int32), 0, n - 1)
  upper = jnp.clip(lower + 1, 0, n - 1)
  frac = (position - lower).reshape(q.shape + (1,) * len(batch))
  pick = lambda i: jnp.take(sorted_x, i.ravel(), axis=0).reshape(q.shape + batch)
  quantiles = pick(lower) * (1 - frac) + pick(upper) * frac
  # a traced level outside [0, 1] (or NaN): NaN, not an extrapolated or clipped value
  valid = ((q >= 0) & (q <= 1)).reshape(q.shape + (1,) * len(batch))
  return jnp.where(valid, quantiles, jnp.nan).astype(x.dtype)
