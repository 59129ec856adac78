"""Numerical companion of proofs/grad_topk.md (GradTopK and seed 001's iterative baseline).

Checks, on random instances (brute-force enumeration of k-subsets, exact rationals, high
precision decimals; no library code in the references):
  (a) exact identities with fractions.Fraction weights: DP == enumeration, sum_i Z_{k,i} = k Z_k,
      0 < Z_{k,i} < Z_k, Z_{k,i} - Z_{k,j} = (w_i - w_j) e_{k-1}(w_{-ij}), e_k(c w) = c^k e_k(w),
      k = 1 gives w / sum(w);
  (b) Gibbs / LP form: <u, E_p 1_S> + H(p) <= log Z_k for random p, equality at q, marginals y;
  (c) Jacobian = Cov_q(1_S) / l (finite differences of enumeration), off-diagonal <= 0;
  (d) ||y - hard||_inf <= max(k, n-k) exp(-gap / l); y -> k/n as l -> inf;
  (e) the seed's recursion breaks on 100 * randn while a numpy log-space DP is accurate;
  (f) iterative baseline: counterexamples and limits (the weighted one in 120-digit decimals);
  (g) the library agrees.
"""

import decimal
import itertools
import math
import os
import sys
from fractions import Fraction

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import numpy as np  # noqa: E402

import _proofs_common as C  # noqa: E402


# --------------------------------------------------------------------------
# references
# --------------------------------------------------------------------------
def subsets(n, k):
    return list(itertools.combinations(range(n), k))


def esp_enum(w, k):
    """e_k(w) by enumeration (exact for Fractions)."""
    total = Fraction(0) if isinstance(w[0], Fraction) else 0.0
    for S in subsets(len(w), k):
        term = w[S[0]] if S else 1
        for i in S[1:]:
            term = term * w[i]
        total = total + term
    return total if k > 0 else type(total)(1)


def esp_dp(w, k):
    """e_k(w) by the dynamic program of the library (exact for Fractions)."""
    e = [Fraction(1)] + [Fraction(0)] * k
    for wi in w:
        for j in range(k, 0, -1):
            e[j] = e[j] + wi * e[j - 1]
    return e[k]


def enumerate_y(x, k, l=1.0):
    """(y, log Z_k, subsets, q) in float64: max shift, math.fsum, no subtraction."""
    u = np.asarray(x, dtype=np.float64) / l
    sets = subsets(u.size, k)
    s = np.array([math.fsum(u[list(S)]) for S in sets])
    m = s.max()
    w = np.exp(s - m)
    z = math.fsum(w)
    q = w / z
    y = np.array([math.fsum(q[t] for t, S in enumerate(sets) if i in S) for i in range(u.size)])
    return y, m + math.log(z), sets, q


def decimal_y(x, k, digits):
    """y_i = w_i e_{k-1}(w_{-i}) / e_k(w) in ``digits``-digit decimal arithmetic."""
    with decimal.localcontext() as ctx:
        ctx.prec = digits
        w = [decimal.Decimal(float(v)).exp() for v in x]

        def e(ws, j):
            t = [decimal.Decimal(1)] + [decimal.Decimal(0)] * j
            for wi in ws:
                for m in range(j, 0, -1):
                    t[m] += wi * t[m - 1]
            return t[j]

        total = e(w, k)
        y = np.array([float(w[i] * e(w[:i] + w[i + 1:], k - 1) / total) for i in range(len(w))])
        return y, float(total.ln())


def seed_grad_topk(x, k):
    """Seed 001's reference code, verbatim."""
    for i in range(1, k + 1):
        logZs = x if i == 1 else x + logZ + np.log(1 - np.exp(logZs - logZ))  # noqa: F821
        logZ = np.logaddexp.reduce(logZs) - np.log(i)
    return np.exp(logZs - logZ)


def numpy_log_esp(u, k):
    """The log-space DP in plain numpy (value only)."""
    c = np.max(u)
    L = np.full(k + 1, -np.inf)
    L[0] = 0.0
    for ui in u - c:
        L[1:] = np.logaddexp(L[1:], ui + L[:-1])
    return L[k] + k * c


