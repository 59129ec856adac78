"""Pool-Adjacent-Violators (PAV) kernels for p-norm regularised top-k.

Pure numpy + numba (this module must not import jax).

Mathematics
-----------
Let ``s_1 >= ... >= s_n`` (sorted descending), ``w`` a nonincreasing weight
vector, ``l > 0`` and ``p > 1``.  With ``omega(y) = |y|^p / p`` and
``a = 1 / (p - 1)``, the inverse of ``omega'`` is ``g(z) = sign(z) |z|^a``.
The isotonic problem

    min_{v_1 >= ... >= v_n}  sum_i [ l * omega*((s_i - v_i) / l) + w_i v_i ]

is solved by PAV: consecutive indices are pooled in blocks ``B`` sharing one
value ``v_B``, the unique root of the (strictly decreasing in ``v``) block
condition

    sum_{i in B} g((s_i - v) / l) = sum_{i in B} w_i =: W_B .

The primal solution ``y_i = g((s_i - v_i) / l)`` lies in the permutahedron of
``w``.  For ``w = (1, .., 1, f, 0, .., 0)`` (``floor(k)`` ones, then the
fractional part ``f`` of ``k`` if nonzero) that permutahedron is the capped
simplex ``{y in [0, 1]^n : sum y = k}`` and ``y_i = clip(g((s_i - lam)/l), 0, 1)``
for a scalar threshold ``lam`` (see :func:`capped_simplex_threshold`).

Design
------
There is exactly one PAV loop, :func:`_pav_row`.  It takes the *block solver*
as a first-class numba function argument (numba compiles one specialisation
per solver).  The loop keeps, for every block, its start index, its weight sum
``W``, its count and mean and, for the cubic solver only, its centred moments
``M2 = sum (s-mean)^2`` and ``M3 = sum (s-mean)^3``; all are merged in O(1)
with the numerically stable Chan/Pebay pairwise update formulas.  After the
scan, the final non-singleton blocks are optionally polished with a few Newton
steps on the data (O(n) in total).  Block solvers (all share one signature):

* ``p == 2``      (:func:`_solve_p2`):  closed form ``v = mean - l W / m``, O(1).
  (Running block sums/means are used instead of differences of global prefix
  sums: same O(1) cost, but no cancellation between large prefix sums.)  One
  Newton step on the data polishes the final blocks (exact for p = 2).
* ``p == 4/3``    (:func:`_solve_cubic`): ``a = 3``; the block condition is the
  cubic ``sum (s_i - v)^3 = l^3 W``.  With ``t = v - mean``,
  ``t^3 + 3 sigma2 t + (l^3 W - M3) / m = 0`` (``sigma2 = M2 / m``) has a single
  real root, obtained in O(1) with a cancellation-free Cardano formula.  The
  final blocks are polished with up to 3 Newton steps on the actual data
  (O(n) in total), which makes the values exact to machine precision.
* any other ``p`` (:func:`_solve_general`): safeguarded Newton / bisection in
  the bracket given by the two merged blocks' values, to machine precision.
  Each solve costs O(|B|) (it evaluates the block condition on the data), so
  general ``p`` is O(n * block size) in the worst case (O(n^2) when one block
  grows to span the whole row, e.g. a large ``l`` in the capped simplex).
  ``p = 1.5`` (``a = 2``) and ``p = 3`` (``a = 1/2``) use pow-free fast paths.

A singleton block has the closed form ``v = s - l sign(W) |W|^(p-1)``.
All accumulations are done in float64, also for float32 data.

:func:`capped_simplex_threshold` first applies an exact reduction: entries
that are provably 1 (``s_i - l >= s_(ceil k)``) or 0 (``s_i <= s_(floor k+1) - l``)
are removed with two binary searches, so the PAV (and its memory) only spans
the window of entries that can be fractional.

Compiled functions use ``cache=True``; the per-row loops use ``prange``.
Numba cannot cache a function that *receives* a dispatcher as an argument
from Python (nor one whose compiled code keeps a dispatcher argument alive),
so each (entry point, solver) pair has a tiny cached ``prange`` wrapper that
references its solver as a global, and the generic row functions (which take
the solver as an argument) are inlined into it (``inline="always"``).
"""

import math

import numpy as np
from numba import njit, prange

__all__ = ["isotonic_pav", "permutahedron_blocks", "capped_simplex_threshold",
           "magnitude_threshold"]

_EPS = np.finfo(np.float64).eps
_MAXIT = 200  # iteration cap for the safeguarded Newton/bisection solver
_P43_TOL = 1e-9  # |p - 4/3| below this selects the cubic solver


# ----------------------------------------------------------------------------
# elementwise helpers
# ----------------------------------------------------------------------------


@njit(cache=True)
def _singleton_value(s, W, l, pm1):
    """Value of a one-element block: ``s - l sign(W) |W|^(p-1)``."""
    if W == 0.0:
        return s
    if W == 1.0:
        return s - l
    return s - l * math.copysign(abs(W) ** pm1, W)


# Links of the other built-in regularizers (``implicit_topk.regularizers``), by code:
# 1 = exp (entropy), 2 = sigmoid (binary entropy), 3 = Laplace CDF; 0 = the p-norm.
LINKS = {"exp": 1, "sigmoid": 2, "laplace": 3}


@njit(cache=True)
def _link_value(z, link):
    """``(g(z), g'(z))`` for a link code."""
    if link == 1:
        e = math.exp(z)
        return e, e
    if link == 2:
        if z >= 0.0:
            g = 1.0 / (1.0 + math.exp(-z))
        else:
            e = math.exp(z)
            g = e / (1.0 + e)
        return g, g * (1.0 - g)
    if z < 0.0:
        e = 0.5 * math.exp(z)
        return e, e
    e = 0.5 * math.exp(-z)
    return 1.0 - e, e


@njit(cache=True)
def _link_inverse(t, link):
    """``omega'(t) = g^{-1}(t)``; -inf/+inf where g never reaches t."""
    if t <= 0.0:
        return -np.inf
    if link == 1:
        return math.log(t)
    if t >= 1.0:
        return np.inf
    if link == 2:
        return math.log(t) - math.log1p(-t)
    if t < 0.5:
        return math.log(2.0 * t)
    return -math.log(2.0 * (1.0 - t))


@njit(cache=True)
def _link_class(W, m, link):
    """+1 if a block's value is +inf (its weight is at the bottom of g's range:
    W = 0 for the links), -1 if -inf (W = m for the bounded sigmoid and Laplace
    links), 0 if finite (always for the p-norm)."""
    if link == 0:
        return 0
    if W <= 0.0:
        return 1
    if link != 1 and W >= m:
        return -1
    return 0


@njit(cache=True)
def _link_singleton(s, i, w, l, a, pm1):
    """One-element block of a link (code in ``a``): ``s - l g^{-1}(w)``."""
    return s[i] - l * _link_inverse(w, int(a))


