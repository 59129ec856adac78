"""The PAV kernels as XLA FFI custom calls (solver="pav"): no host callback, so they
export with jax.export, keep a batch-sharded input sharded, and refuse bad input with an
error instead of a crash."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import implicit_topk as itk
from implicit_topk.kernels.cpu import ffi, pav_calls

_OPS = {
    "mask": "lambda z: itk.soft_topk_mask(z, 2.5, regularization_strength=0.7, solver='pav')",
    "magnitude": "lambda z: itk.soft_topk_mag(z, 2.5, regularization_strength=0.7, solver='pav')",
    "soft_rank": "lambda z: itk.soft_rank(z, regularization_strength=0.7, solver='pav')",
}
_TARGETS = {"mask": "implicit_topk_pav_capped_simplex", "magnitude": "implicit_topk_pav_magnitude",
            "soft_rank": "implicit_topk_pav_permutahedron"}


def _run(script, *args):
  env = {k: v for k, v in os.environ.items() if k != "JAX_ENABLE_X64"}
  done = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True,
                        text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  return done.stdout.strip()


def test_every_pav_target_is_registered_by_register_kernels():
  # (at first use of solver="pav"; not at import: a cold numba cache takes a minute)
  itk.register_kernels()
  names = set(ffi.registered_targets())
  for family in ("capped_simplex", "magnitude", "permutahedron"):
    for dtype in ("float32", "float64"):
      assert f"implicit_topk_pav_{family}_{dtype}" in names


def test_no_host_callback_in_the_package():
  root = os.path.dirname(itk.__file__)
  for folder, _, files in os.walk(root):
    for name in files:
      if name.endswith(".py"):
        with open(os.path.join(folder, name)) as f:
          assert "pure_callback(" not in f.read(), name


_EXPORT = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp
    from jax import export
    import implicit_topk as itk
    op = {op}
    f = jax.jit(jax.value_and_grad(lambda x: jnp.sum(op(x) * jnp.cos(x))))
    x = jnp.linspace(-1.0, 2.0, 24).reshape(3, 8) ** 3
    blob = export.export(f, disabled_checks=itk.export_safety_checks())(x).serialize()
    open(sys.argv[1], "wb").write(blob)
    value, grad = f(x)
    open(sys.argv[1] + ".npy", "wb").write(bytes(memoryview(jax.device_get(grad))))
""")
_IMPORT = textwrap.dedent("""
    import sys
    import numpy as np
    import jax, jax.numpy as jnp
    from jax import export
    import implicit_topk
    exported = export.deserialize(bytearray(open(sys.argv[1], "rb").read()))
    implicit_topk.register_kernels(exported)  # the kernels it calls are built on first use
    assert "{target}" in exported.mlir_module(), "not the PAV kernel"
    x = jnp.linspace(-1.0, 2.0, 24).reshape(3, 8) ** 3
    expected = np.frombuffer(open(sys.argv[1] + ".npy", "rb").read(), np.float32).reshape(3, 8)
    value, grad = exported.call(x)
    np.testing.assert_array_equal(np.asarray(grad), expected)
    print("ok")
""")


@pytest.mark.parametrize("name", list(_OPS))
def test_export_serialize_and_call_in_a_fresh_process(name, tmp_path):
  path = str(tmp_path / f"{name}.jax")
  _run(_EXPORT.format(op=_OPS[name]), path)
  assert _run(_IMPORT.format(target=_TARGETS[name]), path) == "ok"


