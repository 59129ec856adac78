r"""The exact threshold of the soft top-k in magnitude, one row at a time (numba, CPU).

For a row :math:`x` with :math:`s = |x|`, target :math:`k`, strength :math:`l` and
:math:`a = 1/(p-1)`, the output of :func:`~implicit_topk.soft_topk_mag` is
:math:`\mathrm{sign}(x_i)\min(s_i, t_i + g(t_i/l))`, :math:`t_i = (s_i - \lambda)_+`,
:math:`g(u) = u^a`, with :math:`\lambda \ge 0` the root of

.. math::

    F(\lambda) = \sum_i \min\big(\lambda, g(t_i / l)\big) - k\lambda,
    \qquad F(\lambda)/\lambda = \sum_i \min\big(1, g(t_i/l)/\lambda\big) - k,

the mask equation with threshold :math:`\lambda` and strength :math:`l\lambda^{p-1}`,
nonincreasing (Sander et al. 2023, "Fast, differentiable and sparse top-k: a convex
analysis perspective", ICML; ``proofs/magnitude_threshold.md``). No sort
(``proofs/native_magnitude_bracket.md``): with :math:`m = \lceil k\rceil`,
:math:`j = \lfloor k\rfloor` (over the finite entries, after the infinite ones took
theirs) and :math:`h(y) = y + l y^{p-1}`,

.. math:: h^{-1}(s_{(m)}) \;\le\; \lambda \;\le\; s_{(j+1)},

so only the entries above :math:`h^{-1}(s_{(m)})` can be nonzero at the root. One
branch-free pass gathers the magnitudes above a cut guessed from the previous row
(checked: at least :math:`m + 1` entries at or above :math:`h` of it; else every finite
nonzero magnitude), a selection finds :math:`s_{(m)}` and :math:`s_{(j+1)}` among them
(:func:`native_threshold._order_statistics`: an insertion buffer for small :math:`m`,
a quickselect otherwise), a scalar Newton gives :math:`h^{-1}`, and the safeguarded
Newton iteration of the mask kernel (:func:`native_threshold._newton`, compiled here
with this problem's :math:`F`) runs on the candidates alone. With
integer :math:`k` and :math:`h(s_{(k+1)}) < s_{(k)}` the solution is the hard top-k in
magnitude and :math:`\lambda` is the middle of the flat root interval
:math:`[s_{(k+1)}, h^{-1}(s_{(k)})]`, as the other solvers' ``snap`` returns it.

The iteration is Newton (or Schroeder) on :math:`F` itself (piecewise linear for
:math:`p = 2`: finite termination, as the pure-JAX solver), its values divided by
:math:`\lambda` so that the mask kernel's stopping rules read in the problem's units:
a step below 4 ulps of :math:`\lambda` with :math:`|F| \le \sqrt{\mathrm{tol}}\,(k+1)
\lambda` (the threshold solver's ``step_scale`` and ``residual_scale``),
:math:`F = 0`, or a collapsed bracket; float64 whatever the input dtype. Rows the
problem's ``bracket`` answers (NaN, more infinite entries than ``k``, ``k`` at the
count of infinite entries, at most ``k`` nonzero entries) get its values. XLA's CPU
runtime flushes subnormal floats to 0, so the iteration stays on normal floats: a root
below the smallest normal float64 is returned as 0 (the output is then ``x`` up to
rounding, as at the exact root).
"""

from __future__ import annotations

import math
import types
from typing import Any

import numpy as np
from numba import carray, njit

from implicit_topk.kernels.cpu import abi, threads
from implicit_topk.kernels.cpu import native_threshold as _nt

_H_STEPS = 100  # cap of the scalar Newton for h^{-1} (it is monotone: a few suffice)
_H_TOL = 2.0**-44  # relative step at which that Newton stops (quadratic: then converged)
_H_SLACK = 2.0**-40  # the relative distance within which h^-1 is known only up to rounding
_GUESS_FRACTION = 0.7  # the next row's cut: this fraction of this row's h^-1(s_(m))
_MU_EXPONENT = 500  # the Newton variable mu = lam 2^-shift stays below 2^_MU_EXPONENT
_TINY = float(np.finfo(np.float64).tiny)  # the smallest normal float64
_OPTIONS: dict[str, Any] = dict(cache=True, error_model="numpy", fastmath=False)


