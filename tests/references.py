"""Independent references for ``tests/test_fuzz.py`` (issue 15).

Written from the math of the public docstrings, ``README.md`` and ``proofs/*.md``; nothing
here imports ``implicit_topk`` or copies its code paths. Slow on purpose, one row at a time:

* the capped-simplex mask: the link of each regularizer derived here from its Omega, and
  the threshold located **exactly** among the breakpoints of ``phi`` with rational
  arithmetic (``fractions.Fraction``: differences of doubles of any magnitude are exact),
  then found by float64 bisection in a frame re-centred on the root (so ``z_i - t`` is
  accurate to its own ulp even when ``|x| / l`` is 1e300); for ``p = 2`` the root is the
  exact rational root of the linear piece;
* the top-k in magnitude: the threshold equation of ``proofs/magnitude_threshold.md``
  (bisection on ``log lam``, then on ``lam`` to adjacent doubles), and, as a second
  route, a plain PAV on the reference's isotonic dual (D);
* permutahedron operators: a plain-Python PAV on the isotonic dual
  (``proofs/isotonic_dual.md``), block values by bisection (closed forms for ``p = 2`` and
  entropy);
* GradTopK, the smooth top-k SVM loss and ``sparse_softmax``: brute force over subsets;
* the iterative softmax: 60-digit ``decimal`` arithmetic;
* SLSQP (scipy) versions of the LPs for tiny ``n``, to check these references themselves.
"""

from __future__ import annotations

import decimal
import itertools
import math
from decimal import Decimal, localcontext
from fractions import Fraction

import numpy as np

# Beyond |z| = _TAIL an exponential tail is below e^-60 ~ 1e-26 (invisible in float64);
# used as pseudo-breakpoints for links that never saturate exactly.
_TAIL = 60


# ---------------------------------------------------------------------------------------
# Regularizers: omega, and g = (omega')^{-1} derived from it
# ---------------------------------------------------------------------------------------


class PNormRef:
  """omega(y) = |y|^p / p. omega'(y) = sign(y)|y|^(p-1), so g(z) = sign(z)|z|^(1/(p-1)).

  On [0, 1]: omega'(0) = 0 and omega'(1) = 1, so the clipped link is 0 for z <= 0,
  z^a on (0, 1) and 1 for z >= 1 (a = 1/(p-1)); saturation interval [0, 1].
  """

  def __init__(self, p):
    self.p = float(p)
    self.a = 1.0 / (self.p - 1.0)
    self.z0, self.z1 = 0.0, 1.0
    self.name = f"pnorm{p:g}"

  def omega(self, y):
    return np.abs(y) ** self.p / self.p

  def link(self, z):
    z = np.asarray(z, np.float64)
    return np.sign(z) * np.abs(z) ** self.a

  def link_inv(self, y):
    y = np.asarray(y, np.float64)
    return np.sign(y) * np.abs(y) ** (self.p - 1.0)

  def mask(self, z):
    z = np.asarray(z, np.float64)
    inside = (z > 0) & (z < 1)
    return np.where(z >= 1, 1.0, np.where(inside, np.where(inside, z, 0.5) ** self.a, 0.0))


class EntropyRef:
  """omega(y) = y log y - y: omega'(y) = log y, g = exp; on [0, 1] the mask is min(1, e^z),
  exactly 1 for z >= 0 and never exactly 0 (saturation (-inf, 0])."""

  z0, z1 = -math.inf, 0.0
  name = "entropy"

  def omega(self, y):
    y = np.asarray(y, np.float64)
    return np.where(y > 0, y * np.log(np.where(y > 0, y, 1.0)), 0.0) - y

  def link(self, z):
    return np.exp(np.asarray(z, np.float64))

  def link_inv(self, y):
    return np.log(y)

  def mask(self, z):
    z = np.asarray(z, np.float64)
    return np.where(z >= 0, 1.0, np.exp(np.minimum(z, 0.0)))


def _xlogx(y):
  y = np.asarray(y, np.float64)
  return np.where(y > 0, y * np.log(np.where(y > 0, y, 1.0)), 0.0)


class SigmoidRef:
  """omega(y) = y log y + (1-y) log(1-y): omega'(y) = log(y / (1 - y)), g = the logistic
  sigmoid; never exactly 0 or 1."""

  z0, z1 = -math.inf, math.inf
  name = "sigmoid"

  def omega(self, y):
    return _xlogx(y) + _xlogx(1.0 - np.asarray(y, np.float64))

  def mask(self, z):
    z = np.asarray(z, np.float64)
    e = np.exp(-np.abs(z))
    return np.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


class LaplaceRef:
  """g = F, the Laplace CDF (e^z / 2 below 0, 1 - e^-z / 2 above), so omega' = F^{-1}
  (log 2y below 1/2, -log 2(1 - y) above) and omega = its integral from 0:
  y log 2y - y below 1/2, (1-y) log 2(1-y) - (1-y) above (continuous at 1/2: -1/2)."""

  z0, z1 = -math.inf, math.inf
  name = "laplace"

  def omega(self, y):
    y = np.asarray(y, np.float64)
    below = _xlogx(y) + y * math.log(2.0) - y
    u = 1.0 - y
    above = _xlogx(u) + u * math.log(2.0) - u
    return np.where(y < 0.5, below, above)

  def mask(self, z):
    z = np.asarray(z, np.float64)
    return np.where(z < 0, 0.5 * np.exp(np.minimum(z, 0.0)), 1.0 - 0.5 * np.exp(-np.maximum(z, 0.0)))


def regularizer(name="pnorm", p=4.0 / 3.0):
  """The reference regularizer for a library name (``None``/"pnorm" -> PNormRef(p))."""
  if name in (None, "pnorm"):
    return PNormRef(p)
  return {"entropy": EntropyRef, "sigmoid": SigmoidRef, "binary_entropy": SigmoidRef,
          "laplace": LaplaceRef}[name]()


# ---------------------------------------------------------------------------------------
# Capped simplex: y = clip(g((x - lam) / l), 0, 1) with sum y = k
# ---------------------------------------------------------------------------------------


def _fsum_mask(reg, d):
  return math.fsum(reg.mask(d).tolist())


def _is_exact_p2(reg):
  return isinstance(reg, PNormRef) and reg.p == 2.0


def _phi_exact_p2(z, k, t):
  return sum(min(max(zi - t, Fraction(0)), Fraction(1)) for zi in z) - k


def _phi_at(reg, z, k, t):
  """phi(t) = sum_i mask(z_i - t) - k, each z_i - t exact then rounded once."""
  if _is_exact_p2(reg):
    return float(_phi_exact_p2(z, k, t))
  d = np.array([float(zi - t) for zi in z])
  return _fsum_mask(reg, d) - float(k)


def _breakpoints(reg, z):
  """The t where some entry enters or leaves a saturation (pseudo ones at +-_TAIL)."""
  z0 = Fraction(reg.z0) if math.isfinite(reg.z0) else Fraction(-_TAIL)
  z1 = Fraction(reg.z1) if math.isfinite(reg.z1) else Fraction(_TAIL)
  return sorted({zi - z0 for zi in z} | {zi - z1 for zi in z})


