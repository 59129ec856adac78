"""Numerical companion of proofs/float_range.md.

Checks:
  1. rescaling: the library's exponent (implicit_topk.solvers.float_range) keeps every
     scaled entry below 2^(emax-2) and scaled strengths normal with room (2^(emin+m)),
     and the scaled values are the exact rationals 2^-E x (Fractions), float64 and float32;
  2. binary rows near the float maximum: every row the library decides exactly is binary
     in exact arithmetic with the same k-th largest entry (Fractions), and every row that
     is binary exactly is either decided so or still binary, with the same top set, in
     the shifted coordinates;
  3. the ordered bisection on integer keys (numpy, independent of the library) finds the
     k-th largest finite entry within b halvings, against np.sort;
  4. the CPU kernel's exponent (implicit_topk.kernels.cpu.native_threshold, numba) equals
     the library's on rows at both ends, ordinary rows and rows with +-inf and NaN
     entries, and is 0 on every row its cheap test passes (4 x_i finite, l >= 2^-969).
"""

import os
import sys
from fractions import Fraction

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import numpy as np  # noqa: E402

import _proofs_common as C  # noqa: E402

INTS = {np.float32: np.int32, np.float64: np.int64}


def exact_binary(x, k, l):
    """(binary, a): the row is binary in exact arithmetic, and its k-th largest entry."""
    finite = np.sort(x[np.isfinite(x)])[::-1]
    m = int(k)
    a, b = finite[m - 1], finite[m]
    tied = np.sum(finite >= a) > m
    return (not tied) and Fraction(a) - Fraction(b) >= Fraction(l), a


def hidden_rows(rng, rows, n):
    """Rows with the maximum near the float maximum and a cluster a few of its ulps wide
    anywhere in the top binades (both signs), strengths of a few cluster ulps."""
    top = float(np.finfo(np.float64).max)
    xs, ks, ls = [], [], []
    for _ in range(rows):
        c = rng.choice([-1.0, 1.0]) * top * rng.uniform(0.05, 0.95)
        u = float(np.spacing(abs(c)))
        x = c + u * rng.integers(-6, 7, n)
        x[0] = top * rng.uniform(0.9, 1.0)
        xs.append(rng.permutation(x))
        ks.append(float(rng.integers(2, n)))
        ls.append(u * rng.uniform(0.3, 4.0))
    return np.array(xs), np.array(ks), np.array(ls)


def check_rescaling(itk, rng):
    import jax.numpy as jnp
    from implicit_topk.problems import layout
    from implicit_topk.solvers import float_range as F
    for dtype in (np.float64, np.float32):
        info = np.finfo(dtype)
        emax, emin, m = info.maxexp, info.minexp, info.nmant + 1
        rows = []
        for scale in (float(info.max), float(info.tiny), 1.0):
            x = rng.choice([-1.0, 1.0], (40, 7)) * scale * rng.uniform(0.02, 1.0, (40, 7))
            with np.errstate(over="ignore"):
                l = scale * 10.0 ** rng.uniform(-8, 1, 40)
            rows.append((np.clip(x, -info.max, info.max).astype(dtype),
                         np.clip(l, info.tiny, 0.25 / info.tiny).astype(dtype)))
        for x, l in rows:
            e = np.asarray(F.scale_exponent(layout.DEFAULT, jnp.asarray(x), jnp.asarray(l)))
            xs, ls = (np.asarray(v) for v in F.rescale(layout.DEFAULT, jnp.asarray(x),
                                                         jnp.asarray(l), jnp.asarray(e)))
            assert np.all(np.abs(xs) < 2.0 ** (emax - 2)), "scaled entries too large"
            e_lo = np.floor(np.log2(np.max(np.abs(x), axis=1))) + 3 - emax
            free = e_lo <= 0
            assert np.all(ls[free] >= 2.0 ** (emin + m)), "scaled strength too small"
            for r in range(x.shape[0]):
                f = Fraction(2) ** int(-e[r])
                for v, w in zip(x[r], xs[r]):
                    # normal inputs with normal products (XLA reads subnormals as 0)
                    if abs(v) >= info.tiny and abs(float(Fraction(float(v)) * f)) >= info.tiny:
                        assert Fraction(float(w)) == Fraction(float(v)) * f, (v, w, e[r])
                assert Fraction(float(ls[r])) == Fraction(float(l[r])) * f
        print(f"1. {np.dtype(dtype).name}: {sum(x.shape[0] for x, _ in rows)} rows rescaled "
              "exactly, entries below 2^(emax-2), strengths normal")


