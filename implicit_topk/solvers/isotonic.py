r"""The permutahedron's isotonic dual in pure JAX: sort orders and exact PAV blocks.

The permutahedron operators (:mod:`implicit_topk.permutahedron`) need, for rows
``s`` and ``w`` sorted descending, the solution of

.. math::

    v^\star = \arg\min_{v_1 \ge \dots \ge v_n} \sum_i f_i(v_i), \qquad
    f_i(v) = l\,\omega^*\big((s_i - v)/l\big) + w_i v,

as blocks of consecutive indices: ``ids`` (the block of each position, nondecreasing
from 0) and ``values`` (block ``j``'s value at index ``j``, 0 past the last block), the
layout of the host kernel :func:`implicit_topk.solvers.pav_kernels.permutahedron_blocks`.
A block's value :math:`u_B` minimizes :math:`\sum_{i \in B} f_i`: the root of
:math:`F_B(u) = \sum_{i \in B} g((s_i - u)/l) - \sum_{i \in B} w_i`.

**Parallel PAV.** Start with singleton blocks. Each round computes every block's value
and removes every boundary between adjacent blocks ``A`` (before) and ``B`` with
:math:`u_A \le u_B`: all at once, so a chain of violating neighbours becomes one block.
Valid because of the pooling lemma for separable strictly convex isotonic problems:
if the unconstrained minimizers of two adjacent pooled terms satisfy
:math:`u_A \le u_B`, then :math:`v^\star` is constant on :math:`A \cup B` (KKT: a strict
boundary between them would need :math:`u_A \ge v^\star_A > v^\star_B \ge u_B`); the
reduced problem over the current blocks is again of the same form, so every such pair
of one round may be merged together. The rounds stop when adjacent values strictly
decrease, which is the optimality condition of the reduced problem; merging equal
neighbours too gives the host's convention (adjacent blocks never share a value).
Each round removes at least one boundary: at most ``n - 1`` rounds, typically a few.

Everything is kept per block (arrays of length ``n``, entry ``j`` for block ``j``):
the start positions and the statistics that merge by sums, so a round is one scan
(the new block numbers) and a few segmented scans (:func:`segmented_scan`: sums
within runs of adjacent blocks, then one scatter to distinct addresses); nothing is
``n x n``, and no two entries ever add into one address (a GPU serializes those).

* ``p = 2``: :math:`u_B = \mathrm{mean}_B(s - l w)`: sums of ``s - l w``.
* entropy (:math:`g = \exp`): :math:`u_B = M_B + l \log \sum_B e^{(s_i - M_B)/l} - l \log W_B`
  with :math:`M_B` = the block's first (largest) ``s``; :math:`+\infty` if
  :math:`W_B \le 0` (as the host).
* other ``p``: a merged block's value lies between the smallest and the largest of the
  values it pools (:math:`F_B` is their sum of decreasing terms): safeguarded Newton
  / bisection in that bracket on the data (the host's :func:`_newton_block`, vectorized
  over all blocks of all rows), started where it is exact if the block's entries
  equal their mean.

:func:`descending_order` sorts with XLA's single-operand sort only (keys packed with
positions, least significant digits first): on CPU the sort of (key, index) pairs is
several times slower than sorting packed integers.

Rows with a non-finite ``s`` or ``w``, or ``l`` not in (0, inf), get NaN values and
one block per position (as the host).
"""

from __future__ import annotations

import jax
import jax.export
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["descending_order", "isotonic_blocks"]

_MAXIT = 200  # Newton / bisection iterations per round (the host's cap)


# -- sorting ---------------------------------------------------------------------------


def _descending_keys(x):
  """Unsigned integer keys whose ascending order is ``x``'s descending order (by bit
  pattern, as the host's radix sort: +0.0 before -0.0)."""
  bits = {np.dtype(np.float32): jnp.uint32, np.dtype(np.float64): jnp.uint64}[np.dtype(x.dtype)]
  width = np.dtype(bits).itemsize * 8
  b = lax.bitcast_convert_type(x, bits)
  negative = (b >> (width - 1)) == 1
  top = jnp.asarray(1 << (width - 1), bits)
  ascending = jnp.where(negative, ~b, b | top)
  return ~ascending, width