def hard(x, k):
    out = np.zeros(x.size)
    out[np.argsort(-x, kind="stable")[:k]] = 1.0
    return out


def iterative_logits(x, k, l):
    v = (x - x.min()) / l
    p = np.zeros_like(v)
    for _ in range(k):
        z = (1 - p) * v
        e = np.exp(z - z.max())
        p = p + e / e.sum()
    return p


def iterative_weighted_decimal(x, k, l, digits=120):
    """The weighted variant with p and 1 - p in ``digits``-digit decimals (as the seed states it)."""
    with decimal.localcontext() as ctx:
        ctx.prec = digits
        w = [(decimal.Decimal(float(v)) / decimal.Decimal(float(l))).exp() for v in x]
        p = [decimal.Decimal(0)] * len(w)
        for _ in range(k):
            weights = [(1 - pi) * wi for pi, wi in zip(p, w)]
            z = sum(weights)
            p = [pi + wt / z for pi, wt in zip(p, weights)]
        return np.array([float(pi) for pi in p])


# --------------------------------------------------------------------------
# checks
# --------------------------------------------------------------------------
def check_identities(rng):
    count = 0
    for _ in range(40):
        n = int(rng.integers(2, 8))
        k = int(rng.integers(1, n))
        w = [Fraction(int(a), int(b)) for a, b in zip(rng.integers(1, 50, n), rng.integers(1, 20, n))]
        zk = esp_enum(w, k)
        C.check(esp_dp(w, k) == zk, "DP != enumeration")
        zki = [w[i] * esp_enum(w[:i] + w[i + 1:], k - 1) if k > 1 else w[i] for i in range(n)]
        C.check(sum(zki) == k * zk, "sum_i Z_{k,i} != k Z_k")
        C.check(all(0 < z < zk for z in zki), "Z_{k,i} not in (0, Z_k)")
        for i in range(n):
            for j in range(n):
                if i != j:
                    rest = [w[m] for m in range(n) if m not in (i, j)]
                    e = esp_enum(rest, k - 1) if k > 1 else Fraction(1)
                    C.check(zki[i] - zki[j] == (w[i] - w[j]) * e, "monotonicity identity")
                    C.check(e > 0, "e_{k-1}(w_{-ij}) not positive")
        c = Fraction(int(rng.integers(1, 9)), int(rng.integers(1, 9)))
        C.check(esp_dp([c * wi for wi in w], k) == c**k * zk, "homogeneity")
        if k == 1:
            C.check([z / zk for z in zki] == [wi / sum(w) for wi in w], "k = 1 is not w / sum(w)")
        count += 1
    print(f"  (a) exact (Fraction) identities: DP, sum = k, 0 < y < 1, monotonicity, shift, k=1 "
          f"({count} instances)")


def check_gibbs(rng):
    worst = -np.inf
    for _ in range(20):
        n = int(rng.integers(3, 7))
        k = int(rng.integers(1, n))
        x, l = rng.normal(size=n), float(rng.uniform(0.2, 3.0))
        y, logz, sets, q = enumerate_y(x, k, l)
        u = x / l
        ind = np.array([[1.0 if i in S else 0.0 for i in range(n)] for S in sets])
        entropy = lambda p: -np.sum(p[p > 0] * np.log(p[p > 0]))  # noqa: E731
        C.check(abs(u @ (q @ ind) + entropy(q) - logz) <= 1e-12 * (1 + abs(logz)), "equality at q")
        np.testing.assert_allclose(q @ ind, y, atol=1e-15)
        C.check(np.all((y > 0) & (y < 1)) and abs(y.sum() - k) < 1e-12, "y not in the capped simplex")
        for _ in range(20):
            p = rng.dirichlet(np.full(len(sets), 0.3))
            gapv = u @ (p @ ind) + entropy(p) - logz
            C.check(gapv <= 1e-12, "Gibbs inequality violated")
            worst = max(worst, gapv)
    print(f"  (b) Gibbs: <u, E_p 1_S> + H(p) <= log Z_k (max {worst:.2e} <= 0), equality at q; "
          "y = marginals of q, in C_k")


