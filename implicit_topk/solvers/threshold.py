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
  ``phi`` says; ``step`` is Newton's step, or Schroeder's where it is longer, refined to
  the root of the polynomial phi is on at the current piece where ``derivatives`` also
  gives phi''' (:func:`piece_refined_step`); ``newton = lam - step``; ``accept`` marks a
  step below ``step_tol * scale`` with ``abs(phi)`` at rounding level (shared by
  :func:`safeguarded_newton_step` and the GPU kernel's bounded iteration)."""
  step_tol, phi_tol = tols
  phi, dphi, d2phi, *d3phi = derivatives(lam)
  lo = jnp.where(phi > 0, lam, lo)
  hi = jnp.where(phi < 0, lam, hi)
  newton_step = phi / jnp.where(dphi < 0, dphi, -1)
  denominator = dphi * dphi - phi * d2phi
  schroeder_step = phi * dphi / jnp.where(denominator > 0, denominator, 1)
  longer = (denominator > 0) & (jnp.abs(schroeder_step) > jnp.abs(newton_step))
  step = jnp.where(longer, schroeder_step, newton_step)
  if d3phi:
    step = piece_refined_step(step, phi, dphi, d2phi, d3phi[0])
  newton = lam - step
  scale = step_scale(lam)
  small_step = jnp.abs(step) <= step_tol * scale
  accept = (dphi < 0) & small_step & (jnp.abs(phi) <= phi_tol * residual_scale(lam))
  return phi, dphi, lo, hi, step, newton, scale, small_step, accept


#: Newton steps on the piece's polynomial per pass (no pass over the entries).
PIECE_REFINEMENTS = 3


def piece_refined_step(step, phi, dphi, d2phi, d3phi):
  r"""``step`` (of ``lam -> lam - step``) refined towards the root of the Taylor cubic

  .. math:: c(s) = \phi + \phi' s + \phi'' s^2/2 + \phi''' s^3/6 ,

  which *is* phi on the current piece when phi is a polynomial of degree at most 3
  between kinks (p-norm regularizers with p in {2, 3/2, 4/3}: no entry enters or leaves
  the fractional range). :data:`PIECE_REFINEMENTS` Newton steps on ``c`` from
  ``s = -step``, each kept only where ``c'(s) < 0`` (phi is nonincreasing); ``step``
  itself where the result is not finite. A root on the current piece is then reached in
  one pass (confirmed by the next), as Newton's is for p = 2. Only the proposal changes:
  the caller's safeguards (inside the bracket, at most half the step before the last,
  else a fallback point) and stopping rules are unchanged."""
  s = -step
  for _ in range(PIECE_REFINEMENTS):
    slope = dphi + s * (d2phi + 0.5 * s * d3phi)
    value = phi + s * (dphi + s * (0.5 * d2phi + s * d3phi / 6))
    s = jnp.where(slope < 0, s - value / jnp.where(slope < 0, slope, -1), s)
  return jnp.where(jnp.isfinite(s), -s, step)


def safeguarded_newton_step(derivatives, carry, *, tols, step_scale, residual_scale,
                            geometric=False, free_passes=None):
  """One safeguarded (Schroeder-)Newton iteration on a nonincreasing scalar function.

  ``derivatives(lam) -> (phi, phi', phi''[, phi'''])`` per row;
  ``carry = (lam, lo, hi, (last_step, step_before, phi_lo, phi_hi), done, iter_num)``
  (``phi_lo``, ``phi_hi``: phi at the bracket's ends, NaN where not evaluated); rows
  already done stay put.

  The sign of ``phi`` shrinks the bracket. A Newton step is taken only if it lands
  strictly inside the bracket and is at most half the step before the last one (as in
  Numerical Recipes' rtsafe; this rules out cycles and slow creeping, and lets Newton
  resume right after a fallback step). Otherwise, on odd passes, the false-position
  point of the bracket's ends (the secant through ``(lo, phi_lo)`` and
  ``(hi, phi_hi)``) where both are known and it lies strictly inside: one step to a
  root next to a kink, where a curved piece makes Newton overshoot the bracket (a
  saturating top entry), or, where Newton lands just beyond an end, the point half the
  stopping width inside that end; on even passes, or without it, we bisect (when ``geometric``,
  a bracket spanning more than two binades halves its ordered bit patterns instead,
  :func:`_ordered_middle`: roots many decades below the bracket's far end, or near 0
  in a bracket from -1e300). So the bracket at least halves every other rejected pass.
  Schroeder's step (Newton on phi / phi') replaces Newton's
  where it is longer: near the degenerate roots phi ~ c (lam - a)^m at which a flat
  piece of phi starts (p < 2), Newton converges only linearly and Schroeder's step lands
  on a. A step below ``step_tol * step_scale(lam)`` counts as convergence only if
  ``abs(phi) <= phi_tol * residual_scale(lam)`` too (a huge slope, e.g. p > 2 near a
  coordinate leaving 0, could otherwise stall Newton); a collapsed bracket or
  ``phi == 0`` also stop.

  ``free_passes`` (an int; the GPU kernel's bounded iteration,
  :mod:`implicit_topk.kernels.gpu.bounded_newton`): from that pass on, every other pass
  takes the ordered midpoint of the bracket whatever Newton proposes, and a bracket
  with no float strictly inside also stops (R4 of Proposition 17).
  """
  step_tol = tols[0]
  lam, lo, hi, (last_step, step_before, phi_lo, phi_hi), done, iter_num = carry
  phi, dphi, lo, hi, step, newton, scale, small_step, accept = newton_proposal(
      derivatives, lam, lo, hi, tols, step_scale, residual_scale)
  phi_lo = jnp.where(phi > 0, phi, phi_lo)
  phi_hi = jnp.where(phi < 0, phi, phi_hi)
  newton_inside = ((dphi < 0) & (newton > lo) & (newton < hi) & ~small_step
                   & (jnp.abs(step) <= 0.5 * jnp.abs(step_before)))
  even = iter_num % 2 == 0
  middle = midpoint(lo, hi)
  if geometric:
    middle = jnp.where(even, _ordered_middle(lo, hi, middle), middle)
  # (both ends known: phi_lo > 0 > phi_hi; the masked division keeps autodiff of an
  # unrolled iteration free of NaN from the unknown ends)
  ends_known = (phi_lo > 0) & (phi_hi < 0)
  fraction = jnp.where(ends_known, phi_lo, 0) / jnp.where(ends_known, phi_lo - phi_hi, 1)
  secant = lo + (hi - lo) * fraction
  middle = jnp.where(~even & ends_known & (secant > lo) & (secant < hi), secant, middle)
  # Newton just beyond an end (by less than its own step): the root sits within rounding
  # of that end, at a kink (a top entry saturating there). Half the stopping width
  # inside the end: a sign change there stops the row by the bracket rule.
  nudge = 0.5 * step_tol * scale
  near_lo = (dphi < 0) & (newton <= lo) & (lo - newton < lam - lo) & (lo + nudge < hi)
  near_hi = (dphi < 0) & (newton >= hi) & (newton - hi < hi - lam) & (hi - nudge > lo)
  middle = jnp.where(~even & near_lo, lo + nudge, middle)
  middle = jnp.where(~even & near_hi, hi - nudge, middle)
  converged = (phi == 0) | (hi - lo <= step_tol * scale) | accept
  if free_passes is not None:
    ordered = ordered_midpoint(lo, hi)
    forced = (iter_num >= free_passes) & ((iter_num - free_passes) % 2 == 0)
    newton_inside = newton_inside & ~forced
    middle = jnp.where(forced, ordered, middle)
    converged = converged | (ordered == lo) | (ordered == hi)  # R4: no float inside
  candidate = jnp.where(accept | newton_inside, newton, middle)
  new_lam = jnp.where(phi == 0, lam, candidate)
  memory = (jnp.where(done, last_step, new_lam - lam), jnp.where(done, step_before, last_step),
            phi_lo, phi_hi)
  lam = jnp.where(done, lam, new_lam)
  iter_num = iter_num + jnp.where(done, 0, 1)
  return lam, lo, hi, memory, done | converged, iter_num


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
  """lam -> (phi, phi', phi'') per row, by nested ``jax.jvp`` (one fused pass), and
  phi''' too where phi is a polynomial of degree 2 or 3 between kinks
  (``problem.piece_degree``; :func:`piece_refined_step` then uses it)."""
  fun = lambda lam: problem.optimality(lam, x, k, l)
  third = getattr(problem, "piece_degree", None) in (2, 3)

  def derivatives(lam):
    ones = jnp.ones_like(lam)
    first = lambda u: jax.jvp(fun, (u,), (ones,))
    if not third:
      (phi, dphi), (_, d2phi) = jax.jvp(first, (lam,), (ones,))
      return phi, dphi, d2phi
    second = lambda u: jax.jvp(first, (u,), (ones,))
    ((phi, dphi), (_, d2phi)), (_, (_, d3phi)) = jax.jvp(second, (lam,), (ones,))
    return phi, dphi, d2phi, d3phi

  return derivatives


def newton_iteration(problem, x, k, l, **options):
  """``carry -> carry``: one :func:`safeguarded_newton_step` on the rows of ``x``, with
  the problem's derivatives and scales. Everything that does not change from pass to
  pass (the step floor: :meth:`step_floor` where the problem has one) is computed here,
  once, outside the loop that calls the returned function."""
  tols = tolerances(problem.layout.dtype(x) if hasattr(problem, "layout") else x.dtype)
  floor = problem.step_floor(x) if hasattr(problem, "step_floor") else None
  step_scale = lambda lam: problem.step_scale(lam, l)
  if floor is not None:
    # the floor no higher than the scale of the entries that can be fractional, where the
    # problem bounds it (:meth:`step_ceiling`)
    ceiling = getattr(problem, "step_ceiling", lambda lam, l: None)
    step_scale = lambda lam: jnp.maximum(problem.step_scale(lam, l), floor if ceiling(
        lam, l) is None else jnp.minimum(floor, ceiling(lam, l)))
  derivatives = _derivatives(problem, x, k, l)
  return lambda carry: safeguarded_newton_step(
      derivatives, carry, tols=tols, step_scale=step_scale,
      residual_scale=lambda lam: problem.residual_scale(lam, k),
      geometric=problem.geometric, **options)


def initial_memory(last_step):
  """The iteration's memory before its first pass: ``(last_step, step_before, phi_lo,
  phi_hi)`` with both steps ``last_step`` (a bound on the first Newton step) and phi at
  the bracket's ends unknown (NaN)."""
  unknown = jnp.full_like(last_step, jnp.nan)
  return (last_step, last_step, unknown, unknown)


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
  memory = initial_memory(2 * (bracket.hi - bracket.lo))
  return (lam, bracket.lo, bracket.hi, memory, bracket.known, iter_num), bracket


def _finish(problem, lam, x, k, l, bracket):
  lam = problem.snap(lam, x, k, l, bracket.known)
  return jnp.where(bracket.known, bracket.value, lam)


@dataclasses.dataclass(frozen=True)
class ThresholdSolver(ThresholdRootSolver):
  r"""Sort-free threshold solver: safeguarded Newton in ``lax.while_loop`` (pure JAX).

  The operators' pure-JAX solver (``solver="threshold"``; ``"auto"`` on every backend
  but CPU, where it runs the compiled kernel of :class:`NativeSolver`, and CUDA, where it
  runs the fused GPU kernel). For the
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
    carry, bracket = _init_carry(self.problem, init, x, k, l)

    def cond(carry):
      *_, done, iter_num = carry
      return jnp.any(~done & (iter_num < self.maxiter))

    lam, *_, iter_num = jax.lax.while_loop(cond, newton_iteration(self.problem, x, k, l), carry)
    return _finish(self.problem, lam, x, k, l, bracket), iter_num

  def solve_and_map(self, x, k, l):
    """The output on exactly rescaled rows, with binary rows that the shift by the row
    maximum hides decided exactly (:func:`implicit_topk.solvers.float_range.solve_and_map`:
    rows near the float maximum or minimum)."""
    from implicit_topk.solvers import float_range  # pylint: disable=g-import-not-at-top
    return float_range.solve_and_map(self, x, k, l)

  def _solve_unrolled(self, init, x, k, l):
    """``maxiter`` iterations in ``lax.fori_loop``: differentiable by autodiff."""
    carry, bracket = _init_carry(self.problem, init, x, k, l)
    step = newton_iteration(self.problem, x, k, l)
    carry = jax.lax.fori_loop(0, self.maxiter, lambda _, c: step(c), carry)
    lam, *_, iter_num = carry
    return _finish(self.problem, lam, x, k, l, bracket), iter_num
