"""Numerical companion of proofs/snap_to_entry.md.

Checks, on random integer rows (every value exact in float32 and float64), p in
{2, 3/2, 4/3}, k in {1/2 .. 3} and l in {1/2 .. 4}:
  (1) in exact rational arithmetic (fractions.Fraction), which rows have an entry x_j at
      the threshold (phi(x_j) = 0) with phi strictly decreasing there (an entry in
      (x_j, x_j + l)), so that the threshold is x_j and every entry at or below it has
      mass exactly 0;
  (2) the library's default CPU mask (the native kernel, lanes and per-row rows), the
      threshold, pav and fused GPU kernel (Pallas interpret mode) solvers, and the
      budgeted mask (max_support, where it does not bind) on those rows, float64 and
      float32: exactly 0 at every entry at or below x_j, the other masses the exact ones
      to rounding;
  (3) continuous rows (no entry at the threshold): the default mask matches Brent's
      threshold to 1e-12, so the snap moves nothing it should not;
  (4) the top-k in magnitude on integer rows with a magnitude |x_j| at its threshold
      (exact rationals): exactly 0 at every |x_i| <= |x_j| and the exact outputs
      elsewhere, for the four solvers, float64 and float32.
"""

import os
import sys
from fractions import Fraction

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import numpy as np  # noqa: E402

import _proofs_common as C  # noqa: E402

EXPONENT = {2.0: 1, 1.5: 2, 4.0 / 3.0: 3}  # a = 1/(p-1)
# the default (the native CPU kernel here), the pure-JAX iteration, PAV, the GPU kernel's
# program (Pallas interpret mode on this CPU)
SOLVERS = ("auto", "threshold", "pav", "pallas")
MASK_LENGTHS = (6, 8, 16, 24)  # rows drawn at these lengths, checked padded to the last
MAGNITUDE_LENGTHS = (4, 6, 8, 12)


def exact_mask(x, lam, l, a):
    return [min(max((Fraction(v) - lam) / l, Fraction(0)), Fraction(1)) ** a for v in x]


def entry_at_threshold(x, k, l, a):
    """The entry x_j with phi(x_j) = 0 exactly and phi strictly decreasing there, or None."""
    for v in sorted(set(x)):
        lam = Fraction(v)
        if sum(exact_mask(x, lam, l, a)) == k and any(lam < w < lam + l for w in x):
            return lam
    return None


def magnitude_cases(rng, count):
    """Integer rows of the top-k in magnitude whose threshold is one of their magnitudes:
    F(s_j) = sum_i min(s_j, g((s_i - s_j)_+ / l)) - k s_j = 0 exactly, some magnitude above."""
    cases = []
    while len(cases) < count:
        n = int(rng.choice(MAGNITUDE_LENGTHS))
        x = [int(v) for v in rng.integers(-6, 7, size=n)]
        k = Fraction(int(rng.integers(1, 2 * n - 1)), 2)
        l = Fraction(int(rng.integers(1, 5)), 2)
        p = float(rng.choice(list(EXPONENT)))
        s = [Fraction(abs(v)) for v in x]
        for v in sorted(set(s)):
            total = sum(min(v, (max(w - v, Fraction(0)) / l) ** EXPONENT[p]) for w in s)
            if v > 0 and total == k * v and any(v < w for w in s):
                cases.append((x, k, l, p, v))
                break
    return cases


