"""The 0.2.0 API of the top-k mask family: one name and one default for the strength.

Every operator with a regularization strength takes it as the keyword-only
``regularization_strength=1.0`` (the name fast-soft-sort and torchsort use). The former
``l=`` keyword (and the positional third argument of ``grad_topk`` and
``iterative_softmax_topk``) still works until 0.3.0, with a DeprecationWarning; passing
the strength twice is a TypeError. ``k`` is positional everywhere.
"""

import warnings

import jax.numpy as jnp
import numpy as np
import pytest

import implicit_topk as itk
from implicit_topk.kernels.gpu import pallas_threshold

X = jnp.array([3.0, 2.5, 0.0, 2.0])  # k = 2: fractional at strength 1.0, hard at 0.1
TREE = {"a": jnp.array([3.0, 2.5]), "b": jnp.array([[0.0, 2.0]])}
IDS = jnp.array([0, 0, 1, 1])


def _leaves(out):
  return np.concatenate([np.ravel(np.asarray(leaf)) for leaf in
                         (out.values() if isinstance(out, dict) else [out])])


# name -> call(strength keywords) for every operator with a strength
CALLS = {
    "soft_topk_mask": lambda **kw: itk.soft_topk_mask(X, 2, **kw),
    "soft_topk_mag": lambda **kw: itk.soft_topk_mag(X - 1.5, 2, **kw),
    "segment_soft_topk_mask": lambda **kw: itk.segment_soft_topk_mask(
        X, IDS, jnp.array([1.0, 1.0]), num_segments=2, **kw),
    "tree_soft_topk_mask": lambda **kw: itk.tree_soft_topk_mask(TREE, 2, **kw),
    "tree_soft_topk_mag": lambda **kw: itk.tree_soft_topk_mag(
        {"a": TREE["a"] - 1.5, "b": TREE["b"] - 1.5}, 2, **kw),
    "grad_topk": lambda **kw: itk.grad_topk(X, 2, **kw),
    "iterative_softmax_topk": lambda **kw: itk.iterative_softmax_topk(X, 2, **kw),
}


def _call_quietly(name, **kw):
  with warnings.catch_warnings():
    warnings.simplefilter("error", DeprecationWarning)
    # JAX's own notice that the Pallas Triton backend is deprecated (GPU) is not ours
    warnings.filterwarnings("ignore", message=pallas_threshold.TRITON_DEPRECATION,
                            category=DeprecationWarning)  # the new spelling never warns
    return _leaves(CALLS[name](**kw))


@pytest.mark.parametrize("name", sorted(CALLS))
def test_regularization_strength_keyword_works(name):
  got = _call_quietly(name, regularization_strength=0.7)
  other = _call_quietly(name, regularization_strength=0.2)
  assert np.all(np.isfinite(got))
  assert not np.allclose(got, other)  # the keyword is used, not ignored


@pytest.mark.parametrize("name", sorted(CALLS))
def test_old_l_keyword_warns_and_gives_the_same_result(name):
  want = _call_quietly(name, regularization_strength=0.7)
  match = rf"{name}\(\): `l` is deprecated.*regularization_strength"
  with pytest.warns(DeprecationWarning, match=match):
    got = _leaves(CALLS[name](l=0.7))
  np.testing.assert_array_equal(got, want)


def test_the_deprecation_warning_points_at_the_caller():
  with pytest.warns(DeprecationWarning) as record:
    itk.soft_topk_mask(X, 2, l=0.7)
  assert record[0].filename == __file__


@pytest.mark.parametrize("name", sorted(CALLS))
def test_both_names_is_a_type_error(name):
  with pytest.raises(TypeError, match="regularization_strength"):
    CALLS[name](regularization_strength=0.7, l=0.7)


@pytest.mark.parametrize("name", sorted(CALLS))
def test_default_strength_is_one(name):
  default = _call_quietly(name)
  np.testing.assert_array_equal(default, _call_quietly(name, regularization_strength=1.0))
  # ... and not the 0.1 of the mask operators before 0.2.0 (these inputs tell them apart)
  assert not np.allclose(default, _call_quietly(name, regularization_strength=0.1))


