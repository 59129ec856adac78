"""Numerical companion of proofs/support_budget.md.

Checks, on random rows with and without ties, scales 1e-6..1e6 and p in {4/3, 1.5, 2}:
  (1) the support of the mask at l has at most m entries iff S(l) >= k (Brent's root);
  (2) l* by bisection of S(l) = k; at l* the threshold is the cut (Brent);
  (3) the closed form t* = ((k - W_J) / R_J)^(1/a) on the crossing piece equals 1 / l*;
  (4) the library's soft_topk_mask(..., max_support=m) equals the reference mask at
      min(l, l*) and has at most m nonzero entries (the tie rule aside).
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import numpy as np  # noqa: E402

import _proofs_common as C  # noqa: E402

PS = (4.0 / 3.0, 1.5, 2.0)


def cut_and_weights(x, k, m):
    """The cut of the tie rule and the gaps above it (descending) with their weights."""
    c = np.sort(x)[::-1][m]
    if np.sum(x > c) >= k:
        above = np.sort(x[x > c])[::-1]
        return c, above - c, np.ones_like(above)
    c2 = np.max(x[x < c])
    above = np.sort(x[x > c])[::-1]
    gaps = np.concatenate([above - c2, [c - c2]])
    return c2, gaps, np.concatenate([np.ones_like(above), [float(np.sum(x == c))]])


def S(gaps, weights, l, a):
    return float(np.sum(weights * np.minimum(1.0, gaps / l) ** a))


def l_star_bisection(gaps, weights, k, a, l):
    lo, hi = np.log(l) - 200.0, np.log(l)
    for _ in range(300):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if S(gaps, weights, np.exp(mid), a) >= k else (lo, mid)
    return float(np.exp(lo))


def closed_form_t(gaps, weights, k, a):
    terms = weights * gaps ** a
    saturated = np.cumsum(weights)
    rest = np.concatenate([np.cumsum(terms[::-1])[::-1][1:], [0.0]])  # suffix sums
    breaks = saturated + rest / gaps ** a
    J = int(np.sum(breaks <= k))
    w_j = saturated[J - 1] if J > 0 else 0.0
    r_j = rest[J - 1] if J > 0 else terms.sum()
    if r_j == 0:
        return 1.0 / gaps[J - 1]
    return ((k - w_j) / r_j) ** (1.0 / a)


def main():
    rng = np.random.default_rng(0)
    itk = C.load_library()
    checked = 0
    for trial in range(240):
        p = PS[trial % 3]
        a = 1.0 / (p - 1.0)
        n = int(rng.integers(5, 12))
        m = int(rng.integers(2, n - 1))
        k = float(rng.uniform(0.5, m - 0.1))
        scale = 10.0 ** rng.uniform(-6, 6)
        x = rng.normal(size=n)
        if trial % 4 == 0:
            x = np.round(x * 2) / 2  # ties
        x = x * scale
        l = float(scale * 10.0 ** rng.uniform(-1.5, 1.5))
        c, gaps, weights = cut_and_weights(x, k, m)
        lam, y = C.threshold_solve(x, k, l, p)
        plain_fits = np.sum(y > 1e-12) <= m
        if np.sum(x > np.sort(x)[::-1][m]) >= k:  # statement 1 (no tie case)
            C.check(plain_fits == (S(gaps, weights, l, a) >= k * (1 - 1e-12)) or
                    abs(S(gaps, weights, l, a) - k) < 1e-9 * k, f"statement 1, trial {trial}")
        ls = l_star_bisection(gaps, weights, k, a, l) if S(gaps, weights, l, a) < k else l
        if ls < l:
            lam_s, _ = C.threshold_solve(x, k, ls, p)
            C.check(abs(lam_s - c) <= 1e-7 * (abs(c) + scale), f"threshold at l*, trial {trial}")
            t = closed_form_t(gaps, weights, k, a)
            C.check(abs(t * ls - 1.0) < 1e-9, f"closed form, trial {trial}: {t * ls}")
        want = C.threshold_solve(x, k, ls, p)[1]
        if itk is not None:
            import jax.numpy as jnp
            got = np.asarray(itk.soft_topk_mask(jnp.asarray(x), k, regularization_strength=l,
                                                p=p, max_support=m))
            C.check(np.max(np.abs(got - want)) < 1e-8, f"library vs reference, trial {trial}: "
                    f"{np.max(np.abs(got - want))}")
            C.check(np.sum(got > 0) <= np.sum(x > c), f"support, trial {trial}")
            C.check(abs(got.sum() - k) < 1e-10 * max(1, k), f"sum, trial {trial}")
        checked += 1
    print(f"  {checked} rows checked (bound, l*, closed form, library)")
    print("support_budget: OK")


if __name__ == "__main__":
    main()
