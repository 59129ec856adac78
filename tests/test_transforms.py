"""JAX transformations of ``soft_topk_mask``: jit, vmap, autodiff, dtypes, axes, sharding.

float64 is enabled by conftest.py (and again below); float32 and the half types are
requested explicitly where they are tested. Arrays and pytrees are compared with
``chex.assert_trees_all_close`` (through :func:`close`: float64, absolute tolerance
only), shapes and dtypes with ``chex.assert_shape`` / ``chex.assert_type``.

Speed: tracing and compiling the threshold solver costs about a second per jitted
function, so each test puts everything it compares into one ``jax.jit`` (the
transformations are the same inside and outside ``jit``; ``test_jit_matches_eager``
runs as chex variants, with and without ``jax.jit``, and checks the two agree). The
sharding check runs in a subprocess that is started in the background when the module
starts and collected by its test at the end.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

import implicit_topk as itk

# One worker runs this module (pyproject: --dist loadgroup): its tests share compiled
# functions, which a second worker would compile again.
pytestmark = pytest.mark.xdist_group("test_transforms")

jax.config.update("jax_enable_x64", True)

SOLVERS = ("threshold", "pav")
P43 = 4.0 / 3.0
PS = (P43, 1.5, 2.0, 3.0)
parametrize_solver = pytest.mark.parametrize("solver", SOLVERS)
# the threshold solver compiles slowly: some of its cases are in the slow group
parametrize_solver_slow_threshold = pytest.mark.parametrize(
    "solver", [pytest.param("threshold", marks=pytest.mark.slow), "pav"])
parametrize_solver_slow_pav = pytest.mark.parametrize(
    "solver", ["threshold", pytest.param("pav", marks=pytest.mark.slow)])
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _x(shape, seed=0, dtype=np.float64):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape), dtype)


def _soft(x, k, l=0.3, **static):
  return itk.soft_topk_mask(x, k, regularization_strength=l, **static)


def close(actual, desired, atol=1e-12):
  """``|actual - desired| <= atol`` leaf by leaf, in float64 (rtol=0).

  ``actual`` and ``desired`` are arrays or pytrees of the same structure; a scalar leaf
  broadcasts against an array leaf, otherwise shapes must match.
  """
  to64 = lambda a: np.asarray(a, np.float64)
  chex.assert_trees_all_close(jax.tree.map(to64, actual), jax.tree.map(to64, desired),
                              rtol=0, atol=atol)


# ---------------------------------------------------------------------------------
# the sharding subprocess (started early, checked by the last test)
# ---------------------------------------------------------------------------------

_SHARDING_SCRIPT = textwrap.dedent(r"""
    import jax
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import implicit_topk as itk

    assert len(jax.devices()) == 2, jax.devices()
    mesh = Mesh(np.array(jax.devices()), ("batch",))
    rows = NamedSharding(mesh, P("batch", None))
    per_row = NamedSharding(mesh, P("batch"))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 64))
    w = rng.normal(size=(8, 64))
    k = np.linspace(1.5, 60.5, 8)
    xs = jax.device_put(x, rows)
    ks = jax.device_put(k, per_row)
    assert len(xs.addressable_shards) == 2
    assert xs.sharding.shard_shape(xs.shape) == (4, 64)

    for solver, p in (("threshold", 4 / 3), ("pav", 4 / 3), ("dykstra", 2.0)):
      options = {"tol": 1e-12} if solver == "dykstra" else {}
      def mask(x, k):
        return itk.soft_topk_mask(x, k, l=0.3, p=p, solver=solver, **options)
      def loss(x, k):
        return jnp.sum(w * mask(x, k))
      grad = jax.grad(loss, argnums=(0, 1))
      # unsharded reference: one device, uncommitted numpy inputs
      y_ref, (gx_ref, gk_ref) = jax.jit(lambda x, k: (mask(x, k), grad(x, k)))(x, k)
      y_ref, gx_ref, gk_ref = map(np.asarray, (y_ref, gx_ref, gk_ref))
      # sharded inputs, shardings propagated by jit
      y_sh = jax.jit(mask)(xs, ks)
      gx_sh, gk_sh = jax.jit(grad)(xs, ks)
      np.testing.assert_allclose(np.asarray(y_sh), y_ref, rtol=0, atol=1e-12)
      np.testing.assert_allclose(np.asarray(gx_sh), gx_ref, rtol=0, atol=1e-10)
      np.testing.assert_allclose(np.asarray(gk_sh), gk_ref, rtol=0, atol=1e-10)
      np.testing.assert_allclose(np.asarray(y_sh).sum(-1), k, rtol=0, atol=1e-10)
      assert np.abs(gx_ref).max() > 1e-3
      # explicit in/out shardings
      f2 = jax.jit(mask, in_shardings=(rows, per_row), out_shardings=rows)
      y2 = f2(x, k)
      assert y2.sharding.is_equivalent_to(rows, 2), y2.sharding
      assert len(y2.addressable_shards) == 2
      np.testing.assert_allclose(np.asarray(y2), y_ref, rtol=0, atol=1e-12)
      g2 = jax.jit(grad, in_shardings=(rows, per_row), out_shardings=(rows, per_row))
      gx2, gk2 = g2(x, k)
      assert gx2.sharding.is_equivalent_to(rows, 2), gx2.sharding
      np.testing.assert_allclose(np.asarray(gx2), gx_ref, rtol=0, atol=1e-10)
      np.testing.assert_allclose(np.asarray(gk2), gk_ref, rtol=0, atol=1e-10)
      print(solver, "ok")
    print("SHARDING OK")
