"""Numerical companion of proofs/isotonic_dual.md.

Checks, on random instances:
  (a) prefix sums of w = (1,..,1, k - floor(k), 0,..,0) are min(j, k);
  (b) capped simplex == permutahedron P(w): for random points, three tests agree
      -- box + sum, majorization (sorted prefix sums <= min(j, k)), and
      membership in conv{permutations of w} decided by an LP (scipy linprog);
  (c) the isotonic dual solved by SLSQP (with the constraints v_1 >= ... >= v_n)
      maps through y_i = g((s_i - v_i)/l) to the primal optimum, with zero
      duality gap;
  (d) an exact PAV for the same dual (block values by brentq) gives the same y,
      all fractional coordinates sit in one block, and that block's value is
      the threshold lam (root of phi); when every coordinate is binary (integer k)
      the roots of phi form [v_{k+1}, v_k] = [s_{k+1}, s_k - l];
  (e) the library's solver="pav" agrees with the reference.
"""

import itertools
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import numpy as np  # noqa: E402
from scipy.optimize import brentq, linprog, minimize  # noqa: E402

import _proofs_common as C  # noqa: E402

PS = (4.0 / 3.0, 1.5, 2.0, 3.0)


def perm_w(n, k):
    m = int(np.floor(k))
    w = np.zeros(n)
    w[:m] = 1.0
    if m < n:
        w[m] = k - m
    return w


def in_capped(y, k, tol):
    return bool(np.all(y >= -tol) and np.all(y <= 1 + tol) and abs(np.sum(y) - k) <= tol)


def in_perm_majorization(y, w, tol):
    ys = np.sort(y)[::-1]
    pw = np.cumsum(np.sort(w)[::-1])
    py = np.cumsum(ys)
    return bool(np.all(py[:-1] <= pw[:-1] + tol) and abs(py[-1] - pw[-1]) <= tol)


def in_perm_hull(y, w):
    """LP feasibility: y = sum_s t_s * sigma_s(w), t >= 0, sum t = 1."""
    verts = np.array(sorted(set(itertools.permutations(w.tolist()))))
    nv = verts.shape[0]
    a_eq = np.vstack([verts.T, np.ones((1, nv))])
    b_eq = np.concatenate([y, [1.0]])
    res = linprog(np.zeros(nv), A_eq=a_eq, b_eq=b_eq, bounds=[(0, None)] * nv, method="highs")
    return res.status == 0


def check_membership(rng):
    n_in = n_out = 0
    for n in (3, 4, 5):
        for k in (1.0, 2.0, 1.5, 0.6, n - 0.3, 2.25):
            if not 0 < k < n:
                continue
            w = perm_w(n, k)
            pw = np.cumsum(w)
            C.check(np.allclose(pw, np.minimum(np.arange(1, n + 1), k), atol=1e-15),
                    "prefix sums of w are not min(j, k)")
            for _ in range(40):
                d = rng.normal(size=n)
                d -= d.mean()
                y = k / n + rng.uniform(0, 1.2) * d / np.max(np.abs(d))
                margin = min(np.min(np.abs(y)), np.min(np.abs(1 - y)))
                if margin < 1e-6:
                    continue
                a = in_capped(y, k, 1e-12)
                b = in_perm_majorization(y, w, 1e-12)
                c = in_perm_hull(y, w)
                C.check(a == b == c, f"membership tests disagree: box={a} maj={b} lp={c} y={y}")
                n_in += a
                n_out += not a
            # points off the hyperplane sum = k are in neither set
            y = np.full(n, k / n) + 1e-3
            C.check(not in_capped(y, k, 1e-12) and not in_perm_majorization(y, w, 1e-12)
                    and not in_perm_hull(y, w), "off-hyperplane point accepted")
    print(f"  (a,b) C_k == P(w): prefix sums min(j,k); box/majorization/LP agree on "
          f"{n_in} inside and {n_out} outside points")


def dual_objective(v, s, w, l, p):
    return float(np.sum(l * C.omega_conj((s - v) / l, p) + w * v))


def dual_slsqp(s, w, l, p):
    n = s.size
    cons = [{"type": "ineq", "fun": lambda v: v[:-1] - v[1:],
             "jac": lambda v: np.eye(n)[:-1] - np.eye(n)[1:]}]
    res = minimize(lambda v: dual_objective(v, s, w, l, p), s.copy(),
                   jac=lambda v: w - C.g((s - v) / l, p), method="SLSQP",
                   constraints=cons, options={"ftol": 1e-15, "maxiter": 2000})
    return res.x


