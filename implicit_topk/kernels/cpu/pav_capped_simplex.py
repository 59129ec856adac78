"""The threshold of the p-norm (or link) regularized top-k mask by PAV, row by row.

The mask ``y = argmax_{y in [0,1]^n, sum y = k} <x, y> - l Omega(y)`` is the
permutahedron LP with ``w = (1, .., 1, f, 0, .., 0)`` (``floor(k)`` ones, then the
fractional part ``f`` of ``k``): its isotonic dual is solved by the PAV loop of
:mod:`implicit_topk.kernels.cpu.isotonic_pav` on the sorted row (Blondel, Teboul, Berthet
and Djolonga 2020, "Fast differentiable sorting and ranking", ICML), after an exact
reduction to the window of entries that can be fractional.

Pure numpy + numba (no jax). numba's disk cache is keyed on this file alone: the
PAV loop and block solvers of :mod:`~implicit_topk.kernels.cpu.isotonic_pav` are compiled
into these functions, so a change there needs a change here too (a stale cache keeps
the old code). The sigmoid and Laplace blocks are solved in complement form
(``proofs/complement_form.md``), by Newton steps that halve the last step or bisection.
"""

import math

import numpy as np
from numba import njit

from implicit_topk.kernels.cpu.isotonic_pav import (KINDS, _per_row, _select, _workspace,
                                                link_code, pav_blocks)
from implicit_topk.kernels.cpu.radix_sort import sort_ascending

_FAR_L = 2.0 ** 64  # l outside [1 / _FAR_L, _FAR_L] is rescaled to [1, 2)


@njit(cache=True)
def capped_row(kind, xs, k, l, a, pm1, ws):
    """Threshold for one row by the block solver ``kind``.  ``xs`` is the row sorted *ascending* (float64),
    i.e. laid out as [-inf...][finite ascending][+inf...][nan...]; ``ws`` is a
    :func:`_workspace` of at least the row's length.

    Links never give an exact 0 (nor, except exp, an exact 1): rows whose
    finite entries would all need one have no finite threshold (NaN), and the
    exact pre-reduction below (a p-norm property) is skipped."""
    n = xs.shape[0]
    link = link_code(kind, a)
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
    nb = pav_blocks(kind, s, w, l, a, pm1, bstart, ws[3], ws[4], ws[5], ws[6], bv)
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


@njit(cache=True)
def capped_rows(x, k, l, kind, a, pm1, lam):
    """The threshold of every row of ``x`` (rows, n) into ``lam``; returns 0.

    Each row is sorted (radix sort, float64). The problem depends on x / l only
    (lam scales with them), and the kernel squares l-sized quantities: a row whose
    l is outside [2^-64, 2^64] is solved on x / c, l / c with c = 2^e the binade of l
    (an exact rescaling, unless an entry leaves the float range, where it becomes
    +-inf or 0: its distance to the others exceeds the float range in units of l
    anyway), and lam is scaled back.
    """
    rows, n = x.shape
    ws = _workspace(n)
    xs = np.empty(n)
    scratch = np.empty(n, dtype=np.uint64)
    for b in range(rows):
        kb, lb = np.float64(k[b]), np.float64(l[b])
        sort_ascending(x[b], xs, scratch, False)
        scale = 1.0
        if lb > 0.0 and lb < np.inf and (lb > _FAR_L or lb < 1.0 / _FAR_L):
            scale = math.ldexp(1.0, math.frexp(lb)[1] - 1)
            for i in range(n):
                xs[i] = xs[i] / scale
            lb = lb / scale
        lam[b] = capped_row(kind, xs, kb, lb, a, pm1, ws) * scale
    return 0


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

    Cost: a radix sort of each row (O(n)) plus a PAV over the window
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
    lam = np.empty(B, dtype=np.float64)
    if B > 0:
        capped_rows(x2, k64, l64, np.int32(KINDS[kind]), a, pm1, lam)
    return lam[0] if squeeze else lam
