"""Numerical companion of proofs/fenchel_young.md (the Fenchel-Young loss of the top-k LP).

L(theta; y) = f*(theta) + l Omega(y) - <theta, y>,  f*(theta) = max_{y' in C_k} <theta, y'> - l Omega(y').

Checks, on random instances, for Omega = sum |y|^p / p (p in {4/3, 1.5, 2, 3}), negative entropy,
binary entropy (sigmoid) and Laplace:
  (a) f* by the threshold map agrees with SLSQP on the primal (never below it) and, for the
      p-norms, with brute-force face enumeration;
  (b) L >= 0, L(theta; y*(theta)) = 0, the exact identity
      L = l B_Omega(y, y*) + <alpha, y> + <beta, 1 - y> (KKT multipliers), and
      L >= (l mu / 2) ||y - y*||^2 for the regularizers with modulus mu > 0; L > 0 off y*;
  (c) grad_theta L = y* - y and dL/dl = Omega(y) - Omega(y*) against central finite
      differences of the reference value (float64); (remark) f* is concave in k, df*/dk = lambda
      where the threshold is unique, one-sided derivatives at the ends of the root interval
      on a hard mask;
  (d) convexity: second differences along random segments in theta and in (theta, l) >= 0,
      chords above the graph, monotone gradient;
  (e) the Hessian in theta (= Jacobian of y*, by finite differences) is symmetric PSD and
      matches the closed form of implicit_gradient.md for the p-norms;
  (f) k = 1 special cases: entropy gives l * (logsumexp(theta / l) - theta_c / l), p = 2 the
      sparsemax loss; the hand value of tests/test_losses.py;
  (g) l -> 0: L - L_0 lies in l [Omega(y) - Omega(v), Omega(y) - n omega(k/n)], with
      L_0 = max over the vertices v of C_k (enumerated) of <theta, v> - <theta, y>;
  (h) the library's topk_fenchel_young_loss: value, gradients in scores and l, exact zeros
      of the gradient where y* = 0 = y, zero at its own mask, Hessian (second derivatives
      through the mask's implicit Jacobian), and the C_k check on the target.
"""

import itertools
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import numpy as np  # noqa: E402
from scipy.optimize import brentq, minimize  # noqa: E402
from scipy.special import expit, logsumexp, xlogy  # noqa: E402

import _proofs_common as C  # noqa: E402


# --------------------------------------------------------------------------
# regularizers (numpy, independent of the library): omega, omega', h = clip(g, 0, 1), mu
# --------------------------------------------------------------------------
class Reg:
    def __init__(self, name, omega, omega_prime, h, mu, ends, lib_kwargs):
        self.name, self.omega, self.omega_prime, self.h = name, omega, omega_prime, h
        self.mu = mu  # omega'(s) - omega'(t) >= mu (s - t) on (0, 1); 0 if only strictly convex
        self.ends = ends  # (a, b) = (omega'(0+), omega'(1-)), possibly infinite
        self.dense = not np.all(np.isfinite(ends))  # y* never touches an end where omega' is infinite
        self.lib_kwargs = lib_kwargs

    def Omega(self, y):
        return float(np.sum(self.omega(np.asarray(y, dtype=np.float64))))


def pnorm(p):
    return Reg(f"p={p:.3g}", lambda t: C.omega(t, p), lambda t: C.omega_prime(t, p),
               lambda u: C.h(u, p), p - 1.0 if p <= 2 else 0.0, (0.0, 1.0), {"p": p})


def _laplace_omega(t):
    lo = xlogy(t, 2 * t) - t
    s = 1 - t
    hi = xlogy(s, 2 * s) - s
    return np.where(t < 0.5, lo, hi)


def _laplace_prime(t):
    with np.errstate(divide="ignore"):
        return np.where(t < 0.5, np.log(2 * t), -np.log(2 * (1 - t)))


def _laplace_h(u):
    return np.where(u < 0, 0.5 * np.exp(np.minimum(u, 0)), 1 - 0.5 * np.exp(-np.maximum(u, 0)))