def check_binary(itk, rng):
    import jax.numpy as jnp
    from implicit_topk.problems import layout
    from implicit_topk.solvers import float_range as F
    problem = itk.problems.CappedSimplex()
    x, k, l = hidden_rows(rng, 300, 7)
    L = layout.DEFAULT
    e = F.scale_exponent(L, jnp.asarray(x), jnp.asarray(l))
    xs, ls = F.rescale(L, jnp.asarray(x), jnp.asarray(l), e)
    origin = F.normalization_origin(problem, xs, ls, L)
    shifted = problem.shift(xs, origin)
    lam = itk.ThresholdSolver().run(None, shifted, jnp.asarray(k), ls).params
    fix, top = F.hidden_binary_rows(problem, L, xs, shifted, origin, lam, jnp.asarray(k), ls)
    fix, top = np.asarray(fix), np.asarray(top)
    xs, ls, shifted = np.asarray(xs), np.asarray(ls), np.asarray(shifted)
    binary_rows = fixed = 0
    for r in range(x.shape[0]):
        binary, a = exact_binary(xs[r], k[r], ls[r])
        binary_rows += binary
        if fix[r]:
            fixed += 1
            assert binary and top[r] == a, (r, x[r], k[r], l[r])
        elif binary:  # not decided: the shifted row must show the same binary answer
            s = np.sort(shifted[r])[::-1]
            m = int(k[r])
            assert s[m - 1] - s[m] >= ls[r] and np.sum(shifted[r] >= s[m - 1]) == m, (
                r, x[r], k[r], l[r])
            assert set(np.flatnonzero(shifted[r] >= s[m - 1])) == set(
                np.flatnonzero(xs[r] >= a)), r
    assert fixed >= 50, fixed
    print(f"2. {x.shape[0]} rows near the float maximum: {binary_rows} binary exactly, "
          f"{fixed} decided on the unshifted row (all right), the others binary after the shift")


def ordered_key(v, dtype):
    bits = np.asarray(v, dtype).view(INTS[dtype]).astype(object)
    top = (1 << (8 * np.dtype(dtype).itemsize - 1)) - 1
    return [(-(b & top) if b < 0 else b) for b in np.atleast_1d(bits)]


def from_key(key, dtype):
    sign = 1 << (8 * np.dtype(dtype).itemsize - 1)
    bits = key if key >= 0 else (-key) | sign
    return np.array([bits], np.uint64 if dtype == np.float64 else np.uint32).view(dtype)[0]


def check_bisection(rng):
    for dtype in (np.float64, np.float32):
        info = np.finfo(dtype)
        bits = 8 * np.dtype(dtype).itemsize
        worst = 0
        for _ in range(200):
            n = int(rng.integers(2, 12))
            scale = rng.choice([float(info.max), float(info.tiny), 1.0])
            x = (rng.choice([-1.0, 1.0], n) * scale * rng.uniform(0.0, 1.0, n)).astype(dtype)
            k = int(rng.integers(1, n + 1))
            lo = ordered_key(-info.max, dtype)[0]
            hi = ordered_key(np.inf, dtype)[0]
            keys = ordered_key(x, dtype)
            halvings = 0
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if sum(kk >= mid for kk in keys) >= k:
                    lo = mid
                else:
                    hi = mid
                halvings += 1
            worst = max(worst, halvings)
            assert halvings <= bits, halvings
            assert from_key(lo, dtype) == np.sort(x)[::-1][k - 1], (x, k)
        print(f"3. {np.dtype(dtype).name}: the k-th largest in at most {worst} <= {bits} halvings")


def check_kernel_exponent(itk, rng):
    import jax.numpy as jnp
    from implicit_topk.problems import layout
    from implicit_topk.solvers import float_range as F
    try:
        from implicit_topk.kernels.cpu import native_threshold as K
    except ImportError:  # no numba
        print("4. skipped (no numba)")
        return
    info = np.finfo(np.float64)
    limit = 2.0 ** 1022
    assert np.isfinite(4 * np.nextafter(limit, 0)) and not np.isfinite(4 * limit)
    rows, strengths = [], []
    for scale in (float(info.max), float(info.tiny), 1.0, limit):
        for _ in range(60):
            n = int(rng.integers(1, 9))
            with np.errstate(over="ignore"):  # beyond the float maximum: +-inf entries
                x = rng.choice([-1.0, 1.0], n) * scale * rng.uniform(0.2, 4.0, n)
                l = scale * 10.0 ** rng.uniform(-20, 1)
            x[rng.uniform(size=n) < 0.1] = rng.choice([np.inf, -np.inf, np.nan])
            rows.append(np.clip(x, -info.max, info.max) if rng.uniform() < 0.5 else x)
            strengths.append(float(np.clip(l, info.tiny, 0.25 / info.tiny)))
    flagged = 0
    for x, l in zip(rows, strengths):
        want = int(np.asarray(F.scale_exponent(layout.DEFAULT, jnp.asarray(x[None]),
                                               jnp.asarray([l])))[0])
        got, finite = K.scale_exponent(x, x.size, l)
        assert got == want and finite == bool(np.all(np.isfinite(x))), (x, l, got, want)
        with np.errstate(over="ignore", invalid="ignore"):
            cheap = bool(np.all(np.isfinite(4 * x))) and l >= 2.0 ** -969
        assert not cheap or got == 0, (x, l, got)
        flagged += not cheap
    print(f"4. float64: the kernel's exponent is the library's on {len(rows)} rows, 0 on "
          f"the {len(rows) - flagged} its one-pass test lets through")


def main():
    rng = np.random.default_rng(33)
    check_bisection(rng)
    itk = C.load_library()
    if itk is not None:
        check_rescaling(itk, rng)
        check_binary(itk, rng)
        check_kernel_exponent(itk, rng)
    print("float_range: OK")


if __name__ == "__main__":
    main()
