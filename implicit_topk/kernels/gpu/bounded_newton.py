r"""Safeguarded Newton on a threshold equation, certified within a fixed number of passes.

The fused GPU kernel (:mod:`implicit_topk.kernels.gpu.pallas_threshold`) must finish every
row inside the kernel: a fallback outside it would be a data-dependent ``lax.cond`` at the
XLA level, which on XLA:GPU copies its predicate to the host and blocks. This module is
the iteration that makes that possible (``proofs/pallas_bounded_iteration.md``,
Proposition 17). The pass itself is :func:`implicit_topk.solvers.threshold.
safeguarded_newton_step` with ``free_passes`` (through
:func:`implicit_topk.solvers.threshold.newton_iteration`); this module holds the cap
and the ordered keys.

For a continuous, nonincreasing :math:`\phi` with a bracket :math:`[lo, hi]` of finite
floats (:math:`\hat\phi(lo) \ge 0 \ge \hat\phi(hi)` up to rounding), each *pass*
evaluates :math:`\hat\phi` and its derivatives at the iterate :math:`\lambda`, moves
``lo`` (``hi``) to :math:`\lambda` where :math:`\hat\phi > 0` (:math:`< 0`), and picks
the next iterate:

* passes ``0 .. free_passes - 1``: exactly the step of the pure-JAX threshold solver
  (:func:`implicit_topk.solvers.threshold.safeguarded_newton_step`): a Newton (or
  Schroeder, refined on the piece) point strictly inside the bracket and at most half
  the step before the last, else a false-position, near-end or bisection point inside
  the bracket;
* from pass ``free_passes`` on, every other pass (``(t - free_passes)`` even) takes the
  *ordered midpoint* of the bracket whatever Newton proposes: the float whose ordered
  bit pattern (the monotone integer key of :func:`ordered_key`) is the floor-average of
  the keys of ``lo`` and ``hi``.

Rows stop by the threshold solver's rules (R1 :math:`\hat\phi = 0`, R2 a bracket of a
few ulps, R3 a Newton step of a few ulps with a residual at rounding level) and by

* **R4**: no float lies strictly between ``lo`` and ``hi`` (key width at most 1).

The keys of the finite floats of ``b`` bits span fewer than :math:`2^b` integers, and an
evaluation at the ordered midpoint leaves at most :math:`\lceil W/2\rceil` of a key width
:math:`W`; so after ``free_passes`` passes, ``2 b`` more passes reach R4 at the latest:
every row that is not answered by its bracket stops within :func:`pass_cap` passes
(``free_passes + 64`` for float32, ``free_passes + 128`` for float64), by construction,
with :math:`\lambda` within one ulp of the rounding band of the root under R4 and the
guarantees of ``proofs/pallas_certificate.md`` under R1-R3.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import implicit_topk.solvers.threshold as _threshold

#: Passes of the unconstrained safeguarded Newton iteration before the forced ordered
#: bisections start (rows of normal scores stop after 3 to 12; the H100 measurement
#: saw 16-26 at most per block with the old start).
FREE_PASSES = 16


def key_bits(dtype) -> int:
  """Bits of the ordered keys of ``dtype`` (its width: 32 for float32, 64 for float64)."""
  return 8 * np.dtype(dtype).itemsize


def pass_cap(dtype, free_passes: int = FREE_PASSES) -> int:
  """The most passes a row can make: ``free_passes + 2 * key_bits(dtype)``."""
  return int(free_passes) + 2 * key_bits(dtype)


def ordered_key(v):
  """The monotone integer key of finite floats: ``sign * (bits without the sign)``
  (-0 and +0 both map to 0); ``a < b`` iff ``key(a) < key(b)``."""
  itype = {2: jnp.int16, 4: jnp.int32, 8: jnp.int64}[jnp.dtype(v.dtype).itemsize]
  bits = jax.lax.bitcast_convert_type(v, itype)
  return jnp.where(bits < 0, -(bits & jnp.iinfo(itype).max), bits)


def exhausted(lo, hi):
  """R4: no float strictly between ``lo <= hi`` (their keys differ by at most 1).

  Read off the ordered midpoint: it equals an end exactly when the key width is at most
  1 (no integer difference is formed, so nothing overflows)."""
  middle = _threshold.ordered_midpoint(lo, hi)
  return (middle == lo) | (middle == hi)
