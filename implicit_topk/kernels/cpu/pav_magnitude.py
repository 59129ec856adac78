"""The threshold of the soft top-k in magnitude by PAV, row by row.

The magnitude operator of Sander et al. 2023 ("Fast, differentiable and sparse top-k:
a convex analysis perspective", ICML) with the p-norm regularizer: its dual is an
isotonic problem solved by the PAV loop of :mod:`implicit_topk.kernels.cpu.isotonic_pav`
on ``|x|`` sorted (``proofs/magnitude_threshold.md``).

Pure numpy + numba (no jax).
"""

import math

import numpy as np
from numba import njit

from implicit_topk.kernels.cpu.isotonic_pav import (CUBIC, GENERAL, KINDS, P2, _EPS, _MAXIT,
                                                _block_eval, _clip, _pav_row, _per_row,
                                                _select)
from implicit_topk.kernels.cpu.radix_sort import sort_ascending

# ============================================================================
# top-k in magnitude (implicit_topk.magnitude, proofs/magnitude_threshold.md)
# ============================================================================
#
# With ``s`` = |x| sorted descending and ``w = (1, .., 1, f, 0, .., 0)`` the
# magnitude dual is the isotonic problem
#
#     min_{v_1 >= ... >= v_n}  sum_i [ l * omega*((s_i - v_i) / l) + w_i v_i^2 / 2 ]
#
# (the reference's, with real k).  Its block condition is
#
#     F_B(v) = sum_{i in B} g((s_i - v) / l) - v W_B = 0,      W_B = sum_B w_i,
#
# strictly decreasing in v and additive over merged blocks, so the same PAV
# loop applies with these block solvers and a singleton that solves F = 0 on
# one element (bracket [0, s_i]).  The solution has at most one block with a
# fractional coordinate; its value is the threshold ``lam`` of
# ``soft_topk_mag``.  Rows are laid out as |x| sorted ascending (radix sort).


#
# Accuracy.  The block values (and lam) can sit many decades below the block's
# entries (lam ~ 2 s^3 / l^3 for p = 4/3 and s << l), or within a few ulps of
# them (p near 1: s - lam ~ l (k lam)^(p-1)).  Every value is therefore solved
# to a few ulps *relative to itself* (an absolute tolerance of a few ulps of
# the entries, or ``mean + t`` from a cubic centred at the mean, leaves no
# correct digit in lam ~ 1e-51 s, and Newton on F alone needs hundreds of
# steps near an entry for large a).  The singleton and general solvers
# (:func:`_mag_root`) bracket the root with a positive lower end
# (:func:`_mag_lower`), bisect float64 bit patterns and take Newton steps on F
# or on log(G / (W v)); the cubic solves Cardano without cancellation and,
# when the root is below half the block mean, redoes it by Newton on the cubic
# around the mean (still O(1)); the fractional block's value, lam, is finally
# refined on the data (O(|B|) per step, once per row).  The exponent is the
# output map's (:func:`_mag_select`).


_TINY = 5e-324  # the smallest positive float64: lower bracket end when the bound underflows
# p = 4/3 rows whose nonzero magnitudes and strength lie in this range take the closed
# form of the cubic (its moments, s^3 and l^3 s summed over a block, stay normal floats
# far from overflow); others Newton's method on the data (the "general" solvers, a = 3).
_CUBIC_RANGE = (2.0**-200, 2.0**200)


@njit(cache=True)
def _pow(z, a):
    """z^a for z >= 0 (exact for a = 1 and 3)."""
    if a == 1.0:
        return z
    if a == 3.0:
        return z * z * z
    return z ** a


@njit(cache=True)
def _scaled_pow(z, l, a):
    """``g(z / l) = (z / l)^a`` for ``z >= 0``; for ``a < 1`` as ``z^a l^-a``, where
    ``z / l`` can leave the float range while the result does not."""
    if a < 1.0:
        return z ** a * l ** -a
    return _pow(z / l, a)


@njit(cache=True)
def _mag_lower(s, i0, i1, W, l, a):
    """A positive lower bound on the value of the block ``s[i0:i1]`` (descending,
    > 0): at ``v = min(s_min / 2, m g(s_min / (2 l)) / W)`` every term is at least
    ``g(s_min / (2 l))``, so ``F_B(v) >= m g(s_min / (2 l)) - W v >= 0``."""
    half = 0.5 * s[i1 - 1]
    if W > 0.0:
        c = (i1 - i0) * _scaled_pow(half, l, a) / W
        if c < half:
            half = c
    return max(half, _TINY)


