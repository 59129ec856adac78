r"""Baselines: faithful JAX implementations of other differentiable sort / top-k relaxations.

Each is written from its paper's definition and, where the peer is installable, checked
against the peer's own code (``tests/test_baselines.py``). Conventions: relaxed
permutation matrices are ``P[..., i, j]`` = weight of input ``j`` at rank ``i`` of the
*descending* sort (rank 0 = largest); ``axis`` selects the sorted axis.

The functions, their methods and their cost per row of length ``n``:

* :func:`neuralsort`: NeuralSort (Grover et al., 2019, "Stochastic optimization of
  sorting networks via continuous relaxations", ICLR); :math:`O(n^2)`.
* :func:`softsort`: SoftSort (Prillo & Eisenschlos, 2020, "SoftSort: a continuous
  relaxation for the argsort operator", ICML); :math:`O(n^2)`.
* :func:`sorting_network`: differentiable sorting networks, odd-even or bitonic, with
  logistic, logistic_phi (activation replacement trick) or Cauchy relaxations
  (Petersen et al., 2021, "Differentiable sorting networks for scalable sorting and
  ranking supervision", ICML; 2022, "Monotonic differentiable sorting networks",
  ICLR); ``k=`` gives difftopk's top-k attribution matrix. :math:`O(L n^2)` for the
  full matrix, :math:`O(L n k)` for the top-k one (``L`` layers).
* :func:`perturbed_topk_mask` and :func:`perturbed_topk_memberships`: perturbed
  optimizers with Gaussian noise, by Monte Carlo (Berthet et al., 2020, "Learning with
  differentiable perturbed optimizers", NeurIPS); :math:`O(S n \log n)` for ``S``
  samples.
* :func:`ot_topk_mask`: entropic optimal-transport top-k (Xie et al., 2020,
  "Differentiable top-k with optimal transport", NeurIPS; as OTT's
  ``soft_sort.topk_mask``); :math:`O(n)` per Sinkhorn iteration.
* :func:`memberships_from_permutation`: soft top-k memberships from any relaxed
  permutation matrix above.
"""

import numbers
from collections.abc import Sequence

import jax
from jax.typing import ArrayLike

from implicit_topk.baselines.neuralsort_softsort import neuralsort, softsort
from implicit_topk.baselines.optimal_transport import ot_topk_mask
from implicit_topk.baselines.perturbed import perturbed_topk_mask, perturbed_topk_memberships
from implicit_topk.baselines.sorting_networks import (bitonic_layers, odd_even_layers, relaxed_swap_prob,
                                                      sorting_network)


def memberships_from_permutation(perm: ArrayLike, ks: Sequence[int]) -> jax.Array:
  """Soft top-k memberships ``P(j in top-k) = sum_{i < k} P[..., i, j]`` for each k in ``ks``.

  Turns a relaxed permutation matrix of the descending sort (:func:`neuralsort`,
  :func:`softsort`, :func:`sorting_network`) into soft top-k masks: the membership of
  input ``j`` in the top ``k`` is the total weight of ``j`` on the first ``k`` ranks.

  Args:
    perm: a relaxed permutation (or top-k attribution) matrix of shape
      ``batch + (r, n)``, rows in descending rank order (row 0 = largest),
      ``r >= max(ks)``.
    ks: a sequence of ints, each 1 <= k <= r.

  Returns:
    Array of shape ``batch + (len(ks), n)`` and the dtype of ``perm``: row ``i`` is the
    soft top-``ks[i]`` mask.

  Example:
    >>> import jax.numpy as jnp
    >>> from implicit_topk import baselines
    >>> p = jnp.array([[0.0, 1.0, 0.0], [0.5, 0.0, 0.5], [0.5, 0.0, 0.5]])
    >>> baselines.memberships_from_permutation(p, (1, 2))
    Array([[0. , 1. , 0. ],
           [0.5, 1. , 0.5]], dtype=float32)
  """
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  if jnp.ndim(perm) < 2:
    raise ValueError(f"`perm` must have shape batch + (r, n); got shape {jnp.shape(perm)}.")
  ranks = jnp.shape(perm)[-2]
  if not all(isinstance(k, numbers.Integral) and not isinstance(k, bool) and 1 <= k <= ranks
             for k in ks):
    raise ValueError(f"`ks` must hold Python ints with 1 <= k <= r = {ranks} (the rows of "
                     f"`perm`); got {tuple(ks)!r}.")
  cum = jnp.cumsum(perm, axis=-2)
  return jnp.take(cum, jnp.asarray(ks) - 1, axis=-2)


__all__ = [
    "neuralsort", "softsort", "sorting_network", "odd_even_layers", "bitonic_layers",
    "relaxed_swap_prob", "perturbed_topk_mask", "perturbed_topk_memberships", "ot_topk_mask",
    "memberships_from_permutation",
]