def block_value(s_b, w_b, l, p):
    """argmin_gamma sum_i l*omega*((s_i - gamma)/l) + w_i*gamma:
    root of sum_i g((s_i - gamma)/l) = sum_i w_i (strictly decreasing in gamma)."""
    target = np.sum(w_b)

    def f(gam):
        return np.sum(C.g((s_b - gam) / l, p)) - target

    lo, hi = np.min(s_b) - 2 * l - 1, np.max(s_b) + 2 * l + 1
    while f(lo) < 0:
        lo -= 2 * (hi - lo)
    while f(hi) > 0:
        hi += 2 * (hi - lo)
    return brentq(f, lo, hi, xtol=1e-15, rtol=4 * np.finfo(float).eps, maxiter=500)


def pav(s, w, l, p):
    """Pool adjacent violators for min_{v nonincreasing} sum_i h_i(v_i).

    Returns (v, blocks) with blocks a list of (start, stop) half-open ranges.
    """
    blocks = []  # [start, stop, value]
    for i in range(s.size):
        blocks.append([i, i + 1, block_value(s[i:i + 1], w[i:i + 1], l, p)])
        while len(blocks) > 1 and blocks[-2][2] <= blocks[-1][2]:
            b2 = blocks.pop()
            b1 = blocks.pop()
            a, b = b1[0], b2[1]
            blocks.append([a, b, block_value(s[a:b], w[a:b], l, p)])
    v = np.empty(s.size)
    for a, b, val in blocks:
        v[a:b] = val
    return v, [(a, b) for a, b, _ in blocks]


