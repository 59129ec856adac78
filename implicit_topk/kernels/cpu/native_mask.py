"""The mask kernel's entry: every row of a call, short router rows a block at a time in
lanes (:mod:`~implicit_topk.kernels.cpu.native_lanes`), the others one by one
(:func:`~implicit_topk.kernels.cpu.native_threshold._solve_row`), with the same results
to the bit; and the XLA FFI handlers ``capped_simplex_f32`` / ``capped_simplex_f64``
(:mod:`~implicit_topk.kernels.cpu.registry` builds them). Its own module so that the
per-row kernel and the lanes, which build on it, import no circle."""

from __future__ import annotations

import math

import numpy as np
from numba import carray, njit

from implicit_topk.kernels.cpu import abi, native_lanes, threads
from implicit_topk.kernels.cpu.native_threshold import (_OPTIONS, _all_finite, _solve_row,
                                                        _write_mask, snap_candidate, snap_to_entry,
                                                        store_threshold, within_snap)


@njit(**_OPTIONS)
def capped_simplex_rows(x, k, l, kind, a, y, lam, passes, residual, shift, lanes=True):
  """Every row of ``x`` (rows, n): its threshold into ``lam``, its mask into ``y``,
  the Newton passes into ``passes``, ``|sum(y) - k|`` (of ``y`` as stored) into
  ``residual`` and the threshold as the pair ``shift + lam`` of the output dtype
  (:func:`~implicit_topk.kernels.cpu.native_threshold.store_threshold`: ``shift`` the
  nearest float to it, ``lam`` the rest; the iteration ran relative to the row's
  largest finite entry where it is far from 0 relative to ``l``). ``lam + shift`` is the
  threshold of the row ``x 2^-E`` with strength ``l 2^-E``: ``E`` is 0 for every row
  away from the ends of the float range (then the threshold of the row as given), and
  for float64 rows at them the exponent of the exact rescaling of
  :func:`~implicit_topk.kernels.cpu.native_threshold.scale_exponent` (the same as
  :func:`implicit_topk.solvers.float_range.scale_exponent`, from ``x`` and ``l``:
  the derivative kernels and :meth:`~implicit_topk.solvers.NativeSolver.run` find it
  again). Short router rows go through :mod:`~implicit_topk.kernels.cpu.native_lanes`
  a block at a time, with the same results (never a row with ``E != 0``;
  ``lanes=False``: none, as the tests compare). Every p-norm row's threshold is then
  snapped to an entry sitting at it
  (:func:`~implicit_topk.kernels.cpu.native_threshold.snap_to_entry`). Returns 0 (the
  status)."""
  rows, n = x.shape
  work = np.empty(max(n, 1), np.float64)
  scratch = np.empty(max(n, 1), np.float64)
  guess = np.full(3, np.inf)  # the next row's distance to its cut; the gaps' mean, deviation
  tol = 4.0 * np.finfo(lam.dtype).eps
  root_eps = math.sqrt(np.finfo(lam.dtype).eps)
  lanes = native_lanes.takes(kind, a, n) if lanes else 0
  values, state, iterating = native_lanes.workspace(n if lanes else 1)
  for b0 in range(0, rows, native_lanes.BLOCK):
    width = min(native_lanes.BLOCK, rows - b0)
    taken = 0
    if lanes == 1:
      taken = native_lanes.block_thresholds(x, b0, width, k, l, a, tol, root_eps, values,
                                            state, iterating, work)
    elif lanes == 2:
      taken = native_lanes.gathered_thresholds(x, b0, width, k, l, a, tol, root_eps, values,
                                               state, iterating, work)
    if lanes:
      native_lanes.write_results(x, k, b0, width, a, state, y, lam, passes, residual, shift)
      for r in range(width):  # (a threshold a few ulps below an entry at it: that entry)
        b = b0 + r
        if (taken >> r) & 1 and within_snap(state[native_lanes.LAM, r],
                                            state[native_lanes.NEAREST, r], float(l[b]), tol):
          _snap(x[b], n, state[native_lanes.LAM, r], state[native_lanes.NEAREST, r],
                float(l[b]), float(k[b]), kind, a, 0.0, tol, y[b], lam, shift, residual, b)
    if taken == native_lanes.every_lane(width):
      continue
    for b in range(b0, b0 + width):
      if (taken >> (b - b0)) & 1:
        continue
      # float32 stays float32 (numba's float()): exact, as they meet only float64 operands
      # (np.float64() cost the 16384 x 64 forward 6%)
      lb, kb = float(l[b]), float(k[b])
      value, it, origin, residual[b] = _solve_row(x[b], n, kb, lb, kind, a, tol, root_eps,
                                                  work, scratch, guess, y[b])
      passes[b] = it
      store_threshold(lam, shift, b, value, origin)
      nearest = snap_candidate(x[b], n, value, lb, kind, origin, tol)
      if nearest == nearest:
        _snap(x[b], n, value, nearest, lb, kb, kind, a, origin, tol, y[b], lam, shift,
              residual, b)
  return 0


