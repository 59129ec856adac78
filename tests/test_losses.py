"""Losses: hand-checkable values, gradient checks, difftopk cross-checks (optional peer)."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads as jax_check_grads

from implicit_topk import losses as L
from gradcheck import check_grads

RNG = np.random.default_rng(0)
LOGITS = jnp.asarray(RNG.normal(size=(6, 10)) * 2)
LABELS = jnp.asarray(RNG.integers(0, 10, size=6))


def _ce(logits, labels):
  return -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1)[:, 0]  # per example


# ---------------------------------------------------------------- top-k cross-entropy


def test_topk_ce_top1_is_softmax_ce():
  ce = _ce(LOGITS, LABELS)
  for mode in ("sm", "smce"):
    np.testing.assert_allclose(L.topk_cross_entropy(LOGITS, LABELS, p_k=[1, 0, 0, 0, 0], top1_mode=mode,
                                                    eps=0.0 if mode == "sm" else 1e-7), ce, rtol=1e-6)
  np.testing.assert_allclose(L.topk_cross_entropy(LOGITS, LABELS, p_k=[1.0], eps=0.0), ce, rtol=1e-14)
  # The default eps floor: -log((1 - 2 eps) D + eps), within 2 eps / D of the CE.
  np.testing.assert_allclose(L.topk_cross_entropy(LOGITS, LABELS, p_k=[1, 0, 0]), ce, rtol=1e-5)


def test_topk_ce_hand_values_and_exact_zero():
  # scores (3, 1, 2), l = 0.5 <= every gap: the sparse mask is the hard top-2 mask (1, 0, 1).
  logits = jnp.array([[3.0, 1.0, 2.0], [3.0, 1.0, 2.0]])
  labels = jnp.array([0, 1])
  losses = L.topk_cross_entropy(logits, labels, p_k=[0, 1], top1_mode="sort", regularization_strength=0.5, reduction="none")
  np.testing.assert_allclose(losses, [-math.log1p(-1e-7), -math.log(1e-7)], rtol=1e-12)
  # "sm" with p_k = (1/2, 1/2): D = softmax/2 + 1/2 * top2 membership.
  sm = jax.nn.softmax(logits[0])
  losses = L.topk_cross_entropy(logits, labels, p_k=[0.5, 0.5], regularization_strength=0.5, eps=0.0, reduction="none")
  np.testing.assert_allclose(losses, [-math.log(sm[0] / 2 + 0.5), -math.log(sm[1] / 2)], rtol=1e-12)
  # Where the label's probability is exactly 0 the gradient is exactly 0, never NaN.
  grad = jax.grad(lambda z: L.topk_cross_entropy(z, labels, p_k=[0, 1], top1_mode="sort",
                                                 regularization_strength=0.5).sum())(logits)
  assert np.all(np.isfinite(grad)) and np.all(grad[1] == 0)


def test_topk_ce_standardize_matches_a_reference():
  """standardize=True: the memberships are the mask at strength l * std(row) (an
  independent reference solve), and the top-k terms do not move under c * x + b."""
  import references

  pk, l, eps = [0.0, 0.5, 0.0, 0.5], 0.7, 1e-7
  ours = L.topk_cross_entropy(LOGITS, LABELS, p_k=pk, regularization_strength=l, standardize=True)
  x, c = np.asarray(LOGITS), np.asarray(LABELS)
  expected = []
  for row, label in zip(x, c):
    strength = l * row.std()
    d = sum(w * references.soft_topk_mask(row, float(k), l=strength)[label]
            for k, w in enumerate(pk, start=1) if w > 0 and k > 1)
    expected.append(-math.log((1 - 2 * eps) * d + eps))
  np.testing.assert_allclose(ours, expected, rtol=1e-9)
  # Without weight on k = 1 the loss does not depend on the scale or shift of the logits.
  moved = L.topk_cross_entropy(25.0 * LOGITS - 3.0, LABELS, p_k=pk, regularization_strength=l,
                               standardize=True)
  np.testing.assert_allclose(moved, ours, rtol=1e-9)
  assert not np.allclose(L.topk_cross_entropy(25.0 * LOGITS, LABELS, p_k=pk, regularization_strength=l),
                         L.topk_cross_entropy(LOGITS, LABELS, p_k=pk, regularization_strength=l))
  with pytest.raises(ValueError, match="standardize"):
    L.topk_cross_entropy(LOGITS, LABELS, p_k=pk, method="neuralsort", standardize=True)


@pytest.mark.slow
def test_topk_ce_grads():
  pk = [0.5, 0.0, 0.25, 0.25]
  check_grads(lambda z: L.topk_cross_entropy(z, LABELS, p_k=pk, regularization_strength=2.0), (LOGITS,), modes=("rev",))


def test_topk_ce_validation():
  with pytest.raises(ValueError, match="p_k"):
    L.topk_cross_entropy(LOGITS, LABELS, p_k=[0.5, 0.4])
  with pytest.raises(ValueError, match="`m`"):
    L.topk_cross_entropy(LOGITS, LABELS, p_k=[0.5, 0.5], m=2)
  with pytest.raises(ValueError, match="eps"):
    L.topk_cross_entropy(LOGITS, LABELS, p_k=[0.0, 1.0], eps=0.0)
  with pytest.raises(ValueError, match="method"):
    L.topk_cross_entropy(LOGITS, LABELS, p_k=[1.0], method="sinkhorn")
  with pytest.raises(ValueError, match="labels"):
    L.topk_cross_entropy(LOGITS, LABELS + 10, p_k=[1.0])
  with pytest.raises(ValueError, match="key"):
    L.topk_cross_entropy(LOGITS, LABELS, p_k=[0.5, 0.5], method="perturbed")


@pytest.mark.slow
def test_topk_ce_other_methods_run():
  pk = [0.5, 0.5]
  for method in ("perturbed", "ot"):
    value = L.topk_cross_entropy(LOGITS, LABELS, p_k=pk, method=method, key=jax.random.PRNGKey(0),
                                 inverse_temperature=5.0)
    assert value.shape == LABELS.shape and np.all(np.isfinite(value))


@pytest.mark.parametrize("method", ["neuralsort", "softsort", "odd_even", "bitonic"])
def test_topk_ce_matches_difftopk(method):
  torch = pytest.importorskip("torch")
  difftopk = pytest.importorskip("difftopk")
  x = np.asarray(LOGITS, np.float32) if method == "neuralsort" else np.asarray(LOGITS)
  pk = [0.25, 0.0, 0.25, 0.0, 0.5]
  kw = dict(distribution="logistic_phi", art_lambda=0.5) if method == "bitonic" else dict(distribution="cauchy")
  for mode in ("sm", "smce", "sort"):
    for m in (None, 6):
      ours = L.topk_cross_entropy(jnp.asarray(x, jnp.float64), LABELS, p_k=pk, m=m, method=method,
                                  inverse_temperature=2.0, top1_mode=mode, reduction="mean", **kw)
      peer_name = "bitonic__non_sparse" if method == "bitonic" else method  # same values, no torch-sparse
      peer = difftopk.TopKCrossEntropyLoss(peer_name, 2.0, pk, 10, m=m, top1_mode=mode, **kw)
      if hasattr(peer, "top_k_net"):
        peer.top_k_net.sorting_network = [[a.double() for a in layer] for layer in peer.top_k_net.sorting_network]
      default = torch.get_default_dtype()
      if method != "neuralsort":
        torch.set_default_dtype(torch.float64)
      try:
        value = float(peer(torch.tensor(x), torch.tensor(np.asarray(LABELS))))
      finally:
        torch.set_default_dtype(default)
      np.testing.assert_allclose(ours, value, rtol=1e-5 if method == "neuralsort" else 1e-10)


# ---------------------------------------------------------------- Fenchel-Young


def test_fenchel_young_hand_values():
  # p = 2, k = 1: y* = sparsemax((1, 0, -1)) = (1, 0, 0); L = (1 - 1/2) + 1/2 - 0 = 1.
  theta, target = jnp.array([1.0, 0.0, -1.0]), jnp.array([0.0, 1.0, 0.0])
  fy = lambda t: L.topk_fenchel_young_loss(t, target, k=1, regularization_strength=1.0, p=2.0)
  np.testing.assert_allclose(fy(theta), 1.0, atol=1e-12)
  np.testing.assert_allclose(jax.grad(fy)(theta), [1.0, -1.0, 0.0], atol=1e-12)
  # entropy, k = 1, one-hot target: l * softmax cross-entropy of theta / l.
  theta = jnp.asarray(RNG.normal(size=(4, 6)))
  onehot = jax.nn.one_hot(jnp.array([0, 3, 5, 1]), 6)
  value = L.topk_fenchel_young_loss(theta, onehot, k=1, regularization_strength=0.5, regularizer="entropy", reduction="none")
  np.testing.assert_allclose(value, 0.5 * (jax.nn.logsumexp(theta / 0.5, -1) - jnp.sum(onehot * theta, -1) / 0.5),
                             rtol=1e-9)
  # zero iff the target is the operator's output; >= 0 otherwise.
  from implicit_topk import soft_topk_mask
  y = soft_topk_mask(theta, 2.5, regularization_strength=0.7)
  np.testing.assert_allclose(L.topk_fenchel_young_loss(theta, y, k=2.5, regularization_strength=0.7, reduction="none"), 0.0, atol=1e-10)


def test_fenchel_young_target_outside_the_capped_simplex():
  # Row 1's target sums to 3, not k = 2: its loss would be negative (-1 here), a
  # meaningless number. Concrete: a ValueError; under jit: NaN loss and gradient for that
  # row only.
  scores = jnp.array([[2.0, 1.0, 0.0], [0.0, 1.0, 3.0]])
  target = jnp.array([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
  with pytest.raises(ValueError, match=r"summing to k=2\); got row sums \[2.0, 3.0\]"):
    L.topk_fenchel_young_loss(scores, target, 2)
  loss = jax.jit(lambda s, t: L.topk_fenchel_young_loss(s, t, 2))
  value = np.asarray(loss(scores, target))
  assert value[0] == 0.0 and np.isnan(value[1])
  grad = np.asarray(jax.grad(lambda s: loss(s, target).sum())(scores))
  np.testing.assert_array_equal(grad[0], 0.0)
  assert np.all(np.isnan(grad[1]))
  # An entry above 1 (sum still k): also outside C_k.
  assert np.isnan(loss(scores, jnp.array([[1.5, 0.5, 0.0], [0.0, 1.0, 1.0]]))[0])
  assert np.isnan(loss(scores, jnp.array([[1.5, 0.5, 0.0], [0.0, 1.0, 1.0]]))).sum() == 1


@pytest.mark.slow
def test_fenchel_young_gradient_convexity():
  theta = jnp.asarray(RNG.normal(size=(3, 8)))
  target = jnp.zeros((3, 8)).at[:, :3].set(1.0)
  fy = lambda t: L.topk_fenchel_young_loss(t, target, k=3, regularization_strength=0.5, reduction="sum")
  from implicit_topk import soft_topk_mask
  np.testing.assert_allclose(jax.grad(fy)(theta), soft_topk_mask(theta, 3, regularization_strength=0.5) - target, atol=1e-10)
  jax_check_grads(fy, (theta,), order=2, modes=("rev",))
  check_grads(lambda l: L.topk_fenchel_young_loss(theta, target, k=3, regularization_strength=l), (0.5,), modes=("rev",))
  other = jnp.asarray(RNG.normal(size=(3, 8)))
  for a in (0.25, 0.5, 0.8):
    assert fy(a * theta + (1 - a) * other) <= a * fy(theta) + (1 - a) * fy(other) + 1e-10
  with pytest.raises(ValueError, match="target_mask"):
    L.topk_fenchel_young_loss(theta, target, k=2)


def _mask_bisect(theta, k, l, p=4.0 / 3.0):
  """The p-norm top-k mask by bisection on the threshold in float64 (finite entries;
  -inf gets 0 and +inf 1, k counting the +inf entries), and the threshold."""
  theta = np.asarray(theta, np.float64)
  finite = np.isfinite(theta)
  k_left = k - np.sum(theta == np.inf)

  def bisect(x):  # the mask of x, with its threshold
    mask = lambda lam: np.clip((x - lam) / l, 0.0, 1.0) ** (1.0 / (p - 1.0))
    lo, hi = x.min() - l, x.max()
    while lo < lo + (hi - lo) / 2 < hi:
      mid = lo + (hi - lo) / 2
      lo, hi = (mid, hi) if math.fsum(mask(mid)) > k_left else (lo, mid)
    return mask(lo), lo

  # Twice: the threshold of theta is only known to its ulp, so the second solve is on
  # theta minus the entry nearest the first threshold (the differences that matter, those
  # below l, are exact), where it is known to the ulp of a number below l.
  _, lam = bisect(theta[finite])
  x = theta[finite] - theta[finite][np.argmin(np.abs(theta[finite] - lam))]
  y = np.where(theta == np.inf, 1.0, 0.0)
  y[finite] = bisect(x)[0]
  return y


def _fy_reference(theta, target, k, l, p=4.0 / 3.0):
  """f*(theta) + l Omega(t) - <theta, t> on the finite entries, at the bisection mask."""
  theta, target = np.asarray(theta, np.float64), np.asarray(target, np.float64)
  y = _mask_bisect(theta, k, l, p)
  f = np.isfinite(theta)
  omega = lambda v: math.fsum((np.abs(v) ** p / p).tolist())
  return (math.fsum((theta[f] * y[f]).tolist()) - l * omega(y[f]) + l * omega(target[f])
          - math.fsum((theta[f] * target[f]).tolist()))


def _fy_exact_p2(theta, target, k, l):
  """The p = 2 loss in exact rational arithmetic: the threshold solves a piecewise linear
  equation (exactly, between two breakpoints), then f*(theta) + l/2 |t|^2 - <theta, t>."""
  from fractions import Fraction as F
  th, t, k, l = [F(float(v)) for v in theta], [F(float(v)) for v in target], F(k), F(l)
  total = lambda lam: sum(min(F(1), max(F(0), (v - lam) / l)) for v in th)
  points = sorted({v for v in th} | {v - l for v in th})
  lo = max(b for b in points if total(b) >= k)
  hi = min(b for b in points if b >= lo and total(b) <= k)
  lam = lo if hi == lo else lo + (total(lo) - k) / (total(lo) - total(hi)) * (hi - lo)
  y = [min(F(1), max(F(0), (v - lam) / l)) for v in th]
  assert sum(y) == k
  value = (sum(a * b for a, b in zip(th, y)) - l / 2 * sum(v * v for v in y)
           + l / 2 * sum(v * v for v in t) - sum(a * b for a, b in zip(th, t)))
  return float(value)


def test_fenchel_young_accurate_at_any_scale_and_offset():
  """The loss is evaluated around the threshold: no cancellation of <theta, y*> against
  <theta, t> (each ~ |theta| k), so it is accurate relative to |theta| eps, and >= 0."""
  eps = np.finfo(np.float64).eps
  base = np.random.default_rng(5).normal(size=8)
  for scale in (1e0, 1e3, 1e6, 1e9, 1e12):
    for shift in (0.0, 1e6, -3e7):
      theta = base * scale + shift
      # At the target y*(theta) (an independent bisection) the exact loss is 0.
      target = _mask_bisect(theta, 7.999, 1.0)
      value = float(L.topk_fenchel_young_loss(jnp.asarray(theta), jnp.asarray(target), 7.999))
      assert 0.0 <= value <= 4 * theta.size * eps * np.abs(theta).max(), (scale, shift, value)
      # p = 2 against exact rational arithmetic, dyadic targets (sum exactly k).
      for k, tg in ((3.0, [1, 0.5, 0.25, 0.75, 0.5, 0, 0, 0]), (2.5, [0, 0, 1, 0, 0.5, 0, 0, 1])):
        tg = np.asarray(tg, np.float64)
        got = float(L.topk_fenchel_young_loss(jnp.asarray(theta), jnp.asarray(tg), k, p=2.0,
                                              regularization_strength=0.5))
        np.testing.assert_allclose(got, _fy_exact_p2(theta, tg, k, 0.5), rtol=1e-12,
                                   err_msg=f"scale {scale}, shift {shift}, k {k}")


def test_fenchel_young_infinite_scores():
  """An infinite score whose target equals the mask there (-inf and 0, +inf and 1) drops
  out: the loss of the row without it (k less the +inf entries), gradient entry 0."""
  inf = np.inf
  rows = [  # (theta, target, k, the finite row's theta, target, k)
      ([0.5, -inf, 1.5, 0.2, -1.0], [1.0, 0.0, 0.5, 1.0, 0.0], 2.5),
      ([0.5, inf, 1.5, 0.2, -1.0], [0.5, 1.0, 1.0, 0.5, 0.0], 3.0),
      ([0.5, -inf, 1.5, inf, -1.0], [0.5, 0.0, 1.0, 1.0, 0.5], 3.0),
  ]
  theta = jnp.asarray([r[0] for r in rows])
  target = jnp.asarray([r[1] for r in rows])
  k = jnp.asarray([r[2] for r in rows])
  value = np.asarray(L.topk_fenchel_young_loss(theta, target, k, regularization_strength=0.7))
  grad = np.asarray(jax.grad(lambda s: L.topk_fenchel_young_loss(
      s, target, k, regularization_strength=0.7).sum())(theta))
  for i, (th, tg, kk) in enumerate(rows):
    th, tg = np.asarray(th), np.asarray(tg)
    f = np.isfinite(th)
    expected = _fy_reference(th[f], tg[f], kk - np.sum(th == inf), 0.7)
    np.testing.assert_allclose(value[i], expected, rtol=1e-12, atol=1e-14)
    assert np.all(np.isfinite(grad[i]))
    np.testing.assert_allclose(grad[i], _mask_bisect(th, kk, 0.7) - tg, atol=1e-12)
    assert np.all(grad[i][~f] == 0)
  # A -inf score with a positive target, a +inf score with a target below 1: +inf.
  s = jnp.asarray([[0.5, -inf, 1.5, 0.2], [0.5, inf, 1.5, 0.2]])
  t = jnp.asarray([[1.0, 0.5, 0.5, 0.0], [1.0, 0.5, 0.5, 0.0]])
  np.testing.assert_array_equal(L.topk_fenchel_young_loss(s, t, 2.0), [inf, inf])


# ---------------------------------------------------------------- smooth top-k SVM


def test_smooth_svm_hand_values():
  # k = 1: tau * logsumexp((s + alpha [j != c]) / tau) - s_c. s = (0, 0), c = 0: log(1 + e).
  np.testing.assert_allclose(L.smooth_topk_svm_loss(jnp.zeros((1, 2)), jnp.array([0]), k=1), math.log1p(math.e))
  # k = 2, n = 3, tau = 1, s = 0: subsets {0,1},{0,2} contain c = 0, {1,2} does not:
  # log(2 + e) - log(2).
  np.testing.assert_allclose(L.smooth_topk_svm_loss(jnp.zeros((1, 3)), jnp.array([0]), k=2),
                             math.log(2 + math.e) - math.log(2))
  # Small tau: the hard top-k SVM loss; smooth_hard switches to it.
  s, c = jnp.array([[2.0, 1.5, 0.0, -1.0]]), jnp.array([1])
  hard = max(0.0, (2.0 + 1 + 0.0 + 1) / 2 - (2.0 + 1.5) / 2)
  np.testing.assert_allclose(L.smooth_topk_svm_loss(s, c, k=2, tau=1e-3), hard, atol=1e-2)
  np.testing.assert_allclose(L.smooth_topk_svm_loss(s, c, k=2, tau=1e-3, mode="smooth_hard"), hard, atol=1e-12)


@pytest.mark.slow
def test_smooth_svm_grads():
  check_grads(lambda z: L.smooth_topk_svm_loss(z, LABELS, k=3, tau=0.5), (LOGITS,), modes=("fwd", "rev"))


def test_smooth_svm_matches_difftopk():
  torch = pytest.importorskip("torch")
  difftopk = pytest.importorskip("difftopk")
  x, y = torch.tensor(np.asarray(LOGITS)), torch.tensor(np.asarray(LABELS))
  for k in (1, 2, 3):
    for tau in (1.0, 0.3):
      ours = L.smooth_topk_svm_loss(LOGITS, LABELS, k, tau=tau, reduction="mean")
      np.testing.assert_allclose(ours, float(difftopk.SmoothTopKLoss(10, k, tau)(x, y)), rtol=1e-10)
      peer = difftopk.SmoothHardTopKLoss(10, k, tau)
      peer.thresh = 2.0  # so that both branches occur on these scores
      ours = L.smooth_topk_svm_loss(LOGITS, LABELS, k, tau=tau, mode="smooth_hard", thresh=2.0,
                                    reduction="mean")
      np.testing.assert_allclose(ours, float(peer(x, y)), rtol=1e-10)


def _svm_brute(s, c, k, tau, alpha):
  """Berrada et al.'s smooth top-k SVM loss by enumeration of the k-subsets (float64)."""
  from itertools import combinations
  from scipy.special import logsumexp
  s = np.asarray(s, np.float64)
  subsets = [list(S) for S in combinations(range(s.size), k)]
  a = [(alpha * (c not in S) + s[S].mean()) / tau for S in subsets]
  b = [s[S].mean() / tau for S in subsets if c in S]
  return tau * (logsumexp(a) - logsumexp(b))


