"""Drop-in names and signatures of the seed reference (``sparse_soft_topk``).

Code written for the reference runs by changing its import to
``from implicit_topk import compat as sparse_soft_topk``. Differences: results are
exact (no float32 PAV noise such as 0.99999714), any leading batch shape works, and
integer inputs are cast to float32 as the reference implicitly did.
"""

from __future__ import annotations

import jax.numpy as jnp

from implicit_topk import hard as _hard
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
  return _ops.soft_topk_mask(_as_float(x), k, l=l, p=p, solver="pav")


def hard_topk_mask(x, k):
  """Hard top-k mask along the last axis."""
  return _hard.hard_topk_mask(_as_float(x), k)


def hard_topk_mag(x, k):
  """Hard top-k in magnitude along the last axis."""
  return _hard.hard_topk_mag(_as_float(x), k)
