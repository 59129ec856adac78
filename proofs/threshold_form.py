"""Numerical companion of proofs/threshold_form.md.

Checks, on random instances:
  (a) the threshold map y_i = clip(g((x_i - lam)/l), 0, 1) at a root lam of phi
      is the optimum: it matches SLSQP on the primal (p in {4/3, 1.5, 2, 3},
      integer and fractional k), is never worse in objective, and carries an
      explicit KKT certificate (multipliers of the right sign);
  (b) the same for a non-power omega (negative entropy, h(u) = min(1, e^u)),
      as the statement is for any separable strictly convex omega;
  (c) phi is nonincreasing, continuous, equals n-k / -k at the bracket ends;
  (d) non-unique lam: for integer k and x_(k) - x_(k+1) > l every lam in
      [x_(k+1), x_(k) - l] is a root and gives the same y (the hard mask); with a
      fractional coordinate the root is unique (phi strictly decreasing there);
  (e) the library's soft_topk_mask (solvers "pav", "threshold", "auto") agrees.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import numpy as np  # noqa: E402
from scipy.optimize import brentq, minimize  # noqa: E402

import _proofs_common as C  # noqa: E402

PS = (4.0 / 3.0, 1.5, 2.0, 3.0)


def kkt_certificate(x, y, lam, l, p, tol=1e-9):
    """Check stationarity l*omega'(y) - x + lam - alpha + beta = 0 with alpha, beta >= 0,
    alpha_i y_i = 0, beta_i (1 - y_i) = 0 and primal feasibility."""
    r = l * C.omega_prime(y, p) - x + lam  # = alpha - beta
    alpha = np.where(y <= 0.0, np.maximum(r, 0.0), 0.0)
    beta = np.where(y >= 1.0, np.maximum(-r, 0.0), 0.0)
    free = (y > 0.0) & (y < 1.0)
    scale = 1.0 + np.max(np.abs(x))
    C.check(np.all(np.isfinite(y)) and np.all(y >= 0) and np.all(y <= 1), "box violated")
    C.check(np.all(np.abs(r[free]) <= tol * scale), f"stationarity on free set {r[free]}")
    C.check(np.all(r[y <= 0] >= -tol * scale), "alpha < 0 on a zero coordinate")
    C.check(np.all(r[y >= 1] <= tol * scale), "beta < 0 on a one coordinate")
    return alpha, beta


def check_power(rng):
    worst_dy, worst_gap, count = 0.0, 0.0, 0
    for p in PS:
        for n in (4, 6, 8):
            for k in (1.0, 2.0, 2.5, n - 1.3, 0.4):
                for _ in range(2):
                    x = rng.normal(size=n) * rng.choice([0.3, 1.0, 3.0])
                    l = float(rng.choice([0.05, 0.3, 1.0, 5.0]))
                    lam, y = C.threshold_solve(x, k, l, p)
                    C.check(abs(np.sum(y) - k) <= 1e-12 * n, "sum(y) != k")
                    kkt_certificate(x, y, lam, l, p)
                    ys, res = C.slsqp_primal(x, k, l, p)
                    f_ref = C.primal_objective(y, x, l, p)
                    f_sl = C.primal_objective(ys, x, l, p)
                    # the threshold point is feasible, so it can't beat the true optimum;
                    # it must be at least as good as what SLSQP finds
                    C.check(f_ref <= f_sl + 1e-10 * (1 + abs(f_sl)),
                            f"threshold objective {f_ref} worse than SLSQP {f_sl} (p={p})")
                    dy = np.max(np.abs(ys - y))
                    # SLSQP stops at ftol; strong convexity is weak for p>2 near 0
                    C.check(dy <= 2e-4, f"SLSQP vs threshold |dy|={dy:.2e} p={p} k={k} n={n}")
                    worst_dy = max(worst_dy, dy)
                    worst_gap = max(worst_gap, f_ref - f_sl)
                    count += 1
    print(f"  (a) power omega: {count} instances, p in {[round(p, 3) for p in PS]}, "
          f"max|y_thr - y_slsqp| = {worst_dy:.1e}, max(f_thr - f_slsqp) = {worst_gap:.1e}")


def check_entropy(rng):
    """omega(y) = y log y - y: omega' = log, h(u) = min(1, exp(u))."""
    worst, count = 0.0, 0
    for n in (4, 6):
        for k in (1.0, 1.7, n - 1.5):
            for _ in range(3):
                x = rng.normal(size=n)
                l = float(rng.choice([0.5, 1.0, 2.0]))

                def yy(lam):
                    return np.minimum(1.0, np.exp((x - lam) / l))

                lam = brentq(lambda t: np.sum(yy(t)) - k, np.min(x) - 50, np.max(x) + 50,
                             xtol=1e-15)
                y = yy(lam)

                def obj(v):
                    v = np.maximum(v, 1e-300)
                    return l * np.sum(v * np.log(v) - v) - x @ v

                res = minimize(obj, np.full(n, k / n),
                               jac=lambda v: l * np.log(np.maximum(v, 1e-300)) - x,
                               method="SLSQP", bounds=[(1e-12, 1.0)] * n,
                               constraints=[{"type": "eq", "fun": lambda v: np.sum(v) - k}],
                               options={"ftol": 1e-14, "maxiter": 1000})
                C.check(obj(y) <= obj(res.x) + 1e-10, "entropy: threshold worse than SLSQP")
                d = np.max(np.abs(res.x - y))
                C.check(d <= 1e-4, f"entropy: |dy| = {d}")
                worst = max(worst, d)
                count += 1
    print(f"  (b) negative entropy: {count} instances, max|y_thr - y_slsqp| = {worst:.1e}")