@njit(inline="always", **_OPTIONS)
def _link(u, a):
  """g(u) = u^a for u >= 0 (products for the common a = 1, 2, 3; 1/2 by sqrt)."""
  if a == 1.0:
    return u
  if a == 3.0:
    return u * u * u
  if a == 2.0:
    return u * u
  if a == 0.5:
    return math.sqrt(u)
  return math.pow(u, a)


@njit(inline="always", **_OPTIONS)
def _link_factors(l, a):
  """``(1 / l, l^-a)``: the factors of :func:`_scaled_link` (``l^-a`` only for ``a < 1``)."""
  return 1.0 / l, (math.pow(l, -a) if a < 1.0 else 1.0)


@njit(inline="always", **_OPTIONS)
def _scaled_link(t, inv, scale, a):
  """g(t / l) for t >= 0 from :func:`_link_factors`: ``g(t / l)`` for ``a >= 1``,
  ``g(t) l^-a`` for ``a < 1`` (``p > 2``), where ``t / l`` can leave the float range
  (``t = 1e-160``, ``l = 1e160``) while ``g(t / l)`` does not; ``g(t)`` and ``l^-a`` stay
  inside it for every ``t`` and allowed ``l``. For ``a >= 1``, ``g(t / l)`` leaves the
  range with ``t / l``: it is then 0 next to ``t``, or saturated."""
  if a < 1.0:
    return _link(t, a) * scale
  return _link(t * inv, a)


@njit(inline="always", **_OPTIONS)
def _magnitude_phi(values, count, mu, l, target, shift, a):
  r"""(F, dF/dmu, d2F/dmu2) / lam at :math:`\lambda = \mu 2^{\mathrm{shift}}` over
  the magnitudes values[:count].

  With :math:`y_i = g(t_i/l)/\lambda` (the mask of entry i) and
  :math:`w_i = \lambda / t_i`: an entry with :math:`y_i > 1` is saturated and adds
  :math:`\lambda` to F; a fractional one adds :math:`g(t_i/l)`, whose derivatives in
  :math:`\lambda` are :math:`-a g/t_i` and :math:`a(a-1) g/t_i^2`. So
  :math:`F/\lambda = \#\mathrm{sat} - k + \sum_{\mathrm{frac}} y_i`,
  :math:`F'_\mu/\lambda = (\#\mathrm{sat} - k - a\sum y_i w_i)/\mu` and
  :math:`F''_\mu/\lambda = a(a-1)\sum y_i w_i^2/\mu^2`: no overflow for
  :math:`\lambda` near the float maximum, exactly 0 on the flat root interval of a
  binary row, and, with ``shift`` putting :math:`\mu` in the middle of the float
  range, no derivative below the normal floats (which XLA's CPU runtime flushes to 0)
  where :math:`1/\lambda` would be. ``w_i`` is at most :math:`2^{53}` (:math:`t_i` is
  at least half an ulp of :math:`\lambda`).
  """
  lam = math.ldexp(mu, shift)
  if not lam >= _TINY:  # the limit lam -> 0+ (every nonzero entry saturated), or below
    return count - target, 0.0, 0.0
  inv, scale = _link_factors(l, a)
  saturated, total, slope, curve = 0.0, 0.0, 0.0, 0.0
  for i in range(count):
    t = values[i] - lam
    if t <= 0.0:
      continue
    y = _scaled_link(t, inv, scale, a) / lam
    if y > 1.0:
      saturated += 1.0
    else:
      w = lam / t
      total += y
      slope += y * w
      curve += y * w * w
  excess = saturated - target
  return excess + total, (excess - a * slope) / mu, a * (a - 1.0) * curve / mu / mu


