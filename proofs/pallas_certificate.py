"""Numerical companion of proofs/pallas_certificate.md.

Checks:
  1. on an independent numpy implementation of the safeguarded Newton/bisection iteration
     in float32 (its own bracket, link derivatives and stopping rules R1-R3), for masks
     with p in {4/3, 2, 3}, entropy and sigmoid: the invariant lo <= B_delta,
     hi >= A_delta at every pass, and the bound of each stopping rule against float64
     Brent roots, with delta the largest rounding error of the row's own evaluations;
  2. the fallback: with caps of 1, 2, 3 passes, rows not certified are solved again from
     the last iterate with a restarted bracket and satisfy the same bounds; the reported
     pass count exceeds the cap exactly for them;
  3. the library's PallasSolver (interpret mode on CPU) with 0, 3 and 16 free Newton
     passes returns the Brent threshold map, every row certified inside the kernel within
     the cap of Proposition 17 (proofs/pallas_bounded_iteration.md).
"""

import math
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import numpy as np  # noqa: E402
from scipy.optimize import brentq  # noqa: E402

import _proofs_common as C  # noqa: E402

F32 = np.float32
EPS = float(np.finfo(F32).eps)


# --------------------------------------------------------------------------
# masks m(z) with m', m'' (numpy, any float dtype), and the bracket of phi
# --------------------------------------------------------------------------
def pnorm(p):
    a = 1.0 / (p - 1.0)

    def derivs(z):
        inside = (z > 0) & (z < 1)
        zs = np.where(inside, z, z.dtype.type(0.5))
        m = np.where(z >= 1, 1, np.where(inside, zs ** a, 0)).astype(z.dtype)
        d1 = np.where(inside, a * zs ** (a - 1), 0).astype(z.dtype)
        d2 = np.where(inside, a * (a - 1) * zs ** (a - 2), 0).astype(z.dtype)
        return m, d1, d2

    def bracket(x, k, l):  # saturation [0, 1]: phi(min x - l) = n - k, phi(max x) = -k
        return np.min(x) - l, np.max(x)

    return derivs, bracket


def entropy():
    def derivs(z):  # min(1, e^z)
        e = np.exp(np.minimum(z, 0))
        below = z < 0
        return np.where(below, e, 1).astype(z.dtype), np.where(below, e, 0).astype(z.dtype), \
            np.where(below, e, 0).astype(z.dtype)

    def bracket(x, k, l):  # every y = 1 at min x; every y <= k/n at max x - l log(k/n)
        return np.min(x), np.max(x) - l * math.log(k / x.size)

    return derivs, bracket


def sigmoid():
    def derivs(z):
        with np.errstate(over="ignore"):  # exp(-z) = inf for z << 0: s = 0, as it should
            s = 1 / (1 + np.exp(-z))
        return s, s * (1 - s), s * (1 - s) * (1 - 2 * s)

    def bracket(x, k, l):  # every y >= k/n at min x - l logit(k/n), <= k/n at max x - ...
        shift = l * math.log((k / x.size) / (1 - k / x.size))
        return np.min(x) - shift, np.max(x) - shift

    return derivs, bracket


MASKS = {"p=4/3": pnorm(4.0 / 3.0), "p=2": pnorm(2.0), "p=3": pnorm(3.0),
         "entropy": entropy(), "sigmoid": sigmoid()}


def phi_parts(derivs, x, k, l, lam, dtype):
    """(phi, phi', phi'') at lam, every operation in ``dtype``."""
    x, k, l, lam = (np.asarray(v, dtype) for v in (x, k, l, lam))
    m, d1, d2 = derivs((x - lam) / l)
    return m.sum(dtype=dtype) - k, -d1.sum(dtype=dtype) / l, d2.sum(dtype=dtype) / (l * l)


def phi64(derivs, x, k, l, lam):
    return float(phi_parts(derivs, x, k, l, lam, np.float64)[0])