def check_jacobian(rng):
    count = 0
    for _ in range(10):
        n = int(rng.integers(3, 7))
        k = int(rng.integers(1, n))
        x, l = rng.normal(size=n), float(rng.uniform(0.3, 2.0))
        y, _, sets, q = enumerate_y(x, k, l)
        ind = np.array([[1.0 if i in S else 0.0 for i in range(n)] for S in sets])
        cov = (ind - y).T @ (q[:, None] * (ind - y)) / l
        h = 1e-6
        fd = np.stack([(enumerate_y(x + h * e, k, l)[0] - enumerate_y(x - h * e, k, l)[0]) / (2 * h)
                       for e in np.eye(n)], axis=1)
        C.check(np.max(np.abs(fd - cov)) <= 1e-8, "Jacobian != Cov / l")
        C.check(np.allclose(np.diag(cov), y * (1 - y) / l, atol=1e-14), "diagonal != y(1-y)/l")
        C.check(np.max(cov[~np.eye(n, dtype=bool)]) <= 1e-15, "positive off-diagonal covariance")
        C.check(np.max(np.abs(cov.sum(1))) <= 1e-14, "rows do not sum to 0")
        count += 1
    print(f"  (c) Jacobian = Cov_q(1_S)/l, diag y(1-y)/l, off-diagonal <= 0 ({count} instances)")


def check_limits(rng):
    worst = 0.0
    for _ in range(40):
        n = int(rng.integers(3, 9))
        k = int(rng.integers(1, n))
        x = rng.normal(size=n)
        s = np.sort(x)[::-1]
        g = s[k - 1] - s[k]
        for l in (2.0, 0.5, 0.1, 0.03, 0.01):
            y = enumerate_y(x, k, l)[0]
            err = np.max(np.abs(y - hard(x, k)))
            bound = max(k, n - k) * np.exp(-g / l)
            C.check(err <= bound * (1 + 1e-12) + 1e-16, f"bound violated: {err} > {bound}")
            if bound > 1e-300:
                worst = max(worst, err / bound)
        y = enumerate_y(x, k, 1e6)[0]
        C.check(np.max(np.abs(y - k / n)) <= 1e-5, "not k/n at large l")
        # k = 1 is softmax
        y = enumerate_y(x, 1, 0.7)[0]
        e = np.exp(x / 0.7 - np.max(x / 0.7))
        C.check(np.allclose(y, e / e.sum(), rtol=1e-14, atol=0), "k = 1 is not softmax")
    print(f"  (d) ||y - hard||_inf <= max(k, n-k) e^(-gap/l) (ratio to bound <= {worst:.2f}); "
          "y -> k/n as l -> inf; k = 1 is softmax")


def check_stability(rng):
    x = rng.normal(size=10) * 100
    with np.errstate(all="ignore"):
        s2 = seed_grad_topk(x, 2)
        order = np.argsort(-x)
        C.check(s2[order[0]] == 0.0 and abs(s2[order[1]] - 2.0) < 1e-12,
                f"seed at k=2 expected (0, 2) at the top two: {s2[order[:2]]}")
        for k in (3, 4, 5):
            C.check(np.all(np.isnan(seed_grad_topk(x, k))), f"seed recursion finite at k={k}")
    worst = 0.0
    for _ in range(5):
        x = rng.normal(size=30) * 100
        for k in (1, 5, 15, 29):
            _, exact = decimal_y(x, k, 60)
            val = numpy_log_esp(x, k)
            worst = max(worst, abs(val - exact) / abs(exact))
    C.check(worst <= 1e-14, f"numpy log-space DP inaccurate: {worst}")
    print(f"  (e) seed recursion on 100*randn(10): (0, 2) at the top two for k=2, NaN for k=3..5; "
          f"log-space DP log Z_k vs 60 digits: rel. err. {worst:.1e}")