def _with_globals(function, **names):
  """``function`` (a numba dispatcher) compiled again with the global ``names`` bound to
  other objects: the same source, another callee.

  Used to share :func:`native_threshold._newton` (the safeguarded Newton/Schroeder
  iteration, its bisection and stopping rules) with this kernel's :math:`F` in place
  of the mask's ``_phi`` (in ``_newton_iteration``, which ``_newton`` calls), without
  copying it (``_phi`` is the only piece that differs; its signature ``(values, count,
  lam, l, target, kind, a)`` fits this problem). Not
  cached on its own (its cache entry would share the original's name): the handlers
  that call it are, and they carry its code.
  """
  source = function.py_func
  missing = set(names) - set(source.__code__.co_names)
  if missing:
    raise ImportError(f"{source.__qualname__} no longer calls {sorted(missing)}; "
                      "implicit_topk.kernels.cpu.native_magnitude needs updating.")
  clone = types.FunctionType(source.__code__, dict(source.__globals__, **names),
                             source.__name__, source.__defaults__, source.__closure__)
  options = {key: value for key, value in _OPTIONS.items() if key != "cache"}
  return njit(**options)(clone)


_newton_iteration = _with_globals(_nt._newton_iteration, _phi=_magnitude_phi)
_newton = _with_globals(_nt._newton, _newton_iteration=_newton_iteration)


@njit(inline="always", **_OPTIONS)
def _h(y, l, a):
  """h(y) = y + l y^(p-1): the output of an entry whose solution is y (increasing); for
  ``p > 2`` as ``y + (y l^a)^(p-1)`` (``y^(p-1)`` alone can underflow where ``l y^(p-1)``
  is of the order of ``y``)."""
  if a < 1.0:
    return y + _link(y * math.pow(l, a), 1.0 / a)
  return y + l * _link(y, 1.0 / a)


@njit(**_OPTIONS)
def _h_inverse(s, l, a):
  r"""A lower bound of :math:`y^* = h^{-1}(s)` equal to it up to rounding, for finite
  :math:`s > 0`.

  In :math:`u = y^{p-1}` (so :math:`y = g(u) = u^a`), :math:`H(u) = u^a + l u = s`.
  For :math:`p \le 2` (:math:`a \ge 1`) :math:`H` is convex: Newton from
  :math:`u_0 = \min(s^{1/a}, s/l) \ge u^*` decreases monotonically to :math:`u^*`
  (one power, then products), and an upper bound :math:`u \ge u^*` gives the lower
  bounds :math:`y^* = s - l u^* \ge s - l u` and
  :math:`y^* = g((s - u^{*a})/l) \ge g((s - u^a)/l)`: the first where :math:`l u \le
  s/2`, the second elsewhere (no cancellation either way). For :math:`p > 2` the
  iteration runs on :math:`y` itself, :math:`h(y) = y + (c y)^{p-1}` with
  :math:`c = l^a`, convex: Newton from :math:`y_0 = \min(s, s^a / c) \ge y^*`
  (within a factor 2 of it) decreases to it, with the same two lower bounds. Either
  stops once a step is below :math:`2^{-44}` of the iterate (quadratic convergence:
  then at rounding level).
  """
  if a == 1.0:
    return s / (1.0 + l)
  if a > 1.0:  # H convex: from above
    u = min(math.pow(s, 1.0 / a), s * (1.0 / l))
    if not u >= _TINY:  # s / l below the normal floats: so is y* <= (s / l)^a
      return 0.0
    for _ in range(_H_STEPS):
      power = _link(u, a)
      step = (power + l * u - s) / (a * power / u + l)
      if not step > 0.0:  # at the root up to rounding (or u = 0: s underflowed)
        break
      u -= step
      if step <= _H_TOL * u:
        break
    if l * u <= 0.5 * s:
      return max(s - l * u, 0.0)
    return _link(max(s - _link(u, a), 0.0) * (1.0 / l), a)
  # p > 2: h(y) = y + (c y)^(p-1), c = l^a (no power of y alone, which can leave the
  # float range), is convex: Newton from y_0 = min(s, s^a / c) >= y* decreases to y*.
  pm1 = 1.0 / a
  c = math.pow(l, a)
  y = min(s, _link(s, a) / c)
  for _ in range(_H_STEPS):
    power = _link(c * y, pm1)
    step = (y + power - s) / (1.0 + pm1 * power / y)
    if not step > 0.0:  # at the root up to rounding (or y = 0: s^a / c underflowed)
      break
    y -= step
    if step <= _H_TOL * y:
      break
  # y >= y*, so y* = s - (c y*)^(p-1) >= s - (c y)^(p-1) and y* = g(s - y*) / c >=
  # g(s - y) / c: the first where y >= s / 2, the second elsewhere (no cancellation).
  if y >= 0.5 * s:
    return max(s - _link(c * y, pm1), 0.0)
  return _link(s - y, a) / c