@njit(cache=True)
def _block_eval(s, i0, i1, v, l, a, link=0):
    """Return ``(G, dG)`` with ``G = sum_{i0<=i<i1} g((s_i - v)/l)`` and
    ``dG = -dG/dv = sum g'((s_i - v)/l) / l  (>= 0, may be +inf for a < 1)``;
    ``g`` is the p-norm link of exponent ``a``, or the link with code ``link``."""
    G = 0.0
    dG = 0.0
    inv_l = 1.0 / l
    if link != 0:
        for i in range(i0, i1):
            g, dg = _link_value((s[i] - v) * inv_l, link)
            G += g
            dG += dg
        dG *= inv_l
    elif a == 1.0:
        for i in range(i0, i1):
            G += (s[i] - v) * inv_l
        dG = (i1 - i0) * inv_l
    elif a == 3.0:
        for i in range(i0, i1):
            z = (s[i] - v) * inv_l
            z2 = z * z
            G += z2 * z
            dG += z2
        dG *= 3.0 * inv_l
    elif a == 2.0:
        for i in range(i0, i1):
            z = (s[i] - v) * inv_l
            az = abs(z)
            G += z * az
            dG += az
        dG *= 2.0 * inv_l
    elif a == 0.5:
        for i in range(i0, i1):
            z = (s[i] - v) * inv_l
            r = math.sqrt(abs(z))
            G += math.copysign(r, z)
            if r > 0.0:
                dG += 0.5 / r
            else:
                dG = np.inf
        dG *= inv_l
    else:
        for i in range(i0, i1):
            z = (s[i] - v) * inv_l
            az = abs(z)
            if az > 0.0:
                t = az ** a
                G += math.copysign(t, z)
                dG += a * t / az
            elif a < 1.0:
                dG = np.inf
        dG *= inv_l
    return G, dG


# ----------------------------------------------------------------------------
# block solvers: solve(s, i0, i1, m, W, mean, M2, M3, l, a, lo, hi) -> v
#   block = s[i0:i1], m = i1 - i0, W = sum of weights, mean/M2/M3 = centred
#   moments of the block, [lo, hi] = bracket (values of the merged blocks).
# ----------------------------------------------------------------------------


@njit(cache=True)
def _clip(v, lo, hi):
    if v < lo:
        return lo
    if v > hi:
        return hi
    return v


@njit(cache=True)
def _solve_p2(s, i0, i1, m, W, mean, M2, M3, l, a, lo, hi):
    """p = 2 (a = 1): sum (s_i - v)/l = W  =>  v = mean - l W / m.  O(1)."""
    return _clip(mean - l * W / m, lo, hi)


@njit(cache=True)
def _solve_cubic(s, i0, i1, m, W, mean, M2, M3, l, a, lo, hi):
    """p = 4/3 (a = 3): sum (s_i - v)^3 = l^3 W, solved in O(1) from moments.

    With t = v - mean:  t^3 + P t + Q = 0,  P = 3 sigma2 >= 0,
    Q = (l^3 W - M3) / m.  Since P >= 0 there is exactly one real root.
    Cardano with the sign choice that avoids cancellation:
        u = -cbrt(Q/2 + sign(Q) sqrt(Q^2/4 + sigma2^3)),   t = u - sigma2 / u.
    If Q^2/4 + sigma2^3 is outside [1e-280, 1e280] (overflow / loss of
    precision to underflow) the cubic is first rescaled by
    r = max(|Q|^(1/3), sqrt(sigma2)); the common path needs one sqrt and
    one cbrt.
    """
    inv_m = 1.0 / m
    sigma2 = M2 * inv_m
    if sigma2 < 0.0:
        sigma2 = 0.0
    Q = (l * l * l * W - M3) * inv_m
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
        t = u - sigma2 / u
    return _clip(mean + r * t, lo, hi)


@njit(cache=True)
def _newton_block(s, i0, i1, m, W, mean, v, l, a, link, lo, hi, slope):
    """Safeguarded Newton / bisection on the block data, O(|B|) per step.

    ``F(v) = G(v) - W (1 - slope + slope v)`` is strictly decreasing (``slope``
    0: the mask's block condition ``G = W``; 1: the magnitude's ``G = v W``);
    the root lies in [lo, hi] (if rounding puts it marginally outside, the
    nearest bracket end is returned, which is within rounding of the root).
    Newton steps from ``v`` are taken while they stay inside the (shrinking)
    bracket and at least halve |F|; otherwise the bracket is bisected.  Stops
    when the bracket or a Newton step is below 4 eps |v| (v's own precision),
    or below 4 eps * scale (the block's scale) while |F| is at rounding level,
    |F| <= 16 eps (|G| + |W v| + |B|).  The first rule alone never ends at a
    root v = 0 under rounding noise; the second alone stops a root far below
    the block's scale (a threshold of 1e-4 between entries 0 and -2.5) at an
    absolute error of eps * scale, many ulps of v (found by hypothesis).
    """
    if not (lo < hi):
        return lo
    tol = 4.0 * _EPS * max(abs(lo), abs(hi), abs(mean))
    if not (lo < v < hi):
        v = 0.5 * (lo + hi)
    Fprev = np.inf
    for _ in range(_MAXIT):
        G, dG = _block_eval(s, i0, i1, v, l, a, link)
        target = W * (1.0 - slope + slope * v)
        F = G - target
        if F == 0.0:
            return v
        if F > 0.0:
            lo = v
        else:
            hi = v
        at_rounding = abs(F) <= 16.0 * _EPS * (abs(G) + abs(target) + m)
        width = hi - lo
        if width <= 4.0 * _EPS * max(abs(lo), abs(hi)) or (width <= tol and at_rounding):
            return 0.5 * (lo + hi)
        D = dG + slope * W
        vn = 0.5 * (lo + hi)
        if D > 0.0 and D < np.inf and abs(F) <= 0.5 * abs(Fprev):
            newton = v + F / D
            if lo < newton < hi:
                vn = newton
        Fprev = F
        step = abs(vn - v)
        if step <= 4.0 * _EPS * max(abs(v), abs(vn)):
            # A step at rounding level is convergence only if the residual is
            # small too: near an entry leaving 0 with a < 1 (p > 2) the slope
            # dG is huge (~|z|^(a-1)) and the Newton step is tiny although F
            # is not; bisect instead (found by hypothesis: x=[0.25, 1e-40]).
            if at_rounding:
                return vn
            vn = 0.5 * (lo + hi)
        elif step <= tol and at_rounding:
            return vn
        v = vn
    return v


@njit(cache=True)
def _solve_general(s, i0, i1, m, W, mean, M2, M3, l, a, lo, hi):
    """Any p: :func:`_newton_block`, started where it is exact if all block
    entries equal their mean."""
    r = W / m
    v = mean - l * math.copysign(abs(r) ** (1.0 / a), r)
    return _newton_block(s, i0, i1, m, W, mean, v, l, a, 0, lo, hi, 0.0)


@njit(cache=True)
def _solve_link(s, i0, i1, m, W, mean, M2, M3, l, a, lo, hi):
    """Sigmoid / Laplace links (code in ``a``): :func:`_newton_block` from the
    value that is exact if all block entries equal their mean."""
    link = int(a)
    v = mean - l * _link_inverse(W / m, link)
    return _newton_block(s, i0, i1, m, W, mean, v, l, 0.0, link, lo, hi, 0.0)


