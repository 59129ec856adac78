r"""The derivatives of the soft top-k mask by the implicit function theorem, per row (numba).

With :math:`z_i = (x_i - \lambda) / l` and :math:`d_i = \mathrm{mask}'(z_i) / l \ge 0`
(0 for saturated and infinite entries), the mask :math:`y_i = \mathrm{mask}(z_i)` and
its constraint :math:`\sum_i y_i = k` give (``proofs/implicit_gradient.md``)

.. math::

    \dot\lambda = \frac{\sum_i d_i(\dot x_i - z_i \dot l) - \dot k}{\sum_i d_i},\qquad
    \dot y_i = d_i\,(\dot x_i - \dot\lambda - z_i\,\dot l),

and, transposed, for cotangents :math:`\bar y, \bar\lambda` and
:math:`c = (\bar\lambda - \sum_i d_i \bar y_i) / \sum_i d_i`:

.. math::

    \bar x_i = d_i(\bar y_i + c), \qquad \bar k = -c, \qquad
    \bar l = -\sum_i d_i z_i (\bar y_i + c).

Where :math:`\sum_i d_i = 0` (a binary mask) :math:`\lambda` is locally constant in
``x`` and ``l`` and the derivative w.r.t. ``k`` is returned as 0, the convention of
every solver here. A row without a threshold (NaN) has NaN derivatives. The slopes
``mask'(z)`` of the dense masks are computed from their tails (the sigmoid's as
``sigmoid(|z|) sigmoid(-|z|)``, not ``s (1 - s)``), so near-binary rows keep
representable derivatives (``proofs/complement_form.md``).

Float64 rows at the ends of the float range were solved by the mask kernel on the exact
rescaling ``x 2^-E``, ``l 2^-E`` (:func:`~implicit_topk.kernels.cpu.native_threshold.scale_exponent`),
and their ``lam`` and ``shift`` are those of the scaled row. ``E = 0`` for every row
whose entries are below :math:`2^{1022}` in magnitude with :math:`l \ge 2^{-969}`, which
the first loop checks as it goes (float64 only: ``4 x_i`` overflows from
:math:`2^{1022}` up; 5-10% of the derivative kernels' time on rows of 8 to 256 entries);
the other rows find the same ``E`` from ``x`` and ``l`` and are done again, one at a
time, in the scaled coordinates (entries, strength and their tangents
times :math:`f = 2^{-E}`, the cotangents of ``x`` and ``l`` times ``f`` on the way out,
``k``'s and ``lam``'s unscaled). Float32 rows are never scaled.

numba's disk cache is keyed on this file alone, not on the functions it inlines from
:mod:`~implicit_topk.kernels.cpu.native_threshold`: a change to ``_mask_terms`` there
needs a change here too (a stale cache would keep the old slopes). Both passes
read each row once and write it once, in float64 whatever the input dtype; the
pure-JAX solvers derive the same formulas by autodiff (the tests compare them).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import carray, literally, njit, types
from numba.extending import overload

from implicit_topk.kernels.cpu import abi, threads
from implicit_topk.kernels.cpu.native_threshold import (PNORM, _LOWEST, _OPTIONS,
                                                        _STRENGTH_FLOOR, _mask_terms,
                                                        _scaled_div, float64_entries,
                                                        power_of_two, scale_exponent)


@njit(**_OPTIONS)
def _slope(v, lam, l, origin, kind, a):
  """(d, z) of one entry: mask'(z) / l and z, with d = 0 where the mask is constant.

  Compiled once and called (LLVM may inline it), not copied by numba into each loop:
  with every regularizer's link inlined it is most of the IR numba copies and types,
  once per call site (a derivative target's build 136 s -> 70 s with it called)."""
  if not abs(v) < np.inf or not abs(lam) < np.inf:
    return 0.0, 0.0
  v = max(v - origin, _LOWEST)
  gap = v - lam
  if kind == PNORM:
    if gap <= 0.0 or gap >= l:
      return 0.0, gap / l
    return _mask_terms(gap / l, kind, a)[1] / l, gap / l
  z = _scaled_div(v, lam, l)  # a dense mask is not constant where gap overflows
  return _mask_terms(z, kind, a)[1] / l, z


@njit(inline="always", **_OPTIONS)
def _gap(v, lam, origin):
  return max(v - origin, _LOWEST) - lam


# (live, d, z) of one entry: ``live`` where the mask is not constant, there
# ``d = mask'(z) / l``; ``z = (x - lam) / l``. For the p-norms branch-free: the
# fractional entries are those with 0 < x - lam < l (never an infinite entry nor a
# non-finite lam), z is taken as (x - lam) * inv.
@njit(inline="always", **_OPTIONS)
def _cubic_slope(v, lam, l, inv, origin, kind, a):  # p = 4/3: mask z^3
  gap = _gap(v, lam, origin)
  z = gap * inv
  return (gap > 0.0) & (gap < l), 3.0 * z * z * inv, z


@njit(inline="always", **_OPTIONS)
def _linear_slope(v, lam, l, inv, origin, kind, a):  # p = 2: mask z
  gap = _gap(v, lam, origin)
  return (gap > 0.0) & (gap < l), inv, gap * inv


@njit(inline="always", **_OPTIONS)
def _general_slope(v, lam, l, inv, origin, kind, a):  # other p; entropy, sigmoid, Laplace
  d, z = _slope(float(v), lam, l, origin, kind, a)
  return d != 0.0, d, z


# The row loops reassociate their sums (and nothing else) so that LLVM vectorizes them;
# each entry rule gets its own compiled loops: ``rule`` is a compile-time literal.
CUBIC, LINEAR, GENERAL = 0, 1, 2  # p = 4/3, p = 2, the others (branchy: a pow or an exp)


#: Added to a rule: the budgeted mask's derivatives (:mod:`~implicit_topk.kernels.cpu.budget_kernel`),
#: whose rows may be pinned (see :func:`_tangent_loops`).
PINNED = 4


def _rule_slope(rule, v, lam, l, inv, origin, kind, a):
  """(live, d, z) of one entry by the entry rule ``rule`` (a compile-time literal)."""
  raise NotImplementedError  # numba only (see the overload below)


@overload(_rule_slope, inline="always")
def _rule_slope_for(rule, v, lam, l, inv, origin, kind, a):
  # The choice is made while typing, so that a target inlines only its own rule's slope:
  # a branch on ``rule`` in the function's body would inline all three at every call site
  # (numba copies and types each) and leave LLVM to drop two.
  if not isinstance(rule, types.IntegerLiteral):
    return None  # typed again with the literal (the callers' ``literally(rule)``)
  slope = {CUBIC: _cubic_slope, LINEAR: _linear_slope}.get(rule.literal_value % PINNED,
                                                           _general_slope)
  return lambda rule, v, lam, l, inv, origin, kind, a: slope(v, lam, l, inv, origin, kind, a)


# The entry rule is chosen on the Python side
# (:func:`implicit_topk.kernels.cpu.native_calls.derivative_rule`): one target each.


_VECTOR_OPTIONS: dict[str, Any] = dict(cache=True, error_model="numpy", fastmath={"reassoc"})


@njit(**_VECTOR_OPTIONS)
def _tangent_loops(x, lam, shift, l, pin, x_dot, k_dot, l_dot, kind, a, y_dot, lam_dot, s_dot,
                   rule):
  r"""Forward mode with the entry rule ``rule`` (a compile-time literal): ``y_dot``,
  ``lam_dot`` from the tangents of ``x``, ``k``, ``l``. Float64 rows with an entry not
  below ``2^1022`` in magnitude (or not finite), or a strength below ``2^-969``, found
  by the first loop as it goes, are done again after the loop by :func:`_tangent_row`
  where their ``E != 0``.

  With ``PINNED`` in ``rule`` (the budgeted mask; no row is rescaled) the strength is an
  output too, its tangent into ``s_dot``; a row whose ``pin`` is not NaN is pinned: its
  threshold is the value ``pin`` (:math:`\dot\lambda = \dot x_c`, the mean over the
  entries equal to ``pin``) and its strength moves instead, :math:`\dot s = (\sum_i
  d_i(\dot x_i - \dot x_c) - \dot k) / \sum_i d_i z_i` (``l_dot`` unused); then
  :math:`\dot y_i = d_i(\dot x_i - \dot\lambda - z_i \dot s)` as for the other rows
  (``proofs/support_budget.md``, 7). Without it, ``pin`` and ``s_dot`` are not read."""
  literally(rule)
  pinned = rule >= PINNED
  wide = float64_entries(x) and not pinned
  rows, n = x.shape
  flagged, count = np.empty(rows if wide else 0, np.int64), 0
  for b in range(rows):
    root, lb, origin, l_tangent = np.float64(lam[b]), np.float64(l[b]), np.float64(shift[b]), np.float64(l_dot[b])
    row, x_tangent, out = x[b], x_dot[b], y_dot[b]
    inv = 1.0 / lb
    total, moved, overflow = 0.0, 0.0, 0.0
    slope, at_pin, pins = 0.0, 0.0, 0.0
    at = float(pin[b]) if pinned else 0.0
    for i in range(n):
      if wide:  # 4 v is exact, and overflows (NaN here) from |v| = 2^1022 up
        t = 4.0 * row[i]
        overflow += t - t
      live, d, z = _rule_slope(rule, row[i], root, lb, inv, origin, kind, a)
      total += d if live else 0.0
      if pinned:
        moved += d * x_tangent[i] if live else 0.0
        slope += _strength_term(rule, d, z) if live else 0.0
        at_pin += x_tangent[i] if row[i] == at else 0.0
        pins += 1.0 if row[i] == at else 0.0
      else:
        moved += d * (x_tangent[i] - z * l_tangent) if live else 0.0
    if pinned:
      slope = _strength_sum(rule, slope, inv)
    if pinned and at == at:  # the threshold is the pin's, the strength moves
      rate = at_pin / max(pins, 1.0)
      l_tangent = (moved - total * rate - k_dot[b]) / slope if slope > 0.0 else 0.0
    else:
      if pinned:
        moved -= slope * l_tangent
      rate = (moved - k_dot[b]) / total if total > 0.0 else 0.0
    if root != root:
      rate, l_tangent = np.nan, np.nan
    lam_dot[b] = rate
    if pinned:
      s_dot[b] = l_tangent
    zero = rate * 0.0
    for i in range(n):
      live, d, z = _rule_slope(rule, row[i], root, lb, inv, origin, kind, a)
      out[i] = d * (x_tangent[i] - rate - z * l_tangent) if live else zero
    if wide:
      flagged[count] = b
      count += not (overflow == 0.0 and lb >= _STRENGTH_FLOOR)
  # after the loop, not in it (a call there cost the other rows 10-20%)
  for j in range(count):
    factor = _row_factor(x, flagged[j], np.float64(l[flagged[j]]))
    if factor != 1.0:
      _tangent_row(x, lam, shift, l, x_dot, k_dot, l_dot, kind, a, y_dot, lam_dot,
                   flagged[j], factor, rule)
  return 0


@njit(**_VECTOR_OPTIONS)
def _cotangent_loops(x, lam, shift, l, pin, y_bar, lam_bar, s_bar, kind, a, x_bar, k_bar, l_bar,
                     rule):
  r"""Reverse mode with the entry rule ``rule`` (a compile-time literal): ``x_bar``,
  ``k_bar``, ``l_bar`` from the cotangents of ``y``, ``lam``. Float64 rows at the ends
  of the float range as in :func:`_tangent_loops` (:func:`_cotangent_row`).

  With ``PINNED`` in ``rule``, the transpose of :func:`_tangent_loops`' pinned form,
  ``s_bar`` the cotangent of the strength: :math:`\bar x_i = d_i(\bar y_i + c)`,
  :math:`\bar k = -c` with, in a pinned row, :math:`c = (\bar s - \sum_i d_i z_i
  \bar y_i) / \sum_i d_i z_i`, :math:`\bar l = 0` and the rest,
  :math:`\bar\lambda - \sum_i d_i(\bar y_i + c)`, shared by the entries equal to
  ``pin``; in the other rows :math:`\bar l` gains :math:`\bar s`."""
  literally(rule)
  pinned = rule >= PINNED
  wide = float64_entries(x) and not pinned
  rows, n = x.shape
  flagged, count = np.empty(rows if wide else 0, np.int64), 0
  for b in range(rows):
    root, lb, origin = np.float64(lam[b]), np.float64(l[b]), np.float64(shift[b])
    row, cotangent, out = x[b], y_bar[b], x_bar[b]
    inv = 1.0 / lb
    total, weighted, overflow = 0.0, 0.0, 0.0
    slope, slope_weighted, pins = 0.0, 0.0, 0.0
    at = float(pin[b]) if pinned else 0.0
    for i in range(n):
      if wide:
        t = 4.0 * row[i]
        overflow += t - t
      live, d, z = _rule_slope(rule, row[i], root, lb, inv, origin, kind, a)
      total += d if live else 0.0
      weighted += d * cotangent[i] if live else 0.0
      if pinned:
        slope += _strength_term(rule, d, z) if live else 0.0
        slope_weighted += _strength_term(rule, d, z) * cotangent[i] if live else 0.0
        pins += 1.0 if row[i] == at else 0.0
    share = 0.0
    if pinned and at == at:
      slope = _strength_sum(rule, slope, inv)
      slope_weighted = _strength_sum(rule, slope_weighted, inv)
      c = (s_bar[b] - slope_weighted) / slope if slope > 0.0 else 0.0
      share = (lam_bar[b] - weighted - c * total) / max(pins, 1.0)
    else:
      c = (lam_bar[b] - weighted) / total if total > 0.0 else 0.0
    if root != root:
      c = np.nan
    zero, strength = c * 0.0, 0.0
    for i in range(n):
      live, d, z = _rule_slope(rule, row[i], root, lb, inv, origin, kind, a)
      g = cotangent[i] + c
      out[i] = d * g if live else zero
      if pinned:
        out[i] += share if row[i] == at else 0.0
      strength -= _strength_term(rule, d, z) * g if live else 0.0
    k_bar[b] = -c
    strength = _strength_sum(rule, strength, inv)
    if pinned:
      strength = 0.0 if at == at else strength + s_bar[b]
    l_bar[b] = strength if c == c else np.nan
    if wide:
      flagged[count] = b
      count += not (overflow == 0.0 and lb >= _STRENGTH_FLOOR)
  for j in range(count):
    factor = _row_factor(x, flagged[j], np.float64(l[flagged[j]]))
    if factor != 1.0:
      _cotangent_row(x, lam, shift, l, y_bar, lam_bar, kind, a, x_bar, k_bar, l_bar,
                     flagged[j], factor, rule)
  return 0


# p = 2: d is 1 / l itself, so d z g = (x - lam) (1 / l)^2 g, and a reassociated loop
# gathers the two loop-invariant factors into (1 / l)^2 (0 or inf for l beyond
# 2^(+-512)): the sum is of z g, divided by l once after the loop.
@njit(inline="always", **_VECTOR_OPTIONS)
def _strength_term(rule, d, z):
  return z if rule % PINNED == LINEAR else d * z


@njit(inline="always", **_VECTOR_OPTIONS)
def _strength_sum(rule, strength, inv):
  return strength * inv if rule % PINNED == LINEAR else strength


@njit(**_OPTIONS)
def _row_factor(x, b, lb):
  """``f = 2^-E`` of the float64 row ``x[b]`` and strength ``lb``
  (:func:`~implicit_topk.kernels.cpu.native_threshold.scale_exponent`; 1 where ``E =
  0``)."""
  return power_of_two(-scale_exponent(x[b], x.shape[1], lb)[0])


# One row again (overwriting what the loops wrote), in the coordinates scaled by
# ``factor`` = 2^-E: entries, strength and their tangents times the factor, the
# cotangents of x and l times it on the way out, k's and lam's not.
@njit(**_VECTOR_OPTIONS)
def _tangent_row(x, lam, shift, l, x_dot, k_dot, l_dot, kind, a, y_dot, lam_dot, b, factor,
                 rule):
  literally(rule)
  n = x.shape[1]
  root, origin = np.float64(lam[b]), np.float64(shift[b])
  lb, l_tangent = np.float64(l[b]) * factor, np.float64(l_dot[b]) * factor
  inv = 1.0 / lb
  total, moved = 0.0, 0.0
  for i in range(n):
    live, d, z = _rule_slope(rule, x[b, i] * factor, root, lb, inv, origin, kind, a)
    total += d if live else 0.0
    moved += d * (x_dot[b, i] * factor - z * l_tangent) if live else 0.0
  rate = (moved - k_dot[b]) / total if total > 0.0 else 0.0
  if root != root:
    rate = np.nan
  lam_dot[b] = rate
  zero = rate * 0.0
  for i in range(n):
    live, d, z = _rule_slope(rule, x[b, i] * factor, root, lb, inv, origin, kind, a)
    y_dot[b, i] = d * (x_dot[b, i] * factor - rate - z * l_tangent) if live else zero


@njit(**_VECTOR_OPTIONS)
def _cotangent_row(x, lam, shift, l, y_bar, lam_bar, kind, a, x_bar, k_bar, l_bar, b, factor,
                   rule):
  literally(rule)
  n = x.shape[1]
  root, origin = np.float64(lam[b]), np.float64(shift[b])
  lb = np.float64(l[b]) * factor
  inv = 1.0 / lb
  total, weighted = 0.0, 0.0
  for i in range(n):
    live, d, z = _rule_slope(rule, x[b, i] * factor, root, lb, inv, origin, kind, a)
    total += d if live else 0.0
    weighted += d * y_bar[b, i] if live else 0.0
  c = (lam_bar[b] - weighted) / total if total > 0.0 else 0.0
  if root != root:
    c = np.nan
  zero, strength = c * 0.0, 0.0
  for i in range(n):
    live, d, z = _rule_slope(rule, x[b, i] * factor, root, lb, inv, origin, kind, a)
    g = y_bar[b, i] + c
    x_bar[b, i] = d * g * factor if live else zero
    strength -= _strength_term(rule, d, z) * g if live else 0.0
  k_bar[b] = -c
  l_bar[b] = _strength_sum(rule, strength, inv) * factor if c == c else np.nan


# -- the FFI handlers. Tangents: (x (..., n), lam, shift, l, x_dot (..., n), k_dot,
#    l_dot) -> (y_dot (..., n), lam_dot); cotangents: (x, lam, shift, l, y_bar (..., n),
#    lam_bar) -> (x_bar (..., n), k_bar, l_bar); one float dtype, attributes a and kind
#    as the threshold kernel's. A rule with PINNED (the budgeted mask's) takes ``pin``
#    (...) after ``l``, and the strength's tangent (a third result) or cotangent (a
#    last argument). -------------------------------------------------------------------
_BAD_ARGUMENTS = abi.message(
    "implicit_topk mask derivative kernel: expected x (..., n), lam, shift, l (...), then "
    "the tangents or cotangents, all of one float dtype, and the attributes a (float64) "
    "and kind (int32)")


@njit(inline="always", **_OPTIONS)
def _layout_ok(frame, code, full_args, full_rets, n_args, n_rets):
  """Whether the call has n_args arguments and n_rets results of dtype ``code``, each
  with x's rows (times n for the positions in the bit masks full_args / full_rets)."""
  if abi.count(frame, False) != n_args or abi.count(frame, True) != n_rets:
    return False, 0, 0
  x = abi.buffer(frame, False, 0)
  rank = abi.buffer_rank(x)
  if rank < 1:
    return False, 0, 0
  n = abi.buffer_dim(x, rank - 1)
  rows = abi.size(x) // n if n > 0 else abi.size(abi.buffer(frame, False, 1))
  for results, total, full in ((False, n_args, full_args), (True, n_rets, full_rets)):
    for i in range(total):
      length = rows * n if (full >> i) & 1 else rows
      if not abi.has(abi.buffer(frame, results, i), code, length):
        return False, 0, 0
  return True, rows, n


@njit(inline="always", **_OPTIONS)
def _attributes(frame):
  a_at, kind_at = abi.scalar_attribute(frame, 97, abi.FLOAT64), abi.scalar_attribute(frame, 107, abi.INT32)
  if a_at == 0 or kind_at == 0:
    return False, 0, 0.0
  return True, abi.load32(kind_at), carray(abi.typed_pointer(a_at, np.float64(0)), (1,))[0]


@njit(inline="always", **_OPTIONS)
def _tangent_call(frame, sample, rule, task):
  if abi.handler_prologue(frame):
    return abi.null()
  found, kind, a = _attributes(frame)
  extra = 1 if rule >= PINNED else 0  # pin, and the strength's tangent
  ok, rows, n = _layout_ok(frame, abi.dtype_code(sample), 1 | 0b10000 << extra, 0b01, 7 + extra,
                           2 + extra)
  if not (found and ok):
    return abi.error(frame, _BAD_ARGUMENTS, abi.ERROR_INVALID_ARGUMENT)
  status = threads.run_rows(frame, rows, n, task, _tangent_block, sample, rule)
  return abi.null() if status == 0 else abi.error(frame, abi.KERNEL_FAILED, abi.ERROR_INTERNAL)


@njit(inline="always", **_OPTIONS)
def _cotangent_call(frame, sample, rule, task):
  if abi.handler_prologue(frame):
    return abi.null()
  found, kind, a = _attributes(frame)
  extra = 1 if rule >= PINNED else 0  # pin, and the strength's cotangent
  ok, rows, n = _layout_ok(frame, abi.dtype_code(sample), 1 | 0b10000 << extra, 0b001,
                           6 + 2 * extra, 3)
  if not (found and ok):
    return abi.error(frame, _BAD_ARGUMENTS, abi.ERROR_INVALID_ARGUMENT)
  status = threads.run_rows(frame, rows, n, task, _cotangent_block, sample, rule)
  return abi.null() if status == 0 else abi.error(frame, abi.KERNEL_FAILED, abi.ERROR_INTERNAL)


# Rows r0 .. r1 - 1 of a checked call (a block of :mod:`~implicit_topk.kernels.cpu.threads`;
# each row's results depend on that row alone): the status. Without PINNED, the places
# of ``pin`` and of the strength's tangent or cotangent hold ``lam``'s (never read).
@njit(**_OPTIONS)
def _tangent_block(frame, r0, r1, sample, rule):
  literally(rule)
  found, kind, a = _attributes(frame)
  n = _row_length(frame)
  rows = r1 - r0
  extra = 1 if rule >= PINNED else 0
  row = lambda results, i: abi.span_of(frame, results, i, sample, r0, rows)
  return _tangent_loops(
      abi.rows_of(frame, False, 0, sample, r0, rows, n), row(False, 1), row(False, 2),
      row(False, 3), row(False, 1 + 3 * extra),
      abi.rows_of(frame, False, 4 + extra, sample, r0, rows, n), row(False, 5 + extra),
      row(False, 6 + extra), kind, a, abi.rows_of(frame, True, 0, sample, r0, rows, n),
      row(True, 1), row(True, 1 + extra), rule)


@njit(**_OPTIONS)
def _cotangent_block(frame, r0, r1, sample, rule):
  literally(rule)
  found, kind, a = _attributes(frame)
  n = _row_length(frame)
  rows = r1 - r0
  extra = 1 if rule >= PINNED else 0
  row = lambda results, i: abi.span_of(frame, results, i, sample, r0, rows)
  return _cotangent_loops(
      abi.rows_of(frame, False, 0, sample, r0, rows, n), row(False, 1), row(False, 2),
      row(False, 3), row(False, 1 + 3 * extra),
      abi.rows_of(frame, False, 4 + extra, sample, r0, rows, n), row(False, 5 + extra),
      row(False, 5 + 2 * extra), kind, a, abi.rows_of(frame, True, 0, sample, r0, rows, n),
      row(True, 1), row(True, 2), rule)


@njit(inline="always", **_OPTIONS)
def _row_length(frame):
  x = abi.buffer(frame, False, 0)
  return abi.buffer_dim(x, abi.buffer_rank(x) - 1)


# One entry point per direction, rule and dtype (a call compiles only the one it needs),
# each with its helper task (``<entry>_task``, void (void*); the registry builds both).
_TASK_TANGENT_CUBIC_F32 = threads.external_task("native_derivatives", "tangent_cubic_f32")


def tangent_cubic_f32(frame):
  return _tangent_call(frame, np.float32(0), CUBIC, _TASK_TANGENT_CUBIC_F32())


def tangent_cubic_f32_task(data):
  threads.serve(data, _tangent_block, np.float32(0), CUBIC)


_TASK_TANGENT_CUBIC_F64 = threads.external_task("native_derivatives", "tangent_cubic_f64")


def tangent_cubic_f64(frame):
  return _tangent_call(frame, np.float64(0), CUBIC, _TASK_TANGENT_CUBIC_F64())


def tangent_cubic_f64_task(data):
  threads.serve(data, _tangent_block, np.float64(0), CUBIC)


_TASK_TANGENT_LINEAR_F32 = threads.external_task("native_derivatives", "tangent_linear_f32")


def tangent_linear_f32(frame):
  return _tangent_call(frame, np.float32(0), LINEAR, _TASK_TANGENT_LINEAR_F32())


def tangent_linear_f32_task(data):
  threads.serve(data, _tangent_block, np.float32(0), LINEAR)


_TASK_TANGENT_LINEAR_F64 = threads.external_task("native_derivatives", "tangent_linear_f64")


def tangent_linear_f64(frame):
  return _tangent_call(frame, np.float64(0), LINEAR, _TASK_TANGENT_LINEAR_F64())


def tangent_linear_f64_task(data):
  threads.serve(data, _tangent_block, np.float64(0), LINEAR)


_TASK_TANGENT_GENERAL_F32 = threads.external_task("native_derivatives", "tangent_general_f32")


def tangent_general_f32(frame):
  return _tangent_call(frame, np.float32(0), GENERAL, _TASK_TANGENT_GENERAL_F32())


def tangent_general_f32_task(data):
  threads.serve(data, _tangent_block, np.float32(0), GENERAL)


_TASK_TANGENT_GENERAL_F64 = threads.external_task("native_derivatives", "tangent_general_f64")


def tangent_general_f64(frame):
  return _tangent_call(frame, np.float64(0), GENERAL, _TASK_TANGENT_GENERAL_F64())


def tangent_general_f64_task(data):
  threads.serve(data, _tangent_block, np.float64(0), GENERAL)


_TASK_COTANGENT_CUBIC_F32 = threads.external_task("native_derivatives", "cotangent_cubic_f32")


def cotangent_cubic_f32(frame):
  return _cotangent_call(frame, np.float32(0), CUBIC, _TASK_COTANGENT_CUBIC_F32())


def cotangent_cubic_f32_task(data):
  threads.serve(data, _cotangent_block, np.float32(0), CUBIC)


_TASK_COTANGENT_CUBIC_F64 = threads.external_task("native_derivatives", "cotangent_cubic_f64")


def cotangent_cubic_f64(frame):
  return _cotangent_call(frame, np.float64(0), CUBIC, _TASK_COTANGENT_CUBIC_F64())


def cotangent_cubic_f64_task(data):
  threads.serve(data, _cotangent_block, np.float64(0), CUBIC)


_TASK_COTANGENT_LINEAR_F32 = threads.external_task("native_derivatives", "cotangent_linear_f32")


def cotangent_linear_f32(frame):
  return _cotangent_call(frame, np.float32(0), LINEAR, _TASK_COTANGENT_LINEAR_F32())


def cotangent_linear_f32_task(data):
  threads.serve(data, _cotangent_block, np.float32(0), LINEAR)


_TASK_COTANGENT_LINEAR_F64 = threads.external_task("native_derivatives", "cotangent_linear_f64")


def cotangent_linear_f64(frame):
  return _cotangent_call(frame, np.float64(0), LINEAR, _TASK_COTANGENT_LINEAR_F64())


def cotangent_linear_f64_task(data):
  threads.serve(data, _cotangent_block, np.float64(0), LINEAR)


_TASK_COTANGENT_GENERAL_F32 = threads.external_task("native_derivatives", "cotangent_general_f32")


def cotangent_general_f32(frame):
  return _cotangent_call(frame, np.float32(0), GENERAL, _TASK_COTANGENT_GENERAL_F32())


def cotangent_general_f32_task(data):
  threads.serve(data, _cotangent_block, np.float32(0), GENERAL)


_TASK_COTANGENT_GENERAL_F64 = threads.external_task("native_derivatives", "cotangent_general_f64")


def cotangent_general_f64(frame):
  return _cotangent_call(frame, np.float64(0), GENERAL, _TASK_COTANGENT_GENERAL_F64())


def cotangent_general_f64_task(data):
  threads.serve(data, _cotangent_block, np.float64(0), GENERAL)