def _svm_hard(s, c, k, alpha):
  """The tau -> 0 limit: max over k-subsets of alpha [c not in S] + mean, minus the max
  over those containing c (enumeration, float64)."""
  from itertools import combinations
  s = np.asarray(s, np.float64)
  subsets = [list(S) for S in combinations(range(s.size), k)]
  return (max(alpha * (c not in S) + s[S].mean() for S in subsets)
          - max(s[S].mean() for S in subsets if c in S))


def test_smooth_svm_per_example_tau_and_alpha():
  """tau and alpha: scalars or arrays broadcastable to the batch shape, in both modes."""
  x = np.random.default_rng(8).normal(size=(4, 6)) * 2
  labels = np.array([0, 1, 2, 3])
  tau, alpha = np.array([0.1, 1.0, 2.0, 0.05]), np.array([0.5, 1.0, 2.0, 0.0])
  for mode in ("smooth", "smooth_hard"):
    got = L.smooth_topk_svm_loss(x, labels, 2, tau=tau, alpha=alpha, mode=mode, thresh=5.0)
    assert got.shape == (4,)
    for i in range(4):
      top = np.sort(x[i])[::-1]
      hard = mode == "smooth_hard" and top[1] - top[2] >= 2 * tau[i] * math.log(5.0)
      ref = (_svm_hard(x[i], labels[i], 2, alpha[i]) if hard
             else _svm_brute(x[i], labels[i], 2, tau[i], alpha[i]))
      np.testing.assert_allclose(got[i], ref, rtol=1e-12, err_msg=f"{mode}, row {i}")
  # A batch of shape (2, 2): tau of shape (2, 1) is per row of the batch, alpha (2,) per column.
  got = L.smooth_topk_svm_loss(x.reshape(2, 2, 6), labels.reshape(2, 2), 2,
                               tau=tau[:2, None], alpha=alpha[:2])
  for i in range(2):
    for j in range(2):
      ref = _svm_brute(x[2 * i + j], labels[2 * i + j], 2, tau[i], alpha[j])
      np.testing.assert_allclose(got[i, j], ref, rtol=1e-12)
  for name, bad in (("tau", tau[:, None]), ("tau", np.array([[0.5]])), ("alpha", alpha[:3]),
                    ("alpha", alpha[:, None])):
    for mode in ("smooth", "smooth_hard"):
      shape = re.escape(str(bad.shape))
      with pytest.raises(ValueError, match=rf"`{name}` must be a scalar or broadcast to the "
                                           rf"batch shape \(4,\).*got shape {shape}"):
        L.smooth_topk_svm_loss(x, labels, 2, **{name: bad}, mode=mode)
  with pytest.raises(ValueError, match=r"`tau` must satisfy 1.175e-38 <= tau"):
    L.smooth_topk_svm_loss(x.astype(np.float32), labels, 2, tau=1e-39)
  with pytest.raises(ValueError, match="`alpha` must be finite"):
    L.smooth_topk_svm_loss(x, labels, 2, alpha=np.nan)


