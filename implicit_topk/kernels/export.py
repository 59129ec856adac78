"""What ``jax.export`` must be told to serialize this package's kernels."""

from __future__ import annotations


def export_safety_checks() -> list:
  """What ``jax.export.export`` must be told to serialize calls of the compiled kernels:
  ``disabled_checks=implicit_topk.export_safety_checks()``.

  ``jax.export`` refuses custom calls that JAX itself does not promise to keep (its
  compatibility guarantees name only JAX's own). The CPU kernels are found by name in
  the process that runs the exported function, which builds and registers them with
  :func:`implicit_topk.register_kernels` (the exported function as its argument: only
  the kernels it calls); the same version of the package on both sides is the safe
  pairing.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import implicit_topk as itk
    >>> f = jax.jit(lambda x: itk.soft_topk_mask(x, 1.5))
    >>> x = jnp.array([[3.0, 1.0, 2.0]])
    >>> exported = jax.export.export(f, disabled_checks=itk.export_safety_checks())(x)
    >>> restored = jax.export.deserialize(exported.serialize())
    >>> itk.register_kernels(restored)  # in the process that runs it
    >>> restored.call(x)
    Array([[1. , 0. , 0.5]], dtype=float32)
  """
  from jax import export
  from implicit_topk.kernels.cpu import registry
  return [export.DisabledSafetyCheck.custom_call(name) for name in registry.all_targets()]