@njit(**_OPTIONS)
def _gather_magnitudes(row, n, out):
  """Copies the finite nonzero ``|x_i|`` of ``row`` into ``out`` (branch-free); returns
  (their count, #(|x_i| = inf), whether a NaN occurs)."""
  count, n_inf, nan = 0, 0, False
  for i in range(n):
    v = abs(np.float64(row[i]))
    out[count] = v
    count += (v > 0.0) & (v < np.inf)
    n_inf += v == np.inf
    nan |= v != v
  return count, n_inf, nan


@njit(**_OPTIONS)
def _largest(values, count):
  """The largest of values[:count] (0 for none)."""
  top = 0.0
  for i in range(count):
    top = max(top, values[i])
  return top


@njit(**_OPTIONS)
def _gather_above(row, n, low, cut, out):
  """Copies the finite ``|x_i| > low`` of ``row`` into ``out`` (branch-free); returns
  (their count, how many finite ``|x_i|`` are at least ``cut``, whether an entry is
  infinite or NaN)."""
  count, above, bad = 0, 0, False
  for i in range(n):
    v = abs(np.float64(row[i]))
    out[count] = v
    finite = v < np.inf
    count += (v > low) & finite
    above += (v >= cut) & finite
    bad |= not finite
  return count, above, bad


@njit(**_OPTIONS)
def _sample_guess(row, n, k, l, a, scratch):
  """A guess of the cut ``L`` for the first row, where there is no previous row (as the
  mask kernel's ``_sample_cut``): ``h^{-1}`` of the order statistic of a strided sample
  of 1024 magnitudes at 1.5 times the matching rank of ``k + 1``, plus 4. Checked by
  the caller."""
  size = 1024
  step = n // size
  for i in range(size):
    v = abs(np.float64(row[i * step]))
    scratch[i] = v if v < np.inf else 0.0  # a NaN or inf entry: the check falls back
  rank = min(size - 1, int(math.ceil(1.5 * (k + 1.0) * size / n)) + 4)
  _nt._select_descending(scratch, size, rank)
  return _h_inverse(scratch[rank], l, a) if scratch[rank] > 0.0 else np.inf