@njit(cache=True)
def _solve_exp(s, i0, i1, m, W, mean, M2, M3, l, a, lo, hi):
    """Entropy (exp link), closed form from the block's log-sum-exp statistics
    (``M2`` = max of the block, ``M3`` = sum of exp((s_i - M2) / l)):
    sum exp((s_i - v)/l) = W  <=>  v = M2 + l log(M3) - l log(W).  O(1)."""
    v = M2 + l * (math.log(M3) - math.log(W))
    if lo < hi:
        return _clip(v, lo, hi)
    return v


@njit(cache=True)
def _polish(s, i0, i1, W, v, l, a, lo, hi, steps, slope=0.0):
    """Up to ``steps`` Newton steps on the actual block data, clipped to
    [lo, hi]; stops early once the step is at rounding level.

    The block condition is ``F(v) = G(v) - W (1 - slope + slope v)``: ``slope = 0``
    for the mask (``G = W``), ``slope = 1`` for the magnitude (``G = v W``)."""
    for _ in range(steps):
        G, dG = _block_eval(s, i0, i1, v, l, a)
        F = G - W * (1.0 - slope + slope * v)
        D = dG + slope * W
        if F == 0.0 or not (D > 0.0 and D < np.inf):
            break
        vn = _clip(v + F / D, lo, hi)
        done = abs(vn - v) <= 2.0 * _EPS * max(abs(v), abs(vn))
        v = vn
        if done:
            break
    return v


# ----------------------------------------------------------------------------
# the one generic PAV loop
# ----------------------------------------------------------------------------


@njit(cache=True, inline="always")
def _block_end(j, nb, end, bstart):
    return bstart[j + 1] if j + 1 < nb else end


@njit(cache=True, inline="always")
def _solve_in_bracket(solve, s, j, i1, stats, link, bstart, bW, bmean, bM2, bM3, l, a):
    """Solves block ``j`` (ending at ``i1``) in the bracket that holds for any
    link: [min_B s - l g^{-1}(W/m), max_B s - l g^{-1}(W/m)] (s is descending)."""
    i0 = bstart[j]
    m = float(i1 - i0)
    z = _link_inverse(bW[j] / m, link)
    M2 = bM2[j] if stats != 0 else 0.0
    M3 = bM3[j] if stats != 0 else 0.0
    return solve(s, i0, i1, m, bW[j], bmean[j], M2, M3, l, a,
                 s[i1 - 1] - l * z, s[i0] - l * z)


@njit(cache=True, inline="always")
def _pav_row(solve, s, w, l, a, pm1, polish_steps, stats,
             bstart, bW, bmean, bM2, bM3, bv, singleton=None, link=0):
    """Generic PAV on one row.  ``solve`` is a block solver (numba function).

    ``singleton(s, i, w_i, l, a, pm1)`` (a numba function, or None for the
    capped-simplex dual's closed form :func:`_singleton_value`) gives the value
    of the one-element block ``[i]``; the magnitude dual and the links pass
    their own.

    ``s`` float64 (n,), ``w`` float64 (n,).  The block structure is written to
    the work arrays (each of length >= n): block ``j`` covers
    ``s[bstart[j]:bstart[j+1]]`` (the last one ends at n) and has value
    ``bv[j]``.  Returns the number of blocks.  If ``polish_steps > 0`` every
    non-singleton final block is refined with that many Newton steps on the
    data (O(n) in total) while keeping the values nonincreasing.
    ``stats`` (a constant per wrapper) selects the block statistics merged in
    O(1) besides count and mean: 3 = centred second and third moments
    ``bM2``/``bM3`` (the cubic solver), 2 = log-sum-exp ``bM2`` = max,
    ``bM3`` = sum exp((s - max)/l) (the entropy solver), 0 = none (``bM2``,
    ``bM3`` may be length-1 dummies and the solver receives zeros).

    Links (``link != 0``) have infinite block values (weight 0: +inf; for the
    sigmoid and Laplace also weight = size: -inf); a violation against an
    infinite neighbour is decided without solving, and a block whose value no
    comparison needs yet (the first block, or one after a -inf block) is left
    pending (NaN) and solved when a comparison or the end needs it.  Without
    this the sigmoid's single block would be re-solved at every merge, O(n^2).
    """
    n = s.shape[0]
    nb = 0
    for i in range(n):
        si = s[i]
        wi = w[i]
        bstart[nb] = i
        bW[nb] = wi
        bmean[nb] = si
        if stats == 3:
            bM2[nb] = 0.0
            bM3[nb] = 0.0
        elif stats == 2:
            bM2[nb] = si
            bM3[nb] = 1.0
        if singleton is None:
            bv[nb] = _singleton_value(si, wi, l, pm1)
        else:
            bv[nb] = singleton(s, i, wi, l, a, pm1)
        nb += 1
        while nb > 1:
            A = bv[nb - 2]
            B = bv[nb - 1]
            if A == -np.inf:
                violated = B != -np.inf
            elif B == np.inf:
                violated = A != np.inf
            elif A == np.inf or B == -np.inf:
                violated = False
            else:
                if np.isnan(A):
                    A = _solve_in_bracket(solve, s, nb - 2, bstart[nb - 1], stats, link,
                                          bstart, bW, bmean, bM2, bM3, l, a)
                    bv[nb - 2] = A
                if np.isnan(B):
                    B = _solve_in_bracket(solve, s, nb - 1, i + 1, stats, link,
                                          bstart, bW, bmean, bM2, bM3, l, a)
                    bv[nb - 1] = B
                violated = A < B
            if not violated:
                break
            j = nb - 2
            mA = float(bstart[j + 1] - bstart[j])
            mB = float(i + 1 - bstart[j + 1])
            m = mA + mB
            inv_m = 1.0 / m
            d = bmean[j + 1] - bmean[j]
            bmean[j] += d * (mB * inv_m)
            M2 = 0.0
            M3 = 0.0
            if stats == 3:  # Chan / Pebay pairwise update of centred moments
                M2A = bM2[j]
                M2B = bM2[j + 1]
                c = mA * mB * inv_m
                M3 = (bM3[j] + bM3[j + 1]
                      + d * d * d * (c * (mA - mB) * inv_m)
                      + 3.0 * d * (mA * M2B - mB * M2A) * inv_m)
                M2 = M2A + M2B + d * d * c
                bM2[j] = M2
                bM3[j] = M3
            elif stats == 2:  # log-sum-exp: common max, rescaled sums
                M2 = max(bM2[j], bM2[j + 1])
                M3 = (bM3[j] * math.exp((bM2[j] - M2) / l)
                      + bM3[j + 1] * math.exp((bM2[j + 1] - M2) / l))
                bM2[j] = M2
                bM3[j] = M3
            bW[j] += bW[j + 1]
            lo = bv[j]
            hi = bv[j + 1]
            nb -= 1
            cls = _link_class(bW[j], m, link)
            if cls == 1:
                bv[j] = np.inf
            elif cls == -1:
                bv[j] = -np.inf
            elif link != 0 and (j == 0 or bv[j - 1] == -np.inf):
                bv[j] = np.nan  # pending: no comparison needs it yet
            elif link != 0 and not (np.isfinite(lo) and np.isfinite(hi)):
                bv[j] = _solve_in_bracket(solve, s, j, i + 1, stats, link,
                                          bstart, bW, bmean, bM2, bM3, l, a)
            else:
                bv[j] = solve(s, bstart[j], i + 1, m, bW[j], bmean[j], M2, M3,
                              l, a, lo, hi)
    if link != 0:
        for j in range(nb):
            if np.isnan(bv[j]):
                bv[j] = _solve_in_bracket(solve, s, j, _block_end(j, nb, n, bstart),
                                          stats, link, bstart, bW, bmean, bM2, bM3, l, a)
    if polish_steps > 0:
        hi = np.inf
        for j in range(nb):
            i0 = bstart[j]
            i1 = _block_end(j, nb, n, bstart)
            lo = bv[j + 1] if j + 1 < nb else -np.inf
            v = bv[j]
            if i1 - i0 > 1:
                v = _polish(s, i0, i1, bW[j], v, l, a, lo, hi, polish_steps)
            v = min(v, hi)
            bv[j] = v
            hi = v
    return nb


