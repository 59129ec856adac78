"""The integer-key reductions of :mod:`implicit_topk.kernels.cpu.ordered_bits` against
Python's float comparison: rows with ties, signed zeros, subnormals, +-inf and the ends
of the float range; thresholds at entries, one float64 ulp off them, between two
float32 values, beyond float32's range, +-0 and +-inf; the largest entry of every
range and of every block of a row."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import njit

from implicit_topk.kernels.cpu.ordered_bits import block_largest, largest, smallest_above


@njit(cache=False)
def _compiled(row, n, lam):
  return smallest_above(row, n, lam)


@njit(cache=False)
def _compiled_largest(row, start, stop):
  return largest(row, start, stop)


@njit(cache=False)
def _compiled_blocks(row, n, block, out):
  block_largest(row, n, block, out)


def _largest_reference(part):
  """Python's ``max`` entry by entry in float64, +0 before -0; -inf for no entry."""
  return max((float(v) for v in part), key=lambda v: (v, not np.signbit(v)), default=-np.inf)


def _reference(row, lam):
  """Python's float comparison, entry by entry in float64 (-0 before +0 where both
  lie above)."""
  above = [float(v) for v in row if float(v) > lam]
  return min(above, key=lambda v: (v, not np.signbit(v))) if above else np.inf


SPECIAL = [0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, 1e-45, -1e-45, 5e-324, -5e-324,
           3.4028235e38, -3.4028235e38, 1.7976931348623157e308, -1.7976931348623157e308]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@given(data=st.data())
@settings(max_examples=300, deadline=None)
def test_smallest_above_is_the_float_comparison(dtype, data):
  entries = st.one_of(st.sampled_from(SPECIAL),
                      st.floats(allow_nan=False, width=32 if dtype == np.float32 else 64),
                      st.integers(-4, 4).map(float))
  with np.errstate(over="ignore"):  # (float64 specials beyond float32's range: +-inf)
    row = np.array(data.draw(st.lists(entries, min_size=1, max_size=40)), dtype)
  pick = data.draw(st.sampled_from(["entry", "up", "down", "any", "special"]))
  if pick == "special":
    lam = data.draw(st.sampled_from(SPECIAL + [1e39, -1e39, 1e-50, -1e-50]))
  elif pick == "any":
    lam = data.draw(st.floats(allow_nan=False))
  else:
    lam = float(row[data.draw(st.integers(0, row.size - 1))])
    if pick != "entry":
      with np.errstate(over="ignore"):  # (past the largest float: +-inf)
        lam = float(np.nextafter(lam, np.inf if pick == "up" else -np.inf))
  got = _compiled(row, row.size, lam)
  want = _reference(row, lam)
  assert got == want and np.signbit(got) == np.signbit(want), (row, lam, got, want)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_smallest_above_hand_cases(dtype):
  """Cases derived by hand: a float64 threshold between two float32 values, -0 and +0,
  an empty answer, a row prefix."""
  row = np.array([1.0, 2.0, 2.0, -0.0, 0.0, 3.0], dtype)
  assert _compiled(row, 6, 1.0) == 2.0
  assert _compiled(row, 6, 1.0 + 2.0 ** -40) == 2.0  # not a float32: rounded down first
  assert _compiled(row, 6, 2.0 - 2.0 ** -40) == 2.0
  assert _compiled(row, 6, -0.0) == 1.0  # +0 is not above -0
  assert _compiled(row, 6, -1e-50) == 0.0  # both zeros lie above; either is 0
  assert _compiled(row, 6, 3.0) == np.inf
  assert _compiled(row, 2, 1.5) == 2.0 and _compiled(row, 1, 0.5) == 1.0
  assert _compiled(row, 0, 0.0) == np.inf


def _float_rows(dtype, max_size):
  entries = st.one_of(st.sampled_from(SPECIAL),
                      st.floats(allow_nan=False, width=32 if dtype == np.float32 else 64),
                      st.integers(-4, 4).map(float))
  return st.lists(entries, min_size=0, max_size=max_size)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@given(data=st.data())
@settings(max_examples=300, deadline=None)
def test_largest_is_the_float_maximum(dtype, data):
  with np.errstate(over="ignore"):
    row = np.array(data.draw(_float_rows(dtype, 200)), dtype)
  start = data.draw(st.integers(0, row.size))
  stop = data.draw(st.integers(start, row.size))
  got = _compiled_largest(row, start, stop)
  want = _largest_reference(row[start:stop])
  assert got == want and np.signbit(got) == np.signbit(want), (row, start, stop, got, want)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@given(data=st.data())
@settings(max_examples=200, deadline=None)
def test_block_largest_is_each_blocks_maximum(dtype, data):
  with np.errstate(over="ignore"):
    row = np.array(data.draw(_float_rows(dtype, 300).filter(len)), dtype)
  n = data.draw(st.integers(1, row.size))
  block = data.draw(st.sampled_from([1, 3, 16, 64]))
  out = np.full((n + block - 1) // block + 1, 7.0)
  _compiled_blocks(row, n, block, out)
  for b in range((n + block - 1) // block):
    want = _largest_reference(row[b * block:min((b + 1) * block, n)])
    assert out[b] == want and np.signbit(out[b]) == np.signbit(want), (row, n, block, b)
  assert out[-1] == 7.0  # nothing past the last block


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_largest_hand_cases(dtype):
  """By hand: signed zeros (+0 wins a tie of zeros), -inf alone, an empty range, a
  subnormal above -0, the float maximum."""
  row = np.array([-0.0, 0.0, -np.inf, 1e-45, -1.0, np.finfo(dtype).max], dtype)
  assert _compiled_largest(row, 0, 2) == 0.0 and not np.signbit(_compiled_largest(row, 0, 2))
  assert np.signbit(_compiled_largest(row, 0, 1))
  assert _compiled_largest(row, 2, 3) == -np.inf
  assert _compiled_largest(row, 3, 3) == -np.inf
  assert _compiled_largest(row, 0, 4) == float(row[3]) > 0.0
  assert _compiled_largest(row, 0, 6) == float(np.finfo(dtype).max)