def _bracket_root(reg, z, k):
  """Consecutive breakpoints [lo, hi] with phi(lo) >= 0 >= phi(hi) (phi is nonincreasing)."""
  b = _breakpoints(reg, z)
  lo, hi = 0, len(b) - 1  # phi(b[0]) = n - k > 0, phi(b[-1]) = -k < 0 (up to the tails)
  while hi - lo > 1:
    mid = (lo + hi) // 2
    if _phi_at(reg, z, k, b[mid]) >= 0:
      lo = mid
    else:
      hi = mid
  return b[lo], b[hi]


def _root_p2(z, k, lo, hi):
  """The exact rational root of the piecewise linear phi in [lo, hi] (consecutive breakpoints)."""
  if _phi_exact_p2(z, k, lo) == 0:
    return lo
  if _phi_exact_p2(z, k, hi) == 0:
    return hi
  mid = (lo + hi) / 2
  ones = sum(1 for zi in z if zi - mid >= 1)
  frac = [zi for zi in z if 0 < zi - mid < 1]
  t = (sum(frac) - (k - ones)) / len(frac)
  assert lo <= t <= hi and _phi_exact_p2(z, k, t) == 0
  return t


def _root_bisect(reg, z, k, lo, hi):
  """The root of phi in [lo, hi] (phi(lo) >= 0 >= phi(hi)) to float64 resolution of every
  mask value.

  The judge of a bracket end is ``_phi_at`` (each z_i - t exact, rounded once). Proposals
  come from a float64 bisection on s = t - lo with d_i = z_i - lo rounded once; a proposal
  the judge rejects becomes the other end. Each round re-centres the frame on the new,
  narrower bracket, so the entries nearest the threshold end up with z_i - t accurate to
  their own ulp (for p = 10 a mask value 1e-8 needs z_i - t ~ 1e-72); rounds where the
  float model makes no progress fall back to exact midpoints. Stops once every mask value
  is the same at both ends (to 1e-18) or its argument is resolved to 2^-60 of itself.
  """
  kf = float(k)
  for _ in range(100):
    width = hi - lo
    if width == 0:
      break
    d = np.array([float(zi - lo) for zi in z])
    dh = np.array([float(zi - hi) for zi in z])
    w = float(width)
    settled = (np.abs(reg.mask(d) - reg.mask(dh)) <= 1e-18) | (w <= 2.0**-60 * np.abs(d))
    if settled.all():
      break
    s_lo, s_hi = 0.0, w
    while True:
      mid = 0.5 * (s_lo + s_hi)
      if not s_lo < mid < s_hi or (s_hi - s_lo) <= w * 2.0**-62:
        break
      if _fsum_mask(reg, d - mid) - kf >= 0:
        s_lo = mid
      else:
        s_hi = mid
    old = width
    for cand in (lo + Fraction(s_lo), lo + Fraction(s_hi)):
      if lo < cand < hi:
        if _phi_at(reg, z, k, cand) >= 0:
          lo = cand
        else:
          hi = cand
    if hi - lo > old / 2:  # the float model is stuck: exact midpoints
      for _ in range(8):
        mid = (lo + hi) / 2
        if _phi_at(reg, z, k, mid) >= 0:
          lo = mid
        else:
          hi = mid
  return (lo + hi) / 2


def _solve_finite_row(reg, xf, k, l):
  """(y, t, z) for finite entries xf, 0 < k < len(xf): t the threshold in units of l."""
  lf = Fraction(l)
  z = [Fraction(v) / lf for v in xf]
  lo, hi = _bracket_root(reg, z, k)
  if _is_exact_p2(reg):
    t = _root_p2(z, k, lo, hi)
    y = np.array([float(min(max(zi - t, Fraction(0)), Fraction(1))) for zi in z])
  else:
    t = _root_bisect(reg, z, k, lo, hi)
    y = reg.mask(np.array([float(zi - t) for zi in z]))
  return y, t, z


def _float_or_inf(q):
  """float(q), or +-inf where |q| is beyond the float range (a threshold near the float
  maximum shifted by l can be)."""
  try:
    return float(q)
  except OverflowError:
    return math.inf if q > 0 else -math.inf


def mask_row(x, k, l, reg):
  """The soft top-k mask of one row (1-D float64) with its documented non-finite behaviour.

  Returns (y, info); info = dict(t=threshold / l as a Fraction or None, z=[x_i / l], lam=float).
  Non-finite rows (README, soft_topk_mask docstring): NaN anywhere -> NaN; +inf -> 1,
  -inf -> 0, the finite entries share k - #(+inf); no threshold (more +inf than k, or
  fewer entries above -inf than k) -> NaN. Exactly k entries at +inf leaves 0 to share
  (finite entries 0); exactly k above -inf gives every finite entry 1.
  """
  x = np.asarray(x, np.float64)
  n = x.size
  nan_row = (np.full(n, np.nan), dict(t=None, z=None, lam=math.nan))
  if np.isnan(x).any():
    return nan_row
  pos, neg = x == np.inf, x == -np.inf
  finite = ~(pos | neg)
  kq = Fraction(float(k))
  k_rest = kq - int(pos.sum())
  if k_rest < 0 or k_rest > int(finite.sum()):
    return nan_row
  y = np.where(pos, 1.0, 0.0)
  info = dict(t=None, z=None, lam=math.nan)
  if k_rest == int(finite.sum()):
    y[finite] = 1.0
  elif k_rest > 0:
    yf, t, z = _solve_finite_row(reg, x[finite], k_rest, float(l))
    y[finite] = yf
    info = dict(t=t, z=z, lam=_float_or_inf(t * Fraction(float(l))), finite=finite)
  return y, info


def _rows(x, axis):
  x = np.asarray(x, np.float64)
  moved = np.moveaxis(x, axis, -1)
  return moved, moved.reshape(-1, moved.shape[-1])


def _per_row(value, batch_shape):
  return np.broadcast_to(np.asarray(value, np.float64), batch_shape).reshape(-1)


# The exact rows already solved: a test checks a mask against ``soft_topk_mask`` and then
# asks ``mask_tolerance`` for its tolerance, which needs the same exact solve (rational
# arithmetic: most of such a test's time at n = 1000). Keyed on the row's bytes, k, l and
# the regularizer; the entries are returned as copies. Bounded, oldest dropped first.
_SOLVED_ROWS: dict = {}
_SOLVED_ROWS_LIMIT = 2048


def _memo_mask_row(row, k, l, regularizer_name, p):
  key = (row.tobytes(), float(k), float(l), regularizer_name, float(p))
  if key not in _SOLVED_ROWS:
    if len(_SOLVED_ROWS) >= _SOLVED_ROWS_LIMIT:
      del _SOLVED_ROWS[next(iter(_SOLVED_ROWS))]
    _SOLVED_ROWS[key] = mask_row(row, k, l, regularizer(regularizer_name, p))
  y, info = _SOLVED_ROWS[key]
  return y.copy(), dict(info)