# --------------------------------------------------------------------------
# the iteration (float32), written from the rules of the proposition
# --------------------------------------------------------------------------
def iterate(derivs, x, k, l, lo, hi, start, cap):
    """Safeguarded Newton/bisection in float32 from ``start`` in [lo, hi].

    Returns dict(lam_out, rule (None if the cap was hit), passes, log of (lo, hi) after
    each pass, lam_at_stop, evaluated points)."""
    lo, hi, lam = F32(lo), F32(hi), F32(start)
    prev = F32(2) * (hi - lo)
    log, points = [], []
    for passes in range(1, cap + 1):
        phi, d1, _ = phi_parts(derivs, x, k, l, lam, F32)
        points.append(lam)
        if phi > 0:
            lo = lam
        if phi < 0:
            hi = lam
        log.append((lo, hi))
        step = phi / d1 if d1 < 0 else phi / F32(-1)
        scale = abs(lam) + F32(np.finfo(F32).tiny)
        small = abs(step) <= 4 * EPS * scale
        accept = d1 < 0 and small and abs(phi) <= math.sqrt(EPS) * (k + 1)
        newton = F32(lam - step)
        use_newton = accept or (d1 < 0 and lo < newton < hi and not small
                                and abs(step) <= 0.5 * abs(prev))
        candidate = newton if use_newton else F32(lo + F32(0.5) * (hi - lo))
        rule = "R1" if phi == 0 else "R2" if hi - lo <= 4 * EPS * scale else \
            "R3" if accept else None
        new = lam if phi == 0 else candidate
        prev, lam_before, lam = F32(new - lam), lam, new
        if rule is not None:
            return dict(lam_out=lam, rule=rule, passes=passes, log=log, lam=lam_before,
                        points=points, phi=phi, d1=d1, step=step)
    return dict(lam_out=lam, rule=None, passes=cap, log=log, points=points)


def band(derivs, x, k, l, delta, lo, hi):
    """[A_delta, B_delta] = {t: |phi(t)| <= delta} in float64 (Brent on phi -+ delta)."""
    f = lambda t, c: phi64(derivs, x, k, l, t) - c
    tol = dict(xtol=1e-300, rtol=4 * np.finfo(float).eps, maxiter=500)
    return (brentq(f, float(lo) - 1.0, float(hi) + 1.0, args=(delta,), **tol),
            brentq(f, float(lo) - 1.0, float(hi) + 1.0, args=(-delta,), **tol))


def rounding_error(derivs, x, k, l, points):
    """The largest |phi_hat - phi| over the evaluated points (the proposition's delta)."""
    return max(abs(float(phi_parts(derivs, x, k, l, t, F32)[0]) - phi64(derivs, x, k, l, float(t)))
               for t in points)


def check_run(derivs, x, k, l, run, lo0, hi0, stats):
    """The invariant and the bound of the rule that stopped the run."""
    delta = rounding_error(derivs, x, k, l, run["points"]) + 1e-300
    a, b = band(derivs, x, k, l, delta, lo0, hi0)
    slack = 1e-12 * (1 + abs(a) + abs(b))
    for lo, hi in run["log"]:
        C.check(float(lo) <= b + slack and float(hi) >= a - slack,
                f"invariant: [{lo}, {hi}] vs band [{a}, {b}]")
    out = float(run["lam_out"])
    scale = 4 * EPS * (abs(float(run["lam"])) + float(np.finfo(F32).tiny))
    dist = max(a - out, out - b, 0.0)
    if run["rule"] == "R1":
        C.check(dist <= slack, f"R1: {out} outside the band [{a}, {b}]")
    elif run["rule"] == "R2":
        lo, hi = run["log"][-1]
        C.check(dist <= float(hi - lo) + slack and float(hi - lo) <= scale * (1 + 8 * EPS),
                f"R2: distance {dist:.3e} > {float(hi - lo):.3e}")
    else:
        lam = float(run["lam"])
        root_a, root_b = band(derivs, x, k, l, 1e-300, lo0, hi0)
        between = abs(phi64(derivs, x, k, l, out)) <= abs(phi64(derivs, x, k, l, lam)) + slack
        C.check(between or dist <= scale + slack, f"R3: {dist:.3e} from the band")
        C.check(abs(phi64(derivs, x, k, l, lam)) <= math.sqrt(EPS) * (k + 1) + delta,
                "R3: residual above sqrt(eps) (k + 1) + delta")
        # the slope factor c: |phi'(lam)| / min |phi'| between lam and the root
        ts = np.linspace(lam, 0.5 * (root_a + root_b), 9)
        slopes = [abs(float(phi_parts(derivs, x, k, l, t, np.float64)[1])) for t in ts]
        if min(slopes) > 0:
            stats["c"].append(slopes[0] / min(slopes))
    stats[run["rule"]] = stats.get(run["rule"], 0) + 1


