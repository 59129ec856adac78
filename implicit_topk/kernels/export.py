"""What ``jax.export`` must be told to serialize this package's kernels."""

from __future__ import annotations


def export_safety_checks() -> list:
  """What ``jax.export.export`` must be told to serialize calls of the compiled kernels:
  ``disabled_checks=implicit_topk.export_safety_checks()``.

  ``jax.export`` refuses custom calls that JAX itself does not promise to keep (its
  compatibility guarantees name only JAX's own). The list names every CPU kernel's
  target and the GPU kernel's: the Triton custom call of Pallas
  (``jax.experimental.pallas.triton.CUSTOM_CALL_TARGET_NAME`` where this jax has it,
  ``"__gpu$xla.gpu.triton"``), which the default's CUDA and ROCm lowering holds (the
  fused kernel of ``solver="pallas"``); so the default exported for
  ``platforms=("cpu", "cuda")`` on a CPU-only host serializes. The Triton kernel is
  embedded in the module (compiled by the XLA that runs it: the same jax and jaxlib
  on both sides is the safe pairing). The CPU kernels are found by name in
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
  names = list(registry.all_targets()) + list(gpu_targets())
  return [export.DisabledSafetyCheck.custom_call(name) for name in dict.fromkeys(names)]


def gpu_targets() -> tuple:
  """The custom call targets of the GPU kernels: Pallas' Triton call (and Mosaic GPU's,
  where this jax names it; the kernels do not use it, naming it costs nothing)."""
  names = []
  try:
    from jax.experimental.pallas import triton as pltriton  # pylint: disable=g-import-not-at-top
    names.append(getattr(pltriton, "CUSTOM_CALL_TARGET_NAME", None))
  except ImportError:  # pragma: no cover (every supported jax ships Pallas)
    pass
  from implicit_topk.kernels.gpu import pallas_threshold  # pylint: disable=g-import-not-at-top
  names.append(pallas_threshold.TRITON_TARGET)
  return tuple(dict.fromkeys(name for name in names if name))
