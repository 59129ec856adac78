"""The permutahedron solvers: pure JAX (``"pav_jax"``, the default) vs the host PAV
(``"pav"``) vs an independent plain-Python PAV; gradients, ``jax.export`` and
``shard_map`` of the default calls."""

import subprocess
import sys
import textwrap
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from scipy import optimize

import device_checks
import implicit_topk as itk
from implicit_topk import permutahedron as perm
from implicit_topk import regularizers
from implicit_topk.solvers import isotonic
from gradcheck import check_grads

# One worker runs this module (pyproject: --dist loadgroup): its tests share compiled
# functions, which a second worker would compile again.
pytestmark = pytest.mark.xdist_group("test_permutahedron_solvers")

def fast_only(values, *fast):
  """Parameters for a parametrization whose values outside ``fast`` are in the slow group
  (a test case is slow when any of its parameters is): the default run keeps one or two
  compilations per test, ``-m slow`` runs the rest."""
  return [v if v in fast else pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=pytest.mark.slow)
          for v in values]


KINDS = {"p1.5": dict(p=1.5), "p2": dict(p=2.0), "p3": dict(p=3.0),
         "entropy": dict(regularizer="entropy")}


# -- an independent reference: plain PAV on the sorted isotonic dual ---------------------


def _link(kind, z):
  if kind == "entropy":
    return np.exp(z)
  a = 1.0 / (KINDS[kind]["p"] - 1.0)
  return np.sign(z) * np.abs(z) ** a


def _link_inverse(kind, t):
  if kind == "entropy":
    return np.log(t)
  return np.sign(t) * np.abs(t) ** (KINDS[kind]["p"] - 1.0)


def _block_value(kind, s, w, l):
  """The root u of sum g((s_i - u) / l) = sum w_i (decreasing in u)."""
  W, m = float(np.sum(w)), len(s)
  if kind == "entropy":  # sum exp((s - u)/l) = W
    top = np.max(s)
    return top + l * np.log(np.sum(np.exp((s - top) / l))) - l * np.log(W)
  if kind == "p2":
    return float(np.mean(s) - l * W / m)
  shift = l * _link_inverse(kind, W / m)
  lo, hi = np.min(s) - shift, np.max(s) - shift
  if lo == hi:
    return lo
  F = lambda u: np.sum(_link(kind, (s - u) / l)) - W
  return optimize.brentq(F, lo, hi, xtol=1e-15, rtol=4 * np.finfo(float).eps, maxiter=500)


def _reference_pav(s, w, l, kind):
  """argmin_{v_1 >= ... >= v_n} sum l omega*((s_i - v_i)/l) + w_i v_i by sequential PAV
  (s, w sorted descending); returns v."""
  blocks = []  # [start, end, value]
  for i in range(len(s)):
    blocks.append([i, i + 1, _block_value(kind, s[i:i + 1], w[i:i + 1], l)])
    while len(blocks) > 1 and blocks[-2][2] <= blocks[-1][2]:
      end = blocks.pop()[1]
      start = blocks[-1][0]
      blocks[-1] = [start, end, _block_value(kind, s[start:end], w[start:end], l)]
  v = np.empty(len(s))
  for start, end, value in blocks:
    v[start:end] = value
  return v


def _reference_argmax(x, w, l, kind):
  """The LP argmax_{y in P(w)} <x, y> - l Omega(y) of one row (float64)."""
  order = np.argsort(-x, kind="stable")
  s, w_sorted = x[order], np.sort(w)[::-1]
  y_sorted = _link(kind, (s - _reference_pav(s, w_sorted, l, kind)) / l)
  y = np.empty_like(y_sorted)
  y[order] = y_sorted
  return y


