r"""The thresholds of router rows, many rows at a time (numba, CPU).

A router row (a few to a few hundred scores, ``k`` of 1 or 2) costs the per-row kernel
(:mod:`~implicit_topk.kernels.cpu.native_threshold`) more in the latency of its
iteration than in arithmetic: each Newton pass waits on the previous one. Here a block
of :data:`BLOCK` rows is put into lanes (entry ``i`` of row ``r`` at ``values[i, r]``),
so that every step runs over the block's rows at once, in loops that LLVM vectorizes
across rows and whose lanes do not wait on each other:

* rows of at most :data:`LANE_ROW` entries go in whole: one pass over the lanes keeps
  each row's three largest entries (min/max pairs) and checks that the row is finite;
  the bracket ``[x_(m) - l, x_(j+1)]`` and the binary rows follow as in
  :func:`~implicit_topk.kernels.cpu.native_threshold._small_k_row`;
* longer rows (up to the per-row kernel's one-pass length) put in their candidates,
  the entries above ``x_(m) - l`` in row order as the per-row kernel gathers them
  (at most :data:`CANDIDATES`; a row with more is left to the per-row kernel), the
  lanes padded with ``-inf``;
* each Newton pass takes phi and its derivatives on every lane (the entries at or below
  a row's bracket and the padding add exact zeros, so each lane's sums are those of the
  per-row kernel, in row order) and the step each lane proposes (for p = 4/3 to the
  root of the cubic phi is on at the current piece), both in loops over the lanes,
  then each row still iterating takes the safeguarded step of
  :func:`~implicit_topk.kernels.cpu.native_threshold._newton`, the same arithmetic;
* after :data:`LANE_PASSES` passes the rows still iterating (a few in 10^4 on
  normal rows: most take 2 or 3 passes) resume the per-row iteration where they are.

So every row gets the per-row kernel's threshold and pass count to the bit. Rows the
lanes do not take (non-finite entries, rows far from 0 relative to ``l``, ``k``
outside ``(0, 2]`` or not below ``n - 1``, p other than 4/3 and 2, and the float64
rows at the ends of the float range, which the per-row kernel rescales: an entry of
magnitude ``2^1022`` or more, a strength below ``2^-969``) are left to the per-row
kernel.

numba's disk cache is keyed on the file of each handler, not on this one;
:mod:`~implicit_topk.kernels.cpu.cache_stamp` clears the handlers' caches after a
change here.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from implicit_topk.kernels.cpu.native_threshold import (_ENTRY_LIMIT, _ONE_PASS_ROW, PNORM,
                                                        _OPTIONS, _STRENGTH_FLOOR,
                                                        _count_above, _gather_two_halves,
                                                        _midpoint, _newton, _safeguarded_step,
                                                        float64_entries, plain_step,
                                                        refined_step, store_threshold,
                                                        third_derivative)

#: Rows per block.
BLOCK = 64
#: Newton passes taken in lanes; rows still iterating then resume one by one.
LANE_PASSES = 5
#: The longest row iterated on in lanes whole; longer rows (up to the per-row kernel's
#: one-pass length) put their candidates in the lanes.
LANE_ROW = 16
#: The most candidates a longer row may put in the lanes.
CANDIDATES = 16
# the rows of the lanes' state array
_TOP0, _TOP1, _TOP2, _BAD, _K, _L, _INV, _LO, _HI, LAM, _PREV = range(11)
COUNT = _BAD  # (gathered rows: each lane's candidates, where whole rows keep their check)
TOTAL, _SLOPE, _CURVE, _STATE, PASSES, _FRACTIONAL, _STEP, NEAREST = range(11, 19)
STATE_ROWS = 19
_SKIP, _ITERATING, _DONE = 0.0, 1.0, 2.0


@njit(**_OPTIONS)
def workspace(n):
  """The arrays the lanes work in, for rows of ``n`` entries: the block's entries (or
  candidates) by lane, the lanes' state and the list of the iterating lanes."""
  return (np.empty((max(min(n, LANE_ROW), CANDIDATES), BLOCK)), np.empty((STATE_ROWS, BLOCK)),
          np.empty(BLOCK, np.int64))


@njit(**_OPTIONS)
def takes(kind, a, n):
  """How rows of ``n`` entries of the regularizer ``(kind, a)`` go through lanes: 0 not
  at all, 1 whole (:func:`block_thresholds`), 2 by their candidates
  (:func:`gathered_thresholds`)."""
  if not (kind == PNORM and (a == 3.0 or a == 1.0) and n >= 3):
    return 0
  return 1 if n <= LANE_ROW else (2 if n <= _ONE_PASS_ROW else 0)


