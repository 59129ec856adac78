"""Cross-checks against SoftJAX (PyPI ``softjax``), where the two operators coincide.

SoftJAX's ``method="fast_soft_sort", mode="c0"`` is the Euclidean projection onto the
permutahedron solved by pool-adjacent-violators (Blondel et al., 2020), the same operator
as our ``soft_sort`` / ``soft_rank`` with ``p=2``. With ``standardize=False`` the
parameters map as follows (n = length of the sorted axis):

* ``softjax.rank(x, softness=s)``  == ``soft_rank(x, regularization_strength=s / (n - 1))``
* ``softjax.sort(x, softness=s)``  == ``soft_sort(x, regularization_strength=(n - 1) * s)``
* ``softjax.top_k(x, k, softness=s)[0]`` == ``soft_topk_values(x, k, regularization_strength=(n - 1) * s)``

with the same ``descending`` flag (SoftJAX's rank defaults to ``descending=True``, ours
to ``False``; the tests pass it explicitly). Why: SoftJAX projects ``z / s`` onto the
permutahedron of anchors ``(1, ..., n) / (n - 1)`` (rank, then multiplies by ``n - 1``)
or projects the anchors ``(0, ..., n - 1) / (n - 1) / s`` onto the permutahedron of ``x``
(sort); the projection is positively homogeneous, ``c P(z, w) = P(c z, c w)``, and
shifting ``z`` by a constant leaves it unchanged.

With ``standardize=True`` (SoftJAX's default) the same holds for the squashed input
``sigmoid((x - mean) / sqrt(var + 1e-6))`` (and, for sort, ``logit`` of the output
rescaled back), checked below so that the documented mapping is complete.

Skipped when softjax is not importable. softjax 0.1.1 declares Python >= 3.12 but
imports and runs on 3.11: install it with
``pip install --ignore-requires-python --no-deps softjax==0.1.1`` plus equinox,
jaxtyping, lineax, optimistix and ott-jax.

Tolerances. Everything is float64. Both sides compute the same PAV block averages of
O(n) numbers of size up to ``max|x| / strength + n``; the differences are summation-order
rounding, a few ulp of those magnitudes (observed: at most 2.6e-13 for ranks up to 260 at
n = 300, about 1e-15 relative). The checks use ``atol = 1e-10 * scale`` with ``scale``
the largest magnitude involved, orders above the rounding and, as the control in every
case asserts, orders below what a wrong mapping changes (a strength off by a factor of 2,
16 for the sort's gradient, moves the output by more than ``1e3 * atol``).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import implicit_topk as itk

sj = pytest.importorskip("softjax")

# (n, batch shape, descending): n = 2 (the mappings coincide there), small and medium n,
# no batch, one and two batch axes. Each case is run on distinct and on tied inputs.
CASES = ((2, (), False), (3, (4,), True), (7, (2, 3), False), (50, (), True),
         (50, (4,), False), (300, (2, 3), True))
GRAD_CASES = ((2, (), True), (7, (), False), (50, (2, 3), True), (300, (), False))
# Softness relative to the data's spread (max - min), so that every case is in the soft
# regime where the strength matters (neither the hard ranks nor an all-equal output): the
# rank's strength s / (n - 1) is C times the mean gap spread / (n - 1); the sort's
# softness C / spread makes the anchors' gap 1 / ((n - 1) s) 1/C times the mean gap.
SOFTNESS_C = (1.5, 4.0, 12.0)
RTOL_ULP = 1e-10


def _softness(op, x):
  spread = float(jnp.max(x) - jnp.min(x))
  return [c * spread if op == "rank" else c / spread for c in SOFTNESS_C]


def _x(n, shape, ties, seed):
  rng = np.random.default_rng(seed)
  if ties:  # few distinct values: every row has ties (n >= 3)
    return jnp.asarray(rng.integers(0, max(2, n // 3), size=(*shape, n)).astype(np.float64))
  return jnp.asarray(rng.normal(size=(*shape, n)) * 2.0)


def _atol(*arrays):
  return RTOL_ULP * max(1.0, *(float(jnp.max(jnp.abs(a))) for a in arrays))


# Jitted with the strength traced: one compilation per shape, not per strength.
@functools.partial(jax.jit, static_argnames=("descending", "standardize"))
def _sj_rank(x, s, descending, standardize=False):
  return sj.rank(x, axis=-1, softness=s, mode="c0", method="fast_soft_sort",
                 descending=descending, standardize=standardize)


@functools.partial(jax.jit, static_argnames=("descending", "standardize"))
def _sj_sort(x, s, descending, standardize=False):
  return sj.sort(x, axis=-1, softness=s, mode="c0", method="fast_soft_sort",
                 descending=descending, standardize=standardize)


@functools.partial(jax.jit, static_argnames=("descending",))
def _our_rank(x, strength, descending):
  return itk.soft_rank(x, regularization_strength=strength, p=2.0, descending=descending)


@functools.partial(jax.jit, static_argnames=("descending",))
def _our_sort(x, strength, descending):
  return itk.soft_sort(x, regularization_strength=strength, p=2.0, descending=descending)


def _rank_strength(s, n):
  return s / (n - 1)


def _sort_strength(s, n):
  return (n - 1) * s


def _assert_match_and_discriminating(ours, theirs, ours_wrong):
  """ours == theirs to atol, and the factor-2-wrong strength is far outside atol."""
  atol = _atol(ours, theirs)
  np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=0, atol=atol)
  miss = float(jnp.max(jnp.abs(ours_wrong - theirs)))
  assert miss > 1e3 * atol, f"input not discriminating: wrong strength misses by {miss:.3g}"


# ------------------------------------------------------------------------- forward


@pytest.mark.parametrize("n,shape,descending", CASES, ids=str)
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_rank_matches(n, shape, ties, descending):
  if ties and n < 3:
    pytest.skip("ties need n >= 3 here")
  x = _x(n, shape, ties, seed=n)
  for s in _softness("rank", x):
    theirs = _sj_rank(x, s, descending)
    r = _rank_strength(s, n)
    _assert_match_and_discriminating(_our_rank(x, r, descending), theirs,
                                     _our_rank(x, 2 * r, descending))


@pytest.mark.parametrize("n,shape,descending", CASES, ids=str)
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_sort_matches(n, shape, ties, descending):
  if ties and n < 3:
    pytest.skip("ties need n >= 3 here")
  x = _x(n, shape, ties, seed=100 + n)
  for s in _softness("sort", x):
    theirs = _sj_sort(x, s, descending)
    r = _sort_strength(s, n)
    _assert_match_and_discriminating(_our_sort(x, r, descending), theirs,
                                     _our_sort(x, 2 * r, descending))


@functools.partial(jax.jit, static_argnums=1)
def _sj_top_k(x, k, s):
  return sj.top_k(x, k, softness=s, mode="c0", method="fast_soft_sort", standardize=False)


@functools.partial(jax.jit, static_argnums=1)
def _our_top_k_values(x, k, strength):
  return itk.soft_topk_values(x, k, regularization_strength=strength, p=2.0)


@pytest.mark.parametrize("n,k", [(7, 3), (50, 5), (300, 20)])
def test_top_k_values_match(n, k):
  """softjax.top_k(method='fast_soft_sort') returns values only (its soft index is None)."""
  x = _x(n, (4,), False, seed=200 + n)
  for s in _softness("sort", x):
    values, index = _sj_top_k(x, k, s)
    assert index is None
    r = _sort_strength(s, n)
    ours, wrong = _our_top_k_values(x, k, r), _our_top_k_values(x, k, 2 * r)
    _assert_match_and_discriminating(ours, values, wrong)


def test_standardize_is_a_sigmoid_squash():
  """SoftJAX's default standardize=True: our operator on the squashed input."""
  n = 40
  x = _x(n, (3,), False, seed=7) * 5 + 3
  mean = jnp.mean(x, -1, keepdims=True)
  std = jnp.sqrt(jnp.mean((x - mean) ** 2, -1, keepdims=True) + 1e-6)
  u = jax.nn.sigmoid((x - mean) / std)
  for s in _softness("rank", x):
    theirs = _sj_rank(x, s, True, standardize=True)
    r = _rank_strength(s, n)
    _assert_match_and_discriminating(_our_rank(u, r, True), theirs, _our_rank(u, 2 * r, True))
    theirs = _sj_sort(x, s, False, standardize=True)
    r = _sort_strength(s, n)
    unsquash = lambda y: jax.scipy.special.logit(jnp.clip(y, 1e-10, 1 - 1e-10)) * std + mean
    _assert_match_and_discriminating(unsquash(_our_sort(u, r, False)), theirs,
                                     unsquash(_our_sort(u, 2 * r, False)))


