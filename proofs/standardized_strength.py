"""Numerical companion of proofs/standardized_strength.md (Proposition 15).

Checks:
  (1) s(c x + b) = c s(x);
  (2) Y(c x + b) = Y(x) with Brent's root of the threshold equation (no library code),
      and the library's soft_topk_mask(..., standardize=True) against that reference;
  (3) M(c x) = c M(x) for the library's soft_topk_mag(..., standardize=True), p in
      {4/3, 1.5, 2}, and the scaling of the magnitude threshold equation with Brent;
  (4) J x = 0, J 1 = 0 (mask) and J x = M (magnitude), by central differences and by
      the library's jax.jacobian; the stop-gradient Jacobian violates J x = 0;
  (5) zero-spread rows return k / n;
  (6) the library's spread (scale and mean held constant in autodiff): value, gradient
      and Hessian-vector products equal the standard deviation's closed forms.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import numpy as np  # noqa: E402
from scipy.optimize import brentq  # noqa: E402

import _proofs_common as C  # noqa: E402

PS = (4.0 / 3.0, 1.5, 2.0)


def spread(x):
    s = float(np.std(x))
    return s if s > 0 else 1.0


def reference_standardized_mask(x, k, l, p):
    return C.threshold_solve(x, k, l * spread(x), p)[1]


def check_spread(rng):
    for _ in range(50):
        x = rng.normal(size=int(rng.integers(2, 20)))
        c, b = float(10 ** rng.uniform(-3, 3)), float(rng.normal() * 100)
        rounding = 64 * np.finfo(float).eps * (abs(b) + c * np.max(np.abs(x)))  # of c x + b
        C.check(abs(spread(c * x + b) - c * spread(x)) <= rounding, "spread")
    print("  (1) s(c x + b) = c s(x)")


def check_mask(rng, itk):
    import jax.numpy as jnp
    for _ in range(40):
        n = int(rng.integers(2, 12))
        x = rng.normal(size=n) * 10 ** rng.uniform(-2, 2)
        k = float(rng.uniform(0.1, n - 0.1))
        l, p = float(10 ** rng.uniform(-1, 0.5)), PS[int(rng.integers(3))]
        c, b = float(10 ** rng.uniform(-3, 3)), float(rng.normal() * 10)
        ref = reference_standardized_mask(x, k, l, p)
        ref_moved = reference_standardized_mask(c * x + b, k, l, p)
        # c x + b rounds each entry to the ulp of |b| + c |x|: relative to the spread c s(x)
        rounding = 1e-12 * (abs(b) + c * np.max(np.abs(x))) / (c * spread(x))
        C.check(np.max(np.abs(ref - ref_moved)) < 1e-9 + rounding, f"Y(cx+b) = Y(x), c = {c}, b = {b}")
        ours = np.asarray(itk.soft_topk_mask(jnp.asarray(x), k, regularization_strength=l, p=p,
                                             standardize=True))
        C.check(np.max(np.abs(ours - ref)) < 1e-9, f"library vs Brent at l s(x), p = {p}")
    print("  (2) the standardized mask is invariant under x -> c x + b (Brent), library agrees")


def magnitude_threshold(x, k, l, p):
    """Brent's root of sum_i min(lam, (t_i / l)^(1/(p-1))) = k lam, t = (|x| - lam)_+."""
    s = np.abs(x)
    f = lambda lam: float(np.sum(np.minimum(lam, (np.maximum(s - lam, 0) / l) ** (1 / (p - 1))))
                          - k * lam)
    return brentq(f, 1e-300, float(s.max()), xtol=1e-300, rtol=4 * np.finfo(float).eps)


def check_magnitude(rng, itk):
    import jax.numpy as jnp
    for _ in range(30):
        n = int(rng.integers(3, 12))
        x = rng.normal(size=n)
        k = float(rng.uniform(0.5, n - 1.5))
        l, p = float(10 ** rng.uniform(-1, 0.5)), PS[int(rng.integers(3))]
        c = float(10 ** rng.uniform(-3, 3))
        lam = magnitude_threshold(x, k, l, p)
        lam_scaled = magnitude_threshold(c * x, k, l * c ** (2 - p), p)
        C.check(abs(lam_scaled - c * lam) <= 1e-9 * c * lam, "magnitude root scales by c")
        m = np.asarray(itk.soft_topk_mag(jnp.asarray(x), k, regularization_strength=l, p=p,
                                         standardize=True))
        m_scaled = np.asarray(itk.soft_topk_mag(jnp.asarray(c * x), k, regularization_strength=l,
                                                p=p, standardize=True))
        C.check(np.max(np.abs(m_scaled - c * m)) <= 1e-10 * c * np.max(np.abs(x)),
                f"M(c x) = c M(x), p = {p}, c = {c}")
    print("  (3) the standardized magnitude operator is equivariant (Brent: the root scales)")


