"""``PallasSolver`` (``solver="pallas"``): the fused Pallas kernel for the threshold.

On CPU the kernel runs in Pallas interpret mode (the same kernel body as XLA
operations). Values are checked against the independent float64 references of
``tests/references.py`` (exact rational bracketing, then float64 bisection; nothing from
``implicit_topk``), to float64 or float32 rounding as ``references.mask_tolerance`` /
``mag_tolerance`` state it; gradients against central differences of those references.
The special-value rules (``+-inf``, NaN, ``k = 0`` and ``k = n``) are the ones of
``soft_topk_mask``'s docstring, checked against the reference and, for the NaN pattern,
against ``solver="threshold"``. Every row is certified inside the kernel within the
proven cap (``proofs/pallas_bounded_iteration.md``), also with no free Newton passes
(ordered bisections from the second pass on). The default run
keeps one shape per check (each new shape, dtype or solver compiles the interpreted
kernel again, about 1.5 s); the slow group sweeps regularizers, shapes and dtypes, runs
``shard_map`` on two host devices and lowers the kernel for CUDA through Triton.
"""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import export

import device_checks
import jaxpr_walk
import implicit_topk as itk
import references as R
from implicit_topk import _apply
from implicit_topk.kernels.gpu import bounded_newton, pallas_derivatives, pallas_threshold
from implicit_topk.problems import CappedSimplex, LastAxis, Magnitude, Segments, Tree
from implicit_topk.solvers.pallas import PallasSolver

jax.config.update("jax_enable_x64", True)

slow = pytest.mark.slow
U64 = np.finfo(np.float64).eps / 2  # unit roundoff
U32 = np.finfo(np.float32).eps / 2
REGULARIZERS = {"pnorm": None, "entropy": itk.Entropy(), "sigmoid": itk.BinaryEntropy(),
                "laplace": itk.Laplace()}

# Three rows of six: ties, a fractional k near 0, a k near n, per-row k and strength.
X = np.array([[0.3, -1.2, 2.0, 0.3, 0.7, -0.4],
              [1.0, 1.0, 1.0, 0.5, -2.0, 3.0],
              [-0.25, 0.8, 1.9, -1.1, 0.05, 0.6]])
K = np.array([2.0, 1e-3, 6 - 1e-3])
L = np.array([0.5, 0.3, 2.0])


def solver(reg=None, p=4.0 / 3.0, magnitude=False, **options):
  problem = Magnitude(p) if magnitude else CappedSimplex(
      itk.PNorm(p) if reg is None else REGULARIZERS[reg] or itk.PNorm(p))
  return PallasSolver(problem=problem, **options)


def run(solver_obj, x, k, l, **kw):
  """The operator path of soft_topk_mask / soft_topk_mag: ``(output, RootState)``."""
  return _apply.threshold_operator(solver_obj, x, k, l, axis=-1, return_info=True, **kw)


def mask_reference(x, k, l, reg=None, p=4.0 / 3.0):
  name = None if reg in (None, "pnorm") else reg
  return R.soft_topk_mask(x, k, l, p, name)


def mask_tolerance(x, k, l, reg=None, p=4.0 / 3.0, eps=U64):
  # unshifted_rows: rows whose maximum is within l / sqrt(eps) of 0 are solved without
  # the shift by the row maximum (CappedSimplex.normalize documents it).
  name = None if reg in (None, "pnorm") else reg
  return R.mask_tolerance(x, k, l, p, name, eps=eps, unshifted_rows=True)


def assert_close(actual, expected, tol, what=""):
  """|actual - expected| <= tol entrywise; NaN exactly where expected is NaN."""
  actual = np.asarray(actual, np.float64)
  expected = np.asarray(expected, np.float64)
  assert actual.shape == expected.shape, what
  np.testing.assert_array_equal(np.isnan(actual), np.isnan(expected), err_msg=what)
  finite = ~np.isnan(expected)
  diff = np.abs(actual - expected)[finite]
  assert np.all(diff <= np.broadcast_to(tol, actual.shape)[finite]), (
      f"{what}: max |diff| {diff.max():.3e}\nactual={actual}\nexpected={expected}")


def low_precision_tolerance(x64, k, l, dtype, p=4.0 / 3.0):
  """A result computed in float32 and rounded once to ``dtype``: the float64 rule with
  float32's unit roundoff, k and l rounded to float32 (u32 k on the sum), and half an
  eps of ``dtype`` for the final rounding (the mask lies in [0, 1])."""
  return (mask_tolerance(x64, k, l, p=p, eps=U32) + 16 * U32 * np.max(k)
          + float(ml_dtypes.finfo(dtype).eps) / 2)


# -- values against the independent reference ------------------------------------------


@pytest.mark.parametrize("reg", ["pnorm", "sigmoid", pytest.param("entropy", marks=slow),
                                 pytest.param("laplace", marks=slow)])