def test_smooth_svm_extreme_tau():
  """The DP works in the units of the scores: no s / tau overflows, however small tau.
  Tiny tau gives the hard loss (within tau log C(n, k)) and its gradient; huge tau the
  brute-force value."""
  s = np.array([[3e3, -1.2e4, 2e4, 7e3, -4e3, 1.1e4]])
  hard = _svm_hard(s[0], 1, 3, 1.0)  # 6334.33...
  # The hard loss is linear near s: its gradient by central differences (exact).
  h = 1.0
  fd = np.array([(_svm_hard(s[0] + h * e, 1, 3, 1.0) - _svm_hard(s[0] - h * e, 1, 3, 1.0)) / (2 * h)
                 for e in np.eye(6)])
  for dtype, taus in ((jnp.float32, (1e-35, 2e-38, 1e-20)), (jnp.float64, (1e-300, 1e-200))):
    for tau in taus:
      for mode in ("smooth", "smooth_hard"):
        f = lambda z, t: L.smooth_topk_svm_loss(z, jnp.array([1]), 3, tau=t, mode=mode)[0]
        z, t = jnp.asarray(s, dtype), jnp.asarray(tau, dtype)
        np.testing.assert_allclose(f(z, t), hard, rtol=4 * np.finfo(dtype).eps)
        grad_s, grad_tau = jax.grad(f, argnums=(0, 1))(z, t)
        np.testing.assert_allclose(grad_s[0], fd, atol=1e-6)
        assert np.isfinite(grad_tau) and abs(grad_tau) <= math.log(math.comb(6, 3))
  # float64 scores near the top of the range, tau = 1: s / tau alone would be finite, but
  # e_k of exp(s / (k tau)) is not.
  big = s * 1e303
  expected = _svm_hard(big[0], 1, 3, 1.0)
  assert np.isfinite(expected)
  np.testing.assert_allclose(L.smooth_topk_svm_loss(big, np.array([1]), 3), expected, rtol=1e-15)
  # Huge tau: tau log 2 here (half the subsets contain the label), against the brute force.
  for tau in (1e30, 8e37):
    got = L.smooth_topk_svm_loss(jnp.asarray(s, jnp.float32), jnp.array([1]), 3, tau=tau)
    np.testing.assert_allclose(got, _svm_brute(s[0], 1, 3, tau, 1.0), rtol=1e-6)