def check_iterative(rng):
    p = iterative_logits(np.array([0.0, 6.0, 0.0]), 2, 1.0)
    C.check(abs(p[1] - 1.33500981) < 1e-8 and p[1] > 1, f"[0,6,0]: {p}")
    p = iterative_logits(np.array([0.0, 6.0, 0.0]), 2, 1e-3)
    C.check(np.allclose(p, [1 / 3, 4 / 3, 1 / 3], atol=1e-12), f"[0,6,0] limit: {p}")
    p = iterative_logits(np.array([0.0, 5.0, 6.0]), 2, 1.0)
    C.check(p[1] > p[2] and p[1] > 1, f"[0,5,6] is monotone: {p}")
    for _ in range(20):
        n = int(rng.integers(3, 9))
        k = int(rng.integers(1, n))
        x = rng.permutation(n) * 0.1 + rng.uniform(0, 0.05)  # distinct, gaps >= 0.1
        C.check(np.allclose(iterative_logits(x, k, 2e-3), hard(x, k), atol=1e-9), "logits limit")
        p = iterative_logits(rng.normal(size=n), k, float(rng.uniform(0.1, 3)))
        C.check(abs(p.sum() - k) < 1e-12, "logits variant does not sum to k")
    x = np.array([3.0, 0.0, 2.0, 1.0, -0.5])
    errs = []
    for l in (0.1, 0.02, 0.01):
        p = iterative_weighted_decimal(x, 2, l)
        err = np.max(np.abs(p - [1.5, 0.0, 0.5, 0.0, 0.0]))
        C.check(err <= 3 * np.exp(-1.0 / l), f"weighted limit l={l}: {p}")
        errs.append(err)
    p = iterative_weighted_decimal(x, 3, 0.01)
    C.check(np.allclose(p, [2.5, 0.0, 0.5, 0.0, 0.0], atol=1e-12), f"weighted k=3: {p}")
    print(f"  (f) iterative: [0,6,0] -> 1.335 (limit 1/3, 4/3, 1/3), [0,5,6] not monotone, logits "
          f"-> hard for distinct entries; weighted k=2 -> (1.5, 0.5) (errors {errs[0]:.0e}.."
          f"{errs[-1]:.0e}), k=3 -> (2.5, 0.5)")


def check_library(rng):
    itk = C.load_library()
    if itk is None:
        return
    import jax.numpy as jnp

    from implicit_topk.smooth_topk import grad_topk, iterative_softmax_topk

    count = 0
    for n in (3, 6, 8):
        x = rng.normal(size=(3, n)) * rng.choice([0.3, 1.0, 5.0])
        for k in range(1, n):
            y = np.asarray(grad_topk(jnp.asarray(x), k, regularization_strength=0.6))
            for xr, yr in zip(x, y):
                C.check(np.max(np.abs(yr - enumerate_y(xr, k, 0.6)[0])) <= 1e-13, f"library n={n} k={k}")
                count += 1
    x = rng.normal(size=30) * 100
    exact, _ = decimal_y(x, 15, 80)
    y = np.asarray(grad_topk(jnp.asarray(x), 15))
    big = exact > 1e-300
    rel = np.max(np.abs(y[big] - exact[big]) / exact[big])
    C.check(np.max(np.abs(y - exact)) <= 1e-13 and rel <= 1e-11, f"library vs 80 digits: {rel}")
    for variant in ("logits", "weighted"):
        x = rng.normal(size=(4, 7))
        p = np.asarray(iterative_softmax_topk(jnp.asarray(x), 3, regularization_strength=0.8, variant=variant))
        if variant == "logits":
            ref = np.stack([iterative_logits(r, 3, 0.8) for r in x])
        else:
            ref = np.stack([iterative_weighted_decimal(r, 3, 0.8, 40) for r in x])
        C.check(np.max(np.abs(p - ref)) <= 1e-12, f"library iterative {variant}")
    p = np.asarray(iterative_softmax_topk(jnp.array([3.0, 0.0, 2.0, 1.0, -0.5]), 2, regularization_strength=0.01, variant="weighted"))
    C.check(np.allclose(p, [1.5, 0.0, 0.5, 0.0, 0.0], atol=1e-12), "library weighted limit")
    print(f"  (g) library: grad_topk == enumeration ({count} rows), vs 80 digits on 100*randn(30), "
          f"k=15: rel. err. {rel:.1e}; iterative variants match the references")


def main():
    rng = np.random.default_rng(7)
    print("grad_topk:")
    check_identities(rng)
    check_gibbs(rng)
    check_jacobian(rng)
    check_limits(rng)
    check_stability(rng)
    check_iterative(rng)
    check_library(rng)
    print("grad_topk: OK")


if __name__ == "__main__":
    main()