def soft_topk_mask(x, k, l=0.1, p=4.0 / 3.0, regularizer_name=None, axis=-1, with_info=False):
  """Reference of ``itk.soft_topk_mask`` (any batch shape, per-row k and l)."""
  moved, rows = _rows(x, axis)
  ks, ls = _per_row(k, moved.shape[:-1]), _per_row(l, moved.shape[:-1])
  out, infos = [], []
  for row, kk, ll in zip(rows, ks, ls):
    y, info = _memo_mask_row(np.ascontiguousarray(row), kk, ll, regularizer_name, p)
    out.append(y)
    infos.append(info)
  y = np.moveaxis(np.array(out).reshape(moved.shape), -1, axis)
  return (y, infos) if with_info else y


def mask_tolerance(x, k, l, p=4.0 / 3.0, regularizer_name=None, *, eps, c_lam=16.0, c_sum=16.0,
                   axis=-1, unshifted_rows=False):
  """Per-entry absolute tolerance for a mask computed in a precision with unit roundoff eps.

  The problem is shift invariant, so we measure rounding from a shift-invariant origin,
  the row's largest finite entry x_max (the same answer for x and x + c): an exact
  solver in that precision evaluates y_i = mask((x_i - lam)/l) with x_i - x_max and
  lam - x_max rounded, i.e. z_i - t off by delta_i = c_lam eps (|x_i - x_max| +
  |lam - x_max|) / l. By proofs/dykstra_stopping.md the L1 error of any threshold map is
  |phi(lam)|, so the error of y_i is at most the change of its own entry under its
  delta_i plus the total change of all entries (the others' share of the constraint),
  plus c_sum n eps for the rounded sum phi and the rounded mask values.
  (Measured from 0 instead, delta would be eps (|x| + |lam|) / l: far too loose to see
  issue 15's F3a and F3c, where |x| / l is large or z_i - t is far below ulp(x).)

  ``unshifted_rows=True`` allows what the library's ``CappedSimplex.normalize`` documents:
  rows whose largest entry is within l / sqrt(eps) of 0 are solved unshifted, where
  x_i - lam is resolved to eps (|x_i| + |lam|) <= eps (2 |x_max| + the shifted terms); we
  add 2 |x_max| / l to those rows' delta. (README: "An entry that takes a fractional share is
  resolved to the ulp of its distance from the row maximum" says more: see test_fuzz's
  ``test_found_mask_resolved_from_row_max``.)
  """
  reg = regularizer(regularizer_name, p)
  y, infos = soft_topk_mask(x, k, l, p, regularizer_name, axis=axis, with_info=True)
  moved, rows = _rows(x, axis)
  tol = []
  ls = _per_row(l, moved.shape[:-1])
  for row, info, ll in zip(rows, infos, ls):
    n = row.size
    base = np.full(n, c_sum * max(n, 1) * eps)
    if info["t"] is not None:
      finite = info["finite"]
      z, t = info["z"], info["t"]
      top = max(z)
      extra = 0.0
      if unshifted_rows and abs(float(top)) * math.sqrt(2 * eps) <= 1.0:  # |x_max| <= l / sqrt(eps)
        extra = 2 * abs(float(top))
      delta = c_lam * eps * (np.array([float(top - zi) for zi in z]) + abs(float(t - top)) + extra)
      d = np.array([float(zi - t) for zi in z])
      y0 = reg.mask(d)
      sens = np.maximum(np.abs(reg.mask(d + delta) - y0), np.abs(reg.mask(d - delta) - y0))
      base[finite] += sens + math.fsum(sens.tolist())
    elif unshifted_rows and np.isfinite(row).any() and not np.isnan(row).any():
      # all finite entries at a saturation end (k - #(+inf) = 0 or = #finite): the unshifted
      # threshold x - l z1 (x - l z0) rounds by eps |x_max| / l, one step of the mask there
      finite = np.isfinite(row)
      top = float(np.max(np.abs(row[finite]))) / ll
      if top * math.sqrt(2 * eps) <= 1.0:
        delta = c_lam * eps * (2 * top + 1)
        for edge in (reg.z0, reg.z1):
          if math.isfinite(edge):
            base[finite] += abs(float(reg.mask(np.array(edge - delta))) - float(reg.mask(np.array(edge + delta))))
    tol.append(base)
  return np.moveaxis(np.array(tol).reshape(moved.shape), -1, axis)


def mask_partition(x, k, l, p=4.0 / 3.0, regularizer_name=None, margin=0.0):
  """Per row: the sorted tuple of entries' states (0, 1 or 'frac') and whether every
  entry is farther than ``margin`` (in units of l) from a saturation breakpoint."""
  reg = regularizer(regularizer_name, p)
  _, infos = soft_topk_mask(x, k, l, p, regularizer_name, with_info=True)
  states, safe = [], True
  for info in infos:
    if info["t"] is None:
      states.append(None)
      continue
    d = np.array([float(zi - info["t"]) for zi in info["z"]])
    st = tuple("0" if v <= reg.z0 else "1" if v >= reg.z1 else "f" for v in d)
    states.append(st)
    for edge in (reg.z0, reg.z1):
      if math.isfinite(edge) and np.any(np.abs(d - edge) <= margin):
        safe = False
  return states, safe


# ---------------------------------------------------------------------------------------
# SLSQP versions (tiny n; for checking the references above)
# ---------------------------------------------------------------------------------------


def mask_slsqp(x, k, l, reg):
  """argmax_{y in [0,1]^n, sum y = k} <x, y> - l sum omega(y_i) by SLSQP (about 1e-6)."""
  from scipy.optimize import minimize

  x = np.asarray(x, np.float64)
  n = x.size
  eps = 1e-12
  objective = lambda y: -(x @ y) + l * float(np.sum(reg.omega(np.clip(y, eps, 1 - eps))))
  res = minimize(objective, np.full(n, k / n), method="SLSQP", bounds=[(0.0, 1.0)] * n,
                 constraints=[{"type": "eq", "fun": lambda y: np.sum(y) - k}],
                 options=dict(ftol=1e-15, maxiter=1000))
  return res.x


def permutahedron_slsqp(theta, w, l, reg):
  """argmax_{y in P(w)} <theta, y> - l sum omega(y_i), P(w) by majorization (Rado):
  sum y = sum w and the sum over any subset S of y is <= the |S| largest w's sum."""
  from scipy.optimize import minimize

  theta, w = np.asarray(theta, np.float64), np.asarray(w, np.float64)
  n = theta.size
  ws = np.sort(w)[::-1]
  cons = [{"type": "eq", "fun": lambda y: np.sum(y) - np.sum(w)}]
  for size in range(1, n):
    cap = float(np.sum(ws[:size]))
    for subset in itertools.combinations(range(n), size):
      idx = list(subset)
      cons.append({"type": "ineq", "fun": lambda y, idx=idx, cap=cap: cap - np.sum(y[idx])})
  objective = lambda y: -(theta @ y) + l * float(np.sum(reg.omega(y)))
  res = minimize(objective, np.full(n, np.mean(w)), method="SLSQP", constraints=cons,
                 options=dict(ftol=1e-15, maxiter=1000))
  return res.x


