"""The native CPU solver (a numba kernel called as an XLA FFI custom call).

Values are checked against the independent references of ``tests/references.py``
(exact rational breakpoints, then bisection; no code shared with the library), with the
tolerance rule of ``tests/test_fuzz.py``; gradients against central differences in
float64. The bridge's own behaviour (errors instead of crashes, export in a fresh
process, vmap, batch sharding) is checked here too.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import implicit_topk as itk
import references as R
from implicit_topk import problems
from implicit_topk.kernels.cpu import abi, native_calls, native_threshold, registry
from implicit_topk.solvers import mask_tangent, native
from test_fuzz import FAST, SLOW, U32, U64, assert_close, k_rows, log_uniform, mtol, unit_rows
from gradcheck import check_grads

jax.config.update("jax_enable_x64", True)

slow = pytest.mark.slow
REGULARIZERS = ((None, 4.0 / 3.0), (None, 2.0), (None, 1.5), (None, 3.0), ("entropy", 2.0),
                ("sigmoid", 2.0), ("laplace", 2.0))


def native_mask(x, k, l, reg=None, p=4.0 / 3.0, solver="native", **kw):
  options = dict(regularizer=reg) if reg else dict(p=p)
  return itk.soft_topk_mask(x, k, regularization_strength=l, solver=solver, **options, **kw)


def test_auto_picks_native_on_cpu_and_pallas_on_gpu_where_they_apply():
  auto = itk.solvers.auto_solver_name
  mask = problems.CappedSimplex(itk.PNorm(4.0 / 3.0))
  assert auto(mask, backend="cpu", row_length=8) == "native"
  assert auto(mask, backend="gpu", row_length=256) == "pallas"
  assert auto(problems.Magnitude(2.0), backend="gpu", row_length=256) == "pallas"
  assert auto(mask, backend="gpu", row_length=100_000) == "threshold"  # longer than a block
  assert auto(mask, backend="tpu", row_length=8) == "threshold"
  for backend in ("cpu", "gpu"):
    assert auto(mask, backend=backend, row_length=8, sharded=True) == "threshold"
  assert auto(problems.Magnitude(2.0), backend="cpu", row_length=8) == "native"
  assert auto(problems.Magnitude(2.0), backend="cpu", row_length=8, sharded=True) == "threshold"
  assert auto(problems.CappedSimplex(_UserRegularizer()), backend="cpu", row_length=8) == "threshold"


@pytest.mark.parametrize("p", [2.0, 1.5])
@pytest.mark.parametrize("n", [8, 20])  # the lanes, the per-row kernel
def test_an_entry_exactly_at_the_threshold_gets_exactly_zero(n, p):
  """Integer rows whose threshold is an entry (``proofs/snap_to_entry.md``): the kernel
  stopped a few ulps below it and gave it 7e-17 (p = 2); the expected masks are exact
  rational arithmetic: [2, 4, 1, 0, 3, 0, -1, -2], k = 2, l = 3 has the threshold 1 at
  p = 2 (1/3 + 1 + 2/3 = 2), and [2, -2, -2, 0, -2, 2, 0, -2], k = 1/2, l = 4 the
  threshold 0 at p = 3/2 ((1/2)^2 + (1/2)^2 = 1/2; its zeros got 4e-36); padded with -10
  to n entries."""
  from fractions import Fraction
  if p == 2.0:
    row, k, l, lam, a = [2, 4, 1, 0, 3, 0, -1, -2], Fraction(2), Fraction(3), 1, 1
  else:
    row, k, l, lam, a = [2, -2, -2, 0, -2, 2, 0, -2], Fraction(1, 2), Fraction(4), 0, 2
  exact = [min(max(Fraction(v - lam) / l, 0), 1) ** a for v in row]
  assert sum(exact) == k  # the threshold is the entry lam
  want = [float(v) for v in exact]
  x = np.full(n, -10.0)
  x[:len(row)] = row
  want = np.concatenate([want, np.zeros(n - len(row))])
  for dtype in (jnp.float64, jnp.float32):
    y = np.asarray(native_mask(jnp.asarray(x[None], dtype), float(k), float(l), p=p), np.float64)[0]
    np.testing.assert_array_equal(y == 0, want == 0)
    np.testing.assert_allclose(y, want, rtol=0, atol=1e-7 if dtype == jnp.float32 else 1e-15)


@pytest.mark.parametrize("n", [1_000, 10_000])
def test_a_long_float32_row_is_not_snapped_away_from_its_root(n):
  """The snap moves a threshold onto an entry only if the mask there sums to k to the
  rounding of an exact root. Its allowance was a float32 sum's worst case, n 4 eps32 k
  (24 at n = 1e4, k = 5000), and took an entry 7 float32 ulps above the root of a row of
  entries 1000 + N(0, 1): the mask summed to k - 1.66 at n = 1e4. Against a
  float64 bisection with exact sums (math.fsum) on the same rounded entries."""
  import math
  x = (1000 + np.random.default_rng(1).normal(size=n)).astype(np.float32)
  k, wide = n // 2, x.astype(np.float64)
  mask = lambda lam: np.minimum(1, np.maximum(wide - lam, 0) ** 3)  # p = 4/3, l = 1
  lo, hi = wide.min() - 1, wide.max()
  while (mid := 0.5 * (lo + hi)) not in (lo, hi):
    lo, hi = (mid, hi) if math.fsum(mask(mid)) > k else (lo, mid)
  y = np.asarray(itk.soft_topk_mask(jnp.asarray(x), k, solver="native"), np.float64)
  np.testing.assert_allclose(y, mask(lo), rtol=0, atol=4 * 2.0**-24)
  assert abs(math.fsum(y) - k) <= 1e-4


@pytest.mark.parametrize("reg,p", REGULARIZERS)
@given(data=st.data())
@FAST
def test_matches_the_reference(reg, p, data):
  n = data.draw(st.sampled_from((1, 2, 5, 8, 40)))
  x = data.draw(unit_rows(n))
  k = data.draw(k_rows(n))
  l = data.draw(st.lists(log_uniform(-3, 1), min_size=3, max_size=3).map(np.array))
  y = np.asarray(native_mask(x, k, l, reg, p))
  assert_close(y, R.soft_topk_mask(x, k, l, p, reg), mtol(x, k, l, p, reg), f"native {reg} {p}")


@slow
@pytest.mark.parametrize("reg,p", REGULARIZERS)
@given(data=st.data())
@SLOW
def test_matches_the_reference_sweep(reg, p, data):
  n = data.draw(st.sampled_from((1, 3, 9, 17, 64, 300)))
  x = data.draw(unit_rows(n, batch=4)) * data.draw(log_uniform(-6, 6))
  k = data.draw(k_rows(n, batch=4))
  l = data.draw(st.lists(log_uniform(-4, 3), min_size=4, max_size=4).map(np.array))
  y = np.asarray(native_mask(x, k, l, reg, p))
  assert_close(y, R.soft_topk_mask(x, k, l, p, reg), mtol(x, k, l, p, reg), f"native {reg} {p}")


@pytest.mark.parametrize("n,k", [(256, 8), (1000, 10), (2000, 300), pytest.param(5000, 2.5, marks=slow),
                                 pytest.param(8192, 2000.5, marks=slow)])
def test_long_rows_and_many_rows_take_the_same_path_as_the_reference(n, k):
  # Many similar rows: each row's candidate cut comes from the previous row's threshold
  # (a guess that is right, too low or too high), long rows select by quickselect.
  rng = np.random.default_rng(n)
  x = rng.normal(size=(6, n)) * np.array([[1.0], [1.0], [10.0], [0.01], [1.0], [3.0]])
  x[4] = np.round(x[4], 1)  # many ties
  l = np.array([0.5, 0.1, 0.1, 0.1, 0.05, 2.0])
  y = np.asarray(native_mask(x, float(k), l))
  assert_close(y, R.soft_topk_mask(x, k, l), mtol(x, k, l), "native long rows")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_gather_near_the_top_skips_only_blocks_without_candidates(dtype):
  # White-box: the long rows' gather (``_gather_near_top``) skips the blocks of 64 entries
  # with no entry above ``low``; numpy's boolean selection is the reference (the same
  # entries, in row order, and the count at or above ``cut``). Rows: candidates in the
  # first block only, in the last (partial) block only, one at each block boundary, an
  # entry exactly at ``low`` (not a candidate), none at all; relative to 0 and to a far
  # origin; lengths around the block's.
  rng = np.random.default_rng(7)
  lowest = -np.finfo(np.float64).max
  work = np.empty(5000)
  cases = 0
  for n in (1, 63, 64, 65, 130, 1000, 4099):
    for where in ("first", "last", "boundaries", "at_low", "none", "random"):
      row = rng.normal(size=n) - 6.0
      spots = {"first": [0], "last": [n - 1], "boundaries": list(range(63, n, 64)) + [0],
               "at_low": [n // 2], "none": [], "random": list(rng.integers(0, n, 5))}[where]
      row[spots] = 1.0 + rng.random(len(spots))
      if where == "at_low":
        row[n // 2] = 0.5
      for origin in (0.0, -1e7):
        x = (row - origin).astype(dtype)
        v = np.maximum(x.astype(np.float64) - origin, lowest)
        low, cut = (float(v[n // 2]), 1.5) if where == "at_low" else (0.5, 1.5)
        count, above = native_threshold._gather_near_top(x, n, origin, cut, low, work)
        chosen = v[v > low]
        assert count == chosen.size and above == np.sum(chosen >= cut), (n, where, origin)
        np.testing.assert_array_equal(work[:count], chosen)
        cases += 1
  assert cases == 2 * 7 * 6


_SMALL_K_DEFAULT = {(8, 1.0), (64, 0.5), (8, 1.5), (512, 2.0), (513, 2.5)}  # the rest: slow


@pytest.mark.parametrize("n,k", [(n, k) if (n, k) in _SMALL_K_DEFAULT else pytest.param(n, k, marks=slow)
                                 for n in (3, 8, 64, 512, 513) for k in (0.5, 1.0, 1.5, 2.0, 2.5)])
def test_small_k_rows_one_pass_and_guessed_cut_agree_with_the_reference(n, k):
  # k <= 2 on rows of at most 512 entries take one pass (the three largest and a
  # running cut); n = 513 and k = 2.5 take the guessed cut. Rows: normal, many ties,
  # the maximum first or last (the running cut at its lowest and highest), far from 0
  # (solved relative to the maximum), a binary row and a row of equal entries.
  rng = np.random.default_rng([n, int(2 * k)])
  x = rng.normal(size=(8, n))
  x[1] = np.round(x[1], 0)
  x[2] = np.sort(x[2])[::-1]
  x[3] = np.sort(x[3])
  x[4] = x[4] + 1e7
  x[5] = np.where(np.arange(n) < 3, 10.0 - np.arange(n), 0.0)  # binary at l = 0.5
  x[6] = 1.0
  l = np.array([0.5, 0.5, 0.3, 0.3, 0.5, 0.5, 0.5, 2.0])
  for p in (4.0 / 3.0, 2.0):
    y = np.asarray(native_mask(x, k, l, p=p))
    assert_close(y, R.soft_topk_mask(x, k, l, p), mtol(x, k, l, p), f"native n={n} k={k} p={p}")


@pytest.mark.parametrize("dtype,eps", [(jnp.float32, U32), (jnp.float16, None), (jnp.bfloat16, None)])
def test_dtypes(dtype, eps):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(4, 9)).astype(np.float32)
  k, l = np.array([1.0, 2.5, 4.0, 8.5]), 0.3
  y = native_mask(jnp.asarray(x, dtype), k, l)
  assert y.dtype == dtype
  reference = R.soft_topk_mask(np.asarray(jnp.asarray(x, dtype), np.float64), k, l)
  if eps is None:  # half precision: computed in float32, rounded once to the output
    eps = float(jnp.finfo(dtype).eps)
    np.testing.assert_allclose(np.asarray(y, np.float64), reference, atol=2 * eps)
  else:
    assert_close(np.asarray(y), reference, mtol(x.astype(np.float64), k, l, eps=eps), "float32")


@pytest.mark.parametrize("n", [8, 64, 1000])  # lanes (two kinds), the per-row kernel
@pytest.mark.parametrize("reg,p", [(None, 4.0 / 3.0), (None, 2.0), ("entropy", 2.0)])
def test_nearly_hard_float32_rows_are_solved_in_float64(n, reg, p):
  """The kernel solves a float32 row in float64, so a nearly hard one (a strength far
  below the ulps of its entries) is as exact as the float64 solution of the same
  rounded entries, to the output's rounding. The threshold used to stop within 4
  float32 ulps of its size, each of which moved a fractional entry by ulp / l: float32,
  l = 1e-6, entries of order 1 gave a fractional entry of 0.084 for 0.5 (the mask
  summed to 2.08 for k = 2.5)."""
  rng = np.random.default_rng(n)
  x = rng.normal(size=(6, n)).astype(np.float32)
  k = np.array([2.5, 1.5, 3.25, 2.5, 7.75, 4.5])
  l = np.array([1e-6, 1e-6, 1e-5, 1e-4, 3e-7, 1e-3])
  y = native_mask(jnp.asarray(x), k, l, reg=reg, p=p)
  reference = R.soft_topk_mask(x.astype(np.float64), k, l, p=p, regularizer_name=reg)
  np.testing.assert_allclose(np.asarray(y, np.float64), reference, rtol=0, atol=8 * U32)
  np.testing.assert_allclose(np.asarray(y, np.float64).sum(-1), k, rtol=0, atol=8 * n * U32)


@pytest.mark.parametrize("reg", [None, "entropy", "sigmoid"])
def test_non_finite_entries_follow_the_documented_rules(reg):
  inf, nan = np.inf, np.nan
  x = np.array([[inf, 1.0, 2.0, -inf], [inf, inf, 0.0, 1.0], [nan, 1.0, 2.0, 3.0],
                [-inf, -inf, 1.0, 2.0], [inf, -inf, -inf, -inf], [1.0, 2.0, -inf, -inf]])
  k = np.array([1.5, 1.0, 1.0, 2.0, 1.0, 2.0])
  y = np.asarray(native_mask(x, k, 0.5, reg, 2.0))
  expected = R.soft_topk_mask(x, k, 0.5, 2.0, reg)
  assert_close(y, expected, mtol(x, k, 0.5, 2.0, reg), "non-finite")
  assert np.all(np.isnan(y[1])) and np.all(np.isnan(y[2]))  # more +inf than k; a NaN entry
  np.testing.assert_array_equal(y[3], [0.0, 0.0, 1.0, 1.0])  # k = #entries above -inf


def test_k_at_zero_and_n_and_n_equal_one():
  x = np.array([[0.3, -1.0, 2.0], [0.3, -1.0, 2.0], [5.0, 5.0, 5.0]])
  k = np.array([0.0, 3.0, 1.5])
  y = np.asarray(native_mask(x, k, 0.1))
  np.testing.assert_array_equal(y[:2], [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
  assert_close(y, R.soft_topk_mask(x, k, 0.1), mtol(x, k, 0.1), "k = 0, n, ties")  # ties: k / n
  for k in (1e-9, 0.37, 1.0 - 1e-9):
    assert float(native_mask(np.array([1.7]), k, 0.2)[0]) == pytest.approx(k, rel=1e-12)


def test_binary_rows_are_exactly_the_hard_mask_and_report_zero_passes():
  x = np.array([[3.0, 1.0, 2.0, -1.0, 0.5]])
  y, info = native_mask(x, 2.0, 0.1, return_info=True)
  np.testing.assert_array_equal(np.asarray(y), [[1.0, 0.0, 1.0, 0.0, 0.0]])
  assert float(info.residual[0]) == 0.0


@pytest.mark.parametrize("reg,p", [(None, 4.0 / 3.0), (None, 2.0), ("entropy", 2.0), ("laplace", 2.0)])
def test_gradients_match_central_differences(reg, p):
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(3, 6)))
  k, l = jnp.array([1.5, 2.0, 3.3]), jnp.array([0.7, 1.1, 0.9])
  f = lambda x, k, l: native_mask(x, k, l, reg, p)
  check_grads(f, (x, k, l), modes=("fwd", "rev"), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("reg,p", [(None, 4.0 / 3.0), (None, 2.0), (None, 3.0), ("entropy", 2.0),
                                   ("sigmoid", 2.0), ("laplace", 2.0)])
def test_derivative_kernels_equal_autodiff_of_the_optimality_condition(reg, p):
  # The tangent and cotangent kernels against the threshold solver's derivatives, which
  # JAX derives from the optimality function by jax.lax.custom_root: every input
  # (x, k, l), forward and reverse mode, rows with binary and saturated entries, and
  # rows with +-inf entries.
  rng = np.random.default_rng(5)
  x = rng.normal(size=(5, 9))
  x[3, :3] = [np.inf, -np.inf, -np.inf]
  x[4] = [4.0, 3.9, 0.0, -1.0, 0.5, 0.2, -3.0, 1.0, 0.1]  # binary at k = 2, l = 0.5
  x = jnp.asarray(x)
  k, l = jnp.array([1.5, 2.0, 4.5, 2.5, 2.0]), jnp.array([0.7, 1.1, 0.3, 0.9, 0.5])
  cotangent = jnp.asarray(rng.normal(size=x.shape))
  tangents = tuple(jnp.asarray(rng.normal(size=np.shape(a))) for a in (x, k, l))
  for solver in ("native", "threshold"):
    f = lambda x, k, l, s=solver: native_mask(x, k, l, reg, p, solver=s)
    loss = lambda x, k, l, f=f: jnp.sum(jnp.where(jnp.isfinite(x), f(x, k, l), 0.0) * cotangent)
    results = (jax.grad(loss, argnums=(0, 1, 2))(x, k, l), jax.jvp(f, (x, k, l), tangents)[1])
    if solver == "native":
      native_results = results
  for got, want in zip(jax.tree.leaves(native_results), jax.tree.leaves(results)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("reg,p", [r if r[0] is None and r[1] in (4.0 / 3.0, 2.0)
                                   else pytest.param(*r, marks=slow) for r in REGULARIZERS])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_jax_form_of_the_derivative_kernels_is_the_same_map(reg, p, dtype):
  # solvers/mask_tangent.py (what higher orders differentiate) against the kernels, in
  # both modes, on every entry rule (p = 4/3 and p = 2 run vectorized loops, the others
  # branchy ones), with +-inf entries, a binary row and a row of one fractional entry.
  rng = np.random.default_rng(7)
  x = rng.normal(size=(5, 40))
  x[1, :3] = [np.inf, -np.inf, -np.inf]
  x[2] = np.linspace(3.0, -3.0, 40)  # k = 2, l = 0.01: binary
  x[3, :3] = [2.0, 1.0, 0.995]  # k = 2.5 ... one fractional entry near the cut
  x = jnp.asarray(x, dtype)
  k, l = (jnp.asarray(v, dtype) for v in ([1.5, 2.0, 2.0, 1.5, 7.5], [0.7, 1.1, 0.01, 0.3, 2.0]))
  regularizer = itk.regularizers.resolve(reg, p)
  attributes = native_calls.kernel_attributes(regularizer)
  operator = native._mask_operator(attributes)
  _, lam, _, _, shift = operator(x, k, l)
  tangents = tuple(jnp.asarray(rng.normal(size=np.shape(a)), dtype) for a in (x, k, l))
  kernel = jax.jvp(lambda *a: operator(*a)[:2], (x, k, l), tangents)[1]
  cotangent = jnp.asarray(rng.normal(size=x.shape), dtype)
  kernel_bar = jax.vjp(lambda *a: operator(*a)[0], x, k, l)[1](cotangent)
  # The kernels compute in float64 whatever the dtype: so does the JAX form here.
  wide = lambda *a: tuple(jnp.asarray(v, jnp.float64) for v in a)
  point = wide(x, lam, shift, l)
  linear = lambda *t: mask_tangent.tangent(int(attributes["kind"]), float(attributes["a"]),
                                           *point, *t)
  form = linear(*wide(*tangents))
  form_bar = jax.vjp(lambda *t: linear(*t)[0], *wide(*tangents))[1](*wide(cotangent))
  tol = dict(rtol=2e-5, atol=2e-5) if dtype == np.float32 else dict(rtol=1e-10, atol=1e-12)
  for got, want in zip((*kernel, *kernel_bar), (*form, *form_bar)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **tol)
  assert float(jnp.max(jnp.abs(kernel[0][0]))) > 1e-2  # the fractional row moves


def test_jit_vmap_and_eager_agree():
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.normal(size=(5, 3, 11)))
  eager = native_mask(x, 2.5, 0.3)
  jitted = jax.jit(lambda z: native_mask(z, 2.5, 0.3))(x)
  mapped = jax.vmap(lambda z: native_mask(z, 2.5, 0.3))(x)
  looped = jnp.stack([native_mask(row, 2.5, 0.3) for row in x])
  for value in (jitted, mapped):
    np.testing.assert_array_equal(np.asarray(value), np.asarray(eager))
  np.testing.assert_array_equal(np.asarray(looped), np.asarray(eager))
  along = native_mask(jnp.moveaxis(x, -1, 1), 2.5, 0.3, axis=1)
  np.testing.assert_array_equal(np.asarray(jnp.moveaxis(along, 1, -1)), np.asarray(eager))


def test_per_row_k_and_strength_under_vmap_of_grad():
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.normal(size=(4, 7)))
  ks, ls = jnp.array([1.0, 2.5, 3.0, 6.5]), jnp.array([0.1, 1.0, 3.0, 0.5])
  grad = lambda row, k, l: jax.grad(lambda z: native_mask(z, k, l)[0])(row)
  mapped = jax.vmap(grad)(x, ks, ls)
  for i in range(4):
    np.testing.assert_allclose(mapped[i], grad(x[i], ks[i], ls[i]), rtol=0, atol=1e-15)


def test_unsupported_problems_are_refused_by_name():
  with pytest.raises(ValueError, match="solver='native'"):  # the magnitude kernel too
    native.NativeSolver(problem=problems.Magnitude()).with_layout(problems.layout.Segments(2))
  with pytest.raises(ValueError, match="solver='native'"):
    native.NativeSolver(regularizer=_UserRegularizer())
  with pytest.raises(ValueError, match="solver='native'"):
    native.NativeSolver().with_layout(problems.layout.Segments(2))


class _UserRegularizer:
  saturation = (0.0, 1.0)

  def mask(self, z):
    return jnp.clip(z, 0.0, 1.0)


def test_the_bridge_checks_buffers_and_raises_instead_of_crashing():
  x = jnp.ones((2, 3), jnp.float32)
  attributes = native_calls.kernel_attributes(itk.PNorm(2.0))
  name = registry.target("capped_simplex", "float32")
  registry.ensure(name)  # a direct ffi_call: nothing here lowers the package's primitive
  row = jax.ShapeDtypeStruct((2,), jnp.float32)
  good = (jax.ShapeDtypeStruct((2, 3), jnp.float32), row, jax.ShapeDtypeStruct((2,), jnp.int32),
          row, row)
  k = l = jnp.ones(2, jnp.float32)
  call = lambda results, *args, **attrs: jax.block_until_ready(
      jax.ffi.ffi_call(name, results)(*args, **attrs))
  assert len(call(good, x, k, l, **attributes)) == 5
  expected = "capped_simplex kernel: expected"
  with pytest.raises(Exception, match=expected):  # k of the wrong length
    call(good, x, jnp.ones(3, jnp.float32), l, **attributes)
  with pytest.raises(Exception, match=expected):  # a missing attribute
    call(good, x, k, l, a=attributes["a"])
  with pytest.raises(Exception, match=expected):  # an attribute of the wrong dtype
    call(good, x, k, l, a=np.float32(3.0), kind=attributes["kind"])
  with pytest.raises(Exception, match=expected):  # a missing result
    call(good[:4], x, k, l, **attributes)
  with pytest.raises(Exception, match=expected):  # float64 data to the float32 kernel
    call(good, x.astype(jnp.float64), k, l, **attributes)


def test_a_kernel_failure_surfaces_as_a_python_error():
  # A handler that reports failure the way every kernel does (a nonzero status).
  from numba import cfunc

  @cfunc(abi.HANDLER_SIGNATURE)
  def failing(frame):
    if abi.handler_prologue(frame):
      return abi.null()
    return abi.error(frame, abi.KERNEL_FAILED, abi.ERROR_INTERNAL)

  registry.register_handler("implicit_topk_test_failing", failing)
  call = jax.ffi.ffi_call("implicit_topk_test_failing", jax.ShapeDtypeStruct((2,), jnp.float32))
  with pytest.raises(Exception, match="native kernel failed"):
    jax.block_until_ready(call(jnp.ones(2, jnp.float32)))


def test_the_solver_refuses_unrolled_differentiation():
  with pytest.raises(ValueError, match="diff='unrolled' needs an iterative solver"):
    itk.soft_topk_mask(jnp.ones(3), 1.0, solver="native", diff="unrolled")


_EXPORT = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp
    from jax import export
    import implicit_topk as itk
    f = jax.jit(jax.grad(lambda x: jnp.sum(itk.{operator}(x, 2.5) * jnp.cos(x))))
    x = jnp.linspace(-1.0, 2.0, 24).reshape(3, 8)
    blob = export.export(f, disabled_checks=itk.export_safety_checks())(x).serialize()
    open(sys.argv[1], "wb").write(blob)
    open(sys.argv[1] + ".npy", "wb").write(bytes(memoryview(jax.device_get(f(x)))))
""")
_IMPORT = textwrap.dedent("""
    import sys
    import numpy as np
    import jax, jax.numpy as jnp
    from jax import export
    import implicit_topk
    exported = export.deserialize(bytearray(open(sys.argv[1], "rb").read()))
    implicit_topk.register_kernels(exported)  # builds the kernels it calls, and only those
    x = jnp.linspace(-1.0, 2.0, 24).reshape(3, 8)
    expected = np.frombuffer(open(sys.argv[1] + ".npy", "rb").read(), np.float32).reshape(3, 8)
    assert "{target}" in exported.mlir_module(), "not the native kernel"
    np.testing.assert_array_equal(np.asarray(exported.call(x)), expected)
    print("ok")
""")


