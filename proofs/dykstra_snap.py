"""Numerical companion of proofs/dykstra_snap.md.

Checks:
  1. the exact partition passes the test and its block means are scipy's solution;
  2. random partitions: passing the test implies the block means are the solution;
     one split or one merge of the exact partition fails (unless it changes nothing);
  3. the library: isotonic_dykstra with a residual and tol > 0 stops early with the
     exact solution; the "dykstra" top-k mask equals PAV's.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import numpy as np  # noqa: E402
from scipy.optimize import isotonic_regression  # noqa: E402

import _proofs_common as C  # noqa: E402


def means_and_test(u, rho, first):
    """Block means of the runs starting where `first` is True, and the order/prefix test."""
    run = np.cumsum(first) - 1
    total = np.bincount(run, rho * u) / np.bincount(run, rho)
    mean = total[run]
    ok = np.all(np.diff(total) <= 1e-12 * (1 + np.abs(total[1:])))
    for r in range(run[-1] + 1):
        idx = np.flatnonzero(run == r)
        mu = np.cumsum(rho[idx] * (total[r] - u[idx]))[:-1]
        ok &= np.all(mu >= -1e-12 * (1 + np.sum(np.abs(rho[idx] * u[idx]))))
    return mean, bool(ok)


def exact(u, rho):
    return isotonic_regression(u, weights=rho, increasing=False).x


def exact_first(v):
    first = np.r_[True, np.abs(np.diff(v)) > 1e-12 * (1 + np.abs(v[1:]))]
    return first


def check_exact_partition(rng):
    for _ in range(200):
        n = int(rng.integers(1, 40))
        u, rho = rng.normal(size=n), rng.uniform(0.2, 3.0, size=n)
        v = exact(u, rho)
        mean, ok = means_and_test(u, rho, exact_first(v))
        C.check(ok and np.allclose(mean, v, atol=1e-12), "the exact partition fails the test")
    print("  1. the exact partition passes, its means are the solution (200 rows)")


def check_random_partitions(rng):
    passed = failed = 0
    for _ in range(3000):
        n = int(rng.integers(2, 12))
        u, rho = rng.normal(size=n), rng.uniform(0.2, 3.0, size=n)
        first = np.r_[True, rng.random(n - 1) < 0.5]
        mean, ok = means_and_test(u, rho, first)
        if ok:
            C.check(np.allclose(mean, exact(u, rho), atol=1e-12), "a passing partition is wrong")
            passed += 1
    for _ in range(300):
        n = int(rng.integers(3, 30))
        u, rho = rng.normal(size=n), rng.uniform(0.2, 3.0, size=n)
        v = exact(u, rho)
        first = exact_first(v)
        j = int(rng.integers(1, n))
        changed = first.copy()
        changed[j] = ~changed[j]  # split a run, or merge two
        mean, ok = means_and_test(u, rho, changed)
        if not np.allclose(mean, v, atol=1e-12):
            C.check(not ok, "a wrong partition passes the test")
            failed += 1
    print(f"  2. {passed} random partitions passed, all with the exact means; "
          f"{failed} one-change partitions with other means all failed")


def check_library(rng):
    itk = C.load_library()
    if itk is None:
        return
    import jax.numpy as jnp
    from implicit_topk.kernels import isotonic_dykstra as kd

    n, k, l = 1000, 10, 1.0
    x = rng.normal(size=(4, n))
    s = -np.sort(-x, axis=1)
    u = jnp.asarray(s / l - np.clip(k - np.arange(n), 0, 1))
    lam = lambda v: 0.5 * l * (v[:, k - 1] + v[:, k])
    residual = lambda v: jnp.abs(jnp.sum(jnp.clip((x - lam(v)[:, None]) / l, 0, 1), 1) - k)
    snapped = kd.isotonic_dykstra(u, tol=1e-12, max_iter=100000, residual_fun=residual)
    plain = kd.isotonic_dykstra(u, tol=0.0, max_iter=100000)
    want = np.stack([exact(row, np.ones(n)) for row in np.asarray(u)])
    C.check(np.allclose(snapped.v, want, atol=1e-9), "library: snapped v is not the solution")
    C.check(np.all(snapped.iter_num < plain.iter_num), "library: no fewer sweeps")
    y = itk.soft_topk_mask(jnp.asarray(x), k, p=2.0, solver="dykstra")
    y_pav = itk.soft_topk_mask(jnp.asarray(x), k, p=2.0, solver="pav")
    C.check(np.allclose(y, y_pav, atol=1e-9), "library: dykstra mask != PAV mask")
    print(f"  3. library: exact after {np.asarray(snapped.iter_num).tolist()} sweeps "
          f"(plain sweeps to rounding: {np.asarray(plain.iter_num).tolist()}); mask == PAV's")


def main():
    rng = np.random.default_rng(14)
    print("dykstra_snap:")
    check_exact_partition(rng)
    check_random_partitions(rng)
    check_library(rng)
    print("dykstra_snap: OK")


if __name__ == "__main__":
    main()