# ---------------------------------------------------------------------------------------
# Top-k in magnitude (proofs/magnitude_threshold.md)
# ---------------------------------------------------------------------------------------


def _mag_log_g(t, l, a):
  """log g(t / l) = a (log t - log l) for t > 0 (no overflow at any scale)."""
  return a * (math.log(t) - math.log(l))


def _mag_g(t, l, a):
  """(log g, g) of g(t / l) = (t / l)^a for t > 0; g = inf past the float range."""
  lg = _mag_log_g(t, l, a)
  if lg > 709:
    return lg, math.inf
  q = t / l
  gval = q**a if 1e-300 < q < 1e300 and lg > -690 else math.exp(lg)
  return lg, gval


def _mag_terms(s, lam, log_lam, l, a):
  """sum_i min(1, g((s_i - lam)_+ / l) / lam) (fsum); lam may underflow (log_lam given)."""
  total = []
  for si in s:
    t = math.fsum([si, -lam])  # one rounding of the exact difference
    if t <= 0:
      total.append(0.0)
      continue
    lg, gval = _mag_g(t, l, a)
    if lam > 1e-300 and 0 < gval < math.inf:
      total.append(1.0 if gval >= lam else gval / lam)
    else:
      e = lg - log_lam
      total.append(1.0 if e >= 0 else math.exp(e))
  return math.fsum(total)


def _mag_lambda(s, k, l, a):
  """The root lam > 0 of sum_i min(1, g((s_i - lam)_+/l)/lam) = k (nnz(s) > k)."""
  nz = [v for v in s if v > 0]
  # at lam = min over nonzero s of min(s/2, g(s/(2l))) every term is 1: phi = nnz - k > 0
  log_lo = min(min(math.log(v / 2), _mag_log_g(v / 2, l, a)) for v in nz)
  log_hi = math.log(max(nz))  # phi = -k there
  phi_log = lambda ll: _mag_terms(s, math.exp(ll), ll, l, a) - k
  while log_hi - log_lo > 1e-3 * max(1.0, abs(log_hi)):
    mid = 0.5 * (log_lo + log_hi)
    if phi_log(mid) >= 0:
      log_lo = mid
    else:
      log_hi = mid
  lo, hi = math.exp(log_lo), math.exp(log_hi)
  if 0 < hi < max(nz) and _mag_terms(s, hi, math.log(hi), l, a) - k >= 0:
    hi = max(nz)  # exp(log(max)) rounded below max, inside the root's bracket: phi(max) = -k
  if lo > 1e-300 and math.isfinite(hi):
    while True:
      mid = 0.5 * (lo + hi)
      if not lo < mid < hi:
        break
      if _mag_terms(s, mid, math.log(mid), l, a) - k >= 0:
        lo = mid
      else:
        hi = mid
    return 0.5 * (lo + hi), math.log(0.5 * (lo + hi))
  while True:
    mid = 0.5 * (log_lo + log_hi)
    if not log_lo < mid < log_hi:
      break
    if phi_log(mid) >= 0:
      log_lo = mid
    else:
      log_hi = mid
  return math.exp(log_lo), log_lo


def _mag_out(s, lam, l, a):
  """min(s_i, t_i + g(t_i / l)), t_i = (s_i - lam)_+ (g may overflow to inf: then s_i)."""
  out = []
  for si in s:
    t = math.fsum([si, -lam])
    out.append(0.0 if t <= 0 else min(si, t + _mag_g(t, l, a)[1]))
  return np.array(out)


def mag_row(x, k, l, p):
  """soft_topk_mag of one row; returns (out, lam). Non-finite (docstring): NaN -> NaN row;
  |x_i| = inf entries kept; more than k of them -> NaN; at most k nonzero -> x unchanged."""
  x = np.asarray(x, np.float64)
  n = x.size
  a = 1.0 / (p - 1.0)
  if np.isnan(x).any():
    return np.full(n, np.nan), math.nan
  inf = np.isinf(x)
  k_rest = float(k) - int(inf.sum())
  if k_rest < 0:
    return np.full(n, np.nan), math.nan
  out = np.where(inf, x, 0.0)
  fin = ~inf
  s = np.abs(x[fin]).tolist()
  if sum(1 for v in s if v > 0) <= k_rest:
    out[fin] = x[fin]
    return out, 0.0
  if k_rest == 0:
    return out, math.inf
  lam, _ = _mag_lambda(s, k_rest, float(l), a)
  out[fin] = np.sign(x[fin]) * _mag_out(s, lam, float(l), a)
  return out, lam


def soft_topk_mag(x, k, l=0.1, p=4.0 / 3.0, axis=-1, with_lam=False):
  moved, rows = _rows(x, axis)
  ks, ls = _per_row(k, moved.shape[:-1]), _per_row(l, moved.shape[:-1])
  res = [mag_row(r, kk, ll, p) for r, kk, ll in zip(rows, ks, ls)]
  out = np.moveaxis(np.array([o for o, _ in res]).reshape(moved.shape), -1, axis)
  return (out, [lam for _, lam in res]) if with_lam else out


def mag_tolerance(x, k, l, p, *, eps, c=16.0, axis=-1):
  """Per-entry tolerance of soft_topk_mag in a precision with unit roundoff eps.

  The solver's lam has a rounding error of c eps lam, plus what a rounded equation
  F(lam) = sum min(lam, g) - k lam (terms of size <= (k + n) lam, error ~ c n eps lam)
  leaves: c n eps (k + n) / |phi'(lam)| (phi' by a central difference of the reference
  equation). The output is evaluated at a rounded t_i = |x_i| - lam and a rounded
  g = (t/l)^a (relative error c (1 + a) eps); we add |out(lam +- delta) - out(lam)|.
  """
  a = 1.0 / (p - 1.0)
  moved, rows = _rows(x, axis)
  ks, ls = _per_row(k, moved.shape[:-1]), _per_row(l, moved.shape[:-1])
  tols = []
  for row, kk, ll in zip(rows, ks, ls):
    out, lam = mag_row(row, kk, ll, p)
    n = row.size
    tol = c * (1.0 + a) * eps * np.abs(np.nan_to_num(out, posinf=0.0, neginf=0.0))
    fin = np.isfinite(row)
    k_rest = kk - int((~fin).sum())
    if 0 < lam < math.inf:
      s = np.abs(row[fin]).tolist()
      r, log_lam = 1e-7, math.log(lam)  # relative steps, in logs: lam may be subnormal
      slope = abs(_mag_terms(s, lam * (1 + r), log_lam + math.log1p(r), ll, a)
                  - _mag_terms(s, lam * (1 - r), log_lam + math.log1p(-r), ll, a)) / (2 * r * lam)
      delta = c * eps * lam
      if slope > 0:
        delta += c * n * eps * (k_rest + n) / slope
      delta = min(delta, lam)
      base = _mag_out(s, lam, ll, a)
      sens = np.maximum(np.abs(_mag_out(s, lam + delta, ll, a) - base),
                        np.abs(_mag_out(s, lam - delta, ll, a) - base))
      tol[fin] += sens
    tols.append(tol)
  return np.moveaxis(np.array(tols).reshape(moved.shape), -1, axis)


