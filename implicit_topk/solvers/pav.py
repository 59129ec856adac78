"""Exact PAV solver: numba kernels behind one ``jax.pure_callback`` for the whole batch.

The kernel (:mod:`implicit_topk.solvers.pav_kernels`) sorts each row, runs
Pool-Adjacent-Violators on the isotonic dual (``proofs/isotonic_dual.md``) and returns
the threshold ``lam``; rows run in parallel (numba ``prange``). Cost per row: one sort
plus O(n) for p = 2 and p = 4/3 (closed-form block values); other p solve each block
value by safeguarded Newton, O(n * block size) in the worst case.

The callback runs on the host: on GPU/TPU prefer the ``"threshold"`` solver.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from implicit_topk.solvers import host
from implicit_topk.solvers.base import CappedSimplexSolver


def _host_threshold(p, kernels, x, k, l):
  """``p``: the p-norm exponent (float) or a link name (see :func:`kernel_spec`)."""
  batch_shape, n = x.shape[:-1], x.shape[-1]
  k = np.broadcast_to(np.asarray(k, np.float64), batch_shape).reshape(-1)
  l = np.broadcast_to(np.asarray(l, np.float64), batch_shape).reshape(-1)
  lam = kernels.capped_simplex_threshold(
      x.reshape(-1, n), np.ascontiguousarray(k), np.ascontiguousarray(l), p)
  return np.asarray(lam, dtype=x.dtype).reshape(batch_shape)


def host_root(host_fn, x, k, l):
  """Thresholds from a host kernel, one ``pure_callback`` for the whole batch.

  ``host_fn(kernels, x, k, l) -> lam`` (numpy, shape ``x.shape[:-1]``); a direct
  method, so the iteration count is 0.
  """
  lam = host.call(host_fn, jax.ShapeDtypeStruct(x.shape[:-1], x.dtype), x, k, l)
  return lam, jnp.zeros(x.shape[:-1], jnp.int32)


def kernel_spec(regularizer):
  """What the numba kernels take for a regularizer: the p of a p-norm, or a link name.

  Built-in regularizers declare ``pav_kind = ("pnorm", p)`` or ``("link", name)``; the
  PAV kernels have block solvers for exactly these. Other regularizers are solved by
  ``solver="threshold"``, which needs nothing beyond the :class:`Regularizer` protocol.
  """
  kind = getattr(regularizer, "pav_kind", None)
  if kind is None or kind[0] not in ("pnorm", "link"):
    raise ValueError(
        f"solver='pav' has block solvers for the built-in regularizers only; got "
        f"{regularizer!r}. Use solver='threshold' (pure JAX), which accepts any regularizer.")
  return float(kind[1]) if kind[0] == "pnorm" else str(kind[1])


@dataclasses.dataclass(frozen=True)
class PAVSolver(CappedSimplexSolver):
  """Exact thresholds by numba PAV on the isotonic dual (host callback)."""

  def _solve(self, init, x, k, l):
    del init  # PAV is a direct method.
    return host_root(functools.partial(_host_threshold, kernel_spec(self.regularizer)), x, k, l)