@njit(**_OPTIONS)
def _snap(row, n, value, nearest, lb, kb, kind, a, origin, tol, out, lam, shift, residual, b):
  """Row ``b``'s threshold ``value`` snapped to the entry ``nearest`` where
  :func:`~implicit_topk.kernels.cpu.native_threshold.snap_to_entry` takes it: its mask
  rewritten, its threshold and residual stored."""
  value, moved = snap_to_entry(row, n, value, nearest, lb, kb, kind, a, origin, tol)
  if moved:
    total = _write_mask(row, n, value, lb, kind, a, origin, _all_finite(row, n), out)
    store_threshold(lam, shift, b, value, origin)
    residual[b] = abs(total - kb)


# -- the FFI handlers: (x (..., n), k (...), l (...)) with attributes a (float64) and
#    kind (int32) -> (y (..., n), lam (...), passes int32 (...), residual (...),
#    shift (...)), one
#    float dtype. ----------------------------------------------------------------------
_BAD_ARGUMENTS = abi.message(
    "implicit_topk capped_simplex kernel: expected x (..., n), k (...), l (...) of one "
    "float dtype, scalar attributes a (float64) and kind (int32); results y (..., n), "
    "lam (...), passes int32 (...), residual (...), shift (...)")


@njit(inline="always", **_OPTIONS)
def _capped_simplex_call(frame, sample, task):
  if abi.handler_prologue(frame):
    return abi.null()
  code = abi.dtype_code(sample)
  a_at, kind_at = abi.scalar_attribute(frame, 97, abi.FLOAT64), abi.scalar_attribute(frame, 107, abi.INT32)
  if abi.count(frame, False) != 3 or abi.count(frame, True) != 5 or a_at == 0 or kind_at == 0:
    return abi.error(frame, _BAD_ARGUMENTS, abi.ERROR_INVALID_ARGUMENT)
  xb, kb, lb = abi.buffer(frame, False, 0), abi.buffer(frame, False, 1), abi.buffer(frame, False, 2)
  yb, lamb, passb, resb, shiftb = (abi.buffer(frame, True, 0), abi.buffer(frame, True, 1),
                                   abi.buffer(frame, True, 2), abi.buffer(frame, True, 3),
                                   abi.buffer(frame, True, 4))
  rank = abi.buffer_rank(xb)
  if rank < 1:
    return abi.error(frame, _BAD_ARGUMENTS, abi.ERROR_INVALID_ARGUMENT)
  n = abi.buffer_dim(xb, rank - 1)
  rows = abi.size(xb) // n if n > 0 else abi.size(kb)
  ok = (abi.buffer_dtype(xb) == code and abi.has(kb, code, rows) and abi.has(lb, code, rows)
        and abi.has(yb, code, rows * n)
        and abi.has(lamb, code, rows) and abi.has(passb, abi.INT32, rows)
        and abi.has(resb, code, rows) and abi.has(shiftb, code, rows))
  if not ok:
    return abi.error(frame, _BAD_ARGUMENTS, abi.ERROR_INVALID_ARGUMENT)
  if threads.run_rows(frame, rows, n, task, _capped_simplex_block, sample, 0) != 0:
    return abi.error(frame, abi.KERNEL_FAILED, abi.ERROR_INTERNAL)
  return abi.null()


@njit(**_OPTIONS)
def _capped_simplex_block(frame, r0, r1, sample, rule):
  """Rows ``r0 .. r1 - 1`` of a checked call (:func:`_capped_simplex_call`); the status.
  A block starts afresh (no guess carried in from the rows before it), so its results
  do not depend on where it runs."""
  xb = abi.buffer(frame, False, 0)
  n = abi.buffer_dim(xb, abi.buffer_rank(xb) - 1)
  rows = r1 - r0
  a_at, kind_at = abi.scalar_attribute(frame, 97, abi.FLOAT64), abi.scalar_attribute(frame, 107, abi.INT32)
  return capped_simplex_rows(
      abi.rows_of(frame, False, 0, sample, r0, rows, n), abi.span_of(frame, False, 1, sample, r0, rows),
      abi.span_of(frame, False, 2, sample, r0, rows), abi.load32(kind_at),
      carray(abi.typed_pointer(a_at, np.float64(0)), (1,))[0],
      abi.rows_of(frame, True, 0, sample, r0, rows, n), abi.span_of(frame, True, 1, sample, r0, rows),
      abi.span_of(frame, True, 2, np.int32(0), r0, rows), abi.span_of(frame, True, 3, sample, r0, rows),
      abi.span_of(frame, True, 4, sample, r0, rows))


_TASK_F32 = threads.external_task("native_mask", "capped_simplex_f32")
_TASK_F64 = threads.external_task("native_mask", "capped_simplex_f64")


def capped_simplex_f32(frame):
  return _capped_simplex_call(frame, np.float32(0), _TASK_F32())


def capped_simplex_f64(frame):
  return _capped_simplex_call(frame, np.float64(0), _TASK_F64())


# The helper tasks (:mod:`~implicit_topk.kernels.cpu.threads`), void (void*).
def capped_simplex_f32_task(data):
  threads.serve(data, _capped_simplex_block, np.float32(0), 0)


def capped_simplex_f64_task(data):
  threads.serve(data, _capped_simplex_block, np.float64(0), 0)
