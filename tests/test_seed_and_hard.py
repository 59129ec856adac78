"""The seed reference's README examples through `implicit_topk.compat`, and the hard ops."""

import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import implicit_topk as itk
from implicit_topk import compat
import references as R


@pytest.fixture
def legacy_prng():
  """The reference README drew its inputs with the pre-0.5 threefry stream."""
  previous = jax.config.jax_threefry_partitionable
  jax.config.update("jax_threefry_partitionable", False)
  yield
  jax.config.update("jax_threefry_partitionable", previous)


def test_seed_1d_examples():
  values = jnp.array([-5.0, -2.0, 3.0, 1.0], jnp.float32)
  # The reference prints 0.99999714 (float32 PAV noise); the exact solution is 1.
  np.testing.assert_array_equal(compat.sparse_soft_topk_mask_pav(values, k=2, l=1e-2), [0, 0, 1, 1])
  np.testing.assert_array_equal(compat.hard_topk_mask(values, k=2), [0, 0, 1, 1])
  np.testing.assert_array_equal(compat.hard_topk_mag(values, k=2), [-5, 0, 3, 0])


@pytest.mark.slow
def test_seed_batched_example(legacy_prng):
  values = (5 * jax.random.normal(jax.random.PRNGKey(2), (2, 3, 4), jnp.float32)).astype(jnp.int32)
  np.testing.assert_array_equal(values, [[[-11, 1, 4, -7], [5, 1, 4, 1], [-10, -3, 4, -6]],
                                         [[7, -6, -8, -4], [-1, 9, 8, 4], [0, 0, -5, 5]]])
  y = compat.sparse_soft_topk_mask_pav(values, k=2, l=1e-2)
  expected = [[[0, 1, 1, 0], [1, 0, 1, 0], [0, 1, 1, 0]],
              [[1, 0, 0, 1], [0, 1, 1, 0], [0.5, 0.5, 0, 1]]]
  assert y.dtype == jnp.float32
  # 0 and 1 are exact; 0.5 = ((0 - lam) / l)^3 goes through lam rounded to float32
  # (lam = -l / 2^(1/3) is irrational), so it is exact to 2 ulps in float32 ...
  y, expected = np.asarray(y), np.asarray(expected)
  binary = (expected == 0) | (expected == 1)
  np.testing.assert_array_equal(y[binary], expected[binary])
  np.testing.assert_allclose(y[~binary], expected[~binary], rtol=0, atol=2 * 2.0**-24)
  # ... and to 1e-15 in float64.
  y64 = compat.sparse_soft_topk_mask_pav(values.astype(jnp.float64), k=2, l=1e-2)
  np.testing.assert_allclose(y64, expected, rtol=0, atol=1e-15)


def test_seed_differentiability_example(legacy_prng):
  k, l = 4, 0.5

  @jax.jit
  def sparse_soft_f(x):
    out = compat.sparse_soft_topk_mask_pav(x, k=k, l=l) + compat.sparse_soft_topk_mask_pav(x**2, k=k, l=l)
    return (out**2).mean()

  @jax.jit
  def hard_f(x):
    out = compat.hard_topk_mask(x, k=k) + compat.hard_topk_mask(x**2, k=k)
    return (out**2).mean()

  x = jax.random.normal(jax.random.PRNGKey(2), (10,), jnp.float32)
  np.testing.assert_array_equal(jax.grad(hard_f)(x), np.zeros(10))
  printed = [0.0, 0.09063217, 0.2323066, 0.0, 0.12527105, 0.05957882, -0.13923873,
             0.05559958, 0.0, -0.09306791]
  np.testing.assert_allclose(jax.grad(sparse_soft_f)(x), printed, atol=1e-6)
  # and the float64 computation agrees with the printed float32 one
  g64 = jax.grad(sparse_soft_f)(x.astype(jnp.float64))
  np.testing.assert_allclose(g64, printed, atol=1e-6)


def test_compat_validates_bisect_max_iter():
  with pytest.raises(ValueError, match="bisect_max_iter"):
    compat.sparse_soft_topk_mask_pav(jnp.ones(3), 1, bisect_max_iter=0)