@njit(**_OPTIONS)
def magnitude_row(row, n, k, l, a, tol, work, scratch, guess):
  r"""The threshold of one row. Returns (lam, passes, count, k_f): ``work[:count]`` then
  holds the magnitudes that can be nonzero at ``lam`` (count -1 for the rows answered
  without them) and ``k_f`` is ``k`` less the infinite entries.

  The magnitudes gathered: with ``L = guess[0]`` (a fraction of the previous row's
  :math:`h^{-1}(s_{(m)})`) and ``c = h(L)``, if at least ``m + 1`` entries are at
  least ``c``, then :math:`s_{(m)} \ge c` so :math:`h^{-1}(s_{(m)}) \ge L`: the
  entries above ``L`` hold the ``m + 1`` largest and every entry that can be nonzero
  at the root, and one branch-free pass gathers them. Otherwise (the first row, a
  guess too high, non-finite entries) every finite nonzero entry is gathered. The
  result does not depend on the guess.
  """
  count, k_f, m = -1, k, int(math.ceil(k))
  valid = k > 0.0 and k < n - 1 and l > 0.0 and l < np.inf
  if valid and guess[0] == np.inf and n >= _nt._SAMPLED_ROW:
    guess[0] = _sample_guess(row, n, k, l, a, scratch)
  if valid and guess[0] > 0.0 and guess[0] < np.inf:  # (an h^-1 that underflowed: none)
    low = guess[0]
    count, above, bad = _gather_above(row, n, low, _h(low, l, a) * (1.0 + _H_SLACK), work)
    if bad or above < m + 1:
      count = -1
  if count < 0:
    count, n_inf, nan = _gather_magnitudes(row, n, work)
    k_f = k - n_inf
    if nan or k_f < 0.0 or not (l > 0.0 and l < np.inf and k == k):
      return np.nan, 0, -1, k_f
    if k_f == 0.0:  # every finite entry is 0
      return _largest(work, count) + l, 0, -1, k_f
    if count <= k_f:  # every nonzero entry kept: the row itself
      return 0.0, 0, -1, k_f
  m, j = int(math.ceil(k_f)), int(math.floor(k_f))
  stats = _nt._order_statistics(work, count, m, j, scratch)  # (s_(m), s_(j+1), ...)
  s_m, s_next = stats[0], stats[1]
  lo, hi = _h_inverse(s_m, l, a), s_next
  guess[0] = _GUESS_FRACTION * lo if lo >= _TINY else np.inf
  # Binary where h(s_(k+1)) < s_(k), i.e. s_(k+1) < h^-1(s_(k)): then lambda is the middle
  # of [s_(k+1), h^-1(s_(k))]. lo is h^-1(s_(k)) up to rounding: h itself decides only
  # within that distance of it.
  if j == m and (hi < lo or (hi <= lo * (1.0 + _H_SLACK) and _h(hi, l, a) < s_m)):
    return _nt._midpoint(hi, max(lo, hi)), 0, count, k_f
  if lo < _TINY:
    # XLA's CPU runtime flushes subnormal floats to 0: keep the iteration on normal
    # floats, and return 0 where the root lies below them (the output is then x, up to
    # rounding, as for the exact root).
    if not (hi > _TINY and _magnitude_phi(work, count, _TINY, l, k_f, 0, a)[0] > 0.0):
      return 0.0, 1, -1, k_f
    lo = _TINY
  lo = min(lo, hi)  # equal up to rounding where h(s_(k+1)) = s_(k)
  count = _nt._count_above(work, count, lo)
  # As the mask kernel: start 2^-a of the way up the bracket.
  start = lo + min(max(0.5 ** a, 0.1), 0.9) * (hi - lo)
  # Iterate on mu = lam 2^-shift, below 2^500 (F'/lam ~ 1/lam is then a normal float),
  # keeping lo 2^-shift a normal float too.
  shift = max(0, min(math.frexp(hi)[1] - _MU_EXPONENT, math.frexp(lo)[1] + 1000))
  mu, passes = _newton(work, count, k_f, l, shift, a, math.ldexp(lo, -shift),
                       math.ldexp(hi, -shift), math.ldexp(start, -shift), tol)
  return math.ldexp(mu, shift), passes, count, k_f


@njit(**_OPTIONS)
def magnitude_rows(x, k, l, a, lam, passes, residual):
  """Every row of ``x`` (rows, n): its threshold into ``lam``, the Newton passes into
  ``passes`` (0 for rows answered in closed form) and :math:`|F(\\lambda)|/\\lambda`
  at ``lam`` as stored into ``residual`` (the mask equation's ``|sum(y) - k|``; 0 for
  rows answered in closed form, NaN for NaN rows). Returns 0 (the status)."""
  rows, n = x.shape
  work = np.empty(max(n, 1), np.float64)
  scratch = np.empty(max(n, 1), np.float64)
  guess = np.full(1, np.inf)
  tol = 4.0 * np.finfo(lam.dtype).eps
  for b in range(rows):
    lb = np.float64(l[b])
    value, it, count, k_f = magnitude_row(x[b], n, np.float64(k[b]), lb, a, tol, work, scratch, guess)
    lam[b] = value
    passes[b] = it
    if count >= 0:
      residual[b] = abs(_magnitude_phi(work, count, np.float64(lam[b]), lb, k_f, 0, a)[0])
    else:
      residual[b] = 0.0 if value == value else np.nan
  return 0


