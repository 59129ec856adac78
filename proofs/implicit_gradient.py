"""Numerical companion of proofs/implicit_gradient.md.

Checks in float64, on random instances with at least one fractional coordinate
and no coordinate within a margin of a kink (u_i = 0 or u_i = 1):
  (a) the implicit-function-theorem formulas
        d_i = h'(u_i) = y_i^(2-p)/(p-1) on the free set, 0 elsewhere, D = sum_i d_i,
        dy_i/dx_j = d_i (delta_ij - d_j / D) / l,
        dy_i/dk   = d_i / D,
        dy_i/dl   = d_i (sum_j d_j u_j / D - u_i) / l,
      computed in numpy from the threshold form, against central finite
      differences of an exact brute-force solver (face enumeration, no phi);
      the brute-force solution itself is checked against SLSQP;
  (b) the degenerate case D = phi'(lam) = 0 (integer k, l < x_(k) - x_(k+1)):
      y is locally constant in (x, l), so the gradient is 0 there; in k it is
      NOT differentiable (one-sided derivatives e_(k+1) and e_(k));
  (c) the library's jax derivatives (jax.grad / jax.jacrev, solvers "pav" and
      "threshold") against (a) and (b).
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import numpy as np  # noqa: E402

import _proofs_common as C  # noqa: E402

PS = (4.0 / 3.0, 1.5, 2.0, 3.0)


def ift_derivatives(x, k, l, p):
    lam, y = C.threshold_solve(x, k, l, p)
    u = (x - lam) / l
    # a root finder may stop on the edge of a flat root interval, leaving ~1e-40 where
    # the exact value is 0; such coordinates are not free
    free = (y > 1e-12) & (y < 1.0 - 1e-12)
    d = np.zeros_like(x)
    d[free] = y[free] ** (2.0 - p) / (p - 1.0)  # = g'(u_i) = 1/omega''(y_i)
    big_d = np.sum(d)
    if big_d == 0.0:  # all coordinates binary: y is locally constant in (x, l)
        return y, np.zeros((x.size, x.size)), None, np.zeros_like(x)
    jx = (np.diag(d) - np.outer(d, d) / big_d) / l
    jk = d / big_d
    jl = d * (np.dot(d, u) / big_d - u) / l
    return y, jx, jk, jl


def fd_derivatives(x, k, l, p, eps=1e-6):
    n = x.size
    sol = C.brute_force_solve
    jx = np.zeros((n, n))
    for j in range(n):
        e = np.zeros(n)
        e[j] = eps
        jx[:, j] = (sol(x + e, k, l, p) - sol(x - e, k, l, p)) / (2 * eps)
    jk = (sol(x, k + eps, l, p) - sol(x, k - eps, l, p)) / (2 * eps)
    jl = (sol(x, k, l + eps, p) - sol(x, k, l - eps, p)) / (2 * eps)
    return jx, jk, jl


def margin_ok(x, k, l, p, margin=0.02):
    lam, y = C.threshold_solve(x, k, l, p)
    u = (x - lam) / l
    return np.min(np.minimum(np.abs(u), np.abs(u - 1.0))) > margin and np.any((y > 0) & (y < 1))


def random_instances(rng, count_per_p=4, n_fixed=None):
    out = []
    for p in PS:
        got = 0
        while got < count_per_p:
            n = int(rng.integers(3, 7)) if n_fixed is None else n_fixed
            k = float(rng.choice([1.0, 2.0, 1.5, n - 0.6]))
            if not 0 < k < n:
                continue
            x = rng.normal(size=n)
            l = float(rng.choice([0.2, 0.7, 2.0]))
            if margin_ok(x, k, l, p):
                out.append((x, k, l, p))
                got += 1
    return out


def check_formula(instances):
    worst = {"x": 0.0, "k": 0.0, "l": 0.0}
    for x, k, l, p in instances:
        y_bf = C.brute_force_solve(x, k, l, p)
        y_sl, _ = C.slsqp_primal(x, k, l, p)
        C.check(np.max(np.abs(y_bf - y_sl)) < 1e-5, "brute force != SLSQP")
        y, jx, jk, jl = ift_derivatives(x, k, l, p)
        C.check(np.max(np.abs(y - y_bf)) < 1e-10, "threshold != brute force")
        fx, fk, fl = fd_derivatives(x, k, l, p)
        for name, a, b in (("x", jx, fx), ("k", jk, fk), ("l", jl, fl)):
            err = np.max(np.abs(a - b)) / (1.0 + np.max(np.abs(b)))
            C.check(err < 1e-6, f"IFT vs FD d/d{name}: rel err {err:.2e} (p={p}, k={k}, l={l})")
            worst[name] = max(worst[name], err)
        # structural identities: sum_i dy_i/dx_j = 0, sum_i dy_i/dk = 1, sum_i dy_i/dl = 0
        C.check(np.allclose(jx.sum(0), 0, atol=1e-12) and abs(jk.sum() - 1) < 1e-12
                and abs(jl.sum()) < 1e-12, "column sums of the Jacobian")
    print(f"  (a) IFT formula vs central FD of brute force: {len(instances)} instances, "
          f"max rel err x {worst['x']:.1e}, k {worst['k']:.1e}, l {worst['l']:.1e}")


def degenerate_instances(rng):
    out = []
    for p in PS:
        n, k = 5, 2.0
        # well separated entries: the one-sided k-derivatives are reached by a step
        # eps only once eps^(p-1) < (x_(k+1) - x_(k+2)) / l (limits.md (b))
        x = -0.5 * np.arange(n) + 0.1 * rng.uniform(-1, 1, size=n)
        x[:2] += 1.5
        x = x[rng.permutation(n)]
        s = np.sort(x)[::-1]
        l = 0.5 * (s[1] - s[2])
        out.append((x, k, l, p))
    return out


def check_degenerate(instances):
    for x, k, l, p in instances:
        y, jx, jk, jl = ift_derivatives(x, k, l, p)
        C.check(jk is None and np.max(np.abs(y - C.hard_topk_mask(x, k))) <= 1e-12,
                "not degenerate")
        fx, _, fl = fd_derivatives(x, k, l, p)
        C.check(np.max(np.abs(fx)) < 1e-9 and np.max(np.abs(fl)) < 1e-9,
                "y not locally constant in (x, l) at a hard point")
        eps = 1e-6
        y0 = C.brute_force_solve(x, k, l, p)
        right = (C.brute_force_solve(x, k + eps, l, p) - y0) / eps
        left = (y0 - C.brute_force_solve(x, k - eps, l, p)) / eps
        order = np.argsort(-x)
        C.check(np.allclose(right, np.eye(x.size)[order[2]], atol=1e-6), "right d/dk != e_(k+1)")
        C.check(np.allclose(left, np.eye(x.size)[order[1]], atol=1e-6), "left d/dk != e_(k)")
    print(f"  (b) D = 0 (hard mask, l < gap): {len(instances)} instances, FD in x and l is 0; "
          "one-sided d/dk = e_(k+1) (right), e_(k) (left): not differentiable in k")


_DERIVS = {}


def lib_derivatives(itk, p, solver):
    """jit-compiled (x, k, l, c) -> (dy/dx, dy/dk, dy/dl, grad_x <y, c>) from the library."""
    import jax
    import jax.numpy as jnp

    key = (p, solver)
    if key not in _DERIVS:
        def f(x, k, l):
            return itk.soft_topk_mask(x, k, regularization_strength=l, p=p, solver=solver)

        def all_derivs(x, k, l, c):
            jx, jk, jl = jax.jacrev(f, argnums=(0, 1, 2))(x, k, l)
            gx = jax.grad(lambda xx: jnp.dot(f(xx, k, l), c))(x)  # how users call it
            return jx, jk, jl, gx

        _DERIVS[key] = jax.jit(all_derivs)
    return _DERIVS[key]


def check_library(instances, degenerate):
    """instances: one regular instance per p; degenerate: hard-mask instances (same n)."""
    itk = C.load_library()
    if itk is None:
        return
    import jax.numpy as jnp

    worst, count, dk_note = 0.0, 0, ""
    for solver in ("pav", "threshold"):
        for x, k, l, p in instances:
            c = np.linspace(-1, 1, x.size)
            _, jx, jk, jl = ift_derivatives(x, k, l, p)
            lx, lk, ll_, gx = (np.asarray(a) for a in lib_derivatives(itk, p, solver)(
                jnp.asarray(x), jnp.asarray(k), jnp.asarray(l), jnp.asarray(c)))
            for name, a, b in (("x", lx, jx), ("k", lk, jk), ("l", ll_, jl), ("grad", gx, jx.T @ c)):
                err = np.max(np.abs(a - b)) / (1.0 + np.max(np.abs(b)))
                C.check(err < 1e-8, f"library {solver} d/d{name}: rel err {err:.2e} p={p} k={k}")
                worst = max(worst, err)
            count += 1
        for x, k, l, p in degenerate:
            c = np.linspace(-1, 1, x.size)
            lx, lk, ll_, _ = (np.asarray(a) for a in lib_derivatives(itk, p, solver)(
                jnp.asarray(x), jnp.asarray(k), jnp.asarray(l), jnp.asarray(c)))
            C.check(np.all(np.isfinite(lx)) and np.max(np.abs(lx)) < 1e-12,
                    f"library {solver}: d/dx at a hard point is {lx}")
            C.check(np.all(np.isfinite(ll_)) and np.max(np.abs(ll_)) < 1e-12,
                    f"library {solver}: d/dl at a hard point is {ll_}")
            C.check(np.all(np.isfinite(lk)), f"library {solver}: d/dk at a hard point is {lk}")
            count += 1
            if p == 2.0:
                dk_note += f" {solver}: d/dk = {np.round(lk, 3).tolist()};"
    print(f"  (c) library jax derivatives (pav, threshold): {count} instances, "
          f"max rel err vs IFT {worst:.1e}; d/dx = d/dl = 0 and finite at hard points")
    print(f"      library value of d/dk at a hard point (p=2), where y has no derivative in k:"
          f"{dk_note}")


def main():
    rng = np.random.default_rng(2)
    print("implicit_gradient:")
    inst = random_instances(rng)
    deg = degenerate_instances(rng)
    check_formula(inst)
    check_degenerate(deg)
    # library: one regular instance per p, all with n = 5 like the hard ones (one compile each)
    lib_inst = random_instances(rng, count_per_p=1, n_fixed=5)
    check_formula(lib_inst)
    check_library(lib_inst, [d for d in deg if d[3] in (4.0 / 3.0, 2.0)])
    print("implicit_gradient: OK")


if __name__ == "__main__":
    main()