def descending_order(x, *, packed_bits: int | None = None):
  """The stable descending order of each row of a float (R, n) array: int32 (R, n).

  A least-significant-digit radix sort whose passes are XLA sorts of one packed
  integer array (digit above the position): each pass is stable because the
  position breaks ties. Ties keep their order; -0.0 comes after +0.0 (bit order, as
  the host's radix sort). ``packed_bits``: the bits of a packed key (default 63 with
  ``jax_enable_x64``, else 31); rows too long to leave 8 bits per digit sort
  (key, position) pairs instead.
  """
  rows, n = x.shape
  keys, key_bits = _descending_keys(x)
  if packed_bits is None:
    packed_bits = 63 if jax.config.read("jax_enable_x64") else 31
  pack = jnp.int64 if packed_bits > 31 else jnp.int32
  symbolic = jax.export.is_symbolic_dim(n)  # a row length unknown until run (jax.export)
  index_bits = 0 if symbolic else max(1, int(n - 1).bit_length())
  digit_bits = packed_bits - index_bits
  position = lax.broadcasted_iota(pack, (rows, n), 1)
  if symbolic or digit_bits < 8:  # rows too long (or unknown) to pack: (key, position) pairs
    return lax.sort((keys, position.astype(jnp.int32)), dimension=1, num_keys=1)[1]
  unsigned = keys.dtype
  order = None
  for shift in range(0, key_bits, digit_bits):
    k = keys if order is None else jnp.take_along_axis(keys, order, axis=1)
    digit = ((k >> shift) & jnp.asarray((1 << min(digit_bits, key_bits - shift)) - 1,
                                         unsigned)).astype(pack)
    packed = lax.sort((digit << index_bits) | position, dimension=1)
    step = (packed & ((1 << index_bits) - 1)).astype(jnp.int32)
    order = step if order is None else jnp.take_along_axis(order, step, axis=1)
  return order


# -- per-block helpers -------------------------------------------------------------------


def _flat(index, size):
  """Flat indices into a (R, size) array for per-row indices (R, m)."""
  rows = index.shape[0]
  return (index + (jnp.arange(rows, dtype=index.dtype) * size)[:, None]).reshape(-1)


def _gather(values, index):
  """``values[r, index[r, i]]`` for a (R, size) array and sorted (R, m) indices."""
  return values.reshape(-1).at[_flat(index, values.shape[1])].get(
      mode="promise_in_bounds", indices_are_sorted=True).reshape(index.shape)


def segmented_scan(values, reach, *, op=jnp.add, reverse: bool = False):
  r"""Inclusive scan of ``op`` along axis 1 within runs of consecutive entries.

  ``out[:, i] = op(values[:, i - reach[:, i]], ..., values[:, i])`` (``reverse``:
  ``values[:, i .. i + reach[:, i]]``), ``reach`` (int32, (R, m)) the distance from
  ``i`` to its run's first (``reverse``: last) entry; ``values`` (R, m[, k]). Hillis
  and Steele (1986, "Data parallel algorithms"): level ``d`` combines with the partial
  result ``2**d`` back where ``reach >= 2**d``; after ``ceil(log2 m)`` levels each
  entry covers its run (by induction, entry ``i`` covers
  ``[max(i - 2**d + 1, i - reach_i), i]`` after ``d`` levels, since
  ``reach_{i - 2**d} = reach_i - 2**d`` in one run). O(m log m) work, no scatter, so
  no two entries ever add into one address (serialized atomics on GPUs); sums stay
  within a run (no cancellation against a long prefix). Linear in ``values`` for
  ``op=jnp.add``: JAX derives its transpose (the same levels the other way), again
  scatter-free, keeping one mask of m booleans per level. The levels are unrolled
  (static shifts, which XLA fuses): the program grows with ``log2 m``.
  """
  m = values.shape[1]
  reach = reach.reshape(reach.shape + (1,) * (values.ndim - 2))
  for d in range(max(0, int(m - 1).bit_length())):
    k = 1 << d
    values = jnp.where(reach >= k, op(values, _shift(values, k if reverse else -k, 0)), values)
  return values