_MAG_DIGITS = 40
_MAG_REL = Decimal(10) ** -25  # bisection stops at this relative bracket width


def magnitude_exponent(p):
  """a = 1 / (p - 1) of the float p, an integer when within 1e-9 of one (the operator's
  definition of its exponent: p = 4/3 is the cubic a = 3)."""
  a = 1.0 / (float(p) - 1.0)
  r = round(a)
  return r if r >= 1 and abs(a - r) <= 1e-9 * max(1.0, a) else a


def decimal_context():
  return decimal.Context(prec=_MAG_DIGITS, Emin=-999999, Emax=999999)


class MagnitudeDecimal:
  """The top-k in magnitude of one row to 40 digits (``decimal``): the exact threshold
  ``lam`` of ``proofs/magnitude_threshold.md`` (bisection, geometric across decades) and
  the exact output map, for ``x`` (1-D floats, converted exactly), ``k``, ``l``, ``p``."""

  def __init__(self, x, k, l, p):
    self.x = np.asarray(x, np.float64)
    with decimal.localcontext(decimal_context()):
      self.a = Decimal(magnitude_exponent(p))
      self.l = Decimal(float(l))
      self.s = [abs(Decimal(float(v))) for v in self.x]
      kD = Decimal(float(k))
      nonzero = [v for v in self.s if v > 0]
      if len(nonzero) <= kD:
        self.lam = Decimal(0)
        return

      def phi(lam):
        return sum(min(Decimal(1), self.g(v - lam) / lam) for v in self.s) - kD

      hi = max(self.s)
      m = min(nonzero)
      lo = min(m / 2, self.g(m / 2))  # every nonzero entry saturated: phi(lo) = #nonzero - k
      assert phi(lo) > 0 and phi(hi) < 0
      while hi - lo > _MAG_REL * hi:
        mid = (lo * hi).sqrt() if hi > 4 * lo else (lo + hi) / 2
        if phi(mid) > 0:
          lo = mid
        else:
          hi = mid
      self.lam = (lo + hi) / 2

  def g(self, t):
    return (t / self.l) ** self.a if t > 0 else Decimal(0)

  def output(self, lam):
    """(out, noise): sign(x_i) min(s_i, t_i + g(t_i / l)) and the scale of its
    evaluation noise in the working dtype, |out| + a g (1 + |log(t / l)|)."""
    out, noise = [], []
    with decimal.localcontext(decimal_context()):
      for v, xv in zip(self.s, self.x):
        t = max(v - lam, Decimal(0))
        gt = self.g(t)
        value = min(v, t + gt)
        out.append(math.copysign(float(value), xv))
        if t > 0 and t + gt < v:
          noise.append(float(value + self.a * gt * (1 + abs((t / self.l).ln()))))
        else:
          noise.append(float(value))
    return np.array(out), np.array(noise)

  def output_within(self, out, lam_err, *, out_ulps, eps, tiny):
    """A backward-error check of ``out`` (float64 array): ``(ok per entry, message)``.

    ``out`` must lie between the exact outputs at ``lam -/+ delta``, ``delta = lam_err +
    2 eps lam + tiny`` (``lam_err`` a Decimal: how far the threshold may be), widened by
    ``out_ulps`` of the output map's evaluation noise, with the sign of ``x``.
    """
    with decimal.localcontext(decimal_context()):
      delta = lam_err + Decimal(2 * eps) * self.lam + Decimal(tiny)
      upper, noise_lo = self.output(max(self.lam - delta, Decimal(0)))  # out is nonincreasing
      lower, noise_hi = self.output(self.lam + delta)                   # in lam (in |out|)
    slack = out_ulps * eps * np.maximum(noise_lo, noise_hi) + tiny
    mag, hi_mag, lo_mag = np.abs(out), np.abs(upper), np.abs(lower)
    ok = ((mag <= hi_mag + slack) & (mag >= lo_mag - slack)
          & ((out == 0) | (np.sign(out) == np.sign(self.x))))
    return ok, f"out {out!r}\n exact outputs in [{lower!r},\n {upper!r}]\n slack {slack!r}"


def mag_isotonic_pav(x, k, l, p):
  """Second route to soft_topk_mag (finite x): PAV on the dual (D) of
  proofs/magnitude_threshold.md, min_{v nonincreasing} sum |s_i - v_i|^q/(q l^(q-1)) +
  w_i v_i^2 / 2, w = (1,..,1, k - floor k, 0..). Block value: the root of
  sum_B g((s_i - v)/l) = v W_B (odd g); y_i = g((s_i - v_i)/l); out = sign(x) (y + l y^(p-1))."""
  x = np.asarray(x, np.float64)
  n = x.size
  a = 1.0 / (p - 1.0)
  s_all = np.abs(x)
  order = np.argsort(-s_all, kind="stable")
  s = s_all[order]
  m = math.floor(k)
  w = np.array([1.0] * m + [k - m] + [0.0] * n)[:n]
  g = lambda u: np.sign(u) * np.abs(u) ** a

  def block_value(sb, wb):
    f = lambda v: float(np.sum(g((sb - v) / l))) - v * wb
    lo, hi = -1.0, float(np.max(sb)) + 1.0
    while f(lo) < 0:
      lo *= 2
    while f(hi) > 0:
      hi *= 2
    for _ in range(2000):
      mid = 0.5 * (lo + hi)
      if not lo < mid < hi:
        break
      if f(mid) > 0:
        lo = mid
      else:
        hi = mid
    return 0.5 * (lo + hi)

  blocks = []  # [start, end, value]
  for i in range(n):
    blocks.append([i, i + 1, block_value(s[i:i + 1], w[i])])
    while len(blocks) > 1 and blocks[-2][2] <= blocks[-1][2]:
      b = blocks.pop()
      blocks[-1][1] = b[1]
      st, en = blocks[-1][0], blocks[-1][1]
      blocks[-1][2] = block_value(s[st:en], float(np.sum(w[st:en])))
  v = np.concatenate([[val] * (en - st) for st, en, val in blocks])
  y = g((s - v) / l)
  out_sorted = y + l * np.sign(y) * np.abs(y) ** (p - 1.0)
  out = np.empty(n)
  out[order] = out_sorted
  return np.sign(x) * out


# ---------------------------------------------------------------------------------------
# Permutahedron (proofs/isotonic_dual.md): PAV on the isotonic dual
# ---------------------------------------------------------------------------------------


