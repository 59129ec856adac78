"""The 0.2.0 API of the sort/rank/quantile operators and the losses.

One name for the regularization strength (``regularization_strength``; the old ``l=``
warns), a positional ``k`` (``soft_sort``'s old ``topk=`` warns), per-example losses by
default (optax's convention) and ``soft_quantile`` shaped as ``jnp.quantile``.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import implicit_topk as itk
from implicit_topk.kernels.gpu import pallas_threshold

import references

RNG = np.random.default_rng(18)
X = jnp.asarray(RNG.normal(size=(3, 6)))
LABELS = jnp.array([0, 4, 2])
TARGET = jnp.asarray(np.eye(6)[[1, 0, 5]] + np.eye(6)[[2, 3, 4]])  # rows in C_2

# name -> (function of the keyword arguments, a strength other than the default 1.0)
STRENGTH_CALLS = {
    "soft_sort": lambda **kw: itk.soft_sort(X, **kw),
    "soft_rank": lambda **kw: itk.soft_rank(X, **kw),
    "soft_quantile": lambda **kw: itk.soft_quantile(X, jnp.array([0.2, 0.7]), **kw),
    "soft_topk_values": lambda **kw: itk.soft_topk_values(X, 3, **kw),
    "permutahedron_argmax": lambda **kw: itk.permutahedron_argmax(X, jnp.arange(6.0), **kw),
    "topk_cross_entropy": lambda **kw: itk.topk_cross_entropy(X, LABELS, p_k=[0.5, 0.5], **kw),
    "topk_fenchel_young_loss": lambda **kw: itk.topk_fenchel_young_loss(X, TARGET, 2, **kw),
    "soft_error_loss": lambda **kw: itk.soft_error_loss(X, LABELS, **kw),
}
STRENGTH = 0.3


def _no_deprecation(f, *args, **kwargs):
  with warnings.catch_warnings():
    warnings.simplefilter("error", DeprecationWarning)
    # JAX's own notice that the Pallas Triton backend is deprecated (GPU) is not ours
    warnings.filterwarnings("ignore", message=pallas_threshold.TRITON_DEPRECATION,
                            category=DeprecationWarning)
    return f(*args, **kwargs)


@pytest.mark.parametrize("name", list(STRENGTH_CALLS))
def test_regularization_strength_is_used_and_does_not_warn(name):
  call = STRENGTH_CALLS[name]
  new = _no_deprecation(call, regularization_strength=STRENGTH)
  default = _no_deprecation(call)
  # the keyword reaches the operator (a different strength gives a different value) ...
  assert not np.allclose(new, default), name
  # ... and the default is 1.0
  np.testing.assert_allclose(default, call(regularization_strength=1.0), rtol=1e-12)


@pytest.mark.parametrize("name", list(STRENGTH_CALLS))
def test_deprecated_l_warns_and_equals_regularization_strength(name):
  call = STRENGTH_CALLS[name]
  with pytest.warns(DeprecationWarning, match="`l` is deprecated.*regularization_strength"):
    old = call(l=STRENGTH)
  np.testing.assert_allclose(old, call(regularization_strength=STRENGTH), rtol=1e-12)


@pytest.mark.parametrize("name", list(STRENGTH_CALLS))
def test_l_and_regularization_strength_together_is_a_type_error(name):
  with pytest.raises(TypeError, match="regularization_strength.*`l`"):
    STRENGTH_CALLS[name](regularization_strength=STRENGTH, l=0.5)


def test_deprecation_warning_points_at_the_caller():
  with pytest.warns(DeprecationWarning) as record:
    itk.soft_rank(X, l=STRENGTH)
  assert record[0].filename == __file__


@pytest.mark.parametrize("name", ["soft_sort", "soft_rank", "topk_fenchel_young_loss"])
def test_bad_strength_errors_name_regularization_strength(name):
  with pytest.raises(ValueError, match="`regularization_strength`"):
    STRENGTH_CALLS[name](regularization_strength=0.0)
  with pytest.raises(ValueError, match="`regularization_strength`"), pytest.warns(DeprecationWarning):
    STRENGTH_CALLS[name](l=-1.0)


# -- k ----------------------------------------------------------------------------------


def test_soft_sort_k_positional_keyword_and_deprecated_topk():
  full = _no_deprecation(itk.soft_sort, X, regularization_strength=0.5)
  by_keyword = _no_deprecation(itk.soft_sort, X, k=2, regularization_strength=0.5)
  by_position = _no_deprecation(itk.soft_sort, X, 2, regularization_strength=0.5)
  assert by_keyword.shape == (3, 2)
  np.testing.assert_allclose(by_keyword, full[:, -2:], rtol=1e-12)
  np.testing.assert_allclose(by_position, by_keyword, rtol=1e-12)
  with pytest.warns(DeprecationWarning, match="`topk` is deprecated.*`k`"):
    old = itk.soft_sort(X, topk=2, regularization_strength=0.5)
  np.testing.assert_allclose(old, by_keyword, rtol=1e-12)
  with pytest.raises(TypeError, match="`k`.*`topk`"):
    itk.soft_sort(X, 2, topk=2)
  descending = itk.soft_sort(X, 2, regularization_strength=0.5, descending=True)
  np.testing.assert_allclose(descending, itk.soft_topk_values(X, 2, regularization_strength=0.5),
                             rtol=1e-12)


def test_loss_k_is_positional_or_keyword():
  np.testing.assert_allclose(itk.topk_fenchel_young_loss(X, TARGET, 2),
                             itk.topk_fenchel_young_loss(X, TARGET, k=2), rtol=1e-12)
  np.testing.assert_allclose(itk.smooth_topk_svm_loss(X, LABELS, 2),
                             itk.smooth_topk_svm_loss(X, LABELS, k=2), rtol=1e-12)
  assert not np.allclose(itk.smooth_topk_svm_loss(X, LABELS, 2), itk.smooth_topk_svm_loss(X, LABELS, 3))


# -- losses: one value per example (optax's convention) ---------------------------------

BATCH = (2, 3)
SCORES = jnp.asarray(RNG.normal(size=BATCH + (6,)))
BATCH_LABELS = jnp.asarray(RNG.integers(0, 6, size=BATCH))
LOSSES = {
    "topk_cross_entropy": lambda **kw: itk.topk_cross_entropy(SCORES, BATCH_LABELS, p_k=[0.5, 0.5], **kw),
    "topk_fenchel_young_loss": lambda **kw: itk.topk_fenchel_young_loss(
        SCORES, itk.hard_topk_mask(-SCORES, 2), 2, **kw),
    "smooth_topk_svm_loss": lambda **kw: itk.smooth_topk_svm_loss(SCORES, BATCH_LABELS, 2, **kw),
    "soft_error_loss": lambda **kw: itk.soft_error_loss(SCORES, BATCH_LABELS, **kw),
}


@pytest.mark.parametrize("name", list(LOSSES))
def test_losses_return_one_value_per_example_by_default(name):
  per_example = _no_deprecation(LOSSES[name])
  assert per_example.shape == BATCH
  assert per_example.dtype == SCORES.dtype
  np.testing.assert_allclose(per_example, LOSSES[name](reduction="none"), rtol=1e-12)
  mean, total = LOSSES[name](reduction="mean"), LOSSES[name](reduction="sum")
  assert mean.shape == total.shape == ()
  np.testing.assert_allclose(mean, jnp.mean(per_example), rtol=1e-12)
  np.testing.assert_allclose(total, jnp.sum(per_example), rtol=1e-12)
  # the rows are independent examples: each value is that row's loss alone
  assert np.ptp(np.asarray(per_example)) > 0


def test_fenchel_young_batch_shape_follows_axis():
  scores = jnp.moveaxis(SCORES, -1, 0)  # (6, 2, 3), candidates on axis 0
  target = jnp.moveaxis(itk.hard_topk_mask(-SCORES, 2), -1, 0)
  loss = itk.topk_fenchel_young_loss(scores, target, 2, axis=0)
  assert loss.shape == BATCH
  np.testing.assert_allclose(loss, LOSSES["topk_fenchel_young_loss"](), rtol=1e-12)


# -- soft_quantile has jnp.quantile's shape ---------------------------------------------


def _slow(*values):
  return pytest.param(*values, marks=pytest.mark.slow)


# The default run keeps a 2-D q along a middle axis of a 3-D input (one compilation); the
# slow group runs every shape.
@pytest.mark.parametrize("x_shape,q_shape,axis", [
    _slow((7,), (), -1), _slow((7,), (3,), 0), _slow((2, 5), (3,), -1), _slow((2, 5), (3,), 0),
    _slow((2, 5), (), 1), ((4, 3, 5), (2, 2), 1), _slow((4, 3, 5), (1,), -1),
    _slow((4, 3, 5), (), 0),
])
def test_soft_quantile_matches_jnp_quantile(x_shape, q_shape, axis):
  rng = np.random.default_rng(len(x_shape) * 10 + len(q_shape) + axis)
  x = jnp.asarray(rng.normal(size=x_shape))
  q = jnp.asarray(rng.uniform(size=q_shape))
  ours = itk.soft_quantile(x, q, axis=axis, regularization_strength=1e-6)
  # numpy.quantile takes levels of any rank, jnp.quantile of rank <= 1; same layout
  expected = np.quantile(np.asarray(x), np.asarray(q), axis=axis)  # method="linear"
  assert ours.shape == expected.shape
  np.testing.assert_allclose(ours, expected, atol=1e-12)
  if q.ndim <= 1:
    expected = jnp.quantile(x, q, axis=axis)  # method="linear", jnp.quantile's default
    assert ours.shape == expected.shape
    np.testing.assert_allclose(ours, expected, atol=1e-12)


def test_soft_quantile_levels_first_then_batch():
  x = jnp.asarray(RNG.normal(size=(2, 5)))
  q = jnp.array([0.0, 0.5, 1.0])
  y = itk.soft_quantile(x, q, regularization_strength=1e-6)
  assert y.shape == (3, 2)
  np.testing.assert_allclose(y[0], jnp.min(x, -1), atol=1e-12)
  np.testing.assert_allclose(y[2], jnp.max(x, -1), atol=1e-12)
  np.testing.assert_allclose(y[1], jnp.median(x, -1), atol=1e-12)
  # differentiable with the new layout
  g = jax.grad(lambda x: jnp.sum(itk.soft_quantile(x, q)[1]))(x)
  assert g.shape == x.shape and np.all(np.isfinite(g))


def _consecutive_half_floats(dtype, n, first=1.0):
  """``n`` increasing floats of a 16-bit dtype: consecutive bit patterns from ``first``."""
  start = np.asarray(first, dtype).view(np.uint16)
  return (start + np.arange(n, dtype=np.uint16)).view(dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_soft_quantile_of_half_inputs_picks_the_right_order_statistic(dtype):
  # (the level and its position q (n - 1) were rounded to x's dtype: bfloat16(0.999) =
  # 1.0 gave the maximum, and the position 2571 read 2560 in bfloat16, 2570 in float16)
  dtype = jnp.dtype(dtype)
  steps = np.where(np.arange(3001) < 2571, 0.0, 100.0).astype(dtype)  # statistic 2571: 100
  got = itk.soft_quantile(jnp.asarray(steps), 0.857, regularization_strength=1e-3)
  assert got.dtype == dtype and float(got) == 100.0
  rng = np.random.default_rng(7)
  x = rng.permutation(_consecutive_half_floats(dtype, 1000))  # distinct: the sort is exact
  levels = np.array([0.1, 0.257, 0.9, 0.99, 0.999])
  got = np.asarray(itk.soft_quantile(jnp.asarray(x), jnp.asarray(levels),
                                     regularization_strength=1e-6), np.float64)
  expected = np.quantile(x.astype(np.float64), levels).astype(dtype).astype(np.float64)
  np.testing.assert_array_equal(got, expected)


def test_soft_error_loss_of_bfloat16_logits_is_not_cancelled_by_rounded_ranks():
  # (the ranks were rounded to bfloat16 before n - r: a rank of 299 read 300 at n = 300,
  # the loss of the second-ranked label 0 and its gradient 0)
  bfloat16 = jnp.dtype("bfloat16")
  n, label, strength = 300, 298, 0.01
  top = np.array([1.0, 1.0 + 2**-7, 1.0 + 2**-6], bfloat16)  # pooled by the strength
  logits = np.concatenate([-_consecutive_half_floats(bfloat16, n - 3, first=2.0), top])
  wide = logits.astype(np.float64)
  loss = lambda z: n - references.soft_rank(z, strength)[label]
  got, grad = jax.value_and_grad(lambda z: itk.soft_error_loss(
      z[None], jnp.array([label]), regularization_strength=strength)[0])(jnp.asarray(logits))
  assert got.dtype == bfloat16 and grad.dtype == bfloat16
  np.testing.assert_allclose(float(got), loss(wide), rtol=2**-8)
  h = 1e-6
  fd = np.array([(loss(wide + h * e) - loss(wide - h * e)) / (2 * h) for e in np.eye(n)[-8:]])
  assert np.abs(fd).max() > 10  # the label shares a block: its gradient is not 0
  np.testing.assert_allclose(np.asarray(grad, np.float64)[-8:], fd, rtol=2**-7, atol=1e-2)


def test_soft_quantile_traced_levels_outside_0_1_give_nan():
  # (-0.5 extrapolated below the minimum, 1.5 was clipped to the maximum)
  x = jnp.asarray(RNG.normal(size=(2, 5)))
  levels = jnp.array([-0.5, 0.0, 0.5, 1.0, 1.5, jnp.nan])
  y = np.asarray(jax.jit(lambda q: itk.soft_quantile(x, q, regularization_strength=1e-6))(levels))
  assert np.all(np.isnan(y[[0, 4, 5]])) and not np.any(np.isnan(y[1:4]))
  np.testing.assert_allclose(y[1:4], np.quantile(np.asarray(x), [0.0, 0.5, 1.0], axis=-1), atol=1e-12)
  g = jax.grad(lambda x: jnp.sum(jax.jit(itk.soft_quantile)(x, levels[1:4])))(x)
  assert np.all(np.isfinite(g))
  with pytest.raises(ValueError, match="`q` must lie in"):
    itk.soft_quantile(x, levels)
