r"""Perturbed top-k (Berthet et al., NeurIPS 2020; Cordonnier et al., CVPR 2021).

The perturbed maximizer of the linear program over the capped simplex :math:`C_k`,

.. math::

    y_\sigma(x) = \mathbb{E}_Z\big[\arg\max_{y \in C_k} \langle x + \sigma Z, y\rangle\big]
                = \mathbb{E}_Z\big[\mathrm{topk\_mask}(x + \sigma Z)\big],
    \qquad Z \sim \mathcal{N}(0, I),

estimated by Monte Carlo with ``num_samples`` draws, and its Jacobian by the same draws
(Berthet et al., Prop. 3.1, Gaussian noise):

.. math::

    J_x y_\sigma(x) = \mathbb{E}_Z\big[\mathrm{topk\_mask}(x + \sigma Z)\, Z^\top\big] / \sigma.

Cost: :math:`O(S\, n \log n)` time (one hard top-k per sample, by sort) and :math:`O(S n)`
memory for ``S = num_samples``, forward and backward. The output is in general not exactly
sparse (an entry is exactly 0 or 1 only when all draws agree on it), and both the value
and the gradient are random (error :math:`O(1/\sqrt{S})`).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from implicit_topk import _validation


def perturbed_topk_memberships(x: ArrayLike, ks: Sequence[int], *, sigma: ArrayLike = 0.1,
                               num_samples: int = 100, key: ArrayLike,
                               axis: int = -1) -> jax.Array:
  r"""Perturbed top-k masks for several ``k`` at once, from shared noise draws.

  The perturbed optimizer of Berthet et al. (2020, "Learning with differentiable
  perturbed optimizers", NeurIPS) for the top-k linear program: the expectation of the
  hard top-k mask of ``x + sigma * Z``, :math:`Z \sim \mathcal{N}(0, I)`, estimated by
  Monte Carlo, with the Monte Carlo Jacobian estimator
  :math:`\mathbb{E}[\mathrm{topk\_mask}(x + \sigma Z)\, Z^\top] / \sigma`
  (Berthet et al., Prop. 3.1). The same draws serve every ``k``.

  Args:
    x: float array (float16, bfloat16, float32 or float64).
    ks: a sequence of ints, each 1 <= k <= n.
    sigma: noise scale, > 0 (default 0.1).
    num_samples: Monte Carlo draws ``S``, an int >= 1 (default 100); the value and the
      gradient have errors of order :math:`1/\sqrt{S}`.
    key: a ``jax.random`` key (required).
    axis: the axis to select along (default -1, the last).

  Returns:
    Float array of shape ``batch + (len(ks), n)`` (``batch`` = the shape of ``x``
    without ``axis``; the float dtype of ``x``): entry ``[..., i, j]`` estimates
    :math:`P(j \in \mathrm{top}_{k_i}(x + \sigma Z))`. Differentiable in ``x`` by the
    Monte Carlo Jacobian estimator (forward and reverse mode).

  Example:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> from implicit_topk import baselines
    >>> y = baselines.perturbed_topk_memberships(
    ...     jnp.array([0.3, 2.0, 1.0]), (1, 2), sigma=0.5, num_samples=1000,
    ...     key=jax.random.key(0))
    >>> y.shape
    (2, 3)
    >>> jnp.round(y.sum(axis=-1), 3)  # each row sums to its k
    Array([1., 2.], dtype=float32)
  """
  x = _validation.as_float_input(x)
  axis = _validation.canonicalize_axis(axis, x.ndim)
  _validation.check_positive(sigma, "sigma")
  if not isinstance(num_samples, int) or num_samples < 1:
    raise ValueError(f"`num_samples` must be an int >= 1; got {num_samples!r}.")
  s = jnp.moveaxis(x, axis, -1)
  n = s.shape[-1]
  for k in ks:
    _validation.check_k(k, n, integer=True, allow_zero=False)
  sigma = jnp.asarray(sigma, s.dtype)
  z = jax.random.normal(key, (num_samples,) + s.shape, s.dtype)
  perturbed = jax.lax.stop_gradient(s) + sigma * z
  ranks = jnp.argsort(jnp.argsort(-perturbed, axis=-1), axis=-1)  # 0 = largest
  ks_arr = jnp.asarray(ks)
  hard = (ranks[..., None, :] < ks_arr[:, None]).astype(s.dtype)  # (S, ..., K, n)
  value = jnp.mean(hard, axis=0)
  # A surrogate whose derivative is the estimator E[hard Z^T] / sigma and whose value is 0.
  proj = jnp.sum(z * s, axis=-1)[..., None, None] / sigma  # (S, ..., 1, 1)
  surrogate = jnp.mean(hard * proj, axis=0)
  # (surrogate - stop(surrogate)) is exactly 0: added to value after the subtraction, the
  # surrogate's size (sum(z x) / sigma, 1e11 at x ~ 1e10) never rounds value away.
  return value + (surrogate - jax.lax.stop_gradient(surrogate))


def perturbed_topk_mask(x: ArrayLike, k: int, *, sigma: ArrayLike = 0.1, num_samples: int = 100,
                        key: ArrayLike, axis: int = -1) -> jax.Array:
  r"""Perturbed top-k mask :math:`y_\sigma(x)`, by Monte Carlo.

  The perturbed optimizer of Berthet et al. (2020, "Learning with differentiable
  perturbed optimizers", NeurIPS) for the top-k linear program:
  :math:`y_\sigma(x) = \mathbb{E}_Z[\mathrm{topk\_mask}(x + \sigma Z)]`,
  :math:`Z \sim \mathcal{N}(0, I)`, estimated with ``num_samples`` draws, and its
  Jacobian by the same draws (:func:`perturbed_topk_memberships` with ``ks=(k,)``).
  Cost: :math:`O(S\, n \log n)` time and :math:`O(S n)` memory for ``S = num_samples``.

  Args:
    x: float array (float16, bfloat16, float32 or float64).
    k: number of entries to select, an int, 1 <= k <= n.
    sigma: noise scale, > 0 (default 0.1).
    num_samples: Monte Carlo draws, an int >= 1 (default 100).
    key: a ``jax.random`` key (required).
    axis: the axis to select along (default -1, the last).

  Returns:
    The mask, a float array of the shape and (float) dtype of ``x``: entries in
    [0, 1], each row along ``axis`` summing to ``k``. Random in value and gradient
    (error of order :math:`1/\sqrt{S}`); not exactly sparse in general.

  Example:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> from implicit_topk import baselines
    >>> y = baselines.perturbed_topk_mask(jnp.array([0.3, 2.0, 1.0]), 1, sigma=0.5,
    ...                                   num_samples=1000, key=jax.random.key(0))
    >>> y.shape
    (3,)
    >>> int(jnp.argmax(y)), float(jnp.round(y.sum(), 3))
    (1, 1.0)
  """
  x = _validation.as_float_input(x)
  axis = _validation.canonicalize_axis(axis, x.ndim)
  y = perturbed_topk_memberships(x, (k,), sigma=sigma, num_samples=num_samples, key=key, axis=axis)
  return jnp.moveaxis(y[..., 0, :], -1, axis)