def _perm_block_value(reg, sb, wb, l):
  """gamma with sum_B g((s_i - gamma)/l) = W_B (g = the unclipped link)."""
  m = sb.size
  if isinstance(reg, PNormRef) and reg.p == 2.0:
    return (float(np.sum(sb)) - l * wb) / m
  if isinstance(reg, EntropyRef):  # sum exp((s - gamma)/l) = W
    top = float(np.max(sb))
    return top + l * (math.log(math.fsum(np.exp((sb - top) / l).tolist())) - math.log(wb))
  u = float(reg.link_inv(wb / m))
  lo, hi = float(np.min(sb)) - l * u, float(np.max(sb)) - l * u
  f = lambda gam: math.fsum(reg.link((sb - gam) / l).tolist()) - wb
  if lo == hi:
    return lo
  for _ in range(3000):
    mid = 0.5 * (lo + hi)
    if not lo < mid < hi:
      break
    if f(mid) > 0:
      lo = mid
    else:
      hi = mid
  return 0.5 * (lo + hi)


def permutahedron_row(theta, w, l, reg, with_blocks=False):
  """argmax_{y in P(w)} <theta, y> - l sum omega(y_i) for one row (PAV on the dual)."""
  theta, w = np.asarray(theta, np.float64), np.asarray(w, np.float64)
  n = theta.size
  order = np.argsort(-theta, kind="stable")
  s = theta[order]
  ws = np.sort(w)[::-1]
  blocks = []
  for i in range(n):
    blocks.append([i, i + 1, _perm_block_value(reg, s[i:i + 1], ws[i], l)])
    while len(blocks) > 1 and blocks[-2][2] <= blocks[-1][2]:
      b = blocks.pop()
      blocks[-1][1] = b[1]
      st, en = blocks[-1][0], blocks[-1][1]
      blocks[-1][2] = _perm_block_value(reg, s[st:en], float(math.fsum(ws[st:en].tolist())), l)
  v = np.concatenate([[val] * (en - st) for st, en, val in blocks])
  y_sorted = reg.link((s - v) / l)
  y = np.empty(n)
  y[order] = y_sorted
  if with_blocks:
    gaps = [blocks[j][2] - blocks[j + 1][2] for j in range(len(blocks) - 1)]
    return y, dict(blocks=[(b[0], b[1]) for b in blocks], order=order, v=v,
                   min_gap=min(gaps, default=np.inf))
  return y


def permutahedron_tolerance(theta, w, l, reg, *, eps, c=16.0):
  """Per-entry tolerance of an exact permutahedron solver working with unit roundoff eps.

  y_i = g((s_i - v_i)/l) is evaluated at a block value v_i rounded to c eps (|s_i| + |v_i|)
  (and s_i - v_i rounded likewise): we take the change of y_i under that perturbation
  (``sens``), plus the total change over its block (the block sum is fixed), plus c eps |y_i|.
  """
  theta = np.asarray(theta, np.float64)
  y, info = permutahedron_row(theta, w, l, reg, with_blocks=True)
  order = info["order"]
  s, v = theta[order], info["v"]
  d = (s - v) / l
  delta = c * eps * (np.abs(s) + np.abs(v)) / l
  y0 = reg.link(d)
  sens = np.maximum(np.abs(reg.link(d + delta) - y0), np.abs(reg.link(d - delta) - y0))
  tol_sorted = sens + c * eps * np.abs(y0)
  for st, en in info["blocks"]:
    tol_sorted[st:en] += math.fsum(sens[st:en].tolist())
  tol = np.empty_like(tol_sorted)
  tol[order] = tol_sorted
  return tol


def soft_sort_tolerance(x, l=1.0, p=2.0, regularizer_name=None, descending=False, *, eps):
  reg = regularizer(regularizer_name, p)

  def row(r, ll):
    t = permutahedron_tolerance(np.arange(r.size, 0, -1.0), r, ll, reg, eps=eps)
    return t if descending else t[::-1]

  return _apply_rows(row, x, -1, l)


def soft_rank_tolerance(x, l=1.0, p=2.0, regularizer_name=None, descending=False, *, eps):
  reg = regularizer(regularizer_name, p)

  def row(r, ll):
    return permutahedron_tolerance(-r if descending else r, np.arange(r.size, 0, -1.0), ll, reg, eps=eps)

  return _apply_rows(row, x, -1, l)


def _apply_rows(fn, x, axis, *per_row):
  moved, rows = _rows(x, axis)
  extra = [_per_row(v, moved.shape[:-1]) for v in per_row]
  out = np.array([fn(r, *vals) for r, *vals in zip(rows, *extra)])
  return np.moveaxis(out.reshape(moved.shape), -1, axis)


def soft_rank(x, l=1.0, p=2.0, regularizer_name=None, axis=-1, descending=False):
  """argmax_{y in P((n..1))} <x, y> - l Omega(y) (descending: of -x)."""
  reg = regularizer(regularizer_name, p)

  def row(r, ll):
    n = r.size
    return permutahedron_row(-r if descending else r, np.arange(n, 0, -1.0), ll, reg)

  return _apply_rows(row, x, axis, l)


def soft_sort(x, l=1.0, p=2.0, regularizer_name=None, axis=-1, descending=False):
  """Descending: argmax_{y in P(x)} <(n..1), y> - l Omega(y). Ascending (even Omega, the
  p-norms): the reverse of the descending one, since <(1..n), y> = <(n+1) - (n..1), y>
  and sum y is fixed on P(x)."""
  reg = regularizer(regularizer_name, p)

  def row(r, ll):
    n = r.size
    y = permutahedron_row(np.arange(n, 0, -1.0), r, ll, reg)
    return y if descending else y[::-1]

  return _apply_rows(row, x, axis, l)


def soft_quantile(x, q, l=1.0, p=2.0, axis=-1):
  """Linear interpolation of the ascending reference soft sort at q (n - 1)."""
  srt = np.moveaxis(soft_sort(x, l, p, axis=axis), axis, -1)
  n = srt.shape[-1]
  q = np.asarray(q, np.float64)
  pos = q * (n - 1)
  lo = np.clip(np.floor(pos).astype(int), 0, n - 1)
  hi = np.clip(lo + 1, 0, n - 1)
  frac = pos - lo
  pick = lambda i: np.take(srt, i.ravel(), axis=-1).reshape(srt.shape[:-1] + q.shape)
  return pick(lo) * (1 - frac) + pick(hi) * frac


def hard_ranks(x):
  """1-based ascending ranks, ties averaged (the l -> 0 limit of soft_rank)."""
  x = np.asarray(x, np.float64)
  return np.array([np.sum(x < v) + (np.sum(x == v) + 1) / 2.0 for v in x])


# ---------------------------------------------------------------------------------------
# Hard operators
# ---------------------------------------------------------------------------------------


