r"""NeuralSort (Grover et al., ICLR 2019) and SoftSort (Prillo & Eisenschlos, ICML 2020).

Both relax the permutation matrix of the descending sort into a unimodal row-stochastic
matrix :math:`\hat P \in \mathbb{R}^{n \times n}` (row ``i`` = rank position ``i``,
column ``j`` = input ``j``; :math:`\hat P s` approximates ``sort(s)[::-1]``). Both are
quadratic by construction: :math:`O(n^2)` time and memory per row, forward and backward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from implicit_topk import _validation


def _prepare(x: ArrayLike, tau: ArrayLike, name: str = "tau") -> tuple[jax.Array, jax.Array]:
  x = _validation.as_float_input(x)
  _validation.check_positive(tau, name)
  return x, jnp.asarray(tau, x.dtype)


def neuralsort(x: ArrayLike, *, tau: ArrayLike = 1.0, axis: int = -1) -> jax.Array:
  r"""NeuralSort relaxed permutation matrix of the descending sort.

  NeuralSort (Grover et al., 2019, "Stochastic optimization of sorting networks via
  continuous relaxations", ICLR) replaces the argmax of each row of the sorting
  permutation by a softmax of an affine function of the scores:

  .. math::
      \hat P_{i,:} = \mathrm{softmax}\Big(\big((n + 1 - 2i)\, s - A_s \mathbf{1}\big) / \tau\Big),
      \qquad (A_s)_{jl} = |s_j - s_l|,\quad i = 1..n.

  Row ``i`` is the soft one-hot of the ``i``-th largest entry; ``tau -> 0`` gives the
  hard permutation. Cost: :math:`O(n^2)` time and memory (the matrix itself).

  Args:
    x: float array (float16, bfloat16, float32 or float64); sorted along ``axis``.
    tau: temperature, > 0 (default 1.0). Smaller is closer to the hard permutation.
    axis: the axis to sort (default -1, the last).

  Returns:
    Float array (the dtype of ``x`` after conversion) of shape ``batch + (n, n)``,
    ``batch`` being the shape of ``x`` without ``axis``: ``P[..., i, j]`` is the weight
    of input ``j`` at rank ``i`` (0 = largest); each row sums to 1. difftopk's
    ``NeuralSort(tau)(-x).transpose(-2, -1)`` is ``P`` flipped along ``i`` and
    transposed (it sorts ascending).

  Example:
    >>> import jax.numpy as jnp
    >>> from implicit_topk import baselines
    >>> p = baselines.neuralsort(jnp.array([0.3, 2.0, 1.0]), tau=0.5)
    >>> jnp.round(p, 3)
    Array([[0.002     , 0.87900007, 0.119     ],
           [0.178     , 0.098     , 0.72400004],
           [0.80200005, 0.        , 0.19800001]], dtype=float32)
  """
  x, tau = _prepare(x, tau)
  axis = _validation.canonicalize_axis(axis, x.ndim)
  s = jnp.moveaxis(x, axis, -1)
  n = s.shape[-1]
  a_one = jnp.sum(jnp.abs(s[..., :, None] - s[..., None, :]), axis=-1)  # (..., n)
  scaling = (n + 1 - 2 * jnp.arange(1, n + 1)).astype(s.dtype)  # (n,)
  p_max = scaling[:, None] * s[..., None, :] - a_one[..., None, :]  # (..., n, n)
  return jax.nn.softmax(p_max / tau, axis=-1)


def softsort(x: ArrayLike, *, tau: ArrayLike = 1.0, power: float = 1.0,
             axis: int = -1) -> jax.Array:
  r"""SoftSort relaxed permutation matrix of the descending sort.

  SoftSort (Prillo & Eisenschlos, 2020, "SoftSort: a continuous relaxation for the
  argsort operator", ICML) puts in row ``i`` a softmax of the negated distances of all
  entries to the ``i``-th largest one:

  .. math::
      \hat P_{i,:} = \mathrm{softmax}\big(-|s_{[i]} - s|^{\,\mathrm{power}} / \tau\big),

  with :math:`s_{[i]}` the ``i``-th largest entry (a hard sort; the gradient flows through
  its values). Cost: :math:`O(n \log n)` for the sort plus :math:`O(n^2)` time and memory
  for the matrix.

  Args:
    x: float array (float16, bfloat16, float32 or float64); sorted along ``axis``.
    tau: temperature, > 0 (default 1.0). Smaller is closer to the hard permutation.
    power: the exponent of the distance (``pow`` in the paper and difftopk), > 0
      (default 1.0). Below 1, :math:`|d|^{\mathrm{power}}` has an infinite slope at
      :math:`d = 0`, which every row meets (the entry at its own rank); that zero
      distance gets the derivative 0 there (a subgradient), not NaN.
    axis: the axis to sort (default -1, the last).

  Returns:
    Float array (the dtype of ``x`` after conversion) of shape ``batch + (n, n)``,
    ``batch`` being the shape of ``x`` without ``axis``: ``P[..., i, j]`` is the weight
    of input ``j`` at rank ``i`` (0 = largest); each row sums to 1. difftopk's
    ``SoftSort(tau)(-x)`` is ``P`` flipped along ``i``.

  Example:
    >>> import jax.numpy as jnp
    >>> from implicit_topk import baselines
    >>> p = baselines.softsort(jnp.array([0.3, 2.0, 1.0]), tau=0.5)
    >>> jnp.round(p, 3)
    Array([[0.029     , 0.85600007, 0.116     ],
           [0.178     , 0.098     , 0.72400004],
           [0.781     , 0.026     , 0.193     ]], dtype=float32)
  """
  x, tau = _prepare(x, tau)
  _validation.check_positive(power, "power")
  axis = _validation.canonicalize_axis(axis, x.ndim)
  s = jnp.moveaxis(x, axis, -1)
  s_sorted = -jnp.sort(-s, axis=-1)  # descending
  diff = jnp.abs(s[..., None, :] - s_sorted[..., :, None])
  if power != 1.0:  # 0 ** power with the derivative 0 (power < 1: infinite, and NaN below)
    positive = diff > 0
    diff = jnp.where(positive, jnp.where(positive, diff, 1.0) ** power, 0.0)
  return jax.nn.softmax(-diff / tau, axis=-1)