def _reference(op, x, l, kind, w=None):
  """soft_rank / soft_sort / argmax along the last axis, row by row."""
  x = np.asarray(x, np.float64)
  rows = x.reshape(-1, x.shape[-1])
  n = rows.shape[1]
  ranks = np.arange(n, 0, -1, dtype=np.float64)
  out = []
  for r, row in enumerate(rows):
    if op == "rank":
      out.append(_reference_argmax(row, ranks, l, kind))
    elif op == "sort":  # descending soft sort: argmax over P(x) of <(n, ..., 1), y>
      out.append(_reference_argmax(ranks, row, l, kind))
    else:
      out.append(_reference_argmax(row, np.asarray(w, np.float64).reshape(-1, n)[r], l, kind))
  return np.asarray(out).reshape(x.shape)


def test_reference_matches_a_brute_force_projection():
  # p = 2: y = the Euclidean projection of x / l onto the permutahedron of w; checked
  # against SLSQP with all 2^n - 2 subset constraints (Rado) for n = 4.
  import itertools
  rng = np.random.default_rng(0)
  x, w, l = rng.normal(size=4), rng.uniform(0.5, 3.0, size=4), 0.7
  w_desc = np.sort(w)[::-1]
  cons = [{"type": "eq", "fun": lambda y: y.sum() - w.sum()}]
  for size in range(1, 4):
    for subset in itertools.combinations(range(4), size):
      cons.append({"type": "ineq",
                   "fun": lambda y, idx=list(subset), b=w_desc[:size].sum(): b - y[idx].sum()})
  res = optimize.minimize(lambda y: np.sum((y - x / l) ** 2), np.full(4, w.mean()),
                          method="SLSQP", constraints=cons, options={"ftol": 1e-15})
  np.testing.assert_allclose(_reference_argmax(x, w, l, "p2"), res.x, atol=1e-6)


# -- the operators: pav_jax vs pav vs the reference ---------------------------------------


def _data(seed, shape, *, ties=False, positive=False):
  x = np.random.default_rng(seed).normal(size=shape)
  if ties:
    x = np.round(2 * x) / 2
  if positive:
    x = np.abs(x) + 0.5
  return x


def _op(name, kind, solver, l, w=None):
  options = dict(KINDS[kind], regularization_strength=l, solver=solver)
  if name == "rank":
    return lambda x: perm.soft_rank(x, **options)
  if name == "sort":
    return lambda x: perm.soft_sort(x, descending=True, **options)
  return lambda x: perm.permutahedron_argmax(x, w, **options)


CASES = [  # (name, shape, ties)
    ("n1", (3, 1), False), ("n2", (4, 2), False), ("ties", (3, 12), True),
    ("random", (2, 40), False), ("long", (2, 700), False),
]


@pytest.mark.parametrize("kind", fast_only(list(KINDS), "p1.5"))
@pytest.mark.parametrize("case,shape,ties", fast_only(CASES, CASES[3]))
@pytest.mark.parametrize("l", fast_only([0.05, 1.0, 30.0], 1.0))
def test_pav_jax_matches_pav_and_the_reference(kind, case, shape, ties, l):
  # a stable seed per case (str hash() changes with every interpreter: PYTHONHASHSEED)
  x = _data(zlib.crc32(case.encode()) % 1000, shape, ties=ties)
  positive = _data(7, shape, ties=ties, positive=True)  # entropy sorts positive values
  w = _data(8, shape, positive=True)
  for name, point in (("rank", x), ("sort", positive if kind == "entropy" else x),
                      ("argmax", x)):
    wj = jnp.asarray(w)
    ours = np.asarray(_op(name, kind, "pav_jax", l, wj)(jnp.asarray(point)))
    host = np.asarray(_op(name, kind, "pav", l, wj)(jnp.asarray(point)))
    scale = 1 + np.abs(host)
    np.testing.assert_allclose(ours / scale, host / scale, atol=1e-12, rtol=0,
                               err_msg=f"{name} vs pav")
    if shape[-1] <= 40:
      reference = _reference(name, point, l, kind, w=w)
      atol = 1e-7 if kind == "p3" else 1e-10  # p > 2: an infinite slope of g at 0
      np.testing.assert_allclose(ours / scale, reference / scale, atol=atol, rtol=0,
                                 err_msg=f"{name} vs reference")