def _topk_indices(v, k):
  """The k largest (NaN above everything), ties: lower index first."""
  key = lambda i: (0 if math.isnan(v[i]) else 1, 0.0 if math.isnan(v[i]) else -v[i], i)
  return sorted(range(len(v)), key=key)[:k]


def hard_topk_mask(x, k, axis=-1):
  def row(r):
    y = np.zeros(r.size)
    y[_topk_indices(r.tolist(), k)] = 1.0
    return y
  return _apply_rows(row, x, axis)


def hard_topk_mag(x, k, axis=-1):
  def row(r):
    y = np.zeros(r.size)
    idx = _topk_indices(np.abs(r).tolist(), k)
    y[idx] = r[idx]
    return y
  return _apply_rows(row, x, axis)


# ---------------------------------------------------------------------------------------
# sparse_softmax: projection onto {simplex, at most k non-zeros} by brute force
# ---------------------------------------------------------------------------------------


def sparsemax(v):
  """Euclidean projection onto the probability simplex (sort-based, Held et al.)."""
  v = np.asarray(v, np.float64)
  u = np.sort(v)[::-1]
  css = np.cumsum(u)
  j = np.arange(1, v.size + 1)
  r = j[u - (css - 1) / j > 0][-1]
  tau = (css[r - 1] - 1) / r
  return np.maximum(v - tau, 0.0)


def _sparsemax_exact(v):
  """sparsemax in rationals: tau = (sum of the r largest - 1) / r, r the support size."""
  u = sorted(v, reverse=True)
  css, r, total = Fraction(0), 0, Fraction(0)
  for j, uj in enumerate(u, start=1):
    css += uj
    if uj - (css - 1) / j > 0:
      r, total = j, css
  tau = (total - 1) / r
  return [max(vi - tau, Fraction(0)) for vi in v]


def sparse_softmax_row(z, k):
  """(p, distance): the best over all supports S of size min(k, n) of the simplex projection
  of z_S, zeros elsewhere (larger supports include every smaller one as a face). Exact
  rational distances; among exactly equal ones the first support in lexicographic order
  (lower indices: the documented tie rule)."""
  z = np.asarray(z, np.float64)
  n = z.size
  zq = [Fraction(v) for v in z]
  best, best_d = None, None
  for s in itertools.combinations(range(n), min(k, n)):
    idx = list(s)
    p = [Fraction(0)] * n
    for i, v in zip(idx, _sparsemax_exact([zq[i] for i in idx])):
      p[i] = v
    d = sum((pi - zi) ** 2 for pi, zi in zip(p, zq))
    if best is None or d < best_d:
      best, best_d = p, d
  return np.array([float(v) for v in best]), float(best_d)


# ---------------------------------------------------------------------------------------
# GradTopK and the iterative softmax
# ---------------------------------------------------------------------------------------


def grad_topk_row(x, k, l):
  """y_i = P(i in S) for q(S) ~ exp(sum_{j in S} x_j / l) over k-subsets (brute force).

  Docstring: -inf entries get 0 if at least k entries are finite (else NaN); NaN or +inf -> NaN.
  """
  x = np.asarray(x, np.float64)
  n = x.size
  if np.isnan(x).any() or (x == np.inf).any() or np.sum(np.isfinite(x)) < k:
    return np.full(n, np.nan)
  subsets = [list(s) for s in itertools.combinations(range(n), k)]
  scores = np.array([np.sum(x[s]) / l for s in subsets])
  logw = scores - np.max(scores)
  wts = np.exp(logw)
  total = math.fsum(wts.tolist())
  y = np.zeros(n)
  for i in range(n):
    y[i] = math.fsum([w for w, s in zip(wts, subsets) if i in s]) / total
  return y


def iterative_softmax_row(x, k, l, variant="logits", digits=60):
  """Seed's iterative softmax in `digits`-digit decimal arithmetic, from the docstring.

  logits: u = (x - min x)/l, p <- p + softmax((1 - p) u), k rounds.
  weighted: p <- p + w e^u / <w, e^u>, w = 1 - p, u = x / l.
  """
  with localcontext() as ctx:
    ctx.prec = digits
    xs = [Decimal(float(v)) for v in x]
    ld = Decimal(float(l))
    p = [Decimal(0)] * len(xs)
    if variant == "logits":
      mn = min(xs)
      u = [(v - mn) / ld for v in xs]
      for _ in range(k):
        e = [(1 - pi) * ui for pi, ui in zip(p, u)]
        top = max(e)
        ex = [(v - top).exp() for v in e]
        tot = sum(ex)
        p = [pi + ei / tot for pi, ei in zip(p, ex)]
    else:
      u = [v / ld for v in xs]
      top = max(u)
      ex = [(v - top).exp() for v in u]
      for _ in range(k):
        wv = [(1 - pi) * ei for pi, ei in zip(p, ex)]
        tot = sum(wv)
        p = [pi + wi / tot for pi, wi in zip(p, wv)]
    return np.array([float(v) for v in p])


# ---------------------------------------------------------------------------------------
# Losses
# ---------------------------------------------------------------------------------------


def _logsumexp(v):
  v = np.asarray(v, np.float64)
  top = np.max(v)
  return top + math.log(math.fsum(np.exp(v - top).tolist()))


def smooth_topk_svm_row(s, c, k, tau, alpha):
  """tau log sum_{|S|=k} exp((alpha [c not in S] + mean_S s)/tau)
     - tau log sum_{|S|=k, c in S} exp(mean_S s / tau), brute force."""
  s = np.asarray(s, np.float64)
  n = s.size
  a, b = [], []
  for subset in itertools.combinations(range(n), k):
    mean = math.fsum(s[list(subset)].tolist()) / k
    a.append((alpha * (c not in subset) + mean) / tau)
    if c in subset:
      b.append(mean / tau)
  return tau * (_logsumexp(a) - _logsumexp(b))


def hard_topk_svm_row(s, c, k, alpha):
  """max(0, mean(top_k(s_{!=c} + alpha)) - (sum top_{k-1}(s_{!=c}) + s_c)/k)."""
  s = np.asarray(s, np.float64)
  others = np.sort(np.delete(s, c))[::-1]
  first = np.mean(others[:k] + alpha)
  second = (np.sum(others[:k - 1]) + s[c]) / k
  return max(0.0, first - second)


def fenchel_young_row(theta, target, k, l, reg):
  """f*(theta) + l Omega(target) - <theta, target>, f* at the reference mask."""
  y, _ = mask_row(theta, k, l, reg)
  conj = math.fsum((theta * y).tolist()) - l * math.fsum(reg.omega(y).tolist())
  return conj + l * math.fsum(reg.omega(target).tolist()) - math.fsum((theta * target).tolist()), y