def test_mask_equals_the_float64_reference(reg):
  y, info = run(solver(reg), X, K, L)
  assert_close(y, mask_reference(X, K, L, reg), mask_tolerance(X, K, L, reg), reg)
  assert np.all(np.asarray(info.iter_num) <= bounded_newton.pass_cap(np.float64)), info
  np.testing.assert_allclose(np.sum(np.asarray(y), -1), K, rtol=0, atol=1e-13)


def test_float32_equals_the_reference_to_float32_rounding():
  x = X.astype(np.float32)
  y, _ = run(solver(), x, K, L)
  assert y.dtype == np.float32
  x64 = x.astype(np.float64)
  assert_close(y, mask_reference(x64, K, L), low_precision_tolerance(x64, K, L, np.float32))


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, pytest.param(np.float16, marks=slow)],
                         ids=["bfloat16", "float16"])
def test_half_precision_is_computed_in_float32(dtype):
  x = X.astype(dtype)
  y, _ = run(solver(), x, K, L)
  assert y.dtype == dtype
  x64 = x.astype(np.float64)
  assert_close(y, mask_reference(x64, K, L), low_precision_tolerance(x64, K, L, dtype))


def test_magnitude_equals_the_float64_reference():
  x = X * np.array([[1.0], [-1.0], [0.5]])
  k = np.array([2.0, 0.5, 4.5])
  y, info = run(solver(magnitude=True), x, k, L)
  assert_close(y, R.soft_topk_mag(x, k, L, 4.0 / 3.0), R.mag_tolerance(x, k, L, 4.0 / 3.0, eps=U64))
  assert np.all(np.asarray(info.iter_num) <= bounded_newton.pass_cap(np.float64))


def test_special_values_follow_the_documented_rules():
  inf, nan = np.inf, np.nan
  x = np.array([[inf, 1.0, 2.0, -inf, 0.0, 3.0],    # +inf is 1, -inf is 0, finite share k - 1
                [1.0, nan, 0.0, 2.0, 3.0, 4.0],     # NaN anywhere: a NaN row
                [inf, inf, inf, 0.0, 1.0, 2.0],     # more +inf than k: no threshold, NaN
                [-inf, -inf, -inf, -inf, 1.0, 2.0],  # k = #(> -inf): finite entries are 1
                [0.5, 0.5, 0.5, 0.5, 0.5, 0.5],     # k = 0: zeros
                [3.0, 1.0, 2.0, 0.0, -1.0, 5.0]])   # k = n: ones
  k = np.array([2.5, 2.0, 2.0, 2.0, 0.0, 6.0])
  l = np.full(6, 0.5)
  y, info = run(solver(), x, k, l)
  expected = mask_reference(x, k, l)
  assert_close(y, expected, mask_tolerance(x, k, l))
  # the same rows as the default solver, NaN for NaN
  y_threshold = itk.soft_topk_mask(x, k, regularization_strength=l, solver="threshold")
  np.testing.assert_array_equal(np.isnan(y), np.isnan(y_threshold))
  np.testing.assert_allclose(np.nan_to_num(np.asarray(y)), np.nan_to_num(np.asarray(y_threshold)),
                             rtol=0, atol=1e-15)
  # rows answered by the bracket take no pass; row 0 iterates
  assert np.asarray(info.iter_num).tolist()[1:] == [0, 0, 0, 0, 0] and info.iter_num[0] > 0


def test_rows_of_one_entry():
  x = np.array([[0.4], [-3.0], [1e3]])
  k = np.array([0.25, 1.0, 0.0])
  y, _ = run(solver(), x, k, np.array([0.1, 1.0, 5.0]))
  np.testing.assert_array_equal(np.asarray(y)[:, 0], k)  # the only entry carries all of k


# -- certificate: every row inside the kernel ------------------------------------------


@pytest.mark.parametrize("free_passes", [0, 16])
def test_every_row_is_certified_in_the_kernel_within_the_cap(free_passes):
  x = np.vstack([X, np.zeros((1, 6)), [[1e-30, -1e30, 3e-38, 0.0, 5.0, 1e30]]])
  k = np.append(K, [0.0, 2.5])  # row 3 is answered by the bracket
  l = np.append(L, [1.0, 1e-3])
  lam, passes, certified = pallas_threshold.threshold_rows(
      CappedSimplex(), jnp.asarray(x), jnp.asarray(k), jnp.asarray(l), free_passes=free_passes)
  assert np.all(np.asarray(certified))
  passes = np.asarray(passes)
  assert passes[3] == 0 and np.all(passes <= bounded_newton.pass_cap(np.float64, free_passes))
  y, info = run(solver(free_passes=free_passes), x, k, l)
  assert_close(y, mask_reference(x, k, l), mask_tolerance(x, k, l))
  assert np.all(np.asarray(info.residual)[:3] <= 1e-13)


