"""Exact PAV solver: numba kernels behind one host callback for the whole batch.

The problem's kernel (:mod:`implicit_topk.solvers.pav_kernels`) sorts each row, runs
Pool-Adjacent-Violators on the isotonic dual (``proofs/isotonic_dual.md``) and returns
the threshold ``lam``; rows run in parallel (numba ``prange``). Cost per row: one sort
plus O(n) for p = 2 and p = 4/3 (closed-form block values); other p solve each block
value by safeguarded Newton, O(n * block size) in the worst case.

The callback runs on the host (:mod:`implicit_topk.solvers.host`): it cannot be
exported with ``jax.export`` and gathers a sharded input to one device; on GPU/TPU,
for export and for sharded inputs use the ``"threshold"`` solver.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from implicit_topk import regularizers
from implicit_topk.solvers import host
from implicit_topk.solvers.base import ThresholdRootSolver

kernel_spec = regularizers.pav_kernel_spec  # used by the permutahedron operators


@dataclasses.dataclass(frozen=True)
class PAVSolver(ThresholdRootSolver):
  """Exact thresholds by numba PAV on the problem's isotonic dual (host callback)."""

  name = "pav"

  def _solve(self, init, x, k, l):
    del init  # PAV is a direct method.
    lam = host.call(self.problem.host_threshold, jax.ShapeDtypeStruct(x.shape[:-1], x.dtype),
                    x, k, l)
    # Rows answered by the bracket (non-finite entries, k = 0 or n, the limits of
    # regularizers that never saturate) take its value, as in the other solvers.
    bracket = self.problem.bracket(x, k, l)
    lam = jnp.where(bracket.known, bracket.value, lam)
    # As the Newton solver: a binary solution whose flat root interval is a single point
    # (a gap of exactly l) gets that point, so the mask is exactly 0/1 (p near 1 turns
    # an ulp of lam into several ulps of y).
    lam = self.problem.snap(lam, x, k, l, bracket.known)
    return lam, jnp.zeros_like(x[..., 0], jnp.int32)