@pytest.mark.parametrize("kind", fast_only(list(KINDS), "p1.5"))
def test_all_equal_rows_and_default_auto(kind):
  x = jnp.full((2, 6), 1.5)
  np.testing.assert_allclose(perm.soft_rank(x, **KINDS[kind]), np.full((2, 6), 3.5),
                             rtol=1e-12)
  # (entropy: y > 0 lies in the permutahedron of positive values, so descending)
  np.testing.assert_allclose(perm.soft_sort(x, descending=kind == "entropy", **KINDS[kind]),
                             x, rtol=1e-12)
  auto = perm.soft_rank(jnp.asarray(_data(1, (3, 9))), regularization_strength=0.3, **KINDS[kind])
  explicit = perm.soft_rank(jnp.asarray(_data(1, (3, 9))), regularization_strength=0.3, solver="pav_jax",
                            **KINDS[kind])
  np.testing.assert_array_equal(auto, explicit)


@pytest.mark.parametrize("kind", fast_only(list(KINDS), "p1.5"))
@pytest.mark.parametrize("dtype", fast_only([jnp.float32, jnp.float64], jnp.float64))
def test_float32_and_float64_match_the_host(kind, dtype):
  x = jnp.asarray(_data(3, (4, 300)), dtype)
  for l in (0.1, 3.0):
    ours = perm.soft_rank(x, regularization_strength=l, solver="pav_jax", **KINDS[kind])
    host = perm.soft_rank(x, regularization_strength=l, solver="pav", **KINDS[kind])
    assert ours.dtype == dtype
    tol = 2e-4 if dtype == jnp.float32 else 1e-10
    np.testing.assert_allclose(ours, host, rtol=tol, atol=tol * 300)


@pytest.mark.parametrize("axis", fast_only([0, 1, 2, -1], 1))
def test_three_d_inputs_along_each_axis(axis):
  x = jnp.asarray(_data(4, (3, 5, 6)))
  w = jnp.asarray(_data(5, (3, 5, 6), positive=True))
  for f in (lambda x, s: perm.soft_rank(x, regularization_strength=0.4, axis=axis, solver=s),
            lambda x, s: perm.soft_sort(x, regularization_strength=0.4, axis=axis, solver=s),
            lambda x, s: perm.soft_sort(x, regularization_strength=0.4, axis=axis, solver=s, k=2, descending=True),
            lambda x, s: perm.soft_quantile(x, jnp.array([0.2, 0.9]), regularization_strength=0.4, axis=axis,
                                            solver=s),
            lambda x, s: perm.permutahedron_argmax(x, w, regularization_strength=0.4, axis=axis, solver=s, p=1.5)):
    np.testing.assert_allclose(f(x, "pav_jax"), f(x, "pav"), atol=1e-10)
  moved = jnp.moveaxis(x, axis, -1)
  np.testing.assert_allclose(jnp.moveaxis(perm.soft_rank(x, regularization_strength=0.4, axis=axis), axis, -1),
                             perm.soft_rank(moved, regularization_strength=0.4), atol=1e-12)


def test_non_finite_rows_give_nan_as_the_host():
  x = jnp.array([[1.0, jnp.nan, 0.0], [1.0, jnp.inf, 0.0], [-jnp.inf, 2.0, 0.0],
                 [1.0, 2.0, 0.0]])
  for solver in ("pav_jax", "pav"):
    y = np.asarray(perm.soft_rank(x, regularization_strength=0.5, solver=solver))
    assert np.all(np.isnan(y[:3])) and np.all(np.isfinite(y[3])), (solver, y)
    z = np.asarray(perm.soft_sort(x, regularization_strength=0.5, solver=solver))
    assert np.all(np.isnan(z[:3])) and np.all(np.isfinite(z[3])), (solver, z)


def test_empty_inputs_and_solver_errors():
  assert perm.soft_rank(jnp.zeros((0, 4))).shape == (0, 4)
  assert perm.soft_sort(jnp.zeros((3, 0))).shape == (3, 0)
  with pytest.raises(ValueError, match="`solver` must be one of"):
    perm.soft_rank(jnp.ones(3), solver="threshold")
  with pytest.raises(ValueError, match="`solver` must be one of"):
    perm.soft_quantile(jnp.ones(3), 0.5, solver="numba")