# ----------------------------------------------------------------------------
# isotonic_pav: generic row + one cached parallel wrapper per solver
# ----------------------------------------------------------------------------


@njit(cache=True, inline="always")
def _pav_blocks(solve, s, w, l, a, pm1, polish_steps, stats, singleton=None, link=0):
    """Allocates the block workspace for one row of length len(s) and runs PAV.

    Returns (number of blocks, block start indices, block values).
    """
    n = s.shape[0]
    bstart = np.empty(n, dtype=np.int64)
    n3 = n if stats != 0 else 1
    bv = np.empty(n)
    nb = _pav_row(solve, s, w, l, a, pm1, polish_steps, stats,
                  bstart, np.empty(n), np.empty(n), np.empty(n3), np.empty(n3), bv,
                  singleton, link)
    return nb, bstart, bv


@njit(cache=True)
def _workspace(n):
    """Work arrays for one row of length <= n (reused across the rows of a chunk):
    (s, w, bstart, bW, bmean, bM2, bM3, bv)."""
    return (np.empty(n), np.empty(n), np.empty(n, dtype=np.int64), np.empty(n),
            np.empty(n), np.empty(n), np.empty(n), np.empty(n))


@njit(cache=True)
def _num_chunks(rows):
    """Chunks of rows for a prange loop: each chunk allocates its workspace once
    (per-row allocations cost ~0.1 us each, more than PAV on a row of 8)."""
    return min(rows, 256)


@njit(cache=True, inline="always")
def _iso_row(solve, s, w, l, a, pm1, polish_steps, stats, out, singleton=None, link=0):
    n = s.shape[0]
    ok = l > 0.0 and l < np.inf
    for i in range(n):
        if not (np.isfinite(s[i]) and np.isfinite(w[i])):
            ok = False
    if not ok:
        out[:] = np.nan
        return
    nb, bstart, bv = _pav_blocks(solve, s, w, l, a, pm1, polish_steps, stats, singleton,
                                 link)
    for j in range(nb):
        i1 = bstart[j + 1] if j + 1 < nb else n
        for i in range(bstart[j], i1):
            out[i] = bv[j]


@njit(cache=True, parallel=True)
def _iso_batch_p2(s, w, l, a, pm1, out):
    ws = 1 if w.shape[0] > 1 else 0
    for b in prange(s.shape[0]):
        _iso_row(_solve_p2, s[b], w[b * ws], l[b], a, pm1, 1, 0, out[b])


@njit(cache=True, parallel=True)
def _iso_batch_cubic(s, w, l, a, pm1, out):
    ws = 1 if w.shape[0] > 1 else 0
    for b in prange(s.shape[0]):
        _iso_row(_solve_cubic, s[b], w[b * ws], l[b], a, pm1, 3, 3, out[b])


@njit(cache=True, parallel=True)
def _iso_batch_general(s, w, l, a, pm1, out):
    ws = 1 if w.shape[0] > 1 else 0
    for b in prange(s.shape[0]):
        _iso_row(_solve_general, s[b], w[b * ws], l[b], a, pm1, 0, 0, out[b])


@njit(cache=True, parallel=True)
def _iso_batch_exp(s, w, l, a, pm1, out):
    ws = 1 if w.shape[0] > 1 else 0
    for b in prange(s.shape[0]):
        _iso_row(_solve_exp, s[b], w[b * ws], l[b], a, pm1, 0, 2, out[b],
                 _link_singleton, 1)


@njit(cache=True, parallel=True)
def _iso_batch_link(s, w, l, a, pm1, out):
    ws = 1 if w.shape[0] > 1 else 0
    for b in prange(s.shape[0]):
        _iso_row(_solve_link, s[b], w[b * ws], l[b], a, pm1, 0, 0, out[b],
                 _link_singleton, int(a))


# ----------------------------------------------------------------------------
# permutahedron_blocks: gather the sorted row, PAV, block ids (one pass per row)
# ----------------------------------------------------------------------------


_U64_SIGN = np.uint64(1 << 63)
_U64_LOW63 = np.uint64((1 << 63) - 1)
_U64_BYTE = np.uint64(255)


@njit(cache=True)
def _argsort_descending(x, order):
    """Writes the descending order of the row ``x`` into ``order`` (int32): LSD
    radix sort, 8-bit digits, on the float64 bit patterns mapped to unsigned keys
    whose ascending order is x's descending order (a few times faster than numpy's
    argsort; digits on which every key agrees, e.g. float32's low mantissa bytes,
    are skipped).  Stable; the order of NaNs is unspecified."""
    n = x.shape[0]
    f = np.empty(n)
    for i in range(n):
        f[i] = x[i]
    keys = f.view(np.uint64)
    hist = np.zeros((8, 256), dtype=np.int64)
    for i in range(n):
        u = keys[i]
        if u & _U64_SIGN:  # negative: larger |x| sorts later, bits as they are
            k = u
        else:  # nonnegative: before every negative, larger first
            k = (~u) & _U64_LOW63
        keys[i] = k
        for d in range(8):
            hist[d, (k >> np.uint64(8 * d)) & _U64_BYTE] += 1
    src_k = keys
    src_i = order
    for i in range(n):
        order[i] = i
    dst_k = np.empty(n, dtype=np.uint64)
    dst_i = np.empty(n, dtype=np.int32)
    offset = np.empty(256, dtype=np.int64)
    passes = 0
    for d in range(8):
        skip = False
        total = 0
        for b in range(256):
            c = hist[d, b]
            if c == n:
                skip = True
                break
            offset[b] = total
            total += c
        if skip:
            continue
        shift = np.uint64(8 * d)
        for i in range(n):
            k = src_k[i]
            b = (k >> shift) & _U64_BYTE
            pos = offset[b]
            offset[b] = pos + 1
            dst_k[pos] = k
            dst_i[pos] = src_i[i]
        src_k, dst_k = dst_k, src_k
        src_i, dst_i = dst_i, src_i
        passes += 1
    if passes % 2 == 1:  # the result is in the scratch buffer
        for i in range(n):
            order[i] = src_i[i]


