"""implicit_topk/figure.py: the curve values of the operator figure, checked independently."""

import numpy as np
import pytest

from implicit_topk import figure

S = np.array([-1.5, 0.0, 0.25, 0.5, 1.0, 1.5, 1.9, 2.0, 2.5, 3.0, 3.2, 3.5, 4.0, 4.6, 5.5])


def _reference_mask(x, k, l, p):
  """argmax <x,y> - l/p sum y^p over {0<=y<=1, sum y = k}, by bisection on the threshold.

  Closed form for a fixed threshold lam: y_i = min(1, ((x_i - lam)_+ / l)^(1/(p-1)));
  for p = 2 it is the Euclidean projection of x / l onto the capped simplex.
  """
  def y_of(lam):
    return np.minimum(1.0, (np.maximum(x - lam, 0.0) / l) ** (1.0 / (p - 1.0)))
  lo, hi = x.min() - l - 1.0, x.max()
  for _ in range(200):
    mid = 0.5 * (lo + hi)
    if y_of(mid).sum() > k:
      lo = mid
    else:
      hi = mid
  return y_of(0.5 * (lo + hi))


def _reference_hard(s):
  # top-2 of (3, 1, s - 1, s): entry 2 or 3 is selected iff s < 1 or s > 4
  return np.where((s < 1.0) | (s > 4.0), 1.0, 0.0)


@pytest.mark.parametrize("p,label", [(2.0, "p = 2"), pytest.param(4.0 / 3.0, "p = 4/3", marks=pytest.mark.slow)])
def test_soft_curves_match_closed_form(p, label):
  values = figure.curves(S, l=1.0, op="mask")[label]
  for s, v in zip(S, values):
    x = np.array([3.0, 1.0, s - 1.0, s])
    y = _reference_mask(x, 2, 1.0, p)
    assert v == pytest.approx(y[1] + y[2], abs=1e-9), s


@pytest.mark.slow
def test_hard_curve():
  s = np.array([-1.5, 0.5, 1.5, 2.5, 3.5, 4.5, 5.5])
  np.testing.assert_array_equal(figure.curves(s, op="mask")["hard"], _reference_hard(s))


@pytest.mark.slow
def test_shape_kinks_smoothness_and_exact_zeros():
  # l = 1: for p = 2 the curve is piecewise linear, 1 - (s - 0)/2 on [0, 2], exactly 0
  # on [2, 3], (s - 3)/2 on [3, 5]: slopes jump at s = 0, 2, 3, 5 (kinks).
  s = np.array([0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5])
  c = figure.curves(s, l=1.0, op="mask")
  np.testing.assert_allclose(c["p = 2"], [0.75, 0.5, 0.25, 0.0, 0.0, 0.0, 0.25, 0.5, 0.75],
                             atol=1e-9)
  # exact zeros (not just small) in the middle for both p
  mid = np.linspace(2.05, 2.95, 7)
  for label in ("p = 2", "p = 4/3"):
    assert np.all(figure.curves(mid, op="mask")[label] == 0.0), label
  # slopes on both sides of s = 2: p = 2 jumps (-1/2 -> 0), p = 4/3 is C^1 (both ~0)
  h = 1e-4
  pts = np.array([2.0 - 2 * h, 2.0 - h, 2.0 + h, 2.0 + 2 * h])
  for label, jump in (("p = 2", True), ("p = 4/3", False)):
    v = figure.curves(pts, op="mask")[label]
    left, right = (v[1] - v[0]) / h, (v[3] - v[2]) / h
    if jump:
      assert left == pytest.approx(-0.5, abs=1e-6) and right == pytest.approx(0.0, abs=1e-9)
    else:
      assert abs(left) < 1e-6 and abs(right) < 1e-9
  # symmetric crossing at 1/2 at s = 1 and s = 4 for both
  v = figure.curves(np.array([1.0, 4.0]), op="mask")
  for label in ("p = 2", "p = 4/3"):
    np.testing.assert_allclose(v[label], [0.5, 0.5], atol=1e-9)


@pytest.mark.slow
def test_mag_panel_sparse_and_bounded():
  s = np.linspace(-2.0, 6.0, 41)
  c = figure.curves(s, l=1.0, op="mag")
  x = np.stack([np.full_like(s, 3.0), np.ones_like(s), s - 1.0, s], -1)
  bound = np.abs(x[:, 1]) + np.abs(x[:, 2])
  for label in ("p = 2", "p = 4/3"):
    assert np.all(np.abs(c[label]) <= bound + 1e-9)
  assert np.any(c["p = 4/3"] == 0.0) and np.any(c["p = 2"] == 0.0)


@pytest.mark.slow
def test_make_figure_writes_png(tmp_path):
  pytest.importorskip("matplotlib")
  path = tmp_path / "sub" / "fig.png"
  data = figure.make_figure(str(path), num=41)
  assert path.stat().st_size > 1000
  assert set(data["mask"]) == {"hard", "p = 2", "p = 4/3"}
  assert data["s"].shape == (41,)
