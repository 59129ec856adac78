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
A regularizer is one small object with (the :class:`Regularizer` protocol):

* ``mask(z)``: the clipped map :math:`z \mapsto \mathrm{clip}(g(z), 0, 1)` in
  ``jax.numpy``, written with safe branches so that its derivatives are finite
  everywhere (the threshold solver's Newton steps and every derivative of the
  operators come from it by autodiff);
* ``saturation``: the interval :math:`[z_0, z_1]` outside which the mask is exactly
  0 (below) or 1 (above); ``-inf``/``inf`` where it never is (entropy never gives an
  exact 0, the sigmoid neither 0 nor 1);
* ``omega_prime(t)``: :math:`\omega'(t)` on :math:`(0, 1)`, which brackets the
  threshold for any regularizer: at :math:`\lambda = \min_i x_i - l\,\omega'(k/n)`
  every :math:`y_i \ge k/n`, at :math:`\max_i x_i - l\,\omega'(k/n)` every
  :math:`y_i \le k/n`;
* ``omega(y)``: the regularizer itself (objective values, Fenchel-Young losses);
* ``complement(z)`` (optional): :math:`1 - \mathrm{mask}(z)` computed without
  cancellation (the sigmoid and Laplace masks, symmetric: ``mask(-z)``). Where it is
  given, the threshold solvers evaluate :math:`\phi` in complement form,
  :math:`\phi = (\#\{z_i > 0\} - k) + \sum_{z_i \le 0} \mathrm{mask}(z_i)
  - \sum_{z_i > 0} \mathrm{complement}(z_i)`, which resolves the threshold of
  near-binary rows (gaps of hundreds of strengths) to the ulp
  (``proofs/complement_form.md``);
* ``link(z)`` (optional): the unclipped :math:`g` on the whole real line, for
  permutahedra of a general ``w`` (soft sort and rank, :mod:`implicit_topk.permutahedron`);
* ``pav_kind`` (optional): which block solver of the exact ``"pav"`` solver
  (:mod:`implicit_topk.solvers.pav_kernels`) fits: ``("pnorm", p)`` or
  ``("link", name)`` with ``name`` in ``"exp"``, ``"sigmoid"``, ``"laplace"``. The
  built-ins declare it; a user-defined regularizer without it is solved by
  ``solver="threshold"`` (pure JAX), and ``solver="pav"`` says so.

Solvers never look inside a regularizer beyond this interface, so a user-defined
regularizer (a dataclass with these members) works with ``solver="threshold"``
without touching any solver; a missing member raises a ``TypeError`` that names it.

Built-ins: :class:`PNorm` (sparse; ``p = 2`` Euclidean, ``p = 4/3`` smooth),
:class:`Entropy` (``min(1, exp)``: softmax at ``k = 1``), :class:`BinaryEntropy`
(sigmoid, Fermi-Dirac) and :class:`Laplace` (the Laplace CDF, "LapSum").
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from implicit_topk import _quotient
from implicit_topk import _validation


@runtime_checkable
class Regularizer(Protocol):
  """What the solvers need from a separable regularizer (see the module docstring).

  Any object with these members can be passed as ``regularizer=`` to
  :func:`implicit_topk.soft_topk_mask` (and the sort/rank operators): the threshold
  solver uses ``mask`` and ``saturation``, plus ``omega_prime`` when the saturation
  interval is infinite; ``omega`` is used by the losses.

  Attributes:
    saturation: ``(z0, z1)``, the interval outside which ``mask`` is exactly 0 (below
      ``z0``) and exactly 1 (above ``z1``); an end may be infinite.

  Example:
    >>> import jax.numpy as jnp
    >>> import implicit_topk as itk
    >>> isinstance(itk.PNorm(2.0), itk.Regularizer)
    True
  """

  saturation: tuple[float, float]

  def mask(self, z: jax.Array) -> jax.Array: ...

  def omega_prime(self, t): ...

  def omega(self, y): ...


def check_protocol(regularizer) -> None:
  """Raises ``TypeError`` naming what ``regularizer`` lacks for the threshold solvers."""
  missing = [name for name in ("mask", "saturation") if not hasattr(regularizer, name)]
  if missing:
    named = ", ".join(f"`{name}`" for name in missing)
    raise TypeError(f"`regularizer` must provide {named} (see implicit_topk.regularizers); "
                    f"got {regularizer!r}.")
  z0, z1 = regularizer.saturation
  if not (z0 < z1):
    raise ValueError(f"`regularizer.saturation` must be an interval z0 < z1; got {(z0, z1)}.")
  if not (np.isfinite(z0) and np.isfinite(z1)) and not hasattr(regularizer, "omega_prime"):
    raise TypeError("`regularizer` has an infinite saturation interval, so it must provide "
                    f"`omega_prime(t)` to bracket the threshold; got {regularizer!r}.")


