"""soft_sort / soft_rank: no contended scatter, and a program that does not grow with n.

Issue 27: on a GPU, ``soft_rank`` forward+backward grew super-linearly in n (387 ms at
1 x 1e5 on an H200) while its forward stayed flat. The backward summed the block
conditions with a segment sum (a scatter-add) and spread the block values with a
gather whose transpose is one: with one large block (soft ranks at a moderate
strength pool everything) all n entries added into one address, and GPU atomics on
one address serialize. Now every scatter, forward and backward, writes distinct
addresses (permutations, or one entry per block); the block sums are segmented scans.

No timings here (they are noisy and forbidden in tests): the checks read the
programs. Each walks the jaxpr (every sub-jaxpr: jit, while, cond, scan, custom
rules) of the forward and of ``jax.grad``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import implicit_topk as itk
from implicit_topk.solvers import isotonic

try:
  from jax.extend import core as _core
  _JAXPR_TYPES = (_core.ClosedJaxpr, _core.Jaxpr)
except ImportError:  # pragma: no cover
  from jax import core as _core
  _JAXPR_TYPES = (_core.ClosedJaxpr, _core.Jaxpr)


def _equations(jaxpr, skip=None):
  """Every equation of ``jaxpr`` and of its sub-jaxprs (not inside a ``jit`` named
  ``skip``)."""
  for eqn in jaxpr.eqns:
    yield eqn
    if skip is not None and eqn.params.get("name") == skip:
      continue
    for value in eqn.params.values():
      for sub in value if isinstance(value, (list, tuple)) else [value]:
        if isinstance(sub, _core.ClosedJaxpr):
          yield from _equations(sub.jaxpr, skip)
        elif isinstance(sub, _core.Jaxpr):
          yield from _equations(sub, skip)


def _outside_branches(jaxpr):
  """The equations of ``jaxpr`` and of the ``jit`` calls in it (the operators' cached
  jit), but not of the solver's jit (``_jax_blocks``) nor of branches (the platform
  switch's ``cond``)."""
  for eqn in jaxpr.eqns:
    yield eqn
    if eqn.primitive.name in ("pjit", "jit") and eqn.params.get("name") != "_jax_blocks":
      yield from _outside_branches(eqn.params["jaxpr"].jaxpr)


def _programs(name, n, solver, regularizer):
  fn = getattr(itk, name)
  kwargs = dict(solver=solver, regularizer=regularizer)
  if name == "soft_sort" and regularizer == "entropy":
    kwargs["descending"] = True
  x = jnp.linspace(1.0, 2.0, n, dtype=jnp.float32)[None] ** 2
  weights = jnp.arange(n, dtype=jnp.float32)
  forward = jax.make_jaxpr(lambda x: fn(x, **kwargs))(x)
  backward = jax.make_jaxpr(jax.grad(lambda x: (fn(x, **kwargs) * weights).sum()))(x)
  return forward.jaxpr, backward.jaxpr


# The default run checks one case per operator (the default solver and regularizer); the
# slow group every solver and regularizer.
CASES = [pytest.param(name, solver, regularizer,
                      marks=() if (solver, regularizer) == ("auto", None) else pytest.mark.slow)
         for name in ("soft_sort", "soft_rank")
         for solver in ("auto", "pav_jax")
         for regularizer in (None, "entropy", itk.PNorm(1.5))]


def _lowered(name, solver, regularizer, platform, n=300):
  """StableHLO text of the forward and of jax.grad, lowered for ``platform`` (a GPU
  program can be lowered on a CPU-only machine)."""
  fn = getattr(itk, name)
  kwargs = dict(solver=solver, regularizer=regularizer)
  if name == "soft_sort" and regularizer == "entropy":
    kwargs["descending"] = True
  x = jnp.linspace(1.0, 2.0, n, dtype=jnp.float32)[None].repeat(2, 0) ** 2
  weights = jnp.arange(n, dtype=jnp.float32)
  programs = (lambda x: fn(x, **kwargs),
              jax.grad(lambda x: (fn(x, **kwargs) * weights).sum()))
  return [jax.jit(f).trace(x).lower(lowering_platforms=(platform,)).as_text()
          for f in programs]


