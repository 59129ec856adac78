"""tree_soft_topk_mask / tree_soft_topk_mag: one threshold over every leaf of a pytree,
equal to the operator on the concatenated leaves, forward and backward (issue 16).
The same with differently sharded leaves on 8 host devices: tests/sharded_check.py
(group ``tree``, slow group of tests/test_sharded_axis.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import implicit_topk as itk
from references import bisect_mask


def _tree(dtype=jnp.float64):
  rng = np.random.default_rng(0)
  return {"dense": {"w": jnp.asarray(rng.normal(size=(6, 5)), dtype)},
          "head": [jnp.asarray(rng.normal(size=(3, 2, 2)) * 2.0, dtype)]}


def _flat(tree):
  return jnp.concatenate([leaf.ravel() for leaf in jax.tree.leaves(tree)])


CASES = {
    "mask": (lambda t, k, l: itk.tree_soft_topk_mask(t, k, regularization_strength=l),
             lambda v, k, l: itk.soft_topk_mask(v, k, regularization_strength=l)),
    "mag": (lambda t, k, l: itk.tree_soft_topk_mag(t, k, regularization_strength=l),
            lambda v, k, l: itk.soft_topk_mag(v, k, regularization_strength=l)),
}


def test_tree_mask_equals_the_flat_bisection_and_finite_differences():
  tree_op, flat_op = CASES["mask"]
  tree = _tree()
  k, l = 9.5, 0.2
  out = tree_op(tree, k, l)
  assert jax.tree.structure(out) == jax.tree.structure(tree)
  assert all(o.shape == t.shape for o, t in zip(jax.tree.leaves(out), jax.tree.leaves(tree)))
  flat = _flat(tree)
  np.testing.assert_allclose(_flat(out), bisect_mask(flat, k, l), atol=1e-10)
  weights = jnp.cos(3 * flat)
  loss = lambda t, k_, l_: jnp.dot(weights, _flat(tree_op(t, k_, l_)))
  g_tree, g_l = jax.jit(jax.grad(loss, argnums=(0, 2)))(tree, k, l)
  # central finite differences in float64 on a few entries of every leaf, and l
  eps = 1e-6
  leaves, treedef = jax.tree.flatten(tree)
  for leaf_index, entry in ((0, (4, 3)), (0, (1, 2)), (1, (1, 1, 0))):  # dense/w, head
    bump = lambda t: treedef.unflatten([leaf.at[entry].add(t) if i == leaf_index else leaf
                                        for i, leaf in enumerate(leaves)])
    fd = (loss(bump(eps), k, l) - loss(bump(-eps), k, l)) / (2 * eps)
    np.testing.assert_allclose(jax.tree.leaves(g_tree)[leaf_index][entry], fd, atol=1e-6)
  np.testing.assert_allclose(g_l, (loss(tree, k, l + eps) - loss(tree, k, l - eps)) / (2 * eps),
                             atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_tree_gradients_equal_the_concatenated_operator(name):
  tree_op, flat_op = CASES[name]
  tree = _tree()
  k, l = 9.5, 0.2
  flat = _flat(tree)
  np.testing.assert_allclose(_flat(tree_op(tree, k, l)), flat_op(flat, k, l), atol=1e-12)
  weights = jnp.cos(3 * flat)
  loss = lambda t, k_, l_: jnp.dot(weights, _flat(tree_op(t, k_, l_)))
  flat_loss = lambda v, k_, l_: jnp.dot(weights, flat_op(v, k_, l_))
  g_tree, g_k, g_l = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(tree, k, l)
  want = jax.grad(flat_loss, argnums=(0, 1, 2))(flat, k, l)
  np.testing.assert_allclose(_flat(g_tree), want[0], atol=1e-10)
  np.testing.assert_allclose([g_k, g_l], want[1:], atol=1e-10)
  # forward mode agrees with reverse mode
  tangent = jax.tree.map(jnp.sin, tree)
  _, jvp = jax.jvp(lambda t: loss(t, k, l), (tree,), (tangent,))
  np.testing.assert_allclose(jvp, jnp.dot(_flat(g_tree), _flat(tangent)), atol=1e-10)


def test_tree_mixed_dtypes_info_and_errors():
  tree = {"a": jnp.linspace(-1.0, 2.0, 7, dtype=jnp.float32),
          "b": jnp.linspace(3.0, -1.0, 4, dtype=jnp.bfloat16)}
  out, info = itk.tree_soft_topk_mask(tree, 3.0, regularization_strength=1e-3, return_info=True)
  assert out["a"].dtype == jnp.float32 and out["b"].dtype == jnp.bfloat16
  assert info.iter_num.shape == ()
  np.testing.assert_allclose(np.sum(_flat(out).astype(np.float32)), 3.0, atol=1e-2)
  with pytest.raises(ValueError, match=r"0 <= k <= n with n=11"):
    itk.tree_soft_topk_mask(tree, 12.0)
  with pytest.raises(ValueError, match=r"`k` must be a scalar"):
    itk.tree_soft_topk_mag(tree, jnp.ones(2))
  with pytest.raises(TypeError, match=r"leaf at \['b'\] has dtype int32"):
    itk.tree_soft_topk_mag({"a": jnp.ones(3), "b": jnp.ones(2, jnp.int32)}, 1.0)
  with pytest.raises(ValueError, match=r"at least one array leaf"):
    itk.tree_soft_topk_mask({}, 1.0)
  # A model's pytree (an Equinox module, say) also holds functions: the error names the
  # leaf and says how to pass the arrays alone.
  with pytest.raises(TypeError, match=r"leaf at \['act'\] is a custom_jvp.*eqx.partition"):
    itk.tree_soft_topk_mag({"w": jnp.ones(3), "act": jax.nn.relu}, 1.0)
  with pytest.raises(ValueError, match=r"solver='pav' sorts whole rows"):
    itk.solvers.make_solver("pav", itk.problems.CappedSimplex(layout=itk.problems.Tree()))


@pytest.mark.slow
def test_tree_k_rule_and_magnitude_forward():
  tree = {"a": jnp.linspace(-1.0, 2.0, 7, dtype=jnp.float32),
          "b": jnp.linspace(3.0, -1.0, 4, dtype=jnp.bfloat16)}
  ones = itk.tree_soft_topk_mask(tree, 11.0, regularization_strength=0.1)
  assert all(np.all(np.asarray(leaf) == 1) for leaf in jax.tree.leaves(ones))
  np.testing.assert_array_equal(_flat(itk.tree_soft_topk_mag(tree, 11.0, regularization_strength=0.1)), _flat(tree))
  assert all(np.all(np.asarray(leaf) == 0)
             for leaf in jax.tree.leaves(itk.tree_soft_topk_mag(tree, 0.0, regularization_strength=0.1)))