_SHARDED = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    import implicit_topk as itk
    # an Auto mesh: the permutahedron operators' flat gathers have no Explicit-mode rule
    mesh = jax.make_mesh((4,), ("d",), axis_types=(AxisType.Auto,))
    x = jax.random.normal(jax.random.PRNGKey(0), (8, 16))
    reference64 = {{}}
    with jax.enable_x64(True):
      for name, op in {ops}.items():
        reference64[name] = np.asarray(jax.grad(lambda z: jnp.sum(op(z) * jnp.sin(z)))(
            x.astype(jnp.float64)))
    for name, op in {ops}.items():
      f = jax.jit(jax.value_and_grad(lambda z: jnp.sum(op(z) * jnp.sin(z))))
      reference = f(x)
      xs = jax.device_put(x, NamedSharding(mesh, P("d", None)))
      hlo = f.lower(xs).compile().as_text()
      # (soft_rank's flat gathers around the kernel, pure JAX for either solver, are
      # partitioned by gathering the batch: checked under shard_map below)
      if name != "soft_rank":
        assert "all-gather" not in hlo, (name, "the batch-sharded input was gathered")
      assert "implicit_topk_pav_" in hlo, name
      value, grad = f(xs)
      if name != "soft_rank":
        assert grad.sharding.spec[0] == "d", (name, grad.sharding)
      np.testing.assert_allclose(value, reference[0], rtol=1e-6)
      # The same kernel; XLA may order the backward pass's row sums differently at 2 rows
      # a device than at 8 (the mask's gradient: 7e-7 apart, each within 6e-7 of float64)
      np.testing.assert_allclose(np.asarray(grad), np.asarray(reference[1]), rtol=1e-5,
                                 atol=1e-6)
      np.testing.assert_allclose(np.asarray(grad), reference64[name], rtol=1e-5, atol=2e-6)
      g = jax.jit(jax.shard_map(op, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
      # the same kernel on each shard's rows; the XLA ops around it may fuse differently
      np.testing.assert_allclose(np.asarray(g(xs)), np.asarray(jax.jit(op)(x)), rtol=1e-6,
                                 atol=1e-7)
      h = jax.jit(jax.shard_map(jax.grad(lambda z: jnp.sum(op(z) * jnp.sin(z))), mesh=mesh,
                                in_specs=P("d"), out_specs=P("d")))
      np.testing.assert_allclose(np.asarray(h(xs)), np.asarray(reference[1]), rtol=1e-5,
                                 atol=1e-6)
    print("ok")
""")


def test_a_batch_sharded_input_stays_sharded():
  ops = "{" + ", ".join(f"{k!r}: {v}" for k, v in _OPS.items()) + "}"
  assert _run(_SHARDED.format(ops=ops)) == "ok"


def test_bad_dtype_or_operands_are_an_error_not_a_crash():
  x = jnp.ones((2, 5), jnp.float32)
  k = jnp.full((2,), 2.0, jnp.float32)
  attributes = pav_calls._attributes("p2", 1.0, 1.0)
  # float64 data to the float32 target: the handler refuses it
  with pytest.raises(Exception, match="PAV threshold kernel"):
    ffi.call("implicit_topk_pav_capped_simplex_float32", (jax.ShapeDtypeStruct((2,), jnp.float32),),
             x.astype(jnp.float64), k, k, **attributes)
  # a missing attribute
  with pytest.raises(Exception, match="PAV threshold kernel"):
    ffi.call("implicit_topk_pav_magnitude_float32", (jax.ShapeDtypeStruct((2,), jnp.float32),),
             x, k, k, kind=np.int32(0))
  # a result of the wrong shape
  with pytest.raises(Exception, match="PAV permutahedron kernel"):
    ffi.call("implicit_topk_pav_permutahedron_float32",
             (jax.ShapeDtypeStruct((2, 4), jnp.float32), jax.ShapeDtypeStruct((2, 5), jnp.int32),
              jax.ShapeDtypeStruct((2, 5), jnp.int32), jax.ShapeDtypeStruct((2, 5), jnp.int32)),
             x, k, xsort=np.int32(1), wsort=np.int32(0), **attributes)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64, jnp.bfloat16])
def test_values_match_the_pure_jax_solvers(dtype):
  x = jnp.asarray(np.random.default_rng(3).normal(size=(2, 3, 40)), dtype)
  tol = {jnp.float32: 1e-5, jnp.float64: 1e-12, jnp.bfloat16: 1e-2}[dtype]
  for op, solver in ((itk.soft_topk_mask, "threshold"), (itk.soft_topk_mag, "threshold")):
    ours = op(x, 3.5, regularization_strength=0.3, solver="pav")
    assert ours.dtype == x.dtype
    want = op(x.astype(jnp.float64), 3.5, regularization_strength=0.3, solver=solver)
    np.testing.assert_allclose(np.asarray(ours, np.float64), want, atol=tol * 10, rtol=tol)
  ours = itk.soft_rank(x, regularization_strength=0.3, solver="pav")
  want = itk.soft_rank(x.astype(jnp.float64), regularization_strength=0.3, solver="pav_jax")
  assert ours.dtype == x.dtype
  np.testing.assert_allclose(np.asarray(ours, np.float64), want, atol=tol * 40, rtol=tol)
