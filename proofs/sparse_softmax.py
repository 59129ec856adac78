"""Numerical companion of proofs/sparse_softmax.md (projection onto the k-sparse simplex).

Checks, on random instances (numpy/scipy references, no library code):
  (a) the exchange identity ||p' - z||^2 - ||p - z||^2 = -2 p_i (z_j - z_i);
  (b) brute force over all supports |S| <= k (projection onto each face by bisection, SLSQP on
      some) == sparsemax of the k largest, every k, with and without ties; strict optimality
      with a gap at k;
  (c) the closed form: {j : 1 + j v_j > S_j} is a prefix, and (v - tau)_+ satisfies KKT;
  (d) properties: sum, support, bounds, monotone, shift, k = n sparsemax, k = 1 argmax,
      temperature thresholds z_[1] - z_[2] and l*, k p -> hard top-k as l -> inf;
  (e) seed 002's formula: sum >= 1, equality iff the stated condition, then equal; examples;
  (f) the library agrees.
"""

import itertools
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import numpy as np  # noqa: E402
from scipy.optimize import minimize  # noqa: E402

import _proofs_common as C  # noqa: E402


# --------------------------------------------------------------------------
# references
# --------------------------------------------------------------------------
def project_bisection(v, iters=200):
    """Projection onto the simplex: tau with sum (v - tau)_+ = 1 by bisection (no sorting)."""
    lo, hi = np.min(v) - 1.0, np.max(v)
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if np.maximum(v - mid, 0).sum() > 1:
            lo = mid
        else:
            hi = mid
    return np.maximum(v - 0.5 * (lo + hi), 0)


def project_slsqp(v):
    res = minimize(lambda p: np.sum((p - v) ** 2), np.full(v.size, 1.0 / v.size),
                   jac=lambda p: 2 * (p - v), method="SLSQP", bounds=[(0, None)] * v.size,
                   constraints=[{"type": "eq", "fun": lambda p: p.sum() - 1,
                                 "jac": lambda p: np.ones(v.size)}],
                   options={"ftol": 1e-12, "maxiter": 500})
    C.check(res.success, res.message)
    return res.x


def all_supports(z, k, project=project_bisection):
    """[(distance, p)] over every support of size 1..k."""
    out = []
    for size in range(1, k + 1):
        for S in itertools.combinations(range(z.size), size):
            p = np.zeros(z.size)
            p[list(S)] = project(z[list(S)])
            out.append((np.sum((p - z) ** 2), p))
    return out


def sparsemax_sorted(v):
    """Closed form of statement 2 for v sorted descending: (p, tau, r); tau is for v - v_1."""
    v = v - v[0]  # shift invariance (statement 5): exact 1 at the top when r = 1
    j = np.arange(1, v.size + 1)
    s = np.cumsum(v)
    c = 1 + j * v - s
    r = int(np.max(j[c > 0]))
    tau = (s[r - 1] - 1) / r
    return np.maximum(v - tau, 0), tau, r


def topk_sparsemax(z, k):
    top = np.argsort(-z, kind="stable")[:k]
    p = np.zeros(z.size)
    p[top] = sparsemax_sorted(z[top])[0]
    return p


def seed_formula(z, k):
    tau = (np.sort(z)[::-1][:k].sum() - 1) / k
    return np.maximum(0, z - tau), tau


def random_z(rng, n, ties=False):
    z = rng.normal(size=n) * rng.choice([0.05, 0.3, 1.0, 3.0])
    if ties:
        z = np.round(z * 4) / 4 + 0.0
    return z


# --------------------------------------------------------------------------
# checks
# --------------------------------------------------------------------------
def check_exchange(rng):
    count = 0
    for _ in range(200):
        n = int(rng.integers(3, 9))
        z = random_z(rng, n)
        k = int(rng.integers(1, n))
        S = list(rng.choice(n, size=k, replace=False))
        p = np.zeros(n)
        p[S] = project_bisection(z[S])
        i = S[int(rng.integers(k))]
        j = int(rng.choice([m for m in range(n) if m not in S]))
        q = p.copy()
        q[j], q[i] = p[i], 0.0
        lhs = np.sum((q - z) ** 2) - np.sum((p - z) ** 2)
        C.check(abs(lhs + 2 * p[i] * (z[j] - z[i])) <= 1e-12, "exchange identity")
        count += 1
    print(f"  (a) exchange identity ||p'-z||^2 - ||p-z||^2 = -2 p_i (z_j - z_i) ({count} instances)")