def test_losses_non_finite_scores():
  """Documented behaviour: a +inf score of a class other than the label makes the row
  NaN (top-k cross-entropy, smooth top-k SVM); for the SVM a -inf one drops out, a -inf
  label gives +inf and a +inf label 0. Other rows are not affected."""
  inf = np.inf
  x = jnp.asarray([[0.5, inf, 1.5, 0.2, -1.0], [0.5, -inf, 1.5, 0.2, -1.0],
                   [0.5, 0.3, 1.5, 0.2, -1.0]])
  labels = jnp.array([0, 0, 2])
  ce = np.asarray(L.topk_cross_entropy(x, labels, p_k=[0.5, 0.5]))
  assert np.isnan(ce[0]) and np.all(np.isfinite(ce[1:]))
  for mode in ("smooth", "smooth_hard"):
    svm = lambda z, c: L.smooth_topk_svm_loss(z, c, 2, tau=0.5, mode=mode)
    value = np.asarray(svm(x, labels))
    assert np.isnan(value[0])
    without = _svm_brute([0.5, 1.5, 0.2, -1.0], 0, 2, 0.5, 1.0)  # the row without its -inf
    np.testing.assert_allclose(value[1], without, rtol=1e-12)
    np.testing.assert_allclose(value[2], _svm_brute(x[2], 2, 2, 0.5, 1.0), rtol=1e-12)
    grad = np.asarray(jax.grad(lambda z: svm(z, labels)[1:].sum())(x))
    assert np.all(np.isfinite(grad[1:])) and grad[1, 1] == 0
    np.testing.assert_array_equal(svm(x[:2], jnp.array([1, 1])), [0.0, inf])