ENTROPY = Reg("entropy", lambda t: xlogy(t, t) - t, np.log, lambda u: np.exp(np.minimum(u, 0.0)),
              1.0, (-np.inf, 0.0), {"regularizer": "entropy"})
SIGMOID = Reg("sigmoid", lambda t: xlogy(t, t) + xlogy(1 - t, 1 - t),
              lambda t: np.log(t) - np.log1p(-t), expit, 4.0, (-np.inf, np.inf),
              {"regularizer": "sigmoid"})
LAPLACE = Reg("laplace", _laplace_omega, _laplace_prime, _laplace_h, 2.0, (-np.inf, np.inf),
              {"regularizer": "laplace"})
PS = (4.0 / 3.0, 1.5, 2.0, 3.0)
REGS = [pnorm(p) for p in PS] + [ENTROPY, SIGMOID, LAPLACE]


# --------------------------------------------------------------------------
# references
# --------------------------------------------------------------------------
def solve(theta, k, l, reg):
    """(lam, y*) by Brent on phi(lam) = sum h((theta - lam) / l) - k (threshold_form.md)."""
    theta = np.asarray(theta, dtype=np.float64)

    def phi(lam):
        return float(np.sum(reg.h((theta - lam) / l)) - k)

    lo, hi = np.min(theta) - 2 * l - 1.0, np.max(theta) + 1.0
    while phi(lo) <= 0:
        lo -= 10 * l
    while phi(hi) >= 0:
        hi += 10 * l
    lam = brentq(phi, lo, hi, xtol=1e-15, rtol=4 * np.finfo(float).eps, maxiter=500)
    return lam, reg.h((theta - lam) / l)


def conj(theta, k, l, reg):
    """f*(theta) = <theta, y*> - l Omega(y*), evaluated as the dual value at the root,

    q(lam) = lam k + sum_i [(theta_i - lam) y_i - l omega(y_i)],  y_i = h((theta_i - lam) / l),

    which equals it at the exact root and, q being stationary there, is off by O(err(lam)^2)
    rather than O(err(lam)) (the sum constraint is only met to the root's accuracy).
    """
    lam, y = solve(theta, k, l, reg)
    return lam * k + float((theta - lam) @ y) - l * reg.Omega(y)


def loss(theta, y, k, l, reg):
    return conj(theta, k, l, reg) + l * reg.Omega(y) - float(np.asarray(theta) @ y)


def conj_slsqp(theta, k, l, reg):
    """f* by SLSQP on the primal (a feasible point: a lower bound on f*)."""
    n = theta.size
    eps = 1e-12 if reg.dense else 0.0

    def obj(y):
        y = np.clip(y, eps, 1 - eps) if reg.dense else y
        return -(theta @ y - l * np.sum(reg.omega(y)))

    def jac(y):
        y = np.clip(y, eps, 1 - eps) if reg.dense else y
        return -(theta - l * reg.omega_prime(y))

    best = -np.inf
    for y0 in (np.full(n, k / n), solve(theta, k, min(10 * l, 1e3), reg)[1]):
        res = minimize(obj, y0, jac=jac, method="SLSQP", bounds=[(eps, 1.0 - eps)] * n,
                       constraints=[{"type": "eq", "fun": lambda y: np.sum(y) - k,
                                     "jac": lambda y: np.ones_like(y)}],
                       options={"ftol": 1e-15, "maxiter": 2000})
        y = np.clip(res.x, 0.0, 1.0)
        r = k - y.sum()  # repair the sum in proportion to the room left in the box
        room = (1 - y) if r > 0 else y
        y = y + r * room / room.sum()
        if np.all((y >= 0) & (y <= 1)):  # a point of C_k: its value is a lower bound on f*
            best = max(best, float(theta @ y) - l * reg.Omega(y))
    return best


def multipliers(theta, lam, l, reg):
    """KKT of threshold_form.md: theta - l v = lam 1 - alpha + beta with v = omega'(y*).

    With u = (theta - lam) / l and (a, b) = (omega'(0), omega'(1)): v = clip(u, a, b),
    alpha = l (a - u)_+ (nonzero only where y* = 0), beta = l (u - b)_+ (only where y* = 1).
    v is taken from u, not from omega'(y*): for the dense regularizers y* can round to 0 or 1
    where omega' is infinite, although mathematically it is inside.
    """
    u = (theta - lam) / l
    a, b = reg.ends
    return l * np.maximum(a - u, 0.0), l * np.maximum(u - b, 0.0), np.clip(u, a, b)


