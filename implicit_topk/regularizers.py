r"""Separable regularizers for the regularized top-k linear program.

The soft top-k mask is

.. math::

    y^\star(x) = \arg\max_{y \in [0,1]^n,\ \sum_i y_i = k}\ \langle x, y\rangle
                 - l \sum_i \omega(y_i).

For a strictly convex separable :math:`\omega` the solution is a threshold map
(``proofs/threshold_form.md``):

.. math::

    y_i = \mathrm{clip}\big(g((x_i - \lambda) / l),\ 0,\ 1\big), \qquad
    g = (\omega')^{-1},

with :math:`\lambda` the root of :math:`\phi(\lambda) = \sum_i y_i(\lambda) - k`.
A regularizer therefore gives a solver two things:

* ``mask(z)``: the clipped map :math:`z \mapsto \mathrm{clip}(g(z), 0, 1)`, written
  with safe branches so that its derivatives are finite everywhere;
* ``saturation``: the interval :math:`[z_0, z_1]` outside which the mask is exactly
  0 (below) or 1 (above), used to bracket :math:`\lambda`.

Solvers never look inside a regularizer beyond this interface (and, for the numba
PAV solver, ``pav_exponent``).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from implicit_topk import _validation


@dataclasses.dataclass(frozen=True)
class PNorm:
  r""":math:`\omega(y) = |y|^p / p` with :math:`p > 1`.

  Then :math:`g(z) = \mathrm{sign}(z) |z|^{1/(p-1)}` and the mask is
  :math:`\min(1, ((x_i - \lambda)_+ / l)^{1/(p-1)})`: exactly sparse. ``p = 2`` is the
  Euclidean projection of ``x / l`` onto the capped simplex (piecewise linear, with
  kinks); ``p = 4/3`` gives a continuously differentiable operator (cubic pieces).
  """

  p: float = 4.0 / 3.0

  def __post_init__(self):
    object.__setattr__(self, "p", _validation.check_p(self.p))

  @property
  def exponent(self) -> float | int:
    """a = 1 / (p - 1); an int when it is one (p = 2 -> 1, p = 4/3 -> 3)."""
    a = 1.0 / (self.p - 1.0)
    rounded = round(a)
    if rounded >= 1 and abs(a - rounded) <= 1e-9 * max(1.0, a):
      return int(rounded)
    return a

  @property
  def saturation(self) -> tuple[float, float]:
    return (0.0, 1.0)

  @property
  def pav_exponent(self) -> float:
    """The p handed to the numba PAV kernels."""
    return self.p

  def mask(self, z):
    """clip(g(z), 0, 1) = min(1, max(z, 0) ** a), with finite derivatives."""
    inside = (z > 0) & (z < 1)
    safe_z = jnp.where(inside, z, jnp.asarray(0.5, z.dtype))
    a = self.exponent
    if isinstance(a, int):
      y_inside = safe_z if a == 1 else safe_z**a  # integer_pow: no log/exp
    else:
      y_inside = jnp.power(safe_z, jnp.asarray(a, z.dtype))
    one = jnp.ones_like(z)
    return jnp.where(z >= 1, one, jnp.where(inside, y_inside, jnp.zeros_like(z)))


def resolve(regularizer, p) -> PNorm:
  """Returns the regularizer object: ``regularizer`` if given, else ``PNorm(p)``."""
  if regularizer is None:
    return PNorm(p)
  if not (hasattr(regularizer, "mask") and hasattr(regularizer, "saturation")):
    raise TypeError(
        "`regularizer` must provide `mask(z)` and `saturation` (see "
        f"implicit_topk.regularizers); got {regularizer!r}."
    )
  return regularizer
