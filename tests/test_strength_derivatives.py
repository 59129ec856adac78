"""Derivatives in the strength far from unit scale, every differentiable solver path.

JAX differentiates ``d / l`` in ``l`` as ``-d * l**-2``, which overflows for ``l > 2^63``
in float32 (and is flushed below ``2^-64``): the derivative in ``l`` of the mask (pure-JAX
and PAV paths), of the top-k in magnitude (every solver at ``p <= 2``) and of the
permutahedron operators came out 0 or NaN at ``l = 1e21``, and with ``standardize=True``
that error reached ``d/dx`` through the row's spread (``implicit_topk/_quotient.py``).

Reference: central differences in float64 at unit scale, carried to the scale ``c`` by
each operator's homogeneity (nothing but the operators' definitions):

* mask, rank: degree 0 in ``(x, l)`` jointly, so ``dF/dl`` at ``(c x, c l)`` is
  ``G'(l) / c``; with ``standardize=True`` the mask has degree 0 in ``x``: ``dF/dx`` at
  ``c x`` is ``G'(x) / c``;
* magnitude: ``mag(c x, l c^(2-p)) = c mag(x, l)``, so ``dF/dl'`` is ``c^(p-1) G'(l)``;
* sort: ``soft_sort(c x, l) = c soft_sort(x, l c^(p-1))``, so at ``l' = c^(1-p)``
  ``dF/dl'`` is ``c^p G'(1)``.

And the values of ``soft_sort`` at ``p > 2`` and large strengths in float32, by the same
identity with ``c`` a power of two.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import implicit_topk as itk

jax.config.update("jax_enable_x64", True)

_RNG = np.random.RandomState(3)
_X0, _COT = _RNG.randn(8), _RNG.randn(8)
_K = 2.5
_SCALES = {np.float32: (1e21, 1e-21), np.float64: (1e160, 1e-160)}
_RTOL = {np.float32: 1e-4, np.float64: 1e-6}


def _central(g, v, h):
  return (g(v + h) - g(v - h)) / (2 * h)


def _functional(op, **kw):
  """``(x, l) -> sum(cot * op(x, l))``."""
  return lambda x, l: jnp.sum(jnp.asarray(_COT, x.dtype) * op(x, regularization_strength=l, **kw))


# (name, op, keyword arguments, the strength at scale c, d/dl at scale c from d/dl at 1)
_CASES = [
    ("mask p=2", lambda x, **kw: itk.soft_topk_mask(x, _K, **kw), dict(p=2.0),
     lambda c, p: c, lambda g, c, p: g / c),
    ("mask p=4/3", lambda x, **kw: itk.soft_topk_mask(x, _K, **kw), dict(p=4 / 3),
     lambda c, p: c, lambda g, c, p: g / c),
    ("magnitude p=4/3", lambda x, **kw: itk.soft_topk_mag(x, _K, **kw), dict(p=4 / 3),
     lambda c, p: c ** (2 - p), lambda g, c, p: c ** (p - 1) * g),
    ("magnitude p=2", lambda x, **kw: itk.soft_topk_mag(x, _K, **kw), dict(p=2.0),
     lambda c, p: 1.0, lambda g, c, p: c * g),
    ("soft_rank", itk.soft_rank, dict(p=2.0), lambda c, p: c, lambda g, c, p: g / c),
    ("soft_rank p=3", itk.soft_rank, dict(p=3.0), lambda c, p: c, lambda g, c, p: g / c),
    ("soft_sort", itk.soft_sort, dict(p=3.0), lambda c, p: c ** (1 - p),
     lambda g, c, p: c ** p * g),
]
# soft_sort's strength goes like c^(1-p) and its derivative like c^p: at p = 3 these
# scales give strengths of 1e+-20 (float32) and 1e+-200 (float64) with a derivative inside
# the float range
_SORT_SCALES = {np.float32: (1e10, 1e-10), np.float64: (1e100, 1e-100)}
# p > 2: the link g(v / l) = g(v) / l^a, whose derivative in l must not form l^(-a-1)
# (3e-41 at l = 1e27, a = 1/2: flushed in float32)
_RANK_P3_SCALES = {np.float32: (1e27, 1e-27), np.float64: (1e250, 1e-250)}
_SOLVERS = {"mask": ("native", "pav", "threshold"), "magnitude": ("native", "pav", "threshold"),
            "soft_rank": ("pav_jax", "pav"), "soft_sort": ("pav_jax", "pav")}


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("name,op,kw,strength,carry", _CASES, ids=[c[0] for c in _CASES])
def test_strength_derivative_at_any_scale(name, op, kw, strength, carry, dtype):
  p = kw["p"]
  for solver in _SOLVERS[name.split()[0]]:
    F = _functional(op, solver=solver, **kw)
    g1 = _central(lambda l: F(jnp.asarray(_X0), l), 1.0, 1e-6)
    scales = {"soft_sort": _SORT_SCALES, "soft_rank p=3": _RANK_P3_SCALES}.get(name, _SCALES)
    for c in scales[dtype]:
      x, l = jnp.asarray(_X0 * c, dtype), jnp.asarray(strength(c, p), dtype)
      got = float(jax.grad(F, argnums=1)(x, l))
      np.testing.assert_allclose(got, carry(g1, c, p), rtol=_RTOL[dtype],
                                 err_msg=f"{name} {solver} c={c}")


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("solver", ["native", "pav", "threshold"])
def test_standardized_mask_derivative_in_x_at_any_scale(solver, dtype):
  F = _functional(lambda x, **kw: itk.soft_topk_mask(x, _K, standardize=True, **kw),
                  solver=solver)
  fd = np.array([_central(lambda v: F(jnp.asarray(_X0).at[i].set(v), 0.5), _X0[i], 1e-6)
                 for i in range(_X0.size)])
  for c in _SCALES[dtype]:
    got = np.asarray(jax.grad(F)(jnp.asarray(_X0 * c, dtype), jnp.asarray(0.5, dtype)))
    np.testing.assert_allclose(got * c, fd, rtol=_RTOL[dtype], atol=_RTOL[dtype] * np.abs(fd).max(),
                               err_msg=f"c={c}")


@pytest.mark.parametrize("solver", ["pav_jax", "pav"])
@pytest.mark.parametrize("p", [3.0, 5.0])
def test_soft_sort_above_p2_at_large_strengths_float32(p, solver):
  """``soft_sort(c x, l c^(1-p)) = c soft_sort(x, l)``: with ``c`` a power of two both
  sides are exact floats. At ``p > 2`` the link's argument ``y^(p-1)`` left the float32
  range where ``y`` did not (entries 2^-60, strength 2^120 at p = 3: 6412 ulps off), so
  the link is evaluated in the units of the sorted values."""
  x = jnp.asarray(_X0, jnp.float32)
  base = np.asarray(itk.soft_sort(x, regularization_strength=0.5, p=p, solver=solver))
  for e in ((-60, -40, 40) if p == 3.0 else (-30, -20, 30)):  # strengths in float32 range
    c = 2.0**e
    l = 0.5 * 2.0 ** (e * (1 - p))
    assert 2.0**-126 <= l < 2.0**126
    got = np.asarray(itk.soft_sort(x * c, regularization_strength=l, p=p, solver=solver))
    np.testing.assert_allclose(got / c, base, rtol=0, atol=64 * 2.0**-23 * np.abs(base).max(),
                               err_msg=f"c=2^{e}")