@pytest.mark.parametrize("fn", [itk.grad_topk, itk.iterative_softmax_topk])
def test_positional_strength_warns_and_gives_the_same_result(fn):
  want = fn(X, 2, regularization_strength=0.7)
  with pytest.warns(DeprecationWarning, match="positionally is deprecated"):
    got = fn(X, 2, 0.7)
  np.testing.assert_array_equal(got, want)
  with pytest.raises(TypeError, match="positional"):
    fn(X, 2, 0.7, 0.5)
  with pytest.raises(TypeError, match="regularization_strength"):
    fn(X, 2, 0.7, regularization_strength=0.5)
  with pytest.raises(TypeError, match="regularization_strength"), \
      pytest.warns(DeprecationWarning):
    fn(X, 2, 0.7, l=0.5)


@pytest.mark.parametrize("name", ["soft_topk_mask", "soft_topk_mag", "segment_soft_topk_mask",
                                  "tree_soft_topk_mask", "tree_soft_topk_mag"])
def test_strength_is_keyword_only(name):
  fn = getattr(itk, name)
  args = {"segment_soft_topk_mask": (X, IDS, 1.0), "tree_soft_topk_mask": (TREE, 2),
          "tree_soft_topk_mag": (TREE, 2)}.get(name, (X, 2))
  with pytest.raises(TypeError):
    fn(*args, 0.7)


@pytest.mark.parametrize("name", sorted(CALLS))
@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan")])
def test_bad_strength_errors_name_regularization_strength(name, bad):
  with pytest.raises(ValueError, match="`regularization_strength`"):
    CALLS[name](regularization_strength=bad)


def test_k_is_positional_everywhere():
  np.testing.assert_array_equal(itk.hard_topk_mask(X, 2), itk.hard_topk_mask(X, k=2))
  np.testing.assert_array_equal(itk.hard_topk_mag(X, 2), itk.hard_topk_mag(X, k=2))
  np.testing.assert_array_equal(itk.sparse_softmax(X, 2), itk.sparse_softmax(X, k=2))
  np.testing.assert_array_equal(itk.soft_topk_mask(X, 2), itk.soft_topk_mask(X, k=2))


@pytest.mark.parametrize("fn", [itk.hard_topk_mask, itk.hard_topk_mag, itk.sparse_softmax])
def test_operators_without_a_strength_reject_one(fn):
  with pytest.raises(TypeError):
    fn(X, 2, regularization_strength=1.0)  # pylint: disable=unexpected-keyword-arg
  with pytest.raises(TypeError):
    fn(X, 2, l=1.0)  # pylint: disable=unexpected-keyword-arg


@pytest.mark.parametrize("k, shown", [(np.int64(5), "got 5."), (np.float32(4.5), "got 4.5."),
                                      (jnp.array([1.0, 7.0]), "got [1.0, 7.0].")])
def test_errors_show_numpy_and_jax_values_as_plain_numbers(k, shown):
  # A user writes k = 5, not np.int64(5): the message shows the value, not its repr.
  with pytest.raises(ValueError, match=r"0 <= k <= n with n=4") as error:
    itk.soft_topk_mask(jnp.ones((2, 4)), k)
  assert str(error.value).endswith(shown)
  assert "np." not in str(error.value) and "Array(" not in str(error.value)


def test_eager_calls_with_int_and_float_k_share_one_compilation():
  # k = 2 then k = 2.5 (a Python int, then a float: different weak types) and the same
  # for the strength: one compiled function, not one per Python type.
  from implicit_topk import _apply
  x = jnp.asarray(np.random.default_rng(3).normal(size=(3, 9)))
  itk.soft_topk_mask(x, 2)
  compiled = _apply._solve_rows_jit._cache_size()
  itk.soft_topk_mask(x, 2.5)
  itk.soft_topk_mask(x, np.float64(3.0), regularization_strength=2)
  itk.soft_topk_mask(x, np.int32(1), regularization_strength=np.float32(0.5))
  assert _apply._solve_rows_jit._cache_size() == compiled
  np.testing.assert_allclose(np.sum(np.asarray(itk.soft_topk_mask(x, 2.5)), -1), 2.5, rtol=1e-12)
