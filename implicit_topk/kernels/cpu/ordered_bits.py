r"""Order statistics of a row on the floats' bit patterns read as integers, inside numba
kernels: LLVM vectorizes integer min/max reductions, while numba's float ``min`` and
``max`` (their NaN rules) keep a reduction scalar, one entry a cycle or more.

A float with bits :math:`u` (a signed integer of its width) maps to the key
:math:`u \oplus ((u \gg (w - 1)) \wedge (2^{w-1} - 1))`: nonnegative floats keep their
bits, negative ones have every bit but the sign flipped, so that the keys' integer order
is the floats' order with :math:`-0 < +0` (the radix sort's map,
:mod:`~implicit_topk.kernels.cpu.radix_sort`, without its unsigned offset).
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload


def _key_types(dtype):
  """(float type, int type, sign bit, 2^(w-1) - 1) of a float32 or float64 numba dtype."""
  if dtype == types.float64:
    floats, ints, sign = np.float64, np.int64, 63
  else:
    floats, ints, sign = np.float32, np.int32, 31
  return floats, ints, ints(sign), ints(np.iinfo(ints).max)


def smallest_above(row, n, lam):
  r""":math:`\min \{x_i : x_i > \lambda\}` over ``row[:n]`` (float32 or float64,
  no NaN) as a float64, ``+inf`` where no entry lies above ``lam``; ``lam`` is a
  float64, not NaN. Vectorized: 0.06 ns an entry against 0.6 for the same loop on
  floats (float32 rows of 1e4, this machine).

  ``lam`` is first rounded down to the row's dtype (an entry lies above ``lam`` iff
  it lies above the largest float of its dtype at or below ``lam``) and ``-0`` read as
  ``+0``, so that the key comparison is the float comparison."""
  above = row[:n][row[:n] > lam]
  return float(above.min()) if above.size else np.inf


@overload(smallest_above, jit_options=dict(error_model="numpy"))
def _smallest_above_for(row, n, lam):
  floats, ints, shift, magnitude = _key_types(row.dtype)

  def smallest_above_impl(row, n, lam):
    cut = floats(lam + 0.0)  # (-0 read as +0; rounded to nearest, then down below)
    bits = cut.view(ints)
    floor = (bits ^ ((bits >> shift) & magnitude)) - ints(float(cut) > lam)
    keys = row.view(ints)
    least = magnitude
    for i in range(n):
      u = keys[i]
      key = u ^ ((u >> shift) & magnitude)
      least = min(least, key if key > floor else magnitude)
    if least == magnitude:
      return np.inf
    return float(ints(least ^ ((least >> shift) & magnitude)).view(floats))
  return smallest_above_impl


def largest(row, start, stop):
  r""":math:`\max_{start \le i < stop} x_i` of ``row`` (float32 or float64, no NaN) as
  a float64, ``-inf`` for an empty range; ``+0`` where the largest entries are zeros of
  both signs. Vectorized: 0.05 ns an entry against 0.5 for numba's ``max`` over the same
  loop (float32 rows of 1e4, this machine)."""
  return max((float(v) for v in row[start:stop]), key=lambda v: (v, not np.signbit(v)),
             default=-np.inf)


@overload(largest, jit_options=dict(error_model="numpy"))
def _largest_for(row, start, stop):
  floats, ints, shift, magnitude = _key_types(row.dtype)
  least = ints(np.iinfo(ints).min)

  def largest_impl(row, start, stop):
    # a slice from 0 to its size (an index from ``start`` on keeps the loop scalar:
    # numba's index arithmetic and negative-index test)
    keys = row[start:stop].view(ints)
    most = least
    for i in range(keys.size):
      u = keys[i]
      key = u ^ ((u >> shift) & magnitude)
      most = key if key > most else most
    if most == least:  # (the key of -NaN with every bit set: no float here has it)
      return -np.inf
    return float(ints(most ^ ((most >> shift) & magnitude)).view(floats))
  return largest_impl


def block_largest(row, n, block, out):
  """``out[b]`` = :func:`largest` of ``row[b block : min((b + 1) block, n)]`` for every
  block of ``row[:n]`` (float32 or float64, no NaN)."""
  for b in range((n + block - 1) // block):
    out[b] = largest(row, b * block, min((b + 1) * block, n))


@overload(block_largest, jit_options=dict(error_model="numpy"))
def _block_largest_for(row, n, block, out):
  floats, ints, shift, magnitude = _key_types(row.dtype)
  least = ints(np.iinfo(ints).min)

  def block_largest_impl(row, n, block, out):
    keys = row.view(ints)
    full = n // block
    for b in range(full):
      # unsigned indices: no negative-index test, so the block's loop is vectorized
      base = np.uint64(b * block)
      most = least
      for j in range(block):
        u = keys[base + np.uint64(j)]
        key = u ^ ((u >> shift) & magnitude)
        most = key if key > most else most
      out[b] = float(ints(most ^ ((most >> shift) & magnitude)).view(floats))
    if full * block < n:
      out[full] = largest(row, full * block, n)
  return block_largest_impl


# -- bisection on the floats' order ----------------------------------------------------
_INT64_MAX = np.int64(np.iinfo(np.int64).max)
_INT64_MIN = np.int64(np.iinfo(np.int64).min)


@njit(cache=True, error_model="numpy")
def midpoint(a, b):
  if (a >= 0.0) == (b >= 0.0):
    return a + 0.5 * (b - a)
  return 0.5 * (a + b)


@njit(cache=True, error_model="numpy")
def ordered_midpoint(a, b):
  """The float whose ordered bit pattern (sign * the bits without the sign) is the
  floor-average of those of the finite ``a`` and ``b``: geometric across binades,
  arithmetic within one; any bracket is down to adjacent floats in 64 halvings."""
  u = np.float64(a).view(np.int64)
  v = np.float64(b).view(np.int64)
  if u < 0:
    u = -(u & _INT64_MAX)
  if v < 0:
    v = -(v & _INT64_MAX)
  mid = (u >> 1) + (v >> 1) + (u & v & 1)
  if mid < 0:
    mid = (-mid) | _INT64_MIN
  return np.int64(mid).view(np.float64)


@njit(cache=True, error_model="numpy")
def bisection_point(lo, hi, it):
  """Where the safeguard bisects [lo, hi] at iteration ``it``: every other time the
  ordered midpoint if the bracket spans more than two binades (max(|lo|, |hi|) >
  4 min(|lo|, |hi|)), else the midpoint. So a bracket from 1e300 to a root near 0 is
  within two binades after ~2 x 11 bisections, not ~1000 halvings."""
  near, far = min(abs(lo), abs(hi)), max(abs(lo), abs(hi))
  if it % 2 == 0 and far > 4.0 * near and far < np.inf:
    return ordered_midpoint(lo, hi)
  return midpoint(lo, hi)