@njit(cache=True)
def _p2_singleton(s, i, w, l, a, pm1):
    """One-element block for p = 2: ``s - l w`` (:func:`_singleton_value` with
    p - 1 = 1, without its ``pow``: the same value)."""
    return s[i] - l * w


@njit(cache=True, inline="always")
def _perm_row(solve, x, xo, sort_x, w, wo, sort_w, l, a, pm1, polish_steps, stats, values,
              ids, inverse, singleton=None, link=0):
    """One row of :func:`permutahedron_blocks`.

    With ``sort_x``/``sort_w`` the descending orders are first written to
    ``xo``/``wo``.  ``s = x[xo]`` and ``w[wo]`` (``xo``/``wo`` of length 0: the row
    is already in order) are gathered into float64 work rows, PAV runs on them, and the block
    structure is written out: ``ids[i]`` = the block of sorted position ``i``
    (blocks are runs of consecutive positions; adjacent PAV blocks with equal
    values are one block: the merged block condition holds too), ``values[j]`` =
    the value of block ``j`` (0 past the last block), ``inverse`` = the inverse
    permutation of ``xo`` (if ``xo`` is given).  A row with a non-finite entry or
    ``l`` not in (0, inf) gets NaN values and one block per position.
    """
    n = x.shape[0]
    s = np.empty(n)
    ws = np.empty(n)
    if sort_x:
        _argsort_descending(x, xo)
    if sort_w:
        _argsort_descending(w, wo)
    if xo.shape[0] == 0:
        for i in range(n):
            s[i] = x[i]
    else:
        for i in range(n):
            k = xo[i]
            s[i] = x[k]
            inverse[k] = i
    if wo.shape[0] == 0:
        for i in range(n):
            ws[i] = w[i]
    else:
        for i in range(n):
            ws[i] = w[wo[i]]
    ok = l > 0.0 and l < np.inf
    for i in range(n):
        if not (np.isfinite(s[i]) and np.isfinite(ws[i])):
            ok = False
    if not ok:
        for i in range(n):
            values[i] = np.nan
            ids[i] = i
        return
    nb, bstart, bv = _pav_blocks(solve, s, ws, l, a, pm1, polish_steps, stats, singleton,
                                 link)
    k = -1
    prev = 0.0
    for j in range(nb):
        if k < 0 or bv[j] != prev:  # compared in float64, before any rounding
            k += 1
            prev = bv[j]
            values[k] = prev
        i1 = bstart[j + 1] if j + 1 < nb else n
        for i in range(bstart[j], i1):
            ids[i] = k
    for j in range(k + 1, n):
        values[j] = 0.0


@njit(cache=True, parallel=True)
def _perm_batch_p2(x, xo, sort_x, w, wo, sort_w, l, a, pm1, values, ids, inverse):
    xs = 1 if x.shape[0] > 1 else 0
    ws = 1 if w.shape[0] > 1 else 0
    for b in prange(l.shape[0]):
        _perm_row(_solve_p2, x[b * xs], xo[b * xs], sort_x, w[b * ws], wo[b * ws], sort_w,
                  l[b], a, pm1, 1, 0,
                  values[b], ids[b], inverse[b * xs], _p2_singleton)


@njit(cache=True, parallel=True)
def _perm_batch_cubic(x, xo, sort_x, w, wo, sort_w, l, a, pm1, values, ids, inverse):
    xs = 1 if x.shape[0] > 1 else 0
    ws = 1 if w.shape[0] > 1 else 0
    for b in prange(l.shape[0]):
        _perm_row(_solve_cubic, x[b * xs], xo[b * xs], sort_x, w[b * ws], wo[b * ws], sort_w,
                  l[b], a, pm1, 3, 3,
                  values[b], ids[b], inverse[b * xs])


@njit(cache=True, parallel=True)
def _perm_batch_general(x, xo, sort_x, w, wo, sort_w, l, a, pm1, values, ids, inverse):
    xs = 1 if x.shape[0] > 1 else 0
    ws = 1 if w.shape[0] > 1 else 0
    for b in prange(l.shape[0]):
        _perm_row(_solve_general, x[b * xs], xo[b * xs], sort_x, w[b * ws], wo[b * ws], sort_w,
                  l[b], a, pm1, 0, 0,
                  values[b], ids[b], inverse[b * xs])


@njit(cache=True, parallel=True)
def _perm_batch_exp(x, xo, sort_x, w, wo, sort_w, l, a, pm1, values, ids, inverse):
    xs = 1 if x.shape[0] > 1 else 0
    ws = 1 if w.shape[0] > 1 else 0
    for b in prange(l.shape[0]):
        _perm_row(_solve_exp, x[b * xs], xo[b * xs], sort_x, w[b * ws], wo[b * ws], sort_w,
                  l[b], a, pm1, 0, 2,
                  values[b], ids[b], inverse[b * xs], _link_singleton, 1)


# ----------------------------------------------------------------------------
# capped_simplex_threshold: generic row + one cached parallel wrapper per solver
# ----------------------------------------------------------------------------