@njit(cache=True)
def _mag_mid(lo, hi):
    """Bisection point of ``0 <= lo < hi``: the midpoint of the float64 bit
    patterns (geometric across binades, arithmetic within one), so any bracket
    shrinks to adjacent floats in at most 64 steps, also when the root is
    decades below ``hi`` or a few ulps below an entry."""
    if not (lo >= 0.0):
        return lo + 0.5 * (hi - lo)
    a = np.float64(lo).view(np.int64)
    b = np.float64(hi).view(np.int64)
    return np.int64(a + (b - a) // 2).view(np.float64)


@njit(cache=True)
def _mag_log_residual(F, W, v):
    """``log(G / (W v)) = log1p(F / (W v))`` for ``F = G - W v``, ``W v > 0``:
    the sign of F, -inf where ``G <= 0``."""
    Wv = W * v
    if not (Wv > 0.0):
        return np.inf if F > 0.0 else -np.inf
    r = F / Wv
    if not (r > -1.0):
        return -np.inf
    return math.log1p(r)


@njit(cache=True)
def _mag_root(s, i0, i1, W, l, a, lo, hi, v):
    """Root of ``F(v) = G(v) - W v``, ``G(v) = sum_{i0<=i<i1} g((s_i - v) / l)``
    (strictly decreasing, ``W > 0``), in ``[lo, hi]``, ``0 < lo < hi < inf``, to
    a few ulps relative to the root.

    Safeguarded Newton: on F where G is flat (``v G' <= G``: the root far
    below the entries, F nearly linear), on ``H = log(G / (W v))`` where G is
    steep (a power law in ``s - v`` near an entry, where Newton on F converges
    only by a factor ``1 - 1/a`` per step for large ``a``); a step is taken
    while it stays inside the bracket and |H| at least halves, otherwise the
    bracket's float64 bit patterns are bisected (:func:`_mag_mid`).  A step
    below 2 eps v is stretched to 2 eps v towards the root, so that the next
    evaluation brackets it (no residual test: near an entry leaving 0 with
    a < 1 the slope is huge and F is not small although the step is, found by
    hypothesis: x = [0.25, 1e-40]).  Stops when the bracket is within 2 eps of
    its upper end and returns the interpolation of H on it.  If rounding puts
    the root outside ``[lo, hi]`` the nearest end is returned.
    """
    if not (lo < hi):
        return hi
    Hlo = np.inf
    Hhi = -np.inf
    if not (lo < v < hi):
        v = _mag_mid(lo, hi)
    Hprev = np.inf
    for _ in range(_MAXIT):
        G, dG = _block_eval(s, i0, i1, v, l, a)
        F = G - W * v
        if F == 0.0 or np.isnan(F):
            return v
        H = _mag_log_residual(F, W, v)
        if F > 0.0:
            lo = v
            Hlo = H
        else:
            hi = v
            Hhi = H
        if hi - lo <= 2.0 * _EPS * hi:
            if Hlo < np.inf and Hhi > -np.inf:
                return lo + (hi - lo) * (Hlo / (Hlo - Hhi))
            return hi if Hhi > -np.inf else lo
        vn = _mag_mid(lo, hi)
        if abs(H) < np.inf and abs(H) <= 0.5 * Hprev and dG < np.inf:
            if v * dG <= G:
                step = F / (dG + W)
            else:
                step = H / (dG / G + 1.0 / v)
            if abs(step) < 2.0 * _EPS * v:
                step = math.copysign(2.0 * _EPS * v, F)
            if lo < v + step < hi:
                vn = v + step
        Hprev = abs(H)
        v = vn
    return v


@njit(cache=True)
def _mag_refine(s, i0, i1, W, l, a, lo, hi, v):
    """:func:`_mag_root` in ``[lo, hi]`` narrowed to ``[_mag_lower, s_max]``
    (for ``W > 0`` the root is below the block's largest entry)."""
    lo2 = max(lo, _mag_lower(s, i0, i1, W, l, a))
    hi2 = min(hi, s[i0]) if W > 0.0 else hi
    if lo2 < hi2:
        return _mag_root(s, i0, i1, W, l, a, lo2, hi2, v)
    return _mag_root(s, i0, i1, W, l, a, lo, hi, v)


@njit(cache=True)
def _solve_mag_p2(s, i0, i1, m, W, mean, M2, M3, l, a, lo, hi):
    """p = 2: sum (s_i - v) / l = v W  =>  v = mean / (1 + l W / m).  O(1)."""
    return _clip(mean / (1.0 + l * W / m), lo, hi)


@njit(cache=True)
def _solve_mag_cubic(s, i0, i1, m, W, mean, M2, M3, l, a, lo, hi):
    """p = 4/3: sum (s_i - v)^3 = l^3 W v.  With t = v - mean,
    t^3 + P t + Q = 0,  P = 3 sigma2 = 3 (M2 + l^3 W / 3) / m,
    Q = (l^3 W mean - M3) / m  (one real root, P >= 0).  O(1).

    Cardano with the cancellation-free sign choice
    u = -cbrt(Q/2 + sign(Q) sqrt(Q^2/4 + sigma2^3)) and, instead of
    t = u - sigma2 / u (which cancels when |Q| << sigma2^(3/2)), the same root
    as t = -Q / (u^2 + sigma2 + sigma2^2 / u^2) (the identity
    u^3 + (-sigma2/u)^3 = -Q; the denominator has no cancellation).  When
    ``v = mean + t < mean / 2``, ``mean + t`` cancels: v is redone by Newton on
    C(v) = sum (s_i - v)^3 - l^3 W v = M3 + 3 d M2 + m d^3 - l^3 W v,
    d = mean - v (no cancellation for s >= 0 and v < mean / 2), which is
    convex and decreasing for v < mean: from v = 0 (C(0) > 0) the iterates
    increase to the root.
    """
    l3W = l * l * l * W
    inv_m = 1.0 / m
    sigma2 = (M2 + l3W / 3.0) * inv_m
    if sigma2 < 0.0:
        sigma2 = 0.0
    Q = (l3W * mean - M3) * inv_m
    r = 1.0
    D2 = 0.25 * Q * Q + sigma2 * sigma2 * sigma2
    if not (1e-280 <= D2 <= 1e280):
        if Q == 0.0 and sigma2 == 0.0:  # t = 0
            return _clip(mean, lo, hi)
        r = max(np.cbrt(abs(Q)), math.sqrt(sigma2))
        if not (r < np.inf):
            return 0.5 * (lo + hi)
        sigma2 = sigma2 / (r * r)
        Q = Q / (r * r * r)
        D2 = 0.25 * Q * Q + sigma2 * sigma2 * sigma2
    u = -np.cbrt(0.5 * Q + math.copysign(math.sqrt(D2), Q))
    if u == 0.0:
        t = 0.0
    else:
        t = -Q / (u * u + sigma2 + (sigma2 / u) * (sigma2 / u))
    v = mean + r * t
    if v >= 0.5 * mean or not (mean > 0.0):
        return _clip(v, lo, hi)
    M2 = max(M2, 0.0)
    vn = 0.0
    for _ in range(_MAXIT):
        d = mean - vn
        C = M3 + 3.0 * d * M2 + m * d * d * d - l3W * vn
        if not (C > 0.0):  # at the root (the iterates approach it from below)
            break
        step = C / (3.0 * (M2 + m * d * d) + l3W)
        if not (step < np.inf):  # overflow: keep Cardano's value
            return _clip(v, lo, hi)
        vn += step
        if step <= 2.0 * _EPS * vn:
            break
    return _clip(vn, lo, hi)


@njit(cache=True)
def _solve_mag_general(s, i0, i1, m, W, mean, M2, M3, l, a, lo, hi):
    """Any p: :func:`_mag_refine` on F(v) = G(v) - v W in the bracket of the
    two merged blocks' values."""
    return _mag_refine(s, i0, i1, W, l, a, lo, hi, _mag_mid(lo, hi))


@njit(cache=True)
def _mag_singleton_p2(s, i, w, l, a, pm1):
    return s[i] / (1.0 + l * w)


@njit(cache=True)
def _mag_singleton_cubic(s, i, w, l, a, pm1):
    if w == 0.0:
        return s[i]
    return _solve_mag_cubic(s, i, i + 1, 1.0, w, s[i], 0.0, 0.0, l, a, 0.0,
                            s[i])


@njit(cache=True)
def _mag_singleton_general(s, i, w, l, a, pm1):
    """g((s - v) / l) = w v.  Since 0 < v < s: w v < g(s / l) and
    s - v = l (w v)^(p-1) < l (w s)^(p-1), so the root lies in
    [s - l (w s)^(p-1), g(s / l) / w] (tight when v ~ s and when v << s
    respectively; widened by the rounding of the bounds)."""
    si = s[i]
    if w == 0.0:
        return si
    hi = _scaled_pow(si, l, a) / w
    hi = min(si, hi * (1.0 + 4.0 * (a + 2.0) * _EPS))
    # l (w s)^(p-1), as (w s l^a)^(p-1) for p > 2, where (w s)^(p-1) alone can underflow
    drop = l * (w * si) ** pm1 if a >= 1.0 else (w * si * l ** a) ** pm1
    lo = max(si - drop - 4.0 * _EPS * si, 0.0)
    v = hi
    if lo > 0.0 and lo < hi:
        v = lo + 0.5 * (hi - lo)
    return _mag_refine(s, i, i + 1, w, l, a, lo, hi, v)


@njit(cache=True)
def _solve_mag_any(kind, s, i0, i1, m, W, mean, M2, M3, l, a, lo, hi):
    """The magnitude block solver of ``kind``."""
    if kind == P2:
        return _solve_mag_p2(s, i0, i1, m, W, mean, M2, M3, l, a, lo, hi)
    if kind == CUBIC:
        return _solve_mag_cubic(s, i0, i1, m, W, mean, M2, M3, l, a, lo, hi)
    return _solve_mag_general(s, i0, i1, m, W, mean, M2, M3, l, a, lo, hi)


@njit(cache=True)
def _mag_singleton_any(kind, s, i, w, l, a, pm1):
    """The magnitude singleton of ``kind``."""
    if kind == P2:
        return _mag_singleton_p2(s, i, w, l, a, pm1)
    if kind == CUBIC:
        return _mag_singleton_cubic(s, i, w, l, a, pm1)
    return _mag_singleton_general(s, i, w, l, a, pm1)


@njit(cache=True)
def _mag_blocks(kind, s, w, l, a, pm1):
    """PAV on the magnitude dual (one compiled loop for every kind): (number of
    blocks, block starts, block values)."""
    n = s.shape[0]
    bstart, bv = np.empty(n, dtype=np.int64), np.empty(n)
    nb = _pav_row(_solve_mag_any, _mag_singleton_any, kind, s, w, l, a, pm1, 0,
                  3 if kind == CUBIC else 0, bstart, np.empty(n), np.empty(n), np.empty(n),
                  np.empty(n), bv, 0)
    return nb, bstart, bv


@njit(cache=True)
def magnitude_row(kind, xa, k, l, a, pm1):
    """Threshold of one row by the block solvers of ``kind``; ``xa`` = |x| sorted ascending ([finite][inf][nan]).

    ``+inf`` magnitudes are kept (they use up ``k``); ``k_f = k - #inf``:
    ``k_f < 0`` (or not finite) gives NaN, ``k_f == 0`` gives
    ``max_finite + l`` (every finite entry 0); if at most ``k_f`` finite
    entries are nonzero the answer is ``lam = 0`` (output = x).
    """
    n = xa.shape[0]
    if n > 0 and np.isnan(xa[n - 1]):
        return np.nan
    if not (l > 0.0 and l < np.inf):
        return np.nan
    hi_f = n
    while hi_f > 0 and xa[hi_f - 1] == np.inf:
        hi_f -= 1
    kf = k - (n - hi_f)
    if not np.isfinite(kf) or kf < 0.0:
        return np.nan
    if kf == 0.0:
        return np.float64(xa[hi_f - 1]) + l if hi_f > 0 else 0.0
    lo_p = 0  # zeros are below any lam > 0: drop them
    while lo_p < hi_f and xa[lo_p] == 0.0:
        lo_p += 1
    m = hi_f - lo_p
    if m <= kf:
        return 0.0
    if kind == CUBIC and not (_CUBIC_RANGE[0] <= min(xa[lo_p], l)
                              and max(xa[hi_f - 1], l) <= _CUBIC_RANGE[1]):
        kind = GENERAL  # the cubic's moments (s^3, l^3 s) would leave the float range
    s = np.empty(m)
    for i in range(m):
        s[i] = xa[hi_f - 1 - i]
    kint = int(math.floor(kf))
    w = np.zeros(m)
    w[:kint] = 1.0
    if kf > kint:
        w[kint] = kf - kint
    nb, bstart, bv = _mag_blocks(kind, s, w, l, a, pm1)
    # the block holding the fractional coordinates: a merged block, or the
    # singleton with weight f; its value is lam.
    for j in range(nb):
        i0 = bstart[j]
        i1 = bstart[j + 1] if j + 1 < nb else m
        if i1 - i0 > 1 or (w[i0] != 0.0 and w[i0] != 1.0):
            # refined on the data to a few ulps relative to lam (the block
            # solvers' values can carry the error of their closed forms)
            W = 0.0
            for i in range(i0, i1):
                W += w[i]
            return _mag_refine(s, i0, i1, W, l, a, 0.0, np.inf, bv[j])
    # all-binary (integer k): every lam in [s_(k+1), h^{-1}(s_(k))] is a
    # root; h^{-1}(s_(k)) is the value of the k-th (kept) singleton.
    return 0.5 * (s[kint] + bv[kint - 1])


@njit(cache=True)
def magnitude_rows(x, k, l, kind, a, pm1, lam):
    """The threshold of every row of ``x`` (rows, n) into ``lam`` (``|x|`` sorted by a
    radix sort, float64); returns 0."""
    rows, n = x.shape
    xa = np.empty(n)
    scratch = np.empty(n, dtype=np.uint64)
    for b in range(rows):
        sort_ascending(x[b], xa, scratch, True)
        lam[b] = magnitude_row(kind, xa, np.float64(k[b]), np.float64(l[b]), a, pm1)
    return 0


def _mag_select(p):
    """(kind, a, p - 1) for the magnitude kernels, with the exponent of
    ``implicit_topk.regularizers.PNorm``: ``a = 1 / (p - 1)`` is taken as the
    integer it is within 1e-9 of, as the output map and the threshold solver
    take it (p = 1.1 is a = 10, not 9.999999999999991: with |x|/l = 1e-30
    that difference alone moves lam by ~3000 ulps)."""
    if isinstance(p, str):
        raise ValueError(f"magnitude_threshold supports the p-norms only; got {p!r}")
    _select(p)  # validates p
    a = 1.0 / (float(p) - 1.0)
    r = round(a)
    if r >= 1 and abs(a - r) <= 1e-9 * max(1.0, a):
        if r == 1:
            return "p2", 1.0, 1.0
        if r == 3:
            return "cubic", 3.0, 1.0 / 3.0
        return "general", float(r), 1.0 / r
    return "general", a, float(p) - 1.0


def magnitude_threshold(x, k, l, p):
    """Threshold ``lam >= 0`` of the soft top-k in magnitude, row-wise, by PAV.

    ``soft_topk_mag(x)_i = sign(x_i) min(|x_i|, t_i + g(t_i / l))`` with
    ``t_i = (|x_i| - lam)_+`` and ``sum_i min(lam, g(t_i / l)) = k lam``;
    ``lam`` is the value of the fractional block of the magnitude dual (see
    the section comment).  All-binary rows (integer ``k``, the k largest
    magnitudes well separated) return the midpoint of the root interval;
    rows with at most ``k`` nonzero entries return 0.

    Parameters and non-finite handling as :func:`capped_simplex_threshold`
    (``x`` unsorted, (B, n) or (n,); NaN rows give NaN; ``|x_i| = inf``
    entries are kept).  Cost: a radix sort of |x| per row plus O(n) for
    ``p in {2, 4/3}``; other ``p`` solve each kept entry and each merged
    block by safeguarded Newton.  Returns (B,) float64 (a scalar for 1-D x).
    The exponent is PNorm's (:func:`_mag_select`).
    """
    kind, a, pm1 = _mag_select(p)
    x_arr = np.asarray(x)
    squeeze = x_arr.ndim == 1
    if x_arr.dtype not in (np.float32, np.float64):
        x_arr = x_arr.astype(np.float64)
    x2 = np.atleast_2d(x_arr)
    if x2.ndim != 2:
        raise ValueError(f"x must be 2-D (B, n), got shape {np.shape(x)}")
    B = x2.shape[0]
    k64 = _per_row(k, B, "k")
    l64 = _per_row(l, B, "l")
    lam = np.empty(B, dtype=np.float64)
    if B > 0:
        magnitude_rows(np.ascontiguousarray(x2), k64, l64, np.int32(KINDS[kind]), a, pm1, lam)
    return lam[0] if squeeze else lam