@njit(**_OPTIONS)
def block_thresholds(x, b0, width, k, l, a, tol, root_eps, values, state, iterating, work):
  """The thresholds of rows ``b0 .. b0 + width - 1`` of ``x`` (``width <= BLOCK``) that
  the lanes take, in float64 (the mask is written from it): row ``b0 + r``'s in
  ``state[LAM, r]``, its passes in ``state[PASSES, r]`` (with ``shift`` 0: these rows
  are solved in their own coordinates). Returns a bit mask of those rows (bit ``r``
  for row ``b0 + r``): :func:`block_brackets`, then :func:`iterate`."""
  taken = block_brackets(x, b0, width, k, l, a, root_eps, values, state)
  iterate(values, x.shape[1], width, a, tol, state, iterating, work)
  return taken


@njit(**_OPTIONS)
def block_brackets(x, b0, width, k, l, a, root_eps, values, state):
  """Rows ``b0 .. b0 + width - 1`` of ``x`` into the lanes (entry ``i`` of row ``b0 +
  r`` at ``values[i, r]``), each lane's three largest entries and bracket; binary rows
  done, the others ready to iterate (:func:`iterate`). Returns the bit mask of the rows
  the lanes take."""
  n = x.shape[1]
  wide = float64_entries(x)
  for r in range(width):
    row = x[b0 + r]
    for i in range(n):
      values[i, r] = row[i]
  top0, top1, top2, bad = state[_TOP0], state[_TOP1], state[_TOP2], state[_BAD]
  for r in range(width):
    top0[r], top1[r], top2[r], bad[r] = -np.inf, -np.inf, -np.inf, 0.0
  for i in range(n):
    for r in range(width):
      v = values[i, r]
      t = 4.0 * v if wide else v  # float64: 4 v overflows from |v| = 2^1022 up
      bad[r] += t - t  # NaN once an entry is +-inf or NaN (or too large to shift)
      carried = min(top0[r], v)
      top0[r] = max(top0[r], v)
      top2[r] = max(top2[r], min(top1[r], carried))
      top1[r] = max(top1[r], carried)
  return _brackets(width, n, k, l, a, b0, root_eps, state)


@njit(**_OPTIONS)
def compact(source, n, values, state, lanes, count):
  """Lanes ``lanes[0] < lanes[1] < ... < lanes[count - 1]`` to the front: their entries
  ``source[:n]`` into ``values[:n]`` and their state moved, in that order, so that
  :func:`iterate` on the first ``count`` lanes runs on them alone (each lane's passes
  are its own). ``source`` may be ``values`` itself."""
  for u in range(count):
    r = lanes[u]
    for i in range(n):
      values[i, u] = source[i, r]
    if r != u:  # (u < r: lane u's state is already moved or not needed)
      for j in range(STATE_ROWS):
        state[j, u] = state[j, r]


@njit(**_OPTIONS)
def gathered_thresholds(x, b0, width, k, l, a, tol, root_eps, values, state, iterating,
                        work):
  """As :func:`block_thresholds` for rows longer than :data:`LANE_ROW` (up to the
  per-row kernel's one-pass length): :func:`gather_block`, then :func:`iterate` on the
  candidates."""
  taken, span = gather_block(x, b0, width, k, l, a, root_eps, values, state, work)
  iterate(values, span, width, a, tol, state, iterating, work)
  return taken


@njit(**_OPTIONS)
def gather_block(x, b0, width, k, l, a, root_eps, values, state, work):
  """Each row's bracket and candidates (the entries above ``x_(m) - l``, in row order)
  from the per-row kernel's one pass, the candidates into the lanes (padded with
  ``-inf``, which adds exact zeros) and their count into ``state[COUNT]`` (0 for binary
  rows, which are done). Rows with more than :data:`CANDIDATES` candidates are left to
  the per-row kernel. Returns (the bit mask of the rows taken, the most candidates of a
  lane)."""
  n = x.shape[1]
  wide = float64_entries(x)
  limit = _ENTRY_LIMIT if wide else np.inf
  taken, span = 0, 0
  fraction = min(max(0.5 ** a, 0.1), 0.9)
  for r in range(width):
    # float(): a float32 k, l stay float32 in numba (np.float64() cost the 16384 x 64
    # forward 6%); exact here, where they meet only float64 operands
    kr, lr = float(k[b0 + r]), float(l[b0 + r])
    state[_K, r], state[_L, r], state[_INV, r] = kr, lr, 1.0 / lr
    state[LAM, r], state[PASSES, r], state[_STATE, r], state[COUNT, r] = 0.0, 0.0, _SKIP, 0.0
    if not (kr > 0.0 and kr <= 2.0 and kr < n - 1 and (not wide or lr >= _STRENGTH_FLOOR)):
      continue
    m, j = int(math.ceil(kr)), int(math.floor(kr))
    finite, top0, top1, top2, count = _gather_two_halves(x[b0 + r], n, m, lr, work, limit)
    if not finite or abs(top0) * root_eps > lr:
      continue
    x_m = top0 if m == 1 else top1
    x_next = top0 if j == 0 else (top1 if j == 1 else top2)
    lo, hi = x_m - lr, x_next
    if j == m and lo >= hi:  # binary: the middle of the flat root interval
      state[LAM, r], state[_STATE, r] = _midpoint(hi, lo), _DONE
      taken |= 1 << r
      continue
    count = _count_above(work, count, lo)
    if count > CANDIDATES:
      continue
    taken |= 1 << r
    for i in range(count):
      values[i, r] = work[i]
    state[COUNT, r] = count
    span = max(span, count)
    state[_LO, r], state[_HI, r] = lo, hi
    state[LAM, r] = lo + fraction * (hi - lo)
    state[_PREV, r] = 2.0 * (hi - lo)
    state[_STATE, r] = _ITERATING
  for r in range(width):
    for i in range(int(state[COUNT, r]), span):
      values[i, r] = -np.inf
  return taken, span


