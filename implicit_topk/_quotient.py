"""``d / l`` whose derivative in ``l`` stays in the float range.

JAX differentiates ``d / l`` in ``l`` as ``-d * l**-2``: ``l**2`` overflows for
``l > 2^63`` (float32; ``2^511`` in float64) and is flushed to 0 below ``2^-64``
(``2^-512``), giving 0 or NaN (``0 * inf``) well inside the strengths the operators take.
:func:`quotient` is ``d / l`` with the tangent ``(d_dot - (d / l) l_dot) / l``: the same
derivative, every intermediate of the order of the result.
"""

from __future__ import annotations

import jax


@jax.custom_jvp
def quotient(d, l):
  """``d / l``, differentiated in ``l`` as ``-(d / l) / l`` (module docstring)."""
  return d / l


@quotient.defjvp
def _quotient_jvp(primals, tangents):
  (d, l), (d_dot, l_dot) = primals, tangents
  u = d / l
  return u, (d_dot - u * l_dot) / l