def test_the_bounded_step_is_the_threshold_step_during_the_free_passes():
  from implicit_topk.solvers import threshold as T
  problem = CappedSimplex()
  x, k, l = (jnp.asarray(v) for v in (X, K, L))

  @jax.jit
  def both(x, k, l):
    carry, _ = T._init_carry(problem, None, x, k, l)
    ours = carry
    plain_step = T.newton_iteration(problem, x, k, l)
    bounded_step = T.newton_iteration(problem, x, k, l, free_passes=16)
    history = []
    for _ in range(6):
      carry, ours = plain_step(carry), bounded_step(ours)
      history.append((carry, ours))
    return history

  for carry, ours in both(x, k, l):
    pending = ~np.asarray(carry[4])
    for a, b in zip(jax.tree.leaves(carry[:4]), jax.tree.leaves(ours[:4])):
      np.testing.assert_array_equal(np.asarray(a)[pending], np.asarray(b)[pending])


def test_the_kernel_origin_is_the_problem_normalization():
  rng = np.random.default_rng(3)
  x = rng.normal(size=(6, 9)) * np.array([[1.0], [1e9], [1e20], [-1e20], [1e-3], [1e300]])
  x[0, 0] = np.inf
  l = np.array([1.0, 1e-3, 1.0, 5.0, 1e-6, 1.0])
  problem = CappedSimplex()
  origin = pallas_threshold.normalization_origin(problem, jnp.asarray(x), jnp.asarray(l))
  np.testing.assert_array_equal(np.asarray(problem.shift(jnp.asarray(x), origin)),
                                np.asarray(problem.normalize(jnp.asarray(x), jnp.asarray(l))))


# -- derivatives ------------------------------------------------------------------------


# Two rows away from kinks, and tangents in x, k and l.
D_ARGS = (X[[0, 2]], np.array([2.0, 2.5]), np.array([0.5, 2.0]))
D_TANGENTS = (np.cos(np.arange(12.0)).reshape(2, 6), np.array([0.3, -0.2]), np.array([0.1, 0.05]))
D_COTANGENT = np.sin(np.arange(12.0)).reshape(2, 6)


def _op(x, k, l):
  return run(solver(), x, k, l)[0]


def _loss_gradient(x, k, l):
  return jax.grad(lambda *a: jnp.sum(_op(*a) * D_COTANGENT), argnums=(0, 1, 2))(x, k, l)


def _central_difference():
  """d/dt of the reference mask along the tangents, by central differences in float64."""
  (x, k, l), (vx, vk, vl), h = D_ARGS, D_TANGENTS, 1e-6
  states, safe = R.mask_partition(x, k, l, margin=1e-4)
  assert safe  # away from kinks: the central difference is accurate
  for sign in (-2, 2):
    assert R.mask_partition(x + sign * h * vx, k + sign * h * vk, l + sign * h * vl)[0] == states
  return (mask_reference(x + h * vx, k + h * vk, l + h * vl)
          - mask_reference(x - h * vx, k - h * vk, l - h * vl)) / (2 * h)


def _check_gradient(grads, fd):
  """<J^T u, v> = <u, J v> with J v from the central difference."""
  lhs = sum(np.sum(np.asarray(g) * v) for g, v in zip(grads, D_TANGENTS))
  np.testing.assert_allclose(lhs, np.sum(fd * D_COTANGENT), rtol=1e-6, atol=1e-9)


def test_jvp_and_grad_equal_central_differences_of_the_reference():
  fd = _central_difference()
  _, tangent = jax.jvp(_op, D_ARGS, D_TANGENTS)
  np.testing.assert_allclose(np.asarray(tangent), fd, rtol=1e-6, atol=2e-7)
  _check_gradient(_loss_gradient(*D_ARGS), fd)


def _entrywise_central_difference(reference, x, k, l, cotangent, h=1e-6):
  """The gradient of <cotangent, reference(x, k, l)> in x, k and l (per-row k and l),
  one coordinate at a time, by float64 central differences."""
  loss = lambda *a: float(np.sum(cotangent * reference(*a)))
  grads = []
  for which, value in enumerate((x, k, l)):
    grad = np.zeros_like(value)
    for index in np.ndindex(value.shape):
      step = np.zeros_like(value)
      step[index] = h
      args = [x, k, l]
      args[which] = value + step
      upper = loss(*args)
      args[which] = value - step
      grad[index] = (upper - loss(*args)) / (2 * h)
    grads.append(grad)
  return grads