def bregman(y, ystar, v, reg):
    """B_Omega(y, y*) = Omega(y) - Omega(y*) - <v, y - y*>, v = omega'(y*)."""
    return reg.Omega(y) - reg.Omega(ystar) - float(v @ (y - ystar))


def vertices(n, k):
    """All vertices of C_k: floor(k) ones, one entry k - floor(k) (if fractional), zeros."""
    m = int(np.floor(k + 1e-12))
    f = k - m
    out = set()
    for ones in itertools.combinations(range(n), m):
        rest = [i for i in range(n) if i not in ones]
        for j in (rest if f > 1e-12 else [None]):
            v = np.zeros(n)
            v[list(ones)] = 1.0
            if j is not None:
                v[j] = f
            out.add(tuple(v))
    return [np.array(v) for v in out]


def random_target(rng, n, k, reg):
    """A point of C_k: a vertex, another mask y*(theta'), or a random convex combination."""
    kind = int(rng.integers(3))
    verts = vertices(n, k)
    if kind == 0:
        return verts[int(rng.integers(len(verts)))]
    if kind == 1:
        return solve(rng.normal(size=n), k, float(rng.choice([0.2, 1.0, 5.0])), reg)[1]
    w = rng.dirichlet(np.ones(4))
    pick = [verts[int(i)] for i in rng.integers(len(verts), size=4)]
    return np.clip(np.sum([wi * v for wi, v in zip(w, pick)], axis=0), 0.0, 1.0)  # 1 + 2e-16 -> 1


def random_instance(rng, n_range=(3, 8)):
    n = int(rng.integers(*n_range))
    k = float(rng.choice([1.0, 2.0, 1.5, n - 1.3, 0.6]))
    k = min(max(k, 0.3), n - 0.3)
    l = float(rng.choice([0.1, 0.5, 1.0, 3.0]))
    theta = rng.normal(size=n) * float(rng.choice([0.5, 1.0, 3.0]))
    return theta, n, k, l


# --------------------------------------------------------------------------
# checks
# --------------------------------------------------------------------------
def check_conjugate(rng):
    worst_sl, worst_bf, count = 0.0, 0.0, 0
    for reg in REGS:
        for _ in range(12):
            theta, n, k, l = random_instance(rng)
            fs = conj(theta, k, l, reg)
            fsl = conj_slsqp(theta, k, l, reg)
            scale = 1.0 + abs(fs)
            C.check(fs >= fsl - 1e-11 * scale, f"{reg.name}: threshold f* {fs} below SLSQP {fsl}")
            C.check(fs - fsl <= 1e-7 * scale, f"{reg.name}: f* {fs} vs SLSQP {fsl}")
            worst_sl = max(worst_sl, fs - fsl)
            if "p" in reg.lib_kwargs:
                p = reg.lib_kwargs["p"]
                yb = C.brute_force_solve(theta, k, l, p)
                fb = float(theta @ yb) - l * reg.Omega(yb)
                C.check(abs(fs - fb) <= 1e-11 * scale, f"{reg.name}: f* vs brute force {fs} {fb}")
                worst_bf = max(worst_bf, abs(fs - fb))
            count += 1
    print(f"  (a) f*: {count} instances, 7 regularizers; 0 <= f*_thr - f*_slsqp <= {worst_sl:.1e}, "
          f"|f*_thr - f*_faces| <= {worst_bf:.1e} (p-norms)")


