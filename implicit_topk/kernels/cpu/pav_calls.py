"""The PAV kernels (:mod:`implicit_topk.kernels.cpu.pav_ffi`) called from JAX: one XLA
FFI custom call per family and dtype, compiled and registered on first use
(:mod:`implicit_topk.kernels.cpu.registry`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from implicit_topk.kernels.cpu import ffi, registry

_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def _kernel_dtype(dtype):
  """The dtype the kernel computes in: float32 or float64 (narrower floats: float32)."""
  return np.dtype(dtype) if np.dtype(dtype) in _DTYPES else np.dtype(np.float32)


def _attributes(kind: str, a: float, pm1: float) -> dict:
  from implicit_topk.kernels.cpu.isotonic_pav import KINDS
  return {"kind": np.int32(KINDS[kind]), "a": np.float64(a), "pm1": np.float64(pm1)}


def _threshold(family, select, x, k, l, p):
  dtype = x.dtype
  compute = _kernel_dtype(dtype)
  rows = x.shape[:-1]
  per_row = lambda v: jnp.broadcast_to(jnp.asarray(v, compute), rows)
  (lam,) = ffi.call(registry.target("pav_" + family, compute), (jax.ShapeDtypeStruct(rows, compute),),
                    x.astype(compute), per_row(k), per_row(l), **_attributes(*select(p)))
  return lam.astype(dtype)


def capped_simplex_threshold(x, k, l, p):
  """The mask's threshold per row of ``x`` (..., n) by PAV: shape ``x.shape[:-1]``,
  ``x``'s dtype; ``k`` and ``l`` broadcast to the rows; ``p`` a p-norm exponent or a
  link name (:func:`implicit_topk.kernels.cpu.pav_capped_simplex.capped_simplex_threshold`)."""
  from implicit_topk.kernels.cpu.isotonic_pav import _select
  return _threshold("capped_simplex", _select, x, k, l, p)


def magnitude_threshold(x, k, l, p):
  """The threshold of the top-k in magnitude per row of ``x`` (..., n) by PAV
  (:func:`implicit_topk.kernels.cpu.pav_magnitude.magnitude_threshold`)."""
  from implicit_topk.kernels.cpu.pav_magnitude import _mag_select
  return _threshold("magnitude", _mag_select, x, k, l, p)


def permutahedron_blocks(x, w, l, p, dtype):
  """The PAV blocks of the permutahedron LP along the last axis of (R, n) arrays ``x``,
  ``w`` (None: the ranks (n, ..., 1)) with ``l`` of shape (R,): ``(values, ids)``, then
  ``(x_order, x_inverse)`` if ``x`` is given, then ``w_order`` if ``w`` is given
  (:func:`implicit_topk.kernels.cpu.pav_permutahedron.permutahedron_blocks`)."""
  compute = _kernel_dtype(dtype)
  given = [a.astype(compute) for a in (x, w) if a is not None]
  shape = given[0].shape
  ints = jax.ShapeDtypeStruct(shape, jnp.int32)
  results = ((jax.ShapeDtypeStruct(shape, compute), ints) + (ints, ints) * (x is not None)
             + (ints,) * (w is not None))
  from implicit_topk.kernels.cpu.isotonic_pav import _select
  kind, a, pm1 = _select(p)
  out = ffi.call(registry.target("pav_permutahedron", compute), results, *given,
                 l.astype(compute), xsort=np.int32(x is not None),
                 wsort=np.int32(w is not None), **_attributes(kind, a, pm1))
  return (out[0].astype(dtype),) + tuple(out[1:])