def random_row(rng, name):
    n = int(rng.choice([2, 5, 12, 40, 200]))
    x = rng.normal(size=n) * rng.choice([0.3, 1.0, 4.0])
    if rng.random() < 0.3:  # ties
        x = np.round(x * 2) / 2
    k = float(rng.choice([1.0, float(max(1, n // 3)), rng.uniform(0.05, n - 0.05)]))
    l = float(rng.choice([0.03, 0.3, 3.0]))
    return x.astype(F32).astype(np.float64), k, l


def check_rules(rng):
    stats = {"c": []}
    for name, (derivs, bracket) in MASKS.items():
        for _ in range(60):
            x, k, l = random_row(rng, name)
            lo0, hi0 = bracket(x, k, l)
            start = lo0 + rng.random() * (hi0 - lo0)
            run = iterate(derivs, x, k, l, lo0, hi0, start, cap=200)
            C.check(run["rule"] is not None, f"{name}: no stop within 200 passes")
            check_run(derivs, x, k, l, run, lo0, hi0, stats)
    c = np.array(stats["c"]) if stats["c"] else np.array([1.0])
    print(f"  1. {sum(stats.get(r, 0) for r in ('R1', 'R2', 'R3'))} float32 runs: R1 "
          f"{stats.get('R1', 0)}, R2 {stats.get('R2', 0)}, R3 {stats.get('R3', 0)}; invariant "
          f"and bounds hold; slope factor c of R3 median {np.median(c):.2f}, max {c.max():.2f}")


def check_fallback(rng):
    left = certified = 0
    for cap in (1, 2, 3):
        for name, (derivs, bracket) in MASKS.items():
            for _ in range(12):
                x, k, l = random_row(rng, name)
                lo0, hi0 = bracket(x, k, l)
                start = lo0 + rng.random() * (hi0 - lo0)
                kernel = iterate(derivs, x, k, l, lo0, hi0, start, cap)
                if kernel["rule"] is not None:
                    certified += 1
                    passes, run = kernel["passes"], kernel
                    C.check(passes <= cap, "a certified row took more than the cap")
                else:
                    left += 1
                    restart = min(max(float(kernel["lam_out"]), lo0), hi0)
                    run = iterate(derivs, x, k, l, lo0, hi0, restart, cap=200)
                    C.check(run["rule"] is not None, "fallback did not stop")
                    passes = cap + run["passes"]
                    C.check(passes > cap, "a fallback row reported within the cap")
                check_run(derivs, x, k, l, run, lo0, hi0, {"c": []})
    print(f"  2. caps 1, 2, 3: {left} rows left the kernel and were solved again within the "
          f"bounds ({certified} certified within the cap)")


def check_library(rng):
    itk = C.load_library()
    if itk is None:
        return
    import jax.numpy as jnp
    from implicit_topk import _apply
    from implicit_topk.kernels.gpu import pallas_threshold
    from implicit_topk.problems import CappedSimplex
    from implicit_topk.solvers.pallas import PallasSolver

    batch, n = 6, 9
    x = rng.normal(size=(batch, n))
    k = np.array([0.0, 1.0, 2.5, 4.0, 8.7, 9.0])
    l = np.array([0.2, 0.5, 1.0, 0.05, 3.0, 1.0])
    expected = np.array([C.threshold_solve(x[i], k[i], l[i], 4.0 / 3.0)[1] if 0 < k[i] < n
                         else np.full(n, k[i] / n) for i in range(batch)])
    worst = 0.0
    from implicit_topk.kernels.gpu import bounded_newton
    for free in (0, 3, 16):  # 0: ordered bisections from the first pass (Proposition 17)
        solver = PallasSolver(free_passes=free)
        y, info = _apply.threshold_operator(solver, x, k, l, axis=-1, return_info=True)
        worst = max(worst, float(np.max(np.sum(np.abs(np.asarray(y) - expected), -1))))
        _, passes, certified = pallas_threshold.threshold_rows(
            CappedSimplex(), jnp.asarray(x), jnp.asarray(k), jnp.asarray(l), free_passes=free)
        C.check(bool(np.all(np.asarray(certified))), f"free {free}: a row left uncertified")
        C.check(int(np.max(passes)) <= bounded_newton.pass_cap(np.float64, free),
                f"free {free}: {np.asarray(passes)} passes beyond the cap")
        C.check(np.array_equal(np.asarray(info.iter_num), np.asarray(passes)),
                f"free {free}: iter_num {np.asarray(info.iter_num)} vs kernel {np.asarray(passes)}")
    C.check(worst <= 1e-12, f"library: L1 distance {worst:.2e} to the Brent mask")
    print(f"  3. library (free passes 0, 3, 16): max L1 distance to Brent {worst:.1e}; every "
          "row certified in the kernel within the cap of Proposition 17")


def main():
    rng = np.random.default_rng(12)
    print("pallas_certificate:")
    check_rules(rng)
    check_fallback(rng)
    check_library(rng)
    print("pallas_certificate: OK")


if __name__ == "__main__":
    main()