def check_nonnegative(rng):
    count, worst_id, min_ratio = 0, 0.0, np.inf
    for reg in REGS:
        for _ in range(25):
            theta, n, k, l = random_instance(rng)
            lam, ys = solve(theta, k, l, reg)
            C.check(abs(loss(theta, ys, k, l, reg)) <= 1e-12 * (1 + np.abs(theta).sum()),
                    f"{reg.name}: L(theta; y*) != 0")
            alpha, beta, v = multipliers(theta, lam, l, reg)
            C.check(np.all(alpha >= 0) and np.all(beta >= 0), "multiplier sign")
            for _ in range(4):
                y = random_target(rng, n, k, reg)
                C.check(abs(y.sum() - k) <= 1e-12 * n and np.all((y >= 0) & (y <= 1)), "target not in C_k")
                L = loss(theta, y, k, l, reg)
                tol = 1e-11 * (1 + np.abs(theta).sum())
                C.check(L >= -tol, f"{reg.name}: L = {L} < 0")
                B = bregman(y, ys, v, reg)
                ident = l * B + float(alpha @ y) + float(beta @ (1 - y))
                C.check(abs(L - ident) <= 1e-9 * (1 + abs(L)), f"{reg.name}: identity {L} vs {ident}")
                worst_id = max(worst_id, abs(L - ident))
                d2 = float(np.sum((y - ys) ** 2))
                C.check(L >= 0.5 * l * reg.mu * d2 - tol, f"{reg.name}: strong convexity bound {L} < {d2}")
                if d2 > 1e-6:
                    C.check(L > 0 and B > 0, f"{reg.name}: L = {L} at y != y*")
                    if reg.mu > 0:
                        min_ratio = min(min_ratio, L / (0.5 * l * reg.mu * d2))
                count += 1
    print(f"  (b) L >= 0 on {count} (theta, y) pairs, L(theta; y*) = 0, identity "
          f"L = l B + <alpha,y> + <beta,1-y> to {worst_id:.1e}; min L / (l mu |y-y*|^2 / 2) = "
          f"{min_ratio:.3f} >= 1")


def fd(fun, v, step):
    return (fun(v + step) - fun(v - step)) / (2 * step)


def check_gradients(rng):
    worst_t, worst_l, worst_k, count, hard_k = 0.0, 0.0, 0.0, 0, 0
    for reg in REGS:
        for _ in range(6):
            theta, n, k, l = random_instance(rng)
            y = random_target(rng, n, k, reg)
            lam, ys = solve(theta, k, l, reg)
            grad = ys - y
            h = 1e-6 * (1 + np.max(np.abs(theta)))
            num = np.array([fd(lambda t: loss(theta + t * np.eye(n)[i], y, k, l, reg), 0.0, h)
                            for i in range(n)])
            d = np.max(np.abs(num - grad))
            C.check(d <= 1e-6, f"{reg.name}: grad_theta |fd - (y* - y)| = {d:.2e}")
            worst_t = max(worst_t, d)
            dl = fd(lambda s: loss(theta, y, k, s, reg), l, 1e-6 * l)
            ref = reg.Omega(y) - reg.Omega(ys)
            C.check(abs(dl - ref) <= 1e-6 * (1 + abs(ref)), f"{reg.name}: dL/dl {dl} vs {ref}")
            worst_l = max(worst_l, abs(dl - ref))
            # remark: f* is concave in k with superdifferential the root set of phi:
            # df*/dk = lam where lam is unique; one-sided [x_(k+1) - l a, x_(k) - l b] on a hard mask
            fk = lambda s: conj(theta, s, l, reg)  # noqa: E731
            e = 1e-6
            right, left = (fk(k + e) - fk(k)) / e, (fk(k) - fk(k - e)) / e
            hard = np.all((ys < 1e-9) | (ys > 1 - 1e-9))
            if hard:
                srt = np.sort(theta)[::-1]
                m = int(round(k))
                a, b = reg.ends
                lo, hi = srt[m] - l * a, srt[m - 1] - l * b
                # concave: the quotients bracket the one-sided derivatives; moving mass e onto a
                # zero coordinate costs l omega(e) = l e^p / p, so right >= lo - l e^(p-1)
                slack = l * e ** (reg.lib_kwargs["p"] - 1) + 1e-6 * (1 + abs(lo))
                C.check(-slack <= right - lo <= 1e-6 and abs(left - hi) <= 1e-5 * (1 + abs(hi)),
                        f"{reg.name}: one-sided df*/dk {right}, {left} vs [{lo}, {hi}]")
                hard_k += 1
            else:
                d = abs(0.5 * (left + right) - lam)
                C.check(d <= 1e-5 * (1 + abs(lam)), f"{reg.name}: df*/dk {0.5 * (left + right)} vs lam {lam}")
                worst_k = max(worst_k, d)
            C.check(left >= right - 1e-6, f"{reg.name}: f* not concave in k")
            count += 1
    print(f"  (c) gradients ({count} instances, central differences): |dL/dtheta - (y* - y)| <= "
          f"{worst_t:.1e}, |dL/dl - (Omega(y) - Omega(y*))| <= {worst_l:.1e}, "
          f"|df*/dk - lam| <= {worst_k:.1e} (one-sided: the ends of the root interval, on {hard_k} "
          "hard masks)")