def topk_cross_entropy_row(scores, c, p_k, l, p, top1_mode="sm", eps=1e-7, m=None):
  """difftopk's top-k cross-entropy on the reference mask (docstring formulas)."""
  scores = np.asarray(scores, np.float64)
  if m is not None:
    others = [i for i in np.argsort(-scores, kind="stable") if i != c][:m - 1]
    scores = np.concatenate([[scores[c]], scores[others]])
    c = 0
  reg = PNormRef(p)
  kmax = len(p_k)
  q = {kk: mask_row(scores, kk, l, reg)[0][c] for kk in range(1, kmax + 1) if p_k[kk - 1] > 0}
  sm = np.exp(scores - _logsumexp(scores))[c]
  nll = lambda d: -math.log((1 - 2 * eps) * d + eps)
  rest = math.fsum([p_k[kk - 1] * q[kk] for kk in q if kk >= 2])
  if top1_mode == "sm":
    return nll(p_k[0] * sm + rest)
  if top1_mode == "smce":
    return -p_k[0] * math.log(sm) + sum(p_k[1:]) * nll(rest)
  return nll(math.fsum([p_k[kk - 1] * q[kk] for kk in q]))


def bisect_mask(x, k, l, p=4.0 / 3.0):
  """The p-norm soft top-k mask of one row (a flat vector) by 200 float64 bisection steps on lam."""
  x = np.asarray(x, np.float64)
  if k == 0:
    return np.zeros_like(x)
  if k == x.size:
    return np.ones_like(x)
  mask = lambda lam: np.minimum(1.0, (np.maximum(x - lam, 0) / l) ** (1.0 / (p - 1.0)))
  lo, hi = x.min() - 2 * l, x.max()
  for _ in range(200):
    mid = 0.5 * (lo + hi)
    lo, hi = (mid, hi) if mask(mid).sum() > k else (lo, mid)
  return mask(0.5 * (lo + hi))


# ---------------------------------------------------------------------------------------
# Near-binary rows of the dense masks (sigmoid, Laplace, entropy): high-precision decimal
# ---------------------------------------------------------------------------------------


def _dec_mask_and_slope(name, u):
  """(g(u), g'(u)) of the mask ``name`` at the Decimal ``u``, in the current context."""
  one = Decimal(1)
  if name in ("sigmoid", "binary_entropy"):
    e = (-abs(u)).exp()
    tail = e / (one + e)  # sigmoid(-|u|)
    g = one - tail if u > 0 else tail
    return g, tail * (one - tail)
  if name == "laplace":
    e = (-abs(u)).exp() / 2
    return (one - e if u >= 0 else e), e
  if name == "entropy":
    if u >= 0:
      return one, Decimal(0)
    e = u.exp()
    return e, e
  raise ValueError(name)


def dense_mask_row_hp(x, k, l, name, *, digits=None):
  """The soft top-k mask of one finite row (0 < k < n) under a dense regularizer
  (``"sigmoid"``, ``"laplace"``, ``"entropy"``) by bisection in decimal arithmetic with
  enough digits that every tail ``1 - y_i`` or ``y_i`` down to e^-(row spread / l) is
  resolved (no complement form or other rearrangement: plain ``sum_i y_i - k`` in
  brute precision), and its derivatives by the implicit function theorem on
  ``sum_i g((x_i - lam) / l) = k``: ``dy_i/dk = g'_i / S`` and
  ``dy_i/dx_j = (g'_i / l)(delta_ij - g'_j / S)``, ``S = sum_j g'_j``.

  ``x``, ``k``, ``l`` are taken exactly as the floats given (a float32 input: pass its
  values). Returns a dict of Decimals and float64 arrays: ``lam`` (the threshold),
  ``y``, ``dk`` (dy/dk), ``slope`` (g'(z_i), for dy/dx) and ``z`` ((x_i - lam) / l,
  float64).
  """
  xs = [Decimal(float(v)) for v in np.asarray(x, np.float64).ravel()]
  n = len(xs)
  assert 0 < float(k) < n
  spread = (max(xs) - min(xs)) / Decimal(float(l))
  if digits is None:
    # The root lies within a few strengths of [x_(k+1), x_(k)], so the largest tail at
    # it is at least ~e^-(spread / 2 + 10): these digits resolve it to ~1e-40.
    digits = 45 + int((float(spread) / 2 + 10) / math.log(10))
  with localcontext() as ctx:
    ctx.prec = digits
    ctx.Emin, ctx.Emax = -10**6, 10**6
    kd, ld = Decimal(float(k)), Decimal(float(l))
    z = [v / ld for v in xs]

    def phi(t):
      vals = [_dec_mask_and_slope(name, zi - t) for zi in z]
      return sum((g for g, _ in vals), Decimal(0)) - kd, sum((d for _, d in vals), Decimal(0))

    lo, hi = min(z) - 80, max(z) + 80  # phi(lo) > 0 > phi(hi) for 0 < k < n
    assert phi(lo)[0] > 0 > phi(hi)[0]
    # Safeguarded Newton (bisection where a step leaves the bracket) down to 2^-110 of
    # the strength: every derivative to ~1e-30 relative.
    t = (lo + hi) / 2
    for _ in range(2000):
      value, slope = phi(t)
      if value == 0:
        lo = hi = t
        break
      if value > 0:
        lo = t
      else:
        hi = t
      if hi - lo <= Decimal(2) ** -110:
        break
      step = value / slope if slope > 0 else None
      if step is not None and lo < t + step < hi and abs(step) > Decimal(2) ** -120:
        t = t + step
      elif step is not None and abs(step) <= Decimal(2) ** -120:
        lo = hi = t + step
        break
      else:
        t = (lo + hi) / 2
    else:
      raise AssertionError("no convergence")
    t = (lo + hi) / 2
    vals = [_dec_mask_and_slope(name, zi - t) for zi in z]
    total = sum((s for _, s in vals), Decimal(0))
    return dict(lam=t * ld, t=t,
                y=np.array([float(g) for g, _ in vals]),
                dk=np.array([float(s / total) for _, s in vals]),
                slope=np.array([float(s) for _, s in vals]),
                slope_sum=total,
                z=np.array([float(zi - t) for zi in z]))


def dense_mask_vjp_hp(ref, w, l):
  """``d/dx sum_i w_i y_i`` from :func:`dense_mask_row_hp`'s result (in decimal):
  ``(g'_i / l)(w_i - c)``, ``c = sum_j w_j g'_j / S``; returns (gradient, a per-entry
  error scale ``(g'_i / l)(|w_i| + |c|)``) as float64 arrays."""
  with localcontext() as ctx:
    ctx.prec = 60
    ctx.Emin, ctx.Emax = -10**6, 10**6
    slopes = [Decimal(float(s)) for s in ref["slope"]]
    total = sum(slopes, Decimal(0))
    ws = [Decimal(float(v)) for v in w]
    c = sum((wi * si for wi, si in zip(ws, slopes)), Decimal(0)) / total
    ld = Decimal(float(l))
    grad = [si / ld * (wi - c) for wi, si in zip(ws, slopes)]
    scale = [si / ld * (abs(wi) + abs(c)) for wi, si in zip(ws, slopes)]
    return np.array([float(g) for g in grad]), np.array([float(s) for s in scale])
