"""Numerical companion of proofs/magnitude_threshold.md.

Checks, on random instances (p in {4/3, 1.5, 2, 3}, integer and fractional k):
  (a) KKT: the threshold point y_i = min(g((s_i - lam)_+/l), h^{-1}(s_i)), with lam the
      Brent root of phi, z_i = min(1, y_i/lam), satisfies s_i = max(y_i, lam) + l y_i^(p-1)
      (y_i > 0), s_i <= lam (y_i = 0), sum z = k;
  (b) primal: it is at least as good as SLSQP on the joint (y, z) form of (P), and close;
  (c) dual: v = s - l y^(p-1) is nonincreasing and at least as good as SLSQP on the
      reference's isotonic problem (D), and the reference's output map applied to v is the
      closed-form output sign(x) min(s, t + g(t/l));
  (d) phi is nonincreasing with the stated limits, and is the mask equation with strength
      l lam^(p-1);
  (e) binary case: the root interval is [s_(k+1), h^{-1}(s_(k))] and the output is the hard
      top-k in magnitude once l s_(k+1)^(p-1) <= s_(k) - s_(k+1);
  (f) the library's soft_topk_mag (solvers "pav", "threshold"; "dykstra" for p = 2) agrees;
  (g) item 4 at the extremes: rows with magnitudes up to the float maximum (float64 and
      float32) where l s_(k+1)^(p-1) <= s_(k) - s_(k+1) holds exactly (in rationals, on
      the rounded inputs) give exactly the hard top-k in magnitude (solver "threshold").
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import numpy as np  # noqa: E402
from fractions import Fraction  # noqa: E402

from scipy.optimize import brentq, minimize  # noqa: E402

import _proofs_common as C  # noqa: E402

PS = (4.0 / 3.0, 1.5, 2.0, 3.0)


def gfun(u, p):
    return np.maximum(u, 0.0) ** (1.0 / (p - 1.0))


def hfun(y, l, p):
    return y + l * y ** (p - 1.0)


def hinv(s, l, p):
    return np.array([brentq(lambda y: hfun(y, l, p) - si, 0.0, si, xtol=1e-300, rtol=1e-15)
                     if si > 0 else 0.0 for si in np.atleast_1d(s)])


def phi(lam, s, k, l, p):
    return float(np.sum(np.minimum(1.0, gfun((s - lam) / l, p) / lam)) - k)


def threshold(s, k, l, p):
    if np.sum(s > 0) <= k:
        return 0.0
    with np.errstate(over="ignore", divide="ignore"):
        return brentq(phi, 1e-300, float(np.max(s)), args=(s, k, l, p), xtol=1e-300,
                      rtol=1e-15, maxiter=1000)


def primal_point(s, k, l, p):
    lam = threshold(s, k, l, p)
    y = np.minimum(gfun((s - lam) / l, p), hinv(s, l, p))
    return lam, y


def output(x, lam, l, p):
    s = np.abs(x)
    t = np.maximum(s - lam, 0.0)
    return np.sign(x) * np.minimum(s, t + gfun(t / l, p))


def ksupport_half_sq(y, k):
    """(1/2)||y||_(k)^2 = min_{z in C_k} sum y^2 / (2 z) by water-filling z = min(1, |y|/mu)."""
    a = np.abs(y)
    if np.sum(a > 0) <= k:
        return 0.5 * float(np.sum(a * a))
    mu = brentq(lambda m: np.sum(np.minimum(1.0, a / m)) - k, 1e-300, 2 * float(max(a.max(), a.sum() / k)),
                xtol=1e-300, rtol=1e-15)
    z = np.minimum(1.0, a / mu)
    nz = a > 0
    return 0.5 * float(np.sum(a[nz] ** 2 / z[nz]))


def primal_objective(y, s, k, l, p):
    return float(s @ y) - ksupport_half_sq(y, k) - l * float(np.sum(np.abs(y) ** p)) / p


def slsqp_joint(s, k, l, p, rng):
    """max_{y >= 0, z in C_k} sum s y - y^2/(2z) - l y^p/p (jointly concave) by SLSQP.

    SLSQP sometimes stalls on this problem (y^2/z near z = 0), so it is run from three
    starting points and the best objective is returned (y, objective)."""
    n = s.size
    def obj(u):
        y, z = u[:n], u[n:]
        return -(s @ y - np.sum(y * y / (2 * z)) - l * np.sum(y ** p) / p)
    def jac(u):
        y, z = u[:n], u[n:]
        return -np.concatenate([s - y / z - l * y ** (p - 1), y * y / (2 * z * z)])
    z0 = np.full(n, k / n)
    starts = [(z0 * s, z0), (s / (1 + l), z0), (rng.uniform(0, 1, n) * s, z0)]
    best = None
    for y0, z in starts:
        res = minimize(obj, np.concatenate([y0, z]), jac=jac, method="SLSQP",
                       bounds=[(0, None)] * n + [(1e-9, 1.0)] * n,
                       constraints=[{"type": "eq", "fun": lambda u: np.sum(u[n:]) - k,
                                     "jac": lambda u: np.concatenate([np.zeros(n), np.ones(n)])}],
                       options={"ftol": 1e-15, "maxiter": 3000})
        y = np.maximum(res.x[:n], 0.0)
        value = primal_objective(y, s, k, l, p)
        if best is None or value > best[1]:
            best = (y, value)
    return best


def dual_objective(v, s, w, l, p):
    q = p / (p - 1.0)
    return float(np.sum(np.abs(s - v) ** q) / (q * l ** (q - 1)) + 0.5 * np.sum(w * v * v))


def slsqp_dual(s, w, l, p):
    q = p / (p - 1.0)
    n = s.size
    res = minimize(lambda v: dual_objective(v, s, w, l, p), s / (1 + l * w),
                   jac=lambda v: -np.sign(s - v) * np.abs(s - v) ** (q - 1) / l ** (q - 1) + w * v,
                   method="SLSQP",
                   constraints=[{"type": "ineq", "fun": lambda v: v[:-1] - v[1:],
                                 "jac": lambda v: np.eye(n)[:-1] - np.eye(n)[1:]}],
                   options={"ftol": 1e-15, "maxiter": 2000})
    return res.x


def instances(rng):
    for p in PS:
        for n in (4, 7):
            for k in (1.0, 2.0, 2.5, n - 1.5):
                for scale in (0.5, 3.0):
                    x = rng.normal(size=n) * scale
                    l = float(rng.choice([0.05, 0.5, 2.0]))
                    yield p, x, k, l


def check_kkt_primal_dual(rng):
    count, reached, worst_y, worst_out = 0, 0, 0.0, 0.0
    for p, x, k, l in instances(rng):
        s = np.sort(np.abs(x))[::-1]
        lam, y = primal_point(s, k, l, p)
        tol = 1e-10 * (1 + s.max())
        # (a) KKT
        z = np.minimum(1.0, y / lam) if lam > 0 else (y > 0).astype(float)
        C.check(abs(np.sum(z) - k) <= 1e-9 or np.sum(s > 0) <= k, "sum z != k")
        pos = y > 0
        C.check(np.all(np.abs(np.maximum(y[pos], lam) + l * y[pos] ** (p - 1) - s[pos]) <= tol),
                "stationarity on y > 0")
        C.check(np.all(s[~pos] <= lam + tol), "a zero above the threshold")
        # (b) primal vs SLSQP
        ys, f_sl = slsqp_joint(s, k, l, p, rng)
        f_thr = primal_objective(y, s, k, l, p)
        C.check(f_thr >= f_sl - 1e-10 * (1 + abs(f_sl)), f"primal: threshold {f_thr} < SLSQP {f_sl}")
        if f_sl >= f_thr - 1e-7 * (1 + abs(f_thr)):  # SLSQP reached the optimum value
            reached += 1
            worst_y = max(worst_y, float(np.max(np.abs(ys - y))))
            C.check(np.max(np.abs(ys - y)) <= 5e-3, f"primal SLSQP far from threshold point p={p}")
        # (c) dual vs SLSQP, and the reference's output map
        w = np.clip(k - np.arange(s.size), 0, 1)
        v = s - l * y ** (p - 1)
        C.check(np.all(np.diff(v) <= 1e-12 * s.max()), "dual not nonincreasing")
        d_thr, d_sl = dual_objective(v, s, w, l, p), dual_objective(slsqp_dual(s, w, l, p), s, w, l, p)
        C.check(d_thr <= d_sl + 1e-10 * (1 + abs(d_sl)), f"dual: threshold {d_thr} > SLSQP {d_sl}")
        y_ref = gfun((s - v) / l, p)
        out_ref = y_ref + l * y_ref ** (p - 1)
        err = float(np.max(np.abs(out_ref - output(s, lam, l, p))))
        worst_out = max(worst_out, err)
        C.check(err <= 1e-9 * (1 + s.max()), "reference output map != closed form")
        count += 1
    print(f"  (a-c) {count} instances: KKT to 1e-10; primal and dual objectives at least as good "
          f"as SLSQP; where SLSQP reached the optimum ({reached}/{count}) max|y_slsqp - y| = "
          f"{worst_y:.1e}; reference map vs closed form {worst_out:.1e}")


def check_phi(rng):
    count = 0
    for p in PS:
        for _ in range(10):
            s = np.abs(rng.normal(size=8)) * 2
            k, l = 2.5, float(rng.choice([0.1, 1.0]))
            lams = np.linspace(1e-6, s.max(), 400)
            vals = np.array([phi(m, s, k, l, p) for m in lams])
            C.check(np.all(np.diff(vals) <= 1e-12), "phi increases")
            C.check(abs(vals[0] - (np.sum(s > 0) - k)) <= 1e-6 * s.size or vals[0] <= np.sum(s > 0) - k,
                    "phi(0+)")
            C.check(abs(vals[-1] + k) <= 1e-12, "phi(max s) != -k")
            for m in lams[::40]:  # the mask equation with strength l m^(p-1)
                mask = np.minimum(1.0, gfun((s - m) / (l * m ** (p - 1)), p))
                C.check(abs(np.sum(mask) - k - phi(m, s, k, l, p)) <= 1e-9, "not the mask equation")
            count += 1
    print(f"  (d) phi nonincreasing, limits, = mask equation with strength l lam^(p-1): {count} rows")


def check_binary(rng):
    count = 0
    for p in PS:
        for _ in range(10):
            s = np.sort(rng.uniform(0.2, 5.0, size=6))[::-1]
            k = int(rng.integers(1, 6))
            gap = s[k - 1] - s[k]
            l = 0.9 * gap / s[k] ** (p - 1)
            A, B = s[k], hinv(s[k - 1], l, p)[0]
            C.check(A < B, "empty root interval under the bound")
            for m in np.linspace(A, B, 5):
                C.check(phi(m, s, float(k), l, p) == 0.0 or abs(phi(m, s, float(k), l, p)) <= 1e-12,
                        "a point of [A, B] is not a root")
            C.check(phi(A * (1 - 1e-3), s, float(k), l, p) > 0 and phi(B * (1 + 1e-3), s, float(k), l, p) < 0,
                    "root interval larger than [A, B]")
            x = s * rng.choice([-1.0, 1.0], size=s.size)
            hard = np.where(np.abs(x) >= s[k - 1], x, 0.0)
            C.check(np.array_equal(output(x, 0.5 * (A + B), l, p), hard), "not the hard top-k")
            count += 1
    print(f"  (e) binary case: root interval [s_(k+1), h^-1(s_(k))], hard output: {count} rows")


def check_library(rng):
    itk = C.load_library()
    if itk is None:
        return
    import jax
    import jax.numpy as jnp

    fns = {}
    def lib(x, k, l, p, solver):
        key = (p, solver)
        if key not in fns:
            fns[key] = jax.jit(lambda x, k, l: itk.soft_topk_mag(x, k, regularization_strength=l, p=p, solver=solver))
        return np.asarray(fns[key](jnp.asarray(x), jnp.asarray(k), jnp.asarray(l)))

    count, worst = 0, 0.0
    for p, x, k, l in instances(rng):
        expected = output(x, threshold(np.abs(x), k, l, p), l, p)
        for solver in ("pav", "threshold"):
            err = float(np.max(np.abs(lib(x, k, l, p, solver) - expected)))
            worst = max(worst, err)
            C.check(err <= 1e-9 * (1 + np.abs(x).max()), f"library {solver} p={p} k={k} l={l}: {err}")
            count += 1
        if p == 2.0:
            dyk = np.asarray(itk.soft_topk_mag(jnp.asarray(x), k, regularization_strength=l, p=2.0, solver="dykstra", tol=1e-10))
            C.check(np.max(np.abs(dyk - expected)) <= 1e-6, "library dykstra")
            count += 1
    print(f"  (f) library: {count} calls, max error {worst:.1e}")


def check_library_extremes(rng):
    itk = C.load_library()
    if itk is None:
        return
    import jax
    import jax.numpy as jnp

    count = 0
    for dtype in (np.float64, np.float32):
        top = float(np.finfo(dtype).max)
        for p, q in ((2.0, 1), (4.0 / 3.0, 3)):  # l s^(p-1) <= gap  <=>  l^q s <= gap^q
            fn = jax.jit(lambda x, k, l, p=p: itk.soft_topk_mag(x, k, regularization_strength=l, p=p))
            for _ in range(6):
                s = np.sort(top * rng.uniform(1e-3, 1.0, size=5))[::-1].astype(dtype)
                k = int(rng.integers(1, 5))
                gap = float(s[k - 1]) - float(s[k])
                l = dtype(0.9 * gap / float(s[k]) ** (p - 1.0))
                holds = Fraction(float(l)) ** q * Fraction(float(s[k])) <= (
                    Fraction(float(s[k - 1])) - Fraction(float(s[k]))) ** q
                C.check(holds, "instance does not satisfy the bound")
                x = (s * rng.choice([-1.0, 1.0], size=s.size)).astype(dtype)
                hard = np.where(np.abs(x) >= s[k - 1], x, dtype(0))
                out = np.asarray(fn(jnp.asarray(x), jnp.asarray(k, dtype), jnp.asarray(l)))
                C.check(np.array_equal(out, hard), f"{dtype.__name__} p={p}: {out} != hard {hard}")
                count += 1
    print(f"  (g) near the float maximum (float64, float32): hard output exactly: {count} rows")


def main():
    rng = np.random.default_rng(7)
    print("magnitude_threshold:")
    check_kkt_primal_dual(rng)
    check_phi(rng)
    check_binary(rng)
    check_library(rng)
    check_library_extremes(rng)
    print("magnitude_threshold: OK")


if __name__ == "__main__":
    main()