def test_the_cotangent_kernel_equals_central_differences_entrywise():
  """Reverse mode (the cotangent kernel) against float64 central differences of the
  independent reference, every entry of the gradient in x, k and l: rows with ties,
  n = 6 (padded to 8 in the kernel)."""
  x, k, l = D_ARGS
  assert R.mask_partition(x, k, l, margin=1e-4)[1]  # away from kinks
  expected = _entrywise_central_difference(mask_reference, x, k, l, D_COTANGENT)
  for got, want in zip(_loss_gradient(*D_ARGS), expected):
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-8)
  assert np.abs(expected[0]).max() > 0.1  # fractional rows: not a vacuous zero


def _kernel_operands(problem, x, k, l, seed=0):
  """Primals of the derivative kernels from the forward kernel on ``(x, k, l)``, and
  random tangents and cotangents (float64)."""
  x, k, l = (jnp.asarray(v, jnp.float64) for v in (x, k, l))
  _, lam, origin, _, _, _, scale, binary = pallas_threshold.fused_rows(problem, x, k, l)
  primals = (x, lam, origin, scale, binary.astype(x.dtype), k, l)
  rng = np.random.default_rng(seed)
  draw = lambda like: jnp.asarray(rng.normal(size=like.shape))
  return primals, (draw(x), draw(k), draw(l)), (draw(x), draw(lam))


def _derivative_kernels(problem, primals, tangents, cotangents, *, interpret=True):
  """The tangent and the cotangent kernel, and the same maps in XLA (the map and its
  transpose by ``jax.vjp``: the path before the kernels)."""
  tangent = pallas_derivatives.RowDerivative(problem, False, interpret=interpret)
  cotangent = pallas_derivatives.RowDerivative(problem, True, interpret=interpret)
  xla = pallas_derivatives.ScaledTangent(problem)
  _, xla_transpose = jax.vjp(lambda *t: xla(*primals, *t), *tangents)
  return (jax.jit(tangent)(*primals, *tangents), jax.jit(cotangent)(*primals, *cotangents),
          xla(*primals, *tangents), xla_transpose(cotangents))


def _check_adjoint_kernels(problem, x, k, l, nan_rows=()):
  """Kernels = XLA maps (NaN where they are NaN), <v, J u> = <J^T v, u> on the other
  rows, and for the mask, on the rows whose output is NaN, a zero ``y_dot`` (its primal
  masks NaN by a double ``where``; the threshold's own tangent is NaN there)."""
  primals, tangents, cotangents = _kernel_operands(problem, x, k, l)
  outs = _derivative_kernels(problem, primals, tangents, cotangents)
  for got, want in zip(outs[0] + outs[1], outs[2] + outs[3]):
    got, want = np.asarray(got), np.asarray(want)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12 * np.nanmax(np.abs(want)))
  (y_dot, lam_dot), (x_bar, k_bar, l_bar) = outs[:2]
  rows = np.setdiff1d(np.arange(len(k)), nan_rows)
  dot = lambda a, b: np.sum(np.asarray(a)[rows] * np.asarray(b)[rows])
  lhs = sum(dot(a, b) for a, b in zip(cotangents, (y_dot, lam_dot)))
  rhs = sum(dot(a, b) for a, b in zip((x_bar, k_bar, l_bar), tangents))
  np.testing.assert_allclose(lhs, rhs, rtol=1e-12)
  for out in (y_dot, lam_dot, x_bar, k_bar, l_bar):
    assert np.all(np.isfinite(np.asarray(out)[rows])), out
  assert np.abs(np.asarray(x_bar)[rows]).max() > 1e-2  # not a vacuous zero
  if isinstance(problem, CappedSimplex):
    assert np.all(np.asarray(y_dot)[list(nan_rows)] == 0)
  return primals, tangents, cotangents


# Rows of 7 (padded to 8), a batch of 5 (padded to 8): ties, a binary row (tiny strength),
# +-inf entries, a NaN row.
SPECIAL_X = np.array([[0.3, -1.2, 2.0, 0.3, 0.7, -0.4, 0.3],
                      [1.0, 1.0, 1.0, 0.5, -2.0, 3.0, 0.0],
                      [5.0, -3.0, 2.0, 0.1, -7.0, 1.0, 4.0],
                      [np.inf, 1.0, 2.0, -np.inf, 0.0, 3.0, 0.5],
                      [1.0, np.nan, 0.0, 2.0, 3.0, 4.0, 0.5]])
SPECIAL_K = np.array([2.5, 2.0, 3.0, 2.5, 2.0])
SPECIAL_L = np.array([0.5, 0.8, 1e-3, 0.5, 0.5])


