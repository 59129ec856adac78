r"""Differentiable sorting networks (Petersen et al., ICML 2021 / ICLR 2022; diffsort, difftopk).

A sorting network is a fixed sequence of layers of disjoint comparators ``(lo, hi)``. A
relaxed comparator mixes its two wires with :math:`\alpha = \sigma(\beta (b - a))`,
:math:`a = x_{lo},\ b = x_{hi}`:

.. math::

    x_{lo} \leftarrow \alpha a + (1 - \alpha) b \ (\text{soft min}), \qquad
    x_{hi} \leftarrow (1 - \alpha) a + \alpha b \ (\text{soft max}),

with :math:`\sigma` the CDF of the chosen relaxation (``distribution``):

* ``"logistic"``: :math:`\sigma(v) = 1/(1 + e^{-v})`;
* ``"logistic_phi"`` (the activation replacement trick, ART):
  :math:`\alpha = \mathrm{logistic}(\beta v / (|v| + 10^{-10})^{\lambda})`, ``lambda = art_lambda``;
* ``"cauchy"``: :math:`\alpha = \arctan(\beta v)/\pi + 1/2` (monotonic, Petersen et al. 2022).

The wires end sorted ascending (the max on the last wire, as in diffsort). The relaxed
permutation matrix is the product of the layers' 2x2 mixings. One kernel serves every
network and relaxation: the network is data (arrays of comparator indices, one row per
layer, padded with a dummy wire), the relaxation a function of ``b - a``.

Cost, for ``L`` layers (odd-even: ``L = n``; bitonic: ``L = log2(N)(log2(N)+1)/2`` with
``N`` the next power of 2), about ``n/2`` comparators each:

* the soft sorted values: :math:`O(L n)` time and memory;
* the full relaxed permutation matrix (diffsort's ``DiffSortNet``): :math:`O(L n^2)` time,
  :math:`O(n^2)` memory (plus :math:`O(L n^2)` saved for reverse mode);
* the top-k attribution matrix (difftopk's ``DiffTopkNet``, its "sparse" evaluation): the
  layers' mixings applied to the ``k`` top output wires from the last layer back,
  :math:`O(L n k)` time, :math:`O(n k + L n)` memory; identical to the top-k columns of the
  full matrix. (difftopk's dense variant costs :math:`O(L n^2 k)`; its sparse one needs
  ``torch-sparse``.)
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from implicit_topk import _validation

NETWORKS = ("odd_even", "bitonic")
DISTRIBUTIONS = ("logistic", "logistic_phi", "cauchy")


def odd_even_layers(n: int) -> list[list[tuple[int, int]]]:
  """The odd-even transposition sorting network on ``n`` wires.

  The network used by Petersen et al. (2021, "Differentiable sorting networks for
  scalable sorting and ranking supervision", ICML): ``n`` layers, alternately comparing
  the wire pairs ``(0, 1), (2, 3), ...`` and ``(1, 2), (3, 4), ...``; it sorts any input
  of length ``n``.

  Args:
    n: the number of wires, >= 0.

  Returns:
    A list of ``n`` layers, each a list of comparators ``(lo, hi)`` (ints, ``lo < hi``):
    after the comparator, wire ``lo`` holds the smaller and wire ``hi`` the larger value.

  Example:
    >>> from implicit_topk import baselines
    >>> baselines.odd_even_layers(4)
    [[(0, 1), (2, 3)], [(1, 2)], [(0, 1), (2, 3)], [(1, 2)]]
  """
  return [[(i, i + 1) for i in range(layer % 2, n - 1, 2)] for layer in range(n)]


def bitonic_layers(n: int) -> list[list[tuple[int, int]]]:
  """The bitonic sorting network on ``N = 2**ceil(log2 n)`` wires, the first ``N - n`` discarded.

  The bitonic network of Petersen et al. (2021, "Differentiable sorting networks for
  scalable sorting and ranking supervision", ICML), as diffsort's ``bitonic_network``:
  ``log2(N) (log2(N) + 1) / 2`` layers; comparators touching a discarded wire are dropped
  (identity), and comparators whose block sorts descending swap ``lo`` and ``hi``.

  Args:
    n: the number of wires, >= 1.

  Returns:
    A list of layers, each a list of comparators ``(lo, hi)`` (ints in ``[0, n)``):
    after the comparator, wire ``lo`` holds the smaller and wire ``hi`` the larger value
    (``lo > hi`` for the descending blocks).

  Example:
    >>> from implicit_topk import baselines
    >>> baselines.bitonic_layers(4)
    [[(0, 1), (3, 2)], [(0, 2), (1, 3)], [(0, 1), (2, 3)]]
  """
  blocks = math.ceil(math.log2(n)) if n > 1 else 0
  big = 2 ** blocks
  off = big - n
  layers = []
  for block in range(blocks):
    for layer in range(block + 1):
      m = 2 ** (block - layer)
      comps = []
      for i in range(0, big, 2 * m):
        for j in range(m):
          a, b = i + j, i + j + m
          if a >= off and b >= off:
            if ((i + j) // 2 ** (block + 1)) % 2 == 1:
              a, b = b, a
            comps.append((a - off, b - off))
      layers.append(comps)
  return layers


@functools.lru_cache(maxsize=64)
def network_arrays(network: str, n: int) -> tuple[np.ndarray, np.ndarray]:
  """The comparator indices of a sorting network as padded integer arrays (cached).

  Args:
    network: ``"odd_even"`` (:func:`odd_even_layers`) or ``"bitonic"``
      (:func:`bitonic_layers`).
    n: the number of wires, >= 1.

  Returns:
    ``(lo, hi)``, two NumPy ``int32`` arrays of shape ``(L, C)`` (``L`` layers, at least
    1; ``C`` the widest layer's comparator count, at least 1), padded with the dummy
    wire ``n``.

  Example:
    >>> from implicit_topk.baselines.sorting_networks import network_arrays
    >>> lo, hi = network_arrays("odd_even", 3)
    >>> lo.ravel().tolist(), hi.ravel().tolist()
    ([0, 1, 0], [1, 2, 1])
  """
  _validation.check_choice(network, "network", NETWORKS)
  layers = odd_even_layers(n) if network == "odd_even" else bitonic_layers(n)
  width = max([len(c) for c in layers] + [1])
  lo = np.full((max(len(layers), 1), width), n, dtype=np.int32)
  hi = np.full_like(lo, n)
  for li, comps in enumerate(layers):
    for ci, (a, b) in enumerate(comps):
      lo[li, ci], hi[li, ci] = a, b
  return lo, hi


def relaxed_swap_prob(v: ArrayLike, steepness: ArrayLike, distribution: str,
                      art_lambda: ArrayLike = 0.25) -> jax.Array:
  r"""The mixing weight :math:`\alpha(v)` of a relaxed comparator, ``v = b - a``.

  The weight of ``a`` in the soft minimum of a relaxed comparator: the logistic and
  ``logistic_phi`` (activation replacement trick) relaxations of Petersen et al. (2021,
  "Differentiable sorting networks for scalable sorting and ranking supervision",
  ICML), and the monotonic Cauchy relaxation of Petersen et al. (2022, "Monotonic
  differentiable sorting networks", ICLR):

  * ``"logistic"``: :math:`\alpha = 1/(1 + e^{-\beta v})`;
  * ``"logistic_phi"``: :math:`\alpha = \mathrm{logistic}(\beta v / (|v| + 10^{-10})^{\lambda})`;
  * ``"cauchy"``: :math:`\alpha = \arctan(\beta v)/\pi + 1/2`.

  Args:
    v: real array, the differences ``b - a`` of the compared wires.
    steepness: the inverse temperature :math:`\beta > 0` (scalar or broadcastable to
      ``v``).
    distribution: ``"logistic"``, ``"logistic_phi"`` or ``"cauchy"``.
    art_lambda: :math:`\lambda \ge 0` of ``"logistic_phi"`` (default 0.25); unused
      otherwise.

  Returns:
    Array of the broadcast shape of ``v`` and ``steepness``, entries in (0, 1),
    increasing in ``v``; 1/2 at ``v = 0``.

  Raises:
    ValueError: for an unknown ``distribution``.

  Example:
    >>> import jax.numpy as jnp
    >>> from implicit_topk import baselines
    >>> baselines.relaxed_swap_prob(jnp.array([-1.0, 0.0, 1.0]), 1.0, "cauchy")
    Array([0.25, 0.5 , 0.75], dtype=float32)
  """
  if distribution == "logistic":
    return jax.nn.sigmoid(steepness * v)
  if distribution == "logistic_phi":
    return jax.nn.sigmoid(steepness * v / (jnp.abs(v) + 1e-10) ** art_lambda)
  if distribution == "cauchy":
    return jnp.arctan(steepness * v) / jnp.pi + 0.5
  raise ValueError(f"`distribution` must be one of {sorted(DISTRIBUTIONS)}; got {distribution!r}.")


def _mix_rows(v, lo, hi, alpha):
  """Applies one layer's symmetric 2x2 mixings to the rows (axis -2) of ``v``."""
  a, b = v[..., lo, :], v[..., hi, :]
  al = alpha[..., :, None]
  new_lo = al * a + (1 - al) * b
  new_hi = (1 - al) * a + al * b
  return v.at[..., lo, :].set(new_lo).at[..., hi, :].set(new_hi)


def sorting_network(x: ArrayLike, *, network: str = "odd_even", steepness: ArrayLike = 10.0,
                    distribution: str = "cauchy", art_lambda: ArrayLike = 0.25,
                    k: int | None = None, axis: int = -1) -> tuple[jax.Array, jax.Array]:
  r"""Differentiable sorting network: soft sorted values and relaxed permutation matrix.

  Differentiable sorting networks (Petersen et al., 2021, "Differentiable sorting
  networks for scalable sorting and ranking supervision", ICML; the Cauchy relaxation
  from Petersen et al., 2022, "Monotonic differentiable sorting networks", ICLR) replace
  each comparator of a sorting network by a soft one (:func:`relaxed_swap_prob`); the
  relaxed permutation matrix is the product of the layers' mixings:

  .. math::
      \hat P = M_L \cdots M_1, \qquad M_\ell = \text{layer } \ell\text{'s relaxed comparators}
      \ (\text{symmetric } 2\times 2 \text{ blocks } [[\alpha, 1-\alpha], [1-\alpha, \alpha]]).

  With ``k=None`` this is diffsort's ``DiffSortNet`` (the full :math:`n \times n` matrix,
  :math:`O(L n^2)`); with an int ``k`` it is difftopk's ``DiffTopkNet`` (Petersen et al.,
  2022, "Differentiable top-k classification learning", ICML): the :math:`k \times n`
  top-k attribution matrix by the reverse pass, :math:`O(L n k)`, equal to the top ``k``
  rows of the full matrix.

  Args:
    x: float array (float16, bfloat16, float32 or float64); sorted along ``axis``, whose size
      ``n`` must be >= 2.
    network: ``"odd_even"`` (default, ``L = n`` layers) or ``"bitonic"``
      (``L = log2(N) (log2(N) + 1) / 2``, ``N`` the next power of 2).
    steepness: the inverse temperature :math:`\beta > 0` (default 10.0).
    distribution: ``"cauchy"`` (default, monotonic), ``"logistic"`` or
      ``"logistic_phi"`` (logistic with the activation replacement trick).
    art_lambda: :math:`\lambda \ge 0` of ``"logistic_phi"`` (default 0.25).
    k: ``None`` (default; the full matrix) or an int, 1 <= k <= n (the top-k rows).
    axis: the axis to sort (default -1, the last).

  Returns:
    ``(values, P)``, float arrays of the (float) dtype of ``x``: ``values`` the soft
    sorted values in descending order, shape ``batch + (n,)`` (``batch + (k,)`` with
    ``k``; ``batch`` = the shape of ``x`` without ``axis``); ``P`` of shape
    ``batch + (n, n)`` (``batch + (k, n)``) with ``P[..., i, j]`` the weight of input
    ``j`` at rank ``i`` (0 = largest). diffsort/difftopk's ``X`` is ``P`` transposed and
    flipped along ``i`` (``X[..., j, -1 - i] == P[..., i, j]``).

  Example:
    >>> import jax.numpy as jnp
    >>> from implicit_topk import baselines
    >>> x = jnp.array([0.3, 2.0, 1.0])
    >>> values, p = baselines.sorting_network(x, steepness=10.0)
    >>> values.shape, p.shape
    ((3,), (3, 3))
    >>> jnp.round(p, 2)
    Array([[0.02      , 0.95      , 0.03      ],
           [0.04      , 0.03      , 0.91999996],
           [0.94      , 0.02      , 0.04      ]], dtype=float32)
    >>> values_k, p_k = baselines.sorting_network(x, network="bitonic", k=1)
    >>> p_k.shape
    (1, 3)
  """
  x = _validation.as_float_input(x)
  axis = _validation.canonicalize_axis(axis, x.ndim)
  _validation.check_choice(distribution, "distribution", DISTRIBUTIONS)
  _validation.check_positive(steepness, "steepness")
  n = x.shape[axis]
  if n < 2:
    raise ValueError(f"`x` must have at least 2 entries along `axis`; got n={n}.")
  if k is not None:
    _validation.check_k(k, n, integer=True, allow_zero=False)
  lo, hi = (jnp.asarray(a) for a in network_arrays(network, n))
  s = jnp.moveaxis(x, axis, -1)
  batch = s.shape[:-1]
  dtype = s.dtype
  steep = jnp.asarray(steepness, dtype)
  lam = jnp.asarray(art_lambda, dtype)
  wires = jnp.concatenate([s, jnp.zeros(batch + (1,), dtype)], axis=-1)  # dummy wire n

  def layer_values(w, lo_l, hi_l):
    a, b = w[..., lo_l], w[..., hi_l]
    alpha = relaxed_swap_prob(b - a, steep, distribution, lam)
    w = w.at[..., lo_l].set(alpha * a + (1 - alpha) * b).at[..., hi_l].set((1 - alpha) * a + alpha * b)
    return w, alpha

  if k is None:
    def step(carry, idx):
      w, v = carry
      w, alpha = layer_values(w, *idx)
      return (w, _mix_rows(v, idx[0], idx[1], alpha)), None

    v0 = jnp.broadcast_to(jnp.eye(n + 1, n, dtype=dtype), batch + (n + 1, n))
    (wires, v), _ = jax.lax.scan(step, (wires, v0), (lo, hi))
    values = jnp.flip(wires[..., :n], axis=-1)
    return values, jnp.flip(v[..., :n, :], axis=-2)

  def forward(w, idx):
    w, alpha = layer_values(w, *idx)
    return w, alpha

  wires, alphas = jax.lax.scan(forward, wires, (lo, hi))  # alphas: (L,) + batch + (C,)

  def backward(e, inputs):
    lo_l, hi_l, alpha = inputs
    return _mix_rows(e, lo_l, hi_l, alpha), None

  # e[..., wire, r] = 1 where wire = n - 1 - r: the k top output wires, largest first.
  e0 = jnp.zeros((n + 1, k), dtype).at[n - 1 - jnp.arange(k), jnp.arange(k)].set(1.0)
  e0 = jnp.broadcast_to(e0, batch + (n + 1, k))
  e, _ = jax.lax.scan(backward, e0, (lo, hi, alphas), reverse=True)
  values = jnp.flip(wires[..., :n], axis=-1)[..., :k]
  return values, jnp.swapaxes(e[..., :n, :], -1, -2)