@pytest.mark.parametrize("op", ["rank", "sort"])
def test_other_mappings_fail(op):
  """Control: the mapping is not one of the nearby guesses (strength = s, or the other
  operator's mapping), which must all miss by far more than the tolerance."""
  n = 50
  x = _x(n, (4,), False, seed=3)
  for s in _softness(op, x):
    if op == "rank":
      theirs = _sj_rank(x, s, True)
      wrong = [s, (n - 1) * s, s / n]
      ours = lambda r: _our_rank(x, r, True)
    else:
      theirs = _sj_sort(x, s, False)
      wrong = [s, s / (n - 1), n * s]
      ours = lambda r: _our_sort(x, r, False)
    for r in wrong:
      miss = float(jnp.max(jnp.abs(ours(r) - theirs)))
      assert miss > 1e3 * _atol(theirs), (s, r, miss)


# ------------------------------------------------------------------------ gradients


def _linear_functional_grad(op):
  """x, g, strength, descending -> the gradient of sum(g * op(x)) in x (jitted)."""
  return jax.jit(jax.grad(lambda x, g, s, d: jnp.sum(g * op(x, s, d))),
                 static_argnums=3)


_grad_sj_rank = _linear_functional_grad(lambda x, s, d: _sj_rank(x, s, d))
_grad_sj_sort = _linear_functional_grad(lambda x, s, d: _sj_sort(x, s, d))
_grad_our_rank = _linear_functional_grad(lambda x, s, d: _our_rank(x, s, d))
_grad_our_sort = _linear_functional_grad(lambda x, s, d: _our_sort(x, s, d))