def check_phi_shape(rng):
    for p in PS:
        for _ in range(5):
            n = 7
            x = rng.normal(size=n)
            k, l = 2.6, 0.4
            lo, hi = C.bracket(x, l)
            grid = np.linspace(lo, hi, 20001)
            vals = np.sum(C.h((x[None, :] - grid[:, None]) / l, p), axis=1) - k
            C.check(np.all(np.diff(vals) <= 1e-14), "phi is not nonincreasing")
            C.check(abs(vals[0] - (n - k)) < 1e-12 and abs(vals[-1] + k) < 1e-12,
                    "phi at bracket ends")
            # continuity: the largest jump shrinks with the grid step
            jump = np.max(np.abs(np.diff(vals)))
            coarse = np.max(np.abs(np.diff(vals[::10])))
            C.check(jump < coarse / 2, "phi does not look continuous")
    print("  (c) phi nonincreasing and continuous on a 20001-point grid, phi(lo)=n-k, phi(hi)=-k")


def check_nonunique(rng):
    count = 0
    for p in PS:
        for _ in range(5):
            n, k = 6, 2
            x = np.sort(rng.normal(size=n))[::-1].copy()
            x[:k] += 2.0  # make a gap
            l = 0.5 * (x[k - 1] - x[k])
            lo, hi = x[k], x[k - 1] - l  # the root interval
            y_ref = C.hard_topk_mask(x, k)
            for t in np.linspace(lo, hi, 11):
                C.check(abs(C.phi(t, x, k, l, p)) <= 1e-12, "phi != 0 inside root interval")
                C.check(np.allclose(C.h((x - t) / l, p), y_ref, rtol=0, atol=1e-12),
                        "y depends on the root")
            eps = 1e-3 * l
            C.check(C.phi(lo - eps, x, k, l, p) > 0 and C.phi(hi + eps, x, k, l, p) < 0,
                    "phi vanishes outside the predicted root interval")
            # the SLSQP optimum is the same hard mask
            ys, _ = C.slsqp_primal(x, k, l, p)
            C.check(np.max(np.abs(ys - y_ref)) < 1e-6, "SLSQP disagrees on a hard instance")
            # fractional coordinate present -> unique root: phi strictly decreasing there
            kf = 2.5
            lam, y = C.threshold_solve(x, kf, l, p)
            C.check(np.any((y > 0) & (y < 1)), "fractional k but no fractional coordinate")
            C.check(C.phi(lam - 1e-7, x, kf, l, p) > 0 > C.phi(lam + 1e-7, x, kf, l, p),
                    "root not isolated although a coordinate is fractional")
            count += 1
    print(f"  (d) non-unique lam: {count} instances, phi = 0 and y constant on "
          "[x_(k+1), x_(k) - l]; unique root whenever a coordinate is fractional")


def check_library(rng):
    itk = C.load_library()
    if itk is None:
        return
    worst, count = 0.0, 0
    n = 7  # one shape: the library compiles once per (p, solver, n)
    for p in PS:
        for k in (1.0, 3.0, 2.5, 0.7, 6.2):
            for l in (0.05, 0.5, 2.0):
                x = rng.normal(size=n)
                _, y = C.threshold_solve(x, k, l, p)
                for solver in ("pav", "threshold", "auto"):
                    yl = C.lib_mask(itk, x, k, l, p, solver)
                    d = np.max(np.abs(yl - y))
                    C.check(d <= 1e-9, f"library solver={solver} p={p} n={n} k={k}: |dy|={d:.2e}")
                    worst = max(worst, d)
                    count += 1
    print(f"  (e) library: {count} calls (pav/threshold/auto), max|y_lib - y_ref| = {worst:.1e}")


def main():
    rng = np.random.default_rng(0)
    print("threshold_form:")
    check_power(rng)
    check_entropy(rng)
    check_phi_shape(rng)
    check_nonunique(rng)
    check_library(rng)
    print("threshold_form: OK")


if __name__ == "__main__":
    main()
