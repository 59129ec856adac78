"""Soft top-k along a reduced axis split over host devices: communication and time.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/bench_sharded.py

For x of shape (rows, n) placed with NamedSharding(mesh, P(None, "d")) on 8 host devices,
compiles under jax.jit and reports, per method, the collectives in the compiled HLO (count
and the largest payload in bytes) and the median wall time of a call:

* soft_topk_mask / soft_topk_mag with the default solver: on CPU the native kernel, whose
  calls are custom-partitioned (``implicit_topk.kernels.cpu.partitioning``): with the
  reduced axis split, each device runs the sort-free threshold Newton on its block, one
  all-reduce of per-row scalars per iteration, and no entry of x moves (before, XLA
  all-gathered the axis for the kernel); their gradients the same way;
* the same with ``solver="threshold"`` (pure JAX, psum'd reductions);
* the same under shard_map with axis_name="d";
* a sort-based alternative: jnp.sort along the sharded axis (what a sort-based soft
  top-k, or a threshold from a sorted sample, needs first), and lax.top_k + scatter
  (the hard mask).

Host devices share this machine's cores, so the times say nothing about a speed-up on
real devices; the collective counts and payloads are what carry over.
"""

import os
import re
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import implicit_topk as itk  # noqa: E402

_BYTES = {"f32": 4, "f64": 8, "s32": 4, "pred": 1, "u32": 4, "s64": 8}


def collectives(text):
  """{kind: (count, largest payload in bytes)} of the compiled HLO's collectives."""
  found = {}
  for kind in ("all-reduce", "all-gather", "all-to-all", "collective-permute"):
    sizes = []
    for match in re.finditer(rf"= \(?([a-z0-9]+)\[([0-9,]*)\][^=]*? {kind}(?:-start)?\(", text):
      dtype, dims = match.groups()
      count = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
      sizes.append(count * _BYTES.get(dtype, 4))
    if sizes:
      found[kind] = (len(sizes), max(sizes))
  return found


def timed(fn, x, repeats=7):
  jax.block_until_ready(fn(x))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(x))
    times.append(time.perf_counter() - start)
  return 1e3 * float(np.median(times))


def main(shapes=((4, 8192), (4, 1 << 17))):
  mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))
  spec = P(None, "d")
  print(f"devices: {len(jax.devices())} x {jax.devices()[0].platform}, jax {jax.__version__}")
  print("| shape | method | ms / call | collectives in the compiled program (count, largest payload) |")
  print("|---|---|---|---|")
  for shape in shapes:
    n = shape[-1]
    k = 0.005 * n + 0.5
    x0 = jax.random.normal(jax.random.PRNGKey(0), shape, jnp.float32)
    x = jax.device_put(x0, NamedSharding(mesh, spec))

    def hard(z):
      _, idx = jax.lax.top_k(z, int(k))
      return jnp.zeros_like(z).at[jnp.arange(z.shape[0])[:, None], idx].set(1.0)

    methods = {
        "soft_topk_mask (jit, sharded)": lambda z: itk.soft_topk_mask(z, k, regularization_strength=0.1),
        "soft_topk_mag (jit, sharded)": lambda z: itk.soft_topk_mag(z, k, regularization_strength=0.1),
        "grad of sum(w * soft_topk_mask) (jit, sharded)": jax.grad(
            lambda z: jnp.sum(jnp.cos(z) * itk.soft_topk_mask(z, k, regularization_strength=0.1))),
        "grad of sum(w * soft_topk_mag) (jit, sharded)": jax.grad(
            lambda z: jnp.sum(jnp.cos(z) * itk.soft_topk_mag(z, k, regularization_strength=0.1))),
        "soft_topk_mask solver='threshold' (jit, sharded)": lambda z: itk.soft_topk_mask(
            z, k, regularization_strength=0.1, solver="threshold"),
        "soft_topk_mask (shard_map, axis_name)": jax.shard_map(
            lambda z: itk.soft_topk_mask(z, k, regularization_strength=0.1, axis_name="d"), mesh=mesh,
            in_specs=spec, out_specs=spec),
        "jnp.sort (jit, sharded)": lambda z: jnp.sort(z, axis=-1),
        "lax.top_k + scatter (jit, sharded)": hard,
    }
    for name, fn in methods.items():
      with jax.set_mesh(mesh):
        compiled = jax.jit(fn).lower(x).compile()
        found = collectives(compiled.as_text())
        ms = timed(compiled, x)
      text = ", ".join(f"{kind} x{c} (max {b} B)" for kind, (c, b) in found.items()) or "none"
      print(f"| {shape} | {name} | {ms:.2f} | {text} |", flush=True)
    one = jax.jit(lambda z: itk.soft_topk_mask(z, k, regularization_strength=0.1, return_info=True))
    _, info = one(x0)
    ms = timed(jax.jit(lambda z: itk.soft_topk_mask(z, k, regularization_strength=0.1)), x0)
    print(f"| {shape} | soft_topk_mask (one device) | {ms:.2f} | none; Newton passes per row: "
          f"{np.asarray(info.iter_num).tolist()} |", flush=True)


if __name__ == "__main__":
  main(*(() if len(sys.argv) < 2 else ([tuple(map(int, s.split("x"))) for s in sys.argv[1:]],)))
