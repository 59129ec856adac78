"""First derivatives against central differences, in one compiled program.

``check_grads(f, args, modes=("fwd", "rev"), eps=, atol=, rtol=)`` makes the checks of
``jax.test_util.check_grads(f, args, order=1, modes=...)``: along a random direction
``t`` (standard normal, a fixed seed), forward mode's ``J t`` must equal the central
difference ``(f(x + eps t) - f(x - eps t)) / (2 eps)``, and reverse mode's
``<J^T c, t>`` for a random cotangent ``c`` must equal ``<c, central difference>``; the
primal outputs of both modes must equal ``f(x)``. Tolerances as JAX's: ``atol`` and
``rtol`` (default: JAX's gradient tolerance of the dtype) times the number of entries
compared.

The difference from JAX's: ``f(x)``, the two shifted evaluations, the JVP and the VJP
are one ``jax.jit`` program, compiled once. JAX's compiles five or six (the function,
its JVP, the VJP's forward and transposed parts, each shifted call of an unjitted
``f`` by itself), each holding a copy of the solver. Measured: one check of soft_rank
by ``pav_jax`` on 2 x 7 rows, 5.6 s -> 4.0 s; the 28 tests using it in CI's selection,
649 -> 581 worker-seconds (two runs, noisy). The shifted calls keep their own copies of
``f`` (a ``lax.map`` or ``vmap`` over the three points compiled no faster).
Second-order checks stay with ``jax.test_util.check_grads``.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import public_test_util

EPS = 1e-4  # JAX's default step


def _tolerance(dtype, tol):
  default = public_test_util.default_gradient_tolerance
  return tol if tol is not None else default.get(np.dtype(dtype), default[np.dtype(np.float64)])


def _assert_close(got, want, atol, rtol, what):
  got, want = np.asarray(got), np.asarray(want)
  assert got.shape == want.shape, (what, got.shape, want.shape)
  dtypes = (got.dtype, want.dtype)
  a = max(_tolerance(d, atol) for d in dtypes)
  r = max(_tolerance(d, rtol) for d in dtypes)
  np.testing.assert_allclose(got, want, atol=a * got.size, rtol=r * want.size, err_msg=what)


def _normal_like(rng, value):
  return jnp.asarray(rng.randn(*np.shape(value)), jnp.result_type(value))


def _inner(a, b):
  return sum(float(np.dot(np.ravel(u).astype(np.float64), np.ravel(v).astype(np.float64)))
             for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def check_grads(f, args, modes=("fwd", "rev"), eps=EPS, atol=None, rtol=None, seed=0):
  """Asserts that ``f``'s first derivatives at ``args`` (a tuple of arrays, scalars or
  pytrees of them) match central differences in the given ``modes`` (see the module
  docstring)."""
  modes = tuple(modes)
  assert modes and set(modes) <= {"fwd", "rev"}, modes
  args = jax.tree.map(jnp.asarray, tuple(args))
  rng = np.random.RandomState(seed)
  tangent = jax.tree.map(lambda a: _normal_like(rng, a), args)
  out_shape = jax.eval_shape(f, *args)
  cotangent = jax.tree.map(lambda s: _normal_like(rng, jnp.zeros(s.shape, s.dtype)), out_shape)

  def program(args, tangent, cotangent):
    shifted = lambda sign: f(*jax.tree.map(lambda a, t: a + sign * eps * t, args, tangent))
    value = f(*args)
    central = jax.tree.map(lambda p, m: (p - m) * (0.5 / eps), shifted(1.0), shifted(-1.0))
    result = {"value": value, "central": central}
    if "fwd" in modes:
      result["jvp"] = jax.jvp(f, args, tangent)
    if "rev" in modes:
      primal, pullback = jax.vjp(f, *args)
      result["vjp"] = (primal, pullback(cotangent))
    return result

  got = jax.jit(program)(args, tangent, cotangent)
  check = lambda a, b, what: jax.tree.map(
      lambda u, v: _assert_close(u, v, atol, rtol, what), a, b)
  if "fwd" in modes:
    primal, directional = got["jvp"]
    check(primal, got["value"], "forward mode: primal output")
    check(directional, got["central"], "forward mode: J t against central differences")
  if "rev" in modes:
    primal, pulled = got["vjp"]
    check(primal, got["value"], "reverse mode: primal output")
    _assert_close(_inner(pulled, tangent), _inner(cotangent, got["central"]), atol, rtol,
                  "reverse mode: <J^T c, t> against <c, central differences>")