""")

_SHARDING_TEST = "test_sharded_batch_matches_unsharded"


def _start_sharding_subprocess():
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  return subprocess.Popen([sys.executable, "-c", _SHARDING_SCRIPT], env=env, cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module", autouse=True)
def _sharding_process(request):
  """Starts the sharding subprocess at once if its test was selected, in a serial run (it
  overlaps the module's other tests). Under pytest-xdist every worker collects every test
  but only one runs it, so there the test starts the subprocess itself (an eager start
  here would run it in every worker)."""
  serial = not hasattr(request.config, "workerinput")
  selected = serial and any(item.name == _SHARDING_TEST for item in request.session.items)
  proc = _start_sharding_subprocess() if selected else None
  yield proc
  if proc is not None and proc.poll() is None:
    proc.kill()
    proc.communicate()


# ---------------------------------------------------------------------------------
# jit and vmap
# ---------------------------------------------------------------------------------

class JitMatchesEagerTest(chex.TestCase):
  """The eager result (Python-number k and l) under ``jax.jit`` and without it."""

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(*((s, s) for s in SOLVERS))
  def test_jit_matches_eager(self, solver):
    x = _x((4, 12))
    y = _soft(x, 3.5, solver=solver)  # eager, Python numbers
    chex.assert_shape(y, x.shape)
    chex.assert_type(y, jnp.float64)
    assert 0 < np.sum(np.asarray(y) == 0) and 0 < np.sum((0 < y) & (y < 1))  # non-trivial
    close(y.sum(-1), 3.5, 1e-10)

    @self.variant
    def both(x, k, l):
      return (_soft(x, 3.5, solver=solver),  # static k, l
              itk.soft_topk_mask(x, k, regularization_strength=l, solver=solver),  # array k, l (traced under jit)
              itk.soft_topk_mask(x, 2.0, regularization_strength=l, solver=solver))

    y_static, y_array, y_k2 = both(x, jnp.asarray(3.5), jnp.asarray(0.3))
    chex.assert_shape([y_static, y_array, y_k2], x.shape)
    chex.assert_type([y_static, y_array, y_k2], jnp.float64)
    close((y_static, y_array), (y, y))
    close(y_k2.sum(-1), 2.0, 1e-10)
    # the public function itself through the variant, k and l Python numbers (weakly
    # typed tracers under jit)
    g = self.variant(itk.soft_topk_mask, static_argnames=("p", "solver", "axis"))
    close(g(x, 3.5, regularization_strength=0.3, solver=solver), y)


@parametrize_solver_slow_threshold
def test_vmap_matches_batched_call(solver):
  x = _x((6, 11), seed=1)
  k = jnp.linspace(0.5, 9.5, 6)
  ls = jnp.linspace(0.1, 2.0, 6)

  @jax.jit
  def run(x, k, ls):
    row = lambda r, kk=3.0, ll=0.3: _soft(r, kk, l=ll, solver=solver)
    return dict(
        batched=_soft(x, 3.0, solver=solver),
        mapped=jax.vmap(row)(x),
        batched_k=_soft(x, k, solver=solver),
        mapped_k=jax.vmap(row)(x, k),
        batched_kl=_soft(x, k, l=ls, solver=solver),
        mapped_kl=jax.vmap(row)(x, k, ls),
        mapped_t=jax.vmap(row, in_axes=1, out_axes=1)(x.T),
        mapped_k_only=jax.vmap(row, in_axes=(None, 0))(x[0], k),
    )

  out = run(x, k, ls)
  close(out["mapped"], out["batched"])
  close(out["mapped_k"], out["batched_k"])
  close(out["mapped_kl"], out["batched_kl"])
  close(out["mapped_t"], out["batched"].T)
  close(out["mapped_k_only"].sum(-1), k, 1e-10)
  close(out["batched_kl"].sum(-1), k, 1e-10)
  # against a plain Python loop of eager calls
  for b in (0, 3):
    close(out["mapped_kl"][b], _soft(x[b], float(k[b]), l=float(ls[b]), solver=solver))
    close(out["mapped_k_only"][b], _soft(x[0], float(k[b]), solver=solver))


@pytest.mark.slow
@parametrize_solver_slow_threshold
def test_nested_vmap(solver):
  x = _x((3, 4, 9), seed=2)
  k = jnp.arange(1.0, 13.0).reshape(3, 4) * 0.6
  ks = jnp.array([1.5, 4.0])
  f = lambda r, kk: _soft(r, kk, solver=solver)

  @jax.jit
  def run(x, k, ks):
    return (jax.vmap(jax.vmap(f))(x, k), _soft(x, k, solver=solver),
            # inner map over k only (x broadcast), outer over x
            jax.vmap(lambda r: jax.vmap(lambda kk: f(r, kk))(ks))(x[0]),  # (4, 2, 9)
            # outer map over the last batch axis
            jax.vmap(jax.vmap(f), in_axes=(1, 1), out_axes=1)(x, k))

  nested, batched, grid, nested_t = run(x, k, ks)
  close(nested, batched)
  close(nested_t, batched)
  close(nested.sum(-1), k, 1e-10)
  for j in range(2):
    close(grid[:, j], _soft(x[0], float(ks[j]), solver=solver))


@pytest.mark.slow
@parametrize_solver_slow_threshold
def test_any_leading_batch_shape(solver):
  x = _x((2, 3, 2, 7), seed=3)

  @jax.jit
  def run(x):
    return _soft(x, 2.5, solver=solver), _soft(x.reshape(-1, 7), 2.5, solver=solver)

  y, flat = run(x)
  chex.assert_shape(y, x.shape)
  close(y.reshape(-1, 7), flat)
  y1 = _soft(x[0, 0, 0], 2.5, solver=solver)  # a single 1-D row, eager
  chex.assert_shape(y1, (7,))
  close(y[0, 0, 0], y1)


# ---------------------------------------------------------------------------------
# axis and per-row k
# ---------------------------------------------------------------------------------

@pytest.mark.slow
@parametrize_solver_slow_threshold
def test_axis_equals_moving_the_axis(solver):
  x = _x((5, 6, 7), seed=4)
  rng = np.random.default_rng(5)
  axes = (0, 1, 2)
  batch = {a: tuple(s for i, s in enumerate(x.shape) if i != a) for a in axes}
  ks = {a: jnp.asarray(rng.uniform(0.2, x.shape[a] - 0.2, size=batch[a])) for a in axes}

  @jax.jit
  def run(x, ks):
    out = {}
    for a in axes:
      moved = jnp.moveaxis(x, a, -1)
      out[a] = dict(
          y=_soft(x, 2.5, axis=a, solver=solver),
          y_neg=_soft(x, 2.5, axis=a - 3, solver=solver),
          manual=jnp.moveaxis(_soft(moved, 2.5, solver=solver), -1, a),
          y_k=_soft(x, ks[a], axis=a, solver=solver),
          manual_k=jnp.moveaxis(_soft(moved, ks[a], solver=solver), -1, a),
      )
    # k broadcastable to the batch shape (5, 6) of axis=-1: shape (5, 1)
    col = _soft(x, ks[2][:, :1], axis=-1, solver=solver)
    return out, col

  out, col = run(x, ks)
  for a in axes:
    o = out[a]
    chex.assert_shape([o["y"], o["y_neg"], o["y_k"]], x.shape)
    close(o["y"], o["manual"])
    close(o["y_neg"], o["y"], 0)
    close(o["y"].sum(a), 2.5, 1e-10)
    close(o["y_k"], o["manual_k"])
    close(o["y_k"].sum(a), ks[a], 1e-10)
    assert not np.allclose(o["y"], out[(a + 1) % 3]["y"])  # the axis matters
  chex.assert_shape(col, x.shape)
  close(col.sum(-1), jnp.broadcast_to(ks[2][:, :1], batch[2]), 1e-10)


@pytest.mark.slow
@parametrize_solver_slow_threshold
def test_per_row_k_matches_row_by_row(solver):
  x = _x((6, 12), seed=6)
  # (non-integer k: at an integer k whose row is all 0/1 the mask is not differentiable
  # in k; the library returns a zero derivative there)
  k = jnp.array([0.5, 1.25, 3.25, 6.5, 9.9, 11.5])
  row_sums = lambda kk: _soft(x, kk, solver=solver).sum(-1)

  @jax.jit
  def run(x, k):
    return (_soft(x, k, solver=solver), [_soft(x[b], k[b], solver=solver) for b in range(6)],
            jax.jacfwd(row_sums)(k), jax.jacrev(row_sums)(k))

  y, rows, jac_f, jac_r = run(x, k)
  close(y.sum(-1), k, 1e-10)
  for b in range(6):
    close(y[b], rows[b])
  # d(sum_i y_bi)/d k_c = delta_bc
  close(jac_f, np.eye(6), 1e-9)
  close(jac_r, np.eye(6), 1e-9)


def test_invalid_arguments_raise():
  x = _x((3, 5))
  with pytest.raises(ValueError, match="0 <= k <= n"):
    itk.soft_topk_mask(x, 5.5)  # k > n
  with pytest.raises(ValueError, match="0 <= k <= n"):
    itk.soft_topk_mask(x, jnp.array([1.0, -0.5, 2.0]))  # one row has k < 0
  with pytest.raises(ValueError):
    itk.soft_topk_mask(x, 2.0, regularization_strength=0.0)
  with pytest.raises(ValueError):
    itk.soft_topk_mask(x, 2.0, axis=2)
  with pytest.raises(ValueError):
    itk.soft_topk_mask(x, 2.0, solver="sort")
  with pytest.raises(ValueError):
    itk.soft_topk_mask(x, 2.0, implicit_diff_backend="torch")
  with pytest.raises(TypeError):
    itk.soft_topk_mask(jnp.arange(5), 2.0)


# ---------------------------------------------------------------------------------
# dtypes
# ---------------------------------------------------------------------------------

_DTYPES = {"float64": 1e-12, "float32": 2e-6, "bfloat16": 1e-2, "float16": 2e-3}


@pytest.mark.parametrize("solver", [pytest.param(s, marks=pytest.mark.slow) for s in ("threshold", "pav")]
                         + ["auto"])
def test_dtype_in_out(solver):
  xs = {d: _x((4, 16), seed=7, dtype=d) for d in _DTYPES}
  w = jnp.arange(16.0)

  def loss(x):
    return jnp.sum(_soft(x, 4.5, l=0.5, solver=solver) * w.astype(x.dtype))

  @jax.jit
  def run(xs):
    out = {}
    for d, x in xs.items():
      out[d] = dict(y=_soft(x, 4.5, l=0.5, solver=solver), g=jax.grad(loss)(x),
                    # reference: the same rounded input, in float64
                    ref=_soft(x.astype(jnp.float64), 4.5, l=0.5, solver="threshold"),
                    g_ref=jax.grad(loss)(x.astype(jnp.float64)))
    return out

  out = run(xs)
  for d, atol in _DTYPES.items():
    o = out[d]
    y, g, ref = o["y"], o["g"], np.asarray(o["ref"])
    chex.assert_type([y, g], jnp.dtype(d))
    chex.assert_shape([y, g], (4, 16))
    y64 = np.asarray(y, np.float64)
    assert np.max(np.abs(y64 - ref)) <= atol, (d, np.max(np.abs(y64 - ref)))
    assert np.all((y64 >= 0) & (y64 <= 1))
    # sparsity survives the cast: exact zeros where the reference has them
    assert np.all(y64[ref == 0.0] == 0.0) and np.any(y64 == 0.0), (d, y64)
    assert np.all(np.isfinite(np.asarray(g, np.float64)))
    if d in ("float32", "float64"):
      close(g, o["g_ref"], 1e-4 if d == "float32" else 1e-12)
  # eager calls keep the dtype as well
  for d in ("float32", "bfloat16"):
    y = _soft(xs[d], 4.5, l=0.5, solver=solver)
    chex.assert_type(y, jnp.dtype(d))
    close(y, out[d]["y"], 1e-2 if d == "bfloat16" else 1e-6)


# ---------------------------------------------------------------------------------
# derivatives
# ---------------------------------------------------------------------------------

def _analytic_jacobian(y, l, p):
  """dy_i/dx_j = (g_i / l) (delta_ij - g_j / sum g), g_i = dmask/dz on 0 < y < 1."""
  a = 1.0 / (p - 1.0)
  y = np.asarray(y)
  inside = (y > 0) & (y < 1)
  z = np.where(inside, y, 0.5) ** (1.0 / a)
  g = np.where(inside, a * z ** (a - 1.0), 0.0)
  return (np.diag(g) - np.outer(g, g) / g.sum()) / l


def _solver_ps(solver):
  # the general-p PAV kernels are covered by test_properties; keep numba time down here
  return PS if solver == "threshold" else (P43, 2.0)


@parametrize_solver
def test_jacobians_agree(solver):
  """jacfwd == jacrev == the closed form; jvp/vjp == products with the Jacobian."""
  x = _x((12,), seed=8)
  v = _x((12,), seed=9)
  l = 1.5
  ps = _solver_ps(solver)

  @jax.jit
  def run(x, v):
    out = {}
    for p in ps:
      f = lambda x: _soft(x, 4.5, l=l, p=p, solver=solver)
      y_jvp, t = jax.jvp(f, (x,), (v,))
      _, vjp = jax.vjp(f, x)
      out[p] = dict(y=f(x), j_fwd=jax.jacfwd(f)(x), j_rev=jax.jacrev(f)(x), y_jvp=y_jvp,
                    jvp=t, vjp=vjp(v)[0])
    return out

  out = run(x, v)
  for p in ps:
    o = out[p]
    y, j_fwd = o["y"], np.asarray(o["j_fwd"])
    assert np.sum((0 < y) & (y < 1)) >= 3 and np.any(y == 0), (p, y)
    close(o["j_rev"], j_fwd, 1e-10)
    close(j_fwd, _analytic_jacobian(y, l, p), 1e-8)
    assert np.abs(j_fwd).max() > 0.1
    close(j_fwd, j_fwd.T, 1e-10)  # the Hessian of a convex function
    close(j_fwd.sum(0), 0.0, 1e-10)  # sum y = k does not move
    close(j_fwd.sum(1), 0.0, 1e-10)  # invariance to x + c
    close(o["y_jvp"], y)
    close(o["jvp"], j_fwd @ np.asarray(v), 1e-10)
    close(o["vjp"], np.asarray(v) @ j_fwd, 1e-10)


@pytest.mark.slow
@parametrize_solver_slow_threshold
def test_batched_jacobian_is_block_diagonal(solver):
  x = _x((3, 8), seed=10)
  k = jnp.array([1.5, 4.0, 6.5])
  f = lambda x: _soft(x, k, l=1.0, solver=solver)

  @jax.jit
  def run(x):
    singles = [jax.jacfwd(lambda r: _soft(r, k[b], l=1.0, solver=solver))(x[b])
               for b in range(3)]
    return jax.jacfwd(f)(x), jax.jacrev(f)(x), singles

  j_fwd, j_rev, singles = run(x)
  chex.assert_shape([j_fwd, j_rev], (3, 8, 3, 8))
  close(j_fwd, j_rev, 1e-10)
  for b in range(3):
    for c in range(3):
      block = np.asarray(j_fwd[b, :, c, :])
      if b == c:
        close(block, singles[b], 1e-10)
        assert np.abs(block).max() > 0.05, (b, block)
      else:
        assert np.all(block == 0.0)


@parametrize_solver_slow_pav
def test_grad_matches_finite_differences(solver):
  """Gradients w.r.t. x, k and l against central differences (float64)."""
  x = _x((2, 10), seed=11)
  w = _x((2, 10), seed=12)
  k = jnp.array([2.5, 6.0])
  l = jnp.array([0.4, 1.3])
  ps = (P43, 2.0)

  def losses(x, k, l):
    return jnp.stack([jnp.sum(w * _soft(x, k, l=l, p=p, solver=solver)) for p in ps])

  f = jax.jit(losses)
  grads = jax.jit(jax.jacrev(losses, argnums=(0, 1, 2)))(x, k, l)
  eps = 1e-6

  def fd(i):
    args = [np.asarray(a) for a in (x, k, l)]
    out = np.zeros((len(ps),) + args[i].shape)
    for idx in np.ndindex(args[i].shape):
      plus = [a.copy() for a in args]
      minus = [a.copy() for a in args]
      plus[i][idx] += eps
      minus[i][idx] -= eps
      out[(slice(None),) + idx] = (np.asarray(f(*plus)) - np.asarray(f(*minus))) / (2 * eps)
    return out

  for i in range(3):
    close(grads[i], fd(i), 1e-6)
  assert np.abs(np.asarray(grads[0])).max() > 1e-2  # not vacuous


@pytest.mark.slow
@parametrize_solver_slow_threshold
def test_hessian_vector_product(solver):
  x = _x((2, 10), seed=13)
  w = _x((2, 10), seed=14)
  v = _x((2, 10), seed=15)
  ps = _solver_ps(solver)
  eps = 1e-6

  @jax.jit
  def run(x, v):
    out = {}
    for p in ps:
      f = lambda x: jnp.sum(w * _soft(x, 3.5, l=0.8, p=p, solver=solver))
      grad = jax.grad(f)
      g, hvp = jax.jvp(grad, (x,), (v,))  # forward-over-reverse
      out[p] = dict(g=g, hvp=hvp,
                    hvp_rr=jax.grad(lambda x: jnp.vdot(grad(x), v))(x),  # reverse-over-reverse
                    fd=(grad(x + eps * v) - grad(x - eps * v)) / (2 * eps))
    return out

  out = run(x, v)
  for p in ps:
    o = out[p]
    assert np.all(np.isfinite(o["g"])) and np.all(np.isfinite(o["hvp"])), p
    close(o["hvp"], o["hvp_rr"], 1e-8)
    if p == P43:  # C^1 with a piecewise-smooth gradient: central differences agree
      close(o["hvp"], o["fd"], 1e-5)
      assert np.abs(np.asarray(o["hvp"])).max() > 1e-3
    if p == 2.0:  # piecewise linear: the Hessian is zero almost everywhere
      close(o["hvp"], 0.0, 1e-10)
      close(o["fd"], 0.0, 1e-6)


# the backend imports jaxopt, which warns that it is unmaintained (expected here)
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:JAXopt is no longer maintained:DeprecationWarning")
@parametrize_solver
def test_implicit_diff_backends(solver):
  x = _x((3, 9), seed=16)
  w = _x((3, 9), seed=17)
  k = jnp.array([1.5, 3.5, 7.0])

  def mask(backend):
    return lambda x, k, l: _soft(x, k, l=l, solver=solver, implicit_diff_backend=backend)

  def loss(backend):
    return lambda x, k, l: jnp.sum(w * mask(backend)(x, k, l))

  @jax.jit
  def run(x, k, l):
    return {b: dict(y=mask(b)(x, k, l), grads=jax.grad(loss(b), (0, 1, 2))(x, k, l),
                    jac=jax.jacrev(mask(b))(x, k, l))
            for b in ("lax", "jaxopt")}

  out = run(x, k, 0.6)
  close(out["jaxopt"]["y"], out["lax"]["y"], 0)  # the primal does not depend on it
  chex.assert_shape(out["lax"]["grads"], [(3, 9), (3,), ()])
  close(out["jaxopt"]["grads"], out["lax"]["grads"], 1e-10)  # (x, k, l)
  close(out["jaxopt"]["jac"], out["lax"]["jac"], 1e-10)
  assert np.abs(np.asarray(out["lax"]["grads"][0])).max() > 1e-2
  # jaxopt's custom_vjp has no forward mode ...
  with pytest.raises(TypeError, match="forward-mode|jvp"):
    jax.jvp(lambda x: loss("jaxopt")(x, k, 0.6), (x,), (w,))
  with pytest.raises(TypeError, match="forward-mode|jvp"):
    jax.jacfwd(lambda x: mask("jaxopt")(x, k, 0.6))(x)
  with pytest.raises(TypeError, match="forward-mode|jvp"):
    jax.jit(lambda x: jax.jvp(lambda x: loss("jaxopt")(x, k, 0.6), (x,), (w,)))(x)
  # ... while the lax backend has
  _, t = jax.jit(lambda x: jax.jvp(lambda x: loss("lax")(x, k, 0.6), (x,), (w,)))(x)
  close(t, jnp.vdot(out["lax"]["grads"][0], w), 1e-10)


@pytest.mark.slow
def test_unrolled_threshold_matches_implicit():
  x = _x((2, 10), seed=18)
  k = jnp.array([2.5, 6.0])
  l = jnp.array([0.5, 0.5])
  implicit = itk.ThresholdSolver(regularizer=itk.PNorm(P43))
  unrolled = itk.ThresholdSolver(regularizer=itk.PNorm(P43), implicit_diff=False, maxiter=40)

  @jax.jit
  def run(x):
    return (implicit.mask(x, k, l), unrolled.mask(x, k, l),
            jax.jacfwd(lambda x: implicit.mask(x, k, l))(x),
            jax.jacfwd(lambda x: unrolled.mask(x, k, l))(x))

  y_imp, y_unr, j_imp, j_unr = run(x)
  close(y_unr, y_imp)
  close(j_unr, j_imp, 1e-6)
  with pytest.raises(ValueError):
    itk.PAVSolver(implicit_diff=False).mask(x, k, l)


@parametrize_solver_slow_threshold
def test_solver_objects(solver):
  """The object API: run -> OptStep(lam, RootState), optimality_fun, mask."""
  cls = {"threshold": itk.ThresholdSolver, "pav": itk.PAVSolver}[solver]
  obj = cls(regularizer=itk.PNorm(P43))
  x = _x((4, 10), seed=19)
  k = jnp.array([1.5, 2.5, 5.0, 8.75])
  l = jnp.full((4,), 0.4)

  @jax.jit
  def run(x, k):
    step = obj.run(None, x, k, 0.4)
    return (step, obj.optimality_fun(step.params, x, k, l), obj.mask(x, k, 0.4),
            _soft(x, k, l=0.4, solver=solver),
            jax.jacfwd(lambda k: obj.run(None, x, k, 0.4).params)(k))

  step, phi, mask, functional, dlam = run(x, k)
  assert isinstance(step, itk.OptStep) and isinstance(step.state, itk.RootState)
  chex.assert_shape([step.params, step.state.iter_num, step.state.residual], (4,))
  assert np.all(step.state.residual <= 1e-10)
  close(phi, 0.0, 1e-10)
  close(mask, functional)
  # d lam / d k = -1 / phi'(lam) < 0: raising k lowers the threshold
  assert np.all(np.diag(np.asarray(dlam)) < 0)
  # eager run with a warm start gives the same threshold
  warm = obj.run(step.params + 0.01, x, k, 0.4)
  close(warm.params, step.params, 1e-10)


# ---------------------------------------------------------------------------------
# sharding (2 host devices in a subprocess started by the module fixture)
# ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_sharded_batch_matches_unsharded(_sharding_process):
  proc = _sharding_process if _sharding_process is not None else _start_sharding_subprocess()
  try:
    stdout, stderr = proc.communicate(timeout=300)
  except subprocess.TimeoutExpired:
    proc.kill()
    stdout, stderr = proc.communicate()
    pytest.fail(f"sharding subprocess timed out:\n{stdout}\n{stderr[-5000:]}")
  assert proc.returncode == 0, f"stdout:\n{stdout}\nstderr:\n{stderr[-5000:]}"
  assert "threshold ok" in stdout and "pav ok" in stdout and "SHARDING OK" in stdout, stdout