def export_in_one_process_and_call_in_another(tmp_path, operator: str, target: str) -> None:
  """Exports the jitted gradient of ``itk.<operator>`` (default solver, float32) and
  serializes it in one fresh process; deserializes and calls it in another that
  registers the kernels it calls (``implicit_topk.register_kernels(exported)``), which must call the custom call ``target`` and give the same values."""
  path = str(tmp_path / "grad.jax")
  env = {k: v for k, v in os.environ.items() if k != "JAX_ENABLE_X64"}
  for script in (_EXPORT.format(operator=operator), _IMPORT.format(target=target)):
    done = subprocess.run([sys.executable, "-c", script, path], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
  assert done.stdout.strip() == "ok"


def test_export_serialize_and_call_in_a_fresh_process(tmp_path):
  export_in_one_process_and_call_in_another(tmp_path, "soft_topk_mask",
                                            "implicit_topk_capped_simplex")


_SHARDED = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import implicit_topk as itk
    mesh = jax.make_mesh((4,), ("d",))
    x = jax.random.normal(jax.random.PRNGKey(0), (8, 16))
    f = jax.jit(jax.value_and_grad(lambda z: jnp.sum(itk.soft_topk_mask(z, 3.5) * jnp.sin(z))))
    reference = f(x)
    xs = jax.device_put(x, NamedSharding(mesh, P("d", None)))
    hlo = f.lower(xs).compile().as_text()
    assert "all-gather" not in hlo, "the batch-sharded input was gathered"
    assert "implicit_topk_capped_simplex" in hlo
    value, grad = f(xs)
    assert grad.sharding.spec[0] == "d", grad.sharding
    np.testing.assert_allclose(value, reference[0], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(grad), np.asarray(reference[1]))
    g = jax.jit(jax.shard_map(lambda z: itk.soft_topk_mask(z, 3.5), mesh=mesh, in_specs=P("d"),
                              out_specs=P("d")))
    np.testing.assert_array_equal(np.asarray(g(xs)), np.asarray(itk.soft_topk_mask(x, 3.5)))
    print("ok")
""")


def test_a_batch_sharded_input_stays_sharded():
  done = subprocess.run([sys.executable, "-c", _SHARDED], capture_output=True, text=True,
                        timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  assert done.stdout.strip() == "ok"


def test_a_reduced_axis_sharded_input_makes_auto_pick_threshold():
  from implicit_topk import _apply
  script = textwrap.dedent("""
      import os
      os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
      import jax
      from jax.sharding import NamedSharding, PartitionSpec as P
      from implicit_topk import _apply
      mesh = jax.make_mesh((2,), ("d",))
      x = jax.device_put(jax.numpy.ones((4, 8)), NamedSharding(mesh, P(None, "d")))
      assert _apply.reduced_axis_is_sharded(x, -1)
      assert not _apply.reduced_axis_is_sharded(x, 0)
      print("ok")
  """)
  done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
  assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
  assert not _apply.reduced_axis_is_sharded(np.ones((2, 3)), -1)


@pytest.mark.parametrize("offset", [1e6, -3e20, 1e300])
def test_rows_far_from_zero_are_solved_relative_to_their_maximum(offset):
  # The kernel measures such rows from their largest entry, as normalize does for the
  # other solvers: the mask and its derivatives keep every digit of x - lam.
  rng = np.random.default_rng(4)
  d = rng.normal(size=(3, 7))
  x = offset + d * abs(offset) * 1e-12 if offset < 1e100 else offset + d * 1e290
  l = np.abs(x[:, :1]).ravel() * 1e-12 if offset < 1e100 else np.full(3, 1e290)
  k = np.array([1.5, 2.0, 3.25])
  y = np.asarray(native_mask(x, k, l))
  assert_close(y, R.soft_topk_mask(x, k, l), mtol(x, k, l), f"offset {offset}")
  if offset < 1e100:  # the derivative w.r.t. x is that of the centered row
    w = np.cos(np.arange(7.0))
    grad = lambda z: jax.grad(lambda z: jnp.sum(native_mask(z, k, l) * w))(z)
    centered = grad(jnp.asarray(x - x.max(axis=1, keepdims=True)))
    np.testing.assert_allclose(np.asarray(grad(jnp.asarray(x))), np.asarray(centered),
                               rtol=1e-6, atol=1e-6 * float(np.max(np.abs(centered))))


@pytest.mark.parametrize("p", [4.0 / 3.0, 2.0])
def test_hessian_vector_products(p):
  # Second order: forward-over-reverse and reverse-over-reverse agree with each other
  # and with central differences of the gradient (the kernels serve the first order,
  # autodiff of their JAX reference the second).
  rng = np.random.default_rng(6)
  x, w, v = (jnp.asarray(rng.normal(size=(2, 10))) for _ in range(3))
  grad = jax.grad(lambda z: jnp.sum(w * native_mask(z, 3.5, 0.8, p=p)))
  _, forward_over_reverse = jax.jvp(grad, (x,), (v,))
  reverse_over_reverse = jax.grad(lambda z: jnp.vdot(grad(z), v))(x)
  central = (grad(x + 1e-6 * v) - grad(x - 1e-6 * v)) / 2e-6
  np.testing.assert_allclose(forward_over_reverse, reverse_over_reverse, rtol=1e-8, atol=1e-10)
  np.testing.assert_allclose(forward_over_reverse, central, rtol=1e-5, atol=1e-6)
  if p != 2.0:  # p = 2 is piecewise linear: a zero Hessian almost everywhere
    assert float(jnp.max(jnp.abs(forward_over_reverse))) > 1e-3


def test_hessian_vmaps_the_derivative_kernels_reference():
  """jax.hessian (vmap of forward over reverse) through the derivative kernels: their
  batching rule maps the JAX reference too (before, the transposed reference kept the
  unbatched shapes: 'Expected cotangent type')."""
  rng = np.random.default_rng(7)
  x, w = jnp.asarray(rng.normal(size=(2, 6))), jnp.asarray(rng.normal(size=(2, 6)))
  loss = lambda z: jnp.sum(w * native_mask(z, 2.5, 0.8))
  hessian = np.asarray(jax.hessian(loss)(x)).reshape(12, 12)
  grad = jax.grad(loss)
  columns = [(np.asarray(grad(x + 1e-6 * e)) - np.asarray(grad(x - 1e-6 * e))).ravel() / 2e-6
             for e in np.eye(12).reshape(12, 2, 6)]
  np.testing.assert_allclose(hessian, np.stack(columns, axis=1), rtol=1e-5, atol=1e-6)
  assert np.abs(hessian).max() > 1e-2


_SHARD_MAP_GRAD = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import implicit_topk as itk
    mesh = jax.make_mesh((2,), ("d",))
    x0 = jax.random.normal(jax.random.PRNGKey(0), (4, 7))
    x = jax.device_put(x0, NamedSharding(mesh, P("d")))
    for p in (4 / 3, 2.0):
      f = lambda z: itk.soft_topk_mask(z, 2.5, regularization_strength=0.3, p=p, solver="native")
      g = jax.grad(lambda z: jnp.sum(f(z) * jnp.cos(3 * z)))
      want = g(x0)
      assert float(jnp.max(jnp.abs(want))) > 0.1  # fractional rows: not a vacuous zero
      with jax.set_mesh(mesh):
        got = jax.jit(jax.shard_map(g, mesh=mesh, in_specs=P("d"), out_specs=P("d")))(x)
      np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7)
    print("ok")
""")