@njit(**_OPTIONS)
def iterate(values, n, width, a, tol, state, iterating, work):
  """The lanes' Newton passes over ``values[:n]``, then the per-row iteration for the
  lanes still iterating after :data:`LANE_PASSES` (on their column of ``values``); then
  each lane's smallest entry above its threshold, into ``state[NEAREST]``."""
  active = 0
  for r in range(width):
    iterating[active] = r
    active += state[_STATE, r] == _ITERATING
  for _ in range(LANE_PASSES):
    if active == 0:
      break
    _phi_lanes(values, n, width, a, state)
    active = _steps(iterating, active, tol, state)
  for position in range(active):  # the slowest rows resume the per-row iteration
    r = iterating[position]
    for i in range(n):
      work[i] = values[i, r]
    state[LAM, r], state[PASSES, r] = _newton(
        work, n, state[_K, r], state[_L, r], PNORM, a, state[_LO, r], state[_HI, r],
        state[LAM, r], tol, state[_PREV, r], int(state[PASSES, r]), state[_L, r])
  # each lane's smallest entry above its threshold (inf where none; the padding is
  # -inf): the candidate of native_threshold.snap_candidate, for the caller's snap
  nearest, lam = state[NEAREST], state[LAM]
  for r in range(width):
    nearest[r] = np.inf
  for i in range(n):
    for r in range(width):
      v = values[i, r]
      nearest[r] = min(nearest[r], v if v > lam[r] else np.inf)


@njit(inline="always", **_OPTIONS)
def every_lane(width):
  """The bit mask of ``width`` lanes (all 64 bits set for a full block)."""
  return -1 if width >= 64 else (1 << width) - 1


@njit(cache=True, error_model="numpy", fastmath={"reassoc"})
def write_results(x, k, b0, width, a, state, y, lam, passes, residual, shift):
  """Rows ``b0 + r`` of the kernel's results from the lanes: the mask at the lane's
  threshold, as :func:`~implicit_topk.kernels.cpu.native_threshold._write_finite_mask`
  writes it (the same values to the bit; ``|sum(y) - k|`` of the values as stored,
  the sum reassociated as there), the threshold (as the pair ``shift + lam``:
  :func:`~implicit_topk.kernels.cpu.native_threshold.store_threshold`), the passes. Rows the
  lanes did not take get values the per-row kernel overwrites. Only the sum is
  reassociated, so that it vectorizes: summed in row order it was one dependent chain
  of adds a row, 3.1 of the 13.0 ms of the mask kernel at 16384 x 256, k = 1, float32
  (median of 21 interleaved calls of both versions in one process, load 2)."""
  n = x.shape[1]
  for r in range(width):
    row, out = x[b0 + r], y[b0 + r]
    root, l, inv = state[LAM, r], state[_L, r], state[_INV, r]
    if a == 3.0:
      for i in range(n):
        d = row[i] - root
        z = 1.0 if d >= l else min(max(d * inv, 0.0), 1.0)
        out[i] = z * z * z
    else:
      for i in range(n):
        d = row[i] - root
        out[i] = 1.0 if d >= l else min(max(d * inv, 0.0), 1.0)
    total = 0.0
    for i in range(n):
      total += out[i]
    b = b0 + r
    passes[b] = state[PASSES, r]
    store_threshold(lam, shift, b, state[LAM, r], 0.0)
    residual[b] = abs(total - float(k[b]))