@njit(cache=True, inline="always")
def _capped_row(solve, xs, k, l, a, pm1, polish_steps, stats, ws, singleton=None, link=0):
    """Threshold for one row.  ``xs`` is the row sorted *ascending* by numpy,
    i.e. laid out as [-inf...][finite ascending][+inf...][nan...]; ``ws`` is a
    :func:`_workspace` of at least the row's length.

    Links never give an exact 0 (nor, except exp, an exact 1): rows whose
    finite entries would all need one have no finite threshold (NaN), and the
    exact pre-reduction below (a p-norm property) is skipped."""
    n = xs.shape[0]
    if n > 0 and np.isnan(xs[n - 1]):
        return np.nan
    if not (l > 0.0 and l < np.inf):
        return np.nan
    lo_f = 0
    while lo_f < n and xs[lo_f] == -np.inf:
        lo_f += 1
    hi_f = n  # finite entries are xs[lo_f:hi_f]
    while hi_f > lo_f and xs[hi_f - 1] == np.inf:
        hi_f -= 1
    n_pinf = n - hi_f
    nf = hi_f - lo_f
    kf = k - n_pinf
    if not np.isfinite(kf):
        return np.nan
    if kf == 0.0:
        if nf == 0:
            return 0.0
        return float(xs[hi_f - 1]) + l if link == 0 else np.nan
    if kf == nf:
        return float(xs[lo_f]) - 2.0 * l if link in (0, 1) else np.nan
    if kf < 0.0 or kf > nf:
        return np.nan
    # 0 < kf < nf.  Descending finite entries: sd(i) = xs[hi_f - 1 - i].
    kint = int(math.floor(kf))
    kc = kint if kint == kf else kint + 1
    # Exact pre-reduction (a window of the same problem).  At most kint
    # entries can have y = 1 and at least kc entries have y > 0, hence
    #     s_(kint+1) - l  <  lam  <  s_(kc)        (1-based order stats).
    # Entries with s_i - l >= s_(kc) are therefore 1 and entries with
    # s_i <= s_(kint+1) - l are 0; PAV runs only on the rest, with k reduced
    # by the number of leading ones.  (top <= kc - 1 < kf and bot > kf, so the
    # reduced problem is again 0 < k' < n'.)  This keeps time and memory
    # proportional to the window, not to n, when l is small.
    top = 0
    bot = nf
    if link == 0:
        s_kc = float(xs[hi_f - kc])
        s_lo = float(xs[hi_f - 1 - kint]) - l
        top = 0  # number of leading entries with s_i - l >= s_kc
        hi_i = kc - 1
        while top < hi_i:  # binary search on a monotone predicate
            mid = (top + hi_i) // 2
            if float(xs[hi_f - 1 - mid]) - l >= s_kc:
                top = mid + 1
            else:
                hi_i = mid
        bot = nf  # first entry (descending order) with s_i <= s_lo
        lo_i = kint + 1
        while lo_i < bot:
            mid = (lo_i + bot) // 2
            if float(xs[hi_f - 1 - mid]) <= s_lo:
                bot = mid
            else:
                lo_i = mid + 1
    m = bot - top
    kwi = kint - top
    frac = kf - kint
    s = ws[0][:m]
    for i in range(m):
        s[i] = xs[hi_f - 1 - top - i]
    w = ws[1][:m]
    w[:] = 0.0
    w[:kwi] = 1.0
    if frac > 0.0:
        w[kwi] = frac
    bstart, bv = ws[2], ws[7]
    nb = _pav_row(solve, s, w, l, a, pm1, polish_steps, stats,
                  bstart, ws[3], ws[4], ws[5], ws[6], bv, singleton, link)
    # the (unique) block holding fractional y: a merged block, or the
    # singleton carrying the fractional weight f.  Singletons with weight 0/1
    # have y = 0/1 exactly (decided structurally, not from rounded y).
    for j in range(nb):
        i0 = bstart[j]
        i1 = bstart[j + 1] if j + 1 < nb else m
        if i1 - i0 > 1 or (w[i0] != 0.0 and w[i0] != 1.0):
            return bv[j]
    # all-binary (integer k, top-k well separated): any lam in
    # [s_(k+1), s_(k) - l] is valid; return the midpoint.
    return 0.5 * (s[kwi] + (s[kwi - 1] - l))