def _compiles_during(fn):
  """The messages of the XLA compilations that ``fn()`` triggers."""
  import logging
  records = []
  handler = logging.Handler()
  handler.emit = records.append
  logger = logging.getLogger("jax")
  with jax.log_compiles():
    logger.addHandler(handler)
    try:
      fn()
    finally:
      logger.removeHandler(handler)
  return [r.getMessage()[:200] for r in records if "Compiling" in r.getMessage()]


@pytest.mark.parametrize("mode", ["smooth", "smooth_hard"])
def test_smooth_svm_eager_calls_compile_once(mode):
  """Eager calls (no jax.jit around the training step) reuse one compiled program: a
  bare lax.scan outside jit is compiled again at every call, forward and transpose."""
  scores = jnp.asarray(RNG.normal(size=(16, 30)), jnp.float32)
  labels = jnp.asarray(RNG.integers(0, 30, size=16))
  step = jax.value_and_grad(lambda s, tau: L.smooth_topk_svm_loss(s, labels, 5, tau=tau, mode=mode,
                                                                 reduction="mean"))
  jax.block_until_ready(step(scores, 1.0))  # compiles
  others = [(scores * 1.5, 1.0), (scores * 0.5, 0.3)]
  compiled = _compiles_during(lambda: [jax.block_until_ready(step(s, tau)) for s, tau in others])
  assert not compiled, compiled