def run_reach(first):
  """``(from_first, to_last)``: each entry's distance to the first and to the last entry
  of its run, for the runs that begin where ``first`` (R, m) is True (entry 0 always
  begins one): int32 (R, m), the ``reach`` of :func:`segmented_scan`. O(m): a cumsum
  (the run numbers), one scatter per end to distinct addresses, two gathers (XLA:CPU
  runs a cumulative max as a reduce-window whose cost is quadratic in m)."""
  rows, m = first.shape
  first = first.at[:, 0].set(True)
  run = _cumsum(first.astype(jnp.int32)) - 1
  position = lax.broadcasted_iota(jnp.int32, (rows, m), 1)

  def at_runs(flags):
    flat = jnp.where(flags, _flat(run, m).reshape(rows, m), rows * m).reshape(-1)
    ends = jnp.zeros((rows * m,), jnp.int32).at[flat].set(
        position.reshape(-1), mode="drop", unique_indices=True)
    return _gather(ends.reshape(rows, m), run)

  return position - at_runs(first), at_runs(_shift(first, 1, True)) - position


def _run_reduce(op, values, starts, size):
  """``op`` (``jnp.add``, ``jnp.minimum``, ``jnp.maximum``) of (R, m[, k]) ``values`` over
  the runs that begin where ``starts`` (R, m) is True (entry 0 always begins one), run
  ``j`` at index ``j`` of an (R, size) array (``size`` >= the runs; the identity past
  them: 0, inf or -inf). A contention-free segment reduction: :func:`segmented_scan` to
  each run's first entry, then one scatter whose indices are distinct (each run's
  first entry to its run's index; the rest dropped). On CPU, where scatters run
  serially (no atomics), the O(m) segment reduction, several times faster."""
  rows, m = starts.shape
  tail = values.shape[2:]
  run = _cumsum(starts.astype(jnp.int32)) - 1

  def on_cpu(values):  # serial scatters on CPU (no atomics): the O(m) segment reduction
    segment = {jnp.add: jax.ops.segment_sum, jnp.minimum: jax.ops.segment_min,
               jnp.maximum: jax.ops.segment_max}[op]
    out = segment(values.reshape((rows * m,) + tail), _flat(run, size),
                  num_segments=rows * size, indices_are_sorted=True)
    return out.reshape((rows, size) + tail)

  def default(values):
    totals = segmented_scan(values, run_reach(starts)[1], op=op, reverse=True)
    flat = jnp.where(starts, _flat(run, size).reshape(rows, m), rows * size).reshape(-1)
    identity = {jnp.add: 0, jnp.minimum: jnp.inf, jnp.maximum: -jnp.inf}[op]
    out = jnp.full((rows * size,) + tail, identity, values.dtype)
    return out.at[flat].set(totals.reshape((-1,) + tail), mode="drop",
                            unique_indices=True).reshape((rows, size) + tail)

  return lax.platform_dependent(values, cpu=on_cpu, default=default)


_SCAN_BLOCK = 16