@njit(**_OPTIONS)
def _brackets(width, n, k, l, a, b0, root_eps, state):
  """Each lane's bracket from its three largest entries: binary rows done, the others
  iterating from the per-row kernel's start; lanes left to the per-row kernel skipped.
  Returns the bit mask of the lanes taken."""
  taken = 0
  wide = float64_entries(l)
  fraction = min(max(0.5 ** a, 0.1), 0.9)
  for r in range(width):
    kr, lr = float(k[b0 + r]), float(l[b0 + r])
    state[_K, r], state[_L, r], state[_INV, r] = kr, lr, 1.0 / lr
    state[LAM, r], state[PASSES, r], state[_STATE, r] = 0.0, 0.0, _SKIP
    top0 = state[_TOP0, r]
    if not (state[_BAD, r] == 0.0 and kr > 0.0 and kr <= 2.0 and kr < n - 1
            and not abs(top0) * root_eps > lr and (not wide or lr >= _STRENGTH_FLOOR)):
      continue
    taken |= 1 << r
    m, j = int(math.ceil(kr)), int(math.floor(kr))
    x_m = top0 if m == 1 else state[_TOP1, r]
    x_next = top0 if j == 0 else (state[_TOP1, r] if j == 1 else state[_TOP2, r])
    lo, hi = x_m - lr, x_next
    state[_LO, r], state[_HI, r] = lo, hi
    if j == m and lo >= hi:  # binary: the middle of the flat root interval
      state[LAM, r], state[_STATE, r] = _midpoint(hi, lo), _DONE
      continue
    state[LAM, r] = lo + fraction * (hi - lo)
    state[_PREV, r] = 2.0 * (hi - lo)
    state[_STATE, r] = _ITERATING
  return taken


@njit(**_OPTIONS)
def _phi_lanes(values, n, width, a, state):
  """phi + k, -l phi' and l^2 phi'' of every lane at its ``lam``, and for p = 4/3 the
  count of its fractional entries (as the per-row kernel's ``_phi`` sums them, entry
  by entry in row order), then the step each lane proposes (the per-row kernel's
  ``newton_step``, for every lane in one vectorized loop), into the state."""
  total, slope, curve = state[TOTAL], state[_SLOPE], state[_CURVE]
  fractional = state[_FRACTIONAL]
  lam, inv, k = state[LAM], state[_INV], state[_K]
  for r in range(width):
    total[r], slope[r], curve[r], fractional[r] = -k[r], 0.0, 0.0, 0.0
  if a == 3.0:  # p = 4/3
    for i in range(n):
      for r in range(width):
        z = min(max((values[i, r] - lam[r]) * inv[r], 0.0), 1.0)
        inside = 1.0 if z < 1.0 else 0.0
        total[r] += z * z * z
        slope[r] -= 3.0 * z * z * inside
        curve[r] += 6.0 * z * inside
        fractional[r] += inside if z > 0.0 else 0.0
  else:  # p = 2
    for i in range(n):
      for r in range(width):
        z = (values[i, r] - lam[r]) * inv[r]
        total[r] += min(max(z, 0.0), 1.0)
        slope[r] -= 1.0 if (z > 0.0) & (z < 1.0) else 0.0
  step = state[_STEP]
  if a == 3.0:
    for r in range(width):
      scale = inv[r]
      dphi, d2phi = slope[r] * scale, curve[r] * scale * scale
      step[r] = refined_step(plain_step(total[r], dphi, d2phi), total[r], dphi, d2phi,
                             third_derivative(fractional[r], scale))
  else:
    for r in range(width):
      scale = inv[r]
      step[r] = plain_step(total[r], slope[r] * scale, curve[r] * scale * scale)


@njit(**_OPTIONS)
def _steps(iterating, active, tol, state):
  """One safeguarded step of each lane in ``iterating[:active]`` (the per-row kernel's
  ``_newton``, pass for pass); those still iterating are moved to the front of
  ``iterating``; returns their count."""
  kept = 0
  for position in range(active):
    r = iterating[position]
    lam, done = _step(r, tol, state)
    state[LAM, r] = lam
    iterating[kept] = r
    kept += not done
  return kept


@njit(inline="always", **_OPTIONS)
def _step(r, tol, state):
  """Lane ``r``'s step (the per-row kernel's, from the lane's phi): (its next lam,
  whether it is done); updates its bracket, last step and pass count."""
  inv, it = state[_INV, r], int(state[PASSES, r])
  phi, dphi = state[TOTAL, r], state[_SLOPE, r] * inv
  state[PASSES, r] = it + 1
  done, lam, state[_LO, r], state[_HI, r], state[_PREV, r] = _safeguarded_step(
      phi, dphi, state[_STEP, r], state[LAM, r], state[_LO, r], state[_HI, r],
      state[_PREV, r], it, tol, math.sqrt(tol) * (state[_K, r] + 1.0), state[_L, r])
  return lam, done
