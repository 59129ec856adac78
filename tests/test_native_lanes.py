"""The native kernel's router rows solved many at a time (``kernels/cpu/native_lanes``).

Rows of 3 to 512 entries with ``0 < k <= 2`` and p = 4/3 or 2 go through lanes, a block
of 64 rows at a time: rows of up to 16 entries whole, longer rows by their candidates
(at most 16 of them; rows with more are left to the per-row kernel). Checked against the independent references of
``tests/references.py`` (exact rational breakpoints, then float64 bisection; no code
shared with the library) with the tolerance rule of ``tests/test_fuzz.py``, on blocks
that mix every kind of row the lanes meet: ordinary, tied, binary, near-binary (more
Newton passes than the lanes take, so they resume one by one), rows the lanes leave to
the per-row kernel (non-finite entries, far from 0, ``k`` outside ``(0, 2]`` or at
``n - 1``), and a last block shorter than 64 rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import implicit_topk as itk
import references as R
from implicit_topk.kernels.cpu import native_lanes, native_mask, native_threshold
from test_fuzz import U32, U64, assert_close, mtol

jax.config.update("jax_enable_x64", True)


def _block_rows(n, rng, rows=150):
  """(x, k, l) float64: ``rows`` rows of ``n`` entries, every kind the lanes meet."""
  x = rng.normal(size=(rows, n))
  k = rng.choice([0.5, 1.0, 1.5, 2.0], size=rows)
  l = 10.0 ** rng.uniform(-1.5, 0.5, size=rows)
  x[1::9] = np.round(x[1::9])  # ties
  for r in range(2, rows, 9):  # binary at integer k: the top k entries l apart
    k[r] = 1.0 + r % 2
    x[r] = np.where(np.arange(n) < k[r], 5.0, 0.0) - 0.01 * np.arange(n)
    l[r] = 1.0
  for r in range(3, rows, 9):  # near-binary: the gap within a few parts in 1e6 of l
    k[r], l[r] = 1.0, 0.5
    x[r] = np.minimum(x[r], 0.0)
    x[r, r % n] = 1.0 + 0.5 * (1.0 + 1e-6 * ((r % 5) - 2))
    x[r, (r + 1) % n] = 1.0
  x[4::9, 0] = np.inf
  x[5::27, -1] = np.nan
  x[14::27, 1] = -np.inf
  x[6::9] += 1e7  # far from 0 relative to l: solved relative to the maximum
  k[7::18] = n - 1.0
  k[16::18] = 0.0
  k[8::9] = rng.choice([2.5, 0.25, 1.75], size=k[8::9].shape)
  return x, k, l


def _reference(x, k, l, p):
  return np.stack([R.soft_topk_mask(x[r:r + 1], k[r:r + 1], l[r:r + 1], p)[0]
                   for r in range(x.shape[0])])


# the default run: the common router width, both ends of the lanes and the gathered rows
@pytest.mark.parametrize("n", [pytest.param(3, marks=pytest.mark.slow), 8, 16,
                               pytest.param(17, marks=pytest.mark.slow), 64])
@pytest.mark.parametrize("p", [4.0 / 3.0, 2.0])
@pytest.mark.parametrize("dtype,eps", [(np.float32, U32), (np.float64, U64)])
def test_router_blocks_match_the_reference(n, p, dtype, eps):
  rng = np.random.default_rng([n, int(3 * p)])
  x, k, l = _block_rows(n, rng)
  x = x.astype(dtype).astype(np.float64)  # the reference sees the rows as the kernel does
  y = np.asarray(itk.soft_topk_mask(jnp.asarray(x, dtype), jnp.asarray(k, dtype),
                                    regularization_strength=jnp.asarray(l, dtype), p=p,
                                    solver="native"))
  assert y.dtype == dtype
  assert_close(y.astype(np.float64), _reference(x, k, l, p), mtol(x, k, l, p, eps=eps),
               f"lanes n={n} p={p} {np.dtype(dtype).name}")


def _kernel(x, k, l, a, per_row):
  """The kernel's (y, lam, passes) on float32 rows: all rows at once, in lanes where they
  apply, or each row by the per-row kernel."""
  rows, _ = x.shape
  y, lam, passes = np.empty_like(x), np.empty(rows, x.dtype), np.empty(rows, np.int32)
  residual, shift = np.empty(rows, x.dtype), np.empty(rows, x.dtype)
  native_mask.capped_simplex_rows(x, k, l, native_threshold.PNORM, a, y, lam, passes,
                                  residual, shift, not per_row)
  return y, lam, passes


# Rows (k = 2, l = 1; padded with -10, never a candidate) on which p = 4/3 takes 6 and 7
# Newton passes, more than the lanes' LANE_PASSES: they resume one by one. Ordinary
# rows take 2 or 3 (the step to the root of the current piece's cubic), near-binary
# ones too.
_SLOW_ROWS = (
    [-0.17189647257328033, -0.6562065482139587, -0.30077359080314636, 0.4728562533855438,
     -0.17435528337955475, -0.46879684925079346, -1.255548357963562, 0.42396673560142517],
    [-0.1927599459886551, 0.75523841381073, 0.0650814026594162, 0.7013830542564392,
     0.14277440309524536, -0.503546416759491, 0.10535727441310883, -0.3764691650867462])


# One worker runs them all: each compiles the kernel's entry for calls from Python (about
# 50 s on a cold numba cache), which two workers did at the same time. In the slow group:
# that compilation was a fifth of the default run's time on one worker; the default run
# checks the lanes' results against the reference (test_router_blocks_match_the_reference).
@pytest.mark.slow
@pytest.mark.xdist_group("native_lanes_bits")
@pytest.mark.parametrize("n", [8, 64])
@pytest.mark.parametrize("a", [3.0, 1.0])
def test_lanes_give_the_per_row_kernel_results_to_the_bit(a, n):
  # The lanes run the per-row kernel's iteration pass for pass: the same mask,
  # threshold and pass count, including the rows that resume after the lanes' passes.
  rng = np.random.default_rng([int(a), n])
  x, k, l = _block_rows(n, rng, rows=200)
  if n > native_lanes.LANE_ROW:  # rows with more candidates than the lanes hold
    x[10::17] = np.linspace(1.0, 0.9, n)
    l[10::17] = 0.5
  for r, row in zip((11, 130), _SLOW_ROWS):  # more passes than the lanes take (p = 4/3)
    x[r], k[r], l[r] = -10.0, 2.0, 1.0
    x[r, :len(row)] = row
  x, k, l = x.astype(np.float32), k.astype(np.float32), l.astype(np.float32)
  lanes, rows = _kernel(x, k, l, a, False), _kernel(x, k, l, a, True)
  for got, expected in zip(lanes, rows):
    np.testing.assert_array_equal(got, expected)
  passes = lanes[2]
  assert (passes == 0).any() and (passes > 0).any()
  if a == 3.0:  # the rows of _SLOW_ROWS take more passes than the lanes do
    assert (passes[[11, 130]] > native_lanes.LANE_PASSES).all(), passes[[11, 130]]


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_half_precision_router_rows(dtype):
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.normal(size=(100, 8)), dtype)
  k = np.where(np.arange(100) % 2 == 0, 1.0, 2.0)
  y = itk.soft_topk_mask(x, k, regularization_strength=0.5, solver="native")
  assert y.dtype == dtype
  reference = _reference(np.asarray(x, np.float64), k, np.full(100, 0.5), 4.0 / 3.0)
  np.testing.assert_allclose(np.asarray(y, np.float64), reference,
                             atol=2 * float(jnp.finfo(dtype).eps))


def test_where_excludes_entries_of_router_rows():
  # Entries outside where= are -inf to the kernel: those rows leave the lanes, the rest
  # of the block stays in them.
  rng = np.random.default_rng(6)
  x = rng.normal(size=(70, 8))
  where = np.ones((70, 8), bool)
  where[::3, 5:] = False
  y = np.asarray(itk.soft_topk_mask(jnp.asarray(x), 2.0, regularization_strength=0.5,
                                    where=jnp.asarray(where), solver="native"))
  expected = np.zeros_like(x)
  for r in range(70):
    expected[r, where[r]] = R.soft_topk_mask(x[r:r + 1, where[r]], 2.0, 0.5)[0]
  np.testing.assert_allclose(y, expected, atol=1e-12)
