"""Numerical companion of proofs/newton_finite_termination_p2.md (p = 2).

phi(lam) = sum_i clip((x_i - lam)/l, 0, 1) - k is piecewise linear.  Checks:
  (a) Newton-step lemma: from any lam with a nonempty free set F, the Newton
      point lam+ = lam + l*phi(lam)/|F| is the exact root of the affine piece
      A_P(t) = |U| + sum_F (x_i - t)/l - k of the current partition P; if the
      partition at lam+ equals P, then phi(lam+) = 0 (to rounding);
  (b) pure Newton can cycle (a hand-checkable 2-cycle), and is undefined on flat
      pieces (F empty) -- the reason for the safeguard;
  (c) safeguarded Newton on the bracket [min x - l, max x] (bisect when the
      Newton point is not strictly inside the bracket or F is empty) terminates
      with the exact root on every random instance; iteration counts printed;
  (d) the library's solver="threshold" (and "pav") at p = 2 agree.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import numpy as np  # noqa: E402

import _proofs_common as C  # noqa: E402


def phi2(lam, x, k, l):
    return float(np.sum(np.clip((x - lam) / l, 0.0, 1.0)) - k)


def partition(lam, x, l):
    """Label 1 for y=1 (u >= 1), 0 for y=0 (u <= 0), 2 for free (0 < u < 1)."""
    u = (x - lam) / l
    return np.where(u >= 1.0, 1, np.where(u <= 0.0, 0, 2))


def newton_point(lam, x, k, l):
    part = partition(lam, x, l)
    nf = int(np.sum(part == 2))
    if nf == 0:
        return None, part
    return lam + l * phi2(lam, x, k, l) / nf, part


def affine_piece(t, part, x, k, l):
    return float(np.sum(part == 1) + np.sum((x[part == 2] - t) / l) - k)


def check_newton_lemma(rng):
    same = changed = 0
    for _ in range(3000):
        n = int(rng.integers(2, 9))
        x = rng.normal(size=n) * rng.choice([0.5, 2.0])
        k = float(rng.choice([1.0, rng.uniform(0.1, n - 0.1)]))
        l = float(rng.choice([0.1, 0.5, 2.0]))
        lam = rng.uniform(np.min(x) - l, np.max(x))
        lam1, part = newton_point(lam, x, k, l)
        if lam1 is None:
            continue
        scale = 1e-12 * (1 + n + np.max(np.abs(x)) / l)
        C.check(abs(affine_piece(lam1, part, x, k, l)) <= scale,
                "Newton point is not the root of the current affine piece")
        if np.array_equal(partition(lam1, x, l), part):
            C.check(abs(phi2(lam1, x, k, l)) <= scale, "partition unchanged but phi != 0")
            same += 1
        else:
            changed += 1
    print(f"  (a) Newton lemma: {same} steps kept the partition (all exact roots), "
          f"{changed} changed it")


def check_cycle():
    x, k, l = np.array([1.0, 3.0, 4.0, 6.0]), 2.0, 4.0
    # from 5: only x=6 free, phi = 1/4 - 2 = -7/4, slope -1/4 -> 5 - 7 = -2
    # from -2: three at 1, x=1 free with u=3/4, phi = 7/4, slope -1/4 -> -2 + 7 = 5
    lam, seq = 5.0, [5.0]
    for _ in range(6):
        lam, _ = newton_point(lam, x, k, l)
        seq.append(lam)
    C.check(np.allclose(seq, [5.0, -2.0] * 3 + [5.0]), f"expected a 2-cycle, got {seq}")
    C.check(abs(phi2(1.5, x, k, l)) == 0.0, "root should be 1.5")
    C.check(newton_point(np.max(x) + 1.0, x, k, l)[0] is None, "flat piece has F empty")
    lam, it = safeguarded_newton(x, k, l, lam0=5.0)
    C.check(lam == 1.5 and it["iters"] <= 4, f"safeguarded run on the cycle example: {lam}, {it}")
    print(f"  (b) pure Newton 2-cycle 5 -> -2 -> 5 on x=(1,3,4,6), k=2, l=4; "
          f"safeguarded Newton from 5 hits the root 1.5 in {it['iters']} evaluations")


def safeguarded_newton(x, k, l, lam0=None, max_iter=200):
    """Bracketed Newton on phi (p = 2). Returns (lam, stats).

    stats['iters'] counts evaluations of phi (passes over the data).
    Stops when phi(lam) == 0, or when a Newton step kept the partition (the
    Newton-step lemma then says lam is the exact root).
    """
    lo, hi = float(np.min(x) - l), float(np.max(x))  # phi(lo) = n-k > 0 > -k = phi(hi)
    lam = 0.5 * (lo + hi) if lam0 is None else float(lam0)
    prev_part, came_by_newton = None, False
    stats = {"iters": 0, "newton": 0, "bisect": 0, "exit": None}
    for _ in range(max_iter):
        val = phi2(lam, x, k, l)
        part = partition(lam, x, l)
        stats["iters"] += 1
        if came_by_newton and np.array_equal(part, prev_part):
            stats["exit"] = "partition kept"
            return lam, stats
        # exact arithmetic would only need `val == 0`; in floating point phi at the
        # root is only zero to rounding (sum of n terms), so accept that level too --
        # otherwise a root hit by bisection, with a Newton step below one ulp, is
        # never recognised and bisection grinds the bracket down to one ulp
        if abs(val) <= 8 * np.finfo(float).eps * (x.size + k):
            stats["exit"] = "phi==0"
            return lam, stats
        if val > 0:
            lo = lam
        else:
            hi = lam
        nf = int(np.sum(part == 2))
        cand = lam + l * val / nf if nf > 0 else None
        if cand is not None and lo < cand < hi:
            lam, came_by_newton = cand, True
            stats["newton"] += 1
        else:
            lam, came_by_newton = 0.5 * (lo + hi), False
            stats["bisect"] += 1
        prev_part = part
    raise AssertionError(f"safeguarded Newton did not terminate in {max_iter} iterations")


def check_safeguarded(rng):
    report = []
    for n, trials in ((5, 400), (20, 200), (1000, 50)):
        iters, exits = [], {}
        for _ in range(trials):
            x = rng.normal(size=n) * rng.choice([0.3, 1.0, 5.0])
            k = float(rng.choice([1.0, max(1.0, n // 10), rng.uniform(0.05, n - 0.05)]))
            l = float(rng.choice([0.01, 0.1, 1.0, 10.0]))
            lam0 = None if rng.random() < 0.5 else rng.uniform(np.min(x) - l, np.max(x))
            lam, st = safeguarded_newton(x, k, l, lam0)
            C.check(abs(phi2(lam, x, k, l)) <= 1e-12 * n, f"not a root: phi = {phi2(lam, x, k, l)}")
            # each accepted Newton point is the root of one affine piece A_P and is never
            # accepted twice; phi(t) realises at most 4n+1 partitions P(t)
            C.check(st["newton"] <= 4 * n + 1, "more Newton steps than affine pieces")
            _, y_ref = C.threshold_solve(x, k, l, 2.0)
            C.check(np.max(np.abs(np.clip((x - lam) / l, 0, 1) - y_ref)) <= 1e-10,
                    "safeguarded Newton y != reference y")
            if n <= 5:
                C.check(np.max(np.abs(np.clip((x - lam) / l, 0, 1)
                                      - C.brute_force_solve(x, k, l, 2.0))) <= 1e-10,
                        "safeguarded Newton y != brute force")
            iters.append(st["iters"])
            exits[st["exit"]] = exits.get(st["exit"], 0) + 1
        iters = np.array(iters)
        report.append(f"n={n}: mean {iters.mean():.1f}, median {int(np.median(iters))}, "
                      f"max {iters.max()} phi evaluations ({trials} runs, exits {exits})")
    print("  (c) safeguarded Newton terminates exactly; " + "; ".join(report))


def check_library(rng):
    itk = C.load_library()
    if itk is None:
        return
    worst, count = 0.0, 0
    for _ in range(4):
        n = 6
        x = rng.normal(size=n)
        for k in (2.0, 2.7):
            l = float(rng.choice([0.05, 0.5, 3.0]))
            lam, _ = safeguarded_newton(x, k, l)
            y = np.clip((x - lam) / l, 0, 1)
            for solver in ("threshold", "pav"):
                d = np.max(np.abs(C.lib_mask(itk, x, k, l, 2.0, solver) - y))
                C.check(d <= 1e-12, f"library {solver} p=2: |dy| = {d:.2e}")
                worst = max(worst, d)
                count += 1
    print(f"  (d) library p=2 (threshold, pav): {count} calls, max|dy| = {worst:.1e}")


def main():
    rng = np.random.default_rng(3)
    print("newton_finite_termination_p2:")
    check_newton_lemma(rng)
    check_cycle()
    check_safeguarded(rng)
    check_library(rng)
    print("newton_finite_termination_p2: OK")


if __name__ == "__main__":
    main()
