"""segment_soft_topk_mask (one threshold per ragged segment) and ``where=`` on padded rows.

References: soft_topk_mask on every segment (or on the valid entries) separately, and an
independent float64 bisection on the threshold equation sum_i y_i(lam) = k in NumPy.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import implicit_topk as itk
from references import bisect_mask


def bisect_mag(x, k, l, p):
  """The soft top-k in magnitude of one row by float64 bisection on
  F(lam) = sum_i min(lam, g(t_i / l)) - k lam (decreasing sign change)."""
  s = np.abs(np.asarray(x, np.float64))
  if np.count_nonzero(s) <= k:
    return np.asarray(x, np.float64)
  g = lambda t: (t / l) ** (1.0 / (p - 1.0))

  def F(lam):  # sum_i min(lam, G_i) - k lam, exactly 0 on a flat root interval
    G = g(np.maximum(s - lam, 0))
    return lam * (np.count_nonzero(G > lam) - k) + G[G <= lam].sum()

  lo, hi = 0.0, s.max()
  for _ in range(200):
    mid = 0.5 * (lo + hi)
    lo, hi = (mid, hi) if F(mid) > 0 else (lo, mid)
  lam = 0.5 * (lo + hi)
  t = np.maximum(s - lam, 0)
  return np.sign(x) * np.minimum(s, t + g(t))


SIZES = (1, 5, 0, 12, 3, 9)  # a size-0 segment (k = 0), a size-1 segment


def _segments(seed=0, shuffle=True):
  rng = np.random.default_rng(seed)
  ids = np.repeat(np.arange(len(SIZES)), SIZES)
  if shuffle:
    ids = rng.permutation(ids)
  x = rng.normal(size=ids.size)
  k = np.array([0.5, 2.5, 0.0, 4.0, 3.0, 1.25])
  return x, ids, k


def _per_segment(fn, x, ids, k, l, p):
  out = np.zeros_like(x)
  for s, k_s in enumerate(k):
    members = ids == s
    if members.any():
      out[members] = fn(x[members], k_s, l, p)
  return out


@pytest.mark.parametrize("p", [4.0 / 3.0, pytest.param(2.0, marks=pytest.mark.slow)])
def test_segments_equal_per_segment_references(p):
  x, ids, k = _segments()
  l = 0.3
  got = itk.segment_soft_topk_mask(jnp.asarray(x), ids, k, num_segments=len(SIZES), regularization_strength=l, p=p)
  np.testing.assert_allclose(got, _per_segment(bisect_mask, x, ids, k, l, p), atol=1e-10)
  if p == 2.0:  # the operator on each segment separately (one compilation per size)
    per_op = _per_segment(lambda xs, ks, l, p: np.asarray(itk.soft_topk_mask(
        jnp.asarray(xs), ks, regularization_strength=l, p=p)), x, ids, k, l, p)
    np.testing.assert_allclose(got, per_op, atol=1e-12)
  sums = np.bincount(ids, weights=np.asarray(got), minlength=len(SIZES))
  np.testing.assert_allclose(sums, k, atol=1e-10)


def test_segments_jit_batch_axis_and_info():
  x, ids, k = _segments(1, shuffle=False)
  batch = np.stack([x, -x, 2 * x])  # (3, n): the segments run along axis 1 ...
  moved = jnp.asarray(batch.T)  # ... here along axis 0
  k_rows = np.stack([k, k, np.minimum(k, 1)])
  f = jax.jit(lambda z, ids_, k_: itk.segment_soft_topk_mask(
      z, ids_, k_, num_segments=len(SIZES), regularization_strength=0.2, axis=0, indices_are_sorted=True,
      return_info=True))
  got, info = f(moved, jnp.asarray(ids), jnp.asarray(k_rows))
  assert got.shape == moved.shape and info.iter_num.shape == (3, len(SIZES))
  for b in range(3):
    np.testing.assert_allclose(got[:, b], _per_segment(bisect_mask, batch[b], ids, k_rows[b],
                                                        0.2, 4.0 / 3.0), atol=1e-10)
  assert np.all(np.asarray(info.residual) < 1e-10)


def _segment_loss(seed=2):
  x, ids, k = _segments(seed)
  w = jnp.asarray(np.random.default_rng(3).normal(size=x.size))

  def loss(z, k_, l_):
    return jnp.sum(w * itk.segment_soft_topk_mask(z, ids, k_, num_segments=len(SIZES), regularization_strength=l_))

  return loss, (jnp.asarray(x), jnp.asarray(k), jnp.asarray(0.4)), ids, w


def test_segment_gradients_match_finite_differences():
  loss, args, _, w = _segment_loss()
  grads = jax.grad(loss, argnums=(0, 1, 2))(*args)
  eps = 1e-6
  fd = lambda f, v: (f(v + eps) - f(v - eps)) / (2 * eps)
  n = args[0].size
  fd_x = [fd(lambda t: loss(args[0].at[i].add(t), *args[1:]), 0.0) for i in range(n)]
  np.testing.assert_allclose(grads[0], fd_x, atol=1e-6)
  fd_k = [fd(lambda t: loss(args[0], args[1].at[s].add(t), args[2]), 0.0) for s in (0, 1, 3)]
  np.testing.assert_allclose(np.asarray(grads[1])[[0, 1, 3]], fd_k, atol=1e-6)
  np.testing.assert_allclose(grads[2], fd(lambda t: loss(args[0], args[1], t), 0.4), atol=1e-6)


# the backend imports jaxopt, which warns that it is unmaintained (expected here)
@pytest.mark.slow  # three operators, two backends: 33 s of a worker in CI
@pytest.mark.filterwarnings("ignore:JAXopt is no longer maintained:DeprecationWarning")
def test_jaxopt_backend_gradients_equal_the_lax_backends():
  # (jaxopt's custom_vjp closed over the traced segment ids: "No constant handler for type
  # DynamicJaxprTracer" under jax.grad; the lax backend's gradients match central
  # differences in the test above)
  x, ids, k = _segments(2)
  w = jnp.asarray(np.random.default_rng(3).normal(size=x.size))
  tree = lambda z: {"a": z[:12], "b": z[12:]}

  def losses(backend):
    kw = dict(regularization_strength=0.4, implicit_diff_backend=backend)
    return {
        "segment": lambda z, k_: jnp.sum(w * itk.segment_soft_topk_mask(
            z, ids, k_, num_segments=len(SIZES), **kw)),
        "tree mask": lambda z, k_: jnp.sum(w * jnp.concatenate(jax.tree.leaves(
            itk.tree_soft_topk_mask(tree(z), k_[3] + 2.0, **kw)))),
        "tree mag": lambda z, k_: jnp.sum(w * jnp.concatenate(jax.tree.leaves(
            itk.tree_soft_topk_mag(tree(z), k_[3] + 2.0, **kw)))),
    }

  args = (jnp.asarray(x), jnp.asarray(k))
  for name, loss in losses("jaxopt").items():
    want = jax.grad(losses("lax")[name], argnums=(0, 1))(*args)
    assert np.abs(np.asarray(want[0])).max() > 1e-2, name
    grad = jax.grad(loss, argnums=(0, 1))
    # under jit for all, eagerly (where the crash was seen) for the segment operator
    for got in [jax.jit(grad)(*args)] + ([grad(*args)] if name == "segment" else []):
      for g, v in zip(got, want):
        np.testing.assert_allclose(g, v, atol=1e-12, err_msg=name)


@pytest.mark.slow
def test_segment_gradients_match_the_per_segment_operator():
  loss, args, ids, w = _segment_loss()

  def reference(z, k_, l_):
    total = 0.0
    for s in range(len(SIZES)):
      members = np.flatnonzero(ids == s)
      if members.size:
        total = total + jnp.sum(w[members] * itk.soft_topk_mask(z[members], k_[s], regularization_strength=l_))
    return total

  grads = jax.grad(loss, argnums=(0, 1, 2))(*args)
  expected = jax.jit(jax.grad(reference, argnums=(0, 1, 2)))(*args)
  for got, want in zip(grads, expected):
    np.testing.assert_allclose(got, want, atol=1e-10)
  # forward mode agrees with reverse mode
  _, jvp = jax.jvp(lambda z: loss(z, *args[1:]), (args[0],), (w,))
  np.testing.assert_allclose(jvp, jnp.dot(grads[0], w), atol=1e-10)


def test_segment_errors_name_the_argument():
  x, ids, k = _segments()
  call = lambda **kw: itk.segment_soft_topk_mask(
      jnp.asarray(x), kw.pop("ids", ids), kw.pop("k", k), **{"num_segments": len(SIZES), **kw})
  with pytest.raises(ValueError, match=r"segment_ids.*\[0, num_segments\) = \[0, 6\)"):
    call(ids=np.where(ids == 3, 7, ids))
  with pytest.raises(ValueError, match=r"segment_ids.*\[0, 6\)"):
    call(ids=np.where(ids == 3, -1, ids))
  with pytest.raises(ValueError, match=r"`k` must satisfy 0 <= k <= the size of its segment"):
    call(k=k + np.array([0, 0, 0.5, 0, 0, 0]))  # the empty segment asks for 0.5
  with pytest.raises(ValueError, match=r"`k` must satisfy 0 <= k <= n"):
    call(k=-1.0)
  with pytest.raises(ValueError, match=r"segment_ids.*shape"):
    call(ids=ids[:-1])
  with pytest.raises(TypeError, match=r"segment_ids.*integer"):
    call(ids=ids.astype(float))
  with pytest.raises(ValueError, match=r"`k` must be a scalar or broadcast"):
    call(k=np.ones(5))
  with pytest.raises(ValueError, match=r"num_segments.*traced"):
    jax.jit(lambda i: itk.segment_soft_topk_mask(jnp.asarray(x), i, 1.0))(ids)
  # num_segments inferred from concrete ids
  np.testing.assert_allclose(itk.segment_soft_topk_mask(jnp.asarray(x), ids, k),
                             call(), atol=0)


@pytest.mark.parametrize("bad_id", [9, -1, -len(SIZES)])  # negative ids: jnp.take wraps them
def test_traced_bad_segments_give_nan(bad_id):
  x, ids, k = _segments()
  f = jax.jit(lambda i, k_: itk.segment_soft_topk_mask(
      jnp.asarray(x), i, k_, num_segments=len(SIZES), regularization_strength=0.1))
  bad_ids = np.where(np.arange(x.size) == 0, bad_id, ids)
  out = np.asarray(f(bad_ids, k))
  assert np.isnan(out[0]) and not np.isnan(out[1:][bad_ids[1:] != ids[0]]).any()
  with_budget = jax.jit(lambda i: itk.segment_soft_topk_mask(
      jnp.asarray(x), i, 1.0, num_segments=len(SIZES), max_support=3, standardize=True))
  assert np.isnan(np.asarray(with_budget(bad_ids))[0])
  too_big = k.copy()
  too_big[1] = 6.0  # segment 1 has 5 entries
  out = np.asarray(f(ids, too_big))
  assert np.isnan(out[ids == 1]).all() and not np.isnan(out[ids != 1]).any()


# -- where= -------------------------------------------------------------------------
def _padded(seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(3, 10))
  lengths = np.array([10, 6, 3])
  where = np.arange(10) < lengths[:, None]
  x[~where] = rng.choice([1e3, np.inf, np.nan], size=(~where).sum())  # padding garbage
  return x, where, lengths


OPS = [(itk.soft_topk_mask, bisect_mask), (itk.soft_topk_mag, bisect_mag)]


@pytest.mark.parametrize("op, reference", OPS)
def test_where_equals_the_operator_on_the_valid_entries(op, reference):
  x, where, lengths = _padded()
  k = np.array([3.5, 2.0, 2.5])
  l, p = 0.3, 4.0 / 3.0
  got = np.asarray(op(jnp.asarray(x), jnp.asarray(k), regularization_strength=l, where=jnp.asarray(where)))
  assert np.all(got[~where] == 0)
  for r, n in enumerate(lengths):
    np.testing.assert_allclose(got[r, :n], reference(x[r, :n], k[r], l, p), atol=1e-10)


@pytest.mark.slow
@pytest.mark.parametrize("op, reference", OPS)
def test_where_jit_and_per_row_operator(op, reference):
  x, where, lengths = _padded()
  k = np.array([3.5, 2.0, 2.5])
  got = np.asarray(op(jnp.asarray(x), jnp.asarray(k), regularization_strength=0.3, where=jnp.asarray(where)))
  got_jit = np.asarray(jax.jit(lambda z, w: op(z, jnp.asarray(k), regularization_strength=0.3, where=w))(x, where))
  np.testing.assert_allclose(got_jit, got, atol=1e-12)
  for r, n in enumerate(lengths):
    np.testing.assert_allclose(got[r, :n], op(jnp.asarray(x[r, :n]), k[r], regularization_strength=0.3), atol=1e-12)


def _where_loss(op, seed=1):
  x, where, lengths = _padded(seed)
  x = np.where(where, x, 0.7)  # finite padding so that the unmasked loss is finite
  w = np.random.default_rng(5).normal(size=x.shape)
  k = jnp.asarray([3.5, 2.0, 2.5])
  loss = lambda z: jnp.sum(w * op(z, k, regularization_strength=0.3, where=jnp.asarray(where)))
  return loss, jnp.asarray(x), where, lengths, w, k


@pytest.mark.parametrize("op", [itk.soft_topk_mask,
                                pytest.param(itk.soft_topk_mag, marks=pytest.mark.slow)])
def test_where_derivatives_are_zero_outside_and_finite_differences_inside(op):
  loss, x, where, _, _, k = _where_loss(op)
  grad = np.asarray(jax.grad(loss)(x))
  assert np.all(grad[~where] == 0)
  eps = 1e-6
  for i, j in zip(*np.nonzero(where)):
    fd = (loss(x.at[i, j].add(eps)) - loss(x.at[i, j].add(-eps))) / (2 * eps)
    np.testing.assert_allclose(grad[i, j], fd, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("op", [itk.soft_topk_mask, itk.soft_topk_mag])
def test_where_derivatives_match_the_per_row_operator(op):
  loss, x, where, lengths, w, k = _where_loss(op)
  grad = np.asarray(jax.grad(loss)(x))
  for r, n in enumerate(lengths):
    want = jax.grad(lambda z: jnp.sum(w[r, :n] * op(z, k[r], regularization_strength=0.3)))(x[r, :n])
    np.testing.assert_allclose(grad[r, :n], want, atol=1e-10)
  _, tangent_out = jax.jvp(lambda z: op(z, k, regularization_strength=0.3, where=jnp.asarray(where)), (x,),
                           (jnp.ones_like(x),))
  assert np.all(np.asarray(tangent_out)[~where] == 0)


def test_where_k_rule_and_errors():
  x, where, lengths = _padded()
  xs, ws = jnp.asarray(x), jnp.asarray(where)
  ones = itk.soft_topk_mask(xs, jnp.asarray(lengths, float), where=ws, regularization_strength=0.1)
  np.testing.assert_array_equal(ones, where.astype(float))
  np.testing.assert_array_equal(itk.soft_topk_mask(xs, jnp.zeros(3), where=ws, regularization_strength=0.1), np.zeros_like(x))
  with pytest.raises(ValueError, match=r"`k` must satisfy 0 <= k <= the number of valid"):
    itk.soft_topk_mask(xs, 4.0, where=ws)  # the last row has 3 valid entries
  with pytest.raises(ValueError, match=r"`where` must be a boolean array of the shape"):
    itk.soft_topk_mask(xs, 1.0, where=ws[:, :5])
  with pytest.raises(TypeError, match=r"`where` must be a boolean"):
    itk.soft_topk_mag(xs, 1.0, where=ws.astype(int))



@pytest.mark.slow
def test_where_traced_k_above_the_valid_count_gives_nan():
  x, where, _ = _padded()
  xs, ws = jnp.asarray(x), jnp.asarray(where)
  out = jax.jit(lambda k_: itk.soft_topk_mask(xs, k_, where=ws, regularization_strength=0.1))(jnp.array([1.0, 1.0, 4.0]))
  assert np.isnan(out[2, :3]).all() and np.all(out[2, 3:] == 0) and not np.isnan(out[:2]).any()


def test_where_magnitude_near_the_valid_count():
  """Excluded entries are solved as zeros, which the magnitude operator never keeps:
  for k up to the valid count the valid entries are unaffected, also when some valid
  entries are 0 themselves."""
  x = np.array([[2.0, -0.5, 0.0, 1.5, 9.0, 9.0]])
  where = np.array([[True, True, True, True, False, False]])
  for k in (2.5, 3.0, 3.5, 4.0):
    got = np.asarray(itk.soft_topk_mag(jnp.asarray(x), k, regularization_strength=0.2, where=jnp.asarray(where)))
    np.testing.assert_allclose(got[0, :4], bisect_mag(x[0, :4], k, 0.2, 4.0 / 3.0), atol=1e-10)
    assert np.all(got[0, 4:] == 0)
  # k >= #nonzero valid entries: the valid entries unchanged
  np.testing.assert_array_equal(itk.soft_topk_mag(jnp.asarray(x), 3.0, regularization_strength=0.2,
                                                  where=jnp.asarray(where))[0, :4], x[0, :4])