def test_the_derivative_kernels_are_adjoint_and_equal_the_xla_maps():
  """Tangent and cotangent kernels on padded rows and batch: equal to the XLA map and
  its JAX transpose (the path before the kernels), adjoint to each other, NaN on the NaN
  row, zero on the NaN row, on the binary row and on rows the forward kernel marked
  ``binary`` (set here by hand: the kernel's convention, not the data's)."""
  problem = CappedSimplex()
  primals, tangents, cotangents = _check_adjoint_kernels(problem, SPECIAL_X, SPECIAL_K,
                                                         SPECIAL_L, nan_rows=[4])
  plain = _derivative_kernels(problem, primals, tangents, cotangents)[:2]
  marked = primals[:4] + (jnp.asarray([1.0, 0, 0, 0, 0]),) + primals[5:]
  flagged = _derivative_kernels(problem, marked, tangents, cotangents)[:2]
  for out, out_flagged in zip(plain[0] + plain[1], flagged[0] + flagged[1]):
    out, out_flagged = np.asarray(out), np.asarray(out_flagged)
    assert np.all(out[2] == 0)  # the binary row: zero derivatives
    assert np.all(out_flagged[0] == 0) and np.any(out[0] != 0)  # the flag zeroes row 0
    np.testing.assert_array_equal(out_flagged[1:], out[1:])  # and nothing else
  # The public cotangent (lam_bar = 0) on the NaN row: zero, as y_dot.
  no_lam_bar = (cotangents[0], jnp.zeros_like(cotangents[1]))
  x_bar = np.asarray(_derivative_kernels(problem, primals, tangents, no_lam_bar)[1][0])
  assert np.all(x_bar[4] == 0) and np.all(np.isfinite(x_bar))


@slow
@pytest.mark.parametrize("name", ["p=2", "p=3", "entropy", "sigmoid", "laplace", "magnitude",
                                  "magnitude p=2"])
def test_the_derivative_kernels_are_adjoint_sweep(name):
  _check_adjoint_kernels(PROBLEMS[name], SPECIAL_X, SPECIAL_K, SPECIAL_L, nan_rows=[4])


def test_special_rows_give_the_threshold_solvers_gradients():
  """The public gradient on rows with +-inf entries, a binary row and a NaN row (zero
  derivatives there, as before the kernels): the gradient of solver='threshold'
  (custom_root's implicit derivative in XLA, an independent path)."""
  w = np.cos(np.arange(SPECIAL_X.size)).reshape(SPECIAL_X.shape)
  mask = lambda z, name: itk.soft_topk_mask(z, SPECIAL_K, regularization_strength=SPECIAL_L,
                                            solver=name)
  loss = lambda name: jax.grad(lambda z: jnp.sum(jnp.where(
      jnp.isnan(mask(z, name)), 0, w * mask(z, name))))
  got, want = loss("pallas")(SPECIAL_X), loss("threshold")(SPECIAL_X)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-10, atol=1e-12)
  assert np.all(np.asarray(got)[[2, 4]] == 0) and np.abs(np.asarray(got)[0]).max() > 0.1


def test_vmap_of_the_gradient_equals_one_call_per_example():
  """vmap over the derivative kernels (their batching rule: the mapped axis becomes rows)."""
  x = np.stack([X, X[::-1] * 2, X * 0.5 + 1])
  grad = jax.grad(lambda z: jnp.sum(run(solver(), z, 2.5, 0.5)[0] * jnp.cos(z)))
  batched = jax.jit(jax.vmap(grad))(x)
  for b in range(len(x)):
    np.testing.assert_allclose(np.asarray(batched[b]), np.asarray(grad(x[b])), rtol=1e-13,
                               atol=1e-14)


@slow
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16, np.float32],
                         ids=["bfloat16", "float16", "float32"])
def test_low_precision_gradients_equal_central_differences(dtype):
  """bf16, f16 and f32 rows: the derivative kernels accumulate in float32, so the
  gradient is the float64 one at the rounded rows to float32 rounding (times the
  condition of the slopes), then rounded once to the dtype."""
  x = D_ARGS[0].astype(dtype)
  x64 = np.asarray(x, np.float64)
  k, l = D_ARGS[1:]
  grad = jax.grad(lambda z: jnp.sum(_op(z, k, l).astype(jnp.float32) * D_COTANGENT))(x)
  assert grad.dtype == dtype
  expected = _entrywise_central_difference(mask_reference, x64, k, l, D_COTANGENT)[0]
  scale = np.abs(expected).max()
  tol = float(ml_dtypes.finfo(dtype).eps) * scale + 1e3 * U32 * scale
  np.testing.assert_allclose(np.asarray(grad, np.float64), expected, rtol=0, atol=tol)


@slow
def test_magnitude_gradient_equals_central_differences_entrywise():
  x, k, l = D_ARGS[0], np.array([2.3, 2.6]), D_ARGS[2]  # integer k: a kink of the magnitude
  op = lambda *a: run(solver(magnitude=True), *a)[0]
  got = jax.grad(lambda *a: jnp.sum(op(*a) * D_COTANGENT), argnums=(0, 1, 2))(x, k, l)
  ref = lambda *a: R.soft_topk_mag(*a, 4.0 / 3.0)
  expected = _entrywise_central_difference(ref, x, k, l, D_COTANGENT)
  for g, want in zip(got, expected):
    np.testing.assert_allclose(np.asarray(g), want, rtol=1e-6, atol=1e-8)
  assert np.abs(expected[0]).max() > 0.1


