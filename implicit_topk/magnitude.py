r"""Sparse, differentiable top-k in magnitude: :func:`soft_topk_mag` and its solvers.

The hard operator keeps the k entries of largest :math:`|x_i|` with their signs,
:math:`\mathrm{topkmag}(x) = \nabla f(x)` with :math:`f(u) = \frac12 \sum_{i \le k}
|u|_{[i]}^2`. Its soft version (the seed reference's, Sander et al. 2023) smooths
:math:`f` with :math:`\Psi(y) = \frac{l}{p}\sum_i |y_i|^p`:

.. math::

    y^\star = \arg\max_{y \in \mathbb{R}^n}\ \langle x, y\rangle
              - \tfrac12 \|y\|_{(k)}^2 - \tfrac{l}{p} \sum_i |y_i|^p,
    \qquad \|y\|_{(k)}^2 = \min_{z \in [0,1]^n,\ \sum_i z_i = k} \sum_i y_i^2 / z_i

(:math:`\frac12\|\cdot\|_{(k)}^2 = f^*`, the squared k-support norm), and returns
:math:`y^\star + \nabla\Psi(y^\star)`, i.e. :math:`\mathrm{sign}(y_i)\,h(|y_i|)` with
:math:`h(y) = y + l y^{p-1}`: that is the reference's output scaling, under which
clearly-kept entries equal :math:`x_i` exactly. With :math:`s = |x|`, the solution is
a threshold map (``proofs/magnitude_threshold.md``):

.. math::

    \mathrm{soft\_topk\_mag}(x)_i = \mathrm{sign}(x_i)\,
        \min\big(s_i,\ t_i + g(t_i / l)\big), \qquad
    t_i = (s_i - \lambda)_+,\quad g(u) = u^{1/(p-1)},

with :math:`\lambda \ge 0` the root of the monotone scalar equation
:math:`\sum_i \min\big(1, g(t_i / l) / \lambda\big) = k` (the mask equation with
threshold :math:`\lambda` and strength :math:`l\lambda^{p-1}`). No :math:`h^{-1}` is
needed. The solvers find :math:`\lambda` per row and differentiate it implicitly
(:mod:`implicit_topk._implicit`) on

.. math::

    F(\lambda; x, k, l) = \sum_i \min\big(\lambda, g(t_i / l)\big) - k\lambda = 0,

whose derivative is one division per row; every other derivative is JAX autodiff of
the output map above.

Solvers: ``"pav"`` (numba PAV on the reference's isotonic dual
:math:`\min_{v_1\ge\dots\ge v_n} \sum_i l\,\omega^*((s_i - v_i)/l) + w_i v_i^2 / 2`,
exact), ``"threshold"`` (pure JAX, sort-free safeguarded Newton on :math:`F`, exact)
and ``"dykstra"`` (``p = 2``: the weighted isotonic regression of
:math:`s / (1 + l w)` with weights :math:`1 + l w` by Dykstra's algorithm; approximate).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from implicit_topk import _validation
from implicit_topk import regularizers
from implicit_topk import solvers as _solvers
from implicit_topk.solvers import pav as _pav
from implicit_topk.solvers import threshold
from implicit_topk.solvers.base import CappedSimplexSolver

_SAMPLE = 256  # sample size for the threshold solver's starting guess
_BISECT_STEPS = 64  # scalar bisection steps for h^{-1} when snapping binary rows


# -- the problem ------------------------------------------------------------------


def _power(u, a):
  """u ** a for u > 0; integer a without log/exp."""
  if isinstance(a, int):
    return u if a == 1 else u**a
  return jnp.power(u, jnp.asarray(a, u.dtype))


def _excess(lam, s):
  """t = (s - lam)_+, with derivative 0 at the kink."""
  return jnp.where(s > lam, s - lam, jnp.zeros_like(s))


def _link(t, l, a):
  """g(t / l) = (t / l)^a for 0 < t < inf, 0 for t = 0, inf for t = inf.

  Where-guarded so that derivatives are finite (0 outside 0 < t < inf).
  """
  inside = (t > 0) & (t < jnp.inf)
  safe = jnp.where(inside, t, jnp.ones_like(t))
  value = _power(safe / l, a)
  return jnp.where(inside, value, jnp.where(t > 0, t, jnp.zeros_like(t)))


def _h(u, l, p):
  """h(u) = u + l u^(p-1) for u >= 0 (h(|y*_i|) is the output of a kept entry)."""
  return u + l * jnp.power(u, jnp.asarray(p - 1.0, u.dtype))


def residual(lam, x, k, l, a):
  r"""F(lam) = sum_i min(lam, g(t_i / l)) - k lam along the last axis (zero at the root).

  Written as ``lam * (#saturated - k) + sum_unsaturated g`` so that it is exactly 0
  on the flat root interval of a binary solution.
  """
  lam_ = lam[..., None]
  G = _link(_excess(lam_, jnp.abs(x)), l[..., None], a)
  sat = G > lam_
  count = jnp.sum(sat, axis=-1).astype(x.dtype)
  return lam * (count - k) + jnp.sum(jnp.where(sat, jnp.zeros_like(G), G), axis=-1)


def output_map(lam, x, l, a):
  """sign(x_i) min(|x_i|, t_i + g(t_i / l)), t_i = (|x_i| - lam)_+; NaN propagates."""
  lam_ = lam[..., None]
  s = jnp.abs(x)
  t = _excess(lam_, s)
  out = jnp.sign(x) * jnp.minimum(s, t + _link(t, l[..., None], a))
  return jnp.where(jnp.isnan(lam_) | jnp.isnan(x), jnp.nan, out)


def _special_rows(s, k, l, a):
  """Rows answered without iterating, and a bracket [lo, hi] of the others' root.

  ``|x_i| = inf`` entries are kept and use up ``k``; with ``k_f = k - #inf``:
  NaN in the row or ``k_f < 0``: NaN; ``k_f = 0``: every finite entry is 0
  (``lam = max_finite + l``); at most ``k_f`` finite nonzero entries: ``lam = 0``
  (output = x). ``hi = max_finite s`` (phi(hi) = -k_f < 0) and
  ``lo = min(m / 2, (m / (2 l))^a) > 0``, ``m`` the smallest nonzero finite ``s``:
  ``h(lo) <= m``, so every nonzero entry is saturated at ``lo`` and phi(lo) = nnz - k_f > 0
  (``lo`` can underflow to 0; the iteration then bisects arithmetically).
  """
  finite = jnp.isfinite(s)
  nonzero = finite & (s > 0)
  m = jnp.min(jnp.where(nonzero, s, jnp.inf), axis=-1)
  m = jnp.where(jnp.isfinite(m), m, 1)
  lo = jnp.minimum(0.5 * m, _power(0.5 * m / l, a))
  s_max = jnp.max(jnp.where(finite, s, 0), axis=-1)
  n_inf = jnp.sum(s == jnp.inf, axis=-1).astype(s.dtype)
  nnz = jnp.sum(finite & (s > 0), axis=-1).astype(s.dtype)
  k_f = k - n_inf
  infeasible = jnp.any(jnp.isnan(s), axis=-1) | (k_f < 0)
  all_zero = k_f == 0
  all_kept = nnz <= k_f
  known = infeasible | all_zero | all_kept
  value = jnp.where(infeasible, jnp.nan, jnp.where(all_zero, s_max + l, 0))
  return known, value.astype(s.dtype), jnp.minimum(lo, 0.5 * s_max), s_max


def _snap_to_binary(lam, s, k, l, p, a, known):
  r"""Moves ``lam`` into the interior of the flat root interval of a binary solution.

  With integer ``k``, the top set ``S`` (here: entries more than half saturated),
  :math:`A = \max_{i \notin S} s_i` and :math:`h(A) < \min_{i \in S} s_i`, every
  :math:`\lambda \in [A, B]`, :math:`h(B) = \min_S s_i`, is a root and the output is
  exactly the hard top-k in magnitude. An iteration can stop a few ulps outside
  (leaving 1e-17 for an exact 0): return :math:`(A + B)/2` instead, with ``B`` from a
  scalar bisection on the increasing ``h``. Other rows keep ``lam``.
  """
  lam_ = lam[..., None]
  top = _link(_excess(lam_, s), l[..., None], a) > 0.5 * lam_
  count = jnp.sum(top, axis=-1).astype(s.dtype)
  A = jnp.max(jnp.where(top, -jnp.inf, s), axis=-1)
  top_min = jnp.min(jnp.where(top, s, jnp.inf), axis=-1)
  ok = jnp.isfinite(A) & jnp.isfinite(top_min) & (A > 0)
  A = jnp.where(ok, A, 1)
  top_min = jnp.where(ok, top_min, 2)
  binary = ok & (count == k) & (_h(A, l, p) < top_min) & ~known

  def bisect(_, bounds):
    lo, hi = bounds
    mid = 0.5 * (lo + hi)
    below = _h(mid, l, p) <= top_min
    return jnp.where(below, mid, lo), jnp.where(below, hi, mid)

  B, _ = jax.lax.fori_loop(0, _BISECT_STEPS, bisect, (A, top_min))
  return jnp.where(binary, 0.5 * (A + B), lam)


# -- solvers ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MagnitudeSolver(CappedSimplexSolver):
  """Base class of the magnitude solvers: the problem's ``optimality_fun`` and ``primal``.

  ``run(init, x, k, l)`` (inherited) returns ``OptStep(lam, RootState)`` with
  implicit derivatives of ``lam``; ``primal(lam, x, l)`` is the output map;
  ``topk_mag`` does both. ``regularizer`` must be a :class:`PNorm`.
  """

  def __post_init__(self):
    super().__post_init__()
    if not isinstance(self.regularizer, regularizers.PNorm):
      raise TypeError(f"soft_topk_mag supports the p-norm regularizer only; got {self.regularizer!r}.")

  @property
  def p(self) -> float:
    return self.regularizer.p

  @property
  def a(self):
    return self.regularizer.exponent

  def primal(self, lam, x, l):
    """The soft top-k in magnitude for thresholds ``lam`` (one per row)."""
    return output_map(lam, x, jnp.broadcast_to(jnp.asarray(l, x.dtype), x.shape[:-1]), self.a)

  def optimality_fun(self, lam, x, k, l):
    """F(lam) = sum_i min(lam, g((|x_i| - lam)_+ / l)) - k lam, one entry per row."""
    return residual(lam, x, k, l, self.a)

  def topk_mag(self, x, k, l, init_params=None):
    """The soft top-k in magnitude along the last axis."""
    x = jnp.asarray(x)
    return self.primal(self.run(init_params, x, k, l).params, x, l)

  def mask(self, x, k, l, init_params=None):
    raise TypeError(f"{type(self).__name__} solves the top-k in magnitude: use `topk_mag`.")


def _initial_guess(s, k, lo, hi):
  """(k+1)-th largest of a strided subsample of |x|, if strictly inside (lo, hi)."""
  n = s.shape[-1]
  sample = s[..., ::max(1, n // _SAMPLE)]
  m = sample.shape[-1]
  sample = jnp.sort(jnp.where(jnp.isnan(sample), 0, sample), axis=-1)
  rank = jnp.clip(jnp.floor(k * (m / n)).astype(jnp.int32), 0, m - 1)
  guess = jnp.take_along_axis(sample, (m - 1 - rank)[..., None], axis=-1)[..., 0]
  return jnp.where((guess > lo) & (guess < hi), guess, 0.5 * (lo + hi))


def _newton_step(a, tols, x, k, l, carry):
  """One step of the shared safeguarded Newton iteration (threshold.py) on F.

  The sign of F is the sign of sum_i min(1, g(t_i/l)/lam) - k (nonincreasing) for
  lam > 0, which brackets the root; tolerances are relative to lam, and wide brackets
  are bisected geometrically (roots can sit many decades below max|x|).
  """
  ones = jnp.ones(x.shape[:-1], x.dtype)
  fun = lambda u: residual(u, x, k, l, a)

  def derivatives(lam):
    (F, dF), (_, d2F) = jax.jvp(lambda u: jax.jvp(fun, (u,), (ones,)), (lam,), (ones,))
    return F, dF, d2F

  return threshold.safeguarded_newton_step(
      derivatives, carry, tols=tols, step_scale=lambda lam: lam,
      residual_scale=lambda lam: (k + 1) * lam, geometric=True)


@dataclasses.dataclass(frozen=True)
class MagnitudeThresholdSolver(MagnitudeSolver):
  """Sort-free safeguarded Newton on F in ``lax.while_loop`` (pure JAX, any backend).

  O(n) memory and O(n) work per pass (``F`` and its two derivatives in one fused pass);
  typically 5-20 passes. For ``p = 2`` F is piecewise linear and Newton lands on the
  root of the current piece.

  Attributes:
    maxiter: cap on passes over the data.
  """

  maxiter: int = 100

  def _solve(self, init, x, k, l):
    s = jnp.abs(x)
    known, known_value, lo, hi = _special_rows(s, k, l, self.a)
    start = _initial_guess(s, k, lo, hi) if init is None else init
    start = jnp.where((start > lo) & (start < hi), start, 0.5 * (lo + hi))
    tols = threshold.tolerances(x.dtype)
    carry = (start, lo, hi, 2 * (hi - lo), known, jnp.zeros(start.shape, jnp.int32))

    def cond(carry):
      *_, done, iter_num = carry
      return jnp.any(~done & (iter_num < self.maxiter))

    lam, *_, iter_num = jax.lax.while_loop(
        cond, lambda c: _newton_step(self.a, tols, s, k, l, c), carry)
    lam = _snap_to_binary(lam, s, k, l, self.p, self.a, known)
    return jnp.where(known, known_value, lam), iter_num


def _host_threshold(p, kernels, x, k, l):
  batch_shape, n = x.shape[:-1], x.shape[-1]
  k = np.broadcast_to(np.asarray(k, np.float64), batch_shape).reshape(-1)
  l = np.broadcast_to(np.asarray(l, np.float64), batch_shape).reshape(-1)
  lam = kernels.magnitude_threshold(
      x.reshape(-1, n), np.ascontiguousarray(k), np.ascontiguousarray(l), p)
  return np.asarray(lam, dtype=x.dtype).reshape(batch_shape)


@dataclasses.dataclass(frozen=True)
class MagnitudePAVSolver(MagnitudeSolver):
  """Exact thresholds by numba PAV on the magnitude dual (host callback).

  One numpy sort of |x| per row, then O(n) for ``p = 2`` and ``p = 4/3``.
  """

  def _solve(self, init, x, k, l):
    del init  # PAV is a direct method.
    return _pav.host_root(functools.partial(_host_threshold, float(self.p)), x, k, l)


@dataclasses.dataclass(frozen=True)
class MagnitudeDykstraSolver(MagnitudeSolver):
  r"""``p = 2`` by Dykstra's algorithm on the weighted isotonic regression (pure JAX).

  With :math:`s` = |x| sorted descending and :math:`w = (1,\dots,1,k-\lfloor
  k\rfloor,0,\dots)`, the dual is
  :math:`\min_{v \downarrow} \sum_i (1 + l w_i)(v_i - s_i / (1 + l w_i))^2`; the
  threshold is its value at index :math:`\lfloor k\rfloor` (0-based). Approximate: it
  stops once a sweep changes the dual by at most ``tol``, or after ``maxiter``.

  Attributes:
    tol: tolerance on the change of the dual between sweeps.
    maxiter: maximum number of sweeps.
  """

  tol: float = 1e-6
  maxiter: int = 1000

  def __post_init__(self):
    super().__post_init__()
    if self.a != 1:
      raise ValueError(f"solver='dykstra' supports p=2 only; got p={self.p}. "
                       "Use solver='pav' or 'threshold' for other p.")
    if not (isinstance(self.maxiter, int) and self.maxiter >= 1):
      raise ValueError(f"`maxiter` must be an int >= 1; got {self.maxiter!r}.")
    if not (np.isfinite(self.tol) and self.tol >= 0):
      raise ValueError(f"`tol` must be finite and >= 0; got {self.tol!r}.")

  def _solve(self, init, x, k, l):
    from implicit_topk.solvers.dykstra import isotonic_dykstra
    del init
    s = jnp.abs(x)
    known, known_value, _, s_max = _special_rows(s, k, l, self.a)
    # inf -> a magnitude that is kept whenever the row has a threshold; NaN rows are known.
    big = ((s_max + 1) * (2 + l))[..., None]
    surrogate = jnp.where(s == jnp.inf, big, jnp.where(jnp.isnan(s), 0, s))
    sorted_s = -jnp.sort(-surrogate, axis=-1)
    n = x.shape[-1]
    w = jnp.clip(k[..., None] - jnp.arange(n, dtype=x.dtype), 0, 1)
    rho = 1 + l[..., None] * w
    result = isotonic_dykstra(sorted_s / rho, rho, tol=self.tol, max_iter=self.maxiter)
    index = jnp.clip(jnp.floor(k).astype(jnp.int32), 0, n - 1)
    lam = jnp.take_along_axis(result.v, index[..., None], axis=-1)[..., 0]
    lam = _snap_to_binary(lam, s, k, l, self.p, self.a, known)
    return jnp.where(known, known_value, lam), result.iter_num


SOLVERS = {"pav": MagnitudePAVSolver, "threshold": MagnitudeThresholdSolver,
           "dykstra": MagnitudeDykstraSolver}
_OPTIONS = {"threshold": ("maxiter",), "dykstra": ("tol", "maxiter")}


def make_solver(name: str, p, *, implicit_diff_backend: str = "lax", tol=None, maxiter=None):
  """Builds the magnitude solver ``name`` ("auto", "pav", "threshold" or "dykstra").

  "auto" follows :func:`implicit_topk.solvers.auto_solver_name` (numba PAV on CPU for
  p = 2 and p = 4/3, the threshold Newton otherwise).
  """
  _validation.check_choice(name, "solver", ("auto", *SOLVERS))
  regularizer = regularizers.PNorm(p)
  if name == "auto":
    name = _solvers.auto_solver_name(regularizer)
  options = {"tol": tol, "maxiter": maxiter}
  for option, value in options.items():
    if value is not None and option not in _OPTIONS.get(name, ()):
      raise ValueError(f"`{option}` does not apply to solver={name!r} (solvers that take it: "
                       f"{[s for s, o in _OPTIONS.items() if option in o]}).")
  kwargs = {key: value for key, value in options.items() if value is not None}
  return SOLVERS[name](regularizer=regularizer, implicit_diff_backend=implicit_diff_backend,
                       **kwargs)


def soft_topk_mag(
    x,
    k,
    *,
    l=0.1,
    p: float = 4.0 / 3.0,
    axis: int = -1,
    solver: str = "auto",
    tol: float | None = None,
    maxiter: int | None = None,
    implicit_diff_backend: str = "lax",
    return_info: bool = False,
):
  r"""Sparse, differentiable top-k in magnitude along ``axis``.

  .. math::

      y^\star = \arg\max_{y}\ \langle x, y\rangle - \tfrac12\|y\|_{(k)}^2
                - \tfrac{l}{p}\sum_i |y_i|^p, \qquad
      \mathrm{out}_i = y^\star_i + l\,\mathrm{sign}(y^\star_i)|y^\star_i|^{p-1}
      = \mathrm{sign}(x_i)\min\big(|x_i|,\ t_i + (t_i / l)^{1/(p-1)}\big)

  where :math:`\|y\|_{(k)}^2 = \min_{z\in[0,1]^n, \sum z = k}\sum_i y_i^2/z_i` (the
  squared k-support norm), :math:`t_i = (|x_i| - \lambda)_+` and the threshold
  :math:`\lambda \ge 0` solves :math:`\sum_i \min(\lambda, (t_i/l)^{1/(p-1)}) = k\lambda`
  (``proofs/magnitude_threshold.md``). This is the seed reference's
  ``sparse_soft_topk_mag_*`` (its isotonic dual, its output scaling), for real ``k``.
  Entries with :math:`|x_i| \le \lambda` are exactly 0, clearly-kept entries equal
  :math:`x_i` exactly; the output is odd in ``x``, :math:`|\mathrm{out}_i| \le |x_i|`,
  and tends to :func:`hard_topk_mag` as ``l -> 0``. Rows with at most ``k`` nonzero
  entries are returned unchanged.

  Derivatives w.r.t. ``x``, ``k`` and ``l``: implicit function theorem on the scalar
  equation above (one division per row), JAX autodiff of the output map for the rest;
  forward and reverse mode with ``implicit_diff_backend="lax"``. Where the solution is
  binary (integer ``k``, the k-th largest magnitude clearly above the (k+1)-th), the
  output is locally ``x`` on the kept set and 0 elsewhere, and the derivative w.r.t.
  ``k`` is returned as 0.

  Args:
    x: float array (float16/bfloat16 are computed in float32 and cast back).
    k: real number or array broadcastable to the batch shape, 0 < k < n.
    l: regularization strength > 0, scalar or broadcastable to the batch shape.
    p: p-norm exponent, a static float > 1 (4/3: continuously differentiable).
    axis: the axis along which to select.
    solver: ``"auto"``, ``"pav"`` (numba, host callback, exact), ``"threshold"``
      (pure JAX, sort-free Newton, exact) or ``"dykstra"`` (pure JAX, ``p = 2``,
      approximate: stops at ``tol``).
    tol: Dykstra's tolerance on the change of its dual between sweeps (default 1e-6).
    maxiter: iteration cap of ``"threshold"`` (100) or ``"dykstra"`` (1000 sweeps).
    implicit_diff_backend: ``"lax"`` or ``"jaxopt"`` (reverse mode only).
    return_info: also return the solver's ``RootState`` (``iter_num``; ``residual``
      :math:`|F(\lambda)|`), one entry per row.

  Returns:
    An array with the shape and dtype of ``x`` (and the ``RootState`` with
    ``return_info``). A row containing NaN gives NaN; ``|x_i| = inf`` entries are kept
    (a row with more than ``k`` of them gives NaN).

  Example:
    >>> import jax.numpy as jnp
    >>> soft_topk_mag(jnp.array([-5., -2., 3., 1.]), k=2, l=1e-2)
    Array([-5., -0.,  3.,  0.], dtype=float32)
  """
  x = _validation.as_float_input(x)
  axis = _validation.canonicalize_axis(axis, x.ndim)
  _validation.check_k(k, x.shape[axis])
  _validation.check_positive(l, "l")
  solver_obj = make_solver(solver, p, implicit_diff_backend=implicit_diff_backend,
                           tol=tol, maxiter=maxiter)
  dtype = _validation.compute_dtype(x.dtype)
  moved = jnp.moveaxis(x, axis, -1).astype(dtype)
  batch_shape = moved.shape[:-1]
  k = jnp.broadcast_to(jnp.asarray(k, dtype), batch_shape)
  l = jnp.broadcast_to(jnp.asarray(l, dtype), batch_shape)
  step = solver_obj.run(None, moved, k, l)
  out = jnp.moveaxis(solver_obj.primal(step.params, moved, l), -1, axis).astype(x.dtype)
  return (out, step.state) if return_info else out
