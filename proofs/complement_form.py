"""Numerical companion of proofs/complement_form.md.

Checks:
  1. the complement form equals the plain sum (80-digit decimal arithmetic);
  2. near-binary rows: the float64 complement form changes sign within a few ulps of the
     decimal root; the float64 plain sum is exactly 0 far away from it (flat);
  3. a float64 bisection on the complement form finds the decimal root to a few ulps for
     gaps up to 700 strengths, and the derivatives from its tails match the decimal ones;
  4. the example of issue 33 (d/dk <w, y> = 2.75 at l = 1e-3), and the library's solvers.
"""

import math
import os
import sys
from decimal import Decimal, localcontext

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import numpy as np  # noqa: E402

import _proofs_common as C  # noqa: E402

MASKS = ("sigmoid", "laplace")


# -- decimal reference: the plain sum in brute precision ------------------------------------

def dec_g(name, u):
    """(g(u), g'(u)) in the current decimal context."""
    one = Decimal(1)
    e = (-abs(u)).exp()
    if name == "sigmoid":
        tail = e / (one + e)
        return (one - tail if u > 0 else tail), tail * (one - tail)
    tail = e / 2
    return (one - tail if u > 0 else tail), tail


def dec_root(name, x, k, l):
    """The root t = lam / l of sum g(x_i / l - t) = k by bisection on the plain sum, with
    digits enough for every tail; returns (lam as Decimal, z_i as Decimals, digits)."""
    spread = (max(x) - min(x)) / l
    digits = 50 + int((spread / 2 + 10) / math.log(10))
    with localcontext() as ctx:
        ctx.prec = digits
        ctx.Emin, ctx.Emax = -10**6, 10**6
        z = [Decimal(v) / Decimal(l) for v in x]
        kd = Decimal(k)
        lo, hi = min(z) - 80, max(z) + 80
        for _ in range(2000):
            if hi - lo <= Decimal(2) ** -110:
                break
            mid = (lo + hi) / 2
            if sum((dec_g(name, zi - mid)[0] for zi in z), Decimal(0)) > kd:
                lo = mid
            else:
                hi = mid
        t = (lo + hi) / 2
        return t * Decimal(l), [zi - t for zi in z], digits


def dec_dk(name, zs, digits):
    with localcontext() as ctx:
        ctx.prec = digits
        ctx.Emin, ctx.Emax = -10**6, 10**6
        slopes = [dec_g(name, u)[1] for u in zs]
        total = sum(slopes, Decimal(0))
        return np.array([float(s / total) for s in slopes])


# -- float64: the plain sum and the complement form ----------------------------------------

def tail64(name, z):
    e = np.exp(-np.abs(z))
    return e / (1.0 + e) if name == "sigmoid" else 0.5 * e


def phi_plain64(name, x, k, l, lam):
    z = (x - lam) / l
    t = tail64(name, z)
    return float(np.sum(np.where(z > 0, 1.0 - t, t)) - k)


def phi_complement64(name, x, k, l, lam):
    z = (x - lam) / l
    t = tail64(name, z)
    upper = int(np.sum(z > 0))
    return float((upper - k) + np.sum(np.where(z > 0, -t, t)))


def slope64(name, z):
    """g'(z) from the tails: sigmoid s(|z|) s(-|z|), Laplace e^-|z| / 2."""
    t = tail64(name, z)
    return t * (1.0 - t) if name == "sigmoid" else t


def bisect64(f, lo, hi):
    """The sign change of a nonincreasing f between adjacent doubles."""
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if not lo < mid < hi:
            break
        if f(mid) > 0:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def near_binary_row(rng, n, k, gap, l):
    top = 2.0 + l * np.cumsum(rng.uniform(0, 3, k))
    bottom = 2.0 - l * gap - l * np.cumsum(rng.uniform(0, 3, n - k))
    return rng.permutation(np.concatenate([top, bottom]))


# -- the checks ----------------------------------------------------------------------------