def pav_kernel_spec(regularizer):
  """What the numba PAV kernels take: the p of a p-norm (float) or a link name (str)."""
  kind = getattr(regularizer, "pav_kind", None)
  if kind is None or kind[0] not in ("pnorm", "link"):
    raise ValueError(
        f"solver='pav' has block solvers for regularizers declaring `pav_kind` only; got "
        f"{regularizer!r}. Use solver='threshold' (pure JAX), which accepts any regularizer.")
  return float(kind[1]) if kind[0] == "pnorm" else str(kind[1])


def native_kernel_spec(regularizer):
  """What the native CPU kernel takes: ``("pnorm", a)`` with ``a = 1 / (p - 1)``, or
  ``("link", name)`` for the built-in dense regularizers; ``ValueError`` otherwise."""
  kind = getattr(regularizer, "pav_kind", None)
  if kind is None or kind[0] not in ("pnorm", "link"):
    raise ValueError(
        f"solver='native' has kernels for the built-in regularizers only; got {regularizer!r}. "
        "Use solver='threshold' (pure JAX), which accepts any regularizer.")
  return ("pnorm", float(PNorm(kind[1]).exponent)) if kind[0] == "pnorm" else kind


def pnorm_exponent(regularizer):
  """``a = 1 / (p - 1)`` for a p-norm regularizer (an int when it is one), else ``None``."""
  kind = getattr(regularizer, "pav_kind", None)
  if kind is None or kind[0] != "pnorm":
    return None
  return PNorm(kind[1]).exponent


def piece_degree(regularizer):
  """``a`` where the p-norm link ``g(z) = z^a`` is a polynomial of degree at most 3
  (``a = 1 / (p - 1)`` in {1, 2, 3}: p in {2, 3/2, 4/3}), else ``None``. The threshold
  functions of the mask and of the magnitude operator are then, between two kinks,
  polynomials of that degree in ``lam``."""
  a = pnorm_exponent(regularizer)
  return a if isinstance(a, int) and 1 <= a <= 3 else None


@dataclasses.dataclass(frozen=True)
class PNorm:
  r""":math:`\omega(y) = |y|^p / p` with :math:`p > 1`.

  Then :math:`g(z) = \mathrm{sign}(z) |z|^{1/(p-1)}` and the mask is
  :math:`\min(1, ((x_i - \lambda)_+ / l)^{1/(p-1)})`: exactly sparse. ``p = 2`` is the
  Euclidean projection of ``x / l`` onto the capped simplex (piecewise linear, with
  kinks); ``p = 4/3`` gives a continuously differentiable operator (cubic pieces).
  Sander et al., "Fast, differentiable and sparse top-k: a convex analysis perspective"
  (ICML 2023).

  Attributes:
    p: the exponent, ``p > 1`` (default 4/3); ``ValueError`` otherwise.

  Example:
    >>> import jax.numpy as jnp
    >>> import implicit_topk as itk
    >>> x = jnp.array([3.0, 1.0, 2.0, -1.0])
    >>> itk.soft_topk_mask(x, 2, regularization_strength=2.0, regularizer=itk.PNorm(2.0))
    Array([1.  , 0.25, 0.75, 0.  ], dtype=float32)
  """

  p: float = 4.0 / 3.0

  def __post_init__(self):
    object.__setattr__(self, "p", _validation.check_p(self.p))

  @property
  def exponent(self) -> float | int:
    """``a = 1 / (p - 1)``; an int when it is one (``p = 2`` gives 1, ``p = 4/3`` gives 3)."""
    a = 1.0 / (self.p - 1.0)
    rounded = round(a)
    if rounded >= 1 and abs(a - rounded) <= 1e-9 * max(1.0, a):
      return int(rounded)
    return a

  @property
  def saturation(self) -> tuple[float, float]:
    return (0.0, 1.0)

  @property
  def pav_kind(self) -> tuple[str, float]:
    """The numba PAV kernel: closed forms for p = 2 and 4/3, Newton for other p."""
    return ("pnorm", self.p)

  def omega_prime(self, t):
    return jnp.power(t, self.p - 1.0)

  def link(self, z):
    """``g(z) = sign(z) |z|^a`` on the whole line (permutahedra with any ``w``).

    For ``a < 1`` (``p > 2``) the derivative at 0 is infinite; it is returned as 0 there.
    """
    a = self.exponent
    if a == 1:
      return z
    if isinstance(a, int):
      return z * jnp.abs(z) ** (a - 1)
    nonzero = z != 0
    safe = jnp.where(nonzero, jnp.abs(z), 1.0)
    return jnp.where(nonzero, jnp.sign(z) * jnp.power(safe, jnp.asarray(a, z.dtype)), 0.0)

  def link_of_ratio(self, v, l):
    """``g(v / l)``, with the strength ``l > 0`` kept out of the power's argument where
    it must be. For ``a < 1`` (``p > 2``) as ``g(v) / l^a``: ``v / l`` can leave the float
    range where ``g`` of it does not (float32 ``v = 1e-19``, ``l = 1e19``), and, as a
    :func:`~implicit_topk._quotient.quotient`, its derivative in ``l`` forms no
    ``l^(-a-1)`` (flushed in float32 at ``l = 1e27``, ``a = 1/2``). For ``a >= 1``,
    ``g(v / l)`` leaves the range with ``v / l`` (0 next to ``v``, or saturated)."""
    a = self.exponent
    if a < 1:
      return _quotient.quotient(self.link(v), l ** jnp.asarray(a, jnp.result_type(v)))
    return self.link(_quotient.quotient(v, l))

  def omega(self, y):
    return jnp.abs(y) ** self.p / self.p

  def mask(self, z):
    """``clip(g(z), 0, 1) = min(1, max(z, 0) ** a)``, with finite derivatives."""
    inside = (z > 0) & (z < 1)
    safe_z = jnp.where(inside, z, jnp.asarray(0.5, z.dtype))
    a = self.exponent
    if isinstance(a, int):
      y_inside = safe_z if a == 1 else safe_z**a  # integer_pow: no log/exp
    else:
      y_inside = jnp.power(safe_z, jnp.asarray(a, z.dtype))
    one = jnp.ones_like(z)
    return jnp.where(z >= 1, one, jnp.where(inside, y_inside, jnp.zeros_like(z)))


