"""Baselines: hand-computed values, structural checks, and peer cross-checks.

The peers (diffsort / difftopk on CPU PyTorch) are optional: those tests are skipped
when torch, diffsort or difftopk cannot be imported. ott-jax is in the test extra.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import norm

import implicit_topk as itk
from implicit_topk import baselines as B
from gradcheck import check_grads

NETS = ("odd_even", "bitonic")
DISTS = ("logistic", "logistic_phi", "cauchy")


def _torch_peers():
  torch = pytest.importorskip("torch")
  diffsort = pytest.importorskip("diffsort")
  difftopk = pytest.importorskip("difftopk")
  return torch, diffsort, difftopk


def _as_peer_x(perm):
  """Our P[..., i, j] (descending ranks) -> diffsort's X[..., j, position] (ascending)."""
  return np.flip(np.swapaxes(np.asarray(perm), -1, -2), -1)


# ---------------------------------------------------------------- NeuralSort / SoftSort


def test_neuralsort_softsort_hand_n2():
  a, b, tau = 0.7, -0.4, 0.5
  s = jax.nn.sigmoid((a - b) / tau)
  expected = np.array([[s, 1 - s], [1 - s, s]])
  np.testing.assert_allclose(B.neuralsort(jnp.array([a, b]), tau=tau), expected, atol=1e-12)
  np.testing.assert_allclose(B.softsort(jnp.array([a, b]), tau=tau), expected, atol=1e-12)


@pytest.mark.parametrize("fn", [B.neuralsort, B.softsort])
def test_relaxed_permutations_limits(fn):
  x = jnp.array([[0.3, -1.2, 2.5, 0.9, -0.1]])
  perm = fn(x, tau=1e-3)
  order = np.argsort(-np.asarray(x[0]))
  np.testing.assert_allclose(perm[0], np.eye(5)[order], atol=1e-9)
  np.testing.assert_allclose(fn(x, tau=0.7).sum(-1), 1.0, atol=1e-12)  # row-stochastic
  check_grads(lambda z: fn(z, tau=0.7), (x,), modes=("rev",))


def test_neuralsort_softsort_match_difftopk():
  torch, _, difftopk = _torch_peers()
  x = np.random.default_rng(0).normal(size=(3, 9)).astype(np.float32)  # difftopk's NeuralSort is float32
  ours = B.neuralsort(jnp.asarray(x, jnp.float64), tau=0.7)
  peer = difftopk.NeuralSort(tau=0.7)(torch.tensor(x)).numpy()
  np.testing.assert_allclose(_as_peer_x(ours), peer, atol=1e-5)
  ours = B.softsort(jnp.asarray(x, jnp.float64), tau=0.7)
  peer = difftopk.SoftSort(tau=0.7)(-torch.tensor(x, dtype=torch.float64)).transpose(-2, -1).numpy()
  np.testing.assert_allclose(_as_peer_x(ours), peer, atol=1e-10)


# ---------------------------------------------------------------- sorting networks


@pytest.mark.slow  # the peers' methods: the default run keeps their hand-computed cases
@pytest.mark.parametrize("network", ["odd_even", "bitonic"])
def test_sorting_network_hard_limit_and_topk_rows(network):
  rng = np.random.default_rng(1)
  for n in (2, 5, 13):
    x = jnp.asarray(rng.normal(size=(2, n)))
    values, _ = B.sorting_network(x, network=network, steepness=1e7, distribution="logistic")
    np.testing.assert_allclose(values, -np.sort(-np.asarray(x), axis=-1), atol=1e-9)
  k = 4
  for dist in DISTS:
    _, full = B.sorting_network(x, network=network, steepness=2.0, distribution=dist)
    np.testing.assert_allclose(full.sum(-1), 1.0, atol=1e-12)  # doubly stochastic
    np.testing.assert_allclose(full.sum(-2), 1.0, atol=1e-12)
    _, topk = B.sorting_network(x, network=network, steepness=2.0, distribution=dist, k=k)
    np.testing.assert_allclose(topk, full[..., :k, :], atol=1e-12)


@pytest.mark.slow
def test_sorting_network_grads_and_validation():
  x = jnp.asarray(np.random.default_rng(2).normal(size=(2, 6)))
  check_grads(lambda z: B.sorting_network(z, network="bitonic", steepness=2.0, k=2)[1], (x,), modes=("fwd", "rev"))
  with pytest.raises(ValueError, match="distribution"):
    B.sorting_network(x, distribution="gumbel")
  with pytest.raises(ValueError, match="network"):
    B.sorting_network(x, network="bubble")