def check_identity(rng):
    worst = 0.0
    with localcontext() as ctx:
        ctx.prec = 80
        for name in MASKS:
            for _ in range(40):
                z = [Decimal(float(v)) for v in rng.normal(size=7) * rng.uniform(0.1, 30)]
                k = Decimal(float(rng.uniform(0.5, 6.5)))
                plain = sum((dec_g(name, u)[0] for u in z), Decimal(0)) - k
                upper = sum(1 for u in z if u > 0)
                tails = [dec_g(name, -abs(u))[0] for u in z]
                comp = (upper - k) + sum((t if u <= 0 else -t for t, u in zip(tails, z)),
                                         Decimal(0))
                worst = max(worst, float(abs(plain - comp)))
    C.check(worst < 1e-70, f"identity: differs by {worst}")
    print(f"  1. identity: the forms agree to {worst:.1e} (80 digits), sigmoid and Laplace")


def check_flatness_and_sign(rng):
    flat_seen = 0
    for name in MASKS:
        for gap in (50, 150, 400, 700):
            l = 1e-3
            k = int(rng.integers(1, 6))
            x = near_binary_row(rng, 7, k, gap, l)
            lam_dec, _, _ = dec_root(name, x, k, l)
            lam = float(lam_dec)
            ulp = np.spacing(abs(lam))
            # the complement form changes sign within a few ulps of the decimal root
            C.check(phi_complement64(name, x, k, l, lam - 4 * ulp) > 0
                    > phi_complement64(name, x, k, l, lam + 4 * ulp),
                    f"complement form: no sign change at the root ({name}, gap {gap})")
            # the plain sum is exactly 0 a whole strength away (and more) on both sides
            if gap >= 80:
                far = [phi_plain64(name, x, k, l, lam + s * l) for s in (-20.0, -1.0, 1.0, 20.0)]
                C.check(all(v == 0.0 for v in far),
                        f"plain sum expected flat ({name}, gap {gap}): {far}")
                flat_seen += 1
    print(f"  2. float64 complement form changes sign within 4 ulps of the decimal root; the "
          f"plain sum is exactly 0 at +-1 and +-20 strengths from it ({flat_seen} rows)")


def check_root_and_derivatives(rng):
    worst_ulps, worst_dk = 0.0, 0.0
    for name in MASKS:
        for gap in (30, 100, 300, 500, 700):
            for _ in range(2):
                n = int(rng.integers(3, 10))
                k = int(rng.integers(1, n))
                l = float(rng.uniform(2e-3, 2e-2))
                x = near_binary_row(rng, n, k, gap, l)
                lam_dec, zs, digits = dec_root(name, x, k, l)
                lam_ref = float(lam_dec)
                lo, hi = float(x.min()) - 50 * l, float(x.max()) + 50 * l
                lam = bisect64(lambda t: phi_complement64(name, x, k, l, t), lo, hi)
                # a few ulps of lam, plus the rounding of x_i - lam (eps |x_i - lam|)
                bound = 4 * np.spacing(abs(lam_ref)) + 4 * 2.0**-53 * float(np.max(np.abs(x - lam_ref)))
                C.check(abs(lam - lam_ref) <= bound, f"root: {lam} vs {lam_ref} ({name}, gap {gap})")
                worst_ulps = max(worst_ulps, abs(lam - lam_ref) / np.spacing(abs(lam_ref)))
                slopes = slope64(name, (x - lam) / l)
                dk = slopes / slopes.sum()
                dk_ref = dec_dk(name, zs, digits)
                rel = np.abs(dk - dk_ref) / np.maximum(dk_ref, 1e-300)
                keep = dk_ref > 1e-250
                worst_dk = max(worst_dk, float(rel[keep].max()))
                C.check(rel[keep].max() < 1e-10, f"dy/dk: relative error {rel[keep].max()}")
    print(f"  3. float64 bisection on the complement form: root within {worst_ulps:.1f} ulps of "
          f"the decimal root (gaps 30..700 strengths); dy/dk from its tails to {worst_dk:.1e}")