def test_jit_and_vmap():
  x = jnp.asarray(_data(6, (4, 3, 9)))
  f = jax.jit(lambda x: perm.soft_sort(x, regularization_strength=0.3))
  np.testing.assert_allclose(jax.vmap(f)(x), f(x), atol=1e-12)
  np.testing.assert_allclose(f(x), perm.soft_sort(x, regularization_strength=0.3, solver="pav"), atol=1e-12)


# -- the solver itself -----------------------------------------------------------------


@pytest.mark.parametrize("packed_bits", [None, 31, 63, 12, 10])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_descending_order_is_the_stable_descending_sort(packed_bits, dtype):
  # 12 bits: 4 index + 8 digit bits per pass; 10 bits: too few, the pair sort.
  rng = np.random.default_rng(0)
  x = np.round(rng.normal(size=(5, 16)), 1).astype(dtype)
  x[0] = 3.0  # all equal
  x[1, :4] = [np.inf, -np.inf, 1e30, -1e-30]
  x = np.where(x == 0, 0.0, x)  # +0.0 only (the bit order puts -0.0 after +0.0)
  order = np.asarray(isotonic.descending_order(jnp.asarray(x), packed_bits=packed_bits))
  np.testing.assert_array_equal(order, np.argsort(-x, axis=-1, kind="stable"))
  one = isotonic.descending_order(jnp.ones((2, 1), dtype))
  np.testing.assert_array_equal(one, np.zeros((2, 1)))


def _host_blocks(s, w, l, p):
  from implicit_topk.kernels.cpu import pav_permutahedron
  values, ids, *_ = pav_permutahedron.permutahedron_blocks(s, w, l, p, sort_x=False,
                                                           sort_w=False)
  return values, ids


@pytest.mark.parametrize("kind", fast_only(list(KINDS), "p1.5"))
def test_blocks_match_the_host_on_distinct_values(kind):
  # Continuous data: no two candidate blocks share a value, so the partition is unique.
  rng = np.random.default_rng(1)
  n = 300
  s = -np.sort(-rng.normal(size=(4, n)), axis=1)
  w = -np.sort(-(np.abs(rng.normal(size=(4, n))) + 0.1), axis=1)
  l = np.array([0.01, 0.3, 3.0, 100.0])
  reg = regularizers.Entropy() if kind == "entropy" else regularizers.PNorm(KINDS[kind]["p"])
  values, ids, rounds = isotonic.isotonic_blocks(jnp.asarray(s), jnp.asarray(w),
                                                 jnp.asarray(l), reg)
  host_values, host_ids = _host_blocks(s, w, l, "exp" if kind == "entropy" else
                                       KINDS[kind]["p"])
  np.testing.assert_array_equal(ids, host_ids)
  np.testing.assert_allclose(values, host_values, rtol=1e-12, atol=1e-12)
  assert 0 <= int(rounds) <= n


@pytest.mark.slow
def test_a_large_block_swallowing_its_neighbours_is_exact():
  # One outlier: its block absorbs neighbours one after another (a PAV cascade).
  n = 2000
  s = np.arange(n, 0, -1, dtype=np.float64)[None]
  w = -np.sort(-np.concatenate([[1e4], np.linspace(0, -1, n - 1)]))[None]
  reg = regularizers.PNorm(2.0)
  l = np.array([1.0])
  values, ids, rounds = isotonic.isotonic_blocks(jnp.asarray(s), jnp.asarray(w),
                                                 jnp.asarray(l), reg)
  v = _reference_pav(s[0], w[0], 1.0, "p2")
  np.testing.assert_allclose(np.take_along_axis(np.asarray(values), np.asarray(ids), 1)[0],
                             v, rtol=1e-12, atol=1e-9)
  plain = isotonic.isotonic_blocks(jnp.asarray(s), jnp.asarray(w), jnp.asarray(l), reg,
                                   gallop=0)
  np.testing.assert_array_equal(plain[1], ids)
  assert int(rounds) < int(plain[2])  # the run tests shorten the cascade


