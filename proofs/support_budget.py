"""Numerical companion of proofs/support_budget.md.

Checks, on random rows with and without ties, scales 1e-6..1e6 and p in {4/3, 1.5, 2, 3}:
  (1) the support of the mask at l has at most m entries iff S(l) >= k (Brent's root);
  (2) l* by bisection of S(l) = k; at l* the threshold is the cut (Brent);
  (3) the piece formula for l* and its max-over-clipped-pieces form equal the bisection;
  (5) locality: the weighted problem on the m+1 largest entries gives the row's threshold;
  (6) the closed forms on a piece (p = 2 linear, 3/2 quadratic, 4/3 Cardano) equal
      bisection of h(delta) = k - W on the piece;
  (7) the derivative formulas equal central differences of the reference mask;
  then the library's soft_topk_mask(..., max_support=m) against the reference mask at
  min(l, l*): within 1e-9 (Brent's threshold at scales up to 1e6), at most m nonzero entries (the tie rule aside), sum k;
  (8) the library's segment_soft_topk_mask(..., max_support=m) against the same reference
      on each segment separately (segments of at most m entries and empty ones included);
  "In the CPU kernel" (v): a row with at most m entries above its plain threshold has
      S(l) >= k (ties included), and the library on batches of router rows of 20 and 64
      entries against the reference, row by row.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import numpy as np  # noqa: E402
from scipy.optimize import brentq  # noqa: E402

import _proofs_common as C  # noqa: E402

PS = (4.0 / 3.0, 1.5, 2.0, 3.0)


def cut_and_weights(x, k, m):
    """The cut of the tie rule and the values above it (descending) with their weights."""
    c = np.sort(x)[::-1][m]
    above = np.sort(x[x > c])[::-1]
    if above.size >= k:
        return c, above, np.ones_like(above)
    c2 = np.max(x[x < c])
    return c2, np.concatenate([above, [c]]), np.concatenate([np.ones_like(above),
                                                              [float(np.sum(x == c))]])


def gm(u, a):
    return np.minimum(1.0, np.maximum(u, 0.0) ** a)


def S(gaps, weights, l, a):
    return float(np.sum(weights * gm(gaps / l, a)))


def l_star_bisection(gaps, weights, k, a, l):
    lo, hi = np.log(l) - 200.0, np.log(l)
    for _ in range(300):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if S(gaps, weights, np.exp(mid), a) >= k else (lo, mid)
    return float(np.exp(lo))


def l_star_pieces(gaps, weights, k, a):
    """Statement 3: (first piece past k, max over the clipped pieces past k)."""
    d, w = gaps, weights
    before = np.cumsum(w) - w
    incl = np.array([np.sum(w[j:] * (d[j:] / d[j]) ** a) for j in range(d.size)])
    past = before + incl > k
    if not past.any():
        return d[-1], d[-1]
    first = int(np.argmax(past))
    left = np.concatenate([[np.inf], d[:-1]])
    cand = [np.clip(d[j] * (incl[j] / (k - before[j])) ** (1 / a), d[j], left[j])
            if k > before[j] else left[j] for j in range(d.size)]
    return cand[first], max(c for c, p_ in zip(cand, past) if p_)


def weighted_threshold(values, weights, cut, k, l, a):
    """Statement 5: the root >= cut of sum_i w_i g((v_i - lam)/l) = k (Brent)."""
    F = lambda lam: float(np.sum(weights * gm((values - lam) / l, a))) - k
    return brentq(F, cut, values[0], xtol=1e-15, rtol=8.9e-16, maxiter=500)


def piece_closed_form(e, w, target, a):
    """Statement 6: delta on a piece from the centred moments."""
    n = w.sum()
    mean = np.sum(w * e) / n
    c = e - mean
    V, M = np.sum(w * c * c), np.sum(w * c ** 3)
    if a == 1:
        return mean - target / n
    if a == 2:
        return mean - np.sqrt(max(target - V, 0.0) / n)
    P, Q = 3 * V / n, (M - target) / n
    A = np.cbrt(abs(Q) / 2 + np.sqrt(Q * Q / 4 + P ** 3 / 27))
    A = -A if Q > 0 else A
    return mean - (A - P / (3 * A) if A != 0 else 0.0)


def check_piece_closed_forms(rng):
    for trial in range(300):
        a = (1, 2, 3)[trial % 3]
        size = int(rng.integers(1, 8))
        e = np.sort(rng.uniform(0.2, 1.0, size))[::-1]
        w = rng.integers(1, 4, size).astype(float)
        width = float(rng.uniform(0, e.min()))
        h = lambda dl: float(np.sum(w * (e - dl) ** a))
        target = h(float(rng.uniform(0, width)))
        ref = brentq(lambda dl: h(dl) - target, 0.0, width, xtol=1e-16, rtol=8.9e-16)
        got = piece_closed_form(e, w, target, a)
        C.check(abs(got - ref) < 1e-12, f"closed form a={a}, trial {trial}: {got} vs {ref}")


def reference_budget_mask(x, k, l, m, p):
    a = 1.0 / (p - 1.0)
    c, values, weights = cut_and_weights(x, k, m)
    gaps = values - c
    ls = l_star_bisection(gaps, weights, k, a, l) if S(gaps, weights, l, a) < k else l
    return C.threshold_solve(x, k, ls, p)[1], ls


def check_derivatives(rng):
    """Statement 7 against central differences of the reference (both regimes)."""
    for trial in range(40):
        p = (4.0 / 3.0, 2.0)[trial % 2]
        a = 1.0 / (p - 1.0)
        x = rng.normal(size=7)
        k, m = 2.5, 3
        l = (0.3, 4.0)[(trial // 2) % 2]
        y, ls = reference_budget_mask(x, k, l, m, p)
        c, _, _ = cut_and_weights(x, k, m)
        lam = C.threshold_solve(x, k, ls, p)[0] if ls == l else c
        z = (x - lam) / ls
        d = np.where((z > 0) & (z < 1), a * np.clip(z, 0, 1) ** (a - 1) / ls, 0.0)
        xd, kd, ld = rng.normal(size=7), float(rng.normal()), float(rng.normal())
        if ls == l:  # the plain mask's derivative
            lam_d = (np.sum(d * (xd - z * ld)) - kd) / np.sum(d)
            l_d = ld
        else:  # lambda' = the cut
            at = x == c
            lam_d = np.mean(xd[at])
            l_d = (np.sum(d * (xd - lam_d)) - kd) / np.sum(d * z)
        want = d * (xd - lam_d) - d * z * l_d
        eps = 1e-6
        f = lambda s: reference_budget_mask(x + s * xd, k + s * kd, l + s * ld, m, p)[0]
        fd = (f(eps) - f(-eps)) / (2 * eps)
        C.check(np.max(np.abs(fd - want)) < 1e-6, f"derivative, trial {trial}: "
                f"{np.max(np.abs(fd - want))}")


def check_segments(rng, itk):
    """Statement 8: the library's segment form against the reference on each segment
    separately (segments of at most m entries: the plain mask, Brent)."""
    import jax.numpy as jnp
    sizes = np.array([1, 3, 0, 9, 6, 5])
    checked = 0
    for trial in range(16):
        p = PS[trial % len(PS)]
        m = 3
        ids = rng.permutation(np.repeat(np.arange(sizes.size), sizes))
        x = rng.normal(size=ids.size)
        if trial % 3 == 0:
            x = np.round(x * 2) / 2  # ties
        scale = 10.0 ** rng.uniform(-6, 6)
        x = x * scale
        k = np.where(sizes == 0, 0.0, rng.uniform(0.2, np.clip(sizes, 1, m) - 0.1))
        l = scale * 10.0 ** rng.uniform(-1.5, 1.5, sizes.size)
        got = np.asarray(itk.segment_soft_topk_mask(
            jnp.asarray(x), jnp.asarray(ids), jnp.asarray(k), num_segments=sizes.size,
            regularization_strength=jnp.asarray(l), p=p, max_support=m))
        for s_ in np.flatnonzero(sizes):
            row = x[ids == s_]
            if row.size <= m:
                want = C.threshold_solve(row, k[s_], l[s_], p)[1]
            else:
                want = reference_budget_mask(row, k[s_], l[s_], m, p)[0]
                C.check(np.sum(got[ids == s_] > 0) <= np.sum(row > cut_and_weights(row, k[s_], m)[0]),
                        f"segment support, trial {trial}, segment {s_}")
            C.check(np.max(np.abs(got[ids == s_] - want)) < 1e-9,
                    f"segment vs reference, trial {trial}, segment {s_}: "
                    f"{np.max(np.abs(got[ids == s_] - want))}")
            C.check(abs(got[ids == s_].sum() - k[s_]) < 1e-10, f"segment sum, trial {trial}")
            checked += 1
    print(f"  {checked} segments checked (the segment form against the per-segment reference)")


def check_router_blocks(rng, itk):
    """The library on batches of longer router rows (the CPU kernel takes them into its
    lanes by their candidates and keeps the plain mask of a row with at most m of them:
    "In the CPU kernel" (v)) against the reference mask at min(l, l*), row by row."""
    import jax.numpy as jnp
    checked = 0
    for trial in range(6):
        n, m = (20, 3) if trial % 2 else (64, 4)
        p = (4.0 / 3.0, 2.0)[trial // 3]
        a = 1.0 / (p - 1.0)
        x = rng.normal(size=(70, n))
        x[3::5] = np.round(x[3::5] * 2) / 2  # ties
        k = rng.choice([0.5, 1.0, 1.5, 2.0], size=70)
        l = 10.0 ** rng.uniform(-1.5, 0.5, size=70)
        l[:20] = 0.05  # rows with at most m candidates (the plain mask kept)
        got = np.asarray(itk.soft_topk_mask(jnp.asarray(x), jnp.asarray(k), p=p,
                                            regularization_strength=jnp.asarray(l),
                                            max_support=m))
        for r in range(70):
            c, values, weights = cut_and_weights(x[r], k[r], m)
            gaps = values - c
            ls = (l_star_bisection(gaps, weights, k[r], a, l[r])
                  if S(gaps, weights, l[r], a) < k[r] else l[r])
            want = C.threshold_solve(x[r], k[r], ls, p)[1]
            C.check(np.max(np.abs(got[r] - want)) < 1e-9, f"router block {trial}, row {r}: "
                    f"{np.max(np.abs(got[r] - want))}")
            checked += 1
    print(f"  {checked} rows of router blocks checked (the library against the reference)")


def main():
    rng = np.random.default_rng(0)
    itk = C.load_library()
    check_piece_closed_forms(rng)
    check_derivatives(rng)
    checked, fits_plain = 0, 0
    for trial in range(240):
        p = PS[trial % len(PS)]
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
        c, values, weights = cut_and_weights(x, k, m)
        gaps = values - c
        lam, y = C.threshold_solve(x, k, l, p)
        plain_fits = np.sum(y > 1e-12) <= m
        if np.sum(x > np.sort(x)[::-1][m]) >= k:  # statement 1 (no tie case)
            C.check(plain_fits == (S(gaps, weights, l, a) >= k * (1 - 1e-12)) or
                    abs(S(gaps, weights, l, a) - k) < 1e-9 * k, f"statement 1, trial {trial}")
        if np.sum(x > lam) <= m:  # "In the CPU kernel" (v): then the budget does not bind
            C.check(S(gaps, weights, l, a) >= k * (1 - 1e-12), f"(v), trial {trial}")
            fits_plain += 1
        ls = l_star_bisection(gaps, weights, k, a, l) if S(gaps, weights, l, a) < k else l
        if ls < l:
            lam_s, _ = C.threshold_solve(x, k, ls, p)
            C.check(abs(lam_s - c) <= 1e-7 * (abs(c) + scale), f"threshold at l*, trial {trial}")
            first, largest = l_star_pieces(gaps, weights, k, a)
            C.check(abs(first / ls - 1.0) < 1e-9 and abs(largest / ls - 1.0) < 1e-9,
                    f"statement 3, trial {trial}: {first / ls}, {largest / ls}")
        else:  # statement 5: the m+1 largest entries (weighted) give the row's threshold
            lam_small = weighted_threshold(values, weights, c, k, l, a)
            C.check(abs(lam_small - lam) <= 1e-9 * (abs(lam) + l), f"locality, trial {trial}")
        want = C.threshold_solve(x, k, ls, p)[1]
        if itk is not None:
            import jax.numpy as jnp
            got = np.asarray(itk.soft_topk_mask(jnp.asarray(x), k, regularization_strength=l,
                                                p=p, max_support=m))
            C.check(np.max(np.abs(got - want)) < 1e-9, f"library vs reference, trial {trial}: "
                    f"{np.max(np.abs(got - want))}")
            C.check(np.sum(got > 0) <= np.sum(x > c), f"support, trial {trial}")
            C.check(abs(got.sum() - k) < 1e-10 * max(1, k), f"sum, trial {trial}")
        checked += 1
    print(f"  {checked} rows checked (bound, l*, pieces, locality, closed forms, derivatives, "
          f"library; {fits_plain} with at most m entries above the plain threshold: (v))")
    if itk is not None:
        check_segments(np.random.default_rng(1), itk)
        check_router_blocks(np.random.default_rng(2), itk)
    print("support_budget: OK")


if __name__ == "__main__":
    main()
