"""The integer-key reduction of :mod:`implicit_topk.kernels.cpu.ordered_bits` against
numpy's float comparison: rows with ties, signed zeros, subnormals, +-inf and the ends
of the float range; thresholds at entries, one float64 ulp off them, between two
float32 values, beyond float32's range, +-0 and +-inf."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import njit

from implicit_topk.kernels.cpu.ordered_bits import smallest_above


@njit(cache=False)
def _compiled(row, n, lam):
  return smallest_above(row, n, lam)


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
