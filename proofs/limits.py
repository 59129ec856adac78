"""Numerical companion of proofs/limits.md.

Checks, on random instances (sorted values x_(1) >= ... >= x_(n)):
  (a) small l, integer k, any p > 1: y is *exactly* the hard top-k mask iff
      l <= x_(k) - x_(k+1)  (checked just below and just above the bound);
  (b) small l, fractional k = m + f: y is exactly (1,..,1, f, 0,..,0) iff
      l <= min((x_(m) - x_(m+1)) / (1 - f^(p-1)), (x_(m+1) - x_(m+2)) / f^(p-1));
  (c) p = 2, large l: y = k/n + (x - mean(x))/l exactly iff
      l >= l* = max(n (mean - min)/k, n (max - mean)/(n - k)), all coordinates in
      (0,1) iff l > l*; y is never exactly k/n unless x is constant, and
      ||y - k/n||_inf = max|x_i - mean| / l;
  (d) any p, large l: ||y - k/n||_inf <= Delta/((p-1) l) for p <= 2 and
      (Delta/l)^(1/(p-1)) for p >= 2, Delta = max x - min x, so y -> k/n;
  (e) the library agrees (exact hard mask below the bound, affine formula above l*).
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import numpy as np  # noqa: E402

import _proofs_common as C  # noqa: E402

PS = (4.0 / 3.0, 1.5, 2.0, 3.0)


def hard_bound(x, k):
    s = np.sort(x)[::-1]
    return s[int(k) - 1] - s[int(k)]


def frac_bound(x, k, p):
    s = np.sort(x)[::-1]
    m = int(np.floor(k))
    f = k - m
    b = np.inf
    if m >= 1:
        b = min(b, (s[m - 1] - s[m]) / (1.0 - f ** (p - 1.0)))
    if m + 1 < s.size:
        b = min(b, (s[m] - s[m + 1]) / f ** (p - 1.0))
    return b


def frac_limit(x, k):
    m = int(np.floor(k))
    order = np.argsort(-x)
    y = np.zeros(x.size)
    y[order[:m]] = 1.0
    y[order[m]] = k - m
    return y


def l_star(x, k):
    n, mu = x.size, np.mean(x)
    return max(n * (mu - np.min(x)) / k, n * (np.max(x) - mu) / (n - k))


def check_hard(rng):
    count = 0
    for p in PS:
        for _ in range(10):
            n = int(rng.integers(3, 8))
            k = float(rng.integers(1, n))
            x = rng.normal(size=n)
            gap = hard_bound(x, k)
            hard = C.hard_topk_mask(x, k)
            s = np.sort(x)[::-1]
            for l in (0.3 * gap, gap * (1 - 1e-6)):
                # the statement: every lam in [x_(k+1), x_(k) - l] is an exact root, y hard
                for t in np.linspace(s[int(k)], s[int(k) - 1] - l, 5)[1:-1]:
                    C.check(np.array_equal(C.h((x - t) / l, p), hard) and C.phi(t, x, k, l, p) == 0,
                            f"not exactly hard below the bound p={p}")
                C.check(np.array_equal(C.brute_force_solve(x, k, l, p), hard),
                        "brute force not hard below the bound")
                # a generic root finder may stop at the edge of the root interval, where
                # a coordinate is ~1e-40 instead of 0 and phi still rounds to 0
                _, y = C.threshold_solve(x, k, l, p)
                C.check(np.max(np.abs(y - hard)) <= 1e-12, "brentq root not hard")
            _, y = C.threshold_solve(x, k, gap * 1.01, p)
            C.check(not np.array_equal(y, hard) and np.max(np.abs(y - hard)) > 1e-12,
                    f"still hard above the bound p={p}")
            yb = C.brute_force_solve(x, k, gap * 1.01, p)
            C.check(np.max(np.abs(yb - hard)) > 1e-12, "brute force still hard above the bound")
            count += 1
    print(f"  (a) integer k: y == hard mask exactly iff l <= x_(k) - x_(k+1) "
          f"({count} instances, all p)")


def check_fractional(rng):
    count = 0
    for p in PS:
        for _ in range(10):
            n = int(rng.integers(3, 8))
            k = rng.uniform(0.05, n - 0.05)
            x = rng.normal(size=n)
            b = frac_bound(x, k, p)
            target = frac_limit(x, k)
            _, y = C.threshold_solve(x, k, b * (1 - 1e-7), p)
            C.check(np.max(np.abs(y - target)) <= 1e-12 * n,
                    f"not (1,..,f,..,0) below the bound p={p}: {y} vs {target}")
            _, y = C.threshold_solve(x, k, b * 1.01, p)
            C.check(np.max(np.abs(y - target)) > 1e-12, "still (1,..,f,..,0) above the bound")
            count += 1
    print(f"  (b) fractional k: y == (1,..,1,f,0,..,0) iff l <= the two-gap bound "
          f"({count} instances, all p)")


def check_p2_large(rng):
    count = 0
    for _ in range(30):
        n = int(rng.integers(2, 9))
        k = float(rng.choice([1.0, rng.uniform(0.05, n - 0.05)]))
        x = rng.normal(size=n) * rng.choice([0.1, 1.0, 10.0])
        ls = l_star(x, k)
        aff = lambda l: k / n + (x - np.mean(x)) / l  # noqa: E731
        for l in (ls, ls * (1 + 1e-9), 3 * ls, 1e6 * ls):
            _, y = C.threshold_solve(x, k, l, 2.0)
            C.check(np.max(np.abs(y - aff(l))) <= 1e-12 * (1 + np.max(np.abs(x)) / l) * n,
                    "p=2 affine formula fails above l*")
            if l > ls:
                C.check(np.all((aff(l) > 0) & (aff(l) < 1)), "not strictly interior above l*")
            C.check(not np.allclose(y, k / n, rtol=0, atol=1e-15 * np.max(np.abs(x))),
                    "y exactly k/n for non-constant x")
            C.check(abs(np.max(np.abs(y - k / n)) - np.max(np.abs(x - np.mean(x))) / l)
                    <= 1e-12 * (1 + np.max(np.abs(x)) / l), "sup distance to k/n")
        _, y = C.threshold_solve(x, k, ls * (1 - 1e-3), 2.0)
        C.check(np.max(np.abs(y - aff(ls * (1 - 1e-3)))) > 1e-9, "affine below l*")
        count += 1
    # constant x: exactly k/n for every l
    _, y = C.threshold_solve(np.full(5, 0.7), 2.0, 0.01, 2.0)
    C.check(np.allclose(y, 0.4, rtol=0, atol=1e-15), "constant x")
    print(f"  (c) p=2: y = k/n + (x - mean)/l exactly iff l >= l* ({count} instances); "
          "never exactly k/n for non-constant x")


def check_large_general(rng):
    worst = 0.0
    for p in PS:
        for _ in range(10):
            n = int(rng.integers(2, 9))
            k = rng.uniform(0.05, n - 0.05)
            x = rng.normal(size=n)
            delta = np.max(x) - np.min(x)
            prev = np.inf
            for l in (0.5, 2.0, 10.0, 1e2, 1e4, 1e6):
                _, y = C.threshold_solve(x, k, l, p)
                dist = np.max(np.abs(y - k / n))
                bound = delta / ((p - 1) * l) if p <= 2 else (delta / l) ** (1 / (p - 1))
                C.check(dist <= bound * (1 + 1e-9) + 1e-14, f"bound violated p={p} l={l}")
                C.check(dist <= prev + 1e-14, "distance to k/n not decreasing in l")
                prev = dist
                worst = max(worst, dist / bound)
            C.check(prev < 1e-2, "not close to k/n at l = 1e6")
    print(f"  (d) any p: ||y - k/n||_inf <= modulus bound, ratio to bound <= {worst:.2f}; "
          "-> 0 as l -> inf")


def check_library(rng):
    itk = C.load_library()
    if itk is None:
        return
    count, not_bitwise = 0, []
    for p in PS:
        n, k = 6, 2.0
        x = rng.normal(size=n)
        gap = hard_bound(x, k)
        hard = C.hard_topk_mask(x, k)
        for solver in ("pav", "threshold"):
            for l in (0.3 * gap, gap * (1 - 1e-6)):
                y = C.lib_mask(itk, x, k, l, p, solver)
                C.check(np.max(np.abs(y - hard)) <= 1e-12,
                        f"library {solver} p={p} l={l / gap:.6f}*gap: not hard: {y}")
                if not np.array_equal(y, hard):
                    # a root finder may stop on the edge of the root interval
                    # [x_(k+1), x_(k) - l]; a coordinate is then ~1e-30, not 0
                    not_bitwise.append(f"{solver} p={p:.3g} l={l / gap:.6g}*gap "
                                       f"max dev {np.max(np.abs(y - hard)):.1e}")
            _, yr = C.threshold_solve(x, k, gap * 1.01, p)
            y = C.lib_mask(itk, x, k, gap * 1.01, p, solver)
            C.check(np.max(np.abs(y - yr)) <= 1e-9, f"library {solver} above gap")
            count += 3
    x = rng.normal(size=6)
    for k in (2.0, 2.5):
        ls = l_star(x, k)
        for l in (2 * ls, 1e6 * ls):
            for solver in ("pav", "threshold"):
                y = C.lib_mask(itk, x, k, l, 2.0, solver)
                aff = k / x.size + (x - np.mean(x)) / l
                C.check(np.max(np.abs(y - aff)) <= 1e-12, f"library {solver} p=2 large l")
                count += 1
    print(f"  (e) library: {count} calls; hard mask (to 1e-12) below the bound, "
          "affine p=2 formula above l*")
    if not_bitwise:
        print("      note: hard to rounding but not bitwise 0/1 (root on the edge of the "
              "root interval): " + "; ".join(not_bitwise))


def main():
    rng = np.random.default_rng(4)
    print("limits:")
    check_hard(rng)
    check_fractional(rng)
    check_p2_large(rng)
    check_large_general(rng)
    check_library(rng)
    print("limits: OK")


if __name__ == "__main__":
    main()