def check_brute_force(rng):
    count, strict = 0, 0
    for trial in range(60):
        n = int(rng.integers(2, 8))
        z = random_z(rng, n, ties=trial % 3 == 0)
        for k in range(1, n + 1):
            cands = all_supports(z, k)
            best = min(d for d, _ in cands)
            p = topk_sparsemax(z, k)
            d = np.sum((p - z) ** 2)
            C.check(d <= best + 1e-12, f"top-k sparsemax not optimal: {d} > {best}")
            s = np.sort(z)[::-1]
            if k == n or s[k - 1] > s[k]:
                # unique: every support reaching the optimum gives the same p
                for dist, q in cands:
                    if dist <= best + 1e-12:
                        C.check(np.max(np.abs(q - p)) <= 1e-9, "a different optimum exists")
                strict += 1
            count += 1
    for _ in range(5):
        n = int(rng.integers(3, 6))
        z = random_z(rng, n)
        k = int(rng.integers(1, n))
        best = min(all_supports(z, k, project_slsqp), key=lambda c: c[0])[1]
        C.check(np.max(np.abs(best - topk_sparsemax(z, k))) <= 1e-7, "SLSQP brute force differs")
    print(f"  (b) brute force over all supports (bisection; SLSQP on 5) == top-k sparsemax "
          f"({count} (z, k) pairs, ties included; uniqueness checked on {strict})")


def check_closed_form(rng):
    for _ in range(300):
        m = int(rng.integers(1, 10))
        v = np.sort(random_z(rng, m, ties=bool(rng.integers(2))))[::-1]
        j = np.arange(1, m + 1)
        c = 1 + j * v - np.cumsum(v)
        pos = np.flatnonzero(c > 0)
        C.check(pos.size > 0 and np.array_equal(pos, np.arange(pos.size)), "not a prefix")
        C.check(np.all(np.diff(c) <= 1e-12), "c_j not nonincreasing")
        p, tau, r = sparsemax_sorted(v)
        tau = tau + v[0]
        C.check(abs(p.sum() - 1) <= 1e-12 and np.all(v[:r] > tau) and np.all(v[r:] <= tau + 1e-15),
                "KKT fails")
        C.check(np.max(np.abs(p - project_bisection(v))) <= 1e-12, "closed form != bisection")
    print("  (c) closed form: {j : 1 + j v_j > S_j} is a prefix, (v - tau)_+ satisfies KKT "
          "(300 instances)")


def check_properties(rng):
    count = 0
    for trial in range(100):
        n = int(rng.integers(2, 9))
        z = random_z(rng, n, ties=trial % 4 == 0)
        k = int(rng.integers(1, n + 1))
        p = topk_sparsemax(z, k)
        C.check(abs(p.sum() - 1) <= 1e-12 and np.all((p >= 0) & (p <= 1)), "not in the simplex")
        C.check(np.count_nonzero(p) <= k, "more than k non-zeros")
        i, j = np.nonzero(z[:, None] > z[None, :])
        C.check(np.all(p[i] >= p[j]) and np.all(p[i][p[j] > 0] > p[j][p[j] > 0]), "not monotone")
        C.check(np.max(np.abs(topk_sparsemax(z + 3.7, k) - p)) <= 1e-12, "not shift invariant")
        sm = project_bisection(z)
        if k >= np.count_nonzero(sm > 1e-12):
            C.check(np.max(np.abs(p - sm)) <= 1e-12, "k >= |supp| is not sparsemax")
        C.check(np.array_equal(topk_sparsemax(z, 1), np.eye(n)[np.argmax(z)]), "k = 1 is not argmax")
        count += 1
    for _ in range(50):
        n = int(rng.integers(3, 9))
        z = rng.normal(size=n)
        k = int(rng.integers(2, n + 1))
        s = np.sort(z)[::-1]
        g = s[0] - s[1]
        onehot = np.eye(n)[np.argmax(z)]
        C.check(np.array_equal(topk_sparsemax(z / (g * 0.999), k), onehot), "not argmax below z1 - z2")
        C.check(not np.array_equal(topk_sparsemax(z / (g * 1.001), k), onehot), "argmax above z1 - z2")
        top = np.argsort(-z)[:k]
        lstar = np.sum(z[top] - s[k - 1])
        for l in (lstar, 1.5 * lstar, 1e3 * lstar):
            aff = np.zeros(n)
            aff[top] = 1 / k + (z[top] - z[top].mean()) / l
            C.check(np.max(np.abs(topk_sparsemax(z / l, k) - aff)) <= 1e-12, "affine formula above l*")
        aff = np.zeros(n)
        aff[top] = 1 / k + (z[top] - z[top].mean()) / (0.99 * lstar)
        C.check(np.max(np.abs(topk_sparsemax(z / (0.99 * lstar), k) - aff)) > 1e-6, "affine below l*")
        l = 1e6 * lstar
        mask = np.zeros(n)
        mask[top] = 1.0
        err = np.max(np.abs(k * topk_sparsemax(z / l, k) - mask))
        C.check(abs(err - k * np.max(np.abs(z[top] - z[top].mean())) / l) <= 1e-12, "k p -> hard rate")
    print(f"  (d) properties ({count} instances): simplex, <= k non-zeros, monotone, shift, "
          "k >= |supp| sparsemax, k = 1 argmax; thresholds z_[1]-z_[2] and l*, k p -> hard mask")