def central_jacobian(f, x, h=1e-6):
    cols = []
    for i in range(x.size):
        e = np.zeros_like(x)
        e[i] = h
        cols.append((f(x + e) - f(x - e)) / (2 * h))
    return np.stack(cols, axis=1)


def check_derivatives(rng, itk):
    import jax
    import jax.numpy as jnp
    x = rng.normal(size=7)
    mask = lambda v: np.asarray(itk.soft_topk_mask(jnp.asarray(v), 2.5, standardize=True))
    J_fd = central_jacobian(mask, x)
    J = np.asarray(jax.jacobian(lambda v: itk.soft_topk_mask(v, 2.5, standardize=True))(jnp.asarray(x)))
    C.check(np.max(np.abs(J - J_fd)) < 1e-6, "mask Jacobian vs central differences")
    C.check(np.max(np.abs(J @ x)) < 1e-10 and np.max(np.abs(J.sum(1))) < 1e-10, "J x = J 1 = 0")
    C.check(np.max(np.abs(J_fd @ x)) < 1e-6, "J x = 0 by central differences")
    # with the spread held constant (a stop-gradient), J x = 0 fails
    s = float(np.std(x))
    J_sg = np.asarray(jax.jacobian(lambda v: itk.soft_topk_mask(v, 2.5, regularization_strength=s))(
        jnp.asarray(x)))
    C.check(np.max(np.abs(J_sg @ x)) > 1e-3, "the stop-gradient Jacobian violates J x = 0")
    mag = lambda v: np.asarray(itk.soft_topk_mag(jnp.asarray(v), 2.5, standardize=True))
    Jm_fd = central_jacobian(mag, x)
    Jm = np.asarray(jax.jacobian(lambda v: itk.soft_topk_mag(v, 2.5, standardize=True))(jnp.asarray(x)))
    C.check(np.max(np.abs(Jm - Jm_fd)) < 1e-6, "magnitude Jacobian vs central differences")
    C.check(np.max(np.abs(Jm @ x - mag(x))) < 1e-10, "Euler: J x = M(x)")
    print("  (4) J x = 0, J 1 = 0 (mask), J x = M (magnitude); not with a stop-gradient")


def check_zero_spread(itk):
    import jax.numpy as jnp
    for n, k in ((1, 0.5), (4, 1.5), (6, 5.0)):
        y = np.asarray(itk.soft_topk_mask(jnp.full(n, 3.25), k, standardize=True))
        C.check(np.max(np.abs(y - k / n)) < 1e-12, f"all-equal row -> k/n (n = {n})")
    print("  (5) zero-spread rows return k / n")


def check_spread_derivatives(rng):
    import jax
    import jax.numpy as jnp
    from implicit_topk import _standardize
    from implicit_topk.problems.layout import LastAxis
    library = lambda v: _standardize.row_spread(LastAxis(), v)
    for n, offset in ((2, 0.0), (7, 0.0), (12, 1e3), (30, -5.0)):
        x = rng.normal(size=n) * float(10 ** rng.uniform(-2, 2)) + offset
        v = rng.normal(size=n)
        s = float(np.std(x))
        d = x - x.mean()
        grad = d / (n * s)  # closed forms of the standard deviation's derivatives
        hessian = (np.eye(n) - 1.0 / n) / (n * s) - np.outer(grad, grad) / s
        value, g = jax.value_and_grad(library)(jnp.asarray(x))
        hv = jax.jvp(jax.grad(library), (jnp.asarray(x),), (jnp.asarray(v),))[1]
        C.check(abs(float(value) - s) <= 1e-12 * s, "spread value")
        C.check(np.max(np.abs(np.asarray(g) - grad)) <= 1e-12 * (1 + np.max(np.abs(grad))),
                "spread gradient")
        want = hessian @ v
        C.check(np.max(np.abs(np.asarray(hv) - want)) <= 1e-10 * (1 + np.max(np.abs(want))),
                "spread Hessian-vector product")
    print("  (6) the spread's value, gradient and Hessian-vector products")


def main():
    rng = np.random.default_rng(15)
    print("standardized_strength:")
    check_spread(rng)
    itk = C.load_library()
    if itk is None:
        return
    check_mask(rng, itk)
    check_magnitude(rng, itk)
    check_derivatives(rng, itk)
    check_zero_spread(itk)
    check_spread_derivatives(rng)
    print("standardized_strength: OK")


if __name__ == "__main__":
    main()