def _safe_exp_below(z, top):
  """exp(z) for z < top, with the argument clamped so the unused branch stays finite."""
  return jnp.exp(jnp.minimum(z, top))


@dataclasses.dataclass(frozen=True)
class Entropy:
  r""":math:`\omega(y) = y \log y - y` on :math:`[0, 1]`: :math:`y_i = \min(1, e^{(x_i - \lambda)/l})`.

  Never exactly 0 (dense), exactly 1 for the clearly kept entries; kinks where an
  entry reaches 1. ``k = 1`` gives ``softmax(x / l)`` exactly (no entry can reach 1
  before the others vanish). Jianlin Su's "Softmax Sequel" (kexue.fm): "ThreTopK with
  min(1, e^x)"; on each piece of the partition {1, (0,1)} the threshold has the closed form
  :math:`\lambda = l \log\sum_{i \notin O} e^{x_i/l} - l \log(k - |O|)`.

  Example:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> import implicit_topk as itk
    >>> x = jnp.array([0.0, 1.0, 2.0])
    >>> y = itk.soft_topk_mask(x, 1, regularizer=itk.Entropy())
    >>> bool(jnp.allclose(y, jax.nn.softmax(x)))  # k = 1: the softmax
    True
  """

  saturation = (-float("inf"), 0.0)
  pav_kind = ("link", "exp")

  def mask(self, z):
    return jnp.where(z >= 0, jnp.ones_like(z), _safe_exp_below(z, 0.0))

  def omega_prime(self, t):
    return jnp.log(t)

  def link(self, z):
    """``g(z) = exp(z)`` on the whole line (permutahedra of positive ``w``: soft ranks)."""
    return jnp.exp(z)

  def omega(self, y):
    return jax.scipy.special.xlogy(y, y) - y