def _matmul_cumsum(x):
  """Inclusive cumsum along axis 1 of small nonnegative integers (float32, exact below
  2**24) as products with a triangular matrix, chunk by chunk: XLA:CPU's own
  cumsum (a reduce_window) is several times slower."""
  rows, m = x.shape
  b = _SCAN_BLOCK
  padded = -(-m // b) * b
  chunks = jnp.pad(x, ((0, 0), (0, padded - m))).reshape(rows, padded // b, b)
  within = jnp.matmul(chunks, jnp.triu(jnp.ones((b, b), x.dtype)),
                      precision=lax.Precision.HIGHEST)
  totals = within[..., -1]
  before = (_matmul_cumsum(totals) - totals if totals.shape[1] > 1
            else jnp.zeros_like(totals))
  return (within + before[..., None]).reshape(rows, padded)[:, :m]


def _cumsum(x):
  """Inclusive cumsum along axis 1 of a nonnegative int32 (R, m) array whose row sums
  stay below 2**24: int32."""
  def on_cpu(x):
    return _matmul_cumsum(x.astype(jnp.float32)).astype(jnp.int32)
  def default(x):
    return jnp.cumsum(x, axis=1, dtype=jnp.int32)
  return lax.platform_dependent(x, cpu=on_cpu, default=default)


def _shift(a, k, fill):
  """``a`` shifted along axis 1 by ``k`` (> 0: ``out[j] = a[j + k]``; < 0: ``a[j - |k|]``),
  ``fill`` where that falls outside."""
  n = a.shape[1]
  if abs(k) >= n:
    return jnp.full_like(a, fill)
  pad = jnp.full_like(a[:, :abs(k)], fill)
  return (jnp.concatenate([a[:, k:], pad], axis=1) if k > 0
          else jnp.concatenate([pad, a[:, :k]], axis=1))


class _ClosedForm:
  """Block statistics that combine associatively (concatenation of runs of blocks)
  and give the block value in closed form: p = 2 (sums of s - l w) and entropy
  (log-sum-exp relative to the run's first, largest, s). ``c`` is the block size."""

  def __init__(self, kind, s, w, l):
    self.kind, self.s, self.w, self.l = kind, s, w, l

  def init(self):
    one = jnp.ones_like(self.s)
    if self.kind == "p2":
      return {"c": one, "t": self.s - self.l * self.w}
    return {"c": one, "m": self.s, "e": one, "w": self.w}

  def empty(self, key):
    return {"c": 0, "t": 0, "m": -jnp.inf, "e": 0, "w": 0}[key]

  def combine(self, a, b):
    """The statistics of run ``a`` followed by run ``b`` (either may be empty)."""
    if self.kind == "p2":
      return {"c": a["c"] + b["c"], "t": a["t"] + b["t"]}
    a_empty = a["c"] == 0
    m = jnp.where(a_empty, b["m"], a["m"])
    scale = jnp.exp(jnp.where((b["c"] > 0) & ~a_empty, b["m"] - a["m"], 0) / self.l)
    e = jnp.where(a_empty, b["e"], a["e"] + b["e"] * scale)
    return {"c": a["c"] + b["c"], "m": m, "e": e, "w": a["w"] + b["w"]}

  def value(self, stats):
    c = stats["c"]
    if self.kind == "p2":
      return stats["t"] / jnp.where(c > 0, c, 1)
    w = stats["w"]
    finite = stats["m"] + self.l * (jnp.log(jnp.where(c > 0, stats["e"], 1))
                                    - jnp.log(jnp.where(w > 0, w, 1)))
    return jnp.where(w > 0, finite, jnp.inf)

  def merge(self, stats, new_index, ids):
    """Statistics of the merged blocks (``new_index``: the new block of each old one)."""
    del ids
    size = new_index.shape[1]
    starts = new_index != _shift(new_index, -1, -1)
    if self.kind == "p2":
      both = _run_reduce(jnp.add, jnp.stack([stats["c"], stats["t"]], -1), starts, size)
      return {"c": both[..., 0], "t": both[..., 1]}, None
    top = _run_reduce(jnp.maximum, stats["m"], starts, size)  # the first s
    shift = jnp.where(stats["c"] > 0, stats["m"] - _gather(top, new_index), 0)
    scaled = stats["e"] * jnp.exp(shift / self.l)
    summed = _run_reduce(jnp.add, jnp.stack([stats["c"], scaled, stats["w"]], -1), starts,
                         size)
    return {"c": summed[..., 0], "m": top, "e": summed[..., 1], "w": summed[..., 2]}, None


class _Newton:
  """Any p-norm: block values by safeguarded Newton on the data (entries' blocks ``ids``)."""

  def __init__(self, regularizer, s, w, l):
    self.p, self.link = float(regularizer.p), regularizer.link
    self.s, self.w, self.l = s, w, l

  def init(self):
    s, w = self.s, self.w
    u = s - self.l * jnp.sign(w) * jnp.abs(w) ** (self.p - 1.0)  # singletons: closed form
    return {"c": jnp.ones_like(s), "w": w, "sum_s": s, "u": u}

  def value(self, stats):
    return stats["u"]

  def merge(self, stats, new_index, ids):
    size = new_index.shape[1]
    ids = _gather(new_index, ids)
    starts = new_index != _shift(new_index, -1, -1)
    sums = _run_reduce(jnp.add, jnp.stack([stats["c"], stats["w"], stats["sum_s"]], -1),
                       starts, size)
    c, w, sum_s = sums[..., 0], sums[..., 1], sums[..., 2]
    # A merged block's root lies between the values it pools.
    lo = _run_reduce(jnp.minimum, stats["u"], starts, size)
    hi = _run_reduce(jnp.maximum, stats["u"], starts, size)
    u = self._newton(ids, w, sum_s, c, lo, hi)
    return {"c": c, "w": w, "sum_s": sum_s, "u": u}, ids

  def _newton(self, ids, W, S, count, lo, hi):
    """Roots of F_B(u) = sum_B g((s_i - u)/l) - W_B in [lo, hi], all blocks at once
    (the host's safeguarded Newton / bisection, :func:`pav_kernels._newton_block`)."""
    s, l, link = self.s, self.l, self.link
    size = W.shape[1]
    eps = jnp.finfo(s.dtype).eps
    m = jnp.where(count > 0, count, 1)
    mean = S / m
    r = W / m
    start = mean - l * jnp.sign(r) * jnp.abs(r) ** (self.p - 1.0)
    tol = 4 * eps * jnp.maximum(jnp.maximum(jnp.abs(lo), jnp.abs(hi)), jnp.abs(mean))
    active = (count > 0) & (lo < hi)
    v = jnp.where((lo < start) & (start < hi), start, 0.5 * (lo + hi))
    v = jnp.where(active, v, lo)

    starts = ids != _shift(ids, -1, -1)

    def evaluate(v):
      z = (s - _gather(v, ids)) / l
      g, dg = jax.jvp(link, (z,), (jnp.ones_like(z),))
      both = _run_reduce(jnp.add, jnp.stack([g, dg], -1), starts, size)
      return both[..., 0], both[..., 1] / l

    def body(state):
      it, v, lo, hi, f_prev, active = state
      G, dG = evaluate(v)
      F = G - W
      lo = jnp.where(active & (F > 0), v, lo)
      hi = jnp.where(active & (F < 0), v, hi)
      mid = 0.5 * (lo + hi)
      newton = v + F / jnp.where(dG > 0, dG, 1)
      use = ((dG > 0) & (dG < jnp.inf) & (jnp.abs(F) <= 0.5 * jnp.abs(f_prev))
             & (lo < newton) & (newton < hi))
      vn = jnp.where(use, newton, mid)
      small = jnp.abs(vn - v) <= tol
      residual_ok = jnp.abs(F) <= 16 * eps * (jnp.abs(G) + jnp.abs(W) + m)
      narrow = hi - lo <= tol
      done = (F == 0) | narrow | (small & residual_ok)
      vn = jnp.where(small & ~residual_ok, mid, vn)
      result = jnp.where(F == 0, v, jnp.where(narrow, mid, vn))
      return (it + 1, jnp.where(active, result, v), lo, hi, jnp.where(active, F, f_prev),
              active & ~done)

    def cond(state):
      return (state[0] < _MAXIT) & jnp.any(state[-1])

    state = (jnp.zeros((), jnp.int32), v, lo, hi, jnp.full_like(v, jnp.inf), active)
    return lax.while_loop(cond, body, state)[1]


def _shift_by(a, k, fill):
  """``a`` shifted along axis 1 by a traced ``k`` in [0, size]: ``out[j] = a[j + k]``
  (``fill`` past the end)."""
  size = a.shape[1]
  padded = jnp.concatenate([a, jnp.full_like(a, fill)], axis=1)
  return lax.dynamic_slice_in_dim(padded, k, size, axis=1)


def _shift_back_by(a, k, fill):
  """``out[j] = a[j - k]`` for a traced ``k`` in [0, size] (``fill`` before the start)."""
  size = a.shape[1]
  padded = jnp.concatenate([jnp.full_like(a, fill), a], axis=1)
  return lax.dynamic_slice_in_dim(padded, size - k, size, axis=1)


def _joins(model, stats, gallop):
  """``joins[:, j]``: block ``j`` merges into block ``j - 1`` (R, size) bool.

  Adjacent blocks with ``u_{j-1} <= u_j``, and for ``gallop`` levels (closed forms)
  also where a run of 2, 4, ..., 2**gallop blocks starting at ``j`` has a value
  >= ``u_{j-1}``, or such a run ending at ``j - 1`` a value <= ``u_j``: by the
  pooling lemma any runs ``[a..j-1]``, ``[j..b]`` whose pooled values violate the
  order prove that ``v*_{j-1} = v*_j``. These runs catch a large block swallowing
  its small neighbours, one per round otherwise. Levels run in a loop, so that each
  is computed once (XLA would fuse and recompute unrolled levels).
  """
  c = stats["c"]
  size = c.shape[1]
  valid = (c > 0) & (lax.broadcasted_iota(jnp.int32, c.shape, 1) > 0)  # block 0 never joins
  u = model.value(stats)
  previous = _shift(u, -1, jnp.inf)
  joins = previous <= u
  levels = min(gallop, max(0, int(size - 1).bit_length()))
  if levels:
    def level(q, carry):
      right, left, joins = carry
      k = jnp.left_shift(jnp.int32(1), q)
      right = model.combine(right, {key: _shift_by(a, k, model.empty(key))
                                    for key, a in right.items()})
      left = model.combine({key: _shift_back_by(a, k, model.empty(key))
                            for key, a in left.items()}, left)
      joins |= (previous <= model.value(right)) | (_shift(model.value(left), -1, jnp.inf) <= u)
      return right, left, joins

    joins = lax.fori_loop(0, levels, level, (stats, stats, joins))[2]
  return valid & joins


def _sizes(n):
  """Block-array sizes: once every row has at most ``size / 8`` blocks, the rounds go on
  with arrays of that size (a round's cost is proportional to it)."""
  sizes = [n]
  while sizes[-1] // 8 >= 64:
    sizes.append(sizes[-1] // 8)
  return sizes


_PLAIN_ROUNDS = 2  # rounds with adjacent tests only, before the run tests start


def isotonic_blocks(s, w, l, regularizer, *, gallop: int = 8):
  """PAV blocks of the isotonic dual for rows sorted descending, in pure JAX.

  Args:
    s: (R, n) float, each row nonincreasing.
    w: (R, n) float (same dtype), each row nonincreasing.
    l: (R,) regularization strengths.
    regularizer: a :class:`~implicit_topk.regularizers.PNorm` (any p > 1) or
      :class:`~implicit_topk.regularizers.Entropy`.
    gallop: levels of run tests (:func:`_joins`; closed forms only), used from round
      ``_PLAIN_ROUNDS`` on (most inputs need fewer rounds; a long cascade needs
      about ``length / 2**gallop`` rounds with them): the result is the same, the
      rounds fewer, each round dearer.

  Returns:
    ``(values, ids, rounds)``: block values (R, n) (block ``j`` at index ``j``, 0 past
    the last block), block ids (R, n) int32 (nondecreasing, from 0), and the number of
    merge rounds run (a diagnostic). Rows with a non-finite entry, or ``l`` not in
    (0, inf), get NaN values and one block per position.
  """
  rows, n = s.shape
  if n >= 2 ** 24:
    raise ValueError(f"rows of length {n} >= 2**24 are not supported by the JAX solver; "
                     "use solver='pav'.")
  ok = (jnp.all(jnp.isfinite(s), axis=1) & jnp.all(jnp.isfinite(w), axis=1)
        & jnp.isfinite(l) & (l > 0))
  s = jnp.where(ok[:, None], s, 0)
  w = jnp.where(ok[:, None], w, 0)
  l = jnp.where(ok, l, 1)[:, None]
  kind = getattr(regularizer, "pav_kind", None)
  model: _ClosedForm | _Newton
  if kind == ("link", "exp"):
    model = _ClosedForm("exp", s, w, l)
  elif regularizer.exponent == 1:
    model = _ClosedForm("p2", s, w, l)
  else:
    model = _Newton(regularizer, s, w, l)
  closed = isinstance(model, _ClosedForm)
  gallop = gallop if closed else 0
  position = lax.broadcasted_iota(jnp.int32, (rows, n), 1) + jnp.zeros_like(s, jnp.int32)

  def body(state):
    rounds, ids, stats, joins = state
    new_index = _cumsum((~joins).astype(jnp.int32)) - 1
    stats, ids = model.merge(stats, new_index, ids)
    if gallop:
      joins = lax.cond(rounds + 1 >= _PLAIN_ROUNDS, lambda st: _joins(model, st, gallop),
                       lambda st: _joins(model, st, 0), stats)
    else:
      joins = _joins(model, stats, 0)
    return rounds + 1, ids, stats, joins

  def blocks(stats):
    return jnp.max(jnp.sum(stats["c"] > 0, axis=1))

  def finish(state):
    rounds, ids, stats, _ = state
    size = stats["c"].shape[1]
    counts = stats["c"].astype(jnp.int32)
    if closed:  # the entries' blocks from the block sizes
      ends = _cumsum(counts)  # block j covers [ends[j] - counts[j], ends[j])
      # a 1 where each block after the first begins: distinct addresses (the rest dropped)
      begins = ((ends < n) & (counts > 0)).reshape(-1)
      starts = jnp.zeros((rows * n,), jnp.int32).at[
          jnp.where(begins, _flat(ends, n), rows * n)].set(
              1, mode="drop", unique_indices=True).reshape(rows, n)
      ids = _cumsum(starts)
    values = jnp.where(counts > 0, model.value(stats), 0).astype(s.dtype)
    return jnp.pad(values, ((0, 0), (0, n - size))), ids, rounds

  def solve(state, sizes):
    """Rounds at block-array size ``sizes[0]``; once every row has at most
    ``sizes[1]`` blocks, on with arrays of that size."""
    if len(sizes) == 1:
      return finish(lax.while_loop(lambda st: jnp.any(st[3]), body, state))
    smaller = sizes[1]
    state = lax.while_loop(lambda st: jnp.any(st[3]) & (blocks(st[2]) > smaller), body, state)

    def shrink(state):
      rounds, ids, stats, joins = state
      return solve((rounds, ids, {key: a[:, :smaller] for key, a in stats.items()},
                    joins[:, :smaller]), sizes[1:])

    return lax.cond(blocks(state[2]) <= smaller, shrink, finish, state)

  stats = model.init()
  state = (jnp.zeros((), jnp.int32), None if closed else position, stats,
           _joins(model, stats, gallop if _PLAIN_ROUNDS <= 0 else 0))
  values, ids, rounds = solve(state, _sizes(n))
  values = jnp.where(ok[:, None], values, jnp.nan)
  ids = jnp.where(ok[:, None], ids, position)
  return values, ids, rounds
