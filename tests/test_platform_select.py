"""``kernels.gpu.platform_select``: a branch per platform, traced and lowered only for its
platform (the default operator's GPU kernels are not traced when it runs on a CPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from implicit_topk.kernels.gpu import platform_select


def _counting_select(traced, cpu=None):
  """x -> (x + 1 on CPU, x + 2 on CUDA, x + 3 elsewhere), counting each branch's traces."""
  def branch(name, shift):
    def fun(x):
      traced[name] = traced.get(name, 0) + 1
      return {"y": x + shift, "rows": jnp.sum(x, axis=-1)}
    return fun
  return lambda x: platform_select.platform_select(
      (x,), {"cpu": cpu or branch("cpu", 1.0), "cuda": branch("cuda", 2.0)},
      branch("default", 3.0), like=lambda x: {"y": x, "rows": jnp.sum(x, axis=-1)})


def test_each_branch_is_traced_only_when_lowered_for_its_platform():
  traced = {}
  select = _counting_select(traced)
  x = jnp.arange(6.0).reshape(2, 3)
  lowered = jax.jit(select).trace(x)
  assert traced == {}, traced  # tracing ran the stand-in only
  text = lowered.lower(lowering_platforms=("cuda",)).as_text()
  assert traced == {"cuda": 1}, traced
  assert "stablehlo.case" not in text  # one platform: its branch alone
  out = jax.jit(select)(x)
  assert traced == {"cuda": 1, "cpu": 1}, traced
  np.testing.assert_array_equal(out["y"], x + 1.0)
  np.testing.assert_array_equal(out["rows"], x.sum(-1))
  jax.jit(select).trace(x).lower(lowering_platforms=("cpu", "cuda", "tpu")).as_text()
  assert traced == {"cuda": 2, "cpu": 2, "default": 1}, traced


def test_vmap_maps_every_branch():
  traced = {}
  select = _counting_select(traced)
  xs = jnp.arange(24.0).reshape(4, 2, 3)
  out = jax.vmap(select)(xs)
  assert out["y"].shape == (4, 2, 3) and out["rows"].shape == (4, 2)
  np.testing.assert_array_equal(out["y"], xs + 1.0)
  np.testing.assert_array_equal(out["rows"], xs.sum(-1))
  jax.jit(jax.vmap(select)).trace(xs).lower(lowering_platforms=("cuda",))
  assert traced["cuda"] == 1


def test_a_branch_of_other_types_is_refused_when_lowered():
  select = _counting_select({}, cpu=lambda x: {"y": x.astype(jnp.int32), "rows": x[:, 0]})
  x = jnp.ones((2, 3))
  with pytest.raises(ValueError, match="the cpu branch returns"):
    jax.jit(select)(x)