# ---------------------------------------------------------------- soft error


@pytest.mark.slow
def test_soft_error_hand_values_and_grads():
  logits = jnp.array([[3.0, 1.0, 2.0], [3.0, 1.0, 2.0]])
  np.testing.assert_allclose(L.soft_error_loss(logits, jnp.array([1, 0]), regularization_strength=1e-3, reduction="none"), [2.0, 0.0],
                             atol=1e-12)
  # p = 2, l large enough that the soft ranks are affine in x: r = (n+1)/2 + (x - mean)/l.
  l = 10.0
  x = logits[0]
  expected = 3 - (2 + (x[1] - x.mean()) / l)
  np.testing.assert_allclose(L.soft_error_loss(logits[:1], jnp.array([1]), regularization_strength=l), expected, rtol=1e-12)
  check_grads(lambda z: L.soft_error_loss(z, LABELS, regularization_strength=1.0), (LOGITS,), modes=("rev",))


def test_soft_error_loss_rows_with_non_finite_logits_are_nan():
  # Documented: a NaN or infinite logit makes its row's loss NaN (its soft ranks are);
  # the other rows keep their value (here the hard limit: labels ranked first -> 0, last
  # of three -> 2).
  logits = jnp.array([[0.5, -jnp.inf, 1.5], [3.0, 1.0, 0.0], [0.0, jnp.nan, 1.0],
                      [0.0, 1.0, 2.0]])
  loss = np.asarray(L.soft_error_loss(logits, jnp.array([2, 0, 2, 0]),
                                      regularization_strength=1e-3))
  assert np.isnan(loss[0]) and np.isnan(loss[2])
  np.testing.assert_array_equal(loss[[1, 3]], [0.0, 2.0])
