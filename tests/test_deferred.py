"""``implicit_topk._deferred``: calls traced when lowered, for their platform only, with
exact derivatives and vmap (checked against the same functions called directly, whose
derivatives jax computes itself), and the default operator's use of them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import implicit_topk as itk
from implicit_topk import _deferred

jax.config.update("jax_enable_x64", True)


def _counting(traced):
  """(x, s) -> (y, count): y = sin(x) * s + x^2 on CPU, y = 2x elsewhere; count an int."""
  def on_cpu(x, s):
    traced["cpu"] = traced.get("cpu", 0) + 1
    return {"y": jnp.sin(x) * s + x * x, "count": jnp.sum(x > 0).astype(jnp.int32)}

  def elsewhere(x, s):
    traced["default"] = traced.get("default", 0) + 1
    return {"y": 2.0 * x * s, "count": jnp.sum(x > 0).astype(jnp.int32)}

  def call(x, s):
    out_avals = {"y": jax.ShapeDtypeStruct(x.shape, x.dtype),
                 "count": jax.ShapeDtypeStruct((), jnp.int32)}
    return _deferred.deferred_call((x, s), out_avals, elsewhere, {"cpu": on_cpu}, name="test")
  return call, on_cpu


def test_each_function_is_traced_only_when_lowered_for_its_platform():
  traced = {}
  call, _ = _counting(traced)
  x = jnp.linspace(-1.0, 1.0, 6)
  lowered = jax.jit(call).trace(x, 2.0)
  assert traced == {}, traced
  text = lowered.lower(lowering_platforms=("tpu",)).as_text()
  assert traced == {"default": 1} and "stablehlo.case" not in text, traced
  np.testing.assert_allclose(jax.jit(call)(x, 2.0)["y"], np.sin(x) * 2.0 + x * x, rtol=1e-15)
  assert traced == {"default": 1, "cpu": 1}, traced


def test_derivatives_and_vmap_equal_those_of_the_function_called_directly():
  call, direct = _counting({})
  rng = np.random.default_rng(0)
  x, s = jnp.asarray(rng.normal(size=5)), jnp.asarray(1.3)
  loss = lambda f: lambda x, s: jnp.sum(jnp.cos(f(x, s)["y"]))
  for argnums in (0, 1, (0, 1)):
    got = jax.jit(jax.grad(loss(call), argnums))(x, s)
    want = jax.grad(loss(direct), argnums)(x, s)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-14), got, want)
  tx = jnp.asarray(rng.normal(size=5))
  got = jax.jvp(lambda x: call(x, s)["y"], (x,), (tx,))
  want = jax.jvp(lambda x: direct(x, s)["y"], (x,), (tx,))
  np.testing.assert_allclose(got[1], want[1], rtol=1e-12, atol=1e-14)
  np.testing.assert_allclose(jax.hessian(loss(call))(x, s), jax.hessian(loss(direct))(x, s),
                             rtol=1e-12)
  xs = jnp.asarray(rng.normal(size=(3, 5)))
  got = jax.vmap(jax.grad(loss(call)), in_axes=(0, None))(xs, s)
  want = jax.vmap(jax.grad(loss(direct)), in_axes=(0, None))(xs, s)
  np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)
  assert call(x, s)["count"].dtype == jnp.int32


def test_a_function_of_other_types_is_refused_when_lowered():
  out_avals = jax.ShapeDtypeStruct((3,), jnp.float64)
  call = lambda x: _deferred.deferred_call((x,), out_avals, lambda x: x[:2], name="short")
  with pytest.raises(ValueError, match="short: the default branch returns"):
    jax.jit(call)(jnp.ones(3))


def test_the_default_operator_on_a_cpu_traces_no_other_platforms_solver(monkeypatch):
  """solver='auto' on this CPU machine: the GPU kernel and the pure-JAX solver are one
  deferred call, not traced when the caller is traced (nor when it runs here)."""
  from implicit_topk.solvers import pallas, threshold
  touched = []
  for cls in (pallas.PallasSolver, threshold.ThresholdSolver):
    original = cls.solve_and_map
    monkeypatch.setattr(cls, "solve_and_map",
                        lambda self, *a, _o=original, _c=cls: touched.append(_c) or _o(self, *a))
  x = jax.random.normal(jax.random.PRNGKey(0), (4, 9))
  fn = lambda z: jnp.sum(jnp.sin(itk.soft_topk_mask(z, 2.0)))
  jaxpr = jax.make_jaxpr(jax.grad(fn))(x)
  assert touched == [], touched
  assert "implicit_topk_deferred" in str(jaxpr)
  jax.jit(jax.grad(fn))(x)
  assert touched == [], touched
  jax.jit(jax.grad(fn)).trace(x).lower(lowering_platforms=("tpu",))
  assert set(touched) == {threshold.ThresholdSolver}, touched  # (forward; backward)


def test_a_budgeted_mask_on_a_cpu_traces_only_its_kernel_path(monkeypatch):
  """max_support on this CPU machine: the kernel path is traced, the pure-JAX path (the
  other platforms') only when lowered for them."""
  from implicit_topk import support_budget
  jax.clear_caches()  # (an earlier test may have traced the operator's inner jit at this shape)
  touched = []
  original = support_budget._jax_mask  # pylint: disable=protected-access
  monkeypatch.setattr(support_budget, "_jax_mask",
                      lambda *a, **kw: touched.append(1) or original(*a, **kw))
  x = jax.random.normal(jax.random.PRNGKey(1), (4, 9))
  fn = lambda z: jnp.sum(jnp.sin(itk.soft_topk_mask(z, 2.0, max_support=3)))
  jax.jit(jax.grad(fn))(x)
  assert touched == [], touched
  jax.jit(jax.grad(fn)).trace(x).lower(lowering_platforms=("tpu",))
  assert touched, "the pure-JAX path is what other platforms run"


def test_platform_dependent_traces_the_branch_of_this_platform_only():
  traced = []
  branch = lambda name, c: (lambda x: traced.append(name) or x * c)
  fn = lambda x: _deferred.platform_dependent(x, here="cpu", cpu=branch("cpu", 2.0),
                                              cuda=branch("cuda", 3.0),
                                              default=branch("default", 4.0))
  x = jnp.arange(3.0)
  np.testing.assert_array_equal(jax.jit(fn)(x), 2.0 * x)
  assert traced == ["cpu"], traced
  for platform, want in (("cuda", "cuda"), ("tpu", "default")):
    traced.clear()
    jax.jit(fn).trace(x).lower(lowering_platforms=(platform,))
    assert traced == [want], traced  # (jit reuses its trace of fn: the lowering alone)
  np.testing.assert_allclose(jax.grad(lambda x: jnp.sum(jnp.sin(fn(x))))(x), 2.0 * np.cos(2.0 * x))


def test_on_a_gpu_the_default_branch_is_traced_once_under_both_gpu_names():
  """``here="gpu"`` where the GPU takes the default branch: jax names a GPU ``"cuda"`` or
  ``"rocm"`` (``"gpu"`` raises), and both names share one traced branch."""
  traced = []
  branch = lambda name, c: (lambda x: traced.append(name) or x * c)
  fn = lambda x: _deferred.platform_dependent(x, here="gpu", cpu=branch("cpu", 2.0),
                                              default=branch("default", 4.0))
  x = jnp.arange(3.0)
  traced_fn = jax.jit(fn).trace(x)
  assert traced == ["default"], traced
  for platform in ("cuda", "rocm", ("cuda", "rocm")):
    traced_fn.lower(lowering_platforms=platform if isinstance(platform, tuple) else (platform,))
  assert traced == ["default"], traced
  traced_fn.lower(lowering_platforms=("cpu",))
  assert traced == ["default", "cpu"], traced  # (the CPU branch deferred: traced at lowering)
  np.testing.assert_array_equal(jax.jit(fn)(x), 2.0 * x)  # (runs here, on the CPU)