def check_example():
    x = [2.57, 2.11, 2.02, 1.79, 1.79, 1.58]
    w = np.arange(6.0)
    values = {}
    for l in (1e-3, 1e-2, 5e-2):
        _, zs, digits = dec_root("sigmoid", x, 3, l)
        values[l] = float(np.dot(w, dec_dk("sigmoid", zs, digits)))
    C.check(abs(values[1e-3] - 2.75) < 1e-15, f"example: {values[1e-3]}")
    C.check(abs(values[5e-2] - 2.687706982649) < 1e-11, f"example: {values[5e-2]}")
    print(f"  4. example: d/dk <w, y> = {values[1e-3]:.15g} (l = 1e-3), {values[1e-2]:.12g} "
          f"(1e-2), {values[5e-2]:.12g} (5e-2)")
    itk = C.load_library()
    if itk is None:
        print("     (library not found: skipped)")
        return
    import jax
    import jax.numpy as jnp
    jax.config.update("jax_enable_x64", True)
    for name in MASKS:
        for solver in ("native", "threshold", "pav"):
            f = lambda k: jnp.sum(jnp.asarray(w) * itk.soft_topk_mask(
                jnp.asarray(x), k, regularization_strength=1e-3, regularizer=name, solver=solver))
            got = float(jax.grad(f)(3.0))
            C.check(abs(got - 2.75) < 1e-11, f"library {solver} {name}: {got}")
    print("     library: 'native', 'threshold' and 'pav' give 2.75 for sigmoid and Laplace")


def _saturated_mask(name, z):
    """g(z) in Decimal for a mask exactly 1 from z1 on: p-norm (name = a, z^a on [0, 1])
    or "entropy" (e^min(z, 0))."""
    if name == "entropy":
        return min(z, Decimal(0)).exp()
    return min(max(z, Decimal(0)), Decimal(1)) ** Decimal(name)


def check_saturated_form(rng):
    """5. (|S| - k) + sum_{z < z1} g(z) equals sum g(z) - k, and keeps a small mass."""
    with localcontext() as ctx:
        ctx.prec = 80
        for name, z1 in ((3, 1), (2, 1), (1, 1), ("entropy", 0)):
            for _ in range(50):
                z = [Decimal(float(v)) for v in rng.normal(size=int(rng.integers(1, 12))) * 2]
                k = Decimal(float(rng.uniform(0, len(z))))
                plain = sum((_saturated_mask(name, v) for v in z), Decimal(0)) - k
                sat = Decimal(sum(v >= z1 for v in z)) - k + sum(
                    (_saturated_mask(name, v) for v in z if v < z1), Decimal(0))
                C.check(abs(plain - sat) < Decimal(10) ** -70, f"saturated form {name}")
    z = np.array([3.0, 2.0, -30.0, -31.0, -32.5])  # entropy, two entries at 1
    k = 2.0 + 1e-14
    mass = np.exp(z[2:])
    sat = (2.0 - k) + mass.sum()
    plain = (1.0 + 1.0 + mass.sum()) - k
    exact = float(Decimal(2) - Decimal(k) + sum((Decimal(float(v)).exp() for v in z[2:]),
                                                 Decimal(0)))
    C.check(abs(sat - exact) <= 4e-16 * abs(exact) + 1e-30, "saturated form in float64")
    C.check(abs(plain - exact) > 1e-3 * abs(exact), "the plain sum rounds the small mass")
    print(f"  5. saturated form = plain sum (decimal, p-norms and entropy); float64 with a mass "
          f"1e-14: {abs(sat - exact) / abs(exact):.1e} relative (plain sum "
          f"{abs(plain - exact) / abs(exact):.1e})")
    itk = C.load_library()
    if itk is None:
        return
    import jax
    import jax.numpy as jnp
    jax.config.update("jax_enable_x64", True)
    x = np.array([40.0, 39.5, 0.7, 0.2, 0.4])
    y = np.asarray(itk.soft_topk_mask(jnp.asarray(x), k, regularization_strength=0.2,
                                      regularizer="entropy", solver="threshold"))
    want = (k - 2.0) * np.exp((x[2:] - x[2:].max()) / 0.2) / np.exp((x[2:] - x[2:].max()) / 0.2).sum()
    C.check(np.allclose(y[2:], want, rtol=1e-12, atol=0), f"library threshold: {y[2:]} {want}")
    print("     library: 'threshold' keeps the entropy mask's mass 1e-14 to 1e-12")


def main():
    rng = np.random.default_rng(33)
    print("complement_form:")
    check_identity(rng)
    check_flatness_and_sign(rng)
    check_root_and_derivatives(rng)
    check_example()
    check_saturated_form(rng)
    print("complement_form: OK")


if __name__ == "__main__":
    main()
