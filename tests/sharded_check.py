"""Soft top-k along a reduced axis split over 8 host devices: jit with NamedSharding
(Auto and Explicit meshes), shard_map with ``axis_name=``, and pytrees whose leaves are
sharded differently. Forward and ``jax.grad`` against the unsharded computation, and the
compiled HLO: an all-reduce of per-row scalars, never an all-gather.

Run as a script (``tests/test_sharded_axis.py`` does, in a subprocess): host devices must
be configured before JAX starts. ``python tests/sharded_check.py [group ...]`` runs the
named groups (``fast``, ``jit``, ``jit_explicit``, ``shard_map``, ``errors``, ``tree``;
default: all but ``fast``, which is a subset); it prints one ``OK``/``FAIL`` line per check and exits 1 if
any failed.
"""

import functools
import os
import re
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import implicit_topk as itk  # noqa: E402
import device_checks  # noqa: E402
from device_checks import report  # noqa: E402

jax.config.update("jax_enable_x64", True)



# (rtol, atol) of a sharded result against the unsharded one. The sharded reduced axis
# runs the threshold iteration where the unsharded call runs the native kernel: both are
# exact to rounding, and the mask moves by up to its slope |dy/dlam| ~ 3/l times the
# threshold's last-ulp difference (a few float32 ulps of 1 at l = 0.1).
TOL = {"float32": (2e-5, 2e-6), "float64": (1e-10, 1e-12)}


def compare(name, got, want, rtol, atol):
  got, want = np.asarray(got), np.asarray(want)
  ok = got.shape == want.shape and np.allclose(got, want, rtol=rtol, atol=atol)
  report(ok, name, f"max |diff| {np.max(np.abs(got - want)):.2e}" if got.shape == want.shape
         else f"shape {got.shape} != {want.shape}")


def check_hlo(name, fn, *args):
  """all-reduce present; no all-gather, all-to-all or collective-permute of the data.
  Returns the compiled function (so that the check costs no second compilation)."""
  compiled = jax.jit(fn).lower(*args).compile()
  text = compiled.as_text()
  gathers = re.findall(r"all-gather[-a-z]*\(", text)
  others = re.findall(r"(?:all-to-all|collective-permute)[-a-z]*\(", text)
  reduces = len(re.findall(r"all-reduce[-a-z]*\(", text))
  report(reduces > 0 and not gathers and not others, name + " HLO",
         f"{reduces} all-reduce, {len(gathers)} all-gather, {len(others)} other collectives")
  return compiled


def operators(n, dense=False):
  k = 0.005 * n + 0.5  # 40.5 at n = 8192
  ops = {
      "mask": lambda z, **kw: itk.soft_topk_mask(z, k, regularization_strength=0.1, **kw),
      "mask_p2": lambda z, **kw: itk.soft_topk_mask(z, k, regularization_strength=0.1, p=2.0, **kw),
      "mag": lambda z, **kw: itk.soft_topk_mag(z, k, regularization_strength=0.1, **kw),
  }
  if dense:  # the other kernel kinds: p = 1.5 (general rule), the dense regularizers
    ops["mask_p1.5"] = lambda z, **kw: itk.soft_topk_mask(z, k, regularization_strength=0.1, p=1.5, **kw)
    ops["mag_p3"] = lambda z, **kw: itk.soft_topk_mag(z, k, regularization_strength=0.1, p=3.0, **kw)
    for reg in ("entropy", "sigmoid", "laplace"):
      ops[f"mask_{reg}"] = (lambda z, reg=reg, **kw: itk.soft_topk_mask(
          z, k, regularization_strength=0.1, regularizer=reg, **kw))
  return ops


def loss_of(op, weights):
  return lambda z: jnp.sum(op(z) * weights)