def main():
    rng = np.random.default_rng(7)
    cases = []
    for _ in range(4000):
        n = int(rng.choice(MASK_LENGTHS))
        x = [int(v) for v in rng.integers(-4, 5, size=n)]
        k = Fraction(int(rng.integers(1, 7)), 2)
        l = Fraction(int(rng.integers(1, 9)), 2)
        p = float(rng.choice(list(EXPONENT)))
        lam = entry_at_threshold(x, k, l, EXPONENT[p])
        if lam is not None and k < n:
            cases.append((x, k, l, p, lam))
    C.check(len(cases) >= 80, f"only {len(cases)} rows with an entry at the threshold")
    print(f"  (1) {len(cases)} of 4000 integer rows have an entry exactly at the threshold")
    itk = C.load_library()
    if itk is None:
        return
    import jax.numpy as jnp

    checked = 0
    for x, k, l, p, lam in cases:
        a = EXPONENT[p]
        # padded to one length with entries far below (mass exactly 0, the same threshold):
        # one compilation per solver, p and dtype instead of one per row length as well
        n = len(x)
        x = x + [-100] * (MASK_LENGTHS[-1] - n)
        want = np.array([float(v) for v in exact_mask(x, lam, l, a)])
        at_or_below = np.array(x, dtype=float) <= float(lam)
        for dtype, tol in ((jnp.float64, 1e-12), (jnp.float32, 1e-6)):
            xs = jnp.asarray([x], dtype)
            got = [itk.soft_topk_mask(xs, float(k), regularization_strength=float(l), p=p,
                                      solver=solver) for solver in SOLVERS]
            m = int(np.sum(np.array(x) > float(lam)))  # the support; a budget above it never binds
            if float(k) < m < n - 1:
                got.append(itk.soft_topk_mask(xs, float(k), regularization_strength=float(l), p=p,
                                              max_support=m + 1))
            for y in got:
                y = np.asarray(y, np.float64)[0]
                C.check(np.all(y[at_or_below] == 0.0),
                        f"x={x} k={k} l={l} p={p} {dtype.__name__}: nonzero mass at or below the "
                        f"threshold {lam}: {y[at_or_below]}")
                C.check(np.max(np.abs(y - want)) <= tol, f"x={x} k={k} l={l} p={p}: {y} vs {want}")
                checked += 1
    print(f"  (2) {checked} masks (the four solvers and the budgeted mask, float64 and float32): "
          "exact zeros")
    for _ in range(200):
        x = rng.normal(size=8)
        k, l, p = float(rng.choice([0.5, 1.0, 2.0])), float(rng.uniform(0.2, 3.0)), 2.0
        _, ref = C.threshold_solve(x, k, l, p)
        y = C.lib_mask(itk, x[None], k, l, p)[0]
        C.check(np.max(np.abs(y - ref)) <= 1e-12, f"continuous row moved: {x}, {y} vs {ref}")
    print("  (3) 200 continuous rows: the default mask within 1e-12 of Brent's")
    checked = 0
    for x, k, l, p, lam in magnitude_cases(rng, 120):
        a = EXPONENT[p]
        x = x + [0] * (MAGNITUDE_LENGTHS[-1] - len(x))  # zeros: output 0, the same threshold
        t = [max(Fraction(abs(v)) - lam, Fraction(0)) for v in x]
        want = np.array([float(np.sign(v) * min(abs(v), u + (u / l) ** a)) for v, u in zip(x, t)])
        at_or_below = np.abs(np.array(x, dtype=float)) <= float(lam)
        for solver in SOLVERS:
            for dtype, tol in ((jnp.float64, 1e-12), (jnp.float32, 1e-5)):
                y = np.asarray(itk.soft_topk_mag(jnp.asarray([x], dtype), float(k),
                                                 regularization_strength=float(l), p=p,
                                                 solver=solver), np.float64)[0]
                C.check(np.all(y[at_or_below] == 0.0),
                        f"magnitude x={x} k={k} l={l} p={p} {solver} {dtype.__name__}: nonzero "
                        f"output at or below the threshold {lam}: {y[at_or_below]}")
                C.check(np.max(np.abs(y - want)) <= tol * max(1.0, np.max(np.abs(want))),
                        f"magnitude x={x} k={k} l={l} p={p} {solver}: {y} vs {want}")
                checked += 1
    print(f"  (4) {checked} outputs of the top-k in magnitude with a magnitude at the threshold "
          "(the four solvers, float64 and float32): exact zeros")
    print("snap_to_entry: OK")


if __name__ == "__main__":
    main()