def test_hard_mask_breaks_ties_by_index_and_uses_axis():
  x = jnp.array([[1.0, 3.0, 3.0, 3.0], [2.0, 2.0, 0.0, 5.0]])
  np.testing.assert_array_equal(itk.hard_topk_mask(x, 2), [[0, 1, 1, 0], [1, 0, 0, 1]])
  np.testing.assert_array_equal(itk.hard_topk_mask(x.T, 2, axis=0), np.asarray(itk.hard_topk_mask(x, 2)).T)
  np.testing.assert_array_equal(itk.hard_topk_mag(jnp.array([-4.0, 1.0, 3.0]), 2), [-4, 0, 3])


def test_hard_ops_gradients():
  x = jnp.array([0.5, -2.0, 1.0])
  np.testing.assert_array_equal(jax.grad(lambda x: jnp.sum(itk.hard_topk_mask(x, 1)))(x), [0, 0, 0])
  np.testing.assert_array_equal(jax.grad(lambda x: jnp.sum(itk.hard_topk_mag(x, 2)))(x), [0, 1, 1])


def test_hard_ops_errors():
  with pytest.raises(TypeError, match="Python int"):
    itk.hard_topk_mask(jnp.ones(3), 1.5)
  with pytest.raises(ValueError, match="0 <= k <= n"):
    itk.hard_topk_mask(jnp.ones(3), 4)
  with pytest.raises(TypeError, match="floating dtype"):
    itk.hard_topk_mag(jnp.ones(3, jnp.int32), 1)


def test_soft_tends_to_hard_on_the_seed_batch(legacy_prng):
  values = (5 * jax.random.normal(jax.random.PRNGKey(2), (2, 3, 4), jnp.float32)).astype(jnp.float32)
  np.testing.assert_array_equal(itk.soft_topk_mask(values, 2, regularization_strength=1e-3), itk.hard_topk_mask(values, 2))


def _demo_rows(out):
  """The demo's `label : [numbers]` lines, as {label: array}."""
  rows = {}
  for line in out.splitlines():
    m = re.match(r"^(.*?)\s+: \[([^\]]*)\]\s*$", line)
    if m:
      rows[m.group(1).strip()] = np.array(m.group(2).split(), float)
  return rows


@pytest.mark.slow
def test_demo_command_runs():
  """The demo's printed values agree with the independent references of tests/references.py."""
  out = subprocess.run([sys.executable, "-m", "implicit_topk", "demo", "--no-timing"],
                       capture_output=True, text=True, check=True).stdout
  rows = _demo_rows(out)
  x = np.array([3.0, 1.0, 0.6, -1.0])
  np.testing.assert_array_equal(rows["hard_topk_mask(x, 2)"], [1, 1, 0, 0])
  for strength in (1.0, 0.1):
    np.testing.assert_allclose(rows[f"soft_topk_mask(x, 2, regularization_strength={strength})"],
                               R.soft_topk_mask(x, 2, strength), atol=6e-5)
  assert rows["d hard mask[1] / dx"].tolist() == [0, 0, 0, 0]
  grad = rows["d soft mask[1] / dx (strength 1.0)"]
  assert grad[1] > 0 and grad[2] == -grad[1] and grad[0] == grad[3] == 0
  xm = np.array([-4.0, 0.5, 2.0, -1.5, 1.2])
  np.testing.assert_allclose(rows["soft_topk_mag(x, 2, regularization_strength=1.0)"],
                             R.soft_topk_mag(xm, 2, 1.0), atol=6e-5)
  xs = np.array([0.3, 2.0, -1.0, 1.8])
  np.testing.assert_allclose(rows["soft_rank(x, regularization_strength=1.0)"],
                             R.soft_rank(xs, 1.0), atol=6e-5)
  np.testing.assert_allclose(rows["soft_sort(x, regularization_strength=1.0)"],
                             R.soft_sort(xs, 1.0), atol=6e-5)
  scores = np.array([[3.0, 2.0, -1.0, -2.0], [0.2, 0.1, 1.5, 1.0]])
  target = np.array([1.0, 1.0, 0.0, 0.0])
  losses = [R.fenchel_young_row(s, target, 2, 1.0, R.regularizer())[0] for s in scores]
  np.testing.assert_allclose(rows["loss per example (default reduction='none')"], losses, atol=6e-5)