def test_gradients_inside_shard_map_are_per_shard():
  # The kernels' results are typed as varying over the shard's mesh axes: a cast after
  # the call would transpose to a sum of the cotangents over devices.
  done = subprocess.run([sys.executable, "-c", _SHARD_MAP_GRAD], capture_output=True, text=True,
                        timeout=300)
  assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


# Issue 33 item 4: float64 rows at both ends of the float range (the repro rows), and an
# ordinary row.
_FAR_ROWS = np.array([[6.24e307, -5.71e307, 1.577e308, 1.17e308, -3.76e307, 1.688e308],
                      [-5.76e-307, 8.52e-307, -1.40e-306, 5.94e-307, -7.02e-307, -1.29e-306],
                      [0.3, -1.2, 2.0, 0.7, 1.1, -0.4]])
_FAR_K, _FAR_L = np.array([4.3516, 2.444, 2.5]), np.array([1.689e296, 4.17e-308, 0.7])


def test_rows_at_the_ends_of_the_float_range_keep_the_kernel_coordinates():
  # The kernel solves them on the exact rescaling x 2^-E, l 2^-E (E = 0 for the ordinary
  # row), its lam and shift in those coordinates: run() returns the threshold of the rows
  # as given, and the per-device form of the reduced-axis-sharded path returns the
  # kernel's coordinates.
  from implicit_topk.kernels.cpu import partitioning
  from implicit_topk.solvers import float_range
  x, k, l = (jnp.asarray(v) for v in (_FAR_ROWS, _FAR_K, _FAR_L))
  e = np.asarray(float_range.scale_exponent(problems.layout.DEFAULT, x, l))
  assert e.tolist() == [2, -53, 0]
  lam = np.asarray(itk.NativeSolver(regularizer=itk.PNorm(4.0 / 3.0)).run(None, x, k, l).params)
  _, infos = R.soft_topk_mask(_FAR_ROWS, _FAR_K, _FAR_L, 4.0 / 3.0, with_info=True)
  want = np.array([info["lam"] for info in infos])
  scale = np.maximum(np.max(np.abs(_FAR_ROWS), axis=1), np.abs(want))  # no overflow
  assert np.all(np.abs(lam - want) <= 128 * U64 * scale), (lam, want, 128 * U64 * scale)

  attributes = native_calls.kernel_attributes(itk.PNorm(4.0 / 3.0))
  _, lam_k, _, _, shift_k = native_calls.capped_simplex_kernel(x, k, l, attributes)
  mesh = jax.make_mesh((1,), ("d",))
  spec = jax.sharding.PartitionSpec()
  form = jax.jit(jax.shard_map(
      lambda *a: partitioning._capped_simplex("d", attributes, *a), mesh=mesh,
      in_specs=(spec,) * 3, out_specs=spec, check_vma=False))
  _, lam_s, _, _, shift_s = form(x, k, l)
  threshold_k, threshold_s = np.asarray(lam_k + shift_k), np.asarray(lam_s + shift_s)
  np.testing.assert_allclose(threshold_s, threshold_k, rtol=1e-9)
  np.testing.assert_allclose(threshold_k * 2.0 ** e, want, rtol=1e-6)


