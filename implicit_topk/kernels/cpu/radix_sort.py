"""Sorting one row inside a numba kernel: LSD radix sorts on float64 bit patterns.

A float64 ``v`` maps to the unsigned key ``~u`` (negative ``v``, bits ``u``) or
``u | 2^63`` (nonnegative ``v``), whose unsigned order is ``v``'s order; 8-bit digits,
least significant first, and a digit on which every key agrees is skipped (float32
data converted to float64 has three such low bytes). Stable. A few times faster than
numba's ``np.sort``/``np.argsort`` (quicksort) on rows of 1e4-1e5 entries.

Pure numpy + numba (no jax).
"""

import numpy as np
from numba import njit

_SIGN = np.uint64(1 << 63)
_LOW63 = np.uint64((1 << 63) - 1)
_BYTE = np.uint64(255)


@njit(cache=True, inline="always")
def _radix_passes(keys, index, scratch_keys, scratch_index, with_index):
  """Sorts ``keys`` (uint64) ascending, moving ``index`` along when ``with_index``;
  returns the number of passes made (odd: the result is in the scratch buffers)."""
  n = keys.shape[0]
  hist = np.zeros((8, 256), dtype=np.int64)
  for i in range(n):
    k = keys[i]
    for d in range(8):
      hist[d, (k >> np.uint64(8 * d)) & _BYTE] += 1
  offset = np.empty(256, dtype=np.int64)
  src_k, dst_k = keys, scratch_keys
  src_i, dst_i = index, scratch_index
  passes = 0
  for d in range(8):
    skip = False
    total = 0
    for b in range(256):
      c = hist[d, b]
      if c == n:
        skip = True
        break
      offset[b] = total
      total += c
    if skip:
      continue
    shift = np.uint64(8 * d)
    for i in range(n):
      k = src_k[i]
      b = (k >> shift) & _BYTE
      pos = offset[b]
      offset[b] = pos + 1
      dst_k[pos] = k
      if with_index:
        dst_i[pos] = src_i[i]
    src_k, dst_k = dst_k, src_k
    src_i, dst_i = dst_i, src_i
    passes += 1
  return passes


@njit(cache=True)
def argsort_descending(x, order):
  """Writes the descending order of the row ``x`` into ``order`` (int32). Stable; the
  order of NaNs is unspecified."""
  n = x.shape[0]
  f = np.empty(n)
  for i in range(n):
    f[i] = x[i]
  keys = f.view(np.uint64)
  for i in range(n):  # ascending keys = descending values
    u = keys[i]
    keys[i] = u if u & _SIGN else (~u) & _LOW63
    order[i] = i
  scratch = np.empty(n, dtype=np.int32)
  if _radix_passes(keys, order, np.empty(n, dtype=np.uint64), scratch, True) % 2 == 1:
    order[:] = scratch


@njit(cache=True)
def sort_ascending(row, out, scratch, absolute):
  """``out`` (float64) = the row (its absolute values when ``absolute``) sorted
  ascending, as ``np.sort`` lays it out: ``-inf``, the finite entries, ``+inf``, then
  every NaN. ``scratch`` is a uint64 work row of the same length."""
  n = row.shape[0]
  keys = out.view(np.uint64)
  for i in range(n):
    v = float(row[i])
    if v != v:
      v = np.nan  # one NaN, sign bit clear: sorts after +inf
    elif absolute:
      v = abs(v)
    out[i] = v
    u = keys[i]
    keys[i] = (~u) if u & _SIGN else u | _SIGN
  index = np.empty(0, dtype=np.int32)
  odd = _radix_passes(keys, index, scratch, index, False) % 2 == 1
  for i in range(n):
    k = scratch[i] if odd else keys[i]
    keys[i] = (k ^ _SIGN) if k & _SIGN else ~k