@dataclasses.dataclass(frozen=True)
class BinaryEntropy:
  r""":math:`\omega(y) = y \log y + (1 - y) \log(1 - y)`: :math:`y_i = \sigma((x_i - \lambda)/l)`.

  The Fermi-Dirac / sigmoid mask (Jianlin Su's "Softmax Sequel" (kexue.fm): "ThreTopK
  with sigmoid"): smooth (:math:`C^\infty`) and dense, never exactly 0 or 1. Also
  available as ``regularizer="sigmoid"``.

  Example:
    >>> import jax.numpy as jnp
    >>> import implicit_topk as itk
    >>> y = itk.soft_topk_mask(jnp.array([3.0, 1.0, 2.0, -1.0]), 2,
    ...                        regularizer=itk.BinaryEntropy())
    >>> round(float(y.sum()), 5)  # dense, and the entries still sum to k
    2.0
  """

  saturation = (-float("inf"), float("inf"))
  pav_kind = ("link", "sigmoid")

  def mask(self, z):
    # Above 0 as 1 - sigmoid(-z): the same value, and a derivative sigmoid(-z)(1 -
    # sigmoid(-z)) that keeps the tail e^-z (jax's sigmoid'(z) = s (1 - s) is 0 once
    # s rounds to 1, z > 37 in float64), so near-binary rows keep their derivatives.
    return jnp.where(z > 0, 1 - jax.nn.sigmoid(-z), jax.nn.sigmoid(z))

  def complement(self, z):
    """``1 - mask(z) = sigmoid(-z)``, accurate in its tail (``proofs/complement_form.md``)."""
    return jax.nn.sigmoid(-z)

  def omega_prime(self, t):
    # logit(t) = log t - log(1 - t): 1 - t is exact for t >= 1/2 and within eps/2 below,
    # so the error is a few eps. (Not log1p(-t): XLA's float64 log1p on CPU is off by up
    # to 128 ulps on [-0.99, -0.01], jax 0.10; all-equal rows take lam from this value.)
    return jnp.log(t) - jnp.log(1 - t)

  def omega(self, y):
    return jax.scipy.special.xlogy(y, y) + jax.scipy.special.xlogy(1 - y, 1 - y)


@dataclasses.dataclass(frozen=True)
class Laplace:
  r"""The Laplace CDF: :math:`y_i = F((x_i - \lambda)/l)`, :math:`F(z) = e^z/2` for
  :math:`z < 0` and :math:`1 - e^{-z}/2` for :math:`z \ge 0`.

  Jianlin Su's "Softmax Sequel" (kexue.fm): "both worlds" (also known as LapSum):
  :math:`C^1`, dense, and on each piece of the partition ``{z < 0, z >= 0}`` the
  threshold solves a quadratic in
  :math:`e^{\lambda/l}` (closed form). :math:`\omega` is the integral of
  :math:`F^{-1}`: :math:`t \log 2t - t` below 1/2, :math:`(1-t)\log 2(1-t) - (1-t)`
  above. Struski et al., "LapSum - one method to differentiate them all: ranking, sorting
  and top-k selection" (ICML 2025)
  study the same operator.

  Example:
    >>> import jax.numpy as jnp
    >>> import implicit_topk as itk
    >>> y = itk.soft_topk_mask(jnp.array([3.0, 1.0, 2.0, -1.0]), 2, regularizer=itk.Laplace())
    >>> bool(jnp.all((y > 0) & (y < 1)))  # dense: no entry exactly 0 or 1
    True
  """

  saturation = (-float("inf"), float("inf"))
  pav_kind = ("link", "laplace")

  def mask(self, z):
    lower = 0.5 * _safe_exp_below(z, 0.0)
    upper = 1.0 - 0.5 * jnp.exp(-jnp.maximum(z, 0.0))
    return jnp.where(z < 0, lower, upper)

  def complement(self, z):
    """``1 - mask(z) = mask(-z)`` (the Laplace CDF is symmetric), accurate in its tail
    (``proofs/complement_form.md``)."""
    return self.mask(-z)

  def omega_prime(self, t):
    below = t < 0.5
    return jnp.where(below, jnp.log(2 * jnp.where(below, t, 0.25)),
                     -jnp.log(2 * (1 - jnp.where(below, 0.75, t))))

  def omega(self, y):
    xlogy = jax.scipy.special.xlogy
    lower = xlogy(y, 2 * y) - y
    upper = xlogy(1 - y, 2 * (1 - y)) - (1 - y)
    return jnp.where(y < 0.5, lower, upper)


BUILTINS = {"pnorm": PNorm, "entropy": Entropy, "binary_entropy": BinaryEntropy,
            "sigmoid": BinaryEntropy, "laplace": Laplace}


def resolve(regularizer, p) -> Any:
  """Returns the regularizer object.

  ``None`` gives ``PNorm(p)``; a string names a built-in (``"entropy"``,
  ``"sigmoid"``/``"binary_entropy"``, ``"laplace"``, ``"pnorm"`` with this ``p``); an
  object must provide ``mask(z)`` and ``saturation`` (and ``omega_prime(t)`` where the
  saturation interval is infinite).
  """
  if regularizer is None:
    return PNorm(p)
  if isinstance(regularizer, str):
    if regularizer not in BUILTINS:
      raise ValueError(f"`regularizer` must be one of {sorted(BUILTINS)} or an object; "
                       f"got {regularizer!r}.")
    return PNorm(p) if regularizer == "pnorm" else BUILTINS[regularizer]()
  check_protocol(regularizer)
  return regularizer