@pytest.mark.parametrize("p", [4.0 / 3.0, 2.0, 1.5])
def test_derivative_kernels_at_the_ends_of_the_float_range_match_their_jax_form(p):
  # The derivative kernels find the kernel's E again and work in its coordinates, as
  # solvers/mask_tangent.py (what higher orders differentiate) does: both modes, every
  # entry rule, tangents on the rows' own scale (derivatives up to 3 / l ~ 7e307).
  attributes = native_calls.kernel_attributes(itk.PNorm(p))
  operator = native._mask_operator(attributes)
  x, k, l = (jnp.asarray(v) for v in (_FAR_ROWS, _FAR_K, _FAR_L))
  _, lam, _, _, shift = operator(x, k, l)
  rng = np.random.default_rng(3)
  tangents = (jnp.asarray(rng.normal(size=x.shape) * _FAR_L[:, None]),
              jnp.asarray(rng.normal(size=3)), jnp.asarray(rng.normal(size=3) * _FAR_L))
  kernel = jax.jvp(lambda *a: operator(*a)[:2], (x, k, l), tangents)[1]
  cotangent = jnp.asarray(1e-3 * rng.normal(size=x.shape))
  kernel_bar = jax.vjp(lambda *a: operator(*a)[0], x, k, l)[1](cotangent)
  linear = lambda *t: mask_tangent.tangent(int(attributes["kind"]), float(attributes["a"]),
                                           x, lam, shift, l, *t)
  form = linear(*tangents)
  form_bar = jax.vjp(lambda *t: linear(*t)[0], *tangents)[1](cotangent)
  for got, want in zip((*kernel, *kernel_bar), (*form, *form_bar)):
    got, want = np.asarray(got), np.asarray(want)
    assert np.all(np.isfinite(got)) and np.array_equal(np.isfinite(got), np.isfinite(want))
    for r in range(3):  # row by row: the rows' scales are 1e600 apart
      np.testing.assert_allclose(got[r], want[r], rtol=1e-10,
                                 atol=1e-10 * float(np.max(np.abs(want[r]))))
  assert float(jnp.max(jnp.abs(kernel[0][1]))) > 1e-2  # the subnormal-scale row moves


@pytest.mark.parametrize("scale", [1e200, 1e-200])
@pytest.mark.parametrize("p", [2.0, 4.0 / 3.0, 1.5])
def test_strength_gradient_at_extreme_scales(p, scale):
  # The mask is invariant under (x, l) -> (c x, c l), so l dy/dl is too. The p = 2
  # cotangent kernel summed d z g = (x - lam) (1 / l)^2 g, and its reassociated loop
  # formed (1 / l)^2: 0 at l = 1e200, NaN at l = 1e-200.
  rng = np.random.default_rng(4)
  x, w = rng.normal(size=(3, 6)), jnp.asarray(rng.normal(size=(3, 6)))

  def scaled_gradient(c):
    g = jax.grad(lambda s: jnp.sum(w * native_mask(jnp.asarray(x * c), 2.5, s, p=p)))(0.7 * c)
    return float(g) * 0.7 * c

  np.testing.assert_allclose(scaled_gradient(scale), scaled_gradient(1.0), rtol=1e-9)
  assert abs(scaled_gradient(1.0)) > 1e-3
