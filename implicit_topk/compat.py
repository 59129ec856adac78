"""Drop-in names and signatures of ``sparse_soft_topk``, the reference implementation of
Sander et al., "Fast, differentiable and sparse top-k: a convex analysis perspective"
(ICML 2023).

Code written for that package runs by changing its import to
``from implicit_topk import compat as sparse_soft_topk``; the strength keeps its name
``l`` (default 0.1) there, as in the original. Differences: results are exact (the
original's float32 PAV returns values such as 0.99999714 for an exact 1), any leading
batch shape works, and integer inputs are cast to float32 as the original implicitly
did.
"""

from __future__ import annotations

import jax.numpy as jnp

from implicit_topk import hard as _hard
from implicit_topk import magnitude as _magnitude
from implicit_topk import ops as _ops


def _as_float(x):
  x = jnp.asarray(x)
  return x if jnp.issubdtype(x.dtype, jnp.floating) else x.astype(jnp.float32)


def sparse_soft_topk_mask_pav(x, k, l=1e-1, p=4 / 3, bisect_max_iter=50):
  """Soft top-k mask along the last axis by exact PAV.

  ``bisect_max_iter`` is accepted for compatibility and unused: block values are
  solved to machine precision.
  """
  if not (isinstance(bisect_max_iter, int) and bisect_max_iter > 0):
    raise ValueError(f"`bisect_max_iter` must be a positive int; got {bisect_max_iter!r}.")
  return _ops.soft_topk_mask(_as_float(x), k, regularization_strength=l, p=p, solver="pav")


def sparse_soft_topk_mask_dykstra(x, k, l=1e-1, num_iter=500):
  """Soft top-k mask (p = 2) along the last axis by Dykstra's algorithm.

  As in the original, ``num_iter`` counts single projections, so ``num_iter // 2``
  sweeps run, with no early stop (``tol=0``). Unlike the original, any leading batch
  shape works without ``vmap``, and the output is the threshold map at Dykstra's
  threshold, so it is exactly 0 and 1 where the original returns values such as 0.99999905.
  """
  if not (isinstance(num_iter, int) and num_iter >= 2):
    raise ValueError(f"`num_iter` must be an int >= 2; got {num_iter!r}.")
  return _ops.soft_topk_mask(_as_float(x), k, regularization_strength=l, p=2.0, solver="dykstra", tol=0.0,
                             maxiter=num_iter // 2)


def sparse_soft_topk_mag_pav(x, k, l=1e-1, p=4 / 3, bisect_max_iter=50):
  """Soft top-k in magnitude along the last axis by exact PAV.

  The original's semantics (its isotonic dual and output scaling, see
  :func:`implicit_topk.soft_topk_mag`); kept entries come out as exactly ``x_i``
  where the original returns values such as -5.000036. ``bisect_max_iter`` is accepted and unused.
  """
  if not (isinstance(bisect_max_iter, int) and bisect_max_iter > 0):
    raise ValueError(f"`bisect_max_iter` must be a positive int; got {bisect_max_iter!r}.")
  return _magnitude.soft_topk_mag(_as_float(x), k, regularization_strength=l, p=p, solver="pav")


def sparse_soft_topk_mag_dykstra(x, k, l=1e-1, num_iter=500):
  """Soft top-k in magnitude (p = 2) along the last axis by Dykstra's algorithm.

  As :func:`sparse_soft_topk_mask_dykstra`: ``num_iter // 2`` sweeps, no early stop,
  any leading batch shape, and the output is the exact map at Dykstra's threshold.
  """
  if not (isinstance(num_iter, int) and num_iter >= 2):
    raise ValueError(f"`num_iter` must be an int >= 2; got {num_iter!r}.")
  return _magnitude.soft_topk_mag(_as_float(x), k, regularization_strength=l, p=2.0, solver="dykstra", tol=0.0,
                                  maxiter=num_iter // 2)


def hard_topk_mask(x, k):
  """Hard top-k mask along the last axis."""
  return _hard.hard_topk_mask(_as_float(x), k)


def hard_topk_mag(x, k):
  """Hard top-k in magnitude along the last axis."""
  return _hard.hard_topk_mag(_as_float(x), k)
