r"""Pure-JAX threshold solver: safeguarded Newton on :math:`\phi(\lambda)`, no sort.

For any problem of :mod:`implicit_topk.problems`, :math:`\phi` is continuous and
nonincreasing in :math:`\lambda`, and the problem gives a bracket ``[lo, hi]`` of the
root and a sort-free starting guess. Each iteration makes one fused pass over the row
(:math:`\phi`, :math:`\phi'` and :math:`\phi''` together, the derivatives by
``jax.jvp`` of the problem's optimality function), shrinks the bracket by the sign of
:math:`\phi`, and takes the Newton step if it stays strictly inside the bracket,
otherwise bisects. It stops when ``phi == 0``, when a step is below a few ulps of
``lam``, or when the bracket has collapsed; so the result is exact to floating-point
precision. For the mask with ``p = 2`` the Newton step is the exact root of the current
linear piece, so the iteration terminates once the partition {0, (0,1), 1} stops
changing (``proofs/newton_finite_termination_p2.md``). Typical counts: 3-20 passes.

Cost: O(n) memory, O(n) time per pass, no sort (a test checks the jaxpr), no n x n
intermediate; each pass is a per-row sum, so an input sharded along the row costs one
all-reduce of a few scalars per pass.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from implicit_topk import _validation
from implicit_topk.problems.base import midpoint
from implicit_topk.solvers.base import ThresholdRootSolver


def tolerances(dtype) -> tuple[float, float]:
  """(step tolerance, residual tolerance) for a dtype: 4 eps and sqrt(eps)."""
  eps = float(np.finfo(np.dtype(dtype)).eps)
  return 4 * eps, float(np.sqrt(eps))


def newton_proposal(derivatives, lam, lo, hi, tols, step_scale, residual_scale):
  """The safeguarded iteration's proposal at ``lam``: ``(phi, phi', lo, hi, step, newton,
  scale, small_step, accept)``. The bracket ``[lo, hi]`` shrinks to ``lam`` on the side
  ``phi`` says; ``step`` is Newton's step, or Schroeder's where it is longer; ``newton =
  lam - step``; ``accept`` marks a step below ``step_tol * scale`` with ``abs(phi)`` at
  rounding level (shared by :func:`safeguarded_newton_step` and the GPU kernel's
  bounded iteration)."""
  step_tol, phi_tol = tols
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
  return phi, dphi, lo, hi, step, newton, scale, small_step, accept


def safeguarded_newton_step(derivatives, carry, *, tols, step_scale, residual_scale,
                            geometric=False):
  """One safeguarded (Schroeder-)Newton iteration on a nonincreasing scalar function.

  ``derivatives(lam) -> (phi, phi', phi'')`` per row;
  ``carry = (lam, lo, hi, prev_step, done, iter_num)``; rows already done stay put.

  The sign of ``phi`` shrinks the bracket. A Newton step is taken only if it lands
  strictly inside the bracket and is at most half the previous step (as in Numerical
  Recipes' rtsafe; this rules out cycles and slow creeping), otherwise we bisect
  (when ``geometric``, every other bisection of a bracket spanning more than two
  binades halves its ordered bit patterns instead, :func:`_ordered_middle`: roots many
  decades below the bracket's far end, or near 0 in a bracket from -1e300).
  Schroeder's step (Newton on phi / phi') replaces Newton's
  where it is longer: near the degenerate roots phi ~ c (lam - a)^m at which a flat
  piece of phi starts (p < 2), Newton converges only linearly and Schroeder's step lands
  on a. A step below ``step_tol * step_scale(lam)`` counts as convergence only if
  ``abs(phi) <= phi_tol * residual_scale(lam)`` too (a huge slope, e.g. p > 2 near a
  coordinate leaving 0, could otherwise stall Newton); a collapsed bracket or
  ``phi == 0`` also stop.
  """
  step_tol = tols[0]
  lam, lo, hi, prev_step, done, iter_num = carry
  phi, dphi, lo, hi, step, newton, scale, small_step, accept = newton_proposal(
      derivatives, lam, lo, hi, tols, step_scale, residual_scale)
  use_newton = accept | ((dphi < 0) & (newton > lo) & (newton < hi) & ~small_step
                         & (jnp.abs(step) <= 0.5 * jnp.abs(prev_step)))
  middle = midpoint(lo, hi)
  if geometric:
    middle = jnp.where(iter_num % 2 == 0, _ordered_middle(lo, hi, middle), middle)
  candidate = jnp.where(use_newton, newton, middle)
  converged = (phi == 0) | (hi - lo <= step_tol * scale) | accept
  new_lam = jnp.where(phi == 0, lam, candidate)
  prev_step = jnp.where(done, prev_step, new_lam - lam)
  lam = jnp.where(done, lam, new_lam)
  iter_num = iter_num + jnp.where(done, 0, 1)
  return lam, lo, hi, prev_step, done | converged, iter_num


def _ordered_middle(lo, hi, middle):
  """The middle of the bracket's ordered bit patterns where it spans more than two
  binades (``max(|lo|, |hi|) > 4 min(|lo|, |hi|)``, either sign), else ``middle``.

  Finite floats, ordered as the integers ``sign * (bits without the sign)``, are
  bisected in at most 64 (float32: 32) halvings of that integer range, whatever the
  bracket: geometric across binades (a root many decades closer to 0 than the far end,
  the top entry of a row whose other entries lie 1e300 below it), arithmetic within one.
  Alternating with plain midpoints, a bracket is within two binades after at most
  ~2 x 11 (float32: 2 x 8) bisections, from any finite ends.
  """
  near = jnp.minimum(jnp.abs(lo), jnp.abs(hi))
  far = jnp.maximum(jnp.abs(lo), jnp.abs(hi))
  wide = (far > 4 * near) & jnp.isfinite(far)
  return jnp.where(wide, ordered_midpoint(lo, hi), middle)


def ordered_midpoint(a, b):
  """The float whose ordered bit pattern is the floor-average of those of ``a``, ``b``
  (finite floats; -0 and +0 both map to 0). Monotone: it lies in ``[a, b]``."""
  dtype = jnp.result_type(a)
  itype = {2: jnp.int16, 4: jnp.int32, 8: jnp.int64}[jnp.dtype(dtype).itemsize]
  top = jnp.iinfo(itype).max

  def to_ordered(v):
    bits = jax.lax.bitcast_convert_type(v, itype)
    return jnp.where(bits < 0, -(bits & top), bits)

  u, v = to_ordered(a), to_ordered(b)
  mid = (u >> 1) + (v >> 1) + (u & v & 1)  # floor((u + v) / 2) without overflow
  bits = jnp.where(mid < 0, (-mid) | jnp.asarray(jnp.iinfo(itype).min, itype), mid)
  return jax.lax.bitcast_convert_type(bits.astype(itype), dtype)


def _derivatives(problem, x, k, l):
  """lam -> (phi, phi', phi'') per row, by nested ``jax.jvp`` (one fused pass)."""
  fun = lambda lam: problem.optimality(lam, x, k, l)

  def derivatives(lam):
    ones = jnp.ones_like(lam)
    (phi, dphi), (_, d2phi) = jax.jvp(
        lambda u: jax.jvp(fun, (u,), (ones,)), (lam,), (ones,))
    return phi, dphi, d2phi

  return derivatives


def _newton_step(problem, tols, x, k, l, carry):
  return safeguarded_newton_step(
      _derivatives(problem, x, k, l), carry, tols=tols,
      step_scale=lambda lam: problem.step_scale(lam, l),
      residual_scale=lambda lam: problem.residual_scale(lam, k),
      geometric=problem.geometric)


def _init_carry(problem, init, x, k, l):
  """The loop carry, and the bracket (its ``known`` rows are done from the start)."""
  bracket = problem.bracket(x, k, l)
  # A bracket end that overflowed (x near the float maximum, l large) is clamped to the
  # float range: bisection from an infinite end would never move.
  big = jnp.finfo(bracket.lo.dtype).max
  bracket = bracket._replace(lo=jnp.clip(bracket.lo, -big, big), hi=jnp.clip(bracket.hi, -big, big))
  start = problem.initial_guess(x, k, l, bracket) if init is None else jnp.clip(
      init, bracket.lo, bracket.hi)
  lam = jnp.where(bracket.known, bracket.value, start)
  iter_num = jnp.zeros_like(lam, jnp.int32)  # zeros_like: keeps shard_map's varying axes
  return (lam, bracket.lo, bracket.hi, 2 * (bracket.hi - bracket.lo), bracket.known,
          iter_num), bracket


def _finish(problem, lam, x, k, l, bracket):
  lam = problem.snap(lam, x, k, l, bracket.known)
  return jnp.where(bracket.known, bracket.value, lam)


@dataclasses.dataclass(frozen=True)
class ThresholdSolver(ThresholdRootSolver):
  r"""Sort-free threshold solver: safeguarded Newton in ``lax.while_loop`` (pure JAX).

  The default solver of the operators (``solver="auto"`` or ``"threshold"``). For the
  top-k mask (Sander et al. 2023, "Fast, differentiable and sparse top-k: a convex
  analysis perspective", ICML)

  .. math::

      y^\star = \arg\max_{y \in [0,1]^n,\ \sum_i y_i = k}\
                 \langle x, y\rangle - l\,\Omega(y), \qquad
      y_i = \mathrm{mask}\big((x_i - \lambda) / l\big),

  the threshold :math:`\lambda` is the root of the continuous, nonincreasing
  :math:`\phi(\lambda) = \sum_i y_i(\lambda) - k`. Each iteration makes one fused
  pass over the row (:math:`\phi`, :math:`\phi'` and :math:`\phi''`), shrinks a
  bracket of the root by the sign of :math:`\phi`, and takes the Newton (or
  Schroeder) step when it stays inside the bracket, else bisects; the result is exact
  to floating-point precision, typically after 3 to 20 passes. No sort and no
  :math:`n \times n` intermediate: O(n) memory and time per pass, so it runs on
  every backend, exports with ``jax.export``, and on an input split over devices
  costs one all-reduce of a few scalars per pass. The derivatives come from the
  implicit function theorem (Blondel et al. 2022, "Efficient and modular implicit
  differentiation", NeurIPS), or with ``implicit_diff=False`` from autodiff through
  exactly ``maxiter`` iterations. The interface follows jaxopt: ``run`` returns an
  :class:`OptStep`.

  Attributes:
    maxiter: cap on the passes over the data per row, an int >= 1 (default 100).
      Bisection alone needs fewer than 64 in float64 on any finite bracket; Newton
      usually stops after 3 to 20. With ``implicit_diff=False`` exactly this many
      iterations are run and differentiated through.
    regularizer: the regularizer of the top-k mask (default ``None``:
      ``PNorm(4/3)``); see :class:`ThresholdRootSolver` for this and the other
      inherited fields ``problem``, ``implicit_diff`` (default ``True``) and
      ``implicit_diff_backend`` (default ``"lax"``).

  ``run(init_params, x, k, l)`` returns ``OptStep(params=lam, state=RootState(...))``
  with one threshold per row; ``primal(lam, x, l)`` is the operator's output and
  ``apply(x, k, l)`` does both.

  Example:
    >>> import jax.numpy as jnp
    >>> import implicit_topk as itk
    >>> x = jnp.array([3.0, 1.0, 2.0, -1.0])
    >>> solver = itk.ThresholdSolver(regularizer=itk.PNorm(2.0))
    >>> step = solver.run(None, x, 2.0, 2.0)  # k = 2, regularization strength 2
    >>> step
    OptStep(params=Array(0.5, dtype=float32), state=RootState(iter_num=Array(2, dtype=int32), residual=Array(0., dtype=float32)))
    >>> solver.primal(step.params, x, 2.0)
    Array([1.  , 0.25, 0.75, 0.  ], dtype=float32)
  """

  maxiter: int = 100
  name = "threshold"

  def __post_init__(self):
    super().__post_init__()
    _validation.check_maxiter(self.maxiter)

  def _solve(self, init, x, k, l):
    tols = tolerances(self.layout.dtype(x))
    carry, bracket = _init_carry(self.problem, init, x, k, l)

    def cond(carry):
      *_, done, iter_num = carry
      return jnp.any(~done & (iter_num < self.maxiter))

    def body(carry):
      return _newton_step(self.problem, tols, x, k, l, carry)

    lam, *_, iter_num = jax.lax.while_loop(cond, body, carry)
    return _finish(self.problem, lam, x, k, l, bracket), iter_num

  def solve_and_map(self, x, k, l):
    """The output on exactly rescaled rows, with binary rows that the shift by the row
    maximum hides decided exactly (:func:`implicit_topk.solvers.float_range.solve_and_map`:
    rows near the float maximum or minimum)."""
    from implicit_topk.solvers import float_range  # pylint: disable=g-import-not-at-top
    return float_range.solve_and_map(self, x, k, l)

  def _solve_unrolled(self, init, x, k, l):
    """``maxiter`` iterations in ``lax.fori_loop``: differentiable by autodiff."""
    tols = tolerances(self.layout.dtype(x))
    carry, bracket = _init_carry(self.problem, init, x, k, l)
    carry = jax.lax.fori_loop(
        0, self.maxiter, lambda _, c: _newton_step(self.problem, tols, x, k, l, c), carry)
    lam, *_, iter_num = carry
    return _finish(self.problem, lam, x, k, l, bracket), iter_num