# -- derivatives --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", fast_only(list(KINDS), "p1.5"))
def test_gradients_match_finite_differences(kind):
  x = jnp.asarray(_data(10, (2, 7)))
  positive = jnp.asarray(_data(11, (2, 7), positive=True))
  w = jnp.asarray(_data(12, (2, 7)))
  options = dict(KINDS[kind], solver="pav_jax")
  ops = [(lambda x: perm.soft_rank(x, regularization_strength=0.4, **options), x),
         (lambda x: perm.soft_sort(x, regularization_strength=0.4, **options), positive),
         (lambda x: perm.permutahedron_argmax(x, jnp.abs(w) + 0.5, regularization_strength=0.4, **options), x),
         (lambda x: perm.soft_quantile(x, jnp.array([0.3, 0.5]), regularization_strength=0.4, **options), positive)]
  # jitted: check_grads evaluates each function a few times and differentiates it both
  # ways; eagerly, every one of those calls dispatches the solver's operations one by one.
  for op, point in ops:
    f = jax.jit(lambda x, op=op: jnp.sum(w[..., :op(x).shape[-1]] * op(x)))
    check_grads(f, (point,), modes=("fwd", "rev"), atol=1e-6, rtol=1e-6, eps=1e-6)
  g = jax.jit(lambda l: jnp.sum(w * perm.soft_rank(x, regularization_strength=l, **options)))
  check_grads(g, (0.4,), modes=("fwd", "rev"), atol=1e-6, rtol=1e-6, eps=1e-6)
  h = jax.jit(lambda v: jnp.sum(w * perm.permutahedron_argmax(x, v, regularization_strength=0.4, **options)))
  check_grads(h, (jnp.abs(w) + 0.5,), modes=("rev",), atol=1e-6, rtol=1e-6, eps=1e-6)


@pytest.mark.slow
def test_gradients_equal_the_host_path():
  x = jnp.asarray(_data(13, (3, 30), ties=True))
  w = jnp.asarray(_data(14, (3, 30)))
  for kind in KINDS:
    grads = [jax.grad(lambda x, s=s: jnp.sum(w * perm.soft_rank(x, regularization_strength=0.7, solver=s,
                                                                 **KINDS[kind])))(x)
             for s in ("pav_jax", "pav")]
    np.testing.assert_allclose(grads[0], grads[1], atol=1e-9)


# -- jax.export and shard_map --------------------------------------------------------------

OPERATORS = {
    "soft_sort": lambda z: perm.soft_sort(z),
    "soft_rank": lambda z: perm.soft_rank(z),
    "soft_quantile": lambda z: perm.soft_quantile(z, 0.5),
    "soft_topk_values": lambda z: perm.soft_topk_values(z, 2),
    "permutahedron_argmax": lambda z: perm.permutahedron_argmax(
        z, jnp.broadcast_to(jnp.arange(7.0, dtype=z.dtype), z.shape)),
}


@pytest.mark.parametrize("name", fast_only(list(OPERATORS), "soft_rank"))
@pytest.mark.parametrize("dtype", fast_only([jnp.float32, jnp.float64], jnp.float64))
def test_default_call_exports(name, dtype):
  f = OPERATORS[name]
  x = jax.random.normal(jax.random.PRNGKey(0), (4, 7), dtype)
  _check_export(f, x)


@pytest.mark.slow
@pytest.mark.parametrize("l", [0.01, 300.0])
def test_long_rows_export(l):
  # Rows of 600: block arrays shrink (small l) or the run tests run (a cascade, large l).
  x = jax.random.normal(jax.random.PRNGKey(2), (3, 600), jnp.float32)
  _check_export(lambda z: perm.soft_rank(z, regularization_strength=l), x)
  _check_export(lambda z: perm.soft_sort(z, regularization_strength=l), x)


def _close(actual, desired):
  """Equal to rounding relative to the array's scale (fusion orders differ)."""
  desired = np.asarray(desired)
  scale = max(1.0, float(np.max(np.abs(desired))))
  np.testing.assert_allclose(actual, desired, rtol=1e-5, atol=1e-5 * scale)


