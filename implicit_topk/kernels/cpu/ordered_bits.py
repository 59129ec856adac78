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
  if row.dtype == types.float64:
    floats, ints, sign = np.float64, np.int64, 63
  else:
    floats, ints, sign = np.float32, np.int32, 31
  magnitude = ints(np.iinfo(ints).max)
  shift = ints(sign)

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
