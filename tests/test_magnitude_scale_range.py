"""The top-k in magnitude across the float range, every solver and p-norm exponent.

``soft_topk_mag`` evaluates ``g(t / l) = (t / l)^(1/(p-1))``. For ``p > 2`` the quotient
``t / l`` can leave the float range while ``g`` of it does not (float32 entries of 1e-19
with ``l = 1e19``); the solvers and the output map take ``t^a l^-a`` there. The PAV
solver's closed form at ``p = 4/3`` sums cubes of the entries (overflow beyond 1e100 in
float64); such rows take its Newton solver. Its kernel read a float32 strength as a
float32 (``l^3`` overflowed at ``l = 1e15``). Dykstra's pair means overflowed near the
float maximum.

Checked against ``references.MagnitudeDecimal`` (a 40-digit ``decimal`` bisection of the
threshold equation; nothing from ``implicit_topk``) as a backward error: each output
lies between the exact outputs at ``lam* -/+ 256 ulps``, widened by 16 ulps of the output
map's evaluation noise (the bounds of ``test_magnitude_pav_accuracy``'s property test).
Rows span the scales whose entries keep normal ulps (down to 2^-970 in float64, 2^-103 in
float32: XLA's CPU runtime flushes subnormal differences to 0, ``docs/operators.md``)
up to the float maximum, with strengths at the row's natural scale ``c^(2-p)`` and
decades away from it.
"""

from __future__ import annotations

import decimal
import os
import sys
from decimal import Decimal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import implicit_topk as itk

sys.path.insert(0, os.path.dirname(__file__))
import references as R  # noqa: E402

jax.config.update("jax_enable_x64", True)

_PATTERN = np.array([0.3, -1.2, 2.0, 0.7, -0.05, 0.9])
# Scales of the row: its smallest entry (0.05 c) keeps a normal ulp.
_SCALES = {np.float64: (1e-280, 1e-150, 1e-40, 1.0, 1e40, 1e150, 1e300),
           np.float32: (1e-28, 1e-19, 1e-8, 1.0, 1e8, 1e19, 1e37)}
_LAM_ULPS, _OUT_ULPS = 256, 16


def _rows(dtype, p):
  """(x, k, l) rows: every scale, strengths ``10^j c^(2-p)`` (j in -3, 0, 3) and 1 (where
  the API takes them), k = 2.5 and 3."""
  info = np.finfo(dtype)
  xs, ks, ls = [], [], []
  lowest, highest = np.log10(2 * float(info.tiny)), np.log10(0.25 / float(info.tiny))
  for c in _SCALES[dtype]:
    natural = np.log10(c) * (2.0 - p)
    for log_l in (natural - 3, natural, natural + 3, 0.0):
      if not lowest <= log_l <= highest:
        continue
      l = 10.0**log_l
      for k in (2.5, 3.0):
        xs.append(_PATTERN * c)
        ks.append(k)
        ls.append(l)
  return np.array(xs, dtype), np.array(ks, dtype), np.array(ls, dtype)


def _assert_exact_up_to_rounding(out, x, k, l, p):
  """Every row of ``out`` (from ``x``, ``k``, ``l`` of one dtype) against the reference."""
  dtype = x.dtype
  eps, tiny = float(np.finfo(dtype).eps), float(np.finfo(dtype).tiny)
  out = np.asarray(out, np.float64)
  failures = []
  for r in range(x.shape[0]):
    ref = R.MagnitudeDecimal(x[r], float(k[r]), float(l[r]), p)
    with decimal.localcontext(R.decimal_context()):
      lam_err = Decimal(_LAM_ULPS * eps) * ref.lam
    ok, why = ref.output_within(out[r], lam_err, out_ulps=_OUT_ULPS, eps=eps, tiny=tiny)
    if not np.all(ok):
      failures.append(f"x={x[r].tolist()} k={float(k[r])} l={float(l[r])!r}: {why}")
  assert not failures, f"{len(failures)} of {x.shape[0]} rows:\n" + "\n".join(failures[:3])


def _check_rows(solver, dtype, p):
  x, k, l = _rows(dtype, p)
  out = jax.jit(lambda x, k, l: itk.soft_topk_mag(x, k, regularization_strength=l, p=p,
                                                  solver=solver))(x, k, l)
  _assert_exact_up_to_rounding(out, x, k, l, p)


_P_VALUES = (4.0 / 3.0, 1.5, 2.0, 3.0, 5.0)


@pytest.mark.parametrize("p", _P_VALUES, ids=lambda p: f"p{p:.3g}")
@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("solver", ["native", "threshold", "pav"])
def test_every_scale_and_strength(solver, dtype, p):
  if solver != "native" and (dtype == np.float64) != (p > 2):
    pytest.skip("the default run: the CPU kernel everywhere, the others at p > 2 in "
                "float64 and p <= 2 in float32; the rest is under the slow marker")
  _check_rows(solver, dtype, p)


@pytest.mark.slow
@pytest.mark.parametrize("p", _P_VALUES, ids=lambda p: f"p{p:.3g}")
@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("solver", ["threshold", "pav"])
def test_every_scale_and_strength_slow(solver, dtype, p):
  if (dtype == np.float64) == (p > 2):
    pytest.skip("in the default run (test_every_scale_and_strength)")
  _check_rows(solver, dtype, p)


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
def test_dykstra_near_the_float_maximum(dtype):
  """p = 2 rows at the float maximum: Dykstra's answer is finite and the exact one (its
  pools are found and snapped), as every other solver's."""
  top = float(np.finfo(dtype).max)
  x = np.array([[0.95, -0.95, 0.3], [0.99, 0.5, -0.6], [0.2, 0.9, 0.1]]) * top
  x = x.astype(dtype)
  k = np.array([1.5, 2.0, 1.0], dtype)
  l = np.ones(3, dtype)
  out = itk.soft_topk_mag(jnp.asarray(x), jnp.asarray(k), regularization_strength=jnp.asarray(l),
                          p=2.0, solver="dykstra")
  assert np.all(np.isfinite(out))
  _assert_exact_up_to_rounding(out, x, k, l, 2.0)


@pytest.mark.parametrize("p,scale", [(3.0, 1e-150), (3.0, 1e150), (5.0, 1e-60), (5.0, 1e60)])
def test_gradients_at_p_above_2_far_from_unit_scale(p, scale):
  """Float64, a strength ``c^(2-p)``: the vector-Jacobian product of every solver against
  central differences (steps of 1e-6 of the row's scale); the Jacobian has degree 0 in the
  scale, so it is compared as it is."""
  x = jnp.asarray(_PATTERN * scale)
  l = scale ** (2.0 - p)
  w = jnp.asarray(np.random.default_rng(0).normal(size=x.shape))
  h = 1e-6 * scale
  for solver in ("native", "threshold", "pav"):
    f = lambda v: jnp.sum(w * itk.soft_topk_mag(v, 2.5, regularization_strength=l, p=p,
                                                solver=solver))
    grad = np.asarray(jax.grad(f)(x))
    fd = np.array([(f(x.at[i].add(h)) - f(x.at[i].add(-h))) / (2 * h) for i in range(x.size)])
    np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-6, err_msg=solver)