def _check_export(f, x):
  exported = export.deserialize(export.export(jax.jit(f))(x).serialize())
  _close(exported.call(x), f(x))
  grad = lambda z: jax.grad(lambda z: jnp.sum(jnp.cos(3 * z[..., :1]) * f(z)))(z)
  exported = export.deserialize(export.export(jax.jit(grad))(x).serialize())
  _close(exported.call(x), grad(x))


def test_the_pav_solver_exports_with_the_safety_checks_named():
  # A custom call: jax.export refuses it by default and serializes it when told.
  x = jnp.ones((2, 5))
  f = jax.jit(lambda z: perm.soft_rank(z, solver="pav"))
  with pytest.raises(Exception, match="custom calls"):
    export.export(f)(x).serialize()
  exported = export.deserialize(
      export.export(f, disabled_checks=itk.export_safety_checks())(x).serialize())
  _close(exported.call(x), f(x))


# The default calls of soft_sort, soft_rank, soft_quantile and soft_topk_values on these
# (4, 7) float32 rows (PRNGKey(0)), forward and grad, are checked under the same shard_map
# by tests/transforms_check.py (test_edges_and_transforms.py, to a tighter atol); this
# script keeps what it does not run: argmax with p = 1.5, the entropy, and long rows.
SHARD_MAP_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from implicit_topk import permutahedron as perm
    assert len(jax.devices()) >= 2, jax.devices()
    OPERATORS = {
        "permutahedron_argmax": lambda z: perm.permutahedron_argmax(
            z, jnp.broadcast_to(jnp.arange(7.0), z.shape), p=1.5),
        "soft_rank_entropy": lambda z: perm.soft_rank(z, regularizer="entropy"),
    }
    mesh = jax.make_mesh((2,), ("d",))
    short = jax.random.normal(jax.random.PRNGKey(0), (4, 7), jnp.float32)
    long = jax.random.normal(jax.random.PRNGKey(1), (4, 600), jnp.float32)
    OPERATORS["soft_rank_long"] = lambda z: perm.soft_rank(z, regularization_strength=0.01)  # fewer blocks: smaller arrays
    OPERATORS["soft_sort_long"] = lambda z: perm.soft_sort(z, regularization_strength=300.0)  # a cascade: run tests
    for name, f in OPERATORS.items():
      x0 = long if name.endswith("long") else short
      x = jax.device_put(x0, NamedSharding(mesh, P("d")))
      g = jax.grad(lambda z, f=f: jnp.sum(f(z) * jnp.cos(3 * z)))
      for kind, fn in (("fwd", f), ("grad", g)):
        sharded = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
        with jax.set_mesh(mesh):
          got = np.asarray(sharded(x))
        want = np.asarray(fn(x0))
        scale = max(1.0, float(np.max(np.abs(want))))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * scale)
        print("OK", name, kind, flush=True)
""")


@pytest.mark.slow
def test_default_calls_under_shard_map_on_two_host_devices():
  env = device_checks.env_with_devices(2, JAX_PLATFORMS="cpu")
  result = subprocess.run([sys.executable, "-c", SHARD_MAP_SCRIPT], env=env,
                          capture_output=True, text=True, timeout=1200)
  assert result.returncode == 0, result.stdout + result.stderr[-3000:]
  assert result.stdout.count("OK") == 8, result.stdout


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices (the subprocess test "
                    "above runs this on 2 host devices)")
def test_shard_map_in_process():
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = jax.make_mesh((2,), ("d",))
  x0 = jax.random.normal(jax.random.PRNGKey(1), (4, 7))
  x = jax.device_put(x0, NamedSharding(mesh, P("d")))
  f = lambda z: jax.grad(lambda z: jnp.sum(perm.soft_sort(z) * jnp.cos(3 * z)))(z)
  sharded = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
  with jax.set_mesh(mesh):
    np.testing.assert_allclose(sharded(x), f(x0), rtol=1e-6, atol=1e-6)
