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

Compiled functions use ``cache=True`` and run serially: they are called from XLA FFI
handlers (:mod:`implicit_topk.kernels.cpu.pav_ffi`), and XLA runs ops on its own threads.
Numba cannot cache a function that *receives* a dispatcher as an argument
from Python (nor one whose compiled code keeps a dispatcher argument alive),
so each (entry point, solver) pair is dispatched on an integer kind inside a
cached function that references its solver as a global, and the generic row
functions (which take the solver as an argument) are inlined into it
(``inline="always"``).

This module holds the PAV loop and its block solvers; the per-problem drivers are
:mod:`~implicit_topk.kernels.cpu.pav_capped_simplex`,
:mod:`~implicit_topk.kernels.cpu.pav_magnitude` and
:mod:`~implicit_topk.kernels.cpu.pav_permutahedron`.
"""

import math

import numpy as np
from numba import njit

from implicit_topk.kernels.cpu.ordered_bits import bisection_point

__all__ = ["isotonic_pav"]

_EPS = np.finfo(np.float64).eps
_MAXIT = 200  # iteration cap for the safeguarded Newton/bisection solver
_P43_TOL = 1e-9  # |p - 4/3| below this selects the cubic solver
# Kernel kinds (the block solver), as the drivers dispatch on them.
P2, CUBIC, GENERAL, EXP, LINK = 0, 1, 2, 3, 4
KINDS = {"p2": P2, "cubic": CUBIC, "general": GENERAL, "exp": EXP, "link": LINK}


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
    elif a < 1.0:
        # g((s - v) / l) = g(s - v) l^-a: (s - v) / l can leave the float range where
        # g of it does not (s - v = 1e-160, l = 1e160); g(s - v) and l^-a cannot.
        scale = l ** -a
        for i in range(i0, i1):
            d = s[i] - v
            ad = abs(d)
            if ad > 0.0:
                t = (math.sqrt(ad) if a == 0.5 else ad ** a) * scale
                G += math.copysign(t, d)
                dG += a * t / ad
            else:
                dG = np.inf
    else:
        for i in range(i0, i1):
            z = (s[i] - v) * inv_l
            az = abs(z)
            if az > 0.0:
                t = az ** a
                G += math.copysign(t, z)
                dG += a * t / az
        dG *= inv_l
    return G, dG


@njit(cache=True)
def _complement_eval(s, i0, i1, v, l, link, W):
    """The block condition of the symmetric links (sigmoid, Laplace: ``1 - g(z) =
    g(-z)``) in complement form (``proofs/complement_form.md``): ``(F, dG, size)`` with

        F = sum_{i0<=i<i1} g((s_i - v)/l) - W
          = (#{z_i > 0} - W) + sum_{z_i <= 0} g(z_i) - sum_{z_i > 0} g(-z_i),

    every term a tail to its own relative precision (the plain sum is flat in floating
    point once the deficits ``1 - g(z_i)`` are below the rounding of ``W``: near-binary
    rows), ``dG`` as :func:`_block_eval`'s and ``size`` the sum of the terms'
    magnitudes, the scale of F's rounding error."""
    upper = 0
    tails = 0.0
    size = 0.0
    dG = 0.0
    inv_l = 1.0 / l
    for i in range(i0, i1):
        z = (s[i] - v) * inv_l
        e = math.exp(-abs(z))
        if link == 2:
            tail = e / (1.0 + e)
            dG += tail / (1.0 + e)
        else:
            tail = 0.5 * e
            dG += tail
        size += tail
        if z > 0.0:
            upper += 1
            tails -= tail
        else:
            tails += tail
    count = upper - W
    return count + tails, dG * inv_l, size + abs(count)


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
    the root lies in [lo, hi]; the sigmoid and Laplace mask conditions are evaluated
    in complement form (:func:`_complement_eval`) (if rounding puts it marginally outside, the
    nearest bracket end is returned, which is within rounding of the root).
    Newton steps from ``v`` are taken while they stay inside the (shrinking)
    bracket and at least halve |F|; otherwise the bracket is bisected, every other
    time on the floats' ordered bit patterns while it spans more than two binades
    (:func:`~implicit_topk.kernels.cpu.ordered_bits.bisection_point`): a sigmoid or
    Laplace row ``(0.3, 1, 0.5, -1e300)`` is one block whose bracket is 1e300 wide,
    which 200 plain halvings left 1e240 wide (the mask ``(1, 1, 1, 0)`` for ``k = 1.5``).  Stops
    when the bracket or a Newton step is below 4 eps |v| (v's own precision),
    or below 4 eps * scale (the block's scale) while |F| is at rounding level,
    |F| <= 16 eps (|G| + |W v| + |B|), and then returns the iterate whose |F| is
    at rounding level, not the bracket's midpoint.  The first rule alone never ends at a
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
    last = np.inf
    complement = link >= 2 and slope == 0.0  # sigmoid, Laplace: the complement form
    for it in range(_MAXIT):
        if complement:
            F, dG, size = _complement_eval(s, i0, i1, v, l, link, W)
        else:
            G, dG = _block_eval(s, i0, i1, v, l, a, link)
            target = W * (1.0 - slope + slope * v)
            F = G - target
            size = abs(G) + abs(target) + m
        if F == 0.0:
            return v
        if F > 0.0:
            lo = v
        else:
            hi = v
        at_rounding = abs(F) <= 16.0 * _EPS * size
        width = hi - lo
        if width <= tol and at_rounding:
            # v is a root to rounding; the bracket's midpoint may be many ulps of v
            # off when the root is far below the block's scale (a Laplace threshold
            # of 5.5e-8 between entries 0 and -1 at l = 1e-8: 3e-18 off, 6e-13 in y)
            return v
        if width <= 4.0 * _EPS * max(abs(lo), abs(hi)):
            return 0.5 * (lo + hi)
        D = dG + slope * W
        vn = bisection_point(lo, hi, it)
        if D > 0.0 and D < np.inf and abs(F) <= 0.5 * abs(Fprev):
            newton = v + F / D
            # Complement form: F is a difference of exponential tails, on which Newton
            # moves about l per step far from the root (hundreds of steps on a
            # near-binary row); a step must also halve the last one, else bisect.
            if lo < newton < hi and (not complement or abs(newton - v) <= 0.5 * last):
                vn = newton
        Fprev = F
        last = abs(vn - v)
        step = abs(vn - v)
        if step <= 4.0 * _EPS * max(abs(v), abs(vn)):
            # A step at rounding level is convergence only if the residual is
            # small too: near an entry leaving 0 with a < 1 (p > 2) the slope
            # dG is huge (~|z|^(a-1)) and the Newton step is tiny although F
            # is not; bisect instead (found by hypothesis: x=[0.25, 1e-40]).
            if at_rounding:
                return vn
            vn = bisection_point(lo, hi, it)
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
def _solve_in_bracket(solve, kind, s, j, i1, stats, link, bstart, bW, bmean, bM2, bM3, l, a):
    """Solves block ``j`` (ending at ``i1``) in the bracket that holds for any
    link: [min_B s - l g^{-1}(W/m), max_B s - l g^{-1}(W/m)] (s is descending)."""
    i0 = bstart[j]
    m = float(i1 - i0)
    z = _link_inverse(bW[j] / m, link)
    M2 = bM2[j] if stats != 0 else 0.0
    M3 = bM3[j] if stats != 0 else 0.0
    return solve(kind, s, i0, i1, m, bW[j], bmean[j], M2, M3, l, a,
                 s[i1 - 1] - l * z, s[i0] - l * z)


@njit(cache=True, inline="always")
def _pav_row(solve, singleton, kind, s, w, l, a, pm1, polish_steps, stats,
             bstart, bW, bmean, bM2, bM3, bv, link):
    """Generic PAV on one row.  ``solve(kind, ...)`` is a block solver and
    ``singleton(kind, s, i, w_i, l, a, pm1)`` gives the value of the one-element
    block ``[i]`` (numba functions that dispatch on the integer ``kind``: the
    p-norms and links here, :func:`_solve_any` and :func:`_singleton_any`; the
    magnitude dual in :mod:`implicit_topk.kernels.cpu.pav_magnitude`).

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
        bv[nb] = singleton(kind, s, i, wi, l, a, pm1)
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
                    A = _solve_in_bracket(solve, kind, s, nb - 2, bstart[nb - 1], stats, link,
                                          bstart, bW, bmean, bM2, bM3, l, a)
                    bv[nb - 2] = A
                if np.isnan(B):
                    B = _solve_in_bracket(solve, kind, s, nb - 1, i + 1, stats, link,
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
                bv[j] = _solve_in_bracket(solve, kind, s, j, i + 1, stats, link,
                                          bstart, bW, bmean, bM2, bM3, l, a)
            else:
                bv[j] = solve(kind, s, bstart[j], i + 1, m, bW[j], bmean[j], M2, M3,
                              l, a, lo, hi)
    if link != 0:
        for j in range(nb):
            if np.isnan(bv[j]):
                bv[j] = _solve_in_bracket(solve, kind, s, j, _block_end(j, nb, n, bstart),
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
# isotonic_pav: generic row + one cached wrapper per solver
# ----------------------------------------------------------------------------


@njit(cache=True)
def _solve_any(kind, s, i0, i1, m, W, mean, M2, M3, l, a, lo, hi):
    """The block solver of ``kind``."""
    if kind == P2:
        return _solve_p2(s, i0, i1, m, W, mean, M2, M3, l, a, lo, hi)
    if kind == CUBIC:
        return _solve_cubic(s, i0, i1, m, W, mean, M2, M3, l, a, lo, hi)
    if kind == GENERAL:
        return _solve_general(s, i0, i1, m, W, mean, M2, M3, l, a, lo, hi)
    if kind == EXP:
        return _solve_exp(s, i0, i1, m, W, mean, M2, M3, l, a, lo, hi)
    return _solve_link(s, i0, i1, m, W, mean, M2, M3, l, a, lo, hi)


@njit(cache=True)
def _singleton_any(kind, s, i, w, l, a, pm1):
    """The value of the one-element block ``[i]``: the closed form
    :func:`_singleton_value` for the p-norms, :func:`_link_singleton` for the links."""
    if kind == EXP or kind == LINK:
        return _link_singleton(s, i, w, l, a, pm1)
    return _singleton_value(s[i], w, l, pm1)


@njit(cache=True)
def link_code(kind, a):
    """0 for the p-norms, the link's code (:data:`LINKS`) otherwise."""
    if kind == EXP:
        return 1
    if kind == LINK:
        return int(a)
    return 0


@njit(cache=True)
def pav_blocks(kind, s, w, l, a, pm1, bstart, bW, bmean, bM2, bM3, bv):
    """PAV on the row ``s`` (float64, descending) with weights ``w`` by the block
    solver ``kind``, into work arrays of length >= n (see :func:`_pav_row`); returns
    the number of blocks. One compiled PAV loop for every p-norm and link: the
    solver is dispatched per block, and ``kind`` fixes the final polishing steps
    (p = 2: one, p = 4/3: three) and the merged block statistics."""
    polish_steps = 1 if kind == P2 else (3 if kind == CUBIC else 0)
    stats = 3 if kind == CUBIC else (2 if kind == EXP else 0)
    return _pav_row(_solve_any, _singleton_any, kind, s, w, l, a, pm1, polish_steps, stats,
                    bstart, bW, bmean, bM2, bM3, bv, link_code(kind, a))


@njit(cache=True)
def _workspace(n):
    """Work arrays for one row of length <= n (reused across the rows):
    (s, w, bstart, bW, bmean, bM2, bM3, bv)."""
    return (np.empty(n), np.empty(n), np.empty(n, dtype=np.int64), np.empty(n),
            np.empty(n), np.empty(n), np.empty(n), np.empty(n))


@njit(cache=True)
def _iso_rows(kind, s, w, l, a, pm1, out):
    """Every row of :func:`isotonic_pav` (``w`` one row each, or one shared row)."""
    rows, n = s.shape
    step = 1 if w.shape[0] > 1 else 0
    ws = _workspace(n)
    for b in range(rows):
        row, weights, lb = s[b], w[b * step], l[b]
        ok = lb > 0.0 and lb < np.inf
        for i in range(n):
            if not (np.isfinite(row[i]) and np.isfinite(weights[i])):
                ok = False
        if not ok:
            out[b, :] = np.nan
            continue
        bstart, bv = ws[2], ws[7]
        nb = pav_blocks(kind, row, weights, lb, a, pm1, bstart, ws[3], ws[4], ws[5], ws[6], bv)
        for j in range(nb):
            i1 = bstart[j + 1] if j + 1 < nb else n
            for i in range(bstart[j], i1):
                out[b, i] = bv[j]


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
        _iso_rows(np.int32(KINDS[kind]), s64, w64, l64, a, pm1, out)
    return out[0] if squeeze else out
