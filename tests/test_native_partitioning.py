"""The per-device forms of the native kernels (``implicit_topk.kernels.cpu.partitioning``),
which XLA runs on each device's block when a reduced axis is split over devices, against
the kernels themselves on one device (a mesh axis of size 1: the psums are identities),
on edge rows: ordinary, binary for the p-norms (no fractional entry: the derivatives'
sum of slopes is 0), with +-inf entries, and without a threshold (NaN). Near-binary rows
of the dense regularizers (gaps of tens of strengths) are left out: their threshold is
not determined in floating point unless every solver writes the equation in complement
form (issue 33, item 2), and the two solvers may pick different roots until then. The 8-device checks (no gather in
the compiled program, results equal to the unsharded call) are in test_sharded_axis.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from implicit_topk.kernels.cpu import ffi, partitioning, registry
from implicit_topk.kernels.cpu.native_calls import (capped_simplex_kernel, derivative_rule,
                                                    kernel_attributes)
import implicit_topk as itk

jax.config.update("jax_enable_x64", True)

ROWS = np.array([
    [0.3, -1.2, 2.0, 0.7, 1.1, -0.4],        # ordinary
    [1.0, 0.8, 0.0, -1.0, 0.5, -2.0],       # binary for the p-norms at l = 0.1
    [np.inf, 0.5, -np.inf, 0.2, 1.0, 0.1],   # infinite entries
    [-np.inf, -np.inf, -np.inf, -np.inf, -np.inf, 1.0],  # k = 2.5 > entries above -inf: NaN
])
K = np.array([2.5, 3.0, 2.5, 2.5])


def _on_one_device(fn, *args):
  mesh = jax.make_mesh((1,), ("d",))
  spec = jax.sharding.PartitionSpec()
  return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * len(args), out_specs=spec,
                               check_vma=False))(*args)


def _assert_same(got, want, tol):
  got, want = np.asarray(got), np.asarray(want)
  np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
  ok = ~np.isnan(want)
  np.testing.assert_allclose(got[ok], want[ok], rtol=tol, atol=tol)


_SLOW = pytest.mark.slow


@pytest.mark.parametrize("regularizer", [
    itk.PNorm(4 / 3), pytest.param(itk.PNorm(2.0), marks=_SLOW), itk.PNorm(1.5),
    itk.Entropy(), itk.BinaryEntropy(), pytest.param(itk.Laplace(), marks=_SLOW)],
    ids=["p4/3", "p2", "p1.5", "entropy", "sigmoid", "laplace"])
def test_per_device_forms_match_the_kernels(regularizer):
  dtype = jnp.float64
  x = jnp.asarray(ROWS, dtype)
  k, l = jnp.asarray(K, dtype), jnp.full((4,), 0.1, dtype)
  attributes = kernel_attributes(regularizer)
  items = tuple(sorted(attributes.items()))
  y, lam, _, _, shift = capped_simplex_kernel(x, k, l, attributes)

  # the forward: the mask and the threshold lam + shift
  y_s, lam_s, _, _, shift_s = _on_one_device(
      lambda *a: partitioning._capped_simplex("d", dict(items), *a), x, k, l)
  _assert_same(y_s, y, 1e-12)
  _assert_same(lam_s + shift_s, lam + shift, 1e-12)

  # the derivative maps, at the kernel's threshold
  rule = derivative_rule(int(attributes["kind"]), float(attributes["a"]))
  rng = np.random.default_rng(0)
  x_dot, y_bar = (jnp.asarray(rng.normal(size=ROWS.shape), dtype) for _ in range(2))
  k_dot, l_dot, lam_bar = (jnp.asarray(rng.normal(size=4), dtype) for _ in range(3))
  full, row = jax.ShapeDtypeStruct(x.shape, dtype), jax.ShapeDtypeStruct((4,), dtype)
  want = ffi.call(registry.target(f"capped_simplex_tangent_{rule}", dtype), (full, row),
                  x, lam, shift, l, x_dot, k_dot, l_dot, **attributes)
  got = _on_one_device(lambda *a: partitioning._tangent("d", dict(items), *a),
                       x, lam, shift, l, x_dot, k_dot, l_dot)
  for g, w in zip(got, want):
    _assert_same(g, w, 1e-12)
  want = ffi.call(registry.target(f"capped_simplex_cotangent_{rule}", dtype), (full, row, row),
                  x, lam, shift, l, y_bar, lam_bar, **attributes)
  got = _on_one_device(lambda *a: partitioning._cotangent("d", dict(items), *a),
                       x, lam, shift, l, y_bar, lam_bar)
  for g, w in zip(got, want):
    _assert_same(g, w, 1e-12)


@pytest.mark.parametrize("p", [4 / 3, pytest.param(2.0, marks=_SLOW), 3.0])
def test_per_device_magnitude_form_matches_the_kernel(p):
  from implicit_topk.kernels.cpu.native_calls import magnitude_kernel
  dtype = jnp.float64
  x = jnp.asarray(np.where(np.isinf(ROWS), 7.0, ROWS[::-1]), dtype)
  k, l = jnp.asarray(K, dtype), jnp.full((4,), 0.1, dtype)
  lam, _, _ = magnitude_kernel(x, k, l, p)
  attributes = {"a": np.float64(itk.PNorm(p).exponent)}
  lam_s, _, _ = _on_one_device(lambda *a: partitioning._magnitude("d", attributes, *a), x, k, l)
  _assert_same(lam_s, lam, 1e-12)


def test_one_device_lowers_the_plain_kernel_call():
  """On one device nothing is partitioned: the compiled program calls the kernel."""
  text = jax.jit(lambda z: itk.soft_topk_mask(z, 2.0, solver="native")).lower(
      jnp.ones((2, 8))).as_text()
  assert "implicit_topk_capped_simplex" in text and "CustomSPMDPartitioning" not in text
