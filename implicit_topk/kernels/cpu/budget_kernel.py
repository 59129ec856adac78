r"""The ``max_support`` kernel: the budgeted p-norm mask of every row of a call, and its
XLA FFI handlers.

Router rows (``k <= 2``, ``m <= 8``, p = 4/3 or 2; whole up to 16 entries, longer ones
by the candidates the plain kernel gathers) go a block of rows at a time through
:mod:`~implicit_topk.kernels.cpu.budget_lanes` where they can; every other row through
:mod:`~implicit_topk.kernels.cpu.budget_row` (its m+1 largest entries, the tie rule, the
crossing strength and the plain threshold in closed form).

The XLA FFI handlers ``budget_f32`` / ``budget_f64``: ``x`` (..., n), ``k`` (...),
``l`` (...) of one float dtype, scalar attributes ``a`` (float64) and ``m`` (int32) ->
``y`` (..., n), ``shift, offset, strength, cut`` (...), built by
:mod:`~implicit_topk.kernels.cpu.registry`. The derivatives are the mask derivative
kernels' (:mod:`~implicit_topk.kernels.cpu.native_derivatives`) with the rule
``PINNED``: entry points ``tangent_<rule>_<dtype>`` and ``cotangent_<rule>_<dtype>``
here, each with its helper task.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import carray, njit

from implicit_topk.kernels.cpu import abi, budget_lanes, native_lanes, threads
from implicit_topk.kernels.cpu.budget_row import (_entries, _largest, _solve, _write_mask)
from implicit_topk.kernels.cpu.native_derivatives import (CUBIC, GENERAL, LINEAR, PINNED,
                                                          _cotangent_block, _cotangent_call,
                                                          _tangent_block, _tangent_call)

_OPTIONS: dict[str, Any] = dict(cache=True, error_model="numpy", fastmath=False)
#: The rows of a block of longer router rows solved first one by one: where all of them
#: bind, so are the others; else the others go through the lanes.
_PROBES = 2


@njit(**_OPTIONS)
def budget_rows(x, k, l, m, a, y, shift, offset, strength, cut, lanes=True):
  """Every row of ``x`` (rows, n): its mask into ``y`` and ``(shift, offset, strength,
  cut)`` per row. Rows go a block of ``BLOCK`` at a time (``lanes=False``: one by one,
  as the tests compare):

  * router rows through the budget's lanes where they take them
    (:mod:`~implicit_topk.kernels.cpu.budget_lanes`: whole up to 16 entries, by their
    candidates up to ``_ONE_PASS_ROW``);
  * the others one by one, by their m+1 largest entries (:func:`_solve_row`).

  A block's choices depend on its own rows only, so the results do not depend on the
  threads (whose blocks are whole blocks of ``BLOCK`` rows). Returns 0."""
  rows, n = x.shape
  top, values, weights = np.empty(m + 1), np.empty(m + 1), np.empty(m + 1)
  scratch = np.empty((4, m + 1))
  how = budget_lanes.takes(a, n, m) if lanes else 0
  workspace = budget_lanes.workspace(n if how else 1, m)
  work = np.empty(max(n, 1))
  tol = 4.0 * np.finfo(shift.dtype).eps
  root_eps = math.sqrt(np.finfo(shift.dtype).eps)
  for b0 in range(0, rows, native_lanes.BLOCK):
    width = min(native_lanes.BLOCK, rows - b0)
    taken = 0
    if how == 1:
      taken = budget_lanes.block_budget(x, b0, width, k, l, m, a, tol, root_eps, work,
                                        workspace, shift, offset, strength, cut)
    elif how == 2:
      # the block's first rows one by one: where all of them bind, the others too (one
      # by one is cheaper where most rows bind), else through the lanes
      probed = min(_PROBES, width)
      binds = True
      for b in range(b0, b0 + probed):
        s, o, t, c = _solve_row(x[b], np.float64(k[b]), np.float64(l[b]), m, a, top, values, weights,
                                scratch)
        shift[b], offset[b], strength[b], cut[b] = s, o, t, c
        binds &= t < np.float64(l[b])
      taken = (1 << probed) - 1
      if not binds and probed < width:
        taken |= budget_lanes.gathered_budget(
            x, b0 + probed, width - probed, k, l, m, a, tol, root_eps, work, workspace,
            shift, offset, strength, cut) << probed
    for b in range(b0, b0 + width):
      if not (taken >> (b - b0)) & 1:
        s, o, t, c = _solve_row(x[b], np.float64(k[b]), np.float64(l[b]), m, a, top, values, weights,
                                scratch)
        shift[b], offset[b], strength[b], cut[b] = s, o, t, c
      # from the values as stored (rounded to x's dtype), as the derivative kernels read
      _write_mask(x[b], np.float64(shift[b]), float(offset[b]), float(strength[b]),
                  float(cut[b]), a, y[b])
  return 0


@njit(**_OPTIONS)  # a call, not inlined: budget_rows calls it twice (its IR once, half the build)
def _solve_row(row, kb, lb, m, a, top, values, weights, scratch):
  """``(shift, offset, strength, cut)`` of one row by its m+1 largest entries
  (:mod:`~implicit_topk.kernels.cpu.budget_row`); ``(0, NaN, NaN, NaN)`` where it has
  NaN."""
  if not _largest(row, m, top):
    return 0.0, np.nan, np.nan, np.nan
  c = _entries(row, top, m, kb, values, weights)
  s, o, t = _solve(values, weights, c, kb, lb, a, scratch)
  return s, o, t, c


# -- the FFI handlers --------------------------------------------------------------
_BAD_ARGUMENTS = abi.message(
    "implicit_topk budget kernel: expected x (..., n), k (...), l (...) of one float "
    "dtype, scalar attributes a (float64) and m (int32); results y (..., n), shift, "
    "offset, strength, cut (...)")


@njit(inline="always", **_OPTIONS)
def _budget_call(frame, sample, task):
  if abi.handler_prologue(frame):
    return abi.null()
  code = abi.dtype_code(sample)
  a_at, m_at = abi.scalar_attribute(frame, 97, abi.FLOAT64), abi.scalar_attribute(frame, 109, abi.INT32)
  if abi.count(frame, False) != 3 or abi.count(frame, True) != 5 or a_at == 0 or m_at == 0:
    return abi.error(frame, _BAD_ARGUMENTS, abi.ERROR_INVALID_ARGUMENT)
  xb = abi.buffer(frame, False, 0)
  rank = abi.buffer_rank(xb)
  if rank < 1:
    return abi.error(frame, _BAD_ARGUMENTS, abi.ERROR_INVALID_ARGUMENT)
  n = abi.buffer_dim(xb, rank - 1)
  kb, lb = abi.buffer(frame, False, 1), abi.buffer(frame, False, 2)
  rows = abi.size(xb) // n if n > 0 else abi.size(kb)
  ok = (abi.buffer_dtype(xb) == code and abi.has(kb, code, rows) and abi.has(lb, code, rows)
        and abi.has(abi.buffer(frame, True, 0), code, rows * n))
  for r in range(1, 5):
    ok = ok and abi.has(abi.buffer(frame, True, r), code, rows)
  m = abi.load32(m_at)
  if not ok or m < 1:
    return abi.error(frame, _BAD_ARGUMENTS, abi.ERROR_INVALID_ARGUMENT)
  if threads.run_rows(frame, rows, n, task, _budget_block, sample, 0) != 0:
    return abi.error(frame, abi.KERNEL_FAILED, abi.ERROR_INTERNAL)
  return abi.null()


@njit(**_OPTIONS)
def _budget_block(frame, r0, r1, sample, rule):
  """Rows ``r0 .. r1 - 1`` of a checked call (a block of
  :mod:`~implicit_topk.kernels.cpu.threads`); the status."""
  xb = abi.buffer(frame, False, 0)
  n = abi.buffer_dim(xb, abi.buffer_rank(xb) - 1)
  rows = r1 - r0
  a = carray(abi.typed_pointer(abi.scalar_attribute(frame, 97, abi.FLOAT64), np.float64(0)), (1,))[0]
  m = abi.load32(abi.scalar_attribute(frame, 109, abi.INT32))
  return budget_rows(abi.rows_of(frame, False, 0, sample, r0, rows, n),
                     abi.span_of(frame, False, 1, sample, r0, rows),
                     abi.span_of(frame, False, 2, sample, r0, rows), m, a,
                     abi.rows_of(frame, True, 0, sample, r0, rows, n),
                     abi.span_of(frame, True, 1, sample, r0, rows),
                     abi.span_of(frame, True, 2, sample, r0, rows),
                     abi.span_of(frame, True, 3, sample, r0, rows),
                     abi.span_of(frame, True, 4, sample, r0, rows))


_TASK_F32 = threads.external_task("budget_kernel", "budget_f32")
_TASK_F64 = threads.external_task("budget_kernel", "budget_f64")


def budget_f32(frame):
  return _budget_call(frame, np.float32(0), _TASK_F32())


def budget_f64(frame):
  return _budget_call(frame, np.float64(0), _TASK_F64())


# The helper tasks (:mod:`~implicit_topk.kernels.cpu.threads`), void (void*).
def budget_f32_task(data):
  threads.serve(data, _budget_block, np.float32(0), 0)


def budget_f64_task(data):
  threads.serve(data, _budget_block, np.float64(0), 0)


# The derivatives: the mask derivative kernels' entries with PINNED added to the rule
# (Python ints, so that numba takes each as a compile-time literal).
_CUBIC, _LINEAR, _GENERAL = (rule + PINNED for rule in (CUBIC, LINEAR, GENERAL))


_TASK_TANGENT_CUBIC_F32 = threads.external_task("budget_kernel", "tangent_cubic_f32")


def tangent_cubic_f32(frame):
  return _tangent_call(frame, np.float32(0), _CUBIC, _TASK_TANGENT_CUBIC_F32())


def tangent_cubic_f32_task(data):
  threads.serve(data, _tangent_block, np.float32(0), _CUBIC)


_TASK_TANGENT_CUBIC_F64 = threads.external_task("budget_kernel", "tangent_cubic_f64")


def tangent_cubic_f64(frame):
  return _tangent_call(frame, np.float64(0), _CUBIC, _TASK_TANGENT_CUBIC_F64())


def tangent_cubic_f64_task(data):
  threads.serve(data, _tangent_block, np.float64(0), _CUBIC)


_TASK_TANGENT_LINEAR_F32 = threads.external_task("budget_kernel", "tangent_linear_f32")


def tangent_linear_f32(frame):
  return _tangent_call(frame, np.float32(0), _LINEAR, _TASK_TANGENT_LINEAR_F32())


def tangent_linear_f32_task(data):
  threads.serve(data, _tangent_block, np.float32(0), _LINEAR)


_TASK_TANGENT_LINEAR_F64 = threads.external_task("budget_kernel", "tangent_linear_f64")


def tangent_linear_f64(frame):
  return _tangent_call(frame, np.float64(0), _LINEAR, _TASK_TANGENT_LINEAR_F64())


def tangent_linear_f64_task(data):
  threads.serve(data, _tangent_block, np.float64(0), _LINEAR)


_TASK_TANGENT_GENERAL_F32 = threads.external_task("budget_kernel", "tangent_general_f32")


def tangent_general_f32(frame):
  return _tangent_call(frame, np.float32(0), _GENERAL, _TASK_TANGENT_GENERAL_F32())


def tangent_general_f32_task(data):
  threads.serve(data, _tangent_block, np.float32(0), _GENERAL)


_TASK_TANGENT_GENERAL_F64 = threads.external_task("budget_kernel", "tangent_general_f64")


def tangent_general_f64(frame):
  return _tangent_call(frame, np.float64(0), _GENERAL, _TASK_TANGENT_GENERAL_F64())


def tangent_general_f64_task(data):
  threads.serve(data, _tangent_block, np.float64(0), _GENERAL)


_TASK_COTANGENT_CUBIC_F32 = threads.external_task("budget_kernel", "cotangent_cubic_f32")


def cotangent_cubic_f32(frame):
  return _cotangent_call(frame, np.float32(0), _CUBIC, _TASK_COTANGENT_CUBIC_F32())


def cotangent_cubic_f32_task(data):
  threads.serve(data, _cotangent_block, np.float32(0), _CUBIC)


_TASK_COTANGENT_CUBIC_F64 = threads.external_task("budget_kernel", "cotangent_cubic_f64")


def cotangent_cubic_f64(frame):
  return _cotangent_call(frame, np.float64(0), _CUBIC, _TASK_COTANGENT_CUBIC_F64())


def cotangent_cubic_f64_task(data):
  threads.serve(data, _cotangent_block, np.float64(0), _CUBIC)


_TASK_COTANGENT_LINEAR_F32 = threads.external_task("budget_kernel", "cotangent_linear_f32")


def cotangent_linear_f32(frame):
  return _cotangent_call(frame, np.float32(0), _LINEAR, _TASK_COTANGENT_LINEAR_F32())


def cotangent_linear_f32_task(data):
  threads.serve(data, _cotangent_block, np.float32(0), _LINEAR)


_TASK_COTANGENT_LINEAR_F64 = threads.external_task("budget_kernel", "cotangent_linear_f64")


def cotangent_linear_f64(frame):
  return _cotangent_call(frame, np.float64(0), _LINEAR, _TASK_COTANGENT_LINEAR_F64())


def cotangent_linear_f64_task(data):
  threads.serve(data, _cotangent_block, np.float64(0), _LINEAR)


_TASK_COTANGENT_GENERAL_F32 = threads.external_task("budget_kernel", "cotangent_general_f32")


def cotangent_general_f32(frame):
  return _cotangent_call(frame, np.float32(0), _GENERAL, _TASK_COTANGENT_GENERAL_F32())


def cotangent_general_f32_task(data):
  threads.serve(data, _cotangent_block, np.float32(0), _GENERAL)


_TASK_COTANGENT_GENERAL_F64 = threads.external_task("budget_kernel", "cotangent_general_f64")


def cotangent_general_f64(frame):
  return _cotangent_call(frame, np.float64(0), _GENERAL, _TASK_COTANGENT_GENERAL_F64())


def cotangent_general_f64_task(data):
  threads.serve(data, _cotangent_block, np.float64(0), _GENERAL)