def check_seed(rng):
    q, _ = seed_formula(np.array([1.0, 0.9, 0.8, 0.7]), 2)
    C.check(np.allclose(q, [0.55, 0.45, 0.35, 0.25]) and np.count_nonzero(q) == 4
            and np.isclose(q.sum(), 1.6), f"example 1: {q}")
    z = np.array([2.0, 1.5, 0.1, -1.0, 3.2, 0.7])
    q, _ = seed_formula(z, 3)
    C.check(np.allclose(q, [0.1, 0, 0, 0, 1.3, 0]) and np.isclose(q.sum(), 1.4), f"seed example: {q}")
    C.check(np.array_equal(topk_sparsemax(z, 3), np.eye(6)[4]), "ours on the seed example")
    agree = 0
    for _ in range(500):
        n = int(rng.integers(2, 9))
        z = random_z(rng, n)
        k = int(rng.integers(1, n + 1))
        q, tau = seed_formula(z, k)
        C.check(q.sum() >= 1 - 1e-12, "seed sum < 1")
        top = np.argsort(-z, kind="stable")[:k]
        rest = np.setdiff1d(np.arange(n), top)
        cond = np.all(z[top] >= tau) and np.all(z[rest] <= tau)
        C.check(cond == (abs(q.sum() - 1) <= 1e-12), "equality condition")
        if cond:
            C.check(np.max(np.abs(q - topk_sparsemax(z, k))) <= 1e-12, "feasible seed != projection")
            agree += 1
    print(f"  (e) seed 002 formula: sum >= 1, = 1 iff the stated condition ({agree}/500 cases), "
          "then equal to the projection; examples: 4 non-zeros / sum 1.6, sum 1.4")


def check_library(rng):
    itk = C.load_library()
    if itk is None:
        return
    import jax.numpy as jnp

    from implicit_topk.sparse_softmax import sparse_softmax

    count = 0
    for n in (2, 5, 8):
        z = np.stack([random_z(rng, n, ties=t % 2 == 1) for t in range(6)])
        for k in range(1, n + 1):
            p = np.asarray(sparse_softmax(jnp.asarray(z), k))
            for zr, pr in zip(z, p):
                C.check(np.max(np.abs(pr - topk_sparsemax(zr, k))) <= 1e-13, f"library n={n} k={k}")
                count += 1
    p = np.asarray(sparse_softmax(jnp.array([1.0, 0.9, 0.8, 0.7]), 2))
    C.check(np.allclose(p, [0.55, 0.45, 0, 0], atol=1e-15), "library example 1")
    p = np.asarray(sparse_softmax(jnp.array([2.0, 1.5, 0.1, -1.0, 3.2, 0.7]), 3))
    C.check(np.array_equal(p, np.eye(6)[4]), "library seed example")
    print(f"  (f) library: sparse_softmax == reference ({count} rows, ties included), both examples")


def main():
    rng = np.random.default_rng(8)
    print("sparse_softmax:")
    check_exchange(rng)
    check_brute_force(rng)
    check_closed_form(rng)
    check_properties(rng)
    check_seed(rng)
    check_library(rng)
    print("sparse_softmax: OK")


if __name__ == "__main__":
    main()
