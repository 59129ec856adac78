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
memory for ``S = num_samples``, forward and backward. The output is never exactly sparse
and both the value and the gradient are random (error :math:`O(1/\sqrt{S})`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from implicit_topk import _validation


def perturbed_topk_memberships(x, ks, *, sigma=0.1, num_samples: int = 100, key, axis: int = -1):
  r"""Perturbed top-k masks for several ``k`` at once (shared noise draws).

  Args:
    x: float array.
    ks: a sequence of ints, each 1 <= k <= n.
    sigma: noise scale > 0.
    num_samples: Monte Carlo draws, >= 1.
    key: a ``jax.random`` key.
    axis: the axis to select along.

  Returns:
    Array of shape ``batch + (len(ks), n)``: entry ``[..., i, j]`` estimates
    :math:`P(j \in \mathrm{top}_{k_i}(x + \sigma Z))`. Differentiable in ``x`` by the
    Monte Carlo Jacobian estimator above (forward and reverse mode).
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
  return value + surrogate - jax.lax.stop_gradient(surrogate)


def perturbed_topk_mask(x, k: int, *, sigma=0.1, num_samples: int = 100, key, axis: int = -1):
  r"""Perturbed top-k mask :math:`y_\sigma(x)` (see the module doc), same shape as ``x``."""
  x = _validation.as_float_input(x)
  axis = _validation.canonicalize_axis(axis, x.ndim)
  y = perturbed_topk_memberships(x, (k,), sigma=sigma, num_samples=num_samples, key=key, axis=axis)
  return jnp.moveaxis(y[..., 0, :], -1, axis)