def check_dual(rng):
    worst_y_sl, worst_gap, worst_lam, count, n_binary = 0.0, 0.0, 0.0, 0, 0
    for p in PS:
        for n in (4, 6, 8):
            for k in (1.0, 3.0, 2.5, 0.4, n - 0.7):
                for trial in range(2):
                    x = rng.normal(size=n) * rng.choice([0.5, 2.0])
                    if trial == 1:
                        x[1] = x[0]  # a tie
                    l = float(rng.choice([0.05, 0.3, 1.0, 4.0]))
                    order = np.argsort(-x, kind="stable")
                    s = x[order]
                    w = perm_w(n, k)
                    lam, y_ref = C.threshold_solve(x, k, l, p)
                    ys_ref = y_ref[order]
                    primal_val = float(x @ y_ref - l * np.sum(C.omega(y_ref, p)))

                    # (c) independent dual solve
                    v_sl = dual_slsqp(s, w, l, p)
                    C.check(np.all(np.diff(v_sl) <= 1e-9), "SLSQP dual not monotone")
                    y_sl = C.g((s - v_sl) / l, p)
                    d = np.max(np.abs(y_sl - ys_ref))
                    # for p > 2, g(u) = |u|^(1/(p-1)) has infinite slope at 0, so an
                    # SLSQP error delta in v shows up as ~ (delta/l)^(1/(p-1)) in y
                    tol_y = 1e-5 if p <= 2 else 5e-4
                    C.check(d <= tol_y, f"dual(SLSQP)->primal mismatch {d:.2e} p={p} k={k}")
                    gap = abs(dual_objective(v_sl, s, w, l, p) - primal_val)
                    C.check(gap <= 1e-8 * (1 + abs(primal_val)), f"duality gap {gap:.2e}")
                    worst_y_sl, worst_gap = max(worst_y_sl, d), max(worst_gap, gap)

                    # (d) exact PAV, fractional block and threshold
                    v, blocks = pav(s, w, l, p)
                    y_pav = C.g((s - v) / l, p)
                    # rounding of s_i - v_i (~1e-16) is amplified by g for p > 2
                    tol_r = 1e-11 + 10 * (1e-15 * (1 + np.max(np.abs(s))) / l) ** min(
                        1.0, 1.0 / (p - 1.0))
                    C.check(np.all(y_pav >= -tol_r) and np.all(y_pav <= 1 + tol_r),
                            "PAV primal point leaves [0,1] without clipping")
                    C.check(np.max(np.abs(y_pav - ys_ref)) <= tol_r, "PAV y != threshold y")
                    C.check(np.max(np.abs(v - v_sl)[(y_pav > 1e-3) & (y_pav < 1 - 1e-3)])
                            <= 1e-4 * (1 + np.abs(v).max()) if np.any(
                                (y_pav > 1e-3) & (y_pav < 1 - 1e-3)) else True,
                            "PAV v != SLSQP v on fractional coordinates")
                    frac = np.where((ys_ref > tol_r) & (ys_ref < 1 - tol_r))[0]
                    m = int(np.floor(k))
                    if k != m:
                        key = [m]  # the block containing index m (0-based): weight k - m
                    else:
                        key = [m - 1, m]  # the block straddling k | k+1
                    blk = [bk for bk in blocks if bk[0] <= min(key) and max(key) < bk[1]]
                    if blk:
                        a, b = blk[0]
                        C.check(np.all((frac >= a) & (frac < b)),
                                "fractional coordinates outside the key block")
                        e = abs(v[a] - lam) / (1 + abs(lam))
                        C.check(e <= 1e-11, f"lam != block value ({e:.2e}) p={p} k={k}")
                        worst_lam = max(worst_lam, e)
                    else:
                        # only possible for integer k with every coordinate binary
                        C.check(k == m and frac.size == 0, "no key block but fractional coords")
                        C.check(abs(v[m - 1] - (s[m - 1] - l)) < 1e-12 and abs(v[m] - s[m]) < 1e-12,
                                "v_k != s_k - l or v_{k+1} != s_{k+1}")
                        # for p < 2, phi is very flat next to the root interval (g'(0) = 0):
                        # moving lam by delta below v_{k+1} changes phi by (delta/l)^(1/(p-1)),
                        # invisible below rounding, so Brent's root may sit that far outside
                        tol_lam = 1e-12 * (1 + abs(lam))
                        if p < 2:
                            tol_lam += l * (1e-14 * n) ** (p - 1.0)
                        C.check(v[m] - tol_lam <= lam <= v[m - 1] + tol_lam,
                                "root not in [v_{k+1}, v_k]")
                        for t in np.linspace(v[m], v[m - 1], 5):
                            C.check(abs(C.phi(t, x, k, l, p)) <= n * tol_r,
                                    "phi != 0 on [v_k+1, v_k]")
                        n_binary += 1
                    count += 1
    print(f"  (c) SLSQP dual -> primal: {count} instances, max|dy| = {worst_y_sl:.1e}, "
          f"max duality gap = {worst_gap:.1e}")
    print(f"  (d) exact PAV: lam == value of the fractional block (max rel err {worst_lam:.1e}); "
          f"{n_binary} all-binary instances with root interval [v_(k+1), v_k]")


def check_library(rng):
    itk = C.load_library()
    if itk is None:
        return
    worst, count = 0.0, 0
    n = 7  # one shape: the library compiles once per (p, solver, n)
    for p in PS:
        for k in (2.0, 1.5, 4.6):
            for l in (0.05, 0.3, 2.0):
                x = rng.normal(size=n)
                order = np.argsort(-x, kind="stable")
                v, _ = pav(x[order], perm_w(n, k), l, p)
                y = np.empty(n)
                y[order] = C.g((x[order] - v) / l, p)
                _, y_thr = C.threshold_solve(x, k, l, p)
                yl = C.lib_mask(itk, x, k, l, p, "pav")
                d = np.max(np.abs(yl - y_thr))
                C.check(d <= 1e-9, f"library pav p={p} n={n} k={k}: |dy| = {d:.2e}")
                # unclipped g((s - v)/l) carries rounding amplified by g for p > 2
                tol_r = 1e-11 + 10 * (1e-15 * (1 + np.max(np.abs(x))) / l) ** min(
                    1.0, 1.0 / (p - 1.0))
                C.check(np.max(np.abs(yl - y)) <= tol_r, "library pav != reference PAV")
                worst = max(worst, d)
                count += 1
    print(f"  (e) library solver='pav': {count} calls, max|y_lib - y_ref| = {worst:.1e}")


def main():
    rng = np.random.default_rng(1)
    print("isotonic_dual:")
    check_membership(rng)
    check_dual(rng)
    check_library(rng)
    print("isotonic_dual: OK")


if __name__ == "__main__":
    main()