# -- the FFI handlers: (x (..., n), k (...), l (...)) with the attribute a = 1/(p-1)
#    (float64) -> (lam (...), passes int32 (...), residual (...)), one float dtype. -----
_BAD_ARGUMENTS = abi.message(
    "implicit_topk magnitude kernel: expected x (..., n), k (...), l (...) of one float "
    "dtype and a scalar attribute a (float64, > 0); results lam (...), passes int32 (...), "
    "residual (...)")


@njit(inline="always", **_OPTIONS)
def _magnitude_call(frame, sample, task):
  if abi.handler_prologue(frame):
    return abi.null()
  code = abi.dtype_code(sample)
  a_at = abi.scalar_attribute(frame, 97, abi.FLOAT64)
  if abi.count(frame, False) != 3 or abi.count(frame, True) != 3 or a_at == 0:
    return abi.error(frame, _BAD_ARGUMENTS, abi.ERROR_INVALID_ARGUMENT)
  a = carray(abi.typed_pointer(a_at, np.float64(0)), (1,))[0]
  xb, kb, lb = abi.buffer(frame, False, 0), abi.buffer(frame, False, 1), abi.buffer(frame, False, 2)
  lamb, passb, resb = abi.buffer(frame, True, 0), abi.buffer(frame, True, 1), abi.buffer(frame, True, 2)
  rank = abi.buffer_rank(xb)
  if rank < 1 or not (a > 0.0 and a < np.inf):
    return abi.error(frame, _BAD_ARGUMENTS, abi.ERROR_INVALID_ARGUMENT)
  n = abi.buffer_dim(xb, rank - 1)
  rows = abi.size(xb) // n if n > 0 else abi.size(kb)
  ok = (abi.buffer_dtype(xb) == code and abi.has(kb, code, rows) and abi.has(lb, code, rows)
        and abi.has(lamb, code, rows) and abi.has(passb, abi.INT32, rows)
        and abi.has(resb, code, rows))
  if not ok:
    return abi.error(frame, _BAD_ARGUMENTS, abi.ERROR_INVALID_ARGUMENT)
  if threads.run_rows(frame, rows, n, task, _magnitude_block, sample, 0) != 0:
    return abi.error(frame, abi.KERNEL_FAILED, abi.ERROR_INTERNAL)
  return abi.null()


@njit(**_OPTIONS)
def _magnitude_block(frame, r0, r1, sample, rule):
  """Rows ``r0 .. r1 - 1`` of a checked call (a block of
  :mod:`~implicit_topk.kernels.cpu.threads`: it starts afresh, no guess carried in from
  the rows before it); the status."""
  xb = abi.buffer(frame, False, 0)
  n = abi.buffer_dim(xb, abi.buffer_rank(xb) - 1)
  rows = r1 - r0
  a = carray(abi.typed_pointer(abi.scalar_attribute(frame, 97, abi.FLOAT64), np.float64(0)), (1,))[0]
  return magnitude_rows(
      abi.rows_of(frame, False, 0, sample, r0, rows, n), abi.span_of(frame, False, 1, sample, r0, rows),
      abi.span_of(frame, False, 2, sample, r0, rows), a, abi.span_of(frame, True, 0, sample, r0, rows),
      abi.span_of(frame, True, 1, np.int32(0), r0, rows), abi.span_of(frame, True, 2, sample, r0, rows))


_TASK_F32 = threads.external_task("native_magnitude", "magnitude_f32")
_TASK_F64 = threads.external_task("native_magnitude", "magnitude_f64")


def magnitude_f32(frame):
  return _magnitude_call(frame, np.float32(0), _TASK_F32())


def magnitude_f64(frame):
  return _magnitude_call(frame, np.float64(0), _TASK_F64())


# The helper tasks (:mod:`~implicit_topk.kernels.cpu.threads`), void (void*).
def magnitude_f32_task(data):
  threads.serve(data, _magnitude_block, np.float32(0), 0)


def magnitude_f64_task(data):
  threads.serve(data, _magnitude_block, np.float64(0), 0)