def group_jit(mesh, shapes=((4, 8192), (4, 64)), dtypes=(jnp.float32, jnp.float64),
              label="auto", names=None, grad=True, jvp=False, dense=False, options=None):
  """jax.jit on an input placed with NamedSharding(mesh, P(None, "d")), default solver.

  On an Explicit mesh the default solver sees the sharding in the input's type and
  reduces across devices by itself. On an Auto mesh nothing at trace time says the
  reduced axis is split: the default (on CPU the native kernel, which needs whole rows)
  is custom-partitioned (``implicit_topk.kernels.cpu.partitioning``), so that XLA runs
  the threshold iteration with psum on each device's block instead of gathering it.
  """
  sharding = NamedSharding(mesh, P(None, "d"))
  options = options or {}
  for shape in shapes:
    for dtype in dtypes:
      tol = TOL[jnp.dtype(dtype).name]
      x0 = jax.random.normal(jax.random.PRNGKey(0), shape, dtype)
      w0 = jnp.cos(3 * x0)
      x = jax.device_put(x0, sharding)
      w = jax.device_put(w0, sharding)
      for name, op in operators(shape[-1], dense=dense).items():
        if names and name not in names:
          continue
        op = functools.partial(op, **options)
        tag = f"jit[{label}] {name} {shape} {jnp.dtype(dtype).name}"
        loss_grad = jax.grad(lambda z, w_, op=op: jnp.sum(op(z) * w_))
        with jax.set_mesh(mesh):
          out = check_hlo(tag + " fwd", op, x)(x)
          if grad:
            compare(tag + " grad", check_hlo(tag + " grad", loss_grad, x, w)(x, w),
                    jax.grad(loss_of(op, w0))(x0), *tol)
          if jvp:  # forward mode: the tangent kernel's sharded form
            jvp_fn = lambda z, t, op=op: jax.jvp(op, (z,), (t,))[1]
            compare(tag + " jvp", check_hlo(tag + " jvp", jvp_fn, x, w)(x, w),
                    jax.jvp(op, (x0,), (w0,))[1], *tol)
        compare(tag + " fwd", out, op(x0), *tol)
        report(out.sharding.spec == P(None, "d") or label.startswith("auto") and
               out.sharding.is_equivalent_to(sharding, 2), tag + " output sharding",
               str(out.sharding.spec))


def group_shard_map(mesh, shapes=((4, 8192), (4, 64)), names=None, full=True):
  """shard_map over the reduced axis with axis_name="d"."""
  spec = P(None, "d")
  for shape in shapes:
    x0 = jax.random.normal(jax.random.PRNGKey(1), shape, jnp.float64)
    w0 = jnp.cos(3 * x0)
    x = jax.device_put(x0, NamedSharding(mesh, spec))
    for name, op in operators(shape[-1]).items():
      if names and name not in names:
        continue
      tag = f"shard_map {name} {shape}"
      local = lambda z, op=op: op(z, axis_name="d")
      mapped = jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=spec)
      loss = lambda z, mapped=mapped: jnp.sum(mapped(z) * w0)
      with jax.set_mesh(mesh):
        out = check_hlo(tag + " fwd", mapped, x)(x)
      compare(tag + " fwd", out, op(x0), 1e-10, 1e-12)
      if not full:
        continue
      with jax.set_mesh(mesh):
        grad = check_hlo(tag + " grad", jax.grad(loss), x)(x)
      compare(tag + " grad", grad, jax.grad(loss_of(op, w0))(x0), 1e-10, 1e-12)
      if name == "mask":
        # forward mode through the psum'd Newton iteration
        tangent = jnp.sin(x0)
        with jax.set_mesh(mesh):
          _, jvp = jax.jit(lambda z, t: jax.jvp(mapped, (z,), (t,)))(x, tangent)
        _, want = jax.jvp(op, (x0,), (tangent,))
        compare(tag + " jvp", jvp, want, 1e-10, 1e-12)
        # a row split over devices with `where` and per-row k
        valid = jnp.arange(shape[-1]) < shape[-1] // 3
        where = jnp.broadcast_to(valid, shape)
        masked = jax.shard_map(
            lambda z, wh: itk.soft_topk_mask(z, 2.5, regularization_strength=0.1, where=wh, axis_name="d"),
            mesh=mesh, in_specs=(spec, spec), out_specs=spec)
        with jax.set_mesh(mesh):
          got = jax.jit(masked)(x, where)
        compare(tag + " where", got, itk.soft_topk_mask(x0, 2.5, regularization_strength=0.1, where=where),
                1e-10, 1e-12)


def collectives(text):
  """{kind: count} of the data-moving collectives in a compiled HLO text."""
  return {kind: len(re.findall(kind + r"[-a-z]*\(", text))
          for kind in ("all-gather", "all-to-all", "collective-permute", "all-reduce")}