@njit(cache=True, parallel=True)
def _cap_batch_p2(xs, k, l, a, pm1, lam):
    rows, chunks = xs.shape[0], _num_chunks(xs.shape[0])
    for c in prange(chunks):
        ws = _workspace(xs.shape[1])
        for b in range(c * rows // chunks, (c + 1) * rows // chunks):
            lam[b] = _capped_row(_solve_p2, xs[b], k[b], l[b], a, pm1, 1, 0, ws)


@njit(cache=True, parallel=True)
def _cap_batch_cubic(xs, k, l, a, pm1, lam):
    rows, chunks = xs.shape[0], _num_chunks(xs.shape[0])
    for c in prange(chunks):
        ws = _workspace(xs.shape[1])
        for b in range(c * rows // chunks, (c + 1) * rows // chunks):
            lam[b] = _capped_row(_solve_cubic, xs[b], k[b], l[b], a, pm1, 3, 3, ws)


@njit(cache=True, parallel=True)
def _cap_batch_general(xs, k, l, a, pm1, lam):
    rows, chunks = xs.shape[0], _num_chunks(xs.shape[0])
    for c in prange(chunks):
        ws = _workspace(xs.shape[1])
        for b in range(c * rows // chunks, (c + 1) * rows // chunks):
            lam[b] = _capped_row(_solve_general, xs[b], k[b], l[b], a, pm1, 0, 0, ws)


@njit(cache=True, parallel=True)
def _cap_batch_exp(xs, k, l, a, pm1, lam):
    rows, chunks = xs.shape[0], _num_chunks(xs.shape[0])
    for c in prange(chunks):
        ws = _workspace(xs.shape[1])
        for b in range(c * rows // chunks, (c + 1) * rows // chunks):
            lam[b] = _capped_row(_solve_exp, xs[b], k[b], l[b], a, pm1, 0, 2, ws, _link_singleton, 1)


@njit(cache=True, parallel=True)
def _cap_batch_link(xs, k, l, a, pm1, lam):
    rows, chunks = xs.shape[0], _num_chunks(xs.shape[0])
    for c in prange(chunks):
        ws = _workspace(xs.shape[1])
        for b in range(c * rows // chunks, (c + 1) * rows // chunks):
            lam[b] = _capped_row(_solve_link, xs[b], k[b], l[b], a, pm1, 0, 0, ws, _link_singleton, int(a))


# ----------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------


def _select(p):
    """Return (kind, a, p - 1) for the exponent p, or for a link name."""
    if isinstance(p, str):
        if p not in LINKS:
            raise ValueError(f"unknown link {p!r}; choose from {sorted(LINKS)}")
        return ("exp" if p == "exp" else "link"), float(LINKS[p]), 0.0
    p = float(p)
    if not (p > 1.0 and np.isfinite(p)):
        raise ValueError(f"p must be a finite number > 1, got {p!r}")
    if p == 2.0:
        return "p2", 1.0, 1.0
    if abs(p - 4.0 / 3.0) <= _P43_TOL:
        return "cubic", 3.0, 1.0 / 3.0
    return "general", 1.0 / (p - 1.0), p - 1.0


_ISO = {"p2": _iso_batch_p2, "cubic": _iso_batch_cubic,
        "general": _iso_batch_general, "exp": _iso_batch_exp,
        "link": _iso_batch_link}
_PERM = {"p2": _perm_batch_p2, "cubic": _perm_batch_cubic,
         "general": _perm_batch_general, "exp": _perm_batch_exp}
_CAP = {"p2": _cap_batch_p2, "cubic": _cap_batch_cubic,
        "general": _cap_batch_general, "exp": _cap_batch_exp,
        "link": _cap_batch_link}


def _per_row(val, B, name):
    arr = np.asarray(val, dtype=np.float64).reshape(-1)
    if arr.size == 1:
        return np.full(B, arr[0])
    if arr.size != B:
        raise ValueError(f"{name} must have shape (B,) = ({B},), got {np.shape(val)}")
    return np.ascontiguousarray(arr)


def isotonic_pav(s, w, l, p):
    """Solve the isotonic problem row-wise with PAV.

    ``min_{v_1 >= ... >= v_n} sum_i l * omega*((s_i - v_i)/l) + w_i v_i`` with
    ``omega(y) = |y|^p / p``, i.e. the block values satisfy
    ``sum_B g((s_i - v)/l) = sum_B w_i`` with ``g(z) = sign(z)|z|^(1/(p-1))``.

    Parameters
    ----------
    s : (B, n) float32/float64 array, each row sorted descending (not
        checked: PAV solves the stated isotonic problem for any rows, the
        sorting is only needed for the permutahedron interpretation).  A 1-D
        array is treated as a single row and a 1-D result is returned.
    w : (B, n) or (n,) array, nonincreasing along the row.
    l : (B,) array (or scalar) of positive regularisation strengths.
    p : python float > 1, or a link name (``"exp"``: entropy, closed-form
        blocks, O(n); ``"sigmoid"``, ``"laplace"``: Newton blocks).
        ``p == 2`` and ``p == 4/3`` (``|p - 4/3| <= 1e-9``)
        use O(1) block solvers, i.e. O(n) per row; other ``p`` use a
        safeguarded Newton solver, O(n * block size) in the worst case.
        Computation is in float64 (float32 input is converted exactly).

    Returns
    -------
    v : (B, n) float64.  The primal solution is ``y = g((s - v)/l)``.
        Rows containing a non-finite ``s``/``w`` or with ``l`` not in
        ``(0, inf)`` are filled with NaN.
    """
    kind, a, pm1 = _select(p)
    s_arr = np.asarray(s)
    squeeze = s_arr.ndim == 1
    s64 = np.ascontiguousarray(np.atleast_2d(s_arr), dtype=np.float64)
    if s64.ndim != 2:
        raise ValueError(f"s must be 2-D (B, n), got shape {s_arr.shape}")
    B, n = s64.shape
    w64 = np.ascontiguousarray(np.atleast_2d(np.asarray(w)), dtype=np.float64)
    if w64.ndim != 2 or w64.shape[1] != n or w64.shape[0] not in (1, B):
        raise ValueError(f"w must have shape (n,) or (B, n); got {np.shape(w)} for s {s64.shape}")
    l64 = _per_row(l, B, "l")
    out = np.empty((B, n), dtype=np.float64)
    if B > 0 and n > 0:
        _ISO[kind](s64, w64, l64, a, pm1, out)
    return out[0] if squeeze else out


def permutahedron_blocks(x, w, l, p, *, sort_x=True, sort_w=True, dtype=None):
    """Sorts the rows of ``x`` and ``w`` descending and solves the isotonic dual by PAV.

    The permutahedron LP ``argmax_{y in P(w)} <x, y> - l Omega(y)`` in block form
    (:func:`isotonic_pav`'s problem with ``s = sort(x)`` and ``w = sort(w)``, both
    descending), in one pass per row: gather, PAV, block ids.

    Parameters
    ----------
    x : (B, n) or (1, n) float array (one row shared by all); with ``sort_x=False``
        already nonincreasing per row.
    w : (B, n) or (1, n) float array; with ``sort_w=False`` already nonincreasing.
    l : (B,) array of regularization strengths (> 0); B is its length.
    p : as in :func:`isotonic_pav` (a p-norm exponent, or ``"exp"``).
    dtype : dtype of the returned block values (default: x's).

    Returns
    -------
    values : (B, n) block values, 0 past each row's last block.
    ids : (B, n) int32, the block of each *sorted* position (nondecreasing, from 0).
    x_order, x_inverse : int32, x's shape: the descending order of ``x`` and its
        inverse permutation (None when ``sort_x=False``).
    w_order : int32, w's shape: the descending order of ``w`` (None when
        ``sort_w=False``).
    Rows with a non-finite entry (or ``l`` not in (0, inf)) get NaN values and one
    block per position.
    """
    kind, a, pm1 = _select(p)
    if kind == "link":
        raise ValueError("permutahedron_blocks supports the p-norms and 'exp'")
    l64 = np.ascontiguousarray(np.asarray(l, dtype=np.float64).reshape(-1))
    B = l64.shape[0]
    rows = []
    for name, arr in (("x", x), ("w", w)):
        arr = np.asarray(arr)
        if arr.dtype not in (np.float32, np.float64):
            arr = arr.astype(np.float64)
        arr = np.ascontiguousarray(np.atleast_2d(arr))
        if arr.ndim != 2 or arr.shape[0] not in (1, B):
            raise ValueError(f"{name} must have shape (n,), (1, n) or ({B}, n); got {arr.shape}")
        rows.append(arr)
    x, w = rows
    if sort_x and x.shape[0] != B:  # each row sorted (and inverted) by its own thread
        x = np.ascontiguousarray(np.broadcast_to(x, (B, x.shape[1])))
    if sort_w and w.shape[0] != B:
        w = np.ascontiguousarray(np.broadcast_to(w, (B, w.shape[1])))
    n = x.shape[1]
    if w.shape[1] != n:
        raise ValueError(f"x and w rows differ in length: {x.shape} and {w.shape}")
    values = np.empty((B, n), dtype=x.dtype if dtype is None else np.dtype(dtype))
    ids = np.empty((B, n), dtype=np.int32)
    empty = np.empty((B, 0), dtype=np.int32)
    x_order = np.empty(x.shape, dtype=np.int32) if sort_x else None
    w_order = np.empty(w.shape, dtype=np.int32) if sort_w else None
    x_inverse = np.empty(x.shape, dtype=np.int32) if sort_x else None
    if B > 0 and n > 0:
        _PERM[kind](x, empty if x_order is None else x_order, sort_x,
                    w, empty if w_order is None else w_order, sort_w, l64, a, pm1,
                    values, ids, empty if x_inverse is None else x_inverse)
    return values, ids, x_order, x_inverse, w_order


def capped_simplex_threshold(x, k, l, p):
    """Threshold ``lam`` of the p-norm regularised top-k (capped simplex).

    For each row, returns ``lam`` such that
    ``y_i = clip(g((x_i - lam)/l), 0, 1)``, ``g(z) = sign(z)|z|^(1/(p-1))``,
    satisfies ``sum_i y_i = k``; ``y`` is the solution of the isotonic problem
    of :func:`isotonic_pav` with ``w = (1,..,1, k - floor(k), 0,..,0)``.  If
    the solution has a strictly fractional entry, ``lam`` is the value of its
    PAV block (unique); if it is all-binary (integer ``k`` with a gap of more
    than ``l`` between the k-th and (k+1)-th largest entry), every ``lam`` in
    ``[x_(k+1), x_(k) - l]`` is valid and the midpoint is returned.

    Parameters
    ----------
    x : (B, n) float32/float64, unsorted.  Never written to (read-only
        buffers, e.g. from jax, are fine).  A 1-D array is one row (scalar out).
    k : (B,) float64 (or scalar), real-valued.
    l : (B,) float64 (or scalar), must be in ``(0, inf)``, else NaN.
    p : python float > 1, or a link name ``"exp"`` (entropy), ``"sigmoid"``
        or ``"laplace"``; links never give an exact 0 (nor, except exp, an
        exact 1), so rows that would need one have no finite threshold: NaN.

    Non-finite entries
    ------------------
    * a row containing any NaN gives ``lam = NaN``;
    * ``+inf`` entries count as ``y = 1`` and ``-inf`` entries as ``y = 0``.
      With ``k_f = k - #(+inf)`` and ``n_f = #finite``:
      ``0 < k_f < n_f``: solved on the finite entries;
      ``k_f == 0``: ``lam = max_finite + l`` (``0.0`` if no finite entry);
      ``k_f == n_f``: ``lam = min_finite - 2 l``;
      otherwise (``k_f < 0`` or ``k_f > n_f``, or ``k`` not finite):
      ``lam = NaN``.

    Returns
    -------
    lam : (B,) float64.

    Cost: a numpy sort of each row (O(n log n)) plus a PAV over the window
    of entries that can be fractional (all entries in the worst case): O(n)
    for ``p in {2, 4/3}``, O(n * block size) in the worst case for other
    ``p``.  All arithmetic is float64.
    """
    kind, a, pm1 = _select(p)
    x_arr = np.asarray(x)
    squeeze = x_arr.ndim == 1
    if x_arr.dtype not in (np.float32, np.float64):
        x_arr = x_arr.astype(np.float64)
    x2 = np.ascontiguousarray(np.atleast_2d(x_arr))
    if x2.ndim != 2:
        raise ValueError(f"x must be 2-D (B, n), got shape {np.shape(x)}")
    B = x2.shape[0]
    k64 = _per_row(k, B, "k")
    l64 = _per_row(l, B, "l")
    # Rows are sorted by numpy before entering numba: its SIMD sort (native
    # dtype) is ~8x faster than numba's sort inside the prange loop (measured
    # 30 ms vs 240 ms for 64 x 1e5 float32 on 2 cores).  np.sort returns a new
    # array, so the (possibly read-only) input is never modified.  NaNs sort
    # last and +-inf to the ends, which _capped_row relies on.
    xs = np.sort(x2, axis=-1)
    # The problem depends on x / l only (lam scales with them), and the kernel squares
    # l-sized quantities: rows whose l is far from 1 are solved on x / 2^e, l / 2^e
    # (2^e the binade of l, an exact rescaling) and lam is scaled back.
    xs, l64, scale = _rescale_far_l(xs, l64)
    lam = np.empty(B, dtype=np.float64)
    if B > 0:
        _CAP[kind](xs, k64, l64, a, pm1, lam)
    if scale is not None:
        with np.errstate(over="ignore"):
            lam = lam * scale
    return lam[0] if squeeze else lam


_FAR_L = 2.0 ** 64  # l outside [1 / _FAR_L, _FAR_L] is rescaled to [1, 2)


def _rescale_far_l(xs, l64):
    """``(xs, l, None)`` when every finite ``l`` is within ``[2^-64, 2^64]``; else
    float64 ``xs / c`` and ``l / c`` with ``c = 2^e`` per row (1 for the other rows),
    ``l / c`` in ``[1, 2)``, and ``c``. Powers of two rescale exactly unless an entry
    leaves the float range, where it becomes +-inf or 0: its distance to the others
    exceeds the float range in units of ``l`` anyway."""
    with np.errstate(invalid="ignore"):
        far = np.isfinite(l64) & (l64 > 0) & ((l64 > _FAR_L) | (l64 < 1.0 / _FAR_L))
    if not far.any():
        return xs, l64, None
    exponent = np.where(far, np.frexp(np.where(far, l64, 1.0))[1] - 1, 0)
    scale = np.ldexp(1.0, exponent)
    with np.errstate(over="ignore", under="ignore"):
        xs = xs.astype(np.float64) / scale[:, None]
    return np.ascontiguousarray(xs), l64 / scale, scale


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
# ``soft_topk_mag``.  Rows are laid out as |x| sorted ascending (numpy).


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


@njit(cache=True)
def _pow(z, a):
    """z^a for z >= 0 (exact for a = 1 and 3)."""
    if a == 1.0:
        return z
    if a == 3.0:
        return z * z * z
    return z ** a


@njit(cache=True)
def _mag_lower(s, i0, i1, W, l, a):
    """A positive lower bound on the value of the block ``s[i0:i1]`` (descending,
    > 0): at ``v = min(s_min / 2, m g(s_min / (2 l)) / W)`` every term is at least
    ``g(s_min / (2 l))``, so ``F_B(v) >= m g(s_min / (2 l)) - W v >= 0``."""
    half = 0.5 * s[i1 - 1]
    if W > 0.0:
        c = (i1 - i0) * _pow(half / l, a) / W
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
    hi = _pow(si / l, a) / w
    hi = min(si, hi * (1.0 + 4.0 * (a + 2.0) * _EPS))
    lo = max(si - l * (w * si) ** pm1 - 4.0 * _EPS * si, 0.0)
    v = hi
    if lo > 0.0 and lo < hi:
        v = lo + 0.5 * (hi - lo)
    return _mag_refine(s, i, i + 1, w, l, a, lo, hi, v)


@njit(cache=True, inline="always")
def _mag_row(solve, singleton, xa, k, l, a, pm1, stats):
    """Threshold of one row; ``xa`` = |x| sorted ascending ([finite][inf][nan]).

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
        return float(xa[hi_f - 1]) + l if hi_f > 0 else 0.0
    lo_p = 0  # zeros are below any lam > 0: drop them
    while lo_p < hi_f and xa[lo_p] == 0.0:
        lo_p += 1
    m = hi_f - lo_p
    if m <= kf:
        return 0.0
    s = np.empty(m)
    for i in range(m):
        s[i] = xa[hi_f - 1 - i]
    kint = int(math.floor(kf))
    w = np.zeros(m)
    w[:kint] = 1.0
    if kf > kint:
        w[kint] = kf - kint
    nb, bstart, bv = _pav_blocks(solve, s, w, l, a, pm1, 0, stats, singleton)
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


@njit(cache=True, parallel=True)
def _mag_batch_p2(xa, k, l, a, pm1, lam):
    for b in prange(xa.shape[0]):
        lam[b] = _mag_row(_solve_mag_p2, _mag_singleton_p2, xa[b], k[b], l[b],
                          a, pm1, 0)


@njit(cache=True, parallel=True)
def _mag_batch_cubic(xa, k, l, a, pm1, lam):
    for b in prange(xa.shape[0]):
        lam[b] = _mag_row(_solve_mag_cubic, _mag_singleton_cubic, xa[b], k[b],
                          l[b], a, pm1, 3)


@njit(cache=True, parallel=True)
def _mag_batch_general(xa, k, l, a, pm1, lam):
    for b in prange(xa.shape[0]):
        lam[b] = _mag_row(_solve_mag_general, _mag_singleton_general, xa[b],
                          k[b], l[b], a, pm1, 0)


_MAG = {"p2": _mag_batch_p2, "cubic": _mag_batch_cubic,
        "general": _mag_batch_general}


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
    entries are kept).  Cost: a numpy sort of |x| per row plus O(n) for
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
    xa = np.sort(np.abs(x2), axis=-1)
    lam = np.empty(B, dtype=np.float64)
    if B > 0:
        _MAG[kind](xa, k64, l64, a, pm1, lam)
    return lam[0] if squeeze else lam
