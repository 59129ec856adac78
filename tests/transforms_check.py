"""Every public operator under ``shard_map`` (default ``check_vma=True``) and
``jax.export`` (serialized, deserialized, called), forward and ``jax.grad``.

Run as a script (``tests/test_edges_and_transforms.py`` does, in a subprocess): host
devices must be configured before JAX starts. ``python tests/transforms_check.py
[name ...]`` checks the named operators only, ``-name`` every operator but that one; it
prints one line per check and exits 1 if any failed.
"""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import export  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import implicit_topk as itk  # noqa: E402

TARGET = jnp.array([1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0])


def _labels(z):
  return jnp.zeros(z.shape[:-1], jnp.int32)


def _per_row(loss, z):
  """A per-row loss spread over the row, so every check has x's shape and sharding."""
  return loss[..., None] * jnp.ones_like(z)


# name -> f(z) with z of shape (rows, 7), reduced along the last axis, default options.
OPERATORS = {
    "soft_topk_mask": lambda z: itk.soft_topk_mask(z, 2.5, regularization_strength=0.1),
    "soft_topk_mask_p2": lambda z: itk.soft_topk_mask(z, 2.5, regularization_strength=0.3, p=2.0),
    "soft_topk_mask_entropy": lambda z: itk.soft_topk_mask(z, 2.5, regularization_strength=0.3, regularizer="entropy"),
    "soft_topk_mag": lambda z: itk.soft_topk_mag(z, 2.5, regularization_strength=0.1),
    "hard_topk_mask": lambda z: itk.hard_topk_mask(z, 2),
    "hard_topk_mag": lambda z: itk.hard_topk_mag(z, 2),
    "grad_topk": lambda z: itk.grad_topk(z, 2),
    "iterative_softmax_topk": lambda z: itk.iterative_softmax_topk(z, 2),
    "sparse_softmax": lambda z: itk.sparse_softmax(z, 3),
    "soft_sort": lambda z: itk.soft_sort(z),
    "soft_rank": lambda z: itk.soft_rank(z),
    "soft_quantile": lambda z: itk.soft_quantile(z, 0.5)[..., None] * jnp.ones_like(z),
    "soft_topk_values": lambda z: jnp.sum(itk.soft_topk_values(z, 2), -1, keepdims=True) * jnp.ones_like(z),
    "permutahedron_argmax": lambda z: itk.permutahedron_argmax(z, jnp.broadcast_to(jnp.arange(7.0), z.shape)),
    "topk_fenchel_young_loss": lambda z: _per_row(itk.topk_fenchel_young_loss(
        z, jnp.broadcast_to(TARGET, z.shape), k=2, reduction="none"), z),
    "topk_cross_entropy": lambda z: _per_row(itk.topk_cross_entropy(
        z, _labels(z), p_k=(0.5, 0.5), reduction="none"), z),
    "smooth_topk_svm_loss": lambda z: _per_row(itk.smooth_topk_svm_loss(
        z, _labels(z), k=2, reduction="none"), z),
    "soft_error_loss": lambda z: _per_row(itk.soft_error_loss(z, _labels(z), reduction="none"), z),
}


def _with_grad(f):
  return jax.grad(lambda z: jnp.sum(f(z) * jnp.cos(3 * z)))


def main(names):
  mesh = jax.make_mesh((2,), ("d",))
  x0 = jax.random.normal(jax.random.PRNGKey(0), (4, 7), jnp.float32)
  x = jax.device_put(x0, NamedSharding(mesh, P("d")))
  failed = []
  for name in names:
    for kind, f in (("fwd", OPERATORS[name]), ("grad", _with_grad(OPERATORS[name]))):
      reference = np.asarray(f(x0))
      checks = {}
      try:
        sharded = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
        with jax.set_mesh(mesh):
          checks["shard_map"] = np.asarray(sharded(x))
      except Exception as e:  # pylint: disable=broad-except
        checks["shard_map"] = e
      try:
        exported = export.deserialize(export.export(
            jax.jit(f), disabled_checks=itk.export_safety_checks())(x0).serialize())
        checks["export"] = np.asarray(exported.call(x0))
      except Exception as e:  # pylint: disable=broad-except
        checks["export"] = e
      for check, result in checks.items():
        if isinstance(result, Exception):
          ok, detail = False, f"{type(result).__name__}: {str(result).splitlines()[0][:200]}"
        else:
          ok = np.allclose(result, reference, rtol=1e-5, atol=1e-6, equal_nan=True)
          detail = f"max |diff| {np.max(np.abs(result - reference)):.2e}"
        print(f"{'OK  ' if ok else 'FAIL'} {name} {kind} {check}: {detail}", flush=True)
        if not ok:
          failed.append((name, kind, check))
  print("FAILED", failed if failed else "none")
  return 1 if failed else 0


def _selected(args):
  """The named operators, or every operator but those named with a leading '-'."""
  named = [a for a in args if not a.startswith("-")]
  skipped = {a[1:] for a in args if a.startswith("-")}
  unknown = (set(named) | skipped) - set(OPERATORS)
  if unknown:
    raise SystemExit(f"unknown operators: {sorted(unknown)}")
  return named or [name for name in OPERATORS if name not in skipped]


if __name__ == "__main__":
  sys.exit(main(_selected(sys.argv[1:])))