@slow
def test_second_order_through_the_derivative_kernels():
  """Hessians (vmap of forward over reverse: the batching rule of the transposed map)
  equal reverse over reverse and central differences of the gradient."""
  x, k, l = D_ARGS
  grad = jax.grad(lambda z: jnp.sum(_op(z, k, l) * D_COTANGENT))
  hessian = np.asarray(jax.jit(jax.hessian(lambda z: jnp.sum(_op(z, k, l) * D_COTANGENT)))(x))
  v = D_TANGENTS[0]
  reverse = jax.grad(lambda z: jnp.vdot(grad(z), v))(x)
  central = (np.asarray(grad(x + 1e-6 * v)) - np.asarray(grad(x - 1e-6 * v))) / 2e-6
  hvp = np.tensordot(hessian, v, axes=2)
  np.testing.assert_allclose(hvp, np.asarray(reverse), rtol=1e-9, atol=1e-10)
  np.testing.assert_allclose(hvp, central, rtol=1e-5, atol=1e-6)
  assert np.abs(hvp).max() > 1e-2


# -- transformations, export, lowering --------------------------------------------------


def test_vmap_equals_the_reference():
  x = np.stack([X, X[::-1] * 2])
  y = jax.vmap(lambda z: run(solver(), z, 2.5, 0.5)[0])(x)
  assert_close(y, mask_reference(x, 2.5, 0.5), mask_tolerance(x, 2.5, 0.5))


def test_jax_export_round_trip():
  """The gradient (its forward pass included), exported for the default backend with
  ``export_safety_checks()``, serialized, deserialized and called: plain HLO in
  interpret mode on CPU, the Triton call on a GPU; equal to central differences."""
  exported = export.deserialize(export.export(
      jax.jit(_loss_gradient), disabled_checks=itk.export_safety_checks())(*D_ARGS).serialize())
  if jax.default_backend() == "cpu":  # interpret mode: plain HLO; on a GPU the Triton call
    assert "custom_call" not in exported.mlir_module()
  _check_gradient(exported.call(*D_ARGS), _central_difference())


def test_the_kernel_is_used_and_nothing_sorts():
  x = jnp.asarray(X)
  forward = lambda z: run(solver(), z, 2.5, 0.5)[0]
  names = jaxpr_walk.primitive_names(
      jax.make_jaxpr(jax.grad(lambda z: jnp.sum(jnp.sin(forward(z)))))(x).jaxpr)
  assert "pallas_call" in names
  assert not names & {"sort", "top_k", "argsort", "approx_top_k"}


def _lower_for_cuda(fn, *args):
  """StableHLO of ``fn`` lowered for CUDA on this (CPU) machine."""
  try:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  except RuntimeError as exc:  # jax >= 0.11 asks for a GPU (or an abstract one) here
    if "GPU" in str(exc):
      pytest.skip(f"this jax lowers Triton kernels only with a GPU: {exc}")
    raise


PROBLEMS = {"p=4/3": CappedSimplex(), "p=2": CappedSimplex(itk.PNorm(2.0)),
            "p=3": CappedSimplex(itk.PNorm(3.0)), "entropy": CappedSimplex(itk.Entropy()),
            "sigmoid": CappedSimplex(itk.BinaryEntropy()), "laplace": CappedSimplex(itk.Laplace()),
            "magnitude": Magnitude(), "magnitude p=2": Magnitude(2.0)}