def check_convexity(rng):
    count = 0
    for reg in REGS:
        for _ in range(5):
            theta0, n, k, l0 = random_instance(rng)
            theta1 = rng.normal(size=n) * 2.0
            l1 = float(rng.choice([0.1, 0.7, 2.0]))
            y = random_target(rng, n, k, reg)
            ts = np.linspace(0.0, 1.0, 41)
            along = np.array([loss(theta0 + t * (theta1 - theta0), y, k, l0, reg) for t in ts])
            joint = np.array([loss(theta0 + t * (theta1 - theta0), y, k, l0 + t * (l1 - l0), reg)
                              for t in ts])
            for vals, what in ((along, "theta"), (joint, "(theta, l)")):
                scale = 1e-10 * (1 + np.max(np.abs(vals)))
                C.check(np.all(vals[:-2] + vals[2:] - 2 * vals[1:-1] >= -scale),
                        f"{reg.name}: not convex along a segment in {what}")
                chord = vals[0] + ts * (vals[-1] - vals[0])
                C.check(np.all(vals <= chord + scale), f"{reg.name}: above the chord in {what}")
            g0 = solve(theta0, k, l0, reg)[1] - y
            g1 = solve(theta1, k, l0, reg)[1] - y
            C.check(float((g1 - g0) @ (theta1 - theta0)) >= -1e-12, "gradient not monotone")
            count += 1
    print(f"  (d) convexity on {count} random segments (41 points): second differences >= 0 in "
          "theta and jointly in (theta, l), chords above the graph, monotone gradient")


def jacobian_fd(theta, k, l, reg, h=1e-6):
    n = theta.size
    return np.stack([(solve(theta + h * e, k, l, reg)[1] - solve(theta - h * e, k, l, reg)[1]) / (2 * h)
                     for e in np.eye(n)], axis=1)


def check_hessian(rng):
    count, worst_cf = 0, 0.0
    for reg in REGS:
        for _ in range(4):
            theta, n, k, l = random_instance(rng)
            lam, ys = solve(theta, k, l, reg)
            J = jacobian_fd(theta, k, l, reg)
            C.check(np.max(np.abs(J - J.T)) <= 1e-5, f"{reg.name}: Jacobian of y* not symmetric")
            C.check(np.min(np.linalg.eigvalsh(0.5 * (J + J.T))) >= -1e-6, f"{reg.name}: not PSD")
            if "p" in reg.lib_kwargs:  # implicit_gradient.md: (diag(d) - d d^T / D) / l
                p = reg.lib_kwargs["p"]
                u = (theta - lam) / l
                free = (ys > 0) & (ys < 1)
                if np.all(np.abs(u - 1) > 1e-4) and np.all(np.abs(u) > 1e-4) and free.any():
                    d = np.where(free, np.where(free, ys, 1.0) ** (2 - p) / (p - 1), 0.0)
                    Jc = (np.diag(d) - np.outer(d, d) / d.sum()) / l
                    C.check(np.max(np.abs(J - Jc)) <= 1e-5, f"{reg.name}: Hessian vs closed form")
                    worst_cf = max(worst_cf, np.max(np.abs(J - Jc)))
            count += 1
    print(f"  (e) Hessian of L in theta = Jacobian of y* (finite differences, {count} instances): "
          f"symmetric PSD; p-norms match (diag(d) - dd^T/D)/l to {worst_cf:.1e}")


