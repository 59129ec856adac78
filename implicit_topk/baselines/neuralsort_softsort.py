r"""NeuralSort (Grover et al., ICLR 2019) and SoftSort (Prillo & Eisenschlos, ICML 2020).

Both relax the permutation matrix of the descending sort into a unimodal row-stochastic
matrix :math:`\hat P \in \mathbb{R}^{n \times n}` (row ``i`` = rank position ``i``,
column ``j`` = input ``j``; :math:`\hat P s` approximates ``sort(s)[::-1]``). Both are
quadratic by construction: :math:`O(n^2)` time and memory per row, forward and backward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from implicit_topk import _validation


def _prepare(x, tau, name="tau"):
  x = _validation.as_float_input(x)
  _validation.check_positive(tau, name)
  return x, jnp.asarray(tau, x.dtype)


def neuralsort(x, *, tau=1.0, axis: int = -1):
  r"""NeuralSort relaxed permutation matrix of the descending sort (Grover et al. 2019).

  .. math::

      \hat P_{i,:} = \mathrm{softmax}\Big(\big((n + 1 - 2i)\, s - A_s \mathbf{1}\big) / \tau\Big),
      \qquad (A_s)_{jl} = |s_j - s_l|,\quad i = 1..n.

  Row ``i`` is the soft one-hot of the ``i``-th largest entry; ``tau -> 0`` gives the
  hard permutation. Cost: :math:`O(n^2)` time and memory (the matrix itself).

  Args:
    x: float array; sorted along ``axis``.
    tau: temperature > 0.
    axis: the axis to sort.

  Returns:
    Array of shape ``batch + (n, n)`` (``batch`` = ``x`` without ``axis``):
    ``P[..., i, j]`` is the weight of input ``j`` at rank ``i`` (0 = largest).
    difftopk's ``NeuralSort(tau)(-x).transpose(-2, -1)`` is ``P`` flipped along ``i``
    and transposed (it sorts ascending).
  """
  x, tau = _prepare(x, tau)
  axis = _validation.canonicalize_axis(axis, x.ndim)
  s = jnp.moveaxis(x, axis, -1)
  n = s.shape[-1]
  a_one = jnp.sum(jnp.abs(s[..., :, None] - s[..., None, :]), axis=-1)  # (..., n)
  scaling = (n + 1 - 2 * jnp.arange(1, n + 1)).astype(s.dtype)  # (n,)
  p_max = scaling[:, None] * s[..., None, :] - a_one[..., None, :]  # (..., n, n)
  return jax.nn.softmax(p_max / tau, axis=-1)


def softsort(x, *, tau=1.0, power: float = 1.0, axis: int = -1):
  r"""SoftSort relaxed permutation matrix of the descending sort (Prillo & Eisenschlos 2020).

  .. math::

      \hat P_{i,:} = \mathrm{softmax}\big(-|s_{[i]} - s|^{\,\mathrm{power}} / \tau\big),

  with :math:`s_{[i]}` the ``i``-th largest entry (a hard sort; the gradient flows through
  its values). Cost: :math:`O(n \log n)` for the sort plus :math:`O(n^2)` time and memory
  for the matrix.

  Args:
    x: float array; sorted along ``axis``.
    tau: temperature > 0.
    power: the exponent of the distance (``pow`` in the paper and difftopk), > 0.
    axis: the axis to sort.

  Returns:
    Array of shape ``batch + (n, n)``, ``P[..., i, j]`` = weight of input ``j`` at rank
    ``i`` (0 = largest); difftopk's ``SoftSort(tau)(-x)`` is ``P`` flipped along ``i``.
  """
  x, tau = _prepare(x, tau)
  _validation.check_positive(power, "power")
  axis = _validation.canonicalize_axis(axis, x.ndim)
  s = jnp.moveaxis(x, axis, -1)
  s_sorted = -jnp.sort(-s, axis=-1)  # descending
  diff = jnp.abs(s[..., None, :] - s_sorted[..., :, None])
  if power != 1.0:
    diff = diff ** power
  return jax.nn.softmax(-diff / tau, axis=-1)
