"""Numerical companion of proofs/native_bracket.md (Proposition 13).

Checks, with Brent's method on phi (``_proofs_common.threshold_solve``, no library code):
  (1) the bracket x_(m) - l <= lam* <= x_(j+1), and zeros below its lower end;
  (2) binary rows: every point of [x_(k+1), x_(k) - l] is a root (the hard mask);
  (3) the candidate rule for random guesses t, in one pass and by blocks;
  (4) the tangent and cotangent formulas against central differences;
  (5) the library's solver="native" against Brent's root;
  (6) the library's bracket for the pure-JAX solvers (CappedSimplex.bracket, tightened by
      statement 1 on the top three distinct values) is a bracket of phi, ties included.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import numpy as np  # noqa: E402

import _proofs_common as C  # noqa: E402

PS = (4.0 / 3.0, 2.0, 3.0)


def order_stats(x, k):
    s = np.sort(x)[::-1]
    m, j = int(np.ceil(k)), int(np.floor(k))
    return s[m - 1], s[j]


def check_bracket(rng):
    for _ in range(300):
        n = int(rng.integers(2, 12))
        x = np.round(rng.normal(size=n), int(rng.integers(0, 3)))  # ties
        k = float(rng.uniform(0.05, n - 0.05))
        l, p = float(10 ** rng.uniform(-2, 1)), PS[int(rng.integers(3))]
        lam, y = C.threshold_solve(x, k, l, p)
        x_m, x_next = order_stats(x, k)
        tol = 1e-12 * (1 + abs(lam))
        C.check(x_m - l - tol <= lam <= x_next + tol, f"bracket {x_m - l} <= {lam} <= {x_next}")
        C.check(np.all(y[x <= x_m - l] == 0.0), "entries below the bracket are 0")
    print("  (1) bracket and zeros below it: 300 rows")


def check_binary(rng):
    count = 0
    for _ in range(200):
        n = int(rng.integers(3, 10))
        x = rng.normal(size=n) * 3
        k = int(rng.integers(1, n))
        s = np.sort(x)[::-1]
        l = float(rng.uniform(0.01, 1.0)) * max(s[k - 1] - s[k], 1e-9)
        if s[k - 1] - l < s[k]:
            continue
        for lam in np.linspace(s[k], s[k - 1] - l, 5):
            C.check(abs(C.phi(lam, x, k, l, 2.0)) <= 1e-12, "binary interval is a root")
        for lam in np.linspace(s[k], s[k - 1] - l, 5)[1:-1]:  # inside: no rounding at the ends
            C.check(np.array_equal(C.h((x - lam) / l, 2.0), C.hard_topk_mask(x, k)), "hard mask")
        count += 1
    C.check(count > 50, "enough binary rows")
    print(f"  (2) binary rows: {count}")


def check_candidates(rng):
    for _ in range(500):
        n = int(rng.integers(2, 30))
        x = rng.normal(size=n)
        k = float(rng.uniform(0.05, n - 1.05))
        l = float(10 ** rng.uniform(-2, 1))
        m = int(np.ceil(k))
        t = float(rng.normal() * 2)
        if np.sum(x > t) < m + 1:
            continue
        top = np.sort(x)[::-1][:m + 1]
        x_m, _ = order_stats(x, k)
        C.check(np.all(top > t), "the m + 1 largest exceed t")
        C.check(np.all(x[x > x_m - l] > t - l), "candidates above t - l")
    print("  (3) the candidate rule: 500 guesses")
    for _ in range(500):
        n = int(rng.integers(2, 30))
        x = np.round(rng.normal(size=n), int(rng.integers(0, 3)))  # ties too
        k = float(rng.uniform(0.05, min(2.0, n - 1.05)))
        l = float(10 ** rng.uniform(-2, 1))
        m = int(np.ceil(k))
        kept = set()
        for i, v in enumerate(x):
            running = np.sort(x[:i])[::-1][m - 1] if i >= m else -np.inf
            if v > running - l:
                kept.add(i)
        x_m, _ = order_stats(x, k)
        C.check(set(np.flatnonzero(x > x_m - l)) <= kept, "one pass keeps every candidate")
    print("  (3) the one-pass rule: 500 rows")
    for _ in range(500):
        n = int(rng.integers(2, 200))
        x = np.round(rng.normal(size=n), int(rng.integers(0, 3)))  # ties too
        k = float(rng.uniform(0.05, n - 1.05))
        l = float(10 ** rng.uniform(-2, 1))
        m, size = int(np.ceil(k)), int(rng.integers(1, 20))
        maxima = np.array([x[b:b + size].max() for b in range(0, n, size)])
        if maxima.size <= m:
            continue
        t = np.sort(maxima)[::-1][m]
        kept = np.repeat(maxima >= t - l, size)[:n]  # the blocks not skipped
        x_m, _ = order_stats(x, k)
        C.check(np.all(kept[np.argsort(-x, kind="stable")[:m + 1]]), "blocks keep the m + 1 largest")
        C.check(np.all(kept[x > x_m - l]), "blocks keep every candidate")
    print("  (3) the block rule: random block sizes")


def _slopes(x, lam, l, p):
    z = (x - lam) / l
    inside = (z > 0) & (z < 1)
    a = 1.0 / (p - 1.0)
    d = np.where(inside, a * np.abs(np.where(inside, z, 1.0)) ** (a - 1.0), 0.0) / l
    return z, d


def check_derivatives(rng):
    for _ in range(40):
        n = 7
        x = rng.normal(size=n)
        k, l, p = float(rng.uniform(1.2, 5.8)), float(rng.uniform(0.3, 2.0)), PS[int(rng.integers(3))]
        xd, kd, ld = rng.normal(size=n), float(rng.normal()), float(rng.normal())
        lam, y = C.threshold_solve(x, k, l, p)
        z, d = _slopes(x, lam, l, p)
        if d.sum() == 0:
            continue
        lam_dot = (np.sum(d * (xd - z * ld)) - kd) / d.sum()
        y_dot = d * (xd - lam_dot - z * ld)
        e = 1e-6
        plus = C.threshold_solve(x + e * xd, k + e * kd, l + e * ld, p)
        minus = C.threshold_solve(x - e * xd, k - e * kd, l - e * ld, p)
        C.check(abs((plus[0] - minus[0]) / (2 * e) - lam_dot) < 1e-5, "lam_dot")
        C.check(np.max(np.abs((plus[1] - minus[1]) / (2 * e) - y_dot)) < 1e-5, "y_dot")
        y_bar, lam_bar = rng.normal(size=n), float(rng.normal())
        c = (lam_bar - np.sum(d * y_bar)) / d.sum()
        x_bar, k_bar, l_bar = d * (y_bar + c), -c, -np.sum(d * z * (y_bar + c))
        pairing = np.dot(y_bar, y_dot) + lam_bar * lam_dot
        C.check(abs(pairing - (np.dot(x_bar, xd) + k_bar * kd + l_bar * ld)) < 1e-10,
                "the cotangent formulas are the transpose")
    print("  (4) tangent and cotangent formulas: central differences, transposition")


def check_library(rng):
    itk = C.load_library()
    import jax.numpy as jnp
    for p in PS:
        x = rng.normal(size=(6, 9))
        k = rng.uniform(0.5, 8.5, size=6)
        l = 10 ** rng.uniform(-1.5, 0.5, size=6)
        y = np.asarray(itk.soft_topk_mask(jnp.asarray(x), jnp.asarray(k), regularization_strength=jnp.asarray(l),
                                          p=p, solver="native"))
        for i in range(6):
            _, ref = C.threshold_solve(x[i], k[i], l[i], p)
            C.check(np.max(np.abs(y[i] - ref)) < 1e-10, f"native vs Brent, p = {p}")
    print("  (5) solver='native' equals Brent's root")


def check_jax_bracket(rng):
    itk = C.load_library()
    import jax
    import jax.numpy as jnp
    from implicit_topk.problems import CappedSimplex
    jax.config.update("jax_enable_x64", True)
    rows = 0
    for p in PS:
        problem = CappedSimplex(itk.PNorm(p))
        x = np.round(rng.normal(size=(200, 7)), 1)  # ties at every level
        k = rng.choice([0.3, 1.0, 1.5, 2.0, 2.7, 3.0, 4.5], size=200)
        l = 10 ** rng.uniform(-2, 0.5, size=200)
        b = problem.bracket(jnp.asarray(x), jnp.asarray(k), jnp.asarray(l))
        lo, hi = np.asarray(b.lo), np.asarray(b.hi)
        for i in range(200):
            # a bracket: phi(lo) >= 0 >= phi(hi) (a binary row's roots fill an interval)
            scale = 1e-12 * (1 + k[i])
            C.check(C.phi(lo[i], x[i], k[i], l[i], p) >= -scale
                    and C.phi(hi[i], x[i], k[i], l[i], p) <= scale,
                    f"x={x[i]}, k={k[i]}, l={l[i]}: [{lo[i]}, {hi[i]}] is no bracket, p = {p}")
            lam, _ = C.threshold_solve(x[i], k[i], l[i], p)
            C.check(C.phi(lam, x[i], k[i], l[i], p) == 0 or lo[i] <= lam <= hi[i],
                    "Brent's root of a row with one root lies in the bracket")
            rows += 1
        tight = np.array([order_stats(x[i], k[i]) for i in range(200)])
        small = k <= 2
        C.check(np.all(hi[small] <= tight[small, 1] + 1e-15), "k <= 2: hi is x_(j+1)")
    print(f"  (6) the pure-JAX solvers' bracket: phi(lo) >= 0 >= phi(hi) on {rows} rows")


def main():
    rng = np.random.default_rng(13)
    print("native_bracket:")
    check_bracket(rng)
    check_binary(rng)
    check_candidates(rng)
    check_derivatives(rng)
    check_library(rng)
    check_jax_bracket(rng)
    print("native_bracket: OK")


if __name__ == "__main__":
    main()
