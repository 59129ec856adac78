r"""Baselines: faithful JAX implementations of other differentiable sort / top-k relaxations.

Each is written from its paper's definition and, where the peer is installable, checked
against the peer's own code (``tests/test_baselines.py``). Conventions: relaxed
permutation matrices are ``P[..., i, j]`` = weight of input ``j`` at rank ``i`` of the
*descending* sort (rank 0 = largest); ``axis`` selects the sorted axis.

| function | method | cost per row |
|---|---|---|
| :func:`neuralsort` | NeuralSort (Grover et al. 2019) | :math:`O(n^2)` |
| :func:`softsort` | SoftSort (Prillo & Eisenschlos 2020) | :math:`O(n^2)` |
| :func:`sorting_network` | differentiable sorting networks, odd-even / bitonic, logistic / logistic_phi (ART) / Cauchy (Petersen et al. 2021, 2022); ``k=`` gives difftopk's top-k attribution matrix | :math:`O(L n^2)` full, :math:`O(L n k)` top-k |
| :func:`perturbed_topk_mask` | perturbed optimizer, Gaussian noise, Monte Carlo (Berthet et al. 2020) | :math:`O(S n \log n)` |
| :func:`ot_topk_mask` | entropic OT top-k (Xie et al. 2020; OTT) | :math:`O(n)` per Sinkhorn iteration |
"""

from implicit_topk.baselines.neuralsort_softsort import neuralsort, softsort
from implicit_topk.baselines.optimal_transport import ot_topk_mask
from implicit_topk.baselines.perturbed import perturbed_topk_mask, perturbed_topk_memberships
from implicit_topk.baselines.sorting_networks import (bitonic_layers, odd_even_layers, relaxed_swap_prob,
                                                      sorting_network)


def memberships_from_permutation(perm, ks):
  """Soft top-k memberships ``P(j in top-k) = sum_{i < k} P[..., i, j]`` for each k in ``ks``.

  Args:
    perm: a relaxed permutation (or top-k attribution) matrix ``batch + (r, n)``, rows
      in descending rank order, ``r >= max(ks)``.
    ks: a sequence of ints.

  Returns:
    Array ``batch + (len(ks), n)``.
  """
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  cum = jnp.cumsum(perm, axis=-2)
  return jnp.take(cum, jnp.asarray(ks) - 1, axis=-2)


__all__ = [
    "neuralsort", "softsort", "sorting_network", "odd_even_layers", "bitonic_layers",
    "relaxed_swap_prob", "perturbed_topk_mask", "perturbed_topk_memberships", "ot_topk_mask",
    "memberships_from_permutation",
]