def check_special_cases(rng):
    for _ in range(20):
        n = int(rng.integers(2, 8))
        theta = rng.normal(size=n) * 2
        c = int(rng.integers(n))
        e = np.eye(n)[c]
        l = float(rng.choice([0.3, 1.0, 2.0]))
        val = loss(theta, e, 1.0, l, ENTROPY)
        ref = l * logsumexp(theta / l) - theta[c]
        C.check(abs(val - ref) <= 1e-10 * (1 + abs(ref)), f"entropy k=1: {val} vs {ref}")
        # p = 2, k = 1: the sparsemax loss (Martins & Astudillo 2016), l = 1 on theta / l
        s = C.brute_force_solve(theta / l, 1.0, 1.0, 2.0)
        ref = l * (float(theta / l @ s) - 0.5 * float(s @ s) + 0.5 - theta[c] / l)
        val = loss(theta, e, 1.0, l, pnorm(2.0))
        C.check(abs(val - ref) <= 1e-10 * (1 + abs(ref)), f"sparsemax loss: {val} vs {ref}")
    theta, target = np.array([1.0, 0.0, -1.0]), np.array([0.0, 1.0, 0.0])
    C.check(abs(loss(theta, target, 1.0, 1.0, pnorm(2.0)) - 1.0) <= 1e-14, "hand value")
    C.check(np.allclose(solve(theta, 1.0, 1.0, pnorm(2.0))[1] - target, [1, -1, 0], atol=1e-14),
            "hand gradient")
    print("  (f) k = 1: entropy -> l logsumexp(theta/l) - theta_c, p = 2 -> the sparsemax loss "
          "(20 instances each); hand value L((1,0,-1); e_2) = 1, gradient (1,-1,0)")


def check_small_l(rng):
    count = 0
    for reg in REGS:
        for _ in range(4):
            theta, n, k, _ = random_instance(rng, (3, 7))
            y = random_target(rng, n, k, reg)
            verts = vertices(n, k)
            L0 = max(float(theta @ v) for v in verts) - float(theta @ y)
            om_v = reg.Omega(verts[0])
            C.check(all(abs(reg.Omega(v) - om_v) <= 1e-12 for v in verts), "Omega differs on vertices")
            om_min = n * float(reg.omega(np.array(k / n)))
            for l in (1.0, 0.1, 0.01, 1e-3):
                L = loss(theta, y, k, l, reg)
                lo = L0 + l * (reg.Omega(y) - om_v)
                hi = L0 + l * (reg.Omega(y) - om_min)
                tol = 1e-10 * (1 + abs(L))
                C.check(lo - tol <= L <= hi + tol, f"{reg.name}: l={l}: {L} not in [{lo}, {hi}]")
            count += 1
    print(f"  (g) l -> 0 ({count} instances, vertices enumerated): L - L_0 in "
          "l [Omega(y) - Omega(vertex), Omega(y) - n omega(k/n)], L_0 = max_v <theta, v> - <theta, y>")