def _tie_group_sums(x, grad):
  """Per row, the gradient summed over each group of equal entries (the derivative along
  moving the whole group together, defined also where the operator has a kink)."""
  x = np.asarray(x).reshape(-1, x.shape[-1])
  grad = np.asarray(grad).reshape(-1, x.shape[-1])
  out = []
  for xr, gr in zip(x, grad):
    vals, inv = np.unique(xr, return_inverse=True)
    out.append(np.bincount(inv, weights=gr, minlength=len(vals)))
  return np.concatenate(out)


@pytest.mark.parametrize("n,shape,desc", GRAD_CASES, ids=str)
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_rank_grad_matches(n, shape, desc, ties):
  if ties and n < 3:
    pytest.skip("ties need n >= 3 here")
  x = _x(n, shape, ties, seed=300 + n)
  g = jnp.asarray(np.random.default_rng(n).normal(size=x.shape))
  for s in _softness("rank", x):
    r = _rank_strength(s, n)
    gs = _grad_sj_rank(x, g, s, desc)
    go, gw = _grad_our_rank(x, g, r, desc), _grad_our_rank(x, g, 2 * r, desc)
    # Tied entries of x always share a PAV block in rank (the anchors are distinct), so
    # the gradient is defined there and compared entrywise.
    _assert_match_and_discriminating(go, gs, gw)


@pytest.mark.parametrize("n,shape,desc", GRAD_CASES, ids=str)
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_sort_grad_matches(n, shape, desc, ties):
  if ties and n < 3:
    pytest.skip("ties need n >= 3 here")
  x = _x(n, shape, ties, seed=400 + n)
  g = jnp.asarray(np.random.default_rng(n + 1).normal(size=x.shape))
  for s in _softness("sort", x):
    r = _sort_strength(s, n)
    gs = _grad_sj_sort(x, g, s, desc)
    # The sort's Jacobian in x is piecewise constant in the strength (block averages of
    # the PAV partition), so the control takes a strength 16x smaller, which changes the
    # partition (a factor 2 may not).
    go, gw = _grad_our_sort(x, g, r, desc), _grad_our_sort(x, g, r / 16, desc)
    if ties:
      # soft sort is not differentiable in x where entries of x are tied (how the
      # gradient splits within a tie is each library's tie-break); compare the sums.
      gs, go, gw = (jnp.asarray(_tie_group_sums(x, a)) for a in (gs, go, gw))
    _assert_match_and_discriminating(go, gs, gw)
