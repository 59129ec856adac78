"""The losses never turn an invalid input into a finite number: traced labels out of
range (``-1`` included), traced strengths and temperatures out of range, a NaN mask and
a ``+inf`` score of another class give NaN; bad static arguments raise errors that name
them. Each case here returned a finite value before (the negative label that of the
last class, the SVM with ``tau < 0`` a negative loss)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import implicit_topk as itk

X = jnp.array([[0.3, -1.2, 2.0, 0.1], [1.0, 0.5, -0.5, 2.5]], jnp.float32)
GOOD = jnp.array([1, 3])

# name -> loss(scores, labels) with the options under test (one loss per example)
LABEL_LOSSES = {
    "cross_entropy": lambda x, c: itk.topk_cross_entropy(x, c, p_k=[0.5, 0.5]),
    "cross_entropy_sort": lambda x, c: itk.topk_cross_entropy(x, c, p_k=[0.0, 1.0], top1_mode="sort"),
    "cross_entropy_m": lambda x, c: itk.topk_cross_entropy(x, c, p_k=[0.5, 0.5], m=3),
    "svm": lambda x, c: itk.smooth_topk_svm_loss(x, c, 2),
    "svm_smooth_hard": lambda x, c: itk.smooth_topk_svm_loss(x, c, 1, mode="smooth_hard"),
    "soft_error": lambda x, c: itk.soft_error_loss(x, c),
}


@pytest.mark.parametrize("name", sorted(LABEL_LOSSES))
@pytest.mark.parametrize("bad", [-1, -4, 4, 7])
def test_traced_labels_out_of_range_give_nan(name, bad):
  loss = jax.jit(LABEL_LOSSES[name])
  labels = GOOD.at[0].set(bad)
  value = np.asarray(loss(X, labels))
  assert np.isnan(value[0]), (name, bad, value)
  np.testing.assert_allclose(value[1], np.asarray(loss(X, GOOD))[1], rtol=1e-12)
  with pytest.raises(ValueError, match="`labels` must lie in"):
    LABEL_LOSSES[name](X, labels)  # concrete: an error


@pytest.mark.parametrize("top1_mode,p_k", [("sm", [0.5, 0.5]), ("sm", [0.0, 1.0]),
                                           ("smce", [0.2, 0.8]), ("sort", [0.3, 0.7])])
def test_cross_entropy_with_a_traced_strength_out_of_range_is_nan(top1_mode, p_k):
  loss = jax.jit(lambda l: itk.topk_cross_entropy(X, GOOD, p_k=p_k, top1_mode=top1_mode,
                                                  regularization_strength=l))
  for l in (-1.0, 0.0, 1e-45, 1e39, np.nan):
    assert np.all(np.isnan(np.asarray(loss(l)))), (l, loss(l))
  assert np.all(np.isfinite(np.asarray(loss(0.5))))


@pytest.mark.parametrize("top1_mode,p_k", [("sm", [0.0, 1.0]), ("smce", [0.2, 0.8]),
                                           ("sort", [0.3, 0.7])])
def test_cross_entropy_of_a_row_with_nan_is_nan(top1_mode, p_k):
  x = X.at[0, 0].set(jnp.nan)
  value = np.asarray(itk.topk_cross_entropy(x, GOOD, p_k=p_k, top1_mode=top1_mode))
  assert np.isnan(value[0]) and np.isfinite(value[1])


@pytest.mark.parametrize("top1_mode,p_k", [("sm", [0.5, 0.5]), ("sm", [0.0, 1.0]),
                                           ("smce", [0.2, 0.8]), ("sort", [0.3, 0.7])])
@pytest.mark.parametrize("label", [0, 1])  # the +inf class, another class
def test_cross_entropy_of_a_row_with_plus_inf_is_nan(top1_mode, p_k, label):
  x = X.at[0, 0].set(jnp.inf)
  labels = GOOD.at[0].set(label)
  value = np.asarray(itk.topk_cross_entropy(x, labels, p_k=p_k, top1_mode=top1_mode))
  assert np.isnan(value[0]) and np.isfinite(value[1])


@pytest.mark.parametrize("mode", ["smooth", "smooth_hard"])
def test_svm_with_a_traced_tau_out_of_range_is_nan(mode):
  loss = jax.jit(lambda t: itk.smooth_topk_svm_loss(X, GOOD, 2, tau=t, mode=mode))
  for tau in (-1.0, -0.1, 0.0, 1e-45, 1e39, np.nan):
    assert np.all(np.isnan(np.asarray(loss(tau)))), (tau, loss(tau))
  per_row = jax.jit(lambda t: itk.smooth_topk_svm_loss(X, GOOD, 2, tau=t, mode=mode))
  value = np.asarray(per_row(jnp.array([-1.0, 0.5])))
  assert np.isnan(value[0]) and np.isfinite(value[1])
  grad = jax.jit(jax.grad(lambda x, t: itk.smooth_topk_svm_loss(x, GOOD, 2, tau=t, mode=mode)[0]))
  assert np.any(np.isnan(np.asarray(grad(X, -1.0))[0]))  # the row's gradient is flagged too


@pytest.mark.parametrize("k", [1, 2, 3])
def test_svm_with_plus_inf_on_another_class_is_nan_for_every_k(k):
  x = X.at[0, 0].set(jnp.inf)
  for mode in ("smooth", "smooth_hard"):
    loss = lambda z: itk.smooth_topk_svm_loss(z, GOOD, k, tau=0.5, mode=mode)
    value = np.asarray(loss(x))
    assert np.isnan(value[0]) and np.isfinite(value[1])
    grad = np.asarray(jax.grad(lambda z: loss(z)[0])(x))
    assert np.any(np.isnan(grad[0])) and np.all(grad[1] == 0)  # the row's gradient is flagged


@pytest.mark.parametrize("thresh,error", [(-1.0, ValueError), (0.5, ValueError), (1.0, ValueError),
                                          (np.nan, ValueError), ("big", TypeError)])
def test_svm_thresh_is_checked(thresh, error):
  with pytest.raises(error, match="`thresh`"):
    itk.smooth_topk_svm_loss(X, GOOD, 2, mode="smooth_hard", thresh=thresh)


def test_svm_thresh_inf_is_the_smooth_loss():
  np.testing.assert_allclose(itk.smooth_topk_svm_loss(X, GOOD, 2, mode="smooth_hard", thresh=np.inf),
                             itk.smooth_topk_svm_loss(X, GOOD, 2), rtol=1e-12)


TARGET = jnp.array([[1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 1.0, 1.0]])


@pytest.mark.parametrize("kwargs,match", [
    (dict(target_mask=jnp.array([1.0, 1.0, 0.0])), "`target_mask` must be a scalar or broadcast to the shape of `scores`"),
    (dict(target_mask=jnp.ones((3, 4)) / 2), "`target_mask` must be a scalar or broadcast to the shape of `scores`"),
    (dict(target_mask=TARGET, k=jnp.array([2.0, 2.0, 2.0])), "`k` must be a scalar or broadcast"),
    (dict(target_mask=TARGET, regularization_strength=jnp.ones(3)),
     "`regularization_strength` must be a scalar or broadcast"),
    (dict(target_mask=TARGET, regularization_strength=1e-320), "got 1e-320"),
    (dict(target_mask=TARGET, regularization_strength=1e39), "got 1e[+]39"),
])
def test_fenchel_young_errors_name_the_argument(kwargs, match):
  kwargs.setdefault("k", 2)
  with pytest.raises(ValueError, match=match):
    itk.topk_fenchel_young_loss(X, **kwargs)


def test_fenchel_young_broadcasts_a_shared_target():
  shared = jnp.array([1.0, 0.0, 1.0, 0.0])
  np.testing.assert_allclose(itk.topk_fenchel_young_loss(X, shared, 2),
                             itk.topk_fenchel_young_loss(X, jnp.broadcast_to(shared, X.shape), 2),
                             rtol=1e-12)


@pytest.mark.parametrize("op", [itk.grad_topk, itk.iterative_softmax_topk])
@pytest.mark.parametrize("shape,k,axis", [((2, 0), 0, -1), ((0, 3), 1, -1), ((0, 2), 0, 0)])
def test_smooth_topk_of_empty_rows(op, shape, k, axis):
  for dtype in (jnp.float32, jnp.bfloat16):
    y = op(jnp.zeros(shape, dtype), k, axis=axis)
    assert y.shape == shape and y.dtype == dtype
