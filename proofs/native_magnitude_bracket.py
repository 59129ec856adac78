"""Numerical companion of proofs/native_magnitude_bracket.md (Proposition 16).

Checks, with Brent's method on phi and on h (scipy, no library code):
  (1) the bracket h^{-1}(s_(m)) <= lam* <= s_(j+1), and zeros at or below its lower end;
  (2) binary rows: every point of [s_(k+1), h^{-1}(s_(k))] is a root, the output is the
      hard top-k in magnitude;
  (3) the candidate rule for random guesses (L, c >= h(L));
  (4) the monotone Newton iterations for h^{-1} and their lower bounds;
  (5) the values and derivatives the kernel iterates on (F/lam, F'_mu/lam, F''_mu/lam)
      against central differences of F;
  (6) the library's solver="native" against Brent's root and output;
  (7) the pure-JAX solvers' bracket (Magnitude.bracket, tightened by statement 1 on the
      top three distinct magnitudes) is a bracket of phi, ties included.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import numpy as np  # noqa: E402
from scipy.optimize import brentq  # noqa: E402

import _proofs_common as C  # noqa: E402

PS = (1.1, 4.0 / 3.0, 1.5, 2.0, 3.0, 5.0)


def gfun(u, p):
    return np.maximum(u, 0.0) ** (1.0 / (p - 1.0))


def hfun(y, l, p):
    return y + l * y ** (p - 1.0)


def hinv(s, l, p):
    return brentq(lambda y: hfun(y, l, p) - s, 0.0, s, xtol=1e-300, rtol=1e-15)


def phi(lam, s, k, l, p):
    return float(np.sum(np.minimum(1.0, gfun((s - lam) / l, p) / lam)) - k)


def big_f(lam, s, k, l, p):
    """F(lam) = sum_i min(lam, g(t_i / l)) - k lam."""
    return float(np.sum(np.minimum(lam, gfun((s - lam) / l, p))) - k * lam)


def threshold(s, k, l, p):
    with np.errstate(over="ignore", divide="ignore"):
        return brentq(phi, 1e-300, float(np.max(s)), args=(s, k, l, p), xtol=1e-300,
                      rtol=1e-15, maxiter=1000)


def output(x, lam, l, p):
    s = np.abs(x)
    t = np.maximum(s - lam, 0.0)
    return np.sign(x) * np.minimum(s, t + gfun(t / l, p))


def hard_topk_mag(x, k):
    out = np.zeros_like(x)
    top = np.argsort(-np.abs(x), kind="stable")[:k]
    out[top] = x[top]
    return out


def row(rng, n):
    x = rng.normal(size=n) * 10.0 ** rng.uniform(-2, 2)
    if rng.uniform() < 0.3:
        x = np.round(x, 1)  # ties
    x[rng.uniform(size=n) < 0.15] = 0.0
    return x


def order_stats(s, k):
    srt = np.sort(s)[::-1]
    m, j = int(np.ceil(k)), int(np.floor(k))
    return srt[m - 1], srt[j], m, j


def check_bracket(rng):
    count = 0
    for _ in range(400):
        n = int(rng.integers(2, 14))
        x = row(rng, n)
        s = np.abs(x)
        nnz = int(np.sum(s > 0))
        if nnz < 2:
            continue
        k = float(rng.uniform(0.05, nnz - 0.05))
        l, p = float(10 ** rng.uniform(-2, 1)) * float(np.max(s)) ** 0.5, PS[int(rng.integers(len(PS)))]
        s_m, s_next, m, j = order_stats(s, k)
        lo = hinv(s_m, l, p)
        C.check(phi(lo, s, k, l, p) >= -1e-12 and phi(s_next, s, k, l, p) <= 1e-12,
                "phi(h^-1(s_(m))) >= 0 >= phi(s_(j+1))")
        if not lo < s_next:
            C.check(j == m, "an empty bracket needs an integer k")
            continue
        lam = threshold(s, k, l, p)
        tol = 1e-12 * lam
        C.check(lo - tol <= lam <= s_next + tol, f"bracket {lo} <= {lam} <= {s_next}")
        C.check(np.all(output(x, lam, l, p)[s <= lo] == 0.0), "zeros at or below h^-1(s_(m))")
        count += 1
    C.check(count > 200, "enough rows with a bracket")
    print(f"  (1) bracket and zeros below it: {count} rows")


def check_binary(rng):
    count = 0
    for _ in range(300):
        n = int(rng.integers(3, 10))
        x = rng.normal(size=n) * 3
        k = int(rng.integers(1, n))
        p = PS[int(rng.integers(len(PS)))]
        srt = np.sort(np.abs(x))[::-1]
        gap = srt[k - 1] - srt[k]
        l = float(rng.uniform(0.01, 1.0)) * gap / max(srt[k], 1e-3) ** (p - 1.0)
        if not hfun(srt[k], l, p) < srt[k - 1]:
            continue
        end = hinv(srt[k - 1], l, p)
        for lam in np.linspace(srt[k], end, 5)[1:-1]:  # inside: no rounding at the ends
            C.check(abs(phi(lam, np.abs(x), k, l, p)) <= 1e-12, "binary interval is a root")
            C.check(np.allclose(output(x, lam, l, p), hard_topk_mag(x, k), rtol=1e-14, atol=0),
                    "the hard top-k in magnitude")
        count += 1
    C.check(count > 100, "enough binary rows")
    print(f"  (2) binary rows: {count}")


def check_candidates(rng):
    count = 0
    for _ in range(600):
        n = int(rng.integers(3, 30))
        s = np.abs(row(rng, n))
        nnz = int(np.sum(s > 0))
        if nnz < 2:
            continue
        k = float(rng.uniform(0.05, nnz - 1.05)) if nnz > 2 else 0.5
        l, p = float(10 ** rng.uniform(-2, 1)), PS[int(rng.integers(len(PS)))]
        L = float(np.quantile(s, rng.uniform(0.2, 1.0))) * float(rng.uniform(0.1, 1.0))
        c = hfun(L, l, p) * (1.0 + float(rng.uniform(0, 0.2)))
        m = int(np.ceil(k))
        if L <= 0 or np.sum(s >= c) < m + 1:
            continue
        s_m, _, _, _ = order_stats(s, k)
        top = np.sort(s)[::-1][:m + 1]
        C.check(np.all(top > L), "the m + 1 largest exceed L")
        C.check(np.all(s[s > hinv(s_m, l, p)] > L), "every candidate exceeds L")
        count += 1
    C.check(count > 100, "enough guesses that pass")
    print(f"  (3) the candidate rule: {count} guesses")


def newton_h_inverse(s, l, p, steps=60):
    """Item 4's iteration: in u = y^(p-1) for p <= 2, in y (h(y) = y + (c y)^(p-1),
    c = l^a) for p > 2; the iterates and the lower bound of y*."""
    a = 1.0 / (p - 1.0)
    if a < 1.0:
        c = l ** a
        y = min(s, s ** a / c)
        iterates = [y]
        for _ in range(steps):
            power = (c * y) ** (p - 1.0)
            y = y - (y + power - s) / (1.0 + (p - 1.0) * power / y)
            iterates.append(y)
        bound = max(s - (c * y) ** (p - 1.0), 0.0) if y >= 0.5 * s else (s - y) ** a / c
        return np.array(iterates), bound
    u = min(s ** (1.0 / a), s / l)
    iterates = [u]
    for _ in range(steps):
        u = u - (u ** a + l * u - s) / (a * u ** (a - 1.0) + l)
        iterates.append(u)
    bound = s - l * u if l * u <= 0.5 * s else float(gfun((s - u ** a) / l, p))
    return np.array(iterates), bound


def check_h_inverse(rng):
    for _ in range(300):
        p = PS[int(rng.integers(len(PS)))]
        s, l = float(10 ** rng.uniform(-3, 3)), float(10 ** rng.uniform(-3, 3))
        y_star = hinv(s, l, p)
        a = 1.0 / (p - 1.0)
        star = y_star ** (p - 1.0) if p <= 2.0 else y_star  # the iteration's variable
        iterates, bound = newton_h_inverse(s, l, p)
        steps = np.diff(iterates)
        rel = 1e-12 * star
        C.check(np.all(iterates >= star - rel), "convex: iterates stay above the root")
        C.check(np.all(steps <= rel), "convex: iterates decrease")
        C.check(bound <= y_star * (1 + 1e-12), "a lower bound of h^-1(s)")
        C.check(bound >= y_star * (1 - 1e-10), "equal to it up to rounding")
        # The lower bounds from any upper bound of the root:
        grow = 1.0 + float(rng.uniform(0, 1))
        if p <= 2.0:
            u = star * grow
            C.check(s - l * u <= y_star * (1 + 1e-12), "s - l u <= y*")
            C.check((max(s - u ** a, 0.0) / l) ** a <= y_star * (1 + 1e-12), "g((s - u^a)/l) <= y*")
        else:
            y, c = star * grow, l ** a
            C.check(s - (c * y) ** (p - 1.0) <= y_star * (1 + 1e-12), "s - (c y)^(p-1) <= y*")
            C.check(max(s - y, 0.0) ** a / c <= y_star * (1 + 1e-12), "(s - y)^a / c <= y*")
    print("  (4) the monotone Newton for h^-1 and its lower bounds: 300 instances")


def kernel_terms(s, lam, mu, k, l, p):
    """(F/lam, F'_mu/lam, F''_mu/lam) by item 5's formulas."""
    a = 1.0 / (p - 1.0)
    t = s - lam
    t = t[t > 0]
    y = gfun(t / l, p) / lam
    sat = y > 1.0
    y, w = y[~sat], lam / t[~sat]
    excess = float(np.sum(sat)) - k
    return (excess + np.sum(y), (excess - a * np.sum(y * w)) / mu,
            a * (a - 1.0) * np.sum(y * w * w) / mu ** 2)


def check_terms(rng):
    count = 0
    for _ in range(300):
        n = int(rng.integers(2, 10))
        s = np.abs(rng.normal(size=n))
        k = float(rng.uniform(0.2, n - 0.2))
        l, p = float(rng.uniform(0.2, 2.0)), PS[int(rng.integers(len(PS)))]
        lam = float(rng.uniform(0.05, 1.0)) * float(np.max(s))
        e = int(rng.integers(-20, 20))
        mu = lam * 2.0 ** -e
        ys = gfun((s - lam) / l, p) / lam
        if np.any(np.abs(ys - 1.0) < 1e-2) or np.any(np.abs(s - lam) < 0.05 * lam):
            continue  # a kink of F (or a steep g near t = 0) within the differences' reach
        f = lambda m_: big_f(m_ * 2.0 ** e, s, k, l, p)
        h1, h2 = 1e-6 * mu, 1e-3 * mu
        d1 = (f(mu + h1) - f(mu - h1)) / (2 * h1)
        d2 = (f(mu + h2) - 2 * f(mu) + f(mu - h2)) / (h2 * h2)
        value, slope, curve = kernel_terms(s, lam, mu, k, l, p)
        C.check(abs(value - f(mu) / lam) <= 1e-12 * (n + k), "F / lam")
        C.check(abs(slope - d1 / lam) <= 1e-6 * (abs(slope) + 1.0 / mu), "F'_mu / lam")
        C.check(abs(curve - d2 / lam) <= 1e-2 * (abs(curve) + 1e-3 / mu ** 2), "F''_mu / lam")
        count += 1
    C.check(count > 100, "enough points away from kinks")
    print(f"  (5) the kernel's values and derivatives in mu: {count} points")


def check_library(rng):
    itk = C.load_library()
    if itk is None:
        return
    import jax.numpy as jnp
    for p in PS:
        x = np.stack([row(rng, 9) for _ in range(6)])
        x[:, 0] = 1.0  # at least 2 nonzero entries
        x[:, 1] = -2.0
        nnz = np.sum(x != 0, axis=1)
        k = rng.uniform(0.3, 1.0, size=6) * (nnz - 0.5)
        l = 10 ** rng.uniform(-1.5, 0.5, size=6)
        solver = itk.NativeSolver(problem=itk.problems.Magnitude(p))
        lam = np.asarray(solver.run(None, jnp.asarray(x), jnp.asarray(k), jnp.asarray(l)).params)
        y = np.asarray(itk.soft_topk_mag(jnp.asarray(x), jnp.asarray(k), regularization_strength=jnp.asarray(l),
                                         p=p, solver="native"))
        for i in range(6):
            s = np.abs(x[i])
            ref = threshold(s, k[i], l[i], p)
            s_m, s_next, m, j = order_stats(s, k[i])
            if j == m and hfun(s_next, l[i], p) < s_m:
                continue  # binary: a root interval, checked by the output below
            C.check(abs(lam[i] - ref) <= 1e-10 * ref, f"native lam vs Brent, p = {p}")
        for i in range(6):
            ref = output(x[i], threshold(np.abs(x[i]), k[i], l[i], p), l[i], p)
            C.check(np.max(np.abs(y[i] - ref)) <= 1e-10 * np.max(np.abs(x[i])),
                    f"native output vs Brent, p = {p}")
    print("  (6) solver='native' equals Brent's root and output")


def check_jax_bracket(rng):
    itk = C.load_library()
    if itk is None:
        return
    import jax
    import jax.numpy as jnp
    jax.config.update("jax_enable_x64", True)
    rows = 0
    for p in PS:
        x = np.round(rng.normal(size=(100, 7)), 1) * rng.choice([-1, 1], size=(100, 7))
        x[:, 0] = 1.5  # at least two nonzero magnitudes, ties with the others
        x[:, 1] = -1.5
        k = rng.choice([0.4, 1.0, 1.5, 2.0, 2.5], size=100)
        l = 10 ** rng.uniform(-1.5, 0.5, size=100)
        b = itk.problems.Magnitude(p).bracket(jnp.asarray(x), jnp.asarray(k), jnp.asarray(l))
        lo, hi, known = (np.asarray(v) for v in (b.lo, b.hi, b.known))
        for i in np.flatnonzero(~known):
            s = np.abs(x[i])
            C.check(0 < lo[i] <= hi[i], "0 < lo <= hi")
            C.check(phi(lo[i], s, k[i], l[i], p) >= -1e-12 and phi(hi[i], s, k[i], l[i], p) <= 1e-12,
                    f"x={x[i]}, k={k[i]}, l={l[i]}: [{lo[i]}, {hi[i]}] is no bracket, p = {p}")
            rows += 1
    print(f"  (7) the pure-JAX solvers' bracket: phi(lo) >= 0 >= phi(hi) on {rows} rows")


def main():
    rng = np.random.default_rng(16)
    print("native_magnitude_bracket:")
    check_bracket(rng)
    check_binary(rng)
    check_candidates(rng)
    check_h_inverse(rng)
    check_terms(rng)
    check_library(rng)
    check_jax_bracket(rng)
    print("native_magnitude_bracket: OK")


if __name__ == "__main__":
    main()
