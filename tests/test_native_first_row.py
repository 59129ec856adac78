"""The native kernel's first row of a block in one pass (``_first_row_attempt``).

A p-norm row with ``2 < k < n - 1``, ``ceil(k) < 16`` and no previous row to guess its
cut from (a single row, the first of a block) keeps its ``ceil(k) + 1`` largest entries
and gathers a superset of the candidates in one pass, instead of the general path's
five. Checked against the independent references of ``tests/references.py`` with the
tolerance rule of ``tests/test_fuzz.py``, and (slow) against the general path to the bit
on rows of every kind: ordinary, tied, binary, sorted either way, far from 0 relative
to ``l`` and non-finite (both left to the general path).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import implicit_topk as itk
import references as R
from implicit_topk.kernels.cpu import native_threshold
from test_fuzz import U32, U64, assert_close, mtol

jax.config.update("jax_enable_x64", True)

_KS = (2.5, 3.0, 10.0, 10.3, 15.0)


def _rows(n, rng):
  """(x, k, l) float64: one row per case, every kind the first-row pass meets."""
  cases = []
  for k in _KS:
    for l in (1e-3, 0.1, 2.0):
      cases.append((rng.normal(size=n), k, l))
      cases.append((np.round(3.0 * rng.normal(size=n)), k, l))  # ties
      cases.append((np.sort(rng.normal(size=n)), k, l))  # ascending
      cases.append((np.sort(rng.normal(size=n))[::-1].copy(), k, l))  # descending
  for k in (3.0, 10.0):  # binary: the top k entries l apart from the rest
    x = rng.normal(size=n) * 0.01
    x[rng.permutation(n)[:int(k)]] += 5.0
    cases.append((x, k, 1.0))
  cases.append((rng.normal(size=n) + 1e7, 10.0, 0.1))  # far from 0: the general path
  x = rng.normal(size=n)
  x[n // 2] = np.inf  # not finite: the general path
  cases.append((x, 10.0, 0.1))
  x = rng.normal(size=n)
  x[1] = -np.inf
  cases.append((x, 3.0, 0.1))
  return cases


@pytest.mark.parametrize("n", [40, 1000])
@pytest.mark.parametrize("p", [4.0 / 3.0, 2.0])
@pytest.mark.parametrize("dtype,eps", [(np.float32, U32), (np.float64, U64)])
def test_single_rows_match_the_reference(n, p, dtype, eps):
  rng = np.random.default_rng([n, int(3 * p)])
  for x, k, l in _rows(n, rng):
    x = x[None].astype(dtype).astype(np.float64)  # the reference sees the row as the kernel
    y = np.asarray(itk.soft_topk_mask(jnp.asarray(x, dtype), k, regularization_strength=l,
                                      p=p, solver="native"))
    assert y.dtype == dtype
    kk, ll = np.array([k]), np.array([l])
    assert_close(y.astype(np.float64), R.soft_topk_mask(x, kk, ll, p),
                 mtol(x, kk, ll, p, eps=eps), f"first row n={n} k={k} l={l} p={p}")


def _solve(row, k, l, a, general):
  """(mask, threshold, passes, origin, residual) of one row by the kernel's row entry
  (the first-row pass where it applies) or by the general path alone."""
  n, dtype = row.shape[0], row.dtype
  tol, root_eps = 4.0 * np.finfo(dtype).eps, float(np.sqrt(np.finfo(dtype).eps))
  work, scratch, guess, out = np.empty(n), np.empty(n), np.full(3, np.inf), np.empty_like(row)
  if general:
    finite = bool(np.all(np.isfinite(row)))
    result = native_threshold._general_row(row, n, k, l, native_threshold.PNORM, a, tol,
                                           root_eps, work, scratch, guess, out, finite)
  else:
    result = native_threshold._solve_row(row, n, k, l, native_threshold.PNORM, a, tol,
                                         root_eps, work, scratch, guess, out)
  return (out, *result, guess)


# One worker runs them all: each compiles the row entries for calls from Python.
@pytest.mark.slow
@pytest.mark.xdist_group("native_first_row_bits")
@pytest.mark.parametrize("a", [3.0, 1.0])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_first_row_gives_the_general_path_results_to_the_bit(a, dtype):
  # The same order statistics, bracket and candidates in row order: the same mask,
  # threshold, passes, origin and guess for the next row (and residual, up to the
  # reassociation of its sum).
  rng = np.random.default_rng([int(a), np.dtype(dtype).itemsize])
  for n in (17, 300, 1000, 4000):
    for x, k, l in _rows(n, rng):
      x = x.astype(dtype)
      got, expected = _solve(x, k, l, a, False), _solve(x, k, l, a, True)
      names = ("mask", "threshold", "passes", "origin", "residual", "guess")
      for name, g, e in zip(names, got, expected):
        if name == "residual":
          # |sum(mask) - k| of the same mask, but its sum is reassociated (vectorized),
          # and LLVM may vectorize the two compiled copies of the loop differently
          np.testing.assert_allclose(g, e, rtol=0, atol=n * U64 * (k + 1), err_msg=f"n={n} k={k} l={l}")
        else:
          np.testing.assert_array_equal(g, e, f"{name}: n={n} k={k} l={l}")