@pytest.mark.parametrize("name,solver,regularizer", CASES)
def test_no_contended_scatter_on_gpu(name, solver, regularizer):
  """Every scatter of the GPU program, forward and backward, writes distinct addresses:
  the permutations (sorting, unsorting, and their transposes) and one entry per block.
  On CPU (``lax.platform_dependent``) the block sums are segment sums: XLA:CPU
  scatters serially, without atomics, and they are several times faster there than the
  O(n log n) scans; the CPU program is checked to have them, so this test would see a
  platform switch that stopped working."""
  for text in _lowered(name, solver, regularizer, "cuda"):
    scatters = text.count('"stablehlo.scatter"(')
    assert scatters >= 1
    assert text.count("unique_indices = true") == scatters, (name, solver, regularizer)
  backward_cpu = _lowered(name, solver, regularizer, "cpu")[1]
  assert backward_cpu.count("unique_indices = false") >= 1


def test_the_jaxpr_marks_the_permutation_scatters_unique():
  """In the jaxpr (both platform branches), the scatters outside the block sums are
  the permutations' transposes, marked unique."""
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 257))
  for name in ("soft_sort", "soft_rank"):
    fn = getattr(itk, name)
    grad = jax.make_jaxpr(jax.grad(lambda x: (fn(x) * jnp.arange(257.0)).sum()))(x)
    top = [e for e in _outside_branches(grad.jaxpr) if "scatter" in e.primitive.name]
    assert top and all(e.params["unique_indices"] for e in top), name


@pytest.mark.parametrize("name", ["soft_sort", "soft_rank"])
def test_program_grows_like_log_n(name):
  """Outside the solver's merge rounds (forward only; a few for any n, below), the
  program is a fixed number of O(n) passes per scan level, ``ceil(log2 n)`` levels:
  O(n log n) work forward and backward, no loop whose trip count follows the blocks."""
  sizes = {}
  for n in (2 ** 8, 2 ** 12, 2 ** 16 + 3):
    forward, backward = _programs(name, n, "auto", None)
    levels = int(n - 1).bit_length()
    sizes[levels] = tuple(len(list(_equations(j, skip="_jax_blocks")))
                          for j in (forward, backward))
    # the only loops are the solver's rounds (in its jit, forward only)
    outside = [e.primitive.name for e in _equations(backward, skip="_jax_blocks")]
    assert "_jax_blocks" in [e.params.get("name") for e in _equations(backward)]
    assert not {"scan", "while"} & set(outside), set(outside)
  # a + b log2(n) equations (the scans' levels; the CPU cumsum's levels of 16): from
  # n = 256 to 65539 the program less than doubles, and the growth per doubling of n
  # does not speed up (anything that grew like a power of n would do both)
  (l0, s0), (l1, s1), (l2, s2) = sorted(sizes.items())
  for part in (0, 1):
    early, late = (s1[part] - s0[part]) / (l1 - l0), (s2[part] - s1[part]) / (l2 - l1)
    assert 0 < early and late < 1.5 * early, sizes
    assert s2[part] < 2 * s0[part], sizes


@pytest.mark.parametrize("n", [2 ** 8, pytest.param(2 ** 14, marks=pytest.mark.slow)])
def test_merge_rounds_stay_few_on_one_block(n):
  """Soft ranks at strength 1 pool the whole row into one block (the case that made
  the GPU serialize): the solver's rounds do not grow with n."""
  s = -jnp.sort(-jax.random.normal(jax.random.PRNGKey(1), (1, n)), axis=1)
  w = jnp.arange(n, 0, -1, dtype=s.dtype)[None]
  values, ids, rounds = isotonic.isotonic_blocks(s, w, jnp.ones(1), itk.PNorm(2.0))
  assert int(ids[0, -1]) == 0  # one block
  np.testing.assert_allclose(values[0, 0], jnp.mean(s - w), rtol=1e-5)
  assert int(rounds) <= 2


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("op", [jnp.add, jnp.maximum])
def test_segmented_scan_matches_a_loop(reverse, op):
  rng = np.random.default_rng(0)
  n = 37
  values = rng.normal(size=(3, n)).astype(np.float32)
  first = rng.random((3, n)) < 0.3
  first[:, 0] = True
  reach = np.zeros((3, n), np.int32)
  expected = np.zeros_like(values)
  for r in range(3):
    runs = np.split(np.arange(n), np.flatnonzero(first[r])[1:])
    for run in runs:
      for j, i in enumerate(run):
        part = run[j:] if reverse else run[:j + 1]
        reach[r, i] = len(part) - 1
        expected[r, i] = functools.reduce(op, values[r, part])
  got = isotonic.segmented_scan(jnp.asarray(values), jnp.asarray(reach), op=op, reverse=reverse)
  np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)

