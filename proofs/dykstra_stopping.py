"""Numerical companion of proofs/dykstra_stopping.md.

Checks:
  1. for any lam, ||y(lam) - y*||_1 == |phi(lam)| (random x, k, l, p; y* by Brent);
  2. Dykstra's change-based stopping rule certifies nothing: a numpy Dykstra (written
     here, independent of the library) stops at a change <= 1e-6 with an error > 1e-3;
  3. the library's "dykstra" solver reports a residual <= tol that equals the L1
     distance of its mask to the exact (PAV) mask.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import numpy as np  # noqa: E402

import _proofs_common as C  # noqa: E402

PS = (4.0 / 3.0, 1.5, 2.0, 3.0)


def check_identity(rng):
    count = 0
    for _ in range(200):
        n = int(rng.integers(2, 30))
        x = rng.normal(size=n) * rng.choice([0.1, 1.0, 10.0])
        k = float(rng.integers(1, n)) + rng.choice([0.0, float(rng.uniform(0, 0.99))])
        k = min(k, n - 0.5)
        l = float(rng.choice([0.05, 0.5, 5.0]))
        p = float(rng.choice(PS))
        lam_star, y_star = C.threshold_solve(x, k, l, p)
        for lam in lam_star + rng.normal(size=5) * l:
            y = C.h((x - lam) / l, p)
            lhs = np.sum(np.abs(y - y_star))
            rhs = abs(C.phi(lam, x, k, l, p))
            C.check(abs(lhs - rhs) <= 1e-12 * (1 + k), f"identity: {lhs} vs {rhs}")
            count += 1
    print(f"  1. ||y(lam) - y*||_1 == |phi(lam)| on {count} (x, k, l, p, lam) to 1e-12")


def numpy_dykstra_change_rule(u, tol):
    """Plain Dykstra for min_{v decreasing} ||v - u||^2 / 2; stops when a sweep moves
    no entry by more than tol. Returns (v, sweeps)."""
    n = u.size
    v, p, q = u.copy(), np.zeros(n), np.zeros(n)

    def project(z, start):
        """Pairs (start, start+1), (start+2, start+3), ...: a violating pair -> its mean."""
        z = z.copy()
        m = (n - start) // 2
        a, b = z[start:start + 2 * m:2], z[start + 1:start + 2 * m:2]
        mean = 0.5 * (a + b)
        bad = a < b
        z[start:start + 2 * m:2] = np.where(bad, mean, a)
        z[start + 1:start + 2 * m:2] = np.where(bad, mean, b)
        return z

    for sweep in range(1, 200000):
        y = project(v + p, 0)
        p = v + p - y
        v_new = project(y + q, 1)
        q = y + q - v_new
        change = np.max(np.abs(v_new - v))
        v = v_new
        if change <= tol:
            return v, sweep
    raise AssertionError("numpy Dykstra did not stop")


def check_change_rule_is_not_a_certificate(rng):
    n, k, l = 1000, 100.0, 0.3
    x = rng.normal(size=n)
    s = np.sort(x)[::-1]
    u = s / l - np.clip(k - np.arange(n), 0, 1)
    v, sweeps = numpy_dykstra_change_rule(u, 1e-6)
    lam = 0.5 * l * (v[int(np.ceil(k)) - 1] + v[int(np.floor(k))])
    _, y_star = C.threshold_solve(x, k, l, 2.0)
    error = np.sum(np.abs(C.h((x - lam) / l, 2.0) - y_star))
    C.check(error > 1e-3, f"expected the change rule to stop early; error {error}")
    C.check(abs(error - abs(C.phi(lam, x, k, l, 2.0))) <= 1e-10, "identity at Dykstra's lam")
    print(f"  2. change-based rule: stopped after {sweeps} sweeps at change <= 1e-6 with "
          f"L1 error {error:.2e} (= |phi|)")


def check_library(rng):
    itk = C.load_library()
    if itk is None:
        return
    import jax.numpy as jnp

    x = jnp.asarray(rng.normal(size=(6, 300)))
    for tol in (1e-3, 1e-6):
        for k in (30.0, 30.5):
            y, info = itk.soft_topk_mask(x, k, regularization_strength=0.3, p=2.0, solver="dykstra", tol=tol,
                                         return_info=True)
            exact = itk.soft_topk_mask(x, k, regularization_strength=0.3, p=2.0, solver="pav")
            l1 = np.sum(np.abs(np.asarray(y) - np.asarray(exact)), axis=-1)
            C.check(np.all(np.asarray(info.residual) <= tol), "library residual above tol")
            C.check(np.allclose(l1, np.asarray(info.residual), atol=1e-10),
                    f"library residual {info.residual} != L1 error {l1}")
    print("  3. library: residual <= tol and residual == L1 error vs PAV (tol 1e-3, 1e-6)")


def main():
    rng = np.random.default_rng(6)
    print("dykstra_stopping:")
    check_identity(rng)
    check_change_rule_is_not_a_certificate(rng)
    check_library(rng)
    print("dykstra_stopping: OK")


if __name__ == "__main__":
    main()
