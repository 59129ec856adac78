"""The native mask and magnitude kernels called from JAX: one XLA FFI custom call per
family and dtype (:mod:`implicit_topk.kernels.cpu.ffi`), each built on first use
(:mod:`implicit_topk.kernels.cpu.registry`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from implicit_topk import regularizers
from implicit_topk.kernels.cpu import ffi, registry
from implicit_topk.kernels.cpu.kinds import KINDS, PNORM


def kernel_attributes(regularizer) -> dict:
  """The mask kernel's attributes for ``regularizer`` (``ValueError`` if it has none):
  the regularizer ``kind`` (int32) and the p-norm exponent ``a`` (float64)."""
  family, value = regularizers.native_kernel_spec(regularizer)
  kind, a = (PNORM, value) if family == "pnorm" else (KINDS[value], 0.0)
  return {"a": np.float64(a), "kind": np.int32(kind)}


def derivative_rule(kind: int, a: float) -> str:
  """The entry rule of the derivative kernels for the regularizer ``(kind, a)``: the
  p-norms with p = 4/3 (``"cubic"``) and p = 2 (``"linear"``) have vectorized loops of
  their own, every other regularizer the ``"general"`` one; each rule is its own
  target, so a call builds only the one it needs."""
  if kind == PNORM and a == 3.0:
    return "cubic"
  return "linear" if kind == PNORM and a == 1.0 else "general"


def _row_kernel(family: str, x, k, l, results, attributes):
  """The kernel ``family`` on ``x`` of shape ``(..., n)`` with ``k`` and ``l``
  broadcast to ``x.shape[:-1]`` (cast to x's dtype); ``results`` names each result's
  kind in order: ``"full"`` (x's shape), ``"row"`` (one per row) or ``"passes"``
  (int32, one per row)."""
  rows, dtype = x.shape[:-1], x.dtype
  shapes = {"full": jax.ShapeDtypeStruct(x.shape, dtype), "row": jax.ShapeDtypeStruct(rows, dtype),
            "passes": jax.ShapeDtypeStruct(rows, jnp.int32)}
  return ffi.call(
      registry.target(family, dtype), tuple(shapes[r] for r in results),
      x, jnp.broadcast_to(k, rows).astype(dtype), jnp.broadcast_to(l, rows).astype(dtype),
      **attributes)


def capped_simplex_kernel(x, k, l, attributes):
  """The mask kernel (:mod:`implicit_topk.kernels.cpu.native_threshold`) on ``x`` of
  shape ``(..., n)``: ``(mask, lam, passes, residual, shift)`` (``lam + shift`` is the
  threshold of ``x``); ``k`` and ``l`` broadcast to ``x.shape[:-1]``."""
  return _row_kernel("capped_simplex", x, k, l, ("full", "row", "passes", "row", "row"),
                     attributes)


def magnitude_kernel(x, k, l, p: float):
  """The magnitude kernel (:mod:`implicit_topk.kernels.cpu.native_magnitude`) on ``x``
  of shape ``(..., n)`` with the p-norm exponent ``p``: ``(lam, passes, residual)``, one
  per row; ``k`` and ``l`` broadcast to ``x.shape[:-1]``."""
  return _row_kernel("magnitude", x, k, l, ("row", "passes", "row"),
                     {"a": np.float64(regularizers.PNorm(p).exponent)})


def derivative_call(family: str, rule: str, primals, tangents, reference, outputs: int,
                    attributes):
  """The derivative kernels ``<family>_tangent_<rule>`` (on ``(*primals, *tangents)``:
  the tangent of the mask, x's shape, and of ``outputs - 1`` per-row values) and
  ``<family>_cotangent_<rule>`` (its transpose: the cotangents of ``x``, ``k``, ``l``) as
  one linear map (:func:`implicit_topk.kernels.cpu.ffi.linear_call`); ``reference`` is
  the same map in JAX, for higher orders. ``primals[0]`` is ``x``."""
  x = primals[0]
  full = jax.ShapeDtypeStruct(x.shape, x.dtype)
  rows = jax.ShapeDtypeStruct(x.shape[:-1], x.dtype)
  return ffi.linear_call(registry.target(f"{family}_tangent_{rule}", x.dtype),
                         registry.target(f"{family}_cotangent_{rule}", x.dtype),
                         (full,) + (rows,) * (outputs - 1), (full, rows, rows), primals,
                         tangents, reference, **attributes)