def check_library(rng):
    itk = C.load_library()
    if itk is None:
        return
    import jax
    import jax.numpy as jnp

    from implicit_topk.losses import topk_fenchel_young_loss

    n, batch = 6, 5
    worst = {"value": 0.0, "grad": 0.0, "dl": 0.0, "hess": 0.0}
    count, zeros = 0, 0
    for reg in REGS:
        # one compilation per regularizer: k and a per-row l are traced; the per-row dL/dl is
        # the gradient of the sum of the rows w.r.t. the vector of l's; also L(theta; mask(theta))
        @jax.jit
        def value_and_grads(t, target, k, lvec, reg=reg):
            def rows(t, target, lvec):
                return topk_fenchel_young_loss(t, target, k=k, regularization_strength=lvec, reduction="none", **reg.lib_kwargs)

            def total(t, lvec):
                r = rows(t, target, lvec)
                return jnp.sum(r), r
            (_, r), grads = jax.value_and_grad(total, argnums=(0, 1), has_aux=True)(t, lvec)
            mask = itk.soft_topk_mask(t, k, regularization_strength=lvec, **reg.lib_kwargs)
            return r, grads, rows(t, mask, lvec)

        for k in (2.0, 1.5):
            theta = rng.normal(size=(batch, n)) * 1.5
            ls = rng.choice([0.3, 0.6, 1.5], size=batch)
            y = np.stack([random_target(rng, n, k, reg) for _ in range(batch)])
            if k == int(k):
                y[0] = C.hard_topk_mask(theta[0], k)
            value, grad, dl, at_mask = (np.asarray(v) for v in jax.tree_util.tree_leaves(
                value_and_grads(jnp.asarray(theta), jnp.asarray(y), jnp.asarray(k), jnp.asarray(ls))))
            for b in range(batch):
                l = ls[b]
                lam, ys = solve(theta[b], k, l, reg)
                ref = loss(theta[b], y[b], k, l, reg)
                worst["value"] = max(worst["value"], abs(value[b] - ref))
                C.check(abs(value[b] - ref) <= 1e-9 * (1 + abs(ref)), f"{reg.name}: value {value[b]} vs {ref}")
                dg = np.max(np.abs(grad[b] - (ys - y[b])))
                worst["grad"] = max(worst["grad"], dg)
                C.check(dg <= 1e-9, f"{reg.name}: grad vs y* - y: {dg:.2e}")
                rl = reg.Omega(y[b]) - reg.Omega(ys)
                worst["dl"] = max(worst["dl"], abs(dl[b] - rl))
                C.check(abs(dl[b] - rl) <= 1e-8 * (1 + abs(rl)), f"{reg.name}: dL/dl {dl[b]} vs {rl}")
                if not reg.dense:  # exact zeros where y* = 0 = y (clearly below the threshold)
                    out = (theta[b] < lam - 1e-6) & (y[b] == 0)
                    C.check(np.all(grad[b][out] == 0.0), f"{reg.name}: gradient not exactly 0 off the support")
                    zeros += int(out.sum())
                count += 1
            C.check(np.all(value >= -1e-12), "library loss < 0")
            C.check(np.max(np.abs(at_mask)) <= 1e-10, f"{reg.name}: L(theta; y*(theta)) != 0")
        # Hessian (second derivatives through the mask's implicit Jacobian) vs FD of the reference y*
        if reg.name in ("p=1.33", "entropy"):  # (each compilation costs seconds)
            theta = rng.normal(size=n)
            k, l = 2.5, 0.8
            y = random_target(rng, n, k, reg)
            H = np.asarray(jax.jit(jax.hessian(lambda t, reg=reg, y=y: topk_fenchel_young_loss(
                t, y, k=k, regularization_strength=l, **reg.lib_kwargs)))(jnp.asarray(theta)))
            dh = np.max(np.abs(H - jacobian_fd(theta, k, l, reg)))
            worst["hess"] = max(worst["hess"], dh)
            C.check(dh <= 1e-5, f"{reg.name}: Hessian vs FD Jacobian of y*: {dh:.2e}")
    bad = np.zeros((1, n))
    bad[0, :3] = 1.0
    try:
        topk_fenchel_young_loss(jnp.zeros((1, n)), bad, k=2)
    except ValueError:
        pass
    else:
        raise AssertionError("a target outside C_k was accepted")
    print(f"  (h) library: {count} rows (7 regularizers, k in {{2, 1.5}}); |L - ref| <= {worst['value']:.1e}, "
          f"|grad - (y* - y)| <= {worst['grad']:.1e}, |dL/dl - ref| <= {worst['dl']:.1e}, "
          f"{zeros} exact gradient zeros off the support, L(theta; mask) = 0, Hessian vs FD "
          f"<= {worst['hess']:.1e}; a target outside C_k raises ValueError")


def main():
    rng = np.random.default_rng(11)
    print("fenchel_young:")
    check_conjugate(rng)
    check_nonnegative(rng)
    check_gradients(rng)
    check_convexity(rng)
    check_hessian(rng)
    check_special_cases(rng)
    check_small_l(rng)
    check_library(rng)
    print("fenchel_young: OK")


if __name__ == "__main__":
    main()
