"""The shared threshold core: no sort in the pure-JAX solver, one cached compilation for
eager calls, options checked the same way on every backend, and the mask and the
magnitude operator solved by the same solver objects."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import implicit_topk as itk
import jaxpr_walk
from implicit_topk import problems, solvers

SORTING_PRIMITIVES = {"sort", "top_k", "argsort", "approx_top_k"}


def _primitives(jaxpr):
  """Every primitive name in a jaxpr, sub-jaxprs (loops, custom rules, hijax) included."""
  return jaxpr_walk.primitive_names(jaxpr)


@pytest.mark.parametrize("operator", [itk.soft_topk_mask, itk.soft_topk_mag])
@pytest.mark.parametrize("p", [4.0 / 3.0, 2.0, 3.0])
def test_threshold_solver_never_sorts_forward_or_backward(operator, p):
  x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 700)), jnp.float32)
  forward = lambda x: operator(x, 7.5, regularization_strength=0.3, p=p, solver="threshold")
  backward = jax.grad(lambda x: jnp.sum(jnp.sin(forward(x))))
  for fn in (forward, backward, lambda x: jax.jvp(forward, (x,), (x,))):
    names = _primitives(jax.make_jaxpr(fn)(x).jaxpr)
    assert not names & SORTING_PRIMITIVES, names & SORTING_PRIMITIVES


def test_the_sort_check_sees_a_sort_inside_a_hijax_primitive():
  """jax 0.11 on a GPU hides sorts (and Pallas calls) inside ``call_hi_primitive``: the walk
  traces such a primitive's program (a hand-made one here, whose program sorts)."""
  hijax = pytest.importorskip("jax._src.hijax")
  if not hasattr(hijax, "VJPHiPrimitive"):
    pytest.skip("this jax has no hijax primitives")

  class SortedCopy(hijax.VJPHiPrimitive):
    def __init__(self, aval):
      self.in_avals, self.out_aval, self.params = (aval,), aval, {}
      super().__init__()

    def expand(self, x):
      return jnp.sort(x)

  x = jnp.arange(4.0)
  jaxpr = jax.make_jaxpr(lambda v: SortedCopy(jax.typeof(v))(v))(x).jaxpr
  assert "call_hi_primitive" in {eqn.primitive.name for eqn in jaxpr.eqns}
  assert "sort" in _primitives(jaxpr)


def test_the_sort_check_sees_a_sort():
  """The jaxpr walk above finds sorts inside custom rules and loops (else it proves nothing)."""
  x = jnp.ones((2, 5))
  fn = lambda x: itk.soft_topk_mask(x, 2.0, regularization_strength=0.3, p=2.0, solver="dykstra")
  assert "sort" in _primitives(jax.make_jaxpr(fn)(x).jaxpr)


@pytest.mark.parametrize("operator", [itk.soft_topk_mask, itk.soft_topk_mag])
def test_eager_calls_compile_once(operator):
  x = jnp.asarray(np.random.default_rng(1).normal(size=(1, 1000)), jnp.float32)
  operator(x, 10.0, regularization_strength=0.1, solver="threshold")  # compiles
  with jax.log_compiles():
    import logging
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("jax")
    logger.addHandler(handler)
    try:
      for k in (10.0, 12.5, 3.0):  # a new k value is an argument, not a new program
        operator(x, k, regularization_strength=0.2, solver="threshold")
    finally:
      logger.removeHandler(handler)
  compiled = [r for r in records if "Compiling" in r.getMessage()]
  assert not compiled, [r.getMessage()[:200] for r in compiled]


@pytest.mark.parametrize("kwargs", [dict(diff="unrolled"), dict(maxiter=20)])
def test_auto_takes_iterative_options_on_every_backend(kwargs, monkeypatch):
  problem = problems.CappedSimplex(itk.PNorm())
  for backend in ("cpu", "gpu", "tpu"):
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    big = 1 << 20
    # With the options too, the iterative pure-JAX solver on every backend.
    assert solvers.resolve_solver_name("auto", problem, size=big, **kwargs) == "threshold"
  monkeypatch.undo()
  x = jnp.linspace(-1.0, 1.0, 9)
  y = itk.soft_topk_mask(x, 2.5, regularization_strength=0.5, **kwargs)
  np.testing.assert_allclose(float(jnp.sum(y)), 2.5, rtol=1e-5)


def test_auto_never_picks_the_host_callback(monkeypatch):
  # The default must export (jax.export) and run under shard_map: never the host PAV.
  # On CPU the mask and the magnitude problem take the native kernels (XLA custom calls,
  # exportable); other backends and a split reduced axis take "threshold".
  for problem in (problems.CappedSimplex(itk.PNorm(2.0)), problems.CappedSimplex(itk.Entropy()),
                  problems.Magnitude(4.0 / 3.0)):
    for backend in ("cpu", "gpu", "tpu"):
      monkeypatch.setattr(jax, "default_backend", lambda b=backend: b)
      expected = "native" if backend == "cpu" else "threshold"
      assert solvers.resolve_solver_name("auto", problem, size=1 << 24) == expected
      assert solvers.resolve_solver_name("auto", problem, sharded=True) == "threshold"