@slow
@pytest.mark.parametrize("name", list(PROBLEMS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_kernel_lowers_through_triton_for_cuda(name, dtype):
  rows = jax.ShapeDtypeStruct((64, 100), dtype)
  per_row = jax.ShapeDtypeStruct((64,), dtype)
  fn = lambda x, k, l: pallas_threshold.fused_rows(PROBLEMS[name], x, k, l)
  text = _lower_for_cuda(fn, rows, per_row, per_row)
  assert text.count("__gpu$xla.gpu.triton") == 1 and "num_warps" in text


def test_export_for_cuda_carries_the_triton_kernels():
  """The forward: one Triton call; the gradient: the forward and the cotangent kernel."""
  x = jax.ShapeDtypeStruct((8, 64), jnp.float32)
  op = lambda z: run(solver(), z, 2.0, 0.5)[0]
  _lower_for_cuda(op, x)  # skips where this jax cannot lower for CUDA without a GPU
  grad = jax.grad(lambda z: jnp.sum(op(z) * jnp.cos(z)))
  for fn, calls in ((op, 1), (grad, 2)):
    exported = export.export(jax.jit(fn), platforms=("cuda",),
                             disabled_checks=itk.export_safety_checks())(x)
    assert exported.mlir_module().count("__gpu$xla.gpu.triton") == calls


# -- options and errors -----------------------------------------------------------------


def test_layouts_other_than_whole_rows_are_refused():
  with pytest.raises(ValueError, match="solver='pallas' holds each whole row"):
    PallasSolver(problem=CappedSimplex(layout=Segments(2)))
  with pytest.raises(ValueError, match="solver='pallas' holds each whole row"):
    PallasSolver(problem=Magnitude()).with_layout(Tree())
  with pytest.raises(ValueError, match="solver='pallas' holds each whole row"):
    PallasSolver().with_layout(LastAxis("d"))
  with pytest.raises(ValueError, match="free_passes"):
    PallasSolver(free_passes=-1)
  with pytest.raises(ValueError, match="num_warps"):
    PallasSolver(num_warps=3)
  with pytest.raises(ValueError, match="use implicit_diff=True"):
    PallasSolver(implicit_diff=False).run(None, jnp.ones(3), 1.0, 1.0)


def _long_rows():
  rng = np.random.default_rng(40)
  x = rng.normal(size=(2, 13)) * np.array([[1.0], [100.0]])
  return x, np.array([3.0, 2.5]), np.array([0.5, 20.0])


def test_the_chunked_kernel_for_long_rows_equals_the_reference():
  """Rows read in chunks (one program per row; chunks of 4 on rows of 13 here, 2048 on
  rows of 4096 < n <= 65536 on a GPU) against the float64 reference."""
  x, k, l = _long_rows()
  args = (CappedSimplex(), jnp.asarray(x), jnp.asarray(k), jnp.asarray(l))
  y, _, _, passes, certified, *_ = pallas_threshold.fused_rows(*args, chunk=4)
  assert_close(y, mask_reference(x, k, l), mask_tolerance(x, k, l))
  assert np.all(np.asarray(certified)) and np.all(np.asarray(passes) > 0)


@slow
def test_the_chunked_kernel_for_the_magnitude():
  x, k, l = _long_rows()
  y = pallas_threshold.fused_rows(Magnitude(), jnp.asarray(x), jnp.asarray(k), jnp.asarray(l),
                                  chunk=4)[0]
  assert_close(y, R.soft_topk_mag(x, k, l, 4.0 / 3.0), R.mag_tolerance(x, k, l, 4.0 / 3.0, eps=U64))


@slow
def test_rows_too_long_for_the_kernel_go_to_the_threshold_solver():
  n = 65536 + 1
  x = np.random.default_rng(0).normal(size=(2, n))
  y, info = run(solver(), x, 40.5, 0.1)
  y_threshold, info_threshold = _apply.threshold_operator(
      itk.ThresholdSolver(), x, 40.5, 0.1, axis=-1, return_info=True)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(y_threshold))
  np.testing.assert_array_equal(np.asarray(info.iter_num), np.asarray(info_threshold.iter_num))


@slow
def test_where_excludes_entries():
  where = np.ones(X.shape, bool)
  where[:, 4:] = False
  y, _ = run(solver(), X, np.array([2.0, 1.5, 0.5]), L, where=where)
  expected = mask_reference(X[:, :4], np.array([2.0, 1.5, 0.5]), L)
  assert np.all(np.asarray(y)[:, 4:] == 0)
  assert_close(np.asarray(y)[:, :4], expected, mask_tolerance(X[:, :4], np.array([2.0, 1.5, 0.5]), L))


# -- sweeps (slow) ----------------------------------------------------------------------


def _random_rows(rng, batch, n):
  """Normal rows, some with ties (entries from a small pool), some scaled."""
  x = rng.normal(size=(batch, n)) * rng.choice([0.1, 1.0, 10.0], size=(batch, 1))
  pool = rng.random((batch, n)) < 0.3
  return np.where(pool, rng.choice([0.0, 0.5, -1.0], size=(batch, n)), x)


def _random_k(rng, batch, n):
  k = rng.uniform(0, n, size=batch)
  k[::4] = np.round(k[::4])
  k[1::5] = rng.uniform(1e-6, 1e-2, size=k[1::5].shape)
  k[2::5] = n - rng.uniform(1e-6, 1e-2, size=k[2::5].shape)
  return k


@slow
@pytest.mark.parametrize("reg,p", [("pnorm", 4.0 / 3.0), ("pnorm", 2.0), ("pnorm", 1.1),
                                   ("pnorm", 3.0), ("entropy", 2.0), ("sigmoid", 2.0),
                                   ("laplace", 2.0)])
@pytest.mark.parametrize("n", [1, 7, 33, 128])
def test_mask_sweep_float64(reg, p, n):
  rng = np.random.default_rng([n, int(100 * p), len(reg)])
  batch = 12
  x = _random_rows(rng, batch, n)
  k = _random_k(rng, batch, n)
  l = 10.0 ** rng.uniform(-1.5, 1, size=batch)
  for free in (16, 0):
    y, info = run(solver(reg, p, free_passes=free), x, k, l)
    assert_close(y, mask_reference(x, k, l, reg, p), mask_tolerance(x, k, l, reg, p),
                 f"{reg} p={p} n={n} free_passes={free}")


@slow
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16],
                         ids=["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("p", [4.0 / 3.0, 2.0])
def test_mask_sweep_low_precision(dtype, p):
  rng = np.random.default_rng([7, int(10 * p)])
  n, batch = 20, 16
  x = _random_rows(rng, batch, n).astype(dtype)
  k = _random_k(rng, batch, n)
  l = 10.0 ** rng.uniform(-1, 1, size=batch)
  y, _ = run(solver(p=p), x, k, l)
  x64 = np.asarray(x, np.float64)
  assert_close(y, mask_reference(x64, k, l, p=p), low_precision_tolerance(x64, k, l, dtype, p))


@slow
@pytest.mark.parametrize("p", [4.0 / 3.0, 2.0, 3.0])
def test_magnitude_sweep(p):
  rng = np.random.default_rng([11, int(10 * p)])
  n, batch = 17, 12
  x = _random_rows(rng, batch, n)
  k = _random_k(rng, batch, n)
  l = 10.0 ** rng.uniform(-1.5, 1, size=batch)
  for free in (16, 0):
    y, _ = run(solver(p=p, magnitude=True, free_passes=free), x, k, l)
    assert_close(y, R.soft_topk_mag(x, k, l, p), R.mag_tolerance(x, k, l, p, eps=U64),
                 f"p={p} free_passes={free}")


@slow
@pytest.mark.parametrize("reg", ["entropy", "sigmoid", "laplace", "magnitude"])
def test_jvp_sweep(reg):
  n, batch, h = 5, 3, 1e-6
  rng = np.random.default_rng(len(reg))
  x = rng.normal(size=(batch, n))
  k = np.array([1.5, 2.2, 3.7])
  l = np.array([0.7, 1.5, 3.0])
  vx = rng.normal(size=(batch, n))
  if reg == "magnitude":
    op = lambda x_: run(solver(magnitude=True), x_, k, l)[0]
    ref = lambda x_: R.soft_topk_mag(x_, k, l, 4.0 / 3.0)
  else:
    op = lambda x_: run(solver(reg), x_, k, l)[0]
    ref = lambda x_: mask_reference(x_, k, l, reg)
  _, tangent = jax.jvp(op, (x,), (vx,))
  fd = (ref(x + h * vx) - ref(x - h * vx)) / (2 * h)
  np.testing.assert_allclose(np.asarray(tangent), fd, rtol=1e-6, atol=2e-7)


_SHARD_MAP_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from implicit_topk import _apply
from implicit_topk.solvers.pallas import PallasSolver
mesh = jax.make_mesh((2,), ("b",))
x0 = np.random.default_rng(0).normal(size=(4, 7)).astype(np.float32)
x = jax.device_put(x0, NamedSharding(mesh, P("b")))
for cap in (16, 0):
  op = lambda z: _apply.threshold_operator(PallasSolver(free_passes=cap), z, 2.5, 0.1, axis=-1)
  grad = jax.grad(lambda z: jnp.sum(op(z) * jnp.cos(z)))
  for name, fn in (("forward", op), ("grad", grad)):
    sharded = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("b"), out_specs=P("b")))
    print(name, cap, float(np.max(np.abs(np.asarray(sharded(x)) - np.asarray(fn(x0))))))
"""


@slow
@pytest.mark.skipif(jax.default_backend() != "cpu",
                    reason="asks for 2 host devices: the default backend here is "
                           f"{jax.default_backend()!r} with its own device count")
def test_shard_map_over_a_batch_sharded_input():
  env = device_checks.env_with_devices(2)
  result = subprocess.run([sys.executable, "-c", _SHARD_MAP_SCRIPT], env=env,
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  lines = result.stdout.split("\n")
  errors = {tuple(line.split()[:2]): float(line.split()[2]) for line in lines if line}
  assert len(errors) == 4, result.stdout
  # sharded = unsharded: the forward to float32 rounding; the gradient to float32 rounding
  # of the threshold times the mask's slope (3 z^2 / l, up to 30 at l = 0.1): two compiled
  # programs may round the threshold an ulp apart (XLA promises no bitwise equality).
  eps = float(np.finfo(np.float32).eps)
  for (name, _), err in errors.items():
    assert err <= (8 * eps if name == "forward" else 30 * 8 * eps), errors