def group_partitioning(mesh):
  """The native kernel's custom partitioning (implicit_topk.kernels.cpu.partitioning):
  a batch-sharded input runs the kernel on each device's rows (no collective at all);
  a 2-D mesh splitting the batch and the reduced axis runs the psum form over the
  reduced axis only; and the HLO check sees the gather of the unpartitioned kernel."""
  from implicit_topk.kernels.cpu import ffi
  n = 512
  ops = operators(n)
  x0 = jax.random.normal(jax.random.PRNGKey(3), (8, n), jnp.float32)
  w0 = jnp.cos(3 * x0)
  batch = NamedSharding(mesh, P("d", None))
  x, w = jax.device_put(x0, batch), jax.device_put(w0, batch)
  native = functools.partial(ops["mask"], solver="native")
  for name, op, kernel, grad_kernel in (
      ("mask", ops["mask"], "implicit_topk_capped_simplex_", "implicit_topk_capped_simplex_"),
      ("mag", ops["mag"], "implicit_topk_magnitude_", "implicit_topk_magnitude_"),
      ("mask native", native, "implicit_topk_capped_simplex_",
       "implicit_topk_capped_simplex_cotangent_")):
    loss_grad = jax.grad(lambda z, w_, op=op: jnp.sum(op(z) * w_))
    for what, fn, args in (("fwd", op, (x,)), ("grad", loss_grad, (x, w))):
      kernel = grad_kernel if what == "grad" else kernel
      tag = f"batch-sharded {name} {what}"
      with jax.set_mesh(mesh):
        compiled = jax.jit(fn).lower(*args).compile()
        got = compiled(*args)
      found = collectives(compiled.as_text())
      moved = {k: c for k, c in found.items() if c and k != "all-reduce"}
      report(not moved and kernel in compiled.as_text(), tag + " HLO",
             f"{found}; the kernel {'runs' if kernel in compiled.as_text() else 'is missing'}")
      want = op(x0) if what == "fwd" else jax.grad(loss_of(op, w0))(x0)
      compare(tag, got, want, *TOL["float32"])
  # batch over "b", reduced axis over "e"
  mesh2 = jax.make_mesh((2, 4), ("b", "e"), axis_types=(AxisType.Auto,) * 2)
  both = NamedSharding(mesh2, P("b", "e"))
  x, w = jax.device_put(x0, both), jax.device_put(w0, both)
  for name in ("mask", "mag"):
    op = ops[name]
    loss_grad = jax.grad(lambda z, w_, op=op: jnp.sum(op(z) * w_))
    with jax.set_mesh(mesh2):
      out = check_hlo(f"2-D mesh {name} fwd", op, x)(x)
      grad = check_hlo(f"2-D mesh {name} grad", loss_grad, x, w)(x, w)
    compare(f"2-D mesh {name} fwd", out, op(x0), *TOL["float32"])
    compare(f"2-D mesh {name} grad", grad, jax.grad(loss_of(op, w0))(x0), *TOL["float32"])
    report(out.sharding.is_equivalent_to(both, 2), f"2-D mesh {name} output sharding",
           str(out.sharding.spec))
  # The check can fail: the kernel without its custom partitioning (the behaviour
  # before) gathers the reduced axis, and check_hlo's pattern sees it.
  x = jax.device_put(jax.random.normal(jax.random.PRNGKey(0), (4, 8192), jnp.float32),
                     NamedSharding(mesh, P(None, "d")))
  kept = ffi._partitions
  ffi._partitions = lambda ctx, target: False
  try:
    with jax.set_mesh(mesh):
      text = jax.jit(operators(8192)["mask"]).lower(x).compile().as_text()
  finally:
    ffi._partitions = kept
  found = collectives(text)
  report(found["all-gather"] > 0, "unpartitioned kernel: the HLO check sees its gather",
         str(found))


def group_errors(mesh):
  spec = P(None, "d")
  x = jax.device_put(jnp.ones((4, 64)), NamedSharding(mesh, spec))
  cases = {
      "axis_name not in the mesh": (lambda z: itk.soft_topk_mask(z, 2.0, axis_name="e", regularization_strength=0.1),
                                    "`axis_name`='e' is not a mesh axis"),
      "axis_name with solver='pav'": (
          lambda z: itk.soft_topk_mask(z, 2.0, axis_name="d", solver="pav", regularization_strength=0.1),
          "solver='pav' sorts whole rows"),
  }
  for name, (fn, match) in cases.items():
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec)
    try:
      with jax.set_mesh(mesh):
        jax.jit(mapped)(x)
      report(False, f"error {name}", "no error")
    except ValueError as e:
      report(match in str(e), f"error {name}", str(e)[:160])
  try:
    itk.soft_topk_mask(jnp.ones((4, 64)), 2.0, axis_name="d", regularization_strength=0.1)
    report(False, "error axis_name outside shard_map", "no error")
  except ValueError as e:
    report("no mesh axis is bound" in str(e), "error axis_name outside shard_map", str(e)[:160])
  # a replicated input (not split over "d") is refused: its sums would count 8 times
  mapped = jax.shard_map(lambda z: itk.soft_topk_mask(z, 2.0, axis_name="d", regularization_strength=0.1), mesh=mesh,
                         in_specs=P(), out_specs=P())
  try:
    with jax.set_mesh(mesh):
      jax.jit(mapped)(jnp.ones((4, 64)))
    report(False, "error replicated input", "no error")
  except ValueError as e:
    report("does not vary over that mesh axis" in str(e), "error replicated input", str(e)[:160])