@pytest.mark.parametrize("network", NETS)
def test_sorting_networks_match_diffsort_and_difftopk(network):
  torch, diffsort, difftopk = _torch_peers()
  rng = np.random.default_rng(3)
  for n in (5, 8):
    x = rng.normal(size=(3, n))
    for dist in DISTS:
      values, perm = B.sorting_network(jnp.asarray(x), network=network, steepness=3.0, distribution=dist,
                                       art_lambda=0.4)
      sorter = diffsort.DiffSortNet(network, n, steepness=3.0, distribution=dist, art_lambda=0.4)
      sorter.sorting_network = [[m.double() for m in layer] for layer in sorter.sorting_network]
      peer_values, peer_x = sorter(torch.tensor(x))
      np.testing.assert_allclose(_as_peer_x(perm), peer_x.numpy(), atol=1e-10)
      np.testing.assert_allclose(np.flip(np.asarray(values), -1), peer_values.numpy(), atol=1e-10)
      k = 3
      _, topk = B.sorting_network(jnp.asarray(x), network=network, steepness=3.0, distribution=dist,
                                  art_lambda=0.4, k=k)
      default = torch.get_default_dtype()
      torch.set_default_dtype(torch.float64)  # difftopk builds its identity in the default dtype
      try:
        net = difftopk.DiffTopkNet(network, n, k, sparse=False, steepness=3.0, distribution=dist, art_lambda=0.4)
        net.sorting_network = [[m.double() for m in layer] for layer in net.sorting_network]
        _, peer_topk = net(torch.tensor(x))
      finally:
        torch.set_default_dtype(default)
      np.testing.assert_allclose(_as_peer_x(topk), peer_topk.numpy(), atol=1e-10)


# ---------------------------------------------------------------- perturbed


def test_perturbed_hand_n2():
  # y_1 = P(x_1 + s Z_1 > x_2 + s Z_2) = Phi((x_1 - x_2) / (s sqrt 2)); its x_1-derivative phi(.)/(s sqrt 2).
  x, sigma, samples = jnp.array([0.1, 0.0]), 0.2, 200_000
  key = jax.random.PRNGKey(0)
  z = 0.1 / (sigma * math.sqrt(2))
  y = B.perturbed_topk_mask(x, 1, sigma=sigma, num_samples=samples, key=key)
  np.testing.assert_allclose(y, [norm.cdf(z), norm.cdf(-z)], atol=5e-3)
  np.testing.assert_allclose(y.sum(), 1.0, atol=1e-12)
  grad = jax.grad(lambda v: B.perturbed_topk_mask(v, 1, sigma=sigma, num_samples=samples, key=key)[0])(x)
  d = norm.pdf(z) / (sigma * math.sqrt(2))
  np.testing.assert_allclose(grad, [d, -d], rtol=0.05)
  jvp = jax.jvp(lambda v: B.perturbed_topk_mask(v, 1, sigma=sigma, num_samples=samples, key=key),
                (x,), (jnp.array([1.0, 0.0]),))[1]
  np.testing.assert_allclose(jvp[0], grad[0], rtol=1e-10)  # same estimator both modes


def test_perturbed_memberships_shape_and_limits():
  x = jnp.array([[3.0, 1.0, 2.0, -1.0]])
  q = B.perturbed_topk_memberships(x, (1, 2, 3), sigma=1e-3, num_samples=16, key=jax.random.PRNGKey(1))
  np.testing.assert_allclose(q[0], [[1, 0, 0, 0], [1, 0, 1, 0], [1, 1, 1, 0]], atol=1e-12)


# ---------------------------------------------------------------- optimal transport


@pytest.mark.slow
def test_ot_topk_matches_ott(epsilon=0.05):
  from ott.tools import soft_sort

  x = jnp.asarray(np.random.default_rng(4).normal(size=(3, 9)))
  weights = jnp.arange(9.0)

  def value_and_grad(fn):
    def objective(z):
      mask = fn(z)
      return jnp.sum(mask * weights), mask
    (_, mask), grad = jax.jit(jax.value_and_grad(objective, has_aux=True))(x)
    return mask, grad

  ours = value_and_grad(lambda z: B.ot_topk_mask(z, 3, epsilon=epsilon))
  peer = value_and_grad(lambda z: soft_sort.topk_mask(z, k=3, epsilon=epsilon, threshold=1e-12,
                                                      max_iterations=100_000))
  np.testing.assert_allclose(ours[0], peer[0], atol=1e-5)
  np.testing.assert_allclose(ours[1], peer[1], atol=1e-5)


@pytest.mark.slow
def test_ot_topk_is_a_sigmoid_topk_and_grads():
  x = jnp.asarray(np.random.default_rng(5).normal(size=(2, 7)))
  eps = 0.05
  u = jax.nn.sigmoid((x - x.mean(-1, keepdims=True)) / (x.std(-1, keepdims=True) + 1e-10))
  ours = B.ot_topk_mask(x, 2.5, epsilon=eps)
  np.testing.assert_allclose(ours.sum(-1), 2.5, atol=1e-8)
  sig = itk.soft_topk_mask(u, 2.5, regularization_strength=eps / 2, regularizer=itk.BinaryEntropy(), solver="threshold")
  np.testing.assert_allclose(ours, sig, atol=1e-8)
  check_grads(lambda z: B.ot_topk_mask(z, 2, epsilon=0.1), (x,), modes=("rev",))
  plain = B.ot_topk_mask(x, 2, epsilon=0.1, polish=False, max_iter=5000)
  np.testing.assert_allclose(plain, B.ot_topk_mask(x, 2, epsilon=0.1), atol=1e-6)


