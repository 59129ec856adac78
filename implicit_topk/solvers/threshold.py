r"""Pure-JAX threshold solver: safeguarded Newton on :math:`\phi(\lambda)`, no sort.

:math:`\phi(\lambda) = \sum_i \mathrm{mask}((x_i - \lambda)/l) - k` is continuous and
nonincreasing. With the saturation interval :math:`[z_0, z_1]` of the regularizer,

* :math:`\lambda_{lo} = \min_i x_i - l z_1` puts every finite coordinate at 1, so
  :math:`\phi(\lambda_{lo}) = \#\{x_i > -\infty\} - k \ge 0`;
* :math:`\lambda_{hi} = \max_i x_i - l z_0` puts every finite coordinate at 0, so
  :math:`\phi(\lambda_{hi}) = \#\{x_i = +\infty\} - k \le 0`.

Each iteration makes one fused pass over the row (``phi`` and ``phi'`` together, the
derivative by ``jax.jvp`` of the regularizer's mask), shrinks the bracket by the sign
of ``phi``, and takes the Newton step if it stays strictly inside the bracket,
otherwise bisects. It stops when ``phi == 0``, when a step is below a few ulps of
``lam``, or when the bracket has collapsed; so the result is exact to floating-point
precision. For ``p = 2`` the Newton step is the exact root of the current linear piece,
so the iteration terminates once the partition {0, (0,1), 1} stops changing
(``proofs/newton_finite_termination_p2.md``). Typical counts: 5-20 passes.

Cost: O(n) memory, O(n) time per pass, no sort, no n x n intermediate. On GPU/TPU
this is the fast path; on CPU it avoids XLA's slow sort.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from implicit_topk.solvers.base import CappedSimplexSolver

# Sample size for the starting guess (a quantile of a strided subsample).
_SAMPLE = 256


def _phi_and_derivatives(regularizer, lam, x, k, l):
  """phi(lam) and its first two derivatives in lam, in one fused pass over the row."""
  z = (x - lam[..., None]) / l[..., None]
  ones = jnp.ones_like(z)
  (y, dy), (_, d2y) = jax.jvp(
      lambda u: jax.jvp(regularizer.mask, (u,), (ones,)), (z,), (ones,))
  return (jnp.sum(y, axis=-1) - k, -jnp.sum(dy, axis=-1) / l,
          jnp.sum(d2y, axis=-1) / (l * l))


def bracket(regularizer, x, k, l):
  """Bracket [lo, hi] of the root, and rows whose answer is known without iterating.

  With ``n_f`` finite entries sharing ``k_f = k - #(+inf)``, a finite saturation end
  gives the bracket end ``min x - l z1`` / ``max x - l z0``; an infinite one uses
  ``omega'``: at ``min x - l omega'(k_f/n_f)`` every finite y is >= k_f/n_f, at
  ``max x - l omega'(k_f/n_f)`` every finite y is <= k_f/n_f. Rows where the finite
  entries must all be 0 (or all 1) are known: the saturation end where it is finite,
  NaN (no finite threshold) where it is not.
  """
  z0, z1 = regularizer.saturation
  finite = jnp.isfinite(x)
  any_finite = jnp.any(finite, axis=-1)
  x_max = jnp.where(any_finite, jnp.max(jnp.where(finite, x, -jnp.inf), axis=-1), 0)
  x_min = jnp.where(any_finite, jnp.min(jnp.where(finite, x, jnp.inf), axis=-1), 0)
  n_pos_inf = jnp.sum(x == jnp.inf, axis=-1).astype(x.dtype)
  n_not_neg_inf = jnp.sum(x > -jnp.inf, axis=-1).astype(x.dtype)
  if np.isfinite(z0) and np.isfinite(z1):
    lo, hi = x_min - l * z1, x_max - l * z0
  else:
    level = jnp.clip((k - n_pos_inf) / jnp.maximum(n_not_neg_inf - n_pos_inf, 1), 0.25, 0.75)
    level = jnp.where((k > n_pos_inf) & (k < n_not_neg_inf),
                      (k - n_pos_inf) / jnp.maximum(n_not_neg_inf - n_pos_inf, 1), level)
    shift = l * jnp.asarray(regularizer.omega_prime(level), x.dtype)
    lo = x_min - l * z1 if np.isfinite(z1) else x_min - shift
    hi = x_max - l * z0 if np.isfinite(z0) else x_max - shift
  has_nan = jnp.any(jnp.isnan(x), axis=-1)
  at_hi = k == n_pos_inf  # all finite coordinates at 0
  at_lo = k == n_not_neg_inf  # all finite coordinates at 1
  infeasible = (has_nan | (n_pos_inf > k) | (n_not_neg_inf < k)
                | (at_hi & (not np.isfinite(z0))) | (at_lo & (not np.isfinite(z1))))
  known = infeasible | at_hi | at_lo
  known_value = jnp.where(infeasible, jnp.nan, jnp.where(at_hi, hi, lo))
  return lo, hi, known, known_value


def _initial_guess(regularizer, x, k, l, lo, hi):
  """k-th largest of a strided subsample of the row, moved into the bracket."""
  n = x.shape[-1]
  stride = max(1, n // _SAMPLE)
  sample = x[..., ::stride]
  m = sample.shape[-1]
  sample = jnp.sort(jnp.where(jnp.isnan(sample), -jnp.inf, sample), axis=-1)
  rank = jnp.clip(jnp.floor(k * (m / n)).astype(jnp.int32), 0, m - 1)
  quantile = jnp.take_along_axis(sample, (m - 1 - rank)[..., None], axis=-1)[..., 0]
  z0, z1 = regularizer.saturation
  guess = quantile - 0.5 * l * (min(z1, 1.0) + max(z0, -1.0))
  return jnp.clip(jnp.where(jnp.isfinite(guess), guess, 0.5 * (lo + hi)), lo, hi)


def tolerances(dtype):
  """(step tolerance, residual tolerance) for a dtype: 4 eps and sqrt(eps)."""
  eps = float(np.finfo(np.dtype(dtype)).eps)
  return 4 * eps, float(np.sqrt(eps))


def safeguarded_newton_step(derivatives, carry, *, tols, step_scale, residual_scale,
                            geometric=False):
  """One safeguarded (Schroeder-)Newton iteration on a nonincreasing scalar function.

  Shared by every sort-free threshold solver (the mask here, the magnitude operator in
  :mod:`implicit_topk.magnitude`). ``derivatives(lam) -> (phi, phi', phi'')`` per row;
  ``carry = (lam, lo, hi, prev_step, done, iter_num)``; rows already done stay put.

  The sign of ``phi`` shrinks the bracket. A Newton step is taken only if it lands
  strictly inside the bracket and is at most half the previous step (as in Numerical
  Recipes' rtsafe; this rules out cycles and slow creeping), otherwise we bisect
  (geometrically over brackets wider than 4x when ``geometric``: roots many decades
  below the bracket's top). Schroeder's step (Newton on phi / phi') replaces Newton's
  where it is longer: near the degenerate roots phi ~ c (lam - a)^m at which a flat
  piece of phi starts (p < 2), Newton converges only linearly and Schroeder's step lands
  on a. A step below ``step_tol * step_scale(lam)`` counts as convergence only if
  ``|phi| <= phi_tol * residual_scale(lam)`` too (a huge slope, e.g. p > 2 near a
  coordinate leaving 0, could otherwise stall Newton); a collapsed bracket or
  ``phi == 0`` also stop.
  """
  step_tol, phi_tol = tols
  lam, lo, hi, prev_step, done, iter_num = carry
  phi, dphi, d2phi = derivatives(lam)
  lo = jnp.where(phi > 0, lam, lo)
  hi = jnp.where(phi < 0, lam, hi)
  newton_step = phi / jnp.where(dphi < 0, dphi, -1)
  denominator = dphi * dphi - phi * d2phi
  schroeder_step = phi * dphi / jnp.where(denominator > 0, denominator, 1)
  longer = (denominator > 0) & (jnp.abs(schroeder_step) > jnp.abs(newton_step))
  step = jnp.where(longer, schroeder_step, newton_step)
  newton = lam - step
  scale = step_scale(lam)
  small_step = jnp.abs(step) <= step_tol * scale
  accept = (dphi < 0) & small_step & (jnp.abs(phi) <= phi_tol * residual_scale(lam))
  use_newton = accept | ((dphi < 0) & (newton > lo) & (newton < hi) & ~small_step
                         & (jnp.abs(step) <= 0.5 * jnp.abs(prev_step)))
  middle = 0.5 * (lo + hi)
  if geometric:
    wide = (lo > 0) & (hi > 4 * lo)
    middle = jnp.where(wide, jnp.sqrt(jnp.where(wide, lo * hi, 1)), middle)
  candidate = jnp.where(use_newton, newton, middle)
  converged = (phi == 0) | (hi - lo <= step_tol * scale) | accept
  new_lam = jnp.where(phi == 0, lam, candidate)
  prev_step = jnp.where(done, prev_step, new_lam - lam)
  lam = jnp.where(done, lam, new_lam)
  iter_num = iter_num + jnp.where(done, 0, 1)
  return lam, lo, hi, prev_step, done | converged, iter_num


def _newton_step(regularizer, tols, x, k, l, carry):
  """The mask's iteration: phi(lam) = sum_i mask((x_i - lam)/l) - k."""
  return safeguarded_newton_step(
      lambda lam: _phi_and_derivatives(regularizer, lam, x, k, l), carry, tols=tols,
      step_scale=lambda lam: jnp.abs(lam) + l, residual_scale=lambda lam: k + 1)


def _init_carry(regularizer, init, x, k, l):
  """The loop carry, and the rows whose answer is known without iterating."""
  lo, hi, known, known_value = bracket(regularizer, x, k, l)
  start = _initial_guess(regularizer, x, k, l, lo, hi) if init is None else jnp.clip(init, lo, hi)
  lam = jnp.where(known, known_value, start)
  iter_num = jnp.zeros(lam.shape, jnp.int32)
  return (lam, lo, hi, 2 * (hi - lo), known, iter_num), known


def _snap_to_binary(regularizer, lam, x, k, l, known):
  r"""Moves ``lam`` to the middle of the flat root interval when the solution is binary.

  With integer ``k`` and a gap wider than the saturation interval between the k-th and
  (k+1)-th largest entries, :math:`\phi` is zero on a whole interval
  :math:`[A, B]`, :math:`A = \max_{i \notin S} x_i - l z_0`,
  :math:`B = \min_{i \in S} x_i - l z_1` (``S`` the top-k set), and the solution is
  the exact 0/1 mask. An iteration that stops where ``phi`` rounds to 0 can land a few
  ulps outside ``[A, B]``, leaving values like 1e-47 for an exact 0. One extra pass
  certifies the binary solution (``|S| = k`` and ``A <= B``, which by uniqueness of the
  solution means it *is* the solution) and returns ``(A + B) / 2``; other rows keep
  ``lam``. Regularizers with an infinite saturation interval never give binary
  solutions and are returned unchanged.
  """
  z0, z1 = regularizer.saturation
  if not (np.isfinite(z0) and np.isfinite(z1)):
    return lam
  top = x - lam[..., None] > 0.5 * (z0 + z1) * l[..., None]
  count = jnp.sum(top, axis=-1).astype(x.dtype)
  a = jnp.max(jnp.where(top, -jnp.inf, x), axis=-1) - l * z0
  b = jnp.min(jnp.where(top, x, jnp.inf), axis=-1) - l * z1
  binary = (count == k) & (a <= b) & jnp.isfinite(a) & jnp.isfinite(b) & ~known
  return jnp.where(binary, 0.5 * (a + b), lam)


@dataclasses.dataclass(frozen=True)
class ThresholdSolver(CappedSimplexSolver):
  """Sort-free safeguarded Newton in ``lax.while_loop`` (pure JAX, any backend).

  Attributes:
    maxiter: cap on passes over the data (bisection alone needs < 64 in float64 on
      any finite bracket; Newton usually stops after 5-20).
  """

  maxiter: int = 100

  def _solve(self, init, x, k, l):
    tols = tolerances(x.dtype)
    carry, known = _init_carry(self.regularizer, init, x, k, l)

    def cond(carry):
      *_, done, iter_num = carry
      return jnp.any(~done & (iter_num < self.maxiter))

    def body(carry):
      return _newton_step(self.regularizer, tols, x, k, l, carry)

    lam, *_, iter_num = jax.lax.while_loop(cond, body, carry)
    return _snap_to_binary(self.regularizer, lam, x, k, l, known), iter_num

  def _solve_unrolled(self, init, x, k, l):
    """``maxiter`` iterations in ``lax.fori_loop``: differentiable by autodiff."""
    tols = tolerances(x.dtype)
    carry, known = _init_carry(self.regularizer, init, x, k, l)
    carry = jax.lax.fori_loop(
        0, self.maxiter, lambda _, c: _newton_step(self.regularizer, tols, x, k, l, c), carry)
    lam, *_, iter_num = carry
    return _snap_to_binary(self.regularizer, lam, x, k, l, known), iter_num