def group_tree(mesh):
  """One threshold over a pytree whose leaves are sharded differently."""
  mesh2 = jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Auto,) * 2)
  keys = jax.random.split(jax.random.PRNGKey(2), 3)
  tree0 = {"w1": jax.random.normal(keys[0], (64, 32)),
           "w2": jax.random.normal(keys[1], (32, 16)) * 0.5,
           "b": jax.random.normal(keys[2], (16,))}
  shardings = {"w1": NamedSharding(mesh2, P("a", "b")), "w2": NamedSharding(mesh2, P("b")),
               "b": NamedSharding(mesh2, P())}
  tree = jax.device_put(tree0, shardings)
  flat0 = jnp.concatenate([leaf.ravel() for leaf in jax.tree.leaves(tree0)])
  n = flat0.size
  for name, tree_op, op in (
      ("tree_mask", lambda t: itk.tree_soft_topk_mask(t, 0.1 * n + 0.5, regularization_strength=0.1),
       lambda v: itk.soft_topk_mask(v, 0.1 * n + 0.5, regularization_strength=0.1)),
      ("tree_mag", lambda t: itk.tree_soft_topk_mag(t, 0.1 * n + 0.5, regularization_strength=0.1),
       lambda v: itk.soft_topk_mag(v, 0.1 * n + 0.5, regularization_strength=0.1))):
    with jax.set_mesh(mesh2):
      out = jax.jit(tree_op)(tree)
      grad = jax.jit(jax.grad(lambda t: sum(jnp.sum(jnp.cos(v) * y) for v, y in zip(
          jax.tree.leaves(t), jax.tree.leaves(tree_op(t))))))(tree)
    flat_out = jnp.concatenate([leaf.ravel() for leaf in jax.tree.leaves(out)])
    compare(f"{name} sharded fwd", flat_out, op(flat0), 1e-10, 1e-12)
    want = jax.grad(lambda v: jnp.sum(jnp.cos(v) * op(v)))(flat0)
    flat_grad = jnp.concatenate([leaf.ravel() for leaf in jax.tree.leaves(grad)])
    compare(f"{name} sharded grad", flat_grad, want, 1e-10, 1e-12)
    report(all(o.sharding.is_equivalent_to(shardings[key], o.ndim) for key, o in out.items()),
           f"{name} leaves keep their shardings",
           str({key: str(o.sharding.spec) for key, o in out.items()}))
    with jax.set_mesh(mesh2):
      check_hlo(f"{name} sharded", tree_op, tree)


def main(groups):
  mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))
  explicit = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))
  runs = {
      # the default test run: the case under jit, shard_map on a small row, errors
      "fast": lambda: (group_jit(mesh, shapes=((4, 8192),), dtypes=(jnp.float32,),
                                 names=("mask", "mag"), jvp=True),
                       group_jit(mesh, shapes=((4, 64),), dtypes=(jnp.float64,),
                                 names=("mask", "mag", "mask_sigmoid"), dense=True),
                       # solver="native": the derivative kernels' sharded forms too
                       group_jit(mesh, shapes=((4, 8192),), dtypes=(jnp.float32,), names=("mask",),
                                 jvp=True, label="auto native", options=dict(solver="native")),
                       group_jit(mesh, shapes=((4, 64),), dtypes=(jnp.float64,),
                                 names=("mask_p2", "mask_p1.5"), jvp=True,
                                 dense=True, label="auto native", options=dict(solver="native")),
                       group_partitioning(mesh),
                       group_shard_map(mesh, shapes=((4, 64),), names=("mask",), full=False),
                       group_errors(mesh)),
      # every operator in both dtypes and at both shapes: the long rows (1024 entries per
      # device) in float32, the short ones (8 per device) in float64; one group each (two
      # subprocesses side by side on two test workers). "jit_threshold" runs the long
      # rows in both dtypes, "fast" the operators at both.
      "jit_float32": lambda: group_jit(mesh, shapes=((4, 8192),), dtypes=(jnp.float32,),
                                       jvp=True, dense=True),
      "jit_float64": lambda: group_jit(mesh, shapes=((4, 64),), dtypes=(jnp.float64,),
                                       jvp=True, dense=True),
      "jit_native": lambda: group_jit(mesh, jvp=True, dense=True, label="auto native",
                                      options=dict(solver="native")),
      "jit_threshold": lambda: group_jit(mesh, shapes=((4, 8192),), label="auto threshold",
                                         options=dict(solver="threshold")),
      "jit_explicit": lambda: group_jit(explicit, shapes=((4, 8192),), dtypes=(jnp.float32,),
                                        label="explicit"),
      "shard_map": lambda: group_shard_map(mesh),
      "errors": lambda: group_errors(mesh),
      "tree": lambda: group_tree(mesh),
  }
  return device_checks.run_named_groups(runs, groups or [name for name in runs if name != "fast"])


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