def test_memberships_from_permutation():
  perm = jnp.eye(4)[jnp.array([2, 0, 3, 1])]
  np.testing.assert_allclose(B.memberships_from_permutation(perm, (1, 3)), [[0, 0, 1, 0], [1, 0, 1, 1]])


def test_memberships_from_permutation_checks_ks():
  perm = B.neuralsort(jnp.array([0.3, 2.0, 1.0]))
  for ks in ((0,), (4,), (1, 2.0), (True,)):
    with pytest.raises(ValueError, match="`ks` must hold Python ints with 1 <= k <= r = 3"):
      B.memberships_from_permutation(perm, ks)


# ---------------------------------------------------------------- edges found by an audit


@pytest.mark.parametrize("scale", [1e10, 1e30])
def test_perturbed_mask_far_from_unit_scale_is_the_hard_mask(scale):
  """The estimator's surrogate (about sum(z x) / sigma) was added to the value before it was
  subtracted, rounding the value away: all zeros at scale 1e10 in float32."""
  x = jnp.array([3.0, 1.0, -2.0], jnp.float32) * scale
  y = B.perturbed_topk_mask(x, 1, sigma=0.1, num_samples=10, key=jax.random.key(0))
  np.testing.assert_array_equal(y, [1.0, 0.0, 0.0])


def test_perturbed_mask_is_shift_invariant_in_value():
  x = jnp.asarray(np.random.default_rng(2).normal(size=(3, 20)))
  key, samples = jax.random.key(3), 64
  plain = B.perturbed_topk_mask(x, 5, sigma=0.5, num_samples=samples, key=key)
  shifted = B.perturbed_topk_mask(x + 1e6, 5, sigma=0.5, num_samples=samples, key=key)
  np.testing.assert_array_equal(shifted, plain)
  np.testing.assert_array_equal(np.asarray(plain) * samples, np.round(np.asarray(plain) * samples))
  np.testing.assert_array_equal(np.asarray(plain).sum(-1), 5.0)


def _ot_mask_by_bisection(u, k, eps):
  """The OT mask sigmoid((2u - 1 + g) / eps) at the root g of sum = k, by bisection
  (numpy, float64; independent of the library's Sinkhorn and Newton)."""
  c = 2.0 * np.asarray(u, np.float64) - 1.0
  lo, hi = -c.max() - 60 * eps, -c.min() + 60 * eps
  mask = lambda g: 0.5 * (1.0 + np.tanh((c + g) / (2 * eps)))
  for _ in range(200):
    mid = 0.5 * (lo + hi)
    lo, hi = (mid, hi) if mask(mid).sum() < k else (lo, mid)
  return mask(0.5 * (lo + hi))


@pytest.mark.parametrize("epsilon", [1e-3, 3e-4, 1e-5])
def test_ot_mask_sums_to_k_at_small_epsilon(epsilon):
  """At small epsilon a saturated row's slope is ~0 and the clipped Newton polish
  oscillated: masks summed to 4 or 1 for k = 3 at epsilon = 3e-4, and 87 of 100 rows
  of n = 100 were off at 5e-4 (by up to 72). Now a bracketed Newton."""
  x = np.concatenate([[[1.02, 1.83, 0.97, -0.56, -0.15, 1.05, 0.27, 0.80] + [0.0] * 92],
                      np.random.default_rng(6).normal(size=(5, 100))])
  x = jnp.asarray(x)
  y = np.asarray(B.ot_topk_mask(x, 10, epsilon=epsilon))
  np.testing.assert_allclose(y.sum(-1), 10.0, rtol=0, atol=1e-8)
  u = jax.nn.sigmoid((x - x.mean(-1, keepdims=True)) / (x.std(-1, keepdims=True) + 1e-10))
  for row, u_row in zip(y, np.asarray(u)):
    np.testing.assert_allclose(row, _ot_mask_by_bisection(u_row, 10, epsilon), rtol=0, atol=1e-6)


def test_softsort_below_power_one_has_finite_gradients():
  x = jnp.array([0.3, 2.0, 1.0, -0.7])
  grad = jax.grad(lambda z: jnp.sum(B.softsort(z, power=0.5) * jnp.arange(16.0).reshape(4, 4)))(x)
  assert np.all(np.isfinite(np.asarray(grad)))
  s = -np.sort(-np.asarray(x))
  expected = np.exp(-np.abs(np.asarray(x)[None, :] - s[:, None]) ** 0.5)
  np.testing.assert_allclose(B.softsort(x, power=0.5), expected / expected.sum(-1, keepdims=True),
                             rtol=1e-12)