def test_auto_refuses_tol_on_every_backend():
  with pytest.raises(ValueError, match="`tol` applies to solver='dykstra'"):
    itk.soft_topk_mask(jnp.ones(4), 2.0, tol=1e-3)


def test_k_of_the_wrong_shape_is_named():
  with pytest.raises(ValueError, match="`k` must be a scalar or broadcast to the batch shape"):
    itk.soft_topk_mask(jnp.ones((3, 5)), jnp.full((3, 1), 2.0))
  with pytest.raises(ValueError, match="`regularization_strength` must be a scalar or broadcast"):
    itk.soft_topk_mag(jnp.ones((3, 5)), 2.0, regularization_strength=jnp.full((2,), 0.5))


@pytest.mark.slow
def test_mask_and_magnitude_run_on_the_same_solver_objects():
  x = jnp.asarray(np.random.default_rng(2).normal(size=(4, 50)))
  for name in ("threshold", "pav"):
    mask = solvers.make_solver(name, problems.CappedSimplex(itk.PNorm(2.0)))
    mag = solvers.make_solver(name, problems.Magnitude(2.0))
    assert type(mask) is type(mag)
    np.testing.assert_allclose(mask.apply(x, 5.0, 0.5),
                               itk.soft_topk_mask(x, 5.0, regularization_strength=0.5, p=2.0, solver="pav"), atol=1e-6)
    np.testing.assert_allclose(mag.apply(x, 5.0, 0.5),
                               itk.soft_topk_mag(x, 5.0, regularization_strength=0.5, p=2.0, solver="pav"), atol=1e-6)


class _NoMask:
  saturation = (0.0, 1.0)


class _Custom:
  """A user-defined regularizer: the p = 2 mask, without a PAV kernel declaration."""
  saturation = (0.0, 1.0)

  def mask(self, z):
    return jnp.clip(z, 0.0, 1.0)


@pytest.mark.slow
def test_user_regularizers_work_or_say_what_they_lack():
  with pytest.raises(TypeError, match=r"must provide `mask` \(see"):
    itk.soft_topk_mask(jnp.ones(4), 2.0, regularizer=_NoMask())
  with pytest.raises(ValueError, match="declaring `pav_kind`"):
    itk.soft_topk_mask(jnp.ones(4), 2.0, regularizer=_Custom(), solver="pav")
  x = jnp.asarray(np.random.default_rng(3).normal(size=(2, 30)), jnp.float32)
  np.testing.assert_allclose(itk.soft_topk_mask(x, 4.5, regularization_strength=0.5, regularizer=_Custom()),
                             itk.soft_topk_mask(x, 4.5, regularization_strength=0.5, p=2.0, solver="pav"), atol=1e-5)


@pytest.mark.parametrize("solver", ["threshold", "pallas"])
@pytest.mark.parametrize("p", [2.0, 3.0, 5.0])
def test_the_step_tolerance_follows_the_fractional_entries_not_the_row_maximum(solver, p):
  # Found by an independent audit: the step tolerance was 4 ulps of |max x| (here 1e6),
  # so at p > 2 (a mask with an infinite slope at 0) the iteration stopped 2e-10 below
  # the entry 0.5 and left it a mass of 1.5e-5 (p = 3) where the answer has 0. The
  # fractional entries lie in (lam, lam + l): their scale bounds the tolerance. Exact
  # answer: y = (1, max(0, k - 1) at p = 2 else 0, 0) with k - 1 < the entry's reach
  # (p = 2: (0.5 - lam) / l = k - 1 exactly; p > 2: the entry's mass (k - 1) needs
  # z = (k - 1)^(p - 1) < 1e-24, far below an ulp of 0.5 - lam, so the root is at 0.5).
  # (float32 at p = 2: a mass 2^-23 is within the snap's rounding allowance, n 4 eps k:
  # 0 is as good an answer there; float64 checks the exact mass)
  cases = [(np.float64, 1e-12)] + ([(np.float32, 2.0 ** -23)] if p > 2 else [])
  for dtype, k_minus_1 in cases:
    x = jnp.asarray(np.array([1e6, 0.5, 0.3], dtype))
    k = dtype(1) + dtype(k_minus_1)
    y = np.asarray(itk.soft_topk_mask(x, k, regularization_strength=1.0, p=p,
                                      solver=solver), np.float64)
    want_middle = float(k) - 1.0 if p == 2.0 else 0.0
    assert y[0] == 1.0 and y[2] == 0.0, (dtype, y)
    assert abs(y[1] - want_middle) <= 4 * np.finfo(dtype).eps * max(want_middle, 1e-30) + (
        1e-30 if p > 2 else 0.0), (dtype, y, want_middle)
